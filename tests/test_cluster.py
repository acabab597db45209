"""End to end against a real local Ray cluster with 2 shards, in both sharding modes."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
import torch

from memserver.api.v1 import memserver_pb2 as pb
from memserver.api.v1 import memserver_pb2_grpc as pb_grpc
from memserver.wire import decode, encode
from tests.conftest import TIMINGS
from tests.reference import RefTable, bag, initial

ROWS, DIM = 1000, 16


@pytest.mark.parametrize("sharding", ["rows", "cols"])
def test_lookup_and_bag_equal_numpy(client, table_name, sharding):
    meta = client.create_table(table_name, ROWS, DIM, sharding=sharding, init_std=0.5, seed=11)
    assert meta.sharding == sharding and len(meta.shards) == 2
    values = initial(meta)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, ROWS, (64, 8))
    ids[0, :3] = [5, 5, 999]  # duplicates and the last row
    np.testing.assert_allclose(client.lookup(table_name, ids), values[ids], rtol=1e-6)
    w = rng.random((64, 8)).astype(np.float32)
    np.testing.assert_allclose(client.bag(table_name, ids, w), bag(values, ids, w), rtol=1e-5, atol=1e-6)
    # ragged bags through offsets, including an empty one
    flat = np.array([3, 4, 5, 998, 7], dtype=np.int64)
    fw = np.array([1.0, 0.5, 0.25, 2.0, 1.0], dtype=np.float32)
    out = client.bag(table_name, flat, fw, offsets=np.array([0, 3, 3, 4]))
    np.testing.assert_allclose(out[0], values[3] + 0.5 * values[4] + 0.25 * values[5], rtol=1e-5)
    np.testing.assert_allclose(out[1], 0)
    np.testing.assert_allclose(out[2], 2 * values[998], rtol=1e-5)
    np.testing.assert_allclose(out[3], values[7], rtol=1e-5)


@pytest.mark.parametrize("sharding", ["rows", "cols"])
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_bag_backward_equals_reference_optimizer(client, table_name, sharding, optimizer):
    meta = client.create_table(table_name, 64, DIM, sharding=sharding, optimizer=optimizer, lr=0.05, init_std=0.3, seed=2)
    blocks = [(sh.col_start, sh.col_end) for sh in meta.shards] if sharding == "cols" else None
    ref = RefTable(initial(meta), optimizer, 0.05, col_blocks=blocks)
    rng = np.random.default_rng(3)
    for _ in range(3):
        ids = rng.integers(0, 20, (16, 6))  # 20 hot rows out of 64: duplicates in and across bags
        w = rng.random((16, 6)).astype(np.float32)
        g = rng.normal(size=(16, DIM)).astype(np.float32)
        got = client.bag_backward(table_name, ids, w, g)
        np.testing.assert_allclose(got, ref.bag_backward(ids, w, g), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(client.lookup(table_name, np.arange(64)), ref.w, rtol=1e-4, atol=1e-5)
    stats = client.slot_stats(table_name, np.arange(64))
    np.testing.assert_array_equal(stats["updates"], ref.steps)


@pytest.mark.parametrize("sharding", ["rows", "cols"])
def test_push_gradients_and_write_rows(client, table_name, sharding):
    meta = client.create_table(table_name, 100, DIM, sharding=sharding, optimizer="adagrad", lr=0.1, seed=4)
    blocks = [(sh.col_start, sh.col_end) for sh in meta.shards] if sharding == "cols" else None
    ref = RefTable(initial(meta), "adagrad", 0.1, col_blocks=blocks)
    ids = np.array([1, 2, 2, 51, 99, 1])
    grads = np.random.default_rng(5).normal(size=(6, DIM)).astype(np.float32)
    assert client.push_gradients(table_name, ids, grads) == 4
    ref.push(ids, grads)
    np.testing.assert_allclose(client.lookup(table_name, np.arange(100)), ref.w, rtol=1e-5, atol=1e-6)
    rows = np.arange(3 * DIM, dtype=np.float32).reshape(3, DIM)
    assert client.write_rows(table_name, [7, 8, 50], rows) == 3
    np.testing.assert_array_equal(client.lookup(table_name, [50, 7, 8]), rows[[2, 0, 1]])


def test_torch_in_torch_out_and_bf16_wire(client, table_name, memory_cluster):
    from client import MemoryClient

    client.create_table(table_name, 200, 32, init_std=1.0)
    ids = torch.randint(0, 200, (8, 4))
    w = torch.rand(8, 4)
    exact = client.bag(table_name, ids, w)
    assert isinstance(exact, torch.Tensor) and exact.dtype == torch.float32 and exact.shape == (8, 32)
    with MemoryClient(memory_cluster.endpoint, wire_dtype="bfloat16") as c16:
        approx = c16.bag(table_name, ids, w)
    torch.testing.assert_close(approx, exact, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("sharding", ["rows", "cols"])
def test_a_float16_wire_answers_a_read_past_float16s_range_in_float32(client, table_name, memory_cluster, sharding):
    """A shard cast a lookup's or bag's answer to the request's float16 wire unchecked: a row of
    1e5 (finite in the float32 table) came back inf, and on a rows table the partial sums of
    2 * row 0 - 2 * row 1 (rows of 40000: 80000 on one shard, -80000 on the other) travelled as
    +inf and -inf, which the client added into NaN where the answer is 0. A shard whose answer
    does not fit float16 sends it in float32 (the answer says its dtype): the same answers as a
    float32 wire, whatever the sharding; an answer that fits still travels in float16."""
    from client import MemoryClient
    from memserver.wire import answer_dtype

    client.create_table(table_name, 4, 2, sharding=sharding, num_shards=2, init_std=0.0)
    client.write_rows(table_name, [0, 1, 2, 3], np.array([[1e5, 1.0], [40000.0, 2.0], [40000.0, 1.0], [0.5, 0.25]],
                                                         np.float32))
    w = np.array([[2.0, -2.0], [1.0, 1.0]], np.float32)
    with MemoryClient(memory_cluster.endpoint, wire_dtype="float16") as c16:
        np.testing.assert_array_equal(c16.lookup(table_name, [0, 1, 3]), client.lookup(table_name, [0, 1, 3]))
        np.testing.assert_array_equal(c16.bag(table_name, [[1, 2], [0, 3]], w), client.bag(table_name, [[1, 2], [0, 3]], w))
        np.testing.assert_array_equal(c16.bag(table_name, [[1, 2]], w[:1]), [[0.0, 2.0]])
    # the rule: the cast's rounding (65519 rounds to 65504), bfloat16's range alike; float32 as asked
    assert [answer_dtype(torch.tensor([0.5, -65519.0]), pb.FLOAT16), answer_dtype(torch.tensor([65520.0]), pb.FLOAT16),
            answer_dtype(torch.tensor([3.4e38]), pb.BFLOAT16), answer_dtype(torch.tensor([3.4e38]), pb.FLOAT32),
            answer_dtype(torch.tensor([float("inf")]), pb.FLOAT16)] == [pb.FLOAT16, pb.FLOAT32, pb.FLOAT32, pb.FLOAT32,
                                                                       pb.FLOAT16]
    # a value the table holds inf (or NaN) beside one past float16's range: judged by the finite ones
    # (a review: one inf kept the whole answer on float16, its 1e5 came back inf)
    assert [answer_dtype(torch.tensor([float("inf"), 1e5]), pb.FLOAT16),
            answer_dtype(torch.tensor([float("nan"), 1e5]), pb.FLOAT16),
            answer_dtype(torch.tensor([float("nan"), 1.0]), pb.FLOAT16)] == [pb.FLOAT32, pb.FLOAT32, pb.FLOAT16]


@pytest.mark.parametrize("sharding", ["rows", "cols"])
def test_replayed_push_is_applied_once(client, table_name, sharding):
    meta = client.create_table(table_name, 50, DIM, sharding=sharding, optimizer="sgd", lr=1.0, init_std=0.0)
    before = client.lookup(table_name, np.arange(50))
    ids = np.array([[0, 1], [1, 3]])
    w = np.ones((2, 2), np.float32)
    g = np.ones((2, DIM), np.float32)
    tag = pb.WriteTag(client_id="test-replay", seq=42)
    answers = []
    for sh in meta.shards:  # send exactly what the client would, twice, straight to each shard
        with grpc.insecure_channel(sh.address) as ch:
            stub = pb_grpc.DataPlaneStub(ch)
            if sharding == "rows":
                mask = ids.reshape(-1) % 2 == sh.index
                owned = ids.reshape(-1)[mask]
                counts = np.bincount(np.repeat(np.arange(2), 2)[mask], minlength=2)
                req = pb.BagBackwardRequest(table=table_name, ids=encode(torch.from_numpy(owned)),
                                            weights=encode(torch.ones(len(owned))),
                                            offsets=encode(torch.from_numpy(np.cumsum(counts) - counts)),
                                            grad_out=encode(torch.from_numpy(g)), tag=tag)
            else:
                req = pb.BagBackwardRequest(table=table_name, ids=encode(torch.from_numpy(ids)), weights=encode(torch.from_numpy(w)),
                                            grad_out=encode(torch.from_numpy(g[:, sh.col_start:sh.col_end].copy())), tag=tag)
            first, second = stub.BagBackward(req), stub.BagBackward(req)
            assert not first.duplicate and second.duplicate
            assert decode(first.grad_weights, "").tolist() == decode(second.grad_weights, "").tolist()
            answers.append(first)
    after = client.lookup(table_name, np.arange(50))
    expect = before.copy()
    expect[0] -= 1.0
    expect[1] -= 2.0  # row 1 appears in both bags: one update with the summed gradient
    expect[3] -= 1.0
    np.testing.assert_allclose(after, expect)
    assert client.slot_stats(table_name, [0, 1, 3])["updates"].tolist() == [1, 1, 1]
    stats = client.slot_stats(table_name, np.array([[0, 1], [3, 0]]))  # the ids' shape, as lookup keeps it
    assert {k: v.shape for k, v in stats.items()} == dict.fromkeys(stats, (2, 2)) and len(stats) == 5
    assert stats["updates"].tolist() == [[1, 1], [1, 1]]


@pytest.mark.parametrize("sharding", ["rows", "cols"])
def test_client_writes_survive_a_replayed_request(client, table_name, sharding):
    """Every shard request of one client write carries one (client_id, seq); a request replayed
    after a lost answer (what a retry does) is applied once."""
    client.create_table(table_name, 10, 4, sharding=sharding, optimizer="sgd", lr=1.0, init_std=0.0)
    real = client.aio._data

    async def twice(address, method, request, server=None):
        await real(address, method, request, server)
        return await real(address, method, request, server)

    client.aio._data = twice
    try:
        client.push_gradients(table_name, [1, 2], np.ones((2, 4), np.float32))
        gw = client.bag_backward(table_name, [[1, 3]], np.ones((1, 2), np.float32), np.ones((1, 4), np.float32))
    finally:
        client.aio._data = real
    np.testing.assert_allclose(gw, [[-4.0, 0.0]])  # <g, v[1]> = 4 * -1, v[3] = 0, before the update
    np.testing.assert_allclose(client.lookup(table_name, [1, 2, 3]), [[-2.0] * 4, [-1.0] * 4, [-1.0] * 4])
    assert client.slot_stats(table_name, [1, 2, 3])["updates"].tolist() == [2, 1, 1]


def test_slot_stats_count_reads_and_mass(client, table_name):
    client.create_table(table_name, 30, 8, sharding="cols", init_std=1.0)
    client.bag(table_name, [[1, 2], [2, 3]], np.array([[0.5, 0.25], [1.0, -2.0]], np.float32))
    client.lookup(table_name, [1])
    s = client.slot_stats(table_name, [1, 2, 3, 4])
    assert s["hits"].tolist() == [2, 2, 1, 0]
    np.testing.assert_allclose(s["weight_mass"], [0.5, 1.25, 2.0, 0.0])
    np.testing.assert_allclose(s["value_norm"], np.linalg.norm(client.lookup(table_name, [1, 2, 3, 4]), axis=1), rtol=1e-5)
    assert s["updates"].tolist() == [0, 0, 0, 0] and s["last_update"].tolist() == [0, 0, 0, 0]


def test_large_batches_are_split(client, table_name, memory_cluster):
    from client import MemoryClient

    client.create_table(table_name, 500, 64, sharding="rows", init_std=1.0)
    ids = np.random.default_rng(0).integers(0, 500, (300, 8))
    w = np.ones((300, 8), np.float32)
    whole = client.bag(table_name, ids, w)
    with MemoryClient(memory_cluster.endpoint, max_request_bytes=4096) as small:
        np.testing.assert_allclose(small.bag(table_name, ids, w), whole, rtol=1e-5)
        np.testing.assert_allclose(small.lookup(table_name, ids), client.lookup(table_name, ids))


def test_control_plane_lists_and_drops(client, table_name):
    client.create_table(table_name, 10, 4)
    assert table_name in {t.name for t in client.list_tables()}
    st = client.status()
    assert len(st.shards) == 2 and all(s.pid > 0 and s.address.startswith("127.0.0.1:") for s in st.shards)
    client.drop_table(table_name)
    assert table_name not in {t.name for t in client.list_tables()}


def test_health_service_on_every_server(client, memory_cluster):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    for address in [memory_cluster.endpoint, *(i["address"] for i in memory_cluster.shard_infos)]:
        with grpc.insecure_channel(address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("sharding", ["rows", "cols"])
def test_quick_timing(client, table_name, sharding):
    """A mid-sized bag and bag_backward give the right numbers; their times are printed at the
    end of the run so a regression shows (not asserted: benchmarks/ measures)."""
    meta = client.create_table(table_name, 65536, 128, sharding=sharding, optimizer="adagrad")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 65536, (1024, 32))
    w = rng.random((1024, 32)).astype(np.float32)
    g = rng.normal(size=(1024, 128)).astype(np.float32)
    np.testing.assert_allclose(client.bag(table_name, ids, w), bag(initial(meta), ids, w), rtol=1e-4, atol=1e-5)
    t0 = time.perf_counter()
    for _ in range(5):
        client.bag(table_name, ids, w)
    t1 = time.perf_counter()
    for _ in range(5):
        client.bag_backward(table_name, ids, w, g)
    t2 = time.perf_counter()
    stats = client.slot_stats(table_name, np.unique(ids))
    assert (stats["updates"] == 5).all() and (stats["hits"] == 6 * np.unique(ids, return_counts=True)[1]).all()
    TIMINGS.append(f"{sharding:4s} 65536x128, B=1024 k=32: bag {1e3 * (t1 - t0) / 5:.1f} ms, bag_backward {1e3 * (t2 - t1) / 5:.1f} ms")


@pytest.mark.parametrize("sharding", ["rows", "cols"])
def test_deferred_apply_is_seen_by_the_next_read(client, table_name, sharding):
    """defer_apply answers first (the shards count the updates they ran after answering), but no
    later request can observe the table without the update."""
    meta = client.create_table(table_name, 64, DIM, sharding=sharding, optimizer="adam", lr=0.05, init_std=0.3, seed=8)
    ref = RefTable(initial(meta), "adam", 0.05)
    rng = np.random.default_rng(9)
    for _ in range(3):
        ids = rng.integers(0, 30, (8, 5))
        w = rng.random((8, 5)).astype(np.float32)
        g = rng.normal(size=(8, DIM)).astype(np.float32)
        deferred = [sh.deferred_updates for sh in client.status().shards]
        got = client.bag_backward(table_name, ids, w, g, defer_apply=True)
        np.testing.assert_allclose(got, ref.bag_backward(ids, w, g), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(client.lookup(table_name, np.arange(64)), ref.w, rtol=1e-4, atol=1e-5)
        assert [sh.deferred_updates for sh in client.status().shards] == [d + 1 for d in deferred]


def test_shards_export_prometheus_metrics(client, table_name):
    """Each shard serves /metrics: requests by method, table and status code, latency, table size."""
    import urllib.request

    import grpc
    import numpy as np

    from memserver.api.v1 import memserver_pb2 as pb
    from memserver.api.v1 import memserver_pb2_grpc as pb_grpc
    from memserver.wire import encode

    client.create_table(table_name, 1000, 8, sharding="cols", wal=True)
    ids, w = np.arange(12).reshape(3, 4), np.ones((3, 4), np.float32)
    for _ in range(5):
        client.bag(table_name, ids, w)
    client.push_gradients(table_name, np.arange(3), np.ones((3, 8), np.float32))
    status = client.status()
    with grpc.insecure_channel(status.shards[0].address) as ch:  # a table no shard has: NOT_FOUND
        with pytest.raises(grpc.RpcError):
            pb_grpc.DataPlaneStub(ch).Bag(pb.BagRequest(table="no-such-table", ids=encode(np.zeros((1, 1), np.int64)),
                                                        weights=encode(np.ones((1, 1), np.float32))))
    for i, shard in enumerate(status.shards):
        assert shard.metrics_address.startswith("127.0.0.1:")
        text = urllib.request.urlopen(f"http://{shard.metrics_address}/metrics", timeout=10).read().decode()
        assert f'memserver_requests_total{{code="OK",method="Bag",table="{table_name}"}} 5.0' in text
        assert f'memserver_table_rows{{table="{table_name}"}} 1000.0' in text
        assert f'memserver_wal_records_total{{table="{table_name}"}} 1.0' in text
        assert 'memserver_request_seconds_count{method="Bag"}' in text
        if i == 0:  # counted, under one label for every name the shard does not hold (labels stay bounded)
            assert 'memserver_requests_total{code="NOT_FOUND",method="Bag",table="(unknown)"}' in text
            assert "no-such-table" not in text
    client.drop_table(table_name)


def test_close_never_hangs_its_caller(memory_cluster, monkeypatch, caplog):
    """MemoryClient.close bounds the asyncio side's close (CLOSE_SECONDS): a close that never
    completes (once seen: a test hung 300 s in it) is logged and left to the process's exit."""
    import asyncio
    import time

    import client.sync
    from client import MemoryClient

    c = MemoryClient(memory_cluster.endpoint, timeout=30)
    c.list_tables()

    async def never() -> None:
        await asyncio.sleep(3600)

    monkeypatch.setattr(c.aio, "close", never)
    monkeypatch.setattr(client.sync, "CLOSE_SECONDS", 0.5)
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="memserver.client"):
        c.close()
    assert time.monotonic() - t0 < 10
    assert "did not finish closing within" in caplog.text


