"""Client sessions of a table slice: exactly-once writes with memory bounded by writes in flight.

Every write carries a `WriteTag` (client_id, seq, acked_below, attempt). A slice keeps, per client,
the answers of the writes it applied whose seq is at or above the client's `acked_below` (the
lowest seq the client has not yet seen answered), so a retry of a write in flight is answered from
here instead of being applied twice, and an answer is forgotten as soon as the client says it has
it. What a slice holds is therefore bounded by the writes clients have in flight, not by how many
steps ran. A session idle for `ttl` seconds is forgotten whole; a retry (attempt > 0) from a
client the slice does not know may be a write it applied before that, so it is refused.

Only the shard's compute thread touches sessions (see memserver.server.dataplane).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from memserver.api.errors import FailedPreconditionError, InvalidArgumentError, ResourceExhaustedError
from memserver.api.v1 import memserver_pb2 as pb

#: Default idle time after which a client's session is forgotten (memserver up --session-ttl).
SESSION_TTL = 3600.0
#: Sessions a slice keeps: past it a new client's write is refused, so sessions do not grow with
#: requests (a new client id per request). The answers a session keeps are not capped: a client's
#: acked_below is its oldest write in flight to the table, so one long call of a healthy client
#: holds the answers of its other calls to that table meanwhile (docs/security.md, "Gaps").
MAX_SESSIONS = 1 << 16
#: Characters of a client id (it is kept per session, logged and echoed in errors).
MAX_CLIENT_ID = 256


@dataclass
class Session:
    last_used: float
    acked_below: int = 0
    answers: dict[int, Any] = field(default_factory=dict)  # seq -> answer (a pb.Tensor or an int)

    def forget_below(self, seq: int) -> None:
        if seq > self.acked_below:
            self.acked_below = seq
            for old in [s for s in self.answers if s < seq]:  # bounded by this client's writes in flight
                del self.answers[old]


class Sessions:
    """The sessions of one table slice (see the module docstring)."""

    def __init__(self, ttl: float = SESSION_TTL) -> None:
        self.ttl = ttl
        self.by_client: OrderedDict[str, Session] = OrderedDict()  # least recently used first

    def recall(self, tag: pb.WriteTag, table: str, replaying: bool = False) -> tuple[bool, Any]:
        """(True, answer) when this write was applied before; (False, None) when it is new.
        Raises FailedPreconditionError for a write that may have been applied but whose answer is
        gone. `replaying`: the log is being replayed (every logged write was accepted once)."""
        s = self.by_client.get(tag.client_id)
        now = time.time()
        if len(tag.client_id) > MAX_CLIENT_ID:
            raise InvalidArgumentError(f"tag: a client id of {len(tag.client_id):,} characters, at most {MAX_CLIENT_ID}")
        if s is None:
            if len(self.by_client) >= MAX_SESSIONS and not replaying:
                self.expire(now)
                if len(self.by_client) >= MAX_SESSIONS:
                    raise ResourceExhaustedError(f"table {table}: {MAX_SESSIONS:,} client sessions already; a new "
                                                 f"client's write waits until idle ones expire ({self.ttl:g} s)")
            if tag.attempt > 0 and not replaying:
                raise FailedPreconditionError(
                    f"table {table}: write {tag.seq} of client {tag.client_id} is a retry (attempt {tag.attempt}), "
                    "but this shard no longer knows the client's session (idle for longer than the session TTL, "
                    "or the shard lost it: a restart, or a rollback of a table without `wal`): it may have been "
                    "applied already, so it is not applied again")
            s = self.by_client[tag.client_id] = Session(now)
        else:
            self.by_client.move_to_end(tag.client_id)
            s.last_used = now
        s.forget_below(tag.acked_below)
        if tag.seq in s.answers:
            return True, s.answers[tag.seq]
        if tag.seq < s.acked_below:
            raise FailedPreconditionError(
                f"table {table}: write {tag.seq} of client {tag.client_id} was already answered (the client "
                f"acknowledged every write below {s.acked_below}); a late duplicate is not applied again")
        return False, None

    def remember(self, tag: pb.WriteTag, answer: Any) -> None:
        self.by_client[tag.client_id].answers[tag.seq] = answer

    def expire(self, now: float | None = None) -> list[str]:
        """Forget sessions idle for longer than the TTL; returns their client ids."""
        now = time.time() if now is None else now
        gone = []
        while self.by_client:
            client, s = next(iter(self.by_client.items()))
            if now - s.last_used <= self.ttl:
                break
            del self.by_client[client]
            gone.append(client)
        return gone

    def remembered(self) -> int:
        """Answers held over all sessions."""
        return sum(len(s.answers) for s in self.by_client.values())

    # -- checkpoints: plain values (torch.load with weights_only reads them back) ----------

    def state(self) -> list[tuple[str, float, int, list[tuple[int, bytes | int]]]]:
        return [
            (c, s.last_used, s.acked_below,
             [(q, a.SerializeToString() if isinstance(a, pb.Tensor) else int(a)) for q, a in s.answers.items()])
            for c, s in self.by_client.items()
        ]

    def load(self, state: list[tuple[str, float, int, list[tuple[int, bytes | int]]]]) -> None:
        self.by_client = OrderedDict(
            (c, Session(last, acked, {q: pb.Tensor.FromString(a) if isinstance(a, bytes) else a for q, a in answers}))
            for c, last, acked, answers in state
        )
