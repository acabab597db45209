"""A table slice: the part of one table a shard holds, with what the shard keeps beside the
values (client sessions for exactly-once writes, the write-ahead log, the parts of training
steps not yet applied).

Only the shard's compute thread touches a slice (see memserver.server.dataplane), so nothing
here takes a lock.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from memserver.api.errors import (
    DataLossError,
    FailedPreconditionError,
    InvalidArgumentError,
    MemserverError,
    StepAbortedError,
    UnavailableError,
)
from memserver.api.types import KIND_NAMES, METRIC_NAMES, STEP_WAIT_SAID, ShardLayout
from memserver.api.v1 import memserver_pb2 as pb
from memserver.core.optim import optimizer_config
from memserver.core.steps import Entries, combine
from memserver.core.table import ValueTable
from memserver.core.triggers import TriggerHeaps
from memserver.server.catalog import slice_cache_bytes
from memserver.server.sessions import SESSION_TTL, Sessions
from memserver.storage.wal import COMMIT_STEP, WriteAheadLog
from memserver.wire import TORCH_DTYPES, check_ids

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Training steps a slice keeps open (parts received, not yet applied) before it drops the oldest.
MAX_OPEN_STEPS = 64
#: The (step, client) pairs drops committed that a slice remembers for their late COMMIT (TableSlice.drop_committed).
DROP_COMMITTED_KEPT = 1024


@dataclass
class Contribution:
    """One client's gathered parts of one step on this slice, by the seq of the write that sent
    each (a tagless write gets a negative key), and how far its commit has come."""

    parts: dict[int, Entries] = field(default_factory=dict)
    prepared: bool = False  # voted: exactly these parts make the step here; no part is added after
    committed: bool = False  # decided (a sync_updates table: waits for the other trainers)
    drop: bool = False  # the client met a non-finite gradient: the step is dropped (CommitStepRequest.drop_step)


@dataclass(frozen=True)
class WaitingStep:
    """A sync_updates step that some trainers committed and the others not yet: it applies once
    they all have (status and the metrics show the oldest)."""

    step: int
    committed: int  # trainers that committed it
    workers: int  # trainers the table waits for (sync_workers)
    seconds: float  # how long commits have waited here with no step applied (TableSlice.stalled_since)


class TableSlice:
    """The rows (rows sharding) or columns (cols) of one table that this shard owns."""

    def __init__(self, spec: pb.TableSpec, info: pb.ShardInfo, num_shards: int, device: torch.device,
                 initialise: bool = True, session_ttl: float = SESSION_TTL, directory: Path | None = None):
        """`initialise` False leaves the values zero (a restore fills them). `directory`: the
        slice's folder in the shard's data directory, where a tier "disk" table keeps its rows."""
        self.spec, self.info, self.num_shards = spec, info, num_shards
        self.layout = ShardLayout.of(spec, num_shards)
        self.by_rows = self.layout.by_rows
        self.counts_reads = self.layout.counts_reads(info.index)
        self.kind = spec.kind or pb.VALUE
        self.is_index = self.kind == pb.INDEX
        self.table: Any
        if self.kind == pb.PRODUCT_KEYS:  # keys and query network; the values are another table's
            from memserver.core.pkm import ProductKeyIndex

            self.table = ProductKeyIndex(int(spec.pkm_heads), int(spec.pkm_n_keys), int(spec.pkm_knn),
                                         int(spec.pkm_k_dim), int(spec.pkm_d_in))
        elif self.is_index:  # the user's ids, no local rows: the index maps them itself
            from memserver.core.index import VectorIndex

            self.table = VectorIndex(int(spec.dim), spec.index_factory, METRIC_NAMES[spec.metric], int(spec.payload_dim),
                                     device=device)
        elif spec.tier == "disk":
            check_placeable(spec, directory is not None)
            from memserver.core.disk import DiskTable

            rows = self.layout.global_rows(info.index)
            self.table = DiskTable(
                directory / "disk", len(rows), int(info.col_end - info.col_start), optimizer_config(spec.optimizer),
                cache_bytes=slice_cache_bytes(spec), init_std=spec.init_std if initialise else None, seed=spec.seed,
                global_rows=rows, col_start=int(info.col_start), total_dim=int(spec.dim), name=spec.name)
        else:
            global_rows = self.layout.global_rows(info.index)
            self.table = ValueTable(
                len(global_rows),
                int(info.col_end - info.col_start),
                optimizer_config(spec.optimizer),
                dtype=TORCH_DTYPES[spec.dtype or pb.FLOAT32],
                device=device,
                init_std=spec.init_std if initialise else 0.0,
                seed=spec.seed,
                global_rows=global_rows,
                col_start=int(info.col_start),
                total_dim=int(spec.dim),
            )
        # Trigger contexts of the slots this shard owns (value tables; see memserver.core.triggers)
        self.triggers = TriggerHeaps() if self.kind == pb.VALUE else None
        self.sessions = Sessions(session_ttl)
        self.requests = 0
        self.wal: WriteAheadLog | None = None  # set once the slice is live (not while replaying)
        self.replaying = False
        # Done when the checkpoint file being written of this slice is (None: none is): its writes
        # wait for it, its reads and every other table's calls go on (shard_actor.checkpoint_table)
        self.saving: Future[None] | None = None
        self.last_lsn = -1  # the newest log record this slice appended
        self.recovered_from = ""
        # Non-zero once rebuilt from files without the writes acknowledged since (see WriteAck):
        # every write's answer says so, the signal a client's trainer gets on its data path.
        self.rebuilt = 0
        self.unavailable = ""  # why this slice refuses requests (e.g. a gap in its log); "" = serving
        # why this slice waits before it serves (UNAVAILABLE: clients retry): a restarted shard's
        # slice of a table without a log, until its siblings are back at the same checkpoint
        self.held = ""
        self.held_from = ""  # the checkpoint file a held slice came back as ("" none: its initial values)
        self.write_failure = ""  # why this slice refuses writes (a logged write failed to apply); "" = none
        # Steps whose parts arrived and are not applied yet: step -> client_id -> its parts.
        self.steps: dict[int, dict[str, Contribution]] = {}
        # time.monotonic() since which a sync table's commits wait with no step applied (None: none
        # waits); a float, written by the compute thread, read by status and the metrics
        self.stalled_since: float | None = None
        self.said_at = -60.0  # time.monotonic() `say_waiting` last logged
        self.steps_dropped = ""  # who last dropped the open steps (STEP_DROP_OPEN), said when parts are missed
        # (step, client) whose prepared contribution a drop committed before dropping: that client's
        # COMMIT, kept while it could not reach this shard and sent again later, is answered once as
        # applied (refused, the client warned that its step was not committed), its ABORT taken and
        # logged (the known window). An entry goes when either is answered or the pair contributes anew;
        # at most DROP_COMMITTED_KEPT, the oldest forgotten first (a client that never came back)
        self.drop_committed: dict[tuple[int, str], None] = {}

    # -- checks every request makes --------------------------------------------------------

    def check_request(self, layout_id: int) -> None:
        """Refuse a request for another incarnation of this table, or while the slice is damaged."""
        if self.unavailable:
            raise DataLossError(f"table {self.spec.name}: this slice is not served: {self.unavailable}")
        if self.held:
            raise UnavailableError(f"table {self.spec.name}: {self.held}; call again")
        if layout_id and layout_id != self.info.layout_id:
            raise FailedPreconditionError(
                f"table {self.spec.name}: the request is for layout {layout_id}, this shard holds layout "
                f"{self.info.layout_id} (the table was dropped and re-created or restored): refresh the shard map")

    def mark_rebuilt(self) -> None:
        """This slice was made from its files without the writes acknowledged since (no log)."""
        self.rebuilt = secrets.randbits(64) | 1

    def ack(self, rows: int, duplicate: bool) -> pb.WriteAck:
        """A write's answer, saying whether this slice was rebuilt without acknowledged writes."""
        return self.said_rebuilt(pb.WriteAck(rows=rows, duplicate=duplicate))

    def said_rebuilt(self, answer: Any) -> Any:
        """`answer` (a WriteAck, a BagBackwardResponse) with this slice's rebuild, if any, set."""
        if self.rebuilt:
            answer.rebuilt, answer.recovered_from = self.rebuilt, self.recovered_from
        return answer

    def close(self) -> None:
        """Close what the slice holds open: its log, a disk table's files (kept until dropped)."""
        if self.wal is not None:
            self.wal.close()
            self.wal = None
        if hasattr(self.table, "close"):
            self.table.close()

    def writes_refused(self) -> str:
        """Why this slice refuses writes ("" = it takes them): its log failed (an update applied
        but not logged could not be acknowledged, and a retry would apply it twice) or a logged
        write failed to apply. Shown by status (TableLoad.writes_refused)."""
        if self.write_failure:
            return self.write_failure
        if self.wal is not None and self.wal.failed is not None:
            return f"its write-ahead log failed ({self.wal.failed})"
        return ""

    def check_writable(self) -> None:
        """Refuse writes while `writes_refused` says why (FAILED_PRECONDITION: the client's call was
        fine, the slice's state refuses it; it used to answer INTERNAL, counted as a bug)."""
        why = self.writes_refused()
        if why:
            raise FailedPreconditionError(f"table {self.spec.name}: {why}; writes are refused until the shard restarts, "
                                          f"or the table is restored (memserver restore --replace --table "
                                          f"{self.spec.name})")

    def local(self, ids: torch.Tensor, what: str = "ids") -> torch.Tensor:
        """Global ids -> local rows (an index keeps the global ids), rejecting ids this shard
        does not own."""
        check_ids(ids, self.spec.num_rows, what)
        ids = ids.long() if self.is_index else ids.to(self.table.device).long()  # int32 ids: half the bytes travel
        if self.layout.whole_rows:
            return ids
        self._check_owner(ids, what, "belongs to shard")
        return ids if self.is_index else self.layout.local(ids)

    def _check_owner(self, ids: torch.Tensor, what: str, says: str) -> None:
        owner = self.layout.owner(ids)
        wrong = owner != self.info.index
        if ids.numel() and bool(wrong.any()):
            first = int(wrong.reshape(-1).nonzero()[0])
            raise InvalidArgumentError(f"{what}: id {int(ids.reshape(-1)[first])} {says} "
                                       f"{int(owner.reshape(-1)[first])}, not {self.info.index}")

    # -- exactly once --------------------------------------------------------------------

    def once(self, tag: pb.WriteTag, kind: int, request: Any, apply: Callable[[], T],
             check: Callable[[], None] | None = None, refusable: bool = False) -> tuple[T, bool]:
        """Apply a write at most once per (client_id, seq) and log it first: (answer, duplicate).

        `check` (raising, changing nothing) runs for a new write before it is logged. The record
        is appended before anything changes, so a failed append leaves the table as it was (and
        the log refuses later writes), and a change is never in memory without being in the log
        and the session's record; what is logged is never refused when the log is replayed.
        `refusable`: `apply` changes nothing before its table call, so an error that call marks
        `changed_nothing` (a disk table's corrupt record) refuses this write alone where nothing
        was logged (no `wal`); any other failure stops the slice's writes (`fail_writes`)."""
        if not self.replaying and tag.client_id and self.sessions.full_for(tag.client_id):
            self._expire()  # room for the new client's session, the idle ones' steps decided
        seen, answer = self.sessions.recall(tag, self.spec.name, self.replaying, kind) if tag.client_id else (False, None)
        if seen:
            return answer, True
        if not self.replaying:
            self._expire()
        if check is not None:
            check()
        self._log(kind, request)
        try:
            answer = apply()
        except Exception as exc:
            if refusable and self.wal is None and getattr(exc, "changed_nothing", False):
                raise  # refused before it changed a row, and not logged: the table is what was acknowledged
            self.fail_writes(self._apply_failed(exc))
            if self.wal is not None and isinstance(exc, MemserverError) and not self.replaying:
                # the log holds it: the restart that rebuilds the slice applies it (a client sending it
                # again as a new write would apply it twice)
                raise type(exc)(f"{exc.details}; this write is in the table's write-ahead log, so the shard's "
                                "restart applies it: do not send it again") from None
            raise
        if not tag.client_id:
            return answer, False
        self.sessions.remember(tag, answer, kind)
        return answer, False

    def _expire(self) -> None:
        """Forget the sessions idle past the TTL, their clients' undecided steps decided first, by
        logged writes of their own (replayed)."""
        for st, client, phase in self.expired(self.sessions.expire()):
            self._resolve(st, client, phase)

    def _resolve(self, step: int, client: str, phase: int) -> None:
        """Decide the step of a client whose session expired (see `expired`), as a logged write of
        its own, replayed like a client's COMMIT or ABORT."""
        if phase == pb.STEP_COMMIT:
            log.warning("table %s: step %d: client %s went away between PREPARE and COMMIT; committing its "
                        "prepared contribution", self.spec.name, step, client)
        self._log(COMMIT_STEP, pb.CommitStepRequest(table=self.spec.name, step=step, phase=phase, contributor=client))
        update = self.step_phase(phase, step, client, [], presumed=True)()
        try:
            if update is not None:
                update()
        except Exception as exc:
            self.fail_writes(self._apply_failed(exc))
            raise

    def _presumed_commit(self, step: int, client: str) -> Callable[[], int] | None:
        """Commit an expired client's prepared contribution, and remember the pair for its late
        COMMIT (drop_committed, bounded by DROP_COMMITTED_KEPT), as drop-steps does."""
        update = self.commit(step, client)
        self.drop_committed[(step, client)] = None
        for key in list(self.drop_committed)[:-DROP_COMMITTED_KEPT]:
            del self.drop_committed[key]
        return update

    def _apply_failed(self, exc: BaseException) -> str:
        """Why writes stop after `exc` interrupted a write: logged (the log holds it, memory does not)
        or, without a log, applied part way."""
        if self.wal is not None:
            return f"a logged write failed to apply ({exc!r})"
        return f"a write failed part way ({exc!r})"

    def fail_writes(self, why: str) -> None:
        """A write failed after it was logged (or, without a log, part way): the table no longer
        equals its log or what was acknowledged, so refuse every later write (a restart rebuilds it
        from its checkpoint and log)."""
        if not self.write_failure:
            log.error("table %s: %s; writes are refused until the shard restarts", self.spec.name, why)
            self.write_failure = why

    def _log(self, kind: int, request: Any) -> None:
        """Append a write to the log (a no-op without one, and while replaying)."""
        if self.wal is not None:
            self.last_lsn = self.wal.append(kind, request.SerializeToString())

    # -- training steps in parts -----------------------------------------------------------
    #
    # A client's contribution to a step is committed by two phases over every shard of the table
    # (CommitStepRequest): PREPARE (check the listed parts are here, drop the others, vote) and
    # COMMIT or ABORT. Each phase is a logged, exactly-once write; a prepared step is kept in
    # checkpoints and rebuilt from the log, so a shard that restarts between the phases still
    # commits. `step_phase` checks a phase (changing nothing) and returns what applies it.

    def _check_room(self, step: int, client: str) -> None:
        """A sync_updates step takes the contributions of sync_workers trainers: one more client's
        part or commit is refused, nothing changed (a walkthrough: a new job's first commit of a
        step a dead job's trainer had committed applied the two together, silently, or the new
        job's other trainer failed "lost in a restart?"). Not while replaying: what is logged was
        accepted."""
        got = self.steps.get(step)
        if not self.spec.sync_updates or self.replaying or not got or client in got or len(got) < self.spec.sync_workers:
            return
        raise FailedPreconditionError(
            f"table {self.spec.name}: step {step} already holds the contributions of {len(got)} trainers on shard "
            f"{self.info.index} (clients {', '.join(sorted(got))}), its sync_workers; client {client} would be one more: "
            f"a step left open by trainers that are gone (another job's?) is dropped by `memserver drop-steps "
            f"{self.spec.name}` once they are stopped; or more trainers train the table than its sync_workers")

    def check_part(self, step: int, tag: pb.WriteTag, gather: bool) -> None:
        """A part of a training step (`gather`, or a sync table's whole contribution), refused
        before anything is kept without a tag a commit can name it by (an untagged or seq 0 part
        was acknowledged, then dropped by its PREPARE, which names parts by seq, or merged with
        every other untagged trainer's: a hunt), or, on a sync table, without its step: 0 is
        proto3's unset, and status showed "waiting step 0", which reads as none waiting (the
        library's step 0 stays a step on other tables: LocalValues and RemoteValues take it
        alike). Not while replaying: what is logged was accepted."""
        if self.replaying:
            return
        what = "a gather part of a step" if gather else "a sync_updates table's BagBackward (a trainer's step)"
        if step < 1 and self.spec.sync_updates:
            raise InvalidArgumentError(f"step: {what} of a sync_updates table needs the trainer's step (>= 1), got 0")
        if not tag.client_id or tag.seq < 1:
            raise InvalidArgumentError(f"tag: {what} needs a write tag with a client_id and a seq >= 1 (the step "
                                       f"counts each trainer by its client_id, a commit names its parts by seq), got "
                                       f"client_id {tag.client_id!r}, seq {tag.seq}")

    def check_gather(self, step: int, client: str) -> None:
        self._check_room(step, client)
        c = self.steps.get(step, {}).get(client)
        if c is not None and (c.prepared or c.committed):
            raise FailedPreconditionError(f"table {self.spec.name}: step {step}: client {client} already "
                                          f"{'committed' if c.committed else 'prepared'} its contribution on shard "
                                          f"{self.info.index}; a part sent after that is not applied")

    def gather(self, step: int, client: str, seq: int, entries: Entries) -> None:
        """Keep one part (the write `seq`) of `client`'s contribution to `step` until it commits
        (check_gather first)."""
        parts = self._contribution(step, client).parts
        parts[seq if seq > 0 else -1 - len(parts)] = entries

    def _contribution(self, step: int, client: str) -> Contribution:
        """`client`'s contribution to `step`, made if new: a drop's commit of that pair is past then
        (a COMMIT of it is this contribution's, never answered from `drop_committed`). A new step
        past MAX_OPEN_STEPS drops the oldest other one not waiting for a decision here: a trainer
        vanished, said rather than grown for ever (by a part or by a commit alone: a sync table's
        shard that a trainer only committed to kept a step per commit, without end: a review)."""
        if step not in self.steps and len(self.steps) >= MAX_OPEN_STEPS:
            # not a step prepared here and waiting for its decision: the other shards may commit it (it was
            # dropped here alone, committed on the others: a hunt); the oldest such only if every one is
            undecided = {st for st, got in self.steps.items() if any(c.prepared and not c.committed for c in got.values())}
            old = min((st for st in self.steps if st not in undecided), default=min(self.steps))
            log.error("table %s: dropping unfinished step %d (contributions from %d client(s))", self.spec.name, old,
                      len(self.steps[old]))
            del self.steps[old]
            if self.stalled_since is not None:  # (the wait goes on, from when it began)
                self._stalled_from(self.stalled_since)
        got = self.steps.setdefault(step, {})
        if client not in got:
            self.drop_committed.pop((step, client), None)
        return got.setdefault(client, Contribution())

    def step_phase(self, phase: int, step: int, client: str, seqs: list[int], count: int = 0, drop: bool = False,
                   presumed: bool = False) -> Callable[[], Callable[[], int] | None]:
        """Check one phase of closing `client`'s contribution to `step` (raising, nothing
        changed) and return the function that applies it; that function returns the row update
        to run now (commit) or None. `presumed`: the shard's own COMMIT of an expired client's
        prepared step (logged with its `contributor`), remembered as drop-steps' commits are."""
        c = self.steps.get(step, {}).get(client)
        where = f"table {self.spec.name}: step {step}: client {client}"
        if phase in (pb.STEP_PREPARE, pb.STEP_PREPARE_COMMIT):
            if c is not None and c.committed:
                how = (" (if a bag_backward without gather=True sent it: on a sync_updates table that is its "
                       "client's whole contribution to its step, committed with it; commit_step is for gathered "
                       "parts)" if self.spec.sync_updates else "")
                raise FailedPreconditionError(f"{where}: already committed on shard {self.info.index}{how}")
            if c is None:
                self._check_room(step, client)
            have = c.parts if c is not None else {}
            missing = sorted(set(seqs) - have.keys())
            if missing:
                raise StepAbortedError(
                    f"{where}: shard {self.info.index} does not hold part(s) {_seqs(missing)} of the {len(seqs)} "
                    f"the client sent it ({self._lost()}); the step is aborted on every shard of the table")

            def prepare() -> Callable[[], int] | None:
                self._prepare(step, client, set(seqs), drop)
                return self.commit(step, client) if phase == pb.STEP_PREPARE_COMMIT else None

            return prepare
        if phase == pb.STEP_COMMIT:
            if c is None and (step, client) in self.drop_committed:

                def answered() -> None:  # committed by the drop (presumed commit): nothing left to apply
                    self.drop_committed.pop((step, client), None)  # (once: a replay of the log does the same)

                return answered
            if c is None or not c.prepared or c.committed:
                why = "committed already" if c is not None and c.committed else f"not prepared (aborted, or {self._lost()})"
                raise FailedPreconditionError(f"{where}: cannot commit on shard {self.info.index}: the step is {why}")
            if presumed:  # its client's late COMMIT is answered as applied (it was refused "not prepared", and
                return lambda: self._presumed_commit(step, client)  # a client sending it again applied it twice)
            return lambda: self.commit(step, client)
        if phase == pb.STEP_ABORT:
            if c is not None and c.committed:
                raise FailedPreconditionError(f"{where}: cannot abort on shard {self.info.index}: committed already")
            if c is None and (step, client) in self.drop_committed:  # the protocol's known window: said, not
                # refused (a refusal could end the client's kept ABORT while another shard still waits for it;
                # and a log of older code holds such aborts, which a replay must take)

                def too_late() -> None:
                    self.drop_committed.pop((step, client), None)
                    if not self.replaying:
                        log.warning("%s: the abort came to shard %d after drop-steps had committed the step here "
                                    "(presumed commit, as a session's expiry decides): it stays committed here, and "
                                    "the shards that took the abort dropped it", where, self.info.index)

                return too_late
            return lambda: self._abort(step, client)
        if phase == pb.STEP_DROP_OPEN:
            return lambda: self._drop_open(client)
        if phase != pb.STEP_PHASE_UNSPECIFIED:
            raise InvalidArgumentError(f"phase: unknown step phase {phase}")
        # the one-shard decision of older clients: a part count, checked and applied here alone
        have_count = len(c.parts) if c is not None else 0
        if c is not None and (c.committed or c.prepared):
            raise FailedPreconditionError(f"{where}: {'committed' if c.committed else 'prepared'} already")
        if have_count != count:
            raise FailedPreconditionError(f"{where}: sent {count} part(s), this shard has {have_count} "
                                          f"({self._lost()}); the client's step is not applied")
        return lambda: self.commit(step, client)

    def _lost(self) -> str:
        """Why a slice may lack a step's parts it acknowledged, as far as it knows (a rebuild or a
        drop may be long past: named as what it was, not as the cause)."""
        if self.rebuilt:
            dropped = f"; or dropped: {self.steps_dropped}" if self.steps_dropped else ""
            return (f"lost in a restart? this slice came back from {self.recovered_from} without a log (the table has "
                    f"no `wal`): parts sent before that are gone{dropped}")
        return f"dropped? {self.steps_dropped}" if self.steps_dropped else "lost in a restart?"

    def _prepare(self, step: int, client: str, seqs: set[int], drop: bool = False) -> None:
        c = self._contribution(step, client)
        c.drop = drop
        dropped = [q for q in c.parts if q not in seqs]
        for q in dropped:  # parts of calls that failed for good: the client does not count them
            del c.parts[q]
        if dropped:
            log.warning("table %s: step %d: client %s: dropped %d part(s) the client did not list", self.spec.name,
                        step, client, len(dropped))
        c.prepared = True

    def _abort(self, step: int, client: str) -> None:
        got = self.steps.get(step, {})
        if got.pop(client, None) is not None and not got:
            del self.steps[step]

    def _drop_open(self, by: str) -> Callable[[], tuple[int, int]]:
        """STEP_DROP_OPEN: forget every open step, every client's parts and commits (`by` asked:
        `memserver drop-steps`); nothing of them applies. A contribution prepared here whose
        decision has not come is decided first as its session's expiry decides it, committed
        (presumed commit; docs/architecture.md, "Known limits", for the ABORT that reached only
        some shards): its COMMIT may have reached the other shards. Keeping such a step for its
        client (whose trainers the drop's user has stopped) left a sync table's step stuck for a
        session's lifetime, then joined to the next job's (a review). The returned "update"
        applies those commits and gives (steps dropped, contributions committed)."""
        prepared = sorted((st, client) for st, got in self.steps.items() for client, c in got.items()
                          if c.prepared and not c.committed)
        updates, self.stalled_since = [], None  # (a commit here that completes nothing says no wait)
        for st, client in prepared:
            if not self.replaying:
                log.warning("table %s: step %d: client %s prepared it on shard %d and its decision has not come: "
                            "committed before the drop, as its session's expiry would (drop-steps)", self.spec.name,
                            st, client, self.info.index)
            if (update := self.commit(st, client)) is not None:
                updates.append(update)
        for key in prepared:  # (after their commits above: the pairs are past)
            self.drop_committed[key] = None
        for key in list(self.drop_committed)[:-DROP_COMMITTED_KEPT]:
            del self.drop_committed[key]
        dropped = len(self.steps)
        if dropped:
            if not self.replaying:  # (said when asked; a replay does it again silently)
                log.warning("table %s: dropped %d open step(s) on shard %d (client %s asked: drop-steps); nothing of "
                            "them applies", self.spec.name, dropped, self.info.index, by)
            self.steps_dropped = f"client {by} dropped {dropped} open step(s) of the table (drop-steps)"
        self.steps = {}
        self.stalled_since = None

        def apply() -> tuple[int, int]:
            for update in updates:
                update()
            return dropped, len(prepared)

        return apply

    def commit(self, step: int, client: str) -> Callable[[], int] | None:
        """Close `client`'s contribution to `step` (checked by step_phase). Returns the update to
        run once the step is complete: at once for an ordinary table, when every trainer committed
        for a sync_updates table (the mean of their contributions); else None. None too when a
        contributor dropped the step (a non-finite gradient): a sync table applies nothing of it."""
        self._contribution(step, client).committed = True
        got = self.steps[step]
        workers = self.spec.sync_workers if self.spec.sync_updates else 1
        if self.spec.sync_updates:
            if sum(x.committed for x in got.values()) < workers:
                if self.stalled_since is None:
                    self.stalled_since = time.monotonic()
                self.say_waiting()
                return None
            ranked = [(c, x) for c, x in sorted(got.items()) if x.committed]  # a fixed order: same sums every run
            del self.steps[step]
            self._stalled_from(time.monotonic())  # a step applies: the wait, if any is left, starts again
        else:
            ranked = [(client, got.pop(client))]
            if not got:
                del self.steps[step]
        contributions = [x for _, x in ranked]
        if dropped := [c for c, x in ranked if x.drop]:
            if self.spec.sync_updates:
                log.warning("table %s: step %d dropped on shard %d, every trainer's update: client(s) %s met a "
                            "non-finite gradient (a GradScaler skips the step)", self.spec.name, step,
                            self.info.index, ", ".join(dropped))
            return None
        parts = [p for x in contributions for _, p in sorted(x.parts.items(), key=_part_order)]
        if not parts:
            return None
        entries = combine(parts, 1.0 / workers)
        return lambda: self.table.apply_entries(*entries)

    def _stalled_from(self, now: float) -> None:
        """`stalled_since` after steps closed or were dropped: `now` while a committed step still
        waits, else None."""
        waits = any(c.committed for got in list(self.steps.values()) for c in list(got.values()))
        self.stalled_since = now if waits else None

    def say_waiting(self) -> None:
        """Log, at most once a minute (`said_at`, one float), that a sync table's commits have
        waited STEP_WAIT_SAID seconds or more with no step applied: a trainer is gone, or the
        trainers do not wait for each other after end_step (docs/library.md). Checked where the
        shard notices: a commit, a status call, a metrics scrape."""
        since, now = self.stalled_since, time.monotonic()
        # (cheap checks first: a healthy run's commits wait briefly, every step; replayed ones were said)
        if self.replaying or since is None or now - since < STEP_WAIT_SAID or now - self.said_at < 60.0:
            return
        waiting = self.waiting_step()
        if waiting is None:
            return
        self.said_at = now
        log.warning("table %s: no step has applied for %.0fs while step %d waits for %d of its %d trainers to commit "
                    "it (sync_updates: a step applies once every trainer commits it): is a trainer gone, or do the "
                    "trainers not wait for each other after end_step? (once its trainers are stopped, `memserver "
                    "drop-steps %s` drops the waiting steps)", self.spec.name, waiting.seconds, waiting.step,
                    waiting.workers - waiting.committed, waiting.workers, self.spec.name)

    def waiting_step(self) -> WaitingStep | None:
        """The oldest step of a sync_updates table that some of its trainers committed and that
        waits for the others, and how long commits have waited (from `stalled_since`: open steps
        past MAX_OPEN_STEPS are dropped, the wait is not); None when none waits. Read from the
        loop's and the metrics' threads while the compute thread commits: it iterates copies."""
        since = self.stalled_since
        if not self.spec.sync_updates or since is None:
            return None
        for st, got in sorted(list(self.steps.items()), key=lambda item: item[0]):
            if done := sum(c.committed for c in list(got.values())):
                return WaitingStep(st, done, self.spec.sync_workers, time.monotonic() - since)
        return None

    def expired(self, clients: list[str]) -> list[tuple[int, str, int]]:
        """How to close the undecided steps of clients whose sessions expired: (step, client,
        phase). Their client is gone, so the shard decides: a prepared step commits (presumed
        commit: a client sends ABORT only after some shard refused PREPARE, and that shard then
        holds nothing prepared; see docs/architecture.md), open parts never prepared are aborted."""
        gone = set(clients)
        return [(st, client, pb.STEP_COMMIT if c.prepared else pb.STEP_ABORT)
                for st, got in self.steps.items() for client, c in got.items() if client in gone and not c.committed]

    # -- checkpoints -----------------------------------------------------------------------

    def extras(self) -> dict[str, Any]:
        """What a checkpoint keeps beside the values: sessions and the open steps' parts."""
        steps = [(st, client, c.committed, c.prepared, [(q, list(p)) for q, p in c.parts.items()], c.drop)
                 for st, got in self.steps.items() for client, c in got.items()]
        out: dict[str, Any] = {"sessions": self.sessions.state(), "step_parts": steps}
        if self.steps_dropped:  # (a late commit's refusal names the drop after a restart too)
            out["steps_dropped"] = self.steps_dropped
        if self.drop_committed:
            out["drop_committed"] = list(self.drop_committed)
        if self.triggers is not None and (self.triggers.slots or self.triggers.info):
            out["triggers"] = self.triggers.state()
        return out

    def load_extras(self, extras: dict[str, Any]) -> None:
        if "sessions" in extras:
            self.sessions.load(extras["sessions"])
        self.steps, self.steps_dropped = {}, str(extras.get("steps_dropped", ""))
        self.drop_committed = dict.fromkeys((int(st), str(client)) for st, client in extras.get("drop_committed", []))

        def here(part: Any) -> tuple:
            """A checkpoint's part (loaded on the CPU) on the slice's device, where the parts sent
            after the restore are: one step's parts are concatenated at its commit."""
            return tuple(t.to(self.table.device) for t in part)

        for st, client, committed, prepared, parts, *drop in extras.get("step_parts", []):  # (no drop: older)
            self.steps.setdefault(int(st), {})[client] = Contribution({int(q): here(p) for q, p in parts},
                                                                      bool(prepared), bool(committed), any(drop))
        for st, client, committed, parts in extras.get("steps", []):  # checkpoints before parts had seqs
            self.steps.setdefault(int(st), {})[client] = Contribution({-1 - i: here(p) for i, p in enumerate(parts)},
                                                                      False, bool(committed))
        self._stalled_from(time.monotonic())  # (a committed step's wait counts from the restore)

    def owns(self, ids: torch.Tensor, what: str = "ids") -> None:
        """Refuse slot ids outside the table or whose per-slot records (trigger contexts) another
        shard keeps: `ShardLayout.owner`, on COLS tables too."""
        check_ids(ids, self.spec.num_rows, what)
        self._check_owner(ids.long(), what, "has its records on shard")

    def slice_meta(self) -> dict[str, Any]:
        """Where this slice sits in its table (recorded in checkpoint files)."""
        return {"table": self.spec.name, "kind": KIND_NAMES[self.kind], "by_rows": self.by_rows,
                "index": self.info.index, "num_shards": self.num_shards,
                "num_rows": int(self.spec.num_rows), "dim": int(self.spec.dim), "col_start": int(self.info.col_start),
                "col_end": int(self.info.col_end)}


def check_placeable(spec: pb.TableSpec, has_data_dir: bool) -> None:
    """What a shard refuses of a spec for what it is, not for its memory: a tier "disk" table
    without a data directory. Asked by a replace before it drops the old table too (check_fits)."""
    if spec.tier == "disk" and not has_data_dir:
        raise FailedPreconditionError(f"table {spec.name}: a tier 'disk' table needs a data directory on its "
                                      "shards (memserver up --data-dir)")


def _part_order(item: tuple[int, Entries]) -> tuple[bool, int]:
    """Parts in the order the client sent them: by seq; parts without one in arrival order after."""
    q = item[0]
    return (q < 0, -q if q < 0 else q)


def _seqs(seqs: list[int]) -> str:
    return ", ".join(f"seq {q}" for q in seqs[:8]) + (f" and {len(seqs) - 8} more" if len(seqs) > 8 else "")
