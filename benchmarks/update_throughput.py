"""Update throughput: `bag_backward` (dL/dweights + sparse row update) against PyTorch's own path.

A memory layer's backward is the expensive call. PyTorch's way to train the same table is
`nn.EmbeddingBag(mode="sum", sparse=True)` with `per_sample_weights` requiring grad, `backward()`
(dL/dweights and a sparse [n, d] row gradient), then a sparse optimizer: `optim.SGD`,
`optim.Adagrad` (element-wise; ours is row-wise, TorchRec style) or `optim.SparseAdam`. Ours:
`ValueTable.bag_backward` in this process with the numba and the torch backends, and remote
`client.bag_backward` (2 shards, cols; 1 thread per shard), also on a table with the write-ahead
log on (each call appended and fsynced before it is acknowledged). The headline ratio compares the same
work: PyTorch's backward + step against our bag_backward; the forward embedding_bag is timed too,
so backward/forward is printed (the floor is about 2-3x the forward: the backward reads each
entry's row, reads grad_out, and reads and writes each touched row and its optimizer state).
All candidates run round robin, so they share the background load.

    python -m benchmarks.update_throughput [--rows 65536 --dim 128 --batch 4096 --ids 128] [--quick]
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from benchmarks.common import local_cluster, machine, summarize, target

# torch.optim.Adagrad builds sparse tensors and warns that it skips their invariant checks
warnings.filterwarnings("ignore", message="Sparse invariant checks")

#: Target: ours at least this many times faster than PyTorch's backward + optimizer step.
TARGET = 2.0
LR = 0.01


def torch_optimizer(name: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """PyTorch's sparse-gradient optimizer for `name`."""
    if name == "adam":
        return torch.optim.SparseAdam(params, lr=LR)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=LR)
    return torch.optim.SGD(params, lr=LR)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=65536)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=4096, help="tokens (bags) per call")
    p.add_argument("--ids", type=int, default=128, help="ids per token (heads * knn)")
    p.add_argument("--optimizers", default="sgd,adagrad,adam")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--max-seconds", type=float, default=40.0, help="time bound per optimizer")
    p.add_argument("--quick", action="store_true", help="3 rounds per optimizer")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.repeat, args.max_seconds = min(args.repeat, 3), min(args.max_seconds, 20.0)
    from client import MemoryClient
    from memserver.core.init import init_values

    rng = np.random.default_rng(0)
    ids = torch.from_numpy(rng.integers(0, args.rows, (args.batch, args.ids)))
    logits = torch.from_numpy(rng.normal(size=(args.batch, args.ids)).astype(np.float32))
    w = torch.softmax(logits, dim=1)
    g = torch.from_numpy(rng.normal(size=(args.batch, args.dim)).astype(np.float32))
    init = init_values(np.arange(args.rows), 0, args.dim, args.dim, 0.02, 0)
    entries = args.batch * args.ids
    results: list[dict[str, Any]] = []
    with local_cluster(2) as cluster, MemoryClient(cluster.endpoint, timeout=300) as client:
        for opt_name in args.optimizers.split(","):
            results.append(measure(opt_name, args, client, ids, w, g, init))
    targets = []
    for r in results:
        targets.append(target("update_throughput", f"{r['optimizer']}: PyTorch bwd+step / ours local (numba)",
                              r["speedup_numba"], TARGET))
        targets.append(target("update_throughput", f"{r['optimizer']}: PyTorch bwd+step / ours remote (2 shards cols)",
                              r["speedup_remote"], TARGET))
    out = {"benchmark": "update_throughput", "config": vars(args), "machine": machine(), "entries": entries,
           "threads": {"torch": torch.get_num_threads(), "numba": _numba_threads(), "shard": 1},
           "results": results, "targets": targets}
    if args.json:
        print(json.dumps(out, indent=2))
        return out
    tbl = Table(title=f"bag_backward vs PyTorch, {args.rows:,} x {args.dim}, {args.batch} tokens x {args.ids} ids = "
                      f"{entries:,} entries, p50 ms (x = PyTorch bwd+step / ours; /fwd = vs forward "
                      f"{results[0]['ms']['forward']:.1f} ms)")
    for col in ("optimizer", "forward", "PyTorch fwd", "PyTorch bwd+step", "ours numba", "x", "ours torch", "x",
                "remote 2 cols", "x", "remote + wal", "wal cost", "bwd/fwd numba", "bwd/fwd PyTorch"):
        tbl.add_column(col, justify="right")
    for r in results:
        m = r["ms"]
        tbl.add_row(r["optimizer"], f"{m['forward']:.1f}", f"{m['torch_fwd']:.1f}", f"{m['torch_bwd_step']:.1f}",
                    f"{m['numba']:.1f}", f"{r['speedup_numba']:.2f}", f"{m['torch_backend']:.1f}",
                    f"{r['speedup_torch_backend']:.2f}", f"{m['remote']:.1f}", f"{r['speedup_remote']:.2f}",
                    f"{m['remote_wal']:.1f}", f"{r['wal_cost']:.2f}x",
                    f"{r['bwd_over_fwd']['numba']:.1f}", f"{r['bwd_over_fwd']['torch_bwd_step']:.1f}")
    Console(width=180).print(tbl)
    return out


