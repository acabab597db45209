"""Every gRPC channel the client side opens is made here (asyncio and blocking, with or without
gRPC's own retries), so message limits, retry policy and credentials live in one place: with a
token, every call carries `authorization: Bearer <token>` (memserver.api.auth); with a CA, the
channel speaks TLS and checks the server's certificate against it."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import grpc

from memserver.api.auth import HEADER, TLS_CA_ENV, TOKEN_ENV
from memserver.wire import GRPC_OPTIONS

_RETRIED = [
    {"service": "memserver.v1.DataPlane"},  # reads are idempotent; writes carry (client_id, seq)
    {"service": "memserver.v1.ControlPlane", "method": "ListTables"},
    {"service": "memserver.v1.ControlPlane", "method": "GetShardMap"},
    {"service": "memserver.v1.ControlPlane", "method": "Status"},
]
#: gRPC retries UNAVAILABLE briefly itself (a connection refused while a server restarts); the
#: clients retry longer on top, with a fresh shard map (see AsyncMemoryClient.retry_seconds).
SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": _RETRIED,
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.05s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)
CHANNEL_OPTIONS = [*GRPC_OPTIONS, ("grpc.service_config", SERVICE_CONFIG), ("grpc.enable_retries", 1)]
#: No retry policy, so no retries: a load test must count an UNAVAILABLE, not hide it.
PLAIN_OPTIONS = list(GRPC_OPTIONS)


def client_token(endpoint: str | None, record: dict[str, Any] | None = None) -> str | None:
    """The token a client sends when given none: $MEMSERVER_TOKEN, else the endpoint file's when
    the client talks to the endpoint that file names (`record`: the file's contents, if read)."""
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    return _from_endpoint_file(endpoint, record, "token")


def client_tls_ca(endpoint: str | None, record: dict[str, Any] | None = None) -> bytes | None:
    """The CA (PEM) a client checks servers against when given none: the file $MEMSERVER_TLS_CA
    names, else the endpoint file's when the client talks to that file's endpoint. None: plaintext."""
    if path := os.environ.get(TLS_CA_ENV):
        with open(path, "rb") as f:
            return f.read()
    ca = _from_endpoint_file(endpoint, record, "tls_ca")
    return ca.encode() if ca else None


def _from_endpoint_file(endpoint: str | None, record: dict[str, Any] | None, key: str) -> str | None:
    if record is None:
        from memserver.cluster.endpoint import read_endpoint

        try:
            record = read_endpoint()
        except (FileNotFoundError, ValueError):
            return None
    if endpoint is None or record.get("endpoint") == endpoint:
        return record.get(key) or None
    return None


def _with_token(details: Any, token: str) -> Any:
    metadata = [*(details.metadata or ()), (HEADER, f"Bearer {token}")]
    return details._replace(metadata=metadata) if hasattr(details, "_replace") else _Details(details, metadata)


class _Details(grpc.ClientCallDetails):
    """A call's details with the token added (for details objects that are not namedtuples)."""

    def __init__(self, base: Any, metadata: list[tuple[str, str]]) -> None:
        self.method, self.timeout, self.metadata = base.method, base.timeout, metadata
        self.credentials = base.credentials
        self.wait_for_ready = getattr(base, "wait_for_ready", None)
        self.compression = getattr(base, "compression", None)


class _SyncToken(grpc.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(_with_token(details, self.token), request)


class _AioToken(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return await continuation(_with_token(details, self.token), request)


def aio_channel(address: str, *, retries: bool = True, token: str | None = None,
                ca: bytes | None = None) -> grpc.aio.Channel:
    """An asyncio channel to a shard or the coordinator (call on the loop that will use it);
    `ca`: speak TLS and trust certificates this CA (PEM) signed."""
    options = CHANNEL_OPTIONS if retries else PLAIN_OPTIONS
    interceptors = [_AioToken(token)] if token else None
    if ca is not None:
        return grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(ca), options=options,
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


def sync_channel(address: str, *, retries: bool = True, token: str | None = None,
                 ca: bytes | None = None) -> grpc.Channel:
    """A blocking channel (the blocking client, the load test's users, the CLI's raw calls)."""
    options = CHANNEL_OPTIONS if retries else PLAIN_OPTIONS
    if ca is not None:
        ch = grpc.secure_channel(address, grpc.ssl_channel_credentials(ca), options=options)
    else:
        ch = grpc.insecure_channel(address, options=options)
    return grpc.intercept_channel(ch, _SyncToken(token)) if token else ch
