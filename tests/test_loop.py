"""memserver.loop.LoopThread: the event-loop thread of the blocking client and the servers."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from memserver.loop import LoopThread, _end_tasks, _grpc_call_task, settle_grpc


def test_stop_ends_the_tasks_left_on_the_loop_instead_of_destroying_them(caplog: pytest.LogCaptureFixture) -> None:
    """A task still pending when the client closes (grpc.aio leaves a closed call's status
    handler behind) is cancelled and finishes; none is destroyed pending, which asyncio reports
    as "Task was destroyed but it is pending!" in the user's output."""
    loop = LoopThread("test-loop")
    ended: list[str] = []

    async def sleeper() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise

    async def start() -> None:
        asyncio.ensure_future(sleeper())  # nothing keeps a reference to it but the loop
        await asyncio.sleep(0)

    loop.call(start())
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        loop.stop()
        gc.collect()
    assert ended == ["cancelled"]
    assert loop.loop.is_closed()
    assert not [r for r in caplog.records if "destroyed" in r.getMessage()]


def test_stop_does_not_wait_past_its_timeout_for_a_task_that_will_not_end() -> None:
    loop = LoopThread("test-loop-stubborn")

    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass  # refuses to end

    async def start() -> None:
        asyncio.ensure_future(stubborn())
        await asyncio.sleep(0)

    loop.call(start())
    t0 = time.monotonic()
    loop.stop(timeout=2.0)
    assert time.monotonic() - t0 < 3.0  # one deadline for the tasks and the thread
    assert not loop.thread.is_alive()


# -- grpc.aio calls closed with their loop --------------------------------------------------------


async def _stream_forever(request: bytes, context: object) -> AsyncIterator[bytes]:
    yield b"first"
    await asyncio.sleep(3600)


async def _echo(request: bytes, context: object) -> bytes:
    return request


@pytest.fixture(scope="module")
def stream_server() -> Iterator[str]:
    """A grpc.aio server on a loop thread of its own: /T/Stream sends one message and then
    nothing (the shape of AttachRegion's stream), /T/Echo answers its request."""
    import grpc

    loop = LoopThread("test-stream-server")

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("T", {
            "Stream": grpc.unary_stream_rpc_method_handler(_stream_forever),
            "Echo": grpc.unary_unary_rpc_method_handler(_echo)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = loop.call(start())
    yield f"127.0.0.1:{port}"
    loop.call(server.stop(None))
    loop.stop()


async def _open_stream_then_close(address: str, settle: bool) -> list[asyncio.Task]:
    """Start a stream, read its first message, close the channel (which cancels the stream);
    the grpc.aio call tasks still waiting for gRPC's core then (after settle_grpc if `settle`)."""
    import grpc

    ch = grpc.aio.insecure_channel(address)
    stream = ch.unary_stream("/T/Stream")(b"")
    assert await stream.read() == b"first"
    await ch.close()
    if settle:
        await settle_grpc()
    return [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and _grpc_call_task(t)]


def test_a_closed_channels_calls_hear_their_end_before_the_loop_closes(stream_server: str) -> None:
    """A stream cancelled by its channel's close still waits for its status from gRPC's core
    (here without settle_grpc, the race the fix is for); settle_grpc waits for it, so no event
    of that call can reach the loop after asyncio.run closes it."""
    left = asyncio.run(_open_stream_then_close(stream_server, settle=False))
    assert len(left) == 1 and left[0].cancelled()  # by asyncio.run's end, before gRPC's core was done with it
    assert asyncio.run(_open_stream_then_close(stream_server, settle=True)) == []


def test_a_stopped_loop_thread_lets_its_calls_hear_their_end_and_breaks_no_drain(
        stream_server: str, caplog: pytest.LogCaptureFixture) -> None:
    """grpc.aio hands each completion to its call's loop from whichever loop drains the process's
    one queue; one for a closed loop raises "Event loop is closed" there and strands the events
    behind it (another loop's answer: a call that never completes). LoopThread.stop's ending of
    the loop's tasks, right after a channel's close, lets the closed stream's status arrive (its
    task ends, not cancelled), and calls on fresh loops afterwards log no such error."""
    import grpc

    async def close_then_end_tasks() -> list[asyncio.Task]:
        left = await _open_stream_then_close(stream_server, settle=False)
        await _end_tasks()  # what LoopThread.stop runs on the loop
        return left

    async def echo_calls() -> None:
        async with grpc.aio.insecure_channel(stream_server) as ch:
            for _ in range(5):
                assert await ch.unary_unary("/T/Echo")(b"y") == b"y"

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        for _ in range(5):
            loop = LoopThread("test-loop-stream")
            left = loop.call(close_then_end_tasks())
            loop.stop()
            assert left  # the status was on its way when the tasks were ended
            assert all(t.done() and not t.cancelled() for t in left)
            asyncio.run(echo_calls())
    assert not [r for r in caplog.records if "Event loop is closed" in str(r.exc_info and r.exc_info[1])]


def test_the_async_clients_close_returns_once_its_calls_heard_their_end() -> None:
    """AsyncMemoryClient.close() settles its channels' calls, so `asyncio.run` (or the blocking
    client's loop) may close the loop at once: a stream open on one of its channels when it
    closes (as AttachRegion's are) leaves no grpc.aio task waiting for gRPC's core."""
    from grpc_health.v1 import health_pb2

    from client import AsyncMemoryClient
    from memserver.cluster.inprocess import InProcessServer

    with InProcessServer(1) as server:
        async def session() -> list[asyncio.Task]:
            ac = AsyncMemoryClient(server.endpoint)
            watch = ac._channel(server.shards[0].address).unary_stream(
                "/grpc.health.v1.Health/Watch", request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                response_deserializer=health_pb2.HealthCheckResponse.FromString)(health_pb2.HealthCheckRequest())
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            await ac.close()
            return [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and _grpc_call_task(t)]

        assert asyncio.run(session()) == []


def test_a_blocking_call_from_the_loops_own_thread_is_refused_not_a_hang() -> None:
    """A submitted call's done-callback runs on the loop's thread; a blocking client call made
    there waited for that thread itself: it hung for ever, and every other caller with it (a
    hunt). Refused, and the loop goes on."""
    import concurrent.futures

    from memserver.loop import LoopThread

    lt = LoopThread("test-own-thread")
    try:
        said: concurrent.futures.Future = concurrent.futures.Future()

        async def noop() -> int:
            return 1

        def callback(_f: object) -> None:
            try:
                lt.call(noop())
            except RuntimeError as exc:
                said.set_result(str(exc))

        async def later() -> int:  # (done before add_done_callback, the callback would run on this thread)
            await asyncio.sleep(0.3)
            return 1

        lt.submit(later()).add_done_callback(callback)
        assert "would wait for that thread itself; make it from another thread" in said.result(10)
        assert lt.call(noop(), timeout=10) == 1
    finally:
        lt.stop()
