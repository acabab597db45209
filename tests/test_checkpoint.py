"""Checkpoints: consistent, atomic (manifest last), restorable into another number of shards."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from client import DataLossError, FailedPreconditionError, InvalidArgumentError, TableExistsError, TableNotFoundError

DIM = 8


def train_a_little(client, name, rng, steps=3, rows=60):
    for _ in range(steps):
        ids = rng.integers(0, rows, (10, 4))
        client.bag_backward(name, ids, rng.random((10, 4)).astype(np.float32), rng.normal(size=(10, DIM)).astype(np.float32))
        client.bag(name, ids, np.ones((10, 4), np.float32))


def state(client, name, rows=60):
    stats = client.slot_stats(name, np.arange(rows))
    return client.lookup(name, np.arange(rows)), stats["updates"], stats["hits"]


@pytest.mark.parametrize("sharding, saved_shards, restored_shards", [("rows", 1, 2), ("rows", 2, 1), ("cols", 2, 1), ("cols", 1, 2)])
def test_restore_equals_checkpoint_and_continues_identically(client, table_name, tmp_path, sharding, saved_shards, restored_shards):
    rng = np.random.default_rng(0)
    client.create_table(table_name, 60, DIM, sharding=sharding, optimizer="adam", lr=0.05, num_shards=saved_shards, seed=3)
    train_a_little(client, table_name, rng)
    r = client.checkpoint(str(tmp_path), step=7)
    assert r["step"] == 7 and table_name in r["tables"] and r["bytes"] > 0
    saved = state(client, table_name)
    # the original continues one step; remember where it ends
    ids = rng.integers(0, 60, (10, 4))
    w = rng.random((10, 4)).astype(np.float32)
    g = rng.normal(size=(10, DIM)).astype(np.float32)
    grad_a = client.bag_backward(table_name, ids, w, g)
    after_a = client.lookup(table_name, np.arange(60))
    # restore (into another number of shards) and replay the same step: Adam's moments came back too
    metas = client.restore(str(tmp_path), replace=True, num_shards=restored_shards, tables=[table_name])
    assert len(metas[0].shards) == restored_shards and metas[0].sharding == sharding
    restored = state(client, table_name)
    np.testing.assert_array_equal(restored[0], saved[0])
    np.testing.assert_array_equal(restored[1], saved[1])
    np.testing.assert_array_equal(restored[2], saved[2] + 0)  # reads by state() itself come after the save
    grad_b = client.bag_backward(table_name, ids, w, g)
    np.testing.assert_allclose(grad_b, grad_a, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(client.lookup(table_name, np.arange(60)), after_a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dropped", [(), (0, 1), (0,), (1,)], ids=["replaced", "new", "new-replaced", "replaced-new"])
def test_a_restore_of_several_tables_spreads_them_as_creates_do(client, table_name, tmp_path, dropped):
    """An operator's walkthrough: a restore with replace planned every table before it placed
    any, so every one started on the same shard (3 one-shard tables, made on 3 shards, all came
    back on one). Each starts on the next shard now, as consecutive creates do, whether it
    replaces a table or is new (placed from the map of its moment)."""
    names = [f"{table_name}-{i}" for i in range(2)]
    for name in names:
        client.create_table(name, 100, DIM, num_shards=1)
    made = {client.table(name).shards[0].address for name in names}
    assert len(made) == 2  # (the session's cluster has 2 shards)
    client.checkpoint(str(tmp_path), step=1, tables=names)
    for i in dropped:
        client.drop_table(names[i])
    metas = client.restore(str(tmp_path), replace=len(dropped) < 2, tables=names)
    assert len({m.shards[0].address for m in metas}) == 2, [m.shards[0].address for m in metas]


def test_a_restore_with_replace_keeps_to_each_tables_kind(client, table_name, tmp_path):
    """An operator's walkthrough: a restore with replace put a checkpoint's value table in the
    place of a live index table of its name (an index may have taken hours to build), where a
    create with replace refuses. Refused the same way (ALREADY_EXISTS), before anything is dropped:
    the restore's other tables and the index stay as they were."""
    from client import TableExistsError

    other = f"{table_name}-other"
    for name in (table_name, other):
        client.create_table(name, 10, DIM, optimizer="sgd", lr=1.0)
    client.checkpoint(str(tmp_path), step=1, tables=[table_name, other])
    client.write_rows(other, [1], np.full((1, DIM), 7.0, np.float32))
    client.drop_table(table_name)
    client.create_index(table_name, 4)
    client.add(table_name, np.arange(3), np.eye(3, 4, dtype=np.float32))
    try:
        with pytest.raises(TableExistsError, match=f"table '{table_name}' is an index table: a restore with replace "
                                                   "replaces only a value table of that name; drop it first "
                                                   rf"\(memserver drop-table {table_name}\) \(coordinator "):
            client.restore(str(tmp_path), replace=True, tables=[other, table_name])
        assert client.table(table_name, refresh=True).kind == "index"
        assert client.search(table_name, np.eye(1, 4, dtype=np.float32), k=1)[1].tolist() == [[0]]
        np.testing.assert_array_equal(client.lookup(other, [1]), np.full((1, DIM), 7.0))  # not restored either
    finally:
        client.drop_table(table_name)
    assert [m.kind for m in client.restore(str(tmp_path), replace=True, tables=[table_name])] == ["value"]  # once dropped


def test_interrupted_checkpoint_leaves_the_previous_one(client, table_name, tmp_path):
    client.create_table(table_name, 60, DIM, optimizer="sgd", lr=1.0)
    client.write_rows(table_name, [1], np.full((1, DIM), 3.0, np.float32))
    client.checkpoint(str(tmp_path), step=1, tables=[table_name])  # other tests' tables share the cluster
    client.write_rows(table_name, [1], np.full((1, DIM), 5.0, np.float32))
    client.checkpoint(str(tmp_path), step=2, tables=[table_name])
    # a crash during step 3's checkpoint: slice files written, no manifest
    broken = tmp_path / "step-0000000003" / table_name
    broken.mkdir(parents=True)
    (broken / "shard-0000.pt").write_bytes(b"half a file")
    client.write_rows(table_name, [1], np.full((1, DIM), 9.0, np.float32))
    metas = client.restore(str(tmp_path), replace=True)
    assert [m.name for m in metas] == [table_name]
    np.testing.assert_array_equal(client.lookup(table_name, [1]), np.full((1, DIM), 5.0))
    client.restore(str(tmp_path), step=1, replace=True)
    np.testing.assert_array_equal(client.lookup(table_name, [1]), np.full((1, DIM), 3.0))


def test_a_checkpoint_given_no_step_takes_the_next_and_replaces_none(client, table_name, tmp_path):
    """`memserver checkpoint --dir D --table a` then `... --table b` (no --step) both wrote step 0:
    the second replaced the first, whose table was then not in any checkpoint. Each takes one past
    the last step there now (an interrupted one too), and every earlier one stays."""
    other = f"{table_name}-b"
    client.create_table(table_name, 60, DIM, optimizer="sgd", lr=1.0)
    client.create_table(other, 60, DIM, optimizer="sgd", lr=1.0)
    try:
        client.write_rows(table_name, [1], np.full((1, DIM), 3.0, np.float32))
        first = client.checkpoint(str(tmp_path), tables=[table_name])
        second = client.checkpoint(str(tmp_path), tables=[other])
        assert (first["step"], second["step"]) == (1, 2) and second["path"].endswith("step-0000000002")
        (tmp_path / "step-0000000007").mkdir()  # an interrupted checkpoint: no manifest, not replaced either
        assert client.checkpoint(str(tmp_path), tables=[other])["step"] == 8
        client.write_rows(table_name, [1], np.full((1, DIM), 5.0, np.float32))
        # no step: the latest checkpoint that holds the table asked (step 1), not the latest (8: the other's)
        assert [m.name for m in client.restore(str(tmp_path), replace=True, tables=[table_name])] == [table_name]
        np.testing.assert_array_equal(client.lookup(table_name, [1]), np.full((1, DIM), 3.0))
        with pytest.raises(TableNotFoundError, match=rf"no complete checkpoint in {tmp_path} holds table\(s\) "
                                                     rf"'nope' \(the latest, step-0000000008, holds {other}\)"):
            client.restore(str(tmp_path), replace=True, tables=["nope"])
        client.write_rows(table_name, [1], np.full((1, DIM), 5.0, np.float32))
        assert [m.name for m in client.restore(str(tmp_path), step=1, replace=True)] == [table_name]
        np.testing.assert_array_equal(client.lookup(table_name, [1]), np.full((1, DIM), 3.0))
        # a step given: as asked; one holding another table too is refused (it dropped it from the manifest)
        with pytest.raises(FailedPreconditionError, match=rf"step 2 in {tmp_path} holds a checkpoint of \['{other}'\] "
                                                          "too: one of .* alone at that step would leave them out"):
            client.checkpoint(str(tmp_path), step=2, tables=[table_name])
        assert [m.name for m in client.restore(str(tmp_path), step=2, replace=True)] == [other]  # still there
        client.checkpoint(str(tmp_path), step=2, tables=[table_name, other])  # together: replaced
        assert client.checkpoint(str(tmp_path), step=2, tables=[table_name, other])["step"] == 2
    finally:
        client.drop_table(other)


def test_a_retried_checkpoint_given_no_step_writes_one_step(memory_cluster, table_name, tmp_path):
    """The first attempt's checkpoint lands but its answer is lost (a deadline, a broken
    connection): the client asks again with the same request_id and the coordinator answers
    with that checkpoint; it wrote one more step per attempt before. A new call takes the next."""
    from client import MemoryClient, UnavailableError

    with MemoryClient(memory_cluster.endpoint, timeout=60, retry_seconds=20) as c:
        c.create_table(table_name, 60, DIM)
        real, attempts = c.aio._control, []

        async def lossy(method, request):
            got = await real(method, request)
            if method == "Checkpoint":
                attempts.append(request.request_id)
                if len(attempts) == 1:
                    raise UnavailableError("the answer was lost (test)")
            return got

        c.aio._control = lossy
        try:
            first = c.checkpoint(str(tmp_path), tables=[table_name])
            assert len(attempts) == 2 and attempts[0] == attempts[1] != ""
            assert first["step"] == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["step-0000000001"]
            assert c.checkpoint(str(tmp_path), tables=[table_name])["step"] == 2 and attempts[2] != attempts[0]
        finally:
            c.drop_table(table_name)


def test_a_checkpoint_retried_while_its_first_attempt_runs_waits_for_that_one(tmp_path):
    """The first attempt outlives the client's deadline (a slow disk): the retry, same request_id,
    waits for that checkpoint (shielded from the first handler's cancellation) instead of starting
    a second one, which, given no step, wrote the next step beside it."""
    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    with InProcessServer(1) as server, MemoryClient(server.endpoint, timeout=1.0, retry_seconds=30) as c:
        with MemoryClient(server.endpoint) as patient:  # (a busy machine's create can outlive 1 s)
            patient.create_table("t", 10, 4)
        coordinator = server.coordinator.servicer
        real, runs = coordinator._checkpoint, []

        async def slow(request):
            import asyncio

            runs.append(request.request_id)
            await asyncio.sleep(2.5)  # past the client's 1 s deadline: it retries meanwhile
            return await real(request)

        coordinator._checkpoint = slow
        got = c.checkpoint(str(tmp_path))
    assert len(runs) == 1 and got["step"] == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["step-0000000001"]


