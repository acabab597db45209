"""Bag throughput: remote `client.bag` against in-process `F.embedding_bag` on the same table.

The question a trainer asks: how much of the in-process speed do I keep when the values live in
the cluster? Both sides compute the same weighted bags (same rows, dim, ids and weights; the
remote result is checked equal to the local one). Remote: 1 and 2 shards, `rows` and `cols`
sharding. Baseline: `torch.nn.functional.embedding_bag(mode="sum", per_sample_weights=...)` in
this process with torch's default threads, timed interleaved with each remote configuration so
both see the same background load. Bytes moved per call are printed per shard, with the machine's
copy bandwidth, so each figure can be read against its limit.

    python -m benchmarks.bag_throughput [--tables 262144x256,65536x1024 --batch 4096 --knn 32] [--quick]

Tables: 262,144 rows at d=256 and 65,536 rows at d=1024 (both 256 MiB of float32 values).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from benchmarks.common import copy_bandwidth_gbs, latencies, local_cluster, machine, target

#: Target: remote throughput at least this fraction of in-process (ratio remote/in-process).
TARGET = 0.5


def shard_bytes(sharding: str, shards: int, ids: np.ndarray, dim: int) -> list[dict[str, int]]:
    """Request (ids int32 + weights float32 [+ int64 offsets]) and response (float32) bytes of one
    bag call, per shard, as the client routes it."""
    b, k = ids.shape
    if shards == 1 or sharding == "cols":
        return [{"request": b * k * (4 + 4), "response": b * (dim * (i + 1) // shards - dim * i // shards) * 4}
                for i in range(shards)]
    owner = ids % shards
    return [{"request": int((owner == i).sum()) * (4 + 4) + b * 8, "response": b * dim * 4} for i in range(shards)]


def configs(quick: bool) -> list[tuple[int, str]]:
    """(shards, sharding). With 1 shard both modes send the whole batch to that shard (the same
    path); quick mode measures it once."""
    one = [(1, "cols")] if quick else [(1, "rows"), (1, "cols")]
    return [*one, (2, "rows"), (2, "cols")]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", default="262144x256,65536x1024", help="comma-separated ROWSxDIM")
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--knn", type=int, default=32)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--max-seconds", type=float, default=20.0, help="time bound per configuration")
    p.add_argument("--quick", action="store_true", help="first table only, 1-shard once, fewer repeats")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from client import MemoryClient
    from memserver.core.init import init_values

    tables = [tuple(int(x) for x in t.split("x")) for t in args.tables.split(",")]
    if args.quick:
        tables, args.repeat, args.max_seconds = tables[:1], min(args.repeat, 6), min(args.max_seconds, 10.0)
    bw = copy_bandwidth_gbs()
    rng = np.random.default_rng(0)
    results: list[dict[str, Any]] = []
    with local_cluster(2) as cluster, MemoryClient(cluster.endpoint, timeout=600) as client:
        for rows, dim in tables:
            weight = init_values(np.arange(rows), 0, dim, dim, 0.02, 0)  # the same values the shards create
            ids = torch.from_numpy(rng.integers(0, rows, (args.batch, args.knn)))
            w = torch.from_numpy(rng.random((args.batch, args.knn), dtype=np.float32))
            expect = F.embedding_bag(ids, weight, None, mode="sum", per_sample_weights=w)
            gathered = args.batch * args.knn * dim * 4  # bytes of rows the gather reads, wherever it runs
            for shards, sharding in configs(args.quick):
                name = f"bench-bag-{rows}x{dim}-{sharding}-{shards}"
                client.create_table(name, rows, dim, sharding=sharding, num_shards=shards, init_std=0.02, seed=0)
                got = client.bag(name, ids, w)
                match = bool(torch.allclose(got, expect, rtol=1e-4, atol=1e-5))
                t = latencies(
                    {"local": lambda ids=ids, w=w, wt=weight: F.embedding_bag(ids, wt, None, mode="sum", per_sample_weights=w),
                     "remote": lambda name=name, ids=ids, w=w: client.bag(name, ids, w)},
                    repeat=args.repeat, warmup=2, max_seconds=args.max_seconds,
                )
                client.drop_table(name)
                per_shard = shard_bytes(sharding, shards, ids.numpy(), dim)
                wire = sum(s["request"] + s["response"] for s in per_shard)
                local_ms, remote_ms = t["local"]["p50_ms"], t["remote"]["p50_ms"]
                results.append({
                    "rows": rows, "dim": dim, "shards": shards, "sharding": sharding, "match": match,
                    "local_ms": local_ms, "remote_ms": remote_ms,
                    "local_qps": args.batch / local_ms * 1e3, "remote_qps": args.batch / remote_ms * 1e3,
                    "ratio": local_ms / remote_ms, "per_shard_bytes": per_shard, "wire_bytes": wire,
                    "gathered_bytes": gathered,
                    # one pass over the bytes at copy bandwidth: the floor of each side's memory traffic
                    "wire_floor_ms": wire / (bw * 1e9) * 1e3, "gather_floor_ms": gathered / (bw * 1e9) * 1e3,
                    "timings": t,
                })
    cols2 = [r for r in results if r["shards"] == 2 and r["sharding"] == "cols"]
    worst = min(results, key=lambda r: r["ratio"])
    targets = [target("bag_throughput", f"remote/in-process q/s, {r['rows']:,}x{r['dim']}, 2 shards cols (default)",
                      r["ratio"], TARGET) for r in cols2]
    targets.append(target("bag_throughput", f"worst config ({worst['shards']} shard {worst['sharding']}, d={worst['dim']})",
                          worst["ratio"], TARGET))
    out = {"benchmark": "bag_throughput", "config": vars(args), "machine": machine(), "copy_bandwidth_gbs": bw,
           "torch_threads": torch.get_num_threads(), "results": results, "targets": targets}
    if args.json:
        print(json.dumps(out, indent=2))
        return out
    tbl = Table(title=f"bag: remote vs in-process embedding_bag, B={args.batch}, knn={args.knn}, p50 "
                      f"(in-process: {torch.get_num_threads()} torch threads; shards: 1 thread each; copy bandwidth "
                      f"{bw:.1f} GB/s)")
    for col in ("table", "shards", "sharding", "in-process ms", "remote ms", "in-proc q/s", "remote q/s",
                "remote/in-proc", "req+resp MB per shard", "wire floor ms", "gather floor ms", "equal"):
        tbl.add_column(col, justify="right")
    for r in results:
        per = " | ".join(f"{s['request'] / 1e6:.2f}+{s['response'] / 1e6:.2f}" for s in r["per_shard_bytes"])
        tbl.add_row(f"{r['rows']:,}x{r['dim']}", str(r["shards"]), r["sharding"], f"{r['local_ms']:.1f}",
                    f"{r['remote_ms']:.1f}", f"{r['local_qps']:,.0f}", f"{r['remote_qps']:,.0f}", f"{r['ratio']:.2f}x",
                    per, f"{r['wire_floor_ms']:.2f}", f"{r['gather_floor_ms']:.1f}", "yes" if r["match"] else "NO")
    Console(width=200).print(tbl)
    return out


if __name__ == "__main__":
    main()
