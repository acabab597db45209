"""Prometheus metrics of every memserver server, served over HTTP for scraping (`memserver
status` lists the URLs). Each server process (the coordinator and each shard) has its own
registry and HTTP server, on the host its gRPC server binds.

Per call, on every server (`ServerMetrics`, the `CallMetrics` the interceptors of
memserver.server.grpcserver record into): a counter by method, table (a data-plane call's; ""
for the coordinator's control calls) and status code and a
latency histogram by method, as the server sees it (from its request read to its answer),
and a counter of calls refused for their token, by method and code. A shard (`ShardMetrics`)
adds, per table slice, read at scrape time: rows, bytes, client sessions and the answers kept
for them, open training steps, whether it refuses writes, write-ahead-log records, bytes and fsyncs; per process, its
resident memory. The coordinator (`CoordinatorMetrics`) adds its catalog: tables by kind, shards
serving, and its last checkpoint's time, age, duration and size.
start_server adds the admission's gauges and refusal counter to a server's registry
(memserver.server.admission).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Container, Iterator
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from memserver.api.v1 import memserver_pb2 as pb
from memserver.cluster.secure import is_loopback, loopback_host_header
from memserver.server.rayutil import bind_first
from memserver.storage.fsutil import atomic_write

log = logging.getLogger(__name__)

#: Latency buckets (seconds): from a tiny lookup (~0.5 ms) to a large backward (seconds).
BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
#: The table label of a call naming a table this server does not hold.
UNKNOWN_TABLE = "(unknown)"
#: The table label that takes over a dropped table's calls (their series go, their counts stay).
DROPPED_TABLE = "(dropped)"


class ServerMetrics:
    """What every server counts per call, and its HTTP endpoint: the one place for the request
    counter, the latency histogram, the authentication failures and their label rules.
    `tables` returns the table names the server holds (the only table labels it keeps)."""

    def __init__(self, tables: Callable[[], Container[str]]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("memserver_requests", "Requests answered, by method, table (a data-plane "
                                "call's; empty for control calls) and gRPC status",
                                ["method", "table", "code"], registry=self.registry)
        self.latency = Histogram("memserver_request_seconds", "Server-side time from request to answer",
                                 ["method"], buckets=BUCKETS, registry=self.registry)
        self.auth_failures = Counter("memserver_auth_failures", "Calls refused for their token, by method and gRPC "
                                     "status (UNAUTHENTICATED: none or unknown; PERMISSION_DENIED: the read token on "
                                     "a write)", ["method", "code"], registry=self.registry)
        self.internal_errors = Counter("memserver_internal_errors", "Calls answered INTERNAL (a bug: an exception the "
                                       "error table does not map; the server log has its traceback), by method",
                                       ["method"], registry=self.registry)
        self._tables = tables
        self.admission: Any = None  # memserver.server.admission.Admission, once the server started
        self.address = ""
        self._server: Any = None

    def observe(self, method: str, table: str, code: str, seconds: float) -> None:
        """The table label is kept only for tables this server holds: names in refused requests
        (unknown, random) would otherwise each add a series forever. The method label is the
        interceptors' (a real method name, or "other")."""
        if table and table not in self._tables():
            table = UNKNOWN_TABLE
        self.requests.labels(method, table, code).inc()
        self.latency.labels(method).observe(seconds)

    def internal(self, method: str) -> None:
        """A call that ended in an unexpected exception (also counted by observe as INTERNAL)."""
        self.internal_errors.labels(method).inc()

    def forget(self, table: str) -> None:
        """A dropped table's series go with it (names come and go, the series must not pile up),
        their counts to the DROPPED_TABLE series of the same method and code: a count of calls
        since the process started never goes down (bound: methods x codes series)."""
        for sample in list(_totals(self.requests)):
            if sample.labels["table"] == table:
                method, code = sample.labels["method"], sample.labels["code"]
                self.requests.remove(method, table, code)
                self.requests.labels(method, DROPPED_TABLE, code).inc(sample.value)

    def refused(self, method: str, code: str) -> None:
        """A call the `Authenticate` interceptor refused: an authentication failure, and a request
        answered with that status (its request is never parsed: no table label)."""
        self.auth_failures.labels(method, code).inc()
        self.observe(method, "", code, 0.0)

    def attach(self, admission: Any) -> None:
        """The server's admission (memserver.server.admission): its gauges and refusal counter
        join this registry, its counts the summary."""
        self.admission = admission
        admission.register(self.registry)

    def summary(self, asking: bool = False) -> pb.CallSummary:
        """The counters summed for `memserver status` (read from the registry: one source).
        `asking`: read inside an admitted call (the coordinator's Status), which is left out of the
        calls in flight (an idle coordinator said it had one)."""
        out = pb.CallSummary()
        for sample in _totals(self.requests):
            n = int(sample.value)
            out.requests += n
            if sample.labels["code"] != "OK":
                out.errors[sample.labels["code"]] += n
        out.auth_failures = sum(int(s.value) for s in _totals(self.auth_failures))
        if self.admission is not None:
            out.rejected = sum(self.admission.rejected.values())
            out.inflight_calls, out.inflight_bytes = max(0, self.admission.calls - asking), self.admission.bytes
        return out

    def serve(self, host: str, state: Path | None = None) -> str:
        """Start the HTTP endpoint on `host`: on the port recorded in `state` if there is one (a
        restarted server keeps the address a scraper was given: it took a new one at every restart,
        while its gRPC port came back: a hunt), else a free one (of rayutil.SERVER_PORTS if it can),
        then recorded; returns HOST:PORT."""
        family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
        server = type("_Server", (_MetricsServer,), {"address_family": family})
        app = make_wsgi_app(self.registry)
        if is_loopback(host):  # a name rebound to 127.0.0.1 let any web site read it (a security walkthrough)
            app = _loopback_names_only(app)
        recorded = 0
        with contextlib.suppress(OSError, ValueError, AttributeError):
            recorded = int(json.loads(state.read_text())["port"]) if state is not None else 0
        # (taken meanwhile, or none recorded: one a restart finds free, recorded in its place)
        self._server = bind_first(lambda p: make_server(host, p, app, server, handler_class=_MetricsHandler), OSError,
                                  recorded, "metrics")
        if state is not None and self._server.server_port != recorded:
            port = self._server.server_port
            atomic_write(state, lambda f: f.write(json.dumps({"port": port}).encode()))
        threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True).start()
        self.address = f"{host}:{self._server.server_port}"
        return self.address

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


