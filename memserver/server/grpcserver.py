"""The one way a memserver gRPC server starts (shards and the coordinator alike).

`start_server` registers the servicers with health checking and reflection and installs the
interceptor chain once, so no handler has to remember anything: `ErrorsAndMetrics` admits each
call within the server's limits (memserver.server.admission: RESOURCE_EXHAUSTED past them), turns
the api's exceptions (memserver.api.errors) into their statuses, any other exception into
INTERNAL (traceback in the log) and counts and times every call; with tokens, `Authenticate`
comes first: no call of ours, nor reflection, runs without a token of the right role (health
checks stay open).
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import re
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from memserver.api.auth import READ_METHODS, AuthConfig
from memserver.api.errors import (
    SHARD_UNAVAILABLE,
    DeadlineExceededError,
    InvalidArgumentError,
    MemserverError,
    first_line,
)
from memserver.api.methods import marked, methods
from memserver.api.types import shown
from memserver.api.v1 import memserver_pb2 as pb
from memserver.loop import LoopThread
from memserver.server.admission import SERVER_OPTIONS, Admission
from memserver.server.config import ServeConfig
from memserver.server.rayutil import bind_first
from memserver.storage.fsutil import atomic_write
from memserver.wire import GRPC_OPTIONS, NO_SERVER, SHARD_HEADER, WRONG_SHARD, check_enums, parse_views, to_bytes

log = logging.getLogger(__name__)

DATA_PLANE = pb.DESCRIPTOR.services_by_name["DataPlane"].full_name
_DATA_PLANE_PATH = f"/{DATA_PLANE}/"
CONTROL_PLANE = pb.DESCRIPTOR.services_by_name["ControlPlane"].full_name
#: Calls of these services go through the error mapping and the metrics (health and reflection do not).
_OUR_SERVICES = ("/memserver.",)
_METHODS = frozenset(m.name for m in methods())
#: Data-plane requests whose tensors are read as views of the request's bytes (memserver.wire.
#: parse_views: protobuf copies each twice): the proto marks them (`option (request_views)`), only
#: those whose tensors the shard does not keep past the call (a kept view would keep the whole
#: request's bytes).
_VIEWED = marked(pb.request_views, "DataPlane")


def request_parser(service: str, method: str) -> Callable[[bytes], Any]:
    """How a server reads a request of `method` of `service` (a full name: DATA_PLANE,
    CONTROL_PLANE): views of its tensors' bytes where the proto marks it, else protobuf's. The
    interceptor's and the doorbell's one reader."""
    svc = pb.DESCRIPTOR.services_by_name[service.rsplit(".", 1)[-1]]
    cls = getattr(pb, svc.methods_by_name[method].input_type.name)
    return partial(parse_views, cls) if service == DATA_PLANE and method in _VIEWED else cls.FromString


def status_of(exc: BaseException, name: str, request: Any, metrics: CallMetrics | None) -> tuple[grpc.StatusCode, str]:
    """The status and text a call that raised `exc` answers, on every path (gRPC's interceptor,
    the doorbell): the api's exceptions their own; a lost Ray actor UNAVAILABLE; anything else a
    bug: INTERNAL, its traceback logged with the method and table, and counted."""
    code, text = _status_of(exc, name, request, metrics)
    return code, bounded_text(text)


#: What a SHARD_HEADER value may be: a shard's index, in decimal, or NO_SERVER's -1 (a map that
#: puts two shards at one address: refused as moved).
_SHARD_INDEX = re.compile(rf"{NO_SERVER}|[0-9]{{1,9}}")

#: The most bytes of a status's text (UTF-8) a call answers. gRPC sends it percent-encoded in a
#: header (at most 3 bytes per byte) under a 16 KiB limit; past it the caller got RESOURCE_EXHAUSTED
#: "received metadata size exceeds hard limit", said as overload, instead of its error.
MAX_STATUS_TEXT = 4096


def bounded_text(text: str) -> str:
    """`text`, or its start and how long it was, within MAX_STATUS_TEXT bytes."""
    raw = text.encode(errors="replace")
    if len(raw) <= MAX_STATUS_TEXT:
        return text
    return raw[: MAX_STATUS_TEXT - 64].decode(errors="ignore") + f"... (cut: {len(raw):,} bytes)"


def _status_of(exc: BaseException, name: str, request: Any, metrics: CallMetrics | None) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, MemserverError):
        return exc.code, exc.details
    if is_actor_error(exc):
        return grpc.StatusCode.UNAVAILABLE, f"{SHARD_UNAVAILABLE} (restarting?): {first_line(exc)}"
    os_error = getattr(exc, "cause", exc)  # (a shard's, through Ray: its RayTaskError's cause)
    if isinstance(os_error, OSError) and not isinstance(os_error, (TimeoutError, ConnectionError)) and \
            os_error.errno is not None:
        # the machine's refusal (a full disk, a path not writable or not a folder), not a bug: said
        # as such, one line, whichever server (or shard) met it
        where = f" ({os_error.filename})" if os_error.filename else ""
        table = getattr(request, "table", "")  # (a log's write names no file: the table says whose)
        text = f"{name}{f' on table {table}' if table else ''}: {os_error.strerror or os.strerror(os_error.errno)}{where}"
        log.warning("%s failed on table %r: %s", name, getattr(request, "table", ""), text)
        full = os_error.errno in (errno.ENOSPC, errno.EDQUOT)
        return (grpc.StatusCode.RESOURCE_EXHAUSTED if full else grpc.StatusCode.FAILED_PRECONDITION), text
    log.error("%s failed on table %r", name, getattr(request, "table", ""), exc_info=exc)
    if metrics is not None:
        metrics.internal(name)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


#: How long a call whose request stream ended empty waits to learn it was cancelled: the end of
#: the stream can come before gRPC marks the cancellation (a client that cancels a call whose
#: large request is on the way: a load test's, when another shard refused its call).
CANCEL_NOTICE_S = 0.2


async def _no_request(name: str, context: grpc.aio.ServicerContext) -> MemserverError:
    """A call that ended before its request came. Its client gave up (its deadline passed, it
    cancelled): counted as such, not as a bad request, which an operator would go looking for
    (a walkthrough: 23 INVALID_ARGUMENT on a shard while a load test's calls were cancelled). A
    client that really sent none waits CANCEL_NOTICE_S for its INVALID_ARGUMENT."""
    cancelled = MemserverError(f"{name}: the client cancelled the call before its request arrived",
                               grpc.StatusCode.CANCELLED)
    end = time.monotonic() + CANCEL_NOTICE_S
    while True:
        left = context.time_remaining()
        if left is not None and left <= 0:
            return DeadlineExceededError(f"{name}: the deadline passed before the request arrived")
        if context.cancelled():
            return cancelled
        if time.monotonic() >= end:
            return InvalidArgumentError(f"request: no {name} request was sent")
        try:
            await asyncio.sleep(0.005)
        except asyncio.CancelledError:  # gRPC ends the handler of a cancelled call here: still counted as such
            return cancelled


def parse_request(parse: Callable[[bytes], Any] | None, raw: bytes, name: str) -> Any:
    """A request's bytes as its message (INVALID_ARGUMENT, never gRPC's UNKNOWN "Unexpected
    DecodeError", for bytes that are no such message). Then check_enums, before any handler."""
    try:
        return parse(raw) if parse is not None else raw
    except Exception as exc:
        raise InvalidArgumentError(f"request: not a valid {name} request ({type(exc).__name__})") from None


class CallMetrics(Protocol):
    """Where the interceptors record each call (memserver.server.metrics.ServerMetrics)."""

    def observe(self, method: str, table: str, code: str, seconds: float) -> None: ...

    def refused(self, method: str, code: str) -> None:
        """A call Authenticate refused (an authentication failure; counted as a request too)."""

    def internal(self, method: str) -> None:
        """A call that ended in an exception the error table does not map (answered INTERNAL)."""

    def attach(self, admission: Admission) -> None:
        """The server's admission: its in-flight counts and refusals join these metrics."""


class ErrorsAndMetrics(grpc.aio.ServerInterceptor):
    """Wraps every unary call of our services: `admission` admits it within the server's limits
    (OverloadedError, i.e. RESOURCE_EXHAUSTED, past them); the api's exceptions become their
    status with their text, a Ray actor error (a shard restarting behind the coordinator)
    UNAVAILABLE, anything else INTERNAL; each call is counted by method, table and status, and
    timed (from its request read to its answer). The metric is recorded before the status is sent,
    so whoever sees the answer can already scrape it.

    Each method is served as stream-unary at the gRPC level (the wire is the same for a unary
    caller) so that this wrapper reads the one request message itself: a call can be refused
    before its bytes are read, and counted from its first moment to its last.

    `shard`: a shard's pool index. A call whose metadata names another shard server (SHARD_HEADER:
    the caller's map puts that one at this address) is refused UNAVAILABLE, its request unparsed:
    that shard restarted elsewhere and this one took its old port, and served, the call would
    read or update this shard's slice in place of that one's. The caller's retry asks for a fresh map."""

    def __init__(self, metrics: CallMetrics | None = None, admission: Admission | None = None,
                 shard: int | None = None) -> None:
        self.metrics = metrics
        self.admission = admission or Admission()
        self.shard = shard
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method
        if handler is None or not method.startswith(_OUR_SERVICES):
            return handler
        if handler.unary_unary is None and handler.unary_stream is None:
            return handler
        if self.shard is not None and method.startswith(_DATA_PLANE_PATH):
            for key, value in details.invocation_metadata or ():
                if key != SHARD_HEADER:
                    continue
                name, unary = method.rsplit("/", 1)[-1], handler.unary_unary is not None
                if not _SHARD_INDEX.fullmatch(value):  # (a malformed one was "moved": a retry on a fresh map, for ever)
                    return self._refused(name, grpc.StatusCode.INVALID_ARGUMENT, unary,
                                         f"{SHARD_HEADER} metadata: {shown(value, 20)} is not a shard index (decimal "
                                         "digits, as the shard map numbers the shards, or -1 for none)")
                if int(value) != self.shard:
                    return self._refused(name, grpc.StatusCode.UNAVAILABLE, unary,
                                         f"{SHARD_UNAVAILABLE}: shard {self.shard} {WRONG_SHARD} for this {name} (shard "
                                         f"{value}: it restarted elsewhere, and this one took its old port): ask for "
                                         "a fresh shard map")
        cached = self._wrapped.get(method)
        if cached is None or cached[0] is not handler:  # one wrapper per method, built once
            service, name = method[1:].rsplit("/", 1)
            wrapped = (self._wrap(handler, name, request_parser(service, name)) if handler.unary_unary is not None
                       else self._wrap_stream(handler, name))
            cached = self._wrapped[method] = (handler, wrapped)
        return cached[1]

    def _refused(self, name: str, code: grpc.StatusCode, unary: bool, text: str) -> grpc.RpcMethodHandler:
        """The refusal of a call by its shard header (meant for another shard server: see the class)."""
        self._observe(name, None, code, time.perf_counter())

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
            del request  # (else its bytes stay in the AbortError's reference cycle until a full GC: see _wrap)
            await context.abort(code, text)

        # the request is read whole and dropped unparsed (the caller passed the token check): refused
        # before it is read, a large one's status could reach the client as a reset stream
        # (CANCELLED), which it takes for overload and retries on the same map until it gives up
        return (grpc.unary_unary_rpc_method_handler(refuse, request_deserializer=None) if unary
                else grpc.unary_stream_rpc_method_handler(refuse, request_deserializer=None))

    def _wrap_stream(self, handler: grpc.RpcMethodHandler, name: str) -> grpc.RpcMethodHandler:
        """A server-streaming method (AttachRegion): its request parsed here, as the unary ones'
        are (bytes that are no such message get INVALID_ARGUMENT), and counted when it starts.
        Not admitted: it stays open as long as the client keeps it (its own bound is the
        handler's, e.g. memserver.server.shm.MAX_REGIONS)."""
        inner, parse = handler.unary_stream, handler.request_deserializer

        async def behavior(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            t0 = time.perf_counter()
            try:
                request = parse(raw) if parse is not None else raw
            except Exception as exc:
                self._observe(name, None, grpc.StatusCode.INVALID_ARGUMENT, t0)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"request: not a valid {name} request ({type(exc).__name__})")
            try:
                check_enums(request)
            except InvalidArgumentError as exc:
                self._observe(name, request, grpc.StatusCode.INVALID_ARGUMENT, t0)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.details)
            # counted with the status the stream opened with: OK at its first answer (or its end),
            # else the refusal it ended with (a refused AttachRegion was counted OK: a hunt); a
            # refusal the handler raises (the api's exceptions) is counted before its status is sent,
            # as a unary call's is (counted after, a scrape that followed the refusal could miss it)
            said = False
            try:
                async for item in inner(request, context):
                    if not said:
                        said = True
                        self._observe(name, request, grpc.StatusCode.OK, t0)
                    yield item
            except MemserverError as exc:
                if not said:
                    said = True
                    self._observe(name, request, exc.code, t0)
                await context.abort(exc.code, exc.details)
            except BaseException as exc:
                if not said:
                    said = True
                    code = (grpc.StatusCode.CANCELLED if isinstance(exc, asyncio.CancelledError)
                            else _code_of(context) or grpc.StatusCode.UNKNOWN)
                    self._observe(name, request, code, t0)
                raise
            if not said:
                self._observe(name, request, grpc.StatusCode.OK, t0)

        return grpc.unary_stream_rpc_method_handler(behavior, request_deserializer=None,
                                                    response_serializer=handler.response_serializer)

    def _wrap(self, handler: grpc.RpcMethodHandler, name: str, parse: Callable[[bytes], Any]) -> grpc.RpcMethodHandler:
        """`parse`: the request's reader (request_parser), in place of the handler's own."""
        inner = handler.unary_unary
        admission = self.admission

        async def behavior(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            t0 = time.perf_counter()
            raw: Any = None
            request: Any = None
            entered, size = False, 0
            try:
                try:
                    admission.enter(name)  # before the request is read
                    entered = True
                    raw = await context.read()
                    if raw is grpc.aio.EOF:
                        raise await _no_request(name, context)
                    admission.take(name, len(raw))
                    size = len(raw)
                    t0 = time.perf_counter()
                    # parsed here, not by gRPC (see parse_request)
                    request = parse_request(parse, raw, name)
                    raw = None
                    check_enums(request)  # every enum field of every request, before any handler runs
                    response = await inner(request, context)
                except grpc.aio.AbortError:  # the handler aborted by itself
                    self._observe(name, request, grpc.StatusCode.UNKNOWN, t0)
                    raise
                except asyncio.CancelledError:  # the caller went (or its deadline passed) while it ran:
                    self._observe(name, request, grpc.StatusCode.CANCELLED, t0)  # counted nowhere, a hunt
                    raise
                except Exception as exc:
                    code, text = status_of(exc, name, request, self.metrics)
                else:
                    # an answer after the caller's deadline reaches no one: the caller got
                    # DEADLINE_EXCEEDED, and it was counted OK (a load test's failures were missing)
                    late = (remaining := context.time_remaining()) is not None and remaining <= 0
                    self._observe(name, request, grpc.StatusCode.DEADLINE_EXCEEDED if late else grpc.StatusCode.OK, t0)
                    return response
                self._observe(name, request, code, t0)
                # gRPC keeps the AbortError, whose traceback holds this frame, in a reference cycle
                # with the call: let go of the request first, or its bytes wait for the cyclic GC
                # (a flood of refused large requests grew a shard by GBs that way)
                raw = request = None
                await context.abort(code, text)
            finally:
                if entered:
                    admission.leave(size)

        # answers are serialised by memserver.wire.to_bytes: a handler may answer with a Lazy
        return grpc.stream_unary_rpc_method_handler(behavior, request_deserializer=None, response_serializer=to_bytes)

    def _observe(self, name: str, request: Any, code: grpc.StatusCode, t0: float) -> None:
        if self.metrics is not None:
            self.metrics.observe(name, getattr(request, "table", ""), code.name, time.perf_counter() - t0)


class Authenticate(grpc.aio.ServerInterceptor):
    """Bearer tokens (memserver.api.auth): a call of our services needs the write token, or the
    read token for READ_METHODS; reflection and health's Watch any valid token; a health Check
    none (each Watch stream holds some of the server's memory as long as its peer keeps it open,
    counted by no limit: a hunt held thousands without a token). Refused calls get
    UNAUTHENTICATED (no token, or an unknown one) or PERMISSION_DENIED (the read token on a write)
    before their request is even read, and are counted as authentication failures."""

    _OPEN = ("/grpc.health.v1.Health/Check",)

    def __init__(self, config: AuthConfig, metrics: CallMetrics | None = None) -> None:
        self.config, self.metrics = config, metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = details.method
        if method in self._OPEN:
            return await continuation(details)
        role = self.config.role(details.invocation_metadata)
        name = method.rsplit("/", 1)[-1]
        ours = method.startswith(_OUR_SERVICES)
        if role is None:
            return self._refuse(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown token: send the cluster's token as "
                                "metadata 'authorization: Bearer <token>' (`memserver up --auth` makes new tokens at "
                                "every start: an earlier `memserver join-info` file holds old ones)", name, ours)
        if ours and role == "read" and name not in READ_METHODS:
            return self._refuse(grpc.StatusCode.PERMISSION_DENIED, f"{name}: the read token may not make this call; "
                                "it needs the write token", name, ours)
        return await continuation(details)

    def _refuse(self, code: grpc.StatusCode, text: str, name: str, ours: bool) -> grpc.RpcMethodHandler:
        if self.metrics is not None:  # the method label only for real methods: paths are the caller's to invent
            self.metrics.refused(name if ours and name in _METHODS else "other", code.name)

        async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(code, text)

        # reflection is a stream; ours are unary, refused as stream-unary: the request bytes are
        # never read (a unary handler would have gRPC read the whole message first).
        return (grpc.stream_unary_rpc_method_handler(refuse) if ours else grpc.stream_stream_rpc_method_handler(refuse))


def is_actor_error(exc: BaseException) -> bool:
    """A Ray actor lost (its process died, or it is restarting): the coordinator's calls to shards."""
    if "ray" not in sys.modules:  # only the coordinator calls Ray actors; never import Ray for this
        return False
    from ray.exceptions import RayActorError

    return isinstance(exc, RayActorError)


async def start_server(
    register: Callable[[grpc.aio.Server], None],
    service_names: list[str],
    host: str,
    port: int = 0,
    *,
    metrics: CallMetrics | None = None,
    config: ServeConfig | None = None,
    admission: Admission | None = None,
    shard: int | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Start a grpc.aio server on host:port (0 = the OS picks) with health, reflection and the
    interceptors; `config`: tokens, TLS and limits (memserver.server.config). Must be awaited on
    the event loop that will own the server. The limits are enforced by an Admission
    (memserver.server.admission), attached to `metrics`: `admission`, or one of config.limits.
    `shard`: a shard's pool index: calls meant for another shard are refused (ErrorsAndMetrics)."""
    config = config or ServeConfig()
    chain: list[grpc.aio.ServerInterceptor] = [Authenticate(config.auth, metrics)] if config.auth is not None else []
    admission = Admission(config.limits) if admission is None else admission
    server = grpc.aio.server(options=[*GRPC_OPTIONS, *SERVER_OPTIONS],
                             interceptors=[*chain, ErrorsAndMetrics(metrics, admission, shard)])
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*service_names, reflection.SERVICE_NAME, health.SERVICE_NAME], server)
    if config.tls is not None:
        bound = server.add_secure_port(f"{host}:{port}", grpc.ssl_server_credentials([config.tls.read()]))
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"could not bind {host}:{port}")
    if metrics is not None:  # once bound: serve_on may try a second port
        metrics.attach(admission)
    await server.start()
    for name in ["", *service_names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound


def _code_of(context: grpc.aio.ServicerContext) -> grpc.StatusCode | None:
    """The status an aborted call set on its context (grpc.aio keeps it there), None if none."""
    try:
        code = context.code()
    except Exception:  # (an older grpc.aio without it)
        return None
    return code if isinstance(code, grpc.StatusCode) else None


def serve_on(loop: LoopThread, register: Callable[[grpc.aio.Server], None], service_names: list[str], host: str,
             port: int = 0, state: Path | None = None, what: str = "server",
             metrics: CallMetrics | None = None, config: ServeConfig | None = None,
             admission: Admission | None = None, shard: int | None = None) -> tuple[grpc.aio.Server, int]:
    """Start a server on `loop`, on `port` when one is given (a port the user asked for: taken, it
    is an error naming it), else on the port recorded in `state` if there is one (a restarted
    process comes back where clients look for it; taken, a new one: callers re-advertise their
    address), else a free port of memserver.server.rayutil.SERVER_PORTS (else any); record the
    bound port. (The recorded port came first, so
    `memserver up --port P` on a data directory of an earlier run served on that run's port, and
    a taken --port fell back to another, unsaid: a hunt.)"""
    recorded = int(json.loads(state.read_text()).get("port", 0)) if state is not None and state.exists() else 0

    def start(p: int) -> tuple[grpc.aio.Server, int]:
        return loop.call(start_server(register, service_names, host, p, metrics=metrics, config=config,
                                      admission=admission, shard=shard))

    if port:
        try:
            server, bound = start(port)
        except RuntimeError:
            raise RuntimeError(f"{what}: port {port} on {host} is taken by another process (--port): give another, "
                               "or 0 for any free port") from None
    else:
        server, bound = bind_first(start, RuntimeError, recorded, what)
    if state is not None:
        atomic_write(state, lambda f: f.write(json.dumps({"port": bound, "host": host}).encode()))
    return server, bound
