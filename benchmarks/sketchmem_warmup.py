"""SketchMem's warm-up (Panigrahy, Wang and Xu 2021, Figure 2a): can a small network memorise N
random 50-bit keys -> random 50-bit values?

A depth-3, width-50 ELU network (50 -> 50 -> 50 -> 50 -> 50 logits, binary cross-entropy) with
and without a memory at each hidden layer (trainer.warmup says exactly where): an
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
from dataclasses import fields
from typing import Any

import torch

from benchmarks.common import cluster_client
from trainer.warmup import RUNS, WarmupConfig, run_one

HELP = {
    "lr": "Adam learning rate of the network (cosine decay to 0)",
    "value_lr": "Adam learning rate of the memory slots (a slot is read about once per epoch: each visit must move it far)",
    "hashes": "LSH: hash functions per memory",
    "bits": "LSH: bits per hash (2^bits buckets)",
    "n_keys": "PKM: sub-keys per half (362^2 = 131,044 slots, about LSH's 8 x 2^14)",
    "max_seconds": "stop a run after the epoch that passes this",
}

def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1000,10000,100000", help="comma-separated N (pairs to memorise)")
    p.add_argument("--runs", default=",".join(RUNS), help="comma-separated subset of: " + ", ".join(RUNS))
    p.add_argument("--remote-max-n", type=int, default=1000, help="run lsh-remote only up to this N (it repeats lsh)")
    for f in fields(WarmupConfig):  # the task's knobs, with its defaults
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default,
                       help=HELP.get(f.name, argparse.SUPPRESS if f.name.startswith("pkm") else None))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    args = p.parse_args(argv)
    cfg = WarmupConfig(**{f.name: getattr(args, f.name) for f in fields(WarmupConfig)})
    torch.set_num_threads(args.threads)
    sizes = [int(x) for x in args.sizes.split(",")]
    runs = [r for r in args.runs.split(",") if r]
    if bad := set(runs) - set(RUNS):
        p.error(f"--runs: unknown {sorted(bad)}; choose from {', '.join(RUNS)}")
    rows: list[dict[str, Any]] = []
    remote = any(r.endswith("remote") for r in runs) and min(sizes) <= args.remote_max_n
    with cluster_client(remote) as client:
        for n in sizes:
            for kind in runs:
                if kind.endswith("remote") and n > args.remote_max_n:
                    continue
                row = run_one(kind, n, cfg, client, args.seed)
                rows.append(row)
                if not args.json:
                    print(f"N={n:>7,} {kind:<11} epochs {row['epochs']:>3} bit acc {row['bit_acc']:.4f} "
                          f"exact {row['exact']:.4f} {row['seconds']:.0f}s", flush=True)
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
        Console(width=140).print(t)
    return rows


if __name__ == "__main__":
    main()
