"""`memserver`: start, inspect, load-test and stop a memory cluster. Thin over memserver.cluster,
memserver.loadtest and client."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("memserver")

TABLE_KEYS = {"name", "num_rows", "dim", "sharding", "optimizer", "lr", "dtype", "init_std", "seed", "num_shards", "eps", "wal"}
CONFIG_KEYS = {"shards", "shard_cpus", "shard_gpus", "threads_per_shard", "placement", "data_dir", "tables"}
#: memserver.cluster.PLACEMENT_STRATEGIES, repeated here so that `--help` and config checks need no Ray import.
PLACEMENTS = ("SPREAD", "STRICT_SPREAD", "PACK")


class CliError(Exception):
    """A user error: printed as `memserver: error: ...`, exit status 2."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def load_config(path: str | None) -> dict[str, Any]:
    """Read tables.yaml; unknown keys are errors that name the key and the file."""
    if not path:
        return {}
    import yaml

    try:
        cfg = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise CliError(f"--config: no such file: {path}") from None
    except yaml.YAMLError as exc:
        raise CliError(f"--config: {path} is not valid YAML: {exc}") from None
    if not isinstance(cfg, dict):
        raise CliError(f"--config: {path} must hold a mapping with a 'tables' list")
    if unknown := set(cfg) - CONFIG_KEYS:
        raise CliError(f"--config: unknown key(s) {sorted(unknown)} in {path}; allowed: {sorted(CONFIG_KEYS)}")
    if "placement" in cfg:
        if str(cfg["placement"]).upper() not in PLACEMENTS:
            raise CliError(f"--config: placement in {path} must be one of {', '.join(PLACEMENTS)}, got {cfg['placement']!r}")
        cfg["placement"] = str(cfg["placement"]).upper()
    for i, table in enumerate(cfg.get("tables") or []):
        if not isinstance(table, dict) or not {"name", "num_rows", "dim"} <= set(table):
            raise CliError(f"--config: tables[{i}] in {path} needs at least name, num_rows and dim")
        if unknown := set(table) - TABLE_KEYS:
            raise CliError(f"--config: tables[{i}] has unknown key(s) {sorted(unknown)}; allowed: {sorted(TABLE_KEYS)}")
    return cfg


def running_cluster() -> dict[str, Any] | None:
    from memserver.cluster import endpoint_file, read_endpoint

    if not endpoint_file().exists():
        return None
    rec = read_endpoint()
    return rec if _pid_alive(int(rec.get("pid", -1))) else None


# ------------------------------------------------------------------------------- up


