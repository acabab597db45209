"""An asyncio event loop on a thread of its own, driven from other threads.

Shared by the servers and the blocking client: a shard or coordinator actor runs its grpc.aio
server on one (so the actor's `__init__` can start it, and a restarted actor serves again
without anyone calling it), and `client.MemoryClient` runs the asyncio client's control plane
and retries on one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class LoopThread:
    """An event loop on a daemon thread; `call` and `submit` run coroutines on it."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def call(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and wait for its result (from any other thread). A wait that
        ends without it (Ctrl-C, `timeout`) cancels it: it went on unseen (a blocking client's
        retries, sent after the caller had given up and decided otherwise: a review)."""
        if threading.current_thread() is self.thread:  # (a future's done-callback runs there): it would wait
            if asyncio.iscoroutine(coro):  # for itself, for ever, and every other caller with it (a hunt)
                coro.close()
            raise RuntimeError(f"a blocking call on the event-loop thread {self.thread.name} (from a done-callback of "
                               "a submitted call?) would wait for that thread itself; make it from another thread")
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except BaseException:
            fut.cancel()  # (done already: nothing)
            raise

    def submit(self, coro: Awaitable[T]) -> concurrent.futures.Future[T]:
        """Schedule `coro` on the loop; its result arrives in the returned future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]

    def stop(self, timeout: float = 5.0) -> None:
        """End the tasks still on the loop, stop it, wait for its thread and close it.

        As `asyncio.run` does at its end: every task left (grpc.aio's own, e.g. a closed call's
        status handler that has not run yet) is cancelled and given the loop to finish, so none is
        destroyed pending when the loop closes ("Task was destroyed but it is pending!"). All of
        it within `timeout` seconds (half of it at most for the tasks): a task that will not end
        by then is left, and destroyed with the loop."""
        deadline = time.monotonic() + timeout
        if self.loop.is_running():
            ending = asyncio.run_coroutine_threadsafe(_end_tasks(), self.loop)
            try:
                ending.result(timeout / 2)  # the rest is the thread's, to stop
            except Exception:  # a task that will not end in time, or the loop stopping: stop anyway
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if not self.loop.is_running():
            self.loop.close()


#: A closing loop waits for grpc.aio's calls to hear their end from gRPC's core until none is
#: left, or none has ended for GRPC_QUIET_SECONDS (the rest are live calls of other channels),
#: and GRPC_SETTLE_SECONDS at most in all.
GRPC_QUIET_SECONDS, GRPC_SETTLE_SECONDS = 0.25, 2.0


def _grpc_call_task(task: asyncio.Task) -> bool:
    """A task of grpc.aio's own client call code (the one that waits for a call's status)."""
    code = getattr(task.get_coro(), "cr_code", None)
    return code is not None and code.co_filename.replace(os.sep, "/").endswith(("/aio/call.pyx.pxi", "/aio/_call.py"))


async def settle_grpc(quiet: float = GRPC_QUIET_SECONDS, timeout: float = GRPC_SETTLE_SECONDS) -> int:
    """Let the grpc.aio calls of the running loop hear their end from gRPC's core; call it after
    closing the loop's channels and before the loop closes. Returns how many were waited for.

    Why: grpc.aio delivers every completion through one queue per process, drained by whichever
    loop wakes first, which hands each event to its call's loop (`call_soon_threadsafe`). A call
    cancelled by a channel's close still gets its status event a moment later; if its loop has
    closed by then (asyncio.run's end, LoopThread.stop), handing it over raises "Event loop is
    closed" inside the drain, which stops there: the events queued behind it, other loops'
    answers, wait for the next event of the process, for ever if none comes (a call that hung
    for minutes in the test suite). A cancelled call's status comes within a millisecond; a live
    call of a channel still open (not this closer's) is waited for `quiet` seconds only."""
    tasks = {t for t in asyncio.all_tasks() if t is not asyncio.current_task() and _grpc_call_task(t)}
    waited = len(tasks)
    end = time.monotonic() + timeout
    while tasks:
        done, tasks = await asyncio.wait(tasks, timeout=min(quiet, max(0.0, end - time.monotonic())),
                                         return_when=asyncio.FIRST_COMPLETED)
        if not done or time.monotonic() >= end:
            break
    return waited


async def _end_tasks() -> None:
    """Cancel every other task on the running loop and wait for them, then its async generators;
    grpc.aio's own call tasks are left to hear their end first (settle_grpc)."""
    loop = asyncio.get_running_loop()
    tasks = [t for t in asyncio.all_tasks(loop) if t is not asyncio.current_task() and not _grpc_call_task(t)]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await settle_grpc()
    tasks = [t for t in asyncio.all_tasks(loop) if t is not asyncio.current_task()]
    for task in tasks:  # grpc's that did not settle in time, and any the cancelled ones started
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await loop.shutdown_asyncgens()
