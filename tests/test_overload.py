"""Overload: every server bounds the calls and request bytes it has in progress
(memserver.server.config.Limits, enforced by memserver.server.admission) and answers
RESOURCE_EXHAUSTED at once past them; the clients back off and retry such refusals.

First without Ray, deterministically: the admission's rules, a server whose handler holds calls
in progress on purpose, the backoff, and both clients against a fake shard that refuses. Then a
one-shard cluster with small limits flooded with 32 MiB Bag requests from 16 threads."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from memserver.api.errors import OVERLOADED, OverloadedError, ResourceExhaustedError
from memserver.api.v1 import memserver_pb2 as pb
from memserver.api.v1 import memserver_pb2_grpc as pb_grpc
from memserver.server.admission import Admission
from memserver.server.config import Limits, ServeConfig
from memserver.wire import GRPC_OPTIONS, decode, encode

MiB = 1 << 20


# ------------------------------------------------------------------ the rules


def test_limits_are_checked():
    assert Limits() == Limits(max_inflight_calls=256, max_inflight_bytes=1 << 30)
    Limits(max_inflight_calls=0, max_inflight_bytes=0)  # no limits
    for bad in ({"max_inflight_calls": -1}, {"max_inflight_bytes": 1.5}, {"max_inflight_calls": True}):
        with pytest.raises(ValueError, match="must be an integer >= 0"):
            Limits(**bad)


def test_admission_rules():
    a = Admission(Limits(max_inflight_calls=3, max_inflight_bytes=100))
    a.enter("Bag")
    a.take("Bag", 250)  # larger than the limit, but alone: admitted
    with pytest.raises(OverloadedError, match="250 B of requests in progress, the limit max_inflight_bytes=100"):
        a.enter("Lookup")  # the bytes are at the limit: refused before the request is read
    a.leave(250)
    a.enter("Bag")
    a.take("Bag", 60)
    a.enter("Bag")
    with pytest.raises(OverloadedError, match="this request's 50 B on top of 60 B in progress would pass "
                       "the limit max_inflight_bytes=100") as err:
        a.take("Bag", 50)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.details.startswith(OVERLOADED)
    a.leave(0)  # the refused call gives its slot back
    a.enter("Bag")
    a.enter("Bag")  # a third call, its request not read yet
    a.take("Bag", 40)  # 100: up to the limit is admitted
    with pytest.raises(OverloadedError, match="3 calls in progress, the limit max_inflight_calls=3"):
        a.enter("Search")
    assert (a.calls, a.bytes) == (3, 100)
    for size in (60, 40, 0):
        a.leave(size)
    assert (a.calls, a.bytes) == (0, 0)
    assert a.rejected == {("Lookup", "max_inflight_bytes"): 1, ("Bag", "max_inflight_bytes"): 1,
                          ("Search", "max_inflight_calls"): 1}
    unlimited = Admission(Limits(max_inflight_calls=0, max_inflight_bytes=0))
    for _ in range(1000):
        unlimited.enter("Bag")
        unlimited.take("Bag", 1 << 30)


def test_overload_errors_come_back_as_overloaded_error():
    from memserver.api.errors import error_for

    assert type(error_for(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{OVERLOADED}: 4 calls")) is OverloadedError
    too_big = error_for(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (300 vs. 268435456)")
    assert type(too_big) is ResourceExhaustedError  # not an overload: retrying cannot help
    assert type(error_for(grpc.StatusCode.CANCELLED, "CANCELLED")) is OverloadedError  # a reset stream
    assert type(error_for(grpc.StatusCode.CANCELLED, "the client cancelled the call")) is not OverloadedError


def test_a_burst_past_the_limit_is_all_answered(monkeypatch):
    """2,000 bags at once to a shard that admits 16: the refusals before reading a request raced
    its bytes, and ~10% of the calls came back CANCELLED (the stream reset) instead of
    RESOURCE_EXHAUSTED, and were not retried (a walkthrough). Every one is answered now."""
    import torch

    from client.aio import AsyncMemoryClient
    from memserver.cluster.inprocess import InProcessServer

    async def burst(endpoint: str) -> list:
        c = AsyncMemoryClient(endpoint, timeout=30, retry_seconds=60)
        try:
            await c.create_table("b", 1000, 16, num_shards=1)
            ids, w = torch.randint(0, 1000, (64, 8)), torch.ones(64, 8)
            return await asyncio.gather(*(c.bag("b", ids, w) for _ in range(2000)), return_exceptions=True)
        finally:
            await c.close()

    monkeypatch.setenv("MEMSERVER_SHM", "0")  # the gRPC path (the doorbell's calls are admitted otherwise)
    config = ServeConfig(limits=Limits(max_inflight_calls=16, max_inflight_bytes=1 << 30))
    with InProcessServer(1, config=config) as server:
        got = asyncio.run(burst(server.endpoint))
    failed = [r for r in got if isinstance(r, BaseException)]
    assert not failed, (len(failed), {str(r)[:120] for r in failed})


# ------------------------------------------------------------------ a server holding calls on purpose


class Metrics:
    """A CallMetrics with a registry, as ServerMetrics has: the admission's metrics join it."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.calls: list[tuple[str, str, str]] = []

    def observe(self, method, table, code, seconds):
        self.calls.append((method, table, code))

    def refused(self, method, code):
        self.observe(method, "", code, 0.0)

    def attach(self, admission):
        admission.register(self.registry)

    def value(self, name, **labels):
        return self.registry.get_sample_value(name, labels) or 0.0


