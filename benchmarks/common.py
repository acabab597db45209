"""Shared plumbing for benchmarks: a local cluster, timers, the machine's copy bandwidth."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import resource
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np


def init_ray() -> bool:
    """Start a Ray head in this process unless one is up; True if this call started it.

    benchmarks.run calls it once so that the benchmarks it runs share one head (starting Ray
    takes 5-20 s on 2 cores)."""
    import ray

    if ray.is_initialized():
        return False
    ray.init(num_cpus=os.cpu_count() or 2, object_store_memory=128 * 1024 * 1024, include_dashboard=False,
             log_to_driver=False, namespace="memserver-bench")
    return True


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, every thread) a process has used so far."""
    from memserver.cluster.endpoint import proc_stat

    fields = proc_stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def context_switches(pid: int) -> int:
    """Context switches (voluntary and not) of every thread of a process so far: each a thread put
    to sleep or woken, what a call's hand-offs between threads and processes cost on few cores."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                total += sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return total


@contextlib.contextmanager
def local_cluster(num_shards: int = 2, shard_cpus: float = 0.25, **kwargs: Any) -> Iterator[Any]:
    """A Ray head in this process plus a memory cluster; everything on 127.0.0.1. `kwargs`: more
    of start_cluster's (auth, tls, ...)."""
    import ray

    from memserver.cluster.launch import start_cluster

    started = init_ray()
    cluster = start_cluster(num_shards, shard_cpus=shard_cpus, name=f"bench{time.monotonic_ns()}", **kwargs)
    try:
        yield cluster
    finally:
        cluster.shutdown()
        if started:
            ray.shutdown()


@contextlib.contextmanager
def cluster_client(wanted: bool, num_shards: int = 2) -> Iterator[Any]:
    """A client of a fresh local cluster (closed, with the cluster, on exit), or None when not
    wanted: for benchmarks whose remote runs are optional."""
    if not wanted:
        yield None
        return
    from client import MemoryClient

    with local_cluster(num_shards) as cluster, MemoryClient(cluster.endpoint) as client:
        yield client


def shm_attached(client: Any, meta: Any, ids: Any, w: Any, doorbell: bool) -> None:
    """Bag (ids, w) until the client has a region (and, with `doorbell`, a doorbell) with every shard of
    the table: they are attached in the background on the first calls."""
    shm = client.aio.shm
    t_end = time.monotonic() + 30
    while time.monotonic() < t_end:
        if all(sh.address in shm.regions and (not doorbell or shm.bell(sh.address) is not None) for sh in meta.shards):
            return
        client.bag(meta.name, ids, w)
        time.sleep(0.05)
    raise RuntimeError(f"no shared-memory region{' and doorbell' if doorbell else ''} with every shard within 30 s "
                       "(see client.shm's log)")


def round_robin_steps(gens: dict[str, Iterator[dict[str, Any]]], blocks: int, block: int, warmup: int,
                      until: float = float("inf"), key: str = "step_ms") -> dict[str, list[Any]]:
    """memtrain runs (generators of log records, one a step) advanced `block` steps each in turn,
    `blocks` rounds (none started after `until`, a perf_counter time), so background load falls on
    all alike; their step_ms (or the records' `key`s: a list of them per step, in key order when
    `key` is comma-separated), without the first round's first `warmup` steps and every later
    round's first step (it follows another run's steps)."""
    keys = key.split(",")
    step_ms: dict[str, list[Any]] = {n: [] for n in gens}
    for b in range(blocks):
        if b and time.perf_counter() > until:
            break
        for n, gen in gens.items():
            for s in range(block):
                rec = next(gen)
                if (b == 0 and s < warmup) or (b > 0 and s == 0):
                    continue
                step_ms[n].append(rec[key] if len(keys) == 1 else [rec[k] for k in keys])
    return step_ms


