"""`memserver loadtest`: check every flag, run the locust load (memserver.loadtest) and print its
report."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from memserver.cli.common import CliError, endpoint_of


def _parsed(parse: Any, value: str, flag: str) -> Any:
    try:
        return parse(value)
    except ValueError as exc:
        raise CliError(f"{flag}: {exc}") from None


def cmd_loadtest(args: argparse.Namespace) -> int:
    """Check every flag before touching the cluster, then run memserver.loadtest and print."""
    # locust and gevent are imported only in the child process that run_loadtest starts (see there)
    from memserver.loadtest.config import LoadConfig, parse_duration, parse_mix
    from memserver.loadtest.run import LoadTestError, ScratchTable, run_loadtest

    duration = _parsed(parse_duration, args.duration, "--duration")
    mix = _parsed(parse_mix, args.mix, "--mix")
    for flag, value in (("--users", args.users), ("--batch", args.batch), ("--knn", args.knn),
                        ("--max-requests", args.max_requests), ("--num-rows", args.num_rows), ("--dim", args.dim)):
        if value is not None and value < 1:
            raise CliError(f"{flag} must be at least 1, got {value}")
    for flag, value in (("--spawn-rate", args.spawn_rate), ("--timeout", args.timeout)):
        if not value > 0:
            raise CliError(f"{flag} must be more than 0, got {value}")
    scratch = None
    if args.table is None:
        scratch = ScratchTable(args.num_rows or 65536, args.dim or 128, args.sharding or "cols")
    elif args.num_rows is not None or args.dim is not None or args.sharding:
        raise CliError("--num-rows, --dim and --sharding shape the scratch table; they cannot be used with --table")
    cfg = LoadConfig(endpoint=endpoint_of(args), table=args.table or "(scratch)", mix=mix, batch=args.batch, knn=args.knn,
                     wire_dtype=args.wire_dtype, timeout=args.timeout, max_requests=args.max_requests)
    try:
        report = run_loadtest(cfg, args.users, args.spawn_rate, duration, scratch=scratch)
    except LoadTestError as exc:
        print(f"memserver: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_load_report(report)
    if report["interrupted"]:
        return 130
    return 1 if report["failures"] or report["locust_exceptions"] else 0


def _ms(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3f}" if x < 1 else f"{x:.2f}" if x < 100 else f"{x:.0f}"


def print_load_report(report: dict[str, Any]) -> None:
    """The rich table of `memserver loadtest`: one row per call type and the total."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    t, c = report["table"], report["config"]
    console = Console()
    if not console.is_terminal:  # piped or logged: rich would assume 80 columns and cut the table
        console = Console(width=120)
    console.print(
        f"loadtest of [bold]{t['name']}[/] ({t['num_rows']:,} x {t['dim']} {t['sharding']}, {t['shards']} shards"
        f"{', scratch' if t['scratch'] else ''}) at {report['endpoint']}\n{report['users']} users for "
        f"{report['elapsed_s']:.1f} s, batch {c['batch']} x knn {c['knn']}, wire {c['wire_dtype']}"
    )
    out = Table(title="latency in ms: exact, over successful requests", box=box.SIMPLE_HEAD)
    for col in ("call", "requests", "failures", "req/s", "MB/s", "mean", "p50", "p95", "p99", "max"):
        out.add_column(col, justify="left" if col == "call" else "right", no_wrap=True)
    rows = [*report["per_type"].items(), ("total", report["total"])]
    for i, (name, s) in enumerate(rows):
        mb_s = s["response_bytes"] / 1e6 / report["elapsed_s"] if report["elapsed_s"] else 0.0
        out.add_row(name, f"{s['requests']:,}", f"{s['failures']:,}", f"{s['rps']:.1f}", f"{mb_s:.1f}",
                    *(_ms(s[k]) for k in ("mean_ms", "p50_ms", "p95_ms", "p99_ms", "max_ms")),
                    end_section=i == len(rows) - 2)
    console.print(out)
    for err, n in report["errors"].items():
        console.print(f"[red]{n} x {err}[/]")
    if report["interrupted"]:
        console.print("[yellow]interrupted before --duration was over[/]")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`loadtest`."""
    lt = sub.add_parser("loadtest", help="measure the running cluster under locust load (bag, lookup, bag_backward)",
                        description="Run locust headless against the running cluster: --users closed-loop clients call "
                        "the shards directly with a weighted mix of bag / lookup / bag_backward for --duration, then print "
                        "requests/s, failures and exact p50/p95/p99/max latency per call type. Without --table, a scratch "
                        "table is created for the run and dropped afterwards. Exit status 1 if any request failed.")
    lt.add_argument("--users", type=int, default=4, help="concurrent simulated clients (default 4)")
    lt.add_argument("--spawn-rate", type=float, default=4.0, help="users started per second (default 4)")
    lt.add_argument("--duration", default="30s", help="how long to load, e.g. 30s, 2m, 500ms (default 30s)")
    lt.add_argument("--table", help="existing table to load (bag_backward updates its rows!); default: a scratch table")
    lt.add_argument("--mix", default="bag:8,lookup:1,bag_backward:1", help="weighted calls (default bag:8,lookup:1,bag_backward:1)")
    lt.add_argument("--batch", type=int, default=256, help="bags per bag/bag_backward call, ids per lookup (default 256)")
    lt.add_argument("--knn", type=int, default=32, help="entries per bag (default 32)")
    lt.add_argument("--wire-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="dtype rows, bag outputs and gradients travel in (default float32)")
    lt.add_argument("--timeout", type=float, default=10.0, help="deadline of every request, seconds (default 10)")
    lt.add_argument("--max-requests", type=int, default=1_000_000, help="stop after this many calls even before --duration")
    lt.add_argument("--num-rows", type=int, help="scratch table rows (default 65536)")
    lt.add_argument("--dim", type=int, help="scratch table dim (default 128)")
    lt.add_argument("--sharding", choices=["rows", "cols"], help="scratch table sharding (default cols)")
    lt.add_argument("--endpoint", help="coordinator HOST:PORT (default: from the endpoint file)")
    lt.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    lt.set_defaults(func=cmd_loadtest)
