"""A training step's commit: this client's `gather` parts of a step applied as one optimizer step
on every shard of a value table or on none, in two phases (PREPARE, then COMMIT or ABORT)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Generator
from typing import Any

import grpc

from client.ops.base import Op
from client.ops.checks import UINT64, check_ints
from client.ops.sessions import ClientSession, WriteTags
from memserver.api.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    MemserverError,
    StepAbortedError,
    TableNotFoundError,
    UnavailableError,
)
from memserver.api.types import TableMeta
from memserver.api.v1 import memserver_pb2 as pb

log = logging.getLogger(__name__)


class TableRemadeError(MemserverError):
    """The table was made anew (a restore, a create with replace) while a step was open: its
    parts went to the incarnation that is gone (commit_step_plan commits the step with none,
    saying so)."""


def step_phase_op(meta: TableMeta, step: int, phase: int, tags: WriteTags, parts: dict[int, list[int]] | None = None,
                  defer_apply: bool = False, layout_id: int = 0, drop: bool = False) -> Op:
    """One phase of closing this client's contribution to `step`, on every shard (see
    CommitStepRequest). PREPARE on a table of one shard is PREPARE_COMMIT. Returns (rows updated
    now, whether the step is committed). `layout_id`: the table incarnation the step's parts went
    to (0: any); another one is TableRemadeError, nothing sent. `drop`: CommitStepRequest.drop_step."""
    if layout_id and meta.layout_id != layout_id:
        raise TableRemadeError(f"table {meta.name}: made anew (a restore, or a create with replace) while step {step} "
                               "was open: its update went to the old table and is dropped (the step is committed with "
                               "none of it)", grpc.StatusCode.ABORTED)
    if phase == pb.STEP_PREPARE and len(meta.shards) == 1:
        phase = pb.STEP_PREPARE_COMMIT
    calls = [(sh.address, "CommitStep",
              pb.CommitStepRequest(table=meta.name, step=step, phase=phase, tag=tags(0, meta, sh),
                                   part_seqs=(parts or {}).get(sh.index, []), defer_apply=defer_apply,
                                   layout_id=meta.layout_id, drop_step=drop))
             for sh in meta.shards]
    acks = yield calls
    rows = int(sum(a.rows for a in acks) // (1 if meta.by_rows else len(meta.shards)))
    return rows, phase in (pb.STEP_COMMIT, pb.STEP_PREPARE_COMMIT)


def drop_open_steps_op(meta: TableMeta, tags: WriteTags) -> Op:
    """Drop every open step of the table on every shard, every client's parts and commits
    (STEP_DROP_OPEN): the remedy for a sync_updates step whose trainers are gone. Returns
    {"dropped": the most open steps one shard dropped, "committed": the most contributions one
    shard committed first, prepared there with their decision not come} (each shard holds the
    steps its parts or commits reached)."""
    calls = [(sh.address, "CommitStep", pb.CommitStepRequest(table=meta.name, phase=pb.STEP_DROP_OPEN,
                                                             tag=tags(0, meta, sh), layout_id=meta.layout_id))
             for sh in meta.shards]
    acks = yield calls
    return {"dropped": max((int(a.rows) for a in acks), default=0),
            "committed": max((int(a.decided) for a in acks), default=0)}


#: A commit plan yields (make_op, tags, retry) and is sent the op's result, or the MemserverError
#: it raised (client.sync and client.aio run it: `commit_step`). `retry` False: one attempt, not
#: the client's retry window (the call is kept and re-sent later anyway).
CommitPlan = Generator[tuple[Callable[[TableMeta], Op], WriteTags, bool], Any, int]

_PHASES = {pb.STEP_COMMIT: "commit", pb.STEP_ABORT: "abort", pb.STEP_PREPARE_COMMIT: "commit"}
#: Refusals that re-sending cannot change (the shard answered): a decision refused so is not kept.
_FINAL = (FailedPreconditionError, StepAbortedError, TableNotFoundError, InvalidArgumentError)


def commit_step_plan(session: ClientSession, table: str, step: int, shards: int, defer_apply: bool = False,
                     drop: bool = False, pin: int = 0) -> CommitPlan:
    """Commit this client's `gather` parts of `step` on every shard of `table` (`shards` of them),
    or on none: PREPARE on every shard (each checks it holds exactly the parts it acknowledged),
    then COMMIT on every shard if all prepared, else ABORT on every shard and raise
    StepAbortedError naming the shard that refused. One shard: one call (PREPARE_COMMIT). A
    decision that cannot reach a shard (unavailable past the client's retries) is kept, its seqs
    in flight, and re-sent with the same tags before the table's next commit, which raises until
    it is delivered. Returns the rows updated now. `drop`: this client met a non-finite gradient
    in the step; a sync table drops the whole step, every trainer's contribution (drop_step).
    `pin` (not 0): the incarnation the caller trains (its `layout_id`); a table made anew since is
    FailedPreconditionError, nothing sent to it: the step is not committed there with no parts
    (where it would take a place in another run's sync step). Interrupted anywhere (a call of it
    out: settle_interrupted; or its own code between calls, a Ctrl-C there), it keeps what the
    step needs: its decision, or an abort (_Pending)."""
    check_ints(UINT64, step=step)
    pending = _Pending()
    try:
        return (yield from _commit(session, table, step, shards, defer_apply, drop, pin, pending))
    except BaseException as exc:
        pending.keep(session, table, step, exc)
        raise


def _commit(session: ClientSession, table: str, step: int, shards: int, defer_apply: bool, drop: bool, pin: int,
            pending: _Pending) -> Generator[Any, Any, Any]:
    """commit_step_plan's work: the kept decisions re-sent, then the step's two phases."""
    for st, (phase, tags, parts, dropped) in session.undecided(table).items():
        got = yield (lambda meta, st=st, phase=phase, tags=tags, parts=parts, dropped=dropped:
                     step_phase_op(meta, st, phase, tags, parts, drop=dropped)), tags, True
        if isinstance(got, _Interrupted):  # before this step's PREPARE: aborted, not left open (_Pending.keep)
            raise got
        if isinstance(got, MemserverError) and not isinstance(got, _FINAL):
            raise type(got)(f"table {table}: step {step} is not committed: the {_PHASES[phase]} of step {st} has not "
                            f"reached every shard yet ({got.details}); commit step {step} again later",
                            got.code, target=got.target)
        if isinstance(got, MemserverError):
            log.warning("table %s: the %s of step %d was refused: %s", table, _PHASES[phase], st, got)
        session.set_undecided(table, st, None)
        if st == step and tags.drops_parts and not isinstance(got, MemserverError):
            session.forget_step(table, step)  # (the shards dropped them all)
            raise StepAbortedError(f"table {table}: step {step} is not committed: its commit was aborted (a shard "
                                   "refused it, could not be reached, or the commit was interrupted), and the abort, "
                                   "kept until every shard had it, went out only now: it dropped every part of the "
                                   "step, those sent since included; send the step again")
    parts, layout = session.take_step(table, step)
    layout = layout or pin  # (a step with no parts: the pin alone says which table it belongs to)
    while True:  # twice at most: once more, with no parts, when the table was made anew meanwhile
        outcome = yield from _prepare_and_decide(session, table, step, shards, defer_apply, parts, layout, drop, pending)
        if not isinstance(outcome, TableRemadeError):
            return outcome
        if pin:
            raise FailedPreconditionError(f"table {table}: made anew (a restore, or a create with replace) while step "
                                          f"{step} was open: not committed there, since the caller trains the table "
                                          f"it pinned (incarnation {pin})")
        # The parts went to the old table; the new one holds none of them. The step is committed
        # there with no parts (nothing of this client's applied; a sync table still counts its
        # commit, so the other trainers' step is not left waiting for it).
        log.warning("%s", outcome.details)
        parts, layout = {}, 0


def settle_interrupted(plan: CommitPlan, why: BaseException) -> None:
    """A commit interrupted while one of its calls was out (a cancelled task, Ctrl-C): that call's
    outcome is unknown, as an unreachable shard's is. The plan goes on with that answer for each
    call it would send next, sending nothing, so the decision it took, or the abort a prepare's
    failure calls for, is kept and re-sent before the table's next commit: the step is never left
    prepared on some shards with its decision dropped (a review: committed on one shard, prepared
    for good on the other, its seqs in flight for ever). Interrupted while it re-sends an earlier
    step's kept decision, before its own PREPARE, the commit aborts its step the same way."""
    if inspect.getgeneratorstate(plan) == inspect.GEN_CREATED:  # interrupted before it began: nothing sent
        plan.close()
        return
    lost = _Interrupted(f"the call was interrupted ({type(why).__name__}) before its answer came")
    lost.cause = type(why).__name__
    try:
        while True:
            plan.send(lost)
    except (StopIteration, MemserverError):
        pass


class _Interrupted(UnavailableError):
    """settle_interrupted's answer for each call an interrupted commit would send; `cause`: what
    interrupted it, by name."""

    cause = ""


class _Pending:
    """What an interrupt keeps for a commit's step (commit_step_plan): an exception that is not
    the plan's own answer (a MemserverError) raised in the plan's code between its calls (a Ctrl-C
    lands anywhere), or settle_interrupted's answer to a call. `decision` (phase, tags, parts,
    drop): the one the plan chose, or the PREPARE_COMMIT it sends, kept to re-send; None: none
    chosen yet, so nothing is committed anywhere and the step is aborted: its parts, open on the
    shards, by an ABORT kept the same way, and forgotten here (they were left open, the decision
    dropped once the PREPARE went out: hunts); past ClientSession.MAX_KEPT_ABORTS such aborts of
    the table, dropped here alone (its commit refused). `settled`: the plan delivered its decision or kept
    it itself. `tags`: the plan's tags, released unless kept (else their seqs stay in flight)."""

    def __init__(self) -> None:
        self.decision: tuple[int, WriteTags, dict[int, list[int]] | None, bool] | None = None
        self.settled = False
        self.tags: list[WriteTags] = []
        self.prepared = False  # the PREPARE may have gone out: some shard may hold the step prepared

    def keep(self, session: ClientSession, table: str, step: int, exc: BaseException) -> None:
        if not self.settled and (isinstance(exc, _Interrupted) or not isinstance(exc, MemserverError)):
            cause = getattr(exc, "cause", "") or type(exc).__name__  # (a Ctrl-C, a cancelled task: not ours)
            if self.decision is not None:
                session.set_undecided(table, step, self.decision)
            elif step in session.undecided(table):  # interrupted re-sending the step's own kept decision (a
                pass  # retried commit): kept as it is; an abort over a COMMIT some shards have split the step (a review)
            elif not self.prepared and sum(t.drops_parts for _, t, _, _ in session.undecided(table).values()) \
                    >= session.MAX_KEPT_ABORTS:
                # Bounded: a kept abort is re-sent by each commit, and while a shard stays away each interrupted
                # commit kept one more. This step was never prepared, so its parts, open on the shards, apply only if
                # a PREPARE lists them: left to the shards (dropped past their open steps, or when the session expires).
                # (One whose PREPARE may be out keeps its abort whatever the count: expiry would commit it.)
                session.drop_step(table, step, f"its commit was interrupted ({cause}) before its "
                                               f"decision went out, with {session.MAX_KEPT_ABORTS} aborts of earlier "
                                               "steps of the table still kept to re-send")
                log.warning("table %s: step %d is not committed: its commit was interrupted (%s) before its decision "
                            "went out; its parts are dropped here, not aborted on the shards (%d aborts of the table "
                            "wait to be delivered already): nothing of it applies; send the step again", table, step,
                            cause, session.MAX_KEPT_ABORTS)
            else:
                session.forget_step(table, step)
                abort = WriteTags(session)
                abort.held = True  # (a kept decision's: its seqs stay in flight until every shard has it)
                abort.drops_parts = True
                self.tags.append(abort)
                session.set_undecided(table, step, (pb.STEP_ABORT, abort, None, False))
                log.warning("table %s: step %d is not committed: its commit was interrupted (%s) before its decision "
                            "went out; the step is aborted, nothing of it applied, by an abort sent before the "
                            "table's next commit: send the step again", table, step, cause)
        kept = session.undecided(table).get(step)
        for tags in self.tags:
            if kept is None or kept[1] is not tags:
                tags.held = False
                tags.close()


def _prepare_and_decide(session: ClientSession, table: str, step: int, shards: int, defer_apply: bool,
                        parts: dict[int, list[int]], layout: int, drop: bool, pending: _Pending) -> Generator[Any, Any, Any]:
    """commit_step_plan's two phases for `parts` (sent to table incarnation `layout`): the rows
    updated now, or the TableRemadeError of a table made anew since (nothing decided). Each
    change of what an interrupt would keep (`pending`) comes before what makes it so."""
    prepare, decide = WriteTags(session), WriteTags(session)
    prepare.held = shards == 1  # PREPARE_COMMIT is a decision: kept if it may not have arrived
    decide.held = True  # its seqs stay in flight until every shard has the decision
    pending.decision, pending.settled, pending.tags = None, False, [prepare, decide]
    if shards == 1:
        pending.decision = (pb.STEP_PREPARE_COMMIT, prepare, parts, drop)
    pending.prepared = True
    voted = yield (lambda meta: step_phase_op(meta, step, pb.STEP_PREPARE, prepare, parts, defer_apply, layout, drop)), \
        prepare, True
    if isinstance(voted, TableRemadeError):  # nothing of the step reached the new table: nothing to decide
        pending.decision = None
        prepare.held = False
        prepare.close()
        return voted
    if shards == 1 and isinstance(voted, MemserverError) and not isinstance(voted, _FINAL):
        session.set_undecided(table, step, (pb.STEP_PREPARE_COMMIT, prepare, parts, drop))
        pending.settled = True
        raise _undelivered(voted, table, step, pb.STEP_PREPARE_COMMIT)
    if not isinstance(voted, MemserverError) and voted[1]:  # one shard: prepared and committed at once
        pending.settled = True
        prepare.held = False
        prepare.close()
        return voted[0]
    decision = pb.STEP_ABORT if isinstance(voted, MemserverError) else pb.STEP_COMMIT
    pending.decision = (decision, decide, None, False)
    prepare.held = False
    prepare.close()
    # A prepare that could not reach a shard has already waited out the client's retries: its abort
    # gets one attempt (kept and re-sent before the next commit if it fails), so a trainer whose
    # cluster went away fails after one retry window, not two.
    unreachable = isinstance(voted, MemserverError) and not isinstance(voted, _FINAL)
    got = yield (lambda meta: step_phase_op(meta, step, decision, decide, None, defer_apply, layout)), decide, \
        not unreachable
    if isinstance(got, TableRemadeError):  # made anew after the prepare: the prepared step went with the old table
        pending.decision = None
        decide.held = False
        decide.close()
        return got
    if isinstance(got, MemserverError) and not isinstance(got, _FINAL):
        session.set_undecided(table, step, (decision, decide, None, False))
        pending.settled = True
        if unreachable:  # neither phase got through
            raise type(got)(f"table {table}: step {step} is not committed: a shard could not be reached (stopped, "
                            f"its host lost or cut off), neither by its prepare ({voted.details}) nor by the abort that "
                            f"followed ({got.details}); nothing of the step was applied, and this client re-sends the "
                            "abort before its next commit of the table", got.code, target=got.target)
        raise _undelivered(got, table, step, decision)
    pending.settled = True
    decide.held = False
    decide.close()
    if isinstance(got, MemserverError):
        if isinstance(voted, _FINAL):  # the prepare's refusal is the cause, the abort's follows from it
            raise type(voted)(f"{voted.details}; the abort that followed was refused too: {got.details}",
                              voted.code, target=voted.target)
        raise got
    if isinstance(voted, MemserverError):
        raise StepAbortedError(f"table {table}: step {step} aborted on every shard, nothing of it applied: "
                               f"{voted.details}", target=voted.target)
    return got[0]


def _undelivered(exc: MemserverError, table: str, step: int, phase: int) -> MemserverError:
    return type(exc)(f"table {table}: step {step}: the {_PHASES[phase]} did not reach every shard ({exc.details}); "
                     "this client re-sends it before the table's next commit", exc.code, target=exc.target)
