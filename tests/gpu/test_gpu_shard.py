"""A shard's data on a GPU (issue 29), each answer checked against the CPU path of the same call.

Without Ray and faiss (a machine with a CUDA build of torch, numpy, numba, grpcio, protobuf,
prometheus_client, pyyaml): the ValueTable tests and the in-process server tests run; the faiss
and Ray tests skip with the reason (pytest.importorskip)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memserver.core.optim import OPTIMIZERS, OptimizerConfig
from memserver.core.table import ValueTable
from tests.test_inprocess import check_serving, close, serve_like_a_table

CUDA = torch.device("cuda", 0)
ROWS, DIM = 1000, 32


def _tol(dtype: torch.dtype) -> dict[str, float]:
    # bfloat16 rows: each step rounds to 8 bits of mantissa, on both devices but in another order
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def _pair(opt: str, dtype: torch.dtype) -> tuple[ValueTable, ValueTable]:
    """The same table (same seed, same values) on the CPU (torch path, as CUDA runs) and on CUDA."""
    cfg = OptimizerConfig(opt, lr=0.05)
    return tuple(ValueTable(ROWS, DIM, cfg, dtype=dtype, device=d, seed=7, backend="torch") for d in ("cpu", CUDA))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_value_table_on_cuda_computes_what_the_cpu_does(opt, dtype):
    """bag (fixed-size and with offsets), lookup, bag_backward + every optimizer's step (duplicate
    ids within a batch included), push_gradients, write_rows and the read counters: CUDA against
    the CPU, the results on the table's device, the state back on the CPU as a checkpoint takes it."""
    cpu, gpu = _pair(opt, dtype)
    assert gpu.weight.device == CUDA and all(t.device == CUDA for t in gpu.state().values())
    torch.testing.assert_close(gpu.weight.cpu(), cpu.weight)
    rng = np.random.default_rng(0)
    tol = _tol(dtype)
    for _ in range(3):
        ids = torch.from_numpy(rng.integers(0, ROWS // 4, size=(64, 8)))  # a quarter of the rows: duplicates
        w = torch.from_numpy(rng.random((64, 8), dtype=np.float32))
        g = torch.from_numpy(rng.normal(size=(64, DIM)).astype(np.float32))
        out = gpu.bag(ids.to(CUDA), w.to(CUDA))
        assert out.device == CUDA and out.dtype == torch.float32
        torch.testing.assert_close(out.cpu(), cpu.bag(ids, w), **tol)
        flat, offsets = ids.reshape(-1)[:300], torch.tensor([0, 7, 7, 100, 299])  # an empty bag among them
        torch.testing.assert_close(gpu.bag(flat, w.reshape(-1)[:300], offsets).cpu(),
                                   cpu.bag(flat, w.reshape(-1)[:300], offsets), **tol)
        grad_w = gpu.bag_backward(ids, w, None, g)  # CPU inputs: the table moves them to its device
        assert grad_w.device == CUDA
        torch.testing.assert_close(grad_w.cpu(), cpu.bag_backward(ids, w, None, g), **tol)
        rows = torch.from_numpy(rng.choice(ROWS, 20, replace=False))
        grads = torch.from_numpy(rng.normal(size=(20, DIM)).astype(np.float32))
        assert gpu.push_gradients(rows, grads) == cpu.push_gradients(rows, grads) == 20
        torch.testing.assert_close(gpu.lookup(torch.arange(ROWS)).cpu(), cpu.lookup(torch.arange(ROWS)), **tol)
    new = torch.randn(5, DIM)
    gpu.write_rows(torch.arange(5), new)
    cpu.write_rows(torch.arange(5), new)
    torch.testing.assert_close(gpu.lookup(torch.arange(5)).cpu(), cpu.lookup(torch.arange(5)))
    for name, t in cpu.state().items():
        if name == "last_update":  # wall-clock times of the two tables' steps
            assert torch.equal(gpu.state()[name].cpu() > 0, t > 0)
        elif name in ("hits", "updates"):
            assert torch.equal(gpu.state()[name].cpu(), t), name
        else:
            torch.testing.assert_close(gpu.state()[name].cpu(), t, **tol, msg=name)


def test_a_float16_step_past_its_range_is_counted_on_cuda_and_in_a_gpu_shards_status(tmp_path):
    """The count stays on the device (no wait per step) and a GPU shard's status reads its pinned
    host copy (no wait for the device either): what the CPU counts (tests/test_table.py,
    tests/test_errors.py)."""
    from client import MemoryClient
    from memserver.api.v1 import memserver_pb2 as pb
    from memserver.cluster.inprocess import InProcessServer

    t = ValueTable(4, 2, OptimizerConfig("sgd", 1.0), init_std=0.0, dtype=torch.float16, device=CUDA)
    t.push_gradients(torch.tensor([0, 1, 2]), torch.tensor([[-1e5, 0.0], [-10.0, 0.0], [0.0, 7e4]]))
    t.push_gradients(torch.tensor([0, 3]), torch.ones(2, 2))
    assert t.nonfinite_updates.device == CUDA and int(t.nonfinite_updates) == 3
    torch.cuda.synchronize()  # (the host copy is the count of a step the device finished)
    assert t.nonfinite_seen.is_pinned() and t.nonfinite_count() == 3
    with InProcessServer(1, ["cuda:0"], data_dir=str(tmp_path / "data")) as server, \
            MemoryClient(server.endpoint, timeout=60) as c:
        c.create_table("h", 4, 2, optimizer="sgd", lr=1.0, init_std=0.0, dtype="float16")
        c.push_gradients("h", [0], [[-1e5, 0.0]])
        torch.cuda.synchronize()
        (load,) = pb.ShardStatus.FromString(server.shards[0].status()).tables
        assert load.nonfinite_updates == 1


def test_numba_cpu_and_cuda_agree():
    """The CPU's compiled kernels (float32's default there) and CUDA's torch path: the same step."""
    cfg = OptimizerConfig("adam", lr=0.05)
    cpu = ValueTable(ROWS, DIM, cfg, seed=7)
    gpu = ValueTable(ROWS, DIM, cfg, seed=7, device=CUDA)
    assert cpu.backend == "numba" and gpu.backend == "torch"
    ids = torch.randint(0, 50, (128, 4))
    w, g = torch.rand(128, 4), torch.randn(128, DIM)
    torch.testing.assert_close(gpu.bag_backward(ids, w, None, g).cpu(), cpu.bag_backward(ids, w, None, g), rtol=1e-5,
                               atol=1e-5)
    torch.testing.assert_close(gpu.weight.cpu(), cpu.weight, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_shard_serves_bags_and_updates(tmp_path, dtype):
    """A shard on the GPU, started in this process (no Ray): bags over TCP and through shared memory
    (the answer copied from the device straight into the caller's block), bag_backward and adagrad
    steps like a CPU table; its checkpoint restores onto a CPU shard; status says cuda:0."""
    status = serve_like_a_table(["cuda:0"], tmp_path, dtype)
    assert [s.device for s in status.shards] == ["cuda:0"]


def test_mixed_cluster_of_gpu_and_cpu_shards(tmp_path):
    """One table over a GPU shard and a CPU shard answers like one table; restorable on the CPU."""
    status = serve_like_a_table(["cuda:0", "cpu"], tmp_path)
    assert [s.device for s in status.shards] == ["cuda:0", "cpu"]


def test_a_gpu_shards_memory_is_its_gpu():
    """What the coordinator sums a table's slices over (rayutil.memory_domain): a GPU shard's is its
    GPU, named by the GPU's UUID (the same GPU for two devices only if they are one), a CPU
    shard's its node."""
    from memserver.server.rayutil import memory_domain, node_id

    gpu = memory_domain(torch.device("cuda:0"))
    assert gpu == f"{node_id()}/gpu-{torch.cuda.get_device_properties(0).uuid}" and gpu == memory_domain(torch.device("cuda", 0))
    assert memory_domain(torch.device("cpu")) == node_id() != gpu


def test_shared_memory_answer_is_written_from_the_device():
    """memserver.wire.shm_write: a CUDA tensor lands in the region byte for byte as the CPU copy
    would (float32 and bfloat16, at an aligned offset), and the message says where."""
    import mmap

    from memserver.api.v1 import memserver_pb2 as pb
    from memserver.wire import shm_write, tensor_bytes, wire_tensor

    mm = mmap.mmap(-1, 1 << 16)
    for dtype in (torch.float32, torch.bfloat16):
        t = torch.randn(40, 16, device=CUDA).to(dtype)
        msg = pb.BagResponse()
        shm_write(mm, msg, {"out": wire_tensor(t, keep_device=True)}, [4096])
        want = bytes(tensor_bytes(t.cpu()))
        assert msg.out.shm.offset == 4096 and msg.out.shm.nbytes == len(want) and list(msg.out.shape) == [40, 16]
        assert mm[4096 : 4096 + len(want)] == want
    mm.close()  # no view of the region outlives the copy


def _faiss_gpu():
    faiss = pytest.importorskip("faiss", reason="faiss is not installed: the faiss-gpu tests need it")
    if not hasattr(faiss, "index_cpu_to_gpu") or faiss.get_num_gpus() == 0:
        pytest.skip("this faiss has no GPU support (faiss-cpu): the faiss-gpu tests need faiss-gpu")
    return faiss


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_faiss_gpu_flat_equals_the_cpu_flat(metric):
    """A Flat index slice on the shard's GPU finds what the CPU Flat finds (dead entries and upserts
    included), and its state, taken on the CPU, restores onto the CPU with the same answers."""
    _faiss_gpu()
    from memserver.core.index import VectorIndex

    rng = np.random.default_rng(3)
    x = rng.normal(size=(3000, 24)).astype(np.float32)
    ids = np.arange(3000) * 3
    pair = {d: VectorIndex(24, "Flat", metric, payload_dim=2, device=d) for d in ("cpu", "cuda:0")}
    assert pair["cuda:0"].device == "cuda:0" and pair["cuda:0"].placement == "faiss GPU 0"
    for vi in pair.values():
        vi.add(ids, x, x[:, :2])
        vi.add(ids[:100], x[:100] + 1, x[:100, :2])
        vi.remove(ids[200:300])
    q = rng.normal(size=(50, 24)).astype(np.float32)
    (s_cpu, i_cpu, p_cpu), (s_gpu, i_gpu, p_gpu) = (pair[d].search(q, 20, with_payload=True) for d in ("cpu", "cuda:0"))
    assert torch.equal(torch.as_tensor(i_gpu), torch.as_tensor(i_cpu))
    close(s_gpu, torch.as_tensor(s_cpu), rtol=1e-4, atol=1e-4)
    close(p_gpu, torch.as_tensor(p_cpu))
    _, i_d, u, rows = pair["cuda:0"].search_distinct(q, 20)  # what a GPU shard's search answer carries
    assert torch.equal(torch.as_tensor(i_d), torch.as_tensor(i_cpu))
    assert u.tolist() == sorted(set(i_d[i_d >= 0].tolist())) and rows.shape == (len(u), 2)
    back = VectorIndex.from_state(24, "Flat", metric, 2, pair["cuda:0"].state(), device="cpu")
    assert back.device == "cpu" and torch.equal(torch.as_tensor(back.search(q, 20)[1]), torch.as_tensor(i_cpu))


def test_index_table_on_a_gpu_shard_says_so(tmp_path, caplog):
    """An index table on a GPU shard: Flat goes to faiss's GPU, HNSW stays on the CPU (no GPU
    version); status and the log say which."""
    _faiss_gpu()
    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    x = np.random.default_rng(4).normal(size=(500, 8)).astype(np.float32)
    with InProcessServer(1, ["cuda:0"]) as server, MemoryClient(server.endpoint, timeout=60) as c:
        with caplog.at_level("INFO", logger="memserver.server.shard_actor"):
            c.create_index("flat", 8, index_factory="Flat", metric="l2")
            c.create_index("hnsw", 8, index_factory="HNSW8", metric="l2")
        for name in ("flat", "hnsw"):
            c.add(name, np.arange(500), x)
        assert c.search("flat", x[:10], 1)[1].reshape(-1).tolist() == list(range(10))
        devices = {t.table: t.index_device for t in c.status().shards[0].tables}
    assert devices == {"flat": "cuda:0", "hnsw": "cpu"}
    assert "index flat on shard 0: faiss GPU 0" in caplog.text
    assert "index hnsw on shard 0: CPU: factory 'HNSW8' (IndexHNSWFlat) has no GPU version in faiss" in caplog.text


def test_index_table_on_a_gpu_shard_with_faiss_cpu_stays_on_the_cpu(caplog):
    """faiss-cpu on a GPU node (what `make gpu-wheels` carries to a lent GPU machine): a shard on
    cuda:0 keeps its value tables there and its index tables on the CPU, says why in status and
    the log, and the index answers as on a CPU shard."""
    faiss = pytest.importorskip("faiss", reason="faiss is not installed")
    if hasattr(faiss, "index_cpu_to_gpu") and faiss.get_num_gpus() > 0:
        pytest.skip("this faiss has GPU support: test_index_table_on_a_gpu_shard_says_so covers it")
    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    x = np.random.default_rng(5).normal(size=(500, 8)).astype(np.float32)
    with InProcessServer(1, ["cuda:0"]) as server, MemoryClient(server.endpoint, timeout=60) as c:
        with caplog.at_level("INFO", logger="memserver.server.shard_actor"):
            c.create_index("flat", 8, index_factory="Flat", metric="l2")
        c.create_table("values", num_rows=64, dim=8)
        c.add("flat", np.arange(500) * 2, x)
        assert (c.search("flat", x[:10], 1)[1].reshape(-1) // 2).tolist() == list(range(10))
        shard = c.status().shards[0]
        assert c.bag("values", np.array([[1, 2]]), np.ones((1, 2), np.float32)).shape == (1, 8)
    assert shard.device == "cuda:0" and {t.table: t.index_device for t in shard.tables}["flat"] == "cpu"
    assert "index flat on shard 0: CPU: this faiss has no GPU support (faiss-cpu) or sees no GPU" in caplog.text


def test_ray_shard_with_a_gpu(tmp_path):
    """`memserver up --shards 3 --shard-gpus 0.5,0.5,0`: Ray gives two shard actors the GPU, they
    keep their slices there (status: cuda:0, 1 GPU id), the third stays on the CPU, and the mixed
    table serves like a CPU table."""
    ray = pytest.importorskip("ray", reason="Ray is not installed: the Ray-actor GPU test needs it")
    from memserver.cluster.launch import start_cluster

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, namespace="memserver-gpu-tests", log_to_driver=False,
                 object_store_memory=200 * 2**20)  # (the shards pass no objects through it)
    if ray.cluster_resources().get("GPU", 0) < 1:
        pytest.skip("the Ray cluster of this session has no GPU")
    # (check_serving checkpoints below tmp_path: the cluster's checkpoint root)
    cluster = start_cluster(3, shard_cpus=0.25, shard_gpus=[0.5, 0.5, 0], name="memserver-gpu", checkpoint_root=tmp_path)
    try:  # a mixed cluster: two shards share the GPU, the third is on the CPU
        status = check_serving(cluster.endpoint, 3, tmp_path)
        assert [(s.device, s.gpus) for s in status.shards] == [("cuda:0", 1.0)] * 2 + [("cpu", 0.0)]
    finally:
        cluster.shutdown()
        if started:
            ray.shutdown()


def _open_step_recovered(device: str) -> torch.Tensor:
    """A slice gathers part 1 of step 1, is checkpointed (its extras saved, loaded back on the
    CPU as a restarted shard reads them), a new slice on the same device loads them, gathers part 2
    sent after the restart and commits the step; returns its values."""
    import io

    from memserver.api.v1 import memserver_pb2 as pb
    from memserver.core.steps import bag_entries
    from memserver.server.catalog import plan_table, validate_spec
    from memserver.server.slice import TableSlice

    spec = validate_spec(pb.TableSpec(name="s", num_rows=64, dim=8, optimizer=pb.OptimizerSpec(name="adagrad", lr=0.05),
                                      sharding=pb.ROWS, seed=3), 1)
    info = plan_table(spec, [{"address": "x", "node_id": "n", "pid": 1}]).shards[0]
    before, after = (TableSlice(spec, info, 1, torch.device(device)) for _ in range(2))
    rng = np.random.default_rng(5)
    ids = torch.from_numpy(rng.integers(0, 64, (8, 4))).to(device)
    w = torch.from_numpy(rng.random((8, 4), dtype=np.float32)).to(device)
    g = torch.from_numpy(rng.normal(size=(8, 8)).astype(np.float32)).to(device)
    before.gather(1, "c", 1, bag_entries(ids[:4], w[:4], None, g[:4]))  # as the dataplane keeps a part
    saved = io.BytesIO()
    torch.save(before.extras(), saved)
    saved.seek(0)
    after.load_extras(torch.load(saved, map_location="cpu", weights_only=False))
    after.gather(1, "c", 2, bag_entries(ids[4:], w[4:], None, g[4:]))
    after.step_phase(pb.STEP_PREPARE_COMMIT, 1, "c", [1, 2])()()  # prepared and committed: the update applied
    return after.table.weight.cpu()


def test_an_open_step_recovered_on_a_gpu_shard_commits_with_parts_sent_after():
    """A shard restarted from its checkpoint reloads the parts of a step not yet committed, read
    on the CPU; a GPU slice moves them back to its device, so its commit concatenates them with a
    part sent after the restart (mixed devices failed there) and applies what the CPU slice does."""
    torch.testing.assert_close(_open_step_recovered("cuda:0"), _open_step_recovered("cpu"), rtol=1e-5, atol=1e-6)
