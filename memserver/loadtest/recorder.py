"""Exact latencies: every response time kept, percentiles computed from all of them; with
locust's distributed mode, every worker's kept times travel to the master (`to_message`,
`from_message`) and are merged there (`merge`), so its percentiles are over every response."""

from __future__ import annotations

import math
import time
from array import array
from collections import Counter
from collections.abc import Mapping
from typing import Any

import grpc
import numpy as np


class LatencyRecorder:
    """Every response time (ms, as float64) per request name, for exact percentiles.

    Hooked to locust's `request` event, so it sees exactly what locust's stats see. 8 bytes per
    request: the default bound of 1,000,000 requests costs 8 MB. Per process: with distributed
    locust each worker records its own and sends it to the master (see the module docstring).

    `max_samples` bounds what is kept (and so what a worker sends): a successful response beyond
    it is counted in `dropped`, not kept. The load test sets it to `max_requests`, which its users
    never exceed, so in a load test nothing is dropped; the bound is what a message can rely on.
    """

    def __init__(self, max_samples: int | None = None) -> None:
        self.max_samples = max_samples
        self.clear()

    def clear(self) -> None:
        """Forget everything recorded (a new test in the same process)."""
        self.ok: dict[str, array] = {}
        self.failures: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self.dropped = 0
        self.kept = 0
        self.first: float | None = None
        self.last: float | None = None
        self.elapsed_s: float | None = None  # merged recorders: no common clock, the caller's span

    @property
    def total(self) -> int:
        return self.kept + sum(self.failures.values())

    def on_request(self, request_type: str, name: str, response_time: float, response_length: int,
                   exception: BaseException | None = None, **_: Any) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now - response_time / 1000
        self.last = now
        if exception is None:
            if self.max_samples is not None and self.kept >= self.max_samples:
                self.dropped += 1
                return
            self.ok.setdefault(name, array("d")).append(float(response_time))
            self.kept += 1
            self.bytes[name] += int(response_length or 0)
        else:
            self.failures[name] += 1
            self.errors[f"{name}: {_describe(exception)}"] += 1

    def report(self, elapsed_s: float | None = None, names: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
        """Per name and in total: requests, failures, req/s and exact latency percentiles (ms)
        over the successful requests. `elapsed_s` defaults to first request start -> last answer."""
        if elapsed_s is None:
            elapsed_s = self.elapsed()
        every = list(dict.fromkeys([*names, *self.ok, *self.failures]))
        per = {n: _stats(np.frombuffer(self.ok.get(n, array("d")), dtype=np.float64), self.failures[n], self.bytes[n], elapsed_s)
               for n in every}
        all_ok = np.concatenate([np.frombuffer(a, dtype=np.float64) for a in self.ok.values()]) if self.ok else np.empty(0)
        total = _stats(all_ok, sum(self.failures.values()), sum(self.bytes.values()), elapsed_s)
        return {"elapsed_s": round(elapsed_s, 3), "requests": total["requests"], "failures": total["failures"],
                "rps": total["rps"], "per_type": per, "total": total, "errors": dict(self.errors.most_common(MAX_ERRORS)),
                "dropped": self.dropped}

    def elapsed(self) -> float:
        """Seconds from the first request's start to the last answer (this process's clock)."""
        if self.elapsed_s is not None:
            return self.elapsed_s
        return (self.last - self.first) if self.first is not None and self.last is not None else 0.0

    def to_message(self) -> dict[str, Any]:
        """What a worker sends the master: the kept latencies as raw float64 bytes per request
        name, failures, bytes and the MAX_ERRORS most frequent errors. At most max_samples x 8
        bytes of latencies (plus names and counters): 8 MB for the default 1,000,000 requests."""
        return {"ok": {n: a.tobytes() for n, a in self.ok.items()}, "failures": dict(self.failures),
                "errors": dict(self.errors.most_common(MAX_ERRORS)), "bytes": dict(self.bytes),
                "dropped": self.dropped, "elapsed_s": self.elapsed()}

    @classmethod
    def from_message(cls, msg: Mapping[str, Any], max_samples: int | None = None) -> LatencyRecorder:
        """The recorder a worker's `to_message` describes. The master's port is unauthenticated
        (docs/security.md): anything malformed, or with more than `max_samples` latencies, is a
        ValueError, never a crash or an unbounded allocation beyond the message itself."""
        try:
            rec = cls()
            for name, raw in dict(msg["ok"]).items():
                if not isinstance(name, str) or not isinstance(raw, bytes) or len(raw) % 8:
                    raise ValueError(f"latencies of {name!r}: not float64 bytes")
                rec.ok[name] = array("d", raw)
                ms = np.frombuffer(rec.ok[name], dtype=np.float64)
                if not (np.isfinite(ms) & (ms >= 0)).all():  # (a NaN made the report's percentiles NaN, invalid JSON)
                    raise ValueError(f"latencies of {name!r}: not all finite and >= 0")
                rec.kept += len(rec.ok[name])
            for key, into in (("failures", rec.failures), ("errors", rec.errors), ("bytes", rec.bytes)):
                for name, n in dict(msg[key]).items():
                    if not isinstance(name, str) or not _is_count(n):
                        raise ValueError(f"{key}: {name!r}: {n!r} is not a count")
                    into[name] += n
            dropped, elapsed = msg["dropped"], msg["elapsed_s"]
            if not _is_count(dropped):
                raise ValueError(f"dropped: {dropped!r} is not a count")
            if isinstance(elapsed, bool) or not isinstance(elapsed, (int, float)) or not 0 <= elapsed < math.inf:
                raise ValueError(f"elapsed_s: {elapsed!r} is not a number of seconds >= 0")
            rec.dropped, rec.elapsed_s = dropped, float(elapsed)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a latency message: {type(exc).__name__}: {exc}") from None
        if max_samples is not None and rec.kept > max_samples:
            raise ValueError(f"{rec.kept} latencies, more than the bound of {max_samples}")
        return rec

    def merge(self, other: LatencyRecorder) -> LatencyRecorder:
        """Add `other`'s responses to this one (in place; returns self): its percentiles are then
        those of the two recorders' latencies together. The span (`elapsed_s`) is left to the
        caller: workers' clocks are not comparable."""
        for name, a in other.ok.items():
            self.ok.setdefault(name, array("d")).extend(a)
        self.kept += other.kept
        self.failures.update(other.failures)
        self.errors.update(other.errors)
        self.bytes.update(other.bytes)
        self.dropped += other.dropped
        return self


def _is_count(n: object) -> bool:
    """An int >= 0, not a bool (True is an int to isinstance: it counted as 1)."""
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


#: Distinct error messages a report (and a worker's message) carries, most frequent first.
MAX_ERRORS = 20


def percentile(sorted_ms: np.ndarray, q: float) -> float:
    """Nearest-rank percentile: an observed value, at least q% of the samples are <= it."""
    n = len(sorted_ms)
    return float(sorted_ms[min(n - 1, max(0, math.ceil(q / 100 * n) - 1))])


def _stats(ms: np.ndarray, failures: int, nbytes: int, elapsed_s: float) -> dict[str, Any]:
    ms = np.sort(ms)
    n = len(ms)
    out: dict[str, Any] = {"requests": n + failures, "failures": failures,
                           "rps": round((n + failures) / elapsed_s, 2) if elapsed_s > 0 else 0.0,
                           # (rps counts refused calls: under overload half of it was failures)
                           "ok_rps": round(n / elapsed_s, 2) if elapsed_s > 0 else 0.0,
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
