"""The disk tier: a table 8x its cache against the same table in RAM, in the same run.

For each read distribution (Zipf 1.0 and 1.2 over the rows, ranks scattered by a random
permutation, uniform, and the reads of a trained memtrain layer: `trained_reads`), `bag` and `bag_backward` (adagrad) on a `DiskTable` whose cache is
1/8 of its file and on a `ValueTable` of the same spec, alternating call by call so both share the
machine's load: calls/s, queries (bags)/s, p99, and the cache's hit rate (distinct rows of a call
found in the cache). Uniform reads are bounded by the disk: their row reads per second are set
against the disk's own random read rate of rows, measured in the same run on the same file
(`os.pread` of one record at a random row, after dropping the file from the page cache; one at a
time and 16 at a time), and the disk table's calls' major faults (pages the device served on a
touch rather than ahead). Also how long madvise(WILLNEED) of 3,000 cold rows takes to return
(why a hint's read-ahead, DiskTable.warm, runs off the compute thread).

The cache policy: the same traces replayed through TinyLFU-over-CLOCK (ours), CLOCK without
admission, and an exact LRU (an OrderedDict), hit rates side by side.

    python -m benchmarks.disk_tier [--rows 2000000 --dim 64 --bags 512 --ids 32 --calls 40 --dir /tmp --threads 1]
                                   [--trained-steps 200]  (0: no trained distribution, no cluster)

The page cache: the data file is dropped from it (POSIX_FADV_DONTNEED) before each distribution,
but on a machine whose free memory exceeds the file it fills again as the run reads, so misses
are served from RAM. `--page-cache MIB` runs the timed calls in a memory cgroup (tests/memlimit.py)
that holds the cache's bound, MIB of page cache and 64 MiB for a call's temporaries: the file
(8x the cache) no longer fits, and misses and write-backs go to the device as on a host whose
table is larger than its memory. The process joins the group for the disk table's work only
(the RAM table's calls run outside it, as a table that fits in memory); the tables are built
outside (their pages are charged there until dropped), the cache's slots inside.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import mmap
import os
import resource
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from memserver.core.disk import DiskTable, _read_ahead, record_layout
from memserver.core.optim import OptimizerConfig
from memserver.core.table import ValueTable, set_threads


def zipf_sampler(n: int, s: float, rng: np.random.Generator):
    """Rows drawn with P(rank k) ~ 1/k^s over n rows (s = 0: uniform), ranks scattered."""
    perm = rng.permutation(n)
    if s == 0:
        return lambda size: rng.integers(0, n, size)
    cdf = np.cumsum(1.0 / np.arange(1, n + 1, dtype=np.float64) ** s)
    cdf /= cdf[-1]
    return lambda size: perm[np.minimum(np.searchsorted(cdf, rng.random(size)), n - 1)]


def trained_reads(steps: int) -> np.ndarray:
    """How often each slot of a memtrain product-key layer was read over `steps` training steps
    (memtrain's defaults, remote values on a local 2-shard cluster, whose shards count every read:
    the slots' `hits`), so the benchmark reads as a trained layer does."""
    from benchmarks.common import local_cluster
    from client import MemoryClient
    from trainer.train import build_parser, train

    table = "disk-tier-trained"
    with local_cluster(2) as cluster, MemoryClient(cluster.endpoint, timeout=120) as client:
        args = build_parser().parse_args(["--memory", "remote", "--steps", str(steps), "--eval-every", str(10**9),
                                          "--log-every", str(10**9), "--table", table])
        for _ in train(args, client=client):
            pass
        rows = client.table(table).num_rows
        return np.asarray(client.slot_stats(table, np.arange(rows))["hits"], dtype=np.float64)


def trained_sampler(n: int, hits: np.ndarray, rng: np.random.Generator):
    """Rows drawn as the trained layer read its slots: slot s with probability hits[s] / sum,
    spread evenly over n / len(hits) rows of this table (the slots' skew at a larger size: the
    top 1% of rows carry the mass the top 1% of slots did), the groups scattered."""
    k = len(hits)
    m = max(1, n // k)
    cdf = np.cumsum(hits / hits.sum())
    perm = rng.permutation(k * m)
    return lambda size: perm[np.minimum(np.searchsorted(cdf, rng.random(size)), k - 1) * m + rng.integers(0, m, size)]


def drop_page_cache(t: DiskTable) -> None:
    """Out of the page cache: written back, unmapped from this process (the kernel keeps a
    mapped page whatever fadvise says), dropped. The cache's dirty rows are written back first.
    The read counters too when they are not locked in memory (`--unlocked-counters`)."""
    t.flush()
    for m, fd in ((t._map, t._fd),) + (() if t.counters_resident else ((t._smap, t._sfd),)):
        m.flush()
        m.madvise(mmap.MADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def disk_random_reads(t: DiskTable, seconds: float, rng: np.random.Generator, threads: int = 1) -> float:
    """Rows per second the device gives `threads` threads each reading one record at a random
    row at a time (`threads` reads in flight: the device's queue depth)."""
    drop_page_cache(t)
    n, t0 = t.num_rows, time.perf_counter()
    done = [0] * threads

    def reader(k: int) -> None:
        local = np.random.default_rng([k, int(rng.integers(1 << 30))])
        while time.perf_counter() - t0 < seconds:
            for r in local.integers(0, n, 64):
                os.pread(t._fd, t.record, int(r) * t.record)
            done[k] += 64

    pool = [threading.Thread(target=reader, args=(k,)) for k in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    return sum(done) / (time.perf_counter() - t0)


def willneed_ms(t: DiskTable, rows: int, rng: np.random.Generator) -> float:
    """How long `_read_ahead` (madvise WILLNEED) takes to return for `rows` cold rows at random:
    the call waits until the device has taken the requests, which is why a hint's read-ahead
    (DiskTable.warm) runs on a thread of its own, not on the compute thread."""
    drop_page_cache(t)
    sel = np.unique(rng.integers(0, t.num_rows, rows)).astype(np.int64)
    _read_ahead(t._raw, sel[:0])  # numba's first dispatch (~3 ms) is not the device's
    t0 = time.perf_counter()
    _read_ahead(t._raw, sel)
    return 1e3 * (time.perf_counter() - t0)


def mapped_random_reads(t: DiskTable, seconds: float, rng: np.random.Generator, advice: int) -> float:
    """Rows per second one thread reads through the table's mapping (a byte of a record at a
    random row: a page fault each) under `advice` (MADV_RANDOM, as the table maps its file, or
    MADV_NORMAL: the kernel's default read-around); the table's advice is restored after."""
    drop_page_cache(t)
    t._map.madvise(advice)
    n, done, t0 = t.num_rows, 0, time.perf_counter()
    try:
        while time.perf_counter() - t0 < seconds:
            for r in rng.integers(0, n, 16):
                t._raw[int(r), 0]
            done += 16
    finally:
        t._map.madvise(mmap.MADV_RANDOM)
    return done / (time.perf_counter() - t0)


def lru_hit_rate(batches: list[np.ndarray], capacity: int) -> float:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for b in batches:
        for r in np.unique(b).tolist():
            total += 1
            if r in cache:
                hits += 1
                cache.move_to_end(r)
            else:
                cache[r] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits / max(total, 1)


def p99(xs: list[float]) -> float:
    return float(np.percentile(xs, 99)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--ratio", type=int, default=8, help="file bytes / cache bytes")
    ap.add_argument("--bags", type=int, default=512)
    ap.add_argument("--ids", type=int, default=32)
    ap.add_argument("--calls", type=int, default=40, help="timed calls per kind, table and distribution")
    ap.add_argument("--warm", type=int, default=40, help="untimed calls first (fill the cache)")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--threads", type=int, default=1, help="torch and numba threads, both tables (a shard's compute thread's)")
    ap.add_argument("--page-cache", type=int, default=0, metavar="MIB",
                    help="run the timed calls in a memory cgroup with room for the cache, MIB of page cache "
                         "and 64 MiB of temporaries (0: no limit; needs root and a memory cgroup)")
    ap.add_argument("--unlocked-counters", action="store_true",
                    help="leave the disk table's read counters to the page cache (munlock), as before they were "
                         "locked in memory: the A/B of that choice")
    ap.add_argument("--trained-steps", type=int, default=200,
                    help="memtrain steps whose product-key reads make the 'trained' distribution (0: skip it)")
    args = ap.parse_args()
    trained = trained_reads(args.trained_steps) if args.trained_steps else None
    if trained is not None:
        top = np.sort(trained)[::-1]
        print(f"trained reads: memtrain's product-key layer after {args.trained_steps} steps, {len(trained):,} slots, "
              f"{(trained > 0).mean():.1%} read; the top 1% of slots take {top[: max(1, len(top) // 100)].sum() / top.sum():.1%} "
              f"of the reads, the top 10% {top[: max(1, len(top) // 10)].sum() / top.sum():.1%}")
    set_threads(args.threads)
    cfg = OptimizerConfig("adagrad", 0.01)
    work = Path(tempfile.mkdtemp(prefix="disk-tier-", dir=args.dir))
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, work, ignore_errors=True)
        t0 = time.perf_counter()
        cache = args.rows * record_layout(args.dim, cfg.name)[0] // args.ratio
        disk = DiskTable(work / "t", args.rows, args.dim, cfg, cache_bytes=cache, seed=1, name="bench")
        ram = ValueTable(args.rows, args.dim, cfg, seed=1, track_stats=True)
        if args.unlocked_counters and disk.counters_resident:
            ctypes.CDLL(None).munlock(ctypes.c_void_p(disk._sraw.ctypes.data), ctypes.c_size_t(disk._sraw.nbytes))
            disk.counters_resident = False
        print(f"table: {args.rows:,} rows x {args.dim} float32 + adagrad, record {disk.record} B, file "
              f"{disk.num_rows * disk.record / 2**20:,.0f} MiB, cache bound {cache / 2**20:,.1f} MiB "
              f"({disk.capacity:,} rows, 1/{args.ratio}); RAM table {ram.nbytes() / 2**20:,.0f} MiB; built in "
              f"{time.perf_counter() - t0:.1f}s; dir {work}")
        limit = None
        if args.page_cache:
            from tests.memlimit import MemoryLimit

            limit = MemoryLimit(cache + (args.page_cache + 64) * 2**20, name="disk-tier")
            stack.callback(limit.close)
            print(f"memory cgroup: {limit.limit / 2**20:,.0f} MiB (the cache's {cache / 2**20:,.1f}, "
                  f"{args.page_cache} of page cache for a {disk.num_rows * disk.record / 2**20:,.0f} MiB file, 64 "
                  f"of temporaries) for the disk table's calls; the RAM table's run outside it; {limit.dir}")

        @contextlib.contextmanager
        def held(t: ValueTable):
            """The disk table's work inside the memory cgroup (when there is one), the RAM
            table's outside: it is the table that fits in memory."""
            inside = limit is not None and t is disk
            if inside:
                limit.add()
            try:
                yield
            finally:
                if inside:
                    limit.leave()

        rng = np.random.default_rng(0)
        with held(disk):
            disk_rate = disk_random_reads(disk, 3.0, rng)
            disk_rate16 = disk_random_reads(disk, 3.0, rng, threads=16)
            ahead = willneed_ms(disk, 3000, rng)
        print(f"disk random reads (pread of one {disk.record} B record, page cache dropped): {disk_rate:,.0f} rows/s "
              f"one at a time, {disk_rate16:,.0f} rows/s 16 at a time (16 threads); 'vs disk' below is against the first")
        print(f"madvise(WILLNEED) of 3,000 cold rows at random returns after {ahead:,.1f} ms (it waits for the "
              "device to take them: a hint's read-ahead runs off the compute thread)")
        if limit is not None:
            with held(disk):
                plain = mapped_random_reads(disk, 3.0, rng, mmap.MADV_NORMAL)
                rand = mapped_random_reads(disk, 3.0, rng, mmap.MADV_RANDOM)
            print(f"through the mapping, a fault each: {plain:,.0f} rows/s with the kernel's read-around (MADV_NORMAL), "
                  f"{rand:,.0f} rows/s with MADV_RANDOM (the table's)")
        shape = (args.bags, args.ids)
        print(f"calls: {args.bags} bags x {args.ids} ids; {args.warm} warm-up calls, then {args.calls} timed per kind")
        print(f"{'reads':>9} {'call':>13} {'RAM q/s':>10} {'disk q/s':>10} {'ratio':>6} {'RAM p99':>9} {'disk p99':>9} "
              f"{'hit rate':>8} {'rows read/s':>12} {'vs disk':>8} {'faults/call':>11}")
        policy_traces = {}
        dists = [("zipf 1.0", 1.0), ("zipf 1.2", 1.2), ("uniform", 0.0)] + ([("trained", None)] if trained is not None else [])
        for label, s in dists:
            draw = trained_sampler(args.rows, trained, rng) if s is None else zipf_sampler(args.rows, s, rng)
            with held(disk):
                drop_page_cache(disk)
                disk._make_cache()  # each distribution from a cold cache
            batches = [draw(shape[0] * shape[1]).reshape(shape) for _ in range(args.warm + 2 * args.calls)]
            policy_traces[label] = batches
            w = torch.rand(shape)
            g = torch.randn(args.bags, args.dim) * 1e-3
            for b in batches[: args.warm]:  # both tables: the RAM one's first calls are slow too
                with held(disk):
                    disk.bag(torch.from_numpy(b), w)
                ram.bag(torch.from_numpy(b), w, count=False)
            for t in (disk, ram):  # and one backward each, so no timed call compiles a kernel (numba, first use)
                with held(t):
                    t.bag_backward(torch.from_numpy(batches[0]), w, None, g)
            for k, kind in enumerate(("bag", "bag_backward")):  # fresh draws for each: no replayed rows
                lat: dict[str, list[float]] = {"ram": [], "disk": []}
                before = disk.cache_stats()
                faults = 0
                for b in batches[args.warm + k * args.calls : args.warm + (k + 1) * args.calls]:
                    ids = torch.from_numpy(b)
                    for name, t in (("ram", ram), ("disk", disk)):
                        with held(t):
                            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
                            c0 = time.perf_counter()
                            if kind == "bag":
                                t.bag(ids, w)
                            else:
                                t.bag_backward(ids, w, None, g)
                            lat[name].append(time.perf_counter() - c0)
                            if t is disk:
                                faults += resource.getrusage(resource.RUSAGE_SELF).ru_majflt - f0
                after = disk.cache_stats()
                hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
                reads = after["disk_reads"] - before["disk_reads"]
                qs = {k: args.bags * len(v) / sum(v) for k, v in lat.items()}
                read_rate = reads / sum(lat["disk"])
                print(f"{label:>9} {kind:>13} {qs['ram']:>10,.0f} {qs['disk']:>10,.0f} {qs['disk'] / qs['ram']:>5.2f}x "
                      f"{p99(lat['ram']):>7.1f}ms {p99(lat['disk']):>7.1f}ms {hits / max(hits + misses, 1):>8.1%} "
                      f"{read_rate:>12,.0f} {read_rate / disk_rate:>7.2f}x {faults / args.calls:>8,.0f}")
        print("cache policy on the same traces (distinct rows per call; cache of "
              f"{disk.capacity:,} rows):")
        print(f"{'reads':>9} {'TinyLFU+CLOCK':>14} {'CLOCK':>7} {'LRU':>7}")
        for label, batches in policy_traces.items():
            rates = []
            for policy in ("tinylfu", "clock"):
                t = DiskTable(work / f"p-{policy}", args.rows, 1, OptimizerConfig("sgd", 0.1),
                              cache_bytes=disk.capacity * (8 + 24 + 18 + 40), init_std=0.0, policy=policy)
                t._make_cache()
                cap = t.capacity
                for b in batches:
                    t.bag(torch.from_numpy(b), torch.ones(shape), count=False)
                c = t.cache_stats()
                rates.append(c["hits"] / (c["hits"] + c["misses"]))
                t.close()
                shutil.rmtree(work / f"p-{policy}")
            print(f"{label:>9} {rates[0]:>14.1%} {rates[1]:>7.1%} {lru_hit_rate(batches, cap):>7.1%}")
        if args.page_cache:
            print(f"memory cgroup: peak {limit.peak() / 2**20:,.0f} MiB of {limit.limit / 2**20:,.0f}; "
                  f"{limit.major_faults():,} major faults (pages read from the device on a touch)")
        disk.close()


if __name__ == "__main__":
    main()
