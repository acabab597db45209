"""A training step applies on every shard of its table or on none: the two-phase commit of
`commit_step` (client.ops.commit_step_plan, TableSlice.step_phase; docs/architecture.md, "A training
step is one optimizer step"). Two shards run in this process (no Ray) per table; a second pair that
gets the same calls without the fault is the reference, compared exactly, every shard's values and
optimizer state included."""

from __future__ import annotations

import re
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from client import FailedPreconditionError, MemoryClient, MemserverError, StepAbortedError, ops
from memserver.api.v1 import memserver_pb2 as pb
from memserver.api.v1 import memserver_pb2_grpc as pb_grpc
from memserver.server.catalog import plan_table, validate_spec
from memserver.wire import encode

NAME, ROWS, DIM = "m", 64, 8


def spec(sharding: int = pb.COLS, wal: bool = True, **kwargs) -> pb.TableSpec:
    return pb.TableSpec(name=NAME, num_rows=ROWS, dim=DIM, sharding=sharding, wal=wal, seed=3, init_std=0.3,
                        optimizer=pb.OptimizerSpec(name="adagrad", lr=0.5), **kwargs)


class _Maps(pb_grpc.ControlPlaneServicer):
    """The one coordinator call a data-plane client makes: the shard map (re-read after a refusal)."""

    def __init__(self, info: pb.TableInfo) -> None:
        self.info = info

    def GetShardMap(self, request, context):
        return self.info


class Pair:
    """Two shards in this process holding one table, a stand-in coordinator serving its shard map,
    and clients."""

    def __init__(self, root, table: pb.TableSpec, session_ttl: float = 3600.0, client_id: str = "trainer",
                 count: int = 2) -> None:
        from memserver.server.shard_actor import ShardActor

        self.root, self.ttl = root, session_ttl
        self.shards = [ShardActor(i, host="127.0.0.1", data_dir=str(root), session_ttl=session_ttl)
                       for i in range(count)]  # (`count` 1: a table of one shard)
        table = validate_spec(table, count)
        self.info = plan_table(table, [s.info() for s in self.shards])
        for s, sh in zip(self.shards, self.info.shards):
            s.create_table(table.SerializeToString(), sh.SerializeToString(), count)
        self.maps = grpc.server(ThreadPoolExecutor(2))
        pb_grpc.add_ControlPlaneServicer_to_server(_Maps(self.info), self.maps)
        self.endpoint = f"127.0.0.1:{self.maps.add_insecure_port('127.0.0.1:0')}"
        self.maps.start()
        self.clients: list[MemoryClient] = []
        self.client = self.new_client(client_id)

    def new_client(self, client_id: str) -> MemoryClient:
        # shm=False: every call by gRPC, whose methods (`_methods`) the tests intercept to lose a
        # shard at a chosen phase (by the doorbell the same calls run the same plans)
        c = MemoryClient(self.endpoint, timeout=10, retry_seconds=0, client_id=client_id, shm=False)
        self.clients.append(c)
        return c

    def slice(self, i: int):
        return self.shards[i].servicer.tables[NAME]

    def state(self) -> list[dict[str, torch.Tensor]]:
        """Every shard's values, optimizer state and slot statistics (not the update times: a clock)."""
        return [{k: v.clone() for k, v in self.slice(i).table.state().items() if k != "last_update"} for i in range(2)]

    def checkpoint(self, step: int) -> None:
        for i, s in enumerate(self.shards):
            s.checkpoint_table(NAME, str(self.root / "ck" / f"step-{step:010d}" / NAME / f"shard-{i:04d}.pt"), step)
        (self.root / "ck" / f"step-{step:010d}" / "manifest.json").write_text("{}")

    def restart(self, i: int) -> str:
        """Stop shard i and start it again on its data directory (same port): what Ray does after
        a crash. Returns what it recovered from."""
        from memserver.server.shard_actor import ShardActor

        self.shards[i].stop()
        self.shards[i] = ShardActor(i, host="127.0.0.1", data_dir=str(self.root), session_ttl=self.ttl)
        return self.slice(i).recovered_from

    def close(self) -> None:
        for c in self.clients:
            c.close()
        for s in self.shards:
            s.stop()
        self.maps.stop(None)


@pytest.fixture
def pairs(tmp_path):
    made: list[Pair] = []

    def make(name: str, table: pb.TableSpec | None = None, **kwargs) -> Pair:
        made.append(Pair(tmp_path / name, table or spec(), **kwargs))
        return made[-1]

    yield make
    for p in made:
        p.close()


def batch(seed: int, bags: int = 6, k: int = 4) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.integers(0, ROWS, (bags, k)), rng.random((bags, k)).astype(np.float32),
            rng.normal(size=(bags, DIM)).astype(np.float32))


def send_part(client: MemoryClient, step: int, seed: int) -> None:
    client.bag_backward(NAME, *batch(seed), step=step, gather=True)


def train_step(client: MemoryClient, step: int, seeds: tuple[int, ...], **commit) -> None:
    for seed in seeds:
        send_part(client, step, seed)
    client.commit_step(NAME, step, **commit)


def assert_same(got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]]) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys()
        for k in g:
            torch.testing.assert_close(g[k], w[k], rtol=0, atol=0, msg=lambda m, i=i, k=k: f"shard {i}, {k}: {m}")


@pytest.mark.parametrize("sharding", [pb.COLS, pb.ROWS], ids=["cols", "rows"])
def test_a_part_lost_on_one_shard_aborts_the_step_on_every_shard(pairs, sharding):
    """Shard 1 lost a part of step 2 (as a shard restarted without it): PREPARE fails there, so the
    step is aborted on both shards; the client's error names the shard and the part; the table is
    the previous step on every shard; the next step commits as usual."""
    run, ref = pairs("run", spec(sharding)), pairs("ref", spec(sharding))
    for p in (run, ref):
        train_step(p.client, 1, (1,))
    before = run.state()
    for seed in (2, 3):
        send_part(run.client, 2, seed)
    parts = run.slice(1).steps[2]["trainer"].parts
    lost = min(parts)
    del parts[lost]
    with pytest.raises(StepAbortedError, match=f"step 2 aborted on every shard.*shard 1 does not hold part.s. seq {lost}"):
        run.client.commit_step(NAME, 2)
    assert_same(run.state(), before)
    assert not run.slice(0).steps and not run.slice(1).steps  # the step's parts are gone everywhere
    for p in (run, ref):
        train_step(p.client, 3, (4, 5))
    assert_same(run.state(), ref.state())


def test_a_gather_call_that_failed_on_one_shard_commits_only_the_listed_parts(pairs, monkeypatch):
    """A gather call fails for good on shard 1 after shard 0 stored its part: the client lists
    only the parts every shard acknowledged, so shard 0 drops the extra part and the step equals
    one without the failed call, on both shards."""
    run, ref = pairs("run"), pairs("ref")
    for p in (run, ref):
        train_step(p.client, 1, (1,))
    broken = run.slice(1)
    with monkeypatch.context() as m:
        m.setattr(broken, "check_writable", lambda: (_ for _ in ()).throw(RuntimeError("disk on fire")))
        with pytest.raises(MemserverError, match="disk on fire"):
            send_part(run.client, 2, 2)
    assert len(run.slice(0).steps[2]["trainer"].parts) == 1 and 2 not in run.slice(1).steps
    train_step(run.client, 2, (3,))
    train_step(ref.client, 2, (3,))
    assert_same(run.state(), ref.state())


def _raw_steps(pair: Pair, seeds: tuple[int, ...], step: int, first_seq: int) -> list[pb_grpc.DataPlaneStub]:
    """Stubs of both shards, after sending them the gather parts of `step` as client "raw" would
    (a cols table: each shard its columns of grad_out), seqs first_seq, first_seq + 1, ..."""
    stubs = [pb_grpc.DataPlaneStub(grpc.insecure_channel(s.address)) for s in pair.shards]
    for n, seed in enumerate(seeds):
        ids, w, g = batch(seed)
        for stub, sh in zip(stubs, pair.info.shards):
            stub.BagBackward(pb.BagBackwardRequest(
                table=NAME, ids=encode(torch.as_tensor(ids)), weights=encode(torch.as_tensor(w)),
                grad_out=encode(torch.as_tensor(g[:, sh.col_start : sh.col_end]).contiguous()), step=step, gather=True,
                tag=pb.WriteTag(client_id="raw", seq=first_seq + n, acked_below=first_seq)))
    return stubs


def _phase(stubs, step: int, phase: int, seq: int, acked_below: int, seqs: list[int] = (), attempt: int = 0,
           parts: int = 0):
    return [stub.CommitStep(pb.CommitStepRequest(table=NAME, step=step, phase=phase, part_seqs=seqs, parts=parts,
                                                 tag=pb.WriteTag(client_id="raw", seq=seq, acked_below=acked_below,
                                                                 attempt=attempt)))
            for stub in stubs]


def test_retried_phases_apply_once(pairs):
    """PREPARE, COMMIT and ABORT resent with the same tag (a lost answer) are answered as
    duplicates and applied once; a COMMIT of an aborted step is refused and changes nothing."""
    run, ref = pairs("run"), pairs("ref", client_id="raw")
    train_step(ref.client, 1, (1, 2))
    stubs = _raw_steps(run, (1, 2), 1, 1)
    for attempt in (0, 1):
        acks = _phase(stubs, 1, pb.STEP_PREPARE, 3, 1, [1, 2], attempt)
        assert [a.duplicate for a in acks] == [bool(attempt)] * 2
    for attempt in (0, 1, 2):
        acks = _phase(stubs, 1, pb.STEP_COMMIT, 4, 3, attempt=attempt)
        assert [a.duplicate for a in acks] == [bool(attempt)] * 2
    assert_same(run.state(), ref.state())

    _raw_steps(run, (3,), 2, 5)
    _phase(stubs, 2, pb.STEP_PREPARE, 6, 5, [5])
    for attempt in (0, 1):
        assert [a.duplicate for a in _phase(stubs, 2, pb.STEP_ABORT, 7, 6, attempt=attempt)] == [bool(attempt)] * 2
    assert not run.slice(0).steps and not run.slice(1).steps
    with pytest.raises(grpc.RpcError) as err:
        _phase(stubs[:1], 2, pb.STEP_COMMIT, 8, 8)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "not prepared" in err.value.details()
    assert_same(run.state(), ref.state())


@pytest.mark.parametrize("checkpoint", [False, True], ids=["log", "checkpoint+log"])
def test_a_wal_shard_restarted_between_prepare_and_commit_still_commits(pairs, checkpoint):
    """Shard 1 restarts after voting (its parts and its prepared mark come back from its log, or
    from a checkpoint taken while prepared plus the log after it): the client's COMMIT applies the
    step there as on shard 0, and the table equals a run without the restart."""
    run, ref = pairs("run"), pairs("ref")
    for p in (run, ref):
        train_step(p.client, 1, (1,))
        for seed in (2, 3):
            send_part(p.client, 2, seed)
    plan = ops.commit_step_plan(run.client.aio.session, NAME, 2, 2)
    make, tags, _ = next(plan)
    voted = run.client._call(NAME, make, tags)
    assert run.slice(1).steps[2]["trainer"].prepared
    if checkpoint:
        run.checkpoint(2)
    recovered = run.restart(1)
    assert recovered == ("checkpoint step 2 + 0 logged writes" if checkpoint else "initial values + 6 logged writes")
    assert run.slice(1).steps[2]["trainer"].prepared
    make, tags, _ = plan.send(voted)
    with pytest.raises(StopIteration):
        plan.send(run.client._call(NAME, make, tags))
    ref.client.commit_step(NAME, 2)
    assert_same(run.state(), ref.state())


def _prepared_then_restarted(run: Pair, shard: int):
    """A table without wal: step 1 trained and checkpointed, step 2 prepared on both shards, then
    shard `shard` restarted (back to checkpoint step 1, the prepared step gone). Returns the
    commit plan and its decision's (make, tags), not sent yet."""
    train_step(run.client, 1, (1,))
    run.checkpoint(1)
    send_part(run.client, 2, 2)
    plan = ops.commit_step_plan(run.client.aio.session, NAME, 2, 2)
    make, tags, _ = next(plan)
    voted = run.client._call(NAME, make, tags)
    assert run.restart(shard) == "checkpoint step 1"
    make, tags, _ = plan.send(voted)
    return plan, make, tags


def test_a_shard_without_wal_restarted_between_prepare_and_commit_leaves_one_checkpoint(pairs):
    """Without the log, shard 1 comes back as its last checkpoint (step 1), without the prepared
    step: its COMMIT is refused while shard 0 applies; the coordinator then rolls shard 0 back to
    the same checkpoint (ShardActor.rollback_table, as on a real restart), so the table is step 1
    on every shard, as a run that never sent step 2."""

    run, ref = pairs("run", spec(wal=False)), pairs("ref", spec(wal=False))
    train_step(ref.client, 1, (1,))
    plan, make, tags = _prepared_then_restarted(run, 1)
    with pytest.raises(FailedPreconditionError, match="cannot commit on shard 1: the step is not prepared"):
        plan.send(run.client._call(NAME, make, tags))
    run.shards[0].rollback_table(NAME, str(run.root / "ck" / f"step-{1:010d}"))
    assert_same(run.state(), ref.state())


