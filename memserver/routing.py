"""A table's shard map and the pure routing of ids to its shards.

Kept apart from client/aio.py so that code which must not pull in Ray or asyncio (the locust
load test runs on gevent) routes requests exactly as the client does: one implementation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from memserver.v1 import memserver_pb2 as pb
from memserver.wire import dtype_name


@dataclass(frozen=True)
class ShardMeta:
    index: int
    address: str
    col_start: int
    col_end: int
    num_rows: int
    node_id: str
    pid: int


@dataclass(frozen=True)
class TableMeta:
    """What a client knows about a table: its spec and where its shards are."""

    name: str
    num_rows: int
    dim: int
    sharding: str
    optimizer: str
    lr: float
    dtype: str
    init_std: float
    seed: int
    shards: tuple[ShardMeta, ...]
    epoch: int
    wal: bool = False

    @classmethod
    def from_proto(cls, info: pb.TableInfo) -> TableMeta:
        s = info.spec
        return cls(
            name=s.name,
            num_rows=s.num_rows,
            dim=s.dim,
            sharding=pb.Sharding.Name(s.sharding).lower(),
            optimizer=s.optimizer.name,
            lr=s.optimizer.lr,
            dtype=dtype_name(s.dtype),
            init_std=s.init_std,
            seed=s.seed,
            shards=tuple(
                ShardMeta(sh.index, sh.address, sh.col_start, sh.col_end, sh.num_rows, sh.node_id, sh.pid)
                for sh in info.shards
            ),
            wal=s.wal,
            epoch=info.epoch,
        )

    @property
    def by_rows(self) -> bool:
        return self.sharding == "rows"

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "shards"}
        d["shards"] = [sh.__dict__ for sh in self.shards]
        return d


def wire_ids(ids: torch.Tensor, meta: TableMeta) -> torch.Tensor:
    """Ids travel as int32 when the table allows it: a third less request bytes for a bag."""
    return ids.int() if meta.num_rows < 2**31 else ids


def route_ids(meta: TableMeta, ids: torch.Tensor) -> list[tuple[ShardMeta, torch.Tensor]]:
    """(shard, positions in `ids`) pairs: ROWS -> the ids each shard owns; COLS -> every
    shard sees all ids."""
    if not meta.by_rows or len(meta.shards) == 1:
        every = torch.arange(len(ids))
        return [(sh, every) for sh in meta.shards]
    owner = ids % len(meta.shards)
    return [(sh, (owner == sh.index).nonzero().squeeze(1)) for sh in meta.shards]


def route_bags(
    meta: TableMeta,
    ids: torch.Tensor,
    w: torch.Tensor,
    off: torch.Tensor | None,
    with_mask: bool = False,
) -> list[Any]:
    """Per shard, the (ids, weights, offsets) of its entries. COLS: the whole batch to every
    shard. ROWS: each shard gets its own entries as 1-D ids + offsets (bags may be empty).
    With `with_mask`, each item also carries the boolean mask of its entries in the flat batch
    (None for COLS), which puts per-entry answers back in place."""
    if not meta.by_rows or len(meta.shards) == 1:
        out = [(sh, (ids, w, off)) for sh in meta.shards]
        return [(*o, None) for o in out] if with_mask else out
    flat_ids, flat_w = ids.reshape(-1), w.reshape(-1)
    num_bags = ids.shape[0] if off is None else len(off)
    if off is None:
        bag_of = torch.arange(num_bags).repeat_interleave(ids.shape[1])
    else:
        counts = torch.diff(off, append=torch.tensor([len(flat_ids)]))
        bag_of = torch.repeat_interleave(torch.arange(num_bags), counts)
    owner = flat_ids % len(meta.shards)
    routed = []
    for sh in meta.shards:
        mask = owner == sh.index
        counts = torch.bincount(bag_of[mask], minlength=num_bags)
        s_off = torch.cumsum(counts, 0) - counts
        item = (sh, (flat_ids[mask], flat_w[mask], s_off))
        routed.append((*item, mask) if with_mask else item)
    return routed
