"""Exact latencies: every response time kept, percentiles computed from all of them."""

from __future__ import annotations

import math
import time
from array import array
from collections import Counter
from typing import Any

import grpc
import numpy as np


class LatencyRecorder:
    """Every response time (ms, as float64) per request name, for exact percentiles.

    Hooked to locust's `request` event, so it sees exactly what locust's stats see. 8 bytes per
    request: the default bound of 1,000,000 requests costs 8 MB. Per process: with distributed
    locust each worker records its own.
    """

    def __init__(self) -> None:
        self.ok: dict[str, array] = {}
        self.failures: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self.first: float | None = None
        self.last: float | None = None

    @property
    def total(self) -> int:
        return sum(len(a) for a in self.ok.values()) + sum(self.failures.values())

    def on_request(self, request_type: str, name: str, response_time: float, response_length: int,
                   exception: BaseException | None = None, **_: Any) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now - response_time / 1000
        self.last = now
        if exception is None:
            self.ok.setdefault(name, array("d")).append(float(response_time))
            self.bytes[name] += int(response_length or 0)
        else:
            self.failures[name] += 1
            self.errors[f"{name}: {_describe(exception)}"] += 1

    def report(self, elapsed_s: float | None = None, names: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
        """Per name and in total: requests, failures, req/s and exact latency percentiles (ms)
        over the successful requests. `elapsed_s` defaults to first request start -> last answer."""
        if elapsed_s is None:
            elapsed_s = (self.last - self.first) if self.first is not None and self.last is not None else 0.0
        every = list(dict.fromkeys([*names, *self.ok, *self.failures]))
        per = {n: _stats(np.frombuffer(self.ok.get(n, array("d")), dtype=np.float64), self.failures[n], self.bytes[n], elapsed_s)
               for n in every}
        all_ok = np.concatenate([np.frombuffer(a, dtype=np.float64) for a in self.ok.values()]) if self.ok else np.empty(0)
        total = _stats(all_ok, sum(self.failures.values()), sum(self.bytes.values()), elapsed_s)
        return {"elapsed_s": round(elapsed_s, 3), "requests": total["requests"], "failures": total["failures"],
                "rps": total["rps"], "per_type": per, "total": total, "errors": dict(self.errors.most_common(20))}


def percentile(sorted_ms: np.ndarray, q: float) -> float:
    """Nearest-rank percentile: an observed value, at least q% of the samples are <= it."""
    n = len(sorted_ms)
    return float(sorted_ms[min(n - 1, max(0, math.ceil(q / 100 * n) - 1))])


def _stats(ms: np.ndarray, failures: int, nbytes: int, elapsed_s: float) -> dict[str, Any]:
    ms = np.sort(ms)
    n = len(ms)
    out: dict[str, Any] = {"requests": n + failures, "failures": failures,
                           "rps": round((n + failures) / elapsed_s, 2) if elapsed_s > 0 else 0.0,
                           "response_bytes": nbytes}
    for key, q in (("p50_ms", 50), ("p95_ms", 95), ("p99_ms", 99)):
        out[key] = round(percentile(ms, q), 4) if n else None
    out["max_ms"] = round(float(ms[-1]), 4) if n else None
    out["mean_ms"] = round(float(ms.mean()), 4) if n else None
    return out


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        try:
            return f"{exc.code().name}: {exc.details()}"
        except Exception:  # a half-built error object: fall back to its repr
            pass
    return f"{type(exc).__name__}: {exc}"
