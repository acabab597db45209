"""Prometheus metrics of a shard, served over HTTP for scraping (`memserver status` lists the URLs).

Per request (recorded by the `ErrorsAndMetrics` interceptor of memserver.server.grpcserver): a
counter by method, table and status code and a latency histogram by method, as the shard sees it
(from receiving the request to its answer). Per table slice, read at scrape time: rows, bytes,
client sessions and the answers kept for them, open training steps, write-ahead-log records,
bytes and fsyncs; per process, its resident memory. Each shard process has its own registry and HTTP server;
start_server adds the admission's gauges and refusal counter to it (memserver.server.admission).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

#: Latency buckets (seconds): from a tiny lookup (~0.5 ms) to a large backward (seconds).
BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


class ShardMetrics:
    """The metrics of one shard process; `tables` returns its live {name: TableSlice}."""

    def __init__(self, index: int, tables: Callable[[], dict[str, Any]], restarted: bool) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("memserver_requests", "Data-plane requests answered, by method, table and gRPC status",
                                ["method", "table", "code"], registry=self.registry)
        self.latency = Histogram("memserver_request_seconds", "Shard-side time from request to answer",
                                 ["method"], buckets=BUCKETS, registry=self.registry)
        self.registry.register(_TableCollector(index, tables, restarted))
        self._tables = tables
        self.address = ""
        self._server: Any = None

    def observe(self, method: str, table: str, code: str, seconds: float) -> None:
        """The table label is kept only for tables this shard holds: names in refused requests
        (unknown, random) would otherwise each add a series forever."""
        if table and table not in self._tables():
            table = "(unknown)"
        self.requests.labels(method, table, code).inc()
        self.latency.labels(method).observe(seconds)

    def serve(self, host: str) -> str:
        """Start the HTTP endpoint on a free port of `host`; returns HOST:PORT."""
        self._server, _ = start_http_server(0, addr=host, registry=self.registry)
        self.address = f"{host}:{self._server.server_port}"
        return self.address

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None


class _TableCollector:
    """Per-slice figures, read from the live slices at scrape time."""

    def __init__(self, index: int, tables: Callable[[], dict[str, Any]], restarted: bool) -> None:
        self.index, self.tables, self.restarted = index, tables, restarted

    def collect(self) -> Iterator[Any]:
        rows = GaugeMetricFamily("memserver_table_rows", "Rows of the table held by this shard (index tables: vectors)",
                                 labels=["table"])
        triggers = GaugeMetricFamily("memserver_trigger_slots", "Slots holding trigger contexts (value tables)",
                                     labels=["table"])
        nbytes = GaugeMetricFamily("memserver_table_bytes", "Bytes of values and optimizer state", labels=["table"])
        wal_records = CounterMetricFamily("memserver_wal_records", "Write-ahead log records appended", labels=["table"])
        wal_bytes = CounterMetricFamily("memserver_wal_bytes", "Write-ahead log bytes appended", labels=["table"])
        wal_syncs = CounterMetricFamily("memserver_wal_fsyncs", "Write-ahead log fsyncs (one per group commit)",
                                        labels=["table"])
        sessions = GaugeMetricFamily("memserver_sessions", "Client sessions the slice remembers", labels=["table"])
        remembered = GaugeMetricFamily("memserver_remembered_answers",
                                       "Write answers kept for retries (bounded by writes in flight)", labels=["table"])
        open_steps = GaugeMetricFamily("memserver_open_steps", "Training steps with parts not yet applied",
                                       labels=["table"])
        for name, sl in list(self.tables().items()):
            held = sl.table.ntotal if sl.is_index else getattr(sl.table, "num_rows", 0)  # product keys: no rows
            rows.add_metric([name], held)
            if sl.triggers is not None:
                triggers.add_metric([name], sl.triggers.slots)
            nbytes.add_metric([name], sl.table.nbytes())
            sessions.add_metric([name], len(sl.sessions.by_client))
            remembered.add_metric([name], sl.sessions.remembered())
            open_steps.add_metric([name], len(sl.steps))
            if sl.wal is not None:
                wal_records.add_metric([name], sl.wal.next_lsn)
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
        yield from (rows, triggers, nbytes, sessions, remembered, open_steps, wal_records, wal_bytes, wal_syncs, restarted, up, rss)


def rss_bytes() -> int:
    """Resident memory of this process now (Linux /proc; elsewhere the peak, from getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


_START = time.time()
