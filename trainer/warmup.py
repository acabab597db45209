"""SketchMem's warm-up task (Panigrahy, Wang and Xu 2021, Figure 2a): memorise N random 50-bit
keys -> random 50-bit values with a depth-3, width-50 ELU network, with or without a memory layer
at each hidden layer.

Memory i reads hidden layer i's input (the key itself for the first) and adds its read to that
layer's output, i.e. to the next layer's input. The first memory thus hashes the fixed keys, so
its buckets never move; the later ones hash drifting activations, and a cosine decay of the
network's learning rate lets them settle at the end. benchmarks.sketchmem_warmup prints the
table, `make demo` runs a small instance.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer.memory import LocalValues, LSHMemory, MemoryLayer, ProductKeyMemory, RemoteValues, ValueBackend


@dataclass
class WarmupConfig:
    epochs: int = 100
    max_seconds: float = 1800.0  # stop after the epoch that passes this
    batch_size: int = 128
    lr: float = 1e-3  # Adam, the network; cosine decay to 0
    value_lr: float = 0.3  # Adam, the memory slots: a slot is read about once per epoch, so each visit moves it far
    init_std: float = 0.0  # the slots start at zero
    width: int = 50
    depth: int = 3
    hashes: int = 8  # LSH: hash functions per memory
    bits: int = 14  # LSH: 2^bits buckets per hash
    n_keys: int = 362  # PKM: n_keys^2 = 131,044 slots, about LSH's 8 x 2^14
    pkm_heads: int = 1
    pkm_knn: int = 8
    pkm_k_dim: int = 32


BITS_IO = 50  # key and value bits
RUNS = ("none", "lsh", "lsh-remote", "pkm")  # no memory, LSH here, LSH in the cluster, product keys here


class WarmupNet(nn.Module):
    """depth ELU layers of `width`; memory l (if any) reads hidden layer l's input and adds to its output."""

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


def make_memories(kind: str, width: int, depth: int, args: WarmupConfig, client: Any, seed: int,
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


def run_one(kind: str, n: int, args: WarmupConfig, client: Any = None, seed: int = 0) -> dict[str, Any]:
    """Train one network of `kind` on N fresh random pairs; its bit and exact-match accuracy on them."""
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
