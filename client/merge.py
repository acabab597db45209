"""Merging the top-k answers of an index table's slices into the table's top-k.

Pure torch: no faiss, numba or server code, so the client imports it (the shards answer each
search with their own best k; a slice holds the ids with `id % S == s`, so no id comes twice).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from memserver.api.errors import InvalidArgumentError

#: Metrics by their order: "ip" (inner product, larger is better), "l2" (distance, smaller is better).
METRIC_LARGER_IS_BETTER = {"ip": True, "l2": False}


def _tensor(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))


def merge_topk(scores: Sequence[Any], ids: Sequence[Any], k: int, metric: str) -> tuple[Any, Any]:
    """The best k of several top-k answers, query by query.

    `scores[i]`, `ids[i]`: [B, k_i] (torch or numpy; the k_i may differ). Order: the metric's own
    (ip: larger first; l2: smaller first), ties by smaller id, missing hits (id -1) last. Exact:
    no hit better than the k-th of the answer is left out, given each part is its slice's best
    k_i. Returns (scores [B, k] float32, ids [B, k] int64), torch if scores[0] is a tensor, else
    numpy; where fewer than k hits exist, id -1 and score -inf (ip) / +inf (l2). The hits'
    payload comes apart, each distinct hit's row once (`hit_payload`).

    Cost: O(B * K log K) for K = sum of k_i (three stable sorts)."""
    if metric not in METRIC_LARGER_IS_BETTER:
        raise InvalidArgumentError(f"metric: must be one of {sorted(METRIC_LARGER_IS_BETTER)}, got {metric!r}")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
        raise InvalidArgumentError(f"k: must be an integer >= 0, got {k!r}")
    if not scores or len(scores) != len(ids):
        raise InvalidArgumentError("scores, ids: one answer per part, at least one")
    as_torch = isinstance(scores[0], torch.Tensor)
    s_parts = [_tensor(s) for s in scores]
    i_parts = [_tensor(i) for i in ids]
    b = s_parts[0].shape[0] if s_parts[0].dim() == 2 else -1
    for n, (s, i) in enumerate(zip(s_parts, i_parts)):
        if s.dim() != 2 or s.shape != i.shape or s.shape[0] != b:
            raise InvalidArgumentError(
                f"scores[{n}], ids[{n}]: shapes {list(s.shape)} and {list(i.shape)}; every part must be [B={b}, k_i]")
    device = s_parts[0].device
    s = torch.cat([p.to(device=device, dtype=torch.float32) for p in s_parts], 1)
    i = torch.cat([p.to(device=device, dtype=torch.int64) for p in i_parts], 1)
    larger = METRIC_LARGER_IS_BETTER[metric]
    missing = i < 0
    key = torch.where(missing, torch.zeros_like(s), -s if larger else s) + 0.0  # -0.0 == 0.0
    # Lexicographic (missing, key, id) by stable sorts, least significant key first.
    order = torch.argsort(i, dim=1, stable=True)
    order = order.gather(1, torch.argsort(key.gather(1, order), dim=1, stable=True))
    order = order.gather(1, torch.argsort(missing.gather(1, order).to(torch.uint8), dim=1, stable=True))
    order = order[:, :k]
    out_s, out_i = s.gather(1, order), i.gather(1, order)
    fill = float("-inf") if larger else float("inf")
    if out_s.shape[1] < k:  # fewer hits than k in all parts together
        pad = k - out_s.shape[1]
        out_s = torch.cat([out_s, out_s.new_full((b, pad), fill)], 1)
        out_i = torch.cat([out_i, out_i.new_full((b, pad), -1)], 1)
    miss = out_i < 0
    out_s = out_s.masked_fill(miss, fill)
    out_i = out_i.masked_fill(miss, -1)
    if as_torch:
        return out_s, out_i
    return out_s.cpu().numpy(), out_i.cpu().numpy()


def hit_payload(ids: torch.Tensor, payload_ids: Sequence[torch.Tensor], payloads: Sequence[torch.Tensor],
                width: int) -> torch.Tensor:
    """The payload of each hit, [B, k, width] float32 (zeros where id is -1), from the shards'
    distinct hits' rows: `payload_ids[i]` [U_i] int64 ascending and `payloads[i]` [U_i, width]
    (a shard sends each row once, however many queries hit it). Every hit id must be among them:
    an answer that lacks one is refused (InvalidArgumentError names the id), never filled in."""
    for n, (u, p) in enumerate(zip(payload_ids, payloads)):
        if u.dim() != 1 or p.shape != (len(u), width):
            raise InvalidArgumentError(f"payload_ids[{n}], payload[{n}]: shapes {list(u.shape)} and {list(p.shape)}; "
                                       f"expected [U] and [U, {width}]")
    known = torch.cat([u.to(torch.int64) for u in payload_ids])
    rows = torch.cat([p.to(torch.float32) for p in payloads]) if len(payloads) > 1 else payloads[0].float()
    known, order = torch.sort(known)
    hit = ids >= 0
    if len(known) == 0:
        if bool(hit.any()):
            raise InvalidArgumentError(f"payload: the answer has no payload row for hit id {int(ids[hit][0])}")
        return torch.zeros((*ids.shape, width), dtype=torch.float32)
    at = torch.searchsorted(known, ids.clamp(min=0)).clamp_(max=len(known) - 1)
    lacking = hit & (known[at] != ids)
    if bool(lacking.any()):
        raise InvalidArgumentError(f"payload: the answer has no payload row for hit id {int(ids[lacking][0])}")
    return rows[order[at]].masked_fill_(~hit[..., None], 0.0)
