"""What `memserver loadtest` runs: an optional scratch table and a bounded locust child process."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, replace
from typing import Any

from memserver.loadtest.config import CHILD_OF_CLI_ENV, MAX_DURATION_S, LoadConfig

log = logging.getLogger(__name__)


class LoadTestError(RuntimeError):
    """The locust process failed or hung; its own messages went to stderr."""


@dataclass(frozen=True)
class ScratchTable:
    """The table `memserver loadtest` creates when none is named, and drops afterwards."""

    num_rows: int = 65536
    dim: int = 128
    sharding: str = "cols"


@dataclass(frozen=True)
class Master:
    """Run as locust master (memserver/loadtest/distributed.py): no local users; `users` spread
    over `expect_workers` workers that connect to `bind` (HOST:PORT); `wait_s` bounds the wait
    for them to connect and, after the run, for each one's latencies."""

    bind: tuple[str, int]
    expect_workers: int
    wait_s: float = 60.0


def run_loadtest(cfg: LoadConfig, users: int, spawn_rate: float, duration_s: float,
                 scratch: ScratchTable | None = None, master: Master | None = None,
                 save_latencies: str | None = None) -> dict[str, Any]:
    """Run a headless locust load against cfg.table and return the report (LatencyRecorder.report
    plus what was run). With `scratch`, creates a fresh table for the run instead and drops it
    afterwards, also on errors and Ctrl-C. With `master`, the load comes from locust workers
    (`run_worker` elsewhere) and the report merges every worker's latencies exactly.

    Locust runs in a child process (memserver/loadtest/distributed.py): importing locust monkey-patches
    sockets, threads and time with gevent for the whole process, which breaks the MemoryClient's
    asyncio loop thread and grpc.aio here, and cannot be undone. The child is bounded in time
    (duration + grace, then killed) and in requests (cfg.max_requests).
    """
    from client import MemoryClient
    from memserver.loadtest.caller import check_table

    with MemoryClient(cfg.endpoint, timeout=60.0) as mem:
        if scratch is not None:
            cfg = replace(cfg, table=f"loadtest-{uuid.uuid4().hex[:8]}")
            _create_scratch(mem, cfg.table, scratch)
        try:
            meta = mem.table(cfg.table)  # TableNotFoundError before any locust starts
            check_table(meta, cfg.batch, cfg.knn, mix=cfg.mix)  # an index table, a call too large: before any locust
            if scratch is not None:
                _warm_up(mem, meta, cfg)
            # the users stop themselves a little after the duration even if the runner does not; the
            # cap follows the duration (the config's 3600 s default, taken as a bound, cut a 2 h run quietly)
            cfg = replace(cfg, max_seconds=duration_s + cfg.timeout + 5)
            args = ["--users", str(users), "--spawn-rate", str(spawn_rate), "--duration", str(duration_s)]
            grace = duration_s + 2 * cfg.timeout + 120
            if master is not None:
                args += ["--master-bind", f"{master.bind[0]}:{master.bind[1]}", "--expect-workers",
                         str(master.expect_workers), "--wait", str(master.wait_s)]
                grace += 2 * master.wait_s
            report = _run_child(cfg.to_env(), args, grace, save_latencies)
        except BaseException:
            if scratch is not None and (error := _drop_scratch(mem, cfg.table)):
                log.warning("%s", error)  # the run's own error is the one raised: the failed drop is said here
            raise
        if scratch is not None and (error := _drop_scratch(mem, cfg.table)):
            report["scratch_drop_error"] = error  # the run's figures still stand: printed, with this beside them
    report.update({
        "endpoint": cfg.endpoint,
        "table": {"name": meta.name, "num_rows": meta.num_rows, "dim": meta.dim, "sharding": meta.sharding,
                  "shards": len(meta.shards), "scratch": scratch is not None},
        "users": users, "spawn_rate": spawn_rate, "duration_s": duration_s,
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("endpoint", "table")},
    })
    return report


def _create_scratch(mem: Any, table: str, scratch: ScratchTable) -> None:
    """Create the run's scratch table on every shard; a shape the cluster cannot split is a
    ValueError naming the flags (the catalog's own words name create_table's arguments)."""
    from memserver.api.errors import InvalidArgumentError
    from memserver.api.types import SHARDINGS, split_problem

    try:
        mem.create_table(table, scratch.num_rows, scratch.dim, sharding=scratch.sharding)
    except InvalidArgumentError:
        shards = len(mem.status().shards)
        problem = split_problem(SHARDINGS[scratch.sharding], scratch.num_rows, scratch.dim, shards)
        if problem is None:
            raise
        field, what = problem
        other = split_problem(SHARDINGS["rows" if field == "dim" else "cols"], scratch.num_rows, scratch.dim, shards)
        fix = f"--{field.replace('_', '-')} >= {shards}" + ("" if other else ", or --sharding " +
                                                           ("rows" if field == "dim" else "cols"))
        raise ValueError(f"--{field.replace('_', '-')}: {what} (the scratch table takes every shard of the cluster): "
                         f"give {fix}") from None


