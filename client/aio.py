"""The asyncio client: reads a table's shard map once, then calls its shards directly.

Per call it validates the input (so a write is rejected whole before any shard sees it),
routes ids to their shards, sends all shard requests at once, and reassembles the answers in
the caller's order. Every RPC carries a deadline. Reads are idempotent and writes carry a
(client_id, seq) tag the shards deduplicate, so every data-plane call is safe to retry: gRPC
retries UNAVAILABLE briefly itself (SERVICE_CONFIG), and the client keeps retrying, re-reading
the shard map, for up to `retry_seconds` while a shard or the coordinator restarts.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Generator
from typing import Any

import grpc
import torch

from client.errors import InvalidArgumentError, TableNotFoundError, UnavailableError, from_rpc_error
from memserver.cluster import read_endpoint
from memserver.routing import TableMeta, route_bags, route_ids, wire_ids
from memserver.table import aggregate
from memserver.v1 import memserver_pb2 as pb
from memserver.v1 import memserver_pb2_grpc as pb_grpc
from memserver.wire import (
    GRPC_OPTIONS,
    BadInput,
    as_tensor,
    check_bag,
    check_ids,
    check_rows,
    decode,
    dtype_code,
    encode,
    tune_malloc,
)

_READ_METHODS = [
    {"service": "memserver.v1.DataPlane"},  # reads are idempotent; writes carry (client_id, seq)
    {"service": "memserver.v1.ControlPlane", "method": "ListTables"},
    {"service": "memserver.v1.ControlPlane", "method": "GetShardMap"},
    {"service": "memserver.v1.ControlPlane", "method": "Status"},
]
SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": _READ_METHODS,
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.05s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)
CHANNEL_OPTIONS = [*GRPC_OPTIONS, ("grpc.service_config", SERVICE_CONFIG), ("grpc.enable_retries", 1)]
log = logging.getLogger(__name__)
#: A data-plane op (see AsyncMemoryClient._lookup_op): yields [(address, method, request)], gets the answers.
Op = Generator[list[tuple[str, str, Any]], list[Any], Any]
#: Requests and responses are kept below this size; larger batches are split.
MAX_REQUEST_BYTES = 64 * 1024 * 1024


def _like(t: torch.Tensor, ref: Any) -> Any:
    """Return `t` as the caller's kind: numpy in, numpy out; torch in, torch out on its device."""
    if isinstance(ref, torch.Tensor):
        return t.to(ref.device)
    return t.numpy()


def _ids(x: Any, meta: TableMeta, what: str = "ids") -> torch.Tensor:
    t = as_tensor(x)
    if t.dtype == torch.int32:
        t = t.long()
    check_ids(t, meta.num_rows, what)
    return t.cpu()


def _floats(x: Any, what: str) -> torch.Tensor:
    t = as_tensor(x)
    if not t.dtype.is_floating_point:
        raise BadInput(f"{what}: dtype must be floating point, got {str(t.dtype).removeprefix('torch.')}")
    return t.detach().cpu()


def _encoder(meta: TableMeta) -> Callable[..., pb.Tensor]:
    """encode() memoised by tensor identity: `cols` shards all get the same ids and weights, which
    are then converted and copied into bytes once per call, not once per shard."""
    seen: dict[tuple[int, bool, int | None], tuple[torch.Tensor, pb.Tensor]] = {}

    def enc(t: torch.Tensor, *, ids: bool = False, wire_dtype: int | None = None) -> pb.Tensor:
        key = (id(t), ids, wire_dtype)
        if key not in seen:  # the tensor is kept alive with its encoding, so its id stays unique
            seen[key] = (t, encode(wire_ids(t, meta) if ids else t, wire_dtype))
        return seen[key][1]

    return enc


