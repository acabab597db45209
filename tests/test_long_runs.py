"""Long runs stay bounded and correct: client sessions, steps in parts, stale shard maps, the order
of log and apply, recovery of an open step. Shards run in this process where the test needs to
restart one (no Ray); the rest uses the session's cluster."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
import torch

from client import FailedPreconditionError, InvalidArgumentError, StepAbortedError
from memserver.api.v1 import memserver_pb2 as pb
from memserver.api.v1 import memserver_pb2_grpc as pb_grpc
from memserver.server.catalog import plan_table, validate_spec
from memserver.server.sessions import Sessions
from memserver.wire import decode, encode
from tests.reference import RefTable, initial

DIM = 8


def _shard(tmp_path, spec: pb.TableSpec, **kwargs):
    from memserver.server.shard_actor import ShardActor

    shard = ShardActor(0, host="127.0.0.1", data_dir=str(tmp_path), **kwargs)
    spec = validate_spec(spec, 1)
    shard.create_table(spec.SerializeToString(), plan_table(spec, [shard.info()]).shards[0].SerializeToString(), 1)
    return shard


def _rows(stub, name, n):
    return decode(stub.Lookup(pb.LookupRequest(table=name, ids=encode(torch.arange(n)))).rows, "rows").clone()


def _push(stub, name, ids, grads, seq, client="c", acked_below=0, attempt=0):
    return stub.PushGradients(pb.PushGradientsRequest(
        table=name, ids=encode(torch.as_tensor(ids)), grads=encode(torch.as_tensor(grads)),
        tag=pb.WriteTag(client_id=client, seq=seq, acked_below=acked_below, attempt=attempt)))


# ------------------------------------------------------------------ sessions


def test_sessions_forget_answers_the_client_has_seen():
    s = Sessions(ttl=60)
    for seq in range(1, 101):  # a client with one write in flight at a time
        tag = pb.WriteTag(client_id="a", seq=seq, acked_below=seq)
        assert s.recall(tag, "t") == (False, None)
        s.remember(tag, seq)
    assert s.remembered() == 1  # not 100: only the write the client has not acknowledged yet
    assert s.recall(pb.WriteTag(client_id="a", seq=100, acked_below=100, attempt=1), "t") == (True, 100)
    with pytest.raises(FailedPreconditionError, match="already answered"):  # a late duplicate of a seen write
        s.recall(pb.WriteTag(client_id="a", seq=50, acked_below=50, attempt=1), "t")  # (sent before 50 was answered)


def test_a_write_whose_acked_below_is_above_its_own_seq_is_refused_leaving_the_session():
    """A hunt: seq 5 with acked_below 10 (the write itself and the ones after it called answered)
    was refused FAILED_PRECONDITION "already answered", never applied, yet it moved the session's
    acked_below to 10 for good: the client's next honest write, seq 6, was refused too, and
    acked_below 2^64 - 1 made a new client's session refuse every write. Refused INVALID_ARGUMENT
    before the session is touched (or made)."""
    s = Sessions(ttl=60)
    first = pb.WriteTag(client_id="k", seq=1, acked_below=1)
    assert s.recall(first, "t") == (False, None)
    s.remember(first, 1)
    for bad in (pb.WriteTag(client_id="k", seq=5, acked_below=10), pb.WriteTag(client_id="new", acked_below=2**64 - 1)):
        with pytest.raises(InvalidArgumentError, match=rf"tag: acked_below \({bad.acked_below}\) must be <= seq "
                                                       rf"\({bad.seq}\): a write in flight is not answered yet"):
            s.recall(bad, "t")
    assert list(s.by_client) == ["k"] and s.by_client["k"].acked_below == 1 and s.remembered() == 1
    assert s.recall(pb.WriteTag(client_id="k", seq=6, acked_below=2), "t") == (False, None)  # its next write is taken
    assert s.recall(pb.WriteTag(client_id="k", seq=6, acked_below=6), "t") == (False, None)  # (= seq: every one below)


def test_answers_of_clients_gone_are_bounded_in_bytes(monkeypatch):
    """A client that goes away never acknowledges its last answer (a walkthrough: 200 short-lived
    clients left 200 bag_backward answers, 163 MiB, on each shard and in every checkpoint). Past
    MAX_ANSWER_BYTES the least recently remembered session's tensor answers are let go (8 bytes
    each stand for them), and a late retry of one is refused, never applied twice. Its
    acked_below stays where its client put it: its write still on the way is applied when it
    comes, and a checkpoint's sessions load back (and replay) within the bound (a review: moving
    acked_below past the answers let go refused both)."""
    import memserver.server.sessions as sessions

    answer = encode(torch.zeros(4096, 32))  # a bag_backward's weight gradient
    size = sessions.answer_bytes(answer)
    monkeypatch.setattr(sessions, "MAX_ANSWER_BYTES", 10 * size)
    s = Sessions(ttl=60)

    def tensors(x: Sessions) -> int:
        return sum(isinstance(a, pb.Tensor) for v in x.by_client.values() for a in v.answers.values())

    for i in range(50):  # one write each, never acknowledged; c0 has seq 1 on its way still
        tag = pb.WriteTag(client_id=f"c{i}", seq=2 if i == 0 else 1, acked_below=1)
        assert s.recall(tag, "t") == (False, None)
        s.remember(tag, answer)
        assert s.nbytes <= 10 * size
    assert s.nbytes == sum(x.nbytes for x in s.by_client.values()) and s.remembered() == 50
    assert 8 <= tensors(s) <= 10 and s.nbytes == tensors(s) * size + (50 - tensors(s)) * 8
    assert s.recall(pb.WriteTag(client_id="c49", seq=1, acked_below=1, attempt=1), "t")[0]  # the newest: answered
    with pytest.raises(FailedPreconditionError, match="write 2 of client c0 was applied, and its answer let go"):
        s.recall(pb.WriteTag(client_id="c0", seq=2, acked_below=1, attempt=1), "t")  # not applied again
    assert s.recall(pb.WriteTag(client_id="c0", seq=1, acked_below=1), "t") == (False, None)  # still to apply
    s.remember(pb.WriteTag(client_id="c0", seq=1, acked_below=1), 7)
    s.recall(pb.WriteTag(client_id="c45", seq=2, acked_below=2), "t")  # c45 has its answer
    assert s.nbytes == sum(x.nbytes for x in s.by_client.values()) and s.remembered() == 50
    again = Sessions(ttl=60)
    again.load(s.state())  # (a restart: the same answers, tensors or let go)
    assert again.nbytes == s.nbytes and again.remembered() == s.remembered() and tensors(again) == tensors(s)
    with pytest.raises(FailedPreconditionError, match="its answer let go"):
        again.recall(pb.WriteTag(client_id="c0", seq=2, acked_below=1, attempt=1), "t")
    assert s.expire(time.time() + 61) and s.remembered() == 0 and s.nbytes == 0 and not s.holding


def test_sessions_stay_bounded_whatever_clients_send(monkeypatch):
    """From a hostile-input audit: a new client id per write made a session each, and a client id
    of any length was kept. Each is refused at its bound now, changing nothing. (Answers are not
    capped: a healthy client's one long call holds acked_below for every slice it writes.)"""
    import memserver.server.sessions as sessions
    from memserver.api.errors import ResourceExhaustedError

    monkeypatch.setattr(sessions, "MAX_SESSIONS", 3)
    s = Sessions(ttl=60)
    for seq in range(1, 6):  # never acknowledged: acked_below stays 1, every answer kept
        tag = pb.WriteTag(client_id="a", seq=seq, acked_below=1)
        assert s.recall(tag, "t") == (False, None)
        s.remember(tag, seq)
    assert s.recall(pb.WriteTag(client_id="a", seq=3, acked_below=1, attempt=1), "t") == (True, 3)  # retries answered
    for c in ("b", "c"):  # (an applied write makes its client's session)
        s.recall(tag := pb.WriteTag(client_id=c, seq=1, acked_below=1), "t")
        s.remember(tag, 1)
    with pytest.raises(ResourceExhaustedError, match="3 client sessions already"):
        s.recall(pb.WriteTag(client_id="d", seq=1, acked_below=1), "t")
    assert set(s.by_client) == {"a", "b", "c"}
    assert s.expire(time.time() + 61) == ["a", "b", "c"]  # idle ones expire: a new client is taken again
    assert s.recall(pb.WriteTag(client_id="d", seq=1, acked_below=1), "t") == (False, None)
    with pytest.raises(InvalidArgumentError, match="a client id of 1,000 characters"):
        s.recall(pb.WriteTag(client_id="x" * 1000, seq=1, acked_below=1), "t")


def test_sessions_expired_to_make_room_for_a_new_client_have_their_steps_decided(tmp_path, monkeypatch):
    """A review: at MAX_SESSIONS, a new client's write expired the idle sessions inside `recall`
    and dropped them there, so a gone client's step prepared on shard 1 (its COMMIT reached only
    shard 0) was never decided: prepared for good. They are expired by the slice now, which
    commits such a step first (presumed commit), as any expiry does."""
    import memserver.server.sessions as sessions
    from client import MemoryClient, UnavailableError
    from memserver.cluster.inprocess import InProcessServer

    monkeypatch.setattr(sessions, "MAX_SESSIONS", 2)  # (for 65,536)
    rng = np.random.default_rng(0)
    ids, w, g = rng.integers(0, 64, (6, 4)), rng.random((6, 4)).astype(np.float32), rng.normal(size=(6, 8)).astype(np.float32)
    with InProcessServer(2, data_dir=str(tmp_path), session_ttl=1.0) as server:
        with MemoryClient(server.endpoint, timeout=10, retry_seconds=0, client_id="A", shm=False) as a:
            a.create_table("t", 64, 8, wal=True)
            a.bag_backward("t", ids, w, g, step=1, gather=True)
            late, real = a.table("t").shards[1].address, a._methods

            def methods(at):  # A's COMMIT cannot reach shard 1: A then goes away
                got = dict(real(at))
                if at == late:
                    commit_step = got["CommitStep"]

                    def cut(raw, *args, **kwargs):
                        if pb.CommitStepRequest.FromString(bytes(raw)).phase == pb.STEP_COMMIT:
                            raise UnavailableError("unreachable (test)")
                        return commit_step(raw, *args, **kwargs)

                    got["CommitStep"] = cut
                return got

            a._methods = methods
            with pytest.raises(UnavailableError):
                a.commit_step("t", 1)
        held = server.shards[1].servicer.tables["t"]
        assert held.steps[1]["A"].prepared
        one = (np.array([1]), np.ones((1, 8), np.float32))
        with MemoryClient(server.endpoint, timeout=10, client_id="B", shm=False) as b:
            b.push_gradients("t", *one)  # shard 1's sessions: A and B, the most it holds
            time.sleep(1.5)  # both idle past the TTL
            with MemoryClient(server.endpoint, timeout=10, client_id="C", shm=False) as c:
                c.push_gradients("t", *one)
        assert list(held.sessions.by_client) == ["C"] and not held.steps  # A's step committed, not left prepared
        assert not server.shards[0].servicer.tables["t"].steps


def test_an_expired_session_refuses_a_retry_and_accepts_new_writes():
    s = Sessions(ttl=60)
    tag = pb.WriteTag(client_id="a", seq=1, acked_below=1)
    s.recall(tag, "t")
    s.remember(tag, 7)
    assert s.expire(time.time() + 30) == [] and s.expire(time.time() + 61) == ["a"]
    with pytest.raises(FailedPreconditionError, match="no longer knows the client's session"):
        s.recall(pb.WriteTag(client_id="a", seq=1, acked_below=1, attempt=1), "t")
    assert s.recall(pb.WriteTag(client_id="a", seq=2, acked_below=2), "t") == (False, None)  # a new write is fine


def test_a_shard_remembers_only_the_writes_in_flight_and_checkpoints_stay_the_same_size(client, table_name, tmp_path):
    """The shard's answers are bounded by writes in flight (one here), not by how many ran, and a
    checkpoint after 100 writes is the size of one after 10."""
    client.create_table(table_name, 4096, DIM, sharding="cols", wal=True)
    rng = np.random.default_rng(0)
    sizes = []
    for n, total in ((1, 10), (2, 100)):
        while n <= total:
            ids = rng.integers(0, 4096, (64, 32))
            client.bag_backward(table_name, ids, np.ones((64, 32), np.float32), rng.normal(size=(64, DIM)).astype(np.float32))
            n += 1
        sizes.append(client.checkpoint(str(tmp_path / "ck"), total, [table_name])["bytes"])
    for shard in client.status().shards:
        (load,) = [t for t in shard.tables if t.table == table_name]
        assert load.sessions == 1 and load.remembered == 1
    # one answer of 64 x 32 float32 is 8 KiB per shard: 90 more remembered would be 720 KiB more
    assert abs(sizes[1] - sizes[0]) < 1024, sizes


def test_a_decision_held_for_one_table_does_not_make_another_tables_shards_keep_answers(client, table_name):
    """A commit decision that missed a shard stays in flight until the table's next commit_step
    re-sends it; a client that trains another table meanwhile tells that table's shards to forget
    its answers as before (an acknowledgement over every table made them keep all of them)."""
    from client.ops.sessions import WriteTags

    held, other = f"{table_name}-held", f"{table_name}-other"
    held_meta = client.create_table(held, 64, DIM, sharding="cols")
    client.create_table(other, 4096, DIM, sharding="cols")
    session = client.aio.session
    decision = WriteTags(session)  # what commit_step_plan keeps when a decision could not be delivered
    decision(0, held_meta, held_meta.shards[0])
    session.set_undecided(held, 1, (pb.STEP_COMMIT, decision, None, False))
    rng = np.random.default_rng(1)
    for _ in range(12):
        client.bag_backward(other, rng.integers(0, 4096, (64, 32)), np.ones((64, 32), np.float32),
                            rng.normal(size=(64, DIM)).astype(np.float32))
    loads = [t for shard in client.status().shards for t in shard.tables if t.table == other]
    assert [load.remembered for load in loads] == [1] * len(loads)
    session.set_undecided(held, 1, None)


def test_an_expired_sessions_retry_is_refused_and_changes_nothing(tmp_path):
    spec = pb.TableSpec(name="m", num_rows=16, dim=4, optimizer=pb.OptimizerSpec(name="sgd", lr=1.0), sharding=pb.ROWS)
    shard = _shard(tmp_path, spec, session_ttl=0.2)
    try:
        with grpc.insecure_channel(shard.address) as ch:
            stub = pb_grpc.DataPlaneStub(ch)
            _push(stub, "m", [1], np.ones((1, 4), np.float32), 1, client="a", acked_below=1)
            before = _rows(stub, "m", 16)
            time.sleep(0.4)
            _push(stub, "m", [2], np.ones((1, 4), np.float32), 1, client="b", acked_below=1)  # expires a's session
            after_b = _rows(stub, "m", 16)
            with pytest.raises(grpc.RpcError) as err:
                _push(stub, "m", [1], np.ones((1, 4), np.float32), 1, client="a", acked_below=1, attempt=1)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            torch.testing.assert_close(_rows(stub, "m", 16), after_b, rtol=0, atol=0)
            assert not torch.equal(before, after_b)
    finally:
        shard.stop()


def test_a_refused_write_of_a_new_client_leaves_no_session(tmp_path):
    """A hunt: 20 CommitStep COMMITs of steps never prepared, from new client ids, each refused
    FAILED_PRECONDITION, left 20 sessions behind, each counting toward MAX_SESSIONS for the
    session TTL: a flood of refusals turned new clients away. A session is made by the first
    write that applies; a known client's refused write keeps its session as it was."""
    spec = pb.TableSpec(name="m", num_rows=16, dim=4, optimizer=pb.OptimizerSpec(name="sgd", lr=1.0), sharding=pb.ROWS)
    shard = _shard(tmp_path, spec)
    try:
        sessions = shard.servicer.tables["m"].sessions
        with grpc.insecure_channel(shard.address) as ch:
            stub = pb_grpc.DataPlaneStub(ch)
            _push(stub, "m", [1], np.ones((1, 4), np.float32), 1, client="a", acked_below=1)
            for i in range(20):
                with pytest.raises(grpc.RpcError) as err:
                    stub.CommitStep(pb.CommitStepRequest(table="m", step=1, phase=pb.STEP_COMMIT,
                                                         tag=pb.WriteTag(client_id=f"c{i}", seq=1, acked_below=1)))
                assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
            with pytest.raises(grpc.RpcError):
                stub.CommitStep(pb.CommitStepRequest(table="m", step=1, phase=pb.STEP_COMMIT,
                                                     tag=pb.WriteTag(client_id="a", seq=2, acked_below=2)))
            assert list(sessions.by_client) == ["a"] and sessions.by_client["a"].acked_below == 2
            _push(stub, "m", [2], np.ones((1, 4), np.float32), 1, client="c0", acked_below=1)  # its first applied write
            assert list(sessions.by_client) == ["a", "c0"] and sessions.by_client["c0"].acked_below == 1
            assert stub.PushGradients(pb.PushGradientsRequest(  # and a retry of it is answered from the session
                table="m", ids=encode(torch.tensor([2])), grads=encode(torch.ones(1, 4)),
                tag=pb.WriteTag(client_id="c0", seq=1, acked_below=1, attempt=1))).duplicate
    finally:
        shard.stop()


def test_a_seq_reused_by_another_kind_of_write_is_refused_naming_both(tmp_path):
    """A client that sends a WriteRows and then a BagBackward under one (client, seq) got INTERNAL
    (the first call's answer does not fit the second: a TypeError). It is INVALID_ARGUMENT now,
    naming both calls, with nothing applied; the same call again is still a duplicate, and the
    kinds survive a checkpoint of the sessions."""
    spec = pb.TableSpec(name="m", num_rows=16, dim=4, optimizer=pb.OptimizerSpec(name="sgd", lr=1.0), sharding=pb.ROWS)
    shard = _shard(tmp_path, spec)
    tag = pb.WriteTag(client_id="x", seq=1)
    write = pb.WriteRowsRequest(table="m", ids=encode(torch.tensor([3])), rows=encode(torch.ones(1, 4)), tag=tag)
    backward = pb.BagBackwardRequest(table="m", ids=encode(torch.tensor([[3]])), weights=encode(torch.ones(1, 1)),
                                     grad_out=encode(torch.ones(1, 4)), tag=tag)
    try:
        with grpc.insecure_channel(shard.address) as ch:
            stub = pb_grpc.DataPlaneStub(ch)
            stub.WriteRows(write)
            before = _rows(stub, "m", 16)
            for call, request, was, now in [(stub.BagBackward, backward, "WriteRows", "BagBackward"),
                                            (stub.PushGradients, pb.PushGradientsRequest(
                                                table="m", ids=encode(torch.tensor([3])), grads=encode(torch.ones(1, 4)),
                                                tag=tag), "WriteRows", "PushGradients")]:
                with pytest.raises(grpc.RpcError) as err:
                    call(request)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
                assert f"write 1 of client x was a {was} call, not {now}" in err.value.details()
            assert stub.WriteRows(write).duplicate
            assert torch.equal(_rows(stub, "m", 16), before)
    finally:
        shard.stop()
    s = Sessions()
    s.recall(tag, "m", call=3)
    s.remember(tag, 1, 3)
    s.load(s.state())
    with pytest.raises(InvalidArgumentError, match="was a WriteRows call, not BagBackward"):
        s.recall(tag, "m", call=1)
    s.load([("y", time.time(), 0, [(1, 5)])])  # a checkpoint made before the kinds were kept
    assert s.recall(pb.WriteTag(client_id="y", seq=1), "m", call=1) == (True, 5)


# ------------------------------------------------------------------ steps in parts


def test_parts_of_a_step_make_one_optimizer_step(client, table_name):
    """Three gather parts then a commit equal one bag_backward of the three batches together
    (Adam: one step per row, so the per-row step count is 1, not 3), and dL/dw of every part is
    computed on the values before the step."""
    meta = client.create_table(table_name, 64, DIM, sharding="rows", optimizer="adam", lr=0.05, init_std=0.3, seed=4)
    ref = RefTable(initial(meta), "adam", 0.05)
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 64, (12, 5))
    w = rng.random((12, 5)).astype(np.float32)
    g = rng.normal(size=(12, DIM)).astype(np.float32)
    got = [client.bag_backward(table_name, ids[i : i + 4], w[i : i + 4], g[i : i + 4], step=1, gather=True)
           for i in (0, 4, 8)]
    np.testing.assert_array_equal(client.lookup(table_name, np.arange(64)), ref.w)  # nothing applied yet
    client.commit_step(table_name, 1)
    want = ref.bag_backward(ids, w, g)
    np.testing.assert_allclose(np.concatenate(got), want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(client.lookup(table_name, np.arange(64)), ref.w, rtol=1e-4, atol=1e-5)
    assert client.slot_stats(table_name, np.unique(ids))["updates"].max() == 1


def test_a_commit_whose_parts_did_not_all_arrive_is_refused(client, table_name):
    """The shard refuses and nothing of the step is applied (on a table of several shards, on none
    of them: tests/test_commit.py)."""
    client.create_table(table_name, 64, DIM, sharding="cols", optimizer="sgd", lr=1.0, num_shards=1)
    before = client.lookup(table_name, np.arange(64))
    client.bag_backward(table_name, [[1, 2]], np.ones((1, 2), np.float32), np.ones((1, DIM), np.float32), step=7,
                        gather=True)
    client.aio.session.step_parts(table_name, 7).add(0, 10**9)  # claim a part shard 0 never received
    with pytest.raises(StepAbortedError, match="shard 0 does not hold part.s. seq 1000000000"):
        client.commit_step(table_name, 7)
    np.testing.assert_array_equal(client.lookup(table_name, np.arange(64)), before)


def test_an_open_sync_step_survives_a_shard_restart(tmp_path):
    """Trainer a's contribution arrives, the shard checkpoints and is restarted, then trainer b's
    arrives: the step is the mean of both (the open step was in the checkpoint; before, replay
    started after it and a's push was gone)."""
    spec = pb.TableSpec(name="s", num_rows=16, dim=4, optimizer=pb.OptimizerSpec(name="sgd", lr=1.0),
                        sharding=pb.ROWS, wal=True, sync_updates=True, sync_workers=2, init_std=0.0)

    def contribute(stub, client, value, checkpoint=None):
        req = pb.BagBackwardRequest(table="s", ids=encode(torch.tensor([[3]])), weights=encode(torch.ones(1, 1)),
                                    grad_out=encode(torch.full((1, 4), value)), step=1,
                                    tag=pb.WriteTag(client_id=client, seq=1, acked_below=1))
        return stub.BagBackward(req)

    shard = _shard(tmp_path / "data", spec)
    with grpc.insecure_channel(shard.address) as ch:
        contribute(pb_grpc.DataPlaneStub(ch), "a", 2.0)
    step_dir = tmp_path / "ck" / "step-0000000001"
    shard.checkpoint_table("s", str(step_dir / "s" / "shard-0000.pt"), 1)
    (step_dir / "manifest.json").write_text("{}")
    shard.stop()
    again = _shard_again(tmp_path / "data")
    try:
        with grpc.insecure_channel(again.address) as ch:
            stub = pb_grpc.DataPlaneStub(ch)
            assert float(_rows(stub, "s", 16)[3, 0]) == 0.0  # still waiting for b
            contribute(stub, "b", 4.0)
            np.testing.assert_allclose(_rows(stub, "s", 16)[3].numpy(), -3.0)  # -lr * mean(2, 4)
    finally:
        again.stop()


def test_sessions_a_restart_replays_are_as_old_as_the_log(tmp_path):
    """A shard restarted from its log made every session of the log fresh (stamped at the
    replay), so they lived another whole TTL (a walkthrough: 301 sessions after a restart where
    1 had been left). They are as old as the log's last write: an hour-old log's sessions expire
    at the next write, the restart or not."""
    import os

    spec = pb.TableSpec(name="s", num_rows=16, dim=4, optimizer=pb.OptimizerSpec(name="sgd", lr=1.0),
                        sharding=pb.ROWS, wal=True)
    shard = _shard(tmp_path / "data", spec)
    with grpc.insecure_channel(shard.address) as ch:
        for i in range(5):
            _push(pb_grpc.DataPlaneStub(ch), "s", [i], np.ones((1, 4), np.float32), 1, client=f"c{i}", acked_below=1)
    shard.stop()
    hour_ago = time.time() - 3600
    for log_file in (tmp_path / "data").rglob("wal-*.log"):
        os.utime(log_file, (hour_ago, hour_ago))
    from memserver.server.shard_actor import ShardActor

    again = ShardActor(0, host="127.0.0.1", data_dir=str(tmp_path / "data"), session_ttl=600)
    try:
        sessions = again.servicer.tables["s"].sessions
        assert sorted(sessions.by_client) == [f"c{i}" for i in range(5)]
        assert all(abs(x.last_used - hour_ago) < 1 for x in sessions.by_client.values())
        with grpc.insecure_channel(again.address) as ch:
            _push(pb_grpc.DataPlaneStub(ch), "s", [9], np.ones((1, 4), np.float32), 1, client="new", acked_below=1)
        assert list(sessions.by_client) == ["new"]  # the log's hour-old sessions expired (TTL 600 s)
    finally:
        again.stop()


def _shard_again(data_dir):
    from memserver.server.shard_actor import ShardActor

    return ShardActor(0, host="127.0.0.1", data_dir=str(data_dir))


# ------------------------------------------------------------------ stale maps


def test_a_client_with_a_stale_map_is_refused_then_refreshes(memory_cluster, client, table_name):
    """Another client drops the table and creates a namesake with another layout: the first
    client's next calls are refused (FAILED_PRECONDITION), it refreshes its map and gets the new
    table's rows, never the old layout's columns."""
    from client import MemoryClient

    client.create_table(table_name, 64, DIM, sharding="cols", seed=1)
    with MemoryClient(memory_cluster.endpoint, timeout=60) as other:
        stale = other.lookup(table_name, np.arange(64))  # caches the cols map
        client.drop_table(table_name)
        meta = client.create_table(table_name, 64, DIM, sharding="rows", seed=2)
        np.testing.assert_array_equal(other.lookup(table_name, np.arange(64)), initial(meta))
        assert not np.array_equal(stale, initial(meta))
        other.push_gradients(table_name, [5], np.ones((1, DIM), np.float32))  # a write goes to the new table too
        assert client.slot_stats(table_name, [5])["updates"][0] == 1
    old = pb.LookupRequest(table=table_name, ids=encode(torch.arange(2)), layout_id=meta.layout_id + 1)
    with grpc.insecure_channel(meta.shards[0].address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.DataPlaneStub(ch).Lookup(old)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "layout" in err.value.details()


# ------------------------------------------------------------------ log, then apply


def test_a_write_whose_log_append_fails_changes_nothing(tmp_path, monkeypatch):
    """The record is appended before the table changes: when the append fails the rows are as
    they were, so a retry cannot apply the write twice."""
    import memserver.storage.wal as wal

    spec = pb.TableSpec(name="m", num_rows=16, dim=4, optimizer=pb.OptimizerSpec(name="sgd", lr=1.0),
                        sharding=pb.ROWS, wal=True)
    shard = _shard(tmp_path, spec)
    try:
        with grpc.insecure_channel(shard.address) as ch:
            stub = pb_grpc.DataPlaneStub(ch)
            before = _rows(stub, "m", 16)

            def full_disk(fd, data):
                raise OSError(28, "No space left on device")

            monkeypatch.setattr(wal.os, "write", full_disk)
            with pytest.raises(grpc.RpcError) as full:
                _push(stub, "m", [1], np.ones((1, 4), np.float32), 1)
            monkeypatch.undo()
            assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert full.value.details().startswith("PushGradients on table m: No space left on device; the table's "
                                                   "write-ahead log stopped: its writes are refused until the shard "
                                                   "restarts (free or fix the disk first) (")  # its table; what follows
            assert full.value.details().endswith("shard-0000/m)")  # and the log's folder
            torch.testing.assert_close(_rows(stub, "m", 16), before, rtol=0, atol=0)
    finally:
        shard.stop()


# ------------------------------------------------------------------ optimizer fields


def test_zero_is_a_value_for_eps_and_beta1(client, table_name):
    """eps=0 and beta1=0 reach the shards as 0 (proto3 optional), not as "use the default"."""
    from memserver.core.optim import OptimizerConfig, optimizer_config

    client.create_table(table_name, 16, 4, optimizer="adam", eps=0.0, betas=(0.0, 0.999))
    with grpc.insecure_channel(client.endpoint) as ch:
        info = pb_grpc.ControlPlaneStub(ch).GetShardMap(pb.GetShardMapRequest(name=table_name))
    cfg = optimizer_config(info.spec.optimizer)
    assert (cfg.eps, cfg.effective_eps, cfg.beta1, cfg.beta2) == (0.0, 0.0, 0.0, 0.999)
    unset = optimizer_config(validate_spec(pb.TableSpec(name="x", num_rows=4, dim=4,
                                                        optimizer=pb.OptimizerSpec(name="adam")), 1).optimizer)
    assert unset == OptimizerConfig("adam", 0.01, 1e-8, 0.9, 0.999)


# ------------------------------------------------------------------ a gap in the log


def test_a_slice_whose_log_has_a_gap_is_not_served(tmp_path):
    """The log segment after the checkpoint is lost: the restarted shard lists the slice with the
    reason, answers DATA_LOSS and refuses to checkpoint it, instead of serving it without the
    acknowledged writes."""
    from memserver.api.errors import DataLossError

    spec = pb.TableSpec(name="m", num_rows=16, dim=4, optimizer=pb.OptimizerSpec(name="sgd", lr=1.0),
                        sharding=pb.ROWS, wal=True)
    shard = _shard(tmp_path / "data", spec)
    with grpc.insecure_channel(shard.address) as ch:
        stub = pb_grpc.DataPlaneStub(ch)
        _push(stub, "m", [1], np.ones((1, 4), np.float32), 1, acked_below=1)
        step_dir = tmp_path / "ck" / "step-0000000001"
        shard.checkpoint_table("m", str(step_dir / "m" / "shard-0000.pt"), 1)
        (step_dir / "manifest.json").write_text("{}")
        _push(stub, "m", [2], np.ones((1, 4), np.float32), 2, acked_below=2)  # acknowledged, then its file is lost
    shard.stop()
    segments = sorted((tmp_path / "data" / "shard-0000" / "m").glob("wal-*.log"))
    segments[-1].unlink()
    again = _shard_again(tmp_path / "data")
    try:
        (load,) = pb.ShardStatus.FromString(again.status()).tables
        assert "misses record 1" in load.unavailable
        with grpc.insecure_channel(again.address) as ch:
            with pytest.raises(grpc.RpcError) as err:
                _rows(pb_grpc.DataPlaneStub(ch), "m", 16)
        assert err.value.code() == grpc.StatusCode.DATA_LOSS
        with pytest.raises(DataLossError):
            again.checkpoint_table("m", str(tmp_path / "ck2" / "shard-0000.pt"), 2)
    finally:
        again.stop()


def test_a_slice_whose_whole_log_is_gone_is_not_served(tmp_path):
    """From an operator's walkthrough: a `wal` table with no checkpoint whose log files were
    removed came back from its initial values ("initial values + 0 logged writes"), every
    acknowledged write lost without a word. A table's log has a segment from its making on, so
    none at all is a loss: the slice is listed with the reason and answers DATA_LOSS."""
    spec = pb.TableSpec(name="m", num_rows=16, dim=4, optimizer=pb.OptimizerSpec(name="sgd", lr=1.0),
                        sharding=pb.ROWS, wal=True)
    shard = _shard(tmp_path / "data", spec)
    with grpc.insecure_channel(shard.address) as ch:
        _push(pb_grpc.DataPlaneStub(ch), "m", [1], np.ones((1, 4), np.float32), 1, acked_below=1)  # acknowledged
    shard.stop()
    for segment in (tmp_path / "data" / "shard-0000" / "m").glob("wal-*.log"):
        segment.unlink()
    again = _shard_again(tmp_path / "data")
    try:
        (load,) = pb.ShardStatus.FromString(again.status()).tables
        assert load.unavailable.startswith(f"its write-ahead log is gone (no wal-*.log in {tmp_path}/data/shard-0000/m")
        assert "writes acknowledged since initial values may be missing" in load.unavailable
        with grpc.insecure_channel(again.address) as ch:
            with pytest.raises(grpc.RpcError) as err:
                _rows(pb_grpc.DataPlaneStub(ch), "m", 16)
        assert err.value.code() == grpc.StatusCode.DATA_LOSS
    finally:
        again.stop()
    fresh = _shard(tmp_path / "fresh", spec)  # a table made and never written: its log is there, empty
    fresh.stop()
    served = _shard_again(tmp_path / "fresh")
    try:
        (load,) = pb.ShardStatus.FromString(served.status()).tables
        assert not load.unavailable and load.recovered_from == "initial values + 0 logged writes"
    finally:
        served.stop()


def test_threads_per_shard_reach_the_compute_thread():
    """numba's thread count is per thread: the shard sets it on the thread that computes."""
    import numba

    from memserver.server.dataplane import DataPlaneServicer

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one numba thread at most: nothing to tell apart")
    servicer = DataPlaneServicer(torch.device("cpu"), threads=1)  # a new thread's default is NUMBA_NUM_THREADS
    assert servicer.pool.submit(numba.get_num_threads).result() == 1
    servicer.pool.shutdown()


# ------------------------------------------------------------------ review fixes


def _slice(**spec_fields):
    from memserver.server.slice import TableSlice

    spec = validate_spec(pb.TableSpec(name="s", num_rows=16, dim=4, optimizer=pb.OptimizerSpec(name="sgd", lr=1.0),
                                      sharding=pb.ROWS, **spec_fields), 1)
    info = plan_table(spec, [{"address": "x", "node_id": "n", "pid": 1}]).shards[0]
    return TableSlice(spec, info, 1, torch.device("cpu"))


@pytest.mark.parametrize("wal", [True, False])
def test_a_write_that_fails_after_it_was_logged_stops_the_slices_writes(tmp_path, wal):
    """Said as it is: a logged write where the table has a log, a write applied part way where
    it has none (it used to say "logged" there too); and what lifts it."""
    sl = _slice(wal=wal)
    if wal:
        from memserver.storage.wal import WriteAheadLog

        sl.wal = WriteAheadLog(tmp_path / "wal")

    def boom():
        raise MemoryError("no room for the update")

    with pytest.raises(MemoryError):
        sl.once(pb.WriteTag(client_id="c", seq=1, acked_below=1), 2, pb.PushGradientsRequest(), boom)
    said = "a logged write failed to apply" if wal else "a write failed part way"
    with pytest.raises(FailedPreconditionError, match=f"table s: {said} .*; writes are refused until the shard restarts, or the "
                       "table is restored \\(memserver restore --replace --table s\\)"):
        sl.check_writable()


def test_dropping_old_open_steps_never_drops_the_step_just_sent():
    from memserver.server.slice import MAX_OPEN_STEPS

    sl = _slice()
    part = (torch.tensor([1]), torch.tensor([0]), torch.tensor([1.0]), torch.ones(1, 4))
    for step in range(1, MAX_OPEN_STEPS + 1):
        sl.gather(step, "c", step, part)
    sl.gather(0, "late", 1, part)  # a lagging trainer's step is the oldest one
    assert 0 in sl.steps and 1 not in sl.steps and len(sl.steps) == MAX_OPEN_STEPS


def test_a_sync_tables_steps_committed_with_no_part_here_stay_bounded():
    """A review: on a sync_updates table whose second trainer is gone, the shard that the live
    trainer only committed to (its parts all went to the other shard) kept a waiting step per
    commit, without end (200 after 200 steps): the bound held for parts alone."""
    from memserver.server.slice import MAX_OPEN_STEPS

    sl = _slice(sync_updates=True, sync_workers=2)
    for step in range(1, MAX_OPEN_STEPS + 40):
        assert sl.commit(step, "live") is None  # (it waits for the other trainer)
    assert len(sl.steps) == MAX_OPEN_STEPS and min(sl.steps) == 40  # the newest kept, the oldest dropped


def test_a_table_a_shard_lost_is_retried_with_the_same_tags_and_a_new_one_with_new_tags():
    """TableNotFound from a shard while the coordinator still maps the same layout: the retry
    keeps the write's seqs (a shard that applied it answers it); a new layout gets new seqs."""
    import asyncio

    from client import AsyncMemoryClient, TableNotFoundError
    from memserver.api.types import TableMeta

    async def run(new_layout: bool) -> tuple[list[int], list[int]]:
        c = AsyncMemoryClient("127.0.0.1:1", retry_seconds=0)
        metas = iter([1, 2 if new_layout else 1])

        async def table(name, refresh=False):
            if name not in c._tables:
                info = pb.TableInfo(spec=pb.TableSpec(name=name, num_rows=8, dim=2, sharding=pb.ROWS), layout_id=next(metas))
                info.shards.add(index=0, address="127.0.0.1:1", col_end=2, num_rows=8)
                c._tables[name] = TableMeta.from_proto(info)
            return c._tables[name]

        c.table = table
        tags = c.tags()
        seen: list[list[int]] = []

        async def fn(meta):
            tags(0, meta, meta.shards[0])
            seen.append(list(tags.seqs.values()))
            if len(seen) == 1:
                raise TableNotFoundError("gone")
            return "ok"

        assert await c._with_table("t", fn, tags) == "ok"
        return seen[0], seen[1]

    first, second = asyncio.run(run(new_layout=False))
    assert first == second
    first, second = asyncio.run(run(new_layout=True))
    assert first != second


# ------------------------------------------------------------------ checkpoints while serving


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_a_checkpoint_holds_its_tables_writes_only(tmp_path, monkeypatch, tier):
    """A slice's checkpoint file was written on the compute thread, holding every call of the
    shard for its whole length (a walkthrough: an unrelated 4-id lookup took 9.6 s during a 256
    MiB table's save; a disk table's file was read twice there until a later hunt). Now, while
    the file is written: another table's calls and this table's reads run; this table's writes
    wait, and the file holds the table as it was when the save began (values and read
    counters), with none of the writes that waited."""
    import threading

    import memserver.server.shard_actor as shard_actor
    from memserver.core.disk import MIN_CACHE_BYTES, unpack
    from memserver.server.shard_actor import ShardActor

    started, go = threading.Event(), threading.Event()
    save = shard_actor.save_slice

    def held_save(*args, **kwargs):
        started.set()
        assert go.wait(30)
        return save(*args, **kwargs)

    monkeypatch.setattr(shard_actor, "save_slice", held_save)
    sgd = pb.OptimizerSpec(name="sgd", lr=1.0)
    shard = ShardActor(0, host="127.0.0.1", data_dir=str(tmp_path / "data"))
    for name in ("big", "small"):
        disk = dict(tier="disk", cache_bytes=2 * MIN_CACHE_BYTES) if tier == "disk" and name == "big" else {}
        spec = validate_spec(pb.TableSpec(name=name, num_rows=64, dim=4, optimizer=sgd, sharding=pb.ROWS, **disk), 1)
        shard.create_table(spec.SerializeToString(), plan_table(spec, [shard.info()]).shards[0].SerializeToString(), 1)
    path = tmp_path / "ck" / "big.pt"
    try:
        with grpc.insecure_channel(shard.address) as ch:
            stub = pb_grpc.DataPlaneStub(ch)
            before = _rows(stub, "big", 64)
            saving = threading.Thread(target=shard.checkpoint_table, args=("big", str(path), 1))
            saving.start()
            assert started.wait(30)
            t0 = time.monotonic()
            stub.Lookup(pb.LookupRequest(table="small", ids=encode(torch.arange(4))), timeout=10)  # another table's
            stub.Bag(pb.BagRequest(table="big", ids=encode(torch.tensor([[3, 4]])), weights=encode(torch.ones(1, 2))),
                     timeout=10)  # this table's read (it counts: after the file's counters were taken)
            assert time.monotonic() - t0 < 5
            push = stub.PushGradients.future(pb.PushGradientsRequest(
                table="big", ids=encode(torch.tensor([3])), grads=encode(torch.ones(1, 4)),
                tag=pb.WriteTag(client_id="w", seq=1, acked_below=1)), timeout=30)
            # a waiting write whose client gives up (its deadline) must not end the others' wait (a
            # review: it cancelled the future they shared, and they waited out their deadlines)
            with pytest.raises(grpc.RpcError) as late:
                stub.PushGradients(pb.PushGradientsRequest(
                    table="big", ids=encode(torch.tensor([6])), grads=encode(torch.ones(1, 4)),
                    tag=pb.WriteTag(client_id="late", seq=1, acked_below=1)), timeout=0.3)
            assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert not push.done()  # this table's write waits for the file
            from memserver.api.errors import DeadlineExceededError

            rung = pb.PushGradientsRequest(table="big", ids=encode(torch.tensor([5])), grads=encode(torch.ones(1, 4)),
                                           tag=pb.WriteTag(client_id="d", seq=1, acked_below=1))
            with pytest.raises(DeadlineExceededError, match="while its table's checkpoint was written"):
                shard.servicer.serve_now("PushGradients", rung, deadline=time.monotonic() + 0.3)  # the doorbell's way
            if tier == "disk":  # a replace now would drop the table, whose files' space the save holds
                from memserver.api.errors import UnavailableError

                big = shard.servicer.tables["big"]
                with pytest.raises(UnavailableError, match="a checkpoint of it is being written"):
                    shard.check_fits(big.spec.SerializeToString(), big.info.SerializeToString(), 0, 0, 1 << 20, 1 << 20)
            t0 = time.monotonic()
            go.set()
            saving.join(30)
            assert push.result().rows == 1 and time.monotonic() - t0 < 5  # as soon as the file is written
            assert float(_rows(stub, "big", 64)[3, 0]) == float(before[3, 0]) - 1.0
    finally:
        go.set()
        shard.stop()
    if tier == "disk":  # (written: the replace is checked as any other)
        shard.check_fits(big.spec.SerializeToString(), big.info.SerializeToString(), 0, 0, 1 << 20, 1 << 20)
    saved = unpack(torch.load(path, weights_only=True)["state"])
    assert torch.equal(saved["weight"], before)  # as the save began: not the write that waited
    assert int(saved["hits"].sum()) == 64  # the lookup before it, not the bag during it