def test_a_decision_that_missed_a_shard_is_resent_before_the_next_step(pairs, monkeypatch):
    """The COMMIT reaches shard 0 but not shard 1 (unavailable past the client's retries): the
    call raises, and the client's next commit_step on the table sends it again, same tags, before
    its own step; then the table equals a run where nothing failed."""
    run, ref = pairs("run"), pairs("ref")
    for p in (run, ref):
        train_step(p.client, 1, (1,))
        send_part(p.client, 2, 2)
    def prepared() -> bool:  # shard 1 answers PREPARE, then is unreachable for the decision
        c = run.slice(1).steps.get(2, {}).get("trainer")
        return c is not None and c.prepared

    monkeypatch.setattr(run.client, "_methods", _commit_step_down(run, 1, prepared))
    with pytest.raises(MemserverError, match="the commit did not reach every shard"):
        run.client.commit_step(NAME, 2)
    assert 2 not in run.slice(0).steps and run.slice(1).steps[2]["trainer"].prepared
    monkeypatch.undo()
    send_part(run.client, 3, 3)
    run.client.commit_step(NAME, 3)
    assert not run.client.aio.session.undecided(NAME)
    ref.client.commit_step(NAME, 2)
    train_step(ref.client, 3, (3,))
    assert_same(run.state(), ref.state())


@pytest.mark.parametrize("by", ["sync", "aio"])
def test_a_decision_one_shard_refuses_is_kept_for_the_shard_it_could_not_reach(pairs, monkeypatch, caplog, by):
    """The COMMIT is refused by shard 0 (restarted without the log: the prepared step is gone) and
    cannot reach shard 1: the call raised shard 0's refusal (first in shard order), a final one,
    so the decision was not kept, and shard 1 held its prepared step until its session expired.
    A write raises the shard it could not reach first: the decision is kept, re-sent before the
    next commit, and shard 1 commits then (shard 0's refusal is logged)."""
    run = pairs("run", spec(wal=False))
    plan, make, tags = _prepared_then_restarted(run, 0)  # shard 0 lost the prepared step: it refuses the commit
    if by == "sync":  # the blocking client's own first attempt
        monkeypatch.setattr(run.client, "_methods", _commit_step_down(run, 1))
        call = run.client._call
    else:  # the asyncio client's
        monkeypatch.setattr(run.client.aio, "_data", _aio_commit_step_down(run, 1))

        def call(table, make, tags):
            return run.client._run(run.client.aio._call(table, make, tags, retry=False))
    try:
        got = call(NAME, make, tags)
    except MemserverError as exc:
        got = exc
    with pytest.raises(MemserverError, match=r"step 2: the commit did not reach every shard \(shard unreachable \(test\); "
                                             r"and shard 127.0.0.1:\d+ refused it: FAILED_PRECONDITION: .*cannot commit "
                                             "on shard 0"):
        plan.send(got)
    assert run.slice(1).steps[2]["trainer"].prepared  # waits for the decision
    monkeypatch.undo()
    send_part(run.client, 3, 3)
    run.client.commit_step(NAME, 3)
    assert 2 not in run.slice(1).steps and not run.client.aio.session.undecided(NAME)
    assert "the commit of step 2 was refused: " in caplog.text and "cannot commit on shard 0" in caplog.text


def test_a_commits_errors_keep_the_status_the_shard_answered():
    """A review: a shard's INTERNAL failure of a commit reached the caller as UNKNOWN (the plan's
    errors were made again without their code): a PREPARE_COMMIT's, a kept decision's re-send's
    and an abort's after an unreachable prepare."""
    from memserver.api.errors import error_for

    for shards in (1, 2):
        session = ops.ClientSession("c")
        plan = ops.commit_step_plan(session, "t", 1, shards)
        next(plan)
        with pytest.raises(MemserverError) as got:
            plan.send(error_for(grpc.StatusCode.INTERNAL, "boom", "shard x"))  # the prepare (one shard: the commit)
            plan.send(error_for(grpc.StatusCode.INTERNAL, "boom again", "shard x"))  # the abort, kept
        assert got.value.code == grpc.StatusCode.INTERNAL, (shards, got.value)
        plan = ops.commit_step_plan(session, "t", 2, shards)  # the kept decision re-sent first
        next(plan)
        with pytest.raises(MemserverError) as got:
            plan.send(error_for(grpc.StatusCode.INTERNAL, "still", "shard x"))
        assert got.value.code == grpc.StatusCode.INTERNAL and "has not reached every shard" in got.value.details


def _step_2_sent(pairs: Any) -> tuple[Any, Any]:
    """Two tables alike (`run`, `ref`) after step 1, each with step 2's part sent; `ref`'s step 2
    committed, `run`'s left to the test to commit (and interrupt)."""
    run, ref = pairs("run"), pairs("ref")
    for p in (run, ref):
        train_step(p.client, 1, (1,))
        send_part(p.client, 2, 2)
    ref.client.commit_step(NAME, 2)
    return run, ref


def _interrupted_commits(run: Pair, monkeypatch, by: str):
    """Make every COMMIT to `run`'s shard 1 interrupted: by Ctrl-C (`by` "sync": the blocking
    client's call raises KeyboardInterrupt) or by its caller's deadline (the asyncio client's call
    is slow and the commit is cancelled). Returns a function that commits a step expecting that."""
    import asyncio

    address = run.shards[1].address

    def is_commit(raw) -> bool:
        return pb.CommitStepRequest.FromString(bytes(raw)).phase == pb.STEP_COMMIT

    if by == "sync":  # Ctrl-C while the COMMIT to shard 1 is out
        real = run.client._methods

        def methods(at):
            got = dict(real(at))
            if at == address:
                commit = got["CommitStep"]

                def interrupted(raw, *a, **k):
                    if is_commit(raw):
                        raise KeyboardInterrupt
                    return commit(raw, *a, **k)

                got["CommitStep"] = interrupted
            return got

        monkeypatch.setattr(run.client, "_methods", methods)

        def commit(step: int) -> None:
            with pytest.raises(KeyboardInterrupt):
                run.client.commit_step(NAME, step)
    else:  # cancelled by its caller's deadline while the COMMIT to shard 1 is slow
        real_data = run.client.aio._data

        async def data(at, method, request, server=None):
            if at == address and method == "CommitStep" and is_commit(request):
                await asyncio.sleep(5)
            return await real_data(at, method, request, server)

        monkeypatch.setattr(run.client.aio, "_data", data)

        def commit(step: int) -> None:
            with pytest.raises((asyncio.TimeoutError, TimeoutError)):
                run.client._run(asyncio.wait_for(run.client.aio.commit_step(NAME, step), 1.0))

    return commit


@pytest.mark.parametrize("by", ["sync", "aio"])
def test_a_commit_interrupted_with_its_decision_out_keeps_the_decision(pairs, monkeypatch, by):
    """A review: a commit cancelled (asyncio.wait_for, a cancelled task) or interrupted (Ctrl-C)
    while its COMMIT was on the way to shard 1 dropped the decision: step 2 committed on shard 0
    and stayed prepared on shard 1 for good, its seqs in flight for ever. The decision is kept and
    re-sent before the next commit, and the table equals a run never interrupted."""
    run, ref = _step_2_sent(pairs)
    _interrupted_commits(run, monkeypatch, by)(2)
    # (shard 0 has committed, or will, or was not sent it yet: the call beside the interrupted one)
    assert run.slice(1).steps[2]["trainer"].prepared
    assert list(run.client.aio.session.undecided(NAME)) == [2]  # kept, to re-send
    monkeypatch.undo()
    for p in (run, ref):
        train_step(p.client, 3, (3,))
    assert 2 not in run.slice(0).steps and 2 not in run.slice(1).steps and not run.client.aio.session.undecided(NAME)
    assert_same(run.state(), ref.state())


@pytest.mark.parametrize("then", ["commit-again", "next-step"])
@pytest.mark.parametrize("by", ["sync", "aio"])
def test_a_commit_interrupted_while_it_resends_an_earlier_decision_aborts_its_step(pairs, monkeypatch, by, then):
    """A hunt: step 3's commit interrupted (Ctrl-C, a deadline) while it re-sent step 2's kept
    COMMIT, before its own PREPARE, left step 3's parts open on the shards and in the client: a
    trainer that went on to step 4 left them there for good, and one that committed step 3 again
    applied it late, unannounced (after sending its parts again: twice). Step 3 is aborted, that
    abort kept and re-sent like a decision; a commit of step 3 that delivers it is refused
    (StepAbortedError), and the table equals a run that never sent step 3."""
    run, ref = _step_2_sent(pairs)
    commit = _interrupted_commits(run, monkeypatch, by)
    commit(2)  # step 2's COMMIT kept for shard 1
    send_part(run.client, 3, 3)
    commit(3)  # interrupted while it re-sends step 2's COMMIT
    assert not any(c.prepared for i in range(2) for c in run.slice(i).steps[3].values())  # never prepared
    assert list(run.client.aio.session.undecided(NAME)) == [2, 3]  # step 2's COMMIT, step 3's ABORT
    monkeypatch.undo()
    if then == "commit-again":
        send_part(run.client, 3, 4)  # (the step sent again: dropped with the rest by the abort)
        with pytest.raises(StepAbortedError, match=r"table m: step 3 is not committed: its commit was aborted"):
            run.client.commit_step(NAME, 3)
    for p in (run, ref):
        train_step(p.client, 4, (5,))
    assert all(3 not in run.slice(i).steps for i in range(2)) and not run.client.aio.session.undecided(NAME)
    assert_same(run.state(), ref.state())


@pytest.mark.parametrize("by", ["sync", "aio"])
def test_the_aborts_kept_for_interrupted_commits_are_bounded(pairs, monkeypatch, by):
    """Each commit interrupted while it re-sent an undeliverable decision kept one more abort,
    without end while the shard stayed away, and each commit re-sent them all. Past
    MAX_KEPT_ABORTS of a table (here 2) a never-prepared step's parts are dropped in the client
    alone: its commit is refused, its parts stay open on the shards and apply nothing, and the
    table equals a run that never sent those steps."""
    run, ref = _step_2_sent(pairs)
    session = run.client.aio.session
    commit = _interrupted_commits(run, monkeypatch, by)
    monkeypatch.setattr(session, "MAX_KEPT_ABORTS", 2)
    commit(2)  # step 2's COMMIT kept for shard 1
    for step in (3, 4, 5, 6):
        send_part(run.client, step, step)
        commit(step)  # interrupted while it re-sends the kept decisions
    assert list(session.undecided(NAME)) == [2, 3, 4]  # step 2's COMMIT, then two aborts: no more
    assert not session._parts and all(c.parts and not c.prepared for st in (5, 6) for c in run.slice(1).steps[st].values())
    monkeypatch.undo()
    with pytest.raises(StepAbortedError, match=r"table m: step 5 is not committed: its commit was interrupted "
                                               r"\((KeyboardInterrupt|CancelledError)\) before its decision went out, "
                                               r"with 2 aborts of earlier steps of the table still kept"):
        run.client.commit_step(NAME, 5)  # (delivers the kept decisions first)
    assert not session.undecided(NAME) and not any(st in run.slice(i).steps for st in (2, 3, 4) for i in range(2))
    send_part(run.client, 6, 7)  # a dropped step sent again: its commit lists the new part alone
    send_part(ref.client, 6, 7)
    for p in (run, ref):
        p.client.commit_step(NAME, 6)
        train_step(p.client, 7, (8,))
    assert_same(run.state(), ref.state())
    assert not session._in_flight


@pytest.mark.parametrize("by", ["sync", "aio"])
def test_a_retried_commit_interrupted_while_it_resends_its_own_steps_kept_commit_keeps_that_commit(pairs, monkeypatch,
                                                                                                   by):
    """A review: step 2's commit interrupted with its COMMIT out (kept), then the same step's
    commit retried and interrupted again while it re-sent that COMMIT, replaced the kept COMMIT
    by an abort: shard 0 kept the step, shard 1 never got it, the next commit said the step was
    dropped whole, and the COMMIT's seq stayed in flight for good. The kept COMMIT stays kept."""
    run, ref = _step_2_sent(pairs)
    session = run.client.aio.session
    commit = _interrupted_commits(run, monkeypatch, by)
    commit(2)  # step 2's COMMIT kept for shard 1
    kept = session.undecided(NAME)[2]
    commit(2)  # retried: interrupted again while it re-sends that COMMIT
    assert session.undecided(NAME)[2] is kept
    monkeypatch.undo()
    run.client.commit_step(NAME, 2)  # delivers it: step 2 committed on both shards
    assert not session.undecided(NAME)
    for p in (run, ref):
        train_step(p.client, 3, (3,))
    assert_same(run.state(), ref.state())
    assert not session._in_flight  # (no seq left in flight: the shards free this client's answers)


