"""The trainer on CUDA against the trainer on the CPU (issue 29): a memory layer with LocalValues,
memtrain's losses, bf16 autocast, RemoteValues' pinned and non-blocking transfers and their
overlap with the GPU's work, checkpoints across devices. Every tensor of a run lives on one
device; TF32 is off while comparing, so float32 is float32 on both sides.

Neither Ray nor faiss is needed (the local KIF run imports faiss or skips): the remote transfer
path is checked against `TableClient`, an in-process stand-in for the client's calls over a CPU
ValueTable, and memtrain's remote runs against GPU shards of `memserver.cluster.inprocess`."""

from __future__ import annotations

import copy
import math
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from memserver.core.optim import OptimizerConfig
from memserver.core.steps import bag_entries, combine
from memserver.core.table import ValueTable
from tests.ddp import run_trainers
from trainer.memory import EngramMemory, LocalValues, LSHMemory, ProductKeyMemory, RemoteValues
from trainer.memory.backends import DeviceFuture
from trainer.train import build_parser, train

TINY = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "32", "--batch-size", "4",
        "--n-keys", "16", "--heads", "2", "--knn", "4", "--k-dim", "16", "--mem-layers", "1",
        "--eval-every", "5", "--eval-iters", "2", "--log-every", "1", "--threads", "1", "--memory", "local"]
ENGRAM = ["--engram-slots", "4096"]


