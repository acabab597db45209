"""memserver.loop.LoopThread: the event-loop thread of the blocking client and the servers."""

from __future__ import annotations

import asyncio
import gc
import logging
import time

import pytest

from memserver.loop import LoopThread


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