def test_an_abort_kept_for_a_shard_out_of_reach_does_not_refuse_the_steps_next_commit(pairs, monkeypatch):
    """A review: step 2's COMMIT missed shard 1 (kept); its retried commit delivered it, then its
    own (empty) PREPARE and ABORT could not reach shard 1 (an ABORT kept). The next commit of
    step 2 delivered that ABORT and raised StepAbortedError ("dropped every part ... send the step
    again"): the step was committed everywhere, and sending it again applied it twice. Only the
    abort an interrupt keeps for its own step drops the step's parts, and only it says so."""
    from client import MemserverError

    run, ref = pairs("run"), pairs("ref")
    for p in (run, ref):
        train_step(p.client, 1, (1,))
    train_step(ref.client, 2, (2,))
    send_part(run.client, 2, 2)
    address, real = run.shards[1].address, run.client._methods
    failing = {pb.STEP_COMMIT}

    def methods(at):
        got = dict(real(at))
        if at == address:
            commit = got["CommitStep"]

            def flaky(raw, *a, **k):
                if pb.CommitStepRequest.FromString(bytes(raw)).phase in failing:
                    raise _Unavailable()
                return commit(raw, *a, **k)

            got["CommitStep"] = flaky
        return got

    monkeypatch.setattr(run.client, "_methods", methods)
    with pytest.raises(MemserverError):
        run.client.commit_step(NAME, 2)  # the COMMIT reaches shard 0 only: kept
    failing.clear()
    failing.update({pb.STEP_PREPARE, pb.STEP_ABORT})
    with pytest.raises(MemserverError):
        run.client.commit_step(NAME, 2)  # the kept COMMIT goes out; the step's own PREPARE cannot
    monkeypatch.undo()
    run.client.commit_step(NAME, 2)  # the kept ABORT goes out: nothing of step 2 is dropped by it
    assert not run.client.aio.session.undecided(NAME)
    assert_same(run.state(), ref.state())


@pytest.mark.parametrize("bounded", [False, True], ids=["", "bounded"])
@pytest.mark.parametrize("kept", [False, True], ids=["", "kept"])
@pytest.mark.parametrize("shards", [2, 1])
def test_a_ctrl_c_anywhere_in_a_commit_keeps_its_decision(tmp_path, monkeypatch, shards, kept, bounded):
    """A hunt: a Ctrl-C that lands in the commit's own code between its calls (the plan's step,
    the blocking client's loop: not a call, which settle_interrupted covers) dropped the decision:
    past the PREPARE, the step stayed prepared on every shard with nothing kept to re-send (and
    before it, the step's parts were left open). A KeyboardInterrupt is raised at each line of
    the commit in turn (`kept`: with an earlier step's decision kept to re-send first): after each, a
    step any shard holds of this client is a kept decision's (or an abort's), the next commit
    settles it, and every shard applied the same steps. `bounded`: no abort may be kept for a step
    never prepared (MAX_KEPT_ABORTS 0), so such a step is dropped in the client alone; one whose
    PREPARE may be out keeps its abort all the same (a review: a prepared step dropped so would
    be committed by its session's expiry)."""
    import sys

    from client.ops import steps

    run = Pair(tmp_path, spec(), count=shards)
    try:
        applied: dict[int, list[int]] = {i: [] for i in range(shards)}
        for i in range(shards):
            sl, real = run.slice(i), run.slice(i).commit
            monkeypatch.setattr(sl, "commit", lambda st, client, i=i, real=real: (applied[i].append(st), real(st, client))[1])
        session = run.client.aio.session
        if bounded:
            monkeypatch.setattr(session, "MAX_KEPT_ABORTS", 0)
        train_step(run.client, 1, (1,))
        commit = MemoryClient.commit_step.__code__  # and every function of the plan's module

        def interrupt_at(n: int, fired: list[int]):
            def local(frame, event, arg):
                # the client's loop from its first call on (before, the plan never ran: as a Ctrl-C before the call)
                if event == "line" and (frame.f_code is not commit or "make" in frame.f_locals):
                    fired.append(frame.f_lineno)
                    if len(fired) == n:
                        raise KeyboardInterrupt
                return local

            return lambda frame, event, arg: local if frame.f_code is commit or frame.f_code.co_filename == \
                steps.__file__ else None

        for n in range(1, 200):
            fired: list[int] = []
            step = 3 * n
            if kept:  # step - 1's decision cannot reach a shard: kept
                send_part(run.client, step - 1, step - 1)
                with monkeypatch.context() as down, pytest.raises(MemserverError, match=f"step {step - 1}"):
                    down.setattr(run.client, "_methods", _commit_step_down(run, shards - 1))
                    run.client.commit_step(NAME, step - 1)
                assert list(session.undecided(NAME)) == [step - 1]
            send_part(run.client, step, step)
            tracer = sys.gettrace()  # (a coverage run's, put back)
            sys.settrace(interrupt_at(n, fired))
            try:
                run.client.commit_step(NAME, step)
            except KeyboardInterrupt:
                pass
            finally:
                sys.settrace(tracer)
            if len(fired) < n:
                break  # the commit ran to its end before its n-th line: every line was tried
            held = session.undecided(NAME)
            if (NAME, step) in session._parts:  # interrupted before the plan did anything: the step can be committed
                assert step not in held and not any(run.slice(i).steps[step]["trainer"].prepared for i in range(shards))
                run.client.commit_step(NAME, step)
            dropped = {st for t, st in session._forgotten if t == NAME}  # (bounded: open on the shards, never prepared)
            assert bounded or not dropped
            for i in range(shards):
                for st, got in run.slice(i).steps.items():
                    assert "trainer" not in got or st in held or (st in dropped and not got["trainer"].prepared), \
                        (n, fired[-1], i, st, held)
            train_step(run.client, step + 1, (step + 1,))  # re-sends what was kept first
            assert not session.undecided(NAME) and not session._parts, (n, fired[-1])
            assert all(set(run.slice(i).steps) <= dropped for i in range(shards)), n
            if any(run.slice(i).steps for i in range(shards)):
                run.client.drop_open_steps(NAME)  # (those parts: an operator's remedy, so the next round starts clean)
            if shards == 2:
                assert applied[0] == applied[1], (n, fired[-1])
        assert n > 10
    finally:
        run.close()


def test_a_step_whose_shard_cannot_be_reached_says_so_and_is_aborted_when_it_can(pairs, monkeypatch):
    """Shard 1 is unreachable for both phases (its cluster went away): the error says the shards
    could not be reached (not only that an abort is pending); once it is back, the next commit
    delivers the abort first, and the table equals a run that never sent step 2."""
    run, ref = pairs("run"), pairs("ref")
    for p in (run, ref):
        train_step(p.client, 1, (1,))
    send_part(run.client, 2, 2)
    monkeypatch.setattr(run.client, "_methods", _commit_step_down(run, 1))
    with pytest.raises(MemserverError, match=r"step 2 is not committed: a shard could not be reached \(stopped, its "
                                             r"host lost or cut off\), neither by its prepare .*shard unreachable.* nor by "
                                             "the abort that followed .*; nothing of the step was applied"):
        run.client.commit_step(NAME, 2)
    monkeypatch.undo()
    for p in (run, ref):
        send_part(p.client, 3, 3)
        p.client.commit_step(NAME, 3)
    assert not run.client.aio.session.undecided(NAME)
    assert_same(run.state(), ref.state())


def test_the_abort_after_an_unreachable_prepare_gets_one_attempt_not_a_second_retry_window(pairs, monkeypatch):
    """A client that retries: its PREPARE to an unreachable shard is retried for its window; the
    ABORT that follows is sent once (it is kept and re-sent before the next commit), so a trainer
    whose cluster went away fails after one window, not two."""
    run = pairs("run")
    client = MemoryClient(run.endpoint, timeout=10, retry_seconds=1.0, client_id="retrying", shm=False)
    run.clients.append(client)
    train_step(client, 1, (1,))
    send_part(client, 2, 2)
    address, real, sent = run.shards[1].address, client._methods, []

    def methods(at):
        got = dict(real(at))
        if at == address:
            def down(request, **kwargs):
                sent.append(pb.CommitStepRequest.FromString(request).phase)
                raise _Unavailable()

            got["CommitStep"] = down
        return got

    monkeypatch.setattr(client, "_methods", methods)
    with pytest.raises(MemserverError, match="neither by its prepare .* nor by the abort"):
        client.commit_step(NAME, 2)
    assert sent.count(pb.STEP_PREPARE) >= 3  # the prepare did use the retry window
    assert sent.count(pb.STEP_ABORT) == 1 and sent[-1] == pb.STEP_ABORT
    monkeypatch.undo()
    send_part(client, 3, 3)
    client.commit_step(NAME, 3)  # the kept abort is delivered first
    assert not client.aio.session.undecided(NAME)


def _commit_step_down(run, shard: int, when=lambda: True):
    """run.client's methods with shard `shard`'s CommitStep unreachable (UNAVAILABLE) while `when()`."""
    address, real = run.shards[shard].address, run.client._methods

    def methods(at):
        got = dict(real(at))
        if at == address and when():
            def down(*a, **k):
                raise _Unavailable()

            got["CommitStep"] = down
        return got

    return methods


def _aio_commit_step_down(run, shard: int):
    """run.client.aio's data-plane sender with shard `shard`'s CommitStep unreachable."""
    address, real = run.shards[shard].address, run.client.aio._data

    async def data(at, method, request, server=None):
        if at == address and method == "CommitStep":
            from client import UnavailableError

            raise UnavailableError("shard unreachable (test)", target=f"shard {at}")
        return await real(at, method, request, server)

    return data


class _Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "shard unreachable (test)"


def test_a_client_made_anew_with_a_used_client_id_is_refused_and_told_why(pairs):
    """A client_id names one client's writes (seqs from 1): a second client given the same id
    (a restarted process passing its own id) sends seq 1 again. The shard refuses it rather than
    answer it as the first client's write, and says what to change; nothing is applied."""
    run = pairs("run")
    for step in (1, 2):
        train_step(run.client, step, (step,))
    before = run.state()
    again = run.new_client("trainer")
    with pytest.raises(FailedPreconditionError, match="same client_id, its writes start at 1 again: give each client its own"):
        again.push_gradients(NAME, np.arange(4), np.ones((4, DIM), np.float32))
    assert_same(run.state(), before)


