"""A table slice: the part of one table a shard holds, with what the shard keeps beside the
values (the exactly-once window, the write-ahead log, a sync step's partial pushes).

Only the shard's compute thread touches a slice (see memserver.server.dataplane), so nothing
here takes a lock.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from memserver.api.errors import InvalidArgumentError
from memserver.api.types import ShardLayout
from memserver.api.v1 import memserver_pb2 as pb
from memserver.core.table import ValueTable
from memserver.server.catalog import optimizer_config
from memserver.storage.wal import WriteAheadLog
from memserver.wire import TORCH_DTYPES, check_ids

log = logging.getLogger(__name__)
T = TypeVar("T")

#: How many (client_id, seq) answers each table slice remembers for replayed writes.
DEDUP_WINDOW = 4096


class TableSlice:
    """The rows (rows sharding) or columns (cols) of one table that this shard owns."""

    def __init__(self, spec: pb.TableSpec, info: pb.ShardInfo, num_shards: int, device: torch.device,
                 initialise: bool = True):
        """`initialise` False leaves the values zero (a restore fills them)."""
        self.spec, self.info, self.num_shards = spec, info, num_shards
        self.layout = ShardLayout.of(spec, num_shards)
        self.by_rows = self.layout.by_rows
        global_rows = self.layout.global_rows(info.index)
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
            raise InvalidArgumentError(f"step {step}: trainer {client_id} already sent its gradients (sync tables take "
                                       "one bag_backward per trainer per step)")
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
                "num_rows": int(self.spec.num_rows), "dim": int(self.spec.dim), "col_start": int(self.info.col_start),
                "col_end": int(self.info.col_end)}

    def local(self, ids: torch.Tensor, what: str = "ids") -> torch.Tensor:
        """Global ids -> local rows, rejecting ids this shard does not own."""
        check_ids(ids, self.spec.num_rows, what)
        ids = ids.long().to(self.table.device)
        if self.layout.whole_rows:
            return ids
        owner = self.layout.owner(ids)
        wrong = owner != self.info.index
        if ids.numel() and bool(wrong.any()):
            first = int(wrong.reshape(-1).nonzero()[0])
            raise InvalidArgumentError(f"{what}: id {int(ids.reshape(-1)[first])} belongs to shard "
                                       f"{int(owner.reshape(-1)[first])}, not {self.info.index}")
        return self.layout.local(ids)

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
