"""The ops that read how a value table's slots are used: per-slot statistics, trigger records,
the hottest (coldest) slots and the usage histograms."""

from __future__ import annotations

from typing import Any

import torch

from client.ops.base import Op, OpOptions, Plan, meta_op, request_parts
from client.ops.checks import INT32, check_ints, checked_floats, checked_ids, value_table
from client.ops.routing import route_ids, route_owned
from memserver.api.errors import InvalidArgumentError
from memserver.api.types import MAX_INSPECT_SLOTS, ShardMeta, TableMeta
from memserver.api.usage import Histogram
from memserver.api.v1 import memserver_pb2 as pb
from memserver.wire import as_tensor, check_float, check_triggers, decode, encode

#: `top_slots`' statistics as users name them, and the proto's.
SLOT_STATS = {"hits": pb.HITS, "mass": pb.WEIGHT_MASS, "updates": pb.UPDATES, "norm": pb.VALUE_SQ_NORM}


def slot_stats_op(meta: TableMeta, ids: Any) -> Op:
    """Per-slot statistics: hits, weight_mass, updates, last_update (unix s), value_norm, each
    of the ids' shape (as lookup keeps it; they came back flat)."""
    given = checked_ids(ids, meta)
    t = given.reshape(-1)
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
    reqs = [(sh.address, "SlotStats", pb.SlotStatsRequest(table=meta.name, ids=encode(uniq[sel]), layout_id=meta.layout_id))
            for sh, sel in routes]
    for (sh, sel), resp in zip(routes, (yield reqs)):
        for key in out:
            got = decode(getattr(resp, key), key)
            if key == "value_sq_norm" and not meta.by_rows:
                out[key] += got  # cols: each shard holds part of the row
            elif meta.layout.counts_reads(sh.index):  # cols: shard 0 keeps the counters
                out[key][sel] = got
    norm = out.pop("value_sq_norm").sqrt()
    out["value_norm"] = norm
    return {k: v[inv].reshape(given.shape) for k, v in out.items()}


def record_triggers_op(meta: TableMeta, ids: Any, weights: Any, positions: Any, contexts: Any, nxt: Any,
                       info: str, opts: OpOptions) -> Op:
    """Send trigger records (memserver.core.triggers) to the shards keeping the slots' records:
    record i read slot ids[i] with weights[i] at the position whose context is
    contexts[positions[i]] (int32 [P, L], -1 padded) and next token nxt[positions[i]]. Returns
    {"slots": slots holding records, "dropped": records refused by the bound, summed over shards}."""
    value_table(meta, "record_triggers")
    t = checked_ids(ids, meta).reshape(-1)
    w = checked_floats(weights, "weights").reshape(-1)
    check_float(w, "weights")  # (before the conversion: a float64 beyond float32's range is said as that)
    w = w.float()
    pos = as_tensor(positions).long().reshape(-1)
    ctx, nx = as_tensor(contexts), as_tensor(nxt)
    check_triggers(t, w, pos, ctx, nx, info)
    ctx, nx = ctx.int(), nx.int()
    per_record = 16 + 4 * (ctx.shape[1] + 1)
    calls = []
    for sh, sel in route_owned(meta, t):
        for part in request_parts(len(sel), per_record, opts.max_request_bytes):
            mine = sel[part]
            used, local = torch.unique(pos[mine], return_inverse=True)  # only the contexts these records read
            calls.append((sh.address, "RecordTriggers", pb.RecordTriggersRequest(
                table=meta.name, ids=encode(t[mine]), weights=encode(w[mine]), positions=encode(local.int()),
                contexts=encode(ctx[used]), next=encode(nx[used]), info=info, layout_id=meta.layout_id)))
    if info:  # every shard keeps the table's info, records or not
        have = {a for a, _, _ in calls}
        empty = torch.zeros(0, dtype=torch.int64)
        for sh in meta.shards:
            if sh.address not in have:
                calls.append((sh.address, "RecordTriggers", pb.RecordTriggersRequest(
                    table=meta.name, ids=encode(empty), weights=encode(empty.float()), positions=encode(empty.int()),
                    contexts=encode(torch.zeros((0, ctx.shape[1]), dtype=torch.int32)),
                    next=encode(torch.zeros(0, dtype=torch.int32)), info=info, layout_id=meta.layout_id)))
    answers = yield calls
    most: dict[str, tuple[int, int]] = {}
    for (address, _, _), a in zip(calls, answers):  # a shard's parts may run in any order: its largest counts
        was = most.get(address, (0, 0))
        most[address] = (max(was[0], a.slots), max(was[1], a.dropped))
    return {"slots": sum(x[0] for x in most.values()), "dropped": sum(x[1] for x in most.values())}


def triggers_op(meta: TableMeta, ids: Any) -> Op:
    """The slots' trigger records: {"weights": [n, C] descending (0 = none), "contexts": [n, C, L],
    "next": [n, C], "info": the table's trace info as a dict ({} = never traced)}."""
    import json

    value_table(meta, "triggers")
    t = checked_ids(ids, meta).reshape(-1)
    if len(t) > MAX_INSPECT_SLOTS:
        raise InvalidArgumentError(f"ids: at most {MAX_INSPECT_SLOTS} slots per call, got {len(t)}")
    routes = route_owned(meta, t)
    calls = [(sh.address, "Triggers", pb.TriggersRequest(table=meta.name, ids=encode(t[sel]), layout_id=meta.layout_id))
             for sh, sel in routes]
    answers = yield calls
    out: dict[str, Any] = {"weights": None, "contexts": None, "next": None, "info": {}}
    for (_, sel), a in zip(routes, answers):
        got = {k: decode(getattr(a, k), k) for k in ("weights", "contexts", "next")}
        for k, v in got.items():
            if out[k] is None:
                out[k] = torch.full((len(t), *v.shape[1:]), 0 if k == "weights" else -1, dtype=v.dtype)
            out[k][sel] = v
        if a.info and not out["info"]:
            out["info"] = json.loads(a.info)
    if out["weights"] is None:  # no ids
        out.update(weights=torch.zeros((0, 0)), contexts=torch.zeros((0, 0, 0), dtype=torch.int32),
                   next=torch.zeros((0, 0), dtype=torch.int32))
    return out


