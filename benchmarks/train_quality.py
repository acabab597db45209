"""Validation loss of the same transformer with no memory and with memory layers (values in this
process or in a 2-shard memserver cluster started here), at an equal step budget.

A run is `none`, `local` or `remote` (where the values live), optionally with memory kinds:
`local-lsh`, `remote-kif`, `local-engram`, `local-pkm+engram` (kinds joined by +; plain
`local`/`remote` are product keys). `--seeds 0,1` repeats every run per seed; `--data` picks the
corpus (a text file or the WikiText-2 folder).

    python -m benchmarks.train_quality --steps 1000 --out results/quality
    python -m benchmarks.train_quality --steps 1000 --runs none,local,local-lsh --out results/kinds
    python -m benchmarks.train_quality --steps 1000 --runs none,local,local-engram,local-pkm+engram --seeds 0,1 \
        --data data/wikitext-2 --out results/engram-wt2

Writes one JSON-lines log per run, summary.json and val_loss.png into --out, prints a table.
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import nullcontext
from pathlib import Path

from rich.console import Console
from rich.table import Table

from benchmarks.common import local_cluster, machine


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--out", default="results/quality")
    p.add_argument("--runs", default="none,local,remote", help="which memories to train, comma-separated")
    p.add_argument("--threads", type=int, default=0, help="torch threads per run (0: torch's default)")
    p.add_argument("--extra", default="", help="extra memtrain flags for the memory runs, e.g. '--mem-mode replace'")
    p.add_argument("--seeds", default="0", help="comma-separated seeds: every run once per seed")
    p.add_argument("--data", default=None, help="memtrain --data (default: tiny Shakespeare)")
    args = p.parse_args(argv)
    from client import MemoryClient
    from trainer.train import build_parser, train

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = ["--steps", str(args.steps), "--eval-every", str(args.eval_every), "--eval-iters", "20", "--log-every", "50",
            "--threads", str(args.threads), *(["--data", args.data] if args.data else [])]
    seeds = [int(x) for x in args.seeds.split(",")]
    summary: dict = {"machine": machine(), "steps": args.steps, "data": args.data or "tinyshakespeare", "runs": {}}
    names = [f"{m}-s{seed}" if len(seeds) > 1 else m for seed in seeds for m in args.runs.split(",")]
    remote = any(m.startswith("remote") for m in args.runs.split(","))
    with local_cluster(2) if remote else nullcontext() as cluster, \
            MemoryClient(cluster.endpoint) if remote else nullcontext() as client:
        for memory, seed in ((n.rsplit("-s", 1)[0] if len(seeds) > 1 else n, s) for n, s in
                             zip(names, [s for s in seeds for _ in args.runs.split(",")])):
            where, _, kind = memory.partition("-")
            argv_run = [*base, "--seed", str(seed), "--memory", where,
                        *(["--memory-kind", kind.replace("+", ",")] if kind else []),
                        *(args.extra.split() if where != "none" else [])]
            if len(seeds) > 1:
                memory = f"{memory}-s{seed}"
            log_path = out / f"{memory}.jsonl"
            t0 = time.perf_counter()
            recs = []
            with open(log_path, "w") as f:
                for rec in train(build_parser().parse_args(argv_run), client=client):
                    recs.append(rec)
                    f.write(json.dumps(rec) + "\n")
                    f.flush()
                    if "val_loss" in rec:
                        print(f"{memory:6s} step {rec['step']:5d} train {rec['loss']:.4f} val {rec['val_loss']:.4f} "
                              f"{rec['step_ms']:.0f} ms/step", flush=True)
            wall = time.perf_counter() - t0
            evals = [r for r in recs if "val_loss" in r]
            summary["runs"][memory] = {
                "command": "memtrain " + " ".join(argv_run),
                "wall_s": wall,
                "final_val_loss": evals[-1]["val_loss"],
                "best_val_loss": min(r["val_loss"] for r in evals),
                "mean_step_ms": sum(r["step_ms"] for r in recs[1:]) / max(1, len(recs) - 1),
                "usage": {k: v for k, v in evals[-1].items() if k.startswith(("mem", "lsh", "kif", "engram"))},
            }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot(out, names, summary["data"])
    t = Table(title=f"{summary['data']}, {args.steps} steps of 32x128 tokens")
    for col in ("memory", "final val loss", "best val loss", "ms/step", "wall s", "slots used", "KL(weights)"):
        t.add_column(col, justify="right")
    for memory, r in summary["runs"].items():
        used = next((f"{v:.1f}%" for k, v in r["usage"].items() if k.endswith("used_pct")), "-")
        kl = next((f"{v:.3f}" for k, v in r["usage"].items() if k.endswith("kl_weights")), "-")
        t.add_row(memory, f"{r['final_val_loss']:.4f}", f"{r['best_val_loss']:.4f}", f"{r['mean_step_ms']:.0f}",
                  f"{r['wall_s']:.0f}", used, kl)
    Console(width=140).print(t)
    return summary


def plot(out: Path, runs: list[str], data: str = "tiny Shakespeare") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for memory in runs:
        recs = [json.loads(x) for x in (out / f"{memory}.jsonl").read_text().splitlines()]
        ev = [r for r in recs if "val_loss" in r]
        ax.plot([r["step"] for r in ev], [r["val_loss"] for r in ev], marker="o", label=memory)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/char)")
    ax.set_title(f"char-level LM on {Path(data).name}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "val_loss.png", dpi=110)


if __name__ == "__main__":
    main()
