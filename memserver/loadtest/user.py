"""The locust side of the load test: `MemserverUser` and a headless runner.

Importing this module imports locust, which monkey-patches the whole process with gevent, and
switches gRPC to gevent-friendly polling. Import it only in a process that exists to make load:
`locust -f deploy/locustfile.py`, or `python -m memserver.loadtest.distributed` (what `memserver loadtest`
starts). What the users send comes from MEMSERVER_* variables (memserver.loadtest.config.LoadConfig).
"""

from __future__ import annotations

# isort: off
import locust  # first: it monkey-patches the process with gevent before grpc or torch are loaded

# isort: on
import itertools
import logging
import signal
import time
import uuid
from typing import Any

import gevent
import gevent.event
import gevent.lock
import grpc.experimental.gevent as grpc_gevent
import numpy as np
import torch
from locust.exception import StopUser
from locust.runners import WorkerRunner

from client.ops import ClientSession, WriteTags
from memserver.api.errors import first_line
from memserver.cli.common import WRONG_COMMAND, exit_status
from memserver.loadtest.caller import Batches, ShardCaller, fetch_table, setup_seconds
from memserver.loadtest.config import LoadConfig
from memserver.loadtest.recorder import LatencyRecorder

grpc_gevent.init_gevent()  # before any channel exists, as gRPC requires under gevent
torch.set_num_threads(1)  # the load generator shares the machine with the shards
# Importing torch takes seconds while the gevent loop sleeps; its cached clock would then be that
# stale and locust's timers (--run-time) would fire at once. Refresh it.
gevent.get_hub().loop.update_now()


class _Process:
    """Per-process state shared by all users: one shard map read, one channel per shard, and the
    process-wide bounds (calls issued, seconds since the first user started)."""

    lock = gevent.lock.BoundedSemaphore()
    cfg: LoadConfig | None = None
    caller: ShardCaller | None = None
    started: float | None = None
    issued = itertools.count()
    override: LoadConfig | None = None  # on a locust worker: the master's settings (distributed.py)
    failed = ""  # why the load could not start (said once, by the first user)

    @classmethod
    def configure(cls, cfg: LoadConfig) -> None:
        """Load with `cfg` instead of MEMSERVER_*: a new test's settings, before its users start."""
        with cls.lock:
            if cls.caller is not None and cls.cfg != cfg:
                cls.caller.close()
                cls.caller = cls.cfg = None
            cls.override = cfg

    @classmethod
    def get(cls) -> tuple[LoadConfig, ShardCaller]:
        with cls.lock:
            if cls.caller is None:
                cfg = cls.override or LoadConfig.from_env()
                meta = fetch_table(cfg.endpoint, cfg.table, setup_seconds(cfg.timeout))  # GetShardMap, once
                caller = ShardCaller(meta, cfg)
                caller.connect()
                cls.cfg, cls.caller, cls.started = cfg, caller, time.monotonic()
            assert cls.cfg is not None
            return cls.cfg, cls.caller


class MemserverUser(locust.User):
    """A trainer-like client, closed loop (next call as soon as the last one answered): each call
    is a weighted pick from MEMSERVER_MIX, reported to locust as request_type "grpc" named after
    the call, with its latency from first shard send to last shard answer decoded."""

    wait_time = locust.constant(0)

    def on_start(self) -> None:
        self.cfg: LoadConfig | None = None
        try:
            self.cfg, self.caller = _Process.get()
        except Exception as exc:  # no such table, no cluster: every user would fail so for the whole run
            # counted as locust counts a user's error (a worker's reach its master's report), but not
            # raised here, where locust logs a traceback per user; its task stops it
            self.environment.events.user_error.fire(user_instance=self, exception=exc, tb=exc.__traceback__)
            if not _Process.failed:
                _Process.failed = first_line(exc)
                logging.getLogger("memserver.loadtest").error("the load cannot start: %s; stopping", _Process.failed)
            # the memserver CLI's rule: 2 for a wrong table, or settings the load's own checks refused
            # (ValueError, which `memserver loadtest` says as a CliError), 1 for a cluster that failed
            self.environment.process_exit_code = WRONG_COMMAND if isinstance(exc, ValueError) else exit_status(exc)
            runner = self.environment.runner
            if runner is not None and not isinstance(runner, WorkerRunner):  # (a worker's master ends the test)
                gevent.spawn(runner.quit)  # (not from inside this user's greenlet)
            return
        self.batches = Batches(self.caller.meta, self.cfg)
        self.ops, self.weights = list(self.cfg.mix), np.array(list(self.cfg.mix.values())) / sum(self.cfg.mix.values())
        self.session = ClientSession(f"locust-{uuid.uuid4().hex}")  # one per user: its writes are exactly-once on their own
        self.running = count_users(self.environment)
        self.running.started()

    def on_stop(self) -> None:
        if getattr(self, "running", None) is not None:  # (not a user whose on_start failed: it never ran)
            self.running.stopped()
            self.running = None

    @locust.task
    def call(self) -> None:
        if self.cfg is None:  # (on_start said why)
            raise StopUser()
        assert _Process.started is not None
        if next(_Process.issued) >= self.cfg.max_requests or time.monotonic() - _Process.started > self.cfg.max_seconds:
            raise StopUser()
        op = self.ops[int(self.batches.rng.choice(len(self.ops), p=self.weights))]
        args: tuple[Any, ...] = self.batches.inputs(op)
        if op == "bag_backward":
            args += (WriteTags(self.session),)
        exc: BaseException | None = None
        nbytes = 0
        t0 = time.perf_counter()
        try:
            _, nbytes = getattr(self.caller, op)(*args)
        except Exception as e:  # grpc.RpcError (deadline, unavailable, ...) or a decode error
            exc = e
        ms = (time.perf_counter() - t0) * 1000
        self.environment.events.request.fire(request_type="grpc", name=op, response_time=ms, response_length=nbytes,
                                             exception=exc, context={})


