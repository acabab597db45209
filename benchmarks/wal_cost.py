"""Write-ahead log cost: update throughput of a table with `wal` against the same table without.

With the log on, a shard appends each applied write (the request as it arrived) and acknowledges
it only after an fsync; a flusher thread fsyncs whatever was appended since its last fsync in one
go (group commit), so concurrent writers share flushes. Measured: `push_gradients` of small
(256 rows) and large (4096 rows) batches, d=128, from 1 and from 4 concurrent client threads,
and bag_backward at the training-step size is in benchmarks.update_throughput. Calls alternate
between the two tables, so both see the same background load. The ratio is
(updates/s with the log) / (updates/s without).

    python -m benchmarks.wal_cost [--quick]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks.common import local_cluster, machine


def run_pushes(client: Any, table: str, batches: list[tuple[np.ndarray, np.ndarray]], threads: int) -> float:
    """Push every batch (split over `threads` client threads); returns rows/s."""
    parts = [batches[i::threads] for i in range(threads)]
    t0 = time.perf_counter()
    workers = [threading.Thread(target=lambda p=p: [client.push_gradients(table, ids, g) for ids, g in p]) for p in parts]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return sum(len(ids) for ids, _ in batches) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=65536)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--calls", type=int, default=200, help="pushes per measurement")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per configuration (median reported)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.calls, args.rounds = min(args.calls, 80), min(args.rounds, 2)
    from client import MemoryClient

    rng = np.random.default_rng(0)
    results = []
    with local_cluster(2) as cluster, MemoryClient(cluster.endpoint, timeout=120) as client:
        for wal in (False, True):
            client.create_table(f"bench-wal-{wal}", args.rows, args.dim, sharding="cols", optimizer="adagrad", wal=wal)
        for batch in (256, 4096):
            calls = args.calls if batch == 256 else max(10, args.calls // 8)
            batches = [(rng.choice(args.rows, batch, replace=False), rng.normal(size=(batch, args.dim)).astype(np.float32))
                       for _ in range(calls)]
            for threads in (1, 4):
                rates: dict[bool, list[float]] = {False: [], True: []}
                run_pushes(client, "bench-wal-True", batches[:5], 1)  # warm-up
                run_pushes(client, "bench-wal-False", batches[:5], 1)
                for _ in range(args.rounds):
                    for wal in (False, True):
                        rates[wal].append(run_pushes(client, f"bench-wal-{wal}", batches, threads))
                off, on = float(np.median(rates[False])), float(np.median(rates[True]))
                results.append({"batch": batch, "threads": threads, "rows_per_s": {"no_wal": off, "wal": on},
                                "ratio": on / off, "request_bytes": batch * (args.dim * 4 + 4)})
        for wal in (False, True):
            client.drop_table(f"bench-wal-{wal}")
    targets = [{"name": "wal_cost", "what": f"push {r['batch']} rows x {r['threads']} thread(s): with wal / without",
                "target": "info", "value": r["ratio"], "measured": f"{r['ratio']:.2f}x", "pass": None} for r in results]
    out = {"benchmark": "wal_cost", "config": vars(args), "machine": machine(), "results": results, "targets": targets}
    if args.json:
        print(json.dumps(out, indent=2))
        return out
    tbl = Table(title=f"write-ahead log cost: push_gradients, {args.rows:,} x {args.dim} adagrad, 2 shards cols (rows/s)")
    for col in ("batch rows", "client threads", "request MiB", "no wal", "wal", "wal / no wal"):
        tbl.add_column(col, justify="right")
    for r in results:
        tbl.add_row(str(r["batch"]), str(r["threads"]), f"{r['request_bytes'] / 2**20:.2f}", f"{r['rows_per_s']['no_wal']:,.0f}",
                    f"{r['rows_per_s']['wal']:,.0f}", f"{r['ratio']:.2f}x")
    Console(width=160).print(tbl)
    return out


if __name__ == "__main__":
    main()
