"""A value table slice larger than memory: its rows on disk under a bounded cache of hot rows.

`DiskTable` answers every call `ValueTable` answers with the same numbers. A write (a step, a
push, write_rows) runs the same code: it gathers the rows it touches (each distinct row once,
from the cache or the file) into a small dense working set, runs `ValueTable`'s math on it
(`ValueTable.over`: the same numba kernels, the same optimizer step), and scatters the changed
rows back. A read (bag, lookup) takes no working set: one compiled pass (`_read_rows`) finds
each id's row where it is, its cache slot or its record in the file's mapping (misses checked,
then placed in the cache), and a second sums (`_bag_sum`, in the order and with the roundings
of torch's CPU embedding_bag, the in-memory table's bag) or copies the values straight from
there. Either way a call's memory grows with the rows it touches, never with the table.

On disk, one file per slice, `rows.dat`: a fixed-stride record per row holding everything a
step reads and writes, so a miss is one read and a write-back one write of one place:

    updates int64 | last_update float64 | check uint32 | pad | weight f32[dim] | acc f32 (adagrad)
                                                              | exp_avg f32[dim], exp_avg_sq f32[dim] (adam)

(`check` is a checksum of the rest of the record, `_check_of`: a corrupt row is refused by
name, never served). The read counters (hits, weight mass: written by every read, never by a step) are a
second file, `stats.dat`, mapped and locked in memory (`COUNTER_BYTES`), so reads never dirty a row. The
cache keeps whole records in the same layout, so moving a row is one copy.

The cache: CLOCK (a reference bit per slot, a hand that sweeps) for the victim, and TinyLFU
admission (a 4-bit count-min sketch of recent reads, halved every 10 x capacity additions): a
missed row replaces the victim only when it was read more often recently. A call pins its hits
first, then places its misses together (`_admit`: one CLOCK victim offered to each miss, in
order), so no miss of a call evicts a row the same call read. Memory layers read
Zipf-like, and a scan of cold rows (a uniform batch) then cannot flush the hot ones; measured
against plain LRU in `benchmarks.disk_tier` (docs/benchmarks.md). Everything the cache holds
(records, the row -> slot hash, CLOCK bits, sketch) is counted against `cache_bytes`.

The file is the slice's working copy, not its durable state: as for an in-memory slice, that
is the latest checkpoint plus the write-ahead log (memserver.server.shard_actor rebuilds the
file from them on every restart), so a process killed in the middle of a write-back loses
nothing acknowledged. The file is allocated whole at creation (`posix_fallocate`), so a full
disk is refused then, by name, and never hits a write-back later.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import math
import mmap
import os
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from pathlib import Path

import numba as nb
import numpy as np
import torch
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from memserver.api.errors import DataLossError, FailedPreconditionError, MemserverError, ResourceExhaustedError
from memserver.core import kernels
from memserver.core.init import init_values
from memserver.core.optim import OptimizerConfig
from memserver.core.table import ValueTable

#: Bytes of a record before its values: updates, last_update, check, pad.
HEADER = 24
#: Bytes of a row's read counters (hits int64, weight_mass float64) in stats.dat, which a slice
#: keeps in memory (mlock): every read writes them, and a Zipf call touches most of their
#: pages, so left to the page cache they are evicted by the records streaming through and a
#: call faults on them one at a time (a Zipf 1.0 bag's q/s 1.3-1.6x lower once the file exceeds
#: memory: docs/benchmarks.md). The catalog counts them with the cache (catalog.slice_size).
COUNTER_BYTES = 16
#: Rows per chunk when the whole file is streamed (creation, checksums, statistics).
_CHUNK_ROWS = 1 << 14
POLICIES = ("tinylfu", "clock")
#: The smallest cache bound: the cache's fixed bookkeeping fits in it with room for slots.
MIN_CACHE_BYTES = 1024
# indices into the cache's small state array
_HAND, _EPOCH, _ADDS, _SAMPLE, _USED, _EVICT, _HITS, _MISSES, _SHIFT = range(9)
# and the CPU ticks (`_ticks`) reads spent in each stage of `_read_rows`: benchmarks.disk_profile
_T_IDS, _T_CHECK, _T_PLACE = range(9, 12)
# and the rows whose pages `_read_ahead` asked the kernel for (the file was not in memory), and
# the ticks `_read_rows` spent in it (the look, and the requests when the file was cold)
_AHEAD_ROWS, _T_AHEAD = 12, 13
_EMPTY = np.int64(-1)


_OPTIONAL_FIELDS = ("weight", "acc", "exp_avg", "exp_avg_sq")
_LIBC = ctypes.CDLL(None, use_errno=True)
#: What a data file's DATA_LOSS tells the operator to do.
_REBUILD = ("restart the shard to rebuild it from its checkpoint and, for a table with `wal`, its write-ahead log "
            "(without one, its writes since that checkpoint are lost)")
log = logging.getLogger(__name__)


def unpack(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's state as `ValueTable.state()` names it: a disk slice's records and counters
    (`DiskTable.checkpoint_state`) become views of them (nothing copied); any other state as it is."""
    if "records" not in state:
        return state
    recs, stats = state["records"], state["stats"]
    out = {}
    for name, (off, k) in zip(_OPTIONAL_FIELDS, state["record_fields"].tolist()):
        if off >= 0:
            v = _as(recs[:, off : off + 4 * k], torch.float32)
            out[name] = v[:, 0] if name == "acc" else v
    counters = stats.reshape(-1, COUNTER_BYTES)  # (a slice of no rows: `_as` makes its views)
    out.update(updates=_as(recs[:, 0:8], torch.int64)[:, 0], last_update=_as(recs[:, 8:16], torch.float64)[:, 0],
               hits=_as(counters[:, :8], torch.int64)[:, 0], weight_mass=_as(counters[:, 8:16], torch.float64)[:, 0])
    return out


def cache_size(cap: int, record: int, policy: str = "tinylfu") -> int:
    """The bytes a cache of `cap` slots of `record`-byte records allocates: the records, each
    slot's row, CLOCK and dirty bits and pin, the row -> slot hash (>= 2 x cap places) and the
    TinyLFU sketch (DiskTable._make_cache)."""
    h, w = DiskTable._shape(cap)
    return cap * (record + 8 + 1 + 1 + 8) + h * 16 + 4 * (w if policy == "tinylfu" and cap else 1) + 16 * 8


def files_bytes(rows: int, dim: int, optimizer: str) -> int:
    """The disk a slice's files take (rows.dat's records and stats.dat's counters, allocated whole
    at creation: DiskTable._create)."""
    return rows * (record_layout(dim, optimizer)[0] + COUNTER_BYTES)


def record_layout(dim: int, optimizer: str) -> tuple[int, dict[str, tuple[int, int]]]:
    """(record bytes, {field: (byte offset, float32 count)}) of a row of `dim` values."""
    fields = {"weight": (HEADER, dim)}
    end = HEADER + 4 * dim
    if optimizer == "adagrad":
        fields["acc"] = (end, 1)
        end += 4
    elif optimizer == "adam":
        fields["exp_avg"] = (end, dim)
        fields["exp_avg_sq"] = (end + 4 * dim, dim)
        end += 8 * dim
    return (end + 7) // 8 * 8, fields


# ------------------------------------------------------------------ compiled bookkeeping


@nb.njit(inline="always")
def _mix(x, k):  # pragma: no cover - compiled
    h = (np.uint64(x) + np.uint64(k)) * np.uint64(0x9E3779B97F4A7C15)
    return h ^ (h >> np.uint64(29))


@nb.njit(inline="always")
def _fnv(h, x):  # pragma: no cover - compiled
    """One FNV-1a step on a 32-bit state (held in a uint64) and a 32-bit word."""
    return ((h ^ x) * np.uint64(16777619)) & np.uint64(0xFFFFFFFF)


@nb.njit(inline="always")
def _check_of(rec):  # pragma: no cover - compiled
    """A record's checksum: FNV-1a over its uint32 words in 8 interleaved lanes (word k to lane
    k mod 8; the check word and its pad, words 4 and 5, read as 0), the lanes folded by FNV-1a.
    Every step is a bijection of its lane, so any change to one word is caught; 8 independent
    chains instead of one (a miss's check was most of a read's time: 7x faster). The record as
    uint64 words (8-byte reads; records are a multiple of 8 bytes, at least 4 words)."""
    m = np.uint64(0xFFFFFFFF)
    h0 = h1 = h2 = h3 = h4 = h5 = h6 = h7 = np.uint64(2166136261)
    nw = rec.shape[0]
    for j in range(0, nw - nw % 4, 4):
        a, b, c, d = rec[j], rec[j + 1], rec[j + 2], rec[j + 3]
        if j == 0:
            c = np.uint64(0)
        h0, h1 = _fnv(h0, a & m), _fnv(h1, a >> np.uint64(32))
        h2, h3 = _fnv(h2, b & m), _fnv(h3, b >> np.uint64(32))
        h4, h5 = _fnv(h4, c & m), _fnv(h5, c >> np.uint64(32))
        h6, h7 = _fnv(h6, d & m), _fnv(h7, d >> np.uint64(32))
    for j in range(nw - nw % 4, nw):
        a = rec[j]
        h0, h1 = _fnv(h0, a & m), _fnv(h1, a >> np.uint64(32))
    h = np.uint64(2166136261)
    for x in (h0, h1, h2, h3, h4, h5, h6, h7):
        h = _fnv(h, x)
    return h


