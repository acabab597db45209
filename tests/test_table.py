"""ValueTable math against the numpy reference, without Ray or gRPC."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from client.ops import aggregate
from memserver.core.init import init_values
from memserver.core.optim import OptimizerConfig
from memserver.core.table import ValueTable
from tests.reference import RefTable, bag


def test_init_is_independent_of_sharding():
    full = init_values(np.arange(100), 0, 24, 24, 0.5, seed=7).numpy()
    assert abs(full.std() - 0.5) < 0.05 and abs(full.mean()) < 0.05
    rows_slice = init_values(np.arange(1, 100, 3), 0, 24, 24, 0.5, seed=7).numpy()
    np.testing.assert_array_equal(rows_slice, full[1::3])
    cols_slice = init_values(np.arange(100), 8, 16, 24, 0.5, seed=7).numpy()
    np.testing.assert_array_equal(cols_slice, full[:, 8:16])
    assert not np.array_equal(full, init_values(np.arange(100), 0, 24, 24, 0.5, seed=8).numpy())


def test_bag_matches_reference_fixed_and_ragged():
    t = ValueTable(50, 8, OptimizerConfig("sgd", 0.1), init_std=1.0, seed=3)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, (6, 4))
    w = rng.random((6, 4)).astype(np.float32)
    out = t.bag(torch.from_numpy(ids), torch.from_numpy(w)).numpy()
    np.testing.assert_allclose(out, bag(t.weight.numpy(), ids, w), rtol=1e-5, atol=1e-6)
    # ragged: bags of 3, 0 and 2 entries
    flat, fw, offsets = torch.tensor([1, 2, 3, 4, 4]), torch.tensor([0.5, 1.0, 2.0, 1.0, 1.0]), torch.tensor([0, 3, 3])
    out = t.bag(flat, fw, offsets).numpy()
    v = t.weight.numpy()
    np.testing.assert_allclose(out[0], 0.5 * v[1] + v[2] + 2 * v[3], rtol=1e-5)
    np.testing.assert_allclose(out[1], 0)
    np.testing.assert_allclose(out[2], 2 * v[4], rtol=1e-5)


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_bag_backward_matches_reference_with_duplicates(optimizer, backend):
    rng = np.random.default_rng(1)
    t = ValueTable(40, 8, OptimizerConfig(optimizer, 0.05), init_std=0.3, seed=5, backend=backend)
    assert t.backend == backend
    ref = RefTable(t.weight.numpy(), optimizer, 0.05)
    for _ in range(3):
        ids = rng.integers(0, 12, (5, 6))  # few rows: many duplicates within and across bags
        w = rng.random((5, 6)).astype(np.float32)
        g = rng.normal(size=(5, 8)).astype(np.float32)
        got = t.bag_backward(torch.from_numpy(ids), torch.from_numpy(w), None, torch.from_numpy(g)).numpy()
        np.testing.assert_allclose(got, ref.bag_backward(ids, w, g), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(t.weight.numpy(), ref.w, rtol=1e-4, atol=1e-6)
    assert t.updates[:12].sum() > 0 and t.updates[12:].sum() == 0


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_step_on_column_slices_equals_the_step_on_the_whole_row(optimizer):
    """A cols table's shards each step their own columns: the columns must round as they do in one
    table whatever the slice's width (a walkthrough: resharded 3 -> 2 shards, an Adam table's
    rows moved apart by 7e-9 in 10% of them, since fastmath's "arcp" and "afn" let a vector lane
    divide and take square roots otherwise than the scalar tail). (Adagrad's accumulator is per
    slice by design: docs/architecture.md, "Sharding".)"""
    rng = np.random.default_rng(6)
    whole = ValueTable(300, 40, OptimizerConfig(optimizer, 0.01), init_std=0.3, seed=3, backend="numba")
    cuts = [(0, 13), (13, 26), (26, 40), (0, 7), (7, 40)]
    parts = [ValueTable(300, b - a, OptimizerConfig(optimizer, 0.01), init_std=0.3, seed=3, backend="numba",
                        col_start=a, total_dim=40) for a, b in cuts]
    for _ in range(4):
        ids = torch.from_numpy(rng.integers(0, 300, 500))
        g = torch.from_numpy(rng.normal(size=(500, 40)).astype(np.float32) * 10.0 ** rng.integers(-4, 2, (500, 1)))
        whole.push_gradients(ids, g)
        for (a, b), t in zip(cuts, parts):
            t.push_gradients(ids, g[:, a:b].contiguous())
    for (a, b), t in zip(cuts, parts):
        assert torch.equal(t.weight, whole.weight[:, a:b]), (a, b)
        if optimizer == "adam":
            assert torch.equal(t.exp_avg_sq, whole.exp_avg_sq[:, a:b]) and torch.equal(t.exp_avg, whole.exp_avg[:, a:b])


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_numba_and_torch_backends_agree(optimizer):
    """The compiled kernels and the torch path (used on GPUs) compute the same update."""
    rng = np.random.default_rng(4)
    tables = {b: ValueTable(500, 48, OptimizerConfig(optimizer, 0.01), init_std=0.1, seed=9, backend=b) for b in ("numba", "torch")}
    flat = torch.from_numpy(rng.integers(0, 500, 300))
    offsets = torch.tensor([0, 10, 10, 150, 299])  # ragged, with an empty bag
    w = torch.from_numpy(rng.random(300).astype(np.float32))
    g = torch.from_numpy(rng.normal(size=(5, 48)).astype(np.float32))
    pushed = torch.from_numpy(rng.normal(size=(300, 48)).astype(np.float32))
    got = {}
    for b, t in tables.items():
        gw = [t.bag_backward(flat, w, offsets, g) for _ in range(3)]
        t.push_gradients(flat, pushed)
        got[b] = (torch.stack(gw), t.weight.clone(), t.updates.clone())
    torch.testing.assert_close(got["numba"][0], got["torch"][0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got["numba"][1], got["torch"][1], rtol=1e-4, atol=1e-5)
    assert torch.equal(got["numba"][2], got["torch"][2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_storage_uses_float32_math(dtype):
    t32 = ValueTable(30, 16, OptimizerConfig("adagrad", 0.01), init_std=1.0, seed=2)
    t16 = ValueTable(30, 16, OptimizerConfig("adagrad", 0.01), init_std=1.0, seed=2, dtype=dtype)
    ids, w = torch.randint(0, 30, (4, 5)), torch.rand(4, 5)
    tol = 3e-2 if dtype == torch.bfloat16 else 3e-3
    np.testing.assert_allclose(t16.bag(ids, w).numpy(), t32.bag(ids, w).numpy(), rtol=tol, atol=tol)
    assert t16.weight.dtype == dtype and t16.bag(ids, w).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_float16_step_past_its_range_is_counted(dtype):
    """A float16 row stepped past 65504 is stored as inf (as a torch float16 parameter would be):
    each such row update is counted, for status and the metrics. bfloat16 and float32 hold the
    same values finite."""
    t = ValueTable(4, 2, OptimizerConfig("sgd", 1.0), init_std=0.0, dtype=dtype)
    t.push_gradients(torch.tensor([0, 1, 2]), torch.tensor([[-1e5, 0.0], [-10.0, 0.0], [0.0, 7e4]]))
    t.push_gradients(torch.tensor([0, 3]), torch.ones(2, 2))  # row 0 stays inf: counted again
    half = dtype == torch.float16
    assert (int(t.nonfinite_updates) if half else t.nonfinite_updates) == (3 if half else None)  # (others: no counter)
    assert t.nonfinite_count() == (3 if half else None) and t.nonfinite_seen is None  # (a GPU's host copy only)
    assert torch.isinf(t.weight.float()).any(1).tolist() == [half, False, half, False]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.floats(-10, 10, allow_nan=False)), min_size=1, max_size=30))
def test_aggregate_sums_duplicates(pairs):
    ids = torch.tensor([p[0] for p in pairs])
    rows = torch.tensor([[p[1], 2 * p[1]] for p in pairs], dtype=torch.float32)
    uniq, summed = aggregate(ids, rows)
    expect: dict[int, float] = {}
    for i, x in pairs:
        expect[i] = expect.get(i, 0.0) + x
    assert uniq.tolist() == sorted(expect)
    np.testing.assert_allclose(summed[:, 0].numpy(), [expect[i] for i in sorted(expect)], rtol=1e-5, atol=1e-4)


def test_optimizer_config_rejects_bad_values():
    with pytest.raises(ValueError, match="unknown optimizer"):
        OptimizerConfig("rmsprop")
    with pytest.raises(ValueError, match="lr"):
        OptimizerConfig("sgd", lr=-1)


def test_compiled_init_matches_numpy_reference():
    rows = np.array([0, 5, 17, 99_999], dtype=np.int64)
    fast = init_values(rows, 3, 40, 64, 0.7, seed=12).numpy()
    ref = init_values(rows, 3, 40, 64, 0.7, seed=12, _numpy_init=True).numpy()
    np.testing.assert_allclose(fast, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_read_statistics(backend):
    t = ValueTable(10, 4, OptimizerConfig("sgd", 0.1), backend=backend)
    t.bag(torch.tensor([[1, 2], [2, 2]]), torch.tensor([[0.5, -1.0], [2.0, 0.25]]))
    t.lookup(torch.tensor([1, 9]))
    assert t.hits.tolist() == [0, 2, 3, 0, 0, 0, 0, 0, 0, 1]
    np.testing.assert_allclose(t.weight_mass.numpy()[[1, 2, 9]], [0.5, 3.25, 0.0])


def test_malloc_tuning_stops_page_faults_on_large_messages():
    """With tune_malloc, serialising a 4 MiB two-tensor request again and again reuses heap memory:
    no page faults (untuned glibc faults fresh pages in on every call here, which made it 14x
    slower; docs/benchmarks.md). MEMSERVER_MALLOC_TUNE=0 turns it off."""
    import os
    import subprocess
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("mallopt is glibc's")
    code = """if True:
        import resource, torch
        from memserver.wire import tune_malloc, encode
        from memserver.api.v1 import memserver_pb2 as pb
        tuned = tune_malloc()
        req = pb.BagRequest(table="t", ids=encode(torch.zeros(4096, 128, dtype=torch.int32)),
                            weights=encode(torch.zeros(4096, 128)))
        req.SerializeToString()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(20):
            req.SerializeToString()
        print(tuned, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 20)
    """
    def run(**env):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, **env}).stdout.split()
        return out[0] == "True", float(out[1])

    tuned, faults = run()
    assert tuned and faults <= 2, faults
    assert run(MEMSERVER_MALLOC_TUNE="0")[0] is False


# ------------------------------------------------------------- writes cost O(entries), not O(rows)


def test_group_by_row_is_sized_by_entries_and_stable():
    """The grouping the numba kernel uses is given only the ids (never the table's row count),
    returns arrays sized by the n entries, and is a stable sort: a row's entries keep their order."""
    import inspect

    from memserver.core import kernels

    assert list(inspect.signature(kernels.group_by_row.py_func).parameters) == ["ids"]
    rng = np.random.default_rng(11)
    cases = [
        np.zeros(0, np.int64),
        np.array([7], np.int64),
        np.full(50, 2**40 + 3, np.int64),  # one row, many entries
        rng.integers(0, 30, 1000),  # dense: one counting pass over the span
        rng.integers(0, 2**62, 300),  # sparse: radix passes
        np.concatenate([rng.integers(2**38 - 40, 2**38, 200), rng.integers(0, 40, 200)])[rng.permutation(400)],
        rng.integers(0, 2**24, 5000).astype(np.int32),
    ]
    for ids in cases:
        slot, starts, rows = kernels.group_by_row(ids)
        n = len(ids)
        assert len(slot) == n and len(rows) <= n and len(starts) == len(rows) + 1
        order = np.empty(n, np.int64)
        order[slot] = np.arange(n)  # slot is a permutation ...
        np.testing.assert_array_equal(order, np.argsort(ids, kind="stable"))  # ... of the stable sort
        np.testing.assert_array_equal(rows, np.unique(ids))
        np.testing.assert_array_equal(np.diff(starts), np.unique(ids, return_counts=True)[1])
        assert starts[0] == 0 and starts[-1] == n


def _huge_table(num_rows: int, dim: int, optimizer: str, backend: str) -> ValueTable:
    """A table of `num_rows` rows (far more than fit in memory) whose state lives in anonymous
    MAP_NORESERVE mappings: only the pages of rows a call touches ever exist. A call that does
    any work or allocation per table row cannot finish (numba cannot allocate 8 bytes x rows)."""
    import mmap

    def zeros(shape: tuple[int, ...], dtype: type) -> torch.Tensor:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)
        try:
            mm = mmap.mmap(-1, nbytes, flags=flags)
        except (OSError, ValueError, OverflowError) as exc:
            pytest.skip(f"cannot reserve {nbytes} bytes of address space: {exc}")
        return torch.from_numpy(np.frombuffer(mm, dtype=dtype).reshape(shape))

    t = ValueTable(1, dim, OptimizerConfig(optimizer, 0.05), backend=backend)
    t.num_rows = num_rows
    for name in t.STATE:
        if hasattr(t, name):
            old = getattr(t, name)
            setattr(t, name, zeros((num_rows, *old.shape[1:]), old.numpy().dtype.type))
    return t