def timeit(fn: Callable[[], Any], *, repeat: int = 10, warmup: int = 2, max_seconds: float = 20.0) -> dict[str, float]:
    """Run fn `repeat` times (bounded by max_seconds) and return ms statistics."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    t_end = time.perf_counter() + max_seconds
    while len(times) < repeat and time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"p50_ms": statistics.median(times), "mean_ms": statistics.fmean(times), "min_ms": min(times), "n": len(times)}


def latencies(fns: dict[str, Callable[[], Any]], *, repeat: int = 200, warmup: int = 10,
              max_seconds: float = 30.0, shuffle: bool = False, block: int = 1) -> dict[str, dict[str, float]]:
    """Call every fn in turn (round robin) and return per-fn ms statistics with p50 and p99.

    Interleaving puts the same background load on every candidate, so on a shared machine their
    ratio stays meaningful even when the absolute numbers drift. `shuffle`: a new (seeded) order
    every round, so no candidate always follows the same one: a call right after another to the
    same server process finds it awake (a process idle for a round answers a small call ~0.2 ms
    slower here), and a call right after a parallel torch op may find its OpenMP threads still
    spinning on a core the call needs. `block` > 1: each candidate runs `block` calls in a row per
    round and the first is not counted (it pays for whatever ran before it: libgomp's threads of
    an in-process torch op spin on both cores for milliseconds after it, which a remote call's
    shards would otherwise always meet), so `repeat` rounds count repeat x (block - 1) calls."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns.items())
    rng = random.Random(0)
    t_end = time.perf_counter() + max_seconds
    for _ in range(repeat):
        if time.perf_counter() >= t_end:
            break
        if shuffle:
            rng.shuffle(order)
        for k, fn in order:
            for i in range(block):
                t0 = time.perf_counter()
                fn()
                if block == 1 or i:
                    times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: summarize(v) for k, v in times.items()}


def summarize(times_ms: list[float]) -> dict[str, float]:
    """p50 / p99 / mean / min of a list of ms timings."""
    xs = sorted(times_ms)
    p99 = xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]
    return {"p50_ms": statistics.median(xs), "p99_ms": p99, "mean_ms": statistics.fmean(xs), "min_ms": xs[0], "n": len(xs)}


def peak_rss_bytes() -> int:
    """This process's peak resident set size (getrusage ru_maxrss, KiB on Linux). Note: Linux keeps
    ru_maxrss across fork + exec, so a process exec'd from a big parent starts with its peak."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def vm_hwm_bytes() -> int:
    """Peak RSS of this process image only (/proc/self/status VmHWM; 0 where there is none)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def target(name: str, what: str, value: float, threshold: float, higher_is_better: bool = True,
           unit: str = "x") -> dict[str, Any]:
    """One row of the summary: a measured ratio against its target."""
    ok = value >= threshold if higher_is_better else value <= threshold
    sign = ">=" if higher_is_better else "<="
    return {"name": name, "what": what, "target": f"{sign} {threshold:g}{unit}", "value": value,
            "measured": f"{value:.2f}{unit}", "pass": bool(ok)}


def info(name: str, what: str, value: float, unit: str = "x", fmt: str = ".2f") -> dict[str, Any]:
    """One row of the summary shown for information (INFO): a figure with no target, kept so a
    run's summary still says where the time goes."""
    return {"name": name, "what": what, "target": "info", "value": value, "measured": f"{value:{fmt}}{unit}",
            "pass": None}


def answers(name: str, wrong: list[str]) -> dict[str, Any]:
    """The row that says whether every path answered as the reference did (`wrong`: those that did
    not). Unlike a missed speed target (MISS: the machine may be shared), a wrong answer is a bug:
    the benchmark (exit_status) and benchmarks.run fail on it (it was stored in the JSON only)."""
    return {"name": name, "what": "answers equal the reference", "target": "all equal", "value": float(not wrong),
            "measured": "WRONG: " + ", ".join(wrong) if wrong else "yes", "pass": not wrong, "answers": True}


def wrong_answers(targets: list[dict[str, Any]]) -> list[str]:
    """The `answers` rows of these targets that found wrong answers (their measured text)."""
    return [t["measured"] for t in targets if t.get("answers") and not t["pass"]]


def exit_status(out: dict[str, Any]) -> int:
    """A benchmark's exit status run alone: 1 if it found a wrong answer, 0 otherwise (a MISS too)."""
    return 1 if wrong_answers(out.get("targets", [])) else 0


def print_targets(targets: list[dict[str, Any]], out: Callable[[str], Any] = print) -> None:
    """A benchmark's target lines ("target WHAT: MEASURED (TARGET): pass|MISS|WRONG"); INFO rows are left out."""
    for t in targets:
        if t["pass"] is not None:
            verdict = "pass" if t["pass"] else "WRONG" if t.get("answers") else "MISS"
            out(f"target {t['what']}: {t['measured']} ({t['target']}): {verdict}")


def copy_bandwidth_gbs(nbytes: int = 256 * 1024 * 1024) -> float:
    """Measured memory copy bandwidth (read + write bytes per second), the ceiling for big calls."""
    src = np.ones(nbytes // 8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict[str, Any]:
    """What the figures were measured on, including the load average (the machine is shared)."""
    return {"cpus": os.cpu_count(), "cpu_model": cpu_model(), "platform": platform.platform(),
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
            "loadavg": [round(x, 2) for x in os.getloadavg()]}


def write_results(path: str, results: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
