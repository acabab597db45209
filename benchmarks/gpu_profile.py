"""Where a remote memtrain step's time goes, on a GPU or the CPU: py-spy on the trainer and on
its shards, neither needing Ray nor faiss (what a lent GPU machine runs; docs/benchmarks.md,
"GPUs", quotes it).

Two shards on `--device` serve in a child process (`memserver.cluster.inprocess`, as
benchmarks.gpu runs them), memtrain trains against them in another (`--memory remote`, its
defaults otherwise), and once it has warmed up `py-spy record --threads --idle` samples both
for `--seconds`. Printed, per training step of the sampled window:

- **trainer**: its main thread, every sample counted, waits included: what the step's wall time
  is made of (the ms a function and what it called took, inclusive); on CUDA a custom
  function's backward runs on a device thread of torch's autograd engine while the main thread
  waits for it, and is shown beside it;
- **shards**: their threads' busy time (a sample in which the thread was not waiting for a
  request, a lock or its queue), summed over the shards, and the functions it was spent in.

Each figure is its share of the sampled ticks times the step's p50 time (py-spy slows what it
samples a little; the shares are what to read).

A profile, not a benchmark (no baseline ratio, no target).

    python -m benchmarks.gpu_profile [--device cuda] [--kind pkm] [--staleness 0] [--seconds 10] [--rate 400]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu import gpu_shards
from benchmarks.shard_profile import IDLE_LEAVES as SHARD_IDLE
from benchmarks.shard_profile import frames, record

#: Innermost Python frames of a thread that waits, not works: shard_profile's (the event loop's
#: selector, a pool's queue, a lock), a doorbell's socket waiting for a request or a connection,
#: the metrics server's selector, and a thread blocked in a C call at its own entry (the shards'
#: process on its stdin, gRPC's poller).
IDLE_LEAVES = (*SHARD_IDLE, "recv_exact", "socket.accept", "_PollLikeSelector.select", "<module>", "Thread.run")
#: Frames that only wrap the work under them (threads' and loops' entry points), not shown.
WRAPPERS = ("Thread.", "BaseEventLoop.run_forever", "<module>", "_run_module", "_run_code", "_main", "main")
#: A custom autograd function's backward, run by a device thread of torch's autograd engine (on
#: CUDA) while the main thread waits in `_engine_run_backward`.
BACKWARD = "BackwardCFunction.apply"


def idle(fr: list[str]) -> bool:
    return not fr or fr[-1] in IDLE_LEAVES


def summarise(lines: list[str], step_ms: float, top: int, *, trainer: bool) -> dict[str, Any]:
    """py-spy's raw output (`--threads --idle`: every thread sampled at every tick) -> ms per
    step, as each share of the ticks times the step's p50 time. Trainer: the main thread, every
    sample, waits included (its total is the step), with an autograd thread's Python backward
    shown beside it (it overlaps the main thread's wait for it). Shards: every thread's busy
    samples, summed (two shards can be busy at once)."""
    ticks: collections.Counter[str] = collections.Counter()
    counted = 0
    funcs: collections.Counter[str] = collections.Counter()
    for line in lines:
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not stack or not n.isdigit():
            continue
        thread, fr = frames(stack)
        ticks[thread] += int(n)
        if trainer:
            main = thread.startswith("MainThread")
            if not main and (BACKWARD not in fr or idle(fr)):
                continue
            counted += int(n) if main else 0
        elif idle(fr):
            continue
        else:
            counted += int(n)
        for f in dict.fromkeys(fr):
            funcs[f] += int(n)
    tick_ms = step_ms / max(ticks.values()) if ticks else 0.0
    return {"ms_per_step": counted * tick_ms, "threads": len(ticks),
            "functions": [(f, c * tick_ms) for f, c in funcs.most_common() if not f.startswith(WRAPPERS)][:top]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="the trainer's and the shards' device (default: cuda where torch sees one)")
    p.add_argument("--kind", default="pkm", help="memtrain --memory-kind")
    p.add_argument("--staleness", type=int, choices=[0, 1], default=0)
    p.add_argument("--seconds", type=float, default=10.0, help="how long py-spy samples")
    p.add_argument("--warmup", type=int, default=10, help="steps before sampling starts")
    p.add_argument("--rate", type=int, default=400, help="py-spy samples per second")
    p.add_argument("--top", type=int, default=25, help="functions shown per process")
    p.add_argument("--memtrain", default="", help="more memtrain arguments, one string (e.g. \"--batch-size 8\")")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device here (torch.cuda.is_available() is False)")
    shard_device = "cuda:0" if args.device.startswith("cuda") else "cpu"
    with tempfile.TemporaryDirectory() as tmp, gpu_shards(2, shard_device) as (endpoint, shards_pid):
        log_json = Path(tmp) / "steps.jsonl"
        cmd = [sys.executable, "-m", "trainer.train", "--memory", "remote", "--memory-kind", args.kind,
               "--staleness", str(args.staleness), "--device", args.device, "--endpoint", endpoint,
               "--steps", "1000000", "--eval-every", "1000000", "--log-every", "1", "--log-json", str(log_json),
               "--table", "gpu-profile", *args.memtrain.split()]
        err = Path(tmp) / "memtrain.err"  # a file, not a pipe: a log line a step would fill a pipe nobody reads
        with open(err, "w") as err_file:
            trainer = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err_file)
        try:
            deadline = time.monotonic() + 600
            while not log_json.exists() or len(log_json.read_text().splitlines()) < args.warmup:
                if trainer.poll() is not None:
                    raise RuntimeError(f"memtrain ended before its warm-up: {err.read_text()[-2000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError("memtrain did not reach its warm-up steps in 600 s")
                time.sleep(0.2)
            first = len(log_json.read_text().splitlines())
            spies = {"trainer": (record(trainer.pid, int(args.seconds), args.rate, f"{tmp}/trainer.txt"), True),
                     "shards": (record(shards_pid, int(args.seconds), args.rate, f"{tmp}/shards.txt"), False)}
            failed = {name: proc.stderr.read()[-2000:] if proc.stderr else "" for name, (proc, _) in spies.items()
                      if proc.wait() != 0}  # both waited for, whichever fails
            if failed:
                raise RuntimeError(f"py-spy failed: {failed}")
            records = [json.loads(r) for r in log_json.read_text().splitlines()[first:]]
        finally:
            trainer.terminate()
            try:
                trainer.wait(30)
            except subprocess.TimeoutExpired:
                trainer.kill()
                trainer.wait()
        steps = len(records)
        step_ms = statistics.median(r["step_ms"] for r in records) if records else float("nan")
        out: dict[str, Any] = {"device": args.device, "kind": args.kind, "staleness": args.staleness,
                               "steps": steps, "step_ms_p50": step_ms,
                               "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None}
        for name, (_, is_trainer) in spies.items():
            lines = (Path(tmp) / f"{name}.txt").read_text().splitlines()
            out[name] = summarise(lines, step_ms, args.top, trainer=is_trainer)
    if args.json:
        print(json.dumps(out, indent=2))
        return out
    print(f"memtrain --memory remote --memory-kind {args.kind} --staleness {args.staleness} --device {args.device}"
          f"{' ' + args.memtrain if args.memtrain else ''}" + (f" ({out['gpu']})" if out["gpu"] else ""))
    print(f"{steps} steps sampled, p50 {step_ms:.1f} ms/step")
    for name, what in (("trainer", "its main thread, waits included; an autograd thread's backward beside it"),
                       ("shards", "their threads' busy time, summed")):
        got = out[name]
        print(f"\n{name} ({what}): {got['ms_per_step']:.1f} ms per step")
        for f, ms in got["functions"]:
            print(f"  {ms:7.2f} ms  {f}")
    return out


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
