"""Client sessions of a table slice: exactly-once writes with memory bounded by writes in flight.

Every write carries a `WriteTag` (client_id, seq, acked_below, attempt). A slice keeps, per client,
the answers of the writes it applied whose seq is at or above the client's `acked_below` (the
lowest seq the client has not yet seen answered), so a retry of a write in flight is answered from
here instead of being applied twice, and an answer is forgotten as soon as the client says it has
it. What a slice holds is therefore bounded by the writes clients have in flight, not by how many
steps ran. A session idle for `ttl` seconds is forgotten whole; a retry (attempt > 0) from a
client the slice does not know may be a write it applied before that, so it is refused.

A client that goes away never acknowledges its last answers (a bag_backward's weight gradient:
512 KiB at B=4096, knn=32), so the answers are also bounded in bytes, MAX_ANSWER_BYTES per
slice: past it, the tensor answers of the session that remembered least recently are let go,
each replaced by LET_GO (8 bytes, as an int answer counts), so a late retry of one is refused
(FAILED_PRECONDITION) rather than applied twice. Its acked_below stays: a write of that client
still on its way (a lower seq) is applied when it comes, and a replay of the log does exactly
what the first run did whichever answers it let go (a review: moving acked_below past them
refused both). A walkthrough's 200 short-lived clients left 200 answers (163 MiB of RSS, and 161
MiB in every checkpoint file of a 256 KiB table) on each shard.

Only the shard's compute thread touches sessions (see memserver.server.dataplane).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from memserver.api.errors import FailedPreconditionError, InvalidArgumentError, ResourceExhaustedError
from memserver.api.v1 import memserver_pb2 as pb
from memserver.storage.wal import RECORD_CALLS

#: Default idle time after which a client's session is forgotten (memserver up --session-ttl).
SESSION_TTL = 3600.0
#: Sessions a slice keeps: past it a new client's write is refused, so sessions do not grow with
#: requests (a new client id per request). The answers a session keeps are not capped by count (a
#: client's acked_below is its oldest write in flight to the table, so one long call of a healthy
#: client holds the answers of its other calls to that table meanwhile), only in bytes, over all
#: sessions (MAX_ANSWER_BYTES; docs/security.md, "Gaps").
MAX_SESSIONS = 1 << 16
#: Characters of a client id (it is kept per session, logged and echoed in errors).
MAX_CLIENT_ID = 256
#: Bytes of remembered answers a slice keeps (see the module docstring): 128 answers of B=4096
#: x knn=32 weight gradients, far more than the writes healthy clients have in flight at once.
MAX_ANSWER_BYTES = 64 << 20


#: What stands for an answer let go at the byte bound (checkpointed as None).
LET_GO = None


def answer_bytes(answer: Any) -> int:
    """What an answer holds: a tensor's serialized size, else (an int, LET_GO) 8 bytes."""
    return answer.ByteSize() if isinstance(answer, pb.Tensor) else 8


@dataclass
class Session:
    last_used: float
    acked_below: int = 0
    answers: dict[int, Any] = field(default_factory=dict)  # seq -> answer (a pb.Tensor or an int)
    nbytes: int = 0  # of its answers
    calls: dict[int, int] = field(default_factory=dict)  # seq -> the kind of call it answered (wal's kinds)


