"""What a load test sends: the mix of calls, batch shapes, wire dtype, deadline and bounds."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: The calls a load mix can contain.
OPS = ("bag", "lookup", "bag_backward")
DEFAULT_MIX = "bag:8,lookup:1,bag_backward:1"
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
    if not math.isfinite(sum(mix.values())):  # (each finite, their sum inf: every call then failed, NaN odds)
        raise ValueError(f"the weights of {text!r} sum beyond a float's range; use smaller ones (only their ratios count)")
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


#: Set in the locust child's environment by `memserver loadtest` (memserver.loadtest.run), which
#: says the child's errors itself; run by hand, the child says them on stderr.
CHILD_OF_CLI_ENV = "MEMSERVER_LOADTEST_CHILD_OF_CLI"

_CASTS: dict[str, Any] = {"endpoint": str, "table": str, "mix": parse_mix, "batch": int, "knn": int, "wire_dtype": str,
                          "timeout": float, "max_requests": int, "max_seconds": float}


def _endpoint_from_file() -> str:
    from memserver.cluster.endpoint import live_endpoint

    try:
        return live_endpoint()["endpoint"]
    except FileNotFoundError as exc:
        raise ValueError(f"MEMSERVER_ENDPOINT: not set, and {exc}") from None


def parse_host_port(text: str, default_port: int = 5557) -> tuple[str, int]:
    """'HOST:PORT' or 'HOST' -> (host, port) of a locust master (locust's port by default). A
    wildcard host is refused: the master's port has no authentication, bind one private address."""
    host, sep, port = str(text).strip().rpartition(":")
    if not sep:
        host, port = port, str(default_port)
    host = host.strip("[]")
    if not host:
        raise ValueError(f"expected HOST[:PORT], got {text!r}")
    if host in ("*", "0.0.0.0", "::"):
        raise ValueError(f"{host} is a wildcard (every interface); name one (private) address")
    try:
        p = int(port)
    except ValueError:
        raise ValueError(f"port of {text!r} is not a number") from None
    if not 0 < p < 65536:
        raise ValueError(f"port of {text!r} must be 1..65535")
    return host, p
