"""Bad input gets a precise status and a message naming the problem, and changes nothing."""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest
import torch

from client import (
    FailedPreconditionError,
    InvalidArgumentError,
    ResourceExhaustedError,
    TableExistsError,
    TableNotFoundError,
)
from memserver.api.v1 import memserver_pb2 as pb
from memserver.api.v1 import memserver_pb2_grpc as pb_grpc
from memserver.wire import encode

DIM = 8


@pytest.fixture(params=["rows", "cols"])
def table(request, client, table_name):
    client.create_table(table_name, 100, DIM, sharding=request.param, optimizer="sgd", lr=1.0, init_std=1.0)
    return table_name


def snapshot(client, table):
    return client.lookup(table, np.arange(100)), client.slot_stats(table, np.arange(100))["updates"]


W = np.ones((2, 3), np.float32)
G = np.ones((2, DIM), np.float32)
IDS = np.array([[1, 2, 3], [4, 5, 6]])

BAD_WRITES = [
    ("out of range", lambda c, t: c.bag_backward(t, np.array([[1, 2, 100], [4, 5, 6]]), W, G), "id 100 out of range"),
    ("negative id", lambda c, t: c.bag_backward(t, np.array([[1, -2, 3], [4, 5, 6]]), W, G), "negative id -2"),
    ("float ids", lambda c, t: c.bag_backward(t, IDS.astype(np.float32), W, G), "dtype must be int64 or int32, got float32"),
    ("weights shape", lambda c, t: c.bag_backward(t, IDS, np.ones((2, 2), np.float32), G), "weights: shape"),
    ("grad_out shape", lambda c, t: c.bag_backward(t, IDS, W, np.ones((2, DIM + 1), np.float32)), "grad_out: shape"),
    ("grad_out batch", lambda c, t: c.bag_backward(t, IDS, W, np.ones((3, DIM), np.float32)), "grad_out: shape"),
    ("nan gradient", lambda c, t: c.bag_backward(t, IDS, W, np.full((2, DIM), np.nan, np.float32)), "NaN or infinite"),
    ("inf weight", lambda c, t: c.bag_backward(t, IDS, np.full((2, 3), np.inf, np.float32), G), "NaN or infinite"),
    ("int grads", lambda c, t: c.push_gradients(t, [1, 2], np.ones((2, DIM), np.int64)), "floating point"),
    ("push length", lambda c, t: c.push_gradients(t, [1, 2, 3], np.ones((2, DIM), np.float32)), "grads: shape"),
    ("push inf", lambda c, t: c.push_gradients(t, [1, 2], np.full((2, DIM), np.inf, np.float32)), "NaN or infinite"),
    # finite rows whose id repeats, summed in the client beyond float32 (row 1's shard refused it,
    # row 2's applied)
    ("push sum inf", lambda c, t: c.push_gradients(t, [1, 1, 2], np.full((3, DIM), 3e38, np.float32)),
     "grads: the rows of id 1 sum beyond float32's range"),
    # a bag's entries of one row (weight x grad_out, summed) beyond float32: row 1's shard refused
    # it, the other applied its part
    ("bag sum inf", lambda c, t: c.bag_backward(t, np.array([[1, 1, 2], [4, 5, 6]]), np.full((2, 3), 3e38, np.float32), G),
     r"grad_out: the entries \(weight x grad_out\) of id 1 sum beyond float32's range"),
    ("write dup ids", lambda c, t: c.write_rows(t, [1, 1], np.ones((2, DIM), np.float32)), "distinct ids"),
    ("write range", lambda c, t: c.write_rows(t, [1, 1000], np.ones((2, DIM), np.float32)), "out of range"),
    ("write nan", lambda c, t: c.write_rows(t, [1, 2], np.full((2, DIM), np.nan, np.float32)), "NaN"),
    # finite float64 that float32 cannot hold: it was stored as inf (a walkthrough's 1e300)
    ("write 1e300", lambda c, t: c.write_rows(t, [20], np.full((1, DIM), 1e300)), "beyond float32's largest"),
    ("push 1e300", lambda c, t: c.push_gradients(t, [1, 2], np.full((2, DIM), -1e300)), "beyond float32's largest"),
    ("grad_out 1e300", lambda c, t: c.bag_backward(t, IDS, W, np.full((2, DIM), 1e300)), "beyond float32's largest"),
    ("weight 1e300", lambda c, t: c.bag_backward(t, IDS, np.full((2, 3), 1e300), G), "beyond float32's largest"),
    ("1-d bag ids", lambda c, t: c.bag_backward(t, np.array([1, 2]), np.ones(2, np.float32), G), r"shape \[B, k\]"),
    # an integer argument that is not one, or that its protobuf field cannot hold: named (protobuf's
    # own TypeError or ValueError named nothing)
    ("float step", lambda c, t: c.bag_backward(t, IDS, W, G, step=1.5, gather=True), "step: must be an integer, got 1.5"),
    ("negative step", lambda c, t: c.bag_backward(t, IDS, W, G, step=-1, gather=True), r"step: -1 is out of range \(0 \.\."),
    ("float commit", lambda c, t: c.commit_step(t, 2.0), "step: must be an integer, got 2.0"),
]


@pytest.mark.parametrize("case", BAD_WRITES, ids=[c[0] for c in BAD_WRITES])
def test_bad_writes_are_rejected_whole(client, table, case):
    _, call, message = case
    before = snapshot(client, table)
    with pytest.raises(InvalidArgumentError, match=message) as err:
        call(client, table)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    after = snapshot(client, table)
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1], before[1])


def test_a_gradient_beyond_float16s_range_on_a_float16_wire_is_said_as_that(client, table, memory_cluster):
    """A finite gradient of 1e6 sent with wire_dtype float16 becomes infinite in the cast: the
    refusal blamed the caller's gradient ("contains NaN or infinite values"), which was finite,
    and came from the shards, each for its own part: a cols row whose big values fell in one
    shard's columns was updated in the other's (a hunt). The client refuses it whole, first."""
    from client import MemoryClient

    before = snapshot(client, table)
    big = np.ones((2, DIM), np.float32)
    big[:, -1] = 1e6  # (the last shard's columns, or rows 4-6's bag on rows)
    says = "a value of magnitude {} is beyond float16's largest \\(65504\\), which this client's wire_dtype sends"
    with MemoryClient(memory_cluster.endpoint, wire_dtype="float16") as half:
        with pytest.raises(InvalidArgumentError, match="grads: " + says.format("1e\\+06")):
            half.push_gradients(table, [1, 2], np.full((2, DIM), 1e6, np.float32))
        with pytest.raises(InvalidArgumentError, match="grad_out: " + says.format("1e\\+06")):
            half.bag_backward(table, IDS, W, big)
        with pytest.raises(InvalidArgumentError, match="grads: " + says.format("8e\\+04")):  # (each row finite as float16,
            # their sum not)
            half.push_gradients(table, [3, 3], np.full((2, DIM), 40000.0, np.float32))
    after = snapshot(client, table)
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1], before[1])
    with MemoryClient(memory_cluster.endpoint, wire_dtype="float16") as half:  # (rounds to 65504: finite, sent)
        half.push_gradients(table, [9], np.full((1, DIM), 65519.0, np.float32))
    assert snapshot(client, table)[1][9] == before[1][9] + 1


def test_a_gradient_beyond_bfloat16s_range_on_a_bfloat16_wire_is_said_as_that(client, table, memory_cluster):
    """A finite float32 gradient of 3.4e38 rounds to inf in bfloat16 too, but only a float16 wire
    was checked: sent with wire_dtype bfloat16 it arrived infinite, each shard refused its own
    part, and on cols the other shard applied its columns of the row. The client refuses it
    whole first, naming bfloat16's largest value, as on a float16 wire."""
    from client import MemoryClient

    before = snapshot(client, table)
    big = np.ones((2, DIM), np.float32)
    big[:, -1] = 3.4e38  # (the last shard's columns, or rows 4-6's bag on rows)
    says = "a value of magnitude {} is beyond bfloat16's largest \\(3.38953e\\+38\\), which this client's wire_dtype sends"
    with MemoryClient(memory_cluster.endpoint, wire_dtype="bfloat16") as half:
        with pytest.raises(InvalidArgumentError, match="grads: " + says.format("3.4e\\+38")):
            half.push_gradients(table, [1, 2], np.full((2, DIM), 3.4e38, np.float32))
        with pytest.raises(InvalidArgumentError, match="grad_out: " + says.format("3.4e\\+38")) as err:
            half.bag_backward(table, IDS, W, big)
        assert "send float32 (wire_dtype)" in str(err.value)
    after = snapshot(client, table)
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1], before[1])
    with MemoryClient(memory_cluster.endpoint, wire_dtype="bfloat16") as half:  # (rounds to 3.38953e38: finite, sent)
        half.push_gradients(table, [9], np.full((1, DIM), 3.39e38, np.float32))
    assert snapshot(client, table)[1][9] == before[1][9] + 1


def test_rows_beyond_a_float16_tables_range_are_refused_whole(client, table_name):
    """write_rows of 1e5 into a float16 table stored inf. Refused by the client before anything is
    sent (here only shard 1's columns are too large: a cols table takes all or none), naming the
    range and the table; the table is unchanged."""
    client.create_table(table_name, 10, 4, sharding="cols", num_shards=2, dtype="float16", init_std=0.5)
    before = client.lookup(table_name, np.arange(10))
    rows = np.ones((2, 4), np.float32)
    rows[1, 3] = 1e5
    with pytest.raises(InvalidArgumentError, match=f"rows: 100000 is beyond float16's largest value \\(65504\\), "
                                                   f"which table {table_name} stores"):
        client.write_rows(table_name, [1, 2], rows)
    np.testing.assert_array_equal(client.lookup(table_name, np.arange(10)), before)
    rows[1, 3] = 6e4  # within the range: written (as float16 rounds it)
    assert client.write_rows(table_name, [1, 2], rows) == 2
    assert client.lookup(table_name, [2])[0, 3] == np.float16(6e4)


def test_a_shard_refuses_float16_overflowing_rows_and_counts_overflowing_steps(tmp_path):
    """Through a shard, without the client's check: write_rows beyond float16's range is refused
    INVALID_ARGUMENT, nothing written; an optimizer step past it stores inf (the table's math, as
    in torch) and is counted in status (TableLoad.nonfinite_updates, `status --json`) and in the
    metrics."""
    from memserver.cli.tables import status_dict
    from memserver.server.catalog import plan_table, validate_spec
    from memserver.server.shard_actor import ShardActor
    from memserver.wire import decode

    shard = ShardActor(0, host="127.0.0.1", data_dir=str(tmp_path))
    spec = validate_spec(pb.TableSpec(name="h", num_rows=8, dim=2, sharding=pb.ROWS, dtype=pb.FLOAT16,
                                      optimizer=pb.OptimizerSpec(name="sgd", lr=1.0)), 1)
    shard.create_table(spec.SerializeToString(), plan_table(spec, [shard.info()]).shards[0].SerializeToString(), 1)
    try:
        with grpc.insecure_channel(shard.address) as ch:
            stub = pb_grpc.DataPlaneStub(ch)

            def rows(ids):
                return decode(stub.Lookup(pb.LookupRequest(table="h", ids=encode(torch.tensor(ids)))).rows, "rows")

            before = rows([0, 1])
            with pytest.raises(grpc.RpcError) as err:
                stub.WriteRows(pb.WriteRowsRequest(table="h", ids=encode(torch.tensor([0, 1])),
                                                   rows=encode(torch.tensor([[1.0, 1.0], [7e4, 0.0]])),
                                                   tag=pb.WriteTag(client_id="c", seq=1)))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "rows: 70000 is beyond float16's largest value (65504), which table h stores" in err.value.details()
            assert torch.equal(rows([0, 1]), before)
            # such a write logged by an older shard (which took it) is replayed as it was, not refused at recovery
            from memserver.storage.wal import WRITE_ROWS

            old = pb.WriteRowsRequest(table="h", ids=encode(torch.tensor([5])), rows=encode(torch.tensor([[7e4, 1.0]])))
            shard.servicer.replay(shard.servicer.tables["h"], WRITE_ROWS, old.SerializeToString())
            assert torch.isinf(rows([5])[0, 0])
            stub.PushGradients(pb.PushGradientsRequest(table="h", ids=encode(torch.tensor([0, 1])),
                                                       grads=encode(torch.tensor([[-1e5, 0.0], [1.0, 1.0]])),
                                                       tag=pb.WriteTag(client_id="c", seq=2)))
            assert torch.isinf(rows([0])).any() and torch.isfinite(rows([1])).all()
        load = next(t for t in pb.ShardStatus.FromString(shard.status()).tables if t.table == "h")
        assert load.nonfinite_updates == 1
        shown = status_dict(pb.StatusResponse(shards=[pb.ShardStatus.FromString(shard.status())]))
        assert shown["shards"][0]["tables"][0]["nonfinite_updates"] == 1
        assert shard.metrics.registry.get_sample_value("memserver_table_nonfinite_updates_total", {"table": "h"}) == 1
    finally:
        shard.stop()


