"""A one-process memory server: no Ray, for tests and single-GPU users.

The same `ShardActor`s and coordinator `memserver up` runs as Ray actors, started here as plain
objects in this process: each shard serves DataPlane on its own loop thread, the coordinator
serves ControlPlane over them (calling them through `LocalHandle`, the shape of a Ray actor
handle), and any client connects to `endpoint` as to a cluster (shared memory included: the
shards are on this machine). Nothing here imports Ray, and faiss only once an index table is
made, so a GPU machine with torch, numpy, numba and grpcio runs value tables on its GPU.

What Ray gives a cluster and this does not: actors restarted after their process dies, placement
over nodes, `num_gpus` scheduling (a shard's device is given here instead).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch

from memserver.server.config import ServeConfig
from memserver.server.coordinator import CoordinatorActor
from memserver.server.rayutil import LOCALHOST
from memserver.server.sessions import SESSION_TTL
from memserver.server.shard_actor import ShardActor


class _Method:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Awaitable[Any]:
        # a shard's methods block until its own loop has done the work: run them off the caller's loop
        return asyncio.to_thread(self.fn, *args, **kwargs)


class LocalHandle:
    """A shard in this process, called the way the coordinator calls a Ray actor handle:
    `handle.method.remote(...)` is an awaitable of the method's answer."""

    def __init__(self, shard: ShardActor) -> None:
        self.shard = shard

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self.shard, name))


class InProcessServer:
    """`num_shards` shards and their coordinator, serving on `host` in this process until `stop()`
    (or the end of a `with` block). `devices`: one per shard ("cpu", "cuda:0", ...; a mixed
    cluster may mix them); default: every shard on the CPU. The other arguments are
    ShardActor's and CoordinatorActor's (`data_dir`: checkpoints' records and write-ahead logs)."""

    def __init__(self, num_shards: int = 1, devices: Sequence[str | torch.device] | None = None, *,
                 host: str = LOCALHOST, threads: int = 1, data_dir: str | None = None,
                 config: ServeConfig | None = None, session_ttl: float = SESSION_TTL) -> None:
        devices = list(devices) if devices is not None else ["cpu"] * num_shards
        if len(devices) != num_shards:
            raise ValueError(f"devices: one per shard, got {len(devices)} for {num_shards} shards")
        self.shards: list[ShardActor] = []
        self.coordinator: CoordinatorActor | None = None
        try:
            for i, device in enumerate(devices):
                self.shards.append(ShardActor(i, threads, host, data_dir, session_ttl=session_ttl, config=config,
                                              device=str(device)))
            self.coordinator = CoordinatorActor.over(
                [LocalHandle(s) for s in self.shards], [s.info() for s in self.shards],
                [s.describe_tables() for s in self.shards], host, data_dir=data_dir, config=config)
        except BaseException:
            self.stop()
            raise

    @property
    def endpoint(self) -> str:
        """The coordinator's address, for `MemoryClient(endpoint)`."""
        assert self.coordinator is not None
        return self.coordinator.endpoint()

    def stop(self) -> None:
        """Stop the coordinator, then the shards (their slices closed: logs flushed)."""
        if self.coordinator is not None:
            self.coordinator.stop()
            self.coordinator.loop.stop()
            self.coordinator = None
        while self.shards:
            shard = self.shards.pop()
            shard.stop()
            shard.loop.stop()
            shard.servicer.pool.shutdown(wait=True)

    def __enter__(self) -> InProcessServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
