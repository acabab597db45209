"""Write cost against table size: a small write must cost the same on a large table slice.

A write's work is its entries: grouping them by row, summing each row's gradient and one
optimizer step on each touched row. Nothing should be sized by the slice's row count (issue 10:
`sparse_step` grouped entries with a counting sort over all the slice's rows, so pushing 256
ids took 0.15 ms on 65,536 rows and 202 ms on 16,777,216). Measured in this process with
`ValueTable` (numba and torch backends, adagrad, d=8), on tables of 65,536, 4,194,304 and
16,777,216 rows: p50 of `push_gradients` of the same 256 distinct ids (drawn over the whole
table) and of `bag_backward` of the same batch of 64 bags x 32 ids (every id in two bags). One
large table exists at a time, and its calls alternate with the same calls on the smallest table
(kept for the run), so each ratio compares calls that shared the same background load. The
ratio is p50 on the largest table / p50 on the smallest; target <= 2x.

    python -m benchmarks.write_cost [--quick] [--rows 65536,4194304,16777216] [--repeat 50]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from benchmarks.common import latencies, machine, target

#: Target: p50 on the largest table at most this many times p50 on the smallest.
TARGET = 2.0
DIM = 8
PUSH_IDS = 256
BAGS, SLOTS = 64, 32


class Workload:
    """The fixed calls on a table of `rows` rows: push_gradients of the same 256 distinct ids (drawn
    over the whole table) and bag_backward of the same 64 x 32 batch (every id in two bags)."""

    def __init__(self, rows: int, backend: str) -> None:
        from memserver.core.optim import OptimizerConfig
        from memserver.core.table import ValueTable

        rng = np.random.default_rng(0)
        self.ids = torch.from_numpy(rng.choice(rows, PUSH_IDS, replace=False))
        self.grads = torch.from_numpy(rng.normal(size=(PUSH_IDS, DIM)).astype(np.float32))
        self.bag_ids = torch.from_numpy(rng.integers(0, rows, (BAGS, SLOTS)))
        self.bag_ids[:, SLOTS // 2 :] = self.bag_ids[:, : SLOTS // 2].roll(1, 0)
        self.w = torch.softmax(torch.from_numpy(rng.normal(size=(BAGS, SLOTS)).astype(np.float32)), 1)
        self.g = torch.from_numpy(rng.normal(size=(BAGS, DIM)).astype(np.float32))
        t0 = time.perf_counter()
        self.table = ValueTable(rows, DIM, OptimizerConfig("adagrad", 0.01), backend=backend)
        self.create_s = time.perf_counter() - t0

    def push(self) -> None:
        self.table.push_gradients(self.ids, self.grads)

    def bag_backward(self) -> None:
        self.table.bag_backward(self.bag_ids, self.w, None, self.g)


def measure(backend: str, sizes: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    """For each size: its table's p50s, measured round robin with the smallest table's calls (kept
    for the whole run: 4 MiB), so each ratio compares calls that shared the same background load.
    One large table exists at a time."""
    small = Workload(sizes[0], backend)
    out = []
    for rows in sizes:
        big = small if rows == sizes[0] else Workload(rows, backend)
        calls = {"push": big.push, "bag_backward": big.bag_backward}
        if big is not small:
            calls |= {"small_push": small.push, "small_bag_backward": small.bag_backward}
        stats = latencies(calls, repeat=args.repeat, warmup=5, max_seconds=args.max_seconds)
        ms = {k: v["p50_ms"] for k, v in stats.items()}
        base = {op: ms.get(f"small_{op}", ms[op]) for op in ("push", "bag_backward")}
        out.append({"rows": rows, "backend": backend, "table_bytes": big.table.nbytes(), "create_s": big.create_s,
                    "ms": ms, "ratio": {op: ms[op] / base[op] for op in base}, "timings": stats})
        del big, calls  # free it before the next table is made
        gc.collect()
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="65536,4194304,16777216", help="table sizes, smallest first")
    p.add_argument("--backends", default="numba,torch")
    p.add_argument("--repeat", type=int, default=50, help="calls of each kind per table (after 5 warm-up calls)")
    p.add_argument("--max-seconds", type=float, default=30.0, help="time bound per table")
    p.add_argument("--quick", action="store_true", help="20 calls of each kind per table")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.repeat, args.max_seconds = min(args.repeat, 20), min(args.max_seconds, 10.0)
    sizes = sorted(int(r) for r in args.rows.split(","))
    backends = args.backends.split(",")
    results = [r for b in backends for r in measure(b, sizes, args)]
    by = {(r["backend"], r["rows"]): r for r in results}
    small, large = sizes[0], sizes[-1]
    targets, ratios = [], {}
    for b in backends:
        for op in ("push", "bag_backward"):
            ratio = by[(b, large)]["ratio"][op]
            ratios[f"{b}/{op}"] = ratio
            what = {"push": f"push_gradients {PUSH_IDS} ids", "bag_backward": f"bag_backward {BAGS}x{SLOTS}"}[op]
            targets.append(target("write_cost", f"{b} {what}: p50 {large:,} rows / {small:,} rows", ratio, TARGET,
                                  higher_is_better=False))
    out = {"benchmark": "write_cost", "config": vars(args), "machine": machine(),
           "threads": {"torch": torch.get_num_threads(), "numba": _numba_threads()},
           "results": results, "ratios": ratios, "targets": targets}
    if args.json:
        print(json.dumps(out, indent=2))
        return out
    tbl = Table(title=f"write cost vs table rows: adagrad, d={DIM}; push_gradients of {PUSH_IDS} ids, bag_backward of "
                      f"{BAGS} bags x {SLOTS} ids; p50 ms (x = vs the {small:,}-row table's p50, measured round robin "
                      f"with it: in brackets)")
    for col in ("backend", "rows", "table MiB", "create s", "push p50", "x", "bag_backward p50", "x"):
        tbl.add_column(col, justify="left" if col == "backend" else "right")
    for r in results:
        ms, x = r["ms"], r["ratio"]
        base = {op: f" [{ms[f'small_{op}']:.3f}]" if f"small_{op}" in ms else "" for op in ("push", "bag_backward")}
        tbl.add_row(r["backend"], f"{r['rows']:,}", f"{r['table_bytes'] / 2**20:,.0f}", f"{r['create_s']:.1f}",
                    f"{ms['push']:.3f}{base['push']}", f"{x['push']:.2f}",
                    f"{ms['bag_backward']:.3f}{base['bag_backward']}", f"{x['bag_backward']:.2f}")
    Console(width=160).print(tbl)
    return out


def _numba_threads() -> int:
    try:
        import numba
    except ImportError:
        return 0
    return int(numba.get_num_threads())


if __name__ == "__main__":
    main()