def test_bad_reads(client, table):
    with pytest.raises(InvalidArgumentError, match="out of range"):
        client.lookup(table, [0, 100])
    assert len(client.top_slots(table, n=np.int64(2))[0]) == len(client.top_slots(table, n=torch.tensor(2))[0]) == 2
    for bad, says in ((lambda: client.top_slots(table, n=2.5), "n: must be an integer, got 2.5"),
                      (lambda: client.top_slots(table, n=None), "n: must be an integer, got None"),
                      (lambda: client.checkpoint("ck", step=None), "step: must be an integer, got None"),
                      (lambda: client.top_slots(table, n=1 << 40), "n: 1099511627776 is out of range"),
                      (lambda: client.checkpoint("ck", step="7"), "step: must be an integer, got '7'"),
                      (lambda: client.restore("ck", num_shards=1.0), "num_shards: must be an integer, got 1.0"),
                      (lambda: client.restore("ck", cache_bytes="4G"), "cache_bytes: must be an integer, got '4G'"),
                      (lambda: client.create_index(table + "-ix", 8.0), "dim: must be an integer, got 8.0"),
                      (lambda: client.create_product_keys(table + "-pk", table, 2, 10, knn=4.0, k_dim=8),
                       "knn: must be an integer, got 4.0")):
        with pytest.raises(InvalidArgumentError, match=says):
            bad()
    with pytest.raises(InvalidArgumentError, match="offsets"):
        client.bag(table, np.array([1, 2, 3]), np.ones(3, np.float32), offsets=np.array([1, 2]))


def test_unknown_table_is_not_found(client):
    with pytest.raises(TableNotFoundError, match="'nope' does not exist") as err:
        client.lookup("nope", [1])
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(TableNotFoundError):
        client.drop_table("nope")


def test_a_shards_address_given_as_the_endpoint_says_what_to_give(client):
    """A coordinator call at a shard answers gRPC's bare UNIMPLEMENTED "Method not found!"."""
    from client import MemoryClient, MemserverError

    shard = client.status().shards[0].address
    with MemoryClient(shard, timeout=10, retry_seconds=0) as wrong, pytest.raises(MemserverError) as err:
        wrong.list_tables()
    assert err.value.code == grpc.StatusCode.UNIMPLEMENTED
    assert f"(coordinator {shard}; not a memserver coordinator (a shard's address?), or an older one: give the " \
           "coordinator's HOST:PORT, which `memserver status` and the endpoint file name)" in str(err.value)


def test_an_http_port_given_as_the_endpoint_fails_at_once_saying_so():
    """A metrics or web page's port (HTTP/1) answers a gRPC call with bytes that are not HTTP/2:
    no retry can change that, so the client raises NotGrpcError at once, not after its window
    of retries (30 s here; the test's timeout would end it) as UnavailableError."""
    import http.server
    import threading

    from client import MemoryClient, NotGrpcError

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"127.0.0.1:{server.server_address[1]}"
        with MemoryClient(endpoint, timeout=10, retry_seconds=30) as wrong, pytest.raises(NotGrpcError) as err:
            wrong.list_tables()
    finally:
        server.shutdown()
        server.server_close()
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert "the server there does not speak gRPC (an HTTP/1 server: a metrics or web page's port?): give the " \
           "coordinator's HOST:PORT" in str(err.value) and f"(coordinator {endpoint})" in str(err.value)
    assert "is a memserver cluster running there?" not in str(err.value)


@pytest.mark.parametrize("there", ["grpc", "http", "plaintext under tls"])
def test_a_shards_old_port_taken_by_another_server_is_a_shard_that_moved(table_name, there, tmp_path):
    """A shard restarted on a new port and another server took its old one (a local Ray's workers
    bind ports from the same range): a call there met UNIMPLEMENTED from that gRPC server (or
    bytes that are no HTTP/2, or no TLS where the cluster speaks it) and the write failed at once,
    half applied (a CI run's shard 1). Both clients take it as a shard that moved now: a fresh
    map, the write sent again with its tags, applied once on each shard."""
    import asyncio
    import dataclasses
    import http.server
    import threading
    from concurrent import futures

    from grpc_health.v1 import health, health_pb2_grpc

    from client import AsyncMemoryClient, MemoryClient
    from client.channels import ClientTls
    from memserver.cluster.inprocess import InProcessServer
    from memserver.server.config import ServeConfig, TlsFiles
    from tests.certs import self_signed

    if there == "http":
        web = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
        threading.Thread(target=web.serve_forever, daemon=True).start()
        taken = f"127.0.0.1:{web.server_address[1]}"
    else:
        other = grpc.server(futures.ThreadPoolExecutor(1))
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), other)
        taken = f"127.0.0.1:{other.add_insecure_port('127.0.0.1:0')}"
        other.start()
    config, tls = None, None
    if there == "plaintext under tls":
        cert, key = self_signed(tmp_path)
        config, tls = ServeConfig(tls=TlsFiles(str(cert), str(key))), ClientTls(cert.read_bytes())

    def stale(meta):  # the map as the client held it: shard 1 where it served before its restart
        return dataclasses.replace(meta, shards=(meta.shards[0], dataclasses.replace(meta.shards[1], address=taken)))

    async def aio_push(endpoint: str) -> str:
        async with AsyncMemoryClient(endpoint, shm=False, retry_seconds=30, timeout=5, tls=tls) as ac:
            ac._tables[table_name] = stale(await ac.table(table_name))
            await ac.push_gradients(table_name, [4, 5], np.ones((2, DIM), np.float32))
            return ac._tables[table_name].shards[1].address

    try:
        with InProcessServer(2, config=config) as srv, \
                MemoryClient(srv.endpoint, shm=False, retry_seconds=30, timeout=5, tls=tls) as c:
            c.create_table(table_name, 10, DIM, sharding="rows", optimizer="sgd", lr=1.0, init_std=0.0)
            c.aio._tables[table_name] = stale(c.table(table_name))
            c.push_gradients(table_name, [0, 1, 2, 3], np.ones((4, DIM), np.float32))  # (ids 1, 3 on shard 1)
            assert c.table(table_name).shards[1].address != taken
            assert asyncio.run(aio_push(srv.endpoint)) != taken
            got = c.lookup(table_name, np.arange(8))
    finally:
        if there == "http":
            web.shutdown()
            web.server_close()
        else:
            other.stop(None)
    assert (got[:6] == -1).all() and (got[6:] == 0).all(), got  # each row's update applied once (sgd, lr 1)


@pytest.mark.parametrize("path", ["grpc", "shared memory"])
@pytest.mark.parametrize("sharding", ["rows", "cols"])
def test_a_call_meant_for_a_shard_that_moved_is_refused_by_the_shard_now_at_its_address(table_name, sharding, path):
    """Shard 1 restarted on a new port and shard 0 took its old one (and the reverse): a client
    still on the old map sent shard 1's calls to shard 0, which answered a cols table's calls from
    its own columns, silently (a rows table's ids were refused as another shard's: the call failed,
    INVALID_ARGUMENT). Each call names the shard server its map puts there (memserver-shard), the other one refuses it
    UNAVAILABLE, and the call goes again with a fresh map: right rows, each update applied once on
    its own rows. Both clients; through shared memory (and the shards' doorbells) too, whose
    regions are each bound to the server they were attached to."""
    import asyncio
    import dataclasses
    import time

    from client import AsyncMemoryClient, MemoryClient, UnavailableError
    from memserver.cluster.inprocess import InProcessServer
    from memserver.wire import NO_SERVER, SHARD_HEADER, WRONG_SHARD
    from tests.test_shm import attach

    shm = path == "shared memory"
    n = 8
    rows = np.arange(n * DIM, dtype=np.float32).reshape(n, DIM)

    def swapped(meta):  # the map as a client held it: each shard where the other one serves now
        a, b = meta.shards
        return dataclasses.replace(meta, shards=(dataclasses.replace(a, address=b.address),
                                                 dataclasses.replace(b, address=a.address)))

    async def aio_push(endpoint: str) -> tuple[np.ndarray, np.ndarray]:
        async with AsyncMemoryClient(endpoint, shm=shm, retry_seconds=30, timeout=5) as ac:
            meta = await ac.table(table_name)
            ac._tables[table_name] = swapped(meta)
            got = await ac.lookup(table_name, np.arange(n))
            ac._tables[table_name] = swapped(meta)
            await ac.push_gradients(table_name, [4, 5, 6, 7], np.ones((4, DIM), np.float32))
            return got, await ac.lookup(table_name, np.arange(n))

    with InProcessServer(2) as srv, MemoryClient(srv.endpoint, shm=shm, retry_seconds=30, timeout=5) as c:
        c.create_table(table_name, n, DIM, sharding=sharding, optimizer="sgd", lr=1.0, init_std=0.0)
        c.write_rows(table_name, np.arange(n), rows)
        c.create_table(other := f"{table_name}_b", n, DIM, sharding=sharding)
        meta = c.table(table_name)
        assert [sh.server for sh in meta.shards] == [0, 1]
        c.aio._tables[other] = swapped(c.table(other))
        if shm:  # both regions (and doorbells) attached, each to its own shard, before the map goes stale
            attach(c, table_name, 2)
            assert {c.aio.shm.regions[sh.address].server for sh in meta.shards} == {0, 1}
            assert all(c.aio.shm.bell(sh.address, sh.server) is not None for sh in meta.shards)
            before = c.aio.shm.calls + c.aio.shm.bell_calls
        c.aio._tables[table_name] = swapped(meta)
        np.testing.assert_array_equal(c.lookup(table_name, np.arange(n)), rows)
        assert other not in c.aio._tables  # the other table's map, as stale, forgotten with it
        c.aio._tables[table_name] = swapped(meta)
        c.push_gradients(table_name, [0, 1, 2, 3], np.ones((4, DIM), np.float32))
        assert c.aio._tables[table_name] == meta  # the fresh map
        if shm:  # the retries went through the regions again (their servers now the ones the map names)
            assert c.aio.shm.calls + c.aio.shm.bell_calls > before
        first, pushed = asyncio.run(aio_push(srv.endpoint))
        np.testing.assert_array_equal(first, rows - np.repeat([1, 0], 4)[:, None])
        np.testing.assert_array_equal(pushed, rows - 1)  # each row's update once, on its own row (sgd, lr 1)

        # the refusal itself: UNAVAILABLE, naming both shards; a large request's too (read whole, not
        # refused unread: its status could then come as a reset stream, CANCELLED, taken for overload)
        from client.transport import methods

        with grpc.insecure_channel(meta.shards[1].address) as ch:
            req = pb.LookupRequest(table=table_name, ids=encode(np.arange(1, n, 2) if sharding == "rows" else
                                                                  np.arange(n)), layout_id=meta.layout_id)
            big = pb.LookupRequest(table=table_name, ids=encode(np.zeros(2_500_000, np.int64)), layout_id=meta.layout_id)
            for r in (req, big):
                with pytest.raises(grpc.RpcError) as err:
                    methods(ch)["Lookup"](r.SerializeToString(), timeout=5, metadata=((SHARD_HEADER, "0"),))
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert f"shard 1 {WRONG_SHARD} for this Lookup (shard 0:" in err.value.details()
            assert len(methods(ch)["Lookup"](req.SerializeToString(), timeout=5,
                                             metadata=((SHARD_HEADER, "1"),)).rows.shape) == 2
            # a header that is no shard index is the caller's error, not a move: a hunt's client in
            # another language, formatting the index its own way, was sent for fresh maps for ever
            for bad in (" 1", "+1", "1.0", "one", "-2", "9" * 10):
                with pytest.raises(grpc.RpcError) as err:
                    methods(ch)["Lookup"](req.SerializeToString(), timeout=5, metadata=((SHARD_HEADER, bad),))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
                assert f"{SHARD_HEADER} metadata: {bad!r} is not a shard index" in err.value.details()
            for named, code in (("01", None), (str(NO_SERVER), grpc.StatusCode.UNAVAILABLE)):
                try:
                    methods(ch)["Lookup"](req.SerializeToString(), timeout=5, metadata=((SHARD_HEADER, named),))
                    assert code is None, named
                except grpc.RpcError as e:
                    assert e.code() == code, (named, e)

        # a map that puts both shards at one address (shard 0 down, shard 1 on the port it left):
        # every call there names no server, and is refused until the map is whole again
        both = dataclasses.replace(meta, shards=(dataclasses.replace(meta.shards[0], address=meta.shards[1].address),
                                                 meta.shards[1]))
        assert both.servers == {meta.shards[1].address: NO_SERVER}
        with MemoryClient(srv.endpoint, shm=shm, retry_seconds=0, timeout=5) as once:
            once.aio._tables[table_name] = both
            with pytest.raises(UnavailableError, match=WRONG_SHARD):
                once.lookup(table_name, np.arange(n))
            assert not (once.aio.shm.regions or once.aio.shm.attaching or once.aio.shm.not_before)  # none attached to no server

        if shm:  # an attach refused as meant for another shard is asked again soon, not after RETRY_AFTER
            from client.shm import MOVED_RETRY, ShmTransport

            async def refused_attach() -> float:
                async with grpc.aio.insecure_channel(meta.shards[1].address) as channel:
                    transport = ShmTransport(True, lambda a: channel, size=1 << 16)
                    await transport._attach(meta.shards[1].address, 0)
                    assert not transport.regions
                    return transport.not_before[meta.shards[1].address] - time.monotonic()

            assert 0 < asyncio.run(refused_attach()) <= MOVED_RETRY


