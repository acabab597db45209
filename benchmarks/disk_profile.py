"""Where a disk-tier bag's time goes: one `DiskTable.bag` call split into its stages, p50 over
calls drawn Zipf-like, beside the same table in RAM, both on the same threads (`--threads`,
torch's and numba's). The stages: `_read_rows` (where each id's row is), itself in three (the
pass over the ids: hash probes, pins, the sketch's counts, the read counters; `_read_ahead`'s
look at whether the misses' pages are in memory (mincore; here they are, so no more); the
misses' checksums; their placement: CLOCK's sweep, TinyLFU, evictions, records copied into slots),
counted inside the kernel by the CPU's cycle counter (disk._T_IDS ...), converted to ms at the
counter's rate measured here; then the sum `_bag_sum`, from the cache slots and the file's
mapping. A profile, not a benchmark.

    python -m benchmarks.disk_profile [--rows 400000 --dim 64 --zipf 1.0 --calls 30 --warm 40 --threads 1]

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
from memserver.core.table import ValueTable, set_threads

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
    p.add_argument("--threads", type=int, default=1, help="torch and numba threads (a shard's compute thread's)")
    args = p.parse_args(argv)
    set_threads(args.threads)
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
        disk._read_rows, disk._bag_sum = timed("_read_rows (read pass)", disk._read_rows), timed("_bag_sum", disk._bag_sum)
        t._check_file = timed("_check_file (stat, fstat)", t._check_file)
        distinct: list[int] = []
        stages = ("the ids (probe, pin, count)", "the look for cold pages", "the misses' checksums",
                  "placing the misses")
        ticks = [disk._T_IDS, disk._T_AHEAD, disk._T_CHECK, disk._T_PLACE]
        disk.ticks()  # compiled before the clock starts
        t0, c0 = time.perf_counter(), disk.ticks()
        for ids in calls[args.warm :]:
            timed("RAM table bag", ram.bag)(ids, w)
            before = t._st[ticks].copy()
            timed("disk table bag (whole call)", t.bag)(ids, w)
            for name, n in zip(stages, t._st[ticks] - before):
                TIMES[name].append(float(n))
            distinct.append(len(np.unique(ids.numpy())))
        rate = (disk.ticks() - c0) / (time.perf_counter() - t0)  # counter ticks a second
        for name in stages:
            TIMES[name] = [n / rate for n in TIMES[name]] if rate > 0 else [float("nan")]
        t.close()
    print(f"{args.rows:,} rows x {args.dim}, cache 1/{args.ratio}, zipf {args.zipf}, {args.bags} x {args.ids} ids "
          f"(~{statistics.median(distinct):,.0f} distinct rows a call), p50 ms over {args.calls} calls:")
    p50 = {name: 1e3 * statistics.median(v) for name, v in TIMES.items()}
    for name, ms in p50.items():
        print(f"  {'  ' + name if name in stages else name:>32}: {ms:7.3f}")
    rest = p50["disk table bag (whole call)"] - sum(p50[k] for k in ("_read_rows (read pass)", "_bag_sum",
                                                                      "_check_file (stat, fstat)"))
    print(f"  {'the rest (Python, arguments)':>32}: {rest:7.3f}  (the whole call less the stages above)")
    s = t.cache_stats()
    print(f"  hit rate {s['hits'] / max(1, s['hits'] + s['misses']):.3f} (distinct rows of a call found in the cache), "
          f"disk / RAM q/s {p50['RAM table bag'] / p50['disk table bag (whole call)']:.2f}x")


if __name__ == "__main__":
    main()
