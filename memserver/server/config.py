"""What every memserver server of a cluster is told at start: who may call (tokens), how (TLS),
where checkpoints may go, and how much work it takes on. One frozen value, made by
memserver.cluster.launch and passed to each shard and the coordinator (Ray replays it on a
restart), so the rules are the same on every server.

It holds no secret: tokens as their digests (memserver.api.auth), the TLS key as a path each
node reads (a mounted secret on Kubernetes), since Ray records an actor's constructor arguments.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class Limits:
    """What one server takes on at once (documented in docs/security.md)."""


@dataclass(frozen=True)
class ServeConfig:
    """`auth` None: no tokens; `tls` None: plaintext; `checkpoint_root` None: any directory."""

    auth: AuthConfig | None = None
    tls: TlsFiles | None = None
    checkpoint_root: str | None = None
    limits: Limits = field(default_factory=Limits)
