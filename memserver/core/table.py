"""The math of a value table slice: lookup, bag, bag-backward, the optimizer step, statistics.

This is the one implementation of memory-value math in the project. A shard actor hosts one
`ValueTable` per table slice; the trainer's `local` memory backend uses the very same class
in-process, so local and remote training compute the same numbers.

Ids given to `ValueTable` are *local* row numbers of the slice (the shard maps global ids).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from memserver.core.init import init_values
from memserver.core.optim import OptimizerConfig, torch_step
from memserver.wire import bag_index

try:  # numba is a dependency, but the torch path must keep working without it
    from memserver.core import kernels
except ImportError:  # pragma: no cover
    kernels = None  # type: ignore[assignment]

# Entries processed per chunk in the backward, bounding temporaries to ~chunk * dim floats.
_CHUNK_ENTRIES = 1 << 16


class TopN:
    """The n best (largest, or coldest: smallest) values of a statistic seen chunk by chunk, in
    ascending rows, ties to the smaller row: what ranking the whole array gives, in memory of a
    chunk plus 2n. Candidates are pooled and cut back to the n best (a partition) when the pool
    passes 2n; once n are held, a chunk's rows not strictly better than the n-th are dropped
    first (a later row loses a tie). `rows` and `values` are the result, best first."""

    def __init__(self, n: int, coldest: bool = False) -> None:
        self.n, self.coldest = n, coldest
        self._rows: list[np.ndarray] = []
        self._vals: list[np.ndarray] = []
        self._size = 0
        self._worst: float | None = None  # the n-th best key, once n are held
        self._done: tuple[np.ndarray, np.ndarray] | None = None

    def _key(self, values: np.ndarray) -> np.ndarray:
        """Smaller is better; NaN is worst (a NaN n-th best would compare false with everything)."""
        key = values if self.coldest else -values
        nan = np.isnan(key)
        return np.where(nan, np.inf, key) if nan.any() else key

    def add(self, start: int, values: np.ndarray) -> None:
        """values[i] is row start + i's; each call's rows after the previous call's."""
        if self.n <= 0 or not len(values):
            return
        rows = np.arange(start, start + len(values), dtype=np.int64)
        if self._worst is not None:
            keep = np.flatnonzero(self._key(values) < self._worst)
            rows, values = rows[keep], values[keep]
        if len(rows):
            self._rows.append(rows)
            self._vals.append(np.asarray(values, dtype=np.float64))
            self._size += len(rows)
            self._done = None
            if self._size > 2 * self.n:
                self._cut()

    def _cut(self) -> None:
        """Keep the n best of the pool (ties: the smaller rows)."""
        rows, vals = np.concatenate(self._rows), np.concatenate(self._vals)
        if len(rows) > self.n:
            key = self._key(vals)
            t = np.partition(key, self.n - 1)[self.n - 1]
            better, tied = np.flatnonzero(key < t), np.flatnonzero(key == t)
            idx = np.r_[better, tied[np.argsort(rows[tied], kind="stable")][: self.n - len(better)]]
            rows, vals, self._worst = rows[idx], vals[idx], float(t)
        self._rows, self._vals, self._size = [rows], [vals], len(rows)

    def _result(self) -> tuple[np.ndarray, np.ndarray]:
        if self._done is None:
            if self._rows:
                self._cut()
            rows = self._rows[0] if self._rows else np.zeros(0, dtype=np.int64)
            vals = self._vals[0] if self._vals else np.zeros(0, dtype=np.float64)
            order = np.lexsort((rows, self._key(vals)))
            self._done = rows[order], vals[order]
        return self._done

    @property
    def rows(self) -> np.ndarray:
        return self._result()[0]

    @property
    def values(self) -> np.ndarray:
        return self._result()[1]