@pytest.fixture
def exact_cuda():
    """float32 matmuls and convolutions in float32 (no TF32) while a test compares with the CPU."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def losses(argv: list[str], client=None) -> list[tuple[float, float | None]]:
    return [(r["loss"], r.get("val_loss")) for r in train(build_parser().parse_args(argv), client=client)]


def assert_same_losses(a: list, b: list, rel: float = 1e-3) -> None:
    assert len(a) == len(b)
    for (la, va), (lb, vb) in zip(a, b):
        assert lb == pytest.approx(la, rel=rel)
        assert (va is None) == (vb is None) and (va is None or vb == pytest.approx(va, rel=rel))


# -- one memory layer ---------------------------------------------------------------------------

ROWS = {"pkm": 16 * 16, "lsh": 4 * 64, "engram": 2 * 2 * 64}
DIM = {"pkm": 32, "lsh": 32, "engram": 8}


def make_layer(kind: str, values) -> torch.nn.Module:
    if kind == "pkm":
        return ProductKeyMemory(32, 32, values, n_keys=16, heads=2, k_dim=16, knn=4, micro_batches=2)
    if kind == "lsh":
        return LSHMemory(32, 32, values, hashes=4, bits=6)
    return EngramMemory(32, 32, values, orders=(2, 3), heads=2)


def one_step(layer: torch.nn.Module, x: torch.Tensor, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """A training step of the layer alone; what it read, wrote and computed, on the CPU."""
    layer.values.begin_step(1)
    out = layer(x, tokens)
    # a sum, not a mean: Adam's first step moves a value by lr * g / (|g| + eps), so where a
    # gradient is within ~1e-6 of zero (dozens of pkm's values under a mean's 1e-4-sized gradients)
    # it turns CUDA's atomic summation order (1e-7 relative) into differences above float32's
    # tolerance; the sum's gradients are O(1) and none is that close to zero
    (out**2).sum().backward()
    layer.values.end_step(1)
    got = {"out": out, "ids": layer.last_access[0], "weights": layer.last_access[1]}
    if isinstance(layer.values, LocalValues):
        got["table"] = layer.values.table.weight
    got.update({f"grad.{n}": p.grad for n, p in layer.named_parameters() if p.grad is not None})
    return {k: v.detach().cpu() for k, v in got.items()}


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("kind", ["pkm", "lsh", "engram"])
def test_memory_layer_with_local_values_on_cuda_equals_cpu(exact_cuda, kind, optimizer):
    """The layer moved to CUDA takes its LocalValues' table along; forward, dense gradients and the
    values' update equal the CPU's (float32 tolerance), the addressing exactly. SGD beside Adam:
    Adam's first step is about lr * sign(g), blind to a wrongly scaled value gradient; SGD's is not."""
    torch.manual_seed(0)
    cpu = make_layer(kind, LocalValues(ROWS[kind], DIM[kind], optimizer=optimizer, lr=0.05, seed=1))
    gpu = copy.deepcopy(cpu).to("cuda")
    assert gpu.values is not cpu.values
    assert {t.device.type for t in gpu.values.table.state().values()} == {"cuda"}
    assert gpu.values.table.backend == "torch" and cpu.values.table.device.type == "cpu"
    x, tokens = torch.randn(4, 16, 32), torch.randint(0, 50, (4, 16))
    want = one_step(cpu, x, tokens)
    got = one_step(gpu, x.cuda(), tokens.cuda())
    assert set(got) == set(want)
    assert torch.equal(got["ids"], want["ids"])
    for key in want:
        assert torch.allclose(got[key], want[key], rtol=1e-4, atol=1e-5), key


def test_local_values_made_on_cuda_answer_on_the_ids_device():
    """LocalValues(device=cuda) holds its table there; a CPU caller still gets CPU answers."""
    values = LocalValues(64, 8, seed=3, device="cuda")
    ref = LocalValues(64, 8, seed=3)
    ids, w = torch.randint(0, 64, (10, 4)), torch.rand(10, 4)
    assert values.table.weight.is_cuda and values.table.device == torch.device("cuda", torch.cuda.current_device())
    assert torch.allclose(values.bag(ids.cuda(), w.cuda()).cpu(), ref.bag(ids, w), atol=1e-6)
    on_cpu = values.bag(ids, w)
    assert on_cpu.device.type == "cpu" and torch.allclose(on_cpu, ref.bag(ids, w), atol=1e-6)


# -- memtrain -----------------------------------------------------------------------------------

@pytest.mark.parametrize("extra", [[], ["--memory-kind", "pkm,lsh,engram", "--lsh-bits", "6", *ENGRAM,
                                        "--micro-batches", "2"],
                                   ["--memory-kind", "engram", *ENGRAM, "--staleness", "1"],
                                   ["--memory-kind", "kif", "--kif-encoder", "hash", "--kif-sentences", "64"]],
                         ids=["pkm", "pkm+lsh+engram-micro-batches", "engram-stale", "kif"])
def test_memtrain_on_cuda_gives_the_cpu_losses(exact_cuda, extra):
    if "kif" in extra:
        pytest.importorskip("faiss", reason="the local KIF source is a faiss index")
    common = [*TINY, "--steps", "5", "--seed", "3", "--value-lr", "0.05", *extra]
    assert_same_losses(losses([*common, "--device", "cpu"]), losses([*common, "--device", "cuda"]))


def test_bf16_autocast_on_cuda_trains():
    common = [*TINY, "--steps", "12", "--seed", "1", "--lr", "3e-3", "--value-lr", "0.05", "--eval-every", "12",
              "--memory-kind", "pkm,engram", *ENGRAM, "--device", "cuda"]
    fp32 = losses(common)
    bf16 = losses([*common, "--dtype", "bf16"])
    assert all(math.isfinite(loss) for loss, _ in bf16) and bf16 != fp32
    assert bf16[-1][0] < bf16[0][0] - 0.1
    assert bf16[-1][1] == pytest.approx(fp32[-1][1], rel=0.05)


def test_a_checkpoint_resumes_across_devices(exact_cuda, tmp_path):
    """Saved on CUDA, resumed on the CPU, and back, and on CUDA again (its CUDA rng state set back):
    the losses of one uninterrupted CPU run; the file holds CPU tensors only, so it loads without
    map_location on a machine without CUDA."""
    from trainer.checkpoints import latest_trainer_file

    common = [*TINY, "--seed", "2", "--value-lr", "0.05", "--memory-kind", "pkm,engram", *ENGRAM]
    full = losses([*common, "--steps", "6", "--device", "cpu"])
    for first, then in (("cuda", "cpu"), ("cpu", "cuda"), ("cuda", "cuda")):
        ck = str(tmp_path / f"{first}-then-{then}")
        a = losses([*common, "--steps", "3", "--checkpoint-dir", ck, "--device", first])
        b = losses([*common, "--steps", "6", "--resume", ck, "--device", then])
        assert [loss for loss, _ in a + b] == pytest.approx([loss for loss, _ in full], rel=1e-3)
        assert b[-1][1] == pytest.approx(full[-1][1], rel=1e-3)
        blob = torch.load(latest_trainer_file(ck), weights_only=False)
        devices: set[str] = set()

        def walk(obj, devices=devices):
            if isinstance(obj, torch.Tensor):
                devices.add(obj.device.type)
            elif isinstance(obj, dict):
                for v in obj.values():
                    walk(v)
            elif isinstance(obj, (list, tuple)):
                for v in obj:
                    walk(v)

        walk(blob)
        assert devices == {"cpu"}


# -- remote values: the transfer path, Ray-free ---------------------------------------------------

class TableClient:
    """The client calls RemoteValues makes, answered in this process by a CPU ValueTable of the
    seed LocalValues uses (gathered parts, one optimizer step per commit, as a shard). It records
    where each tensor it was handed lives, and answers `submit_bag` from a thread after `delay` s."""

    def __init__(self, rows: int, dim: int, *, delay: float = 0.0) -> None:
        self.values = ValueTable(rows, dim, OptimizerConfig("adam", 0.05), init_std=dim**-0.5, seed=1, track_stats=False)
        self.delay, self.parts, self.handed, self.ids_dtypes = delay, [], [], set()
        self.pool = ThreadPoolExecutor(1)

    def table(self, name: str, refresh: bool = False) -> SimpleNamespace:
        """What RemoteValues(create=False) checks its shape and incarnation against (client.table's
        answer; one incarnation, never made anew). tests/test_trainer_device.py runs a step over this
        stand-in on the CPU, so `make test` sees it fall behind what RemoteValues asks."""
        return SimpleNamespace(num_rows=self.values.num_rows, dim=self.values.dim, kind="value", a_kind="a value table",
                               optimizer="adam", lr=0.05, layout_id=1)

    def rebuilds(self, table: str) -> tuple[int, str]:
        """No slice here is ever rebuilt (RemoteValues looks after each commit and checkpoint)."""
        return 0, ""

    def _hand(self, ids: torch.Tensor, *tensors: torch.Tensor) -> None:
        self.handed += [(t.device.type, t.is_pinned()) for t in (ids, *tensors)]
        self.ids_dtypes.add(ids.dtype)

    def bag(self, table, ids, weights, *, count=True):
        self._hand(ids, weights)
        return self.values.bag(ids, weights)

    def submit_bag(self, table, ids, weights, *, count=True):
        self._hand(ids, weights)
        return self.pool.submit(lambda: (time.sleep(self.delay), self.values.bag(ids, weights))[1])

    def bag_backward(self, table, ids, weights, grad_out, *, defer_apply=False, step=0, gather=False, layout=0):
        self._hand(ids, weights, grad_out)
        if not gather:
            return self.values.bag_backward(ids, weights, None, grad_out)
        grad_w, _ = self.values.bag_grad(ids, weights, None, grad_out)
        self.parts.append(bag_entries(ids, weights, None, grad_out, copy=True))
        return grad_w

    def submit_bag_backward(self, table, ids, weights, grad_out, *, step, gather=True, layout=0):
        return self.pool.submit(self.bag_backward, table, ids, weights, grad_out, step=step, gather=gather)

    def commit_step(self, table, step, *, defer_apply=False, drop=False, layout=0):
        parts, self.parts = self.parts, []
        if parts and not drop:
            self.values.apply_entries(*combine(parts))

    def submit_commit_step(self, table, step, *, defer_apply=False, drop=False, layout=0):
        """end_step(wait=False)'s commit (after the parts sent before it: one thread)."""
        return self.pool.submit(self.commit_step, table, step, defer_apply=defer_apply, drop=drop)

    def abandon_step(self, table, step) -> int:
        """A step begun again, or one whose backward overflowed: its parts are dropped."""
        parts, self.parts = self.parts, []
        return len(parts)


