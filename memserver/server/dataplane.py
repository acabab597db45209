"""The DataPlane service of a shard: lookup, bag, bag_backward, push, write, slot statistics and
inspection (trigger contexts, top slots, usage histograms).

Requests are decoded on the server's event loop (views of the payload bytes) and computed on one
worker thread per shard: table state is only ever touched by that thread, so a retried write's
exactly-once check and its application are atomic, and the loop keeps receiving while torch
works (torch releases the GIL). Handlers raise memserver.api.errors; the interceptors of
memserver.server.grpcserver turn them into statuses and count every call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Generator, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any, NamedTuple, TypeVar

import grpc
import numpy as np
import torch

from memserver.api.errors import (
    DataLossError,
    DeadlineExceededError,
    InvalidArgumentError,
    TableNotFoundError,
    UnavailableError,
)
from memserver.api.types import MAX_INSPECT_SLOTS, check_table_name, shown
from memserver.api.usage import Histogram
from memserver.api.v1 import memserver_pb2 as pb
from memserver.api.v1 import memserver_pb2_grpc as pb_grpc
from memserver.core.steps import bag_entries
from memserver.core.table import TopN, set_threads
from memserver.server.shm import Region, Regions, answer, serve_attach
from memserver.server.slice import TableSlice
from memserver.storage.wal import ADD, BAG_BACKWARD, COMMIT_STEP, LOAD_PRODUCT_KEYS, PUSH_GRADIENTS, REMOVE, WRITE_ROWS
from memserver.wire import (
    MAX_TRIGGER_INFO,
    Lazy,
    answer_dtype,
    check_1d,
    check_answer,
    check_bag,
    check_row_sums,
    check_rows,
    check_stored,
    check_triggers,
    check_wire_dtype,
    decode,
    encode,
    inline,
)

T = TypeVar("T")
log = logging.getLogger(__name__)

#: What each table kind is and the calls it takes (the refusal of a call of another kind says so).
_KIND_CALLS = {
    pb.VALUE: "a value table (Lookup, Bag, BagBackward, ...)",
    pb.INDEX: "an index table (Search, Add, Remove)",
    pb.PRODUCT_KEYS: "a product-key table (Address, LoadProductKeys)",
}

#: Requests with at most this many ids run on the event loop when the compute thread is idle.
INLINE_ENTRIES = 2048
#: A search runs there only below this many multiply-adds of a brute-force scan (queries x vectors x dim).
INLINE_SEARCH_WORK = 1 << 22


class _Saving(Exception):
    """A write reached a slice whose checkpoint file is being written (TableSlice.saving): nothing
    was done; run it again once `done` is."""

    def __init__(self, done: Future[None]) -> None:
        super().__init__("the table's checkpoint is being written")
        self.done = done


class Wait(NamedTuple):
    """What a call's steps wait for (DataPlaneServicer.serve_steps): `done`, or `until` (a
    time.monotonic(); None: no end) passing, whichever comes first; the steps then say which."""

    done: Future[Any]
    until: float | None


def finish(steps: Generator[Wait, None, T]) -> T:
    """A call's steps run to their end on the calling thread, each wait waited out here."""
    try:
        wait = next(steps)
        while True:
            futures_wait([wait.done], None if wait.until is None else max(0.0, wait.until - time.monotonic()))
            wait = steps.send(None)
    except StopIteration as end:
        return end.value


class Call(NamedTuple):
    """One data-plane call, validated: `work` computes its answer with the tables to itself;
    `entries` sizes it (small ones may run inline); `write`: answered only once durable (the
    slice's log). Built by a plan (DataPlaneServicer.PLANS) and run by gRPC's handler (`_serve`)
    or by the doorbell's threads (`serve_steps`): one path of checks and math for both. `scan`: a
    pass over every row of the slice, in chunks that each run as their own work item before
    `work` (the shard's other calls run between them, so an inspection never holds the shard for
    the whole slice; each chunk sees the table as it is then)."""

    sl: TableSlice
    work: Callable[[], Any]
    entries: int
    write: bool = False
    scan: Iterable[Callable[[], None]] = ()
    #: its answer's bytes where they may be many times its request's (check_answer): counted in the
    #: shard's max_inflight_bytes while it runs, as its request is (a bag of [B, 0] ids, 23 bytes,
    #: answered B rows, counted as 23 bytes: a few at once took a shard's memory unrefused, a hunt)
    answer: int = 0


