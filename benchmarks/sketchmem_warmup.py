"""SketchMem's warm-up (Panigrahy, Wang and Xu 2021, Figure 2a): can a small network memorise N
random 50-bit keys -> random 50-bit values?

A depth-3, width-50 ELU network (50 -> 50 -> 50 -> 50 -> 50 logits, binary cross-entropy) with
and without a memory after each hidden layer (its output added to the next layer's input): an
LSH sketch memory (trainer.memory.LSHMemory, `hashes` x 2^`bits` buckets of 50 floats), the same
memory with its tables in the memserver cluster (remote: same numbers), and a product-key memory
(trainer.memory.ProductKeyMemory) of the same slot count in the same place. Reported on the N
training pairs (memorisation is the task): bit accuracy and exact-match accuracy (all 50 bits).

    python -m benchmarks.sketchmem_warmup [--sizes 1000,10000,100000] [--runs none,lsh,lsh-remote,pkm]
                                          [--epochs 100] [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer.memory import LocalValues, LSHMemory, MemoryLayer, ProductKeyMemory, RemoteValues, ValueBackend

BITS_IO = 50  # key and value bits
RUNS = ("none", "lsh", "lsh-remote", "pkm")


class WarmupNet(nn.Module):
    """depth ELU layers of `width`; memory layer l (if any) reads hidden layer l's output and adds to it."""

    def __init__(self, width: int, depth: int, memories: list[MemoryLayer] | None = None) -> None:
        super().__init__()
        self.hidden = nn.ModuleList([nn.Linear(BITS_IO if i == 0 else width, width) for i in range(depth)])
        self.memories = nn.ModuleList(memories or [])
        self.out = nn.Linear(width, BITS_IO)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for i, layer in enumerate(self.hidden):
            out = F.elu(layer(h))
            if i < len(self.memories):
                out = out + self.memories[i](h)  # memory i reads layer i's input, adds to its output
            h = out
        return self.out(h)


def make_memories(kind: str, width: int, depth: int, args: argparse.Namespace, client: Any, seed: int,
                  backends: list[ValueBackend]) -> list[MemoryLayer]:
    out: list[MemoryLayer] = []
    for i in range(depth):
        rows = args.hashes << args.bits if kind.startswith("lsh") else args.n_keys**2
        common = dict(optimizer="adam", lr=args.value_lr, init_std=args.init_std, seed=seed * 100 + i)
        if kind.endswith("remote"):
            b: ValueBackend = RemoteValues(client, f"warmup-{kind}-{i}", rows, width, **common)
        else:
            b = LocalValues(rows, width, **common)
        backends.append(b)
        if kind.startswith("lsh"):
            out.append(LSHMemory(BITS_IO if i == 0 else width, width, b, hashes=args.hashes, bits=args.bits, seed=seed * 100 + i))
        else:
            out.append(ProductKeyMemory(BITS_IO if i == 0 else width, width, b, n_keys=args.n_keys, heads=args.pkm_heads, k_dim=args.pkm_k_dim,
                                        knn=args.pkm_knn, query_bn=True))
    return out


