"""Where a shard's time goes while it serves bag calls: py-spy on the shard process.

A one-shard local cluster serves a loop of the client's own pre-built `Bag` request, sent by a
raw blocking stub (the `raw stub` row of benchmarks.bag_throughput: transport + shard, no client
op), while `py-spy record --threads --idle` samples the shard's Python threads. Printed, per call: the
wall time, each thread's busy time (a sample in which the thread was not waiting: not in the
event loop's selector, not on the compute thread's queue), and the functions that busy time
was spent in (inclusive). gRPC's own C threads have no Python frames and are not seen; the rest
of a call (transport, gRPC) is the wall time minus what the threads show, roughly.

This is the profile behind the `shard overhead` row of benchmarks.bag_throughput (what the
shard adds beyond its compute and the TCP floor) and, with `--batch 1`, behind the shard's part
of benchmarks.small_call_latency.

    python -m benchmarks.shard_profile [--rows 262144 --dim 256 --batch 4096 --knn 32] [--seconds 10]
    python -m benchmarks.shard_profile --batch 1 --rows 65536      # one query
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from benchmarks.common import local_cluster, machine

#: Innermost Python frames of a thread that is waiting, not working: the loop in its selector,
#: the compute thread in its pool's queue (a C call under `_worker`), a lock or condition.
IDLE_LEAVES = ("EpollSelector.select", "_worker", "Condition.wait", "Event.wait")
#: The threads reported, by the name prefix the shard gives them.
THREADS = {"loop": "shard0-grpc", "compute": "shard-compute"}


def py_spy() -> str:
    """The py-spy binary: on the PATH, else beside this Python (the venv's, from the dev extra)."""
    return shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")


def record(pid: int, seconds: int, rate: int, out: str) -> subprocess.Popen:
    """`py-spy record --threads --idle` of process `pid` into `out` (raw stacks), started now."""
    return subprocess.Popen([py_spy(), "record", "-p", str(pid), "-r", str(rate), "-d", str(seconds), "--threads",
                             "--idle", "--format", "raw", "-o", out, "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def frames(stack: str) -> tuple[str, list[str]]:
    """A py-spy raw stack -> (its thread's name, its frames root first, without file:line)."""
    parts = stack.split(";")
    thread = parts[0].split(": ", 1)[-1] if ": " in parts[0] else parts[0]
    return thread, [f.split(" (", 1)[0] for f in parts[1:]]


def summarise(lines: list[str], calls: int, seconds: float, top: int) -> dict[str, Any]:
    """py-spy's raw output (one `stack count` per line) -> per thread: busy ms per call and the
    functions (inclusive) busy time was spent in, ms per call. With `--idle` every thread is
    sampled at every tick, so a thread's samples cover `seconds` whatever rate py-spy kept up with."""
    total: collections.Counter[str] = collections.Counter()
    busy: collections.Counter[str] = collections.Counter()
    funcs: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in lines:
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not stack or not n.isdigit():
            continue
        thread, fr = frames(stack)
        key = next((k for k, prefix in THREADS.items() if thread.startswith(prefix)), None)
        if key is None:
            continue
        total[key] += int(n)
        if not fr or fr[-1] in IDLE_LEAVES:
            continue
        busy[key] += int(n)
        for f in dict.fromkeys(fr):  # each function once per sample (inclusive)
            funcs[key][f] += int(n)
    out: dict[str, Any] = {}
    for key in THREADS:
        if not total[key]:
            continue
        per_sample_ms = seconds / total[key] / calls * 1e3  # ms of one call that one sample stands for
        out[key] = {"samples": total[key], "busy_ms_per_call": busy[key] * per_sample_ms,
                    "functions": [(f, n * per_sample_ms) for f, n in funcs[key].most_common()
                                  if not f.startswith(("Thread.", "BaseEventLoop.run_forever", "<module>"))][:top]}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=262144)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--knn", type=int, default=32)
    p.add_argument("--seconds", type=float, default=10.0, help="how long the loop runs (and py-spy samples)")
    p.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    p.add_argument("--top", type=int, default=15, help="functions shown per thread")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not 1 <= args.seconds <= 120:
        p.error("--seconds: must be in [1, 120]")
    if not os.path.exists(py_spy()):
        p.error("py-spy is not installed (it comes with the project: make install)")

    from benchmarks.bag_throughput import BAG_PATH
    from benchmarks.echo import raw_method
    from client import MemoryClient, ops
    from client.channels import sync_channel
    from memserver.wire import to_bytes

    rng = np.random.default_rng(0)
    ids = torch.from_numpy(rng.integers(0, args.rows, (args.batch, args.knn)))
    w = torch.from_numpy(rng.random((args.batch, args.knn), dtype=np.float32))
    with local_cluster(1) as cluster, MemoryClient(cluster.endpoint, shm=False) as client:
        meta = client.create_table("profile", args.rows, args.dim, num_shards=1, init_std=0.02, seed=0)
        (address, _, req), = next(ops.bag_op(meta, ids, w, None, client.aio.opts))
        pid = int(client.status().shards[0].pid)
        channel = sync_channel(address)
        call, raw = raw_method(channel, BAG_PATH), to_bytes(req)
        for _ in range(5):
            call(raw)
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "shard.txt")
            spy_proc = record(pid, int(args.seconds) + 1, args.rate, out)
            time.sleep(0.5)  # py-spy attaches
            times: list[float] = []
            t_start = time.perf_counter()
            t_end = time.monotonic() + args.seconds
            while time.monotonic() < t_end and len(times) < 1_000_000:
                t0 = time.perf_counter()
                call(raw)
                times.append(time.perf_counter() - t0)
            seconds = time.perf_counter() - t_start
            try:
                _, err = spy_proc.communicate(timeout=args.seconds + 60)
            except subprocess.TimeoutExpired:
                spy_proc.kill()
                raise
            if spy_proc.returncode != 0 or not os.path.exists(out):
                raise RuntimeError(f"py-spy failed (exit {spy_proc.returncode}): {err.strip()[-500:]}")
            with open(out) as f:
                lines = f.readlines()
        channel.close()
        client.drop_table("profile")
    # py-spy sampled for a little longer than the loop ran: count its samples over its own span
    threads = summarise(lines, len(times), int(args.seconds) + 1, args.top)
    result = {"benchmark": "shard_profile", "machine": machine(), "rows": args.rows, "dim": args.dim, "batch": args.batch,
              "knn": args.knn, "calls": len(times), "seconds": seconds, "p50_ms": float(np.median(times) * 1e3),
              "mean_ms": float(np.mean(times) * 1e3), "threads": threads}
    if args.json:
        print(json.dumps(result, indent=2))
        return result
    console = Console(width=130)
    head = Table(title=f"a shard serving {len(times)} raw-stub bags ({args.batch} x {args.knn} ids, {args.rows:,} x "
                       f"{args.dim}) in {seconds:.1f} s: ms per call")
    for col in ("thread", "busy ms / call", "share of the mean call"):
        head.add_column(col, justify="left" if col == "thread" else "right")
    head.add_row("(the call, client side) p50 / mean", f"{result['p50_ms']:.3f} / {result['mean_ms']:.3f}", "")
    for key, t in threads.items():
        head.add_row(f"{key} ({THREADS[key]})", f"{t['busy_ms_per_call']:.3f}", f"{t['busy_ms_per_call'] / result['mean_ms']:.0%}")
    console.print(head)
    for key, t in threads.items():
        tbl = Table(title=f"{key} thread: where its busy time goes (inclusive, ms per call)")
        tbl.add_column("function")
        tbl.add_column("ms / call", justify="right")
        for f, ms in t["functions"]:
            tbl.add_row(f, f"{ms:.3f}")
        console.print(tbl)
    return result


if __name__ == "__main__":
    main()