def _chunks(n: int, bytes_per_item: int, limit: int) -> list[slice]:
    step = max(1, limit // max(1, bytes_per_item))
    return [slice(i, min(n, i + step)) for i in range(0, max(n, 1), step)]


class AsyncMemoryClient:
    """asyncio client of a memserver cluster.

    `endpoint` is the coordinator's HOST:PORT; by default it is read from the endpoint file
    that `memserver up` writes. `wire_dtype` ("float32", "float16", "bfloat16") is the dtype
    rows and gradients travel in; math on the shards is always float32.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout: float = 60.0,
        wire_dtype: str = "float32",
        client_id: str | None = None,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        retry_seconds: float = 60.0,
    ) -> None:
        """`retry_seconds`: how long a call keeps retrying while a shard or the coordinator is
        UNAVAILABLE (restarting) before it raises UnavailableError; 0 = do not retry."""
        tune_malloc()  # large calls build their messages in reused memory (see memserver.wire)
        self.endpoint = endpoint or read_endpoint()["endpoint"]
        self.timeout = timeout
        self.retry_seconds = retry_seconds
        self.wire_dtype = dtype_code(wire_dtype)
        self.client_id = client_id or uuid.uuid4().hex
        self.max_request_bytes = max_request_bytes
        self._seq = itertools.count(1)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._tables: dict[str, TableMeta] = {}

    # -- plumbing ------------------------------------------------------------------------

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        return ch

    async def _control(self, method: str, request: Any) -> Any:
        stub = pb_grpc.ControlPlaneStub(self._channel(self.endpoint))
        try:
            return await getattr(stub, method)(request, timeout=self.timeout)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err, f"coordinator {self.endpoint}") from None

    async def _read_control(self, method: str, request: Any) -> Any:
        """A read-only coordinator call, retried while the coordinator restarts."""
        return await self._retrying(lambda: self._control(method, request))

    async def _retrying(self, call: Callable[[], Awaitable[Any]], on_retry: Callable[[], Awaitable[None]] | None = None) -> Any:
        """call(), again with backoff while it fails with UNAVAILABLE, for up to retry_seconds."""
        deadline = time.monotonic() + self.retry_seconds
        delay = 0.1
        while True:
            try:
                return await call()
            except UnavailableError as exc:
                if time.monotonic() + delay > deadline:
                    raise
                log.warning("%s; retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 2.0)
                if on_retry is not None:
                    await on_retry()

    async def _data(self, address: str, method: str, request: Any) -> Any:
        stub = pb_grpc.DataPlaneStub(self._channel(address))
        try:
            return await getattr(stub, method)(request, timeout=self.timeout)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err, f"shard {address}") from None

    async def table(self, name: str, *, refresh: bool = False) -> TableMeta:
        """The table's metadata and shard map (cached; `refresh` asks the coordinator again)."""
        if refresh or name not in self._tables:
            info = await self._read_control("GetShardMap", pb.GetShardMapRequest(name=name))
            self._tables[name] = TableMeta.from_proto(info)
        return self._tables[name]

    async def _with_table(self, name: str, fn: Callable[[TableMeta], Awaitable[Any]]) -> Any:
        """Run fn(meta); if a shard no longer knows the table (dropped and re-created), refresh once;
        while a shard is UNAVAILABLE (restarting, maybe at a new address), retry with a fresh shard
        map. fn must be safe to run again: writes keep their tags across attempts.
        Input the client itself rejects raises the same InvalidArgumentError a shard would."""

        async def attempt() -> Any:
            try:
                return await fn(await self.table(name))
            except TableNotFoundError:
                if name not in self._tables:
                    raise
                del self._tables[name]
                return await fn(await self.table(name))

        async def refresh() -> None:
            try:  # the coordinator may be restarting too: then keep the map we have
                self._tables[name] = TableMeta.from_proto(
                    await self._control("GetShardMap", pb.GetShardMapRequest(name=name)))
            except UnavailableError:
                pass

        try:
            return await self._retrying(attempt, refresh)
        except BadInput as exc:
            raise InvalidArgumentError(f"INVALID_ARGUMENT: {exc}") from None

    async def _call(self, table: str, make_op: Callable[[TableMeta], Op]) -> Any:
        """Run the op for `table`'s shard map: its requests all at once over grpc.aio."""

        async def run(meta: TableMeta) -> Any:
            op = make_op(meta)
            calls = next(op)
            answers = await asyncio.gather(*(self._data(address, method, req) for address, method, req in calls))
            return finish(op, answers)

        return await self._with_table(table, run)

    def _tag(self, tags: dict[int, pb.WriteTag], part: int) -> pb.WriteTag:
        """The tag of part `part` of one call: the same on every attempt, so a retried part that a
        shard already applied is answered from its exactly-once window, not applied twice."""
        if part not in tags:
            tags[part] = pb.WriteTag(client_id=self.client_id, seq=next(self._seq))
        return tags[part]

    async def close(self) -> None:
        await asyncio.gather(*(ch.close() for ch in self._channels.values()))
        self._channels.clear()

    async def __aenter__(self) -> AsyncMemoryClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- control plane -------------------------------------------------------------------

    async def create_table(
        self,
        name: str,
        num_rows: int,
        dim: int,
        *,
        sharding: str | None = None,
        optimizer: str = "adagrad",
        lr: float = 0.01,
        dtype: str = "float32",
        init_std: float = 0.02,
        seed: int = 0,
        num_shards: int = 0,
        eps: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        sync_workers: int = 0,
        wal: bool = False,
    ) -> TableMeta:
        """Create a value table. `sharding` is "rows" or "cols" (None: the server's default).
        `sync_workers` > 0 makes it a sync_updates table for that many data-parallel trainers.
        `wal`: log every write before acknowledging it, so a restarted shard loses none (see
        docs/architecture.md for what it costs); without it a restart returns the table to its
        latest checkpoint."""
        shard_modes = {None: pb.SHARDING_UNSPECIFIED, "rows": pb.ROWS, "cols": pb.COLS}
        if sharding not in shard_modes:
            raise InvalidArgumentError(f"INVALID_ARGUMENT: sharding: expected 'rows' or 'cols', got {sharding!r}")
        try:
            dtype_value = dtype_code(dtype)
        except BadInput as exc:
            raise InvalidArgumentError(f"INVALID_ARGUMENT: {exc}") from None
        spec = pb.TableSpec(
            name=name,
            kind=pb.VALUE,
            num_rows=num_rows,
            dim=dim,
            sharding=shard_modes[sharding],
            optimizer=pb.OptimizerSpec(name=optimizer, lr=lr, eps=eps, beta1=betas[0], beta2=betas[1]),
            dtype=dtype_value,
            init_std=init_std,
            seed=seed,
            num_shards=num_shards,
            sync_updates=sync_workers > 0,
            sync_workers=sync_workers,
            wal=wal,
        )
        meta = TableMeta.from_proto(await self._control("CreateTable", pb.CreateTableRequest(spec=spec)))
        self._tables[name] = meta
        return meta

    async def drop_table(self, name: str) -> None:
        self._tables.pop(name, None)
        await self._control("DropTable", pb.DropTableRequest(name=name))

    async def list_tables(self) -> list[TableMeta]:
        resp = await self._read_control("ListTables", pb.ListTablesRequest())
        return [TableMeta.from_proto(t) for t in resp.tables]

    async def status(self) -> pb.StatusResponse:
        return await self._read_control("Status", pb.StatusRequest())

    async def checkpoint(self, dir: str, step: int = 0, tables: list[str] | None = None) -> dict[str, Any]:
        """Make every shard write its slices as of now (call it at a step barrier); returns
        {path, step, bytes, tables, seconds}."""
        r = await self._control("Checkpoint", pb.CheckpointRequest(dir=str(dir), step=step, tables=tables or []))
        return {"path": r.path, "step": r.step, "bytes": r.bytes, "tables": list(r.tables), "seconds": r.seconds}

    async def restore(self, dir: str, step: int = 0, *, replace: bool = False, num_shards: int = 0,
                      tables: list[str] | None = None) -> list[TableMeta]:
        """Load tables from a checkpoint (the latest complete one when step is 0), optionally
        into a different number of shards."""
        r = await self._control("Restore", pb.RestoreRequest(dir=str(dir), step=step, replace=replace,
                                                             num_shards=num_shards, tables=tables or []))
        metas = [TableMeta.from_proto(t) for t in r.tables]
        for m in metas:
            self._tables[m.name] = m
        return metas

    # -- data plane ----------------------------------------------------------------------

    async def lookup(self, table: str, ids: Any) -> Any:
        """Rows of `ids` (any shape) -> float32 array of shape ids.shape + (dim,)."""
        return _like(await self._call(table, lambda meta: self._lookup_op(meta, ids)), ids)

    # Each data-plane call is an op: a generator that validates and routes the input, yields the
    # shard requests [(address, method, request)], receives their answers in that order and
    # returns the assembled result. This client sends them with grpc.aio (`_call`); the blocking
    # MemoryClient sends the same requests with blocking stubs, without a hop to an event loop.

    def _lookup_op(self, meta: TableMeta, ids: Any) -> Op:
        t = _ids(ids, meta)
        uniq, inv = torch.unique(t.reshape(-1), return_inverse=True)
        rows = torch.empty((len(uniq), meta.dim), dtype=torch.float32)
        calls, places = [], []
        encoded: dict[int, tuple[torch.Tensor, list[tuple[slice, pb.Tensor]]]] = {}
        for sh, sel in route_ids(meta, uniq):
            if id(sel) not in encoded:  # cols: every shard gets the same ids; encode them once
                sub = uniq[sel]
                parts = _chunks(len(sub), meta.dim * 4 + 8, self.max_request_bytes)
                encoded[id(sel)] = (sel, [(p, encode(wire_ids(sub[p], meta))) for p in parts])
            for part, ids_msg in encoded[id(sel)][1]:
                req = pb.LookupRequest(table=meta.name, ids=ids_msg, wire_dtype=self.wire_dtype)
                calls.append((sh.address, "Lookup", req))
                places.append((sh, sel, part))
        for (sh, sel, part), resp in zip(places, (yield calls)):
            rows[sel[part], sh.col_start : sh.col_end] = decode(resp.rows, "rows").float()
        return rows[inv].view(*t.shape, meta.dim)

    async def bag(self, table: str, ids: Any, weights: Any, offsets: Any = None) -> Any:
        """Weighted bags: out[b] = sum_j weights[b, j] * v[ids[b, j]] -> [B, dim] float32.

        ids/weights are [B, k], or 1-D with `offsets` [B] marking where each bag starts.
        """
        return _like(await self._call(table, lambda meta: self._bag_op(meta, ids, weights, offsets)), weights)

    def _bag_op(self, meta: TableMeta, ids: Any, weights: Any, offsets: Any) -> Op:
        t_ids, w, off, num_bags = self._bag_args(meta, ids, weights, offsets)
        out = torch.zeros((num_bags, meta.dim), dtype=torch.float32)
        calls, places = [], []
        k = max(1, t_ids.shape[1] if off is None else -(-t_ids.shape[0] // max(1, num_bags)))
        for bags in _chunks(num_bags, max(k * 8, meta.dim * 4), self.max_request_bytes):
            b_ids, b_w, b_off = _slice_bags(t_ids, w, off, bags)
            enc = _encoder(meta)
            for sh, (s_ids, s_w, s_off) in route_bags(meta, b_ids, b_w, b_off):
                req = pb.BagRequest(table=meta.name, ids=enc(s_ids, ids=True), weights=enc(s_w), wire_dtype=self.wire_dtype)
                if s_off is not None:
                    req.offsets.CopyFrom(enc(s_off))
                calls.append((sh.address, "Bag", req))
                places.append((sh, bags))
        for (sh, bags), resp in zip(places, (yield calls)):
            got = decode(resp.out, "out").float()
            if meta.by_rows:
                out[bags] += got
            else:
                out[bags, sh.col_start : sh.col_end] = got
        return out

    async def bag_backward(
        self,
        table: str,
        ids: Any,
        weights: Any,
        grad_out: Any,
        offsets: Any = None,
        *,
        defer_apply: bool = False,
        step: int = 0,
    ) -> Any:
        """Backward of `bag`: returns dL/dweights (shape of ids) and makes the shards apply
        weights * grad_out to the rows through the table's optimizer (exactly once).

        `defer_apply`: the shards answer before applying the update (they apply it before serving
        anything else), so the caller overlaps it with its next step; see docs/architecture.md.
        `step`: the trainer's step, which sync_updates tables use to gather all trainers' pushes."""
        tags: dict[int, pb.WriteTag] = {}
        op = lambda meta: self._bag_backward_op(meta, ids, weights, grad_out, offsets, defer_apply, step, tags)  # noqa: E731
        return _like(await self._call(table, op), weights)

    def _bag_backward_op(self, meta: TableMeta, ids: Any, weights: Any, grad_out: Any, offsets: Any, defer_apply: bool,
                         step: int, tags: dict[int, pb.WriteTag]) -> Op:
        """`tags`: one per part, kept across attempts (see `_tag`)."""
        t_ids, w, off, num_bags = self._bag_args(meta, ids, weights, offsets)
        g = _floats(grad_out, "grad_out")
        check_rows(g, num_bags, meta.dim, "grad_out")
        grad_w = torch.zeros(t_ids.shape, dtype=torch.float32)
        flat_gw = grad_w.view(-1)
        calls, places = [], []
        k = max(1, t_ids.shape[1] if off is None else -(-t_ids.shape[0] // max(1, num_bags)))
        for part, bags in enumerate(_chunks(num_bags, k * 12 + meta.dim * 4, self.max_request_bytes)):
            b_ids, b_w, b_off = _slice_bags(t_ids, w, off, bags)
            b_g = g[bags]
            entries = _entry_range(t_ids, off, bags)
            tag = self._tag(tags, part)
            enc = _encoder(meta)
            for sh, (s_ids, s_w, s_off), mask in route_bags(meta, b_ids, b_w, b_off, with_mask=True):
                g_sh = b_g if meta.by_rows else b_g[:, sh.col_start : sh.col_end]
                req = pb.BagBackwardRequest(
                    table=meta.name,
                    ids=enc(s_ids, ids=True),
                    weights=enc(s_w),
                    grad_out=encode(g_sh, self.wire_dtype),
                    tag=tag,
                    defer_apply=defer_apply,
                    step=step,
                )
                if s_off is not None:
                    req.offsets.CopyFrom(enc(s_off))
                calls.append((sh.address, "BagBackward", req))
                places.append((entries, mask))
        for (entries, mask), resp in zip(places, (yield calls)):
            got = decode(resp.grad_weights, "grad_weights").reshape(-1)
            if mask is None:
                flat_gw[entries] += got  # COLS: each shard's dot product covers its columns
            else:
                flat_gw[entries][mask] = got  # ROWS: each entry lives on one shard
        return grad_w

    def _bag_args(
        self, meta: TableMeta, ids: Any, weights: Any, offsets: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
        t_ids = _ids(ids, meta)
        w = _floats(weights, "weights")
        off = None if offsets is None else as_tensor(offsets).cpu()
        return t_ids, w, off, check_bag(t_ids, w, off)

    async def push_gradients(self, table: str, ids: Any, grads: Any) -> int:
        """Apply row gradients through the table's optimizer; duplicate ids are summed first.
        Returns the number of distinct rows updated."""
        tags: dict[int, pb.WriteTag] = {}
        return await self._call(table, lambda meta: self._push_op(meta, ids, grads, tags))

    def _push_op(self, meta: TableMeta, ids: Any, grads: Any, tags: dict[int, pb.WriteTag]) -> Op:
        t = _ids(ids, meta)
        g = _floats(grads, "grads")
        if t.dim() != 1:
            raise BadInput(f"ids: must be 1-D, got shape {list(t.shape)}")
        check_rows(g, len(t), meta.dim, "grads")
        uniq, summed = aggregate(t, g)
        return (yield from self._write_op(meta, "PushGradients", uniq, summed, "grads", tags))

    async def write_rows(self, table: str, ids: Any, rows: Any) -> int:
        """Overwrite rows (optimizer state is kept). Ids must be distinct."""
        tags: dict[int, pb.WriteTag] = {}
        return await self._call(table, lambda meta: self._write_rows_op(meta, ids, rows, tags))

    def _write_rows_op(self, meta: TableMeta, ids: Any, rows: Any, tags: dict[int, pb.WriteTag]) -> Op:
        t = _ids(ids, meta)
        r = _floats(rows, "rows")
        if t.dim() != 1:
            raise BadInput(f"ids: must be 1-D, got shape {list(t.shape)}")
        check_rows(r, len(t), meta.dim, "rows")
        if len(torch.unique(t)) != len(t):
            raise BadInput("ids: write_rows needs distinct ids (which of two rows would win?)")
        return (yield from self._write_op(meta, "WriteRows", t, r, "rows", tags))

    def _write_op(self, meta: TableMeta, method: str, ids: torch.Tensor, values: torch.Tensor, field: str,
                  tags: dict[int, pb.WriteTag]) -> Op:
        req_cls = pb.PushGradientsRequest if method == "PushGradients" else pb.WriteRowsRequest
        calls = []
        for i, part in enumerate(_chunks(len(ids), meta.dim * 4 + 8, self.max_request_bytes)):
            p_ids, p_vals, tag = ids[part], values[part], self._tag(tags, i)
            for sh, sel in route_ids(meta, p_ids):
                v = p_vals[sel] if meta.by_rows else p_vals[:, sh.col_start : sh.col_end]
                req = req_cls(table=meta.name, ids=encode(wire_ids(p_ids[sel], meta)), tag=tag)
                getattr(req, field).CopyFrom(encode(v, self.wire_dtype if method == "PushGradients" else None))
                calls.append((sh.address, method, req))
        acks = yield calls
        return len(ids) if not acks else int(sum(a.rows for a in acks) // (1 if meta.by_rows else len(meta.shards)))

    async def slot_stats(self, table: str, ids: Any) -> dict[str, Any]:
        """Per-slot statistics: hits, weight_mass, updates, last_update (unix s), value_norm."""
        stats = await self._call(table, lambda meta: self._slot_stats_op(meta, ids))
        return {k: _like(v, ids) for k, v in stats.items()}

    def _slot_stats_op(self, meta: TableMeta, ids: Any) -> Op:
        t = _ids(ids, meta).reshape(-1)
        uniq, inv = torch.unique(t, return_inverse=True)
        n = len(uniq)
        out = {
            "hits": torch.zeros(n, dtype=torch.int64),
            "weight_mass": torch.zeros(n, dtype=torch.float64),
            "updates": torch.zeros(n, dtype=torch.int64),
            "last_update": torch.zeros(n, dtype=torch.float64),
            "value_sq_norm": torch.zeros(n, dtype=torch.float64),
        }
        routes = route_ids(meta, uniq)
        reqs = [(sh.address, "SlotStats", pb.SlotStatsRequest(table=meta.name, ids=encode(uniq[sel]))) for sh, sel in routes]
        for i, ((_, sel), resp) in enumerate(zip(routes, (yield reqs))):
            for key in out:
                got = decode(getattr(resp, key), key)
                if key == "value_sq_norm" and not meta.by_rows:
                    out[key] += got  # COLS: each shard holds part of the row
                elif meta.by_rows or i == 0:  # COLS: counters are identical on every shard
                    out[key][sel] = got
        norm = out.pop("value_sq_norm").sqrt()
        out["value_norm"] = norm
        return {k: v[inv] for k, v in out.items()}


def finish(op: Op, answers: list[Any]) -> Any:
    """Hand an op its answers and return its result (ops ask once)."""
    try:
        op.send(answers)
    except StopIteration as done:
        return done.value
    raise RuntimeError("a data-plane op asked for answers twice")


def _slice_bags(
    ids: torch.Tensor, w: torch.Tensor, off: torch.Tensor | None, bags: slice
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    if off is None:
        return ids[bags], w[bags], None
    start = int(off[bags.start]) if bags.start < len(off) else len(ids)
    stop = int(off[bags.stop]) if bags.stop < len(off) else len(ids)
    return ids[start:stop], w[start:stop], off[bags] - start


def _entry_range(ids: torch.Tensor, off: torch.Tensor | None, bags: slice) -> slice:
    """The flat entries that belong to a slice of bags."""
    if off is None:
        k = ids.shape[1]
        return slice(bags.start * k, bags.stop * k)
    start = int(off[bags.start]) if bags.start < len(off) else len(ids)
    stop = int(off[bags.stop]) if bags.stop < len(off) else len(ids)
    return slice(start, stop)
