"""Where a disk-tier bag's time goes: one `DiskTable.bag` call split into its stages (read
counters, distinct rows, the cache's bookkeeping `_resolve`, the record copy `_copy_records`, the
sum), p50 over calls drawn Zipf-like, beside the same table in RAM. A profile, not a benchmark.

    python -m benchmarks.disk_profile [--rows 400000 --dim 64 --zipf 1.0 --calls 30 --warm 40]

docs/benchmarks.md ("Disk tier") quotes it.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import memserver.core.disk as disk
from benchmarks.disk_tier import zipf_sampler
from memserver.core.optim import OptimizerConfig
from memserver.core.table import ValueTable

TIMES: dict[str, list[float]] = collections.defaultdict(list)


def timed(name: str, fn: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        TIMES[name].append(time.perf_counter() - t0)
        return out

    return run


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=400_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--ratio", type=int, default=8, help="file bytes / cache bytes")
    p.add_argument("--zipf", type=float, default=1.0, help="exponent (0: uniform)")
    p.add_argument("--bags", type=int, default=512)
    p.add_argument("--ids", type=int, default=32)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--warm", type=int, default=40)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = OptimizerConfig("adagrad", 0.01)
    with tempfile.TemporaryDirectory(prefix="disk-profile-") as work:
        record, _ = disk.record_layout(args.dim, cfg.name)
        t = disk.DiskTable(Path(work) / "t", args.rows, args.dim, cfg, cache_bytes=args.rows * record // args.ratio,
                           seed=1, name="profile")
        ram = ValueTable(args.rows, args.dim, cfg, seed=1, track_stats=True)
        draw = zipf_sampler(args.rows, args.zipf, np.random.default_rng(0))
        w = torch.rand(args.bags, args.ids)
        calls = [torch.from_numpy(draw(args.bags * args.ids).reshape(args.bags, args.ids))
                 for _ in range(args.warm + args.calls)]
        for ids in calls[: args.warm]:
            t.bag(ids, w)
        disk._resolve, disk._copy_records = timed("_resolve", disk._resolve), timed("_copy_records", disk._copy_records)
        t._count_reads, t._distinct = timed("read counters", t._count_reads), timed("distinct rows", t._distinct)
        t._gather = timed("_gather (resolve + copy + rest)", t._gather)
        distinct: list[int] = []
        for ids in calls[args.warm :]:
            timed("RAM table bag", ram.bag)(ids, w)
            timed("disk table bag (whole call)", t.bag)(ids, w)
            distinct.append(len(np.unique(ids.numpy())))
        t.close()
    print(f"{args.rows:,} rows x {args.dim}, cache 1/{args.ratio}, zipf {args.zipf}, {args.bags} x {args.ids} ids "
          f"(~{statistics.median(distinct):,.0f} distinct rows a call), p50 ms over {args.calls} calls:")
    p50 = {name: 1e3 * statistics.median(v) for name, v in TIMES.items()}
    for name, ms in p50.items():
        print(f"  {name:>32}: {ms:7.3f}")
    rest = p50["disk table bag (whole call)"] - sum(p50[k] for k in ("read counters", "distinct rows",
                                                                      "_gather (resolve + copy + rest)"))
    print(f"  {'the sum (weights copy + bag)':>32}: {rest:7.3f}  (the whole call less the stages above)")


if __name__ == "__main__":
    main()