def set_threads(n: int) -> None:
    """Use `n` torch, numba and faiss (OpenMP) threads (numba's clamped to
    numba.config.NUMBA_NUM_THREADS; a library that is missing is skipped) in the *calling thread*.

    numba's thread count is a per-thread setting, and torch's (OpenMP) is too, so this must run
    on the thread that computes: a shard calls it in its compute thread's initializer, not on
    the actor's main thread. The numba kernels read the calling thread's count at each call."""
    n = max(1, int(n))
    torch.set_num_threads(n)
    if kernels is not None:
        kernels.nb.set_num_threads(min(n, kernels.nb.config.NUMBA_NUM_THREADS))
    try:  # index tables search with faiss on the same thread
        import faiss

        faiss.omp_set_num_threads(n)
    except ImportError:  # pragma: no cover - faiss is a dependency
        pass


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t, copied if its data is not at a multiple of its element size: a view of a TCP request's
    bytes (memserver.wire.parse_views) can start anywhere, and the compiled kernels (LLVM) assume
    naturally aligned elements, so both transports hand them the same kind of array."""
    return t if t.data_ptr() % t.element_size() == 0 else t.clone()


# ------------------------------------------------------------------ the table


_EMPTY1 = np.zeros(0, dtype=np.float32)
_EMPTY2 = np.zeros((0, 0), dtype=np.float32)


#: The state a read changes (its slot statistics, kernels.count_reads); every other field of
#: ValueTable.STATE changes only by a write.
READ_COUNTERS = ("hits", "weight_mass")


class ValueTable:
    """One slice of a value table: rows, optimizer state and per-slot statistics."""

    #: A float16 table's overflow count (on its device) and, on a GPU, its pinned host copy; None
    #: for every other table (set per instance in __init__; a DiskTable, float32, keeps the None).
    nonfinite_updates: torch.Tensor | None = None
    nonfinite_seen: torch.Tensor | None = None

    def __init__(
        self,
        num_rows: int,
        dim: int,
        optimizer: OptimizerConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        init_std: float = 0.02,
        seed: int = 0,
        global_rows: np.ndarray | None = None,
        col_start: int = 0,
        total_dim: int | None = None,
        track_stats: bool = True,
        backend: str | None = None,
    ) -> None:
        """`backend`: "numba" (compiled CPU kernels, float32 on CPU only), "torch", or None = the
        MEMSERVER_BACKEND environment variable, else numba where it applies."""
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"value dtype must be float32, float16 or bfloat16, got {dtype}")
        self.num_rows, self.dim, self.optimizer = num_rows, dim, optimizer
        self.dtype, self.device = dtype, torch.device(device)
        if global_rows is None:
            global_rows = np.arange(num_rows, dtype=np.int64)
        total_dim = total_dim or dim
        self.weight = init_values(global_rows, col_start, col_start + dim, total_dim, init_std, seed)
        self.weight = self.weight.to(device=self.device, dtype=dtype)
        f32 = dict(dtype=torch.float32, device=self.device)
        if optimizer.name == "adagrad":
            self.acc = torch.zeros(num_rows, **f32)
        elif optimizer.name == "adam":
            self.exp_avg = torch.zeros((num_rows, dim), **f32)
            self.exp_avg_sq = torch.zeros((num_rows, dim), **f32)
        self.track_stats = track_stats
        backend = backend or os.environ.get("MEMSERVER_BACKEND") or "auto"
        if backend not in ("auto", "numba", "torch"):
            raise ValueError(f"backend must be 'numba', 'torch' or 'auto', got {backend!r}")
        fast_ok = kernels is not None and self.device.type == "cpu" and dtype == torch.float32
        if backend == "numba" and not fast_ok:
            raise ValueError("the numba backend needs numba and a float32 table on the CPU")
        self.backend = "numba" if fast_ok and backend != "torch" else "torch"
        self.hits = torch.zeros(num_rows, dtype=torch.int64, device=self.device)
        self.weight_mass = torch.zeros(num_rows, dtype=torch.float64, device=self.device)
        self.updates = torch.zeros(num_rows, dtype=torch.int64, device=self.device)
        self.last_update = torch.zeros(num_rows, dtype=torch.float64, device=self.device)
        # Row updates that stored inf or NaN (a float16 table's step past 65504): counted on the
        # device, never waited for by the step; read by status and the metrics (nonfinite_count;
        # float16 tables only, the others keep None).
        self.nonfinite_updates = torch.zeros((), dtype=torch.int64, device=self.device) if dtype == torch.float16 \
            else None
        # on a GPU, a pinned host copy each step refreshes without waiting: what status and the
        # metrics read (int() of the device's count waits for the whole queue of the GPU)
        self.nonfinite_seen = torch.zeros((), dtype=torch.int64, pin_memory=True) \
            if self.nonfinite_updates is not None and self.device.type == "cuda" else None

    @classmethod
    def over(cls, weight: torch.Tensor, optimizer: OptimizerConfig, updates: torch.Tensor, last_update: torch.Tensor,
             acc: torch.Tensor | None = None, exp_avg: torch.Tensor | None = None,
             exp_avg_sq: torch.Tensor | None = None) -> ValueTable:
        """A table over tensors it does not own (float32, CPU; strided views are fine), without
        read counters: the working set a disk table gathers for a call (memserver.core.disk), so
        both tiers run this class's math on the same rows."""
        t = cls.__new__(cls)
        t.num_rows, t.dim = weight.shape
        t.optimizer, t.dtype, t.device = optimizer, weight.dtype, weight.device
        t.weight, t.updates, t.last_update = weight, updates, last_update
        for name, x in (("acc", acc), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            if x is not None:
                setattr(t, name, x)
        t.track_stats = False
        fast_ok = kernels is not None and t.device.type == "cpu" and t.dtype == torch.float32
        t.backend = "numba" if fast_ok and (os.environ.get("MEMSERVER_BACKEND") or "auto") != "torch" else "torch"
        return t

    # -- reads ---------------------------------------------------------------------------

    STATE = ("weight", "acc", "exp_avg", "exp_avg_sq", "hits", "weight_mass", "updates", "last_update")
    #: The counters of reads: kept by the shards ShardLayout.counts_reads names (on cols, shard 0).
    READ_COUNTERS = ("hits", "weight_mass")

    def state(self) -> dict[str, torch.Tensor]:
        """Everything a checkpoint keeps: values, optimizer state, slot statistics."""
        return {name: getattr(self, name) for name in self.STATE if hasattr(self, name)}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state().values())

    def on_device(self, *inputs: tuple[torch.Tensor | np.ndarray | None, torch.dtype]) -> tuple:
        """The one place inputs reach the table's device: each (tensor, dtype) as a contiguous
        tensor of that dtype on self.device (None stays None; numpy arrays and lists are taken
        too). A no-op for inputs already right; every public method calls it first, so rows,
        ids, offsets and gradients never mix devices and results live on self.device."""
        return tuple(None if t is None else _aligned(torch.as_tensor(t).to(device=self.device, dtype=dt).contiguous())
                     for t, dt in inputs)

    def _count_reads(self, ids: torch.Tensor, weights: torch.Tensor | None) -> None:
        """O(entries): only the read rows' counters are touched. Inputs already on the device."""
        flat = ids.reshape(-1)
        if self.backend == "numba":
            w = weights.reshape(-1).numpy() if weights is not None else _EMPTY1
            kernels.count_reads(flat.numpy(), w, self.hits.numpy(), self.weight_mass.numpy())
            return
        self.hits.index_add_(0, flat, torch.ones_like(flat))
        if weights is not None:
            self.weight_mass.index_add_(0, flat, weights.reshape(-1).abs().double())

    def lookup(self, ids: torch.Tensor, count: bool = True, admit: bool = True) -> torch.Tensor:
        """Rows as float32; `count` False: not counted in the slots' hits (an inspection read, or a
        column slice that does not keep the counters). `admit` False: an inspection read that a
        cache (DiskTable's) places nothing for; a table in memory has no cache."""
        (ids,) = self.on_device((ids, torch.int64))
        if self.track_stats and count:
            self._count_reads(ids, None)
        return self.weight.index_select(0, ids).float()

    def warm(self, ids: torch.Tensor) -> int:
        """A hint that `ids` will be read soon (a disk table reads their pages ahead: DiskTable.warm).
        Rows in memory need nothing: 0 rows handed on."""
        return 0

    def count_reads(self, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """The slot statistics of a bag's reads (hits, weight mass), apart from the bag: a shard
        counts them after it answered (memserver.server.dataplane)."""
        if self.track_stats:
            ids, weights = self.on_device((ids, torch.int64), (weights, torch.float32))
            self._count_reads(ids, weights)

    def bag(self, ids: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor | None = None,
            count: bool = True) -> torch.Tensor:
        """out[b] = sum_{i in bag b} weights_i * v[ids_i], in float32; `count` False: the reads are
        counted later (count_reads)."""
        ids, weights, offsets = self.on_device((ids, torch.int64), (weights, torch.float32), (offsets, torch.int64))
        if self.track_stats and count:
            self._count_reads(ids, weights)
        if ids.numel() == 0:  # empty bags (legal): zeros, whatever the storage dtype
            return torch.zeros((ids.shape[0] if offsets is None else len(offsets), self.dim), device=self.device)
        if self.dtype == torch.float32:
            return F.embedding_bag(ids, self.weight, offsets, mode="sum", per_sample_weights=weights)
        # Half-precision storage: gather, widen, then sum in float32.
        if offsets is None:
            rows = self.weight[ids].float()  # [B, k, d]
            return torch.einsum("bk,bkd->bd", weights, rows)
        out = torch.zeros((len(offsets), self.dim), dtype=torch.float32, device=self.device)
        out.index_add_(0, bag_index(ids, offsets), self.weight[ids].float() * weights[:, None])
        return out

    def slot_stats(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        (ids,) = self.on_device((ids, torch.int64))
        rows = self.weight.index_select(0, ids).double()
        return {
            "hits": self.hits[ids],
            "weight_mass": self.weight_mass[ids],
            "updates": self.updates[ids],
            "last_update": self.last_update[ids],
            "value_sq_norm": (rows * rows).sum(1),
        }

    def nonfinite_count(self) -> int | None:
        """Row updates stored as inf or NaN (float16 tables; None for the others). On a GPU the
        count of a recent step, read without waiting for the device (the pinned copy each step
        refreshes); on the CPU, exact."""
        if self.nonfinite_updates is None:
            return None
        return int(self.nonfinite_seen if self.nonfinite_seen is not None else self.nonfinite_updates)

    #: The per-slot statistics `top` (TopN over `stat`'s chunks) and `usage` rank and bin.
    STATS = ("hits", "weight_mass", "updates", "value_sq_norm")
    #: Rows a scan of every slot (top_slots, usage) reads at a time: its temporaries are ~40 bytes a
    #: row of one chunk, never of the slice, and a shard runs each chunk as its own work item.
    STAT_CHUNK = 1 << 16

    def stat(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """One statistic of rows [start, stop) of the slice (default all), float64
        (value_sq_norm: over its columns)."""
        if name not in self.STATS:
            raise ValueError(f"unknown slot statistic {name!r}")
        stop = self.num_rows if stop is None else min(stop, self.num_rows)
        if name == "value_sq_norm":
            out = np.empty(max(0, stop - start), dtype=np.float64)
            for s in range(start, stop, _CHUNK_ENTRIES):  # bounded temporaries
                rows = self.weight[s : min(s + _CHUNK_ENTRIES, stop)].double()
                out[s - start : s - start + len(rows)] = (rows * rows).sum(1).cpu().numpy()
            return out
        return getattr(self, name)[start:stop].cpu().numpy().astype(np.float64)


    # -- writes --------------------------------------------------------------------------

    def bag_backward(
        self,
        ids: torch.Tensor,
        weights: torch.Tensor,
        offsets: torch.Tensor | None,
        grad_out: torch.Tensor,
    ) -> torch.Tensor:
        """Return dL/dweights (shape of ids) and apply w_i * grad_out_b to the rows.

        dL/dw_i = <grad_out_b, v[id_i]> uses the values *before* this update.
        """
        grad_w, update = self.bag_grad(ids, weights, offsets, grad_out)
        update()
        return grad_w

    def bag_grad(
        self,
        ids: torch.Tensor,
        weights: torch.Tensor,
        offsets: torch.Tensor | None,
        grad_out: torch.Tensor,
    ) -> tuple[torch.Tensor, Callable[[], None]]:
        """dL/dweights now, and the row update as a callable to run later.

        A shard answers a deferred BagBackward with dL/dw first and runs the update right after,
        before any later request, so the trainer's next step overlaps the update.
        """
        ids, weights, offsets, grad_out = self.on_device(
            (ids, torch.int64), (weights, torch.float32), (offsets, torch.int64), (grad_out, torch.float32))
        flat_ids = ids.reshape(-1)
        flat_w = weights.reshape(-1)
        bags = bag_index(ids, offsets)
        if self.backend == "numba":
            grad_w_np = np.empty(flat_ids.shape[0], dtype=np.float32)
            kernels.grad_weights(self.weight.numpy(), flat_ids.numpy(), bags.numpy(), grad_out.numpy(), grad_w_np)
            grad_w = torch.from_numpy(grad_w_np)
        else:
            grad_w = torch.empty(flat_ids.shape[0], dtype=torch.float32, device=self.device)
            for s in range(0, flat_ids.shape[0], _CHUNK_ENTRIES):
                e = s + _CHUNK_ENTRIES
                rows = self.weight.index_select(0, flat_ids[s:e]).float()
                grad_w[s:e] = (rows * grad_out.index_select(0, bags[s:e])).sum(1)
        return grad_w.view(ids.shape), lambda: self.apply_entries(flat_ids, bags, flat_w, grad_out)

    def apply_entries(self, ids: torch.Tensor, src_index: torch.Tensor, scale: torch.Tensor, src: torch.Tensor) -> int:
        """One optimizer step from gradient entries: row ids[i] receives scale[i] * src[src_index[i]];
        entries of the same row are summed first. Returns the number of distinct rows updated.

        The common form of a bag's backward (src = dL/d(out), scale = the bag weights) and of a
        gradient push (src = the rows' gradients, scale = 1).

        O(entries) on both paths, whatever the table's row count: the numba kernel groups entries
        with `kernels.group_by_row`; the torch path sorts the n ids (torch.unique) and sums with
        index_add_, which on the CPU adds in entry order (on CUDA, with atomics, in no fixed
        order), and `torch_step` gathers and scatters only the distinct rows."""
        ids, src_index, scale, src = self.on_device(
            (ids, torch.int64), (src_index, torch.int64), (scale, torch.float32), (src, torch.float32))
        if self.backend == "numba":
            return self._step_numba(ids, src_index, scale, src.numpy())
        uniq, inv = torch.unique(ids, return_inverse=True)
        row_grad = torch.zeros((len(uniq), self.dim), dtype=torch.float32, device=self.device)
        for s in range(0, ids.shape[0], _CHUNK_ENTRIES):
            e = s + _CHUNK_ENTRIES
            row_grad.index_add_(0, inv[s:e], src.index_select(0, src_index[s:e]).mul_(scale[s:e, None]))
        torch_step(self, uniq, row_grad)
        return len(uniq)

    def push_gradients(self, ids: torch.Tensor, grads: torch.Tensor) -> int:
        (ids,) = self.on_device((ids, torch.int64))
        n = ids.shape[0]
        return self.apply_entries(ids, torch.arange(n, device=self.device), torch.ones(n, device=self.device), grads)

    def write_rows(self, ids: torch.Tensor, rows: torch.Tensor) -> int:
        """Overwrite rows (optimizer state is kept). Ids must be distinct (checked by callers)."""
        ids, rows = self.on_device((ids, torch.int64), (rows, self.dtype))
        self.weight[ids] = rows
        return len(ids)

    def _step_numba(self, ids: torch.Tensor, src_index: torch.Tensor, scale: torch.Tensor, src: np.ndarray) -> int:
        """The fused kernel: sum each distinct row's gradient, then step it in place. Inputs are
        contiguous int64 / float32 CPU tensors (apply_entries' `on_device`)."""
        opt = self.optimizer
        kind = {"sgd": kernels.SGD, "adagrad": kernels.ADAGRAD, "adam": kernels.ADAM}[opt.name]
        acc = self.acc.numpy() if opt.name == "adagrad" else _EMPTY1
        m = self.exp_avg.numpy() if opt.name == "adam" else _EMPTY2
        v = self.exp_avg_sq.numpy() if opt.name == "adam" else _EMPTY2
        return int(
            kernels.sparse_step(
                self.weight.numpy(), ids.numpy(), src_index.numpy(), scale.numpy(), src, kind, float(opt.lr),
                float(opt.effective_eps), float(opt.beta1), float(opt.beta2), acc, m, v, self.updates.numpy(),
                self.last_update.numpy(), time.time(), kernels.nb.get_num_threads(),
            )
        )