def test_remote_values_on_cuda_send_pinned_host_tensors_and_answer_on_the_device(exact_cuda):
    """A layer on CUDA over RemoteValues: the client is handed pinned host copies of ids, weights
    and gradients, the answers come back as CUDA tensors (micro-batches: through a DeviceFuture),
    and the step equals the same layer over LocalValues on CUDA."""
    torch.manual_seed(0)
    client = TableClient(ROWS["pkm"], DIM["pkm"])
    local = make_layer("pkm", LocalValues(ROWS["pkm"], DIM["pkm"], optimizer="adam", lr=0.05, seed=1)).to("cuda")
    remote = copy.deepcopy(local)
    remote.values = RemoteValues(client, "t", ROWS["pkm"], DIM["pkm"], optimizer="adam", lr=0.05, create=False)
    x = torch.randn(4, 16, 32, device="cuda")
    sent = remote.values.submit_bag(torch.zeros(2, 4, dtype=torch.int64, device="cuda"), torch.ones(2, 4, device="cuda"))
    assert isinstance(sent, DeviceFuture) and sent.result().is_cuda
    want, got = one_step(local, x, None), one_step(remote, x, None)
    assert client.handed and set(client.handed) == {("cpu", True)}
    assert client.ids_dtypes == {torch.int32}  # narrowed on the GPU: half the bytes cross (RemoteValues._ids)
    for key in ("out", "ids", "weights", "grad.keys", "grad.query.weight"):
        assert torch.allclose(got[key], want[key], rtol=1e-4, atol=1e-5), key
    assert torch.allclose(client.values.weight, want["table"], rtol=1e-4, atol=1e-5)


