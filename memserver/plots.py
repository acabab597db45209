"""Plots people would rather look at than read: a table's slot usage (`memserver usage --plot`
and the inspection page draw the same PNG)."""

from __future__ import annotations

import io

import numpy as np

from memserver.api.usage import TableUsage


def usage_png(usage: TableUsage, title: str) -> bytes:
    """Two panels from the shards' histograms: the rank-frequency curve of reads on log-log axes
    (a slot's rank by hits against its hits; a flat curve is even use, a steep one a few hot
    slots), and how many slots sit at each read weight (log bins; the never-read slots are
    counted in its title). Works headless (Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for hist, label in ((usage.hits, "hits"), (usage.weight_mass, "weight mass")):
        counts, values = hist.descending()
        if len(counts):
            ranks = np.cumsum(counts)  # the last rank of each step
            left.step(np.r_[1, ranks[:-1] + 1], values, where="post", label=label)
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("slot rank")
    left.set_ylabel("hits (weight mass) of the slot")
    left.set_title("rank-frequency (log-log)")
    if left.get_legend_handles_labels()[0]:  # (a table never read draws no line: matplotlib warned of an empty legend)
        left.legend()
    mass = usage.weight_mass
    nz = np.flatnonzero(mass.counts[1:]) + 1
    if len(nz):
        from memserver.api.usage import LOW_EXP, PER_DECADE

        lo, hi = nz.min(), nz.max()
        centers = 10 ** ((np.arange(lo, hi + 1) - 0.5) / PER_DECADE + LOW_EXP)
        right.bar(centers, mass.counts[lo : hi + 1], width=centers * (10 ** (1 / PER_DECADE) - 1), align="center")
        right.set_xscale("log")
    right.set_xlabel("weight mass of the slot")
    right.set_ylabel("slots")
    unread = int(usage.hits.counts[0])
    right.set_title(f"{unread:,} of {usage.hits.slots:,} slots never read "
                    f"({100.0 * unread / max(usage.hits.slots, 1):.1f}%)")
    fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()