def test_a_map_refused_as_overloaded_between_attempts_keeps_the_call_retrying(table_name):
    """A shard down (its address refuses connections), and the coordinator refusing the shard map
    asked between the attempts as overloaded (every client asks it at once after a shard's
    restart): the call ended there with OverloadedError, a write half applied (a hunt). The
    refused map keeps the one the client has, and the call goes on, applied once."""
    import asyncio
    import dataclasses
    import socket

    from client import AsyncMemoryClient, MemoryClient
    from memserver.api.errors import OVERLOADED, OverloadedError
    from memserver.cluster.inprocess import InProcessServer

    with socket.socket() as s:  # a port where nothing listens: the shard's address while it restarts
        s.bind(("127.0.0.1", 0))
        down = f"127.0.0.1:{s.getsockname()[1]}"

    def stale(meta):
        return dataclasses.replace(meta, shards=(meta.shards[0], dataclasses.replace(meta.shards[1], address=down)))

    with InProcessServer(2) as srv, MemoryClient(srv.endpoint, shm=False, retry_seconds=30, timeout=5) as c:
        c.create_table(table_name, 10, DIM, sharding="rows", optimizer="sgd", lr=1.0, init_std=0.0)
        coordinator = srv.coordinator.servicer
        get, armed, refused = coordinator._get, [False], []

        def busy_once(name):  # the next map asked once armed is refused
            if armed[0]:
                armed[0] = False
                refused.append(name)
                raise OverloadedError(f"{OVERLOADED}: (a test) too many calls in progress; retry with backoff")
            return get(name)

        coordinator._get = busy_once
        c.aio._tables[table_name] = stale(c.table(table_name))
        armed[0] = True
        c.push_gradients(table_name, [0, 1, 2, 3], np.ones((4, DIM), np.float32))  # (ids 1, 3 on shard 1)

        async def aio_push() -> None:
            async with AsyncMemoryClient(srv.endpoint, shm=False, retry_seconds=30, timeout=5) as ac:
                ac._tables[table_name] = stale(await ac.table(table_name))
                armed[0] = True
                await ac.push_gradients(table_name, [4, 5], np.ones((2, DIM), np.float32))

        asyncio.run(aio_push())
        got = c.lookup(table_name, np.arange(8))
    assert refused == [table_name] * 2
    assert (got[:6] == -1).all() and (got[6:] == 0).all(), got  # each row's update applied once (sgd, lr 1)


def test_a_shard_error_names_what_answered_and_which_call():
    """What a client says when a shard's address answers but not as a shard, once its retries are
    over: which call, and that an older shard may be why (gRPC's Python servers say "Method not
    found!" either way); a certificate the client does not trust stays a TlsError, raised at once."""
    from memserver.api.errors import ShardGoneError, TlsError, shard_error

    class Failed(grpc.RpcError):
        def __init__(self, code, details):
            self._code, self._details = code, details

        def code(self):
            return self._code

        def details(self):
            return self._details

    gone = shard_error(Failed(grpc.StatusCode.UNIMPLEMENTED, ""), "h:1", "Bag")
    assert isinstance(gone, ShardGoneError) and gone.code == grpc.StatusCode.UNAVAILABLE and gone.target == "shard h:1"
    assert str(gone) == ("UNAVAILABLE: the address answers, but not as a memserver shard: UNIMPLEMENTED: no details: "
                         "another gRPC server has the shard's old port (the shard restarted elsewhere?), or the shard "
                         "runs an older memserver without DataPlane/Bag (shard h:1)")
    untrusted = shard_error(Failed(grpc.StatusCode.UNAVAILABLE, "Ssl handshake failed: CERTIFICATE_VERIFY_FAILED"),
                            "h:1", "Bag")
    assert type(untrusted) is TlsError
    assert type(shard_error(Failed(grpc.StatusCode.NOT_FOUND, "table 't' does not exist"), "h:1", "Bag")).__name__ \
        == "TableNotFoundError"


def test_a_coordinators_own_unavailable_gets_no_hint_of_a_missing_cluster():
    """The coordinator's UNAVAILABLE for a restarting shard quotes Ray's "Connection reset by
    peer": the client must not add that no cluster may be running at its endpoint (it did)."""
    from concurrent import futures

    from client import MemoryClient, UnavailableError
    from memserver.api.errors import SHARD_UNAVAILABLE

    said = f"{SHARD_UNAVAILABLE} (restarting?): The actor is unavailable: recvmsg:Connection reset by peer"

    def refuse(request, context):
        context.abort(grpc.StatusCode.UNAVAILABLE, said)

    handler = grpc.method_handlers_generic_handler(
        "memserver.v1.ControlPlane", {"TrainIndex": grpc.unary_unary_rpc_method_handler(refuse)})
    server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with MemoryClient(f"127.0.0.1:{port}", timeout=10, retry_seconds=0) as c, \
                pytest.raises(UnavailableError) as err:
            c.train_index("t", np.zeros((4, 2), np.float32))
    finally:
        server.stop(None)
    assert said in str(err.value) and "is a memserver cluster running there" not in str(err.value), str(err.value)


def test_duplicate_table_is_already_exists(client, table_name):
    client.create_table(table_name, 10, 4, seed=1)
    client.write_rows(table_name, [0], np.full((1, 4), 7.0, np.float32))
    with pytest.raises(TableExistsError, match="already exists") as err:
        client.create_table(table_name, 20, 4)
    assert err.value.code == grpc.StatusCode.ALREADY_EXISTS
    np.testing.assert_array_equal(client.lookup(table_name, [0]), np.full((1, 4), 7.0))  # untouched
    assert client.table(table_name, refresh=True).num_rows == 10


def test_a_create_that_meets_a_slice_outside_the_catalog_leaves_it(memory_cluster, client, table_name, tmp_path):
    """A shard still holding a slice of that name that the catalog left out (its table came back
    incomplete): the create is ALREADY_EXISTS naming the fix, and that slice is not dropped by the
    create's undo (it was, deleting its files, a wal table's log included). Dropping the name drops
    it (it was TableNotFound, and the name refused every create for good), as do a create or a
    restore with replace."""
    import ray

    from memserver.api.errors import TableNotFoundError

    spec = pb.TableSpec(name=table_name, kind=pb.VALUE, num_rows=8, dim=4, optimizer=pb.OptimizerSpec(name="sgd", lr=1.0),
                        init_std=1.0, num_shards=1)
    info = pb.ShardInfo(index=0, address="", col_start=0, col_end=4)

    def stray() -> None:
        ray.get(memory_cluster.shards[1].create_table.remote(spec.SerializeToString(), info.SerializeToString(), 1))

    stray()
    try:
        for _ in range(2):  # the second: the slice was not dropped by the first's undo
            with pytest.raises(TableExistsError, match=f"already exists on shard 1, outside the catalog.*drop-table {table_name}"):
                client.create_table(table_name, 8, 4)
        assert table_name not in {t.name for t in client.list_tables()}
        client.drop_table(table_name)  # the stray goes
        with pytest.raises(TableNotFoundError):
            client.drop_table(table_name)  # nothing left anywhere
        assert client.create_table(table_name, 8, 4).num_rows == 8
        client.drop_table(table_name)
        stray()
        assert client.create_table(table_name, 6, 4, replace=True).num_rows == 6  # replace: whatever was there goes
        client.create_table(f"{table_name}-b", 6, 4)
        client.checkpoint(str(tmp_path), step=1, tables=[table_name, f"{table_name}-b"])
        client.drop_table(table_name)
        client.drop_table(f"{table_name}-b")
        stray()
        with pytest.raises(TableExistsError, match="outside the catalog.*or create or restore with replace"):
            # a plain restore leaves it, as a create does, and makes none of the tables (not the first, either)
            client.restore(str(tmp_path), tables=[f"{table_name}-b", table_name])
        assert {t.name for t in client.list_tables()}.isdisjoint({table_name, f"{table_name}-b"})
        [restored] = client.restore(str(tmp_path), tables=[table_name], replace=True)  # a restore with replace too
        assert restored.num_rows == 6
    finally:
        ray.get(memory_cluster.shards[1].drop_table.remote(table_name))
        if table_name in {t.name for t in client.list_tables()}:
            client.drop_table(table_name)