def test_the_coordinator_remembers_the_newest_checkpoint_calls_only(tmp_path):
    """The request_ids kept for retries are bounded (CHECKPOINT_CALLS): a long run's checkpoints
    do not grow the coordinator; a retry of a kept one is answered as its first attempt was."""
    import asyncio

    from memserver.api.v1 import memserver_pb2 as pb
    from memserver.server.coordinator import CHECKPOINT_CALLS, ControlPlaneServicer

    coord = ControlPlaneServicer([], [])

    async def calls():
        got = [await coord.Checkpoint(pb.CheckpointRequest(dir=str(tmp_path), request_id=f"c{i}"), None)
               for i in range(CHECKPOINT_CALLS + 5)]
        again = await coord.Checkpoint(pb.CheckpointRequest(dir=str(tmp_path), request_id=f"c{CHECKPOINT_CALLS}"), None)
        return got, again

    got, again = asyncio.run(calls())
    assert [r.step for r in got] == list(range(1, CHECKPOINT_CALLS + 6))
    assert list(coord.checkpoint_calls) == [f"c{i}" for i in range(5, CHECKPOINT_CALLS + 5)]
    assert again.step == CHECKPOINT_CALLS + 1 and len(list(tmp_path.iterdir())) == CHECKPOINT_CALLS + 5


def test_a_retry_after_a_coordinator_restart_gets_the_checkpoint_its_first_attempt_wrote(tmp_path):
    """The coordinator remembers calls in memory: one restarted between a checkpoint and its
    client's retry wrote the next step too. The manifest names the call that wrote it, so the
    retry gets that checkpoint; another call, or one whose first attempt wrote nothing, a new one."""
    import asyncio

    from memserver.api.v1 import memserver_pb2 as pb
    from memserver.server.coordinator import ControlPlaneServicer

    def call(request_id: str, step: int = 0) -> pb.CheckpointResponse:
        restarted = ControlPlaneServicer([], [])  # a fresh coordinator each time: it remembers no call
        return asyncio.run(restarted.Checkpoint(pb.CheckpointRequest(dir=str(tmp_path), step=step,
                                                                     request_id=request_id), None))

    first = call("a")
    again = call("a")
    assert (again.step, again.path) == (first.step, first.path) == (1, str(tmp_path / "step-0000000001"))
    assert [p.name for p in tmp_path.iterdir()] == ["step-0000000001"]
    assert call("b").step == 2 and call("a").step == 3  # not the newest step's call: a new checkpoint
    written = (tmp_path / "step-0000000007" / "manifest.json")
    assert call("c", step=7).step == 7
    created = json.loads(written.read_text())["created"]
    assert call("c", step=7).step == 7 and json.loads(written.read_text())["created"] == created  # not rewritten
    assert call("d", step=7).step == 7 and json.loads(written.read_text())["created"] != created


def test_a_request_id_reused_by_another_checkpoint_call_is_refused_naming_what_differs(tmp_path):
    """A call whose request_id an earlier call of another dir, step or table list had got that
    first call's answer (its path, step and tables) with OK, and nothing of its own was written:
    a client reading the answer believed its tables saved (a hunt). Refused INVALID_ARGUMENT,
    nothing written; a true retry (the same request) is still answered by its first attempt, also
    by a restarted coordinator, which finds the call in the manifest."""
    import asyncio

    from memserver.api.v1 import memserver_pb2 as pb
    from memserver.server.coordinator import ControlPlaneServicer

    coord = ControlPlaneServicer([], [])
    first = pb.CheckpointRequest(dir=str(tmp_path / "a"), step=3, request_id="X")
    got = asyncio.run(coord.Checkpoint(first, None))
    for field, value, says in [("dir", str(tmp_path / "b"), "dir '.*b' \\(the first: '.*a'\\)"),
                               ("step", 7, "step 7 \\(the first: 3\\)"),
                               ("tables", ["t"], r"tables \['t'\] \(the first: every table\)")]:
        other = pb.CheckpointRequest()
        other.CopyFrom(first)
        if field == "tables":
            other.tables[:] = value
        else:
            setattr(other, field, value)
        with pytest.raises(InvalidArgumentError, match=f"request_id: 'X' was used by another checkpoint call; this one "
                                                       f"asks for {says}: a retry repeats its call"):
            asyncio.run(coord.Checkpoint(other, None))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"] and [p.name for p in (tmp_path / "a").iterdir()] == [
        "step-0000000003"]
    assert asyncio.run(coord.Checkpoint(first, None)) == got  # a retry
    restarted = ControlPlaneServicer([], [])  # it remembers no call: the manifest names it
    with pytest.raises(InvalidArgumentError, match=r"tables \['t'\] \(the first: every table\)"):
        asyncio.run(restarted.Checkpoint(pb.CheckpointRequest(dir=first.dir, step=3, tables=["t"], request_id="X"), None))
    assert asyncio.run(restarted.Checkpoint(first, None)).path == got.path


def test_checkpoints_into_one_root_at_once_are_written_one_after_the_other(tmp_path):
    """Two checkpoints at once into one root, given no step, both took the next step (the folder
    is made by the first slice written) and each wrote the other's files under its own manifest.
    One at a time per root now: two steps, each complete; the lock is gone once both are done."""
    import asyncio

    from client import MemoryClient
    from memserver.api.v1 import memserver_pb2 as pb
    from memserver.cluster.inprocess import InProcessServer

    with InProcessServer(2) as server, MemoryClient(server.endpoint) as c:
        c.create_table("t", 60, DIM, num_shards=2)
        coordinator = server.coordinator

        async def both(step: int = 0) -> list[pb.CheckpointResponse]:
            return await asyncio.gather(*(coordinator.servicer.Checkpoint(
                pb.CheckpointRequest(dir=str(tmp_path), step=step, request_id=f"{step}-{i}"), None) for i in range(2)))

        assert sorted(r.step for r in coordinator.loop.call(both())) == [1, 2]
        assert [r.step for r in coordinator.loop.call(both(7))] == [7, 7]
        assert coordinator.servicer.writing == {}
        for step in (1, 2, 7):
            assert [m.name for m in c.restore(str(tmp_path), step=step, replace=True)] == ["t"]


def test_a_checkpoint_that_overlaps_a_replace_of_its_table_saves_no_slice_of_the_new_one(tmp_path, monkeypatch):
    """A hunt: a shard that took its checkpoint call late (busy) saved the table made anew
    meanwhile (create with replace), under the old table's spec: the checkpoint answered done
    and its restore gave rows of both tables. Each shard now saves only the incarnation the
    checkpoint planned: the late one refuses, nothing of the checkpoint is kept."""
    import threading

    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer
    from memserver.server.shard_actor import ShardActor

    save = ShardActor.checkpoint_table
    replaced = threading.Event()

    def late(self, *args, **kwargs):
        if self.index == 1:  # (a busy shard: its call runs once the table was made anew)
            assert replaced.wait(30)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(ShardActor, "checkpoint_table", late)
    with InProcessServer(2) as server, MemoryClient(server.endpoint, timeout=60) as c:
        c.create_table("u", 4, DIM, num_shards=2)  # (the replace then places the table as before)
        c.create_table("t", 10, DIM, sharding="rows", num_shards=2, seed=1, init_std=1.0)
        out: dict = {}

        def checkpoint() -> None:
            try:
                out["done"] = c.checkpoint(str(tmp_path), step=1, tables=["t"])
            except Exception as exc:  # noqa: BLE001 - said below
                out["error"] = exc

        th = threading.Thread(target=checkpoint)
        th.start()
        time.sleep(1.0)
        c.create_table("t", 10, DIM, sharding="rows", num_shards=2, seed=2, init_std=1.0, replace=True)
        replaced.set()
        th.join(60)
        assert isinstance(out.get("error"), FailedPreconditionError), out
        assert "made anew" in str(out["error"]) and "nothing of it written" in str(out["error"])
        with pytest.raises(InvalidArgumentError, match="no complete checkpoint of step 1"):  # (no manifest)
            c.restore(str(tmp_path), step=1, replace=True, tables=["t"])


def test_a_checkpoint_whose_slice_files_the_coordinator_cannot_see_is_refused_naming_shard_and_root(tmp_path,
                                                                                                     monkeypatch):
    """A hunt: with a checkpoint root local to each node (the shipped configs' data_dir, the
    default root) each shard wrote its slice on its own node and the coordinator wrote a manifest
    listing files it could not see: the checkpoint answered done and no restore could read it.
    A slice file not where the manifest is written (here: gone once written, as on another
    node) is refused by shard, node and path, saying the root must be shared; no manifest."""
    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer
    from memserver.server.shard_actor import ShardActor

    save = ShardActor.checkpoint_table

    def elsewhere(self, name, path, *args, **kwargs):
        out = save(self, name, path, *args, **kwargs)
        if self.index == 1:  # (written on its own node's disk: not here)
            os.rename(path, tmp_path / "other-node.pt")
        return out

    monkeypatch.setattr(ShardActor, "checkpoint_table", elsewhere)
    with InProcessServer(2) as server, MemoryClient(server.endpoint, retry_seconds=0) as c:
        c.create_table("t", 60, DIM, num_shards=2)
        root = tmp_path / "ckpt"
        with pytest.raises(FailedPreconditionError, match=r"shard 1 of table 't' \(node .*\).*shard-0001\.pt.*not found "
                                                          r"here.*storage every node shares \(.*--checkpoint-root"):
            c.checkpoint(str(root), step=1)
        assert not list(root.rglob("manifest.json"))
        with pytest.raises(InvalidArgumentError, match="no complete checkpoint of step 1"):
            c.restore(str(root), step=1, replace=True)


def test_a_failed_checkpoint_removes_the_files_it_wrote(tmp_path):
    """A checkpoint that filled the disk failed, and the slices written before it did stayed in a
    step folder no restore reads, holding the space a retry needed (a retry at another step,
    given none, failed again). They are removed, with the folders they leave empty; a file it
    did not write stays. On a real small disk: one slice fits, two do not."""
    from client import MemoryClient, ResourceExhaustedError
    from memserver.cluster.inprocess import InProcessServer
    from tests.smalldisk import small_disk

    with small_disk(tmp_path / "small", "1m") as mnt, InProcessServer(2) as server, \
            MemoryClient(server.endpoint) as c:
        c.create_table("t", 2000, 64, num_shards=2, sharding="rows", optimizer="adam")  # ~0.6 MiB a slice
        (mnt / "step-0000000003").mkdir()
        (mnt / "step-0000000003" / "notes.txt").write_text("mine")
        for step in (1, 2, 3):
            with pytest.raises(ResourceExhaustedError, match="the disk is full"):
                c.checkpoint(str(mnt), step=step)
        assert sorted(p.name for p in mnt.rglob("*")) == ["notes.txt", "step-0000000003"]
        c.drop_table("t")
        c.create_table("t", 1000, 64, num_shards=2, sharding="rows", optimizer="adam")  # both fit
        assert c.checkpoint(str(mnt))["step"] == 4


