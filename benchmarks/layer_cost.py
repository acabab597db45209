"""Where a memory layer's time goes: each kind's stages timed alone, at memtrain's default shapes.

One memory layer of each kind (product keys, LSH, KIF) with its values in this process, on
N = 32 x 128 = 4,096 positions of width 128 (memtrain's batch), stage by stage: `queries` (the
query network: PKM's linear + BatchNorm, KIF's f_E; LSH has none), addressing (PKM's key
scoring and top-k, LSH's hashing, KIF's faiss search), the read (the bag from the value
table and, for LSH, the sketch that combines the hashes' buckets; KIF's softmax-weighted sum of
the returned encodings), `output` (KIF's gate and projection; nothing for the others) and the backward of all of it (for PKM and LSH this includes the value table's
dL/dweights and sparse update). Timings are p50 over --repeat calls; the whole-step cost beside a
model without memory is benchmarks.train_step's.

    python -m benchmarks.layer_cost [--repeat 10] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from trainer.data import DEFAULT_DATA
from trainer.memory import KIFMemory, LocalKnowledge, LocalValues, LSHMemory, MemoryLayer, ProductKeyMemory
from trainer.memory.knowledge import corpus_sentences, encode_cached, make_encoder

N, D = 32 * 128, 128


def stages(layer: MemoryLayer, x: torch.Tensor) -> dict[str, float]:
    """One forward, stage by stage, then the backward; ms each."""
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    q = layer.queries(x)
    t1 = time.perf_counter()
    if isinstance(layer, KIFMemory):
        started = layer.start(q, False)
        started.result()
        t2 = time.perf_counter()
        ids, w, read = layer.finish(q, started)
    else:
        ids, w = layer.address(q)
        t2 = time.perf_counter()
        ids, w, read = layer.finish(q, (ids, w, None))
    t3 = time.perf_counter()
    y = layer.output(read, x)
    t4 = time.perf_counter()
    y.square().mean().backward()
    if layer.values is not None:
        layer.values.end_step(0)
    t5 = time.perf_counter()
    for name, a, b in (("queries", t0, t1), ("address", t1, t2), ("read", t2, t3), ("output", t3, t4),
                       ("backward", t4, t5)):
        out[name] = 1e3 * (b - a)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kif-sentences", type=int, default=4096)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    e = encode_cached(make_encoder("minilm"), corpus_sentences(DEFAULT_DATA.read_text(), args.kif_sentences))
    layers = {
        "pkm (128^2 slots, 4 heads x knn 32)": ProductKeyMemory(D, D, LocalValues(128**2, D, lr=1e-2), n_keys=128),
        "lsh (4 x 2^12 buckets)": LSHMemory(D, D, LocalValues(4 << 12, D, lr=1e-2), hashes=4, bits=12),
        f"kif ({len(e):,} MiniLM encodings, 8 hits, exact search)": KIFMemory(D, D, LocalKnowledge("k", e, device="cpu"), knn=8),
    }
    x = torch.randn(N, D)
    res: dict[str, dict[str, float]] = {}
    for name, layer in layers.items():
        runs = []
        for _ in range(args.repeat + 2):
            layer.zero_grad(set_to_none=True)
            if layer.values is not None:
                layer.values.begin_step(0)
            runs.append(stages(layer, x))
        runs = runs[2:]
        res[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        res[name]["total"] = sum(res[name].values())
    if args.json:
        print(json.dumps(res, indent=2))
        return res
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"one memory layer, {N:,} positions x {D} (memtrain's batch), p50 ms over {args.repeat}, "
                    f"{args.threads} threads")
    for col in ("layer", "queries", "address", "read", "output", "backward", "total"):
        t.add_column(col, justify="left" if col == "layer" else "right")
    for name, r in res.items():
        t.add_row(name, *(f"{r[k]:.1f}" for k in ("queries", "address", "read", "output", "backward", "total")))
    Console(width=140).print(t)
    return res


if __name__ == "__main__":
    main()
