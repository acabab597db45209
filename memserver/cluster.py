"""Start and stop a memory cluster on Ray: shard actors first, then the coordinator.

The caller (the `memserver up` process, a test fixture, a notebook) owns the shard actors, so a
dead coordinator does not take the shards down with it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from memserver.coordinator import CoordinatorActor
from memserver.shard import ShardActor

log = logging.getLogger(__name__)


def memserver_home() -> Path:
    """Where `up` writes its endpoint file: $MEMSERVER_HOME, else ~/.memserver."""
    return Path(os.environ.get("MEMSERVER_HOME") or Path.home() / ".memserver")


def endpoint_file() -> Path:
    return memserver_home() / "endpoint.json"


def read_endpoint(path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The running cluster's endpoint record; FileNotFoundError says how to start one."""
    p = Path(path) if path else endpoint_file()
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no memserver endpoint file at {p}: start a cluster with `memserver up`, "
            "or pass the coordinator's HOST:PORT explicitly"
        ) from None


def write_endpoint(record: dict[str, Any], path: Path | None = None) -> Path:
    p = path or endpoint_file()
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(p)
    return p


def bind_host() -> str:
    """127.0.0.1 on one machine; a multi-node cluster needs the node's own address."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    return "127.0.0.1" if len(alive) <= 1 else ray.util.get_node_ip_address()


@dataclass
class MemoryCluster:
    """Handles to a running cluster's actors; `shutdown()` stops them."""

    endpoint: str
    coordinator: Any
    shards: list[Any]
    shard_infos: list[dict[str, Any]] = field(default_factory=list)

    def shutdown(self) -> None:
        for actor in [self.coordinator, *self.shards]:
            try:
                ray.get(actor.stop.remote(), timeout=10)
            except Exception:  # already gone
                pass
            ray.kill(actor)


def start_cluster(
    num_shards: int = 2,
    *,
    shard_cpus: float = 0.5,
    shard_gpus: float = 0.0,
    threads_per_shard: int = 1,
    name: str = "memserver",
    host: str | None = None,
    port: int = 0,
) -> MemoryCluster:
    """Start `num_shards` shard actors and a named coordinator on the connected Ray cluster."""
    if not ray.is_initialized():
        raise RuntimeError("ray is not initialised: call ray.init() (or use `memserver up`)")
    if num_shards < 1:
        raise ValueError(f"--shards must be at least 1, got {num_shards}")
    t0 = time.perf_counter()
    host = host or bind_host()
    shard_cls = ray.remote(ShardActor)
    shards = [
        shard_cls.options(
            name=f"{name}-shard-{i}", num_cpus=shard_cpus, num_gpus=shard_gpus, max_concurrency=1000
        ).remote(i, threads_per_shard)
        for i in range(num_shards)
    ]
    infos = ray.get([s.start.remote(host) for s in shards])
    coord = ray.remote(CoordinatorActor).options(name=f"{name}-coordinator", num_cpus=0.1).remote(shards, infos)
    endpoint = ray.get(coord.start.remote(host, port))
    log.info("memory cluster %s up in %.1fs: coordinator %s, %d shards", name, time.perf_counter() - t0, endpoint, num_shards)
    return MemoryCluster(endpoint, coord, shards, infos)
