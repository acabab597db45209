"""memtrain's --device and --dtype, as far as a machine without a GPU can check them: the CPU path
is exactly what it was, the device rule and its errors, bf16 autocast on the CPU, and the device
plumbing of the value backends (identity on the CPU; a LocalValues follows its layer). The CUDA
side of each is tests/gpu/test_trainer_gpu.py."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from trainer.device import dist_backend, resolve_device
from trainer.memory import LocalValues, ProductKeyMemory
from trainer.memory.backends import on_device, to_device, to_host
from trainer.train import build_parser, main, train

TINY = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "32", "--batch-size", "4",
        "--n-keys", "16", "--heads", "2", "--knn", "4", "--k-dim", "16", "--mem-layers", "1",
        "--eval-every", "3", "--eval-iters", "2", "--log-every", "1", "--threads", "1", "--memory", "local"]
CPU = torch.device("cpu")


@pytest.fixture
def no_cuda(monkeypatch):
    """This process as a machine without CUDA (also where the suite runs on a GPU machine)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def two_gpus(monkeypatch):
    """A pretend machine with two GPUs, for the device rule alone (nothing is allocated)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)


def losses(argv: list[str]) -> list[tuple[float, float | None]]:
    return [(r["loss"], r.get("val_loss")) for r in train(build_parser().parse_args(argv))]


@pytest.mark.parametrize("extra", [[], ["--memory-kind", "pkm,engram", "--engram-slots", "4096", "--micro-batches", "2"],
                                   ["--memory-kind", "lsh", "--lsh-bits", "6"]],
                         ids=["pkm", "pkm+engram-micro-batches", "lsh"])
def test_device_cpu_and_auto_without_cuda_give_exactly_the_default_losses(no_cuda, extra):
    """--device cpu, and auto on a machine without CUDA, train bit for bit as memtrain did
    before the flag (the default run's losses, compared with ==)."""
    common = [*TINY, "--steps", "4", "--seed", "3", "--value-lr", "0.05", *extra]
    default = losses(common)
    assert losses([*common, "--device", "cpu"]) == default
    assert losses([*common, "--device", "auto", "--dtype", "fp32"]) == default


THREADS_RUN = """
import json, sys, numba, torch
sys.path.insert(0, "tests")
from test_trainer_device import TINY, losses
common = [*TINY, "--steps", "3", "--seed", "3", "--memory", "none", "--threads", sys.argv[1]]
first = losses(common)
counts = [torch.get_num_threads(), numba.get_num_threads()]
print(json.dumps({"same": losses(common) == first, "counts": counts}))
"""


@pytest.mark.parametrize("threads, env, want", [("1", {}, 1), ("0", {"OMP_NUM_THREADS": "1"}, 1)],
                         ids=["--threads 1", "OMP_NUM_THREADS=1"])
def test_threads_hold_for_the_whole_run_torch_and_numba_alike(threads, env, want):
    """memtrain's thread count holds from the first step to the last, for torch and numba alike,
    in a process where numba's pool has not started yet: starting, it sets the OpenMP count that
    torch shares back to every core. Before, the first run in a process trained on 1 thread until
    numba's first kernel and on 2 after, so its losses differed from a second run's in the 7th digit."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", THREADS_RUN, threads], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "NUMBA_NUM_THREADS": "2", **env}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"same": True, "counts": [want, want]}


def test_device_rule_without_cuda(no_cuda):
    assert resolve_device("auto") == CPU and resolve_device("cpu") == CPU and resolve_device(" CPU ") == CPU
    for spec in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match="torch sees no CUDA device"):
            resolve_device(spec)
    for spec in ("gpu", "cuda:x", "cuda:", "mps", "cuda:-1"):
        with pytest.raises(ValueError, match="not a device: auto, cpu, cuda or cuda:N"):
            resolve_device(spec)
    assert dist_backend(CPU) == "gloo" and dist_backend(torch.device("cuda", 0)) == "nccl"


def test_device_rule_with_gpus(two_gpus, monkeypatch):
    """Plain cuda and auto: this process's GPU (LOCAL_RANK under torchrun, else 0); cuda:N as asked."""
    cuda = lambda n: torch.device("cuda", n)  # noqa: E731
    assert resolve_device("auto") == resolve_device("cuda") == cuda(0)
    assert resolve_device("cuda:1") == cuda(1) and resolve_device("cpu") == CPU
    with pytest.raises(ValueError, match=r"2 CUDA device\(s\), cuda:0 to cuda:1"):
        resolve_device("cuda:2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_device("auto") == resolve_device("cuda") == cuda(1) and resolve_device("cuda:0") == cuda(0)
    assert resolve_device("cuda", local_rank=0) == cuda(0)


@pytest.mark.parametrize("spec, message", [("cuda", "--device cuda: torch sees no CUDA device"),
                                           ("cuda:3", "--device cuda:3: torch sees no CUDA device"),
                                           ("tpu", "--device tpu: not a device: auto, cpu, cuda or cuda:N")])
def test_memtrain_names_the_device_flag_in_one_line(no_cuda, capsys, spec, message):
    """Like every memtrain error: one line, `memtrain: error: --flag value: why`, no traceback."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main([*TINY, "--steps", "1", "--device", spec])
    text = capsys.readouterr().err  # exit 2: the command's mistake, as argparse's refusals
    assert exc.value.code == 2 and text.startswith(f"memtrain: error: {message}") and text.count("\n") == 1, text


def test_dtype_is_fp32_or_bf16(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([*TINY, "--dtype", "fp16"])
    assert "invalid choice: 'fp16'" in capsys.readouterr().err


def test_bf16_autocast_trains_on_the_cpu(no_cuda):
    """--dtype bf16 --device cpu runs the dense part in bf16 (the losses are not fp32's) and trains."""
    common = [*TINY, "--steps", "12", "--seed", "1", "--lr", "3e-3", "--value-lr", "0.05", "--eval-every", "12",
              "--memory-kind", "pkm,engram", "--engram-slots", "4096", "--device", "cpu"]
    fp32 = losses(common)
    bf16 = losses([*common, "--dtype", "bf16"])
    assert all(torch.isfinite(torch.tensor(loss)) for loss, _ in bf16)
    assert bf16 != fp32  # autocast is on
    assert bf16[-1][0] < bf16[0][0] - 0.1 and bf16[-1][1] < 4.0  # it trains (start: ln(65) = 4.17)
    assert bf16[-1][1] == pytest.approx(fp32[-1][1], rel=0.05)


def test_addressing_stays_float32_under_autocast():
    """Under bf16 autocast a product-key layer picks the slots the float32 layer picks (top-k on
    bf16 scores would pick others) and reads them in float32; only its output follows autocast."""
    torch.manual_seed(0)
    mem = ProductKeyMemory(32, 16, LocalValues(32 * 32, 16), n_keys=32, heads=2, k_dim=16, knn=8, mem_plus=True)
    x = torch.randn(512, 32)
    ref = mem(x)
    ref_ids, ref_w = mem.last_access
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mem(x)
    ids, w = mem.last_access
    assert torch.equal(ids, ref_ids) and w.dtype == torch.float32 and torch.allclose(w, ref_w, atol=1e-6)
    assert out.dtype == torch.bfloat16 and torch.allclose(out.float(), ref, rtol=0.05, atol=0.02)


def test_transfers_are_the_identity_on_the_cpu():
    """The one place host and device meet (trainer.memory.backends) adds nothing on the CPU."""
    a, b = torch.arange(6).view(2, 3), torch.ones(2, 3)
    got = to_host(a, b)
    assert got[0] is a and got[1] is b
    assert to_device(a, CPU) is a
    answer: Future = Future()
    assert on_device(answer, CPU) is answer


def test_local_values_follow_their_layer_to_another_device():
    """`layer.to(device)` moves a LocalValues' table (values and optimizer state) with the layer's
    parameters; the meta device stands in for a GPU here (tests/gpu moves to cuda)."""
    values = LocalValues(8 * 8, 4, seed=1)
    values.table.exp_avg.fill_(0.5)
    mem = ProductKeyMemory(6, 4, values, n_keys=8, heads=1, k_dim=4, knn=2)
    assert values.to("cpu") is values and values.table.device == CPU
    mem.to("meta")
    assert mem.keys.device.type == "meta" and mem.values is values
    assert {t.device.type for t in values.table.state().values()} == {"meta"}
    assert values.table.backend == "torch"  # the compiled kernels are for CPU tables


def test_the_gpu_tests_stand_in_client_answers_what_remote_values_asks():
    """tests/gpu checks RemoteValues' transfers against `TableClient`, a stand-in for the client's
    calls. Only a GPU machine runs those tests, so a stand-in that fell behind RemoteValues (a field
    of client.table's answer it began to read) failed only there (2026-11-29's H200 run: 2 of 38).
    The same step on the CPU here: a product-key layer over the stand-in equals it over LocalValues,
    and a read sent early answers."""
    import copy

    from tests.gpu.test_trainer_gpu import DIM, ROWS, TableClient, make_layer, one_step
    from trainer.memory import RemoteValues

    torch.manual_seed(0)
    client = TableClient(ROWS["pkm"], DIM["pkm"])
    local = make_layer("pkm", LocalValues(ROWS["pkm"], DIM["pkm"], optimizer="adam", lr=0.05, seed=1))
    remote = copy.deepcopy(local)
    remote.values = RemoteValues(client, "t", ROWS["pkm"], DIM["pkm"], optimizer="adam", lr=0.05, create=False)
    x = torch.randn(4, 16, 32)
    sent = remote.values.submit_bag(torch.zeros(2, 4, dtype=torch.int64), torch.ones(2, 4))
    assert torch.allclose(sent.result(), client.values.bag(torch.zeros(2, 4, dtype=torch.int64), torch.ones(2, 4)))
    want, got = one_step(local, x, None), one_step(remote, x, None)
    assert client.handed and client.ids_dtypes == {torch.int64}  # (narrowed to int32 on a GPU only)
    for key in ("out", "ids", "weights", "grad.keys", "grad.query.weight"):
        assert torch.allclose(got[key], want[key], rtol=1e-4, atol=1e-5), key
    assert torch.allclose(client.values.weight, want["table"], rtol=1e-4, atol=1e-5)