def _top_round_op(meta: TableMeta, stat: int, n: int, coldest: bool, shards: list[ShardMeta]) -> Op:
    req = pb.TopSlotsRequest(table=meta.name, by=stat, n=n, coldest=coldest, layout_id=meta.layout_id)
    answers = yield [(sh.address, "TopSlots", req) for sh in shards]
    return [(decode(a.ids, "ids"), decode(a.values, "values")) for a in answers]


def _best(ids: torch.Tensor, values: torch.Tensor, n: int, coldest: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The n best (ids, values), best first, ties by the smaller id."""
    import numpy as np

    key = values.numpy() if coldest else -values.numpy()
    order = torch.from_numpy(np.lexsort((ids.numpy(), key))[:n])
    return ids[order], values[order]


def top_slots_plan(by: str, n: int, coldest: bool) -> Plan:
    """The n hottest (coldest) slots by hits, mass (summed read weight), updates or norm (of the
    value): (ids int64 [n], values float64 [n]), best first, ties by the smaller id.

    Each shard ranks its own rows; the client merges. On COLS tables shard 0 keeps the counters
    (`ShardLayout.counts_reads`: it answers), while a norm is split over the column blocks: the client then
    runs Fagin's threshold algorithm: each shard's top m partial norms, the candidates' exact norms
    (SlotStats), and the answer is exact once the n-th candidate is at least as good as the sum of
    the shards' m-th partials (no unseen row can be better; one with an equal norm may have a
    smaller id); else m grows x4, and past what one call ranks, every row's norm is read
    (`_scan_norms`)."""
    check_ints(INT32, n=n)
    if by not in SLOT_STATS:
        raise InvalidArgumentError(f"by: one of {', '.join(SLOT_STATS)}, got {by!r}")
    if not 1 <= n <= MAX_INSPECT_SLOTS:
        raise InvalidArgumentError(f"n: must be in [1, {MAX_INSPECT_SLOTS}], got {n}")
    meta: TableMeta = yield lambda m: meta_op(m)
    value_table(meta, "top_slots")
    stat = SLOT_STATS[by]
    if meta.layout.by_rows or len(meta.shards) == 1 or by != "norm":
        shards = [sh for sh in meta.shards if meta.layout.counts_reads(sh.index)]
        got = yield lambda m: _top_round_op(m, stat, n, coldest, shards)
        ids, values = _best(torch.cat([g[0] for g in got]), torch.cat([g[1] for g in got]), n, coldest)
        return ids, values.sqrt() if by == "norm" else values
    m = n
    while True:
        got = yield lambda mt, m=m: _top_round_op(mt, stat, m, coldest, mt.shards)
        cand = torch.unique(torch.cat([g[0] for g in got]))
        stats = yield lambda mt, cand=cand: slot_stats_op(mt, cand)
        exact = stats["value_norm"].double() ** 2
        ids, values = _best(cand, exact, n, coldest)
        complete = all(len(g[0]) < m for g in got) or m >= meta.num_rows
        bound = sum(float(g[1][-1]) for g in got if len(g[1]))  # unseen rows: total <= bound (coldest: >=)
        if complete or (len(values) == n and (float(values[-1]) >= bound if not coldest else float(values[-1]) <= bound)):
            return ids, values.sqrt()
        if m >= MAX_INSPECT_SLOTS:  # the most one call ranks, still undecided: every row's norm, in chunks
            return (yield from _scan_norms(meta.num_rows, n, coldest))
        m = min(4 * m, meta.num_rows, MAX_INSPECT_SLOTS)


def _scan_norms(num_rows: int, n: int, coldest: bool) -> Plan:
    """Exact top n norms by reading every row's (SlotStats of MAX_INSPECT_SLOTS rows at a time):
    O(rows) work, O(n + chunk) memory; the threshold algorithm's fallback."""
    ids, values = torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.float64)
    for s in range(0, num_rows, MAX_INSPECT_SLOTS):
        chunk = torch.arange(s, min(num_rows, s + MAX_INSPECT_SLOTS))
        stats = yield lambda mt, chunk=chunk: slot_stats_op(mt, chunk)
        ids, values = _best(torch.cat([ids, chunk]), torch.cat([values, stats["value_norm"].double() ** 2]), n, coldest)
    return ids, values.sqrt()


def usage_op(meta: TableMeta) -> Op:
    """The table's usage histograms (memserver.api.usage), each shard's added up: {"hits",
    "weight_mass", "updates"} -> Histogram. COLS: shard 0 keeps the counters (ShardLayout.counts_reads)."""
    value_table(meta, "usage")
    shards = [sh for sh in meta.shards if meta.layout.counts_reads(sh.index)]
    req = pb.SlotUsageRequest(table=meta.name, layout_id=meta.layout_id)
    answers = yield [(sh.address, "SlotUsage", req) for sh in shards]
    out = {k: Histogram.empty() for k in ("hits", "weight_mass", "updates")}
    for a in answers:
        for k in out:
            h = getattr(a, k)
            out[k] = out[k] + Histogram(int(h.slots), float(h.total), float(h.sum_xlogx), float(h.max),
                                        decode(h.counts, f"{k}.counts").numpy(), decode(h.sums, f"{k}.sums").numpy())
    return out
