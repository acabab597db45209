"""The ops of product-key tables: address (queries to slot ids and weights) and loading the keys."""

from __future__ import annotations

from typing import Any

import torch

from client.ops.base import Op, OpOptions, request_parts
from client.ops.checks import checked_floats, product_keys_table
from client.ops.sessions import WriteTags
from memserver.api.errors import FailedPreconditionError, InvalidArgumentError
from memserver.api.types import TableMeta, a_kind
from memserver.api.v1 import memserver_pb2 as pb
from memserver.wire import check_float, decode, encode


def slots_table(keys: TableMeta, values: TableMeta) -> TableMeta:
    """The value table a product-key table's slots are read from (`values`, its values_table),
    refused (FAILED_PRECONDITION, naming both) unless it has the keys' pkm_n_keys^2 rows: one made
    anew with another shape failed the read with "ids: id 238 out of range for a table of 10 rows",
    ids the caller never gave (a hunt)."""
    if values.kind != "value" or values.num_rows != keys.num_rows:
        what = f"one of {values.num_rows:,} rows" if values.kind == "value" else a_kind(values.kind)
        raise FailedPreconditionError(f"table {keys.name!r} reads its slots from {values.name!r}, which must be a value "
                                      f"table of {keys.num_rows:,} rows (pkm_n_keys^2); it is {what}: make it again "
                                      "with that shape")
    return values


def address_op(meta: TableMeta, queries: Any, opts: OpOptions) -> Op:
    """Product-key addressing on the table's shard: inputs [B, d_in] (a query network is stored)
    or queries [B, heads*k_dim] / [B, heads, k_dim] -> (ids int64 [B, heads*knn], weights float32
    [B, heads*knn]). Large batches are split below the request size limit."""
    product_keys_table(meta)
    q = checked_floats(queries, "queries")  # (checked before the conversion: a float64 beyond float32's range
    q_dim = meta.pkm_heads * meta.pkm_k_dim  # is said as that, not as NaN or infinite)
    if meta.pkm_d_in:
        ok, want = q.dim() == 2 and q.shape[1] == meta.pkm_d_in, f"[B, {meta.pkm_d_in}]"
    else:
        ok = (q.dim() == 2 and q.shape[1] == q_dim) or (q.dim() == 3 and tuple(q.shape[1:]) == (meta.pkm_heads, meta.pkm_k_dim))
        want = f"[B, {q_dim}] or [B, {meta.pkm_heads}, {meta.pkm_k_dim}]"
    if not ok:
        raise InvalidArgumentError(f"queries: shape must be {want}, got {list(q.shape)}")
    check_float(q, "queries")
    q = q.float()
    per_row = max(4 * (q.numel() // max(1, q.shape[0])), 12 * meta.pkm_heads * meta.pkm_knn)
    chunks = request_parts(q.shape[0], per_row, opts.max_request_bytes)
    shard = meta.shards[0]
    calls = [(shard.address, "Address", pb.AddressRequest(table=meta.name, queries=encode(q[c]), layout_id=meta.layout_id))
             for c in chunks]
    answers = yield calls
    ids = [decode(a.ids, "ids").long() for a in answers]
    weights = [decode(a.weights, "weights").float() for a in answers]
    return (torch.cat(ids), torch.cat(weights)) if len(chunks) > 1 else (ids[0].clone(), weights[0].clone())


def load_product_keys_op(meta: TableMeta, keys: Any, query_weight: Any, query_bias: Any, bn: dict[str, Any] | None,
                         tags: WriteTags) -> Op:
    """Install sub-keys [heads, 2, n_keys, k_dim/2] and, for a table with pkm_d_in, the query
    Linear (weight [heads*k_dim, d_in], bias [heads*k_dim] or None) and an eval-mode BatchNorm
    (`bn`: running_mean, running_var, weight, bias [heads*k_dim], optional eps; None = none).
    Returns the number of sub-keys loaded. Shapes are checked here and again on the shard."""
    product_keys_table(meta)
    h, n_keys, k_dim, d_in = meta.pkm_heads, meta.pkm_n_keys, meta.pkm_k_dim, meta.pkm_d_in
    q_dim = h * k_dim

    def tensor(x: Any, shape: tuple[int, ...], what: str) -> pb.Tensor:
        t = checked_floats(x, what)
        if tuple(t.shape) != shape:
            raise InvalidArgumentError(f"{what}: shape must be {list(shape)}, got {list(t.shape)}")
        check_float(t, what)  # (before the conversion, as address's queries)
        return encode(t.float().contiguous())

    req = pb.LoadProductKeysRequest(table=meta.name, keys=tensor(keys, (h, 2, n_keys, k_dim // 2), "keys"),
                                    layout_id=meta.layout_id)
    if not d_in and (query_weight is not None or query_bias is not None or bn is not None):
        raise InvalidArgumentError(f"query_weight: the table {meta.name!r} takes queries already projected "
                                   "(created with d_in=0); it stores no query network")
    if d_in:
        if query_weight is None:
            raise InvalidArgumentError(f"query_weight: required: the table {meta.name!r} projects inputs of dim {d_in}")
        req.query_weight.CopyFrom(tensor(query_weight, (q_dim, d_in), "query_weight"))
        if query_bias is not None:
            req.query_bias.CopyFrom(tensor(query_bias, (q_dim,), "query_bias"))
        if bn is not None:
            missing = {"running_mean", "running_var", "weight", "bias"} - set(bn)
            if missing:
                raise InvalidArgumentError(f"bn: missing {sorted(missing)}")
            req.bn.CopyFrom(pb.QueryBatchNorm(eps=float(bn.get("eps", 1e-5)), **{
                k: tensor(bn[k], (q_dim,), f"bn.{k}") for k in ("running_mean", "running_var", "weight", "bias")}))
    shard = meta.shards[0]
    req.tag.CopyFrom(tags(0, meta, shard))
    (ack,) = yield [(shard.address, "LoadProductKeys", req)]
    return int(ack.rows)
