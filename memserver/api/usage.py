"""How evenly a memory's slots are used: one definition of the metrics (the PKM paper's and
XLM's: % used, KL to uniform, the slots holding 50/90/99% of the weight mass; plus Gini), exact
from per-slot arrays (a trainer's evaluation) or from fixed-bin histograms (a whole table in the
cluster: each shard bins its slots, the bins add up, the answer's size does not grow with the table).

Histogram bins: bin 0 holds zeros; bin i >= 1 holds [10^((i-1)/20 - 9), 10^(i/20 - 9)), 20 bins a
decade from 1e-9 up to 1e18; values beyond either end fall in the first or last bin. Every bin
keeps its count and its sum, so totals and used counts are exact and only where a value sits
inside its bin (12% wide) is approximated (by the bin's mean) in Gini and the mass quantiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

PER_DECADE = 20
LOW_EXP, HIGH_EXP = -9, 18
BINS = 1 + PER_DECADE * (HIGH_EXP - LOW_EXP)


@dataclass
class Histogram:
    """One statistic over a set of slots: exact count, total, sum of x ln x, max; binned values."""

    slots: int
    total: float
    sum_xlogx: float
    max: float
    counts: np.ndarray = field(repr=False)  # int64 [BINS] (left out of repr: ~7 kB of bins each)
    sums: np.ndarray = field(repr=False)  # float64 [BINS]

    @classmethod
    def of(cls, x: np.ndarray) -> Histogram:
        """Bin the values x (>= 0). O(len(x))."""
        x = np.asarray(x, dtype=np.float64).reshape(-1)
        nz = x[x > 0]
        b = np.zeros(len(x), dtype=np.int64)
        if len(nz):  # (an infinite value, a float32 sum that overflowed: the last bin)
            pos = np.clip(np.floor((np.minimum(np.log10(nz), HIGH_EXP) - LOW_EXP) * PER_DECADE).astype(np.int64) + 1,
                          1, BINS - 1)
            b[x > 0] = pos
        counts = np.bincount(b, minlength=BINS).astype(np.int64)
        sums = np.bincount(b, weights=x, minlength=BINS)
        return cls(len(x), float(x.sum()), float((nz * np.log(nz)).sum()), float(x.max()) if len(x) else 0.0, counts, sums)

    @classmethod
    def empty(cls) -> Histogram:
        return cls(0, 0.0, 0.0, 0.0, np.zeros(BINS, dtype=np.int64), np.zeros(BINS, dtype=np.float64))

    def __add__(self, other: Histogram) -> Histogram:
        return Histogram(self.slots + other.slots, self.total + other.total, self.sum_xlogx + other.sum_xlogx,
                         max(self.max, other.max), self.counts + other.counts, self.sums + other.sums)

    @property
    def used(self) -> int:
        return int(self.counts[1:].sum())

    def descending(self) -> tuple[np.ndarray, np.ndarray]:
        """(slots, mean value) of each nonempty nonzero bin, largest values first: the
        rank-frequency curve, one step per bin."""
        idx = np.flatnonzero(self.counts[1:] > 0)[::-1] + 1
        return self.counts[idx], self.sums[idx] / self.counts[idx]


def percent(x: float, digits: int = 1) -> str:
    """A percentage (0-100) with `digits` decimals, more where rounding would make a share just
    short of all or just above none read as 100% or 0% (1 slot of 16,384 never read: 99.994%)."""
    for d in range(digits, 7):
        s = f"{x:.{d}f}"
        if not ((float(s) >= 100 > x) or (float(s) <= 0 < x)):
            return s + "%"
    return ">99.999999%" if x > 50 else "<0.000001%"


def kl_to_uniform(total: float, sum_xlogx: float, n: int) -> float:
    """KL(p || uniform over n slots) with p = x / total: ln n + sum p ln p."""
    if total <= 0 or n == 0:
        return 0.0
    return max(0.0, math.log(n) + sum_xlogx / total - math.log(total))


def gini(counts: np.ndarray, values: np.ndarray) -> float:
    """Gini coefficient of a distribution given as (how many slots, at which value) groups."""
    n, total = counts.sum(), float((counts * values).sum())
    if n == 0 or total <= 0:
        return 0.0
    order = np.argsort(values, kind="stable")
    c, v = counts[order].astype(np.float64), values[order]
    first = np.cumsum(c) - c  # slots before each group, ascending
    # sum over slots of (2 * rank - n - 1) * value, rank 1-based, each group's ranks summed in closed form
    rank_sum = c * (2 * first + c + 1) / 2
    return float(((2 * rank_sum - (n + 1) * c) * v).sum() / (n * total))


def mass_quantiles(counts: np.ndarray, values: np.ndarray, qs: tuple[int, ...] = (50, 90, 99)) -> dict[str, float | None]:
    """How many of the hottest slots hold q% of the mass, for (slots, value) groups hottest first;
    None with no mass (the keys are there either way: `usage --json` keeps its shape)."""
    mass = counts * values
    total = float(mass.sum())
    out: dict[str, float | None] = {f"top{q}_slots": None for q in qs}
    if not 0 < total < math.inf:  # (a mass that overflowed float32: no quantile; int(NaN) raised)
        return out
    cum = np.cumsum(mass) / total
    before = np.cumsum(counts) - counts
    for q in qs:
        g = int(np.searchsorted(cum, q / 100 - 1e-12))  # the group where the q% is reached
        g = min(g, len(counts) - 1)
        reached = cum[g - 1] if g else 0.0
        need = (q / 100 - reached) * total / values[g]  # slots of group g still needed
        out[f"top{q}_slots"] = int(before[g] + max(1, math.ceil(need - 1e-9)))  # a count of slots
    return out


def usage_metrics(counts: np.ndarray, mass: np.ndarray) -> dict[str, float | None]:
    """Exact, from per-slot access counts and summed weights (empty: {})."""
    counts, mass = np.asarray(counts, dtype=np.float64), np.asarray(mass, dtype=np.float64)
    n = counts.size
    if n == 0:
        return {}
    out: dict[str, float | None] = {"used_pct": 100.0 * float((counts > 0).sum()) / n}
    for key, x in (("kl_counts", counts), ("kl_weights", mass)):
        nz = x[x > 0]  # (no reads: None, no distribution to compare; not 0, an even one)
        out[key] = kl_to_uniform(float(x.sum()), float((nz * np.log(nz)).sum()), n) if nz.size else None
    out["gini_weights"] = gini(np.ones(n, dtype=np.int64), mass) if 0 < mass.sum() < math.inf else None
    hot = np.sort(mass)[::-1]
    out.update(mass_quantiles(np.ones(n, dtype=np.int64), hot))
    return out


#: The metrics `histogram_metrics` approximates (each within a bin's width); the others are exact.
APPROXIMATE = ("gini_weights", "top50_slots", "top90_slots", "top99_slots")


def histogram_metrics(hits: Histogram, mass: Histogram) -> dict[str, float | None]:
    """The same metrics from the shards' histograms: used %, both KLs exact; Gini and the mass
    quantiles from the bins."""
    n = hits.slots
    if n == 0:
        return {}
    out: dict[str, float | None] = {"used_pct": 100.0 * hits.used / n,  # (no reads: None, as in usage_metrics)
                                    "kl_counts": kl_to_uniform(hits.total, hits.sum_xlogx, n) if hits.total > 0 else None,
                                    "kl_weights": None, "gini_weights": None}
    out.update(mass_quantiles(np.zeros(0), np.zeros(0)))  # (None each, until there is mass)
    if mass.total > 0:
        out["kl_weights"] = kl_to_uniform(mass.total, mass.sum_xlogx, n)
        c, v = mass.descending()
        out["gini_weights"] = gini(np.r_[c, mass.counts[0]], np.r_[v, 0.0]) if mass.total < math.inf else None
        out.update(mass_quantiles(c, v))
    return out


@dataclass
class TableUsage:
    """A whole table's usage, from its shards' histograms (client.MemoryClient.usage)."""

    hits: Histogram
    weight_mass: Histogram
    updates: Histogram

    def metrics(self) -> dict[str, float]:
        return histogram_metrics(self.hits, self.weight_mass)
