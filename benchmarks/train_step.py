"""memtrain step time: remote memory against local memory, side by side in one run.

What a user of memserver pays per training step for keeping the memory values outside the
trainer. Same config as memtrain's defaults (4 layers, d=128, n_keys 128, 4 heads, knn 32,
batch 32 x 128 tokens, memory beside the FFN of block 2). Runs: no memory (reference), local
memory (the same `ValueTable` in this process), remote memory (2 shards, cols), remote with
`--staleness 1` (the shards apply the update after answering) and remote with
`--micro-batches 2` (one chunk's call overlaps the next chunk's addressing); then the other
kinds, local and remote: LSH sketch memory (4 x 2^12 buckets, the same 16,384 slots) and KIF
(4,096 training sentences encoded with all-MiniLM-L6-v2, 8 hits per position; the first run
encodes them, later ones read the cache); and remote product keys with live tracing of trigger
contexts (`--trace-every 1` and `10`, 5% of the positions), compared with plain remote; and
Engram (orders 2,3 x 4 hash heads, 65,536 rows of 32 floats: the product-key default's bytes)
locally, remotely with its reads prefetched (exact, and `--staleness 1`), remotely without the
prefetch, remotely with each step's commit waited for (`--sync-commit`; memtrain's default sends
it and goes on), and locally with a table 8x the product-key default's bytes (524,288 rows). Each
remote run is compared with the local run of its kind, and every run with no memory.

The runs are advanced in blocks of --block steps, round robin, so background load on the
shared machine falls on all of them alike; the first block's first --warmup steps and the first
step of every later block (which follows another run's steps) are not counted. No evaluation
runs (the generators are closed before their last step). step_ms is memtrain's own timer
(forward + backward + optimizer step).

    python -m benchmarks.train_step [--blocks 4 --block 11 --warmup 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.common import local_cluster, machine, print_targets, round_robin_steps, target

#: Target: remote step time at most this multiple of local; with `--staleness 1` (the shards are
#: on this machine: the client sends the tensors through shared memory) at most TARGET_STALE.
TARGET, TARGET_STALE = 1.3, 1.1
#: Targets against the same model without memory (issue 15: a memory layer that costs little).
TARGETS_VS_NONE = {"local": 1.3, "remote staleness 1": 1.4, "local engram": 1.2}
#: Engram (issue 25): its prefetched remote reads cost what local ones do; a table 8x larger costs the same.
TARGETS_ENGRAM = {"remote engram / local engram": 1.05, "remote engram staleness 1 / local engram": 1.02,
                  "local engram 8x / local engram": 1.05}

RUNS: dict[str, list[str]] = {
    "none": ["--memory", "none"],
    "local": ["--memory", "local"],
    "remote": ["--memory", "remote"],
    "remote staleness 1": ["--memory", "remote", "--staleness", "1"],
    "remote micro-batches 2": ["--memory", "remote", "--micro-batches", "2"],
    "local lsh": ["--memory", "local", "--memory-kind", "lsh"],
    "remote lsh": ["--memory", "remote", "--memory-kind", "lsh"],
    "local kif": ["--memory", "local", "--memory-kind", "kif"],
    "remote kif": ["--memory", "remote", "--memory-kind", "kif"],
    # live tracing of trigger contexts (5% of a batch's positions), every step and every 10th
    "remote trace 1": ["--memory", "remote", "--trace-every", "1", "--trace-sample", "0.05"],
    "remote trace 10": ["--memory", "remote", "--trace-every", "10", "--trace-sample", "0.05"],
    # Engram: reads prefetched as soon as the batch is drawn (exact by default)
    "local engram": ["--memory", "local", "--memory-kind", "engram"],
    "remote engram": ["--memory", "remote", "--memory-kind", "engram"],
    "remote engram staleness 1": ["--memory", "remote", "--memory-kind", "engram", "--staleness", "1"],
    "remote engram no prefetch": ["--memory", "remote", "--memory-kind", "engram", "--no-prefetch"],
    "remote engram sync commit": ["--memory", "remote", "--memory-kind", "engram", "--sync-commit"],
    "local engram 8x": ["--memory", "local", "--memory-kind", "engram", "--engram-slots", str(8 * 65536)],
}


def local_of(run: str) -> str:
    """The local run a remote run compares with: the same memory kind, in this process."""
    kind = run.split()[1] if len(run.split()) > 1 and run.split()[1] in ("lsh", "kif", "engram") else ""
    return f"local {kind}".strip()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=4, help="rounds of the round robin")
    p.add_argument("--block", type=int, default=11, help="consecutive steps of one run per round")
    p.add_argument("--warmup", type=int, default=3, help="uncounted steps at the start of each run")
    p.add_argument("--runs", default=",".join(RUNS), help="comma-separated subset of: " + ", ".join(RUNS))
    p.add_argument("--max-seconds", type=float, default=600.0, help="stop starting new blocks after this")
    p.add_argument("--threads", type=int, default=0, help="memtrain --threads of every run (0: torch's default)")
    p.add_argument("--quick", action="store_true", help="2 blocks of 6 steps, 2 warm-up")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.blocks, args.block, args.warmup = min(args.blocks, 2), min(args.block, 6), min(args.warmup, 2)
        args.max_seconds = min(args.max_seconds, 150.0)
    import time

    from client import MemoryClient
    from trainer.train import build_parser, train

    names = [r.strip() for r in args.runs.split(",") if r.strip()]
    total = args.blocks * args.block
    commands: dict[str, str] = {}
    t_end = time.perf_counter() + args.max_seconds
    with local_cluster(2) as cluster, MemoryClient(cluster.endpoint, timeout=120) as client:
        gens = {}
        for i, n in enumerate(names):
            # --steps beyond what we run: memtrain evaluates at its last step, which we never reach
            run_argv = [*RUNS[n], "--steps", str(total + 1000), "--eval-every", "1000000", "--log-every", "1",
                        *(["--threads", str(args.threads)] if args.threads else []), "--table", f"bench-train-{i}"]
            commands[n] = "memtrain " + " ".join(run_argv[:-2])
            gens[n] = train(build_parser().parse_args(run_argv), client=client)
        try:
            step_ms = round_robin_steps(gens, args.blocks, args.block, args.warmup, until=t_end)
        finally:
            for gen in gens.values():
                gen.close()  # runs memtrain's cleanup
    res = {n: {"p50_ms": statistics.median(v), "mean_ms": statistics.fmean(v), "min_ms": min(v), "n": len(v),
               "command": commands[n]} for n, v in step_ms.items()}
    ms = {n: r["p50_ms"] for n, r in res.items()}
    ratios: dict[str, float] = {}
    for n in names:
        if n.startswith("remote") and local_of(n) in ms:
            ratios[f"{n} / {local_of(n)}"] = ms[n] / ms[local_of(n)]
    for n in names:
        if "trace" in n and "remote" in ms:
            ratios[f"{n} / remote"] = ms[n] / ms["remote"]
    if "none" in ms:
        for n in names:
            if n != "none":
                ratios[f"{n} / none"] = ms[n] / ms["none"]
    targets = [target("train_step", f"{n} / local (ms/step)", ms[n] / ms["local"],
                      TARGET_STALE if n == "remote staleness 1" else TARGET, higher_is_better=False)
               for n in names if n.startswith("remote") and local_of(n) == "local" and "local" in ms]
    targets += [target("train_step", f"{n} / none (ms/step)", ms[n] / ms["none"], limit, higher_is_better=False)
                for n, limit in TARGETS_VS_NONE.items() if n in ms and "none" in ms]
    for what, limit in TARGETS_ENGRAM.items():
        a, b = what.split(" / ")
        if a in ms and b in ms:
            ratios.setdefault(what, ms[a] / ms[b])
            targets.append(target("train_step", f"{what} (ms/step)", ms[a] / ms[b], limit, higher_is_better=False))
    out = {"benchmark": "train_step", "config": vars(args), "machine": machine(), "results": res, "ratios": ratios,
           "targets": targets}
    if args.json:
        print(json.dumps(out, indent=2))
        return out
    tbl = Table(title=f"memtrain step (defaults: 4 layers, d=128, PKM 128^2 x 128, 4 heads x knn 32, batch 32x128); "
                      f"{args.blocks} blocks of {args.block} steps round robin")
    for col in ("run", "steps counted", "p50 ms/step", "mean ms/step", "x local (same kind)", "x none"):
        tbl.add_column(col, justify="right")
    for n, r in res.items():
        tbl.add_row(n, str(r["n"]), f"{r['p50_ms']:.1f}", f"{r['mean_ms']:.1f}",
                    f"{r['p50_ms'] / ms[local_of(n)]:.2f}" if n != "none" and local_of(n) in ms else "-",
                    f"{r['p50_ms'] / ms['none']:.2f}" if "none" in ms else "-")
    console = Console(width=160)
    console.print(tbl)
    for k, v in ratios.items():
        if "trace" in k and k.endswith("/ remote"):
            console.print(f"{k}: {v:.3f}x")
    print_targets(targets, console.print)
    return out


if __name__ == "__main__":
    main()
