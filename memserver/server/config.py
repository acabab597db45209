"""What every memserver server of a cluster is told at start: who may call (tokens), how (TLS),
where checkpoints may go, and how much work it takes on. One frozen value, made by
memserver.cluster.launch and passed to each shard and the coordinator (Ray replays it on a
restart), so the rules are the same on every server.

It holds no secret: tokens as their digests (memserver.api.auth), the TLS key as a path each
node reads (a mounted secret on Kubernetes), since Ray records an actor's constructor arguments.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from memserver.api.auth import AuthConfig


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a server certificate (its chain) and its private key, readable on every node."""

    cert: str
    key: str

    def read(self) -> tuple[bytes, bytes]:
        """(key, cert) bytes; a clear error naming the file that cannot be read."""
        out = []
        for what, path in (("key", self.key), ("cert", self.cert)):
            try:
                out.append(Path(path).read_bytes())
            except OSError as exc:
                raise ValueError(f"TLS {what} file {path}: {exc.strerror or exc}") from None
        return out[0], out[1]


@dataclass(frozen=True, kw_only=True)
class Limits:
    """What one server (each shard, the coordinator) takes on, documented in docs/security.md; 0
    turns a limit off.

    `max_table_bytes`: the most one shard's slice of a table may hold (values, optimizer state,
    slot statistics: memserver.server.catalog.slice_size), checked by the coordinator and by
    the shard before anything is recorded or allocated; 0: no fixed cap.
    `table_memory_fraction`: a new table's slices on one node may need at most this fraction of
    the memory available there (MemAvailable, lowered by a cgroup limit; GPU memory for GPU
    shards), checked by each shard when it creates its slice; 0: not checked.

    Past the next two a call is answered RESOURCE_EXHAUSTED at once, naming the limit
    (memserver.server.admission enforces them, "Overload" in docs/security.md):
    `max_inflight_calls`: calls of the memserver services in progress (being received, waiting
    for the compute thread or computing). Beyond it a call is refused before its request is read.
    Default 256: far above what trainers keep in flight per shard (one call per op per shard,
    a few ops each). Requests being received are bounded by it times the message limit only (see
    memserver.server.admission): lower it on memory-tight shards.
    `max_inflight_bytes`: request bytes of the calls in progress (of a shared-memory call: the
    tensors it reads out of the client's region, memserver.server.shm; of a call whose answer is
    many times its request, the answer's too, dataplane.Call.answer). A call whose request would
    pass it is refused, except when nothing else is in progress, so a legal request larger than
    the limit still runs (alone). Default 1 GiB: four requests of the 256 MiB message limit,
    sixteen of the client's 64 MiB split size; a big bag call (~100 MB) is not slowed.
    """

    max_table_bytes: int = 0
    table_memory_fraction: float = 0.8
    max_inflight_calls: int = 256
    max_inflight_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if self.max_table_bytes < 0:
            raise ValueError(f"max_table_bytes must be >= 0 (0: no cap), got {self.max_table_bytes}")
        if not 0 <= self.table_memory_fraction <= 1:
            raise ValueError(f"table_memory_fraction must be in [0, 1] (0: not checked), got {self.table_memory_fraction}")
        for name in ("max_inflight_calls", "max_inflight_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: must be an integer >= 0 (0 = no limit), got {value!r}")


@dataclass(frozen=True)
class ServeConfig:
    """`auth` None: no tokens; `tls` None: plaintext; `checkpoint_root` None: any directory."""

    auth: AuthConfig | None = None
    tls: TlsFiles | None = None
    checkpoint_root: str | None = None
    limits: Limits = field(default_factory=Limits)

    def keep_files_private(self) -> None:
        """With tokens, what a server process writes (records, logs, checkpoints) is its user's
        alone (umask 077): the values the tokens guard were readable by every local user
        (mode 644; a security walkthrough). Only in a server's own process (a Ray actor's): a
        process of the user's own (memserver.cluster.inprocess) keeps its umask."""
        from memserver.server.rayutil import in_actor

        if self.auth is not None and in_actor():
            os.umask(0o077)
