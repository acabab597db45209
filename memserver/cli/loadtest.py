"""`memserver loadtest`: check every flag, run the locust load (memserver.loadtest) and print its
report."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import sys
from collections.abc import Iterator
from typing import Any

from memserver.cli.common import CliError, counted, endpoint_of, seconds

#: Flag defaults: the parser's are None, so a worker refuses any master-only flag given, even at
#: its default value (it compared values, and took `--users 4` silently); filled in after that.
DEFAULTS: dict[str, Any] = {"users": 4, "spawn_rate": 4.0, "duration": "30s", "mix": "bag:8,lookup:1,bag_backward:1",
                            "batch": 256, "knn": 32, "wire_dtype": "float32", "timeout": 10.0,
                            "max_requests": 1_000_000}


def _parsed(parse: Any, value: str, flag: str) -> Any:
    try:
        return parse(value)
    except ValueError as exc:
        raise CliError(f"{flag}: {exc}") from None


#: What a worker takes from its master: giving one of these with --worker-of is an error.
MASTER_ONLY = ("users", "spawn_rate", "duration", "table", "mix", "batch", "knn", "wire_dtype", "timeout", "max_requests",
               "num_rows", "dim", "sharding", "expect_workers", "master_bind")


def cmd_loadtest(args: argparse.Namespace) -> int:
    """Check every flag before touching the cluster, then run memserver.loadtest and print."""
    # locust and gevent are imported only in the child process that run_loadtest starts (see there)
    from memserver.loadtest.caller import check_call_size
    from memserver.loadtest.config import LoadConfig, parse_duration, parse_host_port, parse_mix
    from memserver.loadtest.run import LoadTestError, Master, ScratchTable, run_loadtest, run_worker

    given = [f"--{name.replace('_', '-')}" for name in MASTER_ONLY if getattr(args, name) is not None]
    for name, value in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    wait = _parsed(parse_duration, args.wait, "--wait")
    if args.save_latencies is not None:
        _check_writable(args.save_latencies, "--save-latencies")
    if args.worker_of is not None:
        if given:
            raise CliError(f"--worker-of: {', '.join(given)} belong(s) to the master; a worker takes the master's")
        master_addr = _parsed(parse_host_port, args.worker_of, "--worker-of")
        try:
            with _terminate_as_interrupt():
                report = run_worker(master_addr, wait, endpoint=args.endpoint, save_latencies=args.save_latencies)
        except LoadTestError as exc:
            return _failed(exc, args.json)
        return _print_and_exit(report, args.json)
    master = None
    if args.expect_workers is not None:
        if args.expect_workers < 1:
            raise CliError(f"--expect-workers must be at least 1, got {args.expect_workers}")
        if args.users < args.expect_workers:
            raise CliError(f"--users ({args.users}) must be at least --expect-workers ({args.expect_workers}): "
                           "every worker runs at least one user")
        master = Master(_parsed(parse_host_port, args.master_bind or "127.0.0.1", "--master-bind"), args.expect_workers, wait)
    elif args.master_bind is not None:
        raise CliError("--master-bind: only with --expect-workers (the master's workers)")
    duration = _parsed(parse_duration, args.duration, "--duration")
    mix = _parsed(parse_mix, args.mix, "--mix")
    for flag, value in (("--users", args.users), ("--batch", args.batch), ("--knn", args.knn),
                        ("--max-requests", args.max_requests), ("--num-rows", args.num_rows), ("--dim", args.dim)):
        if value is not None and value < 1:
            raise CliError(f"{flag} must be at least 1, got {value}")
    if not 0 < args.spawn_rate < math.inf:
        raise CliError(f"--spawn-rate must be a number more than 0, got {args.spawn_rate}")
    if args.table == "":  # (it was taken for the scratch table's name, "(scratch)", and refused as that)
        raise CliError("--table: give a table name, or leave --table out for a scratch table")
    scratch = None
    if args.table is None:
        scratch = ScratchTable(args.num_rows or 65536, args.dim or 128, args.sharding or "cols")
        try:
            check_call_size(args.batch, args.knn, scratch.dim, mix=mix)
        except ValueError as exc:
            raise CliError(str(exc)) from None
    elif args.num_rows is not None or args.dim is not None or args.sharding:
        raise CliError("--num-rows, --dim and --sharding shape the scratch table; they cannot be used with --table")
    cfg = LoadConfig(endpoint=endpoint_of(args), table=args.table or "(scratch)", mix=mix, batch=args.batch, knn=args.knn,
                     wire_dtype=args.wire_dtype, timeout=args.timeout, max_requests=args.max_requests)
    try:
        with _terminate_as_interrupt():
            report = run_loadtest(cfg, args.users, args.spawn_rate, duration, scratch=scratch, master=master,
                                  save_latencies=args.save_latencies)
    except ValueError as exc:  # the table or the calls' sizes, refused before any load (loadtest.caller)
        raise CliError(str(exc)) from None
    except LoadTestError as exc:
        return _failed(exc, args.json)
    return _print_and_exit(report, args.json)


def _failed(exc: Exception, as_json: bool) -> int:
    """A run that failed (exit status 1; a wrong command is 2): said on stderr, and with --json
    as {"error": ...} on stdout too, as every command's failure is (it printed nothing there)."""
    from memserver.cli.common import one_line, print_json_error

    print(f"memserver: error: {one_line(exc)}", file=sys.stderr)
    if as_json:
        print_json_error(one_line(exc))
    return 1


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (`timeout`, `kill`, a scheduler) stops the run as Ctrl-C does: the load stops and
    a scratch table is dropped (the default action killed the process and left the table)."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _check_writable(path: str, flag: str) -> None:
    """A file the run can write at its end: refused now rather than after the load."""
    import os
    from pathlib import Path

    p = Path(path)
    if p.is_dir():
        raise CliError(f"{flag}: {path} is a directory; name a file (e.g. latencies.npz)")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise CliError(f"{flag}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise CliError(f"{flag}: {path} is not writable")


def _print_and_exit(report: dict[str, Any], as_json: bool) -> int:
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        print_load_report(report)
    for key in ("save_error", "scratch_drop_error"):
        if report.get(key):
            print(f"memserver: error: {report[key]}", file=sys.stderr)
    if report["interrupted"]:
        return 130
    bad = report["failures"] or report["locust_exceptions"] or report.get("missing_workers") or \
        report.get("rejected_workers") or report.get("sent") is False or report.get("save_error") or \
        report.get("scratch_drop_error")
    return 1 if bad else 0


def _ms(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3f}" if x < 1 else f"{x:.2f}" if x < 100 else f"{x:.0f}"


#: A load generator's CPU (share of one core) past which its report says its latencies are its own.
GENERATOR_BUSY = 0.85


def print_load_report(report: dict[str, Any]) -> None:
    """The rich table of `memserver loadtest`: one row per call type and the total."""
    from rich import box
    from rich.table import Table

    from memserver.cli.common import console as common_console

    t, c = report["table"], report["config"]
    console = common_console()
    reached = report.get("users_reached", report["users"])
    console.print(
        f"loadtest of [bold]{t['name']}[/] ({t['num_rows']:,} x {t['dim']} {t['sharding']}, {counted(t['shards'], 'shard')}"
        f"{', scratch' if t['scratch'] else ''}) at {report['endpoint']}\n{counted(reached, 'user')} for "
        f"{report['elapsed_s']:.1f} s, "
        + (f"{counted(c['batch'], 'id')} per lookup" if set(c.get("mix") or {}) == {"lookup"} else f"batch {c['batch']} x knn {c['knn']}")
        + f", wire {c['wire_dtype']}"
    )
    if reached < report["users"] and "spawn_rate" in report and \
            report["users"] / report["spawn_rate"] > report["duration_s"]:
        console.print(f"[yellow]{reached} of the {report['users']} users asked for ran at once: at --spawn-rate "
                      f"{report['spawn_rate']:g}/s they take {report['users'] / report['spawn_rate']:.1f} s to start "
                      f"(--duration {report['duration_s']:g} s); req/s counts the ramp-up too[/]")
    if report.get("generator_cpu", 0.0) >= GENERATOR_BUSY:
        console.print(f"[yellow]the load generator was busy {report['generator_cpu']:.0%} of a core: its users share "
                      "one process, so the latencies below are mostly time its calls waited in it, not the cluster's; "
                      "give fewer --users, or several processes (--expect-workers N, each --worker-of)[/]")
    out = Table(title="latency in ms as the load generator saw each call: exact, over successful requests; req/s "
                "counts failures, ok/s not", box=box.SIMPLE_HEAD)
    for col in ("call", "requests", "failures", "req/s", "ok/s", "MB/s", "mean", "p50", "p95", "p99", "max"):
        out.add_column(col, justify="left" if col == "call" else "right", no_wrap=True)
    rows = [*report["per_type"].items(), ("total", report["total"])]
    for i, (name, s) in enumerate(rows):
        mb_s = s["response_bytes"] / 1e6 / report["elapsed_s"] if report["elapsed_s"] else 0.0
        out.add_row(name, f"{s['requests']:,}", f"{s['failures']:,}", f"{s['rps']:.1f}", f"{s.get('ok_rps', 0.0):.1f}",
                    f"{mb_s:.1f}",
                    *(_ms(s[k]) for k in ("mean_ms", "p50_ms", "p95_ms", "p99_ms", "max_ms")),
                    end_section=i == len(rows) - 2)
    console.print(out)
    if "workers" in report:  # a master: every worker's share of the merged rows above
        console.print(f"merged over {len(report['workers'])} of {report['expect_workers']} workers (master "
                      f"{report['master']}):")
        for wid, w in sorted(report["workers"].items(), key=lambda kv: kv[1]["address"]):
            console.print(f"  {w['address']}: {w['requests']:,} requests, {w['failures']:,} failures, "
                          f"p50 {_ms(w['p50_ms'])} ms, p99 {_ms(w['p99_ms'])} ms  [dim]{wid}[/]")
        for wid in report["missing_workers"]:
            console.print(f"[red]worker {wid} sent no latencies: left out of the percentiles[/]")
        for wid, why in report["rejected_workers"].items():
            console.print(f"[red]worker {wid}'s latencies refused: {why}[/]")
    elif "master" in report:  # a worker
        console.print(f"this worker ({report['address']}) of master {report['master']}: its own share; "
                      f"{'sent to' if report['sent'] else '[red]not sent to[/]'} the master")
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
                        "table is created for the run and dropped afterwards. Exit status 1 if any request failed. "
                        "From several hosts (locust's distributed mode): on one host `--expect-workers N --master-bind "
                        "ADDR:PORT` with the usual flags runs the master, which makes no load itself; on each load host "
                        "`--worker-of ADDR:PORT` runs a worker, which takes table and settings from the master and reaches "
                        "the cluster its own way (--endpoint or the endpoint file, e.g. MEMSERVER_ENDPOINT_FILE=join.json, "
                        "with that file's token and CA). The master prints exact percentiles over every worker's "
                        "responses and each worker's counts; exit status 1 also if a worker's latencies are missing. "
                        "The master's port has no authentication: bind it to a private address.")
    lt.add_argument("--users", type=int, default=None,
                    help="concurrent simulated clients (default 4); with --expect-workers, in total over the workers")
    lt.add_argument("--spawn-rate", type=float, default=None, help="users started per second (default 4)")
    lt.add_argument("--duration", default=None, help="how long to load, e.g. 30s, 2m, 500ms (default 30s)")
    lt.add_argument("--table", help="existing table to load (bag_backward updates its rows, and its reads count in "
                    "the slots' hits: `memserver top` then shows the load); default: a scratch table, made for the "
                    "run, given one untimed call of each kind first (its one-time costs, such as the client's channels "
                    "and shared-memory regions, stay out of the figures) and dropped after; a table given "
                    "here gets no such call")
    lt.add_argument("--mix", default=None, help="weighted calls (default bag:8,lookup:1,bag_backward:1)")
    lt.add_argument("--batch", type=int, default=None,
                    help="bags per bag/bag_backward call, ids per lookup (default 256)")
    lt.add_argument("--knn", type=int, default=None, help="entries per bag (default 32)")
    lt.add_argument("--wire-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="dtype rows read, bag outputs and the gradients sent travel in (default float32); a "
                    "bag_backward's answer, dL/dweights, stays float32")
    lt.add_argument("--timeout", type=seconds, default=None, help="deadline of each call to a shard, seconds (default 10); a request to several shards waits for all of them")
    lt.add_argument("--max-requests", type=int, default=None,
                    help="stop after this many calls even before --duration (per worker with --expect-workers)")
    lt.add_argument("--num-rows", type=int, help="scratch table rows (default 65536)")
    lt.add_argument("--dim", type=int, help="scratch table dim (default 128)")
    lt.add_argument("--sharding", choices=["rows", "cols"], help="scratch table sharding (default cols)")
    lt.add_argument("--endpoint", help="coordinator HOST:PORT (default: from the endpoint file)")
    lt.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    lt.add_argument("--expect-workers", type=int, metavar="N",
                    help="run as locust master: wait for N workers (--worker-of) and spread --users over them; "
                    "no load from this process")
    lt.add_argument("--master-bind", metavar="HOST[:PORT]",
                    help="the master's address for its workers (default 127.0.0.1:5557); one private address, "
                    "never a wildcard: the port has no authentication")
    lt.add_argument("--worker-of", metavar="HOST[:PORT]",
                    help="run as a locust worker of the master there (port default 5557): table and settings come "
                    "from the master, the way to the cluster (--endpoint, endpoint file, token, CA) is this host's")
    lt.add_argument("--wait", default="60s",
                    help="distributed mode: how long the master waits for its workers to connect and, after the run, "
                    "for each one's latencies; how long a worker waits for its master's test (default 60s)")
    lt.add_argument("--save-latencies", metavar="FILE.npz",
                    help="also write every response time kept (float64 ms per call type, numpy .npz): a master's "
                    "are every worker's, a worker's its own")
    lt.set_defaults(func=cmd_loadtest)