class Holding(pb_grpc.DataPlaneServicer):
    """Lookup waits until `release` is set: calls stay in progress as long as the test wants."""

    def __init__(self) -> None:
        self.release: asyncio.Event | None = None
        self.started = 0

    async def Lookup(self, request, context):
        self.started += 1
        if self.release is None:
            self.release = asyncio.Event()
        await self.release.wait()
        return pb.LookupResponse()


@pytest.fixture
def holding_server():
    from memserver.loop import LoopThread
    from memserver.server.grpcserver import DATA_PLANE, start_server

    servicer, metrics = Holding(), Metrics()
    loop = LoopThread("test-overload")
    config = ServeConfig(limits=Limits(max_inflight_calls=3, max_inflight_bytes=4 * MiB))
    server, port = loop.call(start_server(lambda s: pb_grpc.add_DataPlaneServicer_to_server(servicer, s), [DATA_PLANE],
                                          "127.0.0.1", metrics=metrics, config=config))
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)

    def release():
        async def go():
            if servicer.release is not None:
                servicer.release.set()
                servicer.release = None

        loop.call(go())

    try:
        yield servicer, metrics, pb_grpc.DataPlaneStub(channel), channel, release
    finally:
        release()
        channel.close()
        loop.call(server.stop(None))
        loop.stop()