def test_dropping_slices_outside_the_catalog_holds_the_name():
    """While the shards drop slices of a name outside the catalog, a create of that name is refused
    (ALREADY_EXISTS) rather than run beside the drops, which would delete the new slices' files."""
    import asyncio

    from memserver.server.catalog import validate_spec
    from memserver.server.coordinator import ControlPlaneServicer

    class SlowShard:  # a Ray actor handle's shape: handle.method.remote(...) is awaited
        class drop_table:  # noqa: N801
            @staticmethod
            async def remote(name: str) -> bool:
                await asyncio.sleep(0.2)
                return True

    cp = ControlPlaneServicer([SlowShard(), SlowShard()], [{"address": f"a{j}", "node_id": "n", "pid": j} for j in range(2)])
    spec = validate_spec(pb.TableSpec(name="x", num_rows=8, dim=4, num_shards=2), 2)

    async def race() -> tuple[list[int], BaseException | None]:
        dropping = asyncio.ensure_future(cp._drop_strays("x"))
        await asyncio.sleep(0.05)
        try:
            await cp._place(spec)
            refused = None
        except TableExistsError as exc:
            refused = exc
        return await dropping, refused

    held, refused = asyncio.run(race())
    assert held == [0, 1] and refused is not None and "x" not in cp.pending


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(optimizer="adamw"), InvalidArgumentError, "unknown optimizer"),
    (dict(lr=-1.0), InvalidArgumentError, "lr must be"),
    (dict(lr=0.0), InvalidArgumentError, "lr must be a positive finite number, got 0.0"),  # (was taken as unset: 0.01)
    (dict(num_rows=1 << 40), ResourceExhaustedError, "memory available there"),
    (dict(tier="disk", dtype="float16"), InvalidArgumentError, "a tier .disk. table stores float32"),
])
def test_a_replace_that_is_refused_leaves_the_table(client, table_name, kwargs, error, message):
    """create_table(replace=True) drops the old table only once the coordinator has accepted the
    new one (RemoteValues and `memserver create-table --replace` go through it): a bad spec or
    one over the size limit used to be refused after the drop, the table and its values gone."""
    client.create_table(table_name, 10, 4, seed=1)
    client.write_rows(table_name, [0], np.full((1, 4), 7.0, np.float32))
    with pytest.raises(error, match=message):
        client.create_table(table_name, **(dict(num_rows=10, dim=4) | kwargs), replace=True)
    np.testing.assert_array_equal(client.lookup(table_name, [0]), np.full((1, 4), 7.0))
    meta = client.create_table(table_name, 20, 4, seed=1, replace=True)  # accepted: made in its place
    assert client.table(table_name, refresh=True).num_rows == 20 == meta.num_rows
    assert not np.array_equal(client.lookup(table_name, [0]), np.full((1, 4), 7.0))


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_a_shard_refuses_a_write_whose_rows_of_one_id_sum_beyond_float32(tmp_path, tier):
    """Sent raw, without the client's check: a PushGradients of finite rows of a repeated id (or a
    BagBackward whose entries of one row, weight x grad_out, summed) beyond float32's range was
    answered OK and stored inf (a hunt). Refused INVALID_ARGUMENT naming the id, nothing changed,
    on either tier; such a write logged by an older shard is replayed as it was."""
    from memserver.server.catalog import plan_table, validate_spec
    from memserver.server.shard_actor import ShardActor
    from memserver.storage.wal import PUSH_GRADIENTS
    from memserver.wire import decode

    shard = ShardActor(0, host="127.0.0.1", data_dir=str(tmp_path))
    spec = validate_spec(pb.TableSpec(name="s", num_rows=8, dim=2, sharding=pb.ROWS, tier=tier, init_std=1.0,
                                      optimizer=pb.OptimizerSpec(name="sgd", lr=1.0)), 1)
    shard.create_table(spec.SerializeToString(), plan_table(spec, [shard.info()]).shards[0].SerializeToString(), 1)
    try:
        with grpc.insecure_channel(shard.address) as ch:
            stub = pb_grpc.DataPlaneStub(ch)

            def rows():
                return decode(stub.Lookup(pb.LookupRequest(table="s", ids=encode(torch.arange(8)))).rows, "rows")

            before = rows()
            big = torch.full((2, 2), 3e38)
            for call, request, message in [
                (stub.PushGradients, pb.PushGradientsRequest(table="s", ids=encode(torch.tensor([1, 2, 2])),
                                                             grads=encode(torch.ones(3, 2).index_put_((torch.tensor([1, 2]),), big)),
                                                             tag=pb.WriteTag(client_id="c", seq=1)),
                 "grads: the rows of id 2 sum beyond float32's range"),
                (stub.BagBackward, pb.BagBackwardRequest(table="s", ids=encode(torch.tensor([[3, 3], [4, 5]])),
                                                         weights=encode(torch.tensor([[3e38, 3e38], [1.0, 1.0]])),
                                                         grad_out=encode(torch.ones(2, 2)), tag=pb.WriteTag(client_id="c", seq=2)),
                 r"grad_out: the entries (weight x grad_out) of id 3 sum beyond float32's range"),
            ]:
                with pytest.raises(grpc.RpcError) as err:
                    call(request, timeout=30)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details(), \
                    err.value.details()
            assert torch.equal(rows(), before)
            # the rows of each id apart, or of a sum within range: applied
            stub.PushGradients(pb.PushGradientsRequest(table="s", ids=encode(torch.tensor([2, 6])), grads=encode(big),
                                                       tag=pb.WriteTag(client_id="c", seq=3)))
            assert torch.isfinite(rows()).all()
            old = pb.PushGradientsRequest(table="s", ids=encode(torch.tensor([7, 7])), grads=encode(big))
            shard.servicer.replay(shard.servicer.tables["s"], PUSH_GRADIENTS, old.SerializeToString())
            assert torch.isinf(rows()[7]).all()
    finally:
        shard.stop()


def test_the_clients_sum_check_is_each_requests_as_the_shards_sum_them():
    """A review: the client checked a bag_backward's sums over the whole call, the shards over each
    request it is cut into (max_request_bytes), each its own optimizer step. A call whose whole sum
    stayed in range while a later request's alone did not was applied in part (its first request)
    and refused for the rest; one whose whole sum overflowed while no request's did was refused."""
    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    with InProcessServer(1) as server, MemoryClient(server.endpoint, timeout=30, retry_seconds=1,
                                                    max_request_bytes=1024) as c:
        c.create_table("t", 100, 2, optimizer="sgd", lr=1e-30)
        b = 60  # bags of one id each: 2 requests of at most 51 bags
        w, g = np.ones((b, 1), np.float32), np.zeros((b, 2), np.float32)
        ids = np.arange(10, 10 + b).reshape(b, 1)
        ids[[0, 51, 52], 0] = 1
        g[0], g[51], g[52] = -3e38, 3e38, 3e38  # in entry order: finite; the second request's alone: not
        before = c.lookup("t", np.arange(100))
        with pytest.raises(InvalidArgumentError, match=r"grad_out: the entries \(weight x grad_out\) of id 1 sum beyond"):
            c.bag_backward("t", ids, w, g)
        np.testing.assert_array_equal(c.lookup("t", np.arange(100)), before)  # nothing applied, first request neither
        ids = np.arange(10, 10 + b).reshape(b, 1)
        ids[[0, 51], 0] = 2
        g[:] = 0
        g[0], g[51] = 3e38, 3e38  # one in each request: each in range
        c.bag_backward("t", ids, w, g)
        assert np.isfinite(c.lookup("t", [2])).all()


def test_float64_beyond_float32_is_refused_by_the_shard_too(client, table):
    """Sent raw (another language's client): the shard refuses float64 values that float32 cannot
    hold, and a bag's weights too, whose statistics it would have made inf (then `memserver usage`
    failed on NaN), changing nothing."""
    meta = client.table(table)
    stats = client.slot_stats(table, np.arange(100))
    before = snapshot(client, table)
    big = np.full((1, meta.shards[0].col_end - meta.shards[0].col_start), 1e300)
    ids = np.array([0])  # shard 0 holds row 0 under either sharding
    with grpc.insecure_channel(meta.shards[0].address) as ch:
        stub = pb_grpc.DataPlaneStub(ch)
        for call, request in [
            (stub.PushGradients, pb.PushGradientsRequest(table=table, ids=encode(ids), grads=encode(big))),
            (stub.WriteRows, pb.WriteRowsRequest(table=table, ids=encode(ids), rows=encode(big))),
            (stub.Bag, pb.BagRequest(table=table, ids=encode(ids.reshape(1, 1)), weights=encode(np.full((1, 1), 1e300)))),
        ]:
            with pytest.raises(grpc.RpcError) as err:
                call(request, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "beyond float32's largest" in \
                err.value.details(), err.value.details()
    after = snapshot(client, table)
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(client.slot_stats(table, np.arange(100))["weight_mass"], stats["weight_mass"])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_rows=0), "num_rows: must be positive"),
        (dict(dim=-1), "dim: must be positive"),
        (dict(optimizer="rmsprop"), "unknown optimizer"),
        (dict(lr=-0.1), "lr must be"),
        (dict(num_shards=3), "num_shards: 3 requested, the cluster has 2"),
        (dict(dim=1, sharding="cols"), r"cannot be split over 2 shards \(sharding=cols; give num_shards <= 1"),
        (dict(num_rows=1, sharding="rows"), r"num_rows: 1 rows cannot be split over 2 shards \(give num_shards <= 1"),
        (dict(dtype="int8"), r"dtype: expected one of \['bfloat16', 'float16', 'float32'\], got 'int8'"),
        (dict(dtype="int64"), r"dtype: expected one of \['bfloat16', 'float16', 'float32'\], got 'int64'"),
        (dict(init_std=float("nan")), "init_std"),
        (dict(init_std=1e300), r"init_std: 1e\+300 draws values up to 8.65 x init_std, beyond float32's largest"),
        (dict(init_std=8000.0, dtype="float16"), r"init_std: .* beyond float16's largest \(65504\); at most 7571"),
        (dict(sync_workers=-2), "sync_workers: must be >= 0"),
    ],
)
def test_bad_table_specs(client, table_name, kwargs, message):
    args = dict(num_rows=10, dim=4) | kwargs
    with pytest.raises(InvalidArgumentError, match=message):
        client.create_table(table_name, args.pop("num_rows"), args.pop("dim"), **args)
    assert table_name not in {t.name for t in client.list_tables()}


@pytest.mark.parametrize("optimizer, message", [
    (pb.OptimizerSpec(name="sgd", lr=1e300), r"optimizer: lr 1e\+300 is beyond float32's largest \(3.40282e\+38\): the "
                                             "shards step in float32"),
    (pb.OptimizerSpec(name="adagrad", lr=3.5e38), r"optimizer: lr 3.5e\+38 is beyond float32's largest"),
    (pb.OptimizerSpec(name="adam", eps=1e39), r"optimizer: eps 1e\+39 is beyond float32's largest"),
])
def test_an_optimizer_setting_infinite_in_float32_is_refused(optimizer, message):
    """A hunt: lr 1e300 is finite as a double and was taken; the shards step in float32, where it
    is inf, and the first update made the rows it touched inf, or NaN for a zero gradient (adagrad,
    adam). Refused as init_std beyond the stored dtype is; float32's largest itself is taken."""
    from memserver.server.catalog import validate_spec

    with pytest.raises(InvalidArgumentError, match=message):
        validate_spec(pb.TableSpec(name="t", num_rows=8, dim=2, optimizer=optimizer), 1)
    top = float(torch.finfo(torch.float32).max)
    assert validate_spec(pb.TableSpec(name="t", num_rows=8, dim=2, optimizer=pb.OptimizerSpec(lr=top)), 1).optimizer.lr == top


PK = dict(kind=pb.PRODUCT_KEYS, values_table="v", pkm_heads=1, pkm_n_keys=4, pkm_knn=2, pkm_k_dim=4)


