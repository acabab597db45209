"""Start and stop a memory cluster on Ray: shard actors first, then the coordinator.

The caller (the `memserver up` process, a test fixture, a notebook) owns the shard actors, so a
dead coordinator does not take the shards down with it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from memserver.api.auth import AuthConfig
from memserver.api.errors import first_line
from memserver.cluster import (
    DEFAULT_PLACEMENT,
    DEFAULT_SHARD_CPUS,
    DEFAULT_SHARDS,
    DEFAULT_THREADS_PER_SHARD,
    PLACEMENT_STRATEGIES,
    shard_bundle,
    shard_gpu_list,
)
from memserver.cluster.endpoint import memserver_home
from memserver.cluster.secure import network_facing, secure_defaults
from memserver.server.config import Limits, ServeConfig, TlsFiles
from memserver.server.coordinator import CoordinatorActor
from memserver.server.rayutil import LOCALHOST, bind_host, check_host, forced_host
from memserver.server.sessions import SESSION_TTL
from memserver.server.shard_actor import ShardActor
from memserver.storage.store import check_data_dir
from memserver.wire import DOORBELL_ENV, SHM_ENV, switch_on

log = logging.getLogger(__name__)


def _place_shards(bundles: list[dict[str, float]], strategy: str, timeout: float) -> Any:
    """A ready placement group of one bundle per shard; a clear error if Ray cannot place it in time."""
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([dict(b) for b in bundles], strategy=strategy)
    try:
        if pg.wait(timeout_seconds=timeout):
            return pg
    except BaseException:  # (Ctrl-C while it waits: the pending group goes too)
        remove_placement_group(pg)
        raise
    remove_placement_group(pg)
    alive = [n for n in ray.nodes() if n.get("Alive")]
    kinds = list(dict.fromkeys("{" + ", ".join(f"{k}={v:g}" for k, v in b.items()) + "}" for b in bundles))
    need = f"{kinds[0]} each" if len(kinds) == 1 else "of " + " / ".join(kinds)
    total = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
    free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
    n = len(bundles)
    hint = f" (STRICT_SPREAD needs {n} nodes)" if strategy == "STRICT_SPREAD" else ""
    raise RuntimeError(
        f"could not place {n} shards of {need} with placement {strategy}{hint} within {timeout:g}s: "
        f"the Ray cluster has {len(alive)} alive node(s), resources {total}, free {free}. Lower --shard-cpus / "
        "--shard-gpus or --shards, add nodes, pick another --placement, or raise --placement-timeout"
    )


@dataclass
class MemoryCluster:
    """Handles to a running cluster's actors; `shutdown()` stops them."""

    endpoint: str
    coordinator: Any
    shards: list[Any]
    shard_infos: list[dict[str, Any]] = field(default_factory=list)
    placement_group: Any = None
    data_dir: str = ""
    owns_data_dir: bool = False  # a scratch directory start_cluster made (removed at shutdown)
    #: what start_cluster made because the servers face the network (memserver.cluster.secure):
    #: (write, read) tokens, the CA clients trust and the name they check; None when given or not made
    tokens: tuple[str, str] | None = None
    tls_ca: bytes | None = None
    tls_server_name: str | None = None
    #: the security line said at start (--insecure on a network address): `up` says it on the terminal too
    security_warning: str = ""

    def coordinator_address(self, timeout: float = 2.0) -> str | None:
        """Where the coordinator serves now: another address than `endpoint` once Ray restarted it
        and its port had been taken meanwhile (memserver.server.grpcserver.serve_on); None while it
        is restarting (or Ray is going away), after `timeout` seconds at most."""
        try:
            now = ray.get(self.coordinator.endpoint.remote(), timeout=timeout)
        except Exception:  # noqa: BLE001 - restarting, or Ray going away: nothing to say yet
            return None
        return now if isinstance(now, str) else None

    def shutdown(self, release: bool = True) -> None:
        """Stop the servers (all at once, 10 s at most) and, with `release`, kill the actors, give
        their resources back to Ray and remove a scratch data directory. Without it (the Ray head
        goes next, and everything with it; then `remove_scratch_dir`) no call waits on the head:
        one stopped by a signal to its process group, as `timeout` and `docker stop` send, would
        hold each call 60 s."""
        actors, stopping = [self.coordinator, *self.shards], []
        for a in actors:
            with contextlib.suppress(Exception):  # an actor (or the head) already gone: the rest still stop
                stopping.append(a.stop.remote())
        with contextlib.suppress(Exception):
            ray.wait(stopping, num_returns=len(stopping), timeout=10)
        if release:
            for actor in actors:
                ray.kill(actor)
        if release and self.placement_group is not None:  # give the shards' reserved resources back to Ray
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.placement_group)
            except Exception:  # already removed
                pass
            self.placement_group = None
        if release:
            self.remove_scratch_dir()

    def remove_scratch_dir(self) -> None:
        """The data directory start_cluster made (no --data-dir), once no shard writes there."""
        if self.owns_data_dir and self.data_dir:
            import shutil

            shutil.rmtree(self.data_dir, ignore_errors=True)


