"""GPUs end to end (issue 29): a GPU shard's bag and bag_backward, and memtrain on the GPU.

Needs a CUDA device, but neither Ray nor faiss: the shards are `memserver.cluster.inprocess`
shards on cuda:0 in a child process, the client talks to them as to any cluster (shared memory,
since they are on this machine). Every figure is against a baseline measured in the same run:

- **copy bandwidth**: a device-to-device copy of 1 GiB (read + write bytes per second): what
  the GPU's memory gives at best;
- **table**: `ValueTable` on cuda:0 (the code a GPU shard runs), bag and bag_backward, against
  `torch.nn.functional.embedding_bag` on the same GPU, same ids; GB/s = rows' bytes read / time;
- **shard**: the same calls through the client to 2 GPU shards (cols) in a process of their
  own, against the table in this process (what serving adds: the transport, the host copies);
- **memtrain**: step time on the GPU with no memory, local values (on the GPU), remote values
  on the GPU shards (exact, and `--staleness 1`), memtrain's defaults (product keys) and Engram,
  round robin. Targets: remote `--staleness 1` <= 1.1x local (it can hide a read only where the
  read does not wait for the forward: Engram), local <= 1.3x none.

    python -m benchmarks.gpu [--rows 1048576 --dim 256 --bags 4096 --knn 32] [--quick] [--json]

Prints the GPU, torch and CUDA versions with the figures; docs/benchmarks.md records a run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import print_targets, round_robin_steps, target

#: Targets (issue 29): remote memtrain with --staleness 1 against local, local against none.
TARGET_REMOTE_STALE, TARGET_LOCAL = 1.1, 1.3


def cuda_ms(fn: Callable[[], Any], repeat: int, warmup: int = 3) -> list[float]:
    """Each call's time in ms, with the GPU synchronised around it (host-side answers included)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(1e3 * (time.perf_counter() - t0))
    return out


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """GB/s of a device-to-device copy (bytes read + written), best of 10."""
    a = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    ms = min(cuda_ms(lambda: b.copy_(a), 10))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def table_figures(args: argparse.Namespace) -> dict[str, Any]:
    from memserver.core.optim import OptimizerConfig
    from memserver.core.table import ValueTable

    t = ValueTable(args.rows, args.dim, OptimizerConfig("adagrad", 0.01), seed=0, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, args.rows, (args.bags, args.knn), device="cuda", generator=g)
    w = torch.rand(args.bags, args.knn, device="cuda", generator=g)
    grad = torch.randn(args.bags, args.dim, device="cuda", generator=g) * 1e-3
    read = args.bags * args.knn * args.dim * 4
    ms = {
        "embedding_bag": cuda_ms(lambda: F.embedding_bag(ids, t.weight, mode="sum", per_sample_weights=w), args.repeat),
        "table bag": cuda_ms(lambda: t.bag(ids, w), args.repeat),
        "table bag_backward": cuda_ms(lambda: t.bag_backward(ids, w, None, grad), args.repeat),
    }
    out = {k: {"p50_ms": statistics.median(v), "gb_s": read / (statistics.median(v) * 1e-3) / 1e9} for k, v in ms.items()}
    out["_table"], out["_ids"], out["_w"], out["_grad"] = t, ids, w, grad
    return out


