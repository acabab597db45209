"""A shard: one Ray actor that holds a slice of every table and serves DataPlane over grpc.aio.

Requests are decoded on the actor's event loop (views of the payload bytes) and computed on one worker
thread per shard: table state is only ever touched by that thread, so a retried write's
exactly-once check and its application are atomic, and the loop keeps receiving while torch
works (torch releases the GIL).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import grpc
import torch

from memserver.checkpoint import load_into, save_slice
from memserver.durable import (
    BAG_BACKWARD,
    KEEP_CHECKPOINTS,
    PUSH_GRADIENTS,
    WRITE_ROWS,
    ShardStore,
    WriteAheadLog,
    latest_committed,
    read_log,
    repair_log,
    table_record,
)
from memserver.grpc_util import LoopThread, NotFound, rpc, serve_on
from memserver.metrics import ShardMetrics
from memserver.table import OptimizerConfig, ValueTable, bag_index
from memserver.v1 import memserver_pb2 as pb
from memserver.v1 import memserver_pb2_grpc as pb_grpc
from memserver.wire import (
    TORCH_DTYPES,
    BadInput,
    check_bag,
    check_ids,
    check_rows,
    decode,
    encode,
    tune_malloc,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Requests with at most this many ids run on the event loop when the compute thread is idle.
INLINE_ENTRIES = 2048
#: How many (client_id, seq) answers each table slice remembers for replayed writes.
DEDUP_WINDOW = 4096


def optimizer_config(spec: pb.OptimizerSpec) -> OptimizerConfig:
    return OptimizerConfig(
        name=spec.name or "adagrad",
        lr=spec.lr or 0.01,
        eps=spec.eps,
        beta1=spec.beta1 or 0.9,
        beta2=spec.beta2 or 0.999,
    )


class TableSlice:
    """The rows (ROWS) or columns (COLS) of one table that this shard owns."""

    def __init__(self, spec: pb.TableSpec, info: pb.ShardInfo, num_shards: int, device: torch.device,
                 initialise: bool = True):
        """`initialise` False leaves the values zero (a restore fills them)."""
        import numpy as np

        self.spec, self.info, self.num_shards = spec, info, num_shards
        self.by_rows = spec.sharding == pb.ROWS
        global_rows = np.arange(info.index if self.by_rows else 0, spec.num_rows, num_shards if self.by_rows else 1)
        self.table = ValueTable(
            len(global_rows),
            int(info.col_end - info.col_start),
            optimizer_config(spec.optimizer),
            dtype=TORCH_DTYPES[spec.dtype or pb.FLOAT32],
            device=device,
            init_std=spec.init_std if initialise else 0.0,
            seed=spec.seed,
            global_rows=global_rows,
            col_start=int(info.col_start),
            total_dim=int(spec.dim),
        )
        self.applied: OrderedDict[tuple[str, int], Any] = OrderedDict()
        self.requests = 0
        self.wal: WriteAheadLog | None = None  # set once the slice is live (not while replaying)
        self.last_lsn = -1  # the newest log record this slice appended
        self.recovered_from = ""
        # sync_updates: step -> {client_id: (ids, src_index, scale, src)} until all workers sent
        self.sync_steps: OrderedDict[int, dict[str, tuple[torch.Tensor, ...]]] = OrderedDict()

    def contribute(self, step: int, client_id: str, entries: tuple[torch.Tensor, ...]) -> bool:
        """Add one trainer's gradient entries to `step`; apply the mean once all have sent.
        Returns True when this contribution completed the step."""
        workers = self.spec.sync_workers
        got = self.sync_steps.setdefault(step, {})
        if client_id in got:
            raise BadInput(f"step {step}: trainer {client_id} already sent its gradients (sync tables take one "
                           "bag_backward per trainer per step)")
        got[client_id] = entries
        if len(got) < workers:
            if len(self.sync_steps) > 64:  # a trainer vanished: say so rather than grow forever
                old, parts = self.sync_steps.popitem(last=False)
                log.error("table %s: dropping incomplete sync step %d (%d of %d trainers sent)",
                          self.spec.name, old, len(parts), workers)
            return False
        del self.sync_steps[step]
        ids, src_index, scale, src = [], [], [], []
        rows = 0
        for c_ids, c_idx, c_scale, c_src in got.values():
            ids.append(c_ids)
            src_index.append(c_idx + rows)
            scale.append(c_scale / workers)
            src.append(c_src)
            rows += c_src.shape[0]
        self.table.apply_entries(torch.cat(ids), torch.cat(src_index), torch.cat(scale), torch.cat(src))
        return True

    def check_writable(self) -> None:
        """Refuse writes once the log failed: an update applied but not logged could not be
        acknowledged, and a retry would apply it twice."""
        if self.wal is not None and self.wal.failed is not None:
            raise RuntimeError(f"table {self.spec.name}: its write-ahead log failed ({self.wal.failed}); "
                               "writes are refused until the shard restarts")

    def log(self, kind: int, request: Any) -> None:
        """Append an applied write to the log (a no-op without one, and while replaying)."""
        if self.wal is not None:
            self.last_lsn = self.wal.append(kind, request.SerializeToString())

    def dedup_state(self) -> list[tuple[str, int, bytes | int]]:
        """The exactly-once window, for a checkpoint (answers as bytes or ints)."""
        return [(c, q, r.SerializeToString() if isinstance(r, pb.Tensor) else int(r)) for (c, q), r in self.applied.items()]

    def load_dedup(self, entries: list[tuple[str, int, bytes | int]]) -> None:
        self.applied = OrderedDict(
            ((c, q), pb.Tensor.FromString(r) if isinstance(r, bytes) else r) for c, q, r in entries
        )

    def slice_meta(self) -> dict[str, Any]:
        """Where this slice sits in its table (recorded in checkpoint files)."""
        return {"table": self.spec.name, "by_rows": self.by_rows, "index": self.info.index, "num_shards": self.num_shards,
                "num_rows": int(self.spec.num_rows), "col_start": int(self.info.col_start), "col_end": int(self.info.col_end)}

    def local(self, ids: torch.Tensor, what: str = "ids") -> torch.Tensor:
        """Global ids -> local rows, rejecting ids this shard does not own."""
        check_ids(ids, self.spec.num_rows, what)
        ids = ids.long().to(self.table.device)
        if not self.by_rows or self.num_shards == 1:
            return ids
        owner = ids % self.num_shards
        if ids.numel() and bool((owner != self.info.index).any()):
            bad = int(ids[owner != self.info.index][0])
            raise BadInput(f"{what}: id {bad} belongs to shard {bad % self.num_shards}, not {self.info.index}")
        return ids // self.num_shards

    def once(self, tag: pb.WriteTag, apply: Callable[[], T]) -> tuple[T, bool]:
        """Apply a write at most once per (client_id, seq); replay the first answer otherwise."""
        if not tag.client_id:
            return apply(), False
        key = (tag.client_id, tag.seq)
        if key in self.applied:
            return self.applied[key], True
        result = apply()
        self.applied[key] = result
        if len(self.applied) > DEDUP_WINDOW:
            self.applied.popitem(last=False)
        return result, False


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
        self.metrics: ShardMetrics | None = None  # set by the shard actor (see memserver.grpc_util.rpc)

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
            raise NotFound(f"table {name!r} does not exist")
        sl.requests += 1
        self.requests += 1
        return sl

    @staticmethod
    def _bag_inputs(request: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
        ids = decode(request.ids, "ids")
        weights = decode(request.weights, "weights")
        offsets = decode(request.offsets, "offsets") if request.HasField("offsets") else None
        return ids, weights, offsets, check_bag(ids, weights, offsets)

    @rpc
    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        sl = self.slice(request.table)
        ids = decode(request.ids, "ids")
        if ids.dim() != 1:
            raise BadInput(f"ids: must be 1-D, got shape {list(ids.shape)}")

        def work() -> pb.LookupResponse:
            return pb.LookupResponse(rows=encode(sl.table.lookup(sl.local(ids)), request.wire_dtype))

        return await self.run(work, ids.numel())

    @rpc
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
        if ids.dim() != 1:
            raise BadInput(f"ids: must be 1-D, got shape {list(ids.shape)}")
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
        if ids.dim() != 1:
            raise BadInput(f"ids: must be 1-D, got shape {list(ids.shape)}")
        check_rows(rows, ids.shape[0], sl.table.dim, "rows")

        def work() -> pb.WriteAck:
            sl.check_writable()
            local = sl.local(ids)
            if len(torch.unique(local)) != len(local):
                raise BadInput("ids: write_rows needs distinct ids (which of two rows would win?)")

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

    @rpc
    async def BagBackward(
        self, request: pb.BagBackwardRequest, context: grpc.aio.ServicerContext
    ) -> pb.BagBackwardResponse:
        sl = self.slice(request.table)
        work, n = self._bag_backward(sl, request)
        response = await self.run(work, n)
        if self.pending:  # apply promptly even if no request follows (on the compute thread)
            task = asyncio.get_running_loop().create_task(self.run(lambda: None))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        await self._acknowledge(sl)
        return response

    async def _apply_write(self, request: Any, build: Callable[[TableSlice, Any], tuple[Callable[[], T], int]]) -> T:
        sl = self.slice(request.table)
        work, n = build(sl, request)
        response = await self.run(work, n)
        await self._acknowledge(sl)
        return response

    @rpc
    async def PushGradients(self, request: pb.PushGradientsRequest, context: grpc.aio.ServicerContext) -> pb.WriteAck:
        return await self._apply_write(request, self._push_gradients)

    @rpc
    async def WriteRows(self, request: pb.WriteRowsRequest, context: grpc.aio.ServicerContext) -> pb.WriteAck:
        return await self._apply_write(request, self._write_rows)

    @rpc
    async def SlotStats(self, request: pb.SlotStatsRequest, context: grpc.aio.ServicerContext) -> pb.SlotStatsResponse:
        sl = self.slice(request.table)
        ids = decode(request.ids, "ids")
        if ids.dim() != 1:
            raise BadInput(f"ids: must be 1-D, got shape {list(ids.shape)}")

        def work() -> pb.SlotStatsResponse:
            stats = sl.table.slot_stats(sl.local(ids))
            return pb.SlotStatsResponse(**{k: encode(v) for k, v in stats.items()})

        return await self.run(work, ids.numel())


class ShardActor:
    """Ray actor body (wrapped with ray.remote by memserver.cluster): a threaded actor whose gRPC
    server runs on its own loop (see LoopThread).

    `__init__` recovers every table recorded under `data_dir` and starts serving, on the port it
    had before when it is a restart. A restarted shard (Ray re-creates it after its process died)
    then tells the coordinator named `coordinator` where it is now.
    """

    def __init__(self, index: int, threads: int = 1, host: str | None = None, data_dir: str | None = None,
                 coordinator: str | None = None) -> None:
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s shard{index} %(levelname)s %(message)s")
        tune_malloc()
        torch.set_num_threads(max(1, threads))
        try:
            import numba

            numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
        except ImportError:  # the torch path needs no numba
            pass
        import ray

        self.index = index
        self.device = shard_device()
        self.restarted = in_actor() and bool(ray.get_runtime_context().was_current_actor_reconstructed)
        self.servicer = DataPlaneServicer(self.device)
        self.store = ShardStore(data_dir, index) if data_dir else None
        self.loop = LoopThread(f"shard{index}-grpc")
        self.server: grpc.aio.Server | None = None
        self.address = ""
        t0 = time.perf_counter()
        recovered = self._recover() if self.store else []
        if recovered:
            log.info("shard %d: recovered %d table(s) in %.2fs: %s", index, len(recovered), time.perf_counter() - t0,
                     ", ".join(f"{r['table']} from {r['from']}" for r in recovered))
        self._serve(host)
        self.servicer.metrics = ShardMetrics(index, lambda: self.servicer.tables, self.restarted)
        self.servicer.metrics.serve(self.address.rsplit(":", 1)[0])
        if self.restarted and coordinator:
            log.warning("shard %d restarted (pid %d): serving again at %s, telling the coordinator", index,
                        os.getpid(), self.address)
            try:
                ray.get_actor(coordinator).shard_restarted.remote(index, self.info(), recovered)
            except ValueError:  # the coordinator is gone too; when it comes back it asks every shard
                log.warning("shard %d: coordinator %s not found; it will rebuild its catalog from the shards",
                            index, coordinator)

    # -- serving ---------------------------------------------------------------------------

    def _serve(self, host: str | None) -> None:
        from memserver.cluster import bind_host

        host = host or bind_host()
        self.server, bound = serve_on(
            self.loop,
            lambda s: pb_grpc.add_DataPlaneServicer_to_server(self.servicer, s),
            [pb.DESCRIPTOR.services_by_name["DataPlane"].full_name],
            host,
            state=self.store.dir / "shard.json" if self.store else None,
            what=f"shard {self.index}",
        )
        self.address = f"{host}:{bound}"
        log.info("shard %d serving DataPlane at %s on %s", self.index, self.address, self.device)

    def info(self) -> dict[str, Any]:
        return {"address": self.address, "pid": os.getpid(), "node_id": _node_id(), "device": str(self.device),
                "restarted": self.restarted, "metrics": self.servicer.metrics.address if self.servicer.metrics else ""}

    # -- recovery --------------------------------------------------------------------------

    def _recover(self) -> list[dict[str, Any]]:
        assert self.store is not None
        out = []
        for record in self.store.records():
            try:
                sl, how = self._load_slice(record, latest_committed(record), replay=True)
            except Exception:
                log.exception("shard %d: could not recover table %s; it stays unavailable", self.index, record.get("name"))
                continue
            self.servicer.tables[sl.spec.name] = sl
            out.append({"table": sl.spec.name, "from": how, "wal": bool(sl.spec.wal),
                        "checkpoint": (latest_committed(record) or {}).get("file", "")})
        return out

    def _load_slice(self, record: dict[str, Any], checkpoint: dict[str, Any] | None,
                    replay: bool) -> tuple[TableSlice, str]:
        """Build a slice from its record: the given checkpoint, else its restore files, else the
        seeded initial values; then (wal tables, `replay`) the log after that point."""
        spec = pb.TableSpec.FromString(base64.b64decode(record["spec"]))
        info = pb.ShardInfo.FromString(base64.b64decode(record["info"]))
        files = [checkpoint] if checkpoint else record.get("base_files") or []
        sl = TableSlice(spec, info, record["num_shards"], self.device, initialise=not files)
        start, how = 0, "initial values"
        extras: dict[str, Any] = {}
        if files:
            load_into(sl.table, sl.slice_meta(), files, extras)
            how = f"checkpoint step {checkpoint.get('step', 0)}" if checkpoint else "its restore files"
        if checkpoint:
            start = int(checkpoint.get("lsn", 0))
            sl.load_dedup(extras.get("dedup", []))
        if spec.wal and self.store is not None:
            wal_dir = self.store.table_dir(spec.name)
            end = repair_log(wal_dir) if replay else start
            replayed = 0
            if replay:
                for _, kind, payload in read_log(wal_dir, start):
                    self.servicer.replay(sl, kind, payload)
                    replayed += 1
                how += f" + {replayed} logged writes"
            sl.wal = WriteAheadLog(wal_dir, max(start, end))
        sl.recovered_from = how
        return sl, how

    # -- table management (called by the coordinator) ---------------------------------------

    def create_table(self, spec: bytes, info: bytes, num_shards: int) -> None:
        self._add_table(spec, info, num_shards, None)

    def restore_table(self, spec: bytes, info: bytes, num_shards: int, files: list[dict[str, Any]]) -> None:
        """Create this shard's slice of a table from checkpoint files of any earlier sharding."""
        self._add_table(spec, info, num_shards, files)

    def _add_table(self, spec: bytes, info: bytes, num_shards: int, files: list[dict[str, Any]] | None) -> None:
        s = pb.TableSpec.FromString(spec)
        if s.name in self.servicer.tables:
            raise ValueError(f"table {s.name!r} already exists on shard {self.index}")

        def work() -> TableSlice:
            record = table_record(spec, info, num_shards, files)
            if self.store is not None:
                self.store.drop(s.name)  # a stale log of a dropped namesake
                self.store.save(record)
            sl, _ = self._load_slice(record, None, replay=False)
            sl.recovered_from = ""
            return sl

        async def add() -> None:
            self.servicer.tables[s.name] = await self.servicer.run(work)

        self.loop.call(add())
        log.info("shard %d: %s table %s", self.index, "restored" if files else "created", s.name)

    def checkpoint_table(self, name: str, path: str, step: int = 0) -> dict[str, Any]:
        """Write this shard's slice of `name` on the compute thread, i.e. after every write it
        has acknowledged (deferred updates included), and remember it for recovery."""

        def work() -> dict[str, Any]:
            sl = self.servicer.tables.get(name)
            if sl is None:
                raise NotFound(f"table {name!r} does not exist on shard {self.index}")
            meta = sl.slice_meta()
            lsn = sl.wal.next_lsn if sl.wal is not None else 0
            nbytes = save_slice(Path(path), meta, sl.table.state(), extra={"dedup": sl.dedup_state(), "lsn": lsn})
            entry = {"file": path, "bytes": nbytes, **meta, "lsn": lsn, "step": step}
            if self.store is not None:
                record = self.store.record(name)
                if record is not None:
                    previous = latest_committed(record)
                    kept = [*record["checkpoints"], entry][-KEEP_CHECKPOINTS:]
                    if previous is not None and previous not in kept:  # the log after it is all we have
                        kept = [previous, *kept[1:]]
                    record["checkpoints"] = kept
                    self.store.save(record)
                    if sl.wal is not None:  # records before the previous complete checkpoint are no longer needed
                        sl.wal.rotate(previous["lsn"] if previous else None)
            return entry

        return self.loop.call(self.servicer.run(work))

    def rollback_table(self, name: str, checkpoint_dir: str) -> str:
        """Return a table without a log to the state a restarted sibling shard recovered: the
        slice of checkpoint `checkpoint_dir` ("" = its restore files or initial values).
        Acknowledged writes after that point are lost; that is what a table without `wal` means."""

        def work() -> str:
            sl = self.servicer.tables.get(name)
            if sl is None or self.store is None:
                raise NotFound(f"table {name!r} does not exist on shard {self.index}")
            record = self.store.record(name)
            if record is None:
                raise NotFound(f"table {name!r} has no record on shard {self.index}")
            match = [c for c in record["checkpoints"] if checkpoint_dir and Path(c["file"]).parent.parent == Path(checkpoint_dir)]
            new, how = self._load_slice(record, match[-1] if match else None, replay=False)
            new.requests = sl.requests
            new.recovered_from = f"rollback to {how}"
            self.servicer.tables[name] = new
            return how

        how = self.loop.call(self.servicer.run(work))
        log.warning("shard %d: table %s rolled back to %s with its restarted sibling", self.index, name, how)
        return how

    def describe_tables(self) -> list[tuple[bytes, bytes, int]]:
        """(spec, shard info, num_shards) of every slice held: a restarted coordinator's catalog."""

        async def describe() -> list[tuple[bytes, bytes, int]]:
            return [(sl.spec.SerializeToString(), sl.info.SerializeToString(), sl.num_shards)
                    for sl in self.servicer.tables.values()]

        return self.loop.call(describe())

    def drop_table(self, name: str) -> bool:
        async def drop() -> bool:
            sl = self.servicer.tables.pop(name, None)
            if sl is not None and sl.wal is not None:
                sl.wal.close()
            if self.store is not None:
                self.store.drop(name)
            return sl is not None

        return self.loop.call(drop())

    def status(self) -> bytes:
        async def status() -> bytes:
            st = pb.ShardStatus(address=self.address, node_id=_node_id(), pid=os.getpid(), device=str(self.device),
                                requests=self.servicer.requests, restarted=self.restarted,
                                metrics_address=self.servicer.metrics.address if self.servicer.metrics else "")
            for name, sl in self.servicer.tables.items():
                st.tables.add(table=name, rows=sl.table.num_rows, bytes=sl.table.nbytes(), requests=sl.requests,
                              wal_lsn=sl.wal.next_lsn if sl.wal else 0, recovered_from=sl.recovered_from)
            return st.SerializeToString()

        return self.loop.call(status())

    def stop(self) -> None:
        async def stop() -> None:
            if self.server is not None:
                await self.server.stop(grace=1.0)
            if self.servicer.metrics is not None:
                self.servicer.metrics.stop()
            for sl in self.servicer.tables.values():
                if sl.wal is not None:
                    sl.wal.close()
                    sl.wal = None

        self.loop.call(stop())


def shard_device() -> torch.device:
    """Rows live on the GPU only when Ray gave this actor one (never start Ray from here)."""
    import ray

    if torch.cuda.is_available() and (not ray.is_initialized() or ray.get_gpu_ids()):
        return torch.device("cuda")
    return torch.device("cpu")


def in_actor() -> bool:
    """Whether this code runs inside a Ray actor (not a driver, not a plain process)."""
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def _node_id() -> str:
    import ray

    return (ray.get_runtime_context().get_node_id() or "") if ray.is_initialized() else ""
