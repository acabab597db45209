"""Locust's distributed mode (a master, workers on other hosts) with exact percentiles over every
worker's responses. One piece of code for `memserver loadtest --expect-workers / --worker-of` and
for plain `locust -f deploy/locustfile.py --master / --worker`: `setup(environment)` hooks it onto
the environment's runner, over locust's own custom messages.

- Test start, master -> workers (`memserver_config`): the master's LoadConfig as MEMSERVER_*
  variables, before the spawn message (same connection, in order), so a worker needs only the
  master's address. Never a token and never the endpoint: locust's master/worker channel is
  plaintext and unauthenticated (docs/security.md), and a master that could name the endpoint
  could make a worker send its token anywhere. A worker loads through its own way to the cluster
  (its MEMSERVER_ENDPOINT or endpoint file, MEMSERVER_ENDPOINT_FILE, with that file's token and CA).
- Test stopping, master -> workers (`memserver_collect`): each worker stops its users (calls in
  flight finish, up to locust's stop timeout) and answers (`memserver_latencies`) with its
  LatencyRecorder's to_message: at most max_requests x 8 bytes of latencies. The master waits for
  every worker it knows, at most `wait_s`, merges what came (LatencyRecorder.merge) and names the
  workers that did not answer. Stopping is where locust's headless `-t` and Ctrl-C both pass, and
  it comes before locust tells workers to quit.

Import this only where locust may monkey-patch the process (it imports memserver.loadtest.user).
"""

from __future__ import annotations

# isort: off
from memserver.loadtest import user  # first: locust's gevent monkey-patching

# isort: on
import argparse
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import gevent
import grpc
import locust
import numpy as np
from locust.env import Environment
from locust.runners import MasterRunner, WorkerRunner

from memserver.api.errors import MemserverError
from memserver.loadtest.config import CHILD_OF_CLI_ENV, LoadConfig, parse_host_port
from memserver.loadtest.recorder import LatencyRecorder

CONFIG = "memserver_config"
COLLECT = "memserver_collect"
LATENCIES = "memserver_latencies"
#: What the master sends: every LoadConfig variable but the endpoint (see the module docstring).
SENT_VARS = tuple(v for k, v in LoadConfig.ENV.items() if k != "endpoint")

log = logging.getLogger("memserver.loadtest")


def config_message(cfg: LoadConfig) -> dict[str, str]:
    """What the master sends its workers: cfg's MEMSERVER_* variables, no endpoint, no token."""
    return {k: v for k, v in cfg.to_env().items() if k in SENT_VARS}


