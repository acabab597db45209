"""A shard: one Ray actor that holds a slice of every table and serves DataPlane over grpc.aio.

Requests are decoded on the actor's event loop (views of the payload bytes) and computed on one worker
thread per shard: table state is only ever touched by that thread, so a retried write's
exactly-once check and its application are atomic, and the loop keeps receiving while torch
works (torch releases the GIL).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import grpc
import torch

from memserver.checkpoint import load_into, save_slice
from memserver.grpc_util import NotFound, rpc, start_server
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

    @rpc
    async def BagBackward(
        self, request: pb.BagBackwardRequest, context: grpc.aio.ServicerContext
    ) -> pb.BagBackwardResponse:
        sl = self.slice(request.table)
        ids, weights, offsets, num_bags = self._bag_inputs(request)
        grad_out = decode(request.grad_out, "grad_out")
        check_rows(grad_out, num_bags, sl.table.dim, "grad_out")

        def work() -> pb.BagBackwardResponse:
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
                return encode(grad_w)

            grad_w, dup = sl.once(request.tag, apply)
            return pb.BagBackwardResponse(grad_weights=grad_w, duplicate=dup)

        response = await self.run(work, ids.numel())
        if self.pending:  # apply promptly even if no request follows (on the compute thread)
            task = asyncio.get_running_loop().create_task(self.run(lambda: None))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        return response

    @rpc
    async def PushGradients(self, request: pb.PushGradientsRequest, context: grpc.aio.ServicerContext) -> pb.WriteAck:
        sl = self.slice(request.table)
        ids, grads = decode(request.ids, "ids"), decode(request.grads, "grads")
        if ids.dim() != 1:
            raise BadInput(f"ids: must be 1-D, got shape {list(ids.shape)}")
        check_rows(grads, ids.shape[0], sl.table.dim, "grads")

        def work() -> pb.WriteAck:
            local = sl.local(ids)
            rows, dup = sl.once(request.tag, lambda: sl.table.push_gradients(local, grads))
            return pb.WriteAck(rows=rows, duplicate=dup)

        return await self.run(work, ids.numel())

    @rpc
    async def WriteRows(self, request: pb.WriteRowsRequest, context: grpc.aio.ServicerContext) -> pb.WriteAck:
        sl = self.slice(request.table)
        ids, rows = decode(request.ids, "ids"), decode(request.rows, "rows")
        if ids.dim() != 1:
            raise BadInput(f"ids: must be 1-D, got shape {list(ids.shape)}")
        check_rows(rows, ids.shape[0], sl.table.dim, "rows")

        def work() -> pb.WriteAck:
            local = sl.local(ids)
            if len(torch.unique(local)) != len(local):
                raise BadInput("ids: write_rows needs distinct ids (which of two rows would win?)")
            n, dup = sl.once(request.tag, lambda: sl.table.write_rows(local, rows))
            return pb.WriteAck(rows=n, duplicate=dup)

        return await self.run(work, ids.numel())

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
    """Ray actor body (wrapped with ray.remote by memserver.cluster)."""

    def __init__(self, index: int, threads: int = 1) -> None:
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s shard{index} %(levelname)s %(message)s")
        torch.set_num_threads(max(1, threads))
        try:
            import numba

            numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
        except ImportError:  # the torch path needs no numba
            pass
        self.index = index
        self.device = torch.device("cpu")
        if torch.cuda.is_available():
            import ray

            # Rows live on the GPU only when Ray gave this actor one (never start Ray from here).
            if not ray.is_initialized() or ray.get_gpu_ids():
                self.device = torch.device("cuda")
        self.servicer = DataPlaneServicer(self.device)
        self.server: grpc.aio.Server | None = None
        self.address = ""

    async def start(self, host: str | None = None) -> dict[str, Any]:
        """Start the gRPC server on this actor's loop; host None = 127.0.0.1."""
        host = host or "127.0.0.1"
        self.server, port = await start_server(
            lambda s: pb_grpc.add_DataPlaneServicer_to_server(self.servicer, s),
            [pb.DESCRIPTOR.services_by_name["DataPlane"].full_name],
            host,
        )
        self.address = f"{host}:{port}"
        log.info("shard %d serving DataPlane at %s on %s", self.index, self.address, self.device)
        return {"address": self.address, "pid": os.getpid(), "node_id": _node_id(), "device": str(self.device)}

    async def create_table(self, spec: bytes, info: bytes, num_shards: int) -> None:
        s, i = pb.TableSpec.FromString(spec), pb.ShardInfo.FromString(info)
        if s.name in self.servicer.tables:
            raise ValueError(f"table {s.name!r} already exists on shard {self.index}")
        sl = await self.servicer.run(lambda: TableSlice(s, i, num_shards, self.device))
        self.servicer.tables[s.name] = sl
        log.info("shard %d: table %s holds %d rows x %d cols", self.index, s.name, sl.table.num_rows, sl.table.dim)

    async def checkpoint_table(self, name: str, path: str) -> dict[str, Any]:
        """Write this shard's slice of `name` on the compute thread, i.e. after every write it
        has acknowledged (deferred updates included)."""
        sl = self.servicer.tables.get(name)
        if sl is None:
            raise NotFound(f"table {name!r} does not exist on shard {self.index}")

        def work() -> dict[str, Any]:
            meta = sl.slice_meta()
            return {"file": path, "bytes": save_slice(Path(path), meta, sl.table.state()), **meta}

        return await self.servicer.run(work)

    async def restore_table(self, spec: bytes, info: bytes, num_shards: int, files: list[dict[str, Any]]) -> None:
        """Create this shard's slice of a table from checkpoint files of any earlier sharding."""
        s, i = pb.TableSpec.FromString(spec), pb.ShardInfo.FromString(info)
        if s.name in self.servicer.tables:
            raise ValueError(f"table {s.name!r} already exists on shard {self.index}")

        def work() -> TableSlice:
            sl = TableSlice(s, i, num_shards, self.device, initialise=False)
            load_into(sl.table, sl.slice_meta(), files)
            return sl

        self.servicer.tables[s.name] = await self.servicer.run(work)
        log.info("shard %d: restored table %s from %d checkpoint files", self.index, s.name, len(files))

    async def drop_table(self, name: str) -> bool:
        return self.servicer.tables.pop(name, None) is not None

    async def status(self) -> bytes:
        st = pb.ShardStatus(
            address=self.address,
            node_id=_node_id(),
            pid=os.getpid(),
            device=str(self.device),
            requests=self.servicer.requests,
        )
        for name, sl in self.servicer.tables.items():
            st.tables.add(table=name, rows=sl.table.num_rows, bytes=sl.table.nbytes(), requests=sl.requests)
        return st.SerializeToString()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=1.0)


def _node_id() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_node_id() or ""
    except Exception:
        return ""
