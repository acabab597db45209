"""Where a memory layer's time goes: each kind's stages timed alone, at memtrain's default shapes.

One memory layer of each kind (product keys, LSH, KIF) with its values in this process, on
N = 32 x 128 = 4,096 positions of width 128 (memtrain's batch), stage by stage: `queries` (the
query network: PKM's linear + BatchNorm, KIF's f_E; LSH has none), addressing (PKM's key
scoring and top-k, LSH's hashing, KIF's faiss search), the read (the bag from the value
table and, for LSH, the sketch that combines the hashes' buckets; KIF's softmax-weighted sum of
the returned encodings), `output` (KIF's gate and projection; nothing for the others) and the backward of all of it (for PKM and LSH this includes the value table's
dL/dweights and sparse update). Timings are p50 over --repeat calls; the whole-step cost beside a
model without memory is benchmarks.train_step's.

`--profile` breaks one product-key layer down further, at memtrain's defaults, next to the whole
memtrain step without memory and with local memory (the same steps memtrain takes, on its data):
each stage of the layer's forward and backward is timed on its own (its inputs prepared
beforehand), so the rows say what each costs, and their sum can be set against the measured
difference between the two whole steps.

    python -m benchmarks.layer_cost [--repeat 10] [--json]
    python -m benchmarks.layer_cost --profile [--repeat 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
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


#: --profile's stages, in the order a step runs them: (name, what it covers).
PROFILE_STAGES = (
    ("queries", "query network: Linear + BatchNorm"),
    ("address", "key scores, top-k of each half and of the candidate sums, softmax"),
    ("read", "bag forward (the layer's autograd function over the value table)"),
    ("usage", "slot statistics of the read (hits, weight mass; the shards count every read)"),
    ("bag backward", "dL/dweights from the table, and the step's update entries"),
    ("address backward", "dL/dweights -> dL/dscores -> dL/dqueries, dL/dkeys"),
    ("queries backward", "through the BatchNorm and the Linear"),
    ("value update", "the sparse Adam step over the read rows (end_step)"),
)


def _memtrain_step(memory: str, threads: int) -> tuple[Any, Any]:
    """(one memtrain training step at its defaults as a callable, the Run): the same calls as
    trainer.train.train's loop, on the default corpus."""
    from trainer.data import get_batch
    from trainer.train import build_parser, setup

    args = build_parser().parse_args(["--memory", memory, "--threads", str(threads)])
    run = setup(args)
    opt = torch.optim.AdamW([p for p in run.model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)

    def step() -> None:
        x, y = get_batch(run.corpus.train, args.batch_size, args.block_size, gen)
        for b in run.values.values():
            b.begin_step(0)
        _, loss = run.model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for b in run.values.values():
            b.end_step(0)
        opt.step()

    return step, run


def profile(repeat: int, threads: int) -> dict[str, Any]:
    """Each stage of memtrain's product-key layer (block 2, local values) timed alone, round robin
    with the whole memtrain step without memory and with it; p50 ms of each."""
    from memserver.core.steps import bag_entries
    from memserver.core.table import ValueTable

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    step_none, _ = _memtrain_step("none", threads)
    step_local, run = _memtrain_step("local", threads)
    layer = run.model.memories()["mem2"]
    assert isinstance(layer, ProductKeyMemory)
    backend = layer.values
    table = backend.table
    counted = ValueTable(table.num_rows, table.dim, table.optimizer, track_stats=True)  # a shard's table counts reads
    seen: dict[str, torch.Tensor] = {}
    hook = layer.register_forward_hook(lambda m, a, out: seen.__setitem__("x", a[0].detach().reshape(-1, a[0].shape[-1])))
    for _ in range(2):
        step_local()
    hook.remove()
    x = seen["x"]  # the layer's real input: block 2's normalised hidden state [4096, 128]
    g = torch.randn(x.shape[0], table.dim) * 1e-3  # a dL/d(read) of the order the model's gradients have

    def queries() -> Callable[[], Any]:
        xx = x.clone().requires_grad_()
        return lambda: layer.queries(xx)

    def q_graph() -> tuple[torch.Tensor, torch.Tensor]:
        xx = x.clone().requires_grad_()
        q = layer.queries(xx)
        return xx, q

    def address() -> Callable[[], Any]:
        q = layer.queries(x).detach().requires_grad_()
        return lambda: layer.address(q)

    def read() -> Callable[[], Any]:
        q = layer.queries(x).detach().requires_grad_()
        ids, w = layer.address(q)
        return lambda: layer.finish(q, (ids, w, None))

    def addressed() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return layer.address(layer.queries(x))

    def usage() -> Callable[[], Any]:
        ids, w = addressed()
        return lambda: counted._count_reads(ids, w)

    def bag_backward() -> Callable[[], Any]:
        ids, w = addressed()
        return lambda: (table.bag_grad(ids, w, None, g)[0], bag_entries(ids, w, None, g))

    def address_backward() -> Callable[[], Any]:
        q = layer.queries(x).detach().requires_grad_()
        _, w = layer.address(q)
        gw = torch.randn_like(w) * 1e-3
        return lambda: torch.autograd.backward(w, gw)

    def queries_backward() -> Callable[[], Any]:
        _, q = q_graph()
        gq = torch.randn_like(q) * 1e-3
        return lambda: torch.autograd.backward(q, gq)

    def value_update() -> Callable[[], Any]:
        ids, w = addressed()
        entries = bag_entries(ids, w, None, g)
        return lambda: table.apply_entries(*entries)

    def whole_layer() -> Callable[[], Any]:
        xx = x.clone().requires_grad_()

        def run_layer() -> None:
            backend.begin_step(0)
            layer(xx).backward(g)
            backend.end_step(0)
        return run_layer

    prepare: dict[str, Callable[[], Callable[[], Any]]] = {
        "queries": queries, "address": address, "read": read, "usage": usage, "bag backward": bag_backward,
        "address backward": address_backward, "queries backward": queries_backward, "value update": value_update,
        "memory layer, forward + backward": whole_layer,
        "memtrain step, no memory": lambda: step_none, "memtrain step, local memory": lambda: step_local,
    }
    times: dict[str, list[float]] = {k: [] for k in prepare}
    layer.zero_grad(set_to_none=True)
    for r in range(repeat + 2):  # round robin: the machine's load falls on every stage alike
        for name, prep in prepare.items():
            fn = prep()
            t0 = time.perf_counter()
            fn()
            if r >= 2:
                times[name].append(1e3 * (time.perf_counter() - t0))
            layer.zero_grad(set_to_none=True)
    return {k: statistics.median(v) for k, v in times.items()}


def print_profile(res: dict[str, float], repeat: int, threads: int) -> None:
    from rich.console import Console
    from rich.table import Table

    none, local = res["memtrain step, no memory"], res["memtrain step, local memory"]
    t = Table(title=f"memtrain's product-key layer (block 2: 128^2 slots x 128, 4 heads x knn 32, {N:,} positions, "
                    f"local values), p50 ms over {repeat}, {threads} threads")
    for col in ("stage", "what", "ms", "% of the no-memory step"):
        t.add_column(col, justify="left" if col in ("stage", "what") else "right")
    for name, what in PROFILE_STAGES:
        t.add_row(name, what, f"{res[name]:.1f}", f"{100 * res[name] / none:.1f}")
    t.add_row("sum of the stages", "", f"{sum(res[k] for k, _ in PROFILE_STAGES):.1f}",
              f"{100 * sum(res[k] for k, _ in PROFILE_STAGES) / none:.1f}")
    t.add_row("memory layer", "forward + backward + value update, measured whole",
              f"{res['memory layer, forward + backward']:.1f}",
              f"{100 * res['memory layer, forward + backward'] / none:.1f}")
    t.add_row("memtrain step, no memory", "--memory none", f"{none:.1f}", "100.0")
    t.add_row("memtrain step, local memory", "--memory local", f"{local:.1f}", f"{100 * local / none:.1f}")
    Console(width=160).print(t)
    print(f"local / no memory: {local / none:.2f}x")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kif-sentences", type=int, default=4096)
    p.add_argument("--json", action="store_true")
    p.add_argument("--profile", action="store_true", help="the product-key layer stage by stage, beside whole memtrain steps")
    args = p.parse_args(argv)
    if args.profile:
        prof = profile(args.repeat, args.threads)
        if args.json:
            print(json.dumps(prof, indent=2))
        else:
            print_profile(prof, args.repeat, args.threads)
        return prof
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
