"""A lost host and a partition, for real: memory clusters on hosts in network namespaces
(tests/hosts.py), memtrain running on another host while one shard host loses its power or its
cable. Each scenario prints the table's difference from a run that never failed, the losses'
difference, the acknowledged updates lost, and the seconds to serve again or the step-time cost.

    python -m benchmarks.host_loss                       # both scenarios (about 3-5 minutes each here)
    python -m benchmarks.host_loss --scenario loss --steps 60 --json

Scenarios (4 hosts: h0 runs the Ray head, `memserver up`, the coordinator and the trainer; h1 and
h2 one shard each; h3 a spare Ray node that joins after the shards were placed; tables `wal`, the
data directory in the shared work directory, standing in for NFS):

- `loss`: after step K, SIGKILL every process of h1 (a power cut: its raylet, its shard). Ray
  declares the node dead (health checks tuned to ~3 s on the head), reschedules the shard's
  placement bundle on h3 and restarts the actor there; the shard loads its checkpoint and log
  from the shared directory and serves at h3's address; the trainer's calls retry and go on.
- `cut`: the same, with h1's cable pulled first (a real power cut: no reset comes from its stack,
  so a call in flight to it learns only from the client's keepalive pings or its deadline; give
  `--call-timeout 60`, memtrain's default, to see what a trainer with default flags meets).
- `partition`: after step K, h1's cable out for `--down` seconds (8), then back in (Ray's default
  30 s health checks, so the node is not declared dead). The trainer's calls have a 3 s deadline
  per attempt (`--call-timeout`): calls to h1 time out and are sent again (same write tags) until
  the link is back; no push is applied twice.

The reference is the same training (same seed, same flags) on another table of the same cluster,
run first: every acknowledged update is in the table exactly when the two tables are equal.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tests.hosts import FAST_FAILURE_DETECTION, Hosts, MemoryHosts, available, wait_for


def _train(hosts: Hosts, mh: MemoryHosts, table: str, steps: int, **kw: Any) -> tuple[Any, Path]:
    out = hosts.work / f"{table}.json"
    argv = [sys.executable, "-m", "tests.hosts_scenario", "train", table, str(steps), str(out),
            "--checkpoint-dir", str(mh.data_dir / f"ck-{table}")]
    if kw.get("progress"):
        argv += ["--progress", str(kw["progress"]), "--watch"]
    argv += ["--timeout", str(kw.get("timeout", 30))]
    return hosts.popen(0, argv, log=f"{table}.log", env=mh.client_env()), out


def _finish(hosts: Hosts, proc: Any, out: Path, table: str, timeout: float) -> dict[str, Any]:
    try:
        proc.wait(timeout=timeout)
    except Exception:
        proc.kill()
        raise RuntimeError(f"{table}: training did not finish in {timeout:.0f}s\n{hosts.log(f'{table}.log')}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{table}: training exited {proc.returncode}\n{hosts.log(f'{table}.log')}")
    return json.loads(out.read_text())


def scenario(kind: str, steps: int, at: int, down: float, call_timeout: float) -> dict[str, Any]:
    t0 = time.monotonic()
    with Hosts(4) as hosts:
        mh = MemoryHosts(hosts, shard_hosts=[1, 2], up_args=["--placement", "STRICT_SPREAD"],
                         ray_env=FAST_FAILURE_DETECTION if kind in ("loss", "cut") else {})
        try:
            mh.start()
            hosts.ray_worker(3, num_cpus=1, env=mh.env())  # the spare: joins after the shards were placed
            ref_proc, ref_out = _train(hosts, mh, "ref", steps, timeout=call_timeout)
            ref = _finish(hosts, ref_proc, ref_out, "ref", 300)
            progress = hosts.work / "progress"
            # the partition outlasts a call's deadline: attempts time out and are sent again
            proc, out = _train(hosts, mh, "run", steps, progress=progress, timeout=call_timeout)
            wait_for(f"step {at}", lambda: int(progress.read_text() or 0) >= at or None if progress.exists() else None,
                     180, interval=0.02)
            t_fault = time.time()
            victim = 1
            if kind in ("loss", "cut"):
                if kind == "cut":  # a power cut: no reset from the host's stack, its cable stays out
                    hosts.link(victim, up=False)
                killed = hosts.kill_host(victim)
            else:
                hosts.link(victim, up=False)
                time.sleep(down)
                hosts.link(victim, up=True)
                killed = 0
            run = _finish(hosts, proc, out, "run", 300)
            run_log = hosts.log("run.log", tail=1 << 30)
        finally:
            mh.stop()
    ref_values, run_values = np.array(ref["values"]), np.array(run["values"])
    ref_losses = np.array([r["loss"] for r in ref["records"]])
    run_losses = np.array([r["loss"] for r in run["records"]])
    times = [r["t"] for r in run["records"]]
    gaps = np.diff(times)
    fault_step = next(i for i, t in enumerate(times) if t > t_fault)  # the step the fault landed in
    result: dict[str, Any] = {
        "scenario": kind,
        "steps": len(run["records"]),
        "fault_after_step": fault_step,
        "table_max_abs_diff": float(np.abs(ref_values - run_values).max()),
        "table_equal": bool(np.array_equal(ref_values, run_values)),
        "loss_max_abs_diff": float(np.abs(ref_losses - run_losses).max()),
        "step_ms_p50": float(np.median(gaps) * 1e3),
        "fault_step_ms": float((times[fault_step] - (times[fault_step - 1] if fault_step else t_fault)) * 1e3),
        "processes_killed": killed,
        "shards_after": run["shards_after"],
        "wall_s": time.monotonic() - t0,
    }
    if kind in ("loss", "cut"):
        before = {s[0]: s[1] for s in ref["shards_after"]}
        moved = [e for e in run["status_seen"] if e["t"] > t_fault and "shards" in e
                 and all(s[2] == "serving" for s in e["shards"])
                 and any(s[1] != before[s[0]] for s in e["shards"])]
        result["seconds_to_serve"] = (moved[0]["t"] - t_fault) if moved else None
        result["moved"] = [(s[0], s[3], s[1]) for s in run["shards_after"] if s[3]]
    else:
        result["down_s"] = down
        result["deadline_retries"] = sum("DEADLINE_EXCEEDED" in line and "retrying in" in line
                                         for line in run_log.splitlines())
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=["loss", "cut", "partition", "both"], default="both",
                   help="loss: SIGKILL of a host's processes (its stack answers resets); cut: its cable out first "
                   "(a power cut: nothing answers); partition: the cable out for --down s; both: loss and partition")
    p.add_argument("--steps", type=int, default=40, help="training steps per run")
    p.add_argument("--at", type=int, default=10, help="the fault comes after this step")
    p.add_argument("--down", type=float, default=8.0, help="partition: seconds the cable is out")
    p.add_argument("--call-timeout", type=float, default=3.0, help="the trainer client's deadline per call attempt (s)")
    p.add_argument("--json", action="store_true", help="print one JSON object per scenario")
    a = p.parse_args(argv)
    if (why := available()) is not None:
        print(f"host_loss: skipped: {why}")
        return 0
    kinds = ["loss", "partition"] if a.scenario == "both" else [a.scenario]
    results = [scenario(k, a.steps, a.at, a.down, a.call_timeout) for k in kinds]
    if a.json:
        for r in results:
            print(json.dumps(r))
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(title="a lost host, a partition (4 hosts in network namespaces; memtrain remote, wal, cols)")
    for col in ("scenario", "steps", "fault at step", "table vs reference", "losses vs reference",
                "acknowledged updates lost", "step p50", "the fault's step", "seconds to serve again",
                "attempts past their deadline, sent again", "wall"):
        t.add_column(col, justify="left" if col == "scenario" else "right")
    for r in results:
        t.add_row(r["scenario"] + (f" ({r['down_s']:g} s)" if "down_s" in r else ""), str(r["steps"]),
                  str(r["fault_after_step"]),
                  "equal" if r["table_equal"] else f"max |diff| {r['table_max_abs_diff']:.3g}",
                  f"{r['loss_max_abs_diff']:.3g}", "0" if r["table_equal"] else "some",
                  f"{r['step_ms_p50']:.0f} ms", f"{r['fault_step_ms']:.0f} ms",
                  f"{r['seconds_to_serve']:.1f}" if r.get("seconds_to_serve") is not None else "-",
                  str(r.get("deadline_retries", "-")),
                  f"{r['wall_s']:.0f} s")
    Console(width=max(160, Console().width)).print(t)  # wide: often piped to a file
    for r in results:
        if r.get("moved"):
            print(f"{r['scenario']}: moved " + ", ".join(f"shard {i} from {a} to {b}" for i, a, b in r["moved"]))
    return 0 if all(r["table_equal"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