class UserCount:
    """The MemserverUsers running in one environment now, and the most at once. Counted by the
    users themselves: sampling runner.user_count missed a run that ended between two samples (5
    requests in 70 ms reported 0 users)."""

    def __init__(self) -> None:
        self.running = self.peak = 0

    def started(self) -> None:
        self.running += 1
        self.peak = max(self.peak, self.running)

    def stopped(self) -> None:
        self.running -= 1

    def clear(self) -> None:
        """A new test: its peak starts from the users running now."""
        self.peak = self.running


def count_users(environment: Any) -> UserCount:
    """This environment's UserCount (idempotent)."""
    users = getattr(environment, "memserver_users", None)
    if users is None:
        users = environment.memserver_users = UserCount()
    return users


def attach_recorder(environment: Any, max_samples: int | None = None) -> LatencyRecorder:
    """Record every request of this environment exactly (idempotent; `max_samples`: see
    LatencyRecorder)."""
    rec = getattr(environment, "memserver_latency", None)
    if rec is None:
        rec = environment.memserver_latency = LatencyRecorder()
        environment.events.request.add_listener(rec.on_request)
    if max_samples is not None:
        rec.max_samples = max_samples
    return rec


def on_signals() -> gevent.event.Event:
    """An event Ctrl-C / SIGTERM set: the run ends early but cleanly (users finish their call, the
    report is written); without this, KeyboardInterrupt lands in whichever greenlet runs, e.g.
    gRPC's. Kept until exit: a second signal must not kill us mid-report."""
    interrupted = gevent.event.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        gevent.signal_handler(sig, interrupted.set)
    return interrupted


def run_headless(users: int, spawn_rate: float, duration_s: float) -> tuple[dict[str, Any], LatencyRecorder]:
    """locust as a library: a local runner with `users` MemserverUsers for `duration_s`, then
    stop (users finish their call in flight, up to the request deadline). Bounded by duration
    and by cfg.max_requests, whichever comes first. Returns the report and the recorder."""
    from locust.env import Environment

    cfg, _ = _Process.get()  # a missing table or dead coordinator fails here, not in every user
    env = Environment(user_classes=[MemserverUser], events=locust.events, stop_timeout=cfg.timeout + 1)
    rec = attach_recorder(env, max_samples=cfg.max_requests)
    runner = env.create_local_runner()
    interrupted = on_signals()
    users_run = count_users(env)
    t0, cpu0 = time.perf_counter(), time.process_time()
    try:
        runner.start(users, spawn_rate=spawn_rate)
        deadline = time.monotonic() + duration_s
        while time.monotonic() < deadline and rec.total < cfg.max_requests and not interrupted.is_set():
            if runner.user_count == 0 and runner.spawning_greenlet is not None and runner.spawning_greenlet.ready():
                break  # every user stopped itself (request bound)
            interrupted.wait(min(0.05, max(0.0, deadline - time.monotonic())))
        runner.stop()  # graceful: calls in flight are answered and recorded
    finally:
        runner.quit()
    elapsed = time.perf_counter() - t0
    report = rec.report(elapsed, names=list(cfg.mix))
    # the generator's own CPU, as a share of one core: its users share one process (gevent), so
    # at ~1 its calls wait in it and the latencies are mostly its own (a walkthrough: p50 114 ms
    # where the shards' own histograms put Bag under 0.5 ms)
    report["generator_cpu"] = round((time.process_time() - cpu0) / elapsed, 3) if elapsed > 0 else 0.0
    report["interrupted"] = interrupted.is_set()
    report["users_reached"] = users_run.peak
    report["locust_exceptions"] = sum(e["count"] for e in runner.exceptions.values())
    for e in runner.exceptions.values():
        report["errors"][f"user: {e['msg']}"] = e["count"]
    return report, rec
