"""The ops of value tables: lookup, bag and its backward, push_gradients and write_rows (a training
step's commit is client.ops.steps; the slots' statistics client.ops.inspect)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from client.ops.base import Op, OpOptions, request_parts
from client.ops.checks import (
    UINT64,
    bag_args,
    check_ints,
    check_sent,
    checked_floats,
    checked_ids,
    ids_fit_int32,
    value_table,
)
from client.ops.routing import route_bags, route_ids
from client.ops.sessions import StepParts, WriteTags
from memserver.api.errors import FailedPreconditionError, InvalidArgumentError
from memserver.api.types import TableMeta
from memserver.api.v1 import memserver_pb2 as pb
from memserver.wire import (
    Lazy,
    check_1d,
    check_row_sums,
    check_rows,
    check_stored,
    check_sum,
    decode,
    encode,
    wire_tensor,
)


def wire_ids(ids: torch.Tensor, meta: TableMeta) -> torch.Tensor:
    """Ids travel as int32 when the table allows it: a third less request bytes for a bag."""
    return wire_tensor(ids, pb.INT32 if ids_fit_int32(meta.num_rows) else None)


def _encoder(meta: TableMeta) -> Callable[..., torch.Tensor]:
    """wire_tensor() memoised by tensor identity: cols shards all get the same ids and weights,
    which are then converted once per call, not once per shard."""
    seen: dict[tuple[int, bool, int | None], tuple[torch.Tensor, torch.Tensor]] = {}

    def enc(t: torch.Tensor, *, ids: bool = False, wire_dtype: int | None = None) -> torch.Tensor:
        key = (id(t), ids, wire_dtype)
        if key not in seen:  # the tensor is kept alive with its encoding, so its id stays unique
            seen[key] = (t, wire_ids(t, meta) if ids else wire_tensor(t, wire_dtype))
        return seen[key][1]

    return enc


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


def _entries_per_bag(ids_shape: tuple[int, ...], offsets: bool, num_bags: int) -> int:
    return max(1, ids_shape[1] if not offsets else -(-ids_shape[0] // max(1, num_bags)))


def _backward_pieces(k: int, num_bags: int, dim: int, opts: OpOptions) -> list[slice]:
    """bag_backward's requests (bags of `k` entries, each with its row of grad_out)."""
    return request_parts(num_bags, k * 12 + dim * 4, opts.max_request_bytes)


def _shape(x: Any) -> tuple[int, ...] | None:
    """x.shape, or a nested list's/tuple's (its first element's, O(depth)); None if neither."""
    if hasattr(x, "shape"):
        return tuple(x.shape)
    shape = []
    while isinstance(x, (list, tuple)):
        shape.append(len(x))
        if not x:
            break
        x = x[0]
    return tuple(shape) if shape else None


def backward_requests(ids: Any, offsets: Any, grad_out: Any, opts: OpOptions) -> int:
    """How many requests bag_backward_op sends for these arguments, from their shapes alone (no
    pass over them; nested lists by their first elements): the seqs a call sent without waiting
    takes ahead (WriteTags.reserve). A call whose shapes do not fit (refused by the op) counts 1."""
    i_shape, g_shape = _shape(ids), _shape(grad_out)
    if i_shape is None or g_shape is None or len(g_shape) != 2 or len(i_shape) != (1 if offsets is not None else 2):
        return 1
    num_bags, dim = g_shape
    return len(_backward_pieces(_entries_per_bag(tuple(i_shape), offsets is not None, num_bags), num_bags, dim, opts))


