"""Fault tests: SIGKILL a shard or the coordinator of a running cluster and check what comes back.

They run on a second, small memory cluster (its own data directory) inside the session's Ray, so
killing its processes does not disturb the other tests. The pids come from `status`, as they do
from `memserver status --json`.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback

import numpy as np
import pytest

from memserver.api.errors import InvalidArgumentError

ROWS, DIM = 512, 16


@pytest.fixture(scope="module")
def fault_cluster(memory_cluster, tmp_path_factory):
    from memserver.cluster.launch import start_cluster

    cluster = start_cluster(2, shard_cpus=0.25, name="faults", data_dir=tmp_path_factory.mktemp("fault-data"),
                            checkpoint_root=tmp_path_factory.getbasetemp())
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def fclient(fault_cluster):
    from client import MemoryClient

    with MemoryClient(fault_cluster.endpoint, timeout=30, retry_seconds=90) as c:
        yield c


@pytest.fixture(autouse=True)
def serving_after(request):
    """After each test of the fault cluster, wait until its coordinator answers and every shard
    serves: a test that failed while a process it killed restarted left the next tests a dead
    endpoint, each failing at once (a CI run: 8 failures after the one that mattered)."""
    yield
    if "fault_cluster" in request.fixturenames:  # (fclient asks for it too)
        from client import MemoryClient

        with MemoryClient(request.getfixturevalue("fault_cluster").endpoint, timeout=30, retry_seconds=90) as c:
            # (status is a read: retried while the coordinator restarts)
            wait_for(lambda: all(s.state == "serving" for s in c.status().shards), "the fault cluster to serve")


def batches(seed: int, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, ROWS, 64), rng.normal(size=(64, DIM)).astype(np.float32)) for _ in range(n)]


def kill_shard(client, index: int) -> int:
    pid = client.status().shards[index].pid
    os.kill(pid, signal.SIGKILL)
    return pid


def said(errors: list[BaseException]) -> str:
    """A failed thread's first error with its traceback, status and target (its repr has neither)."""
    return "".join(traceback.format_exception(errors[0])) if errors else ""


