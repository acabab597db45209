"""grpc.aio plumbing shared by shard and coordinator servers: one way to start a server, one way
to turn bad input into a status code."""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from memserver.wire import GRPC_OPTIONS, BadInput

log = logging.getLogger(__name__)


class NotFound(KeyError):
    """Unknown table (mapped to NOT_FOUND)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "not found"


class AlreadyExists(ValueError):
    """Duplicate table name (mapped to ALREADY_EXISTS)."""


class ResourceExhausted(RuntimeError):
    """Too big for the server (mapped to RESOURCE_EXHAUSTED)."""


STATUS_OF: dict[type[BaseException], grpc.StatusCode] = {
    BadInput: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
}

T = TypeVar("T")


def rpc(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Wrap a servicer method: known exceptions become precise gRPC statuses with their text, and
    the call is counted and timed in the servicer's `metrics` (memserver.metrics), if it has one."""
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T:
        t0 = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            return await method(self, request, context)
        except tuple(STATUS_OF) as exc:
            code = next(c for t, c in STATUS_OF.items() if isinstance(exc, t))
            await context.abort(code, str(exc))
        except grpc.aio.AbortError:
            code = grpc.StatusCode.UNKNOWN
            raise
        except Exception as exc:
            if _is_actor_error(exc):  # a shard is restarting: the caller retries
                code = grpc.StatusCode.UNAVAILABLE
                await context.abort(code, f"a shard is unavailable (restarting?): {exc}")
            # a bug: say so, with the traceback in the server log
            log.exception("%s failed", name)
            code = grpc.StatusCode.INTERNAL
            await context.abort(code, f"{type(exc).__name__}: {exc}")
        finally:
            metrics = getattr(self, "metrics", None)
            if metrics is not None:
                metrics.observe(name, getattr(request, "table", ""), code.name, time.perf_counter() - t0)
        raise AssertionError("unreachable")

    return wrapper


def _is_actor_error(exc: BaseException) -> bool:
    try:
        from ray.exceptions import RayActorError
    except ImportError:
        return False
    return isinstance(exc, RayActorError)


async def start_server(
    register: Callable[[grpc.aio.Server], None], service_names: list[str], host: str, port: int = 0
) -> tuple[grpc.aio.Server, int]:
    """Start a grpc.aio server on host:port (0 = the OS picks) with health and reflection.

    Must be awaited on the event loop that will own the server (a Ray async actor's loop).
    """
    server = grpc.aio.server(options=GRPC_OPTIONS)
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*service_names, reflection.SERVICE_NAME, health.SERVICE_NAME], server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"could not bind {host}:{port}")
    await server.start()
    for name in ["", *service_names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound


def serve_on(loop: LoopThread, register: Callable[[grpc.aio.Server], None], service_names: list[str], host: str,
             port: int = 0, state: Path | None = None, what: str = "server") -> tuple[grpc.aio.Server, int]:
    """Start a server on `loop`, on the port recorded in `state` if there is one (a restarted
    process comes back where clients look for it), else on `port`; record the bound port.
    If the recorded port is taken, serve on a new one (callers re-advertise their address)."""
    import json

    from memserver.checkpoint import atomic_write

    wanted = int(json.loads(state.read_text()).get("port", port)) if state is not None and state.exists() else port
    try:
        server, bound = loop.call(start_server(register, service_names, host, wanted))
    except RuntimeError:
        if not wanted:
            raise
        log.warning("%s: port %d is taken; serving on a new port", what, wanted)
        server, bound = loop.call(start_server(register, service_names, host, 0))
    if state is not None:
        atomic_write(state, lambda f: f.write(json.dumps({"port": bound}).encode()))
    return server, bound


class LoopThread:
    """An asyncio event loop on a daemon thread, driven from other threads.

    Shard and coordinator actors are threaded Ray actors: their gRPC server lives on this loop,
    not on Ray's, so `__init__` can start it (and a restarted actor serves again without anyone
    calling it), and Ray methods reach the server's state through `call`. The blocking client
    runs its asyncio client on one too.
    """

    def __init__(self, name: str) -> None:
        import asyncio
        import threading

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def call(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and wait for its result (from any other thread)."""

        return self.submit(coro).result(timeout)

    def submit(self, coro: Awaitable[T]) -> concurrent.futures.Future[T]:
        """Schedule `coro` on the loop; its result arrives in the returned future."""
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop, wait for its thread and close it."""
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=timeout)
        if not self.loop.is_running():
            self.loop.close()