def lookup_op(meta: TableMeta, ids: Any, opts: OpOptions, count: bool = True) -> Op:
    """Rows of `ids` (any shape) -> float32 [*ids.shape, dim]; each distinct id is fetched once.
    `count` False: an inspection read, not counted in the slots' hits."""
    t = checked_ids(ids, meta)
    uniq, inv = torch.unique(t.reshape(-1), return_inverse=True)
    rows = torch.empty((len(uniq), meta.dim), dtype=torch.float32)
    calls, places = [], []
    encoded: dict[int, tuple[torch.Tensor, list[tuple[slice, Lazy]]]] = {}
    for sh, sel in route_ids(meta, uniq):
        if id(sel) not in encoded:  # cols: every shard gets the same request; build it once
            sub = uniq[sel]
            parts = request_parts(len(sub), meta.dim * 4 + 8, opts.max_request_bytes)
            encoded[id(sel)] = (sel, [(p, Lazy(pb.LookupRequest(table=meta.name, wire_dtype=opts.wire_dtype,
                                                                layout_id=meta.layout_id, uncounted=not count),
                                               {"ids": wire_ids(sub[p], meta)},
                                               answer_bytes=(p.stop - p.start) * meta.dim * 4))
                                       for p in parts])
        for part, req in encoded[id(sel)][1]:
            calls.append((sh.address, "Lookup", req))
            places.append((sh, sel, part))
    for (sh, sel, part), resp in zip(places, (yield calls)):
        rows[sel[part], sh.col_start : sh.col_end] = decode(resp.rows, "rows").float()
    return rows[inv].view(*t.shape, meta.dim)


def warm_op(meta: TableMeta, ids: Any, opts: OpOptions) -> Op:
    """A hint that `ids` (any shape) will be read soon: a disk table's shards hand the rows their
    caches do not hold to their read-ahead threads, which ask the kernel for the pages while the
    caller goes on (WarmRequest); a RAM table is sent nothing. Returns the rows handed on, summed
    over the shards (cols: every shard reads its own columns' file)."""
    value_table(meta, "warm")
    t = checked_ids(ids, meta).reshape(-1)
    if meta.tier != "disk" or not len(t):
        yield []
        return 0
    t = torch.unique(t)  # one request part per shard where it can: parts beyond a slice's two hints drop
    calls = []
    for sh, sel in route_ids(meta, t):
        sub = t[sel]
        for p in request_parts(len(sub), 8, opts.max_request_bytes):
            if p.stop > p.start:
                calls.append((sh.address, "Warm", Lazy(pb.WarmRequest(table=meta.name, layout_id=meta.layout_id),
                                                     {"ids": wire_ids(sub[p], meta)})))
    return sum(resp.rows for resp in (yield calls))


def _into(out: torch.Tensor, where: tuple[Any, ...], got: torch.Tensor, add: bool) -> None:
    """out[where] = got (or +=), with numpy when it can: one thread (see memserver.wire.check_ids)."""
    if got.dtype == out.dtype and out.device.type == "cpu":
        o, g = out.numpy(), got.numpy()
        if add:
            o[where] += g
        else:
            o[where] = g
    elif add:
        out[where] += got.to(out.dtype)
    else:
        out[where] = got.to(out.dtype)


def bag_op(meta: TableMeta, ids: Any, weights: Any, offsets: Any, opts: OpOptions, count: bool = True) -> Op:
    """out[b] = sum_j weights[b, j] * v[ids[b, j]] -> [B, dim] float32, computed on the shards.
    `count` False: not counted in the slots' statistics (as `lookup_op`'s)."""
    t_ids, w, off, num_bags = bag_args(meta, ids, weights, offsets)
    # cols: every shard fills its columns of every bag (an error fails the call), nothing to zero
    out = (torch.zeros if meta.by_rows else torch.empty)((num_bags, meta.dim), dtype=torch.float32)
    calls, places = [], []
    k = _entries_per_bag(t_ids.shape, off is not None, num_bags)
    itemsize = 2 if opts.wire_dtype in (pb.FLOAT16, pb.BFLOAT16) else 4
    for bags in request_parts(num_bags, max(k * 8, meta.dim * 4), opts.max_request_bytes):
        b_ids, b_w, b_off = _slice_bags(t_ids, w, off, bags)
        enc = _encoder(meta)
        shared: Lazy | None = None
        for sh, (s_ids, s_w, s_off) in route_bags(meta, b_ids, b_w, b_off):
            if shared is None or meta.by_rows:  # cols: one request for every shard
                req = Lazy(pb.BagRequest(table=meta.name, wire_dtype=opts.wire_dtype, layout_id=meta.layout_id,
                                         uncounted=not count),
                           {"ids": enc(s_ids, ids=True), "weights": enc(s_w)},
                           answer_bytes=(bags.stop - bags.start) * (sh.col_end - sh.col_start) * itemsize)
                if s_off is not None:
                    req.tensors["offsets"] = enc(s_off)
                shared = req
            calls.append((sh.address, "Bag", shared))
            places.append((sh, bags))
    for (sh, bags), resp in zip(places, (yield calls)):
        got = decode(resp.out, "out")
        if meta.by_rows:
            _into(out, (bags,), got, add=True)  # rows: each shard's partial sum over the entries it owns
        else:
            _into(out, (bags, slice(sh.col_start, sh.col_end)), got, add=False)
    return out