@pytest.mark.parametrize("spec, message", [
    (dict(kind=pb.INDEX, dim=4, tier="tape", cache_bytes=-7), "tier: only value tables have this field, and this is an index"),
    (dict(kind=pb.INDEX, dim=4, cache_bytes=1 << 20), "cache_bytes: only value tables"),
    (dict(kind=pb.INDEX, dim=4, dtype=pb.INT64), "dtype: only value tables have this field, and this is an index table"),
    (dict(kind=pb.INDEX, dim=4, optimizer=pb.OptimizerSpec(name="bogus")), "optimizer: only value tables"),
    (dict(kind=pb.INDEX, dim=4, init_std=float("nan")), "init_std: only value tables"),
    (dict(kind=pb.INDEX, dim=4, pkm_heads=2), "pkm_heads: only product-keys tables have this field, and this is an index"),
    (PK | dict(tier="disk"), "tier: only value tables have this field, and this is a product-keys table"),
    (PK | dict(payload_dim=3), "payload_dim: only index tables have this field, and this is a product-keys table"),
    (dict(num_rows=8, dim=4, index_factory="IVF4,Flat"), "index_factory: only index tables have this field, and this is "
                                                         "a value table: leave it unset"),
    (dict(num_rows=8, dim=4, metric=pb.L2), "metric: only index tables"),
    (dict(num_rows=8, dim=4, payload_dim=3), "payload_dim: only index tables"),
    (dict(num_rows=8, dim=4, values_table="zz"), "values_table: only product-keys tables"),
])
def test_a_field_another_kind_of_table_has_is_refused(spec, message):
    """CreateTable stored the value fields of an index or product-key table unchecked (tier
    "tape", cache_bytes -7, dtype int64, optimizer "bogus": none of them meant anything) and an
    index's fields on a value table (a hunt). Refused, naming the field and the kinds; a field
    left at its default (an empty optimizer, a restore's spec of an older create) is no field."""
    from memserver.server.catalog import foreign_fields, validate_spec

    with pytest.raises(InvalidArgumentError, match=message):
        validate_spec(pb.TableSpec(name="t", **spec), 2)
    assert validate_spec(pb.TableSpec(name="t", kind=pb.INDEX, dim=4, optimizer=pb.OptimizerSpec()), 2).dim == 4
    assert foreign_fields(pb.TableSpec(name="t", kind=pb.INDEX, dim=4, tier="ram", seed=3)) == ["seed", "tier"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(timeout=0), r"timeout: must be a number of seconds above 0 and at most 1e\+08 \(~3 years\), got 0"),
    (dict(timeout=-1), "timeout: must be a number of seconds above 0"),
    (dict(timeout=float("nan")), "timeout: must be"),
    (dict(timeout=float("inf")), "timeout: must be"),
    (dict(timeout="abc"), "timeout: must be a number of seconds above 0 and at most 1e\\+08 \\(~3 years\\), got 'abc'"),
    (dict(timeout=1.5e8), r"timeout: must be .* at most 1e\+08 .*, got 150000000.0"),  # (gRPC failed at once from 1e10)
    (dict(retry_seconds=1e10), r"retry_seconds: must be .* at most 1e\+08"),
    (dict(retry_seconds=-5), r"retry_seconds: must be a number of seconds >= 0 \(0: no retry\) and at most 1e\+08 "),
    (dict(retry_seconds=float("nan")), "retry_seconds: must be"),
    (dict(max_request_bytes=0), r"max_request_bytes: must be an integer in \[1024, 268435456\]"),
    (dict(max_request_bytes=-1), "max_request_bytes: must be an integer"),
    (dict(max_request_bytes=1.5e6), "max_request_bytes: must be an integer"),
])
def test_a_clients_settings_are_checked_when_it_is_made(kwargs, message):
    """A walkthrough: timeout=0 or nan failed every call DEADLINE_EXCEEDED and then retried it for
    60 s, inf failed at once, "abc" raised a TypeError from inside, and a max_request_bytes of 0
    sent one id per request. Refused when the client is made, naming the argument."""
    from client import AsyncMemoryClient, MemoryClient

    for cls in (AsyncMemoryClient, MemoryClient):
        with pytest.raises(InvalidArgumentError, match=message):
            cls("127.0.0.1:1", **kwargs)


@pytest.mark.parametrize("shm", ["0", "1"])
def test_calls_a_close_ends_in_flight_say_so(shm, monkeypatch):
    """AsyncMemoryClient.close() with calls in flight handed their callers, who cancelled
    nothing, a bare CancelledError, though writes among them had been applied (a walkthrough).
    They get FailedPreconditionError saying the client closed under them, and a write says it
    may have been applied."""
    import asyncio

    from client import FailedPreconditionError
    from client.aio import AsyncMemoryClient
    from memserver.cluster.inprocess import InProcessServer

    monkeypatch.setenv("MEMSERVER_SHM", shm)

    async def scenario(endpoint: str) -> list:
        c = AsyncMemoryClient(endpoint, timeout=30)
        await c.create_table("w", 1000, 16, num_shards=2)
        await c.bag("w", torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1))
        ids, w = torch.randint(0, 1000, (4096, 8)), torch.ones(4096, 8)
        tasks = [asyncio.ensure_future(c.bag("w", ids, w)) for _ in range(20)]
        tasks += [asyncio.ensure_future(c.push_gradients("w", [200], torch.ones(1, 16))) for _ in range(5)]
        await asyncio.sleep(0.02)
        await c.close()
        return await asyncio.gather(*tasks, return_exceptions=True)

    with InProcessServer(2) as server:
        got = asyncio.run(scenario(server.endpoint))
    errors = [r for r in got if isinstance(r, BaseException)]
    assert errors and all(isinstance(e, FailedPreconditionError) for e in errors), {repr(e)[:100] for e in errors}
    said = {str(e) for e in errors}
    assert any("closed while this call was in flight" in t for t in said), said
    assert all("may have been applied" in str(e) for e in got[20:]  # the writes
               if isinstance(e, BaseException) and "in flight" in str(e))


def test_a_client_is_not_pickled_and_says_why():
    """A dataset holding a client, sent to spawned DataLoader workers, is pickled: it failed with
    "cannot pickle '_thread.lock' object" (a walkthrough). Refused naming what to do instead."""
    import copy
    import pickle

    from client import AsyncMemoryClient, MemoryClient

    for cls in (MemoryClient, AsyncMemoryClient):
        c = cls("127.0.0.1:1")
        try:
            for attempt in (pickle.dumps, copy.deepcopy):
                with pytest.raises(TypeError, match=f"a {cls.__name__} holds connections .* make one in each process"):
                    attempt(c)
        finally:
            if cls is MemoryClient:
                c.close()


def test_a_remote_knowledge_source_refuses_a_copy_naming_what_to_save():
    """A hunt: copy.deepcopy or torch.save of a model whose KIF layer searches a cluster's index
    table was refused in the client's words, about DataLoader workers. Named as RemoteValues is."""
    import copy
    import pickle

    from trainer.memory.knowledge import RemoteKnowledge

    source = RemoteKnowledge.__new__(RemoteKnowledge)  # (its __init__ asks a cluster for the table)
    source.name = "kb"
    for attempt in (pickle.dumps, copy.deepcopy):
        with pytest.raises(TypeError, match=r"RemoteKnowledge\('kb'\) holds a connection to the memory cluster and "
                                            r"cannot be pickled or copied: save the model's state_dict\(\)"):
            attempt(source)


def test_an_async_client_used_on_a_second_loop_says_so(client, table_name):
    """An AsyncMemoryClient's channels belong to the loop of its first call: a second asyncio.run
    failed with "Event loop is closed" (a walkthrough). It says what happened, and what to do."""
    import asyncio

    from client import FailedPreconditionError
    from client.aio import AsyncMemoryClient

    client.create_table(table_name, 16, 4)
    mem = AsyncMemoryClient(client.endpoint)

    async def one():
        return await mem.lookup(table_name, [1])

    assert asyncio.run(one()).shape == (1, 4)
    with pytest.raises(FailedPreconditionError, match="first used on another event loop .* one client per loop"):
        asyncio.run(one())


def test_a_client_given_an_endpoint_without_a_port_or_a_wire_dtype_it_cannot_send_says_so():
    """MemoryClient("127.0.0.1") dialled port 443 (gRPC's default) and said only "coordinator
    127.0.0.1"; wire_dtype="int8" listed int32 and float64 as choices, which are then refused."""
    from client import MemoryClient

    for endpoint in ("127.0.0.1", "127.0.0.1:0", "127.0.0.1:port", ":5000"):
        with pytest.raises(InvalidArgumentError, match=f"endpoint: expected the coordinator's HOST:PORT, got '{endpoint}'"):
            MemoryClient(endpoint)
    with pytest.raises(InvalidArgumentError, match=r"wire_dtype: expected one of \['bfloat16', 'float16', 'float32'\]"):
        MemoryClient("127.0.0.1:1", wire_dtype="float64")


def test_index_calls_on_a_value_table_name_its_kind_whatever_their_width(client, table):
    """A search whose queries were not the value table's width said "queries: expected shape
    [B, 8]", as if only the width were wrong."""
    for call, what in ((lambda: client.search(table, np.zeros((1, DIM + 3), np.float32), 1), "search"),
                       (lambda: client.add(table, [1], np.zeros((1, 3), np.float32)), "add"),
                       (lambda: client.remove(table, [1]), "remove")):
        with pytest.raises(InvalidArgumentError, match=f"is a value table, not an index table; {what} is for index"):
            call()


def test_bad_table_name(client):
    with pytest.raises(InvalidArgumentError, match="not a table name"):
        client.create_table("has space", 10, 4)


def test_shard_validates_requests_itself(client, table_name):
    """A client that skips validation still gets INVALID_ARGUMENT from the shard, and nothing applied."""
    meta = client.create_table(table_name, 100, DIM, sharding="rows", optimizer="sgd", lr=1.0)
    before = snapshot(client, table_name)
    sh = meta.shards[0]
    ones = encode(torch.ones(2, DIM))
    bad = [
        (pb.PushGradientsRequest(table=table_name, ids=encode(torch.tensor([0, 1])), grads=ones), "belongs to shard 1"),
        (pb.PushGradientsRequest(table=table_name, ids=encode(torch.tensor([0, 200])), grads=ones), "out of range"),
        (pb.PushGradientsRequest(table=table_name, ids=pb.Tensor(dtype=pb.INT64, shape=[2], data=b"123"), grads=ones),
         "3 bytes do not hold shape"),
        (pb.PushGradientsRequest(table=table_name, ids=encode(torch.tensor([0, 2])), grads=encode(torch.ones(2, DIM + 2))),
         "grads: shape"),
        (pb.PushGradientsRequest(table=table_name, ids=encode(torch.tensor([0, 2]))), "missing or unknown dtype"),
    ]
    with grpc.insecure_channel(sh.address) as ch:
        stub = pb_grpc.DataPlaneStub(ch)
        for req, message in bad:
            with pytest.raises(grpc.RpcError) as err:
                stub.PushGradients(req, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert message in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.Lookup(pb.LookupRequest(table="missing", ids=encode(torch.tensor([0]))), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    after = snapshot(client, table_name)
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1], before[1])


def test_sync_table_takes_one_push_per_trainer_per_step(client, table_name):
    client.create_table(table_name, 100, DIM, optimizer="sgd", lr=1.0, sync_workers=2)
    before = snapshot(client, table_name)
    ids, w, g = np.array([[1, 2]]), np.ones((1, 2), np.float32), np.ones((1, DIM), np.float32)
    client.bag_backward(table_name, ids, w, g, step=1)
    np.testing.assert_array_equal(snapshot(client, table_name)[0], before[0])  # waits for the other trainer
    with pytest.raises(FailedPreconditionError, match="already committed"):  # one request is a whole contribution
        client.bag_backward(table_name, ids, w, g, step=1)
    np.testing.assert_array_equal(snapshot(client, table_name)[0], before[0])


def test_a_sync_tables_contribution_too_large_for_one_request_is_refused_whole(client, table_name, memory_cluster):
    """A non-gather bag_backward on a sync_updates table is the trainer's whole contribution to its
    step: split by max_request_bytes, its first request committed the step with a quarter of it
    and the later ones were refused "already committed" (a hunt). Refused before any is sent,
    saying how to send it; as gather parts it goes whole."""
    from client import MemoryClient

    client.create_table(table_name, 100, DIM, optimizer="sgd", lr=1.0, sync_workers=1)
    before = snapshot(client, table_name)
    ids, w = np.arange(400).reshape(200, 2) % 100, np.ones((200, 2), np.float32)
    g = np.ones((200, DIM), np.float32)
    with MemoryClient(memory_cluster.endpoint, max_request_bytes=1024) as small:
        with pytest.raises(InvalidArgumentError, match=rf"bag_backward: on sync_updates table {table_name} a call is "
                                                       r"this trainer's whole contribution to step 1 and goes in one "
                                                       r"request, and this one needs \d+ of at most max_request_bytes="
                                                       r"1024: send it as gather parts \(gather=True, then "
                                                       r"commit_step\(1\)\)"):
            small.bag_backward(table_name, ids, w, g, step=1)
        np.testing.assert_array_equal(snapshot(client, table_name)[0], before[0])
        opened = [t.open_steps for sh in client.status().shards for t in sh.tables if t.table == table_name]
        assert opened and not any(opened)  # (nothing opened either)
        small.bag_backward(table_name, ids, w, g, step=1, gather=True)
        small.commit_step(table_name, 1)
    client.bag_backward(table_name, ids, w, g, step=2)  # (in one request: as the whole, applied at once: 1 trainer)
    ref = before[0] - 2 * np.bincount(ids.reshape(-1), minlength=100)[:, None]  # sgd, lr 1: each step minus the counts
    np.testing.assert_allclose(snapshot(client, table_name)[0], ref, rtol=1e-6)


