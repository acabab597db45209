"""The write-ahead log and a shard's recovery from its data directory, in this process (no Ray)."""

from __future__ import annotations

import logging
import shutil
import threading

import grpc
import numpy as np
import pytest
import torch

from memserver.api.v1 import memserver_pb2 as pb
from memserver.api.v1 import memserver_pb2_grpc as pb_grpc
from memserver.storage.wal import PUSH_GRADIENTS, WriteAheadLog, read_log, repair_log
from memserver.wire import decode, encode


def test_log_round_trip_and_group_commit(tmp_path, monkeypatch):
    import time

    import memserver.storage.wal as durable

    real_fdatasync = durable.os.fdatasync

    def slow_fdatasync(fd):  # a slow disk: writers waiting on one flush must share the next one
        time.sleep(0.02)
        real_fdatasync(fd)

    monkeypatch.setattr(durable.os, "fdatasync", slow_fdatasync)
    wal = WriteAheadLog(tmp_path)
    lsns = []

    def writer(k):
        for i in range(50):
            lsn = wal.append(PUSH_GRADIENTS, f"{k}-{i}".encode())
            wal.durable(lsn).result(10)
            lsns.append(lsn)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(lsns) == list(range(200))
    assert wal.durable_lsn == 200
    # 4 writers each waiting for its record: one fsync per record would be 200. Shared, they settle in
    # two groups taking turns (one group appends while the other's sync runs): 100 on a quiet machine,
    # a few more when a writer is held up (a 60 ms stall of one made 101)
    assert wal.syncs <= 150, f"{wal.syncs} fsyncs for 200 records: concurrent writers do not share them"
    wal.close()
    monkeypatch.undo()
    records = list(read_log(tmp_path, 0))
    assert [lsn for lsn, _, _ in records] == list(range(200))
    assert {p for _, _, p in records} == {f"{k}-{i}".encode() for k in range(4) for i in range(50)}
    assert [lsn for lsn, _, _ in read_log(tmp_path, 150)] == list(range(150, 200))


def test_torn_tail_is_cut_and_the_log_continues(tmp_path):
    wal = WriteAheadLog(tmp_path)
    for i in range(5):
        wal.append(PUSH_GRADIENTS, b"x" * i)
    wal.durable(4).result(10)
    wal.close()
    seg = next(tmp_path.glob("wal-*.log"))
    with open(seg, "ab") as f:  # a record the crash cut in half
        f.write(b"MSW1\x00\x00")
    assert repair_log(tmp_path) == 5
    wal = WriteAheadLog(tmp_path, 5)
    wal.append(PUSH_GRADIENTS, b"after")
    wal.durable(5).result(10)
    wal.close()
    assert [lsn for lsn, _, _ in read_log(tmp_path, 0)] == list(range(6))


def test_rotate_drops_segments_a_complete_checkpoint_covers(tmp_path):
    wal = WriteAheadLog(tmp_path)
    for _ in range(3):
        wal.append(PUSH_GRADIENTS, b"a")
    wal.rotate(None)  # checkpoint 1 at lsn 3 (not yet complete: keep everything)
    for _ in range(2):
        wal.append(PUSH_GRADIENTS, b"b")
    wal.rotate(3)  # checkpoint 2 at lsn 5; checkpoint 1 (lsn 3) is complete
    wal.append(PUSH_GRADIENTS, b"c")
    wal.close()
    names = sorted(p.name for p in tmp_path.glob("wal-*.log"))
    assert names == [f"wal-{3:016d}.log", f"wal-{5:016d}.log"]
    assert [lsn for lsn, _, _ in read_log(tmp_path, 3)] == [3, 4, 5]


def _push(stub, name, ids, grads, seq):
    return stub.PushGradients(pb.PushGradientsRequest(table=name, ids=encode(torch.as_tensor(ids)),
                                                      grads=encode(torch.as_tensor(grads)),
                                                      tag=pb.WriteTag(client_id="t", seq=seq)))


@pytest.mark.parametrize("checkpoint", [False, True])
def test_shard_recovers_its_tables_from_the_data_dir(tmp_path, checkpoint):
    """A shard started again on its data directory serves the same rows and the same
    exactly-once window: from the log alone, or from a checkpoint plus the log after it."""
    from memserver.server.catalog import plan_table, validate_spec
    from memserver.server.shard_actor import ShardActor

    spec = validate_spec(pb.TableSpec(name="m", num_rows=64, dim=8, optimizer=pb.OptimizerSpec(name="adam", lr=0.1),
                                      sharding=pb.ROWS, wal=True, seed=1), 1)
    shard = ShardActor(0, host="127.0.0.1", data_dir=str(tmp_path))
    info = plan_table(spec, [shard.info()]).shards[0]
    shard.create_table(spec.SerializeToString(), info.SerializeToString(), 1)
    rng = np.random.default_rng(0)
    with grpc.insecure_channel(shard.address) as ch:
        stub = pb_grpc.DataPlaneStub(ch)
        for seq in range(1, 11):
            _push(stub, "m", rng.integers(0, 64, 16), rng.normal(size=(16, 8)).astype(np.float32), seq)
            if checkpoint and seq == 6:
                shard.checkpoint_table("m", str(tmp_path / "ck" / "step-0000000006" / "m" / "shard-0000.pt"), 6)
                (tmp_path / "ck" / "step-0000000006" / "manifest.json").write_text("{}")
        rows = decode(stub.Lookup(pb.LookupRequest(table="m", ids=encode(torch.arange(64)))).rows, "rows").clone()
    shard.stop()
    # a create killed before it recorded its table left its files (a walkthrough: 199 MB, for
    # good, listed nowhere): removed as the shard starts; the recorded table's folder is kept
    here = tmp_path / "shard-0000"
    (here / "kc" / "disk").mkdir(parents=True)
    (here / "kc" / "disk" / "rows.dat").write_bytes(bytes(1 << 20))
    (here / "kc" / "wal-0000000000000000.log").write_bytes(b"")
    # anything else without a record is kept (a review): an operator's copy, notes, a log with records
    for name, f in (("T (old)", "wal-0000000000000000.log"), ("notes", "README"), ("moved", "wal-0000000000000000.log")):
        (here / name).mkdir()
        (here / name / f).write_bytes(b"x" * 100)

    again = ShardActor(0, host="127.0.0.1", data_dir=str(tmp_path))
    assert not (here / "kc").exists() and (here / "m" / "table.json").exists()
    assert all((here / name).exists() for name in ("T (old)", "notes", "moved"))
    assert again.address == shard.address  # the same port: clients find it where it was
    recovered = again.servicer.tables["m"].recovered_from
    assert recovered == ("checkpoint step 6 + 4 logged writes" if checkpoint else "initial values + 10 logged writes")
    with grpc.insecure_channel(again.address) as ch:
        stub = pb_grpc.DataPlaneStub(ch)
        got = decode(stub.Lookup(pb.LookupRequest(table="m", ids=encode(torch.arange(64)))).rows, "rows")
        torch.testing.assert_close(got, rows, rtol=0, atol=0)
        # a retried write the first process applied is answered, not applied again
        assert _push(stub, "m", [1, 2], np.ones((2, 8), np.float32), 3).duplicate
        assert _push(stub, "m", [1, 2], np.ones((2, 8), np.float32), 11).rows == 2
    again.drop_table("m")
    again.stop()
    assert not (tmp_path / "shard-0000" / "m").exists()


