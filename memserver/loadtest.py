"""Load testing a memserver cluster: the parts that do not need locust or gevent.

`memserver loadtest` (memserver/cli.py) and `locust -f deploy/locustfile.py` share this module:

- `LoadConfig`: what to send (table, mix of calls, batch, knn, wire dtype, deadline, bounds), read
  from MEMSERVER_* environment variables so locust's own command line can pass it too;
- `ShardCaller`: one bag / lookup / bag_backward as the client makes it (shard map read once,
  ids routed by memserver.routing, one request per shard, all in flight at once) over the
  blocking gRPC API, which works under gevent (grpc.aio does not mix with it);
- `LatencyRecorder`: every response time kept exactly, because locust rounds its percentiles
  (to whole ms below 100 ms, coarser above) and our calls take 0.3-50 ms;
- `run_loadtest`: what the CLI runs; the locust process itself is memserver/loaduser.py.

Nothing here imports locust or gevent: importing them monkey-patches the whole process.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from array import array
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import grpc
import numpy as np
import torch

from memserver.routing import TableMeta, route_bags, route_ids, wire_ids
from memserver.v1 import memserver_pb2 as pb
from memserver.v1 import memserver_pb2_grpc as pb_grpc
from memserver.wire import GRPC_OPTIONS, decode, dtype_code, encode

#: The calls a load mix can contain.
OPS = ("bag", "lookup", "bag_backward")
DEFAULT_MIX = "bag:8,lookup:1,bag_backward:1"
#: Each request stays below this (the client splits larger batches; the load test refuses them).
MAX_REQUEST_BYTES = 64 * 1024 * 1024
#: What rows, bag outputs and gradients may travel as (the shards compute in float32).
WIRE_DTYPE_NAMES = ("float32", "bfloat16", "float16")
#: Hard bound on any load run, whatever --duration says.
MAX_DURATION_S = 24 * 3600.0

_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h)?\s*$")
_UNIT_S = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(text: str) -> float:
    """'30s', '2m', '500ms', '1h' or a bare number of seconds -> seconds (> 0, at most 24 h)."""
    m = _DURATION.match(str(text))
    if not m:
        raise ValueError(f"expected a time like 30s, 2m or 500ms, got {text!r}")
    seconds = float(m.group(1)) * _UNIT_S[m.group(2)]
    if seconds <= 0:
        raise ValueError(f"must be more than zero, got {text!r}")
    if seconds > MAX_DURATION_S:
        raise ValueError(f"must be at most 24h, got {text!r}")
    return seconds


def parse_mix(text: str) -> dict[str, float]:
    """'bag:8,lookup:1,bag_backward:1' -> {op: weight}; a bare op has weight 1, weight 0 drops it."""
    mix: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        name, _, weight = part.partition(":")
        name = name.strip()
        if name not in OPS:
            raise ValueError(f"unknown call {name!r} in {text!r}; allowed: {', '.join(OPS)}")
        try:
            w = float(weight) if weight.strip() else 1.0
        except ValueError:
            raise ValueError(f"weight of {name!r} must be a number, got {weight!r}") from None
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"weight of {name!r} must be a finite number >= 0, got {weight!r}")
        if w > 0:
            mix[name] = mix.get(name, 0.0) + w
    if not mix:
        raise ValueError(f"no call with a positive weight in {text!r}; e.g. {DEFAULT_MIX}")
    return mix


def format_mix(mix: Mapping[str, float]) -> str:
    return ",".join(f"{k}:{v:g}" for k, v in mix.items())


@dataclass(frozen=True)
class LoadConfig:
    """What every simulated user sends; travels to the locust process as MEMSERVER_* variables."""

    endpoint: str
    table: str
    mix: dict[str, float] = field(default_factory=lambda: parse_mix(DEFAULT_MIX))
    batch: int = 256  # bags per bag/bag_backward call; ids per lookup call
    knn: int = 32  # entries per bag
    wire_dtype: str = "float32"  # dtype rows, bag outputs and grad_out travel in
    timeout: float = 10.0  # deadline of every request, seconds
    max_requests: int = 1_000_000  # calls per locust process, then its users stop
    max_seconds: float = 3600.0  # seconds per locust process, then its users stop

    ENV = {
        "endpoint": "MEMSERVER_ENDPOINT",
        "table": "MEMSERVER_TABLE",
        "mix": "MEMSERVER_MIX",
        "batch": "MEMSERVER_BATCH",
        "knn": "MEMSERVER_KNN",
        "wire_dtype": "MEMSERVER_WIRE_DTYPE",
        "timeout": "MEMSERVER_TIMEOUT",
        "max_requests": "MEMSERVER_MAX_REQUESTS",
        "max_seconds": "MEMSERVER_MAX_SECONDS",
    }

    def __post_init__(self) -> None:
        if not self.endpoint:
            raise ValueError("endpoint: no coordinator HOST:PORT")
        if not self.table:
            raise ValueError("table: no table name")
        for name in ("batch", "knn", "max_requests"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}: must be at least 1, got {getattr(self, name)}")
        for name in ("timeout", "max_seconds"):
            if not float(getattr(self, name)) > 0:
                raise ValueError(f"{name}: must be more than 0, got {getattr(self, name)}")
        if self.wire_dtype not in WIRE_DTYPE_NAMES:
            raise ValueError(f"wire_dtype: expected one of {', '.join(WIRE_DTYPE_NAMES)}, got {self.wire_dtype!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LoadConfig:
        """Read MEMSERVER_*; the endpoint defaults to the endpoint file `memserver up` writes."""
        env = os.environ if environ is None else environ
        kw: dict[str, Any] = {}
        for name, var in cls.ENV.items():
            if raw := env.get(var):
                try:
                    kw[name] = _CASTS[name](raw)
                except ValueError as exc:
                    raise ValueError(f"{var}: {exc}") from None
        if "endpoint" not in kw:
            kw["endpoint"] = _endpoint_from_file()
        if "table" not in kw:
            raise ValueError("MEMSERVER_TABLE: name the table to load (e.g. MEMSERVER_TABLE=values)")
        return cls(**kw)

    def to_env(self) -> dict[str, str]:
        """The MEMSERVER_* variables that make from_env() return this config."""
        return {var: format_mix(self.mix) if name == "mix" else str(getattr(self, name)) for name, var in self.ENV.items()}


_CASTS: dict[str, Any] = {"endpoint": str, "table": str, "mix": parse_mix, "batch": int, "knn": int, "wire_dtype": str,
                          "timeout": float, "max_requests": int, "max_seconds": float}


def _endpoint_from_file() -> str:
    # memserver.cluster.read_endpoint does this too, but importing it imports Ray
    home = os.environ.get("MEMSERVER_HOME") or os.path.join(os.path.expanduser("~"), ".memserver")
    path = os.path.join(home, "endpoint.json")
    try:
        with open(path) as f:
            return json.load(f)["endpoint"]
    except FileNotFoundError:
        raise ValueError(f"MEMSERVER_ENDPOINT: not set and no endpoint file at {path} (start a cluster with `memserver up`)") from None


# ------------------------------------------------------------------ the calls


def fetch_table(endpoint: str, table: str, timeout: float) -> TableMeta:
    """One GetShardMap from the coordinator (blocking gRPC: fine under gevent and outside it)."""
    with grpc.insecure_channel(endpoint, options=GRPC_OPTIONS) as ch:
        info = pb_grpc.ControlPlaneStub(ch).GetShardMap(pb.GetShardMapRequest(name=table), timeout=timeout)
    return TableMeta.from_proto(info)


class ShardCaller:
    """Makes one client call as AsyncMemoryClient does (same routing, same request fields, one
    request per shard, all in flight together), over blocking gRPC so it runs under gevent.

    Unlike the client it neither validates nor splits (load batches are generated valid and
    checked against MAX_REQUEST_BYTES up front) and does not retry: a load test must count an
    UNAVAILABLE as a failure, not hide it. Each call returns (result, response bytes).
    """

    def __init__(self, meta: TableMeta, cfg: LoadConfig, channels: dict[str, grpc.Channel] | None = None) -> None:
        self.meta = meta
        self.timeout = cfg.timeout
        self.wire_dtype = dtype_code(cfg.wire_dtype)
        self.channels = channels if channels is not None else {}
        for sh in meta.shards:
            if sh.address not in self.channels:
                self.channels[sh.address] = grpc.insecure_channel(sh.address, options=GRPC_OPTIONS)
        self.stubs = {sh.address: pb_grpc.DataPlaneStub(self.channels[sh.address]) for sh in meta.shards}
        biggest = max(cfg.batch * meta.dim * 4, cfg.batch * cfg.knn * 12)
        if biggest > MAX_REQUEST_BYTES:
            raise ValueError(f"batch: {cfg.batch} x dim {meta.dim} makes messages of {biggest >> 20} MiB; "
                             f"keep them under {MAX_REQUEST_BYTES >> 20} MiB")

    def connect(self) -> None:
        """Open every shard connection now, so no call's latency includes connection set-up."""
        for ch in self.channels.values():
            grpc.channel_ready_future(ch).result(timeout=self.timeout)

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()

    def _fan_out(self, method: str, calls: list[tuple[str, Any]]) -> list[Any]:
        """All shard requests in flight at once; the first failure cancels the rest and raises."""
        futures = [getattr(self.stubs[addr], method).future(req, timeout=self.timeout) for addr, req in calls]
        try:
            return [f.result() for f in futures]
        finally:
            for f in futures:
                f.cancel()  # no-op for finished ones

    def lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        meta = self.meta
        uniq, inv = torch.unique(ids.reshape(-1), return_inverse=True)
        rows = torch.empty((len(uniq), meta.dim), dtype=torch.float32)
        routes = route_ids(meta, uniq)
        reqs = [(sh.address, pb.LookupRequest(table=meta.name, ids=encode(wire_ids(uniq[sel], meta)), wire_dtype=self.wire_dtype))
                for sh, sel in routes]
        resps = self._fan_out("Lookup", reqs)
        for (sh, sel), resp in zip(routes, resps):
            rows[sel, sh.col_start : sh.col_end] = decode(resp.rows, "rows").float()
        return rows[inv].view(*ids.shape, meta.dim), sum(r.ByteSize() for r in resps)

    def bag(self, ids: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, int]:
        meta = self.meta
        out = torch.zeros((ids.shape[0], meta.dim), dtype=torch.float32)
        routes = route_bags(meta, ids, w, None)
        reqs = []
        for sh, (s_ids, s_w, s_off) in routes:
            req = pb.BagRequest(table=meta.name, ids=encode(wire_ids(s_ids, meta)), weights=encode(s_w), wire_dtype=self.wire_dtype)
            if s_off is not None:
                req.offsets.CopyFrom(encode(s_off))
            reqs.append((sh.address, req))
        resps = self._fan_out("Bag", reqs)
        for (sh, _), resp in zip(routes, resps):
            got = decode(resp.out, "out").float()
            if meta.by_rows:
                out += got
            else:
                out[:, sh.col_start : sh.col_end] = got
        return out, sum(r.ByteSize() for r in resps)

    def bag_backward(self, ids: torch.Tensor, w: torch.Tensor, grad_out: torch.Tensor, tag: pb.WriteTag) -> tuple[torch.Tensor, int]:
        """One tagged write: every shard request of the call carries the same (client_id, seq)."""
        meta = self.meta
        grad_w = torch.zeros(ids.shape, dtype=torch.float32)
        flat_gw = grad_w.view(-1)
        routes = route_bags(meta, ids, w, None, with_mask=True)
        reqs = []
        for sh, (s_ids, s_w, s_off), _ in routes:
            g_sh = grad_out if meta.by_rows else grad_out[:, sh.col_start : sh.col_end]
            req = pb.BagBackwardRequest(table=meta.name, ids=encode(wire_ids(s_ids, meta)), weights=encode(s_w),
                                        grad_out=encode(g_sh, self.wire_dtype), tag=tag)
            if s_off is not None:
                req.offsets.CopyFrom(encode(s_off))
            reqs.append((sh.address, req))
        resps = self._fan_out("BagBackward", reqs)
        for (_, _, mask), resp in zip(routes, resps):
            got = decode(resp.grad_weights, "grad_weights").reshape(-1)
            if mask is None:
                flat_gw += got  # COLS: each shard's dot product covers its columns
            else:
                flat_gw[mask] = got  # ROWS: each entry lives on one shard
        return grad_w, sum(r.ByteSize() for r in resps)