def test_close_from_a_submitted_calls_callback_is_refused_not_a_wait_on_itself(memory_cluster):
    """A done-callback runs on the client's loop thread: close() there waited on that thread
    (its submitted calls, then the loop's own close) until its timeouts ran out."""
    import threading

    from client import MemoryClient

    c = MemoryClient(memory_cluster.endpoint, timeout=30)
    said: list[BaseException] = []
    done = threading.Event()

    def close_here(_fut) -> None:
        try:
            c.close()
        except RuntimeError as exc:
            said.append(exc)
        done.set()

    try:
        c.list_tables()
        c._loop.loop.call_soon_threadsafe(close_here, None)  # where a submit_* future's done-callback runs
        assert done.wait(30)
        assert said and "event-loop thread" in str(said[0])
    finally:
        c.close()  # from this thread: closes
    assert c._closed


def test_an_interrupted_close_is_finished_by_the_next(memory_cluster, monkeypatch):
    """Ctrl-C while close() waits for submitted calls: calls are refused from then on, and the
    next close() closes (it returned at once, leaving the channels and the loop thread open)."""
    import concurrent.futures

    from client import FailedPreconditionError, MemoryClient

    c = MemoryClient(memory_cluster.endpoint, timeout=30)
    c.list_tables()
    stuck: concurrent.futures.Future = concurrent.futures.Future()
    c._pending.add(stuck)  # a submitted call still in flight

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(concurrent.futures, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        c.close()
    with pytest.raises(FailedPreconditionError):
        c.list_tables()
    assert c._loop.thread.is_alive()
    monkeypatch.undo()
    stuck.set_result(None)
    c.close()
    assert not c._loop.thread.is_alive()


def test_the_demo_drops_only_its_own_tables(client, table_name, memory_cluster):
    """`python -m memserver.demo` runs against whatever cluster it is given: the user's tables
    stay (it dropped every table of the cluster)."""
    from memserver.demo import main as demo

    client.create_table(table_name, 100, 4)
    assert demo(["--endpoint", memory_cluster.endpoint, "--rows", "1000", "--dim", "8", "--steps", "2", "--batch", "16",
                 "--train-steps", "0", "--warmup-pairs", "0", "--trace-chars", "0"]) == 0
    names = [t.name for t in client.list_tables()]
    assert table_name in names and not [n for n in names if n.startswith("demo-")]
    client.drop_table(table_name)


@pytest.mark.parametrize("steps", ["1", "0"])
def test_the_demo_refuses_fewer_than_two_steps_naming_the_flag(capsys, steps):
    """`--steps 1` failed its "loss did not fall" check (the loss before the one update against
    itself) and `--steps 0` ended in IndexError (a hunt): refused before any cluster is reached."""
    from memserver.demo import main as demo

    with pytest.raises(SystemExit) as exit_:
        demo(["--endpoint", "127.0.0.1:1", "--steps", steps])
    assert exit_.value.code == 2
    assert f"error: --steps: must be at least 2 (part 1 checks that the loss fell from its first step), got {steps}" \
        in capsys.readouterr().err


def test_a_failed_demo_leaves_none_of_its_tables(client, memory_cluster, monkeypatch):
    """A demo that failed half-way left its demo-* table in the cluster (a hunt): dropped, and its
    own error is the one raised."""
    from client import MemoryClient
    from memserver.demo import main as demo

    def broken(self, *args, **kwargs):
        raise RuntimeError("slot_stats broke (test)")

    monkeypatch.setattr(MemoryClient, "slot_stats", broken)  # after part 1 made and trained its first table
    with pytest.raises(RuntimeError, match="slot_stats broke"):
        demo(["--endpoint", memory_cluster.endpoint, "--rows", "1000", "--dim", "8", "--steps", "2", "--batch", "16",
              "--train-steps", "0", "--warmup-pairs", "0", "--trace-chars", "0"])
    assert not [t.name for t in client.list_tables() if t.name.startswith("demo-")]


def test_the_demos_ms_per_step_is_the_steps_own_time(monkeypatch):
    """Part 2's "ms/step" was the whole wall time (the model's build and the evaluations too) over
    the steps: 22702 for steps of 4-6 s (a hunt). It is the mean of the steps' own times."""
    from rich.console import Console

    import trainer.train
    from memserver.demo import train_comparison

    def train(args, client=None):  # the trainer's records: step_ms is the mean over the steps since the last one
        time.sleep(0.2)  # a model build the steps' time must not count
        for step, ms in ((1, 100.0), (4, 20.0)):
            yield {"step": step, "loss": 2.0, "val_loss": 2.5, "step_ms": ms, "tokens_per_s": 1000.0}

    monkeypatch.setattr(trainer.train, "train", train)
    console = Console(record=True, width=200)
    train_comparison(None, 4, console, "/nonexistent")
    rows = [line.split("│") for line in console.export_text().splitlines() if "2.5000" in line]
    assert len(rows) == 2 and all(r[4].strip() == "40" for r in rows), rows  # (100 + 3 x 20) / 4


def test_a_second_cluster_on_the_same_ray_cluster_is_refused_before_anything_is_made(client, memory_cluster):
    """(Ray's own error said only that an actor name was taken, after placing the shards.)"""
    import ray

    from memserver.cluster.launch import start_cluster

    groups = len(ray.util.placement_group_table())
    with pytest.raises(RuntimeError, match="a memserver already runs on this Ray cluster .*memserver down"):
        start_cluster(1, shard_cpus=0.25)
    assert len(ray.util.placement_group_table()) == groups
    client.list_tables()  # the running one still answers


class _UnavailableOnce(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "shard restarting (test)"


@pytest.mark.parametrize("path", ["sync", "asyncio"])
def test_a_read_retried_for_one_shard_counts_once_on_the_others(memory_cluster, table_name, path):
    """A bag whose call to shard 1 fails once (UNAVAILABLE) is sent again to every shard; the
    shard that answered the first attempt answers again without counting its slots' hits and
    weight mass a second time (it counted them twice)."""
    from concurrent.futures import Future

    from client import MemoryClient, UnavailableError

    with MemoryClient(memory_cluster.endpoint, timeout=60, shm=False) as c:
        meta = c.create_table(table_name, 40, 4, sharding="rows", init_std=1.0)
        shard1 = next(sh.address for sh in meta.shards if sh.index == 1)
        ids, w = np.array([[0, 1]]), np.array([[0.5, 2.0]], np.float32)  # id 0 on shard 0, id 1 on shard 1
        want = c.bag(table_name, ids, w)  # counted once on each shard
        failed = []
        if path == "sync":
            real = c._methods

            class Once:
                def __init__(self, call):
                    self.call = call

                def __call__(self, req, **kwargs):
                    if not failed:
                        failed.append(1)
                        raise _UnavailableOnce()
                    return self.call(req, **kwargs)

                def future(self, req, **kwargs):
                    if not failed:
                        failed.append(1)
                        f = Future()
                        f.set_exception(_UnavailableOnce())
                        return f
                    return self.call.future(req, **kwargs)

            def methods(address):
                got = dict(real(address))
                if address == shard1:
                    got["Bag"] = Once(got["Bag"])
                return got

            c._methods = methods
            got = c.bag(table_name, ids, w)
            del c._methods
        else:
            real = c.aio._data

            async def data(address, method, request, server=None):
                if address == shard1 and method == "Bag" and not failed:
                    failed.append(1)
                    raise UnavailableError("shard restarting (test)")
                return await real(address, method, request, server)

            c.aio._data = data
            got = c.submit_bag(table_name, ids, w).result()
            del c.aio._data
        assert failed and np.array_equal(np.asarray(got), np.asarray(want))
        s = c.slot_stats(table_name, [0, 1])
        assert s["hits"].tolist() == [2, 2]  # two bags each, whatever the retries
        np.testing.assert_allclose(s["weight_mass"], [1.0, 4.0])
        c.drop_table(table_name)


def test_a_retry_marks_uncounted_only_the_read_parts_a_shard_answered():
    """client.transport: a read split in two parts to one shard, one answered and one failed: the
    retry marks the answered part uncounted and sends the failed one counted (it was marked
    whole by shard: the failed part's hits were then never counted); another shard's answered
    read is marked too, a write never."""
    from client import transport
    from memserver.wire import Lazy

    def lookup(layout: int) -> Lazy:
        return Lazy(pb.LookupRequest(table="t", layout_id=layout), {})

    calls = [("a", "Lookup", lookup(7)), ("a", "Lookup", lookup(7)), ("b", "Lookup", lookup(7)),
             ("b", "PushGradients", pb.PushGradientsRequest(table="t", layout_id=7))]
    counted: set = set()
    transport.note_counted(calls, [object(), _UnavailableOnce(), object(), object()], counted)
    again = transport.recount(calls, counted)
    marks = [getattr(req.msg if isinstance(req, Lazy) else req, "uncounted", None) for _, _, req in again]
    assert marks == [True, False, True, None]
    assert [req.msg.uncounted for _, _, req in calls[:3]] == [False] * 3  # the first attempt's messages unchanged
    # a refreshed layout (the table re-made) is another table: nothing of it was counted
    assert not any(req.msg.uncounted for _, _, req in transport.recount([("a", "Lookup", lookup(8))], counted))
