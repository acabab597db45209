"""Seeded initial values that are a pure function of (seed, row, column).

Any shard can create exactly its own rows or columns of a table without generating the rest,
and a table has the same values however it is sharded, equal to a trainer's in-process table of
the same seed (splitmix64 counters + Box-Muller).
"""

from __future__ import annotations

import numpy as np
import torch

try:  # numba is a dependency, but the numpy path must keep working without it
    from memserver.core import kernels
except ImportError:  # pragma: no cover
    kernels = None  # type: ignore[assignment]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def init_values(
    global_rows: np.ndarray, col_start: int, col_end: int, total_dim: int, std: float, seed: int,
    _numpy_init: bool = False,
) -> torch.Tensor:
    """N(0, std^2) float32 values of `global_rows` x columns [col_start, col_end).

    The numba kernel computes it in one pass; the numpy code is the fallback and the reference.
    """
    n, c = len(global_rows), col_end - col_start
    out = torch.empty((n, c), dtype=torch.float32)
    if n == 0 or c == 0 or std == 0:
        return out.zero_()
    key = _splitmix64(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))[0]
    if kernels is not None and not _numpy_init:
        kernels.init_normal(np.ascontiguousarray(global_rows, dtype=np.int64), col_start, total_dim, float(std), key, out.numpy())
        return out
    cols = np.arange(col_start, col_end, dtype=np.uint64)
    step = max(1, (1 << 21) // c)
    with np.errstate(over="ignore"):
        for r0 in range(0, n, step):
            rows = global_rows[r0 : r0 + step].astype(np.uint64)
            counter = (rows[:, None] * np.uint64(total_dim) + cols[None, :]) * np.uint64(2)
            a = _splitmix64(counter ^ key)
            b = _splitmix64((counter + np.uint64(1)) ^ key)
            u1 = ((a >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))
            u2 = (b >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
            z = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
            out[r0 : r0 + step] = torch.from_numpy((z * std).astype(np.float32))
    return out