def test_writes_read_as_views_are_logged_whole(tmp_path, monkeypatch):
    """The shard reads large requests' tensors as views of their bytes (memserver.wire.parse_views);
    the log must still keep every tensor of them: a restart replays the same rows."""
    from memserver import wire
    from memserver.server.catalog import plan_table, validate_spec
    from memserver.server.shard_actor import ShardActor

    views = []
    made = wire.Resolved.__init__
    monkeypatch.setattr(wire.Resolved, "__init__", lambda self, msg, *a: views.append(type(msg).__name__) or made(self, msg, *a))
    spec = validate_spec(pb.TableSpec(name="v", num_rows=512, dim=16, optimizer=pb.OptimizerSpec(name="adagrad", lr=0.1),
                                      sharding=pb.ROWS, wal=True, seed=1), 1)
    shard = ShardActor(0, host="127.0.0.1", data_dir=str(tmp_path))
    shard.create_table(spec.SerializeToString(), plan_table(spec, [shard.info()]).shards[0].SerializeToString(), 1)
    rng = np.random.default_rng(0)
    ids = torch.from_numpy(rng.integers(0, 512, (256, 8)))
    with grpc.insecure_channel(shard.address) as ch:
        stub = pb_grpc.DataPlaneStub(ch)
        for seq in range(1, 4):
            stub.BagBackward(pb.BagBackwardRequest(
                table="v", ids=encode(ids), weights=encode(torch.rand(256, 8)), grad_out=encode(torch.randn(256, 16)),
                tag=pb.WriteTag(client_id="t", seq=seq)))
            _push(stub, "v", rng.integers(0, 512, 2048), rng.normal(size=(2048, 16)).astype(np.float32), 10 + seq)
        rows = decode(stub.Lookup(pb.LookupRequest(table="v", ids=encode(torch.arange(512)))).rows, "rows").clone()
    shard.stop()
    # the writes were read as views
    assert views.count("BagBackwardRequest") == 3 and views.count("PushGradientsRequest") == 3

    again = ShardActor(0, host="127.0.0.1", data_dir=str(tmp_path))
    assert again.servicer.tables["v"].recovered_from == "initial values + 6 logged writes"
    with grpc.insecure_channel(again.address) as ch:
        got = decode(pb_grpc.DataPlaneStub(ch).Lookup(pb.LookupRequest(table="v", ids=encode(torch.arange(512)))).rows, "rows")
        torch.testing.assert_close(got, rows, rtol=0, atol=0)
    again.drop_table("v")
    again.stop()


def test_serve_on_comes_back_on_its_port_or_a_new_one_if_taken(tmp_path):
    import socket

    from memserver.loop import LoopThread
    from memserver.server.grpcserver import serve_on

    loop = LoopThread("test-serve-on")
    state = tmp_path / "port.json"
    server, port = serve_on(loop, lambda s: None, [], "127.0.0.1", state=state)
    loop.call(server.stop(None))
    again, same = serve_on(loop, lambda s: None, [], "127.0.0.1", state=state)
    assert same == port
    loop.call(again.stop(None))
    with socket.socket() as squatter:  # another program took the port meanwhile
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        third, other = serve_on(loop, lambda s: None, [], "127.0.0.1", state=state)
        assert other != port
        loop.call(third.stop(None))
    assert f'"port": {other}' in state.read_text()
    # another memserver serving there (a second `up` on the same data directory, whose records name
    # the first's ports): gRPC's SO_REUSEPORT let both bind it, and clients were split between them
    first, at = serve_on(loop, lambda s: None, [], "127.0.0.1", state=state)
    copy = tmp_path / "copy.json"
    copy.write_text(state.read_text())
    second, moved = serve_on(loop, lambda s: None, [], "127.0.0.1", state=copy)
    assert moved != at
    loop.call(second.stop(None))
    loop.call(first.stop(None))
    # a port the user gave wins over the recorded one (`up --port P` on an earlier run's data directory
    # served on that run's port), and taken, it is an error naming it, not another port (a hunt)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        asked = free.getsockname()[1]
    given, on = serve_on(loop, lambda s: None, [], "127.0.0.1", asked, state=state, what="coordinator")
    assert on == asked != other and f'"port": {asked}' in state.read_text()
    loop.call(given.stop(None))
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", asked))
        squatter.listen()
        with pytest.raises(RuntimeError, match=rf"coordinator: port {asked} on 127.0.0.1 is taken by another process "
                                               r"\(--port\): give another, or 0 for any free port"):
            serve_on(loop, lambda s: None, [], "127.0.0.1", asked, state=state, what="coordinator")
    loop.stop()