@nb.njit(inline="always")
def _intact(rec):  # pragma: no cover - compiled
    return _check_of(rec) == rec[2] & np.uint64(0xFFFFFFFF)


@nb.njit(inline="always")
def _seal(rec):  # pragma: no cover - compiled
    """Set a record's check word (uint32 word 4; its pad, word 5, kept)."""
    rec[2] = (rec[2] & np.uint64(0xFFFFFFFF00000000)) | _check_of(rec)


@nb.njit(parallel=True, nogil=True, cache=True)
def _set_checks(words):  # pragma: no cover - compiled
    """words [n, R/8] (records as uint64): seal each."""
    for i in nb.prange(words.shape[0]):
        _seal(words[i])


def _prefetch_codegen(context, builder, signature, args):  # pragma: no cover - compiled
    aty = signature.args[0]
    ary = context.make_array(aty)(context, builder, args[0])
    ptr = cgutils.get_item_pointer(context, builder, aty, ary, list(args[1:]), wraparound=False, boundscheck=False)
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                        "llvm.prefetch.p0")
    builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
    return context.get_dummy_value()


@intrinsic
def _prefetch(typingctx, a, i):  # pragma: no cover - compiled
    """Ask the CPU to bring the cache line of a[i] (a 1-D array) closer (llvm.prefetch: a read,
    kept in all levels); a hint, never a fault."""
    if isinstance(a, types.Array) and a.ndim == 1:
        return types.void(a, types.intp), _prefetch_codegen
    return None


@intrinsic
def _prefetch2(typingctx, a, i, j):  # pragma: no cover - compiled
    """`_prefetch` of a[i, j] (a 2-D array)."""
    if isinstance(a, types.Array) and a.ndim == 2:
        return types.void(a, types.intp, types.intp), _prefetch_codegen
    return None


@intrinsic
def _ticks(typingctx):  # pragma: no cover - compiled
    """The CPU's cycle counter (llvm.readcyclecounter: the TSC on x86, 0 where there is none)."""

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                            "llvm.readcyclecounter")
        return builder.call(fn, [])

    return types.int64(), codegen


@nb.njit(nogil=True)
def ticks():  # pragma: no cover - compiled
    """`_ticks` for Python (benchmarks.disk_profile calibrates the stages' counts with it)."""
    return _ticks()


@intrinsic
def _fma32(typingctx, a, b, c):  # pragma: no cover - compiled
    """a * b + c rounded once (llvm.fma.f32): the step of torch's CPU embedding_bag with
    per-sample weights (fbgemm's kernels and their reference code accumulate with fused
    multiply-adds), so `_bag_sum` gives its bits. Exact on any CPU (LLVM emulates it where the
    instruction is missing)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return sig, codegen


def _libc_codegen(name: str):  # pragma: no cover - compiled
    """A call of libc's `name`(void *addr, size_t length, int-or-pointer arg) -> int, linked by
    name (so numba's cache keeps the function, as it would not a ctypes pointer)."""

    def codegen(context, builder, signature, args):
        i8p, i64 = ir.IntType(8).as_pointer(), ir.IntType(64)
        third = i8p if name == "mincore" else ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), [i8p, i64, third]), name)
        addr, length, arg = args
        arg = builder.inttoptr(arg, i8p) if name == "mincore" else builder.trunc(arg, ir.IntType(32))
        return builder.call(fn, [builder.inttoptr(addr, i8p), length, arg])

    return codegen


@intrinsic
def _madvise(typingctx, addr, length, advice):  # pragma: no cover - compiled
    """madvise(2) on [addr, addr + length) (addr page-aligned): 0 or -1."""
    return types.int32(types.int64, types.int64, types.int64), _libc_codegen("madvise")


@intrinsic
def _mincore(typingctx, addr, length, vec):  # pragma: no cover - compiled
    """mincore(2): one byte per page of [addr, addr + length) into vec (an address), bit 0 set
    when the page is in memory."""
    return types.int32(types.int64, types.int64, types.int64), _libc_codegen("mincore")


#: A page of the mappings (the unit the kernel reads a miss in).
PAGE = mmap.PAGESIZE
#: How many of a call's rows `_read_ahead` looks up in the page cache before it decides.
_LOOK = 32
_WILLNEED = mmap.MADV_WILLNEED


