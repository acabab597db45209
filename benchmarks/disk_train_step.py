"""memtrain's step with its product-key values on a disk table about 8x its cache, against the
same table in RAM: the runs side by side in one process, round robin in blocks of steps as in
benchmarks.train_step (same warm-up rules), on one local cluster of 2 shards.

The disk run is `memtrain --tier disk --cache-bytes` (the rows' records / --ratio; records as one
rows-sharded slice lays them out: a cols table's records on 2 shards are a header longer, ~1.5%
more file). The cache's hit rate and disk reads come from the shards' status at the end.

    python -m benchmarks.disk_train_step [--blocks 4 --block 11 --warmup 3 --ratio 8 --n-keys 128]
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import local_cluster, round_robin_steps
from memserver.core.disk import MIN_CACHE_BYTES, record_layout


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--block", type=int, default=11)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--ratio", type=int, default=8, help="file bytes / cache bytes")
    p.add_argument("--n-keys", type=int, default=128, help="memtrain's --n-keys (n_keys^2 rows)")
    args = p.parse_args(argv)
    from client import MemoryClient
    from trainer.train import build_parser, train

    cache = max(4 * MIN_CACHE_BYTES, args.n_keys**2 * record_layout(128, "adam")[0] // args.ratio)  # memtrain: d=128, adam
    runs = {"remote RAM table": ["--table", "bench-ram"],
            f"remote disk table, cache 1/{args.ratio}": ["--table", "bench-disk", "--tier", "disk", "--cache-bytes", str(cache)]}
    total = args.blocks * args.block
    with local_cluster(2) as cluster, MemoryClient(cluster.endpoint, timeout=300) as client:
        gens = {}
        for n, extra in runs.items():
            run_argv = ["--memory", "remote", "--n-keys", str(args.n_keys), "--steps", str(total + 1000),
                        "--eval-every", "1000000", "--log-every", "1", *extra]
            gens[n] = train(build_parser().parse_args(run_argv), client=client)
        try:
            step_ms = round_robin_steps(gens, args.blocks, args.block, args.warmup)
            disk: dict[str, int] = {}
            for shard in client.status().shards:  # the disk table's cache, summed over its slices
                for t in shard.tables:
                    if t.tier == "disk":
                        for k in ("cache_hits", "cache_misses", "cache_evictions", "disk_reads", "disk_writes"):
                            disk[k] = disk.get(k, 0) + getattr(t, k)
        finally:
            for gen in gens.values():
                gen.close()
    print(f"memtrain defaults, --n-keys {args.n_keys} ({args.n_keys ** 2:,} rows x 128, adam), 2 shards; "
          f"{args.blocks} blocks of {args.block} steps round robin, {time.strftime('%Y-%m-%d %H:%M')}")
    ms = {n: statistics.median(v) for n, v in step_ms.items()}
    ram = next(iter(ms.values()))
    for n, v in ms.items():
        print(f"  {n:>32}: p50 {v:8.1f} ms/step, min {min(step_ms[n]):8.1f} ({len(step_ms[n])} steps)  "
              f"{v / ram:5.2f}x the RAM table's")
    if disk:
        seen = disk["cache_hits"] + disk["cache_misses"]
        print(f"  disk cache: hit rate {disk['cache_hits'] / max(1, seen):.1%} of distinct rows per call, "
              f"{disk['cache_evictions']:,} evictions, {disk['disk_reads']:,} rows read, {disk['disk_writes']:,} written")


if __name__ == "__main__":
    main()