class Batches:
    """Random inputs of one user: uniform ids, softmax-like weights, small gradients."""

    def __init__(self, meta: TableMeta, cfg: LoadConfig, seed: int | None = None) -> None:
        self.rng = np.random.default_rng(seed)
        self.num_rows, self.dim, self.batch, self.knn = meta.num_rows, meta.dim, cfg.batch, cfg.knn

    def ids(self, *shape: int) -> torch.Tensor:
        return torch.from_numpy(self.rng.integers(0, self.num_rows, shape, dtype=np.int64))

    def weights(self) -> torch.Tensor:
        w = self.rng.random((self.batch, self.knn), dtype=np.float32)
        return torch.from_numpy(w / w.sum(axis=1, keepdims=True))

    def grad_out(self) -> torch.Tensor:
        return torch.from_numpy(self.rng.standard_normal((self.batch, self.dim), dtype=np.float32) * np.float32(1e-3))


# -------------------------------------------------------------- exact latencies


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


# ------------------------------------------------------------- what the CLI runs


class LoadTestError(RuntimeError):
    """The locust process failed or hung; its own messages went to stderr."""


@dataclass(frozen=True)
class ScratchTable:
    """The table `memserver loadtest` creates when none is named, and drops afterwards."""

    num_rows: int = 65536
    dim: int = 128
    sharding: str = "cols"


