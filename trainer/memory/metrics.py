"""How evenly a memory layer's slots are used during an evaluation (the metrics themselves are
memserver.api.usage's, shared with `memserver usage` over a whole table in the cluster)."""

from __future__ import annotations

import numpy as np
import torch

from memserver.api.usage import usage_metrics

__all__ = ["UsageCounter", "usage_metrics"]


class UsageCounter:
    """Accumulates one memory layer's reads (its `last_access` after each forward) over an
    evaluation: num_slots counters and weight sums, float64.

    Slot ids are usually 0..num_slots-1 (a value table's rows); a KIF source's ids are whatever
    its vectors were added under (i*1000+7), so ids at or above num_slots are counted apart, by
    id. Both together hold at most one entry per slot the layer can read, the same bound as the
    dense counters."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.counts = torch.zeros(num_slots, dtype=torch.float64)
        self.mass = torch.zeros(num_slots, dtype=torch.float64)
        self.far_ids = torch.zeros(0, dtype=torch.int64)  # sorted, ids >= num_slots read so far
        self.far = torch.zeros((0, 2), dtype=torch.float64)  # [count, mass] of each

    def add(self, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Negative ids (a KIF search's missing hits, id -1) are not counted."""
        flat, w = ids.reshape(-1).cpu(), weights.reshape(-1).double().cpu()
        near = (flat >= 0) & (flat < self.num_slots)
        self.counts += torch.bincount(flat[near], minlength=self.num_slots).double()
        self.mass += torch.bincount(flat[near], weights=w[near], minlength=self.num_slots)
        far = flat >= self.num_slots
        if far.any():
            both = torch.cat([self.far_ids, flat[far]])
            self.far_ids, at = torch.unique(both, sorted=True, return_inverse=True)
            got = torch.cat([self.far, torch.stack([torch.ones(int(far.sum()), dtype=torch.float64), w[far]], 1)])
            self.far = torch.zeros((len(self.far_ids), 2), dtype=torch.float64).index_add_(0, at, got)

    def metrics(self) -> dict[str, float | None]:
        if not len(self.far_ids):
            return usage_metrics(self.counts.numpy(), self.mass.numpy())
        # the slots read, by their counts; the rest of the num_slots slots were not read
        seen = (self.counts > 0).numpy()
        counts = np.concatenate([self.counts.numpy()[seen], self.far[:, 0].numpy()])
        mass = np.concatenate([self.mass.numpy()[seen], self.far[:, 1].numpy()])
        unread = max(0, self.num_slots - len(counts))
        return usage_metrics(np.pad(counts, (0, unread)), np.pad(mass, (0, unread)))
