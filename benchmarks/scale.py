"""Scale: the paper's memory (1024^2 slots x 1024 dims = 4 GiB of float32, row-wise adagrad) over
4 shards on this machine, with the trainer process staying small.

The point of memserver is a memory larger than the trainer can hold. This creates the table in a
4-shard cluster, times its creation, bag throughput and one bag_backward (the update path at full
size), and reports this (the trainer) process's peak RSS (getrusage ru_maxrss) against the table
size: values and optimizer state live in the shard processes only. Baselines in the same run:
the machine's copy bandwidth (the floor of the shards' gather: B x knn x dim x 4 bytes read) and
this process's RSS before the table existed.

    python -m benchmarks.scale [--rows 1048576 --dim 1024 --shards 4 --batch 4096 --knn 32]
    python -m benchmarks.scale --quick          # 262,144 x 256

Memory: the table and its optimizer state (adagrad: one float per row per shard) plus per-slot
statistics (32 bytes per row per shard) live in the shards: about 4.2 GiB at the default size.
Run it in its own process (benchmarks.run does): ru_maxrss is the peak over the process's life.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks.common import (
    copy_bandwidth_gbs,
    local_cluster,
    machine,
    peak_rss_bytes,
    summarize,
    target,
    vm_hwm_bytes,
)

#: Target: the trainer's peak RSS at most this fraction of the table's bytes (full size). In
#: --quick mode the table (256 MiB) is smaller than Python + torch + Ray, so the RSS growth is
#: reported instead, for information only: it is the per-call buffers (~B x dim floats), which
#: do not grow with the table.
TARGET = 0.25
QUICK = (262144, 256)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1 << 20)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--sharding", choices=["rows", "cols"], default="cols")
    p.add_argument("--optimizer", default="adagrad")
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--knn", type=int, default=32)
    p.add_argument("--repeat", type=int, default=6)
    p.add_argument("--quick", action="store_true", help=f"{QUICK[0]:,} x {QUICK[1]} instead of --rows/--dim")
    p.add_argument("--json", action="store_true")
    p.add_argument("--json-out", help="also write the result here (benchmarks.run runs this in a child process)")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.dim = QUICK
    from client import MemoryClient

    table_bytes = args.rows * args.dim * 4
    rng = np.random.default_rng(0)
    ids = rng.integers(0, args.rows, (args.batch, args.knn))
    w = rng.random((args.batch, args.knn), dtype=np.float32)
    g = rng.normal(size=(args.batch, args.dim)).astype(np.float32)
    rss_start, hwm_start = peak_rss_bytes(), vm_hwm_bytes()
    if hwm_start and rss_start > 2 * hwm_start:
        print(f"note: ru_maxrss starts at {rss_start / 2**20:.0f} MiB, inherited from the parent process (Linux keeps it "
              "across fork + exec); run this from a shell or through benchmarks.run")
    with local_cluster(args.shards) as cluster, MemoryClient(cluster.endpoint, timeout=3600) as client:
        rss_before = peak_rss_bytes()
        t0 = time.perf_counter()
        meta = client.create_table("bench-scale", args.rows, args.dim, sharding=args.sharding, num_shards=args.shards,
                                   optimizer=args.optimizer, init_std=0.02, seed=0)
        create_s = time.perf_counter() - t0
        status = client.status()
        shard_bytes = [t.bytes for sh in status.shards for t in sh.tables if t.table == "bench-scale"]
        times = []
        client.bag("bench-scale", ids, w)  # warm-up
        t_end = time.perf_counter() + 120
        for _ in range(args.repeat):
            if time.perf_counter() > t_end:
                break
            t1 = time.perf_counter()
            out = client.bag("bench-scale", ids, w)
            times.append((time.perf_counter() - t1) * 1e3)
        bag = summarize(times)
        client.bag_backward("bench-scale", ids, w, g)  # warm-up: the shards load their compiled kernels
        bwd_times = []
        for _ in range(3):
            t1 = time.perf_counter()
            client.bag_backward("bench-scale", ids, w, g)
            bwd_times.append((time.perf_counter() - t1) * 1e3)
        backward_ms = summarize(bwd_times)["p50_ms"]
        assert out.shape == (args.batch, args.dim) and np.isfinite(out).all()
        client.drop_table("bench-scale")
        rss_peak, hwm_peak = peak_rss_bytes(), vm_hwm_bytes()
    bw = copy_bandwidth_gbs()  # after the RSS reading: it allocates 512 MiB here
    gathered = args.batch * args.knn * args.dim * 4
    wire = args.shards * args.batch * args.knn * 8 + args.batch * args.dim * 4
    full = not args.quick
    rss_ratio = rss_peak / table_bytes if full else (rss_peak - rss_before) / table_bytes
    res = {
        "rows": args.rows, "dim": args.dim, "shards": args.shards, "sharding": meta.sharding, "table_bytes": table_bytes,
        "shard_bytes": shard_bytes, "create_s": create_s, "bag": bag, "bag_qps": args.batch / bag["p50_ms"] * 1e3,
        "bag_backward_ms": backward_ms, "gathered_bytes": gathered, "wire_bytes": wire, "copy_bandwidth_gbs": bw,
        "gather_floor_ms": gathered / (bw * 1e9) * 1e3, "rss_at_start": rss_start, "rss_before_table": rss_before,
        "rss_peak": rss_peak, "rss_ratio": rss_ratio, "vm_hwm_start": hwm_start, "vm_hwm_peak": hwm_peak,
    }
    what = "trainer peak RSS / table bytes" if full else "trainer RSS growth / table bytes"
    targets = [target("scale", f"{what}, {args.rows:,} x {args.dim}", rss_ratio, TARGET, higher_is_better=False)]
    if not full:  # the growth is per-call buffers (~B x dim floats), not the table: not a test at this size
        targets[0]["pass"] = None
    out_d = {"benchmark": "scale", "config": vars(args), "machine": machine(), "results": res, "targets": targets}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out_d, f, indent=2)
    if args.json:
        print(json.dumps(out_d, indent=2))
        return out_d
    tbl = Table(title=f"scale: {args.rows:,} x {args.dim} float32 ({table_bytes / 2**30:.2f} GiB), {args.optimizer}, "
                      f"{args.shards} shards {meta.sharding}; bag B={args.batch}, knn={args.knn}")
    for col in ("create s", "bag p50 ms", "bag q/s", "gather floor ms", "bag_backward ms", "shard MiB",
                "trainer peak RSS MiB", "RSS growth MiB", "ratio"):
        tbl.add_column(col, justify="right")
    tbl.add_row(f"{create_s:.1f}", f"{bag['p50_ms']:.1f}", f"{res['bag_qps']:,.0f}", f"{res['gather_floor_ms']:.1f}",
                f"{backward_ms:.0f}", " | ".join(f"{b / 2**20:.0f}" for b in shard_bytes), f"{rss_peak / 2**20:.0f}",
                f"{(rss_peak - rss_before) / 2**20:.0f}", f"{rss_ratio:.3f}")
    Console(width=180).print(tbl)
    return out_d


if __name__ == "__main__":
    main()