def test_a_server_given_no_port_takes_one_below_the_ephemeral_range(tmp_path, monkeypatch):
    """A shard or coordinator given no port (nor one recorded) took any free port: one of the
    kernel's ephemeral range, from which every outgoing connection and every port-0 listener (a
    local Ray's workers among them) take theirs. Restarted, it often found that port taken and
    moved to a new one, which its clients then had to find (a CI run's shard). It now takes a free
    one of SERVER_PORTS, below that range (its metrics endpoint too); a taken one is passed over,
    and with every try taken, any free port."""
    import socket
    import urllib.request
    from pathlib import Path

    from memserver.loop import LoopThread
    from memserver.server import metrics, rayutil
    from memserver.server.grpcserver import serve_on

    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 0
    if low <= rayutil.SERVER_PORTS.start + rayutil.PORT_TRIES:
        pytest.skip(f"this machine's ephemeral ports start at {low or 'an unknown port'}: SERVER_PORTS has no room")
    loop = LoopThread("test-serve-ports")
    server, port = serve_on(loop, lambda s: None, [], "127.0.0.1", state=tmp_path / "port.json")
    try:
        assert port in rayutil.SERVER_PORTS and port < low
        with socket.socket() as squatter, monkeypatch.context() as m:
            squatter.bind(("127.0.0.1", 0))
            squatter.listen()
            taken = squatter.getsockname()[1]
            m.setattr(rayutil, "server_ports", lambda: [port, taken, 0])  # both held
            other, at = serve_on(loop, lambda s: None, [], "127.0.0.1")
            assert at not in (port, taken)
            loop.call(other.stop(None))
    finally:
        loop.call(server.stop(None))
        loop.stop()
    served = metrics.ServerMetrics(lambda: set())
    try:
        address = served.serve("127.0.0.1", tmp_path / "metrics.json")
        assert int(address.rsplit(":", 1)[1]) in rayutil.SERVER_PORTS
        assert urllib.request.urlopen(f"http://{address}/metrics", timeout=10).status == 200
    finally:
        served.stop()
    ports = rayutil.server_ports()
    assert len(ports) == rayutil.PORT_TRIES + 1 and ports[-1] == 0 and len(set(ports)) == len(ports)
    monkeypatch.setattr(rayutil, "_EPHEMERAL", tmp_path / "range")
    (tmp_path / "range").write_text("1024\t65535\n")  # a range that takes every port: any free one
    assert rayutil.server_ports() == [0]
    (tmp_path / "range").write_text("20001\t65535\n")  # ... all but 20000
    assert rayutil.server_ports() == [20000, 0]
    (tmp_path / "range").write_text("32768\t60999\n")
    monkeypatch.setattr(rayutil, "SERVER_PORTS", range(29499, 29511))  # torchrun's ports left out
    assert sorted(rayutil.server_ports()[:-1]) == [29499, 29510]


