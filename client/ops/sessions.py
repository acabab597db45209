"""The client's side of its sessions on the shards (memserver.server.sessions): the seqs and tags
that make every write exactly-once, the parts of training steps sent and not yet committed, and
the commit decisions that have not reached every shard yet."""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from memserver.api.errors import StepAbortedError
from memserver.api.types import ShardMeta, TableMeta
from memserver.api.v1 import memserver_pb2 as pb

log = logging.getLogger(__name__)


class ClientSession:
    """The client's side of its sessions on the shards (memserver.server.sessions): its write
    seqs, which of them are in flight (the lowest one is what the shards may forget below), which
    table slices have answered one of its writes, the parts of training steps it has sent and not
    yet committed, and the commit decisions that have not reached every shard yet. Shared by the
    asyncio and blocking clients, hence the lock.

    Bounds: `_in_flight` holds the seqs of calls running now (and of undecided commits), each
    with its table: a table's slices are told to keep only the answers of that table's writes in
    flight, so a decision held for one table never makes another table's shards keep answers;
    `_known` one entry per slice of the tables this client has written to (the MAX_KNOWN_TABLES
    most recently written), with the slice's last `rebuilt` (a table made anew, here or by another
    client, replaces its old slices' entries);
    `_parts` the steps
    sent and not committed (at most MAX_OPEN_STEPS, the oldest dropped first); `_forgotten` as
    many steps whose parts were dropped here, each with why (its commit is refused); `_undecided` the
    decisions a shard could not be reached with, re-sent by the table's next commit_step: per
    table at most one that follows a PREPARE (a commit sends its own only once every kept one is
    delivered) and MAX_KEPT_ABORTS aborts of steps never prepared (client.ops.steps._Pending);
    `_rebuilds` one entry per table whose slices this client saw rebuilt, kept (a count that only
    grows): as many as the rollbacks this client lived through."""

    MAX_OPEN_STEPS = 64
    MAX_KNOWN_TABLES = 1024
    MAX_KEPT_ABORTS = 8

    def __init__(self, client_id: str) -> None:
        self.client_id = client_id
        self._lock = threading.Lock()
        self._next = 1
        self._in_flight: dict[int, str] = {}  # seq -> its table
        # (table, layout_id, shard index) -> the slice's latest `rebuilt` seen (0: none since this
        # client first wrote to it)
        self._known: dict[tuple[str, int, int], int] = {}
        self._known_tables: collections.OrderedDict[str, None] = collections.OrderedDict()  # their tables, by use
        # (table, step) -> (the table layout its parts went to, shard index -> the seqs of the
        # gather parts that shard acknowledged)
        self._parts: dict[tuple[str, int], tuple[int, dict[int, set[int]]]] = {}
        # the steps whose parts were dropped here (MAX_OPEN_STEPS of them, the latest), each with why:
        # their commit is refused, not taken as a commit of nothing
        self._forgotten: collections.OrderedDict[tuple[str, int], str] = collections.OrderedDict()
        self._calls: dict[tuple[str, int], set[int]] = {}  # the calls _parts' parts are of (abandon_step's count)
        self._undecided: dict[str, dict[int, tuple[int, WriteTags, dict[int, list[int]] | None, bool]]] = {}
        # table -> (the rebuilds of its slices seen since this client wrote to them, the latest's text)
        self._rebuilds: dict[str, tuple[int, str]] = {}

    def new_seq(self, table: str) -> int:
        with self._lock:
            seq = self._next
            self._next += 1
            self._in_flight[seq] = table
            return seq

    def new_seqs(self, table: str, n: int) -> list[int]:
        """`n` seqs at once, below any taken after (a call's parts, in their order)."""
        with self._lock:
            seqs = list(range(self._next, self._next + n))
            self._next += n
            self._in_flight.update(dict.fromkeys(seqs, table))
            return seqs

    def release(self, seqs: Iterable[int]) -> None:
        with self._lock:
            for seq in seqs:
                self._in_flight.pop(seq, None)

    def acked_below(self, table: str) -> int:
        """Every write to `table` with a lower seq has finished: its shards may forget the answer.
        Per table, since a slice keeps the sessions of its own table's writes only."""
        with self._lock:
            return min((seq for seq, t in self._in_flight.items() if t == table), default=self._next)

    def answered(self, meta: TableMeta, addresses: Sequence[str], answers: Sequence[Any]) -> None:
        """The slices of `meta` at `addresses` (the shards a write call reached) gave `answers`;
        the others of the table, sent nothing, still may not know this session. A slice this
        client wrote to before that answers with a new `rebuilt` came back from its files without
        its log: writes acknowledged to this client were lost, which is said here (the only sign a
        trainer gets: the shard may keep its address, and the client its shard map)."""
        shard = {sh.address: sh.index for sh in meta.shards}
        self._saw(meta.name, [((meta.layout_id, shard[address]), address, getattr(answer, "rebuilt", 0),
                               getattr(answer, "recovered_from", "")) for address, answer in zip(addresses, answers)],
                  known=True)

    def saw_checkpoint(self, slices: Iterable[pb.SliceRebuilt]) -> None:
        """A checkpoint's rebuilt slices (CheckpointResponse.rebuilt): a rollback after a writer's
        last write is seen here, before the writer pairs anything with that checkpoint. Slices this
        client never wrote to tell it nothing."""
        by_table: dict[str, list[tuple[tuple[int, int], str, int, str]]] = {}
        for s in slices:
            by_table.setdefault(s.table, []).append(((s.layout_id, s.shard), s.address, s.rebuilt, s.recovered_from))
        for table, seen in by_table.items():
            self._saw(table, seen, known=False)

    def _saw(self, table: str, seen: list[tuple[tuple[int, int], str, int, str]], known: bool) -> None:
        """Note each slice's `rebuilt` ((layout, shard index), address, rebuilt, what it came back
        as): one that changed since this client wrote to the slice is a rebuild, warned of and
        counted once. A slice answering a write becomes known (`known`); a later answer of 0 (sent
        before the rebuild, handled after it) never undoes a rebuild."""
        lost: dict[int, str] = {}
        with self._lock:
            for (layout, index), address, rebuilt, recovered_from in seen:
                key = (table, layout, index)
                if key not in self._known and not known:
                    continue
                was = self._known.get(key, rebuilt)
                if rebuilt and was != rebuilt:
                    # the shard by its address: `index` numbers the table's slices, not `memserver status`'s
                    # shards (an operator looked for the pid of the wrong one: a walkthrough)
                    lost[index] = f"its slice {index} on the shard at {address} from {recovered_from}"
                if rebuilt or key not in self._known:
                    self._know(key, rebuilt)
            if lost:
                what = (f"table {table}: rebuilt without a write-ahead log (the table has no `wal`), "
                        f"{'; '.join(lost[i] for i in sorted(lost))}: writes acknowledged to this client after that "
                        "point are lost")
                self._rebuilds[table] = (self._rebuilds.get(table, (0, ""))[0] + 1, what)
        if lost:
            log.warning("%s. Give the table `wal`, or checkpoint it as often as you can afford to lose work", what)

    def rebuilds(self, table: str) -> tuple[int, str]:
        """How many times this client saw slices of `table` it had written to come back without
        their log (`answered`, `saw_checkpoint`), and what the latest said ("" none). It only
        grows, the table made anew or not: a trainer compares it across its steps."""
        with self._lock:
            return self._rebuilds.get(table, (0, ""))

    def _know(self, key: tuple[str, int, int], rebuilt: int) -> None:
        """Keep a slice's `rebuilt` (under the lock), for at most MAX_KNOWN_TABLES tables: past it
        the least recently written table's slices go (a write to it again starts them afresh, as
        a first write: a rollback in between is not seen by this client)."""
        self._known[key] = rebuilt
        self._known_tables[key[0]] = None
        self._known_tables.move_to_end(key[0])
        while len(self._known_tables) > self.MAX_KNOWN_TABLES:
            gone, _ = self._known_tables.popitem(last=False)
            for k in [k for k in self._known if k[0] == gone]:
                del self._known[k]

    def forget_layouts(self, table: str, keep: int) -> None:
        """`table` was made anew (the client found another layout): its old incarnations' slices
        go (here, not as a write is answered: a late answer of the old layout must not remove the
        new one's)."""
        with self._lock:
            for k in [k for k in self._known if k[0] == table and k[1] != keep]:
                del self._known[k]

    def knows(self, meta: TableMeta, shard: ShardMeta) -> bool:
        return (meta.name, meta.layout_id, shard.index) in self._known

    def step_parts(self, table: str, step: int) -> StepParts:
        """Where bag_backward_op (gather) records the parts of `step` each shard acknowledged."""
        return StepParts(self, (table, step))

    def add_part(self, key: tuple[str, int], shard: int, seq: int, layout_id: int = 0, call: int = 0) -> None:
        with self._lock:  # several threads may send parts of one step
            if key not in self._parts and len(self._parts) >= self.MAX_OPEN_STEPS:
                gone = next(iter(self._parts))
                self._drop_step(gone, f"this client dropped its parts when more than {self.MAX_OPEN_STEPS} of its "
                                      "steps had parts sent and none committed (commit each step before that many open)")
                log.warning("table %s: step %d's parts are forgotten: this client holds the parts of at most %d steps "
                            "not committed; its commit will be refused", gone[0], gone[1], self.MAX_OPEN_STEPS)
            self._forgotten.pop(key, None)
            self._parts.setdefault(key, (layout_id, {}))[1].setdefault(shard, set()).add(seq)
            self._calls.setdefault(key, set()).add(call or seq)

    def take_step(self, table: str, step: int) -> tuple[dict[int, list[int]], int]:
        """The parts of `step` (shard index -> the seqs it acknowledged, in order) and the layout
        (table incarnation) they went to, 0 if none was sent; forgotten here (its commit has them).
        StepAbortedError for a step whose parts were dropped here (past MAX_OPEN_STEPS, or
        `drop_step`), saying why: committed with none, it applied nothing and said nothing, and
        opened the step again on the shards."""
        with self._lock:
            if (table, step) in self._forgotten and (table, step) not in self._parts:
                why = self._forgotten.pop((table, step))
                raise StepAbortedError(f"table {table}: step {step} is not committed: {why}; send the step again")
            layout, shards = self._parts.pop((table, step), (0, {}))
            self._calls.pop((table, step), None)
        return {sh: sorted(seqs) for sh, seqs in shards.items()}, layout

    def drop_step(self, table: str, step: int, why: str) -> None:
        """Forget the parts of `step` and refuse its next commit, saying `why` (unless parts are
        sent again first: the commit then lists those alone, and each shard drops the others)."""
        with self._lock:
            self._drop_step((table, step), why)

    def _drop_step(self, key: tuple[str, int], why: str) -> None:
        self._parts.pop(key, None)
        self._calls.pop(key, None)
        self._forgotten[key] = why
        self._forgotten.move_to_end(key)
        while len(self._forgotten) > self.MAX_OPEN_STEPS:
            self._forgotten.popitem(last=False)

    def forget_step(self, table: str, step: int) -> int:
        """Forget the parts of `step`; returns how many calls sent them, as LocalValues counts (a
        part goes to every shard under one seq, and a call split at max_request_bytes sends
        several: it said 2 parts of 2 shards for 1, and 8 for one call in 8 requests)."""
        with self._lock:
            self._parts.pop((table, step), None)
            self._forgotten.pop((table, step), None)
            return len(self._calls.pop((table, step), ()))

    def forget_table(self, table: str) -> None:
        """The table was made anew, restored or dropped: its steps' parts and undecided decisions
        were the old table's (a commit listing them would fail on the new one; a decision re-sent
        would reach a table that never saw the step)."""
        with self._lock:
            for key in [k for k in self._parts if k[0] == table]:
                del self._parts[key]
                self._calls.pop(key, None)
            for key in [k for k in self._forgotten if k[0] == table]:
                del self._forgotten[key]
            for k in [k for k in self._known if k[0] == table]:
                del self._known[k]
            self._known_tables.pop(table, None)
            decisions = self._undecided.pop(table, {})
        for _, tags, _, _ in decisions.values():
            tags.held = False
            tags.close()

    def undecided(self, table: str) -> dict[int, tuple[int, WriteTags, dict[int, list[int]] | None, bool]]:
        """The commit decisions of `table` some shard may not have: step -> (phase, tags, parts,
        drop)."""
        with self._lock:
            return dict(self._undecided.get(table, {}))

    def set_undecided(self, table: str, step: int,
                      decision: tuple[int, WriteTags, dict[int, list[int]] | None, bool] | None) -> None:
        """Keep a decision to re-send (its tags are held: their seqs stay in flight, so every shard
        keeps its answer for the re-send; one it replaces releases its own), or (None) forget it
        once delivered, releasing them."""
        with self._lock:
            if decision is None:
                _, tags, _, _ = self._undecided.get(table, {}).pop(step, (0, None, None, False))
            else:
                kept = self._undecided.setdefault(table, {})
                _, tags, _, _ = kept.get(step, (0, None, None, False))
                kept[step] = decision
                if tags is decision[1]:
                    tags = None
        if tags is not None:  # delivered, or replaced by another decision (its seqs never re-sent: not kept in flight)
            tags.held = False
            tags.close()


