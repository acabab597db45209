"""Which shard gets which ids of a call. The rule (which shard owns an id, which columns it holds)
is the table's `ShardLayout` (memserver.api.types), the one place it is written; this module only
asks it and groups the positions of a call's ids by shard."""

from __future__ import annotations

from typing import Any

import torch

from memserver.api.types import ShardMeta, TableMeta


def route_ids(meta: TableMeta, ids: torch.Tensor) -> list[tuple[ShardMeta, torch.Tensor]]:
    """(shard, positions in `ids`) pairs: rows -> the ids each shard owns, a shard owning none of
    them left out (no empty call, nor an empty logged write); cols -> every shard sees all ids."""
    if meta.layout.whole_rows:
        every = torch.arange(len(ids))
        return [(sh, every) for sh in meta.shards]
    return route_owned(meta, ids)


def route_bags(
    meta: TableMeta,
    ids: torch.Tensor,
    w: torch.Tensor,
    off: torch.Tensor | None,
    with_mask: bool = False,
    every_shard: bool = False,
) -> list[Any]:
    """Per shard, the (ids, weights, offsets) of its entries. cols: the whole batch to every
    shard. rows: each shard gets its own entries as 1-D ids + offsets (bags may be empty), a
    shard owning no entry of the batch left out unless `every_shard` (a call that must reach
    every shard even empty: a sync table's bag_backward is each shard's whole contribution).
    With `with_mask`, each item also carries the boolean mask of its entries in the flat batch
    (None for cols), which puts per-entry answers back in place."""
    if meta.layout.whole_rows:
        out = [(sh, (ids, w, off)) for sh in meta.shards]
        return [(*o, None) for o in out] if with_mask else out
    flat_ids, flat_w = ids.reshape(-1), w.reshape(-1)
    num_bags = ids.shape[0] if off is None else len(off)
    if off is None:
        bag_of = torch.arange(num_bags).repeat_interleave(ids.shape[1])
    else:
        counts = torch.diff(off, append=torch.tensor([len(flat_ids)]))
        bag_of = torch.repeat_interleave(torch.arange(num_bags), counts)
    owner = meta.layout.owner(flat_ids)
    routed = []
    for sh in meta.shards:
        mask = owner == sh.index
        if not every_shard and not bool(mask.any()):  # no entry of the batch is this shard's: no call
            continue
        counts = torch.bincount(bag_of[mask], minlength=num_bags)
        s_off = torch.cumsum(counts, 0) - counts
        item = (sh, (flat_ids[mask], flat_w[mask], s_off))
        routed.append((*item, mask) if with_mask else item)
    return routed


def route_owned(meta: TableMeta, ids: torch.Tensor) -> list[tuple[ShardMeta, torch.Tensor]]:
    """(shard, positions) by the shard keeping each slot's records: `ShardLayout.owner` on any sharding."""
    owner = meta.layout.owner(ids)
    return [(sh, sel) for sh in meta.shards if len(sel := (owner == sh.index).nonzero().squeeze(1))]
