"""A new user's own small model: step time with remote memory values against local ones (issue 26).

Not memtrain: the few lines a user who read trainer/memory would write for a model of their own.
A token embedding (d=64), one product-key memory layer (trainer.memory.ProductKeyMemory: 128^2
slots of 64 floats, 4 heads x knn 32, its queries through a BatchNorm), added to the embedding,
and a linear head; a batch of 128 tokens, cross-entropy against a fixed token-to-token map the
memory can learn. Each step: the backend's begin_step, forward (a bag), backward (a
bag_backward: the values' update gathered, dL/dweights back), the backend's deliver and
end_step (the commit: one optimizer step of the values, `end_step(step)`, which waits for it, as
a user calling the backend's defaults gets), then AdamW on the dense parameters.

Runs (each its own model, the same initial weights and batches, so their losses must agree: the
run fails where a remote one's is more than LOSS_TOLERANCE from local's):

- local: `LocalValues` (the table in this process, torch's default threads);
- remote: `RemoteValues` on a local cluster of 2 shards (benchmarks.common.local_cluster), the
  client with shared memory and the shards' doorbells (the default on one machine);
- remote, doorbell off: the same through gRPC with shared memory (`MEMSERVER_DOORBELL=0`'s path:
  `ShmTransport.doorbell = False`);
- remote, commit in flight: the doorbell client, `end_step(step, wait=False)` (memtrain's
  default: the commit goes out, the next step's read waits for it).

They are advanced in blocks of --block steps, round robin, so the background load of a shared
machine falls on all alike; the first block's first --warmup steps and the first step of every
later block are not counted. A step's time is wall time from begin_step to the end of end_step.
Target (issue 26): remote step time at most 2x local. Beside it, per step: the shards' CPU time
and their context switches (both shard processes, every thread; a switch is a thread put to sleep
or woken: on few cores, what each hand-off on a call's path costs), and this process's CPU time,
all of it and that of its threads other than the one stepping (torch's and numba's OpenMP
workers, the client's threads): a worker spinning while the step waits for the shards shows
there as CPU time the step did not use.

On a machine with few cores the trainer's own torch threads matter: libgomp's threads spin on
the cores for a while after each parallel op (OMP_WAIT_POLICY unset: active), while the shards
(Ray workers, nice 15) wait for a core to answer the call the step is blocked on. The policy in
force is printed; `OMP_WAIT_POLICY=PASSIVE python -m benchmarks.small_model` shows the step
without the spinning (it must be set before the process starts).

    python -m benchmarks.small_model [--blocks 6 --block 21 --warmup 5] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from benchmarks.common import (
    context_switches,
    cpu_seconds,
    info,
    local_cluster,
    machine,
    print_targets,
    round_robin_steps,
    target,
)

#: Target (issue 26): remote step time at most this multiple of local.
TARGET = 2.0
#: The largest |remote loss - local loss| at any step: the same math, with float32 sums in another
#: order (this process's torch threads, a shard's one) an ulp apart (<= 1e-6 for 100 steps), and
#: once a near-tie in the keys' top-k falls the other way, up to 3.4e-4 by step 126 (the default
#: run's last; 7.5e-4 by step 200; measured in process); one commit lost moves the next loss by 2e-3.
LOSS_TOLERANCE = 1e-3
RUNS = ("local", "remote", "remote, doorbell off", "remote, commit in flight")
VOCAB, D, N_KEYS, HEADS, KNN, K_DIM, BATCH = 512, 64, 128, 4, 32, 64, 128


class SmallModel(nn.Module):
    """Embedding -> + product-key memory -> linear head."""

    def __init__(self, values: Any, vocab: int = VOCAB, d: int = D) -> None:
        from trainer.memory import ProductKeyMemory

        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.memory = ProductKeyMemory(d, d, values, n_keys=N_KEYS, heads=HEADS, k_dim=K_DIM, knn=KNN)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        return self.head(h + self.memory(h))


def steps(values: Any, seed: int = 0, wait: bool = True) -> Iterator[dict[str, Any]]:
    """Train a SmallModel on `values`, one step per next(): {"step_ms", "loss"}."""
    torch.manual_seed(seed)
    model = SmallModel(values)
    opt = torch.optim.AdamW([p for p in model.parameters()], lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    target_of = torch.randperm(VOCAB, generator=gen)  # what each token should predict
    step = 0
    try:
        while True:
            step += 1
            x = torch.randint(0, VOCAB, (BATCH,), generator=gen)
            t0 = time.perf_counter()
            values.begin_step(step)
            loss = F.cross_entropy(model(x), target_of[x])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            values.deliver()
            values.end_step(step, wait=wait)
            opt.step()
            yield {"step_ms": (time.perf_counter() - t0) * 1e3, "loss": float(loss.detach())}
    finally:
        values.settle()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=6, help="rounds of the round robin")
    p.add_argument("--block", type=int, default=21, help="consecutive steps of one run per round")
    p.add_argument("--warmup", type=int, default=5, help="uncounted steps at the start of each run")
    p.add_argument("--max-seconds", type=float, default=300.0, help="stop starting new rounds after this")
    p.add_argument("--quick", action="store_true", help="3 blocks of 11 steps, 3 warm-up")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.blocks, args.block, args.warmup = min(args.blocks, 3), min(args.block, 11), min(args.warmup, 3)
        args.max_seconds = min(args.max_seconds, 60.0)
    from client import MemoryClient
    from trainer.memory import LocalValues, RemoteValues

    rows = N_KEYS**2
    t_end = time.perf_counter() + args.max_seconds
    with (local_cluster(2) as cluster, MemoryClient(cluster.endpoint, timeout=120) as bell_client,
          MemoryClient(cluster.endpoint, timeout=120) as grpc_client):
        # $MEMSERVER_DOORBELL is read when a client is made and used from its first attach: set here
        bell_client.aio.shm.doorbell, grpc_client.aio.shm.doorbell = True, False
        backends = {
            "local": LocalValues(rows, D, seed=0),
            "remote": RemoteValues(bell_client, "bench-small-model-0", rows, D, seed=0),
            "remote, doorbell off": RemoteValues(grpc_client, "bench-small-model-1", rows, D, seed=0),
            "remote, commit in flight": RemoteValues(bell_client, "bench-small-model-2", rows, D, seed=0),
        }
        gens = {n: steps(b, wait=n != "remote, commit in flight") for n, b in backends.items()}
        losses: dict[str, list[float]] = {n: [] for n in gens}

        pids = [sh["pid"] for sh in cluster.shard_infos]

        def counters() -> tuple[float, int, float, float]:
            # (the steps run on this thread: process_time - thread_time is every other thread of
            # this process: torch's and numba's pools, the client's)
            return (sum(map(cpu_seconds, pids)), sum(map(context_switches, pids)), time.process_time(),
                    time.thread_time())

        def recorded(name: str) -> Iterator[dict[str, Any]]:
            """The run's steps with the shards' CPU and switches, and this process's CPU, since this
            run's last step: read once a step (a block's first step, which follows another run's, is
            not counted anyway)."""
            last = counters()
            while True:
                rec = next(gens[name])
                now = counters()
                rec["shard_cpu_ms"], rec["shard_switches"] = (now[0] - last[0]) * 1e3, now[1] - last[1]
                rec["cpu_ms"], rec["main_cpu_ms"] = (now[2] - last[2]) * 1e3, (now[3] - last[3]) * 1e3
                last = now
                losses[name].append(rec["loss"])
                yield rec

        try:
            counted = round_robin_steps({n: recorded(n) for n in gens}, args.blocks, args.block, args.warmup,
                                        until=t_end, key="step_ms,shard_cpu_ms,shard_switches,cpu_ms,main_cpu_ms")
        finally:
            for gen in gens.values():
                gen.close()
        shm = {"remote": bell_client.aio.shm, "remote, doorbell off": grpc_client.aio.shm}
        rung = {n: s.bell_calls for n, s in shm.items()}
        shm_calls = {n: s.calls for n, s in shm.items()}
        for n in ("bench-small-model-0", "bench-small-model-1", "bench-small-model-2"):
            bell_client.drop_table(n)
    if rung["remote"] == 0 or rung["remote, doorbell off"] != 0:
        raise RuntimeError(f"calls by the doorbells: {rung} (the doorbell client must use them, the other not)")
    done = min(len(v) for v in losses.values())
    loss_diff = max(abs(losses[n][i] - losses["local"][i]) for n in losses for i in range(done))
    if loss_diff > LOSS_TOLERANCE:
        raise RuntimeError(f"remote losses differ from local by {loss_diff:.2e} (at most {LOSS_TOLERANCE:g}): "
                           "not the same math")
    step_ms = {n: [r[0] for r in v] for n, v in counted.items()}
    res = {n: {"p50_ms": statistics.median(v), "mean_ms": statistics.fmean(v), "min_ms": min(v), "n": len(v),
               "shard_cpu_ms": statistics.fmean(r[1] for r in counted[n]),
               "shard_switches": statistics.fmean(r[2] for r in counted[n]),
               "trainer_cpu_ms": statistics.fmean(r[3] for r in counted[n]),
               "trainer_other_threads_cpu_ms": statistics.fmean(r[3] - r[4] for r in counted[n])}
           for n, v in step_ms.items()}
    ms = {n: r["p50_ms"] for n, r in res.items()}
    targets = [target("small_model", "remote (doorbell) / local, small model step (ms/step)", ms["remote"] / ms["local"],
                      TARGET, higher_is_better=False),
               info("small_model", "remote, doorbell off (gRPC + shared memory) / local (ms/step)",
                    ms["remote, doorbell off"] / ms["local"]),
               info("small_model", "remote, commit in flight / local (ms/step)", ms["remote, commit in flight"] / ms["local"]),
               info("small_model", "local step, ms", ms["local"], unit=" ms")]
    ratios = {f"{n} / local": ms[n] / ms["local"] for n in ms if n != "local"}
    ratios["remote, doorbell off / remote"] = ms["remote, doorbell off"] / ms["remote"]
    out = {"benchmark": "small_model", "config": vars(args), "machine": machine(), "results": res, "ratios": ratios,
           "steps_run": done, "max_loss_diff_vs_local": loss_diff, "doorbell_calls": rung, "shm_calls": shm_calls,
           "model": {"vocab": VOCAB, "d": D, "n_keys": N_KEYS, "heads": HEADS, "knn": KNN, "k_dim": K_DIM, "batch": BATCH},
           "torch_threads": torch.get_num_threads(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
           "targets": targets}
    if args.json:
        print(json.dumps(out, indent=2))
        return out
    tbl = Table(title=f"a small model (embedding d={D}, PKM {N_KEYS}^2 x {D}, {HEADS} heads x knn {KNN}, linear head; "
                      f"batch {BATCH}): bag + bag_backward + commit per step; {args.blocks} blocks of {args.block} steps "
                      f"round robin; this process: {torch.get_num_threads()} torch threads, OMP_WAIT_POLICY "
                      f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}; remote: 2 shards, 1 thread each")
    for col in ("run", "steps counted", "p50 ms/step", "mean ms/step", "min ms/step", "x local",
                "shards' CPU ms/step", "shards' context switches/step", "this process's CPU ms/step",
                "of it other threads"):
        tbl.add_column(col, justify="right")
    for n, r in res.items():
        tbl.add_row(n, str(r["n"]), f"{r['p50_ms']:.2f}", f"{r['mean_ms']:.2f}", f"{r['min_ms']:.2f}",
                    f"{r['p50_ms'] / ms['local']:.2f}", f"{r['shard_cpu_ms']:.2f}", f"{r['shard_switches']:.1f}",
                    f"{r['trainer_cpu_ms']:.2f}", f"{r['trainer_other_threads_cpu_ms']:.2f}")
    console = Console(width=160)
    console.print(tbl)
    console.print(f"losses over {done} steps: largest difference from local {loss_diff:.2e}; calls by the doorbells: "
                  f"{rung['remote']} (doorbell client), {rung['remote, doorbell off']} (doorbell off); "
                  f"remote, doorbell off / remote: {ratios['remote, doorbell off / remote']:.2f}x")
    print_targets(targets, console.print)
    return out


if __name__ == "__main__":
    main()
