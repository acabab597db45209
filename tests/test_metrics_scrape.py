"""Every server's /metrics, scraped over HTTP as Prometheus does: the coordinator's (ControlPlane
calls by method and status, tables, shards serving, the last checkpoint) and a shard's, with the
authentication failures of both, on the cluster started with tokens; `memserver status` shows
the same counts summed."""

from __future__ import annotations

import json
import time
import urllib.request

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from memserver.api.v1 import memserver_pb2 as pb
from memserver.api.v1 import memserver_pb2_grpc as pb_grpc
from memserver.wire import encode
from tests.conftest import READ, WRITE


def scrape(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of http://address/metrics."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def get(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples: dict, name: str, **match: str) -> float:
    """The sum of `name` over every label set that has `match`."""
    return sum(v for (n, labels), v in samples.items()
               if n == name and all(dict(labels).get(k) == want for k, want in match.items()))


def refused(call):
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def test_server_metrics_label_rules_and_summary():
    """Without a cluster: the one class both kinds of server count with."""
    from memserver.server.metrics import UNKNOWN_TABLE, ServerMetrics

    m = ServerMetrics(lambda: {"held"})
    m.observe("Bag", "held", "OK", 0.01)
    m.observe("Bag", "random-name", "NOT_FOUND", 0.01)
    m.refused("Lookup", "UNAUTHENTICATED")
    m.refused("other", "PERMISSION_DENIED")
    address = m.serve("127.0.0.1")
    try:
        assert address.startswith("127.0.0.1:") and m._server.server_address[0] == "127.0.0.1"
        samples = scrape(address)
    finally:
        m.stop()
    assert get(samples, "memserver_requests_total", method="Bag", table="held", code="OK") == 1
    assert get(samples, "memserver_requests_total", method="Bag", table=UNKNOWN_TABLE, code="NOT_FOUND") == 1
    assert get(samples, "memserver_requests_total", method="Lookup", table="", code="UNAUTHENTICATED") == 1
    assert get(samples, "memserver_auth_failures_total", method="Lookup", code="UNAUTHENTICATED") == 1
    assert get(samples, "memserver_auth_failures_total", method="other", code="PERMISSION_DENIED") == 1
    assert not any(dict(labels).get("table") == "random-name" for _, labels in samples)
    s = m.summary()
    assert (s.requests, dict(s.errors), s.auth_failures) == (4, {"NOT_FOUND": 1, "UNAUTHENTICATED": 1,
                                                                 "PERMISSION_DENIED": 1}, 2)
    assert (s.rejected, s.inflight_calls, s.inflight_bytes) == (0, 0, 0)


def test_coordinator_probes_its_shards_in_the_background():
    """Without Ray: what /metrics says of the shards is the last probe's answer (a scrape never
    asks them); a shard that does not answer in time counts as not serving."""
    import asyncio

    from memserver.server.coordinator import ControlPlaneServicer
    from memserver.server.metrics import CoordinatorMetrics

    class Shard:
        def __init__(self, answers: bool) -> None:
            self.answers = answers

        @property
        def info(self):
            shard = self

            class Info:
                @staticmethod
                def remote():
                    async def answer():
                        if not shard.answers:
                            await asyncio.sleep(60)  # restarting: the call waits
                        return {}
                    return answer()
            return Info

    infos = [{"address": f"127.0.0.1:{7000 + j}", "node_id": "n", "pid": j} for j in range(3)]
    servicer = ControlPlaneServicer([Shard(True), Shard(False), Shard(True)], infos)
    metrics = CoordinatorMetrics(servicer)
    address = metrics.serve("127.0.0.1")
    try:
        assert get(scrape(address), "memserver_shards_serving") == 3  # they all answered at the start

        servicer.serving = [False, True, False]  # stale: the probes must turn each one around

        async def probe():
            task = asyncio.create_task(servicer.probe_shards(every=0.05))
            deadline = time.monotonic() + 20
            while servicer.serving != [True, False, True] and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            task.cancel()

        asyncio.run(probe())
        samples = scrape(address)
    finally:
        metrics.stop()
    assert servicer.serving == [True, False, True]
    assert get(samples, "memserver_shards") == 3 and get(samples, "memserver_shards_serving") == 2
    assert [get(samples, "memserver_shard_serving", shard=str(i)) for i in range(3)] == [1, 0, 1]
    assert get(samples, "memserver_tables", kind="value") == 0
    assert ("memserver_last_checkpoint_time_seconds", ()) not in samples  # none yet: no series


def test_coordinator_and_shard_metrics_over_http(auth_cluster, tmp_path, table_name):
    from client import MemoryClient

    ep = auth_cluster.endpoint
    host = ep.rsplit(":", 1)[0]
    with MemoryClient(ep, token=WRITE, retry_seconds=0) as c:
        status = c.status()
        coord, shard = status.coordinator_metrics_address, status.shards[0].metrics_address
        # served on the host the gRPC servers bind (127.0.0.1 here), never on every interface
        assert host == "127.0.0.1" and coord.rsplit(":", 1)[0] == host and shard.rsplit(":", 1)[0] == host
        c0, s0 = scrape(coord), scrape(shard)
        assert get(c0, "memserver_shards") == 1 and get(c0, "memserver_shards_serving") == 1
        assert get(c0, "memserver_shard_serving", shard="0") == 1

        for _ in range(3):
            c.list_tables()
        c.create_table(table_name, 64, 4, sharding="rows")
        c.lookup(table_name, np.arange(5))
        t0 = time.time()
        ck = c.checkpoint(str(tmp_path / "ck"), step=7, tables=[table_name])
        t1 = time.time()

        # refused for their token: none, on both servers; the read token on a write; a path that
        # is no method of ours (counted under "other": callers cannot add label values)
        channel = grpc.insecure_channel(ep)
        control = pb_grpc.ControlPlaneStub(channel)
        assert refused(lambda: control.ListTables(pb.ListTablesRequest(), timeout=30)) == grpc.StatusCode.UNAUTHENTICATED
        spec = pb.TableSpec(name="never", num_rows=8, dim=2)
        assert refused(lambda: control.CreateTable(pb.CreateTableRequest(spec=spec), timeout=30,
                                                   metadata=[("authorization", f"Bearer {READ}")])) == \
            grpc.StatusCode.PERMISSION_DENIED
        bogus = channel.unary_unary("/memserver.v1.ControlPlane/NoSuchMethod")
        assert refused(lambda: bogus(b"", timeout=30)) == grpc.StatusCode.UNAUTHENTICATED
        data = pb_grpc.DataPlaneStub(grpc.insecure_channel(status.shards[0].address))
        lookup = pb.LookupRequest(table=table_name, ids=encode(np.zeros(1, np.int64)))
        assert refused(lambda: data.Lookup(lookup, timeout=30)) == grpc.StatusCode.UNAUTHENTICATED

        c1, s1 = scrape(coord), scrape(shard)
        after = c.status()

    def delta(before, now, name, **labels):
        return get(now, name, **labels) - get(before, name, **labels)

    # the coordinator: calls by method and status, exactly
    assert delta(c0, c1, "memserver_requests_total", method="ListTables", table="", code="OK") == 3
    assert delta(c0, c1, "memserver_requests_total", method="CreateTable", table="", code="OK") == 1
    assert delta(c0, c1, "memserver_requests_total", method="Checkpoint", table="", code="OK") == 1
    assert delta(c0, c1, "memserver_request_seconds_count", method="ListTables") == 4  # the refused one too
    assert delta(c0, c1, "memserver_auth_failures_total", method="ListTables", code="UNAUTHENTICATED") == 1
    assert delta(c0, c1, "memserver_auth_failures_total", method="CreateTable", code="PERMISSION_DENIED") == 1
    assert delta(c0, c1, "memserver_auth_failures_total", method="other", code="UNAUTHENTICATED") == 1
    assert total(c1, "memserver_auth_failures_total") - total(c0, "memserver_auth_failures_total") == 3
    assert delta(c0, c1, "memserver_requests_total", method="ListTables", table="", code="UNAUTHENTICATED") == 1
    assert not any("NoSuchMethod" in str(labels) for _, labels in c1)
    # its catalog and last checkpoint
    assert delta(c0, c1, "memserver_tables", kind="value") == 1
    assert get(c1, "memserver_tables", kind="index") == get(c0, "memserver_tables", kind="index")
    assert 0 < get(c1, "memserver_last_checkpoint_duration_seconds") <= t1 - t0
    assert t0 <= get(c1, "memserver_last_checkpoint_time_seconds") <= t1
    assert 0 <= get(c1, "memserver_last_checkpoint_age_seconds") < 60
    assert get(c1, "memserver_last_checkpoint_bytes") == ck["bytes"] > 0
    assert get(c1, "memserver_last_checkpoint_step") == 7
    assert get(c1, "memserver_shards_serving") == 1
    # the shard: its own calls and authentication failures
    assert delta(s0, s1, "memserver_requests_total", method="Lookup", table=table_name, code="OK") == 1
    assert delta(s0, s1, "memserver_auth_failures_total", method="Lookup", code="UNAUTHENTICATED") == 1
    assert total(s1, "memserver_auth_failures_total") - total(s0, "memserver_auth_failures_total") == 1

    # Status sums the same counters
    cs, ss = after.coordinator_calls, after.shards[0].calls
    assert cs.requests == total(c1, "memserver_requests_total")  # not counting itself (counted once answered)
    assert cs.auth_failures == total(c1, "memserver_auth_failures_total")
    assert cs.errors["UNAUTHENTICATED"] == total(c1, "memserver_requests_total", code="UNAUTHENTICATED")
    assert cs.errors["PERMISSION_DENIED"] >= 1 and "OK" not in cs.errors
    assert ss.requests == total(s1, "memserver_requests_total") and ss.auth_failures == total(s1, "memserver_auth_failures_total")
    with MemoryClient(ep, token=WRITE) as c:
        c.drop_table(table_name)


def test_status_shows_each_servers_calls(auth_cluster, monkeypatch, capsys):
    """`memserver status` (--json and the table) has the coordinator's metrics URL and a calls
    line per server."""
    from memserver.cli import main

    monkeypatch.setenv("MEMSERVER_TOKEN", WRITE)
    ep = auth_cluster.endpoint
    refused(lambda: pb_grpc.ControlPlaneStub(grpc.insecure_channel(ep)).ListTables(pb.ListTablesRequest(), timeout=30))
    assert main(["status", "--endpoint", ep, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["coordinator_metrics"].startswith("http://127.0.0.1:") and st["coordinator_metrics"].endswith("/metrics")
    calls = st["coordinator_calls"]
    assert calls["auth_failures"] >= 1 and calls["errors"]["UNAUTHENTICATED"] >= 1 and calls["requests"] >= 1
    assert set(calls) == {"requests", "errors", "auth_failures", "rejected", "inflight_calls", "inflight_bytes"}
    assert set(st["shards"][0]["calls"]) == set(calls)
    # an idle cluster: nothing in flight (the coordinator counted the Status call itself)
    assert (calls["inflight_calls"], calls["inflight_bytes"]) == (0, 0)
    assert (st["shards"][0]["calls"]["inflight_calls"], st["shards"][0]["calls"]["inflight_bytes"]) == (0, 0)
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["status", "--endpoint", ep]) == 0
    out = capsys.readouterr().out
    assert "calls answered" in out and "coordinator" in out and "shard 0" in out and "UNAUTHENTICATED" in out
    assert st["coordinator_metrics"] in out


def test_a_dropped_tables_series_go_with_it_and_its_counts_stay():
    """Tables come and go under new names: their request series must not pile up. Their counts
    go to the "(dropped)" series: status's calls since the process started went down on a drop."""
    from memserver.server.metrics import DROPPED_TABLE, ServerMetrics

    held = {"a", "b", "c"}
    m = ServerMetrics(lambda: held)
    for table in ("a", "b", "c"):
        m.observe("Lookup", table, "OK", 0.001)
        m.observe("Bag", table, "NOT_FOUND", 0.001)
    m.observe("Lookup", "a", "OK", 0.001)
    before = m.summary()
    m.forget("a")
    m.forget("c")
    tables = {s.labels["table"] for f in m.requests.collect() for s in f.samples}
    assert tables == {"b", DROPPED_TABLE}
    after = m.summary()
    assert (after.requests, dict(after.errors)) == (before.requests, dict(before.errors)) == (7, {"NOT_FOUND": 3})
    get = m.registry.get_sample_value
    assert get("memserver_requests_total", {"method": "Lookup", "table": DROPPED_TABLE, "code": "OK"}) == 3
    assert get("memserver_requests_total", {"method": "Bag", "table": DROPPED_TABLE, "code": "NOT_FOUND"}) == 2
    m.observe("Lookup", "b", "OK", 0.001)  # the others count on
    assert get("memserver_requests_total", {"method": "Lookup", "table": "b", "code": "OK"}) == 2


def test_a_shard_whose_status_call_failed_is_described_in_words():
    """`memserver status` during a shard's restart printed Ray's exception text (an actor id,
    "The task may or may not have been executed", cut off by the table)."""
    import asyncio

    from ray.exceptions import ActorDiedError, ActorUnavailableError

    from memserver.server.coordinator import unavailable_state

    restarting = ActorUnavailableError("The actor is temporarily unavailable: IOError: The actor is restarting.",
                                       bytes(16))
    assert unavailable_state(restarting) == ("unavailable: restarting (Ray is making its process anew; the pid is the "
                                             "last one reported: the new process reports its own before it serves)")
    assert unavailable_state(ActorDiedError()).startswith("unavailable: its process died and is not restarted")
    failed_start = ActorDiedError()
    failed_start.error_msg = ("The actor died because of an error raised in its creation task, "
                              "ray::memserver-shard-1:ShardActor.__init__() (pid=2644)")
    assert str(failed_start).startswith("The actor died because of an error raised in its creation task")
    assert unavailable_state(failed_start).startswith("unavailable: its process failed to start and is not restarted")
    assert unavailable_state(asyncio.TimeoutError()).startswith("unavailable: no answer to its status call within 10 s")
    assert unavailable_state(RuntimeError("first line\nsecond")) == "unavailable: first line"
    lost = unavailable_state(restarting, "f" * 40)  # its node is dead: Ray keeps saying "restarting"
    assert lost == ("unavailable: its host is lost (Ray node ffffffffffff is dead): Ray restarts the shard on a node "
                    "with room for it, its host back (`ray start` there) or a spare; until then its slices are not served")
    assert unavailable_state(ActorDiedError(), "f" * 40).startswith("unavailable: its process died and is not restarted")


def test_status_says_a_shard_whose_node_ray_lists_as_dead_lost_its_host(monkeypatch):
    """An operator's multi-host walkthrough lost a host with no spare node: for the 90 s until the
    host came back, status said the shard was "restarting", long after Ray had declared its node
    dead. The coordinator asks Ray's node table when a shard does not answer."""
    from ray.exceptions import ActorUnavailableError

    import memserver.server.coordinator as coordinator
    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    asked: list[int] = []
    monkeypatch.setattr(coordinator, "dead_nodes", lambda: asked.append(1) or {"n1"})
    with InProcessServer(2) as srv, MemoryClient(srv.endpoint, retry_seconds=0) as c:
        assert [s.state for s in c.status().shards] == ["serving", "serving"] and not asked  # (asked only then)
        infos = srv.coordinator.servicer.infos
        infos[0]["node_id"], infos[1]["node_id"] = "n0", "n1"

        def unavailable() -> None:
            raise ActorUnavailableError("The actor is temporarily unavailable: the actor is restarting.", bytes(16))

        for shard in srv.shards:
            monkeypatch.setattr(shard, "status", unavailable)
        states = [s.state for s in c.status().shards]
        assert states[0].startswith("unavailable: restarting (Ray is making its process anew")  # its node lives
        assert states[1].startswith("unavailable: its host is lost (Ray node n1 is dead)") and asked == [1]


def test_a_call_abandoned_before_its_request_came_is_counted_as_abandoned_not_as_a_bad_request(client, table_name):
    """A client whose deadline passed while its request was on the way: the shard counted an
    INVALID_ARGUMENT "no Bag request was sent" (an operator would hunt for a broken client). A
    call that really sends no request still gets INVALID_ARGUMENT."""
    client.create_table(table_name, 64, 4, sharding="rows")
    st = client.status()
    shard, metrics = st.shards[0].address, st.shards[0].metrics_address
    channel = grpc.insecure_channel(shard)
    bag = channel.stream_unary("/memserver.v1.DataPlane/Bag")

    def late():  # the request never comes before the deadline
        time.sleep(1.5)
        yield b""

    def counts():
        s = scrape(metrics)
        return {code: get(s, "memserver_requests_total", method="Bag", table="", code=code)
                for code in ("INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "CANCELLED")}

    try:
        before = counts()
        assert refused(lambda: bag(late(), timeout=0.3)) == grpc.StatusCode.DEADLINE_EXCEEDED
        with pytest.raises(grpc.RpcError) as empty:
            bag(iter(()), timeout=30)
        assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert empty.value.details() == "request: no Bag request was sent"
        deadline = time.monotonic() + 10
        while (now := counts()) == before and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(2)  # the abandoned call is counted once its stream ends
        now = counts()
        # calls cancelled while their large request was on the way (a load test's, when another
        # shard refused its call): the stream's end came before gRPC marked them cancelled, and
        # they were counted INVALID_ARGUMENT too (dozens of these 200 before)
        big = pb.BagRequest(table=table_name, ids=encode(np.zeros((8192, 8), np.int64)),
                            weights=encode(np.ones((8192, 8), np.float32))).SerializeToString()
        for i in range(200):
            call = bag.future(iter([big]), timeout=30)
            time.sleep(0.0005 * (i % 5))
            call.cancel()
        time.sleep(2)
        after = counts()
    finally:
        channel.close()
    assert now["INVALID_ARGUMENT"] - before["INVALID_ARGUMENT"] == 1  # the empty one only
    assert (now["DEADLINE_EXCEEDED"] - before["DEADLINE_EXCEEDED"]) + (now["CANCELLED"] - before["CANCELLED"]) == 1
    assert after["INVALID_ARGUMENT"] == now["INVALID_ARGUMENT"]


def test_metrics_on_loopback_answer_only_loopback_names():
    """A security walkthrough: a local cluster's metrics (tables, calls) answered any Host header,
    so a web site its user visited could read them through a name rebound to 127.0.0.1 (DNS
    rebinding), where the inspection page refused the same request. Bound to loopback, they now
    answer loopback names only; bound to a network address, any name (scrapers use several)."""
    import http.client

    from memserver.server.metrics import ServerMetrics

    m = ServerMetrics(lambda: set())
    host, port = m.serve("127.0.0.1").rsplit(":", 1)
    try:
        for name, status in (("evil.example", 400), (f"evil.example:{port}", 400), ("127.0.0.1.evil.example", 400),
                             ("", 400), (f"127.0.0.1:{port}", 200), (f"localhost:{port}", 200), ("[::1]", 200)):
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
            conn.putrequest("GET", "/metrics", skip_host=True)
            if name:
                conn.putheader("Host", name)
            conn.endheaders()
            got = conn.getresponse()
            body = got.read()
            assert (name, got.status) == (name, status), body[:200]
            assert (b"memserver_requests_total" in body) == (status == 200)
            conn.close()
    finally:
        m.stop()


def test_the_metrics_endpoint_bounds_its_connections_and_drops_idle_ones(monkeypatch, capsys):
    """It needs no token and binds the node's address: every connection, even one that never
    sent a byte, held a thread of the server's process for as long as the peer kept it (a
    walkthrough: 300 idle connections, 300 threads in a shard)."""
    import socket
    import threading

    import memserver.server.metrics as metrics
    from memserver.server.metrics import METRICS_CONNECTIONS, ServerMetrics

    assert metrics._MetricsHandler.timeout == metrics.METRICS_IDLE_SECONDS > 0
    monkeypatch.setattr(metrics._MetricsHandler, "timeout", 5.0)  # (shorter, for the test)
    m = ServerMetrics(lambda: set())
    address = m.serve("127.0.0.1")
    host, port = address.rsplit(":", 1)
    before = threading.active_count()
    idle = []
    try:
        for _ in range(METRICS_CONNECTIONS + 10):
            idle.append(socket.create_connection((host, int(port)), timeout=5))
        time.sleep(0.5)
        # the rest closed as they came (a held one has its handler's thread and its cut's timer)
        assert threading.active_count() - before <= 2 * METRICS_CONNECTIONS
        over = idle[-1]
        over.settimeout(3.0)  # (a loaded machine's acceptor may be slow; a queued one would wait the 5 s)
        assert over.recv(1) == b""  # closed by the server at once, not served once a slot frees
        time.sleep(5.0)  # past the idle limit: the held ones are dropped too, their threads gone
        assert all(s.recv(1) == b"" for s in idle[:METRICS_CONNECTIONS])
        assert threading.active_count() - before <= 1
        assert "memserver_requests_total" in urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
        assert "Traceback" not in capsys.readouterr().err  # (an idle peer dropped is no error to print)
    finally:
        for s in idle:
            s.close()
        m.stop()


def test_peers_trickling_a_request_are_cut_and_scrapes_get_through(monkeypatch, capsys):
    """16 connections sending a header line every few seconds were never idle for the per-read
    timeout, so they held every slot and each scrape was closed unanswered for as long as they
    went on (a hunt). Each connection is cut after METRICS_REQUEST_SECONDS however it behaves."""
    import socket

    import memserver.server.metrics as metrics
    from memserver.server.metrics import METRICS_CONNECTIONS, ServerMetrics

    assert metrics.METRICS_REQUEST_SECONDS >= metrics.METRICS_IDLE_SECONDS
    monkeypatch.setattr(metrics, "METRICS_REQUEST_SECONDS", 2.0)  # (shorter, for the test)
    m = ServerMetrics(lambda: set())
    address = m.serve("127.0.0.1")
    host, port = address.rsplit(":", 1)
    slow = [socket.create_connection((host, int(port)), timeout=5) for _ in range(METRICS_CONNECTIONS)]
    try:
        t0 = time.monotonic()
        for s in slow:
            s.sendall(b"GET /metrics HTTP/1.1\r\n")
        cut = set()
        while len(cut) < len(slow) and time.monotonic() - t0 < 8:  # a header line each 0.5 s: never idle
            for i, s in enumerate(slow):
                try:
                    s.sendall(b"X-Slow: 1\r\n")
                except OSError:
                    cut.add(i)
            time.sleep(0.5)
        assert len(cut) == len(slow) and time.monotonic() - t0 < 6, (len(cut), time.monotonic() - t0)
        assert "memserver_requests_total" in urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
        assert "Traceback" not in capsys.readouterr().err
    finally:
        for s in slow:
            s.close()
        m.stop()


def test_the_last_checkpoint_survives_a_restart_in_the_metrics(tmp_path):
    """The last-checkpoint series were of checkpoints this coordinator process made: after a
    restart they were absent until the next one, and an operator's "too old" alert went quiet
    just then (a walkthrough). A coordinator starts from the newest complete checkpoint the
    shards' records hold: its time and step (how long it took and its bytes: only of one it made)."""
    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    data = tmp_path / "data"
    with InProcessServer(2, data_dir=str(data)) as server:
        with MemoryClient(server.endpoint, token="") as c:
            c.create_table("t", 64, 4, num_shards=2)
            t0 = time.time()
            c.checkpoint(str(tmp_path / "ck"), step=3)
            c.checkpoint(str(tmp_path / "ck"), step=5)
            t1 = time.time()
    with InProcessServer(2, data_dir=str(data)) as again:
        coordinator = again.coordinator
        deadline = time.monotonic() + 20
        while coordinator.servicer.last_checkpoint is None and time.monotonic() < deadline:
            time.sleep(0.05)
        samples = scrape(coordinator.metrics.address)
    assert get(samples, "memserver_last_checkpoint_step") == 5
    assert t0 <= get(samples, "memserver_last_checkpoint_time_seconds") <= t1
    assert ("memserver_last_checkpoint_duration_seconds", ()) not in samples
    assert ("memserver_last_checkpoint_bytes", ()) not in samples


def test_a_refused_attach_region_is_counted_with_its_refusal():
    """A stream call was counted OK as it opened: an AttachRegion the shard refused (another
    machine's boot id: FAILED_PRECONDITION) read as one more OK in the metrics and `status` (a
    hunt). It counts with the status it ended with; an attach that is taken, OK."""
    import os

    from client.shm import Region, boot_id
    from memserver.cluster.inprocess import InProcessServer

    with InProcessServer(1) as server:
        info = server.shards[0].info()
        with grpc.insecure_channel(info["address"]) as channel:
            attach = pb_grpc.DataPlaneStub(channel).AttachRegion
            bad = pb.AttachRegionRequest(size=4096, boot_id="not-this-machine", nonce=b"x" * 16, pid=1, fd=3)
            assert refused(lambda: next(attach(bad))) == grpc.StatusCode.FAILED_PRECONDITION
            samples = scrape(info["metrics"])
            assert get(samples, "memserver_requests_total", method="AttachRegion", table="",
                       code="FAILED_PRECONDITION") == 1
            assert total(samples, "memserver_requests_total", method="AttachRegion", code="OK") == 0
            region = Region(1 << 20)  # one the shard takes: OK, once its answer came
            good = pb.AttachRegionRequest(pid=os.getpid(), fd=region.fd, size=region.size, boot_id=boot_id(),
                                          nonce=region.nonce)
            stream = attach(good)
            assert next(stream).region
            assert total(scrape(info["metrics"]), "memserver_requests_total", method="AttachRegion", code="OK") == 1
            stream.cancel()


def test_a_refused_stream_is_counted_before_its_status_is_sent():
    """A refused AttachRegion was counted after its status went out (the handler aborted, the
    wrapper counted when the abort came back), so a scrape right after the refusal could miss it
    (a fresh-clone suite under load: the test above read 0). Now the refusal is raised, counted,
    then answered, as a unary call's is."""
    import asyncio

    from memserver.api.errors import FailedPreconditionError
    from memserver.server.grpcserver import ErrorsAndMetrics
    from memserver.server.shm import Regions, serve_attach

    events: list[tuple[str, str]] = []

    class Metrics:
        def observe(self, method, table, code, seconds):
            events.append(("counted", code))

    class Context:
        async def abort(self, code, details):
            events.append(("answered", code.name))
            raise grpc.aio.AbortError()

    async def refuse(request, context):
        raise FailedPreconditionError("shared memory: another machine's region")
        yield  # (a stream handler)

    async def call(handler) -> None:
        wrapped = grpc.unary_stream_rpc_method_handler(handler, request_deserializer=pb.AttachRegionRequest.FromString)
        stream = ErrorsAndMetrics(Metrics())._wrap_stream(wrapped, "AttachRegion").unary_stream
        request = pb.AttachRegionRequest(size=4096, boot_id="not-this-machine", nonce=b"x" * 16, pid=1, fd=3)
        async for _ in stream(request.SerializeToString(), Context()):
            pass

    # the rule (any stream handler's refusal), and AttachRegion's own handler (it aborted by itself)
    for handler in (refuse, lambda request, context: serve_attach(Regions(), request, context)):
        events.clear()
        with pytest.raises(grpc.aio.AbortError):
            asyncio.run(call(handler))
        assert events == [("counted", "FAILED_PRECONDITION"), ("answered", "FAILED_PRECONDITION")]


def test_a_restarted_servers_metrics_come_back_on_their_port(tmp_path):
    """A shard or coordinator that restarts keeps its gRPC port (its data directory records it);
    its metrics endpoint took a new free port each time, so a Prometheus given the address
    `status` showed lost it at every restart, when it mattered most (a hunt). The port is recorded
    beside the gRPC one and taken again; where another program holds it meanwhile, a new one."""
    import socket

    from memserver.server.metrics import ServerMetrics

    state = tmp_path / "metrics.json"
    first = ServerMetrics(lambda: set())
    at = first.serve("127.0.0.1", state)
    first.stop()
    again = ServerMetrics(lambda: set())
    assert again.serve("127.0.0.1", state) == at
    assert urllib.request.urlopen(f"http://{at}/metrics", timeout=10).status == 200
    again.stop()
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (the scrape's connection may be in TIME_WAIT)
        squatter.bind(("127.0.0.1", int(at.rsplit(":", 1)[1])))
        squatter.listen()
        moved = ServerMetrics(lambda: set())
        other = moved.serve("127.0.0.1", state)
        assert other != at and f'"port": {other.rsplit(":", 1)[1]}' in state.read_text()
        moved.stop()


def test_a_restarted_shards_log_counters_count_alike(tmp_path):
    """memserver_wal_records_total read the log's position, carried over a restart (3 beside 0
    bytes and 0 fsyncs after one: a hunt); the three count what this process appended."""
    from memserver.server.catalog import plan_table, validate_spec
    from memserver.server.shard_actor import ShardActor

    spec = validate_spec(pb.TableSpec(name="w", num_rows=10, dim=4, wal=True), 1)
    shard = ShardActor(0, host="127.0.0.1", data_dir=str(tmp_path))
    try:
        shard.create_table(spec.SerializeToString(), plan_table(spec, [shard.info()]).shards[0].SerializeToString(), 1)
        with grpc.insecure_channel(shard.address) as ch:
            for seq in (1, 2, 3):
                pb_grpc.DataPlaneStub(ch).PushGradients(pb.PushGradientsRequest(
                    table="w", ids=encode(np.array([1])), grads=encode(np.ones((1, 4), np.float32)),
                    tag=pb.WriteTag(client_id="c", seq=seq)))
        samples = scrape(shard.info()["metrics"])
        assert get(samples, "memserver_wal_records_total", table="w") == 3
    finally:
        shard.stop()
    again = ShardActor(0, host="127.0.0.1", data_dir=str(tmp_path))
    try:
        samples = scrape(again.info()["metrics"])
        assert [get(samples, f"memserver_wal_{k}_total", table="w") for k in ("records", "bytes", "fsyncs")] == [0, 0, 0]
    finally:
        again.stop()


def test_a_call_answered_after_its_deadline_is_counted_as_such(monkeypatch):
    """A hunt: a load test with a deadline shorter than the shard's compute saw DEADLINE_EXCEEDED
    for a quarter of its calls, while the shard counted every one OK (its answer came after the
    deadline, and reached no one), and `status` showed no errors."""
    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer
    from memserver.core.table import ValueTable

    bag = ValueTable.bag

    def slow(self, *a, **k):
        time.sleep(0.5)
        return bag(self, *a, **k)

    with InProcessServer(1) as srv, MemoryClient(srv.endpoint, shm=False, timeout=30) as c:
        c.create_table("late", 16, 4)
        meta = c.table("late")
        monkeypatch.setattr(ValueTable, "bag", slow)
        req = pb.BagRequest(table="late", ids=encode(np.zeros((2, 1), np.int64)), weights=encode(np.ones((2, 1), np.float32)),
                            layout_id=meta.layout_id)
        with grpc.insecure_channel(meta.shards[0].address) as ch:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.DataPlaneStub(ch).Bag(req, timeout=0.1)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        requests = srv.shards[0].metrics.requests
        deadline = time.monotonic() + 10
        while requests.labels("Bag", "late", "DEADLINE_EXCEEDED")._value.get() + \
                requests.labels("Bag", "late", "CANCELLED")._value.get() < 1:
            assert time.monotonic() < deadline, "the late call was not counted as late"
            time.sleep(0.05)
        assert requests.labels("Bag", "late", "OK")._value.get() == 0
