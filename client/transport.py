"""How a data-plane request goes on the wire, for every sender (the asyncio and blocking clients,
the load test's users): each method as a bytes-in multi-callable of its channel, each distinct
request serialised once (a cols bag sends the same memserver.wire.Lazy to every shard), or
through shared memory with a shard on this machine (client.shm), and then by that shard's
doorbell (client.doorbell: no gRPC) where it has one; answers parsed by the method's response
type. One place, so no sender serialises differently."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf import message_factory

from client.doorbell import Bell
from memserver.api.errors import MemserverError, error_for
from memserver.api.methods import marked
from memserver.api.v1 import memserver_pb2 as pb
from memserver.wire import STALE_REGION, Lazy, parse_views, to_bytes

if TYPE_CHECKING:
    from client.shm import Lease, ShmTransport

_SERVICE = pb.DESCRIPTOR.services_by_name["DataPlane"]
#: method name -> its response message class.
RESPONSES: dict[str, Any] = {m.name: message_factory.GetMessageClass(m.output_type) for m in _SERVICE.methods}


#: The methods whose answers carry large tensors: read as views of the answer's bytes (parse_views);
#: the proto marks them (`option (answer_views)`).
_VIEWED = marked(pb.answer_views, "DataPlane")


#: method name -> how its answer's bytes are read (by gRPC's channels and by the doorbell).
PARSERS: dict[str, Any] = {name: partial(parse_views, cls) if name in _VIEWED else cls.FromString
                           for name, cls in RESPONSES.items()}


def methods(channel: Any) -> dict[str, Any]:
    """The DataPlane methods of a channel (grpc or grpc.aio) as multi-callables that take the
    serialised request and return the parsed answer."""
    return {name: channel.unary_unary(f"/{_SERVICE.full_name}/{name}", request_serializer=None,
                                      response_deserializer=PARSERS[name])
            for name in RESPONSES}


Rung = tuple[Bell, int] | None


def ring(calls: list[tuple[str, str, Any]], sent: list[tuple[bytes, Lease | None]], shm: ShmTransport | None,
         timeout: float | None, servers: Mapping[str, int | None], block: bool = True) -> list[Rung]:
    """Send each call that can go by its shard's doorbell now; (bell, ticket) for each, None for
    those to send by gRPC (no doorbell with that shard, too large, too many answers unread, or no
    room for it in the socket before its deadline). `servers`: the shard server each address is
    (TableMeta.servers): a doorbell is used only with the server the call is meant for. `block`
    False: an event loop's thread, which never waits for room (Bell.send)."""
    if shm is None or not shm.regions:
        return [None] * len(calls)
    out: list[Rung] = []
    for (address, method, _), (raw, lease) in zip(calls, sent):
        # a call packed into a region goes by that region's own doorbell (the one it names)
        bell = shm.bell(address, servers.get(address)) if lease is None else lease.region.bell
        ticket = bell.send(method, raw, timeout, block) if bell is not None else None  # None from a dead bell too
        if ticket is not None:
            shm.bell_calls += 1
        out.append(None if ticket is None else (bell, ticket))
    return out


def answer(rung: tuple[Bell, int], method: str, timeout: float | None) -> Any:
    """A doorbell call's outcome: its parsed answer, or the MemserverError of its status (returned,
    not raised: handled with the gRPC calls' outcomes). An error the shard answered says so
    (`answered`): the shard is done with the call's shared-memory block, which can be freed."""
    bell, ticket = rung
    try:
        code, body = bell.wait(ticket, timeout)
    except MemserverError as exc:  # no answer (deadline, connection lost): the shard may still write
        return exc
    if code == grpc.StatusCode.OK:
        return PARSERS[method](body)
    err = error_for(code, body.decode(errors="replace"), bell.target)
    err.answered = True  # type: ignore[attr-defined]
    return err


def forget(rung: list[Rung], outcomes: list[Any]) -> None:
    """Doorbell calls whose outcome is not known (the caller failed before waiting): their bells
    drop their answers as they come (each still counts against the bell's calls in flight until
    its answer is read: the shard answers it all the same)."""
    for r, o in zip(rung, outcomes):
        if r is not None and o is None:
            r[0].forget(r[1])


def recount(calls: list[tuple[str, str, Any]], counted: set[tuple[str, int, int]]) -> list[tuple[str, str, Any]]:
    """An op's calls on a later attempt: a read that a shard already answered (`counted`, filled
    by `note_counted`: (address, layout_id, the call's rank among the op's calls to that address),
    the same on every attempt of an op, which routes alike) is marked uncounted, so the shard
    answers it again without counting its slots' hits and weight mass twice (when one shard of a
    table refuses a call, the whole op is sent again; a shard sent a large read in several parts
    counts each part once). Other calls as they are; a request shared by several shards (a cols
    bag) is copied for the one marked."""
    if not counted:
        return calls
    out = []
    for (address, method, req), key in zip(calls, _keys(calls)):
        msg = req.msg if isinstance(req, Lazy) else req
        if _counts(msg) and key in counted:
            marked = type(msg)()
            marked.CopyFrom(msg)
            marked.uncounted = True
            req = Lazy(marked, req.tensors, req.answer_bytes) if isinstance(req, Lazy) else marked
        out.append((address, method, req))
    return out