def _why(exc: BaseException) -> str:
    """The error a shard's constructor raised, as one line, out of Ray's wrapping of it (the
    error's last line, "module.Class: text": ours by its text, another by its class too, e.g. a
    TLS key file a node cannot read); Ray's own first line where there is none."""
    lines = [line.strip() for line in str(exc).splitlines()]
    ours = [m.group(1) for line in lines if (m := re.match(r"^memserver\.api\.errors\.\w+: (.+)$", line))]
    other = [m.group(1) for line in lines if (m := re.match(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception): .+)$", line))]
    return ours[-1] if ours else other[-1] if other else first_line(exc)


def start_cluster(
    num_shards: int = DEFAULT_SHARDS,
    *,
    shard_cpus: float = DEFAULT_SHARD_CPUS,
    shard_gpus: float | str | Sequence[float] = 0.0,
    threads_per_shard: int = DEFAULT_THREADS_PER_SHARD,
    name: str = "memserver",
    host: str | None = None,
    port: int = 0,
    placement: str = DEFAULT_PLACEMENT,
    placement_timeout: float = 120.0,
    data_dir: str | os.PathLike[str] | None = None,
    max_restarts: int = -1,
    session_ttl: float = SESSION_TTL,
    auth: AuthConfig | None = None,
    tls: TlsFiles | None = None,
    checkpoint_root: str | os.PathLike[str] | None = None,
    limits: Limits | None = None,
    insecure: bool = False,
) -> MemoryCluster:
    """Start `num_shards` shard actors and a named coordinator on the connected Ray cluster.

    Shards go into a placement group (one bundle of `shard_cpus` CPUs / `shard_gpus` GPUs each,
    or per shard when `shard_gpus` is a list: GPU and CPU shards in one cluster; laid out by `placement`), so SPREAD puts them on different nodes when the cluster has them and
    Ray reserves their resources up front. The coordinator runs on the caller's node, so its
    address is the machine `memserver up` ran on. `host` None: 127.0.0.1 on one node, each
    server's own node address on several ($MEMSERVER_BIND_HOST overrides both).

    `data_dir` holds what a restarted shard needs (its tables' records and write-ahead logs) and
    the coordinator's port; every node must be able to write it. None: a scratch directory under
    $MEMSERVER_HOME/run, removed at shutdown. Starting on a directory of an earlier cluster
    brings its tables back. Ray restarts a dead shard or coordinator up to `max_restarts` times
    (-1: always). `session_ttl`: seconds of silence after which shards forget a client's session
    (see memserver.server.sessions). `auth`: every server requires tokens (memserver.api.auth);
    only the tokens' digests reach the actors. `tls`: every server speaks TLS with this
    certificate and key (files every node can read). `checkpoint_root`: checkpoints and restores
    only below this directory (default: `data_dir` if given, else $MEMSERVER_HOME); relative
    checkpoint paths are taken under it. `limits`: memserver.server.config.Limits.

    Secure by default: when the servers listen beyond loopback (several nodes, or a `host` that
    is not loopback) and `auth` or `tls` is missing, the missing ones are made here (tokens, and
    a self-signed certificate under `data_dir`/tls: memserver.cluster.secure) and returned in the
    MemoryCluster for the endpoint file. `insecure`: make none, and log a warning.
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

    if not ray.is_initialized():
        raise RuntimeError("ray is not initialised: call ray.init() (or use `memserver up`)")
    if num_shards < 1:
        raise ValueError(f"--shards must be at least 1, got {num_shards}")
    strategy = placement.upper()
    if strategy not in PLACEMENT_STRATEGIES:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENT_STRATEGIES)}, got {placement!r}")
    gpus = shard_gpu_list(num_shards, shard_gpus)
    bundles = [shard_bundle(shard_cpus, g) for g in gpus]  # bad sizes refused here, before anything is made
    for actor in (f"{name}-coordinator", f"{name}-shard-0"):  # before anything is placed or made
        try:
            ray.get_actor(actor)
        except ValueError:
            continue
        raise RuntimeError(f"a memserver already runs on this Ray cluster (its actor {actor!r}, Ray namespace "
                           f"{ray.get_runtime_context().namespace!r}): stop it with `memserver down` where it was "
                           "started, or use it (its endpoint file)")
    t0 = time.perf_counter()
    if host:
        check_host(host)
    else:
        alive = [n for n in ray.nodes() if n.get("Alive")]
        host = forced_host() or (LOCALHOST if len(alive) <= 1 else None)
    if data_dir is not None:  # (`~/x`: a folder named `~` in the current directory)
        data_dir = os.path.expanduser(data_dir)
        check_data_dir(data_dir, num_shards)  # before any actor: a slice left out loses its table
    owns_dir = data_dir is None
    pg = coord = None
    try:  # from here on a failure removes what it made: the scratch directory too (a placement that
        # timed out left it behind; made inside: a signal just after it was made kept it, a review)
        if data_dir is None:
            data_dir = tempfile.mkdtemp(prefix=f"{name}-", dir=_mkdir(memserver_home() / "run"))
        data_dir = str(Path(data_dir).absolute())
        if tls is not None:
            tls.read()  # a missing or unreadable file is the caller's error, not every actor's
        root = os.path.expanduser(checkpoint_root) if checkpoint_root else memserver_home() if owns_dir else data_dir  # not a scratch dir removed at shutdown
        nodes = [n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")] if network_facing(host) else []
        sec = secure_defaults(host, auth, tls, insecure, Path(data_dir) / "tls", nodes)
        auth, tls = sec.auth, sec.tls
        if sec.warning:
            log.warning("%s", sec.warning)
        elif sec.tokens or sec.ca:
            log.info("servers listen on %s: %s made and on", host or "each node's address",
                     " and ".join(w for w, made in (("tokens", sec.tokens), ("a self-signed TLS certificate", sec.ca)) if made))
        config = ServeConfig(auth=auth, tls=tls, checkpoint_root=str(Path(root).absolute()), limits=limits or Limits())
        pg = _place_shards(bundles, strategy, placement_timeout)
        shard_cls = ray.remote(ShardActor)
        # A same-host switch turned off where the cluster is started also reaches shards on nodes
        # whose processes came from `ray start` (they inherit its environment, not this one's).
        # Only "off" travels: a node's own off switch (docs/security.md) is never turned back on.
        switches = {n: os.environ[n] for n in (SHM_ENV, DOORBELL_ENV) if not switch_on(n)}
        shards = [
            shard_cls.options(
                name=f"{name}-shard-{i}",
                num_cpus=shard_cpus,
                num_gpus=gpus[i],
                max_concurrency=16,  # threads for Ray calls; data-plane traffic is gRPC
                max_restarts=max_restarts,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
                runtime_env={"env_vars": switches} if switches else None,
            ).remote(i, threads_per_shard, host, data_dir, f"{name}-coordinator", session_ttl, config)
            for i in range(num_shards)
        ]
        try:
            infos = ray.get([s.info.remote() for s in shards])
        except ray.exceptions.RayActorError as exc:  # its __init__ raised (a data directory in use, ...)
            why = _why(exc)
            if tls is not None and (f"TLS key file {tls.key}:" in why or f"TLS cert file {tls.cert}:" in why):
                # (read by path on each shard's node: a file on the `up` node alone, as the key made
                # under a node-local data directory, fails on every other node)
                why += (" (each shard reads the TLS certificate and key by path on its own node: give --tls-cert and "
                        "--tls-key files present on every node" + (", or a --data-dir on storage every node reads (the "
                        "key `up` makes is under it)" if sec.ca else "") + "; docs/deploy.md)")
            elif data_dir in why and ("No such file" in why or "Permission denied" in why):  # (a node that does
                # not see it: the generated TLS key is there too; not a folder in use, said as that)
                why += (f" (every node's shards read {data_dir}: give --data-dir on storage every node reads, "
                        "docs/deploy.md)")
            raise RuntimeError(f"a shard could not start: {why}") from None
        # Pinned to this node (0 CPUs, so even a head started with --num-cpus=0 takes it): the
        # endpoint is this machine's, and --port means a port here.
        coord = ray.remote(CoordinatorActor).options(
            name=f"{name}-coordinator",
            num_cpus=0,
            max_concurrency=16,
            max_restarts=max_restarts,
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
        ).remote([f"{name}-shard-{i}" for i in range(num_shards)], host or bind_host(), port, data_dir, config)
        try:
            endpoint = ray.get(coord.endpoint.remote())
        except ray.exceptions.RayActorError as exc:  # its __init__ raised (--port taken, ...): one line, as a
            why = _why(exc)                          # shard's (it was Ray's ActorDiedError, uncaught by `up`)
            raise RuntimeError(why.removeprefix("RuntimeError: ") if why.startswith("RuntimeError: coordinator")
                               else f"the coordinator could not start: {why}") from None
    except BaseException as exc:
        from ray.util.placement_group import remove_placement_group

        if coord is not None:
            ray.kill(coord)
        if pg is not None:
            remove_placement_group(pg)  # the shard actors die with it
        if owns_dir and data_dir is not None:
            import shutil

            shutil.rmtree(data_dir, ignore_errors=True)
            # a shard still starting can write there again before its process is gone (a fresh-clone
            # suite under load kept the folder): a caller that then ends Ray removes it once more
            exc.scratch_dir = data_dir  # type: ignore[attr-defined]
        raise
    log.info("memory cluster %s up in %.1fs: coordinator %s, %d shards (%s)", name, time.perf_counter() - t0, endpoint,
             num_shards, strategy)
    return MemoryCluster(endpoint, coord, shards, infos, placement_group=pg, data_dir=data_dir, owns_data_dir=owns_dir,
                         tokens=sec.tokens, tls_ca=sec.ca, tls_server_name=sec.server_name,
                         security_warning=sec.warning)


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p
