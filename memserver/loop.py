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
        """Stop the loop, wait for its thread and close it."""
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=timeout)
        if not self.loop.is_running():
            self.loop.close()
