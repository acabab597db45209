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
