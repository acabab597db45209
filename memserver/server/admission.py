"""Bounded work on every memserver server: how many calls and how many request bytes it has in
progress (memserver.server.config.Limits), and RESOURCE_EXHAUSTED at once past either bound,
instead of memory growing with the queue and callers timing out.

Where the bounds act. `ErrorsAndMetrics` (memserver.server.grpcserver) serves each method of our
services as a stream-unary method at the gRPC level and reads the one request message itself,
so it admits a call *before* gRPC reads its request, then again once the size is known:

1. `enter`, before the request is read (its size is not known yet): refused when
   `max_inflight_calls` calls are in progress, or the requests in progress already reach
   `max_inflight_bytes`. A refused call's request is never read: gRPC takes in at most the
   HTTP/2 flow-control window of a stream nobody reads, which SERVER_OPTIONS keeps at its
   initial 64 KiB.
2. `take`, once the request's bytes are read and before they are parsed: refused when they would
   take the bytes in progress past `max_inflight_bytes`, unless no other request is in progress,
   so that a legal request larger than the limit still runs (alone).
3. `leave`, when the call ends, however it ends (answer, error, the caller gone).

A shared-memory call (memserver.server.shm) carries a few hundred bytes; the tensors its handler
copies out of the client's region are taken too, when the handler leases the region (`take` with
the call's own message as `own`: the same rule, alone it is admitted), and given back
(`give_back`) when the handler is done with it.

What that bounds: the admitted requests of a server are at most max(`max_inflight_bytes`, one
request), and the requests being received at most `max_inflight_calls` (each below gRPC's message
limit, memserver.wire.MAX_MESSAGE_BYTES: many large requests arriving at once, before any is
counted, can take max_inflight_calls x that limit; lower the call limit where memory is tight);
a request refused by `take` was read and is dropped at once. What a call allocates on top of its request (the parsed message, decoded tensors: a small
multiple of its bytes) follows the same bounds. An answer many times its request (a lookup, bag,
search, address, slot statistics or trigger records: memserver.server.dataplane.Call.answer) is
taken too, once the call is planned, and given back when it is computed (the same rule: alone it
is admitted); each is also limited per call (memserver.wire.check_answer).

Health checks and reflection are not ours: never counted, never refused.

SERVER_OPTIONS turn gRPC's BDP probing off on the servers. With it, gRPC widens the window it
grants every new stream as it estimates the link's bandwidth-delay product, and a busy server
(slow to answer the probes) looked like a long fat link: under a flood of 32 MiB requests each
waiting stream could push MiBs before the interceptor even saw the call (the flood test of
tests/test_overload.py goes past its RSS bound with it). Without it, a stream nobody reads gets
the initial 64 KiB, and a stream being read still gets the window of the whole message it reads
(gRPC sizes it to what the reader needs), so an upload is not slowed on loopback; over a long
link a request may wait one round trip more for its window.
Answers are not affected: what a server may send is the clients' windows, and they keep BDP.

Not grpc.aio.server(maximum_concurrent_rpcs=N): that limiter counts every RPC, health checks
included, and refuses them alike (a saturated shard would fail its liveness probe and be
restarted); its refusal ("Concurrent RPC limit exceeded!") happens outside the interceptors, so
it could neither be counted in the metrics nor name the limit; it knows nothing of bytes. It
would buy no memory either: it too refuses before the request is read, as `enter` does.

Calls are admitted on the server's event loop and, for the doorbell's calls
(memserver.server.doorbell), on its threads: the counts change under a lock (uncontended, ~0.1
us); the metrics page reads them from its own thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from memserver.api.errors import OVERLOADED, OverloadedError
from memserver.api.types import fmt_bytes
from memserver.server.config import Limits

log = logging.getLogger(__name__)

#: At most one log line per this many seconds about refused calls (a flood must not flood the log).
LOG_EVERY = 10.0
#: gRPC options of every server on top of memserver.wire.GRPC_OPTIONS (see the module docstring).
#: so_reuseport off: gRPC turns it on, and a second process then bound a port already served (a
#: second `up` on the same data directory took its shards' recorded ports: clients were split
#: between two live copies of one table). Off, a taken port is refused and `serve_on` moves on.
#: Pings: a client's keepalive pings (client.channels.KEEPALIVE_OPTIONS: every 2 s while a call runs
#: without data) are allowed, where gRPC's default (one per 5 minutes, 2 strikes) closed the
#: connection under any call longer than about 10 s ("Too many pings"). A client of this version
#: needs servers of this version for calls that long.
SERVER_OPTIONS = [("grpc.http2.bdp_probe", 0), ("grpc.so_reuseport", 0),
                  ("grpc.http2.min_ping_interval_without_data_ms", 1000), ("grpc.http2.max_ping_strikes", 0)]


class Admission:
    """The in-progress counts of one server and its refusals (see the module docstring).
    `register` adds its metrics to a Prometheus registry: gauges `memserver_inflight_calls`,
    `memserver_inflight_bytes`, `memserver_inflight_limit{limit}` and the counter
    `memserver_rejected_total{method, limit}`."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self.calls = 0
        self.bytes = 0
        self.rejected: dict[tuple[str, str], int] = {}  # (method, limit) -> calls refused
        self._next_log = 0.0
        self._unlogged = 0
        self._lock = threading.Lock()

    def enter(self, method: str) -> None:
        """A call of `method` starts, its request not read yet: take a slot, or raise OverloadedError."""
        calls, nbytes = self.limits.max_inflight_calls, self.limits.max_inflight_bytes
        with self._lock:
            if calls and self.calls >= calls:
                self._refuse(method, "max_inflight_calls",
                             f"{self.calls} calls in progress, the limit max_inflight_calls={calls}")
            if nbytes and self.bytes >= nbytes:
                self._refuse(method, "max_inflight_bytes", f"{fmt_bytes(self.bytes)} of requests in progress, the "
                             f"limit max_inflight_bytes={nbytes} ({fmt_bytes(nbytes)})")
            self.calls += 1

    def take(self, method: str, size: int, own: int = 0, what: str = "this request's") -> None:
        """The call's request is read: `size` bytes. Count them, or raise OverloadedError (the call
        keeps its slot until `leave`). Always admitted when no other request is in progress.
        A call that takes more bytes later (a shared-memory call's tensors, memserver.server.shm)
        passes `own`, the bytes it counted already, and `what` they are; it gives them back with
        `give_back`."""
        limit = self.limits.max_inflight_bytes
        with self._lock:
            if limit and self.bytes > own and self.bytes + size > limit:
                self._refuse(method, "max_inflight_bytes", f"{what} {fmt_bytes(size)} on top of "
                             f"{fmt_bytes(self.bytes)} in progress would pass the limit max_inflight_bytes={limit} "
                             f"({fmt_bytes(limit)})")
            self.bytes += size

    def give_back(self, size: int) -> None:
        """Bytes a call took on top of its request (take's `own`) are no longer in use."""
        with self._lock:
            self.bytes -= size

    def leave(self, size: int) -> None:
        """A call that `enter` admitted ended; `size`: the bytes `take` counted for it (0 if none)."""
        with self._lock:
            self.calls -= 1
            self.bytes -= size

    def _refuse(self, method: str, limit: str, why: str) -> None:
        key = (method, limit)
        self.rejected[key] = self.rejected.get(key, 0) + 1
        self._unlogged += 1
        now = time.monotonic()
        if now >= self._next_log:
            log.warning("refused %d call(s) RESOURCE_EXHAUSTED since the last report; the latest, %s: %s",
                        self._unlogged, method, why)
            self._next_log, self._unlogged = now + LOG_EVERY, 0
        raise OverloadedError(f"{OVERLOADED}: {why}; retry with backoff")

    # -- metrics ---------------------------------------------------------------------------

    def register(self, registry: Any) -> None:
        """Export the counts on `registry` (a prometheus_client CollectorRegistry), read at scrape time."""
        registry.register(self)

    def collect(self) -> Iterator[Any]:
        calls = GaugeMetricFamily("memserver_inflight_calls",
                                  "Calls of the memserver services in progress (being received, queued or computing)")
        calls.add_metric([], self.calls)
        nbytes = GaugeMetricFamily("memserver_inflight_bytes", "Request bytes of the calls in progress (a "
                                   "shared-memory call's: its tensors in the region), and the answers many times "
                                   "their request being computed")
        nbytes.add_metric([], self.bytes)
        limits = GaugeMetricFamily("memserver_inflight_limit", "This server's limits on work in progress (0: none)",
                                   labels=["limit"])
        limits.add_metric(["max_inflight_calls"], self.limits.max_inflight_calls)
        limits.add_metric(["max_inflight_bytes"], self.limits.max_inflight_bytes)
        rejected = CounterMetricFamily("memserver_rejected", "Calls refused RESOURCE_EXHAUSTED at a limit, by method "
                                       "and limit", labels=["method", "limit"])
        for (method, limit), n in list(self.rejected.items()):
            rejected.add_metric([method, limit], n)
        yield from (calls, nbytes, limits, rejected)
