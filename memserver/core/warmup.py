"""Every compiled kernel a shard calls, compiled (or loaded from numba's on-disk cache) before it
serves.

numba compiles a kernel at its first call with a new argument type, and compiling holds the GIL:
on a fresh install a shard's first bag_backward or disk-tier read compiled there, and every table
of that shard stalled behind it (calls to other tables ran past their deadlines), before the
shard's request timer even started. `compile_kernels` runs
each kernel once on tiny tables, with the argument types the data plane passes (its inputs are
normalised by `ValueTable.on_device`, so one set covers every request): about 30 s the first time
after an install or an upgrade (the Makefile and the Dockerfile pay it at install time, `python -m
memserver.core.warmup`), about 1 s when numba's cache has them, once per process.
`tests/test_warmup.py` runs the data plane's calls after it and checks that none compiles.
"""

from __future__ import annotations

import tempfile
import threading
import time

import numpy as np
import torch

_lock = threading.Lock()
_done = False


def _value_tables(directory: str) -> None:
    """Each optimizer, in RAM and on disk: every call a value slice answers (memserver.server.dataplane)."""
    from memserver.core.disk import MIN_CACHE_BYTES, POLICIES, DiskTable, _forget, cache_size, record_layout
    from memserver.core.optim import OptimizerConfig
    from memserver.core.table import ValueTable

    rows, dim = 64, 8
    ids = torch.tensor([[1, 2, 2], [5, 63, 0]])
    weights = torch.rand(2, 3)
    offsets = torch.tensor([0, 4])
    grad = torch.rand(2, dim)
    for opt in ("sgd", "adagrad", "adam"):
        config = OptimizerConfig(name=opt, lr=0.1)
        tables: list[ValueTable] = [ValueTable(rows, dim, config, global_rows=np.arange(rows) * 2, col_start=4,
                                               total_dim=2 * dim)]
        for policy in POLICIES:
            cache = max(MIN_CACHE_BYTES, cache_size(8, record_layout(dim, opt)[0], policy))  # 8 of the 64 rows
            tables.append(DiskTable(f"{directory}/{opt}-{policy}", rows, dim, config, cache_bytes=cache,
                                    global_rows=np.arange(rows) * 2, col_start=4, total_dim=2 * dim, policy=policy))
        for t in tables:
            flat = ids.reshape(-1)
            t.lookup(flat)
            t.lookup(flat, count=False)
            t.bag(ids, weights)
            t.bag(ids.reshape(-1), weights.reshape(-1), offsets)
            t.bag(ids, weights, count=False)
            t.count_reads(flat, weights.reshape(-1))
            t.warm(flat)
            t.slot_stats(flat)
            for name in t.STATS:
                t.stat(name)
            t.bag_backward(ids, weights, None, grad)
            grad_w, update = t.bag_grad(flat, weights.reshape(-1), offsets, grad)
            update()
            t.push_gradients(torch.tensor([3, 4]), torch.rand(2, dim))
            t.write_rows(torch.tensor([6, 7]), torch.rand(2, dim))
            if isinstance(t, DiskTable):
                # a read that met a corrupt record drops the misses it had placed (none here)
                _forget(np.zeros(0, np.int64), t._keys, t._vals, t._slot_row, t._dirty, t._st)
                t.flush()
                t.state()
                t.verify_records(t.checkpoint_state())
                t.after_load()
                t.close()


def _product_keys() -> None:
    """The product-key search (index tables' address/pkm_lookup; a trainer's PKM layer too)."""
    from memserver.core.pkm import candidate_pairs, select_topk

    knn = 4
    cand_i, cand_j = candidate_pairs(knn)
    select_topk(torch.rand(2, 2, 3, 16), knn, cand_i, cand_j)


def compile_kernels() -> float | None:
    """Compile or load every kernel once in this process; the seconds it took, or None when this
    process already had (or numba is missing: the torch path compiles nothing)."""
    global _done
    with _lock:
        if _done:
            return None
        try:
            import numba  # noqa: F401
        except ImportError:  # pragma: no cover - numba is a dependency
            _done = True
            return None
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="memserver-warmup-") as directory:
            _value_tables(directory)
        _product_keys()
        _done = True
        return time.perf_counter() - t0


def main() -> None:
    """`python -m memserver.core.warmup`: fill numba's cache (an install step)."""
    took = compile_kernels()
    print(f"memserver: compute kernels compiled or loaded from numba's cache in {took or 0:.1f}s")


if __name__ == "__main__":
    main()
