"""Where a remote memtrain step's extra time goes, seen from the client: every client call the
trainer makes is timed (a blocking call: its own time; a `submit_*` call: the time to send it, and
the time until its answer arrived), over the steps after a warm-up, beside the same run with
local values, and the CPU time per step of the trainer's process and of the shards' processes
(on a machine whose cores the trainer fills, the shards' CPU time is step time: nothing overlaps).
A profile, not a benchmark (no baseline ratio, no target).

    python -m benchmarks.step_calls [--kind engram] [--steps 25 --warmup 5] [--threads 0]

docs/benchmarks.md (issue 25) quotes it for Engram with --threads 0 (torch's default) and 1.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time
from typing import Any

from benchmarks.common import cpu_seconds, local_cluster


class TimedClient:
    """A MemoryClient whose calls are timed into `times` (name -> seconds)."""

    def __init__(self, client: Any) -> None:
        self.client, self.times = client, collections.defaultdict(list)

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.client, name)
        if not callable(fn):
            return fn

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            t1 = time.perf_counter()
            self.times[name].append(t1 - t0)
            if name.startswith("submit"):
                out.add_done_callback(lambda _: self.times[f"{name} (until answered)"].append(time.perf_counter() - t1))
            return out

        return timed


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", default="engram", help="memtrain --memory-kind")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5, help="first steps not counted")
    p.add_argument("--threads", type=int, default=0, help="memtrain --threads (0: torch's default)")
    args = p.parse_args(argv)
    from client import MemoryClient
    from trainer.train import build_parser, train

    with local_cluster(2) as cluster, MemoryClient(cluster.endpoint, timeout=120) as client:
        for memory in ("remote", "local"):
            timed = TimedClient(client)
            run = train(build_parser().parse_args(
                ["--memory", memory, "--memory-kind", args.kind, "--steps", str(args.steps + 1000), "--eval-every",
                 "1000000", "--log-every", "1", "--table", "step-calls", "--threads", str(args.threads)]), client=timed)
            steps = []
            pids = [s["pid"] for s in cluster.shard_infos]
            try:
                for i in range(args.steps):
                    if i == args.warmup:
                        t0, mine0, shards0 = time.perf_counter(), time.process_time(), sum(map(cpu_seconds, pids))
                    rec = next(run)
                    if i >= args.warmup:
                        steps.append(rec["step_ms"])
                n = len(steps)
                wall, mine = (time.perf_counter() - t0) / n, (time.process_time() - mine0) / n
                shards = (sum(map(cpu_seconds, pids)) - shards0) / n
            finally:
                run.close()
            print(f"{memory} {args.kind}: step p50 {statistics.median(steps):.1f} ms ({n} steps); per step: wall "
                  f"{1e3 * wall:.1f} ms, CPU of the trainer process {1e3 * mine:.1f} ms, of the shards "
                  f"{1e3 * shards:.1f} ms ({os.cpu_count()} cores)")
            for name, v in sorted(timed.times.items()):
                last = v[-(args.steps - args.warmup):]
                print(f"    {name:>38}: p50 {1e3 * statistics.median(last):8.2f} ms ({len(v)} calls)")


if __name__ == "__main__":
    main()