def test_a_shards_data_directory_serves_one_shard_at_a_time(tmp_path):
    """A second shard on a folder in use (a second `up` on the same --data-dir, with another
    MEMSERVER_HOME) is refused naming the holder: both appended to the same logs, which then
    read as damaged. A stopped shard lets go; a dead one's lock goes with its process."""
    import os
    import subprocess
    import sys

    from client import FailedPreconditionError
    from memserver.server.shard_actor import ShardActor
    from memserver.storage.store import ShardStore, check_data_dir

    shard = ShardActor(0, host="127.0.0.1", data_dir=str(tmp_path))
    try:
        with pytest.raises(FailedPreconditionError, match=f"data directory {tmp_path}/shard-0000 is in use by another "
                           f"memserver shard \\(pid {os.getpid()}\\)"):
            ShardStore(tmp_path, 0)
        ShardStore(tmp_path, 1).close()  # another shard's folder: free
        with pytest.raises(ValueError, match=f"shard-0000 is in use by another memserver shard \\(pid {os.getpid()}\\)"):
            check_data_dir(tmp_path, 2)  # what `up` asks before any shard starts
    finally:
        shard.stop()
    check_data_dir(tmp_path, 2)
    ShardStore(tmp_path, 0).close()  # let go at stop
    held = subprocess.Popen([sys.executable, "-c", "import sys, time; from memserver.storage.store import ShardStore; "
                             f"s = ShardStore({str(tmp_path)!r}, 0); print('held', flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert held.stdout.readline().strip() == "held"
        with pytest.raises(FailedPreconditionError, match=f"pid {held.pid}"):
            ShardStore(tmp_path, 0)
    finally:
        held.kill()
        held.wait()
    ShardStore(tmp_path, 0).close()  # the killed holder's lock went with it


def test_a_restarted_shard_waits_for_its_earlier_process_to_let_go_of_its_folder(tmp_path, caplog):
    """A partition longer than Ray's health checks: Ray starts the shard on another node while the
    old process lives on with its cut-off host, holding the folder. The restart refused, and Ray
    does not retry a failed start: the shard never served again (a walkthrough). A restart waits,
    saying so in the log, and takes the folder once the holder stops."""
    import logging
    import subprocess
    import sys
    import threading
    import time

    from memserver.storage.store import ShardStore

    held = subprocess.Popen([sys.executable, "-c", "import sys, time; from memserver.storage.store import ShardStore; "
                             f"s = ShardStore({str(tmp_path)!r}, 0); print('held', flush=True); sys.stdin.read()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert held.stdout.readline().strip() == "held"
        got: list[ShardStore] = []
        with caplog.at_level(logging.WARNING, logger="memserver.storage.store"):
            waiting = threading.Thread(target=lambda: got.append(ShardStore(tmp_path, 0, wait=True)))
            waiting.start()
            time.sleep(1.5)
            assert waiting.is_alive() and not got  # still held: it waits
            held.stdin.close()  # the earlier process stops
            waiting.join(timeout=30)
        assert got and f"is held by pid {held.pid}" in caplog.text
        got[0].close()
    finally:
        held.kill()
        held.wait()


def test_coordinator_rebuilds_its_catalog_and_follows_a_moved_shard():
    """The catalog from the shards' own descriptions (what a restarted coordinator does), and a
    restarted shard at a new address updates every table's shard map."""
    import asyncio

    from memserver.server.catalog import plan_table, validate_spec
    from memserver.server.coordinator import ControlPlaneServicer

    infos = [{"address": f"127.0.0.1:{7000 + j}", "node_id": "n", "pid": 10 + j} for j in range(3)]
    spec = validate_spec(pb.TableSpec(name="m", num_rows=10, dim=4, sharding=pb.COLS, num_shards=2), 3)
    stale = plan_table(spec, [infos[0], infos[1]])  # a dropped namesake's (older): its slice 1 left on shard 1
    info = plan_table(spec, [infos[2], infos[0]])  # placed on pool shards 2 and 0, in that order
    held = [[(spec.SerializeToString(), info.shards[1].SerializeToString(), 2)], [],
            [(spec.SerializeToString(), info.shards[0].SerializeToString(), 2)]]
    partial = validate_spec(pb.TableSpec(name="half", num_rows=10, dim=4, num_shards=2), 3)
    held[1].append((partial.SerializeToString(), plan_table(partial, infos[:2]).shards[0].SerializeToString(), 2))
    assert stale.layout_id < info.layout_id
    held[1].append((spec.SerializeToString(), stale.shards[1].SerializeToString(), 2))
    servicer = ControlPlaneServicer([None] * 3, infos)
    servicer.recover_catalog(held)
    assert list(servicer.tables) == ["m"]  # "half" lost a slice: left out, with an error logged
    assert servicer.placement["m"] == [2, 0]  # the stale slice of another layout took no index of it
    assert servicer.tables["m"].layout_id == info.layout_id
    assert [s.address for s in servicer.tables["m"].shards] == ["127.0.0.1:7002", "127.0.0.1:7000"]
    epoch = servicer.epoch
    moved = {"address": "127.0.0.1:7999", "node_id": "n", "pid": 99}
    asyncio.run(servicer.shard_restarted(0, moved, [{"table": "m", "from": "its log", "wal": True, "checkpoint": ""}]))
    assert [s.address for s in servicer.tables["m"].shards] == ["127.0.0.1:7002", "127.0.0.1:7999"]
    assert servicer.tables["m"].shards[1].pid == 99 and servicer.epoch == epoch + 1


def test_of_two_whole_layouts_of_a_name_the_catalog_keeps_the_newer():
    """A drop that missed a shard (down at the time) leaves a whole one-shard layout there; a create
    of the name then makes another. A coordinator rebuilding its catalog kept neither (random
    layout ids cannot say which is newer); it keeps the newer now, whatever order the shards
    describe them in, and dropping the table drops the older one's slice too (it came back as
    the table at the next rebuild). A newer layout with a slice missing is not stood in for by
    an older whole one, and ids made before they told time (random, most far in the future)
    keep the old rule: of several whole layouts, none."""
    import asyncio
    import secrets

    from memserver.server.catalog import plan_table, validate_spec
    from memserver.server.coordinator import ControlPlaneServicer

    dropped: list[int] = []

    class Shard:  # a Ray actor handle's shape: handle.method.remote(...) is awaited
        def __init__(self, j):
            shard = self

            class drop_table:  # noqa: N801
                @staticmethod
                async def remote(name):
                    dropped.append(shard.j)
                    return True
            self.j, self.drop_table = j, drop_table

    infos = [{"address": f"127.0.0.1:{7000 + j}", "node_id": "n", "pid": 10 + j} for j in range(3)]
    spec = validate_spec(pb.TableSpec(name="w", num_rows=10, dim=4, num_shards=1), 3)
    old, new = plan_table(spec, [infos[1]]), plan_table(spec, [infos[0]])
    assert old.layout_id < new.layout_id
    for order in ((0, 1), (1, 0)):
        held = [[(spec.SerializeToString(), (new if j == 0 else old).shards[0].SerializeToString(), 1)] for j in order]
        servicer = ControlPlaneServicer([Shard(j) for j in range(2)], [infos[j] for j in order])
        servicer.recover_catalog(held)
        assert servicer.tables["w"].layout_id == new.layout_id and servicer.placement["w"] == [order.index(0)]
        dropped.clear()
        asyncio.run(servicer._drop("w"))
        assert sorted(dropped) == [0, 1]  # the older layout's shard too
    two = validate_spec(pb.TableSpec(name="w", num_rows=10, dim=4, num_shards=2), 3)
    newer = plan_table(two, infos[1:3])  # its slice 1 (on shard 2) missing
    held = [[(spec.SerializeToString(), old.shards[0].SerializeToString(), 1)],
            [(two.SerializeToString(), newer.shards[0].SerializeToString(), 2)], []]
    servicer = ControlPlaneServicer([Shard(j) for j in range(3)], infos)
    servicer.recover_catalog(held)
    assert "w" not in servicer.tables
    legacy = [secrets.randbits(63) | 1 << 62 for _ in range(2)]  # (from the year 2248 on, as time-based ids)
    held = [[(spec.SerializeToString(), pb.ShardInfo(index=0, layout_id=lid).SerializeToString(), 1)] for lid in legacy]
    servicer = ControlPlaneServicer([Shard(j) for j in range(2)], infos[:2])
    servicer.recover_catalog(held)
    assert "w" not in servicer.tables
    made = [plan_table(spec, [infos[0]]).layout_id for _ in range(1000)]  # many in one millisecond
    assert made == sorted(set(made)) and made[-1] < 1 << 63
    import time

    ahead = (time.time_ns() // 1_000_000 + 3_600_000) << 20  # made an hour "later": the clock stepped back since
    held = [[(spec.SerializeToString(), pb.ShardInfo(index=0, layout_id=ahead).SerializeToString(), 1)], []]
    ControlPlaneServicer([Shard(j) for j in range(2)], infos[:2]).recover_catalog(held)
    assert plan_table(spec, [infos[0]]).layout_id > ahead  # (was below it: the stale one would win the next rebuild)


def test_a_failed_fsync_acknowledges_nothing_after_it(tmp_path, monkeypatch):
    import memserver.storage.wal as durable

    wal = WriteAheadLog(tmp_path)
    wal.durable(wal.append(PUSH_GRADIENTS, b"ok")).result(10)

    def broken(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(durable.os, "fdatasync", broken)
    with pytest.raises(OSError, match="Input/output"):
        wal.durable(wal.append(PUSH_GRADIENTS, b"lost")).result(10)
    assert wal.failed is not None
    with pytest.raises(OSError, match="failed earlier"):
        wal.append(PUSH_GRADIENTS, b"refused")
    monkeypatch.undo()
    wal.close()


def test_interrupted_checkpoints_never_push_out_the_last_complete_one(tmp_path):
    """The log before the last complete checkpoint is deleted, so that checkpoint must stay in the
    shard's record however many interrupted ones (no manifest) follow it."""
    from memserver.server.catalog import plan_table, validate_spec
    from memserver.server.shard_actor import ShardActor

    spec = validate_spec(pb.TableSpec(name="m", num_rows=32, dim=4, optimizer=pb.OptimizerSpec(name="sgd", lr=0.5),
                                      sharding=pb.ROWS, wal=True), 1)
    shard = ShardActor(0, host="127.0.0.1", data_dir=str(tmp_path / "data"))
    shard.create_table(spec.SerializeToString(), plan_table(spec, [shard.info()]).shards[0].SerializeToString(), 1)
    rng = np.random.default_rng(1)
    with grpc.insecure_channel(shard.address) as ch:
        stub = pb_grpc.DataPlaneStub(ch)
        seq = 0
        for step in range(1, 7):
            for _ in range(3):
                seq += 1
                _push(stub, "m", rng.integers(0, 32, 8), rng.normal(size=(8, 4)).astype(np.float32), seq)
            step_dir = tmp_path / "ck" / f"step-{step:010d}"
            shard.checkpoint_table("m", str(step_dir / "m" / "shard-0000.pt"), step)
            if step <= 2:  # complete; steps 3-6 are interrupted (no manifest)
                (step_dir / "manifest.json").write_text("{}")
        rows = decode(stub.Lookup(pb.LookupRequest(table="m", ids=encode(torch.arange(32)))).rows, "rows").clone()
    shard.stop()
    again = ShardActor(0, host="127.0.0.1", data_dir=str(tmp_path / "data"))
    assert again.servicer.tables["m"].recovered_from == "checkpoint step 2 + 12 logged writes"
    with grpc.insecure_channel(again.address) as ch:
        got = decode(pb_grpc.DataPlaneStub(ch).Lookup(pb.LookupRequest(table="m", ids=encode(torch.arange(32)))).rows, "rows")
    torch.testing.assert_close(got, rows, rtol=0, atol=0)
    again.stop()


def test_the_coordinator_waits_for_a_shard_still_finishing_its_restart():
    """A restarted shard tells the coordinator it is back from inside its __init__; Ray refuses
    calls to it until that returns (ActorUnavailableError). The coordinator's call to it (telling
    it which slice it lost) is sent again until the actor takes it, within a bound."""
    import asyncio

    import ray

    from memserver.server.coordinator import _when_ready

    tries = []

    async def call():
        tries.append(1)
        if len(tries) < 3:
            raise ray.exceptions.ActorUnavailableError("The actor is restarting.", None)
        return "marked"

    assert asyncio.run(_when_ready(call)) == "marked" and len(tries) == 3

    async def never():
        raise ray.exceptions.ActorUnavailableError("The actor is restarting.", None)

    with pytest.raises(ray.exceptions.ActorUnavailableError):
        asyncio.run(_when_ready(never, timeout=0.3))


def test_a_table_that_cannot_be_recovered_is_listed_refused_and_its_files_kept(tmp_path):
    """`up` again on a data directory where one table's log is damaged inside (not a torn tail)
    and another's record is garbage: the other tables serve as before; the damaged ones stay
    known (status says why, naming the file; calls get DATA_LOSS), and their files stay as they
    are until the table is dropped: a create of that name is refused, not run over them (they
    vanished from the catalog, and a create deleted them)."""
    from client import DataLossError, MemoryClient, TableExistsError
    from memserver.cluster.inprocess import InProcessServer

    ids, grads = np.arange(8), np.ones((8, 4), np.float32)
    with InProcessServer(2, data_dir=str(tmp_path)) as server, MemoryClient(server.endpoint, timeout=30) as c:
        for name in ("ok", "bad", "rec", "one"):
            c.create_table(name, 64, 4, sharding="cols", wal=True, **({"num_shards": 1} if name == "one" else {}))
            for _ in range(6):
                c.push_gradients(name, ids, grads)
        rows = c.lookup("ok", np.arange(64))
        one_shard = server.coordinator.servicer.placement["one"][0]
    (tmp_path / f"shard-{one_shard:04d}" / "one" / "table.json").write_text("[]")  # its only slice's record
    import shutil
    shutil.copytree(tmp_path / "shard-0000" / "ok", tmp_path / "shard-0000" / "ok (copy)")  # an operator's copy
    seg = sorted((tmp_path / "shard-0001" / "bad").glob("wal-*.log"))[-1]
    data = bytearray(seg.read_bytes())
    data[len(data) // 3 : len(data) // 3 + 16] = bytes(16)  # inside the second record
    seg.write_bytes(bytes(data))
    (tmp_path / "shard-0000" / "rec" / "table.json").write_text("garbage{")

    with InProcessServer(2, data_dir=str(tmp_path)) as server, \
            MemoryClient(server.endpoint, timeout=30, retry_seconds=0) as c:
        np.testing.assert_array_equal(c.lookup("ok", np.arange(64)), rows)
        assert "bad" in [t.name for t in c.list_tables()]  # kept in the catalog: its other slice is fine
        why = {(s.index, t.table): t.unavailable for s in c.status().shards for t in s.tables}
        assert f"could not recover its slice from {tmp_path / 'shard-0001' / 'bad'}: RuntimeError: write-ahead log " \
               f"{seg}: damaged record at byte" in why[(1, "bad")]
        assert "its record" in why[(0, "rec")] and "cannot be read" in why[(0, "rec")]
        with pytest.raises(DataLossError, match="could not recover its slice"):
            c.lookup("bad", np.arange(4))
        for name in ("bad", "rec", "one"):
            with pytest.raises(TableExistsError):
                c.create_table(name, 16, 4)
        assert seg.read_bytes() == bytes(data) and (tmp_path / "shard-0000" / "rec" / "table.json").exists()
        with pytest.raises(DataLossError, match="could not recover its slice"):  # not "does not exist"
            c.checkpoint(str(tmp_path / "ck"), step=1, tables=["ok", "bad"])
        with pytest.raises(DataLossError, match="nothing was written: checkpoint the other tables by name"):
            c.checkpoint(str(tmp_path / "ck"), step=1)  # every table: the lost ones stop it, saying how to save the others
        c.checkpoint(str(tmp_path / "ck"), step=1, tables=["ok"])
        for name in ("bad", "rec", "one"):  # dropped: their files go, and the name is free again
            c.drop_table(name)
            c.create_table(name, 16, 4)
        assert not seg.exists() and (tmp_path / "shard-0000" / "ok (copy)").exists()


@pytest.mark.parametrize("complete, tier", [(1, ""), (3, ""), (3, "disk")])
def test_a_damaged_checkpoint_is_passed_over_for_the_one_before_and_more_of_the_log(tmp_path, complete, tier):
    """The latest checkpoint's slice file has a damaged row when the shard starts again: a logged
    table comes back from the checkpoint before it (or, with none before it, from its start)
    and the log after that, which checkpoints keep, with every acknowledged write; status says
    which file was passed over. It was left lost, though nothing was missing. A table without a
    log has nothing to replay after an older checkpoint, so it stays lost. A disk table's files,
    opened by the attempt that failed, are made anew by the next."""
    from memserver.server.catalog import plan_table, validate_spec
    from memserver.server.shard_actor import ShardActor

    shard = ShardActor(0, host="127.0.0.1", data_dir=str(tmp_path / "data"))
    for name, wal in (("m", True), ("n", False)):
        spec = validate_spec(pb.TableSpec(name=name, num_rows=32, dim=4, optimizer=pb.OptimizerSpec(name="adagrad", lr=0.5),
                                          sharding=pb.ROWS, wal=wal, tier=tier, cache_bytes=1024 if tier else 0), 1)
        shard.create_table(spec.SerializeToString(), plan_table(spec, [shard.info()]).shards[0].SerializeToString(), 1)
    rng = np.random.default_rng(2)
    with grpc.insecure_channel(shard.address) as ch:
        stub = pb_grpc.DataPlaneStub(ch)
        seq = 0
        for step in range(1, complete + 1):
            for _ in range(3):
                seq += 1
                for name in ("m", "n"):
                    _push(stub, name, rng.integers(0, 32, 8), rng.normal(size=(8, 4)).astype(np.float32), seq)
            for name in ("m", "n"):
                shard.checkpoint_table(name, str(tmp_path / "ck" / f"step-{step:010d}" / name / "shard-0000.pt"), step)
            (tmp_path / "ck" / f"step-{step:010d}" / "manifest.json").write_text("{}")
        for _ in range(2):
            seq += 1
            _push(stub, "m", rng.integers(0, 32, 8), rng.normal(size=(8, 4)).astype(np.float32), seq)
        rows = decode(stub.Lookup(pb.LookupRequest(table="m", ids=encode(torch.arange(32)))).rows, "rows").clone()
    shard.stop()
    rows_of = "records" if tier else "weight"  # (a disk table saves its records as they are in its file)
    for name in ("m", "n"):
        path = tmp_path / "ck" / f"step-{complete:010d}" / name / "shard-0000.pt"
        blob = bytearray(path.read_bytes())
        saved = torch.load(path, weights_only=True)["state"][rows_of]
        at = bytes(blob).find(saved.numpy().tobytes())  # the whole tensor
        assert at > 0
        blob[at + 7 * saved[0].numel() * saved.element_size() + 1] ^= 0x04  # row 7
        path.write_bytes(bytes(blob))

    again = ShardActor(0, host="127.0.0.1", data_dir=str(tmp_path / "data"))
    before = f"checkpoint step {complete - 1}" if complete > 1 else "initial values"
    assert again.servicer.tables["m"].recovered_from == (
        f"{before} + 5 logged writes (checkpoint step {complete} passed over: DATA_LOSS: checkpoint "
        f"slice file {tmp_path / 'ck' / f'step-{complete:010d}' / 'm' / 'shard-0000.pt'}: {rows_of} of row 7 does not "
        "match its checksum: the file is damaged)")
    with grpc.insecure_channel(again.address) as ch:
        got = decode(pb_grpc.DataPlaneStub(ch).Lookup(pb.LookupRequest(table="m", ids=encode(torch.arange(32)))).rows, "rows")
    torch.testing.assert_close(got, rows, rtol=0, atol=0)
    assert "n" not in again.servicer.tables and f"{rows_of} of row 7 does not match" in again.servicer.lost["n"]
    if tier:  # what the attempts that failed opened is closed: only the live slice's files stay open
        import os

        held = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                if os.path.exists(f"/proc/self/fd/{fd}")]
        assert sorted(p.rsplit("/", 3)[1:] for p in held if "/disk/" in p and str(tmp_path) in p) == [
            ["m", "disk", "rows.dat"]] * 2 + [["m", "disk", "stats.dat"]] * 2  # (a mapping holds its own copy)
    again.stop()


def test_a_checkpoint_file_removed_since_is_as_lost_as_a_damaged_one(tmp_path, caplog):
    """One slice file of the latest complete checkpoint is removed before the cluster starts
    again. That shard skipped it unsaid: a table without a log came back with that slice from the
    checkpoint before (rows mixing two steps) or, with none before, as its initial values. Now the
    slice is lost (DATA_LOSS naming the file), and a logged table comes back from the checkpoint
    before and more of its log, as from a damaged file, with every acknowledged write."""
    from client import DataLossError, MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    data, ck = str(tmp_path / "data"), tmp_path / "ck"
    with InProcessServer(2, data_dir=data) as server, MemoryClient(server.endpoint, timeout=30) as c:
        for name, wal in (("m", True), ("n", False)):
            c.create_table(name, 10, 4, sharding="cols", optimizer="sgd", wal=wal)
        for step, value in ((1, 3.0), (2, 5.0)):
            for name in ("m", "n"):
                c.write_rows(name, [1], np.full((1, 4), value, np.float32))
            c.checkpoint(str(ck), step=step)
        c.write_rows("m", [2], np.full((1, 4), 7.0, np.float32))
        rows = c.lookup("m", np.arange(10))
    gone = ck / "step-0000000002" / "n" / "shard-0001.pt"
    gone.unlink()
    (ck / "step-0000000002" / "m" / "shard-0001.pt").unlink()
    with InProcessServer(2, data_dir=data) as server, MemoryClient(server.endpoint, timeout=30, retry_seconds=0) as c:
        np.testing.assert_array_equal(c.lookup("m", np.arange(10)), rows)
        assert server.shards[1].servicer.tables["m"].recovered_from.startswith(
            "checkpoint step 1 + 2 logged writes (checkpoint step 2 passed over: DATA_LOSS: checkpoint slice file ")
        with pytest.raises(DataLossError, match=f"checkpoint slice file {gone} is gone"):
            c.lookup("n", [1])
    (ck / "step-0000000001" / "n" / "shard-0001.pt").unlink()  # (with none before it: lost all the same)
    with InProcessServer(2, data_dir=data) as server, MemoryClient(server.endpoint, timeout=30, retry_seconds=0) as c:
        with pytest.raises(DataLossError, match=f"checkpoint slice file {gone} is gone"):
            c.lookup("n", [1])
    # the checkpoints' folders removed whole (as an operator clears a checkpoint folder): the table
    # comes back from its start, as one that never completed a checkpoint, and each shard says so
    shutil.rmtree(ck)
    with caplog.at_level(logging.WARNING), InProcessServer(2, data_dir=data) as server:
        assert {t.recovered_from for s in server.shards for n, t in s.servicer.tables.items() if n == "n"} == {
            "initial values"}
    said = [r.getMessage() for r in caplog.records if "checkpoints (step" in r.getMessage()]
    steps = {(0, "m"): "1, 2", (0, "n"): "1, 2", (1, "m"): "1", (1, "n"): "1, 2"}  # (1, m: step 2 passed over above)
    assert sorted(said) == [f"shard {i}: table {n}: the folders of its later checkpoints (step {steps[i, n]}) are gone, "
                            "removed since or never completed: it comes back from its start" for i, n in sorted(steps)]


def test_a_plain_restore_does_not_run_over_a_lost_slices_files(tmp_path):
    """A table left out of the catalog because a shard's record of it cannot be read keeps its
    files for repair, and a create of the name is refused. A restore without replace dropped
    them (and restored over them); it is refused the same way now, and with replace it runs."""
    from client import MemoryClient, TableExistsError
    from memserver.cluster.inprocess import InProcessServer

    with InProcessServer(2, data_dir=str(tmp_path / "data")) as server, MemoryClient(server.endpoint, timeout=30) as c:
        c.create_table("rec", 64, 4, sharding="cols", wal=True)
        c.push_gradients("rec", np.arange(8), np.ones((8, 4), np.float32))
        c.checkpoint(str(tmp_path / "ck"), step=1)
        rows = c.lookup("rec", np.arange(64))
    record = tmp_path / "data" / "shard-0000" / "rec" / "table.json"
    record.write_text("garbage{")
    with InProcessServer(2, data_dir=str(tmp_path / "data")) as server, \
            MemoryClient(server.endpoint, timeout=30, retry_seconds=0) as c:
        assert "rec" not in [t.name for t in c.list_tables()]
        with pytest.raises(TableExistsError, match="a new table of that name would delete them"):
            c.restore(str(tmp_path / "ck"), tables=["rec"])
        assert record.read_text() == "garbage{"
        c.restore(str(tmp_path / "ck"), tables=["rec"], replace=True)
        np.testing.assert_array_equal(c.lookup("rec", np.arange(64)), rows)


def _two_checkpoints_and_two_writes(tmp_path):
    """A logged table on a new shard: checkpoints at steps 1 and 2 (complete), two writes after.
    Returns the shard (stopped), the rows as acknowledged, and step 2's slice file damaged."""
    from memserver.server.catalog import plan_table, validate_spec
    from memserver.server.shard_actor import ShardActor

    shard = ShardActor(0, host="127.0.0.1", data_dir=str(tmp_path / "data"))
    spec = validate_spec(pb.TableSpec(name="m", num_rows=32, dim=4, optimizer=pb.OptimizerSpec(name="adagrad", lr=0.5),
                                      sharding=pb.ROWS, wal=True), 1)
    shard.create_table(spec.SerializeToString(), plan_table(spec, [shard.info()]).shards[0].SerializeToString(), 1)
    rng, seq = np.random.default_rng(2), 0
    with grpc.insecure_channel(shard.address) as ch:
        stub = pb_grpc.DataPlaneStub(ch)
        for step in (1, 2, None):
            for _ in range(3 if step else 2):
                seq += 1
                _push(stub, "m", rng.integers(0, 32, 8), rng.normal(size=(8, 4)).astype(np.float32), seq)
            if step:
                shard.checkpoint_table("m", str(tmp_path / "ck" / f"step-{step:010d}" / "m" / "shard-0000.pt"), step)
                (tmp_path / "ck" / f"step-{step:010d}" / "manifest.json").write_text("{}")
        rows = decode(stub.Lookup(pb.LookupRequest(table="m", ids=encode(torch.arange(32)))).rows, "rows").clone()
    shard.stop()
    path = tmp_path / "ck" / "step-0000000002" / "m" / "shard-0000.pt"
    blob = bytearray(path.read_bytes())
    at = bytes(blob).find(torch.load(path, weights_only=True)["state"]["weight"].numpy().tobytes())
    blob[at + 7 * 16 + 1] ^= 0x04
    path.write_bytes(bytes(blob))
    return rows


def _lookup(shard):
    with grpc.insecure_channel(shard.address) as ch:
        return decode(pb_grpc.DataPlaneStub(ch).Lookup(pb.LookupRequest(table="m", ids=encode(torch.arange(32)))).rows,
                      "rows").clone()


def test_no_fallback_where_the_log_after_the_damaged_checkpoint_is_gone(tmp_path):
    """The segment the damaged checkpoint started (its writes after it) is gone too: replaying
    from the older checkpoint ends where that segment began, which looks like a whole log. It
    served rows without the two writes, with no error; the slice stays lost now, as it is
    (loudly) when the checkpoint is intact."""
    from memserver.server.shard_actor import ShardActor

    _two_checkpoints_and_two_writes(tmp_path)
    sorted((tmp_path / "data" / "shard-0000" / "m").glob("wal-*.log"))[-1].unlink()
    again = ShardActor(0, host="127.0.0.1", data_dir=str(tmp_path / "data"))
    assert "m" not in again.servicer.tables and "weight of row 7 does not match" in again.servicer.lost["m"]
    again.stop()


def test_after_a_fallback_the_next_checkpoint_keeps_the_log_it_needs(tmp_path):
    """After a fallback the damaged checkpoint stayed in the shard's record: the next checkpoint
    (here one whose manifest is never written) took it for the previous complete one and deleted
    the log from the one the slice came back from, so the next start lost the table. The damaged
    entry leaves the record now: a second start comes back the same way, with the later writes."""
    from memserver.server.shard_actor import ShardActor

    rows = _two_checkpoints_and_two_writes(tmp_path)
    again = ShardActor(0, host="127.0.0.1", data_dir=str(tmp_path / "data"))
    assert again.servicer.tables["m"].recovered_from.startswith("checkpoint step 1 + 5 logged writes (checkpoint step 2 "
                                                               "passed over: ")
    torch.testing.assert_close(_lookup(again), rows, rtol=0, atol=0)
    with grpc.insecure_channel(again.address) as ch:
        _push(pb_grpc.DataPlaneStub(ch), "m", np.arange(8), np.ones((8, 4), np.float32), 99)
    rows = _lookup(again)
    again.checkpoint_table("m", str(tmp_path / "ck" / "step-0000000003" / "m" / "shard-0000.pt"), 3)  # no manifest
    again.stop()
    third = ShardActor(0, host="127.0.0.1", data_dir=str(tmp_path / "data"))
    assert third.servicer.tables["m"].recovered_from == "checkpoint step 1 + 6 logged writes"
    torch.testing.assert_close(_lookup(third), rows, rtol=0, atol=0)
    third.stop()


def test_a_shard_that_cannot_start_is_said_in_one_line():
    """A shard's constructor that raised (its data directory in use on another host) reached
    `up` as Ray's ActorDiedError traceback, past its one-line error."""
    import traceback

    from ray.exceptions import ActorDiedError, RayTaskError

    from client import FailedPreconditionError
    from memserver.cluster.launch import _why

    try:
        raise FailedPreconditionError("data directory /x/shard-0000 is in use by another memserver shard (pid 7)")
    except FailedPreconditionError as exc:
        err = RayTaskError("ShardActor.__init__", traceback.format_exc(), exc, proctitle="ray::ShardActor", pid=1,
                           ip="127.0.0.1")
    assert _why(ActorDiedError(err)) == "FAILED_PRECONDITION: data directory /x/shard-0000 is in use by another " \
                                        "memserver shard (pid 7)"
    assert _why(ActorDiedError()).startswith("The actor died unexpectedly")
    try:  # another error (a node that cannot read the generated TLS key): by its class and text, not Ray's line
        raise ValueError("TLS key file /home/run/x/tls/server-key.pem: No such file or directory")
    except ValueError as exc:
        err = RayTaskError("ShardActor.__init__", traceback.format_exc(), exc, proctitle="ray::ShardActor", pid=1,
                           ip="127.0.0.1")
    assert _why(ActorDiedError(err)) == "ValueError: TLS key file /home/run/x/tls/server-key.pem: No such file or directory"