def bag_backward_op(meta: TableMeta, ids: Any, weights: Any, grad_out: Any, offsets: Any, opts: OpOptions,
                    tags: WriteTags, defer_apply: bool = False, step: int = 0, parts: StepParts | None = None,
                    weight_grad: bool = True, layout: int = 0) -> Op:
    """dL/dweights (shape of ids); the shards apply weights * grad_out to the rows (exactly once).
    `weight_grad` False: the shards skip dL/dweights and the op returns None. `layout` (not 0): the
    incarnation of the table (TableMeta.layout_id) the caller trains; one made anew since is
    refused before a request goes to it (the client's retry would otherwise follow the name there).

    `parts` given: each request is a `gather` part of `step` (the update waits for commit_step_plan),
    and `parts` records, per shard index, the seqs of the parts this call delivered: only once
    every shard answered (a call that fails for good lists none; shards that stored a part of it
    drop it when the step is prepared)."""
    check_ints(UINT64, step=step)
    if layout and meta.layout_id != layout:
        raise FailedPreconditionError(f"table {meta.name} was made anew (incarnation {meta.layout_id}) since the caller "
                                      f"began training incarnation {layout}: this update is not sent to it")
    value_table(meta, "bag_backward")  # (before its shapes: a product-key table's width is not a value table's)
    t_ids, w, off, num_bags = bag_args(meta, ids, weights, offsets)
    g = checked_floats(grad_out, "grad_out")
    check_rows(g, num_bags, meta.dim, "grad_out")
    check_sent(g, opts.wire_dtype, "grad_out")
    grad_w = torch.zeros(t_ids.shape if weight_grad else (0,), dtype=torch.float32)
    flat_gw = grad_w.view(-1)
    calls, places = [], []
    pieces = _backward_pieces(_entries_per_bag(t_ids.shape, off is not None, num_bags), num_bags, meta.dim, opts)
    if len(pieces) > 1 and parts is None and meta.sync_workers:  # (its first request was taken as the whole)
        raise InvalidArgumentError(
            f"bag_backward: on sync_updates table {meta.name} a call is this trainer's whole contribution to step "
            f"{step} and goes in one request, and this one needs {len(pieces)} of at most max_request_bytes="
            f"{opts.max_request_bytes}: send it as gather parts (gather=True, then commit_step({step})), or raise "
            "the client's max_request_bytes")
    for part, bags in enumerate(pieces):
        b_ids, b_w, b_off = _slice_bags(t_ids, w, off, bags)
        b_g = g[bags]
        # as each shard sums it: per request (each its own step), the values as they travel
        check_row_sums(b_ids, wire_tensor(b_g, opts.wire_dtype, keep_device=True), "grad_out", b_w, b_off)
        entries = _entry_range(t_ids, off, bags)
        enc = _encoder(meta)
        # a whole call (not a part of a step gathered for commit_step) reaches every shard: on a
        # sync table it is this trainer's whole contribution to `step` there, empty or not
        for sh, (s_ids, s_w, s_off), mask in route_bags(meta, b_ids, b_w, b_off, with_mask=True,
                                                        every_shard=parts is None):
            g_sh = b_g if meta.by_rows else b_g[:, sh.col_start : sh.col_end]
            tag = tags(part, meta, sh)
            req = Lazy(pb.BagBackwardRequest(table=meta.name, tag=tag, defer_apply=defer_apply,
                                             step=step, layout_id=meta.layout_id, gather=parts is not None,
                                             no_weight_grad=not weight_grad),
                       {"ids": enc(s_ids, ids=True), "weights": enc(s_w), "grad_out": wire_tensor(g_sh, opts.wire_dtype)})
            # no answer space: dL/dw comes back inline (the session keeps it for a retry's answer)
            if s_off is not None:
                req.tensors["offsets"] = enc(s_off)
            calls.append((sh.address, "BagBackward", req))
            places.append((sh, entries, mask, tag.seq))
    answers = yield calls
    call = min(tags.seqs.values(), default=0)  # (this call's first request: the parts are of one call)
    for (sh, entries, mask, seq), resp in zip(places, answers):
        if parts is not None:
            parts.add(sh.index, seq, meta.layout_id, call)
        if not weight_grad:
            continue
        got = decode(resp.grad_weights, "grad_weights").reshape(-1)
        if mask is None:
            _into(flat_gw, (entries,), got, add=True)  # cols: each shard's dot product covers its columns
        else:
            flat_gw[entries][mask] = got  # rows: each entry lives on one shard
    return grad_w if weight_grad else None