class Sessions:
    """The sessions of one table slice (see the module docstring)."""

    def __init__(self, ttl: float = SESSION_TTL) -> None:
        self.ttl = ttl
        self.by_client: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        # the sessions holding tensor answers, least recently remembered first (the bound lets theirs go first)
        self.holding: OrderedDict[str, None] = OrderedDict()
        self.count = 0  # answers held over all sessions, and their bytes: kept as they change (a
        self.nbytes = 0  # sum over 65,536 sessions on every scrape took 28 ms)

    def recall(self, tag: pb.WriteTag, table: str, replaying: bool = False, call: int = 0) -> tuple[bool, Any]:
        """(True, answer) when this write was applied before; (False, None) when it is new.
        Raises FailedPreconditionError for a write that may have been applied but whose answer is
        gone, InvalidArgumentError for a seq that answered another kind of `call` (its answer
        would not be this call's: INTERNAL, a walkthrough's). `replaying`: the log is being
        replayed (every logged write was accepted once)."""
        s = self.by_client.get(tag.client_id)
        now = time.time()
        if len(tag.client_id) > MAX_CLIENT_ID:
            raise InvalidArgumentError(f"tag: a client id of {len(tag.client_id):,} characters, at most {MAX_CLIENT_ID}")
        if tag.acked_below > tag.seq and not replaying:  # before the session moves: it then refused the client's next writes
            raise InvalidArgumentError(f"tag: acked_below ({tag.acked_below}) must be <= seq ({tag.seq}): a write in "
                                       "flight is not answered yet, only those below it may be")
        if replaying and s is not None and (tag.seq in s.answers or tag.seq < s.acked_below):
            # logged, so accepted live, where this seq would have been a duplicate: the session had expired
            # there (expiry is not logged, nor replayed) and the id came back as a new client's. A replay
            # that refused it lost the slice (DATA_LOSS), or skipped it as a duplicate (a hunt): anew here too
            self._drop(tag.client_id)
            s = None
        if s is None:
            # (the idle ones expired first by the caller, which decides their open steps: TableSlice.once;
            # expired here, they were dropped with their prepared steps left undecided: a review)
            if len(self.by_client) >= MAX_SESSIONS and not replaying:
                raise ResourceExhaustedError(f"table {table}: {MAX_SESSIONS:,} client sessions already; a new "
                                             f"client's write waits until idle ones expire ({self.ttl:g} s)")
            if tag.attempt > 0 and not replaying:
                raise FailedPreconditionError(
                    f"table {table}: write {tag.seq} of client {tag.client_id} is a retry (attempt {tag.attempt}), "
                    "but this shard no longer knows the client's session (idle for longer than the session TTL, "
                    "or the shard lost it: a restart, or a rollback of a table without `wal`): it may have been "
                    "applied already, so it is not applied again")
            # made by `remember`, once the write applied: a refused one (its check, a bad tag) left a session
            # behind, toward MAX_SESSIONS (a hunt: 40 refused writes, 40 sessions for the session TTL)
            return False, None
        else:
            self.by_client.move_to_end(tag.client_id)
            s.last_used = now
        self._forget_below(tag.client_id, s, tag.acked_below)
        if tag.seq in s.answers:
            if call and (was := s.calls.get(tag.seq, call)) != call:
                raise InvalidArgumentError(
                    f"tag: write {tag.seq} of client {tag.client_id} was a {RECORD_CALLS.get(was, was)} call, not "
                    f"{RECORD_CALLS.get(call, call)}: a seq names one call (a client sends each call its own)")
            if (answer := s.answers[tag.seq]) is LET_GO:
                raise FailedPreconditionError(
                    f"table {table}: write {tag.seq} of client {tag.client_id} was applied, and its answer let go (the "
                    f"slice keeps {MAX_ANSWER_BYTES >> 20} MiB of answers, and this client's were the least recently "
                    "used): it is not applied again")
            return True, answer
        if tag.seq < s.acked_below:
            raise FailedPreconditionError(
                f"table {table}: write {tag.seq} of client {tag.client_id} was already answered (the client "
                f"acknowledged every write below {s.acked_below}); a late duplicate is not applied again (if this "
                "is a client made anew with the same client_id, its writes start at 1 again: give each client its own id)")
        return False, None

    def full_for(self, client: str) -> bool:
        """Whether a session for `client` would be one more than MAX_SESSIONS (expire first)."""
        return client not in self.by_client and len(self.by_client) >= MAX_SESSIONS

    def remember(self, tag: pb.WriteTag, answer: Any, call: int = 0) -> None:
        s = self.by_client.get(tag.client_id)
        if s is None:  # a new client's first write, applied (recall checked there is room for it)
            s = self.by_client[tag.client_id] = Session(time.time(), tag.acked_below)
        size = answer_bytes(answer)
        s.answers[tag.seq] = answer
        if call:
            s.calls[tag.seq] = call
        s.nbytes += size
        self.count += 1
        self.nbytes += size
        if size > 8:  # (a tensor: what the bound lets go)
            self.holding[tag.client_id] = None
            self.holding.move_to_end(tag.client_id)
        while self.nbytes > MAX_ANSWER_BYTES and len(self.holding) > 1:  # (this client's own stay)
            oldest, _ = self.holding.popitem(last=False)
            gone = self.by_client[oldest]
            for q, a in gone.answers.items():
                if (size := answer_bytes(a)) > 8:
                    gone.answers[q] = LET_GO
                    gone.nbytes -= size - 8
                    self.nbytes -= size - 8

    def _forget_below(self, client: str, s: Session, seq: int) -> None:
        """The client has every answer below `seq` (its acknowledgement: the only thing that moves acked_below)."""
        if seq <= s.acked_below:
            return
        s.acked_below = seq
        for old in [q for q in s.answers if q < seq]:  # bounded by this client's writes in flight
            size = answer_bytes(s.answers.pop(old))
            s.calls.pop(old, None)
            s.nbytes -= size
            self.count -= 1
            self.nbytes -= size
        if not s.answers:
            self.holding.pop(client, None)

    def _drop(self, client: str) -> None:
        s = self.by_client.pop(client)
        self.count -= len(s.answers)
        self.nbytes -= s.nbytes
        self.holding.pop(client, None)

    def expire(self, now: float | None = None) -> list[str]:
        """Forget sessions idle for longer than the TTL; returns their client ids."""
        now = time.time() if now is None else now
        gone = []
        while self.by_client:
            client, s = next(iter(self.by_client.items()))
            if now - s.last_used <= self.ttl:
                break
            self._drop(client)
            gone.append(client)
        return gone

    def replayed(self, since: float, written: float) -> None:
        """After a log's replay: the sessions it touched (used at `since` or later, the replay's
        start) were last used when the log was last `written`, not now. Stamped now, a restart
        made every session since the last checkpoint fresh for another TTL (a walkthrough: 301
        sessions after a replay where 1 had been left). The next write's expiry sees them as
        they were (and resolves their open steps, which needs the log this slice has by then)."""
        for s in self.by_client.values():
            if s.last_used >= since:
                s.last_used = min(s.last_used, written)

    def remembered(self) -> int:
        """Answers held over all sessions."""
        return self.count

    # -- checkpoints: plain values (torch.load with weights_only reads them back) ----------

    def state(self) -> list[tuple[str, float, int, list[tuple[int, bytes | int | None, int]]]]:
        return [
            (c, s.last_used, s.acked_below,
             [(q, a.SerializeToString() if isinstance(a, pb.Tensor) else a if a is LET_GO else int(a), s.calls.get(q, 0))
              for q, a in s.answers.items()])
            for c, s in self.by_client.items()
        ]

    def load(self, state: list[tuple[str, float, int, list[tuple[Any, ...]]]]) -> None:
        """`state`'s answers are (seq, answer, call), or (seq, answer) in checkpoints made before
        the call was kept."""
        self.by_client, self.holding, self.count, self.nbytes = OrderedDict(), OrderedDict(), 0, 0
        for c, last, acked, answers in state:
            self.by_client[c] = Session(last, acked)
            for q, a, *call in answers:
                self.remember(pb.WriteTag(client_id=c, seq=q), pb.Tensor.FromString(a) if isinstance(a, bytes) else a,
                              call[0] if call else 0)