def run_loadtest(cfg: LoadConfig, users: int, spawn_rate: float, duration_s: float,
                 scratch: ScratchTable | None = None) -> dict[str, Any]:
    """Run a headless locust load against cfg.table and return the report (LatencyRecorder.report
    plus what was run). With `scratch`, creates a fresh table for the run instead and drops it
    afterwards, also on errors and Ctrl-C.

    Locust runs in a child process (memserver/loaduser.py): importing locust monkey-patches
    sockets, threads and time with gevent for the whole process, which breaks the MemoryClient's
    asyncio loop thread and grpc.aio here, and cannot be undone. The child is bounded in time
    (duration + grace, then killed) and in requests (cfg.max_requests).
    """
    from client import MemoryClient

    with MemoryClient(cfg.endpoint, timeout=60.0) as mem:
        if scratch is not None:
            cfg = replace(cfg, table=f"loadtest-{uuid.uuid4().hex[:8]}")
            mem.create_table(cfg.table, scratch.num_rows, scratch.dim, sharding=scratch.sharding)
        try:
            meta = mem.table(cfg.table)  # TableNotFoundError before any locust starts
            # the users stop themselves a little after the duration even if the runner does not
            cfg = replace(cfg, max_seconds=min(cfg.max_seconds, duration_s + cfg.timeout + 5))
            report = _run_child(cfg, users, spawn_rate, duration_s)
        finally:
            if scratch is not None:
                mem.drop_table(cfg.table)
    report.update({
        "endpoint": cfg.endpoint,
        "table": {"name": meta.name, "num_rows": meta.num_rows, "dim": meta.dim, "sharding": meta.sharding,
                  "shards": len(meta.shards), "scratch": scratch is not None},
        "users": users, "spawn_rate": spawn_rate, "duration_s": duration_s,
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("endpoint", "table")},
    })
    return report


