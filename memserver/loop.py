"""An asyncio event loop on a thread of its own, driven from other threads.

Shared by the servers and the blocking client: a shard or coordinator actor runs its grpc.aio
server on one (so the actor's `__init__` can start it, and a restarted actor serves again
without anyone calling it), and `client.MemoryClient` runs the asyncio client's control plane
and retries on one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
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
        """Run `coro` on the loop and wait for its result (from any other thread)."""
        return self.submit(coro).result(timeout)

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


async def _end_tasks() -> None:
    """Cancel every other task on the running loop and wait for them, then its async generators."""
    loop = asyncio.get_running_loop()
    tasks = [t for t in asyncio.all_tasks(loop) if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await loop.shutdown_asyncgens()