def test_a_checkpoint_whose_manifest_is_in_place_keeps_its_files_when_a_later_step_fails(tmp_path, monkeypatch):
    """A review: the manifest was renamed into place and then its folder's fsync failed (EIO):
    the cleanup of a failed checkpoint removed every slice file under a manifest that names
    them, so the latest step restored nothing. A step whose manifest is in place keeps them."""
    import errno

    import memserver.storage.fsutil as fsutil
    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    real = fsutil.fsync_dir

    def failing(path):
        if (Path(path) / "manifest.json").exists():
            raise OSError(errno.EIO, "Input/output error")
        return real(path)

    with InProcessServer(2) as server, MemoryClient(server.endpoint, retry_seconds=0) as c:
        c.create_table("t", 60, DIM, num_shards=2)
        c.write_rows("t", [1, 2], np.full((2, DIM), 3.0, np.float32))
        monkeypatch.setattr(fsutil, "fsync_dir", failing)
        with pytest.raises(FailedPreconditionError, match="Input/output error"):
            c.checkpoint(str(tmp_path), step=5)
        monkeypatch.undo()
        assert sorted(p.name for p in (tmp_path / "step-0000000005" / "t").iterdir()) == ["shard-0000.pt", "shard-0001.pt"]
        c.write_rows("t", [1, 2], np.full((2, DIM), 9.0, np.float32))
        c.restore(str(tmp_path), step=5, replace=True)
        np.testing.assert_array_equal(c.lookup("t", [1, 2]), np.full((2, DIM), 3.0))


def test_a_step_whose_manifest_cannot_be_read_is_written_again(client, table_name, tmp_path):
    """A damaged manifest at a step (an interrupted rewrite on a broken disk): the check of which
    tables that step holds read it and refused the new checkpoint; it is withdrawn and rewritten."""
    client.create_table(table_name, 60, DIM)
    (tmp_path / "step-0000000004").mkdir()
    (tmp_path / "step-0000000004" / "manifest.json").write_text("{not json")
    assert client.checkpoint(str(tmp_path), step=4, tables=[table_name])["tables"] == [table_name]
    assert [m.name for m in client.restore(str(tmp_path), step=4, replace=True)] == [table_name]


def test_a_checkpoint_the_disk_refuses_is_one_line_naming_the_path(client, table_name, tmp_path):
    """A directory that cannot be written (a file in the path, an immutable folder, a full disk)
    answered INTERNAL with the exception's class and a logged traceback, or through a shard
    Ray's whole RayTaskError: now FAILED_PRECONDITION (RESOURCE_EXHAUSTED for a full disk) with
    the error and the path."""
    from client import FailedPreconditionError

    client.create_table(table_name, 60, DIM)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(FailedPreconditionError, match=rf"Checkpoint: Not a directory \({tmp_path}/afile/ck/"):
        client.checkpoint(str(tmp_path / "afile" / "ck"), step=1, tables=[table_name])
    (tmp_path / "ck" / "step-0000000001").mkdir(parents=True)
    (tmp_path / "ck" / "step-0000000001" / table_name).write_text("x")  # where the shard writes its slice
    with pytest.raises(FailedPreconditionError, match=rf"Checkpoint: .* \({tmp_path}/ck/step-0000000001/{table_name}"):
        client.checkpoint(str(tmp_path / "ck"), step=1, tables=[table_name])


def test_a_failed_checkpoint_at_a_step_that_had_one_leaves_that_step_incomplete(client, table_name, tmp_path):
    """Written again at a step with a complete checkpoint, the slice files were replaced in place
    under the old manifest: when the rewrite failed, a restore of that step read the newer files
    of some slices as the old checkpoint. The old manifest now goes first: the step is
    incomplete until rewritten whole, and a restore of the latest takes the step before it."""
    client.create_table(table_name, 60, DIM, num_shards=2, sharding="rows", optimizer="sgd", lr=1.0)
    client.write_rows(table_name, [1, 2], np.full((2, DIM), 3.0, np.float32))
    client.checkpoint(str(tmp_path), step=5, tables=[table_name])
    client.write_rows(table_name, [1, 2], np.full((2, DIM), 5.0, np.float32))
    client.checkpoint(str(tmp_path), step=7, tables=[table_name])
    client.write_rows(table_name, [1, 2], np.full((2, DIM), 9.0, np.float32))
    step7 = tmp_path / "step-0000000007"
    (step7 / table_name / "shard-0001.pt").unlink()
    (step7 / table_name / "shard-0001.pt").mkdir()  # shard 1 cannot write its file: the rewrite fails
    with pytest.raises(Exception, match="shard-0001.pt"):
        client.checkpoint(str(tmp_path), step=7, tables=[table_name])
    assert not (step7 / "manifest.json").exists()
    with pytest.raises(InvalidArgumentError, match=r"step: no complete checkpoint of step 7 .*\(the complete ones "
                                                   r"there: 5\)"):  # (a hunt: said as dir's, naming no step there)
        client.restore(str(tmp_path), step=7, replace=True)
    client.restore(str(tmp_path), replace=True)  # the latest complete: step 5
    np.testing.assert_array_equal(client.lookup(table_name, [1, 2]), np.full((2, DIM), 3.0))


def test_a_restore_checks_every_file_before_it_drops_anything(client, table_name, tmp_path):
    """A restore with replace dropped the live table (its log too), then found a slice file
    missing; a checkpoint asked for a table twice listed its slices twice, and the restore added
    the Adagrad accumulator twice; a manifest listing some slices restored the others as zeros.
    Each is refused now, naming the checkpoint, and the live table is as it was."""
    import json

    client.create_table(table_name, 60, DIM, num_shards=2, sharding="rows", optimizer="adagrad", lr=0.1)
    client.push_gradients(table_name, np.arange(60), np.ones((60, DIM), np.float32))
    r = client.checkpoint(str(tmp_path / "twice"), step=1, tables=[table_name, table_name])
    assert r["tables"] == [table_name]
    manifest = json.loads((tmp_path / "twice/step-0000000001/manifest.json").read_text())
    assert len(manifest["tables"][table_name]["files"]) == 2
    acc = client.slot_stats(table_name, np.arange(60))
    client.restore(str(tmp_path / "twice"), replace=True, tables=[table_name])
    after = client.slot_stats(table_name, np.arange(60))
    for k in acc:
        if k != "last_update":
            np.testing.assert_array_equal(after[k], acc[k], err_msg=k)
    live = state(client, table_name)
    step = tmp_path / "twice/step-0000000001"
    good = (step / "manifest.json").read_text()
    files = manifest["tables"][table_name]["files"]
    spec = manifest["tables"][table_name]["spec"]
    for broken, says in (
            ({**manifest, "tables": {table_name: {"spec": spec, "files": files + files[:1]}}}, r"slices \[0, 0, 1\], not each"),
            ({**manifest, "tables": {table_name: {"spec": spec, "files": files[:1]}}}, r"slices \[0\], not each of its 2"),
            ({**manifest, "tables": {table_name: {"spec": spec, "files": []}}}, "without its slice files"),
            ({**manifest, "tables": {table_name: {"spec": "not base64!", "files": files}}}, "does not hold a table spec"),
            ({**manifest, "tables": [table_name]}, "not a manifest memserver wrote"),
            ({**manifest, "step": "x"}, "not a manifest memserver wrote")):
        (step / "manifest.json").write_text(json.dumps(broken))
        with pytest.raises(InvalidArgumentError, match=says):
            client.restore(str(tmp_path / "twice"), replace=True, tables=[table_name])
    (step / "manifest.json").write_text("{not json")
    with pytest.raises(InvalidArgumentError, match="cannot be read as a manifest"):
        client.restore(str(tmp_path / "twice"), replace=True)
    (step / "manifest.json").write_text(good)
    size, whole = (step / table_name / "shard-0000.pt").stat().st_size, (step / table_name / "shard-0000.pt").read_bytes()
    os.truncate(step / table_name / "shard-0000.pt", size // 2)  # the restore failed on a shard, the table dropped
    with pytest.raises(DataLossError, match=f"slice files are not as written: .*shard-0000.pt \\({size // 2:,} bytes, "
                                            f"the manifest says {size:,}\\)"):
        client.restore(str(tmp_path / "twice"), replace=True, tables=[table_name])
    (step / table_name / "shard-0000.pt").write_bytes(whole)
    blob = bytearray((step / table_name / "shard-0001.pt").read_bytes())
    blob[-64:] = bytes(64)  # the archive's directory, at the end: same size
    (step / table_name / "shard-0001.pt").write_bytes(bytes(blob))
    with pytest.raises(DataLossError, match="checkpoint slice file .*shard-0001.pt is damaged"):
        client.restore(str(tmp_path / "twice"), replace=True, tables=[table_name])
    (step / table_name / "shard-0001.pt").unlink()
    with pytest.raises(InvalidArgumentError, match=r"its slice files \[.*shard-0001.pt'\] are missing"):
        client.restore(str(tmp_path / "twice"), replace=True, tables=[table_name])
    values, updates, hits = state(client, table_name)  # nothing dropped
    np.testing.assert_array_equal(values, live[0])
    np.testing.assert_array_equal(updates, live[1])
    np.testing.assert_array_equal(hits, live[2] + 1)  # the reads of state() itself


def test_a_replace_from_a_checkpoint_with_a_damaged_row_leaves_the_live_table(client, table_name, tmp_path):
    """A restore checks each row as it copies it, after a replace dropped the live table: a damaged
    row there left neither table. The replace reads every checksum first now: DATA_LOSS naming
    the file, tensor and row, and the live table as it was."""
    rng = np.random.default_rng(5)
    client.create_table(table_name, 60, DIM, num_shards=2, sharding="rows", optimizer="adagrad", lr=0.1)
    train_a_little(client, table_name, rng)
    saved = client.lookup(table_name, np.arange(60))
    client.checkpoint(str(tmp_path / "c"), step=1, tables=[table_name])
    train_a_little(client, table_name, rng)
    live = state(client, table_name)
    path = tmp_path / "c/step-0000000001" / table_name / "shard-0001.pt"  # ids 1, 3, 5, ...: row 20 is id 41
    blob = bytearray(path.read_bytes())
    at = bytes(blob).find(saved[41].tobytes())
    assert at > 0
    blob[at + 3] ^= 0x01
    path.write_bytes(bytes(blob))
    with pytest.raises(DataLossError, match=f"checkpoint slice file {path}: weight of row 20 does not match its checksum"):
        client.restore(str(tmp_path / "c"), replace=True, tables=[table_name])
    for now, before in zip(state(client, table_name)[:2], live[:2]):  # (its hits count state's own lookups)
        np.testing.assert_array_equal(now, before)


def test_checkpoint_and_restore_errors(client, table_name, tmp_path):
    with pytest.raises(InvalidArgumentError, match=f"dir: {tmp_path}/nothing does not exist"):
        client.restore(str(tmp_path / "nothing"))  # (said "no complete checkpoint", as of an empty one)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidArgumentError, match="no complete checkpoint"):
        client.restore(str(tmp_path / "empty"))
    with pytest.raises(TableNotFoundError):
        client.checkpoint(str(tmp_path), tables=["no-such-table"])
    client.create_table(table_name, 10, 4)
    client.checkpoint(str(tmp_path), step=1, tables=[table_name])
    with pytest.raises(TableExistsError, match="replace"):
        client.restore(str(tmp_path))
    with pytest.raises(InvalidArgumentError, match="step 5"):
        client.restore(str(tmp_path), step=5)


# -- loading slice files, without a cluster ------------------------------------------------


def _save_table(directory, by_rows, num_shards, values, updates):
    """The slice files of a whole table (values [N, D], per-row updates) as its shards save them,
    and their entries (as in the manifest: the slice's place, the file)."""
    import torch

    from memserver.api.types import ShardLayout
    from memserver.storage.checkpoint import save_slice

    n, d = values.shape
    layout = ShardLayout(by_rows, n, d, num_shards)
    entries = []
    for i in range(num_shards):
        rows, (c0, c1) = torch.from_numpy(layout.global_rows(i)), layout.cols(i)
        meta = {"table": "m", "by_rows": by_rows, "index": i, "num_shards": num_shards, "num_rows": n, "dim": d,
                "col_start": c0, "col_end": c1}
        path = directory / f"shard-{i:04d}.pt"
        size = save_slice(path, meta, {"weight": values[rows, c0:c1].contiguous(), "updates": updates[rows]},
                          extra={"lsn": 7, "window": [i]})
        entries.append({"file": str(path), "bytes": size, **meta, "lsn": 7, "step": 1})
    return entries


def _load_table(entries, by_rows, num_shards, n, d, opened):
    """Load every slice of the table in a new sharding from `entries`: the whole table back, and
    per new slice what `opened` (filled by the test's torch.load) held after its load_into."""
    from types import SimpleNamespace

    import torch

    from memserver.api.types import ShardLayout
    from memserver.storage.checkpoint import load_into

    layout = ShardLayout(by_rows, n, d, num_shards)
    values, updates, opens = torch.zeros(n, d), torch.zeros(n, dtype=torch.int64), []
    for i in range(num_shards):
        rows, (c0, c1) = torch.from_numpy(layout.global_rows(i)), layout.cols(i)
        table = SimpleNamespace(weight=torch.zeros(len(rows), c1 - c0), updates=torch.zeros(len(rows), dtype=torch.int64))
        target = {"table": "m", "by_rows": by_rows, "index": i, "num_shards": num_shards, "num_rows": n, "dim": d,
                  "col_start": c0, "col_end": c1}
        opened.clear()
        load_into(table, target, entries, {})
        opens.append(list(opened))
        values[rows, c0:c1] = table.weight
        updates[rows] = table.updates
    return values, updates, opens


@pytest.mark.parametrize("old, new, needs", [
    (("cols", 4), ("cols", 2), [[0, 1], [2, 3]]),
    (("rows", 2), ("rows", 4), [[0], [1], [0], [1]]),
    (("rows", 4), ("rows", 2), [[0, 2], [1, 3]]),
    (("rows", 3), ("cols", 2), [[0, 1, 2], [0, 1, 2]]),
    (("cols", 2), ("rows", 3), [[0, 1], [0, 1], [0, 1]]),
])
def test_a_new_slice_opens_each_file_it_needs_once_and_no_other(tmp_path, monkeypatch, old, new, needs):
    import torch

    import memserver.storage.checkpoint as checkpoint

    n, d = 50, 12
    values = torch.randn(n, d)
    updates = torch.randint(0, 100, (n,))
    entries = _save_table(tmp_path, old[0] == "rows", old[1], values, updates)
    opened: list[int] = []
    real_load = checkpoint.torch.load

    def counting_load(f, *args, **kwargs):
        opened.append(int(str(f)[-7:-3]))  # shard-XXXX.pt
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "load", counting_load)
    restored, restored_updates, opens = _load_table(entries, new[0] == "rows", new[1], n, d, opened)
    monkeypatch.undo()
    assert opens == needs  # every file at most once, and only those holding part of the new slice
    torch.testing.assert_close(restored, values, rtol=0, atol=0)
    torch.testing.assert_close(restored_updates, updates, rtol=0, atol=0)


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 40), st.booleans(), st.integers(1, 7), st.booleans(), st.integers(1, 7), st.integers(1, 9))
def test_which_rows_a_restore_copies_equal_the_layouts_own_rule(n, src_rows, src_shards, dst_rows, dst_shards, chunk):
    """Per chunk of a source slice's rows, by arithmetic: the same (source row, target row) pairs
    and the same files skipped as mapping every row of the table (what restore did, in memory
    of the table's size)."""
    from memserver.api.types import ShardLayout
    from memserver.storage.checkpoint import _row_map, _shares_rows

    src, dst = ShardLayout(src_rows, n, 4, src_shards), ShardLayout(dst_rows, n, 4, dst_shards)
    for i in range(src_shards):
        for t in range(dst_shards):
            local_of = np.full(n, -1)
            local_of[dst.global_rows(t)] = np.arange(dst.rows(t))
            want = local_of[src.global_rows(i)]
            pairs = [_row_map(src, i, dst, t, s, s + chunk) for s in range(0, src.rows(i), chunk)]
            got_src = np.concatenate([p[0] for p in pairs]) if pairs else np.zeros(0, np.int64)
            got_dst = np.concatenate([p[1] for p in pairs]) if pairs else np.zeros(0, np.int64)
            assert got_src.tolist() == np.flatnonzero(want >= 0).tolist()
            assert got_dst.tolist() == want[want >= 0].tolist()
            assert _shares_rows(src, i, dst, t) == bool((want >= 0).any())