class DataPlaneServicer(pb_grpc.DataPlaneServicer):
    def __init__(self, device: torch.device, threads: int = 1) -> None:
        """`threads`: torch and numba threads of the compute thread (set on that thread: numba's
        setting is per thread)."""
        self.device = device
        self.threads = threads  # every thread that computes sets them (set_threads): the doorbell's too
        self.tables: dict[str, TableSlice] = {}
        #: tables whose slice this shard should hold and does not (it restarted where its data
        #: directory is not): name -> what was lost and how to restore it (DATA_LOSS until then)
        self.lost: dict[str, str] = {}
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-compute", initializer=set_threads,
                                       initargs=(threads,))
        self.requests = 0
        # Deferred row updates (BagBackward with defer_apply): run on the compute thread before
        # any later work item, so no request ever observes the table without them.
        self.pending: deque[tuple[TableSlice, Callable[[], object]]] = deque()
        self.busy = 0  # work items handed to the compute thread and not finished
        self.deferred = 0  # updates queued to run after their answer (a count, for status)
        self.tasks: set[asyncio.Task[None]] = set()
        self.regions = Regions()  # clients' shared memory (memserver.server.shm)
        # Whoever computes holds this: the compute thread, the event loop (a small call while the
        # compute thread is idle) or a doorbell thread (memserver.server.doorbell). Table state
        # is only touched under it, so a write's exactly-once check and its application are atomic.
        self.exclusive = threading.Lock()

    def _drain(self) -> None:
        while self.pending:
            sl, update = self.pending.popleft()
            try:
                update()
            except Exception as exc:  # acknowledged and logged: the table must not serve writes without it
                sl.fail_writes(f"a deferred update failed to apply ({exc!r})")

    def _held(self, fn: Callable[[], T], sl: TableSlice | None = None, count: bool = True, write: bool = False) -> T:
        """fn with the tables to itself: called holding `exclusive` (released here), deferred work
        first. The one place every call's work runs (gRPC's on the compute thread or inline, the
        doorbell's): its plan was built on `sl` outside the lock, so it runs only if `sl` is still
        its table's (a slice dropped meanwhile is closed: NOT_FOUND; one replaced, by a rollback or
        a drop and create: UNAVAILABLE, call again), and it is counted here, under the lock (a
        call's scan chunks are not: the call counts once). A `write` to a slice whose checkpoint
        file is being written raises _Saving, nothing done: its caller waits for the file and
        runs it again (the file is written off this lock, so other calls go on meanwhile)."""
        try:
            self._drain()
            if sl is not None:
                name = sl.spec.name
                now = self.tables.get(name)
                if now is not sl:
                    if now is None:
                        raise TableNotFoundError(f"table {name!r} does not exist (dropped while the call waited)")
                    raise UnavailableError(f"table {name!r}: its slice was replaced while the call waited; call again")
                if write and sl.saving is not None:
                    raise _Saving(sl.saving)
                if count:
                    sl.requests += 1
                    self.requests += 1
            return fn()
        finally:
            self.exclusive.release()

    def _exclusively(self, fn: Callable[[], T], sl: TableSlice | None, count: bool = True, write: bool = False) -> T:
        """`_held` once `exclusive` is had, however long that takes (the compute thread)."""
        self.exclusive.acquire()
        return self._held(fn, sl, count, write)

    async def run(self, fn: Callable[[], T], entries: int = INLINE_ENTRIES + 1, sl: TableSlice | None = None,
                  count: bool = True, write: bool = False) -> T:
        """Run fn with exclusive access to the tables (`_held`; `sl`: a call's slice): on the
        compute thread, or, for a small request (`entries` ids) while no one else computes, right
        here on the event loop (inline saves two thread hops on the latency-bound calls). A
        `write` waits while its slice's checkpoint file is written (_Saving)."""
        while True:
            try:
                if entries <= INLINE_ENTRIES and self.busy == 0 and self.exclusive.acquire(blocking=False):
                    return self._held(fn, sl, count, write)
                self.busy += 1
                try:
                    return await asyncio.get_running_loop().run_in_executor(self.pool, self._exclusively, fn, sl,
                                                                            count, write)
                finally:
                    self.busy -= 1
            except _Saving as saving:  # shielded: a waiter cancelled (its deadline) must not cancel the
                await asyncio.shield(asyncio.wrap_future(saving.done))  # future the other waiters share

    async def _serve(self, name: str, request: Any) -> Any:
        """A gRPC call: its plan's checks on the event loop, its work by `run`, its answer once durable."""
        with self._region(request) as region:
            call = self.PLANS[name](self, request, region)
            self._take_answer(name, request, region, call)
            try:
                for chunk in call.scan:  # each its own work item: queued calls run between them
                    await self.run(chunk, INLINE_ENTRIES + 1, call.sl, count=False)
                response = await self.run(call.work, call.entries, call.sl, write=call.write)
            finally:
                self._give_answer(call)
                self._drain_soon()
            if call.write:
                durable = self._durable(call.sl)
                if durable is not None:
                    await asyncio.wrap_future(durable)
            return response

    def drain_now(self) -> None:
        """Deferred work (updates after their answer, read counters) run now unless someone is
        computing (who drains it first): a doorbell thread's call after its answer is sent."""
        if self.pending and self.exclusive.acquire(blocking=False):
            self._held(_nothing)

    def serve_steps(self, name: str, request: Any, deadline: float | None = None) -> Generator[Wait, None, Any]:
        """A doorbell call, on the calling thread (not the event loop), in steps: the same plan as
        `_serve`, its work by `_held` (DEADLINE_EXCEEDED, nothing done, if `exclusive` is not had
        before `deadline`, a time.monotonic()), its answer returned once durable. Where it must
        wait (its slice's checkpoint file being written; a write's log not on disk yet) it yields
        what it waits for (`Wait`), to be resumed (`send(None)`) by any thread once that is done or
        its time is over: the doorbell hands such a call off and serves the connection's later
        calls meanwhile. Its region stays leased until it ends or is closed. The caller runs
        deferred work (`drain_now`) after sending the answer. `serve_now`: the steps waited out."""
        if deadline is not None and not math.isfinite(deadline):
            raise InvalidArgumentError(f"deadline: a time on the shard's monotonic clock, got {deadline}")
        with self._region(request) as region:
            call = self.PLANS[name](self, request, region)
            self._take_answer(name, request, region, call)
            try:
                for chunk in call.scan:  # `exclusive` let go between chunks, as on the compute thread
                    self._acquire_by(deadline, name)
                    self._held(chunk, call.sl, count=False)
                while True:
                    self._acquire_by(deadline, name)
                    try:
                        response = self._held(call.work, call.sl, write=call.write)
                        break
                    except _Saving as saving:  # its slice's checkpoint file is being written: after it
                        yield Wait(saving.done, deadline)
                        if not saving.done.done():
                            raise DeadlineExceededError(f"{name}: the call's deadline passed while its table's "
                                                        "checkpoint was written") from None
            finally:
                self._give_answer(call)
        if call.write:
            durable = self._durable(call.sl)
            if durable is not None:
                if not durable.done():
                    yield Wait(durable, None)
                durable.result()
        return response

    def serve_now(self, name: str, request: Any, deadline: float | None = None) -> Any:
        """`serve_steps` run to its end on the calling thread, each wait waited out."""
        return finish(self.serve_steps(name, request, deadline))

    def _acquire_by(self, deadline: float | None, name: str) -> None:
        """`exclusive`, had before `deadline` (a time.monotonic(); None: however long it takes),
        else DEADLINE_EXCEEDED."""
        wait = -1 if deadline is None else min(deadline - time.monotonic(), threading.TIMEOUT_MAX)
        if (deadline is not None and wait <= 0) or not self.exclusive.acquire(timeout=wait):
            raise DeadlineExceededError(f"{name}: the call's deadline passed before the shard could run it")

    def slice(self, request: Any, kind: int = pb.VALUE) -> TableSlice:
        """The slice a request is for, checked against the request's layout_id and table kind
        (a call of another kind's is refused with INVALID_ARGUMENT naming the table's calls)."""
        sl = self.tables.get(request.table)
        if sl is None:
            if request.table in self.lost:
                raise DataLossError(self.lost[request.table])
            check_table_name(request.table, "table")  # a name no table can have: said so, and not echoed whole
            raise TableNotFoundError(f"table {request.table!r} does not exist")
        if sl.kind != kind:
            raise InvalidArgumentError(f"table: {request.table!r} is {_KIND_CALLS[sl.kind]}, not {_KIND_CALLS[kind]}")
        sl.check_request(request.layout_id)
        return sl

    @staticmethod
    def _bag_inputs(request: Any, region: Region | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
        ids = decode(request.ids, "ids", region)
        weights = decode(request.weights, "weights", region)
        offsets = decode(request.offsets, "offsets", region) if request.HasField("offsets") else None
        return ids, weights, offsets, check_bag(ids, weights, offsets)

    def _take_answer(self, name: str, request: Any, region: Region | None, call: Call) -> None:
        """Count the call's answer in the admission (Call.answer), or refuse it (OverloadedError)
        where it would pass max_inflight_bytes beside other calls (alone, it is admitted)."""
        if call.answer and self.regions.admission is not None:
            own = request.ByteSize() + (region.nbytes if region is not None else 0)  # (what the call took already)
            self.regions.admission.take(name, call.answer, own=own, what="this call's answer")

    def _give_answer(self, call: Call) -> None:
        if call.answer and self.regions.admission is not None:
            self.regions.admission.give_back(call.answer)

    @contextlib.contextmanager
    def _region(self, request: Any) -> Iterator[Region | None]:
        """The shared-memory region a call's tensors are in (None: inline), leased for the call."""
        region = self.regions.acquire(request)
        try:
            yield region
        finally:
            if region is not None:
                region.release()

    async def AttachRegion(self, request: pb.AttachRegionRequest,
                           context: grpc.aio.ServicerContext) -> AsyncIterator[pb.AttachRegionEvent]:
        async for event in serve_attach(self.regions, request, context):
            yield event

    # Plans: one per call of the service (PLANS, at the end of the class), each its checks (any
    # failure raises before anything changes) and the work that answers it.

    def _lookup(self, request: pb.LookupRequest, region: Region | None) -> Call:
        sl = self.slice(request)
        check_wire_dtype(request.wire_dtype)
        ids = decode(request.ids, "ids", region)
        check_1d(ids, "ids")
        nbytes = check_answer(ids.numel(), sl.table.dim, "ids")

        def work() -> Any:
            rows = sl.table.lookup(sl.local(ids), count=sl.counts_reads and not request.uncounted,
                                   admit=not request.uncounted)
            return answer(request, region, Lazy(pb.LookupResponse()).put("rows", rows, answer_dtype(rows, request.wire_dtype)))

        return Call(sl, work, ids.numel(), answer=nbytes)

    def _bag(self, request: pb.BagRequest, region: Region | None) -> Call:
        sl = self.slice(request)
        check_wire_dtype(request.wire_dtype)
        ids, weights, offsets, num_bags = self._bag_inputs(request, region)
        nbytes = check_answer(num_bags, sl.table.dim, "offsets" if offsets is not None else "ids")

        counts = sl.counts_reads and not request.uncounted
        # a large bag's read counters: after its answer (on the shard keeping them)
        later = counts and ids.numel() > INLINE_ENTRIES

        def work() -> Any:
            local = sl.local(ids)
            out = sl.table.bag(local, weights, offsets, count=counts and not later)
            if later:  # run before any later request's work: off the call's path
                self.pending.append((sl, lambda: _logged(sl.table.count_reads, local, weights)))
            return answer(request, region, Lazy(pb.BagResponse()).put("out", out, answer_dtype(out, request.wire_dtype)))

        return Call(sl, work, ids.numel(), answer=nbytes)

    # Each write is built in two halves: validation (on the event loop, before anything changes)
    # and a work() that applies it on the compute thread. Replaying the write-ahead log after a
    # restart runs the same work() on the logged request.

    def _bag_backward(self, sl: TableSlice, request: pb.BagBackwardRequest,
                      region: Region | None = None) -> tuple[Callable[[], pb.BagBackwardResponse], int]:
        ids, weights, offsets, num_bags = self._bag_inputs(request, region)
        grad_out = decode(request.grad_out, "grad_out", region)
        check_rows(grad_out, num_bags, sl.table.dim, "grad_out")
        if region is not None and sl.wal is not None:  # the log keeps the tensors, not where they were
            request = inline(request, ids=ids, weights=weights, offsets=offsets, grad_out=grad_out)
        client = request.tag.client_id or "anonymous"
        # A part of a step (gather), or a sync table's whole contribution in one request: the row
        # update waits for the step; dL/dw is computed now, on the values before the step.
        gathered = request.gather or sl.spec.sync_updates
        if gathered:  # before any work, nothing kept
            sl.check_part(request.step, request.tag, request.gather)

        def work() -> pb.BagBackwardResponse:
            sl.check_writable()
            local = sl.local(ids)
            # on the table's device once, for dL/dw and the kept entries alike (a GPU shard: one
            # host-to-device copy of each, where the step's commit would copy them again)
            w, g = sl.table.on_device((weights, torch.float32), (grad_out, torch.float32))

            def check() -> None:
                if not sl.replaying:  # each row's update (its entries summed) finite: a pass over the request's
                    check_row_sums(ids, grad_out, "grad_out", weights, offsets)  # entries, before any change
                if gathered:
                    sl.check_gather(request.step, client)

            def apply() -> pb.Tensor:
                if gathered:  # dL/dw on the values before the step (not computed if unused)
                    grad_w = None if request.no_weight_grad else sl.table.bag_grad(local, w, offsets, g)[0]
                    # kept until the commit: a copy where they may still be the request's bytes (on the
                    # CPU); a device's tensors are the shard's own already
                    owned = sl.table.device.type != "cpu"
                    sl.gather(request.step, client, request.tag.seq, bag_entries(local, w, offsets, g, copy=not owned))
                    if not request.gather:
                        self._update(sl, sl.commit(request.step, client), request.defer_apply)
                else:
                    grad_w, update = sl.table.bag_grad(local, w, offsets, g)
                    self._update(sl, update, request.defer_apply)
                return pb.Tensor() if request.no_weight_grad else encode(grad_w)

            # (a sync table's whole step: its commit takes the step's parts before the update runs)
            grad_w, dup = sl.once(request.tag, BAG_BACKWARD, request, apply, check, refusable=not gathered or request.gather)
            return sl.said_rebuilt(pb.BagBackwardResponse(grad_weights=grad_w, duplicate=dup))

        return work, ids.numel()

    def _update(self, sl: TableSlice, update: Callable[[], int | None] | None, defer: bool) -> int:
        """Run a row update now, or (defer) right after the answer, before any later request."""
        if update is None:
            return 0
        if defer:
            self.pending.append((sl, update))
            self.deferred += 1
            return 0
        return int(update() or 0)

    def _commit_step(self, sl: TableSlice, request: pb.CommitStepRequest) -> tuple[Callable[[], pb.WriteAck], int]:
        # `contributor`: the shard's own commit of an expired client's prepared step (log only)
        client = request.contributor or request.tag.client_id or "anonymous"
        seqs = list(request.part_seqs)
        if request.step < 1 and sl.spec.sync_updates and request.phase != pb.STEP_DROP_OPEN and not sl.replaying:
            raise InvalidArgumentError("step: a CommitStep of a sync_updates table closes the trainer's step (>= 1), "
                                       "got 0")  # (as its parts: check_part)

        def work() -> pb.WriteAck:
            sl.check_writable()
            checked: list[Callable[[], Callable[[], int] | None]] = []

            def check() -> None:
                checked.append(sl.step_phase(request.phase, request.step, client, seqs, request.parts, request.drop_step,
                                             presumed=bool(request.contributor)))

            def apply() -> int:  # once() ran check() first, also when replaying the log
                if request.phase == pb.STEP_DROP_OPEN:  # (steps dropped, contributions committed first): one
                    dropped, decided = checked[0]()()  # int, as a session remembers a write's answer
                    return dropped | decided << 32
                return self._update(sl, checked[0](), request.defer_apply)

            got, dup = sl.once(request.tag, COMMIT_STEP, request, apply, check)
            if request.phase == pb.STEP_DROP_OPEN:
                ack = sl.ack(got & 0xFFFFFFFF, dup)
                ack.decided = got >> 32
                return ack
            return sl.ack(got, dup)

        return work, 1

    def _push_gradients(self, sl: TableSlice, request: pb.PushGradientsRequest) -> tuple[Callable[[], pb.WriteAck], int]:
        ids, grads = decode(request.ids, "ids"), decode(request.grads, "grads")
        check_1d(ids, "ids")
        check_rows(grads, ids.shape[0], sl.table.dim, "grads")

        def work() -> pb.WriteAck:
            sl.check_writable()
            local = sl.local(ids)

            def check() -> None:  # a repeated id's rows summed (as the client's push sends them) finite too
                if not sl.replaying:  # (a push an older shard logged is replayed as it was then applied)
                    check_row_sums(ids, grads, "grads")

            rows, dup = sl.once(request.tag, PUSH_GRADIENTS, request, lambda: sl.table.push_gradients(local, grads), check,
                                refusable=True)
            return sl.ack(rows, dup)

        return work, ids.numel()

    def _write_rows(self, sl: TableSlice, request: pb.WriteRowsRequest) -> tuple[Callable[[], pb.WriteAck], int]:
        ids, rows = decode(request.ids, "ids"), decode(request.rows, "rows")
        check_1d(ids, "ids")
        check_rows(rows, ids.shape[0], sl.table.dim, "rows")

        def work() -> pb.WriteAck:
            sl.check_writable()
            if not sl.replaying:  # (a write an older shard logged is replayed as it was then applied)
                check_stored(rows, sl.table.dtype, sl.spec.name, "rows")
            local = sl.local(ids)
            if len(torch.unique(local)) != len(local):
                raise InvalidArgumentError("ids: write_rows needs distinct ids (which of two rows would win?)")

            n, dup = sl.once(request.tag, WRITE_ROWS, request, lambda: sl.table.write_rows(local, rows), refusable=True)
            return sl.ack(n, dup)

        return work, ids.numel()

    _WRITES: dict[int, tuple[type, str]] = {
        BAG_BACKWARD: (pb.BagBackwardRequest, "_bag_backward"),
        PUSH_GRADIENTS: (pb.PushGradientsRequest, "_push_gradients"),
        WRITE_ROWS: (pb.WriteRowsRequest, "_write_rows"),
        COMMIT_STEP: (pb.CommitStepRequest, "_commit_step"),
        ADD: (pb.AddRequest, "_add"),
        REMOVE: (pb.RemoveRequest, "_remove"),
        LOAD_PRODUCT_KEYS: (pb.LoadProductKeysRequest, "_load_product_keys"),
    }

    def replay(self, sl: TableSlice, kind: int, payload: bytes) -> None:
        """Re-apply one logged write (recovery; the slice has no log attached yet)."""
        cls, builder = self._WRITES[kind]
        sl.replaying = True  # (its builder's checks too: a write an older shard logged is replayed as accepted then)
        try:
            work, _ = getattr(self, builder)(sl, cls.FromString(payload))
            work()
            self._drain()
        finally:
            sl.replaying = False

    @staticmethod
    def _durable(sl: TableSlice) -> Future[None] | None:
        """Done once every write this slice logged so far is on disk (group commit): a write is
        acknowledged only then, when it would survive a crash (a replayed duplicate waits too).
        None: nothing to wait for (no log; a dropped slice's log is set to None: read once)."""
        wal = sl.wal
        return wal.durable(sl.last_lsn) if wal is not None and sl.last_lsn >= 0 else None

    def _write(self, request: Any, build: Callable[[TableSlice, Any], tuple[Callable[[], Any], int]],
               kind: int = pb.VALUE) -> Call:
        """A write: validated by its builder, applied by its work, answered once logged durably."""
        sl = self.slice(request, kind)
        work, n = build(sl, request)
        return Call(sl, work, n, write=True)

    def _drain_soon(self) -> None:
        """Deferred work (an update, read counters) queued: run it promptly even if no request follows."""
        if self.pending:
            task = asyncio.get_running_loop().create_task(self.run(lambda: None))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def _plan_bag_backward(self, request: pb.BagBackwardRequest, region: Region | None) -> Call:
        return self._write(request, lambda sl, r: self._bag_backward(sl, r, region))

    def _plan_push_gradients(self, request: pb.PushGradientsRequest, region: Region | None) -> Call:
        return self._write(request, self._push_gradients)

    def _plan_write_rows(self, request: pb.WriteRowsRequest, region: Region | None) -> Call:
        return self._write(request, self._write_rows)

    # -- index tables ----------------------------------------------------------------------

    def _add(self, sl: TableSlice, request: pb.AddRequest) -> tuple[Callable[[], pb.WriteAck], int]:
        ids, vectors = decode(request.ids, "ids"), decode(request.vectors, "vectors")
        payload = decode(request.payload, "payload") if request.HasField("payload") else None
        check_1d(ids, "ids")

        def work() -> pb.WriteAck:
            sl.check_writable()
            local = sl.local(ids)
            checked: list[Any] = []  # check_add's arrays, validated once before the log and reused
            n, dup = sl.once(request.tag, ADD, request, lambda: sl.table.add_checked(*checked[0]),
                             lambda: checked.append(sl.table.check_add(local, vectors, payload)))
            return sl.ack(n, dup)

        return work, ids.numel()

    def _remove(self, sl: TableSlice, request: pb.RemoveRequest) -> tuple[Callable[[], pb.WriteAck], int]:
        ids = decode(request.ids, "ids")
        check_1d(ids, "ids")

        def work() -> pb.WriteAck:
            sl.check_writable()
            local = sl.local(ids)
            n, dup = sl.once(request.tag, REMOVE, request, lambda: sl.table.remove(local))
            return sl.ack(n, dup)

        return work, ids.numel()

    def _plan_add(self, request: pb.AddRequest, region: Region | None) -> Call:
        return self._write(request, self._add, kind=pb.INDEX)

    def _plan_remove(self, request: pb.RemoveRequest, region: Region | None) -> Call:
        return self._write(request, self._remove, kind=pb.INDEX)

    def _search(self, request: pb.SearchRequest, region: Region | None) -> Call:
        sl = self.slice(request, pb.INDEX)
        queries = decode(request.queries, "queries", region)
        nprobe = request.nprobe if request.HasField("nprobe") else None
        ef_search = request.ef_search if request.HasField("ef_search") else None
        b = queries.shape[0] if queries.dim() else 1
        with_payload = request.return_payload and sl.table.payload_dim > 0
        # at most a row per hit: a float32 score, an int64 id (2 floats' worth) and, with the
        # payload, a distinct hit's id and payload row (each distinct hit once: U <= B * k)
        nbytes = check_answer(b * max(int(request.k), 0), 3 + (2 + sl.table.payload_dim if with_payload else 0), "k", b)

        def work() -> Any:
            if not with_payload:
                scores, ids, _ = sl.table.search(queries, int(request.k), nprobe=nprobe, ef_search=ef_search)
                return answer(request, region, Lazy(pb.SearchResponse()).put("scores", scores).put("ids", ids))
            scores, ids, payload_ids, payload = sl.table.search_distinct(queries, int(request.k), nprobe=nprobe,
                                                                         ef_search=ef_search)
            return answer(request, region, Lazy(pb.SearchResponse()).put("scores", scores).put("ids", ids)
                          .put("payload", payload).put("payload_ids", payload_ids))

        # Inline (on the event loop) only a search that is small whatever the kind: a few queries
        # over a slice a brute-force scan reads in about a millisecond.
        small = b <= 4 and b * sl.table.ntotal * sl.table.dim <= INLINE_SEARCH_WORK
        return Call(sl, work, 0 if small else INLINE_ENTRIES + 1, answer=nbytes)

    # -- product-key tables ----------------------------------------------------------------

    def _load_product_keys(self, sl: TableSlice, request: pb.LoadProductKeysRequest) -> tuple[Callable[[], pb.WriteAck], int]:
        def opt(msg: Any, field: str, what: str) -> torch.Tensor | None:
            return decode(getattr(msg, field), what) if msg.HasField(field) else None

        keys = decode(request.keys, "keys")
        weight, bias = opt(request, "query_weight", "query_weight"), opt(request, "query_bias", "query_bias")
        bn = None
        if request.HasField("bn"):
            bn = {k: decode(getattr(request.bn, k), f"bn.{k}") for k in ("running_mean", "running_var", "weight", "bias")}

        def work() -> pb.WriteAck:
            sl.check_writable()
            n, dup = sl.once(request.tag, LOAD_PRODUCT_KEYS, request,
                             lambda: sl.table.load(keys, weight, bias, bn, request.bn.eps),
                             lambda: sl.table.check_load(keys, weight, bias, bn, request.bn.eps))
            return sl.ack(n, dup)

        return work, INLINE_ENTRIES + 1

    def _plan_load_product_keys(self, request: pb.LoadProductKeysRequest, region: Region | None) -> Call:
        return self._write(request, self._load_product_keys, kind=pb.PRODUCT_KEYS)

    def _address(self, request: pb.AddressRequest, region: Region | None) -> Call:
        sl = self.slice(request, pb.PRODUCT_KEYS)
        queries = decode(request.queries, "queries")
        b = queries.shape[0] if queries.dim() else 1
        nbytes = check_answer(b, 3 * sl.table.heads * sl.table.knn, "queries")  # int64 ids and float32 weights per hit

        def work() -> pb.AddressResponse:
            ids, weights = sl.table.address(queries)
            return pb.AddressResponse(ids=encode(ids), weights=encode(weights))

        return Call(sl, work, b * sl.table.heads * sl.table.knn, answer=nbytes)

    def _plan_commit_step(self, request: pb.CommitStepRequest, region: Region | None) -> Call:
        if request.contributor:
            raise InvalidArgumentError("contributor: set only by a shard in its own log, never by a client")
        if request.phase != pb.STEP_DROP_OPEN and (not request.tag.client_id or request.tag.seq < 1):
            # (as its parts, TableSlice.check_part: an untagged commit counted as a trainer "anonymous",
            # so a sync table's step was applied without a trainer's acknowledged part: a hunt)
            raise InvalidArgumentError(f"tag: a CommitStep closes a trainer's step and needs its write tag with a "
                                       f"client_id and a seq >= 1 (the step counts each trainer by its client_id), got "
                                       f"client_id {shown(request.tag.client_id)}, seq {request.tag.seq}")
        return self._write(request, self._commit_step)

    def _slot_stats(self, request: pb.SlotStatsRequest, region: Region | None) -> Call:
        sl = self.slice(request)
        ids = decode(request.ids, "ids")
        check_1d(ids, "ids")
        nbytes = check_answer(ids.numel(), 10, "ids")  # five 8-byte statistics per id

        def work() -> pb.SlotStatsResponse:
            stats = sl.table.slot_stats(sl.local(ids))
            return pb.SlotStatsResponse(**{k: encode(v) for k, v in stats.items()})

        return Call(sl, work, ids.numel(), answer=nbytes)

    # -- inspection ------------------------------------------------------------------------

    def _record_triggers(self, request: pb.RecordTriggersRequest, region: Region | None) -> Call:
        sl = self.slice(request)
        ids, weights = decode(request.ids, "ids"), decode(request.weights, "weights")
        positions, contexts, nxt = (decode(getattr(request, f), f) for f in ("positions", "contexts", "next"))
        check_triggers(ids, weights, positions, contexts, nxt, request.info)
        sl.owns(ids)

        def work() -> pb.RecordTriggersResponse:
            heaps = sl.triggers
            if request.info:
                heaps.set_info(request.info, MAX_TRIGGER_INFO)
            heaps.add(ids.numpy(), weights.float().numpy(), positions.long().numpy(), contexts.numpy(), nxt.numpy())
            return pb.RecordTriggersResponse(slots=heaps.slots, dropped=heaps.dropped)

        return Call(sl, work, ids.numel() + contexts.numel())

    def _triggers(self, request: pb.TriggersRequest, region: Region | None) -> Call:
        sl = self.slice(request)
        ids = decode(request.ids, "ids")
        check_1d(ids, "ids")
        if ids.numel() > MAX_INSPECT_SLOTS:
            raise InvalidArgumentError(f"ids: at most {MAX_INSPECT_SLOTS} slots per call, got {ids.numel()}")
        sl.owns(ids)
        per_slot = sl.triggers.capacity * (8 + 4 * sl.triggers.context)  # its records' weights, contexts, next tokens

        def work() -> pb.TriggersResponse:
            w, ctx, nx = sl.triggers.get(ids.long().numpy())
            return pb.TriggersResponse(weights=encode(w), contexts=encode(ctx), next=encode(nx), info=sl.triggers.info)

        # (answered ~144 bytes per request byte: counted as the other large answers are, a review)
        return Call(sl, work, ids.numel(), answer=ids.numel() * per_slot)

    def _top_slots(self, request: pb.TopSlotsRequest, region: Region | None) -> Call:
        sl = self.slice(request)
        if not 1 <= request.n <= MAX_INSPECT_SLOTS:
            raise InvalidArgumentError(f"n: must be in [1, {MAX_INSPECT_SLOTS}], got {request.n}")
        stat = _SLOT_STATS.get(request.by or pb.HITS)
        if stat is None:
            raise InvalidArgumentError(f"by: unknown slot statistic {request.by}")

        best, table = TopN(int(request.n), request.coldest), sl.table

        def work() -> pb.TopSlotsResponse:
            ids = sl.layout.to_global(sl.info.index, best.rows)
            return pb.TopSlotsResponse(ids=encode(ids.astype(np.int64)), values=encode(best.values.astype(np.float64)))

        return Call(sl, work, INLINE_ENTRIES + 1,
                    scan=(_chunk(lambda s, e: best.add(s, table.stat(stat, s, e)), start, table.STAT_CHUNK)
                          for start in range(0, table.num_rows, table.STAT_CHUNK)))

    def _warm(self, request: pb.WarmRequest, region: Region | None) -> Call:
        sl = self.slice(request)
        ids = decode(request.ids, "ids", region)
        check_1d(ids, "ids")
        local = sl.local(ids)

        def work() -> pb.WarmResponse:
            return pb.WarmResponse(rows=sl.table.warm(local))

        return Call(sl, work, ids.numel())

    def _slot_usage(self, request: pb.SlotUsageRequest, region: Region | None) -> Call:
        sl = self.slice(request)

        table, fields = sl.table, ("hits", "weight_mass", "updates")
        hists = dict.fromkeys(fields, Histogram.empty())

        def add(start: int, stop: int) -> None:
            for f in fields:
                hists[f] = hists[f] + Histogram.of(table.stat(f, start, stop))

        def work() -> pb.SlotUsageResponse:
            return pb.SlotUsageResponse(**{
                f: pb.UsageHistogram(slots=h.slots, total=h.total, sum_xlogx=h.sum_xlogx, max=h.max,
                                     counts=encode(h.counts), sums=encode(h.sums))
                for f, h in hists.items()})

        return Call(sl, work, INLINE_ENTRIES + 1,
                    scan=(_chunk(add, start, table.STAT_CHUNK) for start in range(0, table.num_rows, table.STAT_CHUNK)))

    #: Every call of the service but AttachRegion: its plan. The gRPC methods below and the
    #: doorbell (memserver.server.doorbell) serve exactly these.
    PLANS: dict[str, Callable[[Any, Any, Region | None], Call]] = {
        "Lookup": _lookup, "Bag": _bag, "BagBackward": _plan_bag_backward, "PushGradients": _plan_push_gradients,
        "WriteRows": _plan_write_rows, "CommitStep": _plan_commit_step, "Add": _plan_add, "Remove": _plan_remove,
        "Search": _search, "SlotStats": _slot_stats, "LoadProductKeys": _plan_load_product_keys, "Address": _address,
        "RecordTriggers": _record_triggers, "Triggers": _triggers, "TopSlots": _top_slots, "SlotUsage": _slot_usage,
        "Warm": _warm,
    }


def _chunk(fn: Callable[[int, int], None], start: int, size: int) -> Callable[[], None]:
    """One chunk of a scan: fn over rows [start, start + size)."""
    return lambda: fn(start, start + size)


def _grpc_method(name: str) -> Callable[..., Any]:
    async def method(self: DataPlaneServicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._serve(name, request)

    method.__name__ = method.__qualname__ = name
    return method


for _name in DataPlaneServicer.PLANS:
    setattr(DataPlaneServicer, _name, _grpc_method(_name))

_SLOT_STATS = {pb.HITS: "hits", pb.WEIGHT_MASS: "weight_mass", pb.UPDATES: "updates", pb.VALUE_SQ_NORM: "value_sq_norm"}


def _nothing() -> None:
    """The work of a call to `_held` for its deferred work alone."""


def _logged(fn: Callable[..., object], *args: Any) -> None:
    """Deferred work that is not a write (read counters): a failure is logged, and the table
    keeps taking writes (`_drain` refuses them after a failed update)."""
    try:
        fn(*args)
    except Exception:
        log.exception("deferred %s failed", getattr(fn, "__name__", fn))