@nb.njit(nogil=True, cache=True)
def _read_ahead(raw, rows):  # pragma: no cover - compiled
    """When the file's pages of `rows` (records of the mapping `raw`) are not in memory (a
    sample of `_LOOK` of them looked up with mincore: an eighth or more missing), ask the
    kernel to read them all now (madvise WILLNEED, one page span per row): the reads go to the
    device together, its queue full, instead of one page fault at a time as the loops meet
    them (3-6x the rows/s on this machine's disk: docs/benchmarks.md). A resident file costs
    only the look (benchmarks.disk_profile prints it), not a request per row. A look that fails (an address outside the mapping) counts as resident. Returns the rows
    advised."""
    n = rows.shape[0]
    if n == 0 or raw.shape[0] == 0:
        return 0
    rec = raw.shape[1] * raw.itemsize
    base = raw.ctypes.data
    vec = np.zeros(2, np.uint8)
    look = min(n, _LOOK)
    cold = 0
    for k in range(look):
        a = base + rows[(k * n) // look] * rec
        p = a & ~np.int64(PAGE - 1)
        vec[0] = 1
        _mincore(p, PAGE, vec.ctypes.data)
        cold += 1 - (vec[0] & 1)
    if cold * 8 < look:
        return 0
    for k in range(n):
        a = base + rows[k] * rec
        p = a & ~np.int64(PAGE - 1)
        _madvise(p, ((a + rec + PAGE - 1) & ~np.int64(PAGE - 1)) - p, _WILLNEED)
    return n


@nb.njit(nogil=True, cache=True)
def _copy_records(rows, slot_of, hit, slots, raw, recs):  # pragma: no cover - compiled
    """One pass over a call's distinct rows: hits copied from their cache slots, misses read from
    the file's mapping, checked, and copied into the slot they were admitted to (slot_of >= 0).
    Records as uint64 words (8-byte moves; records are a multiple of 8 bytes). Returns (misses
    read, the first corrupt miss's index or -1); a corrupt record stops the pass before it
    reaches the cache."""
    nw = recs.shape[1]
    misses = 0
    for i in range(rows.shape[0]):
        if hit[i]:
            s = slot_of[i]
            for j in range(nw):
                recs[i, j] = slots[s, j]
            continue
        r = rows[i]
        for j in range(nw):
            recs[i, j] = raw[r, j]
        misses += 1
        if not _intact(recs[i]):
            return misses, i
        s = slot_of[i]
        if s >= 0:
            for j in range(nw):
                slots[s, j] = recs[i, j]
    return misses, -1


@nb.njit(inline="always")
def _probe(keys, row, shift):  # pragma: no cover - compiled
    """Position of `row` in the open-addressing table, or of the empty place it would take."""
    mask = keys.shape[0] - 1
    i = np.int64(_mix(row, 0) >> np.uint64(shift)) & mask
    while keys[i] != row and keys[i] != -1:
        i = (i + 1) & mask
    return i


@nb.njit(inline="always")
def _delete(keys, vals, pos, shift):  # pragma: no cover - compiled
    """Remove keys[pos] by backward shift (linear probing keeps no tombstones)."""
    mask = keys.shape[0] - 1
    i = pos
    j = pos
    while True:
        j = (j + 1) & mask
        if keys[j] == -1:
            break
        k = np.int64(_mix(keys[j], 0) >> np.uint64(shift)) & mask
        if (i <= j and i < k <= j) or (i > j and (k > i or k <= j)):
            continue  # keys[j] is still reachable from its home
        keys[i] = keys[j]
        vals[i] = vals[j]
        i = j
    keys[i] = -1


@nb.njit(inline="always")
def _estimate(sketch, row):  # pragma: no cover - compiled
    mask = sketch.shape[1] - 1
    best = 255
    for d in range(sketch.shape[0]):
        best = min(best, sketch[d, np.int64(_mix(row, d + 1)) & mask])
    return best


@nb.njit(inline="always")
def _prefetch_counts(sketch, row):  # pragma: no cover - compiled
    mask = sketch.shape[1] - 1
    for d in range(sketch.shape[0]):
        _prefetch2(sketch, d, np.int64(_mix(row, d + 1)) & mask)


@nb.njit(inline="always")
def _add(sketch, row, st):  # pragma: no cover - compiled
    mask = sketch.shape[1] - 1
    for d in range(sketch.shape[0]):
        p = np.int64(_mix(row, d + 1)) & mask
        if sketch[d, p] < 15:
            sketch[d, p] += 1
    st[_ADDS] += 1
    if st[_ADDS] >= st[_SAMPLE]:  # age: halve every counter, so the sketch follows recent reads
        for d in range(sketch.shape[0]):
            for p in range(sketch.shape[1]):
                sketch[d, p] >>= 1
        st[_ADDS] //= 2


#: How many rows ahead the compiled loops prefetch: a miss's record is one random read of the
#: file's mapping (4 KiB pages: a TLB miss too), and a loop that waits for each is 4-6x slower.
_AHEAD = 16


@nb.njit(inline="always")
def _prefetch_record(a, r, nw):  # pragma: no cover - compiled
    """Prefetch the cache lines of record r of a [rows, nw] array (8-byte words), nw > 0."""
    for j in range(0, nw, 8):
        _prefetch2(a, r, j)
    _prefetch2(a, r, nw - 1)


@nb.njit(inline="always")
def _sweep(slot_row, ref, pin, st, epoch, victims):  # pragma: no cover - compiled
    """CLOCK's victims for a call's misses, in the order they come: from the hand on, each slot
    not pinned by this call that is free or whose bit is clear is taken (and pinned, so no later
    miss of the call takes it again), the bit of every other unpinned slot passed is cleared.
    At most two turns of the hand. Branch-free (its branches were a miss's largest cost: a
    random bit per slot passed). Returns how many it found (fewer than asked: every other slot
    is this call's)."""
    cap = slot_row.shape[0]
    want = victims.shape[0]
    c = st[_HAND]
    k = 0
    for _ in range(2 * cap + 1):
        if k >= want:
            break
        mine = pin[c] == epoch
        take = (not mine) and (slot_row[c] == -1 or ref[c] == 0)
        victims[k] = c
        k += take
        ref[c] = ref[c] if mine else 0
        pin[c] = epoch if take else pin[c]
        c = c + 1 if c + 1 < cap else 0
    st[_HAND] = c
    return k


@nb.njit(inline="always")
def _admit(missed, nmiss, keys, vals, slot_row, ref, pin, dirty, sketch, st, admit_all, slots, raw,
           slot_out):  # pragma: no cover - compiled
    """Place a call's missed rows (distinct, none cached; the call's hits already pinned):
    slot_out[k] the slot missed[k] takes, or -1 (served from the file only). A free slot while
    any is left, else its CLOCK victim (`_sweep`: each miss is offered the next one), kept when
    TinyLFU says it was read at least as often recently. A dirty victim goes back to the file
    (sealed) before its slot is given away; the caller fills the slots. Returns the records
    written back."""
    cap = slot_row.shape[0]
    shift = st[_SHIFT]
    epoch = st[_EPOCH]
    written = 0
    k0 = 0
    victims = np.empty(0, np.int64)
    found = 0
    first = st[_USED]
    if cap:
        k0 = min(nmiss, cap - first)  # a cache still filling: its next free slots first
        st[_USED] += k0
        pin[first : first + k0] = epoch  # theirs: the sweep passes them
        victims = np.empty(nmiss - k0, np.int64)
        found = _sweep(slot_row, ref, pin, st, epoch, victims) if nmiss > k0 else 0
        dirty_rows = np.empty(found, np.int64)  # their write-backs: pages read ahead like misses
        nd = 0
        for k in range(found):
            if slot_row[victims[k]] != -1 and dirty[victims[k]]:
                dirty_rows[nd] = slot_row[victims[k]]
                nd += 1
        st[_AHEAD_ROWS] += _read_ahead(raw, dirty_rows[:nd])
    for k in range(nmiss):
        slot_out[k] = -1
        r = missed[k]
        if k < k0:
            s = first + k
        elif k - k0 < found:
            if not admit_all and k - k0 + _AHEAD < found:  # the estimates' counters, ahead
                _prefetch_counts(sketch, missed[k + _AHEAD])
                ahead = slot_row[victims[k - k0 + _AHEAD]]
                if ahead != -1:
                    _prefetch_counts(sketch, ahead)
            s = victims[k - k0]
            old = slot_row[s]
            if old != -1:
                if not admit_all and _estimate(sketch, r) <= _estimate(sketch, old):
                    continue  # TinyLFU: the victim was read at least as often recently; keep it
                if dirty[s]:
                    for j in range(slots.shape[1]):
                        raw[old, j] = slots[s, j]
                    _seal(raw[old])
                    written += 1
                st[_EVICT] += 1
                _delete(keys, vals, _probe(keys, old, shift), shift)
        else:
            continue  # every slot is this call's: served from the file
        pos = _probe(keys, r, shift)
        keys[pos] = r
        vals[pos] = s
        slot_row[s] = r
        ref[s] = 1
        pin[s] = epoch
        dirty[s] = 0
        slot_out[k] = s
    return written


@nb.njit(nogil=True, cache=True)
def _resolve(rows, keys, vals, slot_row, ref, pin, dirty, sketch, st, admit_all, slots, raw, slot_of,
             hit):  # pragma: no cover - compiled
    """Place each distinct row of a call (a write's gather): slot_of[i] its cache slot (a hit, or
    a miss admitted now, its slot to be filled by `_copy_records`) or -1 (a miss served from the
    file only); hit[i]. The hits first (pinned: no miss of the call evicts them), then the misses
    (`_admit`). Records as uint64 words. Returns the dirty victims written back."""
    shift = st[_SHIFT]
    epoch = st[_EPOCH]
    n = rows.shape[0]
    missed = np.empty(n, np.int64)
    at = np.empty(n, np.int64)
    nmiss = 0
    for i in range(n):
        r = rows[i]
        if not admit_all:
            _add(sketch, r, st)
        pos = _probe(keys, r, shift)
        if keys[pos] == r:
            s = vals[pos]
            ref[s] = 1
            pin[s] = epoch
            slot_of[i] = s
            hit[i] = 1
            st[_HITS] += 1
            continue
        hit[i] = 0
        st[_MISSES] += 1
        missed[nmiss] = r
        at[nmiss] = i
        nmiss += 1
    placed = np.empty(nmiss, np.int64)
    written = _admit(missed, nmiss, keys, vals, slot_row, ref, pin, dirty, sketch, st, admit_all, slots, raw, placed)
    for k in range(nmiss):
        slot_of[at[k]] = placed[k]
    return written


@nb.njit(inline="always")
def _row_set(n):  # pragma: no cover - compiled
    """An empty set of up to `n` rows for `_probe` (open addressing, at least 2n places): (its
    places, -1 each, and the shift `_probe` takes for that size)."""
    m = 16
    while m < 2 * n:
        m *= 2
    shift = 64
    while (np.int64(1) << (64 - shift)) < m:
        shift -= 1
    return np.full(m, -1, np.int64), shift


@nb.njit(inline="always")
def _first_time(seen, row, shift):  # pragma: no cover - compiled
    """Whether `row` was not in the set `seen` (`_row_set`) yet; it is now."""
    q = _probe(seen, row, shift)
    if seen[q] == row:
        return False
    seen[q] = row
    return True


@nb.njit(nogil=True, cache=True)
def _uncached(ids, keys, shift, num_rows):  # pragma: no cover - compiled
    """The distinct rows of `ids` the cache does not hold, in order of first id (ids out of
    range: skipped; a hint never fails)."""
    n = ids.shape[0]
    seen, mshift = _row_set(n)
    out = np.empty(n, np.int64)
    k = 0
    for i in range(n):
        r = ids[i]
        if r < 0 or r >= num_rows:
            continue
        pos = _probe(keys, r, shift)
        if keys[pos] == r or not _first_time(seen, r, mshift):
            continue
        out[k] = r
        k += 1
    return out[:k]


@nb.njit(nogil=True, cache=True)
def _first_torn(words):  # pragma: no cover - compiled
    """The first record of `words` [n, R/8] whose checksum fails, or -1. Serial: a checkpoint's
    writer thread runs it beside the compute thread's kernels, and numba's workqueue layer takes
    one parallel launch at a time (two at once abort the process)."""
    for k in range(words.shape[0]):
        if not _intact(words[k]):
            return k
    return -1


def _first_torn_row(raw: np.ndarray) -> int:
    """The first row of records `raw` [n, R] (uint8) whose checksum fails, or -1; in chunks."""
    for s in range(0, raw.shape[0], _CHUNK_ROWS):
        k = int(_first_torn(raw[s : s + _CHUNK_ROWS].view(np.uint64)))
        if k >= 0:
            return s + k
    return -1


@nb.njit(parallel=True, nogil=True, cache=True)
def _check_rows(raw, rows):  # pragma: no cover - compiled
    """The first of `rows` (its position) whose record in the file fails its checksum, or -1;
    the records read in parallel, prefetched `_AHEAD` ahead."""
    n = rows.shape[0]
    nw = raw.shape[1]
    bad = np.zeros(n, np.uint8)
    for k in nb.prange(n):
        if k + _AHEAD < n:
            _prefetch_record(raw, rows[k + _AHEAD], nw)
        bad[k] = not _intact(raw[rows[k]])
    for k in range(n):
        if bad[k]:
            return k
    return -1


@nb.njit(nogil=True, cache=True)
def _read_rows(ids, weights, hits, weight_mass, keys, vals, slot_row, ref, pin, dirty, sketch, st, admit_all, slots,
               raw, src):  # pragma: no cover - compiled
    """Where each id's row is for a read: src[i] = the cache slot holding row ids[i] (>= 0) or
    -1 - the row, read in place from the file's mapping. First the ids, in order: a hit pins
    its slot (and counts once: its first id in the call), a miss joins this call's misses
    (distinct: a small set). Then the misses, in order of first read: every one checked (its
    checksum) before any is placed, so a call that meets a corrupt row changes no slot, nor the
    read counters (hits, weight_mass; empty: not counted), counted only then, nor the cache's
    hit and miss counts (a refused read counted in `top`, `usage` and the hit rate: a hunt); then placed (`_admit`, as a
    write's `_resolve` places them), each admitted record copied into its slot; their ids still
    read the file (the same bytes). The loops prefetch `_AHEAD` rows ahead. Returns (rows read
    from the file, records written back, 0 or 1 = a corrupt row or 2 = a row out of range, that
    row)."""
    n = ids.shape[0]
    num_rows = raw.shape[0]
    nw = raw.shape[1]
    cap = slot_row.shape[0]
    shift = st[_SHIFT]
    mask = keys.shape[0] - 1
    epoch = st[_EPOCH]
    count = hits.shape[0] > 0
    with_w = weights.shape[0] == n
    t0 = _ticks()
    hits0, misses0 = st[_HITS], st[_MISSES]
    seen, mshift = _row_set(n)  # this call's misses, a set
    missed = np.empty(n, np.int64)  # and in order of first read
    nmiss = 0
    for i in range(n):
        if i + _AHEAD < n:
            a = ids[i + _AHEAD]
            if 0 <= a < num_rows:
                _prefetch(keys, np.int64(_mix(a, 0) >> np.uint64(shift)) & mask)
                _prefetch(vals, np.int64(_mix(a, 0) >> np.uint64(shift)) & mask)
        r = ids[i]
        if r < 0 or r >= num_rows:
            st[_HITS], st[_MISSES] = hits0, misses0
            return 0, 0, 2, r
        if cap:
            pos = _probe(keys, r, shift)
            if keys[pos] == r:
                s = vals[pos]
                src[i] = s
                if pin[s] != epoch:  # the row's first id in this call
                    ref[s] = 1
                    pin[s] = epoch
                    st[_HITS] += 1
                    if not admit_all:
                        _add(sketch, r, st)
                continue
        src[i] = -1 - r
        if not _first_time(seen, r, mshift):
            continue
        missed[nmiss] = r
        nmiss += 1
        st[_MISSES] += 1
        if not admit_all:
            _add(sketch, r, st)
    t1 = _ticks()
    st[_T_IDS] += t1 - t0
    st[_AHEAD_ROWS] += _read_ahead(raw, missed[:nmiss])
    t1b = _ticks()
    st[_T_AHEAD] += t1b - t1
    bad = _check_rows(raw, missed[:nmiss])
    t2 = _ticks()
    st[_T_CHECK] += t2 - t1b
    if bad >= 0:
        st[_HITS], st[_MISSES] = hits0, misses0
        return bad + 1, 0, 1, missed[bad]
    if count:  # every row checked: the read is answered, and counted
        for i in range(n):
            if i + _AHEAD < n:
                _prefetch(hits, ids[i + _AHEAD])
            kernels.count_read(ids[i], weights, i, with_w, hits, weight_mass)
    if cap == 0:
        return nmiss, 0, 0, -1
    placed = np.empty(nmiss, np.int64)
    written = _admit(missed, nmiss, keys, vals, slot_row, ref, pin, dirty, sketch, st, admit_all, slots, raw, placed)
    for k in range(nmiss):
        s = placed[k]
        if s >= 0:
            r = missed[k]
            for j in range(nw):
                slots[s, j] = raw[r, j]
    st[_T_PLACE] += _ticks() - t2
    return nmiss, written, 0, -1


@nb.njit(parallel=True, nogil=True, cache=True)
def _bag_sum(src, slots, raw, w0, weights, starts, out, nthreads):  # pragma: no cover - compiled
    """out[b] = sum over entries i of bag b (starts[b] .. starts[b + 1] - 1, in order) of
    weights[i] * row i's values (its cache slot or its record in the file, `src` as `_read_rows`
    gives it), summed as torch's CPU embedding_bag sums (a fused multiply-add per entry, in
    entry order, from zero), so the in-memory table's bits. Records as float32, values at w0.
    A bag's sum in a thread's own buffer (vectorised: 5x faster than summing in `out`);
    `nthreads` is numba.get_num_threads() (as for kernels.sparse_step)."""
    d = out.shape[1]
    bags = out.shape[0]
    per = (bags + nthreads - 1) // nthreads
    for t in nb.prange(nthreads):
        acc = np.empty(d, np.float32)
        end = starts[min(bags, (t + 1) * per)] if t * per < bags else 0
        for b in range(t * per, min(bags, (t + 1) * per)):
            acc[:] = 0.0
            for i in range(starts[b], starts[b + 1]):
                if i + _AHEAD < end:  # the row _AHEAD entries on (embedding_bag's kernels prefetch too)
                    a = src[i + _AHEAD]
                    for c in range(w0, w0 + d, 16):
                        if a >= 0:
                            _prefetch2(slots, a, c)
                        else:
                            _prefetch2(raw, -1 - a, c)
                s = src[i]
                row = slots[s, w0 : w0 + d] if s >= 0 else raw[-1 - s, w0 : w0 + d]
                x = weights[i]
                for c in range(d):
                    acc[c] = _fma32(x, row[c], acc[c])
            out[b, :] = acc


@nb.njit(parallel=True, nogil=True, cache=True)
def _rows_out(src, slots, raw, w0, out):  # pragma: no cover - compiled
    """out[i] = row i's values (a lookup), from its cache slot or the file (`src`)."""
    d = out.shape[1]
    for i in nb.prange(out.shape[0]):
        s = src[i]
        row = slots[s] if s >= 0 else raw[-1 - s]
        for c in range(d):
            out[i, c] = row[w0 + c]


@nb.njit(nogil=True, cache=True)
def _look(rows, keys, vals, shift, slot_of, hit):  # pragma: no cover - compiled
    """Each row's cache slot where the cache holds it (an inspection: nothing placed or counted)."""
    for i in range(rows.shape[0]):
        pos = _probe(keys, rows[i], shift)
        if keys[pos] == rows[i]:
            slot_of[i], hit[i] = vals[pos], 1


@nb.njit(nogil=True, cache=True)
def _forget(slots, keys, vals, slot_row, dirty, st):  # pragma: no cover - compiled
    """Drop slots from the cache (rows whose load failed): free, clean, not in the hash."""
    for s in slots:
        r = slot_row[s]
        if r != -1:
            _delete(keys, vals, _probe(keys, r, st[_SHIFT]), st[_SHIFT])
            slot_row[s] = -1
            dirty[s] = 0


_NO_I64, _NO_F64, _NO_F32 = np.zeros(0, np.int64), np.zeros(0, np.float64), np.zeros(0, np.float32)


def _bag_starts(ids: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor | None) -> np.ndarray:
    """Where each bag's entries start, and where the last ends: a bag's call as embedding_bag
    takes it (ids [B, k] without offsets, or flat ids with B offsets, the first 0, ascending),
    refused as it refuses it otherwise."""
    if weights.shape != ids.shape:
        raise ValueError(f"per-sample weights must have the ids' shape {tuple(ids.shape)}, got {tuple(weights.shape)}")
    if offsets is None:
        if ids.dim() != 2:
            raise ValueError(f"ids without offsets must be 2-D (bags x ids), got shape {tuple(ids.shape)}")
        return np.arange(ids.shape[0] + 1, dtype=np.int64) * ids.shape[1]
    if ids.dim() != 1 or offsets.dim() != 1:
        raise ValueError("ids with offsets must be 1-D, and so must the offsets")
    starts = np.append(offsets.numpy(), np.int64(ids.numel()))
    if len(offsets) and (starts[0] != 0 or (np.diff(starts) < 0).any()):
        raise ValueError("offsets must start at 0, ascend and end within the ids")
    return starts


# ------------------------------------------------------------------ the table


#: Hints (DiskTable.warm) a table holds at once: a newer one drops the oldest. Two: the rows of
#: the next step, and of the one after, for a trainer that sends them early.
WARM_HINTS = 2


#: The span of `memserver status`'s disk rates: about the last minute.
RATE_SECONDS = 60.0


class RecentRate:
    """Events per second over about the last `tau` seconds: an exponentially weighted average (a
    load average's), corrected while younger than `tau` (then it is the rate since the start).
    O(1) state and work per batch of events; it falls towards 0 while none come, where an average
    since the slice loaded stays up for hours after the work stopped."""

    def __init__(self, tau: float = RATE_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.tau, self.clock = tau, clock
        self.start = self.t = clock()
        self.level = 0.0  # events / tau, decayed to time self.t

    def add(self, n: int) -> None:
        if n:
            now = self.clock()
            self.level = self.level * math.exp(-(now - self.t) / self.tau) + n / self.tau
            self.t = now

    def per_second(self) -> float:
        """The rate now; over at least a second (one call just after the start is not a rate)."""
        now = self.clock()
        seen = 1.0 - math.exp(-max(now - self.start, 1.0) / self.tau)  # the weight the average has gathered
        return self.level * math.exp(-(now - self.t) / self.tau) / seen


class _ReadAhead:
    """The thread that reads hinted rows' pages ahead of the calls that will read them
    (DiskTable.warm). madvise(WILLNEED) returns only once the device has taken the requests,
    which takes as long as reading them while its queue is full (26.3 ms for 3,000 cold rows here:
    benchmarks.disk_tier prints it), so it runs here, not on the compute thread. Holds at most WARM_HINTS hints
    (arrays of rows); a newer one drops the oldest (counted: `dropped`). `close` waits for the
    thread, so no request outlives the mapping."""

    def __init__(self, raw: np.ndarray, name: str) -> None:
        self.raw, self.name = raw, name
        self.hints: deque[np.ndarray] = deque()
        self.cond = threading.Condition()
        self.closed = False
        self.hinted = self.asked = self.dropped = 0  # rows hinted / asked for ahead (cold pages) / dropped
        self.thread: threading.Thread | None = None
        self.working = False  # a hint taken and not yet done

    def put(self, rows: np.ndarray) -> None:
        with self.cond:
            if self.closed:
                return
            self.hinted += len(rows)
            if len(self.hints) >= WARM_HINTS:
                self.dropped += len(self.hints.popleft())
            self.hints.append(rows)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name=f"read-ahead {self.name}", daemon=True)
                self.thread.start()
            self.cond.notify_all()  # the thread, and any wait_idle

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.hints and not self.closed:
                    self.cond.wait()
                if self.closed:
                    return
                rows = self.hints.popleft()
                self.working = True
            try:
                asked = _read_ahead(self.raw, rows)
            except Exception:  # a hint: the read will fault the pages in itself
                asked = 0
                log.exception("table %s: reading %d hinted rows ahead failed", self.name, len(rows))
            with self.cond:
                self.asked += asked
                self.working = False
                self.cond.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Whether every hint handed on was done within `timeout` seconds (for counts that must
        not move while they are read: tests, benchmarks)."""
        with self.cond:
            return self.cond.wait_for(lambda: self.closed or not (self.hints or self.working), timeout)

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.dropped += sum(len(h) for h in self.hints)
            self.hints.clear()
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join()


def _as(fields: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Records' bytes [n, b] as `dtype` [n, b / itemsize], no copy. No records: an empty tensor
    (torch will not reinterpret an empty slice, whose strides it makes 0: a shard that owns none
    of a call's ids is handed none)."""
    if fields.shape[0] == 0:
        return torch.empty((0, fields.shape[1] // dtype.itemsize), dtype=dtype)
    return fields.view(dtype)


class DiskTable(ValueTable):
    """One slice of a value table kept in `directory` (rows.dat, stats.dat) under a RAM cache of
    at most `cache_bytes`. float32, CPU. Same calls and answers as `ValueTable`.

    Only the shard's compute thread calls it (like every slice), so it takes no lock."""

    def __init__(self, directory: str | os.PathLike[str], num_rows: int, dim: int, optimizer: OptimizerConfig, *,
                 cache_bytes: int, init_std: float | None = 0.02, seed: int = 0, global_rows: np.ndarray | None = None,
                 col_start: int = 0, total_dim: int | None = None, track_stats: bool = True, name: str = "",
                 policy: str = "tinylfu") -> None:
        """Create (or overwrite) the slice's files with the seeded initial values (init_std 0:
        zeros; None: the allocated file as it is, zeros unsealed, for a restore to fill and seal:
        load_into, after_load; a restart wrote the file three times: a hunt). Refused with
        RESOURCE_EXHAUSTED naming the file when the disk cannot hold it."""
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if cache_bytes < MIN_CACHE_BYTES:
            raise ValueError(f"cache_bytes must be at least {MIN_CACHE_BYTES}, got {cache_bytes}")
        self.num_rows, self.dim, self.optimizer = int(num_rows), int(dim), optimizer
        self.dtype, self.device, self.backend = torch.float32, torch.device("cpu"), "numba"
        self.track_stats, self.name, self.policy = track_stats, name or "?", policy
        self.dir = Path(directory)
        self.path = self.dir / "rows.dat"
        self.stats_path = self.dir / "stats.dat"
        self.record, self.fields = record_layout(self.dim, optimizer.name)
        self.cache_bound = int(cache_bytes)
        self.disk_reads = self.disk_writes = 0  # rows read from / written to rows.dat
        self.since = time.monotonic()  # the counters' start
        self.read_rate, self.write_rate = RecentRate(), RecentRate()  # their recent rates (status)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise self._file_error(self.dir, 0, exc) from None
        self._fd = self._sfd = -1
        self._map = self._smap = None
        self._ahead = _ReadAhead(np.zeros((0, self.record), np.uint8), self.name)
        try:
            self._create(global_rows, col_start, total_dim or dim, init_std, seed)
        except BaseException as exc:  # (the stats file's disk full, an interrupt): nothing left open or on disk
            # _create's locals in the traceback view the mappings: closing one fails while they live,
            # and the deleted file stays open (its space held) for as long as the caller keeps the error
            traceback.clear_frames(exc.__traceback__)
            self.close()
            for path in (self.path, self.stats_path):  # (a read-only filesystem refuses even a missing file's
                with contextlib.suppress(OSError):  # unlink: EROFS raised in place of the error that says why, a hunt)
                    path.unlink(missing_ok=True)
            raise

    def _create(self, global_rows: np.ndarray | None, col_start: int, total_dim: int, init_std: float | None,
                seed: int) -> None:
        """The files, their mappings and the seeded initial records (see __init__)."""
        self._fd, self._map, raw = self._open(self.path, self.num_rows * self.record)
        self._raw = raw.reshape(self.num_rows, self.record)
        self._ahead = _ReadAhead(self._raw, self.name)
        self._sfd, self._smap, sraw = self._open(self.stats_path, self.num_rows * COUNTER_BYTES)
        self._sraw = sraw
        self.counters_resident = self._lock_counters() if self.track_stats else False
        self.hits = torch.from_numpy(sraw.view(np.int64)[0::2])  # hits, weight_mass interleaved per row
        self.weight_mass = torch.from_numpy(sraw.view(np.float64)[1::2])
        if global_rows is None:
            global_rows = np.arange(self.num_rows, dtype=np.int64)
        w0, _ = self.fields["weight"]
        for s in range(0, self.num_rows if init_std is not None else 0, _CHUNK_ROWS):  # bounded temporaries: a chunk
            e = min(s + _CHUNK_ROWS, self.num_rows)
            recs = np.zeros((e - s, self.record), dtype=np.uint8)
            vals = init_values(global_rows[s:e], col_start, col_start + self.dim, total_dim, init_std, seed).numpy()
            recs[:, w0 : w0 + 4 * self.dim] = vals.view(np.uint8).reshape(e - s, 4 * self.dim)
            self._put(np.arange(s, e), recs)
        self.disk_writes, self.write_rate = 0, RecentRate()  # the file's making is no write of the table's
        self._make_cache()

    def _open(self, path: Path, size: int) -> tuple[int, mmap.mmap | None, np.ndarray]:
        """A new file of `size` bytes, allocated whole, and its shared mapping as uint8."""
        try:  # a new inode, not the old one truncated: a checkpoint's writer may still read the old
            # file's mapping (a rollback or restore makes the files again meanwhile), and a mapping of
            # a truncated file kills the process on its next access (SIGBUS)
            path.unlink(missing_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as exc:
            raise self._file_error(path, size, exc) from None
        try:
            if size:
                os.posix_fallocate(fd, 0, size)
                m = mmap.mmap(fd, size)
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            raise self._file_error(path, size, exc) from None
        if not size:
            return fd, None, np.zeros(0, dtype=np.uint8)
        # rows are read where they fall: no read-around (a fault would read 32 pages for one
        # record, ~80x fewer rows/s once the file is larger than memory: docs/benchmarks.md)
        m.madvise(mmap.MADV_RANDOM)
        return fd, m, np.frombuffer(m, dtype=np.uint8)

    def _file_error(self, path: Path, size: int, exc: OSError) -> MemserverError:
        """A file that cannot be made, as a status naming the table and the path: a full disk or a
        size limit is room (RESOURCE_EXHAUSTED), anything else the data directory's state
        (FAILED_PRECONDITION); a bare OSError reached the client as INTERNAL, naming neither (a hunt)."""
        what = f"table {self.name}: cannot allocate {size:,} bytes for {path}" if size else f"table {self.name}: cannot make {path}"
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return ResourceExhaustedError(
                f"{what}: the disk is full ({exc.strerror}); free space there, give the shards a larger data directory "
                "(memserver up --data-dir), or spread the table's rows over more shards (sharding rows)")
        if exc.errno in (errno.EFBIG, errno.ENOMEM):
            limit = "larger than a file may be there (the filesystem's or the process's limit: ulimit -f)" \
                if exc.errno == errno.EFBIG else "no memory to map it"
            return ResourceExhaustedError(f"{what}: {limit} ({exc.strerror}); spread the table's rows over more "
                                          "shards (sharding rows)")
        return FailedPreconditionError(f"{what}: {exc.strerror}; the shards' data directory must let them make files")

    def _lock_counters(self) -> bool:
        """Keep the read counters' pages in memory (mlock; see COUNTER_BYTES). Without the
        privilege (RLIMIT_MEMLOCK, CAP_IPC_LOCK) they stay in the page cache, said once."""
        if not self.num_rows:
            return False
        if _LIBC.mlock(ctypes.c_void_p(self._sraw.ctypes.data), ctypes.c_size_t(self._sraw.nbytes)) == 0:
            return True
        err = ctypes.get_errno()
        log.warning("table %s: cannot keep its read counters (%s, %s bytes) in memory: %s; they stay in the page "
                    "cache, where reads of a table larger than memory may fault on them (raise RLIMIT_MEMLOCK)",
                    self.name, self.stats_path, f"{self._sraw.nbytes:,}", os.strerror(err))
        return False

    @staticmethod
    def _shape(cap: int) -> tuple[int, int]:
        """(hash places, sketch width) of a cache of `cap` slots: >= 2 x cap places keep probes short."""
        return (1 << max(1, int(2 * cap - 1).bit_length()) if cap else 2), (1 << max(1, int(cap - 1).bit_length()) if cap else 1)

    def _cache_size(self, cap: int) -> int:
        """The bytes `_make_cache` allocates for `cap` slots (what `cache_nbytes` counts)."""
        return cache_size(cap, self.record, self.policy)

    def _make_cache(self) -> None:
        """Slots for as many whole records as `cache_bound` holds with their bookkeeping."""
        lo, hi = 0, min(self.num_rows, self.cache_bound // (self.record + 18))
        while lo < hi:  # the most slots that fit (the hash and sketch grow by powers of two)
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self._cache_size(mid) <= self.cache_bound else (lo, mid - 1)
        cap = lo
        h, w = self._shape(cap)
        self.capacity = cap
        self._slots = np.zeros((cap, self.record), dtype=np.uint8)
        self._keys = np.full(h, -1, dtype=np.int64)
        self._vals = np.zeros(h, dtype=np.int64)
        self._slot_row = np.full(cap, -1, dtype=np.int64)
        self._ref = np.zeros(cap, dtype=np.uint8)
        self._dirty = np.zeros(cap, dtype=np.uint8)
        self._pin = np.zeros(cap, dtype=np.int64)
        self._sketch = np.zeros((4, w), dtype=np.uint8) if self.policy == "tinylfu" and cap else np.zeros((4, 1), np.uint8)
        self._st = np.zeros(16, dtype=np.int64)
        self._st[_SAMPLE] = max(16, 10 * cap)
        self._st[_SHIFT] = 64 - max(1, (h - 1).bit_length())

    # -- what the cache holds, and what status shows ------------------------------------------

    def cache_nbytes(self) -> int:
        """The bytes the cache holds now (its arrays are allocated at their bound at creation)."""
        return sum(a.nbytes for a in (self._slots, self._keys, self._vals, self._slot_row, self._ref, self._dirty,
                                      self._pin, self._sketch, self._st))

    def _count(self, reads: int, writes: int) -> None:
        """Rows read from / written to rows.dat: the totals and their recent rates."""
        self.disk_reads += reads
        self.disk_writes += writes
        self.read_rate.add(reads)
        self.write_rate.add(writes)

    def reset_counters(self) -> None:
        """Start the traffic's counters afresh (hits, misses, evictions, rows read ahead, disk reads
        and writes and their rates): once a restarted slice has replayed its log, status's hit rate
        and disk rates are its callers', not the replay's (they counted the replay's too)."""
        self._st[[_HITS, _MISSES, _EVICT, _AHEAD_ROWS]] = 0
        self.disk_reads = self.disk_writes = 0
        self.read_rate, self.write_rate = RecentRate(), RecentRate()
        self.since = time.monotonic()

    def nbytes(self) -> int:
        """The cache and the read counters (kept in memory); the rows are on disk."""
        return self.cache_nbytes() + self.num_rows * COUNTER_BYTES

    def cache_stats(self) -> dict[str, int]:
        """Counters since creation: distinct-row hits and misses per call, evictions, rows read
        from and written to rows.dat, rows read ahead by calls (their pages were not in memory:
        the device served them), rows hinted (`warm`), read ahead for hints and dropped unread,
        cached rows, slots, bytes and their bound."""
        return {"hits": int(self._st[_HITS]), "misses": int(self._st[_MISSES]), "evictions": int(self._st[_EVICT]),
                "disk_reads": self.disk_reads, "disk_writes": self.disk_writes,
                "read_ahead": int(self._st[_AHEAD_ROWS]), "hinted": self._ahead.hinted, "warmed": self._ahead.asked,
                "warm_dropped": self._ahead.dropped, "counters_resident": int(self.counters_resident),
                "cached_rows": int((self._slot_row >= 0).sum()), "capacity": self.capacity,
                # the bound as it binds: no more than the whole slice's cache (status showed a 2 GiB bound
                # over a table of 1,000 rows, a walkthrough)
                "cache_bytes": self.cache_nbytes(), "cache_bound": min(self.cache_bound, self._cache_size(self.num_rows)),
                "file_bytes": self.num_rows * self.record, "seconds": time.monotonic() - self.since,
                "disk_reads_per_s": self.read_rate.per_second(), "disk_writes_per_s": self.write_rate.per_second()}

    # -- moving rows ---------------------------------------------------------------------

    def check_files(self) -> None:
        """DATA_LOSS naming a data file gone, replaced or truncated (a checkpoint asks first, and
        status, from another thread than the calls'). Nothing for a table closed meanwhile (a
        drop, a rollback): its descriptors' numbers may be another file's by then (a review: a
        rollback's rebuilt file, still empty, under the same number read as truncated)."""
        fds = (self._fd, self._sfd)
        try:
            self._check_file()
        except (DataLossError, OSError):
            if -1 in fds or (self._fd, self._sfd) != fds:
                return
            raise

    def _check_file(self) -> None:
        """Refuse (DATA_LOSS, naming the file) when rows.dat or stats.dat is gone, replaced or shorter
        than the table: a mapping of a truncated file kills the process on its next access (a
        walkthrough: a truncated stats.dat took the shard, and every table on it, down with SIGBUS)."""
        for path, fd, need in ((self.path, self._fd, self.num_rows * self.record),
                               (self.stats_path, self._sfd, self.num_rows * COUNTER_BYTES)):
            try:
                st = os.stat(path)
            except FileNotFoundError:
                raise DataLossError(f"table {self.name}: its data file {path} is missing (deleted under the running "
                                    f"shard); {_REBUILD}") from None
            mine = os.fstat(fd)
            if (st.st_ino, st.st_dev) != (mine.st_ino, mine.st_dev) or mine.st_size < need:
                raise DataLossError(f"table {self.name}: its data file {path} was replaced or truncated "
                                    f"({mine.st_size:,} bytes, the table needs {need:,}); {_REBUILD}")

    def _put(self, rows: np.ndarray, recs: np.ndarray) -> None:
        """Write whole records to the file (with their checksums). `recs` is modified."""
        if len(rows):
            _set_checks(recs.view(np.uint64))
            self._raw[rows] = recs
            self._count(0, len(rows))

    def _gather(self, rows: np.ndarray, admit: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """The records of distinct local `rows`, ascending (`_distinct`), as a new [n, record] array
        (hits copied from the cache, misses read from the file and checked), and each row's slot
        (-1: not cached). `admit` False: an inspection read, which changes nothing in the cache."""
        self._check_file()
        n = len(rows)
        if n and (rows[0] < 0 or rows[-1] >= self.num_rows):  # (ascending: its ends. numba checks no bounds:
            # row -1 read as the hash's empty mark, a hunt; one past the end, outside the mapping)
            raise IndexError(f"table {self.name}: row {int(rows[0] if rows[0] < 0 else rows[-1])} is out of range "
                             f"(the slice has {self.num_rows} rows)")
        recs = np.empty((n, self.record), dtype=np.uint8)
        slot_of = np.full(n, -1, dtype=np.int64)
        hit = np.zeros(n, dtype=np.uint8)
        if admit:  # (with no cache too: a write between a bag_grad and its update is one, a hunt)
            self._st[_EPOCH] += 1
        if admit and self.capacity:
            self._count(0, _resolve(rows, self._keys, self._vals, self._slot_row, self._ref, self._pin, self._dirty,
                                    self._sketch, self._st, self.policy == "clock", self._slots.view(np.uint64),
                                    self._raw.view(np.uint64), slot_of, hit))
        elif self.capacity:  # inspection: look, never place
            _look(rows, self._keys, self._vals, self._st[_SHIFT], slot_of, hit)
        self._st[_AHEAD_ROWS] += _read_ahead(self._raw, rows[hit == 0])
        read, bad = _copy_records(rows, slot_of, hit, self._slots.view(np.uint64), self._raw.view(np.uint64),
                                   recs.view(np.uint64))
        self._count(read, 0)
        if bad >= 0:  # the misses admitted by this call never got their records: out of the cache
            _forget(slot_of[(hit == 0) & (slot_of >= 0)], self._keys, self._vals, self._slot_row, self._dirty, self._st)
            raise self._corrupt(int(rows[bad]))
        return recs, slot_of

    def _read(self, ids: torch.Tensor, weights: torch.Tensor | None, count: bool) -> np.ndarray:
        """Where each id's row is for a read (`_read_rows`: its cache slot, or -1 - the row in the
        file), with the cache's bookkeeping and the read counters (`count`) done in one pass."""
        self._check_file()
        flat = ids.reshape(-1).numpy()
        src = np.empty(len(flat), dtype=np.int64)
        counted = self.track_stats and count
        hits = self.hits.numpy() if counted else _NO_I64
        mass = self.weight_mass.numpy() if counted else _NO_F64
        w = weights.reshape(-1).numpy() if weights is not None else _NO_F32
        self._st[_EPOCH] += 1
        reads, written, err, row = _read_rows(flat, w, hits, mass, self._keys, self._vals, self._slot_row, self._ref,
                                             self._pin, self._dirty, self._sketch, self._st, self.policy == "clock",
                                             self._slots.view(np.uint64), self._raw.view(np.uint64), src)
        self._count(reads, written)
        if err == 1:
            raise self._corrupt(row)
        if err == 2:
            raise IndexError(f"table {self.name}: row {row} is out of range (the slice has {self.num_rows} rows)")
        return src

    def _corrupt(self, row: int) -> DataLossError:
        """Raised where a call finds the record, before the table call changes any row (a write's
        `_gather` comes first): `changed_nothing`, so a slice without a log refuses that write alone
        where the call was the write's first change (TableSlice.once's `refusable`)."""
        err = DataLossError(f"table {self.name}: row {row} of {self.path} is corrupt (its checksum does not match); "
                            f"{_REBUILD}, or restore the table")
        err.changed_nothing = True  # type: ignore[attr-defined]
        return err

    def _check_records(self, rows: np.ndarray, heal: bool = False) -> None:
        """DATA_LOSS naming the first of `rows` whose record in the file fails its checksum. For
        what reads the file's records other than a call's misses: a checkpoint copies them as they
        are (a restore seals them again, so a corrupt one came back as a healthy row: a hunt), and
        the slot statistics sum them. `heal`: a corrupt record whose row the cache holds is written
        again from that copy (checked when it was read in) instead."""
        while len(rows) and (bad := _check_rows(self._raw.view(np.uint64), rows)) >= 0:
            row = rows[bad : bad + 1]
            slot_of, hit = np.full(1, -1, dtype=np.int64), np.zeros(1, dtype=np.uint8)
            if heal and self.capacity:
                _look(row, self._keys, self._vals, self._st[_SHIFT], slot_of, hit)
            if not hit[0]:
                raise self._corrupt(int(row[0]))
            self._put(row, self._slots[slot_of].copy())
            log.warning("table %s: row %d of %s was corrupt (its checksum did not match); written again from its "
                        "cached copy", self.name, int(row[0]), self.path)
            rows = rows[bad + 1 :]

    def _scatter(self, rows: np.ndarray, recs: np.ndarray, slot_of: np.ndarray) -> None:
        """Changed records back: into their cache slots (dirty, written back on eviction or
        flush), straight to the file for rows the cache did not admit."""
        c = slot_of >= 0
        self._slots[slot_of[c]] = recs[c]
        self._dirty[slot_of[c]] = 1
        if not c.all():
            self._put(rows[~c], recs[~c])

    def flush(self) -> int:
        """Write every dirty cached row back; returns how many. O(cache)."""
        d = np.flatnonzero(self._dirty)
        if len(d):
            self._check_file()
            self._put(self._slot_row[d], self._slots[d])
            self._dirty[d] = 0
        return len(d)

    def _view(self, recs: np.ndarray | torch.Tensor, field: str) -> torch.Tensor:
        t = torch.from_numpy(recs) if isinstance(recs, np.ndarray) else recs
        off, k = self.fields[field]
        v = _as(t[:, off : off + 4 * k], torch.float32)
        return v[:, 0] if field == "acc" else v

    def _working_set(self, recs: np.ndarray) -> ValueTable:
        """`ValueTable.over` dense copies of the gathered records' fields: the one implementation
        of the math, on the same memory layout as an in-memory table (numba reduces a strided
        row in another order, which would change the last bits)."""
        t = torch.from_numpy(recs)
        opt = {f: self._view(t, f).contiguous() for f in ("acc", "exp_avg", "exp_avg_sq") if f in self.fields}
        return ValueTable.over(self._view(t, "weight").contiguous(), self.optimizer,
                               _as(t[:, 0:8], torch.int64)[:, 0].contiguous(),
                               _as(t[:, 8:16], torch.float64)[:, 0].contiguous(), **opt)

    def _store(self, ws: ValueTable, recs: np.ndarray) -> None:
        """The working set's fields back into its records (after a step)."""
        t = torch.from_numpy(recs)
        for f in self.fields:
            self._view(t, f).copy_(getattr(ws, f))
        _as(t[:, 0:8], torch.int64)[:, 0].copy_(ws.updates)
        _as(t[:, 8:16], torch.float64)[:, 0].copy_(ws.last_update)

    def _distinct(self, ids: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
        """(distinct rows ascending, each id's position among them, shaped as ids)."""
        uniq, inv = np.unique(ids.reshape(-1).numpy(), return_inverse=True)
        return uniq.astype(np.int64, copy=False), torch.from_numpy(inv.astype(np.int64, copy=False)).view(ids.shape)

    # -- the calls -----------------------------------------------------------------------

    # Reads (lookup, bag) take no working set: one pass places each id's row (`_read`), a
    # second reads the values where they are, the cache slot or the file's mapping.

    def warm(self, ids: torch.Tensor) -> int:
        """A hint that `ids` will be read soon: the distinct rows the cache does not hold go to the
        read-ahead thread (`_ReadAhead`), which asks the kernel for their pages while the caller
        goes on, so the read finds them in memory. Reads, counts and changes nothing (exact reads
        stay exact); returns the rows handed on."""
        (ids,) = self.on_device((ids, torch.int64))
        rows = _uncached(ids.reshape(-1).numpy(), self._keys, self._st[_SHIFT], self.num_rows)
        if len(rows):
            self._ahead.put(rows)
        return len(rows)

    def lookup(self, ids: torch.Tensor, count: bool = True, admit: bool = True) -> torch.Tensor:
        (ids,) = self.on_device((ids, torch.int64))
        if ids.dim() != 1:
            raise ValueError(f"lookup takes 1-D ids, got shape {tuple(ids.shape)}")
        # (`count` alone is not an inspection: a cols table's slices but the first keep no read
        # counters, and their lookups placed nothing in their caches, counted no hit or miss: a walkthrough)
        if not admit:  # an inspection read (as slot_stats): no row admitted, no hit or miss counted (a
            rows, inv = self._distinct(ids)  # scan of the table evicted half the cache: a walkthrough)
            recs, _ = self._gather(rows, admit=False)
            return self._view(torch.from_numpy(recs), "weight").index_select(0, inv)  # (the values only)
        src = self._read(ids, None, count)
        out = np.empty((len(src), self.dim), dtype=np.float32)
        _rows_out(src, self._slots.view(np.float32), self._raw.view(np.float32), HEADER // 4, out)
        return torch.from_numpy(out)

    def bag(self, ids: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor | None = None,
            count: bool = True) -> torch.Tensor:
        ids, weights, offsets = self.on_device((ids, torch.int64), (weights, torch.float32), (offsets, torch.int64))
        starts = _bag_starts(ids, weights, offsets)
        src = self._read(ids, weights, count)
        out = np.empty((len(starts) - 1, self.dim), dtype=np.float32)
        _bag_sum(src, self._slots.view(np.float32), self._raw.view(np.float32), HEADER // 4, weights.reshape(-1).numpy(),
                 starts, out, nb.get_num_threads())
        return torch.from_numpy(out)

    def slot_stats(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        (ids,) = self.on_device((ids, torch.int64))
        rows, inv = self._distinct(ids)
        recs, _ = self._gather(rows, admit=False)
        ws = self._working_set(recs)
        flat = inv.reshape(-1)
        w = ws.weight.index_select(0, flat).double()
        return {"hits": self.hits[ids].clone(), "weight_mass": self.weight_mass[ids].clone(),
                "updates": ws.updates[flat].clone(), "last_update": ws.last_update[flat].clone(),
                "value_sq_norm": (w * w).sum(1)}

    def stat(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        if name not in self.STATS:
            raise ValueError(f"unknown slot statistic {name!r}")
        stop = self.num_rows if stop is None else min(stop, self.num_rows)
        self._check_file()  # a truncated file's mapping would kill the process where it is read
        if name in ("hits", "weight_mass"):
            return getattr(self, name)[start:stop].numpy().astype(np.float64)
        out = np.empty(max(0, stop - start), dtype=np.float64)
        raw, slots = torch.from_numpy(self._raw), torch.from_numpy(self._slots)
        for s in range(start, stop, _CHUNK_ROWS):  # streamed: bounded temporaries
            e = min(s + _CHUNK_ROWS, stop)
            rows = np.arange(s, e, dtype=np.int64)
            hit = np.zeros(e - s, dtype=np.uint8)
            if self.capacity:  # a cached row's record is its slot (dirty ones are newer than the file's)
                slot_of = np.full(e - s, -1, dtype=np.int64)
                _look(rows, self._keys, self._vals, self._st[_SHIFT], slot_of, hit)
            self._check_records(rows[hit == 0])  # (a corrupt record summed into a figure as if it were a row)
            out[s - start : e - start] = self._stat_of(raw[s:e], name)
            if len(c := np.flatnonzero(hit)):
                out[s - start + c] = self._stat_of(slots[torch.from_numpy(slot_of[c])], name)
        return out

    def _stat_of(self, recs: torch.Tensor, name: str) -> np.ndarray:
        if name == "updates":
            return recs[:, 0:8].view(torch.int64)[:, 0].numpy()
        w = self._view(recs, "weight").double()
        return (w * w).sum(1).numpy()

    def bag_grad(self, ids: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor | None,
                 grad_out: torch.Tensor):  # type: ignore[override]
        (ids,) = self.on_device((ids, torch.int64))
        rows, inv = self._distinct(ids)
        recs, slot_of = self._gather(rows)
        ws = self._working_set(recs)
        grad_w, update = ws.bag_grad(inv, weights, offsets, grad_out)
        epoch = int(self._st[_EPOCH])

        def apply() -> int:  # runs before any later call (memserver.server.dataplane): the slots still hold these rows
            if self._st[_EPOCH] != epoch:  # a call placed rows since: slot_of may name other rows' slots now
                raise RuntimeError(f"table {self.name}: a bag_backward's update ran after another call on the table "
                                   "(it must run first: memserver.server.dataplane does); nothing of it applied")
            n = update()
            self._store(ws, recs)
            self._scatter(rows, recs, slot_of)
            return n

        return grad_w, apply

    def apply_entries(self, ids: torch.Tensor, src_index: torch.Tensor, scale: torch.Tensor, src: torch.Tensor) -> int:
        (ids,) = self.on_device((ids, torch.int64))
        rows, inv = self._distinct(ids)
        recs, slot_of = self._gather(rows)
        ws = self._working_set(recs)
        n = ws.apply_entries(inv, src_index, scale, src)
        self._store(ws, recs)
        self._scatter(rows, recs, slot_of)
        return n

    def write_rows(self, ids: torch.Tensor, rows: torch.Tensor) -> int:
        ids, rows = self.on_device((ids, torch.int64), (rows, torch.float32))
        distinct, inv = self._distinct(ids)
        recs, slot_of = self._gather(distinct)
        ws = self._working_set(recs)
        ws.weight[inv] = rows
        self._store(ws, recs)
        self._scatter(distinct, recs, slot_of)
        return len(ids)

    # -- checkpoints -----------------------------------------------------------------------

    def state(self) -> dict[str, torch.Tensor]:
        """The slice's state as views of its files (dirty rows flushed first): a checkpoint
        streams them from the page cache (torch.save writes a storage from its memory), so
        memory never holds the table. Consistent: only the compute thread changes rows."""
        self.flush()
        if self.num_rows:
            self._check_file()
        raw = torch.from_numpy(self._raw)
        out = {"weight": self._view(raw, "weight")}
        for f in ("acc", "exp_avg", "exp_avg_sq"):
            if f in self.fields:
                out[f] = self._view(raw, f)
        out.update(hits=self.hits, weight_mass=self.weight_mass, updates=raw[:, 0:8].view(torch.int64)[:, 0],
                   last_update=raw[:, 8:16].view(torch.float64)[:, 0])
        return out

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint file keeps (`unpack` turns it into `state()`'s fields), taken on the
        compute thread at the cost of the cache and the counters, not the table: the dirty rows
        flushed, corrupt records of cached rows written again from the cache (their copies were
        checked as they came in), the read counters copied (16 bytes a row, held until the file is
        written: reads go on meanwhile and change them). The records stay a view of the mapped
        file, which nothing changes while the slice's writes wait (TableSlice.saving): the
        checkpoint's writer checks them (`verify_records`) and torch.save streams them from the
        page cache off the compute thread, so memory never holds the table and the shard's other
        calls go on (the file was read twice on the compute thread, every table of the shard
        waiting for both reads)."""
        self.flush()
        if self.num_rows:
            self._check_file()
        cached = self._slot_row[self._slot_row >= 0]
        self._check_records(np.sort(cached), heal=True)
        fields = [list(self.fields.get(f, (-1, 0))) for f in _OPTIONAL_FIELDS]
        return {"records": torch.from_numpy(self._raw), "stats": torch.from_numpy(self._sraw.copy()),
                "record_fields": torch.tensor(fields, dtype=torch.int64)}

    def verify_records(self, state: dict[str, torch.Tensor]) -> None:
        """DATA_LOSS naming the first record of `checkpoint_state`'s `state` whose checksum fails
        (copied, a restore sealed it again and served it as a healthy row: a hunt). Reads only
        the state's view, a chunk at a time: for the checkpoint's writer, off the compute thread."""
        bad = _first_torn_row(state["records"].numpy())
        if bad >= 0:  # (raised here: no frame of the traceback views the mapping)
            raise self._corrupt(bad)

    def after_load(self) -> None:
        """A restore wrote the fields in place (memserver.storage.checkpoint.load_into): seal the
        records again (checksums, streamed) and forget what the cache held."""
        for s in range(0, self.num_rows, _CHUNK_ROWS):
            _set_checks(self._raw[s : s + _CHUNK_ROWS].view(np.uint64))
        self._make_cache()

    def close(self) -> None:
        """Unmap and close the files (they stay on disk until the table is dropped)."""
        self._ahead.close()  # no read-ahead request outlives the mapping
        # this object's views of the mappings go first, or closing a mapping fails (BufferError)
        # and keeps its file open, a dropped file's space held until the views are collected
        self._ahead.raw = self._raw = self._sraw = None
        self.hits = self.weight_mass = None
        for m in (self._map, self._smap):
            if m is not None:
                try:
                    m.close()
                except BufferError:  # a tensor still views it: the mapping goes with the last view
                    pass
        fds, (self._fd, self._sfd) = (self._fd, self._sfd), (-1, -1)  # before they close: `check_files`
        for fd in fds:  # on another thread tells a closed table by them (a second close closes nothing)
            try:
                if fd >= 0:
                    os.close(fd)
            except OSError:
                pass
        self._map = self._smap = None
