"""The DataPlane service of a shard: lookup, bag, bag_backward, push, write, slot statistics.

Requests are decoded on the server's event loop (views of the payload bytes) and computed on one
worker thread per shard: table state is only ever touched by that thread, so a retried write's
exactly-once check and its application are atomic, and the loop keeps receiving while torch
works (torch releases the GIL). Handlers raise memserver.api.errors; the interceptors of
memserver.server.grpcserver turn them into statuses and count every call.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import torch

from memserver.api.errors import InvalidArgumentError, TableNotFoundError
from memserver.api.v1 import memserver_pb2 as pb
from memserver.api.v1 import memserver_pb2_grpc as pb_grpc
from memserver.core.table import bag_index
from memserver.server.slice import TableSlice
from memserver.storage.wal import BAG_BACKWARD, PUSH_GRADIENTS, WRITE_ROWS
from memserver.wire import check_1d, check_bag, check_rows, decode, encode

T = TypeVar("T")

#: Requests with at most this many ids run on the event loop when the compute thread is idle.
INLINE_ENTRIES = 2048


class DataPlaneServicer(pb_grpc.DataPlaneServicer):
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.tables: dict[str, TableSlice] = {}
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-compute")
        self.requests = 0
        # Deferred row updates (BagBackward with defer_apply): run on the compute thread before
        # any later work item, so no request ever observes the table without them.
        self.pending: deque[Callable[[], object]] = deque()
        self.busy = 0  # work items handed to the compute thread and not finished
        self.tasks: set[asyncio.Task[None]] = set()

    def _drain(self) -> None:
        while self.pending:
            self.pending.popleft()()

    async def run(self, fn: Callable[[], T], entries: int = INLINE_ENTRIES + 1) -> T:
        """Run fn with exclusive access to the tables: on the compute thread, or, for a small
        request (`entries` ids) while that thread is idle, right here on the event loop. Both are
        exclusive because only this loop hands work to the compute thread; inline saves two
        thread hops on the latency-bound calls."""

        def work() -> T:
            self._drain()
            return fn()

        if entries <= INLINE_ENTRIES and self.busy == 0:
            return work()
        self.busy += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, work)
        finally:
            self.busy -= 1

    def slice(self, name: str) -> TableSlice:
        sl = self.tables.get(name)
        if sl is None:
            raise TableNotFoundError(f"table {name!r} does not exist")
        sl.requests += 1
        self.requests += 1
        return sl

    @staticmethod
    def _bag_inputs(request: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
        ids = decode(request.ids, "ids")
        weights = decode(request.weights, "weights")
        offsets = decode(request.offsets, "offsets") if request.HasField("offsets") else None
        return ids, weights, offsets, check_bag(ids, weights, offsets)

    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        sl = self.slice(request.table)
        ids = decode(request.ids, "ids")
        check_1d(ids, "ids")

        def work() -> pb.LookupResponse:
            return pb.LookupResponse(rows=encode(sl.table.lookup(sl.local(ids)), request.wire_dtype))

        return await self.run(work, ids.numel())

    async def Bag(self, request: pb.BagRequest, context: grpc.aio.ServicerContext) -> pb.BagResponse:
        sl = self.slice(request.table)
        ids, weights, offsets, _ = self._bag_inputs(request)

        def work() -> pb.BagResponse:
            out = sl.table.bag(sl.local(ids), weights, offsets)
            return pb.BagResponse(out=encode(out, request.wire_dtype))

        return await self.run(work, ids.numel())

    # Each write is built in two halves: validation (on the event loop, before anything changes)
    # and a work() that applies it on the compute thread. Replaying the write-ahead log after a
    # restart runs the same work() on the logged request.

    def _bag_backward(self, sl: TableSlice, request: pb.BagBackwardRequest) -> tuple[Callable[[], pb.BagBackwardResponse], int]:
        ids, weights, offsets, num_bags = self._bag_inputs(request)
        grad_out = decode(request.grad_out, "grad_out")
        check_rows(grad_out, num_bags, sl.table.dim, "grad_out")

        def work() -> pb.BagBackwardResponse:
            sl.check_writable()
            local = sl.local(ids)

            def apply() -> pb.Tensor:
                grad_w, update = sl.table.bag_grad(local, weights, offsets, grad_out)
                if sl.spec.sync_updates:
                    entries = tuple(t.clone() for t in (local.reshape(-1), bag_index(local, offsets), weights.reshape(-1).float(), grad_out.float()))
                    sl.contribute(request.step, request.tag.client_id or "anonymous", entries)
                elif request.defer_apply:
                    self.pending.append(update)
                else:
                    update()
                sl.log(BAG_BACKWARD, request)
                return encode(grad_w)

            grad_w, dup = sl.once(request.tag, apply)
            return pb.BagBackwardResponse(grad_weights=grad_w, duplicate=dup)

        return work, ids.numel()

    def _push_gradients(self, sl: TableSlice, request: pb.PushGradientsRequest) -> tuple[Callable[[], pb.WriteAck], int]:
        ids, grads = decode(request.ids, "ids"), decode(request.grads, "grads")
        check_1d(ids, "ids")
        check_rows(grads, ids.shape[0], sl.table.dim, "grads")

        def work() -> pb.WriteAck:
            sl.check_writable()
            local = sl.local(ids)

            def apply() -> int:
                rows = sl.table.push_gradients(local, grads)
                sl.log(PUSH_GRADIENTS, request)
                return rows

            rows, dup = sl.once(request.tag, apply)
            return pb.WriteAck(rows=rows, duplicate=dup)

        return work, ids.numel()

    def _write_rows(self, sl: TableSlice, request: pb.WriteRowsRequest) -> tuple[Callable[[], pb.WriteAck], int]:
        ids, rows = decode(request.ids, "ids"), decode(request.rows, "rows")
        check_1d(ids, "ids")
        check_rows(rows, ids.shape[0], sl.table.dim, "rows")

        def work() -> pb.WriteAck:
            sl.check_writable()
            local = sl.local(ids)
            if len(torch.unique(local)) != len(local):
                raise InvalidArgumentError("ids: write_rows needs distinct ids (which of two rows would win?)")

            def apply() -> int:
                n = sl.table.write_rows(local, rows)
                sl.log(WRITE_ROWS, request)
                return n

            n, dup = sl.once(request.tag, apply)
            return pb.WriteAck(rows=n, duplicate=dup)

        return work, ids.numel()

    _WRITES: dict[int, tuple[type, str]] = {
        BAG_BACKWARD: (pb.BagBackwardRequest, "_bag_backward"),
        PUSH_GRADIENTS: (pb.PushGradientsRequest, "_push_gradients"),
        WRITE_ROWS: (pb.WriteRowsRequest, "_write_rows"),
    }

    def replay(self, sl: TableSlice, kind: int, payload: bytes) -> None:
        """Re-apply one logged write (recovery; the slice has no log attached yet)."""
        cls, builder = self._WRITES[kind]
        work, _ = getattr(self, builder)(sl, cls.FromString(payload))
        work()
        self._drain()

    async def _acknowledge(self, sl: TableSlice) -> None:
        """Wait until every write this slice logged so far is on disk (group commit): a write is
        acknowledged only once it would survive a crash. A replayed duplicate waits too."""
        if sl.wal is not None and sl.last_lsn >= 0:
            await asyncio.wrap_future(sl.wal.durable(sl.last_lsn))

    async def _apply_write(self, request: Any, build: Callable[[TableSlice, Any], tuple[Callable[[], T], int]]) -> T:
        """Validate, apply on the compute thread, then answer once the write is logged durably."""
        sl = self.slice(request.table)
        work, n = build(sl, request)
        response = await self.run(work, n)
        if self.pending:  # a deferred update: apply it promptly even if no request follows
            task = asyncio.get_running_loop().create_task(self.run(lambda: None))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        await self._acknowledge(sl)
        return response

    async def BagBackward(self, request: pb.BagBackwardRequest, context: grpc.aio.ServicerContext) -> pb.BagBackwardResponse:
        return await self._apply_write(request, self._bag_backward)

    async def PushGradients(self, request: pb.PushGradientsRequest, context: grpc.aio.ServicerContext) -> pb.WriteAck:
        return await self._apply_write(request, self._push_gradients)

    async def WriteRows(self, request: pb.WriteRowsRequest, context: grpc.aio.ServicerContext) -> pb.WriteAck:
        return await self._apply_write(request, self._write_rows)

    async def SlotStats(self, request: pb.SlotStatsRequest, context: grpc.aio.ServicerContext) -> pb.SlotStatsResponse:
        sl = self.slice(request.table)
        ids = decode(request.ids, "ids")
        check_1d(ids, "ids")

        def work() -> pb.SlotStatsResponse:
            stats = sl.table.slot_stats(sl.local(ids))
            return pb.SlotStatsResponse(**{k: encode(v) for k, v in stats.items()})

        return await self.run(work, ids.numel())
