"""The blocking client: the asyncio client driven from a private event-loop thread.

Trainers and scripts call it like a normal library; `submit_*` methods return a
concurrent.futures.Future so a trainer can overlap a remote call with its own compute.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

from client.aio import AsyncMemoryClient, TableMeta

T = TypeVar("T")


class MemoryClient:
    """Synchronous client of a memserver cluster; see AsyncMemoryClient for the arguments."""

    def __init__(self, endpoint: str | None = None, **kwargs: Any) -> None:
        self.aio = AsyncMemoryClient(endpoint, **kwargs)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="memserver-client", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return self.aio.endpoint

    def _submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._submit(coro).result()

    def close(self) -> None:
        if self._loop.is_running():
            self._run(self.aio.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            self._loop.close()

    def __enter__(self) -> MemoryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # control plane
    def create_table(self, name: str, num_rows: int, dim: int, **kwargs: Any) -> TableMeta:
        return self._run(self.aio.create_table(name, num_rows, dim, **kwargs))

    def drop_table(self, name: str) -> None:
        self._run(self.aio.drop_table(name))

    def list_tables(self) -> list[TableMeta]:
        return self._run(self.aio.list_tables())

    def table(self, name: str, *, refresh: bool = False) -> TableMeta:
        return self._run(self.aio.table(name, refresh=refresh))

    def status(self) -> Any:
        return self._run(self.aio.status())

    def checkpoint(self, dir: str, step: int = 0, tables: list[str] | None = None) -> dict[str, Any]:
        return self._run(self.aio.checkpoint(dir, step, tables))

    def restore(self, dir: str, step: int = 0, **kwargs: Any) -> list[TableMeta]:
        return self._run(self.aio.restore(dir, step, **kwargs))

    # data plane
    def lookup(self, table: str, ids: Any) -> Any:
        return self._run(self.aio.lookup(table, ids))

    def bag(self, table: str, ids: Any, weights: Any, offsets: Any = None) -> Any:
        return self._run(self.aio.bag(table, ids, weights, offsets))

    def bag_backward(
        self, table: str, ids: Any, weights: Any, grad_out: Any, offsets: Any = None, *, defer_apply: bool = False,
        step: int = 0,
    ) -> Any:
        return self._run(self.aio.bag_backward(table, ids, weights, grad_out, offsets, defer_apply=defer_apply, step=step))

    def push_gradients(self, table: str, ids: Any, grads: Any) -> int:
        return self._run(self.aio.push_gradients(table, ids, grads))

    def write_rows(self, table: str, ids: Any, rows: Any) -> int:
        return self._run(self.aio.write_rows(table, ids, rows))

    def slot_stats(self, table: str, ids: Any) -> dict[str, Any]:
        return self._run(self.aio.slot_stats(table, ids))

    # the same calls, without waiting
    def submit_bag(self, table: str, ids: Any, weights: Any, offsets: Any = None) -> Future[Any]:
        return self._submit(self.aio.bag(table, ids, weights, offsets))

    def submit_bag_backward(
        self, table: str, ids: Any, weights: Any, grad_out: Any, offsets: Any = None, *, defer_apply: bool = False
    ) -> Future[Any]:
        return self._submit(self.aio.bag_backward(table, ids, weights, grad_out, offsets, defer_apply=defer_apply))