def measure(opt_name: str, args: argparse.Namespace, client: Any, ids: torch.Tensor, w: torch.Tensor, g: torch.Tensor,
            init: torch.Tensor) -> dict[str, Any]:
    """One optimizer: PyTorch's path, our local backends and the remote call, round robin."""
    from memserver.core.optim import OptimizerConfig
    from memserver.core.table import ValueTable

    emb = torch.nn.EmbeddingBag(args.rows, args.dim, mode="sum", sparse=True)
    with torch.no_grad():
        emb.weight.copy_(init)
    opt = torch_optimizer(opt_name, list(emb.parameters()))
    local = {b: ValueTable(args.rows, args.dim, OptimizerConfig(opt_name, LR), init_std=0.02, seed=0, backend=b,
                           track_stats=False) for b in ("numba", "torch")}
    name = f"bench-upd-{opt_name}"
    for table, wal in ((name, False), (f"{name}-wal", True)):
        client.create_table(table, args.rows, args.dim, sharding="cols", num_shards=2, optimizer=opt_name, lr=LR,
                            init_std=0.02, seed=0, wal=wal)
    times: dict[str, list[float]] = {k: [] for k in ("forward", "torch_fwd", "torch_bwd_step", "numba", "torch_backend",
                                                     "remote", "remote_wal")}

    def torch_step() -> None:
        wr = w.clone().requires_grad_()
        t0 = time.perf_counter()
        out = emb(ids, per_sample_weights=wr)
        t1 = time.perf_counter()
        out.backward(g)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        times["torch_fwd"].append((t1 - t0) * 1e3)
        times["torch_bwd_step"].append((t2 - t1) * 1e3)

    calls: dict[str, Callable[[], Any]] = {
        "forward": lambda: F.embedding_bag(ids, init, None, mode="sum", per_sample_weights=w),
        "numba": lambda: local["numba"].bag_backward(ids, w, None, g),
        "torch_backend": lambda: local["torch"].bag_backward(ids, w, None, g),
        "remote": lambda: client.bag_backward(name, ids, w, g),
        "remote_wal": lambda: client.bag_backward(f"{name}-wal", ids, w, g),
    }
    torch_step()  # warm-up: compiles numba kernels, allocates optimizer state
    for fn in calls.values():
        fn()
    times["torch_fwd"].clear()
    times["torch_bwd_step"].clear()
    t_end = time.perf_counter() + args.max_seconds
    for _ in range(args.repeat):
        if time.perf_counter() > t_end:
            break
        torch_step()
        for k, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[k].append((time.perf_counter() - t0) * 1e3)
    client.drop_table(name)
    client.drop_table(f"{name}-wal")
    st = {k: summarize(v) for k, v in times.items()}
    ms = {k: v["p50_ms"] for k, v in st.items()}
    return {
        "optimizer": opt_name, "ms": ms, "timings": st,
        "speedup_numba": ms["torch_bwd_step"] / ms["numba"],
        "speedup_torch_backend": ms["torch_bwd_step"] / ms["torch_backend"],
        "speedup_remote": ms["torch_bwd_step"] / ms["remote"],
        "speedup_remote_wal": ms["torch_bwd_step"] / ms["remote_wal"],
        "wal_cost": ms["remote_wal"] / ms["remote"],
        "bwd_over_fwd": {k: ms[k] / ms["forward"] for k in ("torch_bwd_step", "numba", "torch_backend", "remote", "remote_wal")},
    }


def _numba_threads() -> int:
    import numba

    return int(numba.get_num_threads())


if __name__ == "__main__":
    main()