def _warm_up(mem: Any, meta: Any, cfg: LoadConfig) -> None:
    """One untimed call of each kind in the mix on the fresh scratch table: a first call's one-time
    costs (the client's channels and shared-memory regions; a shard that could not load its compiled
    kernels from numba's cache compiles them at its start, memserver.core.warmup) stay out of the
    timed latencies. A user's own table (--table) gets none: its calls would count and write."""
    from memserver.loadtest.caller import Batches

    b = Batches(meta, cfg, seed=0)
    for op in cfg.mix:  # (the client's methods are the mix's names)
        getattr(mem, op)(cfg.table, *b.inputs(op))


def _drop_scratch(mem: Any, table: str) -> str | None:
    """Drop the run's scratch table; what went wrong (the cluster stopped, someone dropped it) or None,
    for the caller to say (once: it was logged here and printed by the command too)."""
    from memserver.api.errors import TableNotFoundError
    from memserver.cli.common import one_line

    try:
        mem.drop_table(table)
    except TableNotFoundError:  # (there is nothing left to drop: no advice to drop it)
        return f"the scratch table {table} was dropped by someone else during the run: its later calls failed"
    except Exception as exc:
        return (f"the scratch table {table} was not dropped: {one_line(exc)}; drop it with `memserver drop-table "
                f"{table}` once the cluster serves it")
    return None


def run_worker(master: tuple[str, int], wait_s: float = 60.0, endpoint: str | None = None,
               save_latencies: str | None = None) -> dict[str, Any]:
    """Run as a locust worker of `master` (memserver/loadtest/distributed.py) and return this
    worker's own report once the master ends the test. The table and every setting come from the
    master; the way to the cluster (`endpoint`, else MEMSERVER_ENDPOINT or the endpoint file, with
    its token and CA) is this host's own. The child bounds itself (see distributed.run_worker)."""
    env = {"MEMSERVER_ENDPOINT": endpoint} if endpoint else {}
    args = ["--worker-of", f"{master[0]}:{master[1]}", "--wait", str(wait_s)]
    return _run_child(env, args, MAX_DURATION_S + 3 * wait_s + 300, save_latencies)


def _run_child(env: dict[str, str], args: list[str], timeout: float, save_latencies: str | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="memserver-loadtest-") as tmp:
        report_path = os.path.join(tmp, "report.json")
        cmd = [sys.executable, "-m", "memserver.loadtest.distributed", *args, "--report", report_path]
        if save_latencies:
            cmd += ["--save-latencies", save_latencies]
        proc = subprocess.Popen(cmd, env={**os.environ, **env, CHILD_OF_CLI_ENV: "1"}, stdin=subprocess.DEVNULL)
        interrupted = False
        try:
            try:
                # start-up (imports) + the run + the users' last answers; after that it is stuck
                rc = proc.wait(timeout=timeout)
            except KeyboardInterrupt:
                # Ctrl-C: the child (same process group) got it too and stops early, writing its
                # report; tell it again in case it runs elsewhere, and wait for that report
                interrupted = True
                rc = stop_child(proc, 120.0)
        except subprocess.TimeoutExpired:
            raise LoadTestError(f"the locust process did not finish within {timeout:.0f} s; killed it") from None
        finally:
            if proc.poll() is None:  # timed out, a second Ctrl-C, an error: stop the load before the table goes
                proc.kill()
                proc.wait()
        if rc == 2 and os.path.exists(report_path):  # the child refused what it was asked: said by the parent
            with open(report_path) as f:
                said = json.load(f).get("error")
            if said:
                raise LoadTestError(said)
        # interrupted, the child may die of the repeated SIGINT after it wrote its report: fine
        if not os.path.exists(report_path) or (rc != 0 and not interrupted):
            if interrupted:  # before the child had started its run: nothing to report
                raise KeyboardInterrupt
            raise LoadTestError(f"the locust process failed (exit status {rc}); its errors are above")
        with open(report_path) as f:
            report = json.load(f)
        if interrupted:  # (said by the exit status, 130, however the child took it)
            report["interrupted"] = True
        return report


def stop_child(proc: subprocess.Popen[Any], timeout: float, every: float = 1.0) -> int:
    """SIGINT to the locust child until it exits (its exit status), `timeout` s at most. Once
    was not enough: a child still importing when it came (its handler not set yet) lost it and
    ran on to its --duration, and a SIGTERMed `loadtest` exited 0 (a whole-suite run). The
    child keeps its handler until it exits, so a repeat only says stop again."""
    deadline = time.monotonic() + timeout
    while True:
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(timeout=max(0.0, min(every, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                raise
