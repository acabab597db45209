"""Every data-plane call of the client, as an *op*: validation, routing and reassembly, with no I/O.

An op is a generator: it validates the input (so a write is rejected whole before any shard sees
it), routes ids to their shards by the table's `ShardLayout`, yields the shard requests
`[(address, method, request)]` all at once, receives their answers in that order and returns
the assembled result in the caller's order. Whoever sends the requests decides how:
`AsyncMemoryClient` with grpc.aio, `MemoryClient` with blocking stubs from the caller's thread,
the load test's users under gevent. One implementation of each call for all of them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from client.merge import merge_topk
from memserver.api.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    MemserverError,
    StepAbortedError,
    TableNotFoundError,
)
from memserver.api.types import MAX_INSPECT_SLOTS, MAX_SEARCH_K, ShardMeta, TableMeta
from memserver.api.usage import Histogram
from memserver.api.v1 import memserver_pb2 as pb
from memserver.wire import (
    Lazy,
    as_tensor,
    check_1d,
    check_bag,
    check_float,
    check_ids,
    check_rows,
    check_triggers,
    decode,
    encode,
    wire_tensor,
)

#: yields [(address, method, request)] once, receives the answers, returns the result. A request is
#: a protobuf message or, for the calls that carry large tensors, a memserver.wire.Lazy; the same
#: Lazy object for several shards (a cols bag) is serialised once.
Op = Generator[list[tuple[str, str, Any]], list[Any], Any]
#: Requests and responses are kept below this size; larger batches are split into parts.
MAX_REQUEST_BYTES = 64 * 1024 * 1024
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OpOptions:
    """What a client decides for all its calls."""

    wire_dtype: int = pb.FLOAT32  # dtype rows, bag outputs and gradients travel in
    max_request_bytes: int = MAX_REQUEST_BYTES


class ClientSession:
    """The client's side of its sessions on the shards (memserver.server.sessions): its write
    seqs, which of them are in flight (the lowest one is what the shards may forget below), which
    table slices have answered one of its writes, the parts of training steps it has sent and not
    yet committed, and the commit decisions that have not reached every shard yet. Shared by the
    asyncio and blocking clients, hence the lock.

    Bounds: `_in_flight` holds the seqs of calls running now (and of undecided commits);
    `_known` one entry per slice of the tables this client has written to; `_parts` the steps
    sent and not committed (at most MAX_OPEN_STEPS, the oldest dropped first); `_undecided` the
    decisions a shard could not be reached with, re-sent by the table's next commit_step."""

    MAX_OPEN_STEPS = 64

    def __init__(self, client_id: str) -> None:
        self.client_id = client_id
        self._lock = threading.Lock()
        self._next = 1
        self._in_flight: set[int] = set()
        self._known: set[tuple[int, int]] = set()  # (layout_id, shard index)
        # (table, step) -> shard index -> the seqs of the gather parts that shard acknowledged
        self._parts: dict[tuple[str, int], dict[int, set[int]]] = {}
        self._undecided: dict[str, dict[int, tuple[int, WriteTags, dict[int, list[int]] | None]]] = {}

    def new_seq(self) -> int:
        with self._lock:
            seq = self._next
            self._next += 1
            self._in_flight.add(seq)
            return seq

    def release(self, seqs: Iterable[int]) -> None:
        with self._lock:
            self._in_flight.difference_update(seqs)

    def acked_below(self) -> int:
        """Every write with a lower seq has finished: the shards may forget its answer."""
        with self._lock:
            return min(self._in_flight, default=self._next)

    def answered(self, meta: TableMeta) -> None:
        with self._lock:
            self._known.update((meta.layout_id, sh.index) for sh in meta.shards)

    def knows(self, meta: TableMeta, shard: ShardMeta) -> bool:
        return (meta.layout_id, shard.index) in self._known

    def step_parts(self, table: str, step: int) -> StepParts:
        """Where bag_backward_op (gather) records the parts of `step` each shard acknowledged."""
        return StepParts(self, (table, step))

    def add_part(self, key: tuple[str, int], shard: int, seq: int) -> None:
        with self._lock:  # several threads may send parts of one step
            if key not in self._parts and len(self._parts) >= self.MAX_OPEN_STEPS:
                del self._parts[next(iter(self._parts))]
            self._parts.setdefault(key, {}).setdefault(shard, set()).add(seq)

    def parts_of(self, table: str, step: int) -> dict[int, list[int]]:
        """shard index -> the seqs of the parts of `step` it acknowledged, in order."""
        with self._lock:
            return {sh: sorted(seqs) for sh, seqs in self._parts.get((table, step), {}).items()}

    def forget_step(self, table: str, step: int) -> None:
        with self._lock:
            self._parts.pop((table, step), None)

    def undecided(self, table: str) -> dict[int, tuple[int, WriteTags, dict[int, list[int]] | None]]:
        """The commit decisions of `table` some shard may not have: step -> (phase, tags, parts)."""
        with self._lock:
            return dict(self._undecided.get(table, {}))

    def set_undecided(self, table: str, step: int,
                      decision: tuple[int, WriteTags, dict[int, list[int]] | None] | None) -> None:
        """Keep a decision to re-send (its tags are held: their seqs stay in flight, so every shard
        keeps its answer for the re-send), or (None) forget it once delivered, releasing them."""
        with self._lock:
            if decision is not None:
                self._undecided.setdefault(table, {})[step] = decision
                return
            _, tags, _ = self._undecided.get(table, {}).pop(step, (0, None, None))
        if tags is not None:
            tags.held = False
            tags.close()


