"""How evenly a memory's slots are used: the metrics of the PKM paper and XLM's code."""

from __future__ import annotations

import torch


def usage_metrics(counts: torch.Tensor, mass: torch.Tensor) -> dict[str, float]:
    """From per-slot access counts and summed weights: % of slots used, KL divergence to the
    uniform distribution (by counts and by weights), and how many of the hottest slots hold
    50/90/99% of the weight mass."""
    n = counts.numel()
    if n == 0:
        return {}
    out: dict[str, float] = {"used_pct": 100.0 * float((counts > 0).sum()) / n}
    for key, x in (("kl_counts", counts.double()), ("kl_weights", mass.double())):
        total = float(x.sum())
        if total <= 0:
            out[key] = 0.0
            continue
        p = x / total
        nz = p[p > 0]
        out[key] = float((nz * (nz * n).log()).sum())  # KL(p || uniform)
    if float(mass.sum()) > 0:
        sorted_mass = mass.double().sort(descending=True).values.cumsum(0) / mass.double().sum()
        for q in (50, 90, 99):
            out[f"top{q}_slots"] = float(int((sorted_mass < q / 100).sum()) + 1)
    return out


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
        return usage_metrics(self.counts, self.mass)