def lookup(n_bytes: int, table: str = "t") -> pb.LookupRequest:
    return pb.LookupRequest(table=table, ids=encode(np.zeros(n_bytes // 8, np.int64)))


def wait_for(cond, what, seconds=10.0):
    end = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.005)


def refusal(call):
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
    return err.value.details()


def test_a_server_refuses_past_its_limits_and_never_health_checks(holding_server):
    servicer, metrics, stub, channel, release = holding_server
    inflight = lambda: (metrics.value("memserver_inflight_calls"), metrics.value("memserver_inflight_bytes"))  # noqa: E731
    assert metrics.value("memserver_inflight_limit", limit="max_inflight_calls") == 3
    # three small calls in progress: the fourth is refused at once, naming the limit
    held = [stub.Lookup.future(lookup(1024), timeout=30) for _ in range(3)]
    wait_for(lambda: servicer.started == 3, "three calls in the handler")
    assert inflight() == (3, 3 * lookup(1024).ByteSize())
    text = refusal(lambda: stub.Lookup(lookup(8), timeout=10))
    assert text.startswith(OVERLOADED) and "max_inflight_calls=3" in text
    health = health_pb2_grpc.HealthStub(channel)
    for _ in range(20):  # health checks are never counted nor refused
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
    release()
    assert all(f.result(timeout=30) == pb.LookupResponse() for f in held)
    # released when each handler ends, which can be just after its answer reached the client
    wait_for(lambda: inflight() == (0, 0), "the calls' admission released")
    # one request larger than the byte limit runs alone; while it runs, any other call is refused
    # before its request is read, and a second large one too
    big = stub.Lookup.future(lookup(6 * MiB), timeout=30)
    wait_for(lambda: servicer.started == 4, "the large call in the handler")
    assert inflight()[1] > 6 * MiB
    text = refusal(lambda: stub.Lookup(lookup(8), timeout=10))
    assert "of requests in progress, the limit max_inflight_bytes=4194304 (4.0 MiB)" in text
    release()
    big.result(timeout=30)
    # two of 1.5 MiB fit; a third would pass 4 MiB: refused once read
    held = [stub.Lookup.future(lookup(3 * MiB // 2), timeout=30) for _ in range(2)]
    wait_for(lambda: servicer.started == 6, "two calls in the handler")
    text = refusal(lambda: stub.Lookup(lookup(3 * MiB // 2), timeout=10))
    assert "this request's 1.5 MiB on top of 3.0 MiB in progress would pass the limit max_inflight_bytes" in text
    release()
    for f in held:
        f.result(timeout=30)
    wait_for(lambda: inflight() == (0, 0), "the calls' admission released")
    rejected = {(s.labels["method"], s.labels["limit"]): s.value
                for fam in metrics.registry.collect() if fam.name == "memserver_rejected" for s in fam.samples}
    assert rejected == {("Lookup", "max_inflight_calls"): 1, ("Lookup", "max_inflight_bytes"): 2}
    refused = [c for c in metrics.calls if c[2] == "RESOURCE_EXHAUSTED"]
    assert refused == [("Lookup", "", "RESOURCE_EXHAUSTED")] * 3  # counted as calls too (table: never parsed)
    assert sum(c[2] == "OK" for c in metrics.calls) == 6


def test_refused_requests_are_freed_at_once(holding_server):
    """A request refused once read (or unparseable) is freed when its call ends, not left to the
    cyclic GC: gRPC keeps the AbortError, whose traceback holds the handler's frame, in a cycle
    with the call (before this, a flood of refused 32 MiB requests grew a shard by GBs)."""
    import gc
    import tracemalloc

    servicer, metrics, stub, channel, release = holding_server
    req = lookup(3 * MiB // 2)
    junk = channel.unary_unary("/memserver.v1.DataPlane/Lookup", request_serializer=None, response_deserializer=None)
    body = b"\xff" * (3 * MiB // 2)
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        for _ in range(4):  # unparseable, alone: admitted, then INVALID_ARGUMENT
            with pytest.raises(grpc.RpcError) as err:
                junk(body, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        held = [stub.Lookup.future(req, timeout=30) for _ in range(2)]
        wait_for(lambda: servicer.started == 2, "two calls in the handler")
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(10):  # 1.5 MiB more would pass 4 MiB: refused once read
            assert "would pass the limit" in refusal(lambda: stub.Lookup(req, timeout=10))
        grown = tracemalloc.get_traced_memory()[0] - before
        release()
        for f in held:
            f.result(timeout=30)
    finally:
        tracemalloc.stop()
        gc.enable()
    assert grown < 2 * MiB, f"{grown / MiB:.1f} MiB of refused requests still held"  # 15 MiB if kept


def test_a_refused_request_is_never_read(holding_server):
    """Past max_inflight_calls, and without a token, a call is refused before its request is read:
    a 64 MiB request then never becomes Python bytes on the server (it would if it were read).
    The client sends pre-serialized bytes, so Python allocations here are the server's."""
    import tracemalloc

    from memserver.api.auth import AuthConfig
    from memserver.loop import LoopThread
    from memserver.server.grpcserver import DATA_PLANE, start_server

    servicer, metrics, stub, channel, release = holding_server
    body = lookup(64 * MiB).SerializeToString()
    raw = channel.unary_unary("/memserver.v1.DataPlane/Lookup", request_serializer=None, response_deserializer=None)
    held = [stub.Lookup.future(lookup(8), timeout=30) for _ in range(3)]
    wait_for(lambda: servicer.started == 3, "three calls in the handler")
    loop = LoopThread("test-auth-overload")
    server, port = loop.call(start_server(lambda s: pb_grpc.add_DataPlaneServicer_to_server(Holding(), s), [DATA_PLANE],
                                          "127.0.0.1", config=ServeConfig(auth=AuthConfig.from_tokens("w"))))
    tracemalloc.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as other:
            unauthenticated = other.unary_unary("/memserver.v1.DataPlane/Lookup", request_serializer=None,
                                                response_deserializer=None)
            tracemalloc.reset_peak()
            for _ in range(3):
                assert "max_inflight_calls=3" in refusal(lambda: raw(body, timeout=30))
                with pytest.raises(grpc.RpcError) as err:
                    unauthenticated(body, timeout=30)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            peak = tracemalloc.get_traced_memory()[1] - tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
        loop.call(server.stop(None))
        loop.stop()
    release()
    for f in held:
        f.result(timeout=30)
    assert peak < 8 * MiB, f"{peak / MiB:.0f} MiB allocated while refusing 64 MiB requests"


def test_a_call_cancelled_while_in_progress_gives_its_slot_back(holding_server):
    servicer, metrics, stub, channel, release = holding_server
    futures = [stub.Lookup.future(lookup(1024), timeout=30) for _ in range(3)]
    wait_for(lambda: servicer.started == 3, "three calls in the handler")
    for f in futures:
        f.cancel()
    wait_for(lambda: metrics.value("memserver_inflight_calls") == 0, "the slots back")
    assert metrics.value("memserver_inflight_bytes") == 0
    release()


# ------------------------------------------------------------------ the clients' retries


def test_backoff_is_jittered_exponential_within_the_deadline():
    import random

    from client.aio import RETRY_FIRST_DELAY, RETRY_MAX_DELAY, Backoff

    now = [100.0]
    b = Backoff(10.0, clock=lambda: now[0], rng=random.Random(1))
    sleeps = []
    while (s := b.next()) is not None and len(sleeps) < 1000:
        sleeps.append(s)
        now[0] += s
    assert len(sleeps) < 1000  # it gives up
    delay = RETRY_FIRST_DELAY
    for s in sleeps:  # each in [delay/2, delay], the delay doubling up to the cap
        assert delay / 2 <= s <= delay
        delay = min(2 * delay, RETRY_MAX_DELAY)
    assert len(set(sleeps)) == len(sleeps)  # jittered
    assert sum(sleeps) <= 10.0 and sum(sleeps) > 10.0 - RETRY_MAX_DELAY
    assert Backoff(0.0).next() is None  # retry_seconds 0: no retry


class FakeShard(pb_grpc.DataPlaneServicer):
    """Refuses the next `refuse` calls with `error`, then answers; records each write's tag."""

    def __init__(self, dim: int) -> None:
        self.dim, self.refuse, self.calls, self.tags = dim, 0, 0, []
        self.error = lambda: OverloadedError(f"{OVERLOADED}: 3 calls in progress, the limit max_inflight_calls=3")

    def _maybe_refuse(self):
        self.calls += 1
        if self.refuse:
            self.refuse -= 1
            raise self.error()

    async def Lookup(self, request, context):
        self._maybe_refuse()
        n = decode(request.ids, "ids").numel()
        return pb.LookupResponse(rows=encode(np.full((n, self.dim), 7.0, np.float32)))

    async def WriteRows(self, request, context):
        self.tags.append((request.tag.client_id, request.tag.seq))
        self._maybe_refuse()
        return pb.WriteAck(rows=decode(request.ids, "ids").numel())


class FakeCoordinator(pb_grpc.ControlPlaneServicer):
    def __init__(self) -> None:
        self.info: pb.TableInfo | None = None
        self.refuse, self.calls = 0, 0

    def _maybe_refuse(self):
        self.calls += 1
        if self.refuse:
            self.refuse -= 1
            raise OverloadedError(f"{OVERLOADED}: 1 calls in progress, the limit max_inflight_calls=1")

    async def GetShardMap(self, request, context):
        return self.info

    async def ListTables(self, request, context):
        self._maybe_refuse()
        return pb.ListTablesResponse(tables=[self.info])

    async def DropTable(self, request, context):
        self._maybe_refuse()
        return pb.DropTableResponse()


@pytest.fixture
def fake_cluster():
    """A coordinator and two shards holding a 2-shard cols table "t" (8 x 4), in this process."""
    from memserver.loop import LoopThread
    from memserver.server.catalog import plan_table
    from memserver.server.grpcserver import CONTROL_PLANE, DATA_PLANE, start_server

    loop = LoopThread("fake-cluster")
    shards, servers, addresses = [FakeShard(2), FakeShard(2)], [], []
    for sh in shards:
        server, port = loop.call(start_server(lambda s, sh=sh: pb_grpc.add_DataPlaneServicer_to_server(sh, s),
                                              [DATA_PLANE], "127.0.0.1"))
        servers.append(server)
        addresses.append(f"127.0.0.1:{port}")
    coord = FakeCoordinator()
    server, port = loop.call(start_server(lambda s: pb_grpc.add_ControlPlaneServicer_to_server(coord, s),
                                          [CONTROL_PLANE], "127.0.0.1"))
    servers.append(server)
    spec = pb.TableSpec(name="t", num_rows=8, dim=4, sharding=pb.COLS, num_shards=2)
    coord.info = plan_table(spec, [{"address": a, "node_id": "", "pid": 0} for a in addresses])
    try:
        yield f"127.0.0.1:{port}", coord, shards
    finally:
        for server in servers:
            loop.call(server.stop(None))
        loop.stop()


def test_clients_retry_calls_an_overloaded_server_refused(fake_cluster):
    from client import AsyncMemoryClient, MemoryClient

    endpoint, coord, (a, b) = fake_cluster
    with MemoryClient(endpoint, retry_seconds=30, token="") as c:
        c.table("t")  # the shard map, so the first attempt is the blocking one
        b.refuse = 3
        t0 = time.monotonic()
        assert c.lookup("t", [1, 2]).tolist() == [[7.0] * 4] * 2
        # 3 backoffs of 0.05-0.1, 0.1-0.2, 0.2-0.4 s (bound loose: a loaded machine is slow, not wrong)
        assert (a.calls, b.calls) == (4, 4) and time.monotonic() - t0 < 10.0
        # a write refused by one shard is sent again with the same tags to both: the one that
        # applied it would answer from the client's session, not apply it twice
        b.refuse = 2
        assert c.write_rows("t", [0, 1], np.zeros((2, 4), np.float32)) == 2
        assert len(a.tags) == len(b.tags) == 3 and len(set(a.tags)) == len(set(b.tags)) == 1
        coord.refuse = 2
        assert [t.name for t in c.list_tables()] == ["t"]  # a coordinator read: retried
        assert coord.calls == 3
        coord.refuse = 1
        with pytest.raises(OverloadedError, match="max_inflight_calls=1"):
            c.drop_table("t")  # a control-plane write: not retried
        assert coord.calls == 4
    with MemoryClient(endpoint, retry_seconds=0, token="") as c:  # no retries at all
        c.table("t")
        a.calls = b.calls = 0
        b.refuse = 1
        with pytest.raises(OverloadedError):
            c.lookup("t", [1])
        assert b.calls == 1
    # any other RESOURCE_EXHAUSTED (a message too large) is not retried: it cannot succeed
    b.error = lambda: ResourceExhaustedError("Received message larger than max (300000000 vs. 268435456)")
    with MemoryClient(endpoint, retry_seconds=30, token="") as c:
        c.table("t")
        a.calls = b.calls = 0
        b.refuse = 1
        with pytest.raises(ResourceExhaustedError) as err:
            c.lookup("t", [1])
        assert not isinstance(err.value, OverloadedError) and b.calls == 1
    b.error = FakeShard(2).error

    async def run():
        async with AsyncMemoryClient(endpoint, retry_seconds=30, token="") as ac:
            b.refuse = 3
            a.calls = b.calls = 0
            out = await ac.lookup("t", [3])
            assert out.tolist() == [[7.0] * 4] and b.calls == 4
            b.refuse = 1000  # refused for good: gives up after retry_seconds
            ac.retry_seconds = 1.0
            t0 = time.monotonic()
            with pytest.raises(OverloadedError):
                await ac.lookup("t", [3])
            # sleeps of 0.05-0.1, 0.1-0.2, 0.2-0.4 and maybe 0.4-0.8 s fit in 1 s; the next does not
            # (fewer attempts fit when each call is slow on a loaded machine; never more)
            assert 0.3 < time.monotonic() - t0 < 5.0 and 2 <= b.calls - 4 <= 5

    asyncio.run(run())


# ------------------------------------------------------------------ a flooded shard

#: The flood's limits: 3 calls, 48 MiB of requests in progress, so with 32 MiB requests one runs,
#: a second is refused once read (it would pass 48 MiB) and the rest before they are read.
FLOOD_LIMITS = Limits(max_inflight_calls=3, max_inflight_bytes=48 * MiB)
THREADS, CALLS_PER_THREAD, FLOOD_SECONDS, FLOOD_ROUNDS = 16, 12, 60.0, 6
BAGS, PER_BAG = 1024, 4096  # a [1024, 4096] bag batch: int32 ids + float32 weights = 32 MiB
REQUEST = 32 * MiB


@pytest.fixture(scope="module")
def overload_cluster(memory_cluster):
    """A second, one-shard memory cluster in the session's Ray, with small limits."""
    from memserver.cluster.launch import start_cluster

    cluster = start_cluster(1, shard_cpus=0.1, name="overloadtest", limits=FLOOD_LIMITS)
    yield cluster
    cluster.shutdown()


def scrape(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def rejected_by(samples, method: str) -> dict[str, float]:
    return {dict(labels)["limit"]: v for (name, labels), v in samples.items()
            if name == "memserver_rejected_total" and dict(labels)["method"] == method}


def readers_refused(samples) -> float:
    """How many of the readers' calls (Lookup on `other`, SlotStats on `flooded`) were refused."""
    return sum(rejected_by(samples, "SlotStats").values()) + sum(rejected_by(samples, "Lookup").values())


def bag_request(table: str, layout_id: int) -> bytes:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1024, (BAGS, PER_BAG), dtype=np.int32)
    return pb.BagRequest(table=table, ids=encode(ids), weights=encode(np.ones((BAGS, PER_BAG), np.float32)),
                         layout_id=layout_id).SerializeToString()


def flood(address: str, body: bytes, threads: int, calls: int, seconds: float, stop: threading.Event) -> dict[str, int]:
    """`threads` threads, each on its own connection, send `body` as a Bag up to `calls` times (until
    `seconds` pass or `stop`); returns how many answers had each status."""
    seen: dict[str, int] = {}
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def user():
        with grpc.insecure_channel(address, options=[*GRPC_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]) as ch:
            bag = ch.unary_unary("/memserver.v1.DataPlane/Bag", request_serializer=None, response_deserializer=None)
            for _ in range(calls):
                if stop.is_set() or time.monotonic() > end:
                    break
                try:
                    bag(body, timeout=60)
                    code = "OK"
                except grpc.RpcError as err:
                    code = err.code().name
                    if code == "RESOURCE_EXHAUSTED":
                        assert err.details().startswith(OVERLOADED), err.details()
                with lock:
                    seen[code] = seen.get(code, 0) + 1

    pool = [threading.Thread(target=user, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(seconds + 120)
    assert not any(t.is_alive() for t in pool), "a flood thread hangs"
    return seen


class RssWatch:
    """Samples a shard's memserver_shard_rss_bytes every 20 ms in a thread; `peak` is the largest."""

    def __init__(self, metrics_address: str) -> None:
        self.address, self.peak, self.samples = metrics_address, 0.0, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.is_set():
            rss = sum(v for (name, _), v in scrape(self.address).items() if name == "memserver_shard_rss_bytes")
            self.peak, self.samples = max(self.peak, rss), self.samples + 1
            self.stop.wait(0.02)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(30)


#: Resident bytes per request byte a shard may hold: a request exists up to ~4 times while its
#: call works on it (gRPC's receive buffer, the Python bytes, the parsed message, the decoded
#: copy; a Bag adds its int64 local ids), and glibc keeps some of it, freed, in the per-thread
#: arenas of gRPC's threads, the event loop and the compute thread (memserver.wire.tune_malloc
#: keeps blocks below 32 MiB in the heap). A refused request adds at most gRPC's initial 64 KiB
#: window (memserver.server.admission.SERVER_OPTIONS).
RSS_FACTOR = 6


def rss_bound(baseline: float) -> float:
    """The flooded shard's RSS stays below its baseline plus RSS_FACTOR x the request bytes its
    limits let it hold at once: each of its max_inflight_calls calls holds at most one request
    (those it admitted, together at most max(max_inflight_bytes, one request)), so 6 x 3 x 32 MiB
    = 576 MiB (the test prints the peak). It fails with the limits off, with gRPC's BDP probing
    on (the windows of refused streams) and with refused requests left to the cyclic GC
    (test_refused_requests_are_freed_at_once catches that one for sure)."""
    return baseline + RSS_FACTOR * FLOOD_LIMITS.max_inflight_calls * REQUEST


def test_a_flooded_shard_refuses_stays_bounded_and_recovers(overload_cluster):
    from client import MemoryClient

    shard = overload_cluster.shard_infos[0]
    address, metrics_address = shard["address"], shard["metrics"]
    endpoint = overload_cluster.endpoint
    with MemoryClient(endpoint, retry_seconds=60, token="") as c:
        c.create_table("flooded", 1024, 8, sharding="rows")
        c.create_table("other", 64, 8, sharding="rows")
        c.write_rows("other", np.arange(4), np.ones((4, 8), np.float32))
        body = bag_request("flooded", c.table("flooded").layout_id)
        assert 32 * MiB < len(body) < 33 * MiB
        with grpc.insecure_channel(address, options=GRPC_OPTIONS) as ch:
            raw_bag = ch.unary_unary("/memserver.v1.DataPlane/Bag", request_serializer=None, response_deserializer=None)
            raw_bag(body, timeout=60)  # alone: admitted; warms the kernels and the heap up
            time.sleep(0.5)
            baseline = sum(v for (name, _), v in scrape(metrics_address).items() if name == "memserver_shard_rss_bytes")

            stop = threading.Event()
            answered = {"other": 0, "flooded": 0}
            failures: list[BaseException] = []

            def reader(table, call):  # MemoryClient reads during the flood: each retried until it gets through
                try:
                    with MemoryClient(endpoint, retry_seconds=60, token="") as rc:
                        while not stop.is_set() and answered[table] < 500:
                            call(rc)
                            answered[table] += 1
                            stop.wait(0.05)
                except BaseException as exc:
                    failures.append(exc)

            # (c) another table on the flooded shard; (f) the flooded table itself (SlotStats)
            readers = [threading.Thread(target=reader, args=("other", lambda rc: rc.lookup("other", [0, 1, 2, 3])), daemon=True),
                       threading.Thread(target=reader, args=("flooded", lambda rc: rc.slot_stats("flooded", [0, 1])),
                                        daemon=True)]
            t0 = time.monotonic()
            with RssWatch(metrics_address) as watch:
                for t in readers:
                    t.start()
                # floods until a reader's call was refused too and the RSS was sampled often
                # enough (on a fast machine one flood of 192 calls can pass between the readers'
                # calls), bounded in rounds and time
                seen: dict[str, int] = {}
                deadline = time.monotonic() + FLOOD_SECONDS
                for _ in range(FLOOD_ROUNDS):
                    left = deadline - time.monotonic()
                    for code, n in flood(address, body, THREADS, CALLS_PER_THREAD, left, threading.Event()).items():
                        seen[code] = seen.get(code, 0) + n
                    if (readers_refused(scrape(metrics_address)) and watch.samples > 10) or time.monotonic() > deadline:
                        break
                stop.set()
                for t in readers:
                    t.join(120)
            flood_seconds = time.monotonic() - t0
            samples = scrape(metrics_address)
            # (d) after the flood: the flooded table answers again, nothing is left in progress
            raw_bag(body, timeout=60)
            assert c.lookup("flooded", [5]).shape == (1, 8)
            after = scrape(metrics_address)
    print(f"flood: {seen} in {flood_seconds:.1f}s; readers answered {answered}; rss baseline {baseline / MiB:.0f} MiB, "
          f"peak {watch.peak / MiB:.0f} MiB ({watch.samples} samples), bound {rss_bound(baseline) / MiB:.0f} MiB; "
          f"rejected {rejected_by(samples, 'Bag')}, SlotStats {rejected_by(samples, 'SlotStats')}, "
          f"Lookup {rejected_by(samples, 'Lookup')}")
    # (a) refusals, and no other error
    assert set(seen) <= {"OK", "RESOURCE_EXHAUSTED"}, seen
    assert seen.get("RESOURCE_EXHAUSTED", 0) > 0 and seen.get("OK", 0) > 0
    # (b) memory bounded by the limits
    assert watch.samples > 10
    assert watch.peak <= rss_bound(baseline), (watch.peak / MiB, baseline / MiB)
    # (c), (f): every read during the flood succeeded, the flooded table's after being refused
    assert not failures, failures
    assert answered["other"] > 0 and answered["flooded"] > 0
    # some of the readers' calls were refused on the way (which reader's is timing: either table's)
    assert readers_refused(samples) > 0
    # (d) in-flight gauges back to 0
    for name in ("memserver_inflight_calls", "memserver_inflight_bytes"):
        assert after[(name, ())] == 0, name
    # (e) the counter counts exactly the refusals the flood saw, by both limits
    bag_refused = rejected_by(samples, "Bag")
    assert set(bag_refused) == {"max_inflight_calls", "max_inflight_bytes"}, bag_refused
    assert sum(bag_refused.values()) == seen["RESOURCE_EXHAUSTED"]
    key = ("memserver_requests_total", (("code", "RESOURCE_EXHAUSTED"), ("method", "Bag"), ("table", "")))
    assert samples[key] == seen["RESOURCE_EXHAUSTED"]
    assert rejected_by(after, "Bag") == bag_refused


def test_the_coordinator_has_the_limits_too(overload_cluster):
    """Bursts of 24 simultaneous Status calls (each asks the shard through Ray) at a coordinator
    taking 3 calls at a time: the burst's excess is refused, naming the limit; health stays open."""
    ep = overload_cluster.endpoint
    channels = [grpc.insecure_channel(ep, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(24)]
    try:
        for ch in channels:  # connected before the bursts
            pb_grpc.ControlPlaneStub(ch).ListTables(pb.ListTablesRequest(), timeout=30)
        seen: dict[str, int] = {}
        texts: set[str] = set()
        lock = threading.Lock()

        def call(ch, barrier):
            barrier.wait(30)
            try:
                pb_grpc.ControlPlaneStub(ch).Status(pb.StatusRequest(), timeout=30)
                code = "OK"
            except grpc.RpcError as err:
                code = err.code().name
                texts.add(err.details())
            with lock:
                seen[code] = seen.get(code, 0) + 1

        for _ in range(5):  # bounded: a burst whose calls happen not to overlap refuses nothing
            barrier = threading.Barrier(len(channels))
            threads = [threading.Thread(target=call, args=(ch, barrier), daemon=True) for ch in channels]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            if seen.get("RESOURCE_EXHAUSTED"):
                break
        assert set(seen) <= {"OK", "RESOURCE_EXHAUSTED"} and seen.get("RESOURCE_EXHAUSTED", 0) > 0, seen
        assert all(t.startswith(OVERLOADED) and "max_inflight_calls=3" in t for t in texts), texts
        health = health_pb2_grpc.HealthStub(channels[0]).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        for ch in channels:
            ch.close()


@pytest.mark.parametrize("path", ["gRPC", "doorbell"])
def test_an_answer_many_times_its_request_counts_against_max_inflight_bytes(path):
    """A hunt: a bag of [B, 0] ids (23 request bytes) answered B rows, counted as 23 bytes,
    and a few at once took a shard's memory unrefused. The answer's bytes count while it
    is computed: beside other calls past the limit it is refused, alone it runs, and its bytes
    are given back after."""
    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer
    from tests.test_shm import shm_client

    config = ServeConfig(limits=Limits(max_inflight_calls=16, max_inflight_bytes=4 * MiB))
    with InProcessServer(1, config=config) as server, MemoryClient(server.endpoint, shm=False, timeout=30) as tcp:
        tcp.create_table("wide", 16, 256, num_shards=1)
        c = shm_client(server.endpoint, "wide", 1, retry_seconds=0) if path == "doorbell" else \
            MemoryClient(server.endpoint, shm=False, retry_seconds=0, timeout=30)
        admission = server.shards[0].servicer.regions.admission
        ids, w = np.zeros((8192, 1), np.int64), np.ones((8192, 1), np.float32)  # 96 KiB asking for 8 MiB
        if path == "doorbell":
            before = c.aio.shm.bell_calls
        admission.take("Other", 1000)  # another call in progress
        try:
            with pytest.raises(OverloadedError, match=r"this call's answer 8(\.0)? MiB on top of"):
                c.bag("wide", ids, w)
            if path == "gRPC":  # raw, [B, 0] ids: no bytes at all, the answer 8 MiB
                meta = c.table("wide")
                with grpc.insecure_channel(meta.shards[0].address) as ch:
                    with pytest.raises(grpc.RpcError) as err:
                        pb_grpc.DataPlaneStub(ch).Bag(pb.BagRequest(
                            table="wide", ids=encode(np.zeros((8192, 0), np.int64)),
                            weights=encode(np.zeros((8192, 0), np.float32))), timeout=30)
                    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert "this call's answer" in err.value.details()
        finally:
            admission.give_back(1000)
        assert c.bag("wide", ids, w).shape == (8192, 256)  # alone: admitted
        if path == "doorbell":
            assert c.aio.shm.bell_calls >= before + 2  # (both went by the doorbell)
        c.close()
        assert admission.bytes == 0 and admission.calls == 0


def test_a_trigger_records_answer_counts_against_max_inflight_bytes(monkeypatch):
    """A review: Triggers answers capacity x (8 + 4 x context) bytes per slot named (~144 bytes
    per request byte, repeats allowed), counted as its request alone while it was computed."""
    import memserver.core.triggers as trg
    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    with InProcessServer(1) as srv, MemoryClient(srv.endpoint, shm=False, timeout=30) as c:
        c.create_table("t", 1000, 8)
        meta = c.table("t")
        admission = srv.shards[0].servicer.regions.admission
        seen: list[int] = []
        get = trg.TriggerHeaps.get
        monkeypatch.setattr(trg.TriggerHeaps, "get", lambda self, slots: (seen.append(admission.bytes), get(self, slots))[1])
        req = pb.TriggersRequest(table="t", ids=encode(np.zeros(4096, np.int32)), layout_id=meta.layout_id)
        with grpc.insecure_channel(meta.shards[0].address, options=GRPC_OPTIONS) as ch:
            answer = pb_grpc.DataPlaneStub(ch).Triggers(req, timeout=30)
        assert seen and seen[0] >= answer.ByteSize() * 0.9 > 50 * req.ByteSize()
        assert admission.bytes == 0
