"""The math and state of one index table slice: a faiss index of the user's vectors under the
user's int64 ids, with optional float payload rows returned with the hits.

A shard hosts one `VectorIndex` per index table slice; the slice holds the ids with
`id % S == s` (`ShardLayout`'s rule, as for value tables) and the client merges the slices'
answers with `client.merge.merge_topk`. Every method runs on the shard's single compute thread
(docs/architecture.md, "One compute thread per shard"), so the class takes no locks; faiss may
use OpenMP threads *inside* a call.

Ids. faiss stores internal *labels*, not the user's ids: label `l` is a row of an arena
(`label -> id` array, payload rows, a live bitmap) and `id -> label` is a dict. A write costs
what it touches whatever the slice holds: an upsert gives the id a new label, and the old one
is either removed from faiss at once (IVF, through a hashtable direct map: O(1) per id) or left
in faiss *dead* and excluded from searches (every other kind: an `IDSelectorBitmap` over the
live bitmap, or over-fetching where faiss takes no selector). When dead labels reach half of
the arena the slice is compacted once (O(N), so O(1) amortised per removal). Arrays grow by
doubling (`reallocations` counts it).

Kinds (`factory`, as faiss.index_factory spells it), and what they support:

| kind | training | remove/upsert | dead entries | `entries()` vectors | exact resharding |
| --- | --- | --- | --- | --- | --- |
| `Flat` | none | dead + selector, compact via remove_ids | until compaction | exact | yes |
| `IVF{n},Flat` (any coarse quantizer, e.g. `IVF{n}_HNSW32,Flat`) | yes | removed at once (hashtable) | none | exact | yes |
| `IVF{n},PQ{m}[x{b}]`, `IVF{n},SQ8`/`SQ4`/`SQfp16` | yes | removed at once (hashtable) | none | decoded codes | no: a decoded vector may fall in another list, and IVF-PQ's residual codes are re-encoded against it (an IVF-PQ index's top hits change for many queries; recall stays close) |
| `HNSW{M}` = `HNSW{M},Flat` | none | dead + selector, compact by rebuilding the graph | until compaction | exact | results of a new graph (HNSW is approximate) |
| `HNSW{M},SQ8`, `HNSW{M},PQ{m}` (l2 only: faiss's ip search over PQ is wrong) | yes | as HNSW | until compaction | decoded codes | as HNSW |
| `PQ{m}[x{b}]` | yes | dead + over-fetch (faiss's IndexPQ takes no selector), compact via remove_ids | at most 1024 | decoded codes | yes (re-encoding a decoded code gives the code back) |
| `SQ8`, `SQ4`, `SQfp16` | yes (not fp16) | dead + selector, compact via remove_ids | until compaction | decoded codes | yes in practice (decode/encode round trip) |
| `OPQ{m}[_{d}],...`, `PCA{d},...`, `RR{d},...`, `L2norm,...` before any of the above | yes | as the inner kind | as inner | reverse-transformed (lossy for PCA with fewer dims and L2norm) | as inner, up to the rotation's rounding |

Refused (`InvalidArgumentError` naming `index_factory`): `IDMap` (ids are the slice's own),
refinement (`RFlat`), `IVF...PQ...+...` (IVFPQR), fast-scan (`...fs`), binary, LSH, NSG and
anything else faiss builds.

Training. Trained kinds are trained ONCE (`train_template`, on the coordinator) and every
slice `install`s the same bytes: the same centroids and codebooks everywhere, so a sharded
index searches exactly like one unsharded index trained the same way.

GPU. `device="cuda:N"` (a shard's own GPU; "cuda" and "auto" mean GPU 0) moves the index to that
GPU with `faiss.index_cpu_to_gpu` when faiss has GPU support, sees that GPU and implements the
kind there (Flat, IVF-Flat, IVF-PQ, IVF-SQ); otherwise the slice runs on the CPU (`device` says
which, `placement` why: `faiss_gpu` is the rule). State is always taken on the CPU. faiss's GPU indexes ignore
IDSelectors and cannot remove, so on a GPU every kind keeps dead entries and over-fetches them
(compacting through a CPU copy above 1024), and `k` is at most `MAX_K_GPU`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

try:
    import faiss
except ImportError as exc:  # an extra of the project: one of the two wheels, never both
    raise ImportError("index tables and KIF need faiss: pip install 'memserver[cpu]' (faiss-cpu), or "
                      "'memserver[gpu]' on a GPU node (faiss-gpu); `make install` / `make install-gpu`") from exc
import numpy as np
import torch

from memserver.api.errors import DataLossError, FailedPreconditionError, InvalidArgumentError
from memserver.api.types import MAX_SEARCH_K
from memserver.wire import check_norms

log = logging.getLogger(__name__)

#: Largest k a search may ask for (faiss's GPU kernels stop at 2048, half of it on a GPU:
#: room for the over-fetched dead entries).
MAX_K = MAX_SEARCH_K  # the API's bound (memserver.api.types)
MAX_K_GPU = 1024
#: A search fetches more hits while a tie crosses its k-th place, up to this many per query
#: (beyond it, which of the tied entries make the cut is faiss's choice).
TIE_FETCH_LIMIT = 2 * MAX_K
#: ...and while the hits those fetches take again, over the whole call, stay within the larger of
#: TIE_FETCH_BUDGET and TIE_FETCH_PER_HIT per hit answered (B * k): a call whose every row ties
#: (all-zero queries of an ip table, a table of duplicates) fetched up to 8,192 hits a row again, 870
#: MiB and 13 s for 2,048 queries of k=8 (a hunt). Past it, the rest is faiss's choice too.
TIE_FETCH_BUDGET, TIE_FETCH_PER_HIT = 1 << 21, 16
#: Hits one faiss call is asked for at most (rows x hits per row): a call's rows go in chunks.
FETCH_CHUNK = 1 << 20
_GPU_MAX_FETCH = 2048  # faiss's GPU k-selection limit
#: Largest ef_search (HNSW's candidate list per query; memory and time grow with it).
MAX_EF_SEARCH = 1 << 16
#: Kinds that cannot filter dead entries inside faiss fetch k + dead hits; they are compacted
#: once this many entries are dead, which bounds the over-fetch.
MAX_DEAD_OVERFETCH = 1024
#: Longest index_factory string taken: faiss's parser (a regex per token) crashed the process on
#: long ones (tens of thousands of characters); its own strings are a few dozen.
MAX_FACTORY = 256
METRICS: dict[str, int] = {"ip": faiss.METRIC_INNER_PRODUCT, "l2": faiss.METRIC_L2}
DEVICES = ("cpu", "cuda", "cuda:N", "auto")

# The faiss classes an index table may be built of (after any pre-transform).
_FLAT = ("IndexFlat", "IndexFlatIP", "IndexFlatL2")
_IVF = ("IndexIVFFlat", "IndexIVFPQ", "IndexIVFScalarQuantizer")
_HNSW = ("IndexHNSWFlat", "IndexHNSWSQ", "IndexHNSWPQ")
_CODES = ("IndexPQ", "IndexScalarQuantizer")
_GPU_KINDS = _FLAT + _IVF  # what faiss.index_cpu_to_gpu implements

# Label states in the arena.
_FREE, _LIVE, _DEAD = 0, 1, 2  # not in faiss / live / in faiss but excluded from results


def _faiss_message(err: Exception) -> str:
    """faiss's error text without its C++ location prefix."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
    return re.sub(r"^Error in .*? at \S+:\d+: (Error: )?", "", text)