def test_a_restores_temporaries_do_not_grow_with_the_table(tmp_path):
    """Which rows go where is worked out a chunk at a time: restoring one slice of a 4-shard table
    allocates as much for a table 4x larger (it mapped every row of the table: ~22 bytes a row,
    on every shard, 178 MiB at 8M rows)."""
    import tracemalloc
    from types import SimpleNamespace

    import torch

    from memserver.api.types import ShardLayout
    from memserver.storage.checkpoint import load_into

    peaks = []
    for n in (1 << 19, 1 << 21):  # 2 and 8 chunks a slice
        d = tmp_path / str(n)
        d.mkdir()
        entries = _save_table(d, True, 4, torch.zeros(n, 1), torch.zeros(n, dtype=torch.int64))
        layout = ShardLayout(True, n, 1, 4)
        table = SimpleNamespace(weight=torch.zeros(layout.rows(0), 1), updates=torch.zeros(layout.rows(0), dtype=torch.int64))
        target = {"by_rows": True, "index": 0, "num_shards": 4, "num_rows": n, "dim": 1, "col_start": 0, "col_end": 1}
        tracemalloc.start()
        try:
            load_into(table, target, entries)
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    assert peaks[1] < peaks[0] + (1 << 20), peaks


def test_loading_a_slice_reads_only_what_it_needs(tmp_path):
    """A file is mapped, not read: a new slice holding a quarter of an old one reads far less than it."""
    import os

    import torch

    if not os.path.exists("/proc/self/io"):
        pytest.skip("needs /proc/self/io")

    def bytes_read():
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar"))

    n, d = 2048, 512  # one 4 MiB slice
    values = torch.randn(n, d)
    entries = _save_table(tmp_path, True, 1, values, torch.zeros(n, dtype=torch.int64))
    size = entries[0]["bytes"]
    from types import SimpleNamespace

    from memserver.api.types import ShardLayout
    from memserver.storage.checkpoint import load_into

    layout = ShardLayout(True, n, d, 4)
    for i in range(4):
        rows = torch.from_numpy(layout.global_rows(i))
        table = SimpleNamespace(weight=torch.zeros(len(rows), d))
        target = {"by_rows": True, "index": i, "num_shards": 4, "num_rows": n, "dim": d, "col_start": 0, "col_end": d}
        before = bytes_read()
        load_into(table, target, entries)
        read = bytes_read() - before
        assert read < size / 8, f"slice {i}: read {read} bytes of a {size}-byte file to load a quarter of it"
        torch.testing.assert_close(table.weight, values[rows], rtol=0, atol=0)