def wait_for(predicate, what: str, timeout: float = 90.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if (got := predicate()):
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


@pytest.mark.parametrize("sharding", ["cols", "rows"])
def test_wal_table_loses_no_acknowledged_push_when_a_shard_is_killed(fclient, client, table_name, sharding, caplog):
    """A stream of pushes with a shard SIGKILLed in the middle: the client retries through the
    restart, the shard replays its log, and the table equals the same stream on a cluster that
    never failed, values and optimizer state (the pushes after recovery would diverge otherwise)."""
    spec = dict(sharding=sharding, optimizer="adam", lr=0.05, seed=5)
    fclient.create_table(table_name, ROWS, DIM, wal=True, **spec)
    client.create_table(table_name, ROWS, DIM, **spec)  # the reference: the session cluster, no failure
    stream = batches(1, 80)
    acked, errors = [], []
    halfway = threading.Event()

    def push_all():
        try:
            for i, (ids, g) in enumerate(stream):
                fclient.push_gradients(table_name, ids, g)
                acked.append(i)
                if i == 25:
                    halfway.set()
        except Exception as exc:  # surfaced below
            errors.append(exc)
            halfway.set()

    pusher = threading.Thread(target=push_all)
    pusher.start()
    assert halfway.wait(60)
    old_pid = kill_shard(fclient, 0)
    pusher.join(120)
    assert not pusher.is_alive() and not errors, said(errors)
    assert acked == list(range(len(stream)))
    for ids, g in stream:
        client.push_gradients(table_name, ids, g)
    np.testing.assert_array_equal(fclient.lookup(table_name, np.arange(ROWS)), client.lookup(table_name, np.arange(ROWS)))

    st = fclient.status().shards[0]
    assert st.pid != old_pid and st.restarted
    load = next(t for t in st.tables if t.table == table_name)
    assert "logged writes" in load.recovered_from and load.wal_lsn > 0
    assert not [r for r in caplog.records if r.name == "client.ops.sessions"]  # nothing lost, nothing said
    # optimizer state came back too: more pushes keep both tables equal
    for ids, g in batches(2, 5):
        fclient.push_gradients(table_name, ids, g)
        client.push_gradients(table_name, ids, g)
    np.testing.assert_array_equal(fclient.lookup(table_name, np.arange(ROWS)), client.lookup(table_name, np.arange(ROWS)))
    fclient.drop_table(table_name)
    client.drop_table(table_name)


@pytest.mark.parametrize("then", ["resumed", "killed"])
def test_a_write_acknowledged_after_a_restart_is_not_undone_by_the_siblings_rollback(fclient, fault_cluster, table_name,
                                                                                     tmp_path, then):
    """A table without `wal`: a restarted shard served at once, and its sibling rolled back to the
    same checkpoint when the coordinator got to it, undoing its half of each write acknowledged in
    between (a walkthrough: 5 of 10 rows lost, 2.5 s after the restart). The restarted shard now
    holds the table (UNAVAILABLE: clients retry) until the coordinator has rolled its siblings
    back; here the coordinator is stopped (SIGSTOP) for the first seconds after the kill, so
    without the hold every write in that time was acknowledged and then undone. `killed`: the
    coordinator is then killed instead of resumed (the shard's word to it is lost with it): the
    restarted coordinator finds the held slice (held_slices) and finishes the rollback."""
    from client import MemoryClient

    fclient.create_table(table_name, ROWS, DIM, sharding="rows", seed=2)
    fclient.checkpoint(str(tmp_path), step=1, tables=[table_name])
    acked: list[int] = []
    errors: list[BaseException] = []
    with MemoryClient(fault_cluster.endpoint, timeout=3, retry_seconds=90) as c:
        c.table(table_name)  # (its map cached: the coordinator is stopped below)

        def writer() -> None:
            try:
                for i in range(24):  # 8 rows a write: 4 on each shard (rows: id % 2)
                    c.write_rows(table_name, np.arange(8 * i, 8 * i + 8), np.full((8, DIM), i + 1.0, np.float32))
                    acked.append(i)
            except BaseException as exc:  # noqa: BLE001 - said below
                errors.append(exc)

        coordinator = fclient.status().coordinator_pid
        kill_shard(fclient, 1)
        os.kill(coordinator, signal.SIGSTOP)
        try:
            thread = threading.Thread(target=writer)
            thread.start()
            t0 = time.monotonic()
            while time.monotonic() - t0 < 12 and len(acked) < 3:
                time.sleep(0.1)
            during = len(acked)  # acknowledged while no rollback could run
        finally:
            os.kill(coordinator, signal.SIGCONT if then == "resumed" else signal.SIGKILL)
        thread.join(120)
        assert not thread.is_alive() and not errors, said(errors)
        wait_for(lambda: [t for s in fclient.status().shards for t in s.tables
                          if t.table == table_name and t.recovered_from and not t.unavailable][1:], "both slices to serve")
        rows = c.lookup(table_name, np.arange(ROWS), count=False)
        warned = c.rebuilds(table_name)[0]
    whole = [i for i in acked if (rows[8 * i:8 * i + 8] == i + 1.0).all()]
    assert during == 0 and acked == list(range(24)), (during, acked)
    # write 0 was in flight across the kill: its shard-0 half, applied before the rollback, is lost
    # with it, which the client said (at its next write); every write after it is whole
    assert whole in (list(range(24)), list(range(1, 24))), whole
    if whole[0] == 1:
        assert warned == 1 and (rows[1:8:2] == 1.0).all()
    fclient.drop_table(table_name)


def test_table_without_wal_returns_to_its_last_checkpoint(fclient, table_name, tmp_path, caplog):
    """Without a log, a killed shard's table (every shard of it) comes back as the last complete
    checkpoint, and later writes go on from there; the client that wrote is told at its next write
    (the shard kept its address: nothing else would tell it)."""
    fclient.create_table(table_name, ROWS, DIM, sharding="rows", optimizer="adagrad", lr=0.1, seed=6)
    for ids, g in batches(3, 10):
        fclient.push_gradients(table_name, ids, g)
    fclient.checkpoint(str(tmp_path), step=10, tables=[table_name])
    at_checkpoint = fclient.lookup(table_name, np.arange(ROWS))
    for ids, g in batches(4, 10):  # acknowledged, but after the checkpoint: lost with the shard
        fclient.push_gradients(table_name, ids, g)
    assert not np.array_equal(fclient.lookup(table_name, np.arange(ROWS)), at_checkpoint)
    kill_shard(fclient, 1)

    def recovered():
        loads = [t for s in fclient.status().shards for t in s.tables if t.table == table_name]
        return len(loads) == 2 and all(t.recovered_from for t in loads) and loads

    loads = wait_for(recovered, "both shards of the table to recover or roll back")
    assert sorted(t.recovered_from for t in loads) == ["checkpoint step 10", "rollback to checkpoint step 10"]
    np.testing.assert_array_equal(fclient.lookup(table_name, np.arange(ROWS)), at_checkpoint)
    ids, g = batches(5, 1)[0]
    caplog.set_level(logging.WARNING, logger="client.ops.sessions")
    before = fclient.rebuilds(table_name)[0]
    fclient.checkpoint(str(tmp_path), step=11, tables=[table_name])  # no write since: the checkpoint says it
    assert fclient.rebuilds(table_name)[0] == before + 1
    assert fclient.push_gradients(table_name, ids, g) == len(np.unique(ids))
    (said,) = [r.getMessage() for r in caplog.records if r.name == "client.ops.sessions"]
    assert said.startswith(f"table {table_name}: rebuilt without a write-ahead log")
    a = [sh.address for sh in fclient.table(table_name).shards]
    assert (f"its slice 0 on the shard at {a[0]} from rollback to checkpoint step 10; its slice 1 on the shard at "
            f"{a[1]} from checkpoint step 10") in said
    fclient.push_gradients(table_name, ids, g)
    assert len([r for r in caplog.records if r.name == "client.ops.sessions"]) == 1
    fclient.drop_table(table_name)


def test_a_table_restored_with_wal_logs_its_writes(fault_cluster, fclient, table_name, tmp_path, cli_in_process):
    """`restore --wal` of a checkpoint taken before the table had a log: it comes back logging, so
    a shard killed after more writes loses none of them (without the flag: as saved)."""
    fclient.create_table(table_name, ROWS, DIM, sharding="cols", optimizer="adagrad", lr=0.1, seed=7)
    for ids, g in batches(8, 3):
        fclient.push_gradients(table_name, ids, g)
    fclient.checkpoint(str(tmp_path), step=3, tables=[table_name])
    assert not fclient.restore(str(tmp_path), replace=True, tables=[table_name])[0].wal  # as saved
    with pytest.raises(InvalidArgumentError, match="wal: True, False or None"):
        fclient.restore(str(tmp_path), replace=True, tables=[table_name], wal="yes")
    st = cli_in_process(["restore", "--dir", str(tmp_path), "--table", table_name, "--replace", "--wal",
                         "--endpoint", fault_cluster.endpoint])
    assert st.returncode == 0 and st.stdout.startswith(f"restored step 3 ({tmp_path / 'step-0000000003'}):\n  {table_name}: ")
    assert ", with wal" in st.stdout, st
    assert fclient.table(table_name, refresh=True).wal
    for ids, g in batches(9, 5):  # acknowledged after the restore: logged now
        fclient.push_gradients(table_name, ids, g)
    before = fclient.lookup(table_name, np.arange(ROWS))
    pid = kill_shard(fclient, 0)

    def recovered():
        s = fclient.status().shards[0]
        return s.pid != pid and any(t.table == table_name and "5 logged writes" in t.recovered_from for t in s.tables)

    wait_for(recovered, "shard 0 to replay the restored table's log")
    np.testing.assert_array_equal(fclient.lookup(table_name, np.arange(ROWS)), before)
    fclient.drop_table(table_name)


def test_coordinator_killed_shards_keep_serving_and_catalog_comes_back(fclient, table_name):
    fclient.create_table(table_name, ROWS, DIM, sharding="cols", optimizer="sgd", lr=0.1, wal=True)
    ids, g = batches(6, 1)[0]
    fclient.push_gradients(table_name, ids, g)
    before = fclient.lookup(table_name, np.arange(ROWS))
    status = fclient.status()
    os.kill(status.coordinator_pid, signal.SIGKILL)
    # the data plane does not go through the coordinator: the shards answer at once
    t0 = time.monotonic()
    np.testing.assert_array_equal(fclient.lookup(table_name, np.arange(ROWS)), before)
    fclient.push_gradients(table_name, ids, g)
    assert time.monotonic() - t0 < 5
    # the restarted coordinator rebuilt its catalog from the shards, at the same endpoint
    names = [t.name for t in fclient.list_tables()]
    assert table_name in names
    after = fclient.status()
    assert after.coordinator_restarted and after.coordinator_pid != status.coordinator_pid
    meta = fclient.aio._tables.pop(table_name)
    fresh = fclient.table(table_name)
    assert [s.address for s in fresh.shards] == [s.address for s in meta.shards]
    assert fclient.lookup(table_name, np.arange(ROWS)).shape == (ROWS, DIM)
    fclient.drop_table(table_name)
    assert table_name not in [t.name for t in fclient.list_tables()]


def test_shared_memory_when_a_shard_is_killed(fault_cluster, table_name, monkeypatch):
    """A client with shared-memory regions on both shards, writing through them to a table with
    the write-ahead log, by the shards' doorbells; SIGKILL a shard: the client drops that region
    (and unmaps it: its memfd is gone with the shard's mapping) and its doorbell connection, its
    calls go on (TCP while the shard restarts), the restarted shard replays the writes that came
    through shared memory (their log records hold the tensors) and the client attaches a fresh
    region to it, with a doorbell again."""
    import client.shm
    from client import MemoryClient

    monkeypatch.setattr(client.shm, "RETRY_AFTER", 2.0)  # an attach refused while the shard restarts: asked sooner
    with MemoryClient(fault_cluster.endpoint, timeout=30, retry_seconds=90, shm=True) as c:
        c.create_table(table_name, ROWS, DIM, sharding="cols", wal=True)
        big = (np.zeros((8192, 1), np.int64), np.ones((8192, 1), np.float32))  # above client.shm.MIN_BYTES
        wait_for(lambda: c.bag(table_name, *big) is not None and len(c.aio.shm.regions) == 2,
                 "regions on both shards", 30)
        rng = np.random.default_rng(5)
        before = c.aio.shm.calls
        rung = c.aio.shm.bell_calls
        for _ in range(3):
            ids = rng.integers(0, ROWS, (2048, 4))
            c.bag_backward(table_name, ids, rng.random((2048, 4), dtype=np.float32),
                           rng.normal(size=(2048, DIM)).astype(np.float32))
        assert c.aio.shm.calls - before == 6 and c.aio.shm.bell_calls - rung == 6
        expect = c.lookup(table_name, np.arange(ROWS))
        address = c.table(table_name).shards[0].address
        region = c.aio.shm.regions[address]
        kill_shard(c, 0)
        wait_for(lambda: address not in c.aio.shm.regions, "the client to drop the dead shard's region", 30)
        wait_for(lambda: region.mm.closed, "the client to unmap the dead shard's region", 30)
        assert not region.bell.alive  # its doorbell connection is closed with it
        with open("/proc/self/maps") as f:
            assert f"/memfd:{region.name} " not in f.read()
        np.testing.assert_array_equal(c.lookup(table_name, np.arange(ROWS)), expect)
        wait_for(lambda: c.bag(table_name, *big) is not None and len(c.aio.shm.regions) == 2,
                 "a region on the restarted shard", 60)
        np.testing.assert_array_equal(c.lookup(table_name, np.arange(ROWS)), expect)
        assert c.aio.shm.bell(address) is not None and c.aio.shm.bell(address) is not region.bell


def test_a_shard_restarted_without_its_data_says_what_was_lost_and_how_to_restore(fault_cluster, fclient, table_name,
                                                                                 tmp_path):
    """A shard that Ray restarts where its data directory does not reach (another host, no shared
    storage; here: its table folder removed before the kill) comes back without the slice: calls
    to it answer DATA_LOSS naming the slice, the data directory and `memserver restore`, status
    says so, and restoring the table from its checkpoint serves it again."""
    import shutil

    from client import DataLossError

    fclient.create_table(table_name, ROWS, DIM, sharding="cols", optimizer="sgd", lr=0.1, seed=8)
    ids, g = batches(7, 1)[0]
    fclient.push_gradients(table_name, ids, g)
    fclient.checkpoint(str(tmp_path), step=1, tables=[table_name])
    saved = fclient.lookup(table_name, np.arange(ROWS))
    folder = os.path.join(fault_cluster.data_dir, "shard-0001", table_name)
    assert os.path.exists(os.path.join(folder, "table.json"))
    shutil.rmtree(folder)  # the new host's (unshared) data directory has never seen this table
    kill_shard(fclient, 1)

    def lost():
        st = fclient.status().shards[1]
        return st.restarted and [t.unavailable for t in st.tables if t.table == table_name and t.unavailable]

    [text] = wait_for(lost, "the restarted shard to report the lost slice")
    for words in (f"table {table_name!r}: shard 1's slice is lost", "holds no record of it", "storage every host reaches", "memserver restore"):
        assert words in text, text
    with pytest.raises(DataLossError, match="slice is lost"):
        fclient.lookup(table_name, np.arange(ROWS))
    fclient.restore(str(tmp_path), step=1, tables=[table_name], replace=True)
    np.testing.assert_array_equal(fclient.lookup(table_name, np.arange(ROWS)), saved)
    assert not any(t.unavailable for s in fclient.status().shards for t in s.tables)
    fclient.drop_table(table_name)


def test_attempts_past_their_deadline_are_sent_again_and_applied_once(fault_cluster, fclient, client, table_name):
    """A shard that stops answering for longer than a call's deadline (SIGSTOP: a partition's
    or a stalled host's view from the client): the attempts time out and are sent again within
    retry_seconds; when the shard answers, every write was applied exactly once (the late first
    attempt applies, the retries are answered from the session)."""
    from client import MemoryClient

    fclient.create_table(table_name, ROWS, DIM, sharding="cols", optimizer="adam", lr=0.05, seed=9)
    with MemoryClient(fault_cluster.endpoint, timeout=1.0, retry_seconds=60) as c:
        client.create_table(table_name, ROWS, DIM, sharding="cols", optimizer="adam", lr=0.05, seed=9)
        stream = batches(8, 4)
        for ids, g in stream[:2]:
            c.push_gradients(table_name, ids, g)
        pid = fclient.status().shards[1].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            timer = threading.Timer(3.5, os.kill, (pid, signal.SIGCONT))
            timer.start()
            t0 = time.monotonic()
            for ids, g in stream[2:]:
                c.push_gradients(table_name, ids, g)
            stalled = time.monotonic() - t0
        finally:
            timer.join()
            os.kill(pid, signal.SIGCONT)
        assert stalled > 3.0  # the calls waited for the shard, through deadlines of 1 s
        for ids, g in stream:
            client.push_gradients(table_name, ids, g)
    np.testing.assert_array_equal(fclient.lookup(table_name, np.arange(ROWS)), client.lookup(table_name, np.arange(ROWS)))
    fclient.drop_table(table_name)
    client.drop_table(table_name)


def test_a_checkpoint_asked_while_a_shard_restarts_waits_for_it(fault_cluster, fclient, table_name, tmp_path):
    """A trainer checkpoints at a step barrier while a shard is down (its host was lost): the
    coordinator answers UNAVAILABLE, the client asks again until the shard is back, and the
    checkpoint is complete (a manifest, every slice). Asking for the same step again (a retry
    whose first attempt did land) keeps one record entry per file."""
    import json
    fclient.create_table(table_name, ROWS, DIM, sharding="cols", optimizer="sgd", lr=0.1, wal=True, seed=10)
    ids, g = batches(9, 1)[0]
    fclient.push_gradients(table_name, ids, g)
    before = fclient.lookup(table_name, np.arange(ROWS))
    kill_shard(fclient, 0)
    done = fclient.checkpoint(str(tmp_path), step=3, tables=[table_name])
    assert done["tables"] == [table_name] and (tmp_path / "step-0000000003" / "manifest.json").exists()
    np.testing.assert_array_equal(fclient.lookup(table_name, np.arange(ROWS)), before)
    fclient.checkpoint(str(tmp_path), step=3, tables=[table_name])
    for i in range(2):
        record = json.loads(open(os.path.join(fault_cluster.data_dir, f"shard-{i:04d}", table_name,
                                              "table.json")).read())
        files = [c["file"] for c in record["checkpoints"]]
        assert len(files) == len(set(files)) == 1, files
    fclient.drop_table(table_name)


def test_an_index_trained_while_a_shard_restarts_waits_for_it(fclient, table_name):
    """train_index right after a shard died waits for its restart, as the data plane's calls do
    (it failed at once), and every shard serves the one trained index."""
    fclient.create_index(table_name, DIM, index_factory="IVF4,Flat", metric="l2", num_shards=2)
    x = np.random.default_rng(3).normal(size=(200, DIM)).astype(np.float32)
    pid = kill_shard(fclient, 1)
    fclient.train_index(table_name, x)
    assert fclient.status().shards[1].pid != pid
    fclient.add(table_name, np.arange(200), x)
    np.testing.assert_array_equal(fclient.search(table_name, x[:50], 1, nprobe=4)[1][:, 0], np.arange(50))
    fclient.drop_table(table_name)


def test_an_actor_knows_it_was_restarted_without_a_deprecation_warning(memory_cluster):
    """A restarted shard or coordinator recovers from its files only when it knows it was
    restarted (rayutil.was_restarted). Ray's own `was_current_actor_reconstructed` put a
    RayDeprecationWarning in `up`'s log at every shard's start (an operator's walkthrough)."""
    import ray

    @ray.remote(max_restarts=1, num_cpus=0.01)
    class Probe:
        def __init__(self) -> None:
            import warnings

            from memserver.server.rayutil import was_restarted

            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                self.said = (was_restarted(), [str(w.message) for w in seen], os.getpid())

        def get(self) -> tuple[bool, list[str], int]:
            return self.said

    probe = Probe.remote()
    first, warned, pid = ray.get(probe.get.remote(), timeout=60)
    assert (first, warned) == (False, [])
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    while True:
        try:
            again, warned, new_pid = ray.get(probe.get.remote(), timeout=60)
            break
        except ray.exceptions.RayActorError:  # (a call that met the dying process)
            assert time.monotonic() - t0 < 60
            time.sleep(0.2)
    assert (again, warned) == (True, []) and new_pid != pid
    ray.kill(probe)


SLEEPY_SERVER = """
import time, grpc
from concurrent import futures
from memserver.server.admission import SERVER_OPTIONS
from memserver.wire import GRPC_OPTIONS
def sleep(request, context):
    time.sleep(float(request.decode()))
    return b"ok"
handler = grpc.method_handlers_generic_handler("t.T", {"Sleep": grpc.unary_unary_rpc_method_handler(sleep)})
server = grpc.server(futures.ThreadPoolExecutor(4), handlers=[handler], options=[*GRPC_OPTIONS, *SERVER_OPTIONS])
port = server.add_insecure_port("127.0.0.1:0")
server.start()
print(port, flush=True)
server.wait_for_termination()
"""


def test_a_connection_whose_peer_stops_answering_is_dropped_before_the_deadline():
    """A host powered off or cut off sends no reset: a call to its shard waited out its whole deadline
    (60 s by default) before the client asked where Ray had moved the shard (a walkthrough's power
    cut: the step took 60 s). The client pings while a call
    is in flight and drops a connection whose peer does not answer: UNAVAILABLE, which it retries
    with a fresh map. (SIGSTOP: the peer's kernel still takes the bytes, its gRPC answers nothing.)
    The servers allow those pings: with gRPC's defaults a call longer than about 10 s was closed
    under the client ("Too many pings")."""
    import subprocess
    import sys

    import grpc

    from client.channels import sync_channel

    # two servers, one check each, at the same time (the suite waits the longer, not both)
    procs = [subprocess.Popen([sys.executable, "-c", SLEEPY_SERVER], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        allows, stops = (int(p.stdout.readline()) for p in procs)
        with sync_channel(f"127.0.0.1:{allows}", retries=False) as ch_allows, \
                sync_channel(f"127.0.0.1:{stops}", retries=False) as ch_stops:
            # a long call without data: pinged, and the server allows it
            long_call = ch_allows.unary_unary("/t.T/Sleep").future(b"14", timeout=30)
            call = ch_stops.unary_unary("/t.T/Sleep").future(b"90", timeout=60)
            time.sleep(0.5)
            t0 = time.monotonic()
            os.kill(procs[1].pid, signal.SIGSTOP)  # the peer stops answering anything, pings too
            with pytest.raises(grpc.RpcError) as err:
                call.result()
            took = time.monotonic() - t0
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and took < 30, (err.value.code(), took)  # 2 s + 20 s
            assert long_call.result() == b"ok"
    finally:
        os.kill(procs[1].pid, signal.SIGCONT)
        for p in procs:
            p.kill()
            p.wait()