def _numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        return (x.float() if x.dtype in (torch.float16, torch.bfloat16) else x).numpy()
    return np.asarray(x)


def _check_ids(ids: Any, what: str = "ids") -> np.ndarray:
    """1-D, integer, >= 0 -> contiguous int64."""
    a = _numpy(ids)
    if a.ndim != 1:
        raise InvalidArgumentError(f"{what}: must be 1-D, got shape {list(a.shape)}")
    if a.size == 0:
        return np.zeros(0, dtype=np.int64)
    if a.dtype.kind not in "iu":
        raise InvalidArgumentError(f"{what}: dtype must be an integer type (e.g. int64), got {a.dtype}")
    if a.dtype == np.uint64 and int(a.max()) > np.iinfo(np.int64).max:
        raise InvalidArgumentError(f"{what}: id {int(a.max())} does not fit in int64")
    a = np.ascontiguousarray(a, dtype=np.int64)
    if (lo := int(a.min())) < 0:
        raise InvalidArgumentError(f"{what}: negative id {lo} (ids are >= 0; -1 means 'no hit')")
    return a


def _check_rows(x: Any, n: int | None, dim: int, what: str, *, distances: bool = True) -> np.ndarray:
    """[n, dim] floating point, finite -> contiguous float32 (n None: any number of rows).
    `distances`: rows that faiss compares (vectors, queries, a training sample), so their norms
    are bounded (memserver.wire.check_norms); a payload's rows are only stored."""
    a = _numpy(x)
    if a.ndim != 2 or (n is not None and a.shape[0] != n) or a.shape[1] != dim:
        want = f"[{n if n is not None else 'n'}, {dim}]"
        raise InvalidArgumentError(f"{what}: shape must be {want}, got {list(a.shape)}")
    if a.dtype.kind != "f":
        raise InvalidArgumentError(f"{what}: dtype must be floating point, got {a.dtype}")
    with np.errstate(over="ignore"):  # float64 beyond float32's range becomes inf: refused below
        a = np.ascontiguousarray(a, dtype=np.float32)
    if a.size and not np.isfinite(a).all():
        raise InvalidArgumentError(f"{what}: contains NaN or infinite values (after conversion to float32)")
    if distances:
        check_norms(torch.from_numpy(a), what)
    return a