def test_own_checkpoint_extras_legacy_files_and_a_wrong_table(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import torch

    from memserver.api.errors import InvalidArgumentError as ServerInvalidArgument
    from memserver.storage.checkpoint import load_into

    values = torch.randn(6, 4)
    entries = _save_table(tmp_path, True, 2, values, torch.arange(6))
    table = SimpleNamespace(weight=torch.zeros(3, 4), updates=torch.zeros(3, dtype=torch.int64))
    target = {k: entries[1][k] for k in ("by_rows", "index", "num_shards", "num_rows", "dim", "col_start", "col_end")}
    extras: dict = {}
    load_into(table, target, [entries[1]], extras)  # a shard's own checkpoint
    assert extras == {"lsn": 7, "window": [1]}
    torch.testing.assert_close(table.weight, values[1::2], rtol=0, atol=0)
    # a file in torch's legacy format (cannot be mapped) still loads
    blob = torch.load(entries[0]["file"], weights_only=True)
    legacy = tmp_path / "legacy.pt"
    torch.save(blob, legacy, _use_new_zipfile_serialization=False)
    target0 = {**target, "index": 0}
    load_into(table, target0, [{"file": str(legacy)}])
    torch.testing.assert_close(table.weight, values[0::2], rtol=0, atol=0)
    import memserver.storage.checkpoint as checkpoint

    def whole(path):
        raise AssertionError(f"{path} read whole for checksums it does not have")

    monkeypatch.setattr(checkpoint, "_open_slice", whole)
    checkpoint.verify_files([{"file": str(legacy)}])  # a replace's check: nothing to check in it, not read
    monkeypatch.undo()
    with pytest.raises(ServerInvalidArgument, match="rows"):  # a file of another table, even one with no overlap
        load_into(table, target0, [{**entries[1], "num_rows": 8}])


def test_checkpoint_paths_stay_under_the_root(tmp_path):
    """Relative paths land under the root; absolute ones must lie in it; `..` and symlinks that
    lead out are refused (PERMISSION_DENIED) before anything is read or written."""
    from memserver.api.errors import InvalidArgumentError, PermissionDeniedError
    from memserver.storage.checkpoint import under_root

    root = tmp_path / "root"
    (root / "in").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (root / "link").symlink_to(tmp_path / "elsewhere")
    assert under_root(root, "run1") == root.resolve() / "run1"
    assert under_root(root, str(root / "in" / "x")) == root.resolve() / "in" / "x"
    assert under_root(root, str(root)) == root.resolve()
    for path in ("../escape", str(tmp_path / "elsewhere"), "/etc", "link/x", "in/../../x", str(tmp_path / "root2")):
        with pytest.raises(PermissionDeniedError, match="outside the cluster's checkpoint root"):
            under_root(root, path)
    for path in ("", "a\x00b"):
        with pytest.raises(InvalidArgumentError):
            under_root(root, path)
    assert under_root(None, "/anywhere") == Path("/anywhere")


def test_checkpoint_outside_the_root_is_refused_and_writes_nothing(client, table_name, tmp_path_factory):
    from client import PermissionDeniedError

    client.create_table(table_name, 8, 4)
    outside = tmp_path_factory.getbasetemp().parent / f"outside-{table_name}"
    try:
        with pytest.raises(PermissionDeniedError, match="checkpoint root"):
            client.checkpoint(str(outside), 1, [table_name])
        with pytest.raises(PermissionDeniedError, match="checkpoint root"):
            client.restore(str(outside), 1, replace=True)
        assert not outside.exists()
    finally:
        client.drop_table(table_name)


def test_a_manifest_cannot_lead_a_restore_out_of_its_directory(client, table_name, tmp_path):
    """The manifest names the folders files are read from: a key that is not its spec's table
    name (e.g. '../../elsewhere') is refused."""
    import json

    from client import InvalidArgumentError

    client.create_table(table_name, 8, 4)
    try:
        client.checkpoint(str(tmp_path), 1, [table_name])
        path = tmp_path / "step-0000000001" / "manifest.json"
        manifest = json.loads(path.read_text())
        manifest["tables"]["../../elsewhere"] = manifest["tables"].pop(table_name)
        path.write_text(json.dumps(manifest))
        with pytest.raises(InvalidArgumentError, match="not one memserver wrote"):
            client.restore(str(tmp_path), 1, replace=True)
    finally:
        client.drop_table(table_name)


def test_dry_run_checks_the_root_and_writes_nothing(client, table_name, tmp_path):
    """CheckpointRequest.dry_run (client.check_checkpoint_dir): the root's rule, nothing written."""
    from memserver.api.errors import PermissionDeniedError

    where = tmp_path / "dry"
    assert client.check_checkpoint_dir(str(where)) == str(where.resolve())
    assert not where.exists()
    with pytest.raises(PermissionDeniedError, match="outside the cluster's checkpoint root"):
        client.check_checkpoint_dir("/etc")


def test_a_step_rewritten_with_fewer_shards_removes_the_slices_it_no_longer_lists(tmp_path, caplog):
    """A step checkpointed again after a restore into fewer shards overwrote shard-0000 and -0001
    and left shard-0002 of the checkpoint it replaced: no manifest listed it, and it held its disk
    space for good. It is removed (and logged); a file memserver did not write stays."""
    import logging

    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    with InProcessServer(3) as server, MemoryClient(server.endpoint, timeout=30) as c:
        c.create_table("t", 60, DIM, num_shards=3, sharding="rows")
        c.write_rows("t", [1, 59], np.full((2, DIM), 3.0, np.float32))
        step = Path(c.checkpoint(str(tmp_path), step=1)["path"])
        assert sorted(p.name for p in (step / "t").iterdir()) == [f"shard-000{i}.pt" for i in range(3)]
        (step / "t" / "notes.txt").write_text("mine")
        c.restore(str(tmp_path), step=1, replace=True, num_shards=2)
        with caplog.at_level(logging.INFO, logger="memserver.server.coordinator"):
            c.checkpoint(str(tmp_path), step=1)
        listed = [Path(f["file"]).name for f in json.loads((step / "manifest.json").read_text())["tables"]["t"]["files"]]
        assert sorted(p.name for p in (step / "t").iterdir()) == sorted([*listed, "notes.txt"]) and len(listed) == 2
        assert "removed the 1 slice files of the checkpoint it replaced" in caplog.text
        c.restore(str(tmp_path), step=1, replace=True)
        np.testing.assert_array_equal(c.lookup("t", [1, 59]), np.full((2, DIM), 3.0))


def test_a_cols_table_restored_into_other_shards_reports_the_last_updates_it_reported(tmp_path):
    """A hunt: each cols slice keeps its own copy of a row's last update time (the moment that
    shard stepped it) and the table reports the counting slice's (shard 0); a restore into
    another number of shards copied every slice's in turn, the last file's winning, so the
    restored table reported other times (by milliseconds) than it did when checkpointed."""
    import time

    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    rng = np.random.default_rng(0)
    with InProcessServer(3) as server, MemoryClient(server.endpoint, timeout=30) as c:
        c.create_table("t", 101, 6, sharding="cols", optimizer="adam", lr=0.05, num_shards=3, seed=1)
        for _ in range(3):
            ids = rng.integers(0, 101, (7, 3))
            c.bag_backward("t", ids, rng.random((7, 3)).astype(np.float32), rng.normal(size=(7, 6)).astype(np.float32))
            time.sleep(0.05)
        for sh in server.shards[1:]:  # (the other slices stepped later: their copies say so)
            sl = sh.servicer.tables["t"]
            sl.table.last_update[sl.table.last_update > 0] += 5.0
        before = c.slot_stats("t", np.arange(101))["last_update"]
        assert (before > 0).sum() > 5
        c.checkpoint(str(tmp_path), step=1)
        for shards in (1, 2, 3):
            c.restore(str(tmp_path), step=1, replace=True, num_shards=shards)
            np.testing.assert_array_equal(c.slot_stats("t", np.arange(101))["last_update"], before)


def test_a_restore_says_the_open_steps_of_its_checkpoint_it_leaves_out(tmp_path, caplog):
    """A hunt: a sync step one trainer of two had committed was in the checkpoint; the restore
    (values only: sessions and open steps are a restart's) dropped it without a word, and the
    other trainer's commit of that step then waited for good. Each shard says what it left out."""
    import logging

    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    ids, w = np.array([[1, 2]]), np.ones((1, 2), np.float32)
    with InProcessServer(1) as server, MemoryClient(server.endpoint, timeout=30) as c:
        c.create_table("s", 10, 4, optimizer="sgd", lr=1.0, init_std=0.0, sync_workers=2)
        c.bag_backward("s", ids, w, np.ones((1, 4), np.float32), step=2, gather=True)
        c.commit_step("s", 2)  # (waits for the other trainer's)
        c.checkpoint(str(tmp_path), step=1)
        with caplog.at_level(logging.WARNING, logger="memserver.server.shard_actor"):
            c.restore(str(tmp_path), step=1, replace=True)
        assert "table s restored without the 1 open steps its checkpoint held (steps 2)" in caplog.text, caplog.text


def test_a_failed_rewrite_with_fewer_shards_removes_the_slices_of_the_step_it_replaced(tmp_path):
    """The same rewrite failing: its manifest withdrawn, the step's shard-0002 was no file a retry
    would overwrite or remove. The failure removes it with the slices it wrote."""
    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    with InProcessServer(3) as server, MemoryClient(server.endpoint, timeout=30) as c:
        c.create_table("t", 60, DIM, num_shards=3, sharding="rows")
        step = Path(c.checkpoint(str(tmp_path), step=1)["path"])
        c.restore(str(tmp_path), step=1, replace=True, num_shards=2)
        (step / "t" / "shard-0001.pt").unlink()
        (step / "t" / "shard-0001.pt").mkdir()  # shard 1 cannot write its file: the rewrite fails
        with pytest.raises(Exception, match="shard-0001.pt"):
            c.checkpoint(str(tmp_path), step=1)
        assert sorted(p.name for p in (step / "t").iterdir()) == ["shard-0001.pt"]  # (the folder in the way)


def test_a_checkpoint_refused_at_a_step_that_had_one_keeps_that_one(tmp_path):
    """A checkpoint written again at a step withdraws its manifest first; a rewrite that a shard
    refuses at once (a slice that lost its state: the DATA_LOSS that tells the operator to
    restore) then destroyed the checkpoint to restore from. The shards are asked first now."""
    from client import DataLossError, MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    with InProcessServer(2, data_dir=str(tmp_path)) as server, \
            MemoryClient(server.endpoint, timeout=30, retry_seconds=1) as c:
        c.create_table("a", 10, 4)
        c.create_table("b", 10, 4)
        ck = str(tmp_path / "ck")  # (no checkpoint root here: an absolute path, never the working directory)
        manifest = Path(c.checkpoint(ck, step=1)["path"]) / "manifest.json"
        server.shards[1].servicer.tables["b"].unavailable = "its log has a gap (a test)"
        with pytest.raises(DataLossError, match="its log has a gap"):
            c.checkpoint(ck, step=1)
        assert manifest.exists()
        assert [m.name for m in c.restore(ck, step=1, replace=True, tables=["a"])] == ["a"]


def test_a_replace_the_shards_cannot_make_leaves_the_table(tmp_path):
    """create_table(replace=True) of a disk table on shards without a data directory dropped the
    table, then the shards refused the new one; a restore with replace did the same. The shards
    are asked before the drop now."""
    from client import FailedPreconditionError, MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    with InProcessServer(2) as server, MemoryClient(server.endpoint, timeout=30, retry_seconds=1) as c:
        c.create_table("t", 10, 4)
        c.write_rows("t", [1], np.full((1, 4), 7.0, np.float32))
        with pytest.raises(FailedPreconditionError, match="a tier 'disk' table needs a data directory"):
            c.create_table("t", 8, 4, tier="disk", replace=True)
        np.testing.assert_array_equal(c.lookup("t", [1]), np.full((1, 4), 7.0))
        ck = str(tmp_path / "ck")
        c.checkpoint(ck, step=1)
        with pytest.raises(FailedPreconditionError, match="a tier 'disk' table needs a data directory"):
            c.restore(ck, replace=True, tier="disk")
        np.testing.assert_array_equal(c.lookup("t", [1]), np.full((1, 4), 7.0))


def _held_names(server) -> list[set[str]]:
    return [set(shard.servicer.tables) for shard in server.shards]


def test_calls_on_one_table_name_at_once_run_one_after_another(tmp_path):
    """A review: two creates with replace of one name at once both failed and the table was gone
    (each refused the other's placing); a replace beside a drop failed UNAVAILABLE, the table gone;
    a create beside a drop of a name that did not exist was refused ALREADY_EXISTS. Calls on one
    name now run one after another: each answers as it would alone, and the catalog and the
    shards agree."""
    import asyncio

    from client import AsyncMemoryClient, TableNotFoundError
    from memserver.cluster.inprocess import InProcessServer

    async def calls(server) -> None:
        async with AsyncMemoryClient(server.endpoint, retry_seconds=0, shm=False) as c:
            await c.create_table("t", 100, 8)
            both = await asyncio.gather(*(c.create_table("t", 100, 8, replace=True) for _ in range(2)))
            assert [m.name for m in both] == ["t", "t"] and [m.name for m in await c.list_tables()] == ["t"]
            await asyncio.gather(c.create_table("t", 100, 8, replace=True), c.drop_table("t"))  # both, in some order
            there = {m.name for m in await c.list_tables()}
            assert there in ({"t"}, set()) and _held_names(server) == [there, there]  # the catalog is what shards hold
            dropped, made = await asyncio.gather(c.drop_table("u"), c.create_table("u", 100, 8), return_exceptions=True)
            assert made.name == "u", made  # (it was refused ALREADY_EXISTS while the drop asked the shards)
            u = {m.name for m in await c.list_tables()} & {"u"}  # the drop first (NOT_FOUND), or after the create
            assert u == ({"u"} if isinstance(dropped, TableNotFoundError) else set()), dropped
            assert [held & {"u"} for held in _held_names(server)] == [u, u]
            servicer = server.coordinator.servicer
            assert not servicer.naming and not servicer.pending and not servicer.replacing  # nothing left held

    with InProcessServer(2, data_dir=str(tmp_path)) as server:
        asyncio.run(calls(server))


def test_an_index_replaced_while_it_is_trained_is_trained_on_no_shard_or_every_one(tmp_path, monkeypatch):
    """A review: TrainIndex installed its quantizer on the shards of the table as it was when it
    began; an index replaced meanwhile (on more shards) came out trained on one shard, and a
    second TrainIndex was refused "trained already". The install and the replace run one after the
    other, and the training installs nothing on an index made anew meanwhile (refused, saying so):
    the new index is trained on no shard, and can be."""
    import asyncio

    from client import AsyncMemoryClient
    from memserver.cluster.inprocess import InProcessServer
    from memserver.core.index import VectorIndex

    train = VectorIndex.train_template

    def slow(*args, **kwargs):  # (a large sample's training)
        time.sleep(1.5)
        return train(*args, **kwargs)

    monkeypatch.setattr(VectorIndex, "train_template", staticmethod(slow))
    sample = np.random.default_rng(0).normal(size=(2000, 16)).astype(np.float32)

    async def calls(server) -> None:
        async with AsyncMemoryClient(server.endpoint, retry_seconds=0, shm=False, timeout=60) as c:
            await c.create_index("ix", 16, index_factory="IVF8,Flat", num_shards=1)

            async def replace():
                await asyncio.sleep(0.5)  # while it trains
                return await c.create_index("ix", 16, index_factory="IVF8,Flat", num_shards=2, replace=True)

            trained, _ = await asyncio.gather(c.train_index("ix", sample), replace(), return_exceptions=True)
            assert isinstance(trained, FailedPreconditionError) and "made anew while it was trained" in str(trained)
            assert [shard.servicer.tables["ix"].table.is_trained for shard in server.shards] == [False, False]
            await c.train_index("ix", sample)
            assert [shard.servicer.tables["ix"].table.is_trained for shard in server.shards] == [True, True]

    with InProcessServer(2, data_dir=str(tmp_path)) as server:
        asyncio.run(calls(server))


def test_a_drop_of_an_index_being_trained_is_not_held_by_the_training(tmp_path, monkeypatch):
    """A hunt: TrainIndex held the name's lock while it trained (bounded by its sample, one
    message, but not in time: the factory's work), so a DropTable of the name waited behind it
    without a word, past its own deadline. The training holds no lock: the drop is done at once,
    and the training, finding its index gone, installs nothing and says so."""
    import asyncio

    from client import AsyncMemoryClient
    from memserver.cluster.inprocess import InProcessServer
    from memserver.core.index import VectorIndex

    train = VectorIndex.train_template

    def slow(*args, **kwargs):  # (a large sample's training)
        time.sleep(4)
        return train(*args, **kwargs)

    monkeypatch.setattr(VectorIndex, "train_template", staticmethod(slow))
    sample = np.random.default_rng(0).normal(size=(2000, 16)).astype(np.float32)

    async def calls(server) -> None:
        async with AsyncMemoryClient(server.endpoint, retry_seconds=0, shm=False, timeout=60) as c:
            await c.create_index("ix", 16, index_factory="IVF8,Flat", num_shards=2)
            training = asyncio.ensure_future(c.train_index("ix", sample))
            await asyncio.sleep(0.5)  # while it trains
            t0 = time.monotonic()
            await c.drop_table("ix")
            assert time.monotonic() - t0 < 2, "the drop waited for the training"
            # the index made anew is trained at once: the dropped one's training, still running, is another's
            # (a review: refused "being trained by another call" until that one ended)
            await c.create_index("ix", 16, index_factory="IVF8,Flat", num_shards=2)
            again = asyncio.ensure_future(c.train_index("ix", sample))
            with pytest.raises(FailedPreconditionError, match=r"index 'ix' was dropped or made anew while it was "
                                                              r"trained \(\d+\.\ds\): nothing was installed"):
                await training
            assert (await again)["sample_rows"] == len(sample)
            servicer = server.coordinator.servicer
            assert not servicer.naming and not servicer.holding and not servicer.training

    with InProcessServer(2, data_dir=str(tmp_path)) as server:
        asyncio.run(calls(server))


def test_a_create_its_caller_gave_up_on_is_made_whole(tmp_path, monkeypatch):
    """A review: a create whose client's deadline passed while a shard made its slice (a slow
    disk) left both slices on the shards and no table in the catalog: the name refused ALREADY_EXISTS
    and served NOT_FOUND until dropped. The create runs to its end (or undoes itself) whoever waits."""
    from client import DeadlineExceededError, MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    with InProcessServer(2, data_dir=str(tmp_path)) as server:
        slow, made = server.shards[1], server.shards[1].create_table

        def late(*args, **kwargs):
            time.sleep(2.5)
            return made(*args, **kwargs)

        monkeypatch.setattr(slow, "create_table", late)
        with MemoryClient(server.endpoint, timeout=1, retry_seconds=0, shm=False) as c:
            with pytest.raises(DeadlineExceededError):
                c.create_table("t", 100, 8)
        t0 = time.monotonic()
        while "t" not in server.coordinator.servicer.tables:
            assert time.monotonic() - t0 < 20, "the create was not finished"
            time.sleep(0.05)
        with MemoryClient(server.endpoint, timeout=30, shm=False) as c:
            assert c.lookup("t", [1]).shape == (1, 8) and _held_names(server) == [{"t"}, {"t"}]


def test_a_restore_its_caller_gave_up_on_restores_every_table_and_a_late_failure_is_logged(tmp_path, monkeypatch,
                                                                                            caplog):
    """A review: a restore whose client's deadline passed while its second table was placed
    undid the first and kept the second (neither all nor none); and a replace that failed after
    its caller had gone dropped the table without a word in any log. The restore runs to its end,
    every table; what a call came to after its caller left is logged."""
    import logging

    from client import DeadlineExceededError, MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    with InProcessServer(2, data_dir=str(tmp_path / "data")) as server:
        with MemoryClient(server.endpoint, shm=False) as c:
            for name in ("a", "b"):
                c.create_table(name, 100, 8)
            c.checkpoint(str(tmp_path / "ck"))
            for name in ("a", "b"):
                c.drop_table(name)
        slow = server.shards[1]
        restore_table = slow.restore_table

        def late_b(blob, *args, **kwargs):
            from memserver.api.v1 import memserver_pb2 as pb

            if pb.TableSpec.FromString(blob).name == "b":
                time.sleep(2.0)
            return restore_table(blob, *args, **kwargs)

        def late_refusal(*args, **kwargs):
            time.sleep(2.0)
            raise RuntimeError("no room (test)")

        monkeypatch.setattr(slow, "restore_table", late_b)
        with MemoryClient(server.endpoint, timeout=1.0, retry_seconds=0, shm=False) as c:
            with pytest.raises(DeadlineExceededError):
                c.restore(str(tmp_path / "ck"))
        t0 = time.monotonic()
        while set(server.coordinator.servicer.tables) != {"a", "b"}:
            assert time.monotonic() - t0 < 20, set(server.coordinator.servicer.tables)
            time.sleep(0.05)
        assert _held_names(server) == [{"a", "b"}, {"a", "b"}]
        monkeypatch.setattr(slow, "create_table", late_refusal)
        with caplog.at_level(logging.INFO, logger="memserver.server.coordinator"):
            with MemoryClient(server.endpoint, timeout=1.0, retry_seconds=0, shm=False) as c:
                with pytest.raises(DeadlineExceededError):
                    c.create_table("a", 100, 8, replace=True)
            t0 = time.monotonic()
            while "failed after its caller had gone" not in caplog.text:
                assert time.monotonic() - t0 < 20, caplog.text[-2000:]
                time.sleep(0.05)
        assert "the create with replace of table 'a' failed after its caller had gone" in caplog.text
        assert "was dropped before" in caplog.text  # (what to do is said: create it again)


def test_a_refused_replace_leaves_a_left_out_tables_slices(tmp_path):
    """A review: a create with replace of a table left out at start-up (one of its slices lost)
    dropped its surviving slices, kept for repair, before the cluster refused the new table (too
    large): every refusal comes before anything of the name is dropped now."""
    import shutil

    from client import MemoryClient, ResourceExhaustedError
    from memserver.cluster.inprocess import InProcessServer
    from memserver.server.config import Limits, ServeConfig

    def cluster() -> InProcessServer:
        return InProcessServer(2, data_dir=str(tmp_path), config=ServeConfig(limits=Limits(max_table_bytes=1 << 20)))

    with cluster() as server, MemoryClient(server.endpoint, shm=False) as c:
        c.create_table("t", 1000, 8, wal=True)
    shutil.rmtree(tmp_path / "shard-0001" / "t")
    with cluster() as server, MemoryClient(server.endpoint, shm=False) as c:
        assert "t" in server.coordinator.servicer.left_out
        with pytest.raises(ResourceExhaustedError, match="above the cluster's limit"):
            c.create_table("t", 100000, 64, replace=True)
        assert "t" in server.coordinator.servicer.left_out and (tmp_path / "shard-0000" / "t").is_dir()


def test_a_restore_with_replace_keeps_to_the_kind_of_a_table_made_while_it_checks(tmp_path, monkeypatch):
    """A review: the kind was checked before the restore read its checkpoint's bytes, and a table
    of another kind made meanwhile (an index, built for hours) was dropped for the checkpoint's
    value table. Checked again where the name is replaced."""
    import asyncio

    from client import AsyncMemoryClient, TableExistsError
    from memserver.cluster.inprocess import InProcessServer
    from memserver.server import coordinator

    verify = coordinator.verify_files

    def slow(files):  # (a large checkpoint's checksum pass)
        time.sleep(1.5)
        return verify(files)

    monkeypatch.setattr(coordinator, "verify_files", slow)

    async def calls(server) -> None:
        async with AsyncMemoryClient(server.endpoint, retry_seconds=0, shm=False) as c:
            await c.create_table("t", 100, 8)
            await c.checkpoint(str(tmp_path / "ck"))

            async def remake() -> None:
                await asyncio.sleep(0.5)
                await c.drop_table("t")
                await c.create_index("t", 8)
                await c.add("t", np.arange(5), np.eye(5, 8, dtype=np.float32))

            restored, _ = await asyncio.gather(c.restore(str(tmp_path / "ck"), replace=True), remake(),
                                               return_exceptions=True)
            assert isinstance(restored, TableExistsError) and "is an index table: a restore with replace" in str(restored)
            assert [(m.name, m.kind) for m in await c.list_tables()] == [("t", "index")]

    with InProcessServer(2, data_dir=str(tmp_path / "data")) as server:
        asyncio.run(calls(server))


@pytest.mark.parametrize("how", ["create", "create-replace", "restore-replace"])
def test_a_shard_restarted_while_its_slice_is_made_is_mapped_at_its_new_process(tmp_path, how):
    """A review: the table's map was planned before its slices were made (a replace's plan before
    its drop), so a shard Ray restarted meanwhile stayed in that table's map at its old address
    and pid: clients dialled a process that is gone. The map is refreshed as the table is placed."""
    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    with InProcessServer(2) as server, MemoryClient(server.endpoint, timeout=30, retry_seconds=1) as c:
        if how != "create":
            c.create_table("t", 10, 4)
            c.checkpoint(str(tmp_path), step=1)
        coordinator, shard = server.coordinator, server.shards[1]
        method = "restore_table" if how.startswith("restore") else "create_table"
        real = getattr(shard, method)

        def made_then_restarted(*args, **kwargs):
            out = real(*args, **kwargs)
            coordinator.shard_restarted(1, {**coordinator.servicer.infos[1], "pid": 424242}, [])
            return out

        setattr(shard, method, made_then_restarted)  # (the handle asks the instance)
        if how == "restore-replace":
            c.restore(str(tmp_path), replace=True)
        else:
            c.create_table("t", 10, 4, replace=how == "create-replace")
        pids = [sh.pid for sh in c.table("t", refresh=True).shards]
        assert sorted(pids) == [os.getpid(), 424242], pids  # (shard 0 in this process; the slices' order is the plan's)


@pytest.mark.parametrize("how", ["restore", "create"])
def test_a_trainers_calls_wait_through_a_replace_of_its_table(tmp_path, how):
    """A table replaced (restore or create with replace) under a running trainer is missing from
    the catalog between its drop and its placing: the trainer's calls there answered NOT_FOUND
    ("does not exist") and the trainer died. The coordinator answers UNAVAILABLE for a table being
    replaced, the client retries, and the call is served by the new table."""
    import threading

    from client import MemoryClient, UnavailableError
    from memserver.cluster.inprocess import InProcessServer

    with InProcessServer(2) as server, MemoryClient(server.endpoint, timeout=30, retry_seconds=30) as c, \
            MemoryClient(server.endpoint, timeout=30, retry_seconds=30) as trainer:
        c.create_table("t", 10, 4, init_std=0.0)
        c.write_rows("t", [1], np.full((1, 4), 3.0, np.float32))
        ck = str(tmp_path / "ck")
        c.checkpoint(ck, step=1)
        c.write_rows("t", [1], np.full((1, 4), 7.0, np.float32))
        np.testing.assert_array_equal(trainer.lookup("t", [1]), np.full((1, 4), 7.0))  # its shard map is cached
        coordinator = server.coordinator.servicer
        real, dropped, go = coordinator._place, threading.Event(), threading.Event()

        async def held_place(*args, **kwargs):  # the old table is dropped: hold the new one back a moment
            import asyncio

            dropped.set()
            await asyncio.to_thread(go.wait, 30)
            return await real(*args, **kwargs)

        coordinator._place = held_place
        replace = threading.Thread(target=lambda: c.restore(ck, replace=True) if how == "restore" else
                                   c.create_table("t", 10, 4, init_std=0.0, replace=True))
        replace.start()
        try:
            assert dropped.wait(30)
            got: list = []
            lookup = threading.Thread(target=lambda: got.append(_outcome(lambda: trainer.lookup("t", [1]))))
            lookup.start()
            lookup.join(1.0)
            assert lookup.is_alive() and not got  # waiting for the table, not refused
            with MemoryClient(server.endpoint, timeout=30, retry_seconds=0) as other, \
                    pytest.raises(UnavailableError, match="is being replaced") as err:
                other.table("t", refresh=True)  # not retried here: said as the coordinator said it
            assert "is a memserver cluster running there" not in str(err.value)
            # (a drop, a create or a restore of the name waits for the replace: test_calls_on_one_table_name_...)
        finally:
            go.set()
            replace.join(30)
        lookup.join(30)
        want = 3.0 if how == "restore" else 0.0
        np.testing.assert_array_equal(got[0], np.full((1, 4), want))


@pytest.mark.parametrize("when", ["before its commit", "between prepare and commit"])
def test_a_step_open_while_its_table_is_restored_is_dropped_saying_so(tmp_path, caplog, when):
    """A trainer's step straddles a `restore --replace` of its table: its parts went to the old
    table, so the new one holds none of them; the commit failed with ABORTED ("does not hold
    part(s)") or FAILED_PRECONDITION ("the step is not prepared") and the trainer died. Now the
    step's update is dropped with a warning and the step committed with no parts (commit_step
    answers 0 rows; a sync table's other trainers are not left waiting), and the next step
    trains on the restored table as on any."""
    from client import MemoryClient, MemserverError, ops
    from memserver.cluster.inprocess import InProcessServer

    ids, w = np.array([[1, 2]]), np.ones((1, 2), np.float32)
    with InProcessServer(2) as server, MemoryClient(server.endpoint, timeout=30, retry_seconds=5) as admin, \
            MemoryClient(server.endpoint, timeout=30, retry_seconds=5) as trainer:
        admin.create_table("t", 10, 4, optimizer="sgd", lr=1.0, init_std=0.0)
        admin.write_rows("t", [1], np.full((1, 4), 3.0, np.float32))
        ck = str(tmp_path / "ck")
        admin.checkpoint(ck, step=1)
        trainer.bag_backward("t", ids, w, np.ones((1, 4), np.float32), step=2, gather=True)
        with caplog.at_level("WARNING", logger="client.ops.steps"):
            if when == "before its commit":
                admin.restore(ck, replace=True)
                assert trainer.commit_step("t", 2) == 0
            else:
                plan = ops.commit_step_plan(trainer.aio.session, "t", 2, 2)
                make, tags, _ = next(plan)
                voted = trainer._call("t", make, tags)  # prepared on the old table's two shards
                admin.restore(ck, replace=True)
                got = voted
                with pytest.raises(StopIteration) as done:
                    while True:  # as commit_step drives it: the commit, then the step again with no parts
                        make, tags, _ = plan.send(got)
                        try:
                            got = trainer._call("t", make, tags)
                        except MemserverError as exc:
                            got = exc
                assert done.value.value == 0
        assert "table t: made anew (a restore, or a create with replace) while step 2 was open: its update went to " \
               "the old table and is dropped" in caplog.text
        np.testing.assert_array_equal(trainer.lookup("t", [1]), np.full((1, 4), 3.0))  # the checkpoint's row
        trainer.bag_backward("t", ids, w, np.ones((1, 4), np.float32), step=3, gather=True)
        assert trainer.commit_step("t", 3) == 2
        np.testing.assert_array_equal(trainer.lookup("t", [1]), np.full((1, 4), 2.0))  # 3 - lr * 1


def test_a_sync_tables_step_across_a_restore_is_not_left_waiting_for_the_trainer_whose_parts_went(tmp_path, caplog):
    """Two data-parallel trainers on a sync_updates table (the step applies once both commit):
    A's parts of step 2 went to the old table, then the restore, then B's to the new one. A's
    commit sent nothing, so the new table's step 2 waited for it for good and B's update never
    applied. A commits the step with no parts now: B's part applies, as the mean of the two."""
    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer

    ids, w, g = np.array([[1, 2]]), np.ones((1, 2), np.float32), np.ones((1, 4), np.float32)
    with InProcessServer(2) as server, MemoryClient(server.endpoint, timeout=30, retry_seconds=5) as a, \
            MemoryClient(server.endpoint, timeout=30, retry_seconds=5) as b:
        a.create_table("t", 10, 4, optimizer="sgd", lr=1.0, init_std=0.0, sync_workers=2)
        a.write_rows("t", [1], np.full((1, 4), 3.0, np.float32))
        ck = str(tmp_path / "ck")
        a.checkpoint(ck, step=1)
        a.bag_backward("t", ids, w, g, step=2, gather=True)
        with MemoryClient(server.endpoint, timeout=30) as admin:
            admin.restore(ck, replace=True)
        b.bag_backward("t", ids, w, g, step=2, gather=True)
        with caplog.at_level("WARNING", logger="client.ops.steps"):
            assert a.commit_step("t", 2) == 0
        assert "while step 2 was open" in caplog.text
        b.commit_step("t", 2)
        np.testing.assert_array_equal(a.lookup("t", [1]), np.full((1, 4), 2.5))  # 3 - (1 + 0) / 2


def _outcome(call):
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - the test compares what came back
        return exc


def test_a_symlink_below_the_checkpoint_root_does_not_lead_outside_it(client, table_name, tmp_path):
    """The root check resolved only `dir`: a step folder linked outside the root took the slice
    files and the manifest there, and a slice file linked outside was read by a restore."""
    import shutil
    import tempfile

    from client import PermissionDeniedError

    client.create_table(table_name, 20, DIM, num_shards=2, sharding="rows")
    outside = Path(tempfile.mkdtemp(prefix="memserver-outside-"))
    try:
        (tmp_path / "a").mkdir()
        (tmp_path / "a" / "step-0000000001").symlink_to(outside)
        with pytest.raises(PermissionDeniedError, match="outside the cluster's checkpoint root"):
            client.checkpoint(str(tmp_path / "a"), step=1, tables=[table_name])
        assert not any(outside.iterdir())
        client.checkpoint(str(tmp_path / "b"), step=1, tables=[table_name])
        slice_file = tmp_path / "b" / "step-0000000001" / table_name / "shard-0001.pt"
        shutil.move(slice_file, outside / "shard-0001.pt")
        slice_file.symlink_to(outside / "shard-0001.pt")
        with pytest.raises(PermissionDeniedError, match="outside the cluster's checkpoint root"):
            client.restore(str(tmp_path / "b"), replace=True, tables=[table_name])
        assert table_name in {t.name for t in client.list_tables()}
    finally:
        shutil.rmtree(outside)


def test_an_atomic_write_never_follows_a_link_planted_at_its_temporary_name(tmp_path):
    """The temporary name is predictable (the writer's pid): a link planted there led a slice file,
    a manifest or a record outside the checkpoint root, past the root's checks."""

    from memserver.storage.fsutil import atomic_write, temporary

    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    target = tmp_path / "root" / "manifest.json"
    target.parent.mkdir()
    temporary(target).symlink_to(outside)
    atomic_write(target, lambda f: f.write(b"new"))
    assert outside.read_bytes() == b"keep" and target.read_bytes() == b"new" and not target.is_symlink()


def test_a_checkpoint_on_a_full_disk_says_so_and_leaves_no_temporaries(tmp_path):
    """From an operator's walkthrough (a full data disk): a checkpoint failed with INTERNAL and a
    Ray traceback (torch.save says a full disk as a RuntimeError), named no path, and left its
    temporary file, holding space on the full disk; one left by a shard killed mid-checkpoint (57
    MB) stayed after the retry that succeeded. Now: RESOURCE_EXHAUSTED naming the table and the
    file, no temporary left, and a dead writer's temporary of that file removed by the next write
    (a live writer's, or another file's, kept). On a real full disk (a 256 KiB tmpfs)."""
    import subprocess

    import torch

    from memserver.api.errors import ResourceExhaustedError
    from memserver.storage.checkpoint import save_slice
    from memserver.storage.fsutil import atomic_write, temporary
    from tests.smalldisk import small_disk

    folder = tmp_path / "ck"
    folder.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = temporary(folder / "shard-0000.pt", dead.pid)  # a writer killed mid-write
    live = temporary(folder / "shard-0000.pt", os.getppid())  # a writer at work
    other = temporary(folder / "shard-0001.pt", dead.pid)  # another file's: its own writer's business
    elsewhere = folder / f".shard-0000.pt.tmp-another-host-{dead.pid}"  # another host's (a shared folder)
    for f in (stale, live, other, elsewhere):
        f.write_bytes(b"x" * 1000)
    meta = {"table": "t", "kind": "index", "index": 0}
    save_slice(folder / "shard-0000.pt", meta, {"keys": torch.zeros(10)})
    assert sorted(p.name for p in folder.iterdir()) == sorted([live.name, other.name, elsewhere.name, "shard-0000.pt"])
    with pytest.raises(ZeroDivisionError):  # any failure: the part written goes
        atomic_write(folder / "x", lambda f: (f.write(b"part"), 1 / 0))
    assert not list(folder.glob(".x.tmp-*"))

    with small_disk(tmp_path / "small", "256k") as mnt:
        with pytest.raises(ResourceExhaustedError, match=rf"table t: cannot write checkpoint file {mnt}/shard-0000.pt: "
                                                         r"the disk is full \(No space left on device\)"):
            save_slice(mnt / "shard-0000.pt", meta, {"keys": torch.zeros(200_000)})
        assert list(mnt.iterdir()) == []


def test_a_slice_file_that_cannot_be_read_is_said_by_name(tmp_path, monkeypatch):
    """Damaged bytes are DATA_LOSS naming the file, whatever the reader raises (a header can make
    zipfile raise NotImplementedError, not BadZipFile; torch's weights_only reader refuses garbage
    and foreign objects with one message)."""
    import fractions

    import torch

    import memserver.storage.checkpoint as checkpoint

    path = tmp_path / "s.pt"
    torch.save({"meta": {}, "state": {}}, path)

    def odd(*args, **kwargs):
        raise NotImplementedError("zip file version 15.4")

    monkeypatch.setattr(checkpoint.zipfile, "ZipFile", odd)
    with pytest.raises(DataLossError, match=f"checkpoint slice file {path} is damaged: zip file version 15.4"):
        checkpoint._check_archive(path)
    monkeypatch.undo()
    checkpoint._check_archive(path)
    torch.save({"meta": fractions.Fraction(1, 3)}, path)
    with pytest.raises(DataLossError, match=f"checkpoint slice file {path} cannot be read"):
        checkpoint._open_slice(path)
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(DataLossError, match=f"checkpoint slice file {path} cannot be read"):
        checkpoint._open_slice(path)


def test_a_flipped_bit_in_a_saved_row_is_refused_by_name(tmp_path):
    """Each saved row carries a checksum, checked as a restore copies it: one flipped bit inside a
    tensor (same size, the archive whole) is DATA_LOSS naming the file, the tensor and the row,
    where it loaded (0xff bytes in a slice file served NaNs)."""
    import torch

    n, d = 2048, 64
    values = torch.randn(n, d)
    entries = _save_table(tmp_path, True, 1, values, torch.zeros(n, dtype=torch.int64))
    path = Path(entries[0]["file"])
    blob = bytearray(path.read_bytes())
    at = bytes(blob).find(values[1000].numpy().tobytes())  # row 1000's values, as torch.save wrote them
    assert at > 0
    blob[at + 5] ^= 0x10
    path.write_bytes(bytes(blob))
    with pytest.raises(DataLossError, match=f"checkpoint slice file {path}: weight of row 1000 does not match its checksum"):
        _load_table(entries, True, 2, n, d, [])
    blob[at + 5] ^= 0x10
    path.write_bytes(bytes(blob))
    restored, _, _ = _load_table(entries, True, 2, n, d, [])
    torch.testing.assert_close(restored, values, rtol=0, atol=0)


def test_the_row_checksum_is_pinned_and_a_file_whose_checksums_do_not_fit_is_data_loss(tmp_path):
    """The checksum is a fixed definition (splitmix64 constants, not a library's random stream):
    files written by one version load in the next. Checksum entries that do not fit the state
    are DATA_LOSS; another definition's are not checked."""
    import torch

    from memserver.storage.checkpoint import row_checks

    assert row_checks(torch.arange(6, dtype=torch.float32).reshape(2, 3)).tolist() == [15538659559471054848,
                                                                                      11894538480327327744]
    assert row_checks(torch.arange(3, dtype=torch.int64)).tolist() == [0, 13166790918009305073, 7886837762309058530]
    n, d = 64, 4
    values = torch.randn(n, d)
    entries = _save_table(tmp_path, True, 1, values, torch.zeros(n, dtype=torch.int64))
    path = Path(entries[0]["file"])
    blob = torch.load(path, weights_only=True)
    blob["row_checks"]["weight"] = blob["row_checks"]["weight"][:10]
    torch.save(blob, path)
    with pytest.raises(DataLossError, match="its checksums of 'weight' do not fit its state"):
        _load_table(entries, True, 1, n, d, [])
    blob["row_checks_version"] = 99  # another definition: not checked, loads
    torch.save(blob, path)
    restored, _, _ = _load_table(entries, True, 1, n, d, [])
    torch.testing.assert_close(restored, values, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["product_keys", "index"])
def test_a_flipped_bit_in_a_slice_saved_whole_is_refused_by_name(tmp_path, kind):
    """What loads whole (product keys; an index's faiss bytes, ids and payload) carries a checksum
    per 4 KiB: a flipped bit is DATA_LOSS naming the file, the tensor and the bytes, where it
    loaded as keys or vectors no one asked for. verify_files (a replace's check before it drops
    anything) says the same of the file."""
    import torch

    from memserver.storage.checkpoint import load_index, load_whole, save_slice, verify_files

    keys = torch.randn(3000, 4)  # 48,000 bytes: 12 blocks, the last one short
    meta = {"table": "k", "kind": kind, "by_rows": True, "index": 0, "num_shards": 1, "num_rows": 3000, "dim": 4,
            "col_start": 0, "col_end": 4}
    path = tmp_path / "s.pt"
    entry = {"file": str(path), **meta}
    empty = torch.empty(0, dtype=torch.int64).as_strided((0,), (0,))  # (an index's empty state: a view as bytes failed)
    save_slice(path, meta, {"keys": keys, "dead": torch.zeros(3000, dtype=torch.bool), "none": empty})
    load = (lambda: load_whole(meta, [entry])) if kind == "product_keys" else (lambda: load_index(lambda s: s, meta, [entry]))
    torch.testing.assert_close(load()["keys"], keys, rtol=0, atol=0)
    verify_files([entry])
    blob = bytearray(path.read_bytes())
    at = bytes(blob).find(keys[2500].numpy().tobytes())  # byte 40,000 of keys: block 9
    assert at > 0
    blob[at + 2] ^= 0x40
    path.write_bytes(bytes(blob))
    says = f"checkpoint slice file {path}: keys bytes 36,864..40,960 do not match their checksum"
    with pytest.raises(DataLossError, match=says):
        load()
    with pytest.raises(DataLossError, match=says):
        verify_files([entry])
    blob[at + 2] ^= 0x40
    blob[0] ^= 0x01  # the archive's first byte: taken for the legacy format, it passed the checks unread
    path.write_bytes(bytes(blob))
    with pytest.raises(DataLossError, match=f"{path} is damaged: it begins with neither a zip archive's header"):
        verify_files([entry])


@pytest.mark.parametrize("load", ["load_into", "verify_files"])
def test_a_flipped_bit_in_a_slice_files_recovery_records_is_refused_by_name(tmp_path, load):
    """The records only recovery reads (the exactly-once window's answers, prepared step parts,
    trigger records) carry a digest too: a flipped bit in a prepared gradient is DATA_LOSS naming
    the file, where it was applied at the step's commit."""
    import torch

    from memserver.storage.checkpoint import extras_digest, load_into, save_slice, verify_files

    n, d = 64, 8
    meta = {"table": "t", "kind": "value", "by_rows": True, "index": 0, "num_shards": 1, "num_rows": n, "dim": d,
            "col_start": 0, "col_end": d}
    grad = torch.full((5, d), 0.25)
    extra = {"sessions": [("client-a", 12.5, 3, [(3, b"\x08\x01answer"), (4, 7)])],
             "step_parts": [(9, "client-a", False, True, [(0, [torch.arange(5), grad])])],
             "triggers": {"slots": torch.arange(3)}, "lsn": 41}
    path = tmp_path / "s.pt"
    entry = {"file": str(path), **meta}
    save_slice(path, meta, {"weight": torch.randn(n, d)}, extra)
    table = type("T", (), {})()
    table.weight = torch.zeros(n, d)
    got: dict = {}
    load_into(table, meta, [entry], got)
    assert extras_digest(got) == extras_digest(extra) and got["lsn"] == 41
    blob = bytearray(path.read_bytes())
    at = bytes(blob).find(grad.numpy().tobytes())  # the prepared gradient, as torch.save wrote it
    assert at > 0
    blob[at + 9] ^= 0x04
    path.write_bytes(bytes(blob))
    says = f"checkpoint slice file {path}: its recovery records .* do not match their checksum"
    with pytest.raises(DataLossError, match=says):
        load_into(table, meta, [entry], {}) if load == "load_into" else verify_files([entry])


def test_a_checkpoint_given_no_step_after_the_last_step_there_is_refused_by_name(tmp_path):
    """A checkpoint at step 2^63-1 and then one given no step failed INTERNAL ("Value out of
    range" from the step's int64); it is refused naming the folder and what to do."""
    from memserver.api.errors import FailedPreconditionError
    from memserver.storage.checkpoint import next_step, step_dir

    step_dir(tmp_path, 2**63 - 2).mkdir()
    assert next_step(tmp_path) == 2**63 - 1
    step_dir(tmp_path, 2**63 - 1).mkdir()
    with pytest.raises(FailedPreconditionError, match=r"step: .*step-9223372036854775807 is the last step a checkpoint "
                                                      r"can take; give a --step below it"):
        next_step(tmp_path)


def test_a_restore_into_more_shards_than_its_sharding_splits_names_num_shards(client, table_name, tmp_path):
    """A 1-row rows table restored into 2 shards was refused "num_rows: ... (give num_shards <= 1,
    or sharding=cols)", a fix a restore cannot take and the CLI could not name as --shards."""
    client.create_table(table_name, 1, 4, sharding="rows", num_shards=1)
    try:
        client.checkpoint(str(tmp_path), step=1, tables=[table_name])
        with pytest.raises(InvalidArgumentError, match=rf"^INVALID_ARGUMENT: num_shards: table '{table_name}': 1 rows "
                                                       r"cannot be split over 2 shards \(restore it into at most 1: a "
                                                       r"restore keeps the checkpoint's sharding\) \(coordinator "):
            client.restore(str(tmp_path), replace=True, num_shards=2, tables=[table_name])
        assert client.restore(str(tmp_path), replace=True, num_shards=1, tables=[table_name])[0].num_rows == 1
    finally:
        client.drop_table(table_name)



def test_a_checkpoint_holding_an_answer_without_dl_dweights_restores_and_restarts(tmp_path):
    """A session's remembered answer of a backward without dL/dweights is empty bytes, which pickle
    writes as a call of `bytes` and torch's weights_only loader refused: a checkpoint taken after
    such a write (LSH and Engram step parts send them) was written, then could neither be restored
    nor recovered by a shard restart: the table was lost (a hunt)."""
    from client import MemoryClient
    from memserver.cluster.inprocess import InProcessServer
    from memserver.server.config import ServeConfig

    ids, w, g = np.arange(8).reshape(4, 2), np.ones((4, 2), np.float32), np.ones((4, DIM), np.float32)
    data, cfg = str(tmp_path / "data"), ServeConfig(checkpoint_root=str(tmp_path))
    with InProcessServer(2, data_dir=data, config=cfg) as server, MemoryClient(server.endpoint, shm=False) as c:
        c.create_table("t", 64, DIM)
        assert c.bag_backward("t", ids, w, g, weight_grad=False) is None
        c.bag_backward("t", ids, w, g, step=1, gather=True, weight_grad=False)  # (an open step's part too)
        c.checkpoint(str(tmp_path / "ck"), 1)
        rows = c.lookup("t", np.arange(64))
        assert [m.name for m in c.restore(str(tmp_path / "ck"), 1, replace=True)] == ["t"]
        np.testing.assert_array_equal(c.lookup("t", np.arange(64)), rows)
        c.bag_backward("t", ids, w, g, weight_grad=False)
        c.checkpoint(str(tmp_path / "ck"), 2)
        rows = c.lookup("t", np.arange(64))
    with InProcessServer(2, data_dir=data, config=cfg) as server, MemoryClient(server.endpoint, shm=False) as c:
        assert [t.unavailable for sh in c.status().shards for t in sh.tables] == ["", ""]
        np.testing.assert_array_equal(c.lookup("t", np.arange(64)), rows)


def test_memserver_checkpoint_of_a_cluster_with_no_table_is_refused(tmp_path, capsys):
    """A hunt: `memserver checkpoint` before any table was made wrote a step of none ("checkpoint
    of 0 table(s)"), and a plain `restore --replace` of it, the latest, restored nothing and said
    it was done. Refused, nothing written."""
    from client import MemoryClient
    from memserver.cli import main as cli_main
    from memserver.cluster.inprocess import InProcessServer

    with InProcessServer(1, data_dir=str(tmp_path / "data")) as server, MemoryClient(server.endpoint) as c:
        argv = ["checkpoint", "--dir", str(tmp_path / "ck"), "--step", "1", "--endpoint", server.endpoint]
        with pytest.raises(SystemExit) as exc:
            cli_main(argv)
        assert exc.value.code == 2 and "the cluster holds no table: nothing to checkpoint" in capsys.readouterr().err
        assert not (tmp_path / "ck").exists()
        c.create_table("t", 8, 4)
        assert cli_main(argv) == 0 and "checkpoint of 1 table(s) at step 1" in capsys.readouterr().out