def cmd_up(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    shards = args.shards or cfg.get("shards") or 2
    if shards < 1:
        raise CliError(f"--shards must be at least 1, got {shards}")
    if (rec := running_cluster()) is not None:
        raise CliError(f"a memserver is already running at {rec['endpoint']} (pid {rec['pid']}); run `memserver down` first")
    if args.detach:
        return _up_detached(args)

    import ray

    from client import MemoryClient
    from memserver.cluster import endpoint_file, start_cluster, write_endpoint

    t0 = time.perf_counter()
    if args.address:
        log.info("joining Ray cluster at %s", args.address)
        ray.init(address=args.address, namespace="memserver", logging_level=logging.WARNING)
    else:
        cpus = args.num_cpus or os.cpu_count() or 2
        log.info("starting an embedded Ray head (%d CPUs, dashboard off)", cpus)
        ray.init(
            # "local": always a new head, even if `ray start` ran on this machine or RAY_ADDRESS is set
            # (ray.init() would otherwise join that cluster); joining is what --address is for.
            address="local",
            num_cpus=cpus,
            include_dashboard=False,
            object_store_memory=args.object_store_mb * 1024 * 1024,
            namespace="memserver",
            logging_level=logging.WARNING,
        )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    cluster = start_cluster(
        shards,
        shard_cpus=cfg.get("shard_cpus", args.shard_cpus),
        shard_gpus=cfg.get("shard_gpus", args.shard_gpus),
        threads_per_shard=cfg.get("threads_per_shard", args.threads_per_shard),
        port=args.port,
        placement=args.placement or cfg.get("placement") or "SPREAD",
        placement_timeout=args.placement_timeout,
        data_dir=args.data_dir or cfg.get("data_dir"),
        max_restarts=args.max_restarts,
    )
    try:
        tables = cfg.get("tables") or []
        if tables:
            from client import TableExistsError

            with MemoryClient(cluster.endpoint) as client:
                for t in tables:
                    t = dict(t)
                    try:
                        meta = client.create_table(t.pop("name"), t.pop("num_rows"), t.pop("dim"), **t)
                    except TableExistsError as exc:  # recovered from --data-dir: keep its contents
                        log.info("keeping the recovered table (%s)", exc)
                        continue
                    log.info("table %s: %d x %d (%s)", meta.name, meta.num_rows, meta.dim, meta.sharding)
        record = {
            "endpoint": cluster.endpoint,
            "pid": os.getpid(),
            "shards": [i["address"] for i in cluster.shard_infos],
            "ray_address": ray.get_runtime_context().gcs_address,
            "started": time.time(),
        }
        path = write_endpoint(record)
        print(f"memserver ready at {cluster.endpoint}", flush=True)
        log.info("up in %.1fs; endpoint file %s; stop with `memserver down` or Ctrl-C", time.perf_counter() - t0, path)
        while not stop.wait(0.5):
            pass
        log.info("stopping")
    finally:
        cluster.shutdown()
        ray.shutdown()
        if endpoint_file().exists() and json.loads(endpoint_file().read_text()).get("pid") == os.getpid():
            endpoint_file().unlink(missing_ok=True)
    log.info("memserver stopped")
    return 0


def _up_detached(args: argparse.Namespace) -> int:
    from memserver.cluster import endpoint_file, memserver_home

    argv = [a for a in sys.argv[1:] if a != "--detach"]
    home = memserver_home()
    home.mkdir(parents=True, exist_ok=True)
    logfile = home / "memserver.log"
    with open(logfile, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "memserver.cli", *argv],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    wait = max(args.timeout, args.placement_timeout + 60)  # placement alone may take --placement-timeout
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = logfile.read_text(errors="replace")[-3000:]
            raise CliError(f"memserver exited with status {proc.returncode} before it was ready; log {logfile}:\n{tail}")
        if endpoint_file().exists():
            rec = json.loads(endpoint_file().read_text())
            if rec.get("pid") == proc.pid:
                print(f"memserver ready at {rec['endpoint']}", flush=True)
                print(f"(running in the background as pid {proc.pid}; log {logfile}; stop with `memserver down`)")
                return 0
        time.sleep(0.2)
    proc.terminate()
    raise CliError(f"memserver was not ready after {wait:.0f}s (--timeout); log {logfile}")


# --------------------------------------------------------------------------- status


def status_dict(resp: Any) -> dict[str, Any]:
    from client import TableMeta

    return {
        "version": resp.version,
        "epoch": resp.epoch,
        "coordinator_pid": resp.coordinator_pid,
        "coordinator_restarted": resp.coordinator_restarted,
        "tables": [TableMeta.from_proto(t).to_dict() for t in resp.tables],
        "shards": [
            {
                "index": s.index,
                "address": s.address,
                "node_id": s.node_id,
                "pid": s.pid,
                "state": s.state,
                "restarted": s.restarted,
                "metrics": f"http://{s.metrics_address}/metrics" if s.metrics_address else "",
                "device": s.device,
                "requests": s.requests,
                "tables": [{"table": t.table, "rows": t.rows, "bytes": t.bytes, "requests": t.requests,
                            "wal_lsn": t.wal_lsn, "recovered_from": t.recovered_from} for t in s.tables],
            }
            for s in resp.shards
        ],
    }


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def cmd_status(args: argparse.Namespace) -> int:
    from client import MemoryClient

    endpoint = _endpoint(args)
    with MemoryClient(endpoint, timeout=args.timeout) as client:
        st = status_dict(client.status())
    if args.json:
        print(json.dumps({"endpoint": endpoint, **st}, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    restarted = " (restarted: catalog rebuilt from the shards)" if st["coordinator_restarted"] else ""
    console.print(f"memserver {st['version']} at [bold]{endpoint}[/], coordinator pid {st['coordinator_pid']}{restarted}, "
                  f"catalog epoch {st['epoch']}")
    tables = Table(title="tables")
    for col in ("name", "rows", "dim", "sharding", "optimizer", "lr", "dtype", "wal", "shards"):
        tables.add_column(col, justify="right" if col in ("rows", "dim", "lr", "shards") else "left")
    for t in st["tables"]:
        tables.add_row(t["name"], f"{t['num_rows']:,}", str(t["dim"]), t["sharding"], t["optimizer"], f"{t['lr']:g}", t["dtype"],
                       "yes" if t["wal"] else "no", str(len(t["shards"])))
    console.print(tables)
    shards = Table(title="shards")
    for col in ("#", "address", "node", "pid", "state", "device", "tables", "rows", "bytes", "requests"):
        shards.add_column(col, justify="right" if col in ("#", "pid", "tables", "rows", "bytes", "requests") else "left")
    for s in st["shards"]:
        rows = sum(t["rows"] for t in s["tables"])
        nbytes = sum(t["bytes"] for t in s["tables"])
        state = s["state"] + (" (restarted)" if s["restarted"] else "")
        shards.add_row(str(s["index"]), s["address"], s["node_id"][:12], str(s["pid"]), state, s["device"], str(len(s["tables"])),
                       f"{rows:,}", _fmt_bytes(nbytes), f"{s['requests']:,}")
    console.print(shards)
    if any(s["metrics"] for s in st["shards"]):
        console.print("Prometheus metrics: " + ", ".join(s["metrics"] for s in st["shards"] if s["metrics"]))
    for s in st["shards"]:
        for t in s["tables"]:
            if t["recovered_from"]:
                console.print(f"shard {s['index']}: table {t['table']} recovered from {t['recovered_from']}")
    return 0


def _cluster_flags(p: argparse.ArgumentParser, timeout: float, json_help: str = "print one JSON object") -> None:
    """--endpoint, --json and --timeout of the commands that talk to a running cluster."""
    p.add_argument("--endpoint", help="coordinator HOST:PORT (default: from the endpoint file)")
    p.add_argument("--json", action="store_true", help=json_help)
    p.add_argument("--timeout", type=float, default=timeout, help="RPC deadline, seconds")


def _endpoint(args: argparse.Namespace) -> str:
    if getattr(args, "endpoint", None):
        return args.endpoint
    from memserver.cluster import read_endpoint

    try:
        return read_endpoint()["endpoint"]
    except FileNotFoundError as exc:
        raise CliError(str(exc)) from None


# ----------------------------------------------------------------- checkpoint, restore


def _checkpoint_dir(args: argparse.Namespace) -> str:
    from memserver.cluster import memserver_home

    return str(Path(args.dir).resolve()) if args.dir else str(memserver_home() / "checkpoints")


def cmd_checkpoint(args: argparse.Namespace) -> int:
    from client import MemoryClient

    if args.step < 0:
        raise CliError(f"--step must be >= 0, got {args.step}")
    with MemoryClient(_endpoint(args), timeout=args.timeout) as client:
        r = client.checkpoint(_checkpoint_dir(args), args.step, args.table or None)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print(f"checkpoint of {len(r['tables'])} table(s) at step {r['step']}: {r['path']} "
              f"({_fmt_bytes(r['bytes'])} in {r['seconds']:.2f}s)")
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    from client import MemoryClient

    with MemoryClient(_endpoint(args), timeout=args.timeout) as client:
        metas = client.restore(_checkpoint_dir(args), args.step, replace=args.replace, num_shards=args.shards,
                               tables=args.table or None)
    if args.json:
        print(json.dumps([m.to_dict() for m in metas], indent=2))
    else:
        for m in metas:
            print(f"restored {m.name}: {m.num_rows:,} x {m.dim} ({m.sharding}) over {len(m.shards)} shards")
    return 0


# ----------------------------------------------------------------------------- down


def cmd_down(args: argparse.Namespace) -> int:
    from memserver.cluster import endpoint_file, read_endpoint

    if not endpoint_file().exists():
        print("no memserver is running (no endpoint file)")
        return 0
    rec = read_endpoint()
    pid = int(rec.get("pid", -1))
    if not _pid_alive(pid):
        endpoint_file().unlink(missing_ok=True)
        print(f"memserver (pid {pid}) was not running; removed its stale endpoint file")
        return 0
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + args.timeout
    while _pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _pid_alive(pid):
        os.kill(pid, signal.SIGKILL)
        endpoint_file().unlink(missing_ok=True)
        print(f"memserver (pid {pid}) did not stop within {args.timeout:.0f}s; killed it")
        return 1
    endpoint_file().unlink(missing_ok=True)
    print(f"memserver at {rec['endpoint']} stopped")
    return 0


# ------------------------------------------------------------------------- loadtest


def _parsed(parse: Any, value: str, flag: str) -> Any:
    try:
        return parse(value)
    except ValueError as exc:
        raise CliError(f"{flag}: {exc}") from None


def cmd_loadtest(args: argparse.Namespace) -> int:
    """Check every flag before touching the cluster, then run memserver.loadtest and print."""
    # locust and gevent are imported only in the child process that run_loadtest starts (see there)
    from memserver.loadtest import LoadConfig, LoadTestError, ScratchTable, parse_duration, parse_mix, run_loadtest

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
    cfg = LoadConfig(endpoint=_endpoint(args), table=args.table or "(scratch)", mix=mix, batch=args.batch, knn=args.knn,
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


# ------------------------------------------------------------------------------ main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="memserver",
        description="A distributed memory server for memory-augmented transformers: value tables sharded "
        "over Ray actors behind a gRPC lookup/update API.",
        epilog="The endpoint file lives in $MEMSERVER_HOME (default ~/.memserver); clients find the cluster through it.",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="start a memory cluster (embedded Ray head unless --address)",
                        description="Start shard actors and the coordinator. With no --address, starts a local Ray "
                        "head in this process. Prints 'memserver ready at HOST:PORT' and writes the endpoint file.")
    up.add_argument("--shards", type=int, default=0, help="number of shard actors (default: the config's, else 2)")
    up.add_argument("--config", help="YAML file: shards, shard_cpus, shard_gpus, threads_per_shard, placement, tables: [{name, num_rows, dim, ...}]")
    up.add_argument("--address", help="join an existing Ray cluster ('auto' or HOST:PORT) instead of starting one")
    up.add_argument("--detach", action="store_true", help="return once ready and leave the cluster running in the background")
    up.add_argument("--port", type=int, default=0, help="coordinator gRPC port (default: any free port)")
    up.add_argument("--num-cpus", type=int, default=0, help="CPUs of the embedded Ray head (default: all)")
    up.add_argument("--object-store-mb", type=int, default=256, help="object store size of the embedded Ray head, MiB")
    up.add_argument("--shard-cpus", type=float, default=0.5, help="Ray CPUs reserved per shard actor")
    up.add_argument("--shard-gpus", type=float, default=0.0, help="Ray GPUs per shard actor (rows then live on the GPU)")
    up.add_argument("--threads-per-shard", type=int, default=1, help="torch compute threads in each shard")
    up.add_argument("--placement", type=str.upper, choices=PLACEMENTS, default=None,
                    help="how shards are laid out over Ray nodes (a placement group, one bundle per shard): SPREAD "
                    "(different nodes where possible), STRICT_SPREAD (one node each, or fail), PACK (fewest nodes); "
                    "default: the config's, else SPREAD")
    up.add_argument("--data-dir", help="where shards keep their table records and write-ahead logs, so a restarted shard "
                    "(and a later `up` on the same directory) recovers its tables; every node must be able to write it "
                    "(default: a scratch directory under $MEMSERVER_HOME/run, removed when the cluster stops)")
    up.add_argument("--max-restarts", type=int, default=-1,
                    help="times Ray restarts a dead shard or coordinator (-1: always, 0: never)")
    up.add_argument("--placement-timeout", type=float, default=120.0,
                    help="seconds to wait for Ray to place the shards (raise it when an autoscaler must add nodes first)")
    up.add_argument("--timeout", type=float, default=180.0, help="with --detach: seconds to wait for readiness (at least --placement-timeout + 60)")
    up.set_defaults(func=cmd_up)

    st = sub.add_parser("status", help="tables and shards of the running cluster",
                        description="Show tables and shards (node, pid, port, state, rows, bytes, requests served, "
                        "metrics URL) and what each restarted shard recovered its tables from.")
    _cluster_flags(st, timeout=30.0, json_help="print one JSON object instead of tables")
    st.set_defaults(func=cmd_status)

    ck = sub.add_parser("checkpoint", help="write a consistent checkpoint of the tables",
                        description="Every shard writes its slices (temporary name, fsync, rename); the manifest is "
                        "written last, so an interrupted checkpoint leaves the previous one intact. Run it at a step "
                        "barrier (no writes in flight) for a consistent cut.")
    ck.add_argument("--dir", help="checkpoint root (default: $MEMSERVER_HOME/checkpoints); must be visible to every shard")
    ck.add_argument("--step", type=int, default=0, help="step number recorded in the checkpoint (its folder is step-<step>)")
    ck.add_argument("--table", action="append", default=[], help="only this table (repeatable; default: all)")
    _cluster_flags(ck, timeout=600.0)
    ck.set_defaults(func=cmd_checkpoint)

    rs = sub.add_parser("restore", help="load tables from a checkpoint",
                        description="Load tables from the latest complete checkpoint in --dir (or --step), into any "
                        "number of shards (--shards reshards).")
    rs.add_argument("--dir", help="checkpoint root (default: $MEMSERVER_HOME/checkpoints)")
    rs.add_argument("--step", type=int, default=0, help="which step (default: the latest complete checkpoint)")
    rs.add_argument("--table", action="append", default=[], help="only this table (repeatable; default: all)")
    rs.add_argument("--replace", action="store_true", help="drop existing tables of the same name first")
    rs.add_argument("--shards", type=int, default=0, help="restore into this many shards (default: as saved)")
    _cluster_flags(rs, timeout=600.0)
    rs.set_defaults(func=cmd_restore)

    down = sub.add_parser("down", help="stop the cluster that `up` started", description="Stop the running memserver cleanly.")
    down.add_argument("--timeout", type=float, default=60.0, help="seconds to wait before killing it")
    down.set_defaults(func=cmd_down)
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
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    try:
        return args.func(args)
    except KeyboardInterrupt:
        parser.exit(130, "memserver: interrupted\n")
    except CliError as exc:
        parser.exit(2, f"memserver: error: {exc}\n")
    except Exception as exc:
        from client.errors import MemserverError

        if isinstance(exc, (MemserverError, FileNotFoundError)):
            parser.exit(1, f"memserver: error: {exc}\n")
        raise


if __name__ == "__main__":
    sys.exit(main())
