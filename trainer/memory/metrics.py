"""How evenly a memory layer's slots are used during an evaluation (the metrics themselves are
memserver.api.usage's, shared with `memserver usage` over a whole table in the cluster)."""

from __future__ import annotations

import torch

from memserver.api.usage import usage_metrics

__all__ = ["UsageCounter", "usage_metrics"]


class UsageCounter:
    """Accumulates one memory layer's reads (its `last_access` after each forward) over an
    evaluation: num_slots counters and weight sums, float64."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.counts = torch.zeros(num_slots, dtype=torch.float64)
        self.mass = torch.zeros(num_slots, dtype=torch.float64)

    def add(self, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Ids outside [0, num_slots) (a KIF search's missing hits, id -1) are not counted."""
        flat, w = ids.reshape(-1).cpu(), weights.reshape(-1).double().cpu()
        keep = (flat >= 0) & (flat < self.num_slots)
        flat, w = flat[keep], w[keep]
        self.counts += torch.bincount(flat, minlength=self.num_slots).double()
        self.mass += torch.bincount(flat, weights=w, minlength=self.num_slots)

    def metrics(self) -> dict[str, float]:
        return usage_metrics(self.counts.numpy(), self.mass.numpy())