def push_op(meta: TableMeta, ids: Any, grads: Any, opts: OpOptions, tags: WriteTags) -> Op:
    """Row gradients through the table's optimizer; duplicate ids summed here first. Returns the
    number of distinct rows updated."""
    value_table(meta, "push_gradients")
    t = checked_ids(ids, meta)
    g = checked_floats(grads, "grads")
    check_1d(t, "ids")
    check_rows(g, len(t), meta.dim, "grads")
    uniq, summed = aggregate(t, g)
    check_sum(uniq, summed, "grads")
    check_sent(summed, opts.wire_dtype, "grads")
    return (yield from _write_op(meta, "PushGradients", uniq, summed, opts, tags))


def write_rows_op(meta: TableMeta, ids: Any, rows: Any, opts: OpOptions, tags: WriteTags) -> Op:
    """Overwrite rows (optimizer state is kept). Ids must be distinct."""
    value_table(meta, "write_rows")
    t = checked_ids(ids, meta)
    r = checked_floats(rows, "rows")
    check_1d(t, "ids")
    check_rows(r, len(t), meta.dim, "rows")
    check_stored(r, meta.dtype, meta.name, "rows")
    if len(torch.unique(t)) != len(t):
        raise InvalidArgumentError("ids: write_rows needs distinct ids (which of two rows would win?)")
    return (yield from _write_op(meta, "WriteRows", t, r, opts, tags))


def _write_op(meta: TableMeta, method: str, ids: torch.Tensor, values: torch.Tensor, opts: OpOptions,
              tags: WriteTags) -> Op:
    push = method == "PushGradients"
    calls = []
    for i, part in enumerate(request_parts(len(ids), meta.dim * 4 + 8, opts.max_request_bytes)):
        p_ids, p_vals = ids[part], values[part]
        for sh, sel in route_ids(meta, p_ids):
            v = p_vals[sel] if meta.by_rows else p_vals[:, sh.col_start : sh.col_end]
            v_msg = encode(v, opts.wire_dtype if push else None)  # rows written travel exactly
            ids_msg = encode(wire_ids(p_ids[sel], meta))
            tag = tags(i, meta, sh)
            req = (pb.PushGradientsRequest(table=meta.name, ids=ids_msg, grads=v_msg, tag=tag, layout_id=meta.layout_id)
                   if push else
                   pb.WriteRowsRequest(table=meta.name, ids=ids_msg, rows=v_msg, tag=tag, layout_id=meta.layout_id))
            calls.append((sh.address, method, req))
    acks = yield calls
    return len(ids) if not acks else int(sum(a.rows for a in acks) // (1 if meta.by_rows else len(meta.shards)))


def aggregate(ids: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum rows that share an id: (unique ids, summed float32 rows). A push sends each row once."""
    uniq, inv = torch.unique(ids, return_inverse=True)
    if len(uniq) == len(ids):
        order = torch.empty_like(inv)
        order[inv] = torch.arange(len(inv), device=inv.device)
        return uniq, rows[order].float()
    out = torch.zeros((len(uniq), rows.shape[1]), dtype=torch.float32, device=rows.device)
    out.index_add_(0, inv, rows.float())
    return uniq, out
