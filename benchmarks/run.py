"""The benchmark suite (`make bench`): every benchmark against its in-run baseline, one summary.

Runs bag_throughput, small_call_latency, update_throughput, write_cost, wal_cost, fresh_memory, train_step,
small_model, index_search (one Ray head in this process, shared) and scale (in a child process: its figure is that process's peak
RSS), writes bench-results.json at the repository root and prints each target with the measured ratio and
PASS / MISS. The machine may be shared and noisy: every ratio is against a baseline measured in
the same run, interleaved with it where the benchmark allows. A MISS is information; a benchmark
that raised (ERROR) or answered wrong (WRONG) makes the exit status 1, after the others have run.

    python -m benchmarks.run                 # full: the paper-size scale benchmark (4 GiB) included
    python -m benchmarks.run --quick         # fewer repeats, scale at 262,144 x 256
    python -m benchmarks.run --only bag_throughput,train_step
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.common import copy_bandwidth_gbs, init_ray, machine, write_results, wrong_answers

ROOT = Path(__file__).resolve().parents[1]
#: In running order. scale runs in a child process (see module docstring).
BENCHMARKS = ("bag_throughput", "small_call_latency", "update_throughput", "write_cost", "wal_cost", "fresh_memory",
              "train_step", "small_model", "index_search", "scale")
ISOLATED = {"scale"}


def run_isolated(name: str, argv: list[str]) -> dict[str, Any]:
    """Run benchmarks.<name> in a fresh Python process (its own Ray head) and return its dict."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        # Through sh, which forks: Linux keeps ru_maxrss across fork + exec, so a child exec'd straight
        # from this (large) process would report our peak RSS as its own.
        cmd = [sys.executable, "-m", f"benchmarks.{name}", *argv, "--json-out", str(out)]
        subprocess.run(["/bin/sh", "-c", '"$@"; exit $?', "sh", *cmd], cwd=ROOT, env=env, check=True, timeout=3 * 3600)
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer repeats; scale at 262,144 x 256")
    p.add_argument("--only", action="append", help=f"run only these (comma-separated or repeated): {', '.join(BENCHMARKS)}")
    p.add_argument("--out", default=str(ROOT / "bench-results.json"))
    args = p.parse_args(argv)
    selected = list(BENCHMARKS)
    if args.only:
        wanted = {n.strip() for item in args.only for n in item.split(",") if n.strip()}
        unknown = wanted - set(BENCHMARKS)
        if unknown:
            p.error(f"--only: unknown benchmark(s) {sorted(unknown)}; choose from {', '.join(BENCHMARKS)}")
        selected = [n for n in BENCHMARKS if n in wanted]
    console = Console(width=160)
    t_start = time.perf_counter()
    results: dict[str, Any] = {
        "command": "python -m benchmarks.run " + " ".join(argv if argv is not None else sys.argv[1:]),
        "quick": args.quick, "machine": machine(), "copy_bandwidth_gbs": copy_bandwidth_gbs(), "benchmarks": {},
    }
    bench_argv = ["--quick"] if args.quick else []
    in_process = [n for n in selected if n not in ISOLATED]
    started_ray = init_ray() if in_process else False
    try:
        for name in selected:
            if name in ISOLATED and started_ray:
                import ray

                ray.shutdown()  # free its processes before the big one starts its own
                started_ray = False
            console.rule(f"[bold]{name}")
            t0 = time.perf_counter()
            try:
                if name in ISOLATED:
                    res = run_isolated(name, bench_argv)
                else:
                    res = importlib.import_module(f"benchmarks.{name}").main(bench_argv)
            except Exception as exc:  # keep the other benchmarks' figures
                traceback.print_exc()
                res = {"benchmark": name, "error": f"{type(exc).__name__}: {exc}", "targets": []}
            res["wall_s"] = time.perf_counter() - t0
            results["benchmarks"][name] = res
            write_results(args.out, results)  # partial results survive an interrupted run
    finally:
        if started_ray:
            import ray

            ray.shutdown()
    results["wall_s"] = time.perf_counter() - t_start
    results["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    results["summary"] = [t for r in results["benchmarks"].values() for t in r.get("targets", [])]
    write_results(args.out, results)
    print_summary(console, results)
    console.print(f"results written to {args.out}")
    if failed := failures(results):
        console.print(f"[red]failed: {', '.join(failed)}[/]")
    return results


def failures(results: dict[str, Any]) -> list[str]:
    """The benchmarks that raised or answered wrong, each with which: they make the suite's exit
    status 1 (it was 0, the ERROR shown only in the table). A missed speed target is no failure."""
    out = []
    for name, r in results["benchmarks"].items():
        if "error" in r:
            out.append(f"{name} (error: {r['error']})")
        elif wrong := wrong_answers(r.get("targets", [])):
            out.append(f"{name} ({'; '.join(wrong)})")
    return out


def print_summary(console: Console, results: dict[str, Any]) -> None:
    """The one table to read: every target, what was measured, PASS / MISS."""
    m = results["machine"]
    tbl = Table(title=f"memserver benchmarks {m['date']} on {m['cpus']} x {m['cpu_model']} (load average at start "
                      f"{m['loadavg'][0]:.1f}, end {m.get('loadavg_end', ['?'])[0]}); copy bandwidth "
                      f"{results['copy_bandwidth_gbs']:.1f} GB/s; {'quick' if results['quick'] else 'full'} run in "
                      f"{results['wall_s']:.0f} s")
    for col in ("benchmark", "measured ratio", "target", "value", "result", "wall s"):
        tbl.add_column(col, justify="left" if col in ("benchmark", "measured ratio") else "right")
    for name, r in results["benchmarks"].items():
        if "error" in r:
            tbl.add_row(name, r["error"][:80], "-", "-", "[red]ERROR", f"{r['wall_s']:.0f}")
            continue
        for i, t in enumerate(r["targets"]):
            verdict = "[dim]INFO" if t["pass"] is None else "[green]PASS" if t["pass"] else \
                "[red]WRONG" if t.get("answers") else "[red]MISS"
            tbl.add_row(name if i == 0 else "", t["what"], t["target"], t["measured"], verdict,
                        f"{r['wall_s']:.0f}" if i == 0 else "")
    console.print(tbl)


if __name__ == "__main__":
    raise SystemExit(1 if failures(main()) else 0)