def run_one(kind: str, n: int, args: argparse.Namespace, client: Any = None, seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randint(0, 2, (n, BITS_IO), generator=gen).float() * 2 - 1  # +-1
    values = torch.randint(0, 2, (n, BITS_IO), generator=gen).float()
    torch.manual_seed(seed)
    backends: list[ValueBackend] = []
    mems = make_memories(kind, args.width, args.depth, args, client, seed, backends) if kind != "none" else []
    net = WarmupNet(args.width, args.depth, mems)
    opt = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=args.lr)
    # cosine decay of the network's learning rate: late in training the layers (and so the
    # hashes of their outputs) settle, and the slots finish memorising
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * -(-n // args.batch_size))
    order = torch.Generator().manual_seed(seed + 1)
    t0, step, deadline = time.perf_counter(), 0, time.perf_counter() + args.max_seconds
    epochs = 0
    for _ in range(args.epochs):
        perm = torch.randperm(n, generator=order)
        for s in range(0, n, args.batch_size):
            idx = perm[s : s + args.batch_size]
            step += 1
            for b in backends:
                b.begin_step(step)
            loss = F.binary_cross_entropy_with_logits(net(keys[idx]), values[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            for b in backends:
                b.end_step(step)
            opt.step()
            sched.step()
        epochs += 1
        if time.perf_counter() > deadline:
            break
    seconds = time.perf_counter() - t0
    net.eval()
    with torch.no_grad():
        pred = torch.cat([(net(keys[s : s + 4096]) > 0).float() for s in range(0, n, 4096)])
    right = pred == values
    return {"run": kind, "n": n, "epochs": epochs, "bit_acc": float(right.float().mean()),
            "exact": float(right.all(1).float().mean()), "seconds": seconds,
            "slots_per_layer": backends[0].num_rows if backends else 0}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1000,10000,100000", help="comma-separated N (pairs to memorise)")
    p.add_argument("--runs", default=",".join(RUNS), help="comma-separated subset of: " + ", ".join(RUNS))
    p.add_argument("--remote-max-n", type=int, default=1000, help="run lsh-remote only up to this N (it repeats lsh)")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--max-seconds", type=float, default=1800.0, help="stop a run after the epoch that passes this")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate of the network (cosine decay to 0)")
    p.add_argument("--value-lr", type=float, default=0.3, help="Adam learning rate of the memory slots (constant: "
                   "a slot is read about once per epoch, so each visit must move it far)")
    p.add_argument("--init-std", type=float, default=0.0, help="initial slot values' std (0: zeros)")
    p.add_argument("--width", type=int, default=50)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--hashes", type=int, default=8, help="LSH: hash functions per memory")
    p.add_argument("--bits", type=int, default=14, help="LSH: bits per hash (2^bits buckets)")
    p.add_argument("--n-keys", type=int, default=362, help="PKM: sub-keys per half (n_keys^2 slots: 362^2 = 131,044, "
                   "about the LSH memory's 8 x 2^14)")
    p.add_argument("--pkm-heads", type=int, default=1)
    p.add_argument("--pkm-knn", type=int, default=8)
    p.add_argument("--pkm-k-dim", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = [int(x) for x in args.sizes.split(",")]
    runs = [r for r in args.runs.split(",") if r]
    if bad := set(runs) - set(RUNS):
        p.error(f"--runs: unknown {sorted(bad)}; choose from {', '.join(RUNS)}")
    rows: list[dict[str, Any]] = []
    remote = any(r.endswith("remote") for r in runs)
    ctx = None
    client = None
    if remote:
        from benchmarks.common import local_cluster
        from client import MemoryClient

        ctx = local_cluster(2)
        cluster = ctx.__enter__()
        client = MemoryClient(cluster.endpoint)
    try:
        for n in sizes:
            for kind in runs:
                if kind.endswith("remote") and n > args.remote_max_n:
                    continue
                row = run_one(kind, n, args, client, args.seed)
                rows.append(row)
                if not args.json:
                    print(f"N={n:>7,} {kind:<11} epochs {row['epochs']:>3} bit acc {row['bit_acc']:.4f} "
                          f"exact {row['exact']:.4f} {row['seconds']:.0f}s", flush=True)
    finally:
        if client is not None:
            client.close()
        if ctx is not None:
            ctx.__exit__(None, None, None)
    if args.json:
        print(json.dumps(rows))
    else:
        from rich.console import Console
        from rich.table import Table

        t = Table(title="SketchMem warm-up: memorise N random 50-bit pairs (depth 3, width 50, ELU)")
        for col in ("N", "memory", "slots/layer", "epochs", "bit accuracy", "exact match", "seconds"):
            t.add_column(col, justify="left" if col == "memory" else "right")
        for r in rows:
            t.add_row(f"{r['n']:,}", r["run"], f"{r['slots_per_layer']:,}", str(r["epochs"]), f"{r['bit_acc']:.4f}",
                      f"{r['exact']:.4f}", f"{r['seconds']:.0f}")
        Console().print(t)
    return rows


if __name__ == "__main__":
    main()
