"""memtrain's step with its memory values on a disk table about 8x its cache, against the same
table in RAM: the runs side by side in one process, round robin in blocks of steps as in
benchmarks.train_step (same warm-up rules), on one local cluster of 2 shards.

The disk runs are `memtrain --tier disk --cache-bytes` (the rows' records / --ratio; records as
one rows-sharded slice lays them out: a cols table's records on 2 shards are a header longer,
~1.5% more file). The cache's hit rate and disk reads come from the shards' status at the end.

`--memory-kind engram` measures the token-addressed layer, whose reads of step t+1 memtrain sends
while step t computes (its prefetch), and hints the shards at those rows once step t's forward is done, so a disk table
reads their pages ahead (`warm`): the runs are then the RAM table, the disk table, the disk
table with `--no-warm` (the prefetch alone) and with `--no-prefetch` (neither: its reads sent
when the forward reaches the layer), so each one's share of hiding the device is measured
beside the RAM table.

`--page-cache MIB` makes the file larger than the shards' memory: once the RAM runs' tables
exist, each shard process joins a memory cgroup (tests/memlimit.py) that holds its share of the
disk tables' caches and read counters, MIB of page cache and `--headroom` MiB of temporaries; the
disk tables are created after that, so their files' pages count there and the kernel must read
evicted ones again from the device (without it, this machine's page cache holds the whole file).

    python -m benchmarks.disk_train_step [--blocks 4 --block 11 --warmup 3 --ratio 8 --n-keys 128]
    python -m benchmarks.disk_train_step --memory-kind engram --engram-slots 2097152 --engram-orders 2,3,4 \\
        --engram-dim 64 --page-cache 64
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Any

from benchmarks.common import local_cluster, round_robin_steps
from memserver.core.disk import COUNTER_BYTES, MIN_CACHE_BYTES, record_layout


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--block", type=int, default=11)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--ratio", type=int, default=8, help="file bytes / cache bytes")
    p.add_argument("--memory-kind", choices=["pkm", "engram"], default="pkm")
    p.add_argument("--n-keys", type=int, default=128, help="pkm: memtrain's --n-keys (n_keys^2 rows, d=128)")
    p.add_argument("--engram-slots", type=int, default=1 << 21, help="engram: memtrain's --engram-slots")
    p.add_argument("--engram-orders", default="2,3,4", help="engram: memtrain's --engram-orders")
    p.add_argument("--engram-dim", type=int, default=64, help="engram: memtrain's --engram-dim")
    p.add_argument("--page-cache", type=int, default=0, metavar="MIB",
                   help="each shard's page cache for the disk tables' files, in a memory cgroup (0: no limit)")
    p.add_argument("--headroom", type=int, default=192, metavar="MIB",
                   help="--page-cache: each shard's group also holds this much for calls' temporaries")
    p.add_argument("--threads", type=int, default=0,
                   help="memtrain's --threads, the trainer's torch threads (0: torch's default; 1 leaves a core to the "
                        "shards on a 2-core machine)")
    args = p.parse_args(argv)
    from client import MemoryClient
    from trainer.train import build_parser, train

    if args.memory_kind == "pkm":
        rows, dim = args.n_keys**2, 128
        kind = ["--n-keys", str(args.n_keys)]
    else:
        segments = len(args.engram_orders.split(",")) * build_parser().get_default("engram_heads")
        rows, dim = args.engram_slots - args.engram_slots % segments, args.engram_dim
        kind = ["--memory-kind", "engram", "--engram-slots", str(args.engram_slots), "--engram-orders",
                args.engram_orders, "--engram-dim", str(args.engram_dim)]
    record = record_layout(dim, "adam")[0]  # memtrain's values: adam
    cache = max(4 * MIN_CACHE_BYTES, rows * record // args.ratio)
    disk = ["--tier", "disk", "--cache-bytes", str(cache)]
    runs = {"RAM table": (["--table", "bench-ram"], False)}
    runs[f"disk table, cache 1/{args.ratio}"] = (["--table", "bench-disk", *disk], True)
    if args.memory_kind == "engram":
        runs[f"disk table, cache 1/{args.ratio}, --no-warm"] = (["--table", "bench-disk-nw", "--no-warm", *disk], True)
        runs[f"disk table, cache 1/{args.ratio}, --no-prefetch"] = (["--table", "bench-disk-np", "--no-prefetch", *disk],
                                                                    True)
    total = args.blocks * args.block
    print(f"memtrain defaults, {args.memory_kind} ({rows:,} rows x {dim}, adam, {rows * record / 2**20:,.0f} MiB of "
          f"records), 2 shards; cache {cache / 2**20:,.0f} MiB a disk table"
          + (f"; each shard in a memory cgroup with {args.page_cache} MiB of page cache" if args.page_cache else ""))
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(local_cluster(2))
        client = stack.enter_context(MemoryClient(cluster.endpoint, timeout=300))
        gens: dict[str, Any] = {}

        def start(n: str) -> None:
            run_argv = ["--memory", "remote", *kind, "--steps", str(total + 1000), "--eval-every", "1000000",
                        "--log-every", "1", "--threads", str(args.threads), *runs[n][0]]
            gens[n] = train(build_parser().parse_args(run_argv), client=client)
            stack.callback(gens[n].close)
            next(gens[n])  # its table created now (the first step, inside round robin's warm-up anyway)

        for n, (_, on_disk) in runs.items():
            if not on_disk:
                start(n)
        limits = []
        if args.page_cache:
            from tests.memlimit import MemoryLimit

            disks = sum(on for _, on in runs.values())
            per_shard = disks * (cache // 2 + rows * COUNTER_BYTES) + (args.page_cache + args.headroom) * 2**20
            for shard in client.status().shards:
                limits.append(stack.enter_context(MemoryLimit(per_shard, name="disk-train-step")))
                limits[-1].add(shard.pid)
            print(f"  each shard's group: {per_shard / 2**20:,.0f} MiB (caches, counters, page cache, headroom)")
        for n, (_, on_disk) in runs.items():
            if on_disk:
                start(n)
        faults0 = [g.major_faults() for g in limits]  # the tables' creation faulted their files in: not counted
        layer = "engram2_read_ms" if args.memory_kind == "engram" else "mem2_read_ms"  # memtrain's --mem-layers 2
        counted = round_robin_steps(gens, args.blocks, args.block, args.warmup, key=f"step_ms,{layer}")
        step_ms = {n: [s for s, _ in v] for n, v in counted.items()}
        reads = {n: [r for _, r in v] for n, v in counted.items()}  # the forward's ms on its reads, same steps
        tables: dict[str, dict[str, int]] = {}
        for shard in client.status().shards:  # each disk table's cache, summed over its slices
            for t in shard.tables:
                if t.tier == "disk":
                    c = tables.setdefault(t.table, {})
                    for k in ("cache_hits", "cache_misses", "cache_evictions", "disk_reads", "disk_writes"):
                        c[k] = c.get(k, 0) + getattr(t, k)
        groups = [(g.peak(), g.major_faults() - f0, g.stat()) for g, f0 in zip(limits, faults0)]
    print(f"  {args.blocks} blocks of {args.block} steps round robin, {time.strftime('%Y-%m-%d %H:%M')}")
    ms = {n: statistics.median(v) for n, v in step_ms.items()}
    ram = next(iter(ms.values()))
    for n, v in ms.items():
        print(f"  {n:>44}: p50 {v:8.1f} ms/step, min {min(step_ms[n]):8.1f} ({len(step_ms[n])} steps)  "
              f"{v / ram:5.2f}x the RAM table's; its forward's reads p50 {statistics.median(reads[n]):6.1f} ms/step")
    for name, c in tables.items():
        seen = c["cache_hits"] + c["cache_misses"]
        print(f"  {name}: hit rate {c['cache_hits'] / max(1, seen):.1%} of distinct rows per call, "
              f"{c['cache_evictions']:,} evictions, {c['disk_reads']:,} rows read, {c['disk_writes']:,} written")
    for i, (peak, faults, stat) in enumerate(groups):
        print(f"  shard {i}'s group: peak {peak / 2**20:,.0f} MiB, {faults:,} major faults during the steps, "
              f"page cache {stat.get('total_cache', stat.get('file', 0)) / 2**20:,.0f} MiB at the end")


if __name__ == "__main__":
    main()
