"""Soak: a long remote training run, watching what each shard holds as the steps go by.

Runs memtrain with remote memory (its defaults: 4 layers, d=128, PKM 128^2 x 128, 4 heads x knn
32, batch 32 x 128, 2 shards, cols) for --steps steps. Every --sample-every steps it reads each
shard's resident memory and the answers it keeps for retries (`memserver status`); every
--checkpoint-every steps it checkpoints the table and records the checkpoint's size. It prints
the samples and, per shard, the RSS growth per 100 steps after --warmup steps (least squares
over the samples after warm-up). Target: below 2 MiB per 100 steps per shard, and checkpoints
whose size does not depend on the step. Not part of `make test` or `make bench` (minutes).

    python -m benchmarks.soak [--steps 1000 --sample-every 50 --checkpoint-every 250 --warmup 200]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from benchmarks.common import local_cluster, machine, target

#: Target: RSS growth per 100 steps per shard after warm-up, MiB.
TARGET_MIB = 2.0
TABLE = "bench-soak"


def growth_per_100(steps: list[int], values: list[float]) -> float:
    """Least-squares slope of values over steps, per 100 steps."""
    if len(steps) < 2:
        return float("nan")
    return float(np.polyfit(np.asarray(steps, float), np.asarray(values, float), 1)[0] * 100)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1000, help="training steps")
    p.add_argument("--sample-every", type=int, default=50, help="read each shard's RSS every N steps")
    p.add_argument("--checkpoint-every", type=int, default=250, help="checkpoint the table every N steps")
    p.add_argument("--warmup", type=int, default=200, help="steps before the growth is measured")
    p.add_argument("--memtrain-args", default="", help="extra memtrain arguments, e.g. '--staleness 1'")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if min(args.steps, args.sample_every, args.checkpoint_every) < 1 or args.warmup >= args.steps:
        p.error("--steps, --sample-every and --checkpoint-every must be positive and --warmup below --steps")

    from client import MemoryClient
    from trainer.train import build_parser, train

    run_argv = ["--memory", "remote", "--steps", str(args.steps), "--eval-every", str(args.steps), "--eval-iters", "2",
                "--log-every", str(args.sample_every), "--table", TABLE, *args.memtrain_args.split()]
    samples: list[dict[str, Any]] = []
    checkpoints: list[dict[str, Any]] = []
    from memserver.cluster.endpoint import memserver_home

    memserver_home().mkdir(parents=True, exist_ok=True)
    # under $MEMSERVER_HOME: the cluster's default checkpoint root
    with local_cluster(2) as cluster, MemoryClient(cluster.endpoint, timeout=120) as client, \
            tempfile.TemporaryDirectory(prefix="soak-", dir=memserver_home()) as ck:

        def sample(step: int) -> None:
            st = client.status()
            tables = [[t for t in sh.tables if t.table == TABLE] for sh in st.shards]
            samples.append({"step": step, "rss_mib": [sh.rss_bytes / 2**20 for sh in st.shards],
                            "remembered": [t[0].remembered if t else 0 for t in tables]})

        bar = tqdm(total=args.steps, unit="step", desc="soak")
        for rec in train(build_parser().parse_args(run_argv), client=client):
            step = rec["step"]
            bar.update(step - bar.n)
            if step % args.sample_every == 0:
                sample(step)
            if step % args.checkpoint_every == 0:
                r = client.checkpoint(ck, step, [TABLE])
                checkpoints.append({"step": step, "mib": r["bytes"] / 2**20})
        bar.close()
    shards = len(samples[0]["rss_mib"])
    after = [s for s in samples if s["step"] >= args.warmup]
    growth = [growth_per_100([s["step"] for s in after], [s["rss_mib"][i] for s in after]) for i in range(shards)]
    ck_sizes = [c["mib"] for c in checkpoints]
    targets = [target("soak", f"shard {i} RSS growth per 100 steps after step {args.warmup} (MiB)", g, TARGET_MIB,
                      higher_is_better=False, unit=" MiB") for i, g in enumerate(growth)]
    out = {"benchmark": "soak", "config": vars(args), "machine": machine(), "command": "memtrain " + " ".join(run_argv),
           "samples": samples, "checkpoints": checkpoints, "rss_growth_mib_per_100_steps": growth, "targets": targets}
    if args.json:
        print(json.dumps(out, indent=2))
        return out
    tbl = Table(title=f"soak: {out['command']}")
    for col in ("step", *(f"shard {i} RSS MiB" for i in range(shards)), "answers kept (per shard)"):
        tbl.add_column(col, justify="right")
    for s in samples:
        tbl.add_row(str(s["step"]), *(f"{r:.1f}" for r in s["rss_mib"]), " / ".join(map(str, s["remembered"])))
    console = Console(width=160)
    console.print(tbl)
    console.print("checkpoint size by step: " + ", ".join(f"{c['step']}: {c['mib']:.3f} MiB" for c in checkpoints)
                  + (f" (spread {max(ck_sizes) - min(ck_sizes):.4f} MiB)" if ck_sizes else ""))
    for t in targets:
        console.print(f"{t['what']}: {t['measured']} (target {t['target']}) {'PASS' if t['pass'] else 'MISS'}")
    return out


if __name__ == "__main__":
    main()