def test_a_remote_read_overlaps_the_gpus_work():
    """submit_bag returns as soon as the ids are on the host: the GPU computes while the call is
    in flight, so both together take about the longer of the two, not their sum."""
    client = TableClient(4096, 64, delay=0.3)
    values = RemoteValues(client, "t", 4096, 64, optimizer="adam", lr=0.05, create=False)
    ids = torch.randint(0, 4096, (8192, 16), device="cuda")
    w = torch.rand(8192, 16, device="cuda")
    a = torch.randn(4096, 4096, device="cuda") / 64

    def gpu_work(n: int) -> torch.Tensor:
        b = a
        for _ in range(n):
            b = torch.tanh(b @ a)
        return b

    gpu_work(2)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    gpu_work(10)
    torch.cuda.synchronize()
    n = max(10, math.ceil(10 * 0.3 / (time.perf_counter() - t0)))  # about as long as the call
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    gpu_work(n)
    torch.cuda.synchronize()
    t_gpu = time.perf_counter() - t0
    t0 = time.perf_counter()
    pending = values.submit_bag(ids, w)
    gpu_work(n)
    read = pending.result()
    torch.cuda.synchronize()
    both = time.perf_counter() - t0
    assert read.is_cuda and torch.allclose(read.cpu(), client.values.bag(ids.cpu(), w.cpu()), atol=1e-5)
    assert both < 0.8 * (t_gpu + client.delay), (both, t_gpu, client.delay)


# -- with a memory server on the GPU (in this process: no Ray) -----------------------------------

@pytest.fixture(scope="module")
def gpu_server():
    """Two shards on cuda:0 and their coordinator in this process (memserver.cluster.inprocess),
    with a client: remote values served from the GPU without Ray."""
    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    with InProcessServer(2, ["cuda:0", "cuda:0"]) as server, MemoryClient(server.endpoint, timeout=60) as client:
        yield server, client


@pytest.mark.parametrize("extra", [["--micro-batches", "2"], ["--memory-kind", "engram", *ENGRAM],
                                   ["--memory-kind", "engram", *ENGRAM, "--staleness", "1"]],
                         ids=["pkm-micro-batches", "engram-prefetch", "engram-stale"])
def test_memtrain_remote_on_cuda_gives_the_cpu_losses(exact_cuda, extra, gpu_server):
    """memtrain --device cuda --memory remote, values on GPU shards: the losses of the same run
    with --device cpu and local values (the same math on every path)."""
    _, client = gpu_server
    table = "gpu-" + "-".join(a.strip("-") for a in extra)
    common = [*TINY, "--steps", "5", "--seed", "3", "--value-lr", "0.05", *extra]
    want = losses([*common, "--device", "cpu"])
    got = losses([*common, "--device", "cuda", "--memory", "remote", "--table", table], client)
    assert_same_losses(want, got)


def test_two_trainers_on_nccl_equal_one_on_the_combined_batch(exact_cuda, request, tmp_path):
    """Data-parallel on GPUs: two NCCL trainers (batch 2 each, one GPU each) == one of batch 4."""
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs one GPU per trainer: this machine has fewer than 2")
    server, _ = request.getfixturevalue("gpu_server")
    table = "gpu-ddp"
    common = [*TINY, "--steps", "4", "--seed", "5", "--value-lr", "0.05", "--no-query-bn", "--eval-every", "4"]
    single = losses([*common, "--batch-size", "4", "--device", "cuda:0"])
    ddp = run_trainers([*common, "--memory", "remote", "--batch-size", "2", "--device", "cuda", "--endpoint",
                        server.endpoint, "--table", table], tmp_path / "ddp.jsonl", env={"NVIDIA_TF32_OVERRIDE": "0"})
    ddp = [(r["loss"], r.get("val_loss")) for r in ddp]
    assert_same_losses(single, ddp)