def _positive_int(v: Any, what: str, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 1 <= int(v) <= hi:
        raise InvalidArgumentError(f"{what}: must be an integer in [1, {hi}], got {v!r}")
    return int(v)


def _as_bytes(b: Any, what: str) -> np.ndarray:
    """Serialised index (bytes, uint8 array or tensor) -> uint8 array."""
    if isinstance(b, torch.Tensor):
        b = b.detach().cpu().numpy()
    if isinstance(b, (bytes, bytearray, memoryview)):
        return np.frombuffer(b, dtype=np.uint8)
    if isinstance(b, np.ndarray) and b.dtype == np.uint8 and b.ndim == 1:
        return b
    raise InvalidArgumentError(f"{what}: a serialised faiss index is bytes or a 1-D uint8 array, got {type(b).__name__}")


def _inner(index: faiss.Index) -> faiss.Index:
    """The index behind any pre-transform (OPQ, PCA, ...)."""
    return faiss.downcast_index(index.index) if isinstance(index, faiss.IndexPreTransform) else index


#: The seed of an HNSW graph's levels, offset by the label of the first vector of each add.
HNSW_SEED = 12345


def _tables_bytes(index: faiss.Index) -> int:
    """What faiss holds whatever the vectors: a PQ's codebook (dim x 2^nbits floats, allocated as
    the index is built: PQ1x16 at dim 2048 is 512 MiB, counted as 0 while it passed every limit:
    a hunt) and the pre-transforms' matrices (once trained)."""
    total = 0
    if isinstance(index, faiss.IndexPreTransform):
        for i in range(index.chain.size()):
            t = faiss.downcast_VectorTransform(index.chain.at(i))
            total += 4 * sum(getattr(t, f).size() for f in ("A", "b", "mean", "PCAMat", "eigenvalues") if hasattr(t, f))
        index = _inner(index)
    if isinstance(index, faiss.IndexHNSW):
        index = faiss.downcast_index(index.storage)
    pq = getattr(index, "pq", None)
    return total + (4 * int(pq.centroids.size()) if pq is not None else 0)


def _kind_name(inner: faiss.Index) -> str:
    """The inner class, with IndexFlat's metric subclasses folded (a serialised `Flat` comes back
    as IndexFlatIP/IndexFlatL2)."""
    name = type(inner).__name__
    return "IndexFlat" if name in _FLAT else name


def _signature(index: faiss.Index) -> tuple:
    """What must match between a slice and a trained template: structure, dims, metric, code size."""
    inner = _inner(index)
    ivf = faiss.try_extract_index_ivf(index)
    chain = index.chain.size() if isinstance(index, faiss.IndexPreTransform) else 0
    code = inner.storage.sa_code_size() if isinstance(inner, faiss.IndexHNSW) else inner.sa_code_size()
    return (_kind_name(inner), chain, index.d, inner.d, int(index.metric_type), code, ivf.nlist if ivf else 0)


def faiss_gpu(device: str | torch.device, faiss_gpus: int, factory: str, kind: str) -> tuple[int | None, str]:
    """The one rule for where faiss keeps an index slice: (GPU number, or None for the CPU; why,
    as the shard logs it). `device`: the slice's, the shard's device for a shard ("cpu" for a
    shard Ray gave no GPU, even where faiss sees GPUs: they are other actors'), "cuda" or "auto"
    meaning GPU 0; `faiss_gpus`: the GPUs faiss sees (0 for a CPU build); `kind`: the faiss class
    `factory` builds (its pre-transform left out)."""
    name = str(device)
    if name == "cpu":
        return None, "CPU: the shard has no GPU"
    try:
        gpu = 0 if name in ("cuda", "auto") else int(torch.device(name).index or 0)
        if torch.device("cuda" if name == "auto" else name).type != "cuda":
            raise ValueError(name)
    except (RuntimeError, ValueError):
        raise InvalidArgumentError(f"device: must be one of {list(DEVICES)}, got {device!r}") from None
    if faiss_gpus <= gpu:
        return None, (f"CPU: faiss sees {faiss_gpus} GPU(s), not GPU {gpu}" if faiss_gpus else
                      "CPU: this faiss has no GPU support (faiss-cpu) or sees no GPU")
    if kind not in _GPU_KINDS:
        return None, f"CPU: factory {factory!r} ({kind}) has no GPU version in faiss"
    return gpu, f"faiss GPU {gpu}"


class VectorIndex:
    """One slice of an index table: a faiss index of `dim`-dim vectors under user ids (>= 0), with
    `payload_dim` floats per id returned with the hits. See the module docstring for the kinds.

    Not thread-safe by design: the shard's compute thread is its only caller."""

    def __init__(
        self, dim: int, factory: str = "Flat", metric: str = "ip", payload_dim: int = 0,
        device: str | torch.device = "cpu"
    ) -> None:
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 1:
            raise InvalidArgumentError(f"dim: must be a positive integer, got {dim!r}")
        if metric not in METRICS:
            raise InvalidArgumentError(f"metric: must be one of {sorted(METRICS)}, got {metric!r}")
        if isinstance(payload_dim, bool) or not isinstance(payload_dim, (int, np.integer)) or payload_dim < 0:
            raise InvalidArgumentError(f"payload_dim: must be an integer >= 0, got {payload_dim!r}")
        self.dim, self.factory, self.metric, self.payload_dim = int(dim), factory, metric, int(payload_dim)
        fresh = self._build(self.dim, factory, metric)
        inner = _inner(fresh)
        self._sig = _signature(fresh)
        self._is_ivf = faiss.try_extract_index_ivf(fresh) is not None
        self._is_hnsw = isinstance(inner, faiss.IndexHNSW)
        self._nlist = faiss.extract_index_ivf(fresh).nlist if self._is_ivf else 0
        faiss_gpus = faiss.get_num_gpus() if hasattr(faiss, "index_cpu_to_gpu") else 0
        #: (GPU number or None, why): see faiss_gpu; the shard logs `placement`
        self._gpu, self.placement = faiss_gpu(device, faiss_gpus, factory, _kind_name(inner))
        # GPU: kept alive on the instance for as long as the GPU index lives.
        self._gpu_res: Any = faiss.StandardGpuResources() if self._gpu is not None else None
        # Dead entries are filtered inside faiss where it takes an IDSelector; otherwise fetched
        # and dropped (IndexPQ, every GPU index). IVF on the CPU removes at once instead.
        self._physical = self._is_ivf and not self.on_gpu
        self._selector_ok = not self.on_gpu and not isinstance(inner, faiss.IndexPQ)
        self._template: np.ndarray | None = faiss.serialize_index(fresh) if fresh.is_trained else None
        self.needs_training = not fresh.is_trained  # (a kind faiss trains: IVF, PQ, SQ8, ...)
        self._reset_arena()
        self._set_index(fresh)
        self._reallocs = 0

    @staticmethod
    def _build(dim: int, factory: str, metric: str) -> faiss.Index:
        if not isinstance(factory, str) or not factory.strip():
            raise InvalidArgumentError(f"index_factory: must be a non-empty string, got {factory!r}")
        if len(factory) > MAX_FACTORY:  # (faiss's parser crashed the process, SIGSEGV, on a long one: a hunt)
            raise InvalidArgumentError(f"index_factory: {factory[:64]!r}... is {len(factory):,} characters; at most "
                                       f"{MAX_FACTORY} (faiss's own strings are a few dozen)")
        if re.search(r"IDMap|RFlat|Refine|fs\b|fs,|\+", factory):
            raise InvalidArgumentError(
                f"index_factory: {factory!r} is not supported by index tables (no IDMap: ids are the "
                "table's own; no refinement, fast-scan or IVFPQR)")
        if "ITQ" in factory:  # no reverse transform: a restore into another shard count could not move its vectors
            raise InvalidArgumentError(f"index_factory: {factory!r}: ITQ is not supported by index tables (faiss cannot "
                                       "reverse it, so its vectors could not move to another sharding); use OPQ, PCA "
                                       "or RR")
        if any(int(m) < 2 for m in re.findall(r"HNSW(\d+)", factory)):  # faiss builds it, then aborts the process
            raise InvalidArgumentError(f"index_factory: {factory!r}: HNSW{{M}} needs M >= 2 (faiss builds a graph of "
                                       "fewer links, then aborts the process at the first add)")
        try:
            index = faiss.index_factory(dim, factory, METRICS[metric])
        except RuntimeError as e:
            raise InvalidArgumentError(f"index_factory: faiss cannot build {factory!r}: {_faiss_message(e)}") from None
        name = type(_inner(index)).__name__
        if name in _IVF and faiss.extract_index_ivf(index).nlist < 1:  # faiss builds it; every search then fails
            raise InvalidArgumentError(f"index_factory: {factory!r} has no inverted lists; IVF{{n}} needs n >= 1")
        if name == "IndexHNSWPQ" and metric == "ip":
            # faiss 1.15.1 answers HNSW,PQ inner-product searches with scores that are not those
            # of the stored vectors, nor in order (checked against reconstruct()).
            raise InvalidArgumentError(f"index_factory: {factory!r} (HNSW over PQ) is wrong in faiss for metric ip; "
                                       "use HNSW{M},SQ8, IVF{n},PQ{m} or metric l2")
        if name not in _FLAT + _IVF + _HNSW + _CODES:
            raise InvalidArgumentError(
                f"index_factory: {factory!r} builds a faiss {name}, which index tables do not support; use Flat, "
                "IVF{n},Flat|PQ{m}|SQ8, HNSW{M}[,Flat|SQ8|PQ{m}], PQ{m}, SQ8, optionally after OPQ/PCA")
        return index

    # -- properties ---------------------------------------------------------------------

    @property
    def kind(self) -> str:
        """The faiss factory string the slice was built with."""
        return self.factory

    @property
    def device(self) -> str:
        """Where faiss put the index: "cuda:N" or "cpu" (a GPU was asked for but faiss does not see
        it, or has no GPU implementation of this kind: "cpu"; `placement` says why)."""
        return f"cuda:{self._gpu}" if self.on_gpu else "cpu"

    @property
    def on_gpu(self) -> bool:
        return self._gpu_res is not None

    @property
    def is_trained(self) -> bool:
        return bool(self._index.is_trained)

    @property
    def ntotal(self) -> int:
        """Live entries (dead ones still inside faiss are not counted)."""
        return len(self._id_to_label)

    @property
    def reallocations(self) -> int:
        """How many times the label arena grew (it doubles: O(log N) for N adds)."""
        return self._reallocs

    def nbytes(self) -> int:
        """Approximate memory: faiss's codes, ids, graph links and centroids, the arena, the dict."""
        cpu = self._index if not self.on_gpu else None
        n = self._present()
        inner = _inner(cpu) if cpu is not None else None
        if isinstance(inner, faiss.IndexHNSW):
            faiss_bytes = n * inner.storage.sa_code_size() + inner.hnsw.neighbors.size() * 4 + n * 12
        elif self._is_ivf:
            ivf = faiss.extract_index_ivf(cpu) if cpu is not None else None
            code = ivf.code_size if ivf is not None else 0
            centroids = self._nlist * self._sig[3] * 4  # _sig[3]: the IVF's input dim
            faiss_bytes = n * (code + 8 + 16) + centroids  # codes, ids, hashtable entries
        else:
            faiss_bytes = n * (inner.sa_code_size() if inner is not None else self.dim * 4)
        arena = self._label_ids.nbytes + self._slot.nbytes + self._live_bits.nbytes + self._payload.nbytes
        template = self._template.nbytes if self._template is not None else 0
        tables = _tables_bytes(cpu) if cpu is not None else 0
        return int(faiss_bytes + tables + arena + template + 100 * len(self._id_to_label))  # ~100 B per dict entry

    # -- the arena ----------------------------------------------------------------------

    def _reset_arena(self) -> None:
        """No labels; arrays grow on the first add."""
        self._label_ids = np.zeros(0, dtype=np.int64)  # label -> user id, -1: none
        self._slot = np.zeros(0, dtype=np.uint8)  # _FREE / _LIVE / _DEAD
        self._live_bits = np.zeros(0, dtype=np.uint8)  # bit l (little-endian in byte l // 8): label l is live
        self._payload = np.zeros((0, self.payload_dim), dtype=np.float32)
        self._n_labels = 0  # labels [0, n) have been used
        self._n_dead = 0
        self._free: list[int] = []  # IVF: labels not in faiss, to reuse
        self._id_to_label: dict[int, int] = {}
        self._selector: Any = None  # over _live_bits; made again whenever that array is replaced

    def _grow(self, need: int) -> None:
        """Room for labels [0, need): double the capacity (amortised O(1) per label), starting at
        64 rows or fewer (a first row's payload of a wide table took 1,024 rows' room)."""
        cap = len(self._label_ids)
        if need <= cap:
            return
        new = max(need, 2 * cap, 64)
        new += (-new) % 8
        for name, fill in (("_label_ids", -1), ("_slot", 0), ("_payload", 0)):
            old = getattr(self, name)
            arr = np.full((new,) + old.shape[1:], fill, dtype=old.dtype)
            arr[:cap] = old
            setattr(self, name, arr)
        bits = np.zeros(new // 8, dtype=np.uint8)
        bits[: len(self._live_bits)] = self._live_bits
        self._live_bits = bits
        self._selector = None
        self._reallocs += 1

    def _set_slot(self, labels: np.ndarray, state: int) -> None:
        """O(len(labels)): the labels' states, and their bits in the live bitmap."""
        if not len(labels):
            return
        self._slot[labels] = state
        live = state == _LIVE
        byte, bit = labels >> 3, (np.uint8(1) << (labels & 7).astype(np.uint8)).astype(np.uint8)
        if live:
            np.bitwise_or.at(self._live_bits, byte, bit)
        else:
            np.bitwise_and.at(self._live_bits, byte, ~bit)

    def _present(self) -> int:
        """Entries inside faiss, live or dead."""
        return len(self._id_to_label) + self._n_dead

    def _dead_limit(self) -> int:
        half = self._n_labels // 2
        return half if self._selector_ok else min(half, MAX_DEAD_OVERFETCH)

    # -- the faiss index ----------------------------------------------------------------

    def _set_index(self, cpu_index: faiss.Index) -> None:
        """Make a CPU index the slice's (on the GPU if the slice is there), reading its defaults."""
        inner = _inner(cpu_index)
        if self._is_ivf and not self.on_gpu:
            ivf = faiss.extract_index_ivf(cpu_index)
            if ivf.direct_map.type != faiss.DirectMap.Hashtable:  # O(1) removal and reconstruct by label
                ivf.set_direct_map_type(faiss.DirectMap.Hashtable)
        self._nprobe = faiss.extract_index_ivf(cpu_index).nprobe if self._is_ivf else 0
        self._ef_search = inner.hnsw.efSearch if isinstance(inner, faiss.IndexHNSW) else 0
        self._index = faiss.index_cpu_to_gpu(self._gpu_res, self._gpu, cpu_index) if self.on_gpu else cpu_index

    def _cpu_index(self) -> faiss.Index:
        """The index on the CPU (a copy when the slice is on a GPU; then IVF gets its hashtable)."""
        if not self.on_gpu:
            return self._index
        cpu = faiss.index_gpu_to_cpu(self._index)
        if self._is_ivf:
            faiss.extract_index_ivf(cpu).set_direct_map_type(faiss.DirectMap.Hashtable)
        return cpu

    def _require_trained(self, call: str) -> None:
        if not self._index.is_trained:
            raise FailedPreconditionError(
                f"{call}: the {self.factory!r} index is not trained: call train_index(...) first "
                "(train a template on a sample and install it on every slice)")

    # -- training -----------------------------------------------------------------------

    @staticmethod
    def train_template(dim: int, factory: str, metric: str, sample: Any) -> bytes:
        """Train an empty `factory` index on `sample` [m, dim] and return it serialised: the one
        template every slice of the table installs."""
        return VectorIndex(dim, factory, metric).train(sample)

    def train(self, sample: Any) -> bytes:
        """Train this (empty) slice on `sample` [m, dim], install the result and return it
        serialised (`install` it on the other slices). Kinds that need no training install a
        fresh empty index. Refused (FailedPreconditionError) while the slice holds entries."""
        x = _check_rows(sample, None, self.dim, "sample")
        if self.ntotal:
            raise FailedPreconditionError(
                f"train_index: the slice holds {self.ntotal} vectors; only an empty index can be trained")
        index = self._build(self.dim, self.factory, self.metric)
        if not index.is_trained:
            if len(x) == 0:
                raise InvalidArgumentError("sample: empty; training needs vectors")
            try:
                with _clustering_quieted(index, f"training {self.factory!r} on {len(x):,} vectors", len(x)):
                    index.train(x)
            except RuntimeError as e:
                raise InvalidArgumentError(
                    f"sample: faiss cannot train {self.factory!r} on {len(x)} vectors: {_faiss_message(e)}") from None
        trained = faiss.serialize_index(index).tobytes()
        self.install(trained)
        return trained

    def install(self, trained: Any) -> None:
        """Make this empty slice's index the trained template `trained` (serialise_index bytes of
        an empty index of the same factory, dim and metric: checked)."""
        buf = _as_bytes(trained, "trained")
        try:
            index = faiss.deserialize_index(buf)
        except RuntimeError as e:
            raise InvalidArgumentError(f"trained: not a serialised faiss index: {_faiss_message(e)}") from None
        if _signature(index) != self._sig:
            raise InvalidArgumentError(
                f"trained: the template is not an index of {self.factory!r} ({self.metric}, dim {self.dim})")
        if not index.is_trained or index.ntotal:
            raise InvalidArgumentError(
                f"trained: the template must be trained and empty (is_trained={index.is_trained}, ntotal={index.ntotal})")
        if self.ntotal:
            raise FailedPreconditionError(
                f"install: the slice holds {self.ntotal} vectors; a template is installed on an empty slice only")
        self._template = buf.copy()
        self._reset_arena()
        self._set_index(index)

    def template(self) -> bytes:
        """The trained empty index this slice was built from (what a new slice installs)."""
        if self._template is None:
            raise FailedPreconditionError(f"template: the {self.factory!r} index is not trained: call train_index(...) first")
        return self._template.tobytes()

    # -- writes -------------------------------------------------------------------------

    def check_add(self, ids: Any, vectors: Any, payload: Any = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Validate an add without changing anything (the shard logs a write only once it would
        apply): trained, ids 1-D int64 >= 0 and distinct, vectors [n, dim] finite, payload
        [n, payload_dim] iff payload_dim > 0. Returns them as numpy arrays."""
        self._require_trained("add")
        ids = _check_ids(ids)
        n = len(ids)
        x = _check_rows(vectors, n, self.dim, "vectors")
        if self.payload_dim == 0 and payload is not None:
            raise InvalidArgumentError("payload: this index stores no payload (payload_dim=0)")
        if self.payload_dim and payload is None:
            raise InvalidArgumentError(f"payload: required, shape [{n}, {self.payload_dim}] (payload_dim={self.payload_dim})")
        p = _check_rows(payload, n, self.payload_dim, "payload", distances=False) if self.payload_dim else None
        uniq, counts = np.unique(ids, return_counts=True)
        if len(uniq) != n:
            raise InvalidArgumentError(f"ids: id {int(uniq[counts > 1][0])} appears more than once in one add")
        return ids, x, p

    def add(self, ids: Any, vectors: Any, payload: Any = None) -> int:
        """Upsert: each id gets `vectors[i]` (and `payload[i]`); an id already there is replaced
        and its old vector is never returned again. Returns the number of ids written.

        Everything is checked before anything changes (`check_add`)."""
        return self.add_checked(*self.check_add(ids, vectors, payload))

    def add_checked(self, ids: np.ndarray, x: np.ndarray, p: np.ndarray | None) -> int:
        """`add` of what `check_add` returned (the shard checks before it logs, then applies)."""
        n = len(ids)
        if n == 0:
            return 0

        # Labels: replaced ids' old labels, then the new ones (reused free labels first: IVF).
        id_list = ids.tolist()
        old = np.fromiter((self._id_to_label.get(i, -1) for i in id_list), dtype=np.int64, count=n)
        old = old[old >= 0]
        reuse = min(n, len(self._free))  # only IVF frees labels
        fresh = n - reuse
        self._grow(self._n_labels + fresh)
        labels = np.empty(n, dtype=np.int64)
        if reuse:
            labels[:reuse] = self._free[len(self._free) - reuse:]
        labels[reuse:] = np.arange(self._n_labels, self._n_labels + fresh)

        # faiss first: if it throws, the slice is as it was.
        if self._is_ivf:
            self._index.add_with_ids(x, labels)
        else:
            assert self._index.ntotal == self._n_labels, "flat kinds number their entries 0..ntotal-1"
            if self._is_hnsw and not self.on_gpu:
                # a node's level is drawn from the graph's generator, which faiss does not save: a slice
                # loaded from its checkpoint (a restart's replay, a restore) drew other levels for the same
                # adds, and answered otherwise than before (a hunt). Seeded by where the adds start, the
                # same adds draw the same levels however the slice came to be.
                _inner(self._index).hnsw.rng = faiss.RandomGenerator(HNSW_SEED + self._n_labels)
            self._index.add(x)
        if reuse:
            del self._free[len(self._free) - reuse:]
        self._n_labels += fresh
        self._drop_labels(old)
        self._label_ids[labels] = ids
        if p is not None:
            self._payload[labels] = p
        self._set_slot(labels, _LIVE)
        self._id_to_label.update(zip(id_list, labels.tolist()))
        self._maybe_compact()
        return n

    def remove(self, ids: Any) -> int:
        """Remove ids (absent ones are ignored); returns how many were there."""
        ids = _check_ids(ids)
        labels = [self._id_to_label.pop(i) for i in np.unique(ids).tolist() if i in self._id_to_label]
        self._drop_labels(np.asarray(labels, dtype=np.int64))
        self._maybe_compact()
        return len(labels)

    def _drop_labels(self, labels: np.ndarray) -> None:
        """Labels whose ids are gone or replaced (the caller updates id_to_label): out of faiss
        at once (IVF on the CPU) or dead until compaction."""
        if not len(labels):
            return
        self._label_ids[labels] = -1
        if self._physical:
            self._index.remove_ids(faiss.IDSelectorArray(labels))  # the hashtable: O(len(labels))
            self._set_slot(labels, _FREE)
            self._free.extend(labels.tolist())
        else:
            self._set_slot(labels, _DEAD)
            self._n_dead += len(labels)

    def _maybe_compact(self) -> None:
        if self._n_dead and self._n_dead > self._dead_limit():
            self.compact()

    def compact(self) -> None:
        """Take the dead entries out of faiss: O(entries) once they are half of the slice (or
        MAX_DEAD_OVERFETCH where they are over-fetched). Codes are kept as they are (remove_ids),
        except HNSW, whose graph is rebuilt from its stored vectors."""
        if not self._n_dead:
            return
        cpu = self._cpu_index()
        end = self._n_labels
        if self._is_ivf:  # IVF keeps labels: the dead ones become free
            dead = np.flatnonzero(self._slot[:end] == _DEAD)
            cpu.remove_ids(faiss.IDSelectorArray(dead))
            self._slot[dead] = _FREE
            self._free.extend(dead.tolist())
        else:  # flat kinds and HNSW number entries 0..ntotal-1: renumber the live ones in order
            keep = self._slot[:end] == _LIVE
            live = np.flatnonzero(keep)
            if self._is_hnsw:
                cpu = self._rebuild_hnsw(cpu, live)
            else:
                cpu.remove_ids(faiss.IDSelectorBitmap(np.packbits(~keep, bitorder="little")))
            n = len(live)
            self._label_ids[:n] = self._label_ids[live]
            self._label_ids[n:end] = -1
            self._payload[:n] = self._payload[live]
            self._payload[n:end] = 0
            self._slot[:n], self._slot[n:end] = _LIVE, _FREE
            self._live_bits[:] = np.packbits(self._slot == _LIVE, bitorder="little")
            self._id_to_label = dict(zip(self._label_ids[:n].tolist(), range(n)))
            self._n_labels = n
        self._n_dead = 0
        self._set_index(cpu)

    def _rebuild_hnsw(self, cpu: faiss.Index, live: np.ndarray) -> faiss.Index:
        """A new graph over the live entries' stored vectors (in the transformed space, so a
        pre-transform is not applied twice; exact for HNSW,Flat, re-encoded for SQ/PQ storage)."""
        vectors = _inner(cpu).reconstruct_batch(live) if len(live) else np.zeros((0, _inner(cpu).d), np.float32)
        new = faiss.deserialize_index(self._template)
        inner = _inner(new)
        inner.hnsw.efSearch = self._ef_search
        inner.add(vectors)
        new.ntotal = inner.ntotal  # an IndexPreTransform counts its own entries
        return new

    # -- reads --------------------------------------------------------------------------

    def search(
        self,
        queries: Any,
        k: int,
        nprobe: int | None = None,
        ef_search: int | None = None,
        with_payload: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The k best live entries for each query: scores [B, k] float32 (inner products for ip,
        squared distances for l2, as faiss computes them), ids [B, k] int64 and, with_payload
        and payload_dim > 0, payload [B, k, payload_dim] (else None). Missing hits are id -1,
        score -inf (ip) / +inf (l2), payload zeros. Each row is in the metric's order with ties
        by smaller id, also at the k-th place (more hits are fetched until a tie there is whole,
        up to TIE_FETCH_LIMIT and TIE_FETCH_BUDGET), so the answer does not depend on insertion
        order and merges exactly across slices. Cost: faiss's search for k + 1 hits (+ dead
        entries where they are over-fetched), again with twice as many only for rows with a tie
        at the k-th place, in chunks of at most FETCH_CHUNK hits.

        nprobe (IVF) and ef_search (HNSW) apply to this call only."""
        scores, ids, labels, hit = self._search(queries, k, nprobe, ef_search)
        payload = None
        if with_payload and self.payload_dim:
            payload = np.zeros((*ids.shape, self.payload_dim), dtype=np.float32)
            payload[hit] = self._payload[labels[hit]]
        return (torch.from_numpy(scores), torch.from_numpy(ids),
                torch.from_numpy(payload) if payload is not None else None)

    def search_distinct(
        self, queries: Any, k: int, nprobe: int | None = None, ef_search: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`search` with each distinct hit's payload once, not once per hit: scores [B, k], ids
        [B, k], payload_ids [U] int64 (the distinct ids >= 0 of `ids`, ascending) and payload
        [U, payload_dim], row j that of payload_ids[j]. A shard's search answer: queries that
        share hits (a knowledge source's: a batch of positions over a few thousand encodings)
        would otherwise send the same rows many times (B * k rows against U <= B * k)."""
        scores, ids, labels, hit = self._search(queries, k, nprobe, ef_search)
        found = np.unique(labels[hit])  # live labels: one id each
        found_ids = self._label_ids[found]
        order = np.argsort(found_ids, kind="stable")
        payload = self._payload[found[order]] if self.payload_dim else np.zeros((len(found), 0), dtype=np.float32)
        return (torch.from_numpy(scores), torch.from_numpy(ids), torch.from_numpy(found_ids[order]),
                torch.from_numpy(payload))

    def _search(self, queries: Any, k: int, nprobe: int | None, ef_search: int | None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """`search`'s hits: scores, ids, their labels and where there is a hit ([B, k] each)."""
        self._require_trained("search")
        k = _positive_int(k, "k", MAX_K_GPU if self.on_gpu else MAX_K)
        q = _check_rows(queries, None, self.dim, "queries")
        b, ip, live = len(q), self.metric == "ip", self.ntotal
        fill = -np.inf if ip else np.inf
        scores = np.full((b, k), fill, dtype=np.float32)
        labels = np.full((b, k), -1, dtype=np.int64)
        rows = np.arange(b if live else 0)
        cap = min(live, TIE_FETCH_LIMIT)
        if self.on_gpu:
            cap = min(cap, _GPU_MAX_FETCH - self._n_dead)  # >= k: at most MAX_DEAD_OVERFETCH dead
        want = min(k + 1, cap)  # one more than k: a tie at the k-th place shows
        params = self._params(nprobe, ef_search, want)
        budget = max(TIE_FETCH_BUDGET, TIE_FETCH_PER_HIT * b * k)  # hits the fetches again may take
        while len(rows):
            more, step = min(2 * want, cap), max(1, FETCH_CHUNK // want)
            redo = []
            for at in range(0, len(rows), step):
                part = rows[at : at + step]
                s, lab, cut = self._fetch(q[part], want, params)
                ids = np.where(lab >= 0, self._label_ids[np.maximum(lab, 0)], -1)  # dead labels: -1 too
                order = np.lexsort((ids, -s if ip else s, ids < 0))  # hits first, metric order, smaller id
                s, lab = np.take_along_axis(s, order, 1)[:, :k], np.take_along_axis(lab, order, 1)[:, :k]
                # faiss cut its answer at `cut`: if that equals the k-th score, entries tied with it
                # may be left out. Fetch those rows again with twice as many, within the budget.
                again = (cut == s[:, -1]) & (want < cap)
                if (n := int(again.sum()) * more) > budget:  # past the budget: faiss's choice of the tied
                    again[:] = False
                else:
                    budget -= n
                scores[part[~again], : s.shape[1]], labels[part[~again], : s.shape[1]] = s[~again], lab[~again]
                redo.append(part[again])
            rows, want = np.concatenate(redo), more
            if self._is_hnsw and len(rows):  # (its candidate list follows the wider fetch)
                params = self._params(nprobe, ef_search, want)
        ids = np.full((b, k), -1, dtype=np.int64)
        hit = labels >= 0
        ids[hit] = self._label_ids[labels[hit]]
        hit &= ids >= 0
        ids[~hit], scores[~hit] = -1, fill
        return scores, ids, labels, hit

    def _params(self, nprobe: int | None, ef_search: int | None, fetch: int = 0) -> Any:
        """This call's faiss SearchParameters: nprobe/efSearch (the index's own by default; HNSW's
        at least `fetch`, the hits asked of faiss: with its default 16 a k=1000 search of 1,000
        live entries gave 530-600 hits and -1s for the rest, an index walkthrough) and the
        live-label selector, wrapped for a pre-transform. None where faiss takes none."""
        if nprobe is not None and not self._is_ivf:
            raise InvalidArgumentError(f"nprobe: only IVF indexes take nprobe; this one is {self.factory!r}")
        if ef_search is not None and not self._is_hnsw:
            raise InvalidArgumentError(f"ef_search: only HNSW indexes take ef_search; this one is {self.factory!r}")
        sel = None
        if self._n_dead and self._selector_ok:
            if self._selector is None:  # refers to _live_bits' buffer: remade when it is reallocated
                self._selector = faiss.IDSelectorBitmap(self._live_bits)
            sel = self._selector
        if self._is_ivf:
            n = _positive_int(nprobe, "nprobe", 1 << 30) if nprobe is not None else self._nprobe
            p = faiss.SearchParametersIVF(nprobe=min(n, self._nlist, 2048 if self.on_gpu else n))  # GPU: <= 2048
        elif self._is_hnsw:
            ef = _positive_int(ef_search, "ef_search", MAX_EF_SEARCH) if ef_search is not None else self._ef_search
            # the graph's dead entries take places in the candidate list the selector then skips: a
            # list as long as it would be over the live entries alone (live entries were missed and
            # recall fell with the dead: a hunt)
            ef = max(ef, fetch)
            if self._n_dead:
                ef = -(-ef * self._n_labels // max(1, self._n_labels - self._n_dead))
            p = faiss.SearchParametersHNSW(efSearch=min(ef, MAX_EF_SEARCH))
        elif sel is not None:
            p = faiss.SearchParameters()
        else:
            return None
        if sel is not None:
            p.sel = sel
        if isinstance(self._index, faiss.IndexPreTransform):
            p = faiss.SearchParametersPreTransform(index_params=p)
        return p

    def _fetch(self, q: np.ndarray, want: int, params: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """faiss's `want` best for each query: scores, labels (-1: none) and the score faiss cut
        at (NaN where it returned fewer than asked: nothing was cut). Where faiss cannot skip
        dead entries they are fetched on top and mapped to -1 by the caller."""
        extra = 0 if self._selector_ok else self._n_dead
        d, lab = self._index.search(q, want + extra, params=params)
        d[lab < 0] = np.nan
        cut = d[:, -1]
        return d, lab, cut

    def entries(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The live entries, by id: ids [n], vectors [n, dim] (as faiss reconstructs them: exact
        for Flat, IVF-Flat and HNSW,Flat; the decoded codes for PQ/SQ kinds; reverse-transformed
        for OPQ/PCA), payload [n, payload_dim] or None. Re-adding them into slices installed
        from the same template rebuilds the table for any number of slices."""
        live = np.flatnonzero(self._slot[: self._n_labels] == _LIVE)
        live = live[np.argsort(self._label_ids[live], kind="stable")]
        ids = self._label_ids[live]
        if len(live):
            vectors = self._cpu_index().reconstruct_batch(live)
        else:
            vectors = np.zeros((0, self.dim), dtype=np.float32)
        payload = torch.from_numpy(self._payload[live]) if self.payload_dim else None
        return torch.from_numpy(ids.copy()), torch.from_numpy(vectors), payload

    # -- checkpoints --------------------------------------------------------------------

    def state(self) -> dict[str, torch.Tensor]:
        """Everything a checkpoint keeps (copies, so later writes do not change them):

        - "index": the faiss index, serialize_index bytes (uint8 [bytes]);
        - "template": the trained empty index it was built from (uint8 [bytes]; empty while
          the slice is not trained);
        - "label_ids": int64 [L], the user id of each faiss label, -1 for none;
        - "dead": bool [L], labels still inside faiss but excluded from results;
        - "payload": float32 [L, payload_dim], by label (only when payload_dim > 0)."""
        end = self._n_labels
        template = self._template.copy() if self._template is not None else np.zeros(0, np.uint8)
        out = {
            "index": torch.from_numpy(faiss.serialize_index(self._cpu_index())),
            "template": torch.from_numpy(template),
            "label_ids": torch.from_numpy(self._label_ids[:end].copy()),
            "dead": torch.from_numpy(self._slot[:end] == _DEAD),
        }
        if self.payload_dim:
            out["payload"] = torch.from_numpy(self._payload[:end].copy())
        return out

    @classmethod
    def from_state(
        cls, dim: int, factory: str, metric: str, payload_dim: int, state: dict[str, Any],
        device: str | torch.device = "cpu"
    ) -> VectorIndex:
        """The slice a `state()` was taken of (InvalidArgumentError if it is not of this spec,
        DataLossError if its parts do not agree)."""
        self = cls(dim, factory, metric, payload_dim, device)
        missing = ({"index", "template", "label_ids", "dead"} | ({"payload"} if payload_dim else set())) - set(state)
        if missing:
            raise DataLossError(f"index state: missing {sorted(missing)}")
        if len(_as_bytes(state["template"], "state['template']")):
            self.install(state["template"])
        try:
            index = faiss.deserialize_index(_as_bytes(state["index"], "state['index']"))
        except RuntimeError as e:
            raise DataLossError(f"index state: the faiss index does not load: {_faiss_message(e)}") from None
        if _signature(index) != self._sig:
            raise InvalidArgumentError(f"state: the index is not of {factory!r} ({metric}, dim {dim})")
        if index.is_trained != (self._template is not None):
            raise DataLossError("index state: the index and its template disagree on training")
        label_ids = np.ascontiguousarray(_numpy(state["label_ids"]), dtype=np.int64)
        dead = np.ascontiguousarray(_numpy(state["dead"]), dtype=bool)
        end = len(label_ids)
        payload = (np.ascontiguousarray(_numpy(state["payload"]), dtype=np.float32) if payload_dim
                   else np.zeros((end, 0), np.float32))
        live = label_ids >= 0
        if dead.shape != (end,) or payload.shape != (end, payload_dim) or (live & dead).any():
            raise DataLossError("index state: label_ids, dead and payload do not agree")
        present = int(live.sum() + dead.sum())
        if index.ntotal != (present if self._is_ivf else end) or (not self._is_ivf and present != end):
            raise DataLossError(f"index state: faiss holds {index.ntotal} entries, the labels say {present}")
        self._grow(end)
        self._label_ids[:end], self._payload[:end] = label_ids, payload
        self._n_labels = end
        labels = np.flatnonzero(live)
        self._id_to_label = dict(zip(label_ids[labels].tolist(), labels.tolist()))
        if len(self._id_to_label) != len(labels):
            raise DataLossError("index state: an id has two labels")
        self._set_index(index)
        self._set_slot(labels, _LIVE)
        dead_labels = np.flatnonzero(dead)
        self._set_slot(dead_labels, _DEAD)
        self._n_dead = len(dead_labels)
        if self._is_ivf:
            self._free = np.flatnonzero(~live & ~dead).tolist()
            if self._physical and self._n_dead:  # saved on a GPU: remove them here
                self._index.remove_ids(faiss.IDSelectorArray(dead_labels))
                self._set_slot(dead_labels, _FREE)
                self._free.extend(dead_labels.tolist())
                self._n_dead = 0
        self._reallocs = 0
        return self


#: faiss's advice for k-means: at least this many training points per centroid (its
#: ClusteringParameters.min_points_per_centroid, below which it prints a warning per k-means).
POINTS_PER_CENTROID = 39


@contextmanager
def _clustering_quieted(index: Any, what: str, n: int) -> Iterator[None]:
    """faiss's C++ prints "WARNING clustering n points to k centroids" to stderr for every k-means
    run on fewer than 39 points per centroid: one per sub-quantizer, and per OPQ iteration
    (hundreds of lines for one OPQ train, into `up`'s memserver.log). Its threshold only decides that
    warning, so it is set to 0 on the k-means this train runs (the IVF's coarse quantizer, a PQ's,
    an OPQ rotation's own PQ, given for the train and taken back after: the same numbers), and the
    advice is logged here once per k-means size. Factories not walked here warn as faiss does."""
    ks: list[int] = []
    opqs: list[tuple[Any, Any]] = []  # (OPQMatrix, the ProductQuantizer lent to its train)

    def quiet(q: Any, k: int) -> None:  # a ProductQuantizer's or an IVF's ClusteringParameters holder
        q.cp.min_points_per_centroid = 0
        ks.append(k)

    inner = index
    if isinstance(index, faiss.IndexPreTransform):
        for i in range(index.chain.size()):
            vt = faiss.downcast_VectorTransform(index.chain.at(i))
            if isinstance(vt, faiss.OPQMatrix) and vt.pq is None:
                pq = faiss.ProductQuantizer(vt.d_out, vt.M, 8)  # as OPQMatrix::train's own default
                quiet(pq, 1 << 8)
                vt.pq = pq
                opqs.append((vt, pq))
        inner = faiss.downcast_index(index.index)
    ivf = faiss.try_extract_index_ivf(inner)
    if ivf is not None:
        quiet(ivf, ivf.nlist)
        inner = faiss.downcast_index(ivf)
    if isinstance(inner, faiss.IndexHNSW):
        inner = faiss.downcast_index(inner.storage)
    if isinstance(getattr(inner, "pq", None), faiss.ProductQuantizer):
        quiet(inner.pq, 1 << inner.pq.nbits)
    try:
        yield
    finally:
        for vt, _ in opqs:
            vt.pq = None  # the lent quantizer is freed with this frame: no pointer to it stays
    for k in sorted(set(ks)):
        if n < POINTS_PER_CENTROID * k:
            log.warning("%s: k-means of %d centroids wants at least %d training vectors (faiss's advice: %d per "
                        "centroid); this quantizer will be coarse", what, k, POINTS_PER_CENTROID * k, POINTS_PER_CENTROID)