#: The metrics endpoint's bounds (it needs no token, and binds the node's address): at most
#: METRICS_CONNECTIONS connections at once, more closed as they come; each closed once idle for
#: METRICS_IDLE_SECONDS, and after METRICS_REQUEST_SECONDS whatever it does (a peer sending a
#: header line every few seconds is never idle: 16 of them kept every scrape out, a hunt).
#: prometheus_client's own server gave every connection a thread for as long as the peer kept it
#: open (a walkthrough: 300 idle ones, 300 threads in the shard).
METRICS_CONNECTIONS, METRICS_IDLE_SECONDS, METRICS_REQUEST_SECONDS = 16, 10.0, 20.0


def _loopback_names_only(app: Any) -> Any:
    """`app` answering only requests whose Host names loopback (secure.loopback_host_header)."""

    def checked(environ: dict[str, Any], start_response: Any) -> Any:
        if not loopback_host_header(environ.get("HTTP_HOST", "")):
            start_response("400 Bad Request", [("Content-Type", "text/plain")])
            return [b"metrics on a loopback address answer only to loopback names (localhost, 127.0.0.1, [::1])\n"]
        return app(environ, start_response)

    return checked


class _MetricsHandler(WSGIRequestHandler):
    timeout = METRICS_IDLE_SECONDS  # (the socket's, per read: an idle peer is dropped; a trickling one by
    # the server's cut, METRICS_REQUEST_SECONDS)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - (no line per scrape)
        pass


