"""The disk tier (memserver.core.disk): the same answers as the in-memory table, a counted cache
bound, durability through checkpoint + write-ahead log, and disk errors named by table and path."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import re
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import memserver.core.disk as disk_mod
from benchmarks.disk_tier import drop_page_cache, lru_hit_rate
from memserver.api.errors import (
    DataLossError,
    FailedPreconditionError,
    InvalidArgumentError,
    ResourceExhaustedError,
    TableExistsError,
)
from memserver.core.disk import MIN_CACHE_BYTES, DiskTable, cache_size, record_layout
from memserver.core.optim import OptimizerConfig
from memserver.core.table import ValueTable
from tests.hosts import wait_for

OPTIMIZERS = ("sgd", "adagrad", "adam")


def _pair(tmp_path: Path, optimizer: str, rows: int = 300, dim: int = 8, cache_rows: int = 40, **kw):
    cfg = OptimizerConfig(optimizer, 0.05)
    ram = ValueTable(rows, dim, cfg, seed=5, init_std=0.5, **kw)
    record = record_layout(dim, optimizer)[0]
    disk = DiskTable(tmp_path / "slice", rows, dim, cfg, cache_bytes=max(MIN_CACHE_BYTES, cache_rows * (record + 40)),
                     seed=5, init_std=0.5, name="t", **kw)
    return ram, disk


def _same_state(ram: ValueTable, disk: DiskTable) -> None:
    a, b = ram.state(), disk.state()
    assert set(a) == set(b)
    for k in a:
        if k != "last_update":  # wall-clock time of the step
            assert torch.equal(a[k], b[k]), k


def _random_calls(ram: ValueTable, disk: DiskTable, seed: int, calls: int = 60, check_bound: bool = True) -> None:
    """Seeded random reads, writes and optimizer steps on both tables; every answer equal."""
    rng = np.random.default_rng(seed)
    n, d = ram.num_rows, ram.dim
    for _ in range(calls):
        op = rng.choice(["bag", "ragged", "lookup", "backward", "push", "write", "stats"])
        hot = rng.random() < 0.7  # Zipf-ish: mostly a small hot set, sometimes anything
        size = int(rng.integers(1, 40))
        ids = torch.from_numpy(rng.integers(0, 20 if hot else n, size))
        if op == "bag":
            ids2 = ids[: size // 4 * 4].view(-1, 4) if size >= 4 else ids.view(1, -1)
            w = torch.from_numpy(rng.standard_normal(ids2.shape).astype(np.float32))
            assert torch.equal(ram.bag(ids2, w), disk.bag(ids2, w))
        elif op == "ragged":
            offsets = torch.from_numpy(np.sort(rng.integers(0, size + 1, 3))).long()
            offsets[0] = 0
            w = torch.from_numpy(rng.random(size).astype(np.float32))
            assert torch.equal(ram.bag(ids, w, offsets), disk.bag(ids, w, offsets))
        elif op == "lookup":
            assert torch.equal(ram.lookup(ids), disk.lookup(ids))
        elif op == "backward":
            offsets = torch.tensor([0, size // 2])
            w = torch.from_numpy(rng.random(size).astype(np.float32))
            g = torch.from_numpy(rng.standard_normal((2, d)).astype(np.float32))
            assert torch.equal(ram.bag_backward(ids, w, offsets, g), disk.bag_backward(ids, w, offsets, g))
        elif op == "push":
            g = torch.from_numpy(rng.standard_normal((size, d)).astype(np.float32))
            assert ram.push_gradients(ids, g) == disk.push_gradients(ids, g)
        elif op == "write":
            u = torch.from_numpy(np.unique(ids.numpy()))
            v = torch.from_numpy(rng.standard_normal((len(u), d)).astype(np.float32))
            assert ram.write_rows(u, v) == disk.write_rows(u, v)
        else:
            a, b = ram.slot_stats(ids), disk.slot_stats(ids)
            for k in ("hits", "weight_mass", "updates", "value_sq_norm"):
                assert torch.equal(a[k], b[k]), k
        if check_bound:
            assert disk.cache_nbytes() <= disk.cache_bound
    _same_state(ram, disk)
    for name in ValueTable.STATS:
        np.testing.assert_array_equal(ram.stat(name), disk.stat(name))


def test_a_backward_update_run_after_another_call_is_refused_before_it_writes(tmp_path):
    """bag_grad's update writes the records it gathered back into the slots they were in; a call
    run between (a reviewer's: three lookups of other rows through a cache of 8) moved other rows
    into those slots, and the update wrote rows 5 and 6 over rows 66 and 67, marked dirty. The
    dataplane runs the update first; run later, it is refused and changes nothing."""
    ram, disk = _pair(tmp_path, "sgd", rows=200, dim=4, cache_rows=0)
    assert disk.capacity < 20
    ids, w, g = torch.tensor([[5, 6]]), torch.ones(1, 2), torch.ones(1, 4)
    _, update = disk.bag_grad(ids, w, None, g)
    for k in range(3):
        assert torch.equal(ram.lookup(torch.arange(20 + 20 * k, 40 + 20 * k)),
                           disk.lookup(torch.arange(20 + 20 * k, 40 + 20 * k)))
    with pytest.raises(RuntimeError, match="table t: a bag_backward's update ran after another call on the table"):
        update()
    _same_state(ram, disk)
    _, update = disk.bag_grad(ids, w, None, g)  # run first, as the dataplane does: applied
    update()
    ram.bag_backward(ids, w, None, g)
    _same_state(ram, disk)
    # a cache of no row: a write between was lost under the update (the guard counted placings only)
    none = DiskTable(tmp_path / "none", 50, 300, OptimizerConfig("sgd", 0.1), cache_bytes=MIN_CACHE_BYTES, name="t")
    assert none.capacity == 0
    _, update = none.bag_grad(ids, w, None, torch.ones(1, 300))
    none.write_rows(torch.tensor([5]), torch.full((1, 300), 7.0))
    with pytest.raises(RuntimeError, match="a bag_backward's update ran after another call"):
        update()
    assert (none.lookup(torch.tensor([5])) == 7.0).all()
    none.close()


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_equal_to_ram_table_under_random_calls(tmp_path, optimizer):
    ram, disk = _pair(tmp_path, optimizer)
    _random_calls(ram, disk, seed=OPTIMIZERS.index(optimizer))
    s = disk.cache_stats()
    assert s["hits"] and s["misses"] and s["evictions"] and s["disk_writes"]  # the cache was exercised


def _steps_alike(ram: ValueTable, disk: DiskTable, rng: np.random.Generator, steps: int) -> None:
    """`steps` bag_backward calls of 64 bags x 4 random ids on both tables, answers equal."""
    for _ in range(steps):
        ids = torch.from_numpy(rng.integers(0, ram.num_rows, (64, 4)))
        w = torch.from_numpy(rng.random((64, 4)).astype(np.float32))
        g = torch.from_numpy(rng.standard_normal((64, ram.dim)).astype(np.float32))
        assert torch.equal(ram.bag_backward(ids, w, None, g), disk.bag_backward(ids, w, None, g))


def test_slot_statistics_read_dirty_cached_rows_in_place_without_writing_the_cache_back(tmp_path):
    """`stat` (top slots, usage) over a range sees the cache's dirty rows where they are: it
    writes nothing back (its cost is the range's, not the cache's), and equals the RAM table for
    any range, the dirty rows included."""
    ram, disk = _pair(tmp_path, "adagrad", rows=5000, cache_rows=200)
    _steps_alike(ram, disk, np.random.default_rng(3), 6)
    dirty, writes = int(disk._dirty.sum()), disk.cache_stats()["disk_writes"]
    assert dirty > 50
    for name in ("updates", "value_sq_norm"):
        np.testing.assert_array_equal(ram.stat(name), disk.stat(name))
        for start, stop in ((0, 1), (17, 2500), (2500, 5000), (4999, 9000)):
            np.testing.assert_array_equal(ram.stat(name, start, stop), disk.stat(name, start, stop))
    assert int(disk._dirty.sum()) == dirty and disk.cache_stats()["disk_writes"] == writes
    _same_state(ram, disk)


def test_an_uncounted_lookup_changes_neither_the_cache_nor_its_counts(tmp_path):
    """A walkthrough: an uncounted lookup (inspection: `search-token`'s scan, the page; `admit`
    False) admitted every row it read, evicting half the cache, and counted its misses in the hit
    rate. It now
    reads as slot_stats does: the values (the dirty cached ones included) equal the RAM table's,
    and no slot, counter or statistic changes."""
    ram, disk = _pair(tmp_path, "adam", rows=3000, cache_rows=100)
    _steps_alike(ram, disk, np.random.default_rng(4), 5)
    before = (disk.cache_stats(), disk._slot_row.copy(), disk._dirty.copy(), disk.hits.clone())
    scan = torch.cat([torch.arange(3000), torch.tensor([5, 5, 2999])])  # every row, some twice
    assert torch.equal(disk.lookup(scan, count=False, admit=False), ram.lookup(scan, count=False))
    after = disk.cache_stats()
    moving = ("disk_reads", "disk_reads_per_s", "disk_writes_per_s", "seconds")  # (the file is read; time goes on)
    assert {k: v for k, v in after.items() if k not in moving} == {k: v for k, v in before[0].items() if k not in moving}
    assert np.array_equal(disk._slot_row, before[1]) and np.array_equal(disk._dirty, before[2])
    assert torch.equal(disk.hits, before[3])
    assert torch.equal(disk.lookup(scan[:10]), ram.lookup(scan[:10]))  # a counted one still counts
    assert disk.cache_stats()["misses"] + disk.cache_stats()["hits"] > after["misses"] + after["hits"]
    _same_state(ram, disk)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_calls_with_no_ids_answer_like_the_ram_table_and_change_nothing(tmp_path, optimizer):
    """A rows-sharded table's shard that owns none of a call's ids gets the call with none
    (client.ops.routing): an empty answer, nothing written, for every call the RAM table takes."""
    ram, disk = _pair(tmp_path, optimizer)
    none, d = torch.zeros(0, dtype=torch.int64), ram.dim
    before = {k: v.clone() for k, v in disk.state().items()}
    for table in (ram, disk):
        table.track_stats = True
    answers = []
    for table in (ram, disk):
        answers.append([
            table.lookup(none), table.bag(none.view(1, 0), torch.zeros(1, 0)),
            table.bag(none, torch.zeros(0), torch.tensor([0, 0])),
            table.bag_backward(none, torch.zeros(0), torch.tensor([0, 0]), torch.ones(2, d)),
            table.push_gradients(none, torch.zeros(0, d)), table.write_rows(none, torch.zeros(0, d)),
            *table.slot_stats(none).values()])
    for a, b in zip(*answers):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    after = disk.state()
    assert all(torch.equal(before[k], after[k]) for k in before if k != "last_update")
    assert disk.cache_stats()["disk_writes"] == 0


@pytest.mark.parametrize("policy", ["tinylfu", "clock"])
def test_equal_with_cols_slice_and_tiny_or_no_cache(tmp_path, policy):
    """A cols slice (columns 3..9 of 16) under the smallest cache (a few rows: calls touch more
    rows than it holds, so slots are pinned and the rest read from the file), and rows too wide
    for it (no slot at all: every call from the file)."""
    for dim, slots in ((6, True), (300, False)):
        kw = dict(global_rows=np.arange(120), col_start=3, total_dim=dim + 10)
        cfg = OptimizerConfig("adam", 0.05)
        ram = ValueTable(120, dim, cfg, seed=1, **kw)
        disk = DiskTable(tmp_path / f"c{dim}", 120, dim, cfg, cache_bytes=MIN_CACHE_BYTES, seed=1, policy=policy, **kw)
        assert (disk.capacity > 0) == slots
        _random_calls(ram, disk, seed=7, calls=40)


def _owned(t: DiskTable) -> int:
    """The bytes of every array the table owns in RAM (the files are mapped)."""
    return sum(v.nbytes for v in vars(t).values() if isinstance(v, np.ndarray) and v.base is None)


def test_cache_bound_counted(tmp_path):
    cfg = OptimizerConfig("adagrad", 0.1)
    with pytest.raises(ValueError, match="cache_bytes must be at least"):
        DiskTable(tmp_path / "x", 10, 4, cfg, cache_bytes=MIN_CACHE_BYTES - 1)
    for bound in (MIN_CACHE_BYTES, 1500, 4096, 10_000, 123_457):
        t = DiskTable(tmp_path / str(bound), 5000, 16, cfg, cache_bytes=bound)
        held = _owned(t)
        assert held == t.cache_nbytes() <= bound
        assert t.capacity * t.record <= bound
        t.bag(torch.arange(0, 5000, 7).view(-1, 1), torch.ones(715, 1))
        t.lookup(torch.arange(0, 5000, 3))
        t.push_gradients(torch.arange(0, 5000, 11), torch.ones(455, 16))
        assert _owned(t) == t.cache_nbytes() == held and t.cache_stats()["cached_rows"] <= t.capacity
    # the capacity is as large as the bound allows: one slot more would not fit
    assert t._cache_size(t.capacity + 1) > bound >= t._cache_size(t.capacity)
    assert t.cache_stats()["cache_bound"] == bound
    # a bound larger than the whole slice binds at the slice: so said (status showed 2 GiB over 1,000 rows)
    big = DiskTable(tmp_path / "big", 100, 16, cfg, cache_bytes=1 << 30)
    assert big.capacity == 100 and big.cache_stats()["cache_bound"] == big._cache_size(100) < 1 << 20


def test_tinylfu_beats_lru_on_zipf_with_scans(tmp_path):
    """Zipf 1.0 reads mixed with uniform scans: admission keeps the hot rows."""
    rng = np.random.default_rng(0)
    n = 20_000
    p = 1.0 / np.arange(1, n + 1)
    p /= p.sum()
    perm = rng.permutation(n)
    trace = [perm[rng.choice(n, 256, p=p)] if i % 3 else rng.integers(0, n, 256) for i in range(300)]
    t = DiskTable(tmp_path / "z", n, 8, OptimizerConfig("sgd", 0.1), cache_bytes=1000 * 100)
    for b in trace:
        t.bag(torch.from_numpy(b).view(-1, 1), torch.ones(len(b), 1), count=False)
    s = t.cache_stats()
    ours = s["hits"] / (s["hits"] + s["misses"])
    lru = lru_hit_rate(trace, t.capacity)
    assert ours > lru + 0.05, (ours, lru)


def _zipf_ids(rng: np.random.Generator, n: int, size: int) -> np.ndarray:
    """Zipf 1.0 reads over n rows, ranks scattered (memory layers' reads)."""
    p = 1.0 / np.arange(1, n + 1)
    return np.random.default_rng(99).permutation(n)[rng.choice(n, size, p=p / p.sum())]


@pytest.mark.parametrize("policy", ["tinylfu", "clock"])
def test_read_path_equal_under_zipf_reads_mixing_hits_and_misses(tmp_path, policy):
    """The read path (bag, ragged bag, lookup: no working set, rows summed from the cache slots
    and the file's mapping): the RAM table's bits on every call, each call both hitting and
    missing; steps between reads leave dirty rows that the reads' admissions evict (written back
    in the read pass). The counters count distinct rows per call: hits + misses = distinct rows,
    misses = rows read from the file; the bound holds after every call."""
    cfg = OptimizerConfig("adagrad", 0.05)
    n, d = 3000, 16
    ram = ValueTable(n, d, cfg, seed=3, init_std=0.5)
    disk = DiskTable(tmp_path / "z", n, d, cfg, cache_bytes=60_000, seed=3, init_std=0.5, name="z", policy=policy)
    assert 100 < disk.capacity < 600  # a cache of a few hundred rows under 3000
    rng = np.random.default_rng(1)
    mixed = 0
    for call in range(40):
        before = disk.cache_stats()
        ids = _zipf_ids(rng, n, 256)
        kind = call % 4
        if kind == 0:
            w = torch.from_numpy(rng.standard_normal((32, 8)).astype(np.float32))
            got, want = disk.bag(torch.from_numpy(ids).view(32, 8), w), ram.bag(torch.from_numpy(ids).view(32, 8), w)
        elif kind == 1:  # ragged, with empty bags (at the start, in the middle, at the end)
            offsets = torch.from_numpy(np.r_[0, 0, np.sort(rng.integers(0, 256, 9)), 256]).long()
            w = torch.from_numpy(rng.standard_normal(256).astype(np.float32))
            got, want = disk.bag(torch.from_numpy(ids), w, offsets), ram.bag(torch.from_numpy(ids), w, offsets)
        elif kind == 2:
            got, want = disk.lookup(torch.from_numpy(ids)), ram.lookup(torch.from_numpy(ids))
        else:  # a step: dirty rows for later reads to evict
            g = torch.from_numpy(rng.standard_normal((64, d)).astype(np.float32))
            assert disk.push_gradients(torch.from_numpy(ids[:64]), g) == ram.push_gradients(torch.from_numpy(ids[:64]), g)
            continue
        assert got.shape == want.shape and torch.equal(got, want), call
        after = disk.cache_stats()
        hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
        assert hits + misses == len(np.unique(ids)), call
        assert after["disk_reads"] - before["disk_reads"] == misses
        mixed += hits > 0 and misses > 0
        assert disk.cache_nbytes() <= disk.cache_bound and after["cached_rows"] <= disk.capacity
    s = disk.cache_stats()
    assert mixed >= 25 and s["evictions"] > 0 and s["disk_writes"] > 0
    _same_state(ram, disk)  # the read counters (hits, weight_mass) too, and every row after the write-backs
    disk.close()


def test_read_path_pins_the_rows_a_call_hit(tmp_path):
    """A call that hits half the cached rows and misses more rows than the cache holds: its
    misses evict the other half, never a slot the call read (pinned), so every answer is still
    the rows' values and the rows it hit are still cached after it."""
    cfg = OptimizerConfig("sgd", 0.1)
    ram = ValueTable(400, 4, cfg, seed=2, init_std=0.5)
    disk = DiskTable(tmp_path / "p", 400, 4, cfg, cache_bytes=MIN_CACHE_BYTES * 2, seed=2, init_std=0.5, policy="clock")
    cap = disk.capacity
    for read in ("bag", "lookup"):
        disk._make_cache()
        disk.lookup(torch.arange(cap))  # the cache full of rows 0 .. cap - 1
        hot = torch.arange(cap // 2)
        ids = torch.cat([hot, torch.arange(cap, 400), hot.flip(0)])  # hits, then misses, then the hits again
        before = disk.cache_stats()
        if read == "bag":
            w, offsets = torch.rand(len(ids)), torch.tensor([0, cap // 2, 400])
            assert torch.equal(disk.bag(ids, w, offsets), ram.bag(ids, w, offsets))
        else:
            assert torch.equal(disk.lookup(ids), ram.lookup(ids))
        after = disk.cache_stats()
        assert after["hits"] - before["hits"] == cap // 2 and after["evictions"] > before["evictions"]
        assert set(hot.tolist()) <= set(disk._slot_row.tolist())
    disk.close()


def test_read_path_refuses_bad_calls(tmp_path):
    _, disk = _pair(tmp_path, "sgd")
    with pytest.raises(IndexError, match="row 300 is out of range"):
        disk.bag(torch.tensor([[1, 300]]), torch.ones(1, 2))
    # the gathering calls too (the slice checks ids first; a direct user's went unchecked: row -1 was
    # read as a hit on slot 0, a row past the end outside the file's mapping, a hunt)
    with pytest.raises(IndexError, match="row -1 is out of range"):
        disk.slot_stats(torch.tensor([-1]))
    for call in (lambda ids: disk.write_rows(ids, torch.ones(len(ids), disk.dim)),
                 lambda ids: disk.push_gradients(ids, torch.ones(len(ids), disk.dim))):
        with pytest.raises(IndexError, match=f"row {disk.num_rows} is out of range"):
            call(torch.tensor([3, disk.num_rows]))
    with pytest.raises(ValueError, match="offsets must start at 0"):
        disk.bag(torch.tensor([1, 2, 3]), torch.ones(3), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="per-sample weights"):
        disk.bag(torch.tensor([[1, 2]]), torch.ones(2))
    assert disk.bag(torch.zeros((3, 0), dtype=torch.int64), torch.ones(3, 0)).shape == (3, 8)  # empty bags: zeros
    assert not disk.bag(torch.zeros((3, 0), dtype=torch.int64), torch.ones(3, 0)).any()


# ------------------------------------------------------------------ disk errors


def test_corrupt_row_is_refused_by_name(tmp_path):
    ram, disk = _pair(tmp_path, "adagrad", cache_rows=4)
    good = torch.tensor([[0, 1]])
    disk.bag(good, torch.ones(1, 2))
    with open(disk.path, "r+b") as f:  # flip a byte in row 200's values (not cached)
        f.seek(200 * disk.record + 30)
        b = f.read(1)
        f.seek(200 * disk.record + 30)
        f.write(bytes([b[0] ^ 0x40]))
    with pytest.raises(DataLossError, match=rf"table t: row 200 of {disk.path} is corrupt"):
        disk.bag(torch.tensor([[199, 200]]), torch.ones(1, 2))
    with pytest.raises(DataLossError):  # never cached: still refused
        disk.lookup(torch.tensor([200]))
    assert torch.equal(ram.bag(good, torch.ones(1, 2)), disk.bag(good, torch.ones(1, 2)))  # the rest still served
    # a ragged call that hits and misses rows around the corrupt one: refused, and no slot changes
    # (every miss is checked before any is placed; the corrupt record never reaches the cache)
    ids = torch.tensor([0, 1, 50, 60, 0, 70, 200, 80, 1])
    slots = disk._slot_row.copy()
    with pytest.raises(DataLossError, match=rf"row 200 of {disk.path} is corrupt"):
        disk.bag(ids, torch.ones(9), torch.tensor([0, 4]))
    assert np.array_equal(disk._slot_row, slots)
    # nor do the read counters and the cache's counts (a refused read was counted in top, usage and the
    # hit rate: a hunt)
    before = (disk.hits.clone(), disk.weight_mass.clone(), disk.cache_stats())
    for _ in range(3):
        with pytest.raises(DataLossError):
            disk.bag(ids, torch.full((9,), 2.0), torch.tensor([0, 4]))
    assert torch.equal(disk.hits, before[0]) and torch.equal(disk.weight_mass, before[1])
    assert {k: disk.cache_stats()[k] for k in ("hits", "misses")} == {k: before[2][k] for k in ("hits", "misses")}
    rest = torch.tensor([0, 1, 50, 60, 70, 80])
    assert torch.equal(ram.lookup(rest), disk.lookup(rest))
    disk.bag(rest[None], torch.ones(1, 6))  # an answered read is counted, each id once
    assert (disk.hits[rest] - before[0][rest]).tolist() == [2, 2, 2, 2, 2, 2]  # (the lookup's too)


def test_a_checkpoint_being_written_keeps_the_files_it_began_with_when_they_are_made_again(tmp_path):
    """A checkpoint's writer streams a disk table's records from their mapping off the compute
    thread, so a rollback or a restore may make the table's files again meanwhile. They were made
    by truncating the same inode: the writer then read the new table's rows (or, mid-rebuild, a
    mapping past the file's end, which kills the process). Made as a new inode, the writer reads
    the table it began with to the end; its read counters are a copy taken at that moment."""
    cfg = OptimizerConfig("sgd", 1.0)
    old = DiskTable(tmp_path / "d", 300, 8, cfg, cache_bytes=MIN_CACHE_BYTES, seed=1, name="t")
    old.lookup(torch.tensor([5, 5]))
    old.push_gradients(torch.tensor([3]), torch.ones(1, 8))
    want = old.lookup(torch.arange(300), count=False).clone()
    state = old.checkpoint_state()  # as checkpoint_table's first part takes it
    old.lookup(torch.tensor([5]))  # a read after that moment: not in the copy
    old.close()  # as a rollback closes the slice, then makes its files again
    new = DiskTable(tmp_path / "d", 300, 8, cfg, cache_bytes=MIN_CACHE_BYTES, seed=2, name="t")
    try:
        old.verify_records(state)  # every record of the old file intact
        saved = disk_mod.unpack(state)
        torch.testing.assert_close(saved["weight"], want, rtol=0, atol=0)
        assert int(saved["hits"][5]) == 2 and int(saved["hits"].sum()) == 2
        assert not torch.equal(new.lookup(torch.arange(300), count=False), want)  # (the new table is another)
    finally:
        state.clear()
        new.close()


def test_a_corrupt_record_is_refused_by_the_statistics_and_never_checkpointed(tmp_path):
    """A checkpoint copied the file's records as they were, unchecked, and its restore sealed them
    again: a corrupt row came back as a healthy one (-4.8e37 for -0.141, a hunt), also when the
    live table served that row right from a clean cached copy. The slot statistics summed it into
    their figures (2.3e75). A row the cache holds is written again from that copy; any other is
    refused DATA_LOSS naming the row and the file."""
    from memserver.storage.checkpoint import load_into, save_slice

    ram, disk = _pair(tmp_path, "adagrad", cache_rows=4)
    disk.lookup(torch.tensor([7]))  # row 7 cached, clean

    def corrupt(row: int) -> None:
        with open(disk.path, "r+b") as f:
            f.seek(row * disk.record + 30)
            b = f.read(1)
            f.seek(row * disk.record + 30)
            f.write(bytes([b[0] ^ 0x40]))

    corrupt(7)
    torch.testing.assert_close(disk.lookup(torch.tensor([7])), ram.lookup(torch.tensor([7])), rtol=0, atol=0)
    # a cached row's checked copy writes its record again: the checkpoint holds the row, intact
    meta = {"table": "t", "kind": "value", "by_rows": True, "index": 0, "num_shards": 1, "num_rows": disk.num_rows,
            "dim": disk.dim, "col_start": 0, "col_end": disk.dim}
    save_slice(tmp_path / "healed.pt", meta, disk.checkpoint_state())
    back = ValueTable(disk.num_rows, disk.dim, OptimizerConfig("adagrad", 0.1))
    load_into(back, meta, [{"file": str(tmp_path / "healed.pt")}])
    torch.testing.assert_close(back.lookup(torch.tensor([7])), ram.lookup(torch.tensor([7])), rtol=0, atol=0)
    corrupt(200)  # not cached: refused (by the checkpoint's writer, before it writes: shard_actor.checkpoint_table)
    state = disk.checkpoint_state()
    with pytest.raises(DataLossError, match=rf"table t: row 200 of {disk.path} is corrupt"):
        disk.verify_records(state)  # (the file is what a checkpoint copies)
    state.clear()
    with pytest.raises(DataLossError, match=rf"table t: row 200 of {disk.path} is corrupt"):
        disk.stat("value_sq_norm")
    np.testing.assert_array_equal(disk.stat("value_sq_norm", 0, 100), ram.stat("value_sq_norm", 0, 100))  # (7: cached)
    np.testing.assert_array_equal(disk.stat("updates", 0, 100), ram.stat("updates", 0, 100))
    disk.close()


def test_a_check_from_another_thread_says_nothing_of_a_table_closed_meanwhile(tmp_path, monkeypatch):
    """status checks a disk slice's files on its loop thread while the compute thread may close the
    table (a drop, a rollback, whose rebuilt file then takes the closed descriptor's number): a
    review's interleaving read the rebuilt file, still empty, as this table's, truncated, and told
    the operator to restart a healthy shard. A table closed meanwhile is not reported; one that
    is not closed still is."""
    _, disk = _pair(tmp_path, "sgd")
    real, opened = os.stat, []

    def stat(path, *args, **kwargs):  # the rollback runs between the check's reading of the fds and its fstat
        if not opened and str(path).endswith("rows.dat"):
            disk.close()
            opened.append(os.open(tmp_path / "rebuilt", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(disk_mod.os, "stat", stat)
    disk.check_files()  # (a false DATA_LOSS without the close's mark)
    monkeypatch.undo()
    assert opened
    os.close(opened[0])
    _, disk = _pair(tmp_path / "b", "sgd")
    os.truncate(disk.path, 100)
    with pytest.raises(DataLossError, match="truncated"):
        disk.check_files()


def test_missing_or_truncated_file_is_refused_by_name(tmp_path):
    _, disk = _pair(tmp_path, "sgd")
    os.unlink(disk.path)
    with pytest.raises(DataLossError, match=rf"table t: its data file {disk.path} is missing"):
        disk.bag(torch.tensor([[1]]), torch.ones(1, 1))
    _, disk = _pair(tmp_path / "b", "sgd")
    os.truncate(disk.path, 100)
    with pytest.raises(DataLossError, match="truncated"):
        disk.lookup(torch.tensor([250]))
    for name in ("updates", "value_sq_norm"):  # a statistic streams the whole file: refused, not a SIGBUS
        with pytest.raises(DataLossError, match="truncated"):
            disk.stat(name)
    # the read counters' file too (a walkthrough: a truncated stats.dat killed the shard, SIGBUS,
    # and with it every table on that shard; here it would kill the test's process)
    ram, disk = _pair(tmp_path / "c", "sgd")
    os.truncate(disk.stats_path, 4096)
    ids = torch.tensor([[250, 3]])
    for read in (lambda: disk.lookup(ids[0]), lambda: disk.bag(ids, torch.ones(1, 2)), lambda: disk.state(),
                 lambda: disk.slot_stats(ids[0]), lambda: disk.stat("hits"), lambda: disk.stat("weight_mass")):
        with pytest.raises(DataLossError, match=rf"table t: its data file {disk.stats_path} was replaced or truncated "
                                                r"\(4,096 bytes, the table needs 4,800\)"):
            read()
    os.unlink(disk.stats_path)
    with pytest.raises(DataLossError, match=rf"{disk.stats_path} is missing"):
        disk.lookup(ids[0])


def _open_files() -> list[str]:
    """What this process's file descriptors point at."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return out


def test_full_disk_is_refused_at_creation(tmp_path, monkeypatch):
    """A real full disk (a 64 KiB tmpfs) when we may mount one, else a failing fallocate."""
    cfg = OptimizerConfig("adagrad", 0.1)
    mnt = tmp_path / "small"
    mnt.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
                                                   capture_output=True).returncode == 0
    try:
        if not mounted:
            def full(fd, off, n):
                raise OSError(errno.ENOSPC, "No space left on device")

            monkeypatch.setattr(os, "posix_fallocate", full)
        with pytest.raises(ResourceExhaustedError, match=rf"table big: cannot allocate .* for {mnt}/big/rows.dat: the disk is full"):
            DiskTable(mnt / "big", 10_000, 16, cfg, cache_bytes=4096, name="big")
        assert not (mnt / "big" / "rows.dat").exists()
        if mounted:  # rows.dat fits, stats.dat does not: the first is closed and removed too
            with pytest.raises(ResourceExhaustedError, match=rf"for {mnt}/half/stats.dat: the disk is full") as caught:
                DiskTable(mnt / "half", 600, 16, cfg, cache_bytes=4096, name="half")  # 15 + 3 pages of 16
            assert not list((mnt / "half").iterdir())
            # while the caller still holds the error (its traceback's frames viewed the mapping)
            assert caught.value is not None and not [f for f in _open_files() if f.startswith(str(mnt))]
            assert DiskTable(mnt / "again", 600, 8, cfg, cache_bytes=4096, name="again").num_rows == 600  # space back
        if mounted:  # the disk still serves a table that fits
            small = DiskTable(mnt / "small", 100, 4, cfg, cache_bytes=4096, name="small")
            assert small.lookup(torch.tensor([3])).shape == (1, 4)
            small.close()
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_read_only_data_directory_is_a_status_naming_the_table_and_path(tmp_path, monkeypatch):
    """A hunt: on a read-only filesystem (a disk remounted read-only after errors) the cleanup's
    unlink of the file it could not make raised EROFS (Linux refuses even a missing file's unlink
    there) in place of the refusal, and a slice folder not made yet failed in mkdir: a bare
    OSError, INTERNAL to the client. A real read-only bind mount where we may make one, else
    every call that writes there failing as that filesystem does."""
    cfg = OptimizerConfig("adagrad", 0.1)
    src, mnt = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    mnt.mkdir()
    (src / "made").mkdir()  # a slice folder there already
    mounted = os.geteuid() == 0 and all(subprocess.run(cmd, capture_output=True).returncode == 0 for cmd in (
        ["mount", "--bind", str(src), str(mnt)], ["mount", "-o", "remount,bind,ro", str(mnt)]))
    try:
        if not mounted:
            (mnt / "made").mkdir()

            def erofs(*_: object, **__: object) -> None:
                raise OSError(errno.EROFS, os.strerror(errno.EROFS))

            real_mkdir = Path.mkdir
            for where, name in ((os, "open"), (Path, "unlink")):
                monkeypatch.setattr(where, name, erofs)
            monkeypatch.setattr(Path, "mkdir", lambda p, *a, **k: real_mkdir(p, *a, **k) if p.exists() else erofs())
        ro = os.strerror(errno.EROFS)
        with pytest.raises(FailedPreconditionError, match=rf"table t: cannot (allocate [0-9,]+ bytes for|make) "
                                                          rf"{mnt}/made/rows.dat: {ro}; the shards' data directory"):
            DiskTable(mnt / "made", 100, 8, cfg, cache_bytes=4096, name="t")
        with pytest.raises(FailedPreconditionError, match=rf"table t: cannot make {mnt}/new/disk: {ro}"):
            DiskTable(mnt / "new" / "disk", 100, 8, cfg, cache_bytes=4096, name="t")
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("err, status, says", [
    (errno.EFBIG, ResourceExhaustedError, "larger than a file may be there"),
    (errno.EACCES, FailedPreconditionError, "Permission denied; the shards' data directory must let them make files"),
    (errno.ENOMEM, ResourceExhaustedError, "no memory to map it")])
def test_a_file_that_cannot_be_made_is_a_status_naming_the_table_and_path(tmp_path, monkeypatch, err, status, says):
    """Beside a full disk, a file-size limit (ulimit -f, a FAT32 disk), a directory the shard may
    not write or a mapping refused reached the client as INTERNAL ("RuntimeError: ... [Errno 27]
    File too large"), naming neither the table nor the file (a hunt); nothing is left behind."""
    cfg = OptimizerConfig("adagrad", 0.1)

    def failing(*_: object) -> None:
        raise OSError(err, os.strerror(err))

    where = {errno.EFBIG: (os, "posix_fallocate"), errno.EACCES: (os, "open"), errno.ENOMEM: (mmap, "mmap")}[err]
    monkeypatch.setattr(*where, failing)
    with pytest.raises(status, match=rf"table big: cannot allocate [0-9,]+ bytes for {tmp_path}/big/rows.dat: .*{says}"):
        DiskTable(tmp_path / "big", 10_000, 16, cfg, cache_bytes=4096, name="big")
    monkeypatch.undo()
    assert not list((tmp_path / "big").iterdir())


def test_a_restore_writes_a_disk_slices_file_once(tmp_path, monkeypatch):
    """A restore (and a restart, the same path) made the file with zero records, sealed, then wrote
    every field from the checkpoint and sealed again: three passes over a file that may be larger
    than memory (a hunt: half a restart's time). The allocated file is filled by the load alone."""
    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    put = []
    real = DiskTable._put
    monkeypatch.setattr(DiskTable, "_put", lambda self, rows, recs: (put.append(len(rows) * (self.name == "t")),
                                                                      real(self, rows, recs))[1])
    with InProcessServer(2, data_dir=str(tmp_path / "data")) as server, MemoryClient(server.endpoint, timeout=30, shm=False) as c:
        c.create_table("t", 3000, 8, tier="disk", cache_bytes=2 * MIN_CACHE_BYTES, optimizer="adam", sharding="cols")
        assert sum(put) == 2 * 3000  # made: each slice's initial records
        c.push_gradients("t", np.arange(0, 3000, 7), np.ones((429, 8), np.float32))
        want = c.lookup("t", np.arange(3000))
        c.checkpoint(str(tmp_path / "ck"), 1)
        put.clear()
        c.restore(str(tmp_path / "ck"), 1, replace=True)
        assert sum(put) == 0
        assert np.array_equal(c.lookup("t", np.arange(3000)), want)
        c.push_gradients("t", [5], np.ones((1, 8), np.float32))  # the restored records read and step as any
        assert not np.array_equal(c.lookup("t", [5]), want[5:6])


def test_a_replace_the_disk_cannot_hold_leaves_the_table(tmp_path):
    """From an operator's walkthrough: `create-table T --replace --tier disk` (or `restore
    --replace --tier disk`) too large for the shards' disk dropped T, then failed to allocate the
    new files: the refusal destroyed the table it was refused for. The shards now check the disk
    with the memory, before the drop (the old tables' files counted as freed), summed over the
    shards that share a disk and over a restore's tables (a reviewer's cases: each slice, or each
    table, fitting alone), on a real full disk (a 1 MiB tmpfs)."""
    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer
    from tests.smalldisk import small_disk

    with small_disk(tmp_path / "small", "1m") as mnt:
        # two shards on one disk: each slice alone fits it, both together do not (the check sums them)
        with InProcessServer(2, data_dir=str(mnt)) as server, MemoryClient(server.endpoint, timeout=30, shm=False) as c:
            kw = dict(tier="disk", cache_bytes=2 * MIN_CACHE_BYTES, optimizer="sgd", sharding="rows")
            c.create_table("t", 2000, 16, **kw)  # 208 KB of files
            c.write_rows("t", np.arange(2000), np.full((2000, 16), 3.0, np.float32))
            with pytest.raises(ResourceExhaustedError, match=r"table t: its slices on shard \d's disk .* need 1,040,000 "
                                                             rf"bytes .* for their files in {mnt}/shard-000\d; .* are "
                                                             r"free there, and the tables it replaces free 208,000"):
                c.create_table("t", 10_000, 16, replace=True, **kw)  # 520 KB a slice
            assert (c.lookup("t", np.arange(2000)) == 3.0).all()  # still there, as it was
            c.create_table("t", 2500, 16, replace=True, seed=1, **kw)  # fits once the old files are gone: made
            assert c.table("t").num_rows == 2500
            c.drop_table("t")
            # a restore of two tables: each alone fits beside the rest, both do not
            for name in ("a", "b"):
                c.create_table(name, 3000, 16, **kw)  # 312,000 bytes each
            c.checkpoint(str(tmp_path / "ck"), 1)
            for name in ("a", "b"):
                c.create_table(name, 500, 16, replace=True, **kw)  # 52,000 each
            c.create_table("c", 4200, 16, **kw)  # 436,800: about 500 KB stay free
            with pytest.raises(ResourceExhaustedError, match=r"need 624,000 bytes .* the tables it replaces free 104,000"):
                c.restore(str(tmp_path / "ck"), 1, replace=True)
            assert [c.table(n).num_rows for n in ("a", "b")] == [500, 500]  # both as they were
            # a restore that makes one table anew and replaces another: the new one's files count too,
            # placed before the other's namesake frees its share (a second review's case: a fitted alone)
            c.drop_table("a")
            with pytest.raises(ResourceExhaustedError, match=r"need 624,000 bytes .* the tables it replaces free 52,000"):
                c.restore(str(tmp_path / "ck"), 1, replace=True)
            assert c.table("b").num_rows == 500 and "a" not in {t.name for t in c.list_tables()}


def test_a_create_the_disk_cannot_hold_is_refused_before_any_file_is_allocated(tmp_path):
    """An operator's walkthrough: a plain create of a disk table larger than the shards' disk
    (86 GB on 77 free) reserved its files whole until the allocation failed, then said "the disk
    is full", on a disk other tables and users share. Checked first now, as a replace is: the
    slices sharing a disk summed (here two, each fitting alone), nothing allocated."""
    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer
    from tests.smalldisk import small_disk

    with small_disk(tmp_path / "small", "1m") as mnt:
        with InProcessServer(2, data_dir=str(mnt)) as server, MemoryClient(server.endpoint, timeout=30, shm=False) as c:
            kw = dict(tier="disk", cache_bytes=2 * MIN_CACHE_BYTES, optimizer="sgd", sharding="rows")
            with pytest.raises(ResourceExhaustedError, match=r"table t: its slices on shard \d's disk .* need 1,040,000 "
                                                             rf"bytes .* for their files in {mnt}/shard-000\d; .* are "
                                                             r"free there: free space"):
                c.create_table("t", 10_000, 16, **kw)  # 520 KB a slice
            assert not list(mnt.glob("shard-*/t")) and "t" not in {t.name for t in c.list_tables()}
            c.create_table("t", 4000, 16, **kw)  # what fits is made
            assert c.table("t").num_rows == 4000
            with pytest.raises(TableExistsError, match="table 't' already exists"):  # the name first, as before
                c.create_table("t", 40_000, 16, **kw)
            # one table made (t, 2 slices from shard 0): a 1-slice table starts on shard 1, and the refusal
            # names that shard, whose folder it gives (it named shard 0, the slice's number: a hunt)
            with pytest.raises(ResourceExhaustedError, match=rf"table big: its slices on shard 1's disk .* in {mnt}/shard-0001;"):
                c.create_table("big", 10_000, 16, num_shards=1, **kw)


def test_a_checkpoint_the_disk_cannot_hold_leaves_nothing_mapped_so_a_drop_frees_the_files(tmp_path):
    """A checkpoint refused for a full disk kept the disk table's mapped files viewed (its error's
    traceback held the records it was writing): a drop then freed nothing on the disk, and a new
    table did not fit (an operator's walkthrough). Now the files' space comes back."""
    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer
    from tests.smalldisk import small_disk

    def free(mnt) -> int:
        st = os.statvfs(mnt)
        return st.f_bavail * st.f_frsize

    def mapped(mnt) -> list[str]:
        return [line for line in Path("/proc/self/maps").read_text().splitlines() if str(mnt) in line]

    with small_disk(tmp_path / "small", "3m") as mnt:
        with InProcessServer(2, data_dir=str(mnt)) as server, MemoryClient(server.endpoint, timeout=30, shm=False) as c:
            empty = free(mnt)
            c.create_table("t", 5000, 32, tier="disk", optimizer="adam", sharding="rows")  # 2 x 0.5 MB of files
            assert mapped(mnt) and free(mnt) < empty - 900_000
            with pytest.raises(ResourceExhaustedError, match="cannot write checkpoint file .* the disk is full"):
                c.checkpoint(str(mnt / "ck"), 1)
            c.drop_table("t")
            assert mapped(mnt) == [] and free(mnt) > empty - 100_000


def test_a_checkpoint_with_a_damaged_disk_table_writes_nothing_and_says_how_to_save_the_others(tmp_path):
    """A walkthrough: a checkpoint of every table, one of them a disk table whose rows.dat was
    truncated, failed at that table's slice after writing the others' (40 MB left), and its error
    did not say how to save the rest. The shards are asked first now: nothing is written, and the
    error says to name the other tables, which then checkpoint."""
    from client import DataLossError, MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    with InProcessServer(1, data_dir=str(tmp_path / "data")) as server, MemoryClient(server.endpoint, shm=False) as c:
        c.create_table("d", 1000, 8, tier="disk")
        c.create_table("r", 1000, 8)
        os.truncate(server.shards[0].servicer.tables["d"].table.path, 4096)
        # status says it at once (a walkthrough: served, exit 0, until a write failed), the RAM table served
        from memserver.cli.tables import problems, status_dict

        wrong = problems(status_dict(c.status()))
        assert len(wrong) == 1 and re.fullmatch(r"shard 0: table d is not served: table d: its data file .*rows.dat was "
                                                r"replaced or truncated \(4,096 bytes, the table needs 64,000\).*", wrong[0])
        with pytest.raises(DataLossError, match=r"table d: its data file .*rows.dat was replaced or truncated .*; "
                                                r"nothing was written: checkpoint the other tables by name"):
            c.checkpoint(str(tmp_path / "ck"), 1)
        assert not (tmp_path / "ck").exists() or list((tmp_path / "ck").iterdir()) == []
        assert c.checkpoint(str(tmp_path / "ck"), 1, tables=["r"])["tables"] == ["r"]


# ------------------------------------------------------------------ checkpoints, restore, the shard


def test_a_slice_of_no_rows_checkpoints_and_restores_in_either_tier(tmp_path):
    """A disk slice without rows (more shards than rows, by rows: the catalog refuses that, a
    direct user may not): its checkpoint's counters could not be read back ("self.stride(-1)
    must be 1 to view Byte as Long"), from a hunt."""
    from memserver.storage.checkpoint import load_into, save_slice

    cfg = OptimizerConfig("adagrad", 0.1)
    meta = {"table": "t", "kind": "value", "by_rows": True, "index": 3, "num_shards": 4, "num_rows": 2, "dim": 4,
            "col_start": 0, "col_end": 4}
    for tier in ("ram", "disk"):
        t = ValueTable(0, 4, cfg) if tier == "ram" else DiskTable(tmp_path / "src", 0, 4, cfg, cache_bytes=4096, name="t")
        save_slice(tmp_path / f"{tier}.pt", meta, t.state() if tier == "ram" else t.checkpoint_state())
        for into in ("ram", "disk"):
            new = (ValueTable(0, 4, cfg) if into == "ram"
                   else DiskTable(tmp_path / f"to-{tier}-{into}", 0, 4, cfg, cache_bytes=4096, name="t"))
            load_into(new, meta, [{"file": str(tmp_path / f"{tier}.pt")}])
            assert new.lookup(torch.zeros(0, dtype=torch.int64)).shape == (0, 4)
            if into == "disk":
                new.close()
        if tier == "disk":
            t.close()


def test_checkpoint_streams_and_restores_into_another_sharding(tmp_path):
    """A disk slice's checkpoint (its state is views of its file) restores into 2 rows slices,
    disk and RAM alike, and into 2 cols slices, with the same numbers as the RAM table's."""
    from memserver.api.types import ShardLayout
    from memserver.storage.checkpoint import load_into, save_slice

    ram, disk = _pair(tmp_path, "adagrad", rows=101, dim=6)
    _random_calls(ram, disk, seed=3, calls=30)
    for t in (ram, disk):  # steps after the last flush: dirty cached rows
        t.push_gradients(torch.arange(0, 101, 3), torch.ones(34, 6))
    meta = {"table": "t", "kind": "value", "by_rows": True, "index": 0, "num_shards": 1, "num_rows": 101, "dim": 6,
            "col_start": 0, "col_end": 6}
    dirty = int(disk._dirty.sum())
    assert dirty  # the checkpoint must flush these
    save_slice(tmp_path / "d.pt", meta, disk.checkpoint_state())
    save_slice(tmp_path / "r.pt", meta, ram.state())
    assert not disk._dirty.any()
    files = [{"file": str(tmp_path / "d.pt")}]
    for by_rows in (True, False):
        layout = ShardLayout(by_rows, 101, 6, 2)
        for i in range(2):
            rows, (c0, c1) = layout.global_rows(i), layout.cols(i)
            target = {**meta, "by_rows": by_rows, "index": i, "num_shards": 2, "col_start": c0, "col_end": c1}
            new = DiskTable(tmp_path / f"n{by_rows}{i}", len(rows), c1 - c0, ram.optimizer, cache_bytes=4096,
                            init_std=0.0, name="t")
            load_into(new, target, files)
            want = ValueTable(len(rows), c1 - c0, ram.optimizer, init_std=0.0)
            load_into(want, target, [{"file": str(tmp_path / "r.pt")}])
            _same_state(want, new)
            assert torch.equal(new.lookup(torch.arange(len(rows)), count=False), ram.weight[rows][:, c0:c1])


_SHARD_SCRIPT = r"""
import os, signal, sys, threading
import grpc, numpy as np, torch
from memserver.api.v1 import memserver_pb2 as pb, memserver_pb2_grpc as pb_grpc
from memserver.core import disk
from memserver.server.catalog import plan_table, validate_spec
from memserver.server.shard_actor import ShardActor
from memserver.wire import encode

data, kill_at, acked_file = sys.argv[1], int(sys.argv[2]), sys.argv[3]
puts = [0]
real_put = disk.DiskTable._put


def put(self, rows, recs):
    puts[0] += 1
    # a write to the file cut in the middle, half its rows written: a step's rows the cache did not
    # take (about one such write a push; dirty victims go back one record at a time, in the kernels)
    if puts[0] == kill_at and len(rows) > 1:
        real_put(self, rows[: len(rows) // 2], recs[: len(rows) // 2])
        os.kill(os.getpid(), signal.SIGKILL)
    real_put(self, rows, recs)


disk.DiskTable._put = put
if kill_at < 0:  # SIGKILL from another thread while the -kill_at-th placement runs (nogil): where
    # dirty victims are written back inside the kernel, one record at a time
    real_resolve, placements = disk._resolve, [0]

    def resolve(*args):
        placements[0] += 1
        if placements[0] == -kill_at:
            threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGKILL)).start()
        return real_resolve(*args)

    disk._resolve = resolve
spec = validate_spec(pb.TableSpec(name="d", num_rows=400, dim=8, optimizer=pb.OptimizerSpec(name="adam", lr=0.1),
                                  sharding=pb.ROWS, wal=True, seed=1, tier="disk", cache_bytes=4096), 1)
shard = ShardActor(0, host="127.0.0.1", data_dir=data)
shard.create_table(spec.SerializeToString(), plan_table(spec, [shard.info()]).shards[0].SerializeToString(), 1)
puts[0] = 0
with grpc.insecure_channel(shard.address) as ch:
    stub = pb_grpc.DataPlaneStub(ch)
    for seq in range(1, 200):
        rng = np.random.default_rng(seq)
        ids, g = rng.integers(0, 400, 24), rng.normal(size=(24, 8)).astype(np.float32)
        stub.PushGradients(pb.PushGradientsRequest(table="d", ids=encode(torch.as_tensor(ids)), grads=encode(torch.as_tensor(g)),
                                                   tag=pb.WriteTag(client_id="t", seq=seq)))
        with open(acked_file + ".tmp", "w") as f:  # replaced whole: a kill mid-write leaves the last one
            f.write(str(seq))
        os.replace(acked_file + ".tmp", acked_file)
        if seq == 40:
            shard.checkpoint_table("d", os.path.join(data, "ck", "step-0000000040", "d", "shard-0000.pt"), 40)
            open(os.path.join(data, "ck", "step-0000000040", "manifest.json"), "w").write("{}")
print("never killed")
"""


def _expected(seqs: int) -> torch.Tensor:
    ram = ValueTable(400, 8, OptimizerConfig("adam", 0.1), seed=1, init_std=0.0)  # the spec leaves init_std 0
    for seq in range(1, seqs + 1):
        rng = np.random.default_rng(seq)
        ram.push_gradients(torch.from_numpy(rng.integers(0, 400, 24)), torch.from_numpy(rng.normal(size=(24, 8)).astype(np.float32)))
    return ram.weight.clone()


@pytest.mark.parametrize("kill_at", [30, 130, -100])  # a cut write before / after the checkpoint at write 40; a
# kill during the 100th placement of missed rows (dirty victims written back inside the kernel)
def test_sigkill_mid_write_back_loses_nothing_acknowledged(tmp_path, kill_at):
    import sys

    import grpc

    from memserver.api.v1 import memserver_pb2 as pb
    from memserver.api.v1 import memserver_pb2_grpc as pb_grpc
    from memserver.server.shard_actor import ShardActor
    from memserver.wire import decode, encode

    acked = tmp_path / "acked"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _SHARD_SCRIPT, str(tmp_path / "data"), str(kill_at), str(acked)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == -9, proc.stdout + proc.stderr[-3000:]
    n = int(acked.read_text())
    assert (n >= 40) == (abs(kill_at) > 40), n  # the kill came where the case says: before or after the checkpoint
    shard = ShardActor(0, host="127.0.0.1", data_dir=str(tmp_path / "data"))
    try:
        sl = shard.servicer.tables["d"]
        assert sl.recovered_from.startswith("checkpoint step 40" if n >= 40 else "initial values")
        # the replay's reads and evictions are not the callers' (status's hit rate and disk rates)
        counted = sl.table.cache_stats()
        assert [counted[k] for k in ("hits", "misses", "evictions", "disk_reads", "disk_writes")] == [0] * 5, counted
        with grpc.insecure_channel(shard.address) as ch:
            got = decode(pb_grpc.DataPlaneStub(ch).Lookup(pb.LookupRequest(table="d", ids=encode(torch.arange(400)),
                                                                           uncounted=True)).rows, "rows")
        # every acknowledged write is there; the one being applied was logged first, so it is too
        if kill_at > 0:  # killed inside write n + 1
            assert torch.equal(got, _expected(n + 1)), n
        else:  # killed inside write n + 1, or between write n's answer and write n + 1
            assert torch.equal(got, _expected(n + 1)) or torch.equal(got, _expected(n)), n
    finally:
        shard.stop()


def test_shard_serves_a_disk_table_beside_a_ram_one_and_reports_its_cache(tmp_path):
    """Through a shard: a disk table answers as a RAM table of the same spec does; status and
    /metrics show its cache and disk counters; a corrupt row fails its table only."""
    import grpc

    from memserver.api.v1 import memserver_pb2 as pb
    from memserver.api.v1 import memserver_pb2_grpc as pb_grpc
    from memserver.cli.tables import _disk_dict, status_dict
    from memserver.server.catalog import plan_table, slice_size, validate_spec
    from memserver.server.shard_actor import ShardActor
    from memserver.wire import decode, encode

    shard = ShardActor(0, host="127.0.0.1", data_dir=str(tmp_path))
    specs = {}
    for name, tier in (("r", ""), ("d", "disk")):
        specs[name] = validate_spec(pb.TableSpec(name=name, num_rows=500, dim=8, sharding=pb.ROWS, seed=2, init_std=0.1,
                                                 tier=tier, cache_bytes=8192 if tier else 0), 1)
        info = plan_table(specs[name], [shard.info()]).shards[0]
        shard.create_table(specs[name].SerializeToString(), info.SerializeToString(), 1)
    assert slice_size(specs["d"], info).held == 8192 + 500 * 16  # the cache and read counters, not the rows
    # a bound above what the slice's rows need counts what its cache allocates (it counted the bound:
    # RESOURCE_EXHAUSTED, "need 10 TiB", for a 48 KB table)
    huge = validate_spec(pb.TableSpec(name="h", num_rows=500, dim=8, sharding=pb.ROWS, tier="disk", cache_bytes=10 << 40), 1)
    hinfo = plan_table(huge, [shard.info()]).shards[0]
    shard.create_table(huge.SerializeToString(), hinfo.SerializeToString(), 1)
    assert slice_size(huge, hinfo).held == shard.servicer.tables["h"].table.cache_nbytes() + 500 * 16
    shard.drop_table("h")
    rng = np.random.default_rng(0)
    try:
        with grpc.insecure_channel(shard.address) as ch:
            stub = pb_grpc.DataPlaneStub(ch)
            for i in range(20):
                ids = torch.from_numpy(rng.zipf(1.2, 64) % 500).view(16, 4)
                w, g = torch.rand(16, 4), torch.randn(16, 8)
                out = {}
                for name in ("r", "d"):
                    bag = stub.Bag(pb.BagRequest(table=name, ids=encode(ids), weights=encode(w)))
                    back = stub.BagBackward(pb.BagBackwardRequest(table=name, ids=encode(ids), weights=encode(w),
                                                                  grad_out=encode(g), tag=pb.WriteTag(client_id="c", seq=i + 1)))
                    out[name] = (decode(bag.out, "out"), decode(back.grad_weights, "g"))
                assert all(torch.equal(a, b) for a, b in zip(out["r"], out["d"]))
            # a hint: the rows the cache does not hold (none for a RAM table); a bad id refused by name
            sl = shard.servicer.tables["d"].table
            cold = np.setdiff1d(np.arange(500), sl._slot_row)[:100]
            assert stub.Warm(pb.WarmRequest(table="d", ids=encode(torch.from_numpy(cold)))).rows == len(cold)
            assert stub.Warm(pb.WarmRequest(table="r", ids=encode(torch.from_numpy(cold)))).rows == 0
            with pytest.raises(grpc.RpcError) as err:
                stub.Warm(pb.WarmRequest(table="d", ids=encode(torch.tensor([3, 500]))))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ids" in err.value.details()
            assert sl._ahead.wait_idle(30)  # the hint's counts settle before they are compared
            load = next(t for t in pb.ShardStatus.FromString(shard.status()).tables if t.table == "d")
            d = _disk_dict(load)
            assert d["tier"] == "disk" and 0 < d["cache_bytes"] <= d["cache_bound"] == 8192
            assert d["memory_bytes"] == load.bytes == sl.nbytes() == d["cache_bytes"] + 500 * 16  # and the counters
            assert (d["cached_rows"], d["capacity"]) == (int((sl._slot_row >= 0).sum()), sl.capacity) and d["cached_rows"] > 0
            assert d["cache_hits"] > 0 and 0 < d["hit_rate"] < 1 and d["disk_reads"] > 0 and d["disk_reads_per_s"] > 0
            reg = shard.metrics.registry
            assert reg.get_sample_value("memserver_disk_cache_bound_bytes", {"table": "d"}) == 8192
            assert reg.get_sample_value("memserver_disk_cache_hits_total", {"table": "d"}) == d["cache_hits"]
            assert reg.get_sample_value("memserver_disk_row_reads_total", {"table": "d"}) >= d["disk_reads"]
            c = sl.cache_stats()
            assert d["hinted"] == len(cold) == c["hinted"] == reg.get_sample_value("memserver_disk_row_hinted_total",
                                                                                  {"table": "d"})
            assert (d["warmed"], d["read_ahead"], d["warm_dropped"]) == (c["warmed"], c["read_ahead"], c["warm_dropped"])
            assert reg.get_sample_value("memserver_disk_row_warmed_total", {"table": "d"}) == c["warmed"]
            assert reg.get_sample_value("memserver_disk_row_warm_dropped_total", {"table": "d"}) == c["warm_dropped"]
            assert reg.get_sample_value("memserver_disk_cache_rows", {"table": "d"}) == d["cached_rows"]
            assert reg.get_sample_value("memserver_disk_cache_slots", {"table": "d"}) == d["capacity"]
            assert reg.get_sample_value("memserver_disk_cache_bytes", {"table": "r"}) is None  # RAM tables: no series
            # a corrupt row: DATA_LOSS naming the table and the file; the other table still serves
            path = load.data_file
            row = next(r for r in range(500) if r not in set(sl._slot_row.tolist()))
            with open(path, "r+b") as f:
                f.seek(row * sl.record + 24)
                f.write(b"\xff\xff\xff\xff")
            with pytest.raises(grpc.RpcError) as err:
                stub.Lookup(pb.LookupRequest(table="d", ids=encode(torch.tensor([row]))))
            assert err.value.code() == grpc.StatusCode.DATA_LOSS and f"table d: row {row} of {path}" in err.value.details()
            assert stub.Lookup(pb.LookupRequest(table="r", ids=encode(torch.tensor([row])))).rows
            # a slice refusing writes says so in status, reads still served
            assert load.writes_refused == ""
            shard.servicer.tables["r"].fail_writes("a logged write failed to apply (a test)")
            load = next(t for t in pb.ShardStatus.FromString(shard.status()).tables if t.table == "r")
            assert load.writes_refused == "a logged write failed to apply (a test)" and not load.unavailable
            assert [reg.get_sample_value("memserver_table_writes_refused", {"table": t}) for t in ("r", "d")] == [1, 0]
            shown = status_dict(pb.StatusResponse(shards=[pb.ShardStatus.FromString(shard.status())]))
            assert {t["table"]: t["writes_refused"] for t in shown["shards"][0]["tables"]}["r"] == load.writes_refused
    finally:
        shard.drop_table("d")
        shard.stop()
    assert not (tmp_path / "shard-0000" / "d").exists()


def test_a_logged_write_that_fails_to_apply_says_the_restart_applies_it(tmp_path):
    """From an operator's walkthrough: a write to a `wal` disk table met a corrupt row and was
    refused DATA_LOSS, then applied whole at the shard's restart (it was logged first); a client
    taking the refusal at its word and sending it again as a new write would apply it twice. The
    refusal now says the restart applies it."""
    import grpc

    from memserver.api.v1 import memserver_pb2 as pb
    from memserver.api.v1 import memserver_pb2_grpc as pb_grpc
    from memserver.server.catalog import plan_table, validate_spec
    from memserver.server.shard_actor import ShardActor
    from memserver.wire import decode, encode

    spec = validate_spec(pb.TableSpec(name="d", num_rows=500, dim=8, sharding=pb.ROWS, seed=2, init_std=0.1, tier="disk",
                                      cache_bytes=8192, wal=True, optimizer=pb.OptimizerSpec(name="sgd", lr=1.0)), 1)
    shard = ShardActor(0, host="127.0.0.1", data_dir=str(tmp_path))
    shard.create_table(spec.SerializeToString(), plan_table(spec, [shard.info()]).shards[0].SerializeToString(), 1)
    sl = shard.servicer.tables["d"]
    row = 321
    assert row not in set(sl.table._slot_row.tolist())  # (nothing read yet: the cache holds no row)
    with open(sl.table.path, "r+b") as f:  # a record the cache does not hold, damaged on disk
        f.seek(row * sl.table.record + 24)
        f.write(b"\xff\xff\xff\xff")
    ids = torch.tensor([row])
    with grpc.insecure_channel(shard.address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.DataPlaneStub(ch).WriteRows(pb.WriteRowsRequest(
                table="d", ids=encode(ids), rows=encode(torch.full((1, 8), 7.0)),
                tag=pb.WriteTag(client_id="c", seq=1)))
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    assert err.value.details().endswith("; this write is in the table's write-ahead log, so the shard's restart "
                                        "applies it: do not send it again"), err.value.details()
    # a checkpoint now would record the log's end past that write, and the restart would skip it (an
    # acknowledged write lost: a hunt): refused until the restart rebuilt the table
    from memserver.api.errors import FailedPreconditionError

    with pytest.raises(FailedPreconditionError, match="table 'd' on shard 0: a logged write failed to apply .* a "
                                                      "checkpoint now would keep that state: restart the shard"):
        shard.checkpoint_table("d", str(tmp_path / "ck"), 1)
    shard.stop()
    again = ShardActor(0, host="127.0.0.1", data_dir=str(tmp_path))
    try:
        with grpc.insecure_channel(again.address) as ch:
            got = pb_grpc.DataPlaneStub(ch).Lookup(pb.LookupRequest(table="d", ids=encode(ids)))
        assert (decode(got.rows, "rows") == 7.0).all()  # as said: applied by the restart
    finally:
        again.stop()


def test_a_disk_table_without_cache_bytes_caches_an_eighth_of_its_records():
    """One default for every entry point (client, CLI, tables.yaml, memtrain --tier disk): the
    catalog fills cache_bytes with 1/8 of the records, never below the per-shard minimum; a cache
    too small is still refused by name, and a RAM table takes none."""
    from memserver.api.errors import InvalidArgumentError
    from memserver.api.v1 import memserver_pb2 as pb
    from memserver.server.catalog import validate_spec

    def spec(rows, **kw):
        return pb.TableSpec(name="d", num_rows=rows, dim=64, optimizer=pb.OptimizerSpec(name="adam"), **kw)

    record = record_layout(64, "adam")[0]
    assert validate_spec(spec(80_000, tier="disk"), 2).cache_bytes == 80_000 * record // 8
    assert validate_spec(spec(4, tier="disk"), 2).cache_bytes == 2 * MIN_CACHE_BYTES
    # rows wider than the minimum: at least one a shard (the default was refused for holding none)
    wide = pb.TableSpec(name="d", num_rows=64, dim=1024, sharding=pb.ROWS, optimizer=pb.OptimizerSpec(name="adam"),
                        tier="disk")
    got = validate_spec(wide, 8)
    assert got.cache_bytes == 8 * cache_size(1, record_layout(1024, "adam")[0]) > 64 * record_layout(1024, "adam")[0] // 8
    assert validate_spec(spec(80_000, tier="disk", cache_bytes=1 << 20), 2).cache_bytes == 1 << 20
    with pytest.raises(InvalidArgumentError, match="at least 1024 bytes of cache per shard"):
        validate_spec(spec(80_000, tier="disk", cache_bytes=100), 2)
    with pytest.raises(InvalidArgumentError, match="only a tier 'disk' table has a cache"):
        validate_spec(spec(80_000, cache_bytes=1 << 20), 2)


def _vm_flags(path: Path) -> set[str]:
    """The kernel's flags of this process's mapping of `path` (/proc/self/smaps VmFlags)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.endswith(str(path)):
            for flags in lines[i + 1 :]:
                if flags.startswith("VmFlags:"):
                    return set(flags.split()[1:])
    raise AssertionError(f"{path} is not mapped")


def test_files_are_mapped_for_random_reads_and_a_resident_file_is_not_read_ahead(tmp_path):
    """The read counters are kept in memory and counted. Both files are advised MADV_RANDOM ('rr': a fault reads the page it needs, not the 32
    around it, 100x the rows/s once the file is larger than memory), and a file in memory is
    never read ahead: only `_read_ahead`'s look (mincore) is paid."""
    ram, disk = _pair(tmp_path, "adagrad", rows=20_000, cache_rows=500)
    assert "rr" in _vm_flags(disk.path) and "rr" in _vm_flags(disk.stats_path)
    # the read counters are locked in memory ('lo') where the process may (root here; else said)
    assert disk.counters_resident == ("lo" in _vm_flags(disk.stats_path)) == (os.geteuid() == 0)
    assert "lo" not in _vm_flags(disk.path) and disk.nbytes() == disk.cache_nbytes() + 20_000 * 16
    _random_calls(ram, disk, seed=11, calls=30)
    rng = np.random.default_rng(0)
    for _ in range(5):  # calls with thousands of misses, every page of the file in memory
        ids = torch.from_numpy(rng.integers(0, 20_000, (64, 32)))
        assert torch.equal(ram.bag(ids, torch.ones(64, 32)), disk.bag(ids, torch.ones(64, 32)))
        ram.push_gradients(ids.view(-1), torch.ones(2048, 8))
        disk.push_gradients(ids.view(-1), torch.ones(2048, 8))
    s = disk.cache_stats()
    assert s["misses"] > 5000 and s["read_ahead"] == 0


def _resident(t: DiskTable, rows: np.ndarray) -> np.ndarray:
    """Whether the first page of each row's record is in memory (mincore on the table's mapping)."""
    vec = (ctypes.c_ubyte * 1)()
    out = np.zeros(len(rows), dtype=bool)
    for i, r in enumerate(rows):
        page = (t._raw.ctypes.data + int(r) * t.record) & ~(mmap.PAGESIZE - 1)
        assert disk_mod._LIBC.mincore(ctypes.c_void_p(page), ctypes.c_size_t(mmap.PAGESIZE), vec) == 0
        out[i] = vec[0] & 1
    return out


def test_a_hint_reads_cold_rows_ahead_and_changes_nothing(tmp_path):
    """warm (a trainer's hint at its next step's rows): the distinct rows the cache does not hold
    go to the read-ahead thread, which brings their pages into memory while the caller goes on;
    the read that follows finds them there (no read-ahead of its own) and answers as the RAM
    table does. The hint reads, counts and changes nothing; rows it does not name stay out."""
    ram, disk = _pair(tmp_path, "sgd", rows=4000, dim=1024, cache_rows=100)  # records of a page and more
    rng = np.random.default_rng(0)
    for _ in range(5):
        ids = torch.from_numpy(rng.integers(0, 4000, (16, 4)))
        assert torch.equal(ram.bag(ids, torch.ones(16, 4)), disk.bag(ids, torch.ones(16, 4)))
    cached = disk._slot_row[disk._slot_row >= 0]
    cold = np.setdiff1d(np.arange(0, 4000, 2), cached)  # no two share a page (a record > a page)
    hinted, other = cold[0::2], cold[1::2]
    drop_page_cache(disk)
    if _resident(disk, cold).any():
        pytest.skip(f"{tmp_path}: the page cache keeps this file's pages (tmpfs?): nothing to read ahead")
    before = disk.cache_stats()
    hits = disk.hits.clone()
    ids = np.concatenate([hinted, hinted[:50], cached[:20]])  # repeats and cached rows: not handed on
    assert disk.warm(torch.from_numpy(rng.permutation(ids))) == len(hinted)
    # (WILLNEED returns once the reads are queued: the pages are in memory a little later)
    wait_for("the hinted pages", lambda: True if _resident(disk, hinted).all() else None, timeout=20, interval=0.01)
    after = disk.cache_stats()
    assert after["hinted"] == after["warmed"] == len(hinted) and after["warm_dropped"] == 0
    assert {k: after[k] for k in ("hits", "misses", "evictions", "read_ahead", "cached_rows")} == {
        k: before[k] for k in ("hits", "misses", "evictions", "read_ahead", "cached_rows")}
    assert torch.equal(disk.hits, hits)
    assert not _resident(disk, other).any()
    q = torch.from_numpy(hinted[:600])
    assert torch.equal(disk.lookup(q), ram.lookup(q))
    assert disk.cache_stats()["read_ahead"] == before["read_ahead"]  # found in memory
    q = torch.from_numpy(other[:600])
    assert torch.equal(disk.lookup(q), ram.lookup(q))
    assert disk.cache_stats()["read_ahead"] == before["read_ahead"] + 600  # cold: the call read them ahead itself
    assert disk.warm(torch.tensor([-1, 4000], dtype=torch.int64)) == 0  # out of range: a hint never fails
    disk.close()


def test_the_read_ahead_thread_holds_two_hints_and_close_waits_for_it(monkeypatch):
    """At most WARM_HINTS hints wait: a newer one drops the oldest, counted. close() drops what
    waits, waits for the hint in flight (no request outlives the mapping), and takes no more."""
    entered, release = threading.Event(), threading.Event()
    done: list[int] = []

    def slow(raw, rows):
        entered.set()
        release.wait(20)
        done.append(len(rows))
        return len(rows)

    monkeypatch.setattr(disk_mod, "_read_ahead", slow)
    ahead = disk_mod._ReadAhead(np.zeros((10, 8), np.uint8), "t")
    ahead.put(np.arange(1))
    assert entered.wait(20)
    for n in (2, 3, 4):
        ahead.put(np.arange(n))
    assert disk_mod.WARM_HINTS == 2 and [len(h) for h in ahead.hints] == [3, 4] and ahead.dropped == 2
    closing = threading.Thread(target=ahead.close)
    closing.start()
    closing.join(0.3)
    assert closing.is_alive()  # the hint in flight holds it
    release.set()
    closing.join(20)
    assert not closing.is_alive() and done == [1] and ahead.dropped == 2 + 3 + 4 and ahead.hinted == 10
    ahead.put(np.arange(5))
    assert not ahead.hints and ahead.hinted == 10


_LARGER_THAN_MEMORY = r"""
import json, mmap, os, resource, sys
from pathlib import Path
import numpy as np, torch
from memserver.core.disk import DiskTable
from memserver.core.optim import OptimizerConfig
from memserver.core.table import ValueTable, set_threads
from tests.memlimit import MemoryLimit

set_threads(1)
rows, dim = 160_000, 64
cfg = OptimizerConfig("adagrad", 0.05)
disk = DiskTable(Path(sys.argv[1]), rows, dim, cfg, cache_bytes=rows * 288 // 8, seed=3, name="big")
ram = ValueTable(rows, dim, cfg, seed=3)
rng = np.random.default_rng(0)
perm = rng.permutation(rows)
cdf = np.cumsum(1.0 / np.arange(1, rows + 1)); cdf /= cdf[-1]
def draw(shape):  # Zipf 1.0, ranks scattered over the file
    return torch.from_numpy(perm[np.minimum(np.searchsorted(cdf, rng.random(shape)), rows - 1)])
w, g = torch.rand(128, 16), torch.randn(128, dim) * 0.1
warm = draw((128, 16))
for t in (ram, disk):  # every kernel compiled (loaded) before the limit, so only the work counts
    t.bag(warm, w); t.lookup(warm[0]); t.bag_backward(warm, w, None, g)
file_bytes = rows * disk.record
with MemoryLimit(disk.cache_bound + 32 * 2**20, name="disk-test") as limit:
    limit.add()
    disk.flush()  # the cache's dirty rows into the file: the cache starts again empty inside the limit
    assert disk.counters_resident  # the read counters stay in memory (mlock); the rows go
    disk._map.flush(); disk._map.madvise(mmap.MADV_DONTNEED); os.posix_fadvise(disk._fd, 0, 0, os.POSIX_FADV_DONTNEED)
    disk._make_cache()  # the cache's slots inside the limit
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    for step in range(30):
        ids = draw((128, 16))
        assert torch.equal(ram.bag(ids, w), disk.bag(ids, w)), step
        ids = draw((128, 16))
        assert torch.equal(ram.bag_backward(ids, w, None, g), disk.bag_backward(ids, w, None, g)), step
        ids = draw(256)
        assert torch.equal(ram.lookup(ids), disk.lookup(ids)), step
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - faults
    for k in ("weight", "acc", "updates"):
        assert torch.equal(ram.state()[k], disk.state()[k]), k
    print(json.dumps({"limit": limit.limit, "peak": limit.peak(), "file": file_bytes, "faults": faults,
                      **disk.cache_stats()}))
"""


def test_a_table_larger_than_its_memory_answers_as_in_ram(tmp_path):
    """The mission's case: a process whose memory (a cgroup: anonymous memory and page cache)
    is smaller than its table's file serves Zipf reads, optimizer steps and lookups with the
    in-memory table's bits; the misses come from the device (read ahead), not the page cache."""
    import json
    import sys

    from tests.memlimit import available

    why = available()
    if why:
        pytest.skip(why)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _LARGER_THAN_MEMORY, str(tmp_path / "big")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # the group's memory (smaller than the file) filled: the process ran in it, under pressure
    assert got["peak"] > 0.9 * got["limit"] and got["limit"] < got["file"], got
    assert got["read_ahead"] > 1000 and got["misses"] > 1000 and got["hits"] > 1000, got


def test_a_rows_disk_table_serves_calls_whose_ids_one_shard_owns(client, table_name):
    """2 shards by rows: each call below reaches one shard with its ids and the other with none
    (client.ops.routing), which must answer and write nothing; the table stays writable and
    equal to a RAM table of the same spec."""
    ram = table_name + "-ram"
    for name, tier in ((table_name, "disk"), (ram, "ram")):
        client.create_table(name, 1000, 16, sharding="rows", tier=tier, seed=3, init_std=0.1)
    ids, g = np.array([[3]]), np.ones((1, 16), np.float32)
    for name in (table_name, ram):
        client.bag_backward(name, ids, np.ones((1, 1), np.float32), g)
        client.write_rows(name, np.array([5]), np.full((1, 16), 2.0, np.float32))
    a, b = client.slot_stats(table_name, np.array([3, 5])), client.slot_stats(ram, np.array([3, 5]))
    assert set(a) == set(b) and a["updates"][0] == 1  # the step reached row 3
    for k in a:
        if k != "last_update":  # wall-clock time of the step
            np.testing.assert_array_equal(a[k], b[k])
    np.testing.assert_array_equal(client.lookup(table_name, np.arange(8)), client.lookup(ram, np.arange(8)))
    loads = [t for s in client.status().shards for t in s.tables if t.table == table_name]
    assert len(loads) == 2 and not any(t.writes_refused or t.unavailable for t in loads)
    client.drop_table(ram)



def test_status_says_no_hit_rate_before_a_disk_tables_first_read(client, table_name, capsys):
    """`memserver status` showed 0.0% hits for a disk table nothing had read yet (the page showed
    none): both say no rate then (JSON null, the table "-"), and the rate once read."""
    import json

    from memserver.cli import main

    client.create_table(table_name, 1000, 8, tier="disk")

    def rates() -> list:
        assert main(["status", "--json", "--endpoint", client.endpoint]) == 0
        st = json.loads(capsys.readouterr().out)
        return [t["hit_rate"] for s in st["shards"] for t in s["tables"] if t["table"] == table_name]

    assert rates() == [None, None]
    assert main(["status", "--endpoint", client.endpoint]) == 0 and table_name[:8] in capsys.readouterr().out
    client.bag(table_name, np.array([[1, 2], [1, 999]]), np.ones((2, 2), np.float32))
    assert all(r is not None and 0 <= r < 1 for r in rates())  # each shard read its column block of 3 rows
    client.drop_table(table_name)


def test_every_column_slice_of_a_disk_table_caches_what_its_lookups_read(client, table_name, capsys):
    """A walkthrough: a cols disk table's second slice keeps no read counters (the first does),
    and its lookups were taken for inspection reads: nothing placed in its cache, no hit or miss
    counted, every lookup read from the file again (0 of 1,000 rows cached, hit rate "-", ~1,000
    disk reads a second). Both slices cache now and count their hits; an inspection read
    (`count=False`) still places nothing."""
    import json

    from memserver.cli import main

    def shards() -> list:
        assert main(["status", "--json", "--endpoint", client.endpoint]) == 0
        st = json.loads(capsys.readouterr().out)
        return [t for s in st["shards"] for t in s["tables"] if t["table"] == table_name]

    client.create_table(table_name, 1000, 16, tier="disk", cache_bytes=1 << 30)  # cols: the default
    try:
        client.lookup(table_name, np.arange(1000), count=False)  # inspection: nothing placed
        assert [t["cached_rows"] for t in shards()] == [0, 0]
        for _ in range(3):
            client.lookup(table_name, np.arange(1000))
        got = shards()
        assert [t["cached_rows"] for t in got] == [1000, 1000], got
        assert [(t["cache_hits"], t["cache_misses"]) for t in got] == [(2000, 1000)] * 2, got
    finally:
        client.drop_table(table_name)


def test_status_says_what_a_cache_bound_above_the_table_holds(client, table_name, capsys):
    """A disk table's cache bound above its whole table (10 TiB for 1,000 rows) is capped by the
    shards at what the rows need; the tables view showed "cache 10.0 TiB" beside the disk view's
    capped bound. It says both now; a bound below the table is shown as given."""
    from memserver.cli import main

    client.create_table(table_name, 1000, 8, tier="disk", cache_bytes=10 << 40)
    client.create_table(table_name + "-small", 1000, 8, tier="disk", cache_bytes=8192)
    try:
        assert main(["status", "--endpoint", client.endpoint]) == 0
        out = capsys.readouterr().out
        assert len(re.findall(r"disk, cache 10\.0 TiB \(holds at most [\d.]+ KiB", out)) == 1, out
        assert re.search(r"disk, cache 8\.0 KiB\s+│", out) and out.count("holds at most") == 1, out
    finally:
        client.drop_table(table_name)
        client.drop_table(table_name + "-small")


@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
def test_restore_moves_a_table_between_tiers_and_it_continues_identically(client, table_name, tmp_path, optimizer):
    """A RAM table's checkpoint restored onto disk (a table that outgrew its shards' memory, its
    cache a fraction of it), then that table's checkpoint restored back into RAM: each time it
    holds the rows, optimizer state and counters it was saved with, and goes on exactly as a RAM
    twin given the same calls. A bad tier or cache is refused, naming the field, and changes nothing."""
    twin = table_name + "-twin"
    rng = np.random.default_rng(5)
    for name in (table_name, twin):
        client.create_table(name, 400, 16, optimizer=optimizer, lr=0.05, seed=3, init_std=0.1)

    def assert_same() -> None:
        np.testing.assert_array_equal(client.lookup(table_name, np.arange(400), count=False),
                                      client.lookup(twin, np.arange(400), count=False))
        a, b = client.slot_stats(table_name, np.arange(400)), client.slot_stats(twin, np.arange(400))
        for k in a:
            if k != "last_update":  # wall-clock time of each row's step
                np.testing.assert_array_equal(a[k], b[k], err_msg=k)

    def same_steps(n: int = 3) -> None:
        for _ in range(n):
            ids = rng.integers(0, 400, (32, 8))
            w, g = rng.random((32, 8)).astype(np.float32), rng.normal(size=(32, 16)).astype(np.float32)
            np.testing.assert_array_equal(client.bag_backward(table_name, ids, w, g), client.bag_backward(twin, ids, w, g))
        assert_same()

    def tiers() -> set[tuple[str, int]]:
        return {(t.tier or "ram", t.cache_bound) for s in client.status().shards for t in s.tables if t.table == table_name}

    try:
        same_steps()
        client.checkpoint(str(tmp_path / "a"), step=1, tables=[table_name])
        meta = client.restore(str(tmp_path / "a"), replace=True, tables=[table_name], tier="disk",
                              cache_bytes=2 * MIN_CACHE_BYTES)[0]
        assert (meta.tier, meta.cache_bytes, len(meta.shards)) == ("disk", 2 * MIN_CACHE_BYTES, 2)
        assert tiers() == {("disk", MIN_CACHE_BYTES)}  # each slice's cache: a few of its 200 rows
        assert_same()
        same_steps()
        for bad, says in (({"tier": "tape"}, "tier: expected one of ram, disk"),
                          ({"tier": "ram", "cache_bytes": 1 << 20}, f"cache_bytes: table {table_name}: only a tier "
                           "'disk' table has a cache, and this restore puts it in tier 'ram'"),
                          # a RAM checkpoint (a walkthrough: every table of a checkpoint, a RAM one among them,
                          # restored with --cache-bytes as docs/deploy.md said, was refused naming none)
                          ({"cache_bytes": 10}, f"cache_bytes: table {table_name}: only a tier 'disk' table has a "
                           r"cache, and it was saved in tier 'ram': restore the disk tables by name \(memserver restore "
                           r"--table NAME\), or move this one to disk \(--tier disk\)"),
                          ({"tier": "disk", "cache_bytes": 10}, "cache_bytes: a tier 'disk' table needs at least")):
            with pytest.raises(InvalidArgumentError, match=says):
                client.restore(str(tmp_path / "a"), replace=True, tables=[table_name], **bad)
        assert tiers() == {("disk", MIN_CACHE_BYTES)}
        assert_same()  # the refused restores dropped nothing
        client.checkpoint(str(tmp_path / "b"), step=2, tables=[table_name])
        meta = client.restore(str(tmp_path / "b"), replace=True, tables=[table_name], tier="ram")[0]
        assert (meta.tier, meta.cache_bytes) == ("ram", 0) and tiers() == {("ram", 0)}
        assert_same()
        same_steps()
        meta = client.restore(str(tmp_path / "b"), replace=True, tables=[table_name])[0]  # as saved: on disk
        assert (meta.tier, meta.cache_bytes) == ("disk", 2 * MIN_CACHE_BYTES)
        # a coordinator that predates the tier field ignores it: the client says so instead of a silent RAM table
        real = client.aio._control

        async def old_coordinator(method, request):
            if method == "Restore":
                request.tier, request.cache_bytes = "", 0
            return await real(method, request)

        client.aio._control = old_coordinator
        try:
            with pytest.raises(FailedPreconditionError, match=r"tier: the cluster restored \[.*\] but not as tier 'ram'"):
                client.restore(str(tmp_path / "b"), replace=True, tables=[table_name], tier="ram")
        finally:
            client.aio._control = real
    finally:
        client.drop_table(twin)


def test_a_disk_table_of_half_floats_is_refused_in_the_dtype_users_write(client, table_name):
    with pytest.raises(InvalidArgumentError, match="dtype: a tier 'disk' table stores float32, not bfloat16 "):
        client.create_table(table_name, 10, 4, tier="disk", dtype="bfloat16")
    assert table_name not in {t.name for t in client.list_tables()}


def test_a_cache_that_holds_no_row_is_refused(client, table_name):
    """A cache smaller than one record was accepted with 0 slots (every read went to the file,
    unsaid; an operator's walkthrough): refused naming what one row takes, for the widest slice."""
    with pytest.raises(InvalidArgumentError, match=r"cache_bytes: 4096 over 1 shard\(s\) leaves 4096 bytes a shard, "
                                                   r"which holds no row of this table \(a cached row takes \d+ bytes"):
        client.create_table(table_name, 100, 1024, tier="disk", cache_bytes=4096, optimizer="adam", num_shards=1)
    assert table_name not in {t.name for t in client.list_tables()}
    client.create_table(table_name, 100, 1024, tier="disk", cache_bytes=4096 * 8, optimizer="adam", num_shards=1)
    client.drop_table(table_name)


def test_recent_rate_is_the_rate_of_the_last_minute_and_falls_to_zero_when_idle():
    """`memserver status`'s disk rates: an average since the slice loaded stayed up for hours
    after the work stopped. The recent rate follows a steady rate from the start, then decays."""
    from memserver.core.disk import RecentRate

    now = [0.0]
    r = RecentRate(60.0, clock=lambda: now[0])
    assert r.per_second() == 0.0
    for _ in range(30):  # 100 rows/s for 3 s: the rate since the start
        now[0] += 0.1
        r.add(10)
    assert r.per_second() == pytest.approx(100, rel=0.02)
    for _ in range(6000):  # ten minutes more at 100 rows/s
        now[0] += 0.1
        r.add(10)
    assert r.per_second() == pytest.approx(100, rel=0.01)
    now[0] += 60  # a minute idle: down to 1/e of it; an hour: nothing left
    assert r.per_second() == pytest.approx(100 / np.e, rel=0.01)
    now[0] += 3600
    assert r.per_second() < 1e-20
    r.add(0)  # no events: no change of its clock
    assert r.per_second() < 1e-20
    fresh = RecentRate(60.0, clock=lambda: now[0])  # one call just after the start is not a rate
    now[0] += 0.001
    fresh.add(1000)
    now[0] += 0.001
    assert fresh.per_second() == pytest.approx(1000, rel=0.01)


def test_status_of_a_shard_without_recent_rates_falls_back_to_its_counters():
    """A shard that predates TableLoad's rates sends 0 for them: status then shows its counters'
    average since load, not 0 reads/s for a busy table."""
    from memserver.api.v1 import memserver_pb2 as pb
    from memserver.cli.tables import _disk_dict

    old = pb.TableLoad(tier="disk", disk_reads=600, disk_writes=120, disk_seconds=60.0, cache_hits=3, cache_misses=1)
    d = _disk_dict(old)
    assert (d["disk_reads_per_s"], d["disk_writes_per_s"], d["hit_rate"]) == (10.0, 2.0, 0.75)
    new = pb.TableLoad(tier="disk", disk_reads=600, disk_seconds=60.0, disk_reads_per_s=0.5)
    assert _disk_dict(new)["disk_reads_per_s"] == 0.5 and _disk_dict(pb.TableLoad(tier="disk"))["disk_reads_per_s"] == 0
    assert _disk_dict(pb.TableLoad(tier="disk"))["hit_rate"] is None  # nothing read yet: no rate, not 0% (as the page)


def test_a_write_meeting_a_corrupt_row_of_a_table_without_wal_is_refused_alone(tmp_path):
    """A hunt: on a disk table without `wal`, a write that met a corrupt record (refused DATA_LOSS
    before it changed any row) marked the slice "a write failed part way", and every later write
    and checkpoint of healthy rows was refused until a restart, which without a log drops the
    writes since the checkpoint. Such a write is refused alone now; the DATA_LOSS says what a
    restart keeps without a log."""
    import grpc

    from memserver.api.v1 import memserver_pb2 as pb
    from memserver.api.v1 import memserver_pb2_grpc as pb_grpc
    from memserver.server.catalog import plan_table, validate_spec
    from memserver.server.shard_actor import ShardActor
    from memserver.wire import decode, encode

    spec = validate_spec(pb.TableSpec(name="d", num_rows=500, dim=8, sharding=pb.ROWS, seed=2, init_std=0.1, tier="disk",
                                      cache_bytes=8192, optimizer=pb.OptimizerSpec(name="sgd", lr=1.0)), 1)
    shard = ShardActor(0, host="127.0.0.1", data_dir=str(tmp_path))
    try:
        shard.create_table(spec.SerializeToString(), plan_table(spec, [shard.info()]).shards[0].SerializeToString(), 1)
        sl = shard.servicer.tables["d"]
        row = 321
        with open(sl.table.path, "r+b") as f:  # a record the cache does not hold, damaged on disk
            f.seek(row * sl.table.record + 24)
            f.write(b"\xff\xff\xff\xff")
        with grpc.insecure_channel(shard.address) as ch:
            stub = pb_grpc.DataPlaneStub(ch)

            def write(ids: list[int], value: float, seq: int) -> None:
                stub.WriteRows(pb.WriteRowsRequest(table="d", ids=encode(torch.tensor(ids)),
                                                   rows=encode(torch.full((len(ids), 8), value)),
                                                   tag=pb.WriteTag(client_id="c", seq=seq)))

            before = decode(stub.Lookup(pb.LookupRequest(table="d", ids=encode(torch.tensor([1])))).rows, "rows")
            with pytest.raises(grpc.RpcError) as err:
                write([1, row], 7.0, 1)
            assert err.value.code() == grpc.StatusCode.DATA_LOSS
            assert err.value.details().endswith(f"row {row} of {sl.table.path} is corrupt (its checksum does not match); "
                                                "restart the shard to rebuild it from its checkpoint and, for a table "
                                                "with `wal`, its write-ahead log (without one, its writes since that "
                                                "checkpoint are lost), or restore the table"), err.value.details()
            got = decode(stub.Lookup(pb.LookupRequest(table="d", ids=encode(torch.tensor([1])))).rows, "rows")
            assert torch.equal(got, before)  # nothing of the refused write
            write([1, 2], 5.0, 2)  # other rows' writes go on
            got = decode(stub.Lookup(pb.LookupRequest(table="d", ids=encode(torch.tensor([1, 2])))).rows, "rows")
            assert (got == 5.0).all()
            assert sl.writes_refused() == ""
            # a commit whose update meets it has taken the step's parts by then: the slice stops its writes
            ids, w = torch.tensor([[2, row]]), torch.ones(1, 2)
            stub.BagBackward(pb.BagBackwardRequest(table="d", ids=encode(ids), weights=encode(w), gather=True, step=1,
                                                   no_weight_grad=True, grad_out=encode(torch.ones(1, 8)),
                                                   tag=pb.WriteTag(client_id="c", seq=3)))
            with pytest.raises(grpc.RpcError) as err:
                stub.CommitStep(pb.CommitStepRequest(table="d", step=1, phase=pb.STEP_PREPARE_COMMIT, part_seqs=[3],
                                                     tag=pb.WriteTag(client_id="c", seq=4)))
            assert err.value.code() == grpc.StatusCode.DATA_LOSS
            assert sl.writes_refused().startswith("a write failed part way (DataLossError")
    finally:
        shard.stop()


def test_a_default_cache_follows_a_restore_into_more_shards(tmp_path):
    """A hunt: a small disk table made without cache_bytes on 1 shard (its default, the 1 KiB
    minimum of one shard), restored into 2 shards as saved, was refused for a cache_bytes nobody
    gave ("needs at least 1024 bytes of cache per shard (2048 over 2), got 1024"). A default is
    the default again for the new shard count; a cache the user gave is kept."""
    from client import MemoryClient
    from memserver.api.v1 import memserver_pb2 as pb
    from memserver.cluster.inprocess import InProcessServer
    from memserver.server.catalog import default_cache_bytes

    with InProcessServer(2, data_dir=str(tmp_path / "data")) as s, MemoryClient(s.endpoint, timeout=60) as cl:
        small = cl.create_table("t", 100, 8, tier="disk", num_shards=1)
        given = cl.create_table("g", 100, 8, tier="disk", num_shards=1, cache_bytes=4000)
        assert small.cache_bytes == 1024 and given.cache_bytes == 4000
        cl.checkpoint(str(tmp_path / "ck"), step=1)
        got = {m.name: m for m in cl.restore(str(tmp_path / "ck"), replace=True, num_shards=2)}
        spec = pb.TableSpec(name="t", num_rows=100, dim=8, tier="disk", optimizer=pb.OptimizerSpec(name="adagrad"))
        assert (got["t"].cache_bytes, len(got["t"].shards)) == (default_cache_bytes(spec, 2), 2) == (2048, 2)
        assert (got["g"].cache_bytes, len(got["g"].shards)) == (4000, 2)
        back = {m.name: m for m in cl.restore(str(tmp_path / "ck"), replace=True, num_shards=1)}
        assert back["t"].cache_bytes == 1024 and back["g"].cache_bytes == 4000
