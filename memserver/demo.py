"""The end-to-end demo that `make demo` runs against the cluster `memserver up` started.

Part 1, the API: create value tables, write and read rows, then train the memory through the
remote path a memory layer uses: weighted bags on the shards (`bag`), dL/d(out) back
(`bag_backward`), which returns dL/dweights and makes the shards apply the sparse update.

Part 2, the product: train the same small character-level transformer on tiny Shakespeare
twice, without memory and with a product-key memory whose values live in the cluster, and print
the validation losses side by side.

Part 3, another kind of memory: SketchMem's warm-up (trainer.warmup), 1,000 random 50-bit
key -> value pairs that a small network cannot memorise alone, and can with an LSH sketch memory
whose buckets live in the cluster.

Part 4, inspection: part 2's trained memory, its slots traced over 100,000 characters of the
training text (`memtrain trace`), then `memserver usage` (with Geva et al.'s agreement against
random slots) and `memserver inspect` on a few slots, exactly as a user types them.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from client import MemoryClient


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m memserver.demo", description=__doc__)
    p.add_argument("--endpoint", help="coordinator HOST:PORT (default: the endpoint file)")
    p.add_argument("--rows", type=int, default=65536)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--knn", type=int, default=32)
    p.add_argument("--train-steps", type=int, default=300, help="LM training steps per model (0: skip part 2)")
    p.add_argument("--warmup-pairs", type=int, default=1000, help="pairs of the LSH warm-up (0: skip part 3)")
    p.add_argument("--trace-chars", type=int, default=100_000, help="characters traced for part 4 (0: skip it)")
    args = p.parse_args(argv)
    if args.steps < 2:  # (1 step compared the loss before the update with itself and failed; 0: IndexError)
        p.error(f"--steps: must be at least 2 (part 1 checks that the loss fell from its first step), got {args.steps}")
    console = Console(width=120)

    with MemoryClient(args.endpoint) as client:
        console.print(f"connected to memserver at [bold]{client.endpoint}[/]")
        _drop_own_tables(client)
        try:
            _parts(client, args, console)
        except BaseException:
            # a failed or interrupted demo leaves none of its tables behind; its own error is the one raised
            with contextlib.suppress(Exception):
                _drop_own_tables(client)
            raise
    console.print("[bold green]demo finished[/]")
    return 0


def _drop_own_tables(client: MemoryClient, prefix: str = "demo-") -> None:
    """The demo's tables only: the cluster may hold the user's."""
    for t in client.list_tables():
        if t.name.startswith(prefix):
            client.drop_table(t.name)


def _parts(client: MemoryClient, args: argparse.Namespace, console: Console) -> None:
    """Parts 1 to 4 (see the module docstring)."""
    rng = np.random.default_rng(0)
    results = Table(title="remote memory training (bag -> loss -> bag_backward)")
    for col in ("table", "sharding", "optimizer", "first loss", "last loss", "bag ms", "bag_backward ms"):
        results.add_column(col, justify="left" if col in ("table", "sharding", "optimizer") else "right")
    # A fixed set of queries, each a weighted bag of knn slots, must learn to produce a target.
    ids = rng.integers(0, args.rows, size=(args.batch, args.knn))
    logits = rng.normal(size=(args.batch, args.knn)).astype(np.float32)
    weights = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    target = rng.normal(size=(args.batch, args.dim)).astype(np.float32)

    for sharding, optimizer, lr in (("cols", "adagrad", 0.05), ("rows", "adam", 0.01)):
        name = f"demo-{sharding}-{optimizer}"
        meta = client.create_table(name, args.rows, args.dim, sharding=sharding, optimizer=optimizer, lr=lr, seed=1)
        console.print(
            f"created [bold]{name}[/]: {meta.num_rows:,} x {meta.dim} float32 "
            f"({meta.num_rows * meta.dim * 4 / 2**20:.0f} MiB) over {len(meta.shards)} shards, sharding={meta.sharding}"
        )
        # write_rows / lookup round trip
        probe = np.arange(8)
        rows = rng.normal(size=(8, args.dim)).astype(np.float32)
        client.write_rows(name, probe, rows)
        assert np.allclose(client.lookup(name, probe), rows), "lookup must return what write_rows wrote"

        losses, t_bag, t_bwd = [], 0.0, 0.0
        for _ in range(args.steps):
            t0 = time.perf_counter()
            out = client.bag(name, ids, weights)
            t1 = time.perf_counter()
            diff = out - target
            losses.append(float((diff**2).mean()))
            grad_out = (2.0 / diff.size) * diff * args.batch  # d(mean sq)/d(out), scaled per query
            client.bag_backward(name, ids, weights, grad_out.astype(np.float32))
            t_bag, t_bwd = t_bag + t1 - t0, t_bwd + time.perf_counter() - t1
        assert losses[-1] < losses[0], f"{name}: loss did not fall ({losses[0]:.4f} -> {losses[-1]:.4f})"
        results.add_row(
            name, sharding, optimizer, f"{losses[0]:.4f}", f"{losses[-1]:.4f}",
            f"{1e3 * t_bag / args.steps:.1f}", f"{1e3 * t_bwd / args.steps:.1f}",
        )
        stats = client.slot_stats(name, ids[0, :5])
        slots = Table(title=f"slot stats of {name} (first query's slots)")
        for col in ("slot", "hits", "weight mass", "updates", "value norm"):
            slots.add_column(col, justify="right")
        for i, slot in enumerate(ids[0, :5]):
            slots.add_row(str(slot), str(stats["hits"][i]), f"{stats['weight_mass'][i]:.3f}",
                          str(stats["updates"][i]), f"{stats['value_norm'][i]:.3f}")
        console.print(slots)
    console.print(results)
    st = client.status()
    console.print(f"cluster: {len(st.shards)} shards, {len(st.tables)} tables, "
                  f"{sum(s.requests for s in st.shards):,} data-plane requests served")
    for t in st.tables:  # its own tables only: the cluster may hold the user's
        if t.spec.name.startswith("demo-"):
            client.drop_table(t.spec.name)
    if args.train_steps:
        from memserver.cluster.endpoint import memserver_home

        # under $MEMSERVER_HOME: the cluster's checkpoint root, where the trainer's memory checkpoint may go
        with tempfile.TemporaryDirectory(prefix="demo-run-", dir=memserver_home()) as ckpt:
            train_comparison(client, args.train_steps, console, ckpt)
            if args.trace_chars:
                inspection(client, ckpt, args.trace_chars, console)
        client.drop_table("demo-pkm")
    if args.warmup_pairs:
        lsh_warmup(client, args.warmup_pairs, console)


def train_comparison(client: MemoryClient, steps: int, console: Console, checkpoint_dir: str) -> None:
    """The same transformer with and without a remote product-key memory, same seed and data
    (the memory run checkpointed into `checkpoint_dir`, for part 4)."""
    from trainer.train import build_parser, train

    common = ["--steps", str(steps), "--eval-every", str(max(1, steps // 3)), "--eval-iters", "10", "--log-every", "50"]
    runs = {
        "no memory": [*common, "--memory", "none"],
        "remote PKM (16k slots, beside FFN of block 2)": [*common, "--memory", "remote", "--table", "demo-pkm",
                                                           "--mem-layers", "2", "--n-keys", "128", "--value-lr", "0.01", "--staleness", "1",
                                                           "--checkpoint-dir", checkpoint_dir],
    }
    table = Table(title=f"char-level LM on tiny Shakespeare, {steps} steps of 32x128 tokens")
    for col in ("model", "val loss", "train loss", "ms/step", "tokens/s", "slots used"):
        table.add_column(col, justify="left" if col == "model" else "right")
    finals = {}
    for label, argv in runs.items():
        console.print(f"training [bold]{label}[/] ...")
        last: dict = {}
        # the steps' own time: each record's step_ms is the mean over the steps since the record before
        # (the wall time it was taken from counted the model's build and the evaluations too)
        step_ms, done = 0.0, 0
        for rec in train(build_parser().parse_args(argv), client=client):
            last = rec
            step_ms, done = step_ms + rec["step_ms"] * (rec["step"] - done), rec["step"]
            if "val_loss" in rec:
                console.print(f"  step {rec['step']:4d}  train {rec['loss']:.3f}  val {rec['val_loss']:.3f}  {rec['step_ms']:.0f} ms/step")
        finals[label] = last["val_loss"]
        used = next((f"{v:.1f}%" for k, v in last.items() if k.endswith("_used_pct")), "-")
        table.add_row(label, f"{last['val_loss']:.4f}", f"{last['loss']:.4f}", f"{step_ms / done:.0f}",
                      f"{last['tokens_per_s']:,.0f}", used)
    console.print(table)


def inspection(client: MemoryClient, checkpoint_dir: str, chars: int, console: Console) -> None:
    """Trace the trained memory, then the commands a user inspects it with."""
    from memserver.cli import main as memserver
    from trainer.data import load_corpus
    from trainer.inspection import Inspector, slot_report, trace

    inspector = Inspector.load(checkpoint_dir, client)
    console.print(f"[bold]$ memtrain trace --checkpoint CKPT --table demo-pkm --tokens {chars}[/]")
    got = trace(inspector, client, "demo-pkm", load_corpus().train[: chars + 1], progress=False)
    console.print(f"traced {got['positions']:,} positions: {got['slots']:,} slots hold trigger contexts")
    endpoint = ["--endpoint", client.endpoint]
    from memserver.cluster.endpoint import memserver_home

    plot = str(memserver_home() / "demo-usage.png")
    console.print(f"[bold]$ memserver usage demo-pkm --agreement --plot {plot}[/]")
    memserver(["usage", "demo-pkm", "--agreement", "--plot", plot, *endpoint])
    # the two slots holding the most read weight, and among the 50 most-read slots the one whose
    # projected tokens agree most with its triggers' next tokens (the selection is stated, not hidden)
    hot, _ = client.top_slots("demo-pkm", "mass", 2)
    top50, _ = client.top_slots("demo-pkm", "hits", 50)
    agree = sorted(((slot_report(client, "demo-pkm", int(s), inspector).get("agreement", 0.0), -int(s)) for s in top50
                    if int(s) not in set(hot.tolist())), reverse=True)
    best = -agree[0][1]
    for slot, why in [*((int(s), "holds the most read weight") for s in hot), (best, "agrees most, of the 50 most read")]:
        console.print(f"[bold]$ memserver inspect demo-pkm {slot}[/]   ({why})")
        memserver(["inspect", "demo-pkm", str(slot), *endpoint])


def lsh_warmup(client: MemoryClient, pairs: int, console: Console) -> None:
    """Memorise random 50-bit pairs: the plain network against one with remote LSH memories."""
    from trainer.warmup import WarmupConfig, run_one

    cfg = WarmupConfig(batch_size=500, lr=3e-3)  # large batches: few calls, same memorisation
    table = Table(title=f"SketchMem warm-up: memorise {pairs:,} random 50-bit key -> value pairs "
                        f"(depth 3, width 50, {cfg.epochs} epochs)")
    for col in ("network", "bit accuracy", "exact match", "seconds"):
        table.add_column(col, justify="left" if col == "network" else "right")
    rows = {}
    try:
        for kind, label in (("none", "plain"), ("lsh-remote", f"+ LSH memory per layer ({cfg.hashes} x 2^{cfg.bits} buckets, in the cluster)")):
            console.print(f"training [bold]{label}[/] ...")
            rows[kind] = r = run_one(kind, pairs, cfg, client)
            table.add_row(label, f"{r['bit_acc']:.4f}", f"{r['exact']:.4f}", f"{r['seconds']:.0f}")
    except BaseException:
        with contextlib.suppress(Exception):  # (as main's: none left behind, the run's error raised)
            _drop_own_tables(client, "warmup-")
        raise
    console.print(table)
    _drop_own_tables(client, "warmup-")
    assert rows["lsh-remote"]["exact"] > rows["none"]["exact"] + 0.5, "the LSH memory should memorise the pairs"


if __name__ == "__main__":
    raise SystemExit(main())