class StepParts:
    """The parts of one (table, step) of a ClientSession."""

    def __init__(self, session: ClientSession, key: tuple[str, int]) -> None:
        self.session, self.key = session, key

    def add(self, shard: int, seq: int) -> None:
        self.session.add_part(self.key, shard, seq)


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
        self.attempt = 0
        self.held = False

    def begin_attempt(self, first: bool) -> None:
        self.attempt = 0 if first and not self.seqs else self.attempt + 1

    def __call__(self, part: int, meta: TableMeta, shard: ShardMeta) -> pb.WriteTag:
        seq = self.seqs.get(part)
        if seq is None:
            seq = self.seqs[part] = self.session.new_seq()
        attempt = self.attempt if self.attempt and self.session.knows(meta, shard) else 0
        return pb.WriteTag(client_id=self.session.client_id, seq=seq, acked_below=self.session.acked_below(),
                           attempt=attempt)

    def reset(self) -> None:
        """Start over with new seqs: the table was re-created, so these writes never reached it."""
        self.session.release(self.seqs.values())
        self.seqs.clear()
        self.attempt = 0

    def close(self) -> None:
        """The call is over (answered or failed for good): the shards may forget its answers."""
        if not self.held:
            self.session.release(self.seqs.values())


def finish(op: Op, answers: list[Any]) -> Any:
    """Hand an op its answers and return its result (ops ask once)."""
    try:
        op.send(answers)
    except StopIteration as done:
        return done.value
    raise RuntimeError("a data-plane op asked for answers twice")


def like(t: torch.Tensor, ref: Any) -> Any:
    """Return `t` as the caller's kind: numpy in, numpy out; torch in, torch out on its device."""
    if isinstance(ref, torch.Tensor):
        return t.to(ref.device)
    return t.numpy()


# ------------------------------------------------------------------ routing


def wire_ids(ids: torch.Tensor, meta: TableMeta) -> torch.Tensor:
    """Ids travel as int32 when the table allows it: a third less request bytes for a bag."""
    return wire_tensor(ids, pb.INT32 if meta.num_rows < 2**31 else None)


def route_ids(meta: TableMeta, ids: torch.Tensor) -> list[tuple[ShardMeta, torch.Tensor]]:
    """(shard, positions in `ids`) pairs: rows -> the ids each shard owns; cols -> every shard
    sees all ids."""
    if meta.layout.whole_rows:
        every = torch.arange(len(ids))
        return [(sh, every) for sh in meta.shards]
    owner = meta.layout.owner(ids)
    return [(sh, (owner == sh.index).nonzero().squeeze(1)) for sh in meta.shards]


def route_bags(
    meta: TableMeta,
    ids: torch.Tensor,
    w: torch.Tensor,
    off: torch.Tensor | None,
    with_mask: bool = False,
) -> list[Any]:
    """Per shard, the (ids, weights, offsets) of its entries. cols: the whole batch to every
    shard. rows: each shard gets its own entries as 1-D ids + offsets (bags may be empty).
    With `with_mask`, each item also carries the boolean mask of its entries in the flat batch
    (None for cols), which puts per-entry answers back in place."""
    if meta.layout.whole_rows:
        out = [(sh, (ids, w, off)) for sh in meta.shards]
        return [(*o, None) for o in out] if with_mask else out
    flat_ids, flat_w = ids.reshape(-1), w.reshape(-1)
    num_bags = ids.shape[0] if off is None else len(off)
    if off is None:
        bag_of = torch.arange(num_bags).repeat_interleave(ids.shape[1])
    else:
        counts = torch.diff(off, append=torch.tensor([len(flat_ids)]))
        bag_of = torch.repeat_interleave(torch.arange(num_bags), counts)
    owner = meta.layout.owner(flat_ids)
    routed = []
    for sh in meta.shards:
        mask = owner == sh.index
        counts = torch.bincount(bag_of[mask], minlength=num_bags)
        s_off = torch.cumsum(counts, 0) - counts
        item = (sh, (flat_ids[mask], flat_w[mask], s_off))
        routed.append((*item, mask) if with_mask else item)
    return routed