def worker_config(data: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> LoadConfig:
    """A worker's LoadConfig: the master's settings, the worker's own endpoint (MEMSERVER_ENDPOINT
    or its endpoint file). Anything but SENT_VARS in the message is ignored."""
    sent = {k: v for k, v in dict(data).items() if k in SENT_VARS}
    if not all(isinstance(v, str) for v in sent.values()):
        raise ValueError("the master's settings are not strings")
    return LoadConfig.from_env({**(os.environ if environ is None else environ), **sent})


@dataclass
class MasterState:
    """The master's merge of one test: every worker's latencies, per-worker counts, who is missing."""

    cfg: LoadConfig | None
    wait_s: float
    merged: LatencyRecorder = field(default_factory=LatencyRecorder)
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)
    expected: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)
    started: float | None = None
    stopped: float | None = None

    def reset(self) -> None:
        self.merged, self.workers, self.expected, self.missing, self.rejected = LatencyRecorder(), {}, [], [], {}
        self.started, self.stopped = time.monotonic(), None

    def report(self, names: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
        """LatencyRecorder.report over every worker's responses, plus `workers` (each one's own
        counts), `missing_workers` and `rejected_workers` (malformed or over-bound messages).
        req/s is over the longest worker's span (its first request to its last answer: workers
        start together, and hosts share no clock); with no worker's report, the master's, test
        start to collect (which also counts the wait for the workers' reports)."""
        spans = [w["elapsed_s"] for w in self.workers.values()]
        span = max(spans) if spans else (
            (self.stopped or time.monotonic()) - self.started if self.started is not None else 0.0)
        out = self.merged.report(span, names=names)
        out.update(workers=self.workers, missing_workers=self.missing, rejected_workers=self.rejected)
        return out


@dataclass
class WorkerState:
    """A worker's side: the master's address, the address this host reaches it from, the config of
    the current test, and whether its latencies were sent."""

    master: str
    address: str
    cfg: LoadConfig | None = None
    config_error: str | None = None
    sent: bool = False


def setup(environment: Environment, cfg: LoadConfig | None = None, wait_s: float | None = None) -> Any:
    """Hook the distributed merge onto environment.runner (create the runner first; idempotent).
    Any runner records exactly (attach_recorder). On a master: `cfg` is what the workers are sent
    (default: the master's own MEMSERVER_* at each test start, if they name a table; if not, the
    workers use their own), `wait_s` bounds the wait for the workers' latencies (default: the
    request deadline + 30 s). Returns MasterState, WorkerState or None (a local runner)."""
    user.attach_recorder(environment)
    runner = environment.runner
    if getattr(environment, "memserver_distributed", None) is not None:
        return environment.memserver_distributed
    state: Any = None
    if isinstance(runner, MasterRunner):
        state = MasterState(cfg, wait_s if wait_s is not None else (cfg.timeout if cfg else 10.0) + 30.0)
        runner.register_message(LATENCIES, _on_latencies)
        environment.events.test_start.add_listener(_master_test_start)
        environment.events.test_stopping.add_listener(_master_test_stopping)
    elif isinstance(runner, WorkerRunner):
        state = _worker_state(runner)
    environment.memserver_distributed = state
    return state


def _worker_state(runner: WorkerRunner) -> WorkerState:
    """A worker's state and its handlers of the master's messages: registered before it connects
    (`_Worker`), since a master that has all its workers sends the test's config at once, and
    one that came before they were there was dropped ("Unknown message type received:
    memserver_config"; the worker then waited its whole bound for a test: a suite run's)."""
    env = runner.environment
    if getattr(env, "memserver_distributed", None) is None:
        env.memserver_distributed = WorkerState(f"{runner.master_host}:{runner.master_port}",
                                                _local_address(runner.master_host, runner.master_port))
        runner.register_message(CONFIG, _on_config)
        runner.register_message(COLLECT, _on_collect)
    return env.memserver_distributed


class _Worker(WorkerRunner):
    """locust's worker runner with memserver's message handlers in place before it connects."""

    def connect_to_master(self) -> None:
        user.attach_recorder(self.environment)
        _worker_state(self)
        super().connect_to_master()


def _local_address(host: str, port: int) -> str:
    """This host's address towards the master (a UDP socket's connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()


# the master's side
def _master_test_start(environment: Environment, **_: Any) -> None:
    state: MasterState = environment.memserver_distributed
    if not isinstance(state, MasterState):
        return
    state.reset()
    cfg = state.cfg
    if cfg is None:
        try:
            cfg = LoadConfig.from_env()
        except ValueError as exc:
            log.warning("the master has no load settings (%s): each worker uses its own MEMSERVER_*", exc)
    if cfg is not None:
        environment.runner.send_message(CONFIG, config_message(cfg))


def _master_test_stopping(environment: Environment, **_: Any) -> None:
    state: MasterState = environment.memserver_distributed
    runner = environment.runner
    if not isinstance(state, MasterState) or state.stopped is not None:
        return
    state.stopped = time.monotonic()
    alive = [c.id for c in runner.clients.ready + runner.clients.spawning + runner.clients.running]
    state.expected = sorted({c.id for c in runner.clients.all})
    if alive:  # none alive: the last worker quit, and this may run in the greenlet that receives
        runner.send_message(COLLECT, None)
        deadline = time.monotonic() + state.wait_s
        while time.monotonic() < deadline and not set(state.expected) <= set(state.workers) | set(state.rejected):
            gevent.sleep(0.05)
    state.missing = [w for w in state.expected if w not in state.workers and w not in state.rejected]
    if state.missing:
        log.error("no latencies from worker(s) %s within %.0f s: the merged percentiles leave them out",
                  ", ".join(state.missing), state.wait_s)


def _on_latencies(environment: Environment, msg: Any, **_: Any) -> None:
    state: MasterState = environment.memserver_distributed
    wid = str(msg.node_id)
    if wid in state.workers or wid in state.rejected:
        return  # one message per worker and test
    bound = state.cfg.max_requests if state.cfg else None
    try:
        rec = LatencyRecorder.from_message(msg.data, max_samples=bound)
    except (ValueError, AttributeError) as exc:
        state.rejected[wid] = str(exc)[:200]
        log.error("worker %s sent latencies the master refuses: %s", wid, exc)
        return
    state.merged.merge(rec)
    r = rec.report()
    address = msg.data.get("address")
    state.workers[wid] = {"address": address[:100] if isinstance(address, str) else "?",
                          "requests": r["requests"], "failures": r["failures"], "dropped": r["dropped"],
                          "rps": r["rps"], "elapsed_s": r["elapsed_s"], "p50_ms": r["total"]["p50_ms"],
                          "p99_ms": r["total"]["p99_ms"]}


# the worker's side
def _on_config(environment: Environment, msg: Any, **_: Any) -> None:
    state: WorkerState = environment.memserver_distributed
    try:
        cfg = worker_config(msg.data or {})
    except (ValueError, TypeError) as exc:
        state.config_error = f"the master's settings: {exc}"
        log.error("%s", state.config_error)
        return
    user._Process.configure(cfg)
    rec = user.attach_recorder(environment, max_samples=cfg.max_requests)
    rec.clear()
    user.count_users(environment).clear()
    state.cfg, state.config_error, state.sent = cfg, None, False


def _on_collect(environment: Environment, msg: Any, **_: Any) -> None:
    state: WorkerState = environment.memserver_distributed
    runner = environment.runner
    runner.stop()  # graceful: calls in flight are answered and recorded first
    rec = user.attach_recorder(environment)
    runner.send_message(LATENCIES, {"address": state.address, **rec.to_message()})
    state.sent = True


# what `memserver loadtest --expect-workers / --worker-of` runs (python -m memserver.loadtest.distributed)
def run_master(users: int, spawn_rate: float, duration_s: float, bind: tuple[str, int], expect_workers: int,
               wait_s: float) -> tuple[dict[str, Any], LatencyRecorder]:
    """A locust master on `bind`, no local users: waits at most `wait_s` for `expect_workers`
    workers, spreads `users` over them for `duration_s`, then collects every worker's latencies
    (at most `wait_s` more) and returns the merged report and recorder."""
    cfg = LoadConfig.from_env()
    env = Environment(user_classes=[user.MemserverUser], events=locust.events, stop_timeout=cfg.timeout + 1)
    runner = _bind_master(env, bind)
    state: MasterState = setup(env, cfg=cfg, wait_s=wait_s)
    interrupted = user.on_signals()
    peak = 0
    try:
        deadline = time.monotonic() + wait_s
        while runner.worker_count < expect_workers and time.monotonic() < deadline and not interrupted.is_set():
            interrupted.wait(0.1)
        if runner.worker_count < expect_workers:
            raise ValueError(f"--expect-workers: {runner.worker_count} of {expect_workers} workers connected to "
                             f"{bind[0]}:{bind[1]} within {wait_s:g} s")
        runner.start(users, spawn_rate=spawn_rate)
        deadline = time.monotonic() + duration_s
        while time.monotonic() < deadline and not interrupted.is_set():
            peak = max(peak, runner.user_count)  # the workers' counts, as their heartbeats report them
            if peak and runner.user_count == 0:
                break  # every user stopped itself (--max-requests): no need to wait for --duration
            interrupted.wait(min(0.05, max(0.0, deadline - time.monotonic())))
    finally:
        runner.quit()  # test_stopping: the collect above; then locust tells the workers to quit
    report = state.report(names=list(cfg.mix))
    report["interrupted"] = interrupted.is_set()
    report["users_reached"] = peak
    report["expect_workers"] = expect_workers
    report["master"] = f"{bind[0]}:{bind[1]}"
    report["locust_exceptions"] = sum(e["count"] for e in runner.exceptions.values())
    for e in runner.exceptions.values():
        report["errors"][f"user: {e['msg']}"] = e["count"]
    return report, state.merged


def run_worker(master: tuple[str, int], wait_s: float) -> tuple[dict[str, Any], LatencyRecorder]:
    """A locust worker of `master`: waits at most `wait_s` for a test, runs the master's users
    with the master's settings and this host's way to the cluster, sends its latencies when the
    master stops, and returns its own report once the master says quit (bounded: the test's
    max_seconds + `wait_s` + the request deadline)."""
    env = Environment(user_classes=[user.MemserverUser], events=locust.events)
    deadline = time.monotonic() + wait_s
    runner = _connect_worker(env, master, wait_s)
    state: WorkerState = setup(env)
    interrupted = user.on_signals()
    try:
        while state.cfg is None and state.config_error is None and time.monotonic() < deadline \
                and not interrupted.is_set() and len(runner.greenlet):
            interrupted.wait(0.1)
        if state.config_error:
            raise ValueError(state.config_error)
        if state.cfg is None:
            raise ValueError(f"--worker-of: no test from the master at {master[0]}:{master[1]} within {wait_s:g} s")
        cfg = state.cfg
        deadline = time.monotonic() + cfg.max_seconds + cfg.timeout + wait_s
        while len(runner.greenlet) and time.monotonic() < deadline and not interrupted.is_set():
            interrupted.wait(0.1)
    finally:
        if len(runner.greenlet):
            runner.quit()  # tells the master this worker leaves
    rec = user.attach_recorder(env)
    reached = user.count_users(env).peak
    report = rec.report(names=list(cfg.mix))
    meta = user._Process.caller.meta if user._Process.caller is not None else None
    report.update({
        "master": f"{master[0]}:{master[1]}", "address": state.address, "sent": state.sent,
        "interrupted": interrupted.is_set(), "endpoint": cfg.endpoint, "users": reached, "users_reached": reached,
        "locust_exceptions": sum(e["count"] for e in runner.exceptions.values()),
        "table": {"name": cfg.table, "num_rows": meta.num_rows if meta else 0, "dim": meta.dim if meta else 0,
                  "sharding": meta.sharding if meta else "?", "shards": len(meta.shards) if meta else 0,
                  "scratch": False},
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("endpoint", "table")},
    })
    return report, rec


def _bind_master(env: Environment, bind: tuple[str, int]) -> Any:
    """locust's master runner listening on `bind`; a port in use or an address not this host's
    is one line naming the flag (locust raised zmq's error, or exited, after its traceback)."""
    import zmq
    from locust.exception import RPCError

    try:
        return env.create_master_runner(*bind)
    except (RPCError, zmq.ZMQError, SystemExit) as exc:
        zmq_error = exc if isinstance(exc, zmq.ZMQError) else exc.__context__  # RPCError wraps zmq's
        why = os.strerror(zmq_error.errno) if isinstance(zmq_error, zmq.ZMQError) else "its port is in use"
        raise ValueError(f"--master-bind {bind[0]}:{bind[1]}: cannot listen there ({why})") from None


def _connect_worker(env: Environment, master: tuple[str, int], wait_s: float) -> WorkerRunner:
    """locust's worker runner, connected to `master` within `wait_s`. locust's own connection
    retries 60 times 5 s (5 minutes) whatever the caller's bound; its two module settings are set
    for this one call, which is all a worker process makes."""
    import math

    import locust.env
    from locust import runners

    saved = runners.CONNECT_TIMEOUT, runners.CONNECT_RETRY_COUNT
    runners.CONNECT_TIMEOUT = max(0.1, min(saved[0], wait_s))
    runners.CONNECT_RETRY_COUNT = max(0, math.ceil(wait_s / runners.CONNECT_TIMEOUT) - 1)
    locust.env.WorkerRunner = _Worker  # (the class create_worker_runner makes: ours, for this one call)
    try:
        return env.create_worker_runner(*master)
    except ConnectionError:
        raise ValueError(f"--worker-of: no locust master answered at {master[0]}:{master[1]} within {wait_s:g} s "
                         "(is `memserver loadtest --expect-workers N --master-bind` running there?)") from None
    finally:
        runners.CONNECT_TIMEOUT, runners.CONNECT_RETRY_COUNT = saved
        locust.env.WorkerRunner = WorkerRunner


def save_latencies(rec: LatencyRecorder, path: str) -> None:
    """Every kept response time, float64 ms, one array per call name, as a numpy .npz written to
    `path` as named (np.savez given a name adds ".npz" to one without it, silently)."""
    with open(path, "wb") as f:
        np.savez(f, **{name: np.frombuffer(a, dtype=np.float64) for name, a in rec.ok.items()})


def main(argv: list[str] | None = None) -> int:
    """`python -m memserver.loadtest.distributed --users N --spawn-rate R --duration S --report FILE`, as a
    master (`--master-bind H:P --expect-workers N --wait S`) or a worker (`--worker-of H:P --wait S`)."""
    p = argparse.ArgumentParser(prog="python -m memserver.loadtest.distributed", description=user.__doc__)
    p.add_argument("--users", type=int, default=1)
    p.add_argument("--spawn-rate", type=float, default=1.0)
    p.add_argument("--duration", type=float, default=1.0, help="seconds")
    p.add_argument("--report", required=True, help="write the JSON report here")
    p.add_argument("--master-bind", help="HOST:PORT: run as locust master of --expect-workers workers")
    p.add_argument("--expect-workers", type=int, default=0)
    p.add_argument("--worker-of", help="HOST:PORT: run as a locust worker of that master")
    p.add_argument("--wait", type=float, default=60.0, help="seconds: bounded waits for workers / for the master")
    p.add_argument("--save-latencies", help="write every kept response time here (.npz)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="locust: %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        if args.master_bind or args.worker_of:
            if args.master_bind:
                report, rec = run_master(args.users, args.spawn_rate, args.duration,
                                                     parse_host_port(args.master_bind), args.expect_workers,
                                                     args.wait)
            else:
                report, rec = run_worker(parse_host_port(args.worker_of), args.wait)
        else:
            report, rec = user.run_headless(args.users, args.spawn_rate, args.duration)
    except (ValueError, grpc.RpcError, MemserverError) as exc:  # bad MEMSERVER_* settings, unknown table, no
        # coordinator, no workers
        detail = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.RpcError) else str(exc)
        with open(args.report, "w") as f:  # `memserver loadtest` says it (on stdout too with --json)
            json.dump({"error": detail}, f)
        if not os.environ.get(CHILD_OF_CLI_ENV):  # run by hand: said here
            print(f"memserver loadtest: error: {detail}", file=sys.stderr)
        return 2
    if args.save_latencies:
        try:
            save_latencies(rec, args.save_latencies)
        except OSError as exc:  # the run's report still comes back; the command fails on this
            report["save_error"] = f"--save-latencies: cannot write {args.save_latencies}: {exc.strerror or exc}"
    with open(args.report, "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
