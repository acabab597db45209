"""The transport floor: a raw gRPC echo between two processes, with memserver's own options.

A remote call's time is transport + shard compute + everything memserver adds (protobuf, checks,
routing, copies, thread hops). The echo measures the first part alone: a grpc.aio server in a Ray
actor (a process of its own, as a shard is), bound to 127.0.0.1 and configured like a shard's
server (memserver.wire.GRPC_OPTIONS + memserver.server.admission.SERVER_OPTIONS), whose one
method takes bytes and answers bytes (a generic handler with no serializers: no protobuf work on
either side; registered with the server as generated servicers are) of the size the request
asks for. The first 8 bytes of a request carry that size
(little endian); a request shorter than 8 bytes gets an empty answer (the empty call). Answers
are preallocated per size (`Answers`), so the server allocates nothing per call after the first
of a size. benchmarks.bell_echo and benchmarks.grpc_designs reuse these pieces.

Callers use the client's own channels (client.channels.sync_channel: the same options, the same
retry service config) and fan out like client.MemoryClient (`fan_out`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

#: The echo's one method (bytes in, bytes out).
SERVICE, METHOD = "bench.Echo", "Echo"
PATH = f"/{SERVICE}/{METHOD}"
#: The request's header: the answer's size in bytes.
HEADER_BYTES = 8


def asked(request: bytes | memoryview) -> int:
    """The answer size a request asks for (0 for one shorter than the header: the empty call)."""
    return int.from_bytes(request[:HEADER_BYTES], "little") if len(request) >= HEADER_BYTES else 0


class Answers(dict[int, bytes]):
    """Answers by size, each made on first use: an echo allocates nothing per call after that."""

    def __missing__(self, n: int) -> bytes:
        answer = self[n] = bytes(n)
        return answer


def register(server: grpc.Server | grpc.aio.Server, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
    """Add `handlers` both ways, as the generated add_*Servicer_to_server registers a shard's
    methods (a registered call is cheaper)."""
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)


class EchoServer:
    """A Ray actor serving the echo on a grpc.aio server run on a loop thread of its own, as a
    shard actor serves (memserver.loop.LoopThread)."""

    def __init__(self) -> None:
        from memserver.loop import LoopThread

        self.answers = Answers()
        self.loop = LoopThread("bench-echo")
        self.server, self.port = self.loop.call(self._start())

    async def _start(self) -> tuple[grpc.aio.Server, int]:
        from memserver.server.admission import SERVER_OPTIONS
        from memserver.wire import GRPC_OPTIONS

        server = grpc.aio.server(options=[*GRPC_OPTIONS, *SERVER_OPTIONS])
        handler = grpc.unary_unary_rpc_method_handler(self._echo, request_deserializer=None, response_serializer=None)
        register(server, SERVICE, {METHOD: handler})
        port = server.add_insecure_port("127.0.0.1:0")
        if port == 0:
            raise RuntimeError("echo: could not bind 127.0.0.1")
        await server.start()
        return server, port

    async def _echo(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return self.answers[asked(request)]

    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        """Stop serving (for use outside an actor, e.g. a test; an actor is killed instead)."""
        self.loop.call(self.server.stop(None))
        self.loop.stop()


def echo_request(request_bytes: int, answer_bytes: int) -> bytes:
    """A request of `request_bytes` (at least the header) asking for `answer_bytes` back."""
    return answer_bytes.to_bytes(HEADER_BYTES, "little") + bytes(max(0, request_bytes - HEADER_BYTES))


@contextlib.contextmanager
def echo_servers(n: int, num_cpus: float = 0.25, cls: type = EchoServer) -> Iterator[list[str]]:
    """`n` echo actors of `cls` (one process each, like `n` shards; benchmarks.bell_echo.BellEcho
    for the doorbell's); yields their addresses, kills them on exit. Needs Ray up
    (benchmarks.common.local_cluster / init_ray)."""
    import ray

    actors = [ray.remote(cls).options(num_cpus=num_cpus).remote() for _ in range(n)]
    try:
        yield ray.get([a.address.remote() for a in actors])
    finally:
        for a in actors:
            ray.kill(a)


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, 0)


def ray_worker_nice() -> int:
    """The nice value Ray runs its workers at, shards and echo actors included
    (RAY_worker_niceness, 15 by default; the driver stays at its own, usually 0)."""
    import ray

    return int(ray.get(ray.remote(num_cpus=0)(_nice).remote()))


def raw_method(channel: grpc.Channel, path: str = PATH) -> grpc.UnaryUnaryMultiCallable:
    """A bytes-in, bytes-out multi-callable for `path` on `channel` (no serializers).

    Registered with the channel, as the generated stubs the client uses register theirs
    (`_registered_method=True`, what grpc's generated code passes): an unregistered call costs
    ~50 us more per call here, which would put the floor above the client's own transport."""
    return channel.unary_unary(path, _registered_method=True)


def fan_out(calls: Sequence[tuple[grpc.UnaryUnaryMultiCallable, Any]], timeout: float = 60.0) -> list[Any]:
    """Send every call at once and wait for all answers, as client.MemoryClient does: all but the
    last as futures, the last as a blocking call in this thread (one wake-up fewer)."""
    futures = [fn.future(req, timeout=timeout) for fn, req in calls[:-1]]
    last_fn, last_req = calls[-1]
    last = last_fn(last_req, timeout=timeout)
    return [*(f.result() for f in futures), last]
