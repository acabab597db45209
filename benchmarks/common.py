"""Shared plumbing for benchmarks: a local cluster, timers, the machine's copy bandwidth."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np


@contextlib.contextmanager
def local_cluster(num_shards: int = 2, shard_cpus: float = 0.25) -> Iterator[Any]:
    """A Ray head in this process plus a memory cluster; everything on 127.0.0.1."""
    import ray

    from memserver.cluster import start_cluster

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=os.cpu_count() or 2, object_store_memory=128 * 1024 * 1024, include_dashboard=False,
                 log_to_driver=False, namespace="memserver-bench")
    cluster = start_cluster(num_shards, shard_cpus=shard_cpus, name=f"bench{time.monotonic_ns()}")
    try:
        yield cluster
    finally:
        cluster.shutdown()
        if started:
            ray.shutdown()


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


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d")}


def write_results(path: str, results: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
