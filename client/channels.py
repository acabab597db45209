"""Every gRPC channel the client side opens is made here (asyncio and blocking, with or without
gRPC's own retries), so message limits, retry policy and credentials live in one place: with a
token, every call carries `authorization: Bearer <token>` (memserver.api.auth); with a CA, the
channel speaks TLS and checks the server's certificate against it."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from memserver.api.auth import HEADER, TLS_CA_ENV, TLS_SERVER_NAME_ENV, TOKEN_ENV
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
#: A connection whose peer is gone without a word (a host powered off or cut off: no reset comes)
#: is found by keepalive pings while calls are in flight (every 2 s) and closed when one is not
#: answered within 20 s, failing its calls UNAVAILABLE, which the client retries with a fresh
#: shard map: a call to a powered-off host's shard waited out its whole deadline (60 s by default)
#: before asking where Ray had moved it. gRPC 1.85 enforces `ping_timeout_ms` (a minute by default),
#: whatever the keepalive timeout says, on every ping, the flow-control (BDP) probes too, whose
#: answers queue behind the data in flight: at 2 s a 20 MB answer over a 2 MB/s link failed every
#: time (a review's proxy); 20 s tolerates ten times the queueing, and a process stalled whole for
#: ~22 s (swapped out) has its calls failed and retried. New connections are tried at most 2 s apart, each given 3 s.
KEEPALIVE_OPTIONS = [("grpc.keepalive_time_ms", 2000), ("grpc.keepalive_timeout_ms", 20000),
                     ("grpc.http2.ping_timeout_ms", 20000),
                     ("grpc.http2.max_pings_without_data", 0), ("grpc.keepalive_permit_without_calls", 0),
                     ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000),
                     ("grpc.min_reconnect_backoff_ms", 3000)]
CHANNEL_OPTIONS = [*GRPC_OPTIONS, *KEEPALIVE_OPTIONS, ("grpc.service_config", SERVICE_CONFIG), ("grpc.enable_retries", 1)]
#: No retry policy, so no retries: a load test must count an UNAVAILABLE, not hide it.
PLAIN_OPTIONS = [*GRPC_OPTIONS, *KEEPALIVE_OPTIONS]


def checked_token(token: str, source: str) -> str:
    """`token` without surrounding whitespace (a token file's line ending), or InvalidArgumentError
    naming `source` when what is left cannot go in a gRPC header (every command failed with a
    50-line traceback from inside gRPC for a token read from a file with CRLF line endings)."""
    from memserver.api.errors import InvalidArgumentError

    token = token.strip()
    if not token.isascii() or not token.isprintable():
        raise InvalidArgumentError(f"{source}: a token is printable ASCII (a header's value); this one holds other "
                                   "characters: copy it again, without its quotes or line breaks")
    return token


def client_token(endpoint: str | None, record: dict[str, Any] | None = None) -> str | None:
    """The token a client sends when given none: $MEMSERVER_TOKEN, else the endpoint file's when
    the client talks to the endpoint that file names (`record`: the file's contents, if read)."""
    return _env_token() or _from_endpoint_file(endpoint, record, "token")


def read_token(endpoint: str | None) -> str | None:
    """The token of a client that only reads (the inspection page): $MEMSERVER_TOKEN, else the
    endpoint file's read token when the client talks to that file's endpoint (else its write
    token: a file written before read tokens)."""
    return _env_token() or _from_endpoint_file(endpoint, None, "read_token") or _from_endpoint_file(endpoint, None, "token")


def _env_token() -> str | None:
    """$MEMSERVER_TOKEN, checked (None: unset or blank): the user's choice wins over any file."""
    return checked_token(os.environ[TOKEN_ENV], f"${TOKEN_ENV}") if os.environ.get(TOKEN_ENV, "").strip() else None


#: What a PEM certificate begins with.
PEM_CERTIFICATE = b"-----BEGIN CERTIFICATE-----"


@dataclass(frozen=True)
class ClientTls:
    """What a client's TLS checks the servers with: the CA (PEM) and, when the certificate names a
    DNS name rather than the addresses dialled (pods whose IPs change), that name."""

    ca: bytes
    server_name: str | None = None

    def __post_init__(self) -> None:
        """A CA that holds no PEM certificate is refused here: gRPC takes empty bytes for "trust the
        system's roots" (any public CA's certificate then passed), and a key or a DER file failed
        every call after a minute of retries as if the cluster were down (a hunt)."""
        if not isinstance(self.ca, bytes) or PEM_CERTIFICATE not in self.ca:
            from memserver.api.errors import InvalidArgumentError

            got = "nothing" if not self.ca else f"{len(self.ca)} bytes without one"
            raise InvalidArgumentError(f"tls: the CA holds no PEM certificate (a '-----BEGIN CERTIFICATE-----' block), "
                                       f"got {got}: give the cluster's CA file (ca.pem)")


def client_tls(endpoint: str | None, record: dict[str, Any] | None = None) -> ClientTls | None:
    """TLS settings of a client given none: the CA file $MEMSERVER_TLS_CA names (and
    $MEMSERVER_TLS_SERVER_NAME), else the endpoint file's when the client talks to that file's
    endpoint. None: plaintext."""
    if path := os.environ.get(TLS_CA_ENV):
        from memserver.api.errors import InvalidArgumentError

        try:
            with open(path, "rb") as f:
                return ClientTls(f.read(), os.environ.get(TLS_SERVER_NAME_ENV) or None)
        except OSError as exc:  # the variable is what the user can fix: name it
            raise OSError(exc.errno, f"${TLS_CA_ENV}: {exc.strerror}", path) from None
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"${TLS_CA_ENV} ({path}): {exc.details.removeprefix('tls: ')}") from None
    rec = _endpoint_record(endpoint, record)
    return record_tls(rec) if rec is not None else None


def record_tls(record: dict[str, Any]) -> ClientTls | None:
    """The TLS settings an endpoint record (an endpoint file's contents) gives its cluster's
    clients, whatever the environment says (None: plaintext)."""
    ca = record.get("tls_ca")
    return ClientTls(ca.encode(), record.get("tls_server_name") or None) if ca else None


def _endpoint_record(endpoint: str | None, record: dict[str, Any] | None) -> dict[str, Any] | None:
    """`record` (else the endpoint file's) when it names `endpoint` (None: any), else None."""
    if record is None:
        from memserver.cluster.endpoint import read_endpoint

        try:
            record = read_endpoint()
        except (FileNotFoundError, ValueError):
            return None
    return record if endpoint is None or record.get("endpoint") == endpoint else None


def _from_endpoint_file(endpoint: str | None, record: dict[str, Any] | None, key: str) -> str | None:
    rec = _endpoint_record(endpoint, record)
    return (rec.get(key) or None) if rec is not None else None


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


class _AioStreamToken(grpc.aio.UnaryStreamClientInterceptor):
    """The token on a server-streaming call too (AttachRegion, client.shm)."""

    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return await continuation(_with_token(details, self.token), request)


def _secure(tls: ClientTls, options: list[tuple[str, Any]]) -> tuple[grpc.ChannelCredentials, list[tuple[str, Any]]]:
    if tls.server_name:
        options = [*options, ("grpc.ssl_target_name_override", tls.server_name)]
    return grpc.ssl_channel_credentials(tls.ca), options


def aio_channel(address: str, *, retries: bool = True, token: str | None = None,
                tls: ClientTls | None = None) -> grpc.aio.Channel:
    """An asyncio channel to a shard or the coordinator (call on the loop that will use it);
    `tls`: speak TLS and trust what its CA signed."""
    options = CHANNEL_OPTIONS if retries else PLAIN_OPTIONS
    interceptors = [_AioToken(token), _AioStreamToken(token)] if token else None
    if tls is not None:
        credentials, options = _secure(tls, options)
        return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


def sync_channel(address: str, *, retries: bool = True, token: str | None = None,
                 tls: ClientTls | None = None) -> grpc.Channel:
    """A blocking channel (the blocking client, the load test's users, the CLI's raw calls)."""
    options = CHANNEL_OPTIONS if retries else PLAIN_OPTIONS
    if tls is not None:
        ch = grpc.secure_channel(address, *_secure(tls, options))
    else:
        ch = grpc.insecure_channel(address, options=options)
    return grpc.intercept_channel(ch, _SyncToken(token)) if token else ch