def aggregate(ids: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum rows that share an id: (unique ids, summed float32 rows). A push sends each row once."""
    uniq, inv = torch.unique(ids, return_inverse=True)
    if len(uniq) == len(ids):
        order = torch.empty_like(inv)
        order[inv] = torch.arange(len(inv), device=inv.device)
        return uniq, rows[order].float()
    out = torch.zeros((len(uniq), rows.shape[1]), dtype=torch.float32, device=rows.device)
    out.index_add_(0, inv, rows.float())
    return uniq, out


# ------------------------------------------------------------------ input checks


def _ids(x: Any, meta: TableMeta, what: str = "ids") -> torch.Tensor:
    t = as_tensor(x)
    if t.dtype == torch.int32:
        t = t.long()
    check_ids(t, meta.num_rows, what)
    return t.cpu()


def _floats(x: Any, what: str) -> torch.Tensor:
    t = as_tensor(x)
    if not t.dtype.is_floating_point:
        raise InvalidArgumentError(f"{what}: dtype must be floating point, got {str(t.dtype).removeprefix('torch.')}")
    return t.detach().cpu()


def _bag_args(meta: TableMeta, ids: Any, weights: Any, offsets: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    t_ids = _ids(ids, meta)
    w = _floats(weights, "weights")
    off = None if offsets is None else as_tensor(offsets).cpu()
    return t_ids, w, off, check_bag(t_ids, w, off)


def _encoder(meta: TableMeta) -> Callable[..., torch.Tensor]:
    """wire_tensor() memoised by tensor identity: cols shards all get the same ids and weights,
    which are then converted once per call, not once per shard."""
    seen: dict[tuple[int, bool, int | None], tuple[torch.Tensor, torch.Tensor]] = {}

    def enc(t: torch.Tensor, *, ids: bool = False, wire_dtype: int | None = None) -> torch.Tensor:
        key = (id(t), ids, wire_dtype)
        if key not in seen:  # the tensor is kept alive with its encoding, so its id stays unique
            seen[key] = (t, wire_ids(t, meta) if ids else wire_tensor(t, wire_dtype))
        return seen[key][1]

    return enc


def _chunks(n: int, bytes_per_item: int, limit: int) -> list[slice]:
    step = max(1, limit // max(1, bytes_per_item))
    return [slice(i, min(n, i + step)) for i in range(0, max(n, 1), step)]


def _slice_bags(
    ids: torch.Tensor, w: torch.Tensor, off: torch.Tensor | None, bags: slice
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    if off is None:
        return ids[bags], w[bags], None
    start = int(off[bags.start]) if bags.start < len(off) else len(ids)
    stop = int(off[bags.stop]) if bags.stop < len(off) else len(ids)
    return ids[start:stop], w[start:stop], off[bags] - start


def _entry_range(ids: torch.Tensor, off: torch.Tensor | None, bags: slice) -> slice:
    """The flat entries that belong to a slice of bags."""
    if off is None:
        k = ids.shape[1]
        return slice(bags.start * k, bags.stop * k)
    start = int(off[bags.start]) if bags.start < len(off) else len(ids)
    stop = int(off[bags.stop]) if bags.stop < len(off) else len(ids)
    return slice(start, stop)


def _entries_per_bag(ids: torch.Tensor, off: torch.Tensor | None, num_bags: int) -> int:
    return max(1, ids.shape[1] if off is None else -(-ids.shape[0] // max(1, num_bags)))


# ------------------------------------------------------------------ the ops


def lookup_op(meta: TableMeta, ids: Any, opts: OpOptions, count: bool = True) -> Op:
    """Rows of `ids` (any shape) -> float32 [*ids.shape, dim]; each distinct id is fetched once.
    `count` False: an inspection read, not counted in the slots' hits."""
    t = _ids(ids, meta)
    uniq, inv = torch.unique(t.reshape(-1), return_inverse=True)
    rows = torch.empty((len(uniq), meta.dim), dtype=torch.float32)
    calls, places = [], []
    encoded: dict[int, tuple[torch.Tensor, list[tuple[slice, Lazy]]]] = {}
    for sh, sel in route_ids(meta, uniq):
        if id(sel) not in encoded:  # cols: every shard gets the same request; build it once
            sub = uniq[sel]
            parts = _chunks(len(sub), meta.dim * 4 + 8, opts.max_request_bytes)
            encoded[id(sel)] = (sel, [(p, Lazy(pb.LookupRequest(table=meta.name, wire_dtype=opts.wire_dtype,
                                                                layout_id=meta.layout_id, uncounted=not count),
                                               {"ids": wire_ids(sub[p], meta)},
                                               answer_bytes=(p.stop - p.start) * meta.dim * 4))
                                       for p in parts])
        for part, req in encoded[id(sel)][1]:
            calls.append((sh.address, "Lookup", req))
            places.append((sh, sel, part))
    for (sh, sel, part), resp in zip(places, (yield calls)):
        rows[sel[part], sh.col_start : sh.col_end] = decode(resp.rows, "rows").float()
    return rows[inv].view(*t.shape, meta.dim)


def _into(out: torch.Tensor, where: tuple[Any, ...], got: torch.Tensor, add: bool) -> None:
    """out[where] = got (or +=), with numpy when it can: one thread (see memserver.wire.check_ids)."""
    if got.dtype == out.dtype and out.device.type == "cpu":
        o, g = out.numpy(), got.numpy()
        if add:
            o[where] += g
        else:
            o[where] = g
    elif add:
        out[where] += got.to(out.dtype)
    else:
        out[where] = got.to(out.dtype)


def bag_op(meta: TableMeta, ids: Any, weights: Any, offsets: Any, opts: OpOptions) -> Op:
    """out[b] = sum_j weights[b, j] * v[ids[b, j]] -> [B, dim] float32, computed on the shards."""
    t_ids, w, off, num_bags = _bag_args(meta, ids, weights, offsets)
    # cols: every shard fills its columns of every bag (an error fails the call), nothing to zero
    out = (torch.zeros if meta.by_rows else torch.empty)((num_bags, meta.dim), dtype=torch.float32)
    calls, places = [], []
    k = _entries_per_bag(t_ids, off, num_bags)
    itemsize = 2 if opts.wire_dtype in (pb.FLOAT16, pb.BFLOAT16) else 4
    for bags in _chunks(num_bags, max(k * 8, meta.dim * 4), opts.max_request_bytes):
        b_ids, b_w, b_off = _slice_bags(t_ids, w, off, bags)
        enc = _encoder(meta)
        shared: Lazy | None = None
        for sh, (s_ids, s_w, s_off) in route_bags(meta, b_ids, b_w, b_off):
            if shared is None or meta.by_rows:  # cols: one request for every shard
                req = Lazy(pb.BagRequest(table=meta.name, wire_dtype=opts.wire_dtype, layout_id=meta.layout_id),
                           {"ids": enc(s_ids, ids=True), "weights": enc(s_w)},
                           answer_bytes=(bags.stop - bags.start) * (sh.col_end - sh.col_start) * itemsize)
                if s_off is not None:
                    req.tensors["offsets"] = enc(s_off)
                shared = req
            calls.append((sh.address, "Bag", shared))
            places.append((sh, bags))
    for (sh, bags), resp in zip(places, (yield calls)):
        got = decode(resp.out, "out")
        if meta.by_rows:
            _into(out, (bags,), got, add=True)  # rows: each shard's partial sum over the entries it owns
        else:
            _into(out, (bags, slice(sh.col_start, sh.col_end)), got, add=False)
    return out


def bag_backward_op(meta: TableMeta, ids: Any, weights: Any, grad_out: Any, offsets: Any, opts: OpOptions,
                    tags: WriteTags, defer_apply: bool = False, step: int = 0, parts: StepParts | None = None,
                    weight_grad: bool = True) -> Op:
    """dL/dweights (shape of ids); the shards apply weights * grad_out to the rows (exactly once).
    `weight_grad` False: the shards skip dL/dweights and the op returns None.

    `parts` given: each request is a `gather` part of `step` (the update waits for commit_step_plan),
    and `parts` records, per shard index, the seqs of the parts this call delivered: only once
    every shard answered (a call that fails for good lists none; shards that stored a part of it
    drop it when the step is prepared)."""
    t_ids, w, off, num_bags = _bag_args(meta, ids, weights, offsets)
    g = _floats(grad_out, "grad_out")
    check_rows(g, num_bags, meta.dim, "grad_out")
    grad_w = torch.zeros(t_ids.shape if weight_grad else (0,), dtype=torch.float32)
    flat_gw = grad_w.view(-1)
    calls, places = [], []
    k = _entries_per_bag(t_ids, off, num_bags)
    for part, bags in enumerate(_chunks(num_bags, k * 12 + meta.dim * 4, opts.max_request_bytes)):
        b_ids, b_w, b_off = _slice_bags(t_ids, w, off, bags)
        b_g = g[bags]
        entries = _entry_range(t_ids, off, bags)
        enc = _encoder(meta)
        for sh, (s_ids, s_w, s_off), mask in route_bags(meta, b_ids, b_w, b_off, with_mask=True):
            g_sh = b_g if meta.by_rows else b_g[:, sh.col_start : sh.col_end]
            tag = tags(part, meta, sh)
            req = Lazy(pb.BagBackwardRequest(table=meta.name, tag=tag, defer_apply=defer_apply,
                                             step=step, layout_id=meta.layout_id, gather=parts is not None,
                                             no_weight_grad=not weight_grad),
                       {"ids": enc(s_ids, ids=True), "weights": enc(s_w), "grad_out": wire_tensor(g_sh, opts.wire_dtype)})
            # no answer space: dL/dw comes back inline (the session keeps it for a retry's answer)
            if s_off is not None:
                req.tensors["offsets"] = enc(s_off)
            calls.append((sh.address, "BagBackward", req))
            places.append((sh, entries, mask, tag.seq))
    for (sh, entries, mask, seq), resp in zip(places, (yield calls)):
        if parts is not None:
            parts.add(sh.index, seq)
        if not weight_grad:
            continue
        got = decode(resp.grad_weights, "grad_weights").reshape(-1)
        if mask is None:
            _into(flat_gw, (entries,), got, add=True)  # cols: each shard's dot product covers its columns
        else:
            flat_gw[entries][mask] = got  # rows: each entry lives on one shard
    return grad_w if weight_grad else None


def step_phase_op(meta: TableMeta, step: int, phase: int, tags: WriteTags, parts: dict[int, list[int]] | None = None,
                  defer_apply: bool = False) -> Op:
    """One phase of closing this client's contribution to `step`, on every shard (see
    CommitStepRequest). PREPARE on a table of one shard is PREPARE_COMMIT. Returns (rows updated
    now, whether the step is committed)."""
    if phase == pb.STEP_PREPARE and len(meta.shards) == 1:
        phase = pb.STEP_PREPARE_COMMIT
    calls = [(sh.address, "CommitStep",
              pb.CommitStepRequest(table=meta.name, step=step, phase=phase, tag=tags(0, meta, sh),
                                   part_seqs=(parts or {}).get(sh.index, []), defer_apply=defer_apply,
                                   layout_id=meta.layout_id))
             for sh in meta.shards]
    acks = yield calls
    rows = int(sum(a.rows for a in acks) // (1 if meta.by_rows else len(meta.shards)))
    return rows, phase in (pb.STEP_COMMIT, pb.STEP_PREPARE_COMMIT)


#: A commit plan yields (make_op, tags) and is sent the op's result, or the MemserverError it
#: raised (client.sync and client.aio run it: `commit_step`).
CommitPlan = Generator[tuple[Callable[[TableMeta], Op], WriteTags], Any, int]

_PHASES = {pb.STEP_COMMIT: "commit", pb.STEP_ABORT: "abort", pb.STEP_PREPARE_COMMIT: "commit"}
#: Refusals that re-sending cannot change (the shard answered): a decision refused so is not kept.
_FINAL = (FailedPreconditionError, StepAbortedError, TableNotFoundError, InvalidArgumentError)


def commit_step_plan(session: ClientSession, table: str, step: int, shards: int, defer_apply: bool = False
                     ) -> CommitPlan:
    """Commit this client's `gather` parts of `step` on every shard of `table` (`shards` of them),
    or on none: PREPARE on every shard (each checks it holds exactly the parts it acknowledged),
    then COMMIT on every shard if all prepared, else ABORT on every shard and raise
    StepAbortedError naming the shard that refused. One shard: one call (PREPARE_COMMIT). A
    decision that cannot reach a shard (unavailable past the client's retries) is kept, its seqs
    in flight, and re-sent with the same tags before the table's next commit, which raises until
    it is delivered. Returns the rows updated now."""
    for st, (phase, tags, parts) in session.undecided(table).items():
        got = yield (lambda meta, st=st, phase=phase, tags=tags, parts=parts:
                     step_phase_op(meta, st, phase, tags, parts)), tags
        if isinstance(got, MemserverError) and not isinstance(got, _FINAL):
            raise type(got)(f"table {table}: step {step} is not committed: the {_PHASES[phase]} of step {st} has not "
                            f"reached every shard yet ({got.details}); commit step {step} again later",
                            target=got.target)
        if isinstance(got, MemserverError):
            log.warning("table %s: the %s of step %d was refused: %s", table, _PHASES[phase], st, got)
        session.set_undecided(table, st, None)
    parts = session.parts_of(table, step)
    session.forget_step(table, step)
    prepare = WriteTags(session)
    prepare.held = shards == 1  # PREPARE_COMMIT is a decision: kept if it may not have arrived
    voted = yield (lambda meta: step_phase_op(meta, step, pb.STEP_PREPARE, prepare, parts, defer_apply)), prepare
    if shards == 1 and isinstance(voted, MemserverError) and not isinstance(voted, _FINAL):
        session.set_undecided(table, step, (pb.STEP_PREPARE_COMMIT, prepare, parts))
        raise _undelivered(voted, table, step, pb.STEP_PREPARE_COMMIT)
    prepare.held = False
    prepare.close()
    if not isinstance(voted, MemserverError) and voted[1]:  # one shard: prepared and committed at once
        return voted[0]
    decision = pb.STEP_ABORT if isinstance(voted, MemserverError) else pb.STEP_COMMIT
    decide = WriteTags(session)
    decide.held = True  # its seqs stay in flight until every shard has the decision
    got = yield (lambda meta: step_phase_op(meta, step, decision, decide, None, defer_apply)), decide
    if isinstance(got, MemserverError) and not isinstance(got, _FINAL):
        session.set_undecided(table, step, (decision, decide, None))
        raise _undelivered(got, table, step, decision)
    decide.held = False
    decide.close()
    if isinstance(got, MemserverError):
        raise got
    if isinstance(voted, MemserverError):
        raise StepAbortedError(f"table {table}: step {step} aborted on every shard, nothing of it applied: "
                               f"{voted.details}", target=voted.target)
    return got[0]


def _undelivered(exc: MemserverError, table: str, step: int, phase: int) -> MemserverError:
    return type(exc)(f"table {table}: step {step}: the {_PHASES[phase]} did not reach every shard ({exc.details}); "
                     "this client re-sends it before the table's next commit", target=exc.target)


def push_op(meta: TableMeta, ids: Any, grads: Any, opts: OpOptions, tags: WriteTags) -> Op:
    """Row gradients through the table's optimizer; duplicate ids summed here first. Returns the
    number of distinct rows updated."""
    t = _ids(ids, meta)
    g = _floats(grads, "grads")
    check_1d(t, "ids")
    check_rows(g, len(t), meta.dim, "grads")
    uniq, summed = aggregate(t, g)
    return (yield from _write_op(meta, "PushGradients", uniq, summed, opts, tags))


def write_rows_op(meta: TableMeta, ids: Any, rows: Any, opts: OpOptions, tags: WriteTags) -> Op:
    """Overwrite rows (optimizer state is kept). Ids must be distinct."""
    t = _ids(ids, meta)
    r = _floats(rows, "rows")
    check_1d(t, "ids")
    check_rows(r, len(t), meta.dim, "rows")
    if len(torch.unique(t)) != len(t):
        raise InvalidArgumentError("ids: write_rows needs distinct ids (which of two rows would win?)")
    return (yield from _write_op(meta, "WriteRows", t, r, opts, tags))


def _write_op(meta: TableMeta, method: str, ids: torch.Tensor, values: torch.Tensor, opts: OpOptions,
              tags: WriteTags) -> Op:
    push = method == "PushGradients"
    calls = []
    for i, part in enumerate(_chunks(len(ids), meta.dim * 4 + 8, opts.max_request_bytes)):
        p_ids, p_vals = ids[part], values[part]
        for sh, sel in route_ids(meta, p_ids):
            v = p_vals[sel] if meta.by_rows else p_vals[:, sh.col_start : sh.col_end]
            v_msg = encode(v, opts.wire_dtype if push else None)  # rows written travel exactly
            ids_msg = encode(wire_ids(p_ids[sel], meta))
            tag = tags(i, meta, sh)
            req = (pb.PushGradientsRequest(table=meta.name, ids=ids_msg, grads=v_msg, tag=tag, layout_id=meta.layout_id)
                   if push else
                   pb.WriteRowsRequest(table=meta.name, ids=ids_msg, rows=v_msg, tag=tag, layout_id=meta.layout_id))
            calls.append((sh.address, method, req))
    acks = yield calls
    return len(ids) if not acks else int(sum(a.rows for a in acks) // (1 if meta.by_rows else len(meta.shards)))


def slot_stats_op(meta: TableMeta, ids: Any) -> Op:
    """Per-slot statistics: hits, weight_mass, updates, last_update (unix s), value_norm."""
    t = _ids(ids, meta).reshape(-1)
    uniq, inv = torch.unique(t, return_inverse=True)
    n = len(uniq)
    out = {
        "hits": torch.zeros(n, dtype=torch.int64),
        "weight_mass": torch.zeros(n, dtype=torch.float64),
        "updates": torch.zeros(n, dtype=torch.int64),
        "last_update": torch.zeros(n, dtype=torch.float64),
        "value_sq_norm": torch.zeros(n, dtype=torch.float64),
    }
    routes = route_ids(meta, uniq)
    reqs = [(sh.address, "SlotStats", pb.SlotStatsRequest(table=meta.name, ids=encode(uniq[sel]), layout_id=meta.layout_id))
            for sh, sel in routes]
    for (sh, sel), resp in zip(routes, (yield reqs)):
        for key in out:
            got = decode(getattr(resp, key), key)
            if key == "value_sq_norm" and not meta.by_rows:
                out[key] += got  # cols: each shard holds part of the row
            elif meta.layout.counts_reads(sh.index):  # cols: shard 0 keeps the counters
                out[key][sel] = got
    norm = out.pop("value_sq_norm").sqrt()
    out["value_norm"] = norm
    return {k: v[inv] for k, v in out.items()}



# ------------------------------------------------------------------ inspection

#: `top_slots`' statistics as users name them, and the proto's.
SLOT_STATS = {"hits": pb.HITS, "mass": pb.WEIGHT_MASS, "updates": pb.UPDATES, "norm": pb.VALUE_SQ_NORM}
#: A plan: yields op factories (meta -> Op) one after another, receives each op's result, returns
#: the answer; for the few calls that need a second round trip (see top_slots_plan).
Plan = Generator[Callable[[TableMeta], Op], Any, Any]


def _value_table(meta: TableMeta, what: str) -> None:
    if meta.kind != "value":
        raise InvalidArgumentError(f"table: {meta.name!r} is a {meta.kind} table; {what} is for value tables")


def _owned(meta: TableMeta, ids: torch.Tensor) -> list[tuple[ShardMeta, torch.Tensor]]:
    """(shard, positions) by the shard keeping each slot's records: `ShardLayout.owner` on any sharding."""
    owner = meta.layout.owner(ids)
    return [(sh, sel) for sh in meta.shards if len(sel := (owner == sh.index).nonzero().squeeze(1))]


def record_triggers_op(meta: TableMeta, ids: Any, weights: Any, positions: Any, contexts: Any, nxt: Any,
                       info: str, opts: OpOptions) -> Op:
    """Send trigger records (memserver.core.triggers) to the shards keeping the slots' records:
    record i read slot ids[i] with weights[i] at the position whose context is
    contexts[positions[i]] (int32 [P, L], -1 padded) and next token nxt[positions[i]]. Returns
    {"slots": slots holding records, "dropped": records refused by the bound, summed over shards}."""
    _value_table(meta, "record_triggers")
    t = _ids(ids, meta).reshape(-1)
    w = _floats(weights, "weights").float().reshape(-1)
    pos = as_tensor(positions).long().reshape(-1)
    ctx, nx = as_tensor(contexts), as_tensor(nxt)
    check_triggers(t, w, pos, ctx, nx, info)
    ctx, nx = ctx.int(), nx.int()
    per_record = 16 + 4 * (ctx.shape[1] + 1)
    calls = []
    for sh, sel in _owned(meta, t):
        for part in _chunks(len(sel), per_record, opts.max_request_bytes):
            mine = sel[part]
            used, local = torch.unique(pos[mine], return_inverse=True)  # only the contexts these records read
            calls.append((sh.address, "RecordTriggers", pb.RecordTriggersRequest(
                table=meta.name, ids=encode(t[mine]), weights=encode(w[mine]), positions=encode(local.int()),
                contexts=encode(ctx[used]), next=encode(nx[used]), info=info, layout_id=meta.layout_id)))
    if info:  # every shard keeps the table's info, records or not
        have = {a for a, _, _ in calls}
        empty = torch.zeros(0, dtype=torch.int64)
        for sh in meta.shards:
            if sh.address not in have:
                calls.append((sh.address, "RecordTriggers", pb.RecordTriggersRequest(
                    table=meta.name, ids=encode(empty), weights=encode(empty.float()), positions=encode(empty.int()),
                    contexts=encode(torch.zeros((0, ctx.shape[1]), dtype=torch.int32)),
                    next=encode(torch.zeros(0, dtype=torch.int32)), info=info, layout_id=meta.layout_id)))
    answers = yield calls
    most: dict[str, tuple[int, int]] = {}
    for (address, _, _), a in zip(calls, answers):  # a shard's parts may run in any order: its largest counts
        was = most.get(address, (0, 0))
        most[address] = (max(was[0], a.slots), max(was[1], a.dropped))
    return {"slots": sum(x[0] for x in most.values()), "dropped": sum(x[1] for x in most.values())}


def triggers_op(meta: TableMeta, ids: Any) -> Op:
    """The slots' trigger records: {"weights": [n, C] descending (0 = none), "contexts": [n, C, L],
    "next": [n, C], "info": the table's trace info as a dict ({} = never traced)}."""
    import json

    _value_table(meta, "triggers")
    t = _ids(ids, meta).reshape(-1)
    if len(t) > MAX_INSPECT_SLOTS:
        raise InvalidArgumentError(f"ids: at most {MAX_INSPECT_SLOTS} slots per call, got {len(t)}")
    routes = _owned(meta, t)
    calls = [(sh.address, "Triggers", pb.TriggersRequest(table=meta.name, ids=encode(t[sel]), layout_id=meta.layout_id))
             for sh, sel in routes]
    answers = yield calls
    out: dict[str, Any] = {"weights": None, "contexts": None, "next": None, "info": {}}
    for (_, sel), a in zip(routes, answers):
        got = {k: decode(getattr(a, k), k) for k in ("weights", "contexts", "next")}
        for k, v in got.items():
            if out[k] is None:
                out[k] = torch.full((len(t), *v.shape[1:]), 0 if k == "weights" else -1, dtype=v.dtype)
            out[k][sel] = v
        if a.info and not out["info"]:
            out["info"] = json.loads(a.info)
    if out["weights"] is None:  # no ids
        out.update(weights=torch.zeros((0, 0)), contexts=torch.zeros((0, 0, 0), dtype=torch.int32),
                   next=torch.zeros((0, 0), dtype=torch.int32))
    return out


def _top_round_op(meta: TableMeta, stat: int, n: int, coldest: bool, shards: list[ShardMeta]) -> Op:
    req = pb.TopSlotsRequest(table=meta.name, by=stat, n=n, coldest=coldest, layout_id=meta.layout_id)
    answers = yield [(sh.address, "TopSlots", req) for sh in shards]
    return [(decode(a.ids, "ids"), decode(a.values, "values")) for a in answers]


def _best(ids: torch.Tensor, values: torch.Tensor, n: int, coldest: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The n best (ids, values), best first, ties by the smaller id."""
    import numpy as np

    key = values.numpy() if coldest else -values.numpy()
    order = torch.from_numpy(np.lexsort((ids.numpy(), key))[:n])
    return ids[order], values[order]


def top_slots_plan(by: str, n: int, coldest: bool) -> Plan:
    """The n hottest (coldest) slots by hits, mass (summed read weight), updates or norm (of the
    value): (ids int64 [n], values float64 [n]), best first, ties by the smaller id.

    Each shard ranks its own rows; the client merges. On COLS tables shard 0 keeps the counters
    (`ShardLayout.counts_reads`: it answers), while a norm is split over the column blocks: the client then
    runs Fagin's threshold algorithm: each shard's top m partial norms, the candidates' exact norms
    (SlotStats), and the answer is exact once the n-th candidate is at least as good as the sum of
    the shards' m-th partials (no unseen row can be better; one with an equal norm may have a
    smaller id); else m grows x4, and past what one call ranks, every row's norm is read
    (`_scan_norms`)."""
    if by not in SLOT_STATS:
        raise InvalidArgumentError(f"by: one of {', '.join(SLOT_STATS)}, got {by!r}")
    if not 1 <= n <= MAX_INSPECT_SLOTS:
        raise InvalidArgumentError(f"n: must be in [1, {MAX_INSPECT_SLOTS}], got {n}")
    meta: TableMeta = yield lambda m: _meta_op(m)
    _value_table(meta, "top_slots")
    stat = SLOT_STATS[by]
    if meta.layout.by_rows or len(meta.shards) == 1 or by != "norm":
        shards = [sh for sh in meta.shards if meta.layout.counts_reads(sh.index)]
        got = yield lambda m: _top_round_op(m, stat, n, coldest, shards)
        ids, values = _best(torch.cat([g[0] for g in got]), torch.cat([g[1] for g in got]), n, coldest)
        return ids, values.sqrt() if by == "norm" else values
    m = n
    while True:
        got = yield lambda mt, m=m: _top_round_op(mt, stat, m, coldest, mt.shards)
        cand = torch.unique(torch.cat([g[0] for g in got]))
        stats = yield lambda mt, cand=cand: slot_stats_op(mt, cand)
        exact = stats["value_norm"].double() ** 2
        ids, values = _best(cand, exact, n, coldest)
        complete = all(len(g[0]) < m for g in got) or m >= meta.num_rows
        bound = sum(float(g[1][-1]) for g in got if len(g[1]))  # unseen rows: total <= bound (coldest: >=)
        if complete or (len(values) == n and (float(values[-1]) >= bound if not coldest else float(values[-1]) <= bound)):
            return ids, values.sqrt()
        if m >= MAX_INSPECT_SLOTS:  # the most one call ranks, still undecided: every row's norm, in chunks
            return (yield from _scan_norms(meta.num_rows, n, coldest))
        m = min(4 * m, meta.num_rows, MAX_INSPECT_SLOTS)


def _scan_norms(num_rows: int, n: int, coldest: bool) -> Plan:
    """Exact top n norms by reading every row's (SlotStats of MAX_INSPECT_SLOTS rows at a time):
    O(rows) work, O(n + chunk) memory; the threshold algorithm's fallback."""
    ids, values = torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.float64)
    for s in range(0, num_rows, MAX_INSPECT_SLOTS):
        chunk = torch.arange(s, min(num_rows, s + MAX_INSPECT_SLOTS))
        stats = yield lambda mt, chunk=chunk: slot_stats_op(mt, chunk)
        ids, values = _best(torch.cat([ids, chunk]), torch.cat([values, stats["value_norm"].double() ** 2]), n, coldest)
    return ids, values.sqrt()


def _meta_op(meta: TableMeta) -> Op:
    """An op without requests: hands a plan the table's metadata."""
    yield []
    return meta


def usage_op(meta: TableMeta) -> Op:
    """The table's usage histograms (memserver.api.usage), each shard's added up: {"hits",
    "weight_mass", "updates"} -> Histogram. COLS: shard 0 keeps the counters (ShardLayout.counts_reads)."""
    _value_table(meta, "usage")
    shards = [sh for sh in meta.shards if meta.layout.counts_reads(sh.index)]
    req = pb.SlotUsageRequest(table=meta.name, layout_id=meta.layout_id)
    answers = yield [(sh.address, "SlotUsage", req) for sh in shards]
    out = {k: Histogram.empty() for k in ("hits", "weight_mass", "updates")}
    for a in answers:
        for k in out:
            h = getattr(a, k)
            out[k] = out[k] + Histogram(int(h.slots), float(h.total), float(h.sum_xlogx), float(h.max),
                                        decode(h.counts, f"{k}.counts").numpy(), decode(h.sums, f"{k}.sums").numpy())
    return out


# ------------------------------------------------------------------ index tables


def _vectors(x: Any, n: int, dim: int, what: str) -> torch.Tensor:
    v = _floats(x, what).float()
    check_rows(v, n, dim, what)
    check_float(v, what)
    return v


def add_op(meta: TableMeta, ids: Any, vectors: Any, payload: Any, opts: OpOptions, tags: WriteTags) -> Op:
    """Upsert vectors (and payload rows) under the user's ids; each id goes to the shard that owns
    it. Returns how many vectors were added."""
    t = _ids(ids, meta)
    check_1d(t, "ids")
    if len(torch.unique(t)) != len(t):
        raise InvalidArgumentError("ids: an add needs distinct ids (which vector would win?)")
    v = _vectors(vectors, len(t), meta.dim, "vectors")
    if (payload is None) != (meta.payload_dim == 0):
        raise InvalidArgumentError(f"payload: the index {meta.name!r} has payload_dim {meta.payload_dim}; "
                                   + ("give payload rows" if payload is None else "it takes no payload"))
    p = None if payload is None else _vectors(payload, len(t), meta.payload_dim, "payload")
    calls = []
    per_id = 8 + 4 * (meta.dim + meta.payload_dim)
    for i, part in enumerate(_chunks(len(t), per_id, opts.max_request_bytes)):
        for sh, sel in route_ids(meta, t[part]):
            req = pb.AddRequest(table=meta.name, ids=encode(t[part][sel]), vectors=encode(v[part][sel]),
                                tag=tags(i, meta, sh), layout_id=meta.layout_id)
            if p is not None:
                req.payload.CopyFrom(encode(p[part][sel]))
            calls.append((sh.address, "Add", req))
    acks = yield calls
    return int(sum(a.rows for a in acks))


def remove_op(meta: TableMeta, ids: Any, opts: OpOptions, tags: WriteTags) -> Op:
    """Remove ids (absent ones are ignored); returns how many were present."""
    t = torch.unique(_ids(ids, meta).reshape(-1))
    calls = []
    for i, part in enumerate(_chunks(len(t), 8, opts.max_request_bytes)):
        for sh, sel in route_ids(meta, t[part]):
            calls.append((sh.address, "Remove", pb.RemoveRequest(table=meta.name, ids=encode(t[part][sel]),
                                                                 tag=tags(i, meta, sh), layout_id=meta.layout_id)))
    acks = yield calls
    return int(sum(a.rows for a in acks))


def search_op(meta: TableMeta, queries: Any, k: int, nprobe: int | None, ef_search: int | None, return_payload: bool,
              opts: OpOptions) -> Op:
    """Every shard's top k of each query, merged exactly in the metric's order (client.merge):
    (scores [B, k], ids [B, k], payload [B, k, payload_dim] or None); a missing hit is id -1."""
    q = _floats(queries, "queries").float()
    if q.dim() != 2 or q.shape[1] != meta.dim:
        raise InvalidArgumentError(f"queries: expected shape [B, {meta.dim}], got {list(q.shape)}")
    check_float(q, "queries")
    if not 0 < k <= MAX_SEARCH_K:
        raise InvalidArgumentError(f"k: must be in 1..{MAX_SEARCH_K}, got {k}")
    for name, value in (("nprobe", nprobe), ("ef_search", ef_search)):
        if value is not None and value <= 0:
            raise InvalidArgumentError(f"{name}: must be positive, got {value}")
    with_payload = return_payload and meta.payload_dim > 0
    per_query = max(4 * meta.dim, k * (12 + (4 * meta.payload_dim if with_payload else 0)))
    chunks = _chunks(q.shape[0], per_query, opts.max_request_bytes)
    calls, places = [], []
    for part in chunks:
        msg = pb.SearchRequest(table=meta.name, k=k, return_payload=with_payload, layout_id=meta.layout_id)
        if nprobe is not None:
            msg.nprobe = nprobe
        if ef_search is not None:
            msg.ef_search = ef_search
        n_q = len(range(q.shape[0])[part])
        req = Lazy(msg, {"queries": wire_tensor(q[part])}, answer_bytes=n_q * k * (12 + 4 * meta.payload_dim * with_payload))
        for sh in meta.shards:  # one request for every shard
            calls.append((sh.address, "Search", req))
            places.append(part)
    answers = yield calls
    out_s, out_i, out_p = [], [], []
    n = len(meta.shards)
    for c in range(len(chunks)):
        got = answers[c * n : (c + 1) * n]
        scores = [decode(a.scores, "scores") for a in got]
        ids = [decode(a.ids, "ids").long() for a in got]
        payloads = [decode(a.payload, "payload") for a in got] if with_payload else None
        s, i, p = merge_topk(scores, ids, k, meta.metric, payloads)
        out_s.append(torch.as_tensor(s))
        out_i.append(torch.as_tensor(i))
        if p is not None:
            out_p.append(torch.as_tensor(p))
    cat = (lambda xs: torch.cat(xs) if len(xs) > 1 else xs[0])  # noqa: E731
    return cat(out_s), cat(out_i), (cat(out_p) if out_p else None)


# ------------------------------------------------------------------ product-key tables


def _product_keys_table(meta: TableMeta) -> None:
    if meta.kind != "product_keys":
        raise InvalidArgumentError(f"table: {meta.name!r} is a {meta.kind} table, not a product-key table")


def address_op(meta: TableMeta, queries: Any, opts: OpOptions) -> Op:
    """Product-key addressing on the table's shard: inputs [B, d_in] (a query network is stored)
    or queries [B, heads*k_dim] / [B, heads, k_dim] -> (ids int64 [B, heads*knn], weights float32
    [B, heads*knn]). Large batches are split below the request size limit."""
    _product_keys_table(meta)
    q = _floats(queries, "queries").float()
    q_dim = meta.pkm_heads * meta.pkm_k_dim
    if meta.pkm_d_in:
        ok, want = q.dim() == 2 and q.shape[1] == meta.pkm_d_in, f"[B, {meta.pkm_d_in}]"
    else:
        ok = (q.dim() == 2 and q.shape[1] == q_dim) or (q.dim() == 3 and tuple(q.shape[1:]) == (meta.pkm_heads, meta.pkm_k_dim))
        want = f"[B, {q_dim}] or [B, {meta.pkm_heads}, {meta.pkm_k_dim}]"
    if not ok:
        raise InvalidArgumentError(f"queries: shape must be {want}, got {list(q.shape)}")
    check_float(q, "queries")
    per_row = max(4 * (q.numel() // max(1, q.shape[0])), 12 * meta.pkm_heads * meta.pkm_knn)
    chunks = _chunks(q.shape[0], per_row, opts.max_request_bytes)
    shard = meta.shards[0]
    calls = [(shard.address, "Address", pb.AddressRequest(table=meta.name, queries=encode(q[c]), layout_id=meta.layout_id))
             for c in chunks]
    answers = yield calls
    ids = [decode(a.ids, "ids").long() for a in answers]
    weights = [decode(a.weights, "weights").float() for a in answers]
    return (torch.cat(ids), torch.cat(weights)) if len(chunks) > 1 else (ids[0].clone(), weights[0].clone())


def load_product_keys_op(meta: TableMeta, keys: Any, query_weight: Any, query_bias: Any, bn: dict[str, Any] | None,
                         tags: WriteTags) -> Op:
    """Install sub-keys [heads, 2, n_keys, k_dim/2] and, for a table with pkm_d_in, the query
    Linear (weight [heads*k_dim, d_in], bias [heads*k_dim] or None) and an eval-mode BatchNorm
    (`bn`: running_mean, running_var, weight, bias [heads*k_dim], optional eps; None = none).
    Returns the number of sub-keys loaded. Shapes are checked here and again on the shard."""
    _product_keys_table(meta)
    h, n_keys, k_dim, d_in = meta.pkm_heads, meta.pkm_n_keys, meta.pkm_k_dim, meta.pkm_d_in
    q_dim = h * k_dim

    def tensor(x: Any, shape: tuple[int, ...], what: str) -> pb.Tensor:
        t = _floats(x, what).float().contiguous()
        if tuple(t.shape) != shape:
            raise InvalidArgumentError(f"{what}: shape must be {list(shape)}, got {list(t.shape)}")
        check_float(t, what)
        return encode(t)

    req = pb.LoadProductKeysRequest(table=meta.name, keys=tensor(keys, (h, 2, n_keys, k_dim // 2), "keys"),
                                    layout_id=meta.layout_id)
    if not d_in and (query_weight is not None or query_bias is not None or bn is not None):
        raise InvalidArgumentError(f"query_weight: the table {meta.name!r} takes queries already projected "
                                   "(created with d_in=0); it stores no query network")
    if d_in:
        if query_weight is None:
            raise InvalidArgumentError(f"query_weight: required: the table {meta.name!r} projects inputs of dim {d_in}")
        req.query_weight.CopyFrom(tensor(query_weight, (q_dim, d_in), "query_weight"))
        if query_bias is not None:
            req.query_bias.CopyFrom(tensor(query_bias, (q_dim,), "query_bias"))
        if bn is not None:
            missing = {"running_mean", "running_var", "weight", "bias"} - set(bn)
            if missing:
                raise InvalidArgumentError(f"bn: missing {sorted(missing)}")
            req.bn.CopyFrom(pb.QueryBatchNorm(eps=float(bn.get("eps", 1e-5)), **{
                k: tensor(bn[k], (q_dim,), f"bn.{k}") for k in ("running_mean", "running_var", "weight", "bias")}))
    shard = meta.shards[0]
    req.tag.CopyFrom(tags(0, meta, shard))
    (ack,) = yield [(shard.address, "LoadProductKeys", req)]
    return int(ack.rows)