class StepParts:
    """The parts of one (table, step) of a ClientSession."""

    def __init__(self, session: ClientSession, key: tuple[str, int]) -> None:
        self.session, self.key = session, key

    def add(self, shard: int, seq: int, layout_id: int = 0, call: int = 0) -> None:
        """`call`: the call the part is of (its first request's seq; 0: the part's own): a call split
        at max_request_bytes is one part of the step to abandon_step's count, as LocalValues counts."""
        self.session.add_part(self.key, shard, seq, layout_id, call or seq)


class WriteTags:
    """The tags of one write call, one seq per part, the same on every attempt: a retried part
    that a shard already applied is answered from the client's session there, not applied twice.

    `attempt` tells a shard the write may have been applied before; it is sent only to slices
    that have answered one of this session's writes, since a slice that never did cannot have
    forgotten the session (see memserver.server.sessions). `held`: the call's seqs stay in flight
    when it ends (a commit decision to re-send later)."""

    def __init__(self, session: ClientSession) -> None:
        self.session = session
        self.seqs: dict[int, int] = {}
        self.reserved: list[int] = []  # seqs taken ahead (`reserve`), not sent yet: the next parts'
        self.attempt = 0
        self.held = False
        # an abort an interrupted commit kept for its own step (client.ops.steps._Pending): delivered by
        # a commit of that step, it has dropped the parts sent since too, which that commit then says
        self.drops_parts = False

    def reserve(self, table: str, n: int) -> WriteTags:
        """Take the seqs of the call's first `n` parts now, on the caller's thread: a step's parts
        apply in seq order, so a call sent without waiting (run later on the client's loop) keeps
        its place before the calls made after it. Parts past `n` take theirs when built."""
        self.reserved = self.session.new_seqs(table, n)
        return self

    def begin_attempt(self, first: bool) -> None:
        self.attempt = 0 if first and not self.seqs else self.attempt + 1

    def __call__(self, part: int, meta: TableMeta, shard: ShardMeta) -> pb.WriteTag:
        seq = self.seqs.get(part)
        if seq is None:
            seq = self.seqs[part] = self.reserved.pop(0) if self.reserved else self.session.new_seq(meta.name)
        attempt = self.attempt if self.attempt and self.session.knows(meta, shard) else 0
        return pb.WriteTag(client_id=self.session.client_id, seq=seq, acked_below=self.session.acked_below(meta.name),
                           attempt=attempt)

    def reset(self) -> None:
        """Start over with new seqs: the table was re-created, so these writes never reached it."""
        self.session.release([*self.seqs.values(), *self.reserved])
        self.seqs.clear()
        self.reserved.clear()
        self.attempt = 0

    def close(self) -> None:
        """The call is over (answered or failed for good): the shards may forget its answers."""
        if not self.held:
            self.session.release([*self.seqs.values(), *self.reserved])
