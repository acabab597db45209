"""Rows vs cols sharding: time and bytes of lookup, bag and bag_backward over 2 shards.

Decides the default sharding mode (docs/architecture.md). Ids are uniform, or Zipf-skewed
(s=1.1) as memory-layer accesses are. Baseline: 1 shard (no fan-out) in the same run.

    python -m benchmarks.sharding [--rows 262144 --dim 256 --batch 4096 --knn 32]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks.common import local_cluster, machine, timeit


def zipf_ids(rng: np.random.Generator, n: int, shape: tuple[int, ...], s: float = 1.1) -> np.ndarray:
    ranks = np.arange(1, n + 1, dtype=np.float64)
    p = ranks**-s
    p /= p.sum()
    perm = rng.permutation(n)  # hot slots scattered over the id space
    return perm[rng.choice(n, size=shape, p=p)]


def bytes_per_call(sharding: str, shards: int, batch: int, knn: int, dim: int) -> dict[str, int]:
    """Request + response payload bytes (ids travel as int32, weights/values as float32)."""
    ids_w = batch * knn * (4 + 4)
    if sharding == "cols":
        return {"bag": shards * ids_w + batch * dim * 4, "bag_backward": shards * ids_w + batch * dim * 4 + shards * batch * knn * 4}
    return {"bag": ids_w + shards * batch * 8 + shards * batch * dim * 4,
            "bag_backward": ids_w + shards * batch * 8 + shards * batch * dim * 4 + batch * knn * 4}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=262144)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--knn", type=int, default=32)
    p.add_argument("--repeat", type=int, default=8)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    dists = {"uniform": rng.integers(0, args.rows, (args.batch, args.knn)), "zipf": zipf_ids(rng, args.rows, (args.batch, args.knn))}
    w = rng.random((args.batch, args.knn)).astype(np.float32)
    g = rng.normal(size=(args.batch, args.dim)).astype(np.float32)
    results = []
    from client import MemoryClient

    with local_cluster(2) as cluster, MemoryClient(cluster.endpoint) as client:
        for sharding, shards in (("rows", 1), ("rows", 2), ("cols", 2)):
            name = f"shard-bench-{sharding}-{shards}"
            client.create_table(name, args.rows, args.dim, sharding=sharding, num_shards=shards, optimizer="adagrad")
            for dist, ids in dists.items():
                row = {"sharding": sharding, "shards": shards, "ids": dist}
                row["bag"] = timeit(lambda name=name, ids=ids: client.bag(name, ids, w), repeat=args.repeat)["p50_ms"]
                row["bag_backward"] = timeit(lambda name=name, ids=ids: client.bag_backward(name, ids, w, g), repeat=args.repeat)["p50_ms"]
                row["lookup"] = timeit(lambda name=name, ids=ids: client.lookup(name, ids[:256]), repeat=args.repeat)["p50_ms"]
                row["bytes"] = bytes_per_call(sharding, shards, args.batch, args.knn, args.dim)
                results.append(row)
            client.drop_table(name)
    out = {"benchmark": "sharding", "config": vars(args), "machine": machine(), "results": results}
    if args.json:
        print(json.dumps(out, indent=2))
        return out
    base = {r["ids"]: r for r in results if r["shards"] == 1}
    t = Table(title=f"rows vs cols: {args.rows:,} x {args.dim}, B={args.batch}, knn={args.knn} (p50 ms; x = vs 1 shard)")
    for col in ("sharding", "shards", "ids", "bag ms", "bag x", "bag MB", "bag_backward ms", "bwd x", "bwd MB", "lookup(256x32) ms"):
        t.add_column(col, justify="right")
    for r in results:
        b = base[r["ids"]]
        t.add_row(r["sharding"], str(r["shards"]), r["ids"], f"{r['bag']:.1f}", f"{b['bag'] / r['bag']:.2f}",
                  f"{r['bytes']['bag'] / 1e6:.1f}", f"{r['bag_backward']:.1f}", f"{b['bag_backward'] / r['bag_backward']:.2f}",
                  f"{r['bytes']['bag_backward'] / 1e6:.1f}", f"{r['lookup']:.1f}")
    Console(width=160).print(t)
    return out


if __name__ == "__main__":
    main()