@contextlib.contextmanager
def gpu_shards(n: int = 2, device: str = "cuda:0") -> Iterator[tuple[str, int]]:
    """`n` shards on `device` and their coordinator (memserver.cluster.inprocess) in a process of
    their own, as a deployment runs them (not sharing this process's GIL with the trainer);
    yields its endpoint and the process's id."""
    code = ("import sys; from memserver.cluster.inprocess import InProcessServer; "
            f"s = InProcessServer({n}, [{device!r}] * {n}); print(s.endpoint, flush=True); sys.stdin.read(); s.stop()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        endpoint = proc.stdout.readline().strip() if proc.stdout else ""
        if not endpoint:
            raise RuntimeError(f"the shards' process ended before serving (exit status {proc.wait(30)})")
        yield endpoint, proc.pid
    finally:
        if proc.stdin:
            proc.stdin.close()  # its end of input: it stops
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def shard_figures(args: argparse.Namespace, ids: torch.Tensor, w: torch.Tensor, grad: torch.Tensor) -> dict[str, Any]:
    from client import MemoryClient

    h_ids, h_w, h_grad = ids.cpu().numpy(), w.cpu().numpy(), grad.cpu().numpy()
    out: dict[str, Any] = {}
    with gpu_shards() as (endpoint, _), MemoryClient(endpoint, timeout=120) as c:
        c.create_table("gpu-bench", args.rows, args.dim, optimizer="adagrad", lr=0.01, sharding="cols")
        out["status"] = [(s.index, s.device, s.gpus) for s in c.status().shards]
        ms = {"shard bag": cuda_ms(lambda: c.bag("gpu-bench", h_ids, h_w), args.repeat),
              "shard bag_backward": cuda_ms(lambda: c.bag_backward("gpu-bench", h_ids, h_w, h_grad), args.repeat)}
    read = args.bags * args.knn * args.dim * 4
    for k, v in ms.items():
        out[k] = {"p50_ms": statistics.median(v), "gb_s": read / (statistics.median(v) * 1e-3) / 1e9}
    return out


ENGRAM = ["--memory-kind", "engram"]
#: memtrain's default memory (product keys: its reads are addressed by the forward's queries, so
#: they wait for it) and Engram (token-addressed: with --staleness 1 step t+1's reads go out while
#: step t computes), each local and remote; the targets are taken where they mean something
RUNS = {
    "none": ["--memory", "none"],
    "local": ["--memory", "local"],
    "remote": ["--memory", "remote"],
    "remote staleness 1": ["--memory", "remote", "--staleness", "1"],
    "engram local": ["--memory", "local", *ENGRAM],
    "engram remote": ["--memory", "remote", *ENGRAM],
    "engram remote staleness 1": ["--memory", "remote", "--staleness", "1", *ENGRAM],
}


def memtrain_figures(args: argparse.Namespace) -> dict[str, Any]:
    """memtrain on cuda, the runs round robin in blocks (as benchmarks.train_step)."""
    from client import MemoryClient
    from trainer.train import build_parser, train

    total = args.blocks * args.block
    with gpu_shards() as (endpoint, _), MemoryClient(endpoint, timeout=120) as c:
        gens = {n: train(build_parser().parse_args([*a, "--device", "cuda", "--steps", str(total + 1000),
                                                    "--eval-every", "1000000", "--log-every", "1",
                                                    "--table", f"gpu-train-{i}"]), client=c)
                for i, (n, a) in enumerate(RUNS.items())}
        try:
            step_ms = round_robin_steps(gens, args.blocks, args.block, args.warmup)
        finally:
            for gen in gens.values():
                gen.close()
    return {n: {"p50_ms": statistics.median(v), "min_ms": min(v), "n": len(v),
                "command": "memtrain --device cuda " + " ".join(RUNS[n])} for n, v in step_ms.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1 << 20)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--bags", type=int, default=4096)
    p.add_argument("--knn", type=int, default=32)
    p.add_argument("--repeat", type=int, default=50, help="timed calls per figure")
    p.add_argument("--blocks", type=int, default=3, help="memtrain: rounds of the round robin")
    p.add_argument("--block", type=int, default=11, help="memtrain: consecutive steps of a run per round")
    p.add_argument("--warmup", type=int, default=5, help="memtrain: uncounted first steps")
    p.add_argument("--quick", action="store_true", help="262,144 rows, 20 calls, 2 blocks of 6 steps")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("no CUDA device: this benchmark measures a GPU (torch.cuda.is_available() is False)")
    if args.quick:
        args.rows, args.repeat, args.blocks, args.block, args.warmup = 1 << 18, 20, 2, 6, 3
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # as a GPU user trains
    gpu = {"name": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
           "capability": ".".join(map(str, torch.cuda.get_device_capability(0)))}
    bw = copy_bandwidth()
    table = table_figures(args)
    ids, w, grad = table.pop("_ids"), table.pop("_w"), table.pop("_grad")
    del table["_table"]
    torch.cuda.empty_cache()
    shard = shard_figures(args, ids, w, grad)
    steps = memtrain_figures(args)
    ms = {n: r["p50_ms"] for n, r in steps.items()}
    targets = [target("gpu", "memtrain engram remote --staleness 1 / engram local (ms/step)",
                      ms["engram remote staleness 1"] / ms["engram local"], TARGET_REMOTE_STALE, higher_is_better=False),
               target("gpu", "memtrain product keys remote --staleness 1 / local (ms/step)",
                      ms["remote staleness 1"] / ms["local"], TARGET_REMOTE_STALE, higher_is_better=False),
               target("gpu", "memtrain local / none (ms/step)", ms["local"] / ms["none"], TARGET_LOCAL,
                      higher_is_better=False),
               target("gpu", "memtrain engram local / none (ms/step)", ms["engram local"] / ms["none"], TARGET_LOCAL,
                      higher_is_better=False)]
    ratios = {"table bag / embedding_bag (time)": table["table bag"]["p50_ms"] / table["embedding_bag"]["p50_ms"],
              "embedding_bag / copy bandwidth": table["embedding_bag"]["gb_s"] / bw,
              "shard bag / table bag (q/s)": table["table bag"]["p50_ms"] / shard["shard bag"]["p50_ms"],
              "shard bag_backward / table bag_backward (q/s)":
                  table["table bag_backward"]["p50_ms"] / shard["shard bag_backward"]["p50_ms"],
              "memtrain remote / local": ms["remote"] / ms["local"],
              "memtrain engram remote / engram local": ms["engram remote"] / ms["engram local"]}
    out = {"benchmark": "gpu", "config": vars(args), "gpu": gpu, "copy_gb_s": bw, "table": table, "shard": shard,
           "memtrain": steps, "ratios": ratios, "targets": targets}
    if args.json:
        print(json.dumps(out, indent=2, default=str))
        return out
    print(f"GPU {gpu['name']} (sm {gpu['capability']}), torch {gpu['torch']}, CUDA {gpu['cuda']}")
    print(f"device-to-device copy: {bw:,.0f} GB/s (read + write)")
    print(f"table {args.rows:,} x {args.dim} float32 (adagrad), {args.bags} bags x {args.knn} ids, p50 of {args.repeat}:")
    for k, v in {**table, **{k: v for k, v in shard.items() if k != 'status'}}.items():
        print(f"  {k:>20}: {v['p50_ms']:8.3f} ms  {v['gb_s']:8.1f} GB/s of rows read")
    print(f"  shards: {shard['status']}")
    print("memtrain --device cuda (defaults), p50 ms/step:")
    for n, r in steps.items():
        print(f"  {n:>26}: {r['p50_ms']:8.1f}  (min {r['min_ms']:.1f}, {r['n']} steps)  x none {r['p50_ms'] / ms['none']:.2f}")
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}")
    print_targets(targets)
    return out


if __name__ == "__main__":
    main()