class _MetricsServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.slots = threading.BoundedSemaphore(METRICS_CONNECTIONS)
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):  # all busy: this one is closed, not queued
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        cut = threading.Timer(METRICS_REQUEST_SECONDS, _cut, (request,))  # (at most METRICS_CONNECTIONS at once)
        cut.daemon = True
        cut.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            cut.cancel()
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A peer dropped for idling or gone mid-request is no error of the server's (socketserver
        printed a traceback to the shard's log for each)."""
        import sys

        if not isinstance(sys.exc_info()[1], OSError):  # (TimeoutError, a reset: OSError)
            super().handle_error(request, client_address)


def _cut(request: Any) -> None:
    """End a connection that outlived METRICS_REQUEST_SECONDS: its handler's read or write fails
    at once (an OSError, not printed: handle_error), and its slot is free."""
    with contextlib.suppress(OSError):
        request.shutdown(socket.SHUT_RDWR)


def _totals(counter: Counter) -> Iterator[Any]:
    """A counter's `_total` samples (not its `_created` timestamps)."""
    for family in counter.collect():
        yield from (s for s in family.samples if s.name.endswith("_total"))


class ShardMetrics(ServerMetrics):
    """The metrics of one shard process; `tables` returns its live {name: TableSlice}."""

    def __init__(self, index: int, tables: Callable[[], dict[str, Any]], restarted: bool) -> None:
        super().__init__(tables)
        self.registry.register(_TableCollector(index, tables, restarted))


class CoordinatorMetrics(ServerMetrics):
    """The metrics of the coordinator: its ControlPlane calls, and its catalog read at scrape
    time from `servicer` (memserver.server.coordinator.ControlPlaneServicer). Whether each
    shard serves is what the coordinator last learnt (its periodic probe, a Status call, a
    restarted shard's report): a scrape never waits for a shard."""

    def __init__(self, servicer: Any) -> None:
        super().__init__(lambda: servicer.tables)
        self.registry.register(_CatalogCollector(servicer))


class _CatalogCollector:
    """The coordinator's catalog, shards and last checkpoint, read at scrape time."""

    KINDS = {pb.VALUE: "value", pb.INDEX: "index", pb.PRODUCT_KEYS: "product_keys"}

    def __init__(self, servicer: Any) -> None:
        self.servicer = servicer

    def collect(self) -> Iterator[Any]:
        sv = self.servicer
        tables = GaugeMetricFamily("memserver_tables", "Tables in the catalog, by kind", labels=["kind"])
        counts = dict.fromkeys(self.KINDS.values(), 0)
        for info in list(sv.tables.values()):
            counts[self.KINDS.get(info.spec.kind, "value")] += 1
        for kind, n in counts.items():
            tables.add_metric([kind], n)
        serving = list(sv.serving)
        yield tables
        yield GaugeMetricFamily("memserver_catalog_epoch", "Catalog epoch (bumped by every change of a shard map)",
                                value=sv.epoch)
        yield GaugeMetricFamily("memserver_shards", "Shards of the cluster", value=len(serving))
        yield GaugeMetricFamily("memserver_shards_serving", "Shards that answered the coordinator's last probe",
                                value=sum(serving))
        each = GaugeMetricFamily("memserver_shard_serving", "1 if the shard answered the coordinator's last probe",
                                 labels=["shard"])
        for i, ok in enumerate(serving):
            each.add_metric([str(i)], 1.0 if ok else 0.0)
        yield each
        yield GaugeMetricFamily("memserver_coordinator_restarted", "1 if Ray restarted the coordinator process",
                                value=1.0 if sv.restarted else 0.0)
        yield GaugeMetricFamily("memserver_coordinator_start_time_seconds", "Unix time the coordinator process started",
                                value=_START)
        last = sv.last_checkpoint
        if last is not None:  # none the shards hold nor made since: no series (alert on their absence)
            yield GaugeMetricFamily("memserver_last_checkpoint_time_seconds",
                                    "Unix time the last checkpoint completed (manifest written)", value=last["time"])
            yield GaugeMetricFamily("memserver_last_checkpoint_age_seconds", "Seconds since the last checkpoint completed",
                                    value=max(0.0, time.time() - last["time"]))
            if last["seconds"] is not None:  # (known of one this process made, not of one its records hold)
                yield GaugeMetricFamily("memserver_last_checkpoint_duration_seconds", "How long the last checkpoint took",
                                        value=last["seconds"])
                yield GaugeMetricFamily("memserver_last_checkpoint_bytes", "Bytes the last checkpoint wrote",
                                        value=last["bytes"])
            yield GaugeMetricFamily("memserver_last_checkpoint_step", "Step of the last checkpoint", value=last["step"])