def test_sync_workers_needs_sync_updates(client, table_name):
    with pytest.raises(InvalidArgumentError, match="sync_workers"):
        client.create_table(table_name, 10, 4, sync_workers=-1)


def test_interceptor_maps_every_exception_and_counts_every_call(caplog):
    """Handlers only raise: the interceptor start_server installs sends the api's exceptions as
    their status with their text, anything else as INTERNAL (logged with its method and table,
    and counted as an internal error), and has counted the call by the time the caller sees the
    status. An unknown enum value is refused before the handler runs. Health checks pass through
    uncounted."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from memserver.api.errors import TableNotFoundError
    from memserver.loop import LoopThread
    from memserver.server.grpcserver import DATA_PLANE, start_server

    class Failing(pb_grpc.DataPlaneServicer):
        async def Lookup(self, request, context):
            raise InvalidArgumentError("ids: must be 1-D")

        async def SlotStats(self, request, context):
            raise TableNotFoundError(f"table {request.table!r} does not exist")

        async def Bag(self, request, context):
            raise ZeroDivisionError("a bug")

        async def WriteRows(self, request, context):
            return pb.WriteAck(rows=3)

    class Seen:
        calls: list[tuple[str, str, str]] = []

        def observe(self, method, table, code, seconds):
            assert seconds >= 0
            self.calls.append((method, table, code))

        def refused(self, method, code):
            raise AssertionError("no tokens here")

        def internal(self, method):
            self.internals.append(method)

        def attach(self, admission):
            pass

    seen = Seen()
    seen.internals = []
    loop = LoopThread("test-interceptor")
    server, port = loop.call(start_server(lambda s: pb_grpc.add_DataPlaneServicer_to_server(Failing(), s), [DATA_PLANE],
                                          "127.0.0.1", metrics=seen))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.DataPlaneStub(ch)
            cases = [(stub.Lookup, pb.LookupRequest(table="a"), grpc.StatusCode.INVALID_ARGUMENT, "ids: must be 1-D"),
                     (stub.SlotStats, pb.SlotStatsRequest(table="b"), grpc.StatusCode.NOT_FOUND, "table 'b' does not exist"),
                     (stub.Bag, pb.BagRequest(table="c"), grpc.StatusCode.INTERNAL, "ZeroDivisionError: a bug"),
                     (stub.Bag, pb.BagRequest(table="e", wire_dtype=99), grpc.StatusCode.INVALID_ARGUMENT,
                      "wire_dtype: unknown DType value 99; one of DTYPE_UNSPECIFIED, FLOAT32, FLOAT16, BFLOAT16, "
                      "FLOAT64, INT64, INT32")]
            for call, req, code, text in cases:
                with pytest.raises(grpc.RpcError) as err:
                    call(req, timeout=10)
                assert (err.value.code(), err.value.details()) == (code, text)
                assert seen.calls[-1] == (call._method.decode().rsplit("/", 1)[1], req.table, code.name)
            assert seen.internals == ["Bag"]  # the bug, not the refused enum
            assert any(r.levelname == "ERROR" and "Bag failed on table 'c'" in r.getMessage() for r in caplog.records)
            assert stub.WriteRows(pb.WriteRowsRequest(table="d"), timeout=10).rows == 3
            assert seen.calls[-1] == ("WriteRows", "d", "OK")
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert len(seen.calls) == 5
    finally:
        loop.call(server.stop(None))
        loop.stop()


def test_a_drop_of_what_is_no_table_name_is_refused_and_removes_nothing(client, tmp_path):
    """`memserver drop-table ..` (or "", "../victim") answered NOT_FOUND after every shard had
    removed that folder: its data directory's parent, the whole shard directory with its logs,
    or a folder outside it. A name is checked before any shard is asked, by the shard itself and
    by its store: no folder is touched."""
    from memserver.api.types import check_table_name
    from memserver.server.shard_actor import ShardActor

    for name in ("", ".", "..", "../victim", "a/b", "-x"):
        with pytest.raises(InvalidArgumentError, match="is not a table name"):
            client.drop_table(name)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("x")
    shard = ShardActor(0, host="127.0.0.1", data_dir=str(tmp_path / "data"))
    try:
        shard_dir = next((tmp_path / "data").glob("shard-*"))
        (shard_dir / "keep").write_text("x")
        for name in ("..", "../../victim", "."):
            with pytest.raises(InvalidArgumentError, match="is not a table name"):
                shard.drop_table(name)
            with pytest.raises(InvalidArgumentError, match="is not a table name"):
                shard.store.drop(name)
    finally:
        shard.stop()
    assert (victim / "keep").exists() and (shard_dir / "keep").exists()
    assert check_table_name("a.b-c_1") == "a.b-c_1"


def test_the_names_of_the_files_beside_the_tables_folders_are_no_table_names(client):
    """An operator's walkthrough: `create-table lock` (or shard.json) passed the name check and
    failed INTERNAL on a shard ("File exists": its folder would be the shard's lock file)."""
    from memserver.api.types import RESERVED_NAMES

    for name in sorted(RESERVED_NAMES):
        with pytest.raises(InvalidArgumentError, match=f"name: '{name}' is not a table name: it is reserved"):
            client.create_table(name, 10, 2)
    assert not RESERVED_NAMES & {t.name for t in client.list_tables()}


def test_answers_deadlines_and_names_are_bounded_before_any_work(monkeypatch):
    """From a hostile-input audit: Address and SlotStats computed their whole answer before it
    failed the message limit (an Address of a few hundred bytes held the shard's compute thread
    for tens of seconds); a doorbell deadline of NaN or inf answered INTERNAL; a 20,000-character table name
    came back in the error and overflowed gRPC's metadata (RESOURCE_EXHAUSTED, not NOT_FOUND);
    a write a slice refuses after a failed write answered INTERNAL."""
    import memserver.wire as wire
    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer
    from memserver.wire import encode

    with InProcessServer(1) as server, MemoryClient(server.endpoint, timeout=30, retry_seconds=1) as c:
        c.create_table("v", 64, 4)
        c.create_product_keys("pk", "v", heads=2, n_keys=8, knn=4, k_dim=4)
        servicer = server.shards[0].servicer
        monkeypatch.setattr(wire, "MAX_MESSAGE_BYTES", 1000)  # answers above 1,000 bytes: refused
        with pytest.raises(InvalidArgumentError, match="ids: 100 rows of 10 floats make an answer of"):
            servicer._slot_stats(pb.SlotStatsRequest(table="v", ids=encode(np.arange(100) % 64)), None)
        with pytest.raises(InvalidArgumentError, match="queries: 30 rows of 24 floats make an answer of"):
            servicer._address(pb.AddressRequest(table="pk", queries=encode(np.zeros((30, 8), np.float32))), None)
        # a search whose one query's k hits alone are too large: the fix is k, not the batch (it said "split the
        # batch" to a batch of one: a hunt)
        from memserver.wire import check_answer

        with pytest.raises(InvalidArgumentError, match="k: 100 rows of 5 floats .* message limit; a smaller k"):
            check_answer(100, 5, "k", 1)
        with pytest.raises(InvalidArgumentError, match="k: 100 rows of 5 floats .* message limit; split the batch"):
            check_answer(100, 5, "k", 10)
        monkeypatch.undo()
        for deadline in (float("nan"), float("inf")):
            with pytest.raises(InvalidArgumentError, match="deadline: a time on the shard's monotonic clock"):
                servicer.serve_now("Lookup", pb.LookupRequest(table="v", ids=encode(np.arange(2))), deadline)
        assert servicer.serve_now("Lookup", pb.LookupRequest(table="v", ids=encode(np.arange(2))), 1e300)
        long = "x" * 20_000
        with pytest.raises(InvalidArgumentError, match=r"'xxxx.*\.\.\. \(20,000 characters\) is not a table name"):
            c.lookup(long, [0])
        with pytest.raises(InvalidArgumentError, match=r"\(20,000 characters\) is not a table name"):
            servicer.slice(pb.LookupRequest(table=long))
        servicer.tables["v"].write_failure = "a write failed part way (a test)"
        with pytest.raises(FailedPreconditionError, match="a write failed part way"):
            c.write_rows("v", [1], np.ones((1, 4), np.float32))


def test_a_product_key_lookup_over_a_values_table_of_another_shape_names_both_tables(tmp_path):
    """pkm_lookup after its values table was made anew with 10 rows said "ids: id 238 out of range
    for a table of 10 rows", ids the caller never gave, naming neither table (a hunt). The cluster
    now refuses a drop or a create with replace of a values table under its product-key tables;
    a restore with replace may still bring one of another shape, and the lookup says so."""
    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    with InProcessServer(1) as server, MemoryClient(server.endpoint, timeout=30, retry_seconds=1) as c:
        c.create_table("v", 10, 8)
        c.checkpoint(str(tmp_path), 1)  # a 10-row "v" to restore under the product keys below
        c.drop_table("v")
        c.create_table("v", 64, 8)
        c.create_product_keys("pk", "v", heads=2, n_keys=8, knn=4, k_dim=4)
        c.load_product_keys("pk", np.random.default_rng(1).standard_normal((2, 2, 8, 2)).astype(np.float32))
        q = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
        assert c.pkm_lookup("pk", q)[2].shape == (3, 8)
        with pytest.raises(FailedPreconditionError, match="product-key table\\(s\\) pk read their slots' values"):
            c.create_table("v", 10, 8, replace=True)
        c.restore(str(tmp_path), 1, replace=True, tables=["v"])
        with pytest.raises(FailedPreconditionError, match=r"table 'pk' reads its slots from 'v', which must be a value "
                                                          r"table of 64 rows \(pkm_n_keys\^2\); it is one of 10 rows"):
            c.pkm_lookup("pk", q)


def test_trigger_info_stays_bounded_call_after_call(client, table_name):
    """Each RecordTriggers' info was bounded, but new keys call after call merged into a stored
    info (and every Triggers answer) without end; deeply nested JSON answered INTERNAL."""
    import memserver.wire as wire

    client.create_table(table_name, 16, 4)
    rec = (np.array([3]), np.array([0.5], np.float32), np.array([0]), np.array([[7, 11]]), np.array([5]))
    chunk = "x" * (wire.MAX_TRIGGER_INFO // 3)
    for i in range(2):
        client.record_triggers(table_name, *rec, info=json.dumps({f"k{i}": chunk}))
    with pytest.raises(InvalidArgumentError, match=r"info: merged with the .* bytes stored, .* at most 4,194,304"):
        client.record_triggers(table_name, *rec, info=json.dumps({"k2": chunk}))
    assert set(client.triggers(table_name, [3])["info"]) == {"k0", "k1"}
    client.record_triggers(table_name, *rec, info=json.dumps({"k1": "short"}))  # a key reused: it fits again
    with pytest.raises(InvalidArgumentError, match="info: must be a JSON object"):
        client.record_triggers(table_name, *rec, info="[" * 100_000)


def test_a_calls_retries_warn_once_then_on_news_or_every_ten_seconds(caplog, monkeypatch):
    """A cluster that is not there (a wrong endpoint, or down mid-training) made each call log a
    warning per retry: ~29 lines a minute per call. One warning now (saying how long it goes
    on), the other retries at debug, until the error changes or RETRY_WARN_SECONDS pass."""
    import logging
    import re
    import socket

    import client.aio as aio
    from client import MemoryClient, UnavailableError

    with socket.socket() as s:  # a port nothing listens on: each attempt is refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(aio, "RETRY_MAX_DELAY", 0.05)
    caplog.set_level(logging.DEBUG, logger="client.aio")
    with MemoryClient(f"127.0.0.1:{port}", retry_seconds=3, timeout=5) as c:  # (gRPC's reconnect: ~0.75 s a try)
        with pytest.raises(UnavailableError):
            c.list_tables()
        retries = [r for r in caplog.records if "retrying" in r.getMessage()]
        warned = [r for r in retries if r.levelno == logging.WARNING]
        assert len(retries) >= 2 and len(warned) == 1
        assert re.search(r"; retrying \(for up to [0-3]s more\)$", warned[0].getMessage())
        caplog.clear()
        monkeypatch.setattr(aio, "RETRY_WARN_SECONDS", 0.1)
        with pytest.raises(UnavailableError):
            c.list_tables()
        assert sum(r.levelno == logging.WARNING and "retrying" in r.getMessage() for r in caplog.records) >= 2


def test_retries_whose_errors_alternate_warn_once_per_text(caplog, monkeypatch):
    """Two errors taking turns (two shards down, a server flapping) warned on every retry: the
    throttle compared each error with the last one only. The texts kept are bounded."""
    import asyncio
    import logging

    import client.aio as aio
    from client import UnavailableError

    monkeypatch.setattr(aio, "RETRY_MAX_DELAY", 0.01)
    caplog.set_level(logging.DEBUG, logger="client.aio")
    c = aio.AsyncMemoryClient("127.0.0.1:9", retry_seconds=1.0, timeout=1)
    tries = iter(range(10**6))

    async def flapping(texts: int) -> None:
        raise UnavailableError(f"shard {next(tries) % texts} is down")

    for texts in (2, aio.RETRY_TEXTS + 4):
        caplog.clear()
        with pytest.raises(UnavailableError):
            asyncio.run(c._retrying(lambda t=texts: flapping(t)))
        retries = [r for r in caplog.records if "retrying" in r.getMessage()]
        warned = [r.getMessage() for r in retries if r.levelno == logging.WARNING]
        assert len(retries) > 2 * texts, len(retries)
        if texts == 2:
            assert len(warned) == 2 and warned[0] != warned[1]
        else:  # more texts than are kept: each is new again when its turn comes
            assert len(warned) == len(retries)



def test_values_a_half_table_would_store_as_infinite_are_named_by_its_range():
    """check_stored, the client's and the shards' rule: float16 rounds up to 65519.99 to 65504
    (taken) and from 65520 to inf (refused); bfloat16 ends just short of float32's largest;
    float32 takes every finite value."""
    from memserver.wire import check_stored

    check_stored(torch.tensor([65519.0, -65519.0]), "float16", "t", "rows")
    with pytest.raises(InvalidArgumentError, match="rows: 65520 is beyond float16's largest value \\(65504\\)"):
        check_stored(torch.tensor([1.0, -65520.0]), torch.float16, "t", "rows")
    with pytest.raises(InvalidArgumentError, match="beyond bfloat16's largest value \\(3.38953e\\+38\\), which table t"):
        check_stored(torch.tensor([3.4e38]), "bfloat16", "t", "rows")
    check_stored(torch.tensor([3.4e38]), "float32", "t", "rows")


def test_a_quoted_failure_is_cut_at_a_word_and_says_so():
    """A recovery note quoting a long failure was cut at 500 characters mid-word ("...; else
    restore the table from a c. Its files ..."): it ends after a whole word, marked as cut."""
    from memserver.api.errors import first_line

    long = RuntimeError("restore the table from a checkpoint " * 20 + "\nsecond line")
    cut = first_line(long, 60)
    assert cut == "restore the table from a checkpoint restore the table ..." and len(cut) <= 60
    assert first_line(RuntimeError("short\nmore")) == "short" and first_line(RuntimeError()) == "RuntimeError"
    assert first_line(RuntimeError("x" * 80), 20) == "x" * 16 + " ..."  # one word: cut where it must be
    path = first_line(RuntimeError("cannot read " + "/data/x" * 100), 100)  # (a reviewer's: the path went whole)
    assert path.startswith("cannot read /data/x/data/x") and path.endswith(" ...") and len(path) == 100
    assert first_line(RuntimeError("abcdefgh"), 3) == "abc"
    assert first_line(RuntimeError(" " + "y" * 40), 20) == " " + "y" * 15 + " ..."  # (a space at 0 is no word's end)
    ray_said = RuntimeError("The actor died because of an error raised in its creation task, \x1b[36mray::A.__init__()"
                            "\x1b[39m (pid=1)")  # (Ray's text, as `memserver restore` printed it)
    assert first_line(ray_said) == ("The actor died because of an error raised in its creation task, ray::A.__init__() "
                                    "(pid=1)")


def test_a_call_whose_shard_keeps_restarting_stops_retrying(monkeypatch):
    """A request that killed its shard (a faiss abort) was sent again to each restarted process
    for the whole retry window (an index walkthrough: ~10 restarts in 60 s, each rolling back the
    shard's tables without wal). A call that meets the shard it failed on restarted twice stops
    retrying, naming the shard and its pids; one restart (the ordinary case), a restart before the
    call (a stale map), or another shard's restarts are retried through (a review's cases)."""
    import asyncio

    import client.aio as aio
    from client import UnavailableError
    from memserver.api.v1 import memserver_pb2 as pb

    monkeypatch.setattr(aio, "RETRY_MAX_DELAY", 0.01)

    def shard_map(pids: tuple[int, int]) -> pb.TableInfo:
        return pb.TableInfo(spec=pb.TableSpec(name="t", num_rows=4, dim=2, num_shards=2), layout_id=1,
                            shards=[pb.ShardInfo(index=i, address=f"127.0.0.1:{9 + i}", pid=p, col_end=2, num_rows=2)
                                    for i, p in enumerate(pids)])

    def call(pids: list[tuple[int, int]], answers_after: int) -> tuple[object, int]:
        c = aio.AsyncMemoryClient("127.0.0.1:9", retry_seconds=30, timeout=1)
        maps, sent = iter(pids), []

        async def control(method: str, request: object) -> pb.TableInfo:
            return shard_map(next(maps))

        async def fn(meta: object) -> str:  # shard 0 is the one that does not answer
            sent.append(meta.shards[0].pid)
            if len(sent) <= answers_after:
                raise UnavailableError("shard 0 is down", target="shard 127.0.0.1:9")
            return "answered"

        c._control = control
        try:
            return asyncio.run(c._with_table("t", fn)), len(sent)
        except UnavailableError as exc:
            return exc, len(sent)

    assert call([(1, 7), (1, 7), (2, 7), (2, 7)], answers_after=3) == ("answered", 4)  # restarted once
    assert call([(0, 7), (5, 7), (6, 7), (6, 7)], answers_after=3) == ("answered", 4)  # (0: before the call)
    assert call([(1, 7), (1, 7), (1, 8), (1, 9), (1, 9)], answers_after=4) == ("answered", 5)  # shard 1's restarts
    got, sent = call([(1, 7), (1, 7), (2, 7), (3, 7), (4, 7)], answers_after=99)  # twice under the call
    assert isinstance(got, UnavailableError) and sent == 3, (got, sent)
    assert "table t: shard 0 (127.0.0.1:9) restarted 2 times while this call was retried (pid 1 -> 2 -> 3): the call " \
           "may be what stops it, so it is not sent again" in str(got)



def test_a_write_that_fails_for_good_on_one_shard_says_which_shards_applied_it(table_name):
    """Each shard applies its part of a plain write on its own: where one shard fails it for good,
    the others' parts stay applied. An operator's multi-host walkthrough saw a push fail (a lost
    host) after the other shard had applied its half, and a caller resending it as a new call
    applies that half twice: the error now names the shards that applied it (both clients). A
    step's parts (applied only by the commit) and a write no shard answered say nothing of it."""
    import asyncio

    from client import AsyncMemoryClient, MemoryClient, UnavailableError
    from memserver.cluster.inprocess import InProcessServer

    with InProcessServer(2) as srv, MemoryClient(srv.endpoint, shm=False, retry_seconds=0, timeout=5) as c:
        c.create_table(table_name, 10, DIM, sharding="cols", optimizer="sgd", lr=1.0, init_std=0.0)
        shards = c.table(table_name).shards
        half = shards[0].col_end
        srv.shards[1].stop()  # its address refuses connections now

        async def aio_push() -> None:
            async with AsyncMemoryClient(srv.endpoint, shm=False, retry_seconds=0, timeout=5) as ac:
                await ac.push_gradients(table_name, [3], np.ones((1, DIM), np.float32))

        said = (f"; the shard at {shards[0].address} (slice 0) applied this write (answered it), and the others may have too: a "
                "write is applied by each shard on its own, not all-or-none across them (docs/architecture.md, Known "
                "limits); sending it again as a new call applies it twice there")
        for push in (lambda: c.push_gradients(table_name, [1, 2], np.ones((2, DIM), np.float32)),
                     lambda: asyncio.run(aio_push())):
            with pytest.raises(UnavailableError) as got:
                push()
            assert got.value.details.endswith(said) and got.value.target == f"shard {shards[1].address}"
        held = srv.shards[0].servicer.tables[table_name].table.lookup(torch.arange(4), count=False)
        assert held.shape == (4, half) and (held[1:] == -1).all() and (held[0] == 0).all()  # as said: applied there
        with pytest.raises(UnavailableError) as got:  # a write that sets values: sending it again completes it
            c.write_rows(table_name, [5], np.ones((1, DIM), np.float32))
        assert got.value.details.endswith("Known limits); sending the same write again once every shard serves "
                                          "completes it (it sets the same values again)")
        with pytest.raises(UnavailableError) as got:  # a step's part: the commit applies it, all or none
            c.bag_backward(table_name, IDS % 10, W, G, step=1, gather=True)
        assert "applied this write" not in str(got.value)
        srv.shards[0].stop()
        with pytest.raises(UnavailableError) as got:  # no shard answered
            c.write_rows(table_name, [1], np.ones((1, DIM), np.float32))
        assert "applied this write" not in str(got.value)


def test_a_call_whose_first_attempt_waited_out_its_deadline_is_still_retried(table_name):
    """The retries' window counts from a call's first failure: memtrain's 60 s deadline and 60 s of
    retries, counted from the first attempt, left no retry after a first attempt that waited out
    its deadline on a host gone without a word (a power cut: a walkthrough's trainers stopped at
    +61 s though the shard served on a spare 10 s after the cut). Both clients; a call fails within
    retry_seconds + 2 x timeout."""
    import asyncio
    import socket
    import time

    from client import AsyncMemoryClient, DeadlineExceededError, MemoryClient, UnavailableError
    from memserver.cluster.inprocess import InProcessServer

    with InProcessServer(1) as srv, MemoryClient(srv.endpoint, shm=False, timeout=2, retry_seconds=2) as c:
        c.create_table(table_name, 10, DIM)
        c.lookup(table_name, [1])  # the shard map is cached: the next call's first attempt goes at once

        async def aio_lookup() -> None:
            async with AsyncMemoryClient(srv.endpoint, shm=False, timeout=2, retry_seconds=2) as ac:
                await ac.table(table_name)  # (its map, before the shard goes silent)
                await ac.lookup(table_name, [1])

        host, port = srv.shards[0].address.rsplit(":", 1)
        srv.shards[0].stop()
        for call in (lambda: c.lookup(table_name, [1]), lambda: asyncio.run(aio_lookup())):
            with socket.create_server((host, int(port))):  # takes connections, says nothing
                t0 = time.monotonic()
                with pytest.raises((DeadlineExceededError, UnavailableError)):  # (a connect without an answer: either)
                    call()
                took = time.monotonic() - t0
            # a second attempt after the first (one alone: ~2 s); none past 2 + 2 + 2. (3.9 failed once at 3.87 s in a
            # fresh-clone run: an attempt can end a little before its 2 s when the connection fails first)
            assert 3.5 < took < 6.0, took
        c.aio.retry_seconds = 0  # no retries: the blocking client's own first attempt is the only one (a review)
        retried = []
        c.aio._with_table = lambda *args: retried.append(args)  # (the retrying path: not entered)
        with socket.create_server((host, int(port))):
            with pytest.raises((DeadlineExceededError, UnavailableError)):  # (a connect without an answer: either)
                c.lookup(table_name, [1])
        assert retried == []



def test_a_shard_that_answered_some_of_a_writes_requests_applied_part_of_it():
    """A write cut into parts (max_request_bytes) whose shard failed one of its parts was said to
    have been applied there whole (a review). Only a shard that answered every request of an
    attempt applied the write; one that answered some applied part of it; a table made anew
    since forgets both; a table gone says neither."""
    from client import TableNotFoundError, UnavailableError
    from client.aio import AppliedBy
    from memserver.api.types import ShardMeta, TableMeta

    def meta(layout: int) -> TableMeta:
        shards = tuple(ShardMeta(index=i, address=f"h{i}:1", col_start=0, col_end=2, num_rows=4, node_id="", pid=1)
                       for i in range(3))
        return TableMeta("t", 4, 2, "cols", "sgd", 1.0, "float32", 0.0, 0, shards, 1, layout_id=layout)

    calls = [("h0:1", "PushGradients", None), ("h0:1", "PushGradients", None), ("h1:1", "PushGradients", None),
             ("h1:1", "PushGradients", None), ("h2:1", "PushGradients", None)]
    failed = UnavailableError("down", target="shard h1:1")
    applied = AppliedBy(AppliedBy.TWICE)
    applied.begin(meta(1))
    applied.note(meta(1), calls, ["ok", "ok", "ok", failed, failed])
    exc = UnavailableError("down", target="shard h1:1")
    applied.say(exc)
    assert exc.details == ("down; the shard at h0:1 (slice 0) applied this write (answered it) and the shard at h1:1 (slice 1) applied part of "
                           "it (answered some of its requests), and the others may have too: a write is applied by "
                           "each shard on its own, not all-or-none across them (docs/architecture.md, Known limits); "
                           "sending it again as a new call applies it twice there")
    gone = TableNotFoundError("no table t")
    applied.say(gone)
    assert gone.details == "no table t"
    applied.begin(meta(2))  # made anew: the old incarnation's answers are not this one's
    quiet = UnavailableError("down")
    applied.say(quiet)
    assert quiet.details == "down"


def test_a_shard_found_at_a_new_address_moves_for_every_tables_map(monkeypatch):
    """After a shard moved (Ray restarted it on a spare host), each table's first call went to the
    old address and waited out its deadline (twice) before its map was asked again: a client of 6
    tables paid ~37 s after the shard served (a walkthrough). One table's fresh map now sends the
    others that named the old address to the coordinator at their next call; the rest stay."""
    import asyncio

    import client.aio as aio
    from client import UnavailableError
    from memserver.api.types import TableMeta
    from memserver.api.v1 import memserver_pb2 as pb

    monkeypatch.setattr(aio, "RETRY_MAX_DELAY", 0.01)

    def info(name: str, addresses: tuple[str, ...]) -> pb.TableInfo:
        return pb.TableInfo(spec=pb.TableSpec(name=name, num_rows=4, dim=2, num_shards=len(addresses)), layout_id=1,
                            shards=[pb.ShardInfo(index=i, address=a, pid=1, col_end=2, num_rows=4)
                                    for i, a in enumerate(addresses)])

    c = aio.AsyncMemoryClient("127.0.0.1:9", retry_seconds=30, timeout=1)
    for name, addresses in (("t", ("h1:1", "h2:1")), ("u", ("h1:1", "h2:1")), ("w", ("h2:1",))):
        c._tables[name] = TableMeta.from_proto(info(name, addresses))

    async def control(method: str, request: object) -> pb.TableInfo:
        return info(request.name, ("h3:1", "h2:1"))  # shard 0 moved from h1 to h3

    tried: list[str] = []

    async def fn(meta: TableMeta) -> str:
        tried.append(meta.shards[0].address)
        if meta.shards[0].address == "h1:1":
            raise UnavailableError("down", target="shard h1:1")
        return "answered"

    c._control = control
    assert asyncio.run(c._with_table("t", fn)) == "answered" and tried == ["h1:1", "h3:1"]
    assert set(c._tables) == {"t", "w"}  # u named h1: asked anew at its next call; w did not


def test_a_call_retried_after_a_first_attempt_made_elsewhere_asks_for_a_fresh_map_first():
    """MemoryClient's first attempt waited out its deadline at a shard's old address (a power cut);
    the retries then began with the same cached map and waited out another deadline there before
    asking where the shard went: a walkthrough's trainer stopped at +130 s though the shard served
    on a spare at +10 s. A retry path entered after a failure asks for the map first."""
    import asyncio
    import time

    import client.aio as aio

    c = aio.AsyncMemoryClient("127.0.0.1:9", retry_seconds=30, timeout=1)
    order: list[str] = []

    async def refresh() -> None:
        order.append("map")

    async def call() -> str:
        order.append("call")
        return "answered"

    assert asyncio.run(c._retrying(call, refresh, failed=time.monotonic(), fresh_map=True)) == "answered"
    assert order == ["map", "call"]
    order.clear()
    assert asyncio.run(c._retrying(call, refresh)) == "answered" and order == ["call"]  # a first attempt: none
    order.clear()  # after an overloaded server's refusal: the same map (the server is there, only busy; a review)
    assert asyncio.run(c._retrying(call, refresh, failed=time.monotonic())) == "answered" and order == ["call"]


def test_a_cached_shard_map_is_read_without_a_hop_to_the_clients_loop(table_name):
    """A trainer reads its table's map at each step's end (RemoteValues._check_rebuilt): through
    the client's event loop that was ~60 us a read; a cached map is read in place now."""
    from client import FailedPreconditionError, MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    with InProcessServer(1) as srv, MemoryClient(srv.endpoint, shm=False) as c:
        meta = c.create_table(table_name, 16, 4)
        assert c.table(table_name).layout_id == meta.layout_id  # (cached by the first read)
        real, c._run = c._run, None  # a hop to the loop would fail now
        assert c.table(table_name) is c.aio._tables[table_name]
        c._run = real
        assert c.table(table_name, refresh=True).layout_id == meta.layout_id  # refresh: asks the coordinator
    with pytest.raises(FailedPreconditionError, match="closed"):
        c.table(table_name)


def test_a_long_string_in_a_request_is_cut_in_its_error(tmp_path):
    """A hunt: a 20,000-character field was echoed whole in its error, past gRPC's 16 KiB limit on
    a status's header, and the caller got RESOURCE_EXHAUSTED "received metadata size exceeds hard
    limit" (said as overload) instead of its error. Each is its own status, cut, and a status's
    text is bounded on every path (grpcserver.bounded_text)."""
    from memserver.cluster.inprocess import InProcessServer

    long = "x" * 20_000
    ck = str(tmp_path / "ck")
    with InProcessServer(1) as srv, grpc.insecure_channel(srv.endpoint) as ch:
        cp = pb_grpc.ControlPlaneStub(ch)
        cp.CreateTable(pb.CreateTableRequest(spec=pb.TableSpec(name="v", num_rows=64, dim=4)), timeout=30)
        cp.Checkpoint(pb.CheckpointRequest(dir=ck, step=1), timeout=60)
        spec = dict(name="t", num_rows=4, dim=4)
        for call, request, code, said in [
            (cp.Checkpoint, pb.CheckpointRequest(dir=long, step=2), "INVALID_ARGUMENT", "dir: 'xxx"),
            (cp.Restore, pb.RestoreRequest(dir=long, replace=True), "INVALID_ARGUMENT", "dir: 'xxx"),
            (cp.Checkpoint, pb.CheckpointRequest(dir=ck, step=3, request_id=long), "INVALID_ARGUMENT", "request_id: 'xxx"),
            (cp.CreateTable, pb.CreateTableRequest(spec=pb.TableSpec(**spec, optimizer=pb.OptimizerSpec(name=long))),
             "INVALID_ARGUMENT", "unknown optimizer 'xxx"),
            (cp.CreateTable, pb.CreateTableRequest(spec=pb.TableSpec(**spec, tier=long)), "INVALID_ARGUMENT", "tier: "),
            (cp.CreateTable, pb.CreateTableRequest(spec=pb.TableSpec(
                name="p", kind=pb.PRODUCT_KEYS, pkm_heads=1, pkm_n_keys=4, pkm_knn=2, pkm_k_dim=4, values_table=long)),
             "INVALID_ARGUMENT", "values_table: 'xxx"),
            (cp.CreateTable, pb.CreateTableRequest(spec=pb.TableSpec(name="i", kind=pb.INDEX, dim=4, index_factory=long)),
             "INVALID_ARGUMENT", "index_factory: 'xxx"),
            (cp.Restore, pb.RestoreRequest(dir=ck, replace=True, tier=long), "INVALID_ARGUMENT", "tier: "),
            (cp.Restore, pb.RestoreRequest(dir=ck, replace=True, tables=[f"t{i:03d}" + "y" * 120 for i in range(200)]),
             "NOT_FOUND", "and 195 more (the latest, step-0000000001, holds v)"),
        ]:
            with pytest.raises(grpc.RpcError) as err:
                call(request, timeout=60)
            assert (err.value.code().name, said in err.value.details()) == (code, True), err.value.details()[:300]
            assert len(err.value.details()) < 1000
        assert [t.spec.name for t in cp.ListTables(pb.ListTablesRequest(), timeout=30).tables] == ["v"]
    from memserver.server.grpcserver import MAX_STATUS_TEXT, bounded_text

    text = bounded_text("é" * 10_000)  # (bytes, not characters: the header carries them percent-encoded)
    assert len(text.encode()) <= MAX_STATUS_TEXT and text.endswith("... (cut: 20,000 bytes)")
    assert bounded_text("short") == "short"


def test_an_untagged_commit_of_a_step_is_refused_and_changes_nothing():
    """A hunt: a CommitStep without a write tag counted as a trainer "anonymous": a sync table of
    two trainers applied step 5 with trainer A's part and that commit (A's gradient halved), and
    trainer B's acknowledged part then waited for ever, and every later step with it."""
    from memserver.cluster.inprocess import InProcessServer
    from memserver.wire import decode

    spec = pb.TableSpec(name="s", num_rows=8, dim=2, sharding=pb.ROWS, optimizer=pb.OptimizerSpec(name="sgd", lr=1.0),
                        sync_updates=True, sync_workers=2)
    with InProcessServer(1) as srv, grpc.insecure_channel(srv.endpoint) as ch:
        info = pb_grpc.ControlPlaneStub(ch).CreateTable(pb.CreateTableRequest(spec=spec), timeout=30)
        with grpc.insecure_channel(info.shards[0].address) as sch:
            st = pb_grpc.DataPlaneStub(sch)

            def row1() -> np.ndarray:
                got = st.Lookup(pb.LookupRequest(table="s", ids=encode(np.array([1])), uncounted=True), timeout=30)
                return decode(got.rows, "rows").numpy()[0].copy()

            def part(client: str) -> pb.BagBackwardRequest:
                return pb.BagBackwardRequest(table="s", ids=encode(np.array([[1]])), weights=encode(np.ones((1, 1),
                                             np.float32)), grad_out=encode(np.ones((1, 2), np.float32)), step=5,
                                             tag=pb.WriteTag(client_id=client, seq=1))

            before = row1()
            st.BagBackward(part("A"), timeout=30)
            for tag in (pb.WriteTag(), pb.WriteTag(client_id="C"), pb.WriteTag(seq=3)):
                with pytest.raises(grpc.RpcError) as err:
                    st.CommitStep(pb.CommitStepRequest(table="s", step=5, phase=pb.STEP_PREPARE_COMMIT, tag=tag), timeout=30)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "tag: a CommitStep closes a trainer's step and needs its write tag" in err.value.details()
            np.testing.assert_array_equal(row1(), before)  # nothing applied
            st.BagBackward(part("B"), timeout=30)  # the second trainer: the step is both parts, applied once
            np.testing.assert_array_equal(row1(), before - 1.0)
