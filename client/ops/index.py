"""The ops of index tables: add, remove and search (every shard's top k merged exactly)."""

from __future__ import annotations

from typing import Any

import torch

from client.merge import hit_payload, merge_topk
from client.ops.base import Op, OpOptions, request_parts
from client.ops.checks import INT32, check_ints, checked_floats, checked_ids, checked_vectors, index_table
from client.ops.routing import route_ids
from client.ops.sessions import WriteTags
from memserver.api.errors import InvalidArgumentError
from memserver.api.types import MAX_SEARCH_K, TableMeta
from memserver.api.v1 import memserver_pb2 as pb
from memserver.wire import Lazy, check_1d, check_float, check_norms, decode, encode, wire_tensor


def add_op(meta: TableMeta, ids: Any, vectors: Any, payload: Any, opts: OpOptions, tags: WriteTags) -> Op:
    """Upsert vectors (and payload rows) under the user's ids; each id goes to the shard that owns
    it. Returns how many vectors were added."""
    index_table(meta, "add")
    t = checked_ids(ids, meta)
    check_1d(t, "ids")
    if len(torch.unique(t)) != len(t):
        raise InvalidArgumentError("ids: an add needs distinct ids (which vector would win?)")
    v = checked_vectors(vectors, len(t), meta.dim, "vectors")
    check_norms(v, "vectors")
    if (payload is None) != (meta.payload_dim == 0):
        raise InvalidArgumentError(f"payload: the index {meta.name!r} has payload_dim {meta.payload_dim}; "
                                   + ("give payload rows" if payload is None else "it takes no payload"))
    p = None if payload is None else checked_vectors(payload, len(t), meta.payload_dim, "payload")
    calls = []
    per_id = 8 + 4 * (meta.dim + meta.payload_dim)
    for i, part in enumerate(request_parts(len(t), per_id, opts.max_request_bytes)):
        for sh, sel in route_ids(meta, t[part]):
            req = pb.AddRequest(table=meta.name, ids=encode(t[part][sel]), vectors=encode(v[part][sel]),
                                tag=tags(i, meta, sh), layout_id=meta.layout_id)
            if p is not None:
                req.payload.CopyFrom(encode(p[part][sel]))
            calls.append((sh.address, "Add", req))
    acks = yield calls
    return int(sum(a.rows for a in acks))


def remove_op(meta: TableMeta, ids: Any, opts: OpOptions, tags: WriteTags) -> Op:
    """Remove ids (absent ones are ignored); returns how many were present."""
    index_table(meta, "remove")
    t = torch.unique(checked_ids(ids, meta).reshape(-1))
    calls = []
    for i, part in enumerate(request_parts(len(t), 8, opts.max_request_bytes)):
        for sh, sel in route_ids(meta, t[part]):
            calls.append((sh.address, "Remove", pb.RemoveRequest(table=meta.name, ids=encode(t[part][sel]),
                                                                 tag=tags(i, meta, sh), layout_id=meta.layout_id)))
    acks = yield calls
    return int(sum(a.rows for a in acks))


def search_op(meta: TableMeta, queries: Any, k: int, nprobe: int | None, ef_search: int | None, return_payload: bool,
              opts: OpOptions) -> Op:
    """Every shard's top k of each query, merged exactly in the metric's order (client.merge):
    (scores [B, k], ids [B, k], payload [B, k, payload_dim] or None); a missing hit is id -1."""
    index_table(meta, "search")
    check_ints(INT32, k=k)
    check_ints(INT32, optional=True, nprobe=nprobe, ef_search=ef_search)
    q = checked_floats(queries, "queries")
    if q.dim() != 2 or q.shape[1] != meta.dim:
        raise InvalidArgumentError(f"queries: expected shape [B, {meta.dim}], got {list(q.shape)}")
    check_float(q, "queries")  # (before the conversion: a float64 beyond float32's range is said as that)
    q = q.float()
    check_norms(q, "queries")
    if not 0 < k <= MAX_SEARCH_K:
        raise InvalidArgumentError(f"k: must be in 1..{MAX_SEARCH_K}, got {k}")
    for name, value in (("nprobe", nprobe), ("ef_search", ef_search)):
        if value is not None and value <= 0:
            raise InvalidArgumentError(f"{name}: must be positive, got {value}")
    if return_payload and not meta.payload_dim:  # (it answered two values where three were asked for)
        raise InvalidArgumentError(f"return_payload: table {meta.name!r} holds no payload (payload_dim 0); search it "
                                   "without return_payload")
    with_payload = return_payload
    # at most a row per hit: score and id, and with the payload a distinct hit's id and row
    per_hit = 12 + (8 + 4 * meta.payload_dim if with_payload else 0)
    per_query = max(4 * meta.dim, k * per_hit)
    chunks = request_parts(q.shape[0], per_query, opts.max_request_bytes)
    calls = []
    for part in chunks:
        msg = pb.SearchRequest(table=meta.name, k=k, return_payload=with_payload, layout_id=meta.layout_id)
        if nprobe is not None:
            msg.nprobe = nprobe
        if ef_search is not None:
            msg.ef_search = ef_search
        n_q = len(range(q.shape[0])[part])
        req = Lazy(msg, {"queries": wire_tensor(q[part])}, answer_bytes=n_q * k * per_hit)
        for sh in meta.shards:  # one request for every shard
            calls.append((sh.address, "Search", req))
    answers = yield calls
    out_s, out_i, out_p = [], [], []
    n = len(meta.shards)
    for c in range(len(chunks)):
        got = answers[c * n : (c + 1) * n]
        scores = [decode(a.scores, "scores") for a in got]
        ids = [decode(a.ids, "ids").long() for a in got]
        s, i = merge_topk(scores, ids, k, meta.metric)
        out_s.append(torch.as_tensor(s))
        out_i.append(torch.as_tensor(i))
        if with_payload:
            out_p.append(hit_payload(i, [decode(a.payload_ids, "payload_ids") for a in got],
                                     [decode(a.payload, "payload") for a in got], meta.payload_dim))
    cat = (lambda xs: torch.cat(xs) if len(xs) > 1 else xs[0])  # noqa: E731
    return cat(out_s), cat(out_i), (cat(out_p) if out_p else None)