class _TableCollector:
    """Per-slice figures, read from the live slices at scrape time."""

    def __init__(self, index: int, tables: Callable[[], dict[str, Any]], restarted: bool) -> None:
        self.index, self.tables, self.restarted = index, tables, restarted

    def collect(self) -> Iterator[Any]:
        rows = GaugeMetricFamily("memserver_table_rows", "Rows of the table held by this shard (index tables: vectors)",
                                 labels=["table"])
        triggers = GaugeMetricFamily("memserver_trigger_slots", "Slots holding trigger contexts (value tables)",
                                     labels=["table"])
        nbytes = GaugeMetricFamily("memserver_table_bytes", "Bytes the slice holds in memory: values, optimizer "
                                   "state and slot statistics (a disk table: its row cache and read counters)",
                                   labels=["table"])
        wal_records = CounterMetricFamily("memserver_wal_records", "Write-ahead log records appended", labels=["table"])
        wal_bytes = CounterMetricFamily("memserver_wal_bytes", "Write-ahead log bytes appended", labels=["table"])
        wal_syncs = CounterMetricFamily("memserver_wal_fsyncs", "Write-ahead log fsyncs (one per group commit)",
                                        labels=["table"])
        sessions = GaugeMetricFamily("memserver_sessions", "Client sessions the slice remembers", labels=["table"])
        remembered = GaugeMetricFamily("memserver_remembered_answers",
                                       "Write answers kept for retries (bounded by writes in flight)", labels=["table"])
        open_steps = GaugeMetricFamily("memserver_open_steps", "Training steps with parts not yet applied",
                                       labels=["table"])
        step_wait = GaugeMetricFamily("memserver_step_wait_seconds", "How long a sync_updates table's commits have "
                                      "waited for its other trainers with no step applied (0: none waits)",
                                      labels=["table"])
        nonfinite = CounterMetricFamily("memserver_table_nonfinite_updates", "Row updates of the optimizer that "
                                        "stored inf or NaN (a float16 table's value past 65504)", labels=["table"])
        refusing = GaugeMetricFamily("memserver_table_writes_refused", "1 while the slice refuses writes until a "
                                     "restart (its log failed, or a logged write failed to apply; status says why)",
                                     labels=["table"])
        disk = {key: family(f"memserver_disk_{key}", text, labels=["table"]) for key, family, text in (
            ("cache_bytes", GaugeMetricFamily, "Bytes a disk table's row cache holds (tier disk)"),
            ("cache_bound_bytes", GaugeMetricFamily, "The bound of a disk table's row cache (its cache_bytes per shard; at most what its whole slice takes)"),
            ("cache_rows", GaugeMetricFamily, "Rows a disk table's row cache holds now (of memserver_disk_cache_slots)"),
            ("cache_slots", GaugeMetricFamily, "Rows a disk table's row cache can hold (its bound, in rows)"),
            ("cache_hits", CounterMetricFamily, "Distinct rows of a call found in the cache"),
            ("cache_misses", CounterMetricFamily, "Distinct rows of a call read from the data file"),
            ("cache_evictions", CounterMetricFamily, "Rows evicted from the cache"),
            ("row_reads", CounterMetricFamily, "Rows read from the data file (rate(): reads per second)"),
            ("row_writes", CounterMetricFamily, "Rows written to the data file (rate(): writes per second)"),
            ("row_read_ahead", CounterMetricFamily,
             "Rows whose data file pages were not in memory, read ahead from the device together"),
            ("row_hinted", CounterMetricFamily, "Rows Warm hints named that the cache did not hold"),
            ("row_warmed", CounterMetricFamily,
             "Rows whose data file pages a Warm hint read ahead, before the call that reads them"),
            ("row_warm_dropped", CounterMetricFamily, "Rows of Warm hints dropped unread (a newer hint took their place)"))}
        for name, sl in list(self.tables().items()):
            if hasattr(sl.table, "cache_stats"):
                c = sl.table.cache_stats()
                for key, value in (("cache_bytes", c["cache_bytes"]), ("cache_bound_bytes", c["cache_bound"]),
                                   ("cache_rows", c["cached_rows"]), ("cache_slots", c["capacity"]),
                                   ("cache_hits", c["hits"]), ("cache_misses", c["misses"]),
                                   ("cache_evictions", c["evictions"]), ("row_reads", c["disk_reads"]),
                                   ("row_writes", c["disk_writes"]), ("row_read_ahead", c["read_ahead"]),
                                   ("row_hinted", c["hinted"]), ("row_warmed", c["warmed"]),
                                   ("row_warm_dropped", c["warm_dropped"])):
                    disk[key].add_metric([name], value)
            held = sl.table.ntotal if sl.is_index else getattr(sl.table, "num_rows", 0)  # product keys: no rows
            rows.add_metric([name], held)
            if sl.triggers is not None:
                triggers.add_metric([name], sl.triggers.slots)
            nbytes.add_metric([name], sl.table.nbytes())
            sessions.add_metric([name], len(sl.sessions.by_client))
            remembered.add_metric([name], sl.sessions.remembered())
            open_steps.add_metric([name], len(sl.steps))
            if sl.kind == pb.VALUE and sl.spec.sync_updates:
                waiting = sl.waiting_step()
                step_wait.add_metric([name], waiting.seconds if waiting is not None else 0.0)
                if waiting is not None:
                    sl.say_waiting()
            refusing.add_metric([name], 1.0 if sl.writes_refused() else 0.0)
            if sl.kind == pb.VALUE and (overflows := sl.table.nonfinite_count()) is not None:  # float16 tables
                nonfinite.add_metric([name], overflows)
            if sl.wal is not None:
                # appended by this process, as its bytes and fsyncs are (the log's position, carried over a
                # restart, read 3 records beside 0 bytes and 0 fsyncs: a hunt)
                wal_records.add_metric([name], sl.wal.records_written)
                wal_bytes.add_metric([name], sl.wal.bytes_written)
                wal_syncs.add_metric([name], sl.wal.syncs)
        restarted = GaugeMetricFamily("memserver_shard_restarted", "1 if Ray restarted this shard process",
                                      labels=["shard"])
        restarted.add_metric([str(self.index)], 1.0 if self.restarted else 0.0)
        up = GaugeMetricFamily("memserver_shard_start_time_seconds", "Unix time this shard process started",
                               labels=["shard"])
        up.add_metric([str(self.index)], _START)
        rss = GaugeMetricFamily("memserver_shard_rss_bytes", "Resident memory of this shard process", labels=["shard"])
        rss.add_metric([str(self.index)], rss_bytes())
        yield from (rows, triggers, nbytes, sessions, remembered, open_steps, step_wait, refusing, nonfinite, wal_records, wal_bytes, wal_syncs, restarted, up, rss,
                    *disk.values())


def rss_bytes() -> int:
    """Resident memory of this process now (Linux /proc; elsewhere the peak, from getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


_START = time.time()