def note_counted(calls: list[tuple[str, str, Any]], outcomes: list[Any], counted: set[tuple[str, int, int]]) -> None:
    """Add the calls of this attempt that answered a counted read to `counted` (see `recount`);
    nothing when no call failed (no attempt follows: every op's path, so it costs one scan then)."""
    if not any(isinstance(o, BaseException) for o in outcomes):
        return
    for (_, _, req), outcome, key in zip(calls, outcomes, _keys(calls)):
        msg = req.msg if isinstance(req, Lazy) else req
        if outcome is not None and not isinstance(outcome, BaseException) and _counts(msg):
            counted.add(key)


def _keys(calls: list[tuple[str, str, Any]]) -> list[tuple[str, int, int]]:
    """Each call's (address, layout_id, rank among the calls to that address)."""
    rank: dict[str, int] = {}
    out = []
    for address, _, req in calls:
        msg = req.msg if isinstance(req, Lazy) else req
        n = rank[address] = rank.get(address, -1) + 1
        out.append((address, getattr(msg, "layout_id", 0), n))
    return out


def _counts(msg: Any) -> bool:
    """A read the shard counts in its slots' statistics (a Lookup or Bag not marked uncounted)."""
    return "uncounted" in msg.DESCRIPTOR.fields_by_name and not msg.uncounted


def serialised(calls: list[tuple[str, str, Any]]) -> list[bytes]:
    """The bytes of each call's request; a request object shared by several calls is serialised once."""
    done: dict[int, bytes] = {}
    out = []
    for _, _, req in calls:
        raw = done.get(id(req))
        if raw is None:
            raw = done[id(req)] = to_bytes(req)
        out.append(raw)
    return out


def prepare(calls: list[tuple[str, str, Any]], shm: ShmTransport | None,
            servers: Mapping[str, int | None]) -> list[tuple[bytes, Lease | None]]:
    """Each call's request bytes and, when it goes through shared memory, its block's lease
    (release them all with `release`, however the calls end). `servers`: as `ring`'s."""
    if shm is None:
        return [(r, None) for r in serialised(calls)]
    out: list[tuple[bytes, Lease | None]] = []
    inline: dict[int, bytes] = {}
    try:
        for address, method, req in calls:
            packed = shm.pack(address, method, req, servers.get(address))
            if packed is None:
                data = inline.get(id(req))
                if data is None:
                    data = inline[id(req)] = to_bytes(req)
                out.append((data, None))
            else:
                out.append(packed)
    except BaseException:
        for _, lease in out:  # packed, never sent
            if lease is not None:
                lease.release()
        raise
    return out


def receive(sent: list[tuple[bytes, Lease | None]], answers: list[Any]) -> list[Any]:
    """The answers, with what shards wrote into shared memory read (client.shm.Lease.unpack: for
    Lookup, Bag and BagBackward views of the blocks; hand them to the op before `release`)."""
    return [a if lease is None else lease.unpack(a) for (_, lease), a in zip(sent, answers)]


#: Statuses a shard answers itself, its handler done with the call's shared-memory block. After
#: any other ending (deadline, cancelled, connection lost) the shard may still write into it.
_ANSWERED = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.OUT_OF_RANGE,
})  # not INTERNAL: gRPC itself says so of a reset stream whose handler may still be running


def stale(sent: list[tuple[bytes, Lease | None]], outcomes: list[Any]) -> bool:
    """Whether a call went to a shard that no longer has its region (a restart at the same
    address the client has not noticed yet): the region is retired (the next calls go by TCP
    while a fresh one is attached) and the caller sends the call again."""
    found = False
    for (_, lease), outcome in zip(sent, outcomes):
        if lease is not None and isinstance(outcome, BaseException) and STALE_REGION in str(outcome):
            lease.region.retire()
            found = True
    return found


def release(sent: list[tuple[bytes, Lease | None]], outcomes: list[Any]) -> None:
    """Free each call's shared-memory block once its outcome (answer or exception; None: not
    known) shows the shard is done with it; abandon it (never reused) otherwise."""
    for (_, lease), outcome in zip(sent, outcomes):
        if lease is None:
            continue
        if outcome is None:
            lease.abandon()
        elif isinstance(outcome, BaseException):
            code = getattr(outcome, "code", None)
            answered = getattr(outcome, "answered", False) or (code() if callable(code) else code) in _ANSWERED
            (lease.release if answered else lease.abandon)()
        else:
            lease.release()
