"""How long a training call waits while someone inspects the table: a small lookup's latency on
one shard alone, and while another client loops `usage` and `top` over the same slice (what the
inspection page asks on every table view).

A shard scans a slice for `top` and `usage` in chunks of ValueTable.STAT_CHUNK rows, each its own
work item, so a call queued behind a scan waits for about one chunk, not the whole slice. The
figure to read is the ratio of the lookup's p50 and p99 during the scans to alone, at two table
sizes: with chunking it should not grow with the table.

    python -m benchmarks.scan_stall [--rows 1048576,4194304] [--dim 8] [--calls 200]

Runs a shard and its coordinator in this process (memserver.cluster.inprocess, no Ray), the
client over TCP (shm off, so the calls queue on the shard's compute thread as a remote
trainer's do). Each phase is bounded in calls and in time.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import numpy as np


def _p(ms: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(ms), q))


def measure(rows: int, dim: int, calls: int) -> dict[str, float]:
    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    with InProcessServer(1) as server, MemoryClient(server.endpoint, timeout=120, shm=False) as c, \
            MemoryClient(server.endpoint, timeout=120, shm=False) as inspector:
        c.create_table("scan", rows, dim, sharding="rows", optimizer="sgd")
        c.bag("scan", np.random.default_rng(0).integers(0, rows, (512, 32)), np.ones((512, 32), np.float32))
        ids = np.arange(4)

        def lookups() -> list[float]:
            out = []
            deadline = time.monotonic() + 120
            for _ in range(calls):
                t0 = time.perf_counter()
                c.lookup("scan", ids, count=False)
                out.append(1e3 * (time.perf_counter() - t0))
                time.sleep(0.002)  # calls spread over the scans
                if time.monotonic() > deadline:
                    break
            return out

        alone = lookups()
        stop = threading.Event()
        scans = [0]

        def inspect() -> None:
            while not stop.is_set() and scans[0] < 10_000:
                inspector.usage("scan")
                inspector.top_slots("scan", "hits", 20)
                scans[0] += 1

        t = threading.Thread(target=inspect)
        t.start()
        try:
            during = lookups()
        finally:
            stop.set()
            t.join(timeout=300)
        t0 = time.perf_counter()
        inspector.usage("scan")
        scan_ms = 1e3 * (time.perf_counter() - t0)
        c.drop_table("scan")
    return {"rows": rows, "usage_ms": scan_ms, "scans": scans[0], "alone_p50": _p(alone, 50), "alone_p99": _p(alone, 99),
            "during_p50": _p(during, 50), "during_p99": _p(during, 99)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1048576,4194304", help="table sizes, comma separated")
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--calls", type=int, default=200, help="lookups per phase")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    results = [measure(int(r), args.dim, args.calls) for r in args.rows.split(",")]
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print("| rows | one usage call ms | lookup p50 alone | p50 during scans | x | p99 alone | p99 during scans | x |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(f"| {r['rows']:,} | {r['usage_ms']:.0f} | {r['alone_p50']:.2f} | {r['during_p50']:.2f} | "
              f"{r['during_p50'] / r['alone_p50']:.1f}x | {r['alone_p99']:.2f} | {r['during_p99']:.2f} | "
              f"{r['during_p99'] / r['alone_p99']:.1f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