def test_ctrl_c_stops_a_sync_call_in_its_retries(pairs, monkeypatch):
    """A shard unreachable: the sync client retries the call on its loop thread, for up to
    retry_seconds. Ctrl-C raised KeyboardInterrupt in the caller and left the retries running
    unseen (a review: a commit's PREPARE retried after the ABORT the interrupted commit kept).
    Now the retries stop with the caller: nothing is sent after the attempt under way ends."""
    import signal
    import threading

    run = pairs("run")
    c = MemoryClient(run.endpoint, timeout=0.5, retry_seconds=30.0, client_id="interrupted", shm=False)
    run.clients.append(c)
    c.lookup(NAME, np.arange(4), count=False)  # the map cached: the first attempt runs in this thread
    address, real, sent = run.shards[1].address, c._methods, []

    class Down:  # shard 1's Lookup, as a plain call and as a future
        def __call__(self, raw, **kwargs):
            sent.append(time.monotonic())
            raise _Unavailable()

        def future(self, raw, **kwargs):
            from concurrent.futures import Future

            sent.append(time.monotonic())
            fut: Future = Future()
            fut.set_exception(_Unavailable())
            return fut

    def methods(at):
        got = dict(real(at))
        if at == address:
            got["Lookup"] = Down()
        return got

    monkeypatch.setattr(c, "_methods", methods)
    # Python's own Ctrl-C, whatever an earlier test of this process left: twice a whole suite run
    # (never the file alone) saw no interrupt here, the retries running out their 30 s; said, so
    # that what left another handler can be found (the next session's to look into)
    if (found := signal.getsignal(signal.SIGINT)) is not signal.default_int_handler:
        warnings.warn(f"SIGINT's handler was {found!r} when this test began", stacklevel=1)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(2.0, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            c.lookup(NAME, np.arange(4), count=False)
        assert time.monotonic() - t0 < 5
    finally:
        timer.cancel()
        if found is not None:  # (None: a handler not set from Python, which cannot be put back)
            signal.signal(signal.SIGINT, found)
    assert len(sent) >= 2  # (the first attempt, and retries)
    after = len(sent)
    time.sleep(3.0)
    assert len(sent) <= after + 1, f"{len(sent) - after} attempts after the interrupt"


def test_a_prepared_step_of_a_client_that_went_away_commits_when_its_session_expires(pairs):
    """The client prepares step 2 on both shards and dies before COMMIT. Once its session expires,
    each shard commits the prepared step itself (a logged write) before the next write it serves;
    the table equals a run where the client committed, and still does after a restart replays
    the log."""
    run, ref = pairs("run", session_ttl=2.0), pairs("ref")
    for p in (ref, run):  # run's last write right before its PREPARE: a stall there cannot outlive the ttl
        train_step(p.client, 1, (1,))
        send_part(p.client, 2, 2)
    plan = ops.commit_step_plan(run.client.aio.session, NAME, 2, 2)
    make, tags, _ = next(plan)
    run.client._call(NAME, make, tags)  # PREPARE on both; then the client is gone
    plan.close()
    time.sleep(3.0)
    other = run.new_client("other")
    train_step(other, 1, (4,))
    ref.client.commit_step(NAME, 2)
    train_step(ref.new_client("other"), 1, (4,))
    assert_same(run.state(), ref.state())
    run.restart(1)
    assert_same(run.state(), ref.state())


def test_past_the_open_steps_bound_a_step_prepared_and_undecided_is_not_the_one_dropped(pairs, monkeypatch):
    """A new step past MAX_OPEN_STEPS dropped the oldest whole, a step prepared on both shards and
    waiting for its COMMIT among them: dropped on one shard, committed on the other (a hunt). The
    oldest step not waiting for a decision goes instead."""
    import memserver.server.slice as slice_mod

    run = pairs("run")
    monkeypatch.setattr(slice_mod, "MAX_OPEN_STEPS", 2)
    send_part(run.client, 1, 1)
    plan = ops.commit_step_plan(run.client.aio.session, NAME, 1, 1)
    make, tags, _ = next(plan)
    voted = run.client._call(NAME, make, tags)  # step 1 prepared on both shards
    send_part(run.new_client("b"), 2, 2)
    send_part(run.new_client("c"), 3, 3)  # a third step: one goes
    assert [sorted(run.slice(i).steps) for i in (0, 1)] == [[1, 3], [1, 3]]
    make, tags, _ = plan.send(voted)
    with pytest.raises(StopIteration):
        plan.send(run.client._call(NAME, make, tags))  # committed on both


def test_a_client_id_back_after_its_session_expired_replays_as_it_was_taken(pairs):
    """A client id used again after its session expired (a trainer restarted with a fixed id): its
    writes, seq 1 again, were taken live as a new client's; the log's replay, which expires no
    session, refused them as late duplicates and the slice was lost (DATA_LOSS) at the shard's next
    restart (a hunt). The replay takes them as they were taken."""
    run, ref = pairs("run", session_ttl=2.0), pairs("ref")
    for step in (1, 2):
        train_step(run.client, step, (step,))
        train_step(ref.client, step, (step,))
    time.sleep(3.0)
    train_step(run.new_client("other"), 3, (4,))  # the next write expires the idle session
    train_step(ref.new_client("other"), 3, (4,))
    again = run.new_client("trainer")  # the same id, its writes from seq 1
    train_step(again, 4, (5,))
    train_step(ref.client, 4, (5,))
    assert_same(run.state(), ref.state())
    for i in (0, 1):
        run.restart(i)
    assert_same(run.state(), ref.state())


def test_the_late_commit_of_a_step_its_sessions_expiry_committed_is_answered_as_applied(pairs):
    """A client slow past its session's TTL between PREPARE and COMMIT: the shards committed its
    prepared step (presumed commit), then its COMMIT was refused "not prepared (aborted, or lost in
    a restart?)", though applied; a trainer taking that at its word and sending the step again
    applies it twice (a hunt). It is answered as applied, as drop-steps' commits are, and a
    restart's replay remembers the same."""
    run, ref = pairs("run", session_ttl=2.0), pairs("ref")
    for p in (ref, run):
        train_step(p.client, 1, (1,))
        send_part(p.client, 2, 2)
    plan = ops.commit_step_plan(run.client.aio.session, NAME, 2, 2)
    make, tags, _ = next(plan)
    voted = run.client._call(NAME, make, tags)  # PREPARE on both; then the client stalls past its TTL
    time.sleep(3.0)
    train_step(run.new_client("other"), 1, (4,))  # each shard's next write decides: presumed commit
    make, tags, _ = plan.send(voted)
    with pytest.raises(StopIteration):
        plan.send(run.client._call(NAME, make, tags))  # the late COMMIT: answered, not refused
    ref.client.commit_step(NAME, 2)
    train_step(ref.new_client("other"), 1, (4,))
    assert_same(run.state(), ref.state())
    run.restart(1)
    assert not run.slice(1).drop_committed  # (the replay remembers it and its answered COMMIT forgets it, as live)
    assert_same(run.state(), ref.state())


@pytest.mark.parametrize("defer", [False, True], ids=["now", "defer_apply"])
def test_a_sync_table_applies_the_mean_once_every_trainer_committed(pairs, defer):
    """Two data-parallel trainers on a sync_updates table, each committing in two phases (with
    defer_apply the shards apply right after answering). Trainer b has only prepared when a
    commits: nothing applies; b's COMMIT applies the step on both shards, equal to one trainer
    stepping their mean on a table without sync."""
    run = pairs("run", spec(sync_updates=True, sync_workers=2))
    ref = pairs("ref")
    a, b = run.client, run.new_client("b")
    send_part(a, 1, 1)
    send_part(b, 1, 2)
    plan = ops.commit_step_plan(b.aio.session, NAME, 1, 2, defer)
    make, tags, _ = next(plan)
    voted = b._call(NAME, make, tags)  # b prepared, not committed
    a.commit_step(NAME, 1, defer_apply=defer)
    assert [run.slice(i).steps[1]["trainer"].committed for i in range(2)] == [True, True]
    assert_same(run.state(), ref.state())  # one trainer committed: nothing applied yet
    make, tags, _ = plan.send(voted)
    with pytest.raises(StopIteration):
        plan.send(b._call(NAME, make, tags))
    ids1, w1, g1 = batch(1)
    ids2, w2, g2 = batch(2)
    ref.client.bag_backward(NAME, np.concatenate([ids1, ids2]), np.concatenate([w1, w2]),
                            np.concatenate([g1, g2]) / 2, step=1, gather=True)
    ref.client.commit_step(NAME, 1)
    run.client.lookup(NAME, [0])  # after any deferred update (it runs before the next request)
    for got, want in zip(run.state(), ref.state()):
        for k in ("weight", "acc", "updates"):
            torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("sync, gather", [(False, True), (True, True), (True, False)],
                         ids=["part", "sync-part", "sync-whole"])
def test_a_part_of_a_step_without_its_step_or_a_tag_a_commit_can_name_is_refused_keeping_nothing(pairs, sync, gather):
    """A hunt: a gather part or a sync table's BagBackward of step 0 (proto3's unset; a sync table
    then showed "waiting step 0", which reads as none waiting), and an untagged or seq 0 part,
    were acknowledged: the untagged one was then dropped by its commit (PREPARE names parts by
    seq), the seq 0 one aborted its PREPARE "does not hold part(s) seq 0", untagged trainers were
    one "anonymous" trainer. Each is refused INVALID_ARGUMENT before anything is kept, as is a
    CommitStep of step 0."""
    run = pairs("run", spec(sync_updates=sync, sync_workers=2 if sync else 0))
    before = run.state()
    stub = pb_grpc.DataPlaneStub(grpc.insecure_channel(run.info.shards[0].address))
    ids, w, g = batch(1)
    what = "a gather part of a step" if gather else r"a sync_updates table's BagBackward \(a trainer's step\)"

    def refused(call, request, says: str):
        with pytest.raises(grpc.RpcError) as err:
            call(request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert re.search(says, err.value.details()), err.value.details()

    def part(step: int, **tag) -> pb.BagBackwardRequest:
        return pb.BagBackwardRequest(table=NAME, ids=encode(torch.as_tensor(ids)), weights=encode(torch.as_tensor(w)),
                                     grad_out=encode(torch.as_tensor(g[:, :4]).contiguous()), step=step, gather=gather,
                                     tag=pb.WriteTag(**tag))

    if sync:  # (another table's step 0 is a step: the library takes it, LocalValues as RemoteValues)
        refused(stub.BagBackward, part(0, client_id="t", seq=1),
                f"step: {what} of a sync_updates table needs the trainer's step \\(>= 1\\), got 0")
    refused(stub.BagBackward, part(2), f"tag: {what} needs a write tag with a client_id and a seq >= 1 .*got "
                                       "client_id '', seq 0")
    refused(stub.BagBackward, part(2, client_id="t", seq=0), "tag: .* needs a write tag .*client_id 't', seq 0")
    if sync:
        refused(stub.CommitStep, pb.CommitStepRequest(table=NAME, step=0, phase=pb.STEP_PREPARE_COMMIT,
                                                      tag=pb.WriteTag(client_id="t", seq=1)),
                r"step: a CommitStep of a sync_updates table closes the trainer's step \(>= 1\), got 0")
    assert_same(run.state(), before)
    assert [(run.slice(i).steps, dict(run.slice(i).sessions.by_client)) for i in range(2)] == [({}, {})] * 2
    stub.BagBackward(part(2, client_id="t", seq=1))  # with its step and tag: taken
    assert 2 in run.slice(0).steps
    if not sync and gather:  # step 0 of a table that is not sync: a step like any other
        stub.BagBackward(part(0, client_id="t", seq=2))
        assert 0 in run.slice(0).steps


def test_a_sync_step_a_trainer_dropped_applies_no_trainers_update(pairs):
    """A GradScaler overflow on one of two data-parallel trainers: both scalers skip the dense
    step (DDP sums the overflow into every trainer's gradients), but the shards applied the other
    trainer's half of the step (a walkthrough). The overflowing trainer's commit drops the whole
    step on every shard; the next step applies as ever, and a restarted shard (its log replayed)
    agrees."""
    run = pairs("run", spec(sync_updates=True, sync_workers=2))
    ref = pairs("ref", spec(sync_updates=True, sync_workers=2))
    a, b = run.client, run.new_client("b")
    ra, rb = ref.client, ref.new_client("b")
    send_part(a, 1, 1)
    send_part(b, 1, 2)
    assert b.abandon_step(NAME, 1) == 1  # (RemoteValues.end_step after an overflow)
    a.commit_step(NAME, 1)
    plan = ops.commit_step_plan(b.aio.session, NAME, 1, 2, False, True)  # b.commit_step(NAME, 1, drop=True)
    make, tags, _ = next(plan)
    voted = b._call(NAME, make, tags)  # b prepared, dropping the step
    for i in range(2):  # a checkpoint's open steps keep it (one written before drop_step: no drop)
        sl = run.slice(i)
        kept = sl.extras()
        sl.load_extras({**kept, "step_parts": [t[:5] for t in kept["step_parts"]]})
        assert not sl.steps[1]["b"].drop
        sl.load_extras(kept)
        assert sl.steps[1]["b"].drop and sl.steps[1]["b"].prepared
    make, tags, _ = plan.send(voted)
    with pytest.raises(StopIteration):
        plan.send(b._call(NAME, make, tags))
    ra.commit_step(NAME, 1)  # the reference: a step with nothing in it
    rb.commit_step(NAME, 1)
    assert not any(run.slice(i).steps for i in range(2))  # closed, not left waiting
    assert_same(run.state(), ref.state())
    for c, r, seed in ((a, ra, 3), (b, rb, 4)):
        train_step(c, 2, (seed,))
        train_step(r, 2, (seed,))
    assert_same(run.state(), ref.state())
    assert not torch.equal(run.state()[0]["weight"], pairs("fresh", spec()).state()[0]["weight"])  # step 2 applied
    run.restart(1)
    assert_same(run.state(), ref.state())


def test_an_old_client_s_count_commit_still_applies_on_its_shard(pairs):
    """Backward compatibility: CommitStep without a phase carries a part count and is decided by
    each shard alone, as before the two phases."""
    run, ref = pairs("run"), pairs("ref", client_id="raw")
    train_step(ref.client, 1, (1, 2))
    stubs = _raw_steps(run, (1, 2), 1, 1)
    with pytest.raises(grpc.RpcError) as err:
        _phase(stubs[:1], 1, pb.STEP_PHASE_UNSPECIFIED, 3, 1, parts=3)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "this shard has 2" in err.value.details()
    _phase(stubs, 1, pb.STEP_PHASE_UNSPECIFIED, 4, 1, parts=2)
    assert_same(run.state(), ref.state())


@pytest.mark.parametrize("sharding", [pb.COLS, pb.ROWS], ids=["cols", "rows"])
def test_parts_without_dl_dw_make_the_same_step_and_the_shards_skip_it(pairs, sharding, monkeypatch):
    """bag_backward(weight_grad=False) (Engram's constant weights): None back, no dL/dw computed on
    any shard, and the very step (values and optimizer state) of parts that asked for it."""
    from memserver.core.table import ValueTable

    calls = {"n": 0}
    bag_grad = ValueTable.bag_grad

    def counting(self, *args, **kwargs):
        calls["n"] += 1
        return bag_grad(self, *args, **kwargs)

    skipping, asking = pairs("skip", spec(sharding)), pairs("ask", spec(sharding))
    # (after the shards start: their kernels' warm-up calls bag_grad, counted when this test ran alone)
    monkeypatch.setattr(ValueTable, "bag_grad", counting)
    for step in (1, 2):
        for seed in (step, step + 10):
            assert skipping.client.bag_backward(NAME, *batch(seed), step=step, gather=True, weight_grad=False) is None
        skipping.client.commit_step(NAME, step)
    assert calls["n"] == 0
    for step in (1, 2):
        for seed in (step, step + 10):
            asking.client.bag_backward(NAME, *batch(seed), step=step, gather=True)
        asking.client.commit_step(NAME, step)
    assert_same(skipping.state(), asking.state())
    assert calls["n"] == 2 * 2 * 2  # the asking pair's: 2 steps x 2 parts x 2 shards
    # the trainer's call (memtrain's Engram and LSH parts) skips it too
    assert skipping.client.submit_bag_backward(NAME, *batch(5), step=3).result() is None
    assert calls["n"] == 8


def test_a_part_sent_as_lists_reserves_a_seq_for_each_of_its_requests():
    """A review: a call given lists counted as one request, so its later requests (a call past
    max_request_bytes) took their seqs when built, after a blocking part sent later."""
    from client.ops.base import OpOptions
    from client.ops.values import backward_requests

    opts = OpOptions(max_request_bytes=1024)
    ids, grad_out = np.arange(60).reshape(60, 1), np.zeros((60, 2), np.float32)
    want = backward_requests(ids, None, grad_out, opts)
    assert want == 2 and backward_requests(ids.tolist(), None, grad_out.tolist(), opts) == want


def test_a_part_sent_without_waiting_keeps_its_place_before_a_later_blocking_part(pairs):
    """A step's parts apply in seq order, and a part sent without waiting (submit_bag_backward: a
    trainer's Engram or LSH part) took its seq only when the client's loop thread ran it: a blocking
    part sent after it, while the loop was busy, took the smaller seq and applied first (row 0:
    (1e8 - 1e8) + 1 against the caller's (1 + 1e8) - 1e8; a run not reproducible bit for bit). The
    seqs are taken on the caller's thread when it sends, in its call order."""
    import threading

    first = (np.array([[0]]), np.array([[1.0]], np.float32), np.ones((1, DIM), np.float32))
    then = (np.array([[0, 0]]), np.array([[1.0, -1.0]], np.float32), np.full((1, DIM), 1e8, np.float32))
    run, ref = pairs("run", spec(pb.ROWS)), pairs("ref", spec(pb.ROWS))
    ref.client.bag_backward(NAME, *first, step=1, gather=True)
    ref.client.bag_backward(NAME, *then, step=1, gather=True)
    ref.client.commit_step(NAME, 1)
    run.client.table(NAME)  # the shard map cached: a blocking call runs on the caller's thread
    busy, free = threading.Event(), threading.Event()

    async def hold() -> None:  # the loop thread busy (as a trainer's other calls keep it)
        busy.set()
        free.wait(30)

    held = run.client._loop.submit(hold())
    assert busy.wait(30)
    sent = run.client.submit_bag_backward(NAME, *first, step=1)
    run.client.bag_backward(NAME, *then, step=1, gather=True)
    free.set()
    held.result(30)
    assert sent.result(30) is None
    run.client.commit_step(NAME, 1)
    assert_same(run.state(), ref.state())


def test_a_rollback_whose_checkpoint_is_damaged_leaves_the_slice_lost_not_closed(pairs):
    """Rolling back to a damaged checkpoint fails, and the slice is then lost (DATA_LOSS with the
    reason, listed), not a closed slice still served."""
    from client import DataLossError

    run = pairs("run", spec(wal=False))
    train_step(run.client, 1, (1,))
    run.checkpoint(1)
    (run.root / "ck" / f"step-{1:010d}" / NAME / "shard-0000.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(DataLossError):
        run.shards[0].rollback_table(NAME, str(run.root / "ck" / f"step-{1:010d}"))
    assert NAME not in run.shards[0].servicer.tables
    with pytest.raises(DataLossError, match="rolling back with its restarted sibling failed"):
        run.client.lookup(NAME, np.arange(4))


def test_a_rollback_under_a_trainer_is_named_by_the_step_it_breaks_and_raised_once_by_remote_values(pairs, caplog):
    """A table without `wal`: shard 0 restarts from the checkpoint of step 1 and shard 1 rolls back
    with it while step 2's parts are out. The commit is refused naming the rollback (it said "lost
    in a restart?", of a shard that never restarted); the next step's answers carry the rebuild,
    the client warns (naming each shard's address) and counts it, and RemoteValues raises
    TableRolledBackError at that step's end, once: its model is ahead of the values."""
    import logging

    from client import StepAbortedError, TableRolledBackError
    from trainer.memory import RemoteValues

    run = pairs("run", spec(wal=False))
    values = RemoteValues(run.client, NAME, ROWS, DIM, create=False)
    assert run.client.rebuilds(NAME) == (0, "")

    def step(n: int) -> None:
        ids, w, g = (torch.from_numpy(x) for x in batch(n))
        values.begin_step(n)
        values.bag(ids, w)
        values.bag_backward(ids, w, g)
        values.end_step(n)

    step(1)
    run.checkpoint(1)
    ids, w, g = (torch.from_numpy(x) for x in batch(2))
    values.begin_step(2)
    values.bag_backward(ids, w, g)
    assert run.restart(0) == "checkpoint step 1"
    run.shards[1].rollback_table(NAME, str(run.root / "ck" / f"step-{1:010d}"))
    with pytest.raises(StepAbortedError, match="this slice came back from (rollback to )?checkpoint step 1 without a "
                                               "log \\(the table has no `wal`\\): parts sent before that are gone"):
        values.end_step(2)
    caplog.set_level(logging.WARNING, logger="client.ops.sessions")
    with pytest.raises(TableRolledBackError, match=f"table {NAME}: rebuilt without a write-ahead log .*: writes "
                                                   "acknowledged to this client after that point are lost, while this "
                                                   "trainer's model kept them"):
        step(3)
    count, what = run.client.rebuilds(NAME)
    addresses = [s.address for s in run.shards]
    assert count == 1 and (f"its slice 0 on the shard at {addresses[0]} from checkpoint step 1; its slice 1 on the "
                           f"shard at {addresses[1]} from rollback to checkpoint step 1") in what
    assert [r.getMessage() for r in caplog.records if r.name == "client.ops.sessions"] == [
        what + ". Give the table `wal`, or checkpoint it as often as you can afford to lose work"]
    step(4)  # raised once: a trainer that chose to go on is not stopped again


def test_remote_values_save_refuses_a_checkpoint_of_values_rolled_back_after_the_last_write(tmp_path):
    """A rollback after a step's last write is first seen by the checkpoint (its rebuilt slices,
    counted by the client): save raises before the trainer writes its file beside that checkpoint
    (a model of step N paired with older values). Once: the next save goes through."""
    from types import SimpleNamespace

    from client import TableRolledBackError
    from trainer.memory import RemoteValues

    class Client:
        seen = 0

        def table(self, name):
            return SimpleNamespace(num_rows=8, dim=4, kind="value", optimizer="adagrad", lr=0.01, layout_id=1)

        def rebuilds(self, name):
            return self.seen, f"table {name}: rebuilt without a write-ahead log (a test)"

        def checkpoint(self, directory, step, tables):
            self.seen = 1  # this checkpoint's answer named a slice rebuilt since this client's writes

    values = RemoteValues(Client(), "t", 8, 4, create=False)
    with pytest.raises(TableRolledBackError, match="table t: rebuilt without a write-ahead log \\(a test\\), while "
                                                   "this trainer's model kept them"):
        values.save(tmp_path, 3)
    assert values.save(tmp_path, 4) == {"checkpoint": "memory/t", "table": "t", "num_rows": 8, "dim": 4,
                                        "optimizer": "adagrad", "lr": 0.01}


def test_a_trainer_whose_table_is_made_anew_under_it_stops_at_the_end_of_the_step(memory_cluster, client, table_name):
    """A second memtrain run of the same --table replaced a running one's table: the first went on
    training on the second's fresh values without a word (a walkthrough: its val loss 2.43 -> 3.05),
    where a rollback stops it. It stops the same way now; the run that made the table goes on."""
    from client import TableRolledBackError
    from trainer.memory import RemoteValues

    ids, w, g = torch.tensor([[1, 2]]), torch.ones(1, 2), torch.ones(1, 4)

    def step(values: RemoteValues, n: int) -> None:
        values.begin_step(n)
        values.bag(ids, w)
        values.bag_backward(ids, w, g)
        values.end_step(n)

    from client import MemoryClient

    with MemoryClient(memory_cluster.endpoint) as other:  # another run: another process's client
        first = RemoteValues(client, table_name, 8, 4, optimizer="sgd", lr=0.1)
        step(first, 1)
        attached = RemoteValues(client, table_name, 8, 4, optimizer="sgd", lr=0.1, create=False)  # (before any step)
        second = RemoteValues(other, table_name, 8, 4, optimizer="sgd", lr=0.1)  # the same name
        step(second, 1)
        before = other.lookup(table_name, np.arange(8), count=False)
        with pytest.raises(TableRolledBackError, match=f"table {table_name} was made anew while this trainer trained"):
            step(first, 2)  # (its calls found the new incarnation: the shards refused the old one's)
        np.testing.assert_array_equal(other.lookup(table_name, np.arange(8), count=False), before)  # not committed
        for call in (lambda: step(first, 3), lambda: first.bag(ids, w), lambda: first.bag_backward(ids, w, g),
                     lambda: first.submit_bag(ids, w)):  # a walkthrough caught the error once and trained on:
            with pytest.raises(TableRolledBackError, match="refuses its reads, updates, steps and saves until values.load"):
                call()  # (the other run's table took its updates)
        np.testing.assert_array_equal(other.lookup(table_name, np.arange(8), count=False), before)
        with pytest.raises(TableRolledBackError, match="was made anew"):  # attached to the old one
            step(attached, 3)
        step(second, 2)
        joined = RemoteValues(client, table_name, 8, 4, optimizer="sgd", lr=0.1, create=False)
        step(joined, 4)
        step(second, 3)


def test_a_steps_part_never_reaches_a_table_made_anew(memory_cluster, client, table_name, capsys):
    """A step's part sent after another run made the table anew (a sync table now) went to the new
    table, where it held a place in that step for good: the new run's second trainer was refused
    there (a review). Refused before it is sent now, waited for or not (constant weights), with
    this backend's error; the new table has no open step."""
    import json

    from client import TableRolledBackError
    from memserver.cli import main as cli_main
    from trainer.memory import RemoteValues

    ids, w, g = torch.tensor([[1, 2]]), torch.ones(1, 2), torch.ones(1, 4)
    with MemoryClient(memory_cluster.endpoint) as other:
        first = RemoteValues(client, table_name, 8, 4, optimizer="sgd", lr=0.1)
        attached = RemoteValues(client, table_name, 8, 4, optimizer="sgd", lr=0.1, create=False)
        RemoteValues(other, table_name, 8, 4, optimizer="sgd", lr=0.1, sync_workers=2)  # another run, the same name
        first.begin_step(5)
        with pytest.raises(TableRolledBackError, match=f"table {table_name} was made anew while this trainer trained"):
            first.bag_backward(ids, w, g)
        attached.begin_step(5)
        assert attached.bag_backward(ids, w, g, weight_grad=False) is None  # sent without waiting
        with pytest.raises(TableRolledBackError, match="was made anew"):
            attached.end_step(5)
        assert first.step is None and attached.step is None  # (no "never ended" warning at a later begin_step)
        assert cli_main(["status", "--json", "--endpoint", client.endpoint]) == 0
        st = json.loads(capsys.readouterr().out)
        assert [t["open_steps"] for s in st["shards"] for t in s["tables"] if t["table"] == table_name] == [0, 0]


def test_a_commit_after_the_table_was_made_anew_takes_no_place_in_the_new_runs_sync_step(memory_cluster, client,
                                                                                          table_name, capsys):
    """A walkthrough: trainer A2 of a sync table sent its step-2 part, another run made the table
    anew (a sync table of 2 too), then A2 committed: the client committed the step on the new table
    with no parts, so it took a place in the new run's step 2, which applied at its first trainer's
    commit, and the second trainer's commit stayed open there for good. The backend pins its
    table: A2's commit is refused, nothing is sent to the new table, and the new run's steps apply
    at their second commit."""
    import json

    from client import TableRolledBackError
    from memserver.cli import main as cli_main
    from trainer.memory import RemoteValues

    ids, w, g = torch.tensor([[1, 2]]), torch.ones(1, 2), torch.ones(1, 4)

    def step(values: RemoteValues, n: int, end: bool = True) -> None:
        values.begin_step(n)
        values.bag(ids, w)
        values.bag_backward(ids, w, g)
        if end:
            values.end_step(n)

    with MemoryClient(memory_cluster.endpoint) as c2, MemoryClient(memory_cluster.endpoint) as b1c, \
            MemoryClient(memory_cluster.endpoint) as b2c:
        a1 = RemoteValues(client, table_name, 8, 4, optimizer="sgd", lr=0.1, sync_workers=2)
        a2 = RemoteValues(c2, table_name, 8, 4, optimizer="sgd", lr=0.1, create=False)
        step(a1, 1), step(a2, 1), step(a1, 2)
        step(a2, 2, end=False)  # its part sent, not committed yet
        b1 = RemoteValues(b1c, table_name, 8, 4, optimizer="sgd", lr=0.1, sync_workers=2)  # another run
        b2 = RemoteValues(b2c, table_name, 8, 4, optimizer="sgd", lr=0.1, create=False)
        with pytest.raises(TableRolledBackError, match=f"table {table_name} was made anew while this trainer trained"):
            a2.end_step(2)
        for n in (1, 2):
            before = b1c.lookup(table_name, np.arange(8), count=False)
            step(b1, n)
            np.testing.assert_array_equal(b1c.lookup(table_name, np.arange(8), count=False), before)  # waits for b2
            step(b2, n)
            assert not np.array_equal(b1c.lookup(table_name, np.arange(8), count=False), before)
        assert cli_main(["status", "--json", "--endpoint", client.endpoint]) == 0
        st = json.loads(capsys.readouterr().out)
        assert [t["open_steps"] for s in st["shards"] for t in s["tables"] if t["table"] == table_name] == [0, 0]


def test_an_update_outside_a_step_never_reaches_a_table_made_anew(memory_cluster, client, table_name):
    """A backend used without steps (bag_backward applied at once): once another run made its table
    anew, its next update is refused before it is sent. The check came after the call, and the
    client's retry had followed the name to the new table: one update in the other run's rows."""
    from client import FailedPreconditionError, TableRolledBackError
    from trainer.memory import RemoteValues

    ids, w, g = torch.tensor([[1, 2]]), torch.ones(1, 2), torch.ones(1, 4)
    with MemoryClient(memory_cluster.endpoint) as other:
        first = RemoteValues(client, table_name, 8, 4, optimizer="sgd", lr=0.1)
        first.bag_backward(ids, w, g)  # (outside a step: applied at once)
        RemoteValues(other, table_name, 8, 4, optimizer="sgd", lr=0.1)  # another run, the same name
        before = other.lookup(table_name, np.arange(8), count=False)
        with pytest.raises(TableRolledBackError, match=f"table {table_name} was made anew while this trainer trained"):
            first.bag_backward(ids, w, g)
        np.testing.assert_array_equal(other.lookup(table_name, np.arange(8), count=False), before)
        with pytest.raises(TableRolledBackError, match="refuses its reads, updates"):
            first.bag_backward(ids, w, g)
        np.testing.assert_array_equal(other.lookup(table_name, np.arange(8), count=False), before)
    now = client.lookup(table_name, np.arange(8), count=False)
    with pytest.raises(FailedPreconditionError, match=r"was made anew \(incarnation \d+\) since the caller began"):
        client.bag_backward(table_name, ids, w, g, layout=client.table(table_name).layout_id + 1)  # the client's own check
    np.testing.assert_array_equal(client.lookup(table_name, np.arange(8), count=False), now)


class _Handle:
    """A stand-in Ray actor handle over a shard in this process: `handle.method.remote(...)` is
    awaited by the coordinator; here it runs the shard's method in a thread, recording the order."""

    def __init__(self, shard, order: list, gate=None) -> None:
        self.shard, self.order, self.gate = shard, order, gate

    def __getattr__(self, method: str):
        handle = self

        class _Method:
            @staticmethod
            def remote(*args):
                async def run():
                    import asyncio

                    if handle.gate is not None and method == "rollback_table":
                        await handle.gate.wait()
                    result = await asyncio.to_thread(getattr(handle.shard, method), *args)
                    handle.order.append((method, handle.shard.index))
                    return result

                return run()

        return _Method


def test_a_restarted_shard_holds_its_slice_until_every_rollback_of_the_table_is_done(pairs):
    """A table without `wal`: the restarted shard holds its slice (UNAVAILABLE: clients retry; a
    checkpoint refused too) until the coordinator has rolled its siblings back. With two shards
    of the table restarting together, the first restart's release waited for nothing else, so a
    write in the gap was undone by the second's rollback (a review); a slice rolled back while
    held stays held, and a release meant for another process of the shard is not taken."""
    import asyncio

    from client import UnavailableError
    from memserver.server.coordinator import ControlPlaneServicer

    run, ref = pairs("run", spec(wal=False)), pairs("ref", spec(wal=False))
    for p in (run, ref):
        train_step(p.client, 1, (1,))
    run.checkpoint(1)
    ck = str(run.root / "ck" / f"step-{1:010d}" / NAME / "shard-0000.pt")
    train_step(run.client, 2, (2,))  # after the checkpoint: lost with the restarts
    run.restart(0), run.restart(1)  # both of the table's shards (a host holding both went down)
    for i in (0, 1):
        assert run.shards[i]._hold([{"table": NAME, "wal": False, "checkpoint": ck}]) == [NAME]
    with pytest.raises(UnavailableError, match="its slice waits for the table's other shards to roll back"):
        run.client.lookup(NAME, np.arange(4), count=False)
    with pytest.raises(UnavailableError, match="checkpoint it again"):
        run.shards[0].checkpoint_table(NAME, str(run.root / "ck2.pt"), 2)
    assert run.shards[1].held_slices()["held"] == [{"table": NAME, "wal": False, "checkpoint": ck,
                                                    "layout_id": run.info.layout_id}]
    run.shards[1].release_tables([NAME], pid=-1)  # another process's release: not taken
    assert run.slice(1).held

    async def both() -> list:
        order: list = []
        gate = asyncio.Event()
        coord = ControlPlaneServicer([_Handle(run.shards[0], order), _Handle(run.shards[1], order, gate)],
                                     [s.info() for s in run.shards])
        coord.tables[NAME], coord.placement[NAME] = run.info, [0, 1]
        held = [{"table": NAME, "wal": False, "checkpoint": ck}]
        first = asyncio.ensure_future(coord.roll_back_siblings(0, run.shards[0].info()["pid"], held))  # rolls 1 back
        second = asyncio.ensure_future(coord.roll_back_siblings(1, run.shards[1].info()["pid"], held))  # rolls 0 back
        for _ in range(600):  # the second's rollback of shard 0 is done (within 30 s); the first's of shard 1 waits
            if ("rollback_table", 0) in order:
                break
            await asyncio.sleep(0.05)
        assert run.slice(0).held and run.slice(0).recovered_from.startswith("rollback")  # still held
        gate.set()
        await asyncio.gather(first, second)
        return order

    order = asyncio.run(both())
    assert [o for o in order if o[0] == "release_tables"] == [("release_tables", 0), ("release_tables", 1)]
    assert order.index(("release_tables", 0)) > order.index(("rollback_table", 1))  # only once every rollback is done
    assert not run.slice(0).held and not run.slice(1).held
    assert_same(run.state(), ref.state())  # the table is step 1 on every shard, as a run that never sent step 2
    for p in (run, ref):
        train_step(p.client, 3, (3,))
    assert_same(run.state(), ref.state())


def test_a_table_made_anew_since_a_shard_restarted_keeps_its_slices_from_the_old_tables_rollback(pairs, caplog):
    """A table without `wal`: shard 0 restarted, and before the coordinator rolled shard 1 back to
    the checkpoint shard 0 came back as, the name was made anew (a create with replace). The
    rollback named only the table, so shard 1 rebuilt the new table's slice from the new table's
    record: its initial values, its acknowledged writes lost (a review). The rollback names the
    layout the restarted shard recovered; a shard holding another one leaves its slice alone."""
    import asyncio
    import logging

    from memserver.server.coordinator import ControlPlaneServicer

    run = pairs("run", spec(wal=False))
    train_step(run.client, 1, (1,))
    run.checkpoint(1)
    ck = str(run.root / "ck" / f"step-{1:010d}" / NAME / "shard-0000.pt")
    old = run.info.layout_id
    run.restart(0)
    held = run.shards[0].held_slices()["held"] or [{"table": NAME, "wal": False, "checkpoint": ck, "layout_id": old}]
    assert held[0]["layout_id"] == old
    # made anew on both shards (as the coordinator's replace does), then written to
    new_spec = validate_spec(spec(wal=False), 2)
    run.info.CopyFrom(plan_table(new_spec, [s.info() for s in run.shards]))
    assert run.info.layout_id != old
    for s, sh in zip(run.shards, run.info.shards):
        s.drop_table(NAME)
        s.create_table(new_spec.SerializeToString(), sh.SerializeToString(), 2)
    train_step(run.client, 1, (2,))
    written = run.state()

    async def roll_back() -> list:
        order: list = []
        coord = ControlPlaneServicer([_Handle(run.shards[0], order), _Handle(run.shards[1], order)],
                                     [s.info() for s in run.shards])
        coord.tables[NAME], coord.placement[NAME] = run.info, [0, 1]
        await coord.roll_back_siblings(0, run.shards[0].info()["pid"], held)
        return order

    with caplog.at_level(logging.INFO):
        order = asyncio.run(roll_back())
    assert ("rollback_table", 1) in order and ("release_tables", 0) in order  # asked, and answered
    assert_same(run.state(), written)  # the new table's writes are all there
    assert f"table {NAME} was made anew since its sibling restarted (layout {run.info.layout_id}, not {old})" \
        in caplog.text
    assert "rolled back to" not in caplog.text


def test_a_rollback_from_a_shard_of_the_previous_code_reaches_its_siblings_as_before(pairs):
    """A held slice reported without its layout (a shard of the previous code, before a restarted
    coordinator of this code): the siblings are rolled back with the two arguments that code's
    rollback_table takes (a review: a third one raised TypeError there, and the table was served
    without its rollback)."""
    import asyncio

    from memserver.server.coordinator import ControlPlaneServicer

    run = pairs("run", spec(wal=False))
    calls: list = []

    class Previous:  # the previous code's shard: rollback_table(name, checkpoint_dir)
        index = 1

        def rollback_table(self, name, checkpoint_dir):
            calls.append((name, checkpoint_dir))
            return "checkpoint step 1"

        def release_tables(self, names, pid=None):
            calls.append(("released", tuple(names)))

    coord = ControlPlaneServicer([_Handle(run.shards[0], []), _Handle(Previous(), [])], [s.info() for s in run.shards])
    coord.tables[NAME], coord.placement[NAME] = run.info, [0, 1]
    ck = str(run.root / "ck" / f"step-{1:010d}" / NAME / "shard-0000.pt")
    asyncio.run(coord.roll_back_siblings(0, 123, [{"table": NAME, "wal": False, "checkpoint": ck}]))
    assert calls == [(NAME, str(run.root / "ck" / f"step-{1:010d}"))]


class _Counted:
    """A multi-callable that records each request sent through it (plain call or future)."""

    def __init__(self, real, sent: list, what) -> None:
        self.real, self.sent, self.what = real, sent, what

    def __call__(self, raw, **kwargs):
        self.sent.append(self.what)
        return self.real(raw, **kwargs)

    def future(self, raw, **kwargs):
        self.sent.append(self.what)
        return self.real.future(raw, **kwargs)


def test_a_sync_call_refused_for_its_map_is_sent_once_more_on_the_fresh_map(pairs, monkeypatch):
    """The table was made anew: the sync client's first attempt, on its cached map, is refused by
    every shard. It sent the call again on the same map, to the same refusals, before it asked
    for the new map (a hunt): one extra round trip for every read and write after a replace. Now
    one refused attempt, then one on the fresh map, for a read and for a write; and a refusal
    the map does not explain (a commit of a step with no parts there) is sent once."""
    run = pairs("run", spec(wal=False))
    c = run.client
    train_step(c, 1, (1,))
    new_spec = validate_spec(spec(wal=False), 2)
    run.info.CopyFrom(plan_table(new_spec, [s.info() for s in run.shards]))
    for s, sh in zip(run.shards, run.info.shards):
        s.drop_table(NAME)
        s.create_table(new_spec.SerializeToString(), sh.SerializeToString(), 2)
    sent: list = []
    real = c._methods
    monkeypatch.setattr(c, "_methods", lambda at: {m: _Counted(f, sent, (at, m)) for m, f in real(at).items()})
    c.lookup(NAME, np.arange(4), count=False)
    assert sorted(sent) == sorted([(s.address, "Lookup") for s in run.shards] * 2), sent
    assert c.table(NAME).layout_id == run.info.layout_id

    run.info.CopyFrom(plan_table(new_spec, [s.info() for s in run.shards]))  # and anew again, for a write
    for s, sh in zip(run.shards, run.info.shards):
        s.drop_table(NAME)
        s.create_table(new_spec.SerializeToString(), sh.SerializeToString(), 2)
    sent.clear()
    ids, w, g = batch(5)
    c.bag_backward(NAME, ids, w, g)
    assert sorted(sent) == sorted([(s.address, "BagBackward") for s in run.shards] * 2), sent

    for i in (0, 1):  # (as after a logged write failed to apply)
        monkeypatch.setattr(run.slice(i), "write_failure", "a write failed to apply")
    sent.clear()
    with pytest.raises(FailedPreconditionError, match="a write failed to apply; writes are refused"):
        c.bag_backward(NAME, ids, w, g)  # the map is current: the refusal is about something else
    assert sorted(sent) == sorted([(s.address, "BagBackward") for s in run.shards]), sent


def test_a_call_refused_for_its_map_goes_through_on_a_map_another_call_refreshed(pairs, monkeypatch):
    """Another thread's call refreshed the map between this call's refused attempt and its retry
    (a review): the retry compared the fresh map with the refreshed one, saw no new layout, and
    raised the refusal. It compares with the map it was refused on, and sends the call once more."""
    run = pairs("run", spec(wal=False))
    c = run.client
    c.lookup(NAME, np.arange(4), count=False)  # map cached
    new_spec = validate_spec(spec(wal=False), 2)
    run.info.CopyFrom(plan_table(new_spec, [s.info() for s in run.shards]))
    for s, sh in zip(run.shards, run.info.shards):
        s.drop_table(NAME)
        s.create_table(new_spec.SerializeToString(), sh.SerializeToString(), 2)
    real = c.aio._with_table

    async def with_table(name, *args, **kwargs):
        await c.aio.table(name, refresh=True)  # what another thread's call did meanwhile
        return await real(name, *args, **kwargs)

    monkeypatch.setattr(c.aio, "_with_table", with_table)
    assert c.push_gradients(NAME, np.arange(4), np.ones((4, DIM), np.float32)) == 4
    assert c.table(NAME).layout_id == run.info.layout_id


def test_a_sync_step_a_trainer_never_commits_is_said_by_status_metrics_and_log(tmp_path, monkeypatch, caplog, capsys):
    """A sync table whose second trainer never commits applies nothing, and nobody was told (the
    shard logged only after 64 open steps). Status, its JSON and the metrics now show the oldest
    waiting step and how long commits have waited with no step applied, through the drops past
    MAX_OPEN_STEPS (a review: the wait restarted at each drop, so it never reached the threshold);
    the shard's log and `memserver status` say it once that wait passes STEP_WAIT_SAID (0.5 s
    here), the log at most once a minute, also when no commit comes (trainers at a barrier): a
    status call or a scrape notices it."""
    import json
    import logging

    import memserver.cli.tables as cli_tables
    import memserver.server.slice as slice_mod
    from memserver.cli import main as cli_main
    from memserver.cluster.inprocess import InProcessServer

    monkeypatch.setattr(slice_mod, "STEP_WAIT_SAID", 0.5)
    monkeypatch.setattr(cli_tables, "STEP_WAIT_SAID", 0.5)
    monkeypatch.setattr(slice_mod, "MAX_OPEN_STEPS", 2)
    caplog.set_level(logging.WARNING, logger="memserver.server.slice")

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if "no step has applied for" in r.getMessage()]

    def loads() -> list:
        return [next(t for t in s.tables if t.table == NAME) for s in a.status().shards]

    with InProcessServer(2) as server, \
            MemoryClient(server.endpoint, timeout=30, client_id="a", shm=False) as a, \
            MemoryClient(server.endpoint, timeout=30, client_id="b", shm=False) as b:
        a.create_table(NAME, ROWS, DIM, optimizer="sgd", lr=1.0, sync_workers=2)
        before = a.lookup(NAME, np.arange(ROWS))
        train_step(a, 1, (1,))  # trainer b never commits
        t1 = time.monotonic()
        assert said() == []  # (not yet waited 0.5 s)
        time.sleep(0.6)
        for load in loads():  # no commit came since: the status call notices
            assert (load.open_steps, load.waiting_step, load.waiting_committed, load.waiting_workers) == (1, 1, 1, 2)
            assert load.waiting_seconds >= 0.6
        assert len(said()) == 2 and all(m.startswith(f"table {NAME}: no step has applied for") and
                                        "while step 1 waits for 1 of its 2 trainers" in m for m in said()), said()
        for step in (2, 3, 4):  # trainer a goes on without waiting for b: past MAX_OPEN_STEPS
            train_step(a, step, (step,))
        np.testing.assert_array_equal(a.lookup(NAME, np.arange(ROWS)), before)  # nothing applied
        waited = time.monotonic() - t1
        for load in loads():
            assert (load.open_steps, load.waiting_step, load.waiting_committed) == (2, 3, 1)  # 1 and 2 dropped
            assert load.waiting_seconds >= waited  # from step 1's commit, through the drops
        assert len(said()) == 2  # once a minute
        for shard in server.shards:
            assert shard.metrics.registry.get_sample_value("memserver_step_wait_seconds", {"table": NAME}) >= waited
        capsys.readouterr()
        assert cli_main(["status", "--endpoint", server.endpoint, "--json"]) == 0
        st = json.loads(capsys.readouterr().out)
        shown = st["shards"][0]["tables"][0]
        assert (shown["open_steps"], shown["waiting_step"], shown["waiting_committed"]) == (2, 3, 1)
        assert [w.split(": no step")[0] for w in st["warnings"]] == [f"shard {i}: table {NAME}" for i in (0, 1)]
        assert st["problems"] == [] and st["tables"][0]["sync_workers"] == 2
        assert cli_main(["status", "--endpoint", server.endpoint]) == 0
        text = " ".join(capsys.readouterr().out.split())
        assert f"shard 0: table {NAME}: no step has applied for" in text
        assert "while step 3 waits for 1 of its 2 trainers (sync_updates): is a trainer gone" in text
        assert "│ 2 trainers │" in text  # the tables' sync column
        assert f"Once its trainers are stopped, `memserver drop-steps {NAME}` drops the waiting steps" in text
        assert f"(once its trainers are stopped, `memserver drop-steps {NAME}` drops the waiting steps)" in said()[0]

        for step in (3, 4):  # b catches up on the steps still open: they apply, none waits
            train_step(b, step, (10 + step,))
        assert not np.array_equal(a.lookup(NAME, np.arange(ROWS)), before)
        for load in loads():
            assert (load.open_steps, load.waiting_step, load.waiting_seconds) == (0, 0, 0.0)
        for shard in server.shards:
            assert shard.metrics.registry.get_sample_value("memserver_step_wait_seconds", {"table": NAME}) == 0
        assert cli_main(["status", "--endpoint", server.endpoint]) == 0
        assert "no step has applied" not in capsys.readouterr().out

        train_step(a, 5, (5,))  # stuck again (b gone for good): the remedy short of dropping the table
        time.sleep(0.6)
        assert cli_main(["status", "--endpoint", server.endpoint]) == 0
        assert "no step has applied" in capsys.readouterr().out
        rows = a.lookup(NAME, np.arange(ROWS))
        assert cli_main(["drop-steps", NAME, "--endpoint", server.endpoint]) == 0
        assert capsys.readouterr().out.splitlines() == [
            f"table {NAME}: dropped 1 open step; nothing of it applies",
            "note: the table has no `wal`: a shard that restarts comes back as its last checkpoint, open steps "
            "included; `memserver checkpoint` now keeps them dropped"]
        for load in loads():
            assert (load.open_steps, load.waiting_step, load.waiting_seconds) == (0, 0, 0.0)
        assert cli_main(["status", "--endpoint", server.endpoint, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["warnings"] == []
        np.testing.assert_array_equal(a.lookup(NAME, np.arange(ROWS)), rows)  # the rows are kept
        assert cli_main(["drop-steps", NAME, "--endpoint", server.endpoint, "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == {"table": NAME, "dropped_steps": 0, "committed": 0, "notes": []}


def test_dropped_open_steps_never_apply_and_a_restart_does_not_bring_them_back(pairs):
    """A sync table whose trainer b is gone: a's commits of steps 1 and 2 wait for good, and every
    later step with them (the remedy was dropping the table, its rows with it). `drop_open_steps`
    (`memserver drop-steps`) drops every open step on every shard, parts and commits, rows kept: new
    trainers then train the table as if those steps had never been sent (equal to a run without
    them), b's late commit of its part is refused naming the drop, and the drop is in the
    write-ahead log, so a restarted shard does not bring the steps back."""
    from client import StepAbortedError

    run = pairs("run", spec(sync_updates=True, sync_workers=2))
    ref = pairs("ref", spec(sync_updates=True, sync_workers=2))
    a, b = run.client, run.new_client("b")
    train_step(a, 1, (1,))
    train_step(a, 2, (2,))
    send_part(b, 2, 3)  # b's part of step 2, never committed (b is stuck or gone)
    send_part(a, 3, 4)
    assert [sorted(run.slice(i).steps) for i in range(2)] == [[1, 2, 3]] * 2
    assert all(run.slice(i).waiting_step().step == 1 for i in range(2))
    assert a.drop_open_steps(NAME) == {"dropped": 3, "committed": 0}
    assert not any(run.slice(i).steps or run.slice(i).waiting_step() for i in range(2))
    assert_same(run.state(), ref.state())  # nothing of them applied
    with pytest.raises(StepAbortedError, match=r"does not hold part\(s\) .*client trainer dropped 3 open step\(s\) "
                                               r"of the table \(drop-steps\)"):
        b.commit_step(NAME, 2)
    c, d, rc, rd = run.new_client("c"), run.new_client("d"), ref.new_client("c"), ref.new_client("d")
    for step in (1, 2):  # a new job from step 1: steps a committed before the drop do not join its steps
        for x, rx, seed in ((c, rc, 10 + step), (d, rd, 20 + step)):
            train_step(x, step, (seed,))
            train_step(rx, step, (seed,))
    assert not any(run.slice(i).steps for i in range(2))
    assert_same(run.state(), ref.state())
    assert not torch.equal(run.state()[0]["weight"], pairs("fresh", spec()).state()[0]["weight"])  # they applied
    run.restart(1)  # its log replayed: the drop with it, so a's step 1 does not come back to join c's
    assert_same(run.state(), ref.state())
    assert not run.slice(1).steps


def test_a_sync_step_refuses_a_trainer_more_than_its_sync_workers(pairs):
    """A walkthrough: a data-parallel job died with its step 4 committed by one trainer and sent in
    part by the other; a new pair on the same table then had its first commit of step 4 applied
    together with the dead trainer's (silently wrong rows), or its other trainer failed "lost in a
    restart?" (the step's applying dropped its parts). A third client in a step of two trainers is
    refused now, naming drop-steps, and nothing changes; after the drop the new pair trains as on
    a table the dead job never touched."""
    from client import FailedPreconditionError, StepAbortedError

    run = pairs("run", spec(sync_updates=True, sync_workers=2))
    ref = pairs("ref", spec(sync_updates=True, sync_workers=2))
    old0, old1 = run.client, run.new_client("old1")
    train_step(old0, 4, (1,))
    send_part(old1, 4, 2)  # and then the job died
    state = run.state()
    new0, new1 = run.new_client("new0"), run.new_client("new1")
    says = (r"step 4 already holds the contributions of 2 trainers on shard 0 \(clients old1, trainer\), its "
            r"sync_workers; client new0 would be one more: a step left open by trainers that are gone \(another "
            rf"job's\?\) is dropped by `memserver drop-steps {NAME}` once they are stopped")
    with pytest.raises(FailedPreconditionError, match=says):
        send_part(new0, 4, 3)
    with pytest.raises(StepAbortedError, match=says):  # a commit with no parts of its own too (its prepare)
        new0.commit_step(NAME, 4)
    assert_same(run.state(), state)
    assert [sorted(run.slice(i).steps[4]) for i in range(2)] == [["old1", "trainer"]] * 2
    assert run.new_client("op").drop_open_steps(NAME) == {"dropped": 1, "committed": 0}
    pairs_ = ((new0, ref.new_client("new0"), 3), (new1, ref.new_client("new1"), 4))  # (the same ids: the same sums)
    for c, r, seed in pairs_:
        send_part(c, 4, seed)
        send_part(r, 4, seed)
    for c, r, _ in pairs_:
        c.commit_step(NAME, 4)
        r.commit_step(NAME, 4)
    assert_same(run.state(), ref.state())
    assert not torch.equal(run.state()[0]["weight"], state[0]["weight"])  # step 4 applied


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "plain"])
def test_a_drop_commits_first_a_contribution_prepared_whose_decision_has_not_come(pairs, monkeypatch, caplog, capsys,
                                                                                  sync):
    """Trainer x's COMMIT of step 2 reached shard 0, not shard 1, where x prepared it (with y's
    commit in: applied on shard 0 and waiting on shard 1, the state status warns of). A review:
    the drop forgot the prepared contribution, so step 2 stayed on shard 0 alone, for good. The
    drop decides it first as the session's expiry does, committed (presumed commit: the ABORT that
    reached only some shards is the protocol's known window, docs/architecture.md), then drops
    the rest: the shards agree with a run without the fault. Keeping such a step for its client
    instead (a later version) left it stuck for a session's lifetime, then joined to the next
    job's step (a third review). A replay of the log does the same, silently; a checkpointed drop
    is still named by a late commit's refusal."""
    import logging

    from client import MemserverError, StepAbortedError
    from memserver.cli import main as cli_main

    caplog.set_level(logging.WARNING, logger="memserver.server.slice")
    kw = {"sync_updates": True, "sync_workers": 2} if sync else {}
    run, ref = pairs("run", spec(**kw)), pairs("ref", spec(**kw))
    x, y, rx, ry = run.client, run.new_client("y"), ref.client, ref.new_client("y")
    for p, q in ((x, y), (rx, ry)):
        train_step(p, 1, (1,))
        train_step(q, 1, (11,))
        train_step(q, 2, (12,))
        send_part(p, 2, 2)
    monkeypatch.setattr(x, "_methods", _commit_step_down(run, 1, lambda: run.slice(1).steps[2]["trainer"].prepared))
    with pytest.raises(MemserverError, match="the commit did not reach every shard"):
        x.commit_step(NAME, 2)
    monkeypatch.undo()
    rx.commit_step(NAME, 2)
    assert run.slice(1).steps[2]["trainer"].prepared and "trainer" not in run.slice(0).steps.get(2, {})
    send_part(y, 9, 19)  # and a part of a step nobody commits
    assert cli_main(["drop-steps", NAME, "--endpoint", run.endpoint]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"table {NAME}: dropped 1 open step; nothing of it applies",
        "note: 1 contribution a trainer had prepared and whose commit or abort had not come committed first, as its "
        "session's expiry would (its commit may have reached the other shards; the shard's log names them)"]
    assert not any(run.slice(i).steps for i in range(2))
    assert_same(run.state(), ref.state())  # step 2 on both shards, step 9 nowhere
    assert "step 2: client trainer prepared it on shard 1 and its decision has not come: committed before" in caplog.text
    caplog.clear()
    assert run.slice(1).drop_committed == {(2, "trainer"): None}
    for p, q in ((x, y), (rx, ry)):  # x's kept COMMIT is re-sent first: answered as applied (by the drop)
        train_step(p, 3, (3,))
        train_step(q, 3, (13,))
    assert not x.aio.session.undecided(NAME)
    assert "refused" not in caplog.text  # (it was refused, and the client warned its commit was refused)
    assert run.slice(1).drop_committed == {}  # answered once
    assert_same(run.state(), ref.state())
    caplog.clear()
    run.restart(1)  # the log replayed, the drop with it; nothing said again
    assert_same(run.state(), ref.state())
    assert "drop" not in caplog.text
    assert run.slice(1).drop_committed == {}  # the replay's drop remembered the pair, its replayed COMMIT answered it
    send_part(y, 4, 14)
    assert run.new_client("op2").drop_open_steps(NAME) == {"dropped": 1, "committed": 0}
    run.checkpoint(4)
    run.restart(0), run.restart(1)
    with pytest.raises(StepAbortedError, match=r"\(dropped\? client op2 dropped 1 open step\(s\) of the table "):
        y.commit_step(NAME, 4)


def test_a_drop_remembers_what_it_committed_until_its_commit_comes_or_the_pair_contributes_anew(pairs, monkeypatch,
                                                                                                 caplog):
    """What a drop committed (presumed commit) is remembered for the client's kept COMMIT: a second
    drop with nothing open forgot it (the COMMIT refused, "lost in a restart?", a review); the
    client's kept ABORT is taken and logged (the known window); a new contribution of the same step by the same
    client is its own (the pair was answered as applied though shard 1 lost its part, a review); and
    the pairs survive a checkpoint."""
    import logging

    from client import MemserverError
    from memserver.cli import main as cli_main

    caplog.set_level(logging.WARNING)
    run = pairs("run", spec())
    x = run.client

    def prepared_then_cut(step: int, seed: int) -> None:  # PREPARE everywhere, the COMMIT lost to shard 1
        send_part(x, step, seed)
        monkeypatch.setattr(x, "_methods", _commit_step_down(run, 1, lambda: run.slice(1).steps[step]["trainer"].prepared))
        with pytest.raises(MemserverError, match="the commit did not reach every shard"):
            x.commit_step(NAME, step)
        monkeypatch.undo()

    train_step(x, 1, (1,))
    prepared_then_cut(2, 2)
    assert cli_main(["drop-steps", NAME, "--endpoint", run.endpoint]) == 0
    assert cli_main(["drop-steps", NAME, "--endpoint", run.endpoint]) == 0  # nothing open: the pair is kept
    assert run.slice(1).drop_committed == {(2, "trainer"): None}
    run.checkpoint(2)
    run.restart(1)
    assert run.slice(1).drop_committed == {(2, "trainer"): None}  # from the checkpoint (and its log after it)
    assert run.slice(1).step_phase(pb.STEP_ABORT, 2, "trainer", []) is not None  # an abort is taken, said (below)
    caplog.clear()
    train_step(x, 3, (3,))  # the kept COMMIT first: answered as applied
    assert "refused" not in caplog.text and not x.aio.session.undecided(NAME)
    assert run.slice(1).drop_committed == {}
    prepared_then_cut(4, 4)
    assert cli_main(["drop-steps", NAME, "--endpoint", run.endpoint]) == 0
    x.aio.session.set_undecided(NAME, 4, None)  # (the client gave up its kept COMMIT: a new job of the same id)
    send_part(x, 4, 44)  # the same step by the same client, anew: its own contribution
    assert run.slice(1).drop_committed == {}
    prepared_then_cut(6, 6)  # a kept ABORT of a pair the drop committed (the known window): taken, and said
    assert cli_main(["drop-steps", NAME, "--endpoint", run.endpoint]) == 0
    caplog.clear()
    run.slice(1).step_phase(pb.STEP_ABORT, 6, "trainer", [])()
    assert "the abort came to shard 1 after drop-steps had committed the step here" in caplog.text
    assert (6, "trainer") not in run.slice(1).drop_committed


def test_a_slice_remembers_at_most_drop_committed_kept_pairs(monkeypatch):
    """The pairs drops committed wait for their client's COMMIT, which may never come (a client
    gone for good): the oldest beyond DROP_COMMITTED_KEPT are forgotten."""
    from memserver.core.steps import bag_entries
    from memserver.server import slice as slice_mod
    from memserver.server.catalog import plan_table, validate_spec

    monkeypatch.setattr(slice_mod, "DROP_COMMITTED_KEPT", 3)
    table = validate_spec(spec(sharding=pb.ROWS, wal=False), 1)
    sl = slice_mod.TableSlice(table, plan_table(table, [{"address": "x", "node_id": "n", "pid": 1}]).shards[0], 1,
                              torch.device("cpu"))
    ids, w, g = (torch.as_tensor(a) for a in batch(1))
    for step in range(1, 6):  # each prepared, its decision lost, then a drop commits it
        sl.gather(step, "gone", 1, bag_entries(ids, w, None, g))
        sl.step_phase(pb.STEP_PREPARE, step, "gone", [1])()
        sl._drop_open("op")()
    assert list(sl.drop_committed) == [(3, "gone"), (4, "gone"), (5, "gone")]


def test_a_commit_after_a_sync_tables_whole_contribution_says_which_call_committed(pairs):
    """A walkthrough's bag_backward(step=1) without gather=True on a sync table (its client's whole
    contribution, committed with it), then commit_step(1): the error was the abort's ("cannot abort:
    committed already"), not the prepare's refusal that caused it, and named no cause."""
    from client import FailedPreconditionError

    run = pairs("run", spec(sync_updates=True, sync_workers=2))
    run.client.bag_backward(NAME, *batch(1), step=1)
    with pytest.raises(FailedPreconditionError) as err:
        run.client.commit_step(NAME, 1)
    said = str(err.value)
    assert "step 1: client trainer: already committed on shard" in said
    assert "(if a bag_backward without gather=True sent it: on a sync_updates table that is its client's whole " \
           "contribution to its step, committed with it; commit_step is for gathered parts); the abort that followed " \
           "was refused too" in said


def test_abandon_step_counts_calls_and_a_commit_of_parts_the_client_dropped_is_refused(monkeypatch, caplog):
    """abandon_step said 8 for one call sent in 8 requests (LocalValues says 1); and past
    MAX_OPEN_STEPS steps with parts the client dropped the oldest's unsaid, and its commit then
    applied nothing, answered as done, and opened the step again on the shards (a hunt). The
    drop is logged and that commit refused; the steps kept commit as ever."""
    import logging

    from client.ops.sessions import ClientSession
    from memserver.cluster.inprocess import InProcessServer

    with InProcessServer(2) as server, MemoryClient(server.endpoint, shm=False, max_request_bytes=1024) as c:
        c.create_table("t", 64, 8, sharding="cols", optimizer="sgd", lr=1.0)
        ids, w, g = np.arange(400).reshape(200, 2) % 64, np.ones((200, 2), np.float32), np.ones((200, 8), np.float32)
        c.bag_backward("t", ids, w, g, step=1, gather=True)  # (several requests of 1024 bytes)
        c.bag_backward("t", ids[:2], w[:2], g[:2], step=1, gather=True)
        assert c.abandon_step("t", 1) == 2
        monkeypatch.setattr(ClientSession, "MAX_OPEN_STEPS", 2)
        before = c.lookup("t", np.arange(64))
        with caplog.at_level(logging.WARNING, logger="client.ops.sessions"):
            for step in (1, 2, 3):
                c.bag_backward("t", ids[:2], w[:2], g[:2], step=step, gather=True)
        assert [r.getMessage() for r in caplog.records if "forgotten" in r.getMessage()] == [
            "table t: step 1's parts are forgotten: this client holds the parts of at most 2 steps not committed; its "
            "commit will be refused"]
        with pytest.raises(StepAbortedError, match=r"table t: step 1 is not committed: this client dropped its parts "
                                                   r"when more than 2 of its steps had parts sent and none committed"):
            c.commit_step("t", 1)
        np.testing.assert_array_equal(c.lookup("t", np.arange(64)), before)
        c.commit_step("t", 2)
        c.commit_step("t", 3)
        expect = before.copy()
        expect[ids[:2].reshape(-1)] -= 2.0  # sgd, lr 1: two steps of weight 1 x grad_out 1
        np.testing.assert_allclose(c.lookup("t", np.arange(64)), expect, rtol=0, atol=1e-6)


def test_a_sync_tables_step_number_used_again_is_a_new_step():
    """Trainers that number their steps per epoch send step 1 again once it applied. A shortcut
    that answered a step committed again as done (reverted, from a review) lost the second epoch's
    update on a shard that held none of one trainer's parts, and left the others' parts waiting
    there for ever. Each use of the number is a step of its own, applied on every shard."""
    from memserver.cluster.inprocess import InProcessServer

    with InProcessServer(2) as server, MemoryClient(server.endpoint, shm=False, client_id="A") as a, \
            MemoryClient(server.endpoint, shm=False, client_id="B") as b:
        a.create_table("sy", 16, 4, optimizer="sgd", lr=0.1, num_shards=2, sync_workers=2, sharding="rows")
        before = a.lookup("sy", np.arange(16))
        for _ in range(2):  # two epochs of one step 1: A's part only on the shard of row 4, B's on both
            b.bag_backward("sy", [[2], [3]], np.ones((2, 1), np.float32), np.ones((2, 4), np.float32), step=1,
                           gather=True)
            a.bag_backward("sy", [[4]], np.ones((1, 1), np.float32), np.ones((1, 4), np.float32), step=1, gather=True)
            b.commit_step("sy", 1)
            a.commit_step("sy", 1)
        assert [sh.servicer.tables["sy"].steps for sh in server.shards] == [{}, {}]
        moved = before - a.lookup("sy", np.arange(16))
        np.testing.assert_allclose(moved[[2, 3, 4]], 2 * 0.1 * 0.5, rtol=1e-5)  # sgd: two steps of the mean, 1/2
        assert not moved[[0, 1, 5]].any()