def _run_child(cfg: LoadConfig, users: int, spawn_rate: float, duration_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="memserver-loadtest-") as tmp:
        report_path = os.path.join(tmp, "report.json")
        cmd = [sys.executable, "-m", "memserver.loaduser", "--users", str(users), "--spawn-rate", str(spawn_rate),
               "--duration", str(duration_s), "--report", report_path]
        proc = subprocess.Popen(cmd, env={**os.environ, **cfg.to_env()}, stdin=subprocess.DEVNULL)
        interrupted = False
        try:
            try:
                # start-up (imports) + the run + the users' last answers; after that it is stuck
                rc = proc.wait(timeout=duration_s + 2 * cfg.timeout + 120)
            except KeyboardInterrupt:
                # Ctrl-C: the child (same process group) got it too and stops early, writing its
                # report; tell it again in case it runs elsewhere, and wait for that report
                interrupted = True
                proc.send_signal(signal.SIGINT)
                rc = proc.wait(timeout=cfg.timeout + 30)
        except subprocess.TimeoutExpired:
            raise LoadTestError(f"the locust process did not finish within {duration_s:.0f}s + grace; killed it") from None
        finally:
            if proc.poll() is None:  # timed out, a second Ctrl-C, an error: stop the load before the table goes
                proc.kill()
                proc.wait()
        # interrupted, the child may die of the repeated SIGINT after it wrote its report: fine
        if not os.path.exists(report_path) or (rc != 0 and not interrupted):
            if interrupted:  # before the child had started its run: nothing to report
                raise KeyboardInterrupt
            raise LoadTestError(f"the locust process failed (exit status {rc}); its errors are above")
        with open(report_path) as f:
            return json.load(f)
