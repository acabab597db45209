"""`memserver`: start, inspect and stop a memory cluster. Thin over memserver.cluster and client."""

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

TABLE_KEYS = {"name", "num_rows", "dim", "sharding", "optimizer", "lr", "dtype", "init_std", "seed", "num_shards", "eps"}
CONFIG_KEYS = {"shards", "shard_cpus", "shard_gpus", "threads_per_shard", "tables"}


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
    )
    try:
        tables = cfg.get("tables") or []
        if tables:
            with MemoryClient(cluster.endpoint) as client:
                for t in tables:
                    t = dict(t)
                    meta = client.create_table(t.pop("name"), t.pop("num_rows"), t.pop("dim"), **t)
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
    deadline = time.monotonic() + args.timeout
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
    raise CliError(f"memserver was not ready after {args.timeout:.0f}s (--timeout); log {logfile}")


# --------------------------------------------------------------------------- status


def status_dict(resp: Any) -> dict[str, Any]:
    from client import TableMeta

    return {
        "version": resp.version,
        "epoch": resp.epoch,
        "tables": [TableMeta.from_proto(t).to_dict() for t in resp.tables],
        "shards": [
            {
                "index": s.index,
                "address": s.address,
                "node_id": s.node_id,
                "pid": s.pid,
                "device": s.device,
                "requests": s.requests,
                "tables": [{"table": t.table, "rows": t.rows, "bytes": t.bytes, "requests": t.requests} for t in s.tables],
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
    console.print(f"memserver {st['version']} at [bold]{endpoint}[/], catalog epoch {st['epoch']}")
    tables = Table(title="tables")
    for col in ("name", "rows", "dim", "sharding", "optimizer", "lr", "dtype", "shards"):
        tables.add_column(col, justify="right" if col in ("rows", "dim", "lr", "shards") else "left")
    for t in st["tables"]:
        tables.add_row(t["name"], f"{t['num_rows']:,}", str(t["dim"]), t["sharding"], t["optimizer"], f"{t['lr']:g}", t["dtype"], str(len(t["shards"])))
    console.print(tables)
    shards = Table(title="shards")
    for col in ("#", "address", "node", "pid", "device", "tables", "rows", "bytes", "requests"):
        shards.add_column(col, justify="right" if col in ("#", "pid", "tables", "rows", "bytes", "requests") else "left")
    for s in st["shards"]:
        rows = sum(t["rows"] for t in s["tables"])
        nbytes = sum(t["bytes"] for t in s["tables"])
        shards.add_row(str(s["index"]), s["address"], s["node_id"][:12], str(s["pid"]), s["device"], str(len(s["tables"])), f"{rows:,}", _fmt_bytes(nbytes), f"{s['requests']:,}")
    console.print(shards)
    return 0


def _endpoint(args: argparse.Namespace) -> str:
    if getattr(args, "endpoint", None):
        return args.endpoint
    from memserver.cluster import read_endpoint

    try:
        return read_endpoint()["endpoint"]
    except FileNotFoundError as exc:
        raise CliError(str(exc)) from None


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
    up.add_argument("--config", help="YAML file: shards, shard_cpus, shard_gpus, threads_per_shard, tables: [{name, num_rows, dim, ...}]")
    up.add_argument("--address", help="join an existing Ray cluster ('auto' or HOST:PORT) instead of starting one")
    up.add_argument("--detach", action="store_true", help="return once ready and leave the cluster running in the background")
    up.add_argument("--port", type=int, default=0, help="coordinator gRPC port (default: any free port)")
    up.add_argument("--num-cpus", type=int, default=0, help="CPUs of the embedded Ray head (default: all)")
    up.add_argument("--object-store-mb", type=int, default=256, help="object store size of the embedded Ray head, MiB")
    up.add_argument("--shard-cpus", type=float, default=0.5, help="Ray CPUs reserved per shard actor")
    up.add_argument("--shard-gpus", type=float, default=0.0, help="Ray GPUs per shard actor (rows then live on the GPU)")
    up.add_argument("--threads-per-shard", type=int, default=1, help="torch compute threads in each shard")
    up.add_argument("--timeout", type=float, default=180.0, help="with --detach: seconds to wait for readiness")
    up.set_defaults(func=cmd_up)

    st = sub.add_parser("status", help="tables and shards of the running cluster",
                        description="Show tables and shards (node, pid, port, rows, bytes, requests served).")
    st.add_argument("--endpoint", help="coordinator HOST:PORT (default: from the endpoint file)")
    st.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    st.add_argument("--timeout", type=float, default=30.0, help="RPC deadline, seconds")
    st.set_defaults(func=cmd_status)

    down = sub.add_parser("down", help="stop the cluster that `up` started", description="Stop the running memserver cleanly.")
    down.add_argument("--timeout", type=float, default=60.0, help="seconds to wait before killing it")
    down.set_defaults(func=cmd_down)
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
    except CliError as exc:
        parser.exit(2, f"memserver: error: {exc}\n")
    except Exception as exc:
        from client.errors import MemserverError

        if isinstance(exc, (MemserverError, FileNotFoundError)):
            parser.exit(1, f"memserver: error: {exc}\n")
        raise


if __name__ == "__main__":
    sys.exit(main())
