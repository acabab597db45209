"""What closing a training step costs: `commit_step` after `gather` parts, per table.

A step's parts (`bag_backward(..., gather=True)`) are applied when the client commits the step
(docs/architecture.md, "A training step is one optimizer step"). This times the commit alone and
the whole step (two gather parts, then the commit) on a table of 2 shards (`cols`) and on one of
1 shard, each also with `defer_apply` (the shards answer the commit first and apply it right
after). The candidates run round robin, so they share the machine's background load.

    python -m benchmarks.commit_cost [--rows 65536 --dim 256 --bags 256 --knn 32 --steps 200] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks.common import local_cluster, machine, summarize

#: Steps of each case not counted (connections, first compilation).
WARMUP = 5


def run(rows: int = 65536, dim: int = 256, bags: int = 256, knn: int = 32, steps: int = 200) -> dict[str, Any]:
    from client import MemoryClient

    rng = np.random.default_rng(0)
    ids = rng.integers(0, rows, (bags, knn))
    w = rng.random((bags, knn)).astype(np.float32)
    g = rng.normal(size=(bags, dim)).astype(np.float32)
    halves = (slice(0, bags // 2), slice(bags // 2, bags))
    with local_cluster(2) as cluster, MemoryClient(cluster.endpoint) as client:
        cases: dict[str, tuple[str, bool]] = {}
        for shards in (2, 1):
            name = f"commit_cost_{shards}"
            client.create_table(name, rows, dim, sharding="cols", optimizer="adagrad", lr=0.01, num_shards=shards)
            for defer in (False, True):
                cases[f"{shards} shard{'s' if shards > 1 else ''}{', defer_apply' if defer else ''}"] = (name, defer)
        commit_ms: dict[str, list[float]] = {k: [] for k in cases}
        step_ms: dict[str, list[float]] = {k: [] for k in cases}
        numbers = itertools.count(1)
        for i in range(steps + WARMUP):
            for label, (name, defer) in cases.items():  # round robin: the same background load for each
                step = next(numbers)
                t0 = time.perf_counter()
                for half in halves:
                    client.bag_backward(name, ids[half], w[half], g[half], step=step, gather=True)
                t1 = time.perf_counter()
                client.commit_step(name, step, defer_apply=defer)
                t2 = time.perf_counter()
                if i >= WARMUP:
                    commit_ms[label].append((t2 - t1) * 1e3)
                    step_ms[label].append((t2 - t0) * 1e3)
    return {"machine": machine(), "rows": rows, "dim": dim, "bags": bags, "knn": knn, "steps": steps,
            "commit": {k: summarize(v) for k, v in commit_ms.items()},
            "step": {k: summarize(v) for k, v in step_ms.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=65536)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--bags", type=int, default=256)
    p.add_argument("--knn", type=int, default=32)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--quick", action="store_true", help="40 steps")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args()
    res = run(a.rows, a.dim, a.bags, a.knn, 40 if a.quick else a.steps)
    t = Table(title=f"commit_step, {a.rows} x {a.dim}, {a.bags} bags x {a.knn} ids in 2 gather parts (p50 / p99 ms)")
    for col in ("table", "commit alone", "step (2 parts + commit)"):
        t.add_column(col)
    for k, c in res["commit"].items():
        s = res["step"][k]
        t.add_row(k, f"{c['p50_ms']:.2f} / {c['p99_ms']:.2f}", f"{s['p50_ms']:.2f} / {s['p99_ms']:.2f}")
    Console().print(t)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