HUGE_ROWS = 2**38  # 2 TiB of int64 counters for a per-row counting sort; 256 GiB of address space here


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_writes_on_a_huge_table_match_reference(optimizer, backend):
    """push_gradients and bag_backward on a 2^38-row table, with duplicate ids in arbitrary order
    and ids at both ends of the table, give the reference's numbers; they could not run if any
    step allocated or scanned per table row."""
    rng = np.random.default_rng(7)
    d = 4
    t = _huge_table(HUGE_ROWS, d, optimizer, backend)
    touched = np.unique(np.concatenate([[0, 1, HUGE_ROWS - 1, HUGE_ROWS - 2, HUGE_ROWS // 2],
                                        rng.integers(0, HUGE_ROWS, 11), rng.integers(HUGE_ROWS - 64, HUGE_ROWS, 4)]))
    init = rng.normal(size=(len(touched), d)).astype(np.float32)
    assert t.write_rows(torch.from_numpy(touched), torch.from_numpy(init)) == len(touched)
    ref = RefTable(init, optimizer, 0.05)
    local = {int(r): i for i, r in enumerate(touched)}  # huge row -> the reference's row
    for step in range(3):
        # a push: every touched row 1-4 times, shuffled (duplicates interleaved with other rows)
        ids = rng.permutation(np.repeat(touched, rng.integers(1, 5, len(touched))))
        grads = rng.normal(size=(len(ids), d)).astype(np.float32)
        assert t.push_gradients(torch.from_numpy(ids), torch.from_numpy(grads)) == len(touched)
        ref.push(np.array([local[int(r)] for r in ids]), grads)
        # a bag backward over a few rows, with duplicates within and across bags
        bag_ids = rng.choice(touched[: 6 + step], (3, 5))
        w = rng.random((3, 5)).astype(np.float32)
        g = rng.normal(size=(3, d)).astype(np.float32)
        got = t.bag_backward(torch.from_numpy(bag_ids), torch.from_numpy(w), None, torch.from_numpy(g))
        expect = ref.bag_backward(np.vectorize(local.get)(bag_ids), w, g)
        np.testing.assert_allclose(got.numpy(), expect, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(t.weight[touched].numpy(), ref.w, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(t.updates[touched].numpy(), ref.steps)


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_entries_of_a_row_are_summed_in_the_order_given(optimizer, backend):
    """Row 5 gets 1, 1e8, -1e8 (interleaved with other rows): in float32, in this order, the sum
    is exactly 0 and the row does not move; any other order (or a lost entry) moves it."""
    t = ValueTable(1 << 12, 4, OptimizerConfig(optimizer, 0.5), init_std=1.0, backend=backend)
    before = t.weight[5].clone()
    ids = torch.tensor([4000, 5, 9, 5, 4000, 5, 1])
    scale = torch.tensor([1.0, 1.0, 2.0, 1e8, 1.0, -1e8, 3.0])
    src = torch.ones(1, 4)
    assert t.apply_entries(ids, torch.zeros(7, dtype=torch.int64), scale, src) == 4
    assert torch.equal(t.weight[5], before)
    assert t.updates.sum() == 4 and t.updates[5] == 1 and t.updates[4000] == 1


# ------------------------------------------------------------- inputs reach the table's device


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_inputs_of_any_dtype_and_layout_are_accepted(backend):
    """int32 ids and offsets, float64 weights and gradients, non-contiguous views and numpy
    arrays give the same numbers as canonical int64 / float32 tensors, on the table's device.
    (Only the CPU exists here: CUDA tables go through the same `on_device`, untested.)"""
    rng = np.random.default_rng(3)
    tables = [ValueTable(100, 8, OptimizerConfig("adam", 0.01), init_std=1.0, seed=4, backend=backend) for _ in range(2)]
    ids = rng.integers(0, 100, 40)
    w = rng.random(40)
    offsets = np.array([0, 10, 10, 25])
    g = rng.normal(size=(4, 8))
    rows = rng.normal(size=(3, 8))
    canon = dict(ids=torch.from_numpy(ids), w=torch.from_numpy(w).float(), offsets=torch.from_numpy(offsets),
                 g=torch.from_numpy(g).float(), push=torch.from_numpy(ids[:6]), rows=torch.from_numpy(rows).float())

    def strided(a: np.ndarray) -> torch.Tensor:  # a non-contiguous view with a's values
        x = torch.from_numpy(np.repeat(a[..., None], 2, axis=-1))[..., 0]
        assert not x.is_contiguous()
        return x

    # int32 ids (as on the wire) with int64 offsets, float64 everywhere, numpy ids and rows
    odd = dict(ids=strided(ids.astype(np.int32)), w=strided(w), offsets=torch.from_numpy(offsets), g=strided(g),
               push=ids[:6].astype(np.int32), rows=rows)
    out = []
    for t, x in zip(tables, (canon, odd)):
        assert t.write_rows(x["push"][:3], x["rows"]) == 3
        res = [t.lookup(x["ids"]), t.bag(x["ids"], x["w"], x["offsets"]),
               t.bag_backward(x["ids"], x["w"], x["offsets"], x["g"]),
               t.bag(x["ids"].reshape(4, 10), x["w"].reshape(4, 10))]
        assert t.push_gradients(x["push"], x["g"][:1].expand(6, 8)) == len(np.unique(ids[:6]))
        stats = t.slot_stats(x["push"])
        res += [t.weight.clone(), *stats.values()]
        for r in res:
            assert r.device == t.device
        assert res[0].dtype == res[1].dtype == res[2].dtype == torch.float32
        out.append(res)
    for a, b in zip(*out):
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------- threads


def test_set_threads_applies_to_the_calling_thread():
    """numba's thread count is per thread: set_threads in a worker thread (the shard's compute
    thread) changes that thread's count, clamped to NUMBA_NUM_THREADS, and not the caller's."""
    import threading

    import numba

    from memserver.core.table import set_threads

    main_numba, main_torch = numba.get_num_threads(), torch.get_num_threads()
    seen: dict[str, int] = {}

    def worker() -> None:
        seen["before"] = numba.get_num_threads()
        set_threads(1)
        seen["one"] = numba.get_num_threads()
        seen["torch"] = torch.get_num_threads()
        set_threads(10_000)
        seen["clamped"] = numba.get_num_threads()
        set_threads(1)

    th = threading.Thread(target=worker)
    th.start()
    th.join()
    try:
        assert seen["one"] == 1 and seen["torch"] == 1
        assert seen["clamped"] == numba.config.NUMBA_NUM_THREADS
        assert numba.get_num_threads() == main_numba
    finally:
        torch.set_num_threads(main_torch)  # torch's setting may be process-wide: restore it
