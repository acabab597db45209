"""The asyncio client: reads a table's shard map once, then calls its shards directly.

Each data-plane method builds an op (client.ops: validation, routing, reassembly) and sends all
of its shard requests at once with grpc.aio. Every RPC carries a deadline. Reads are idempotent
and writes carry a (client_id, seq) tag the shards deduplicate, so every data-plane call is safe
to retry: gRPC retries UNAVAILABLE briefly itself (client.channels), and the client keeps
retrying, re-reading the shard map, for up to `retry_seconds` while a shard or the coordinator
restarts, or while its attempts run past their deadline (`timeout` is per attempt: a host cut off
by a partition answers nothing until its link is back).

A server at one of its limits refuses a call with RESOURCE_EXHAUSTED "server overloaded: ..."
(OverloadedError; memserver.server.admission) before parsing it (or, for an answer many times its
request, once it is planned, before any work). The client retries such calls
with jittered exponential backoff within the same `retry_seconds`: every data-plane call, reads
and writes alike, and the coordinator's reads. A write is safe to retry for the reason it is
through a restart, and more so: the refusing shard applied nothing, and the shards that did
apply their part of the call answer the retry from the client's session (same tags) instead of
applying it twice. Control-plane writes (create, drop, restore, train) are not retried, as on
UNAVAILABLE: their OverloadedError reaches the caller; a checkpoint is (writing a step again is
safe).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import math
import numbers
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from client import ops, transport
from client.channels import ClientTls, aio_channel, checked_token, client_tls, client_token
from client.ops import ClientSession, Op, OpOptions, WriteTags, finish, like
from client.ops.checks import INT32, INT64, check_ints
from client.shm import ShmTransport
from client.shm import enabled as shm_enabled
from memserver.api.errors import (
    NOT_HTTP2,
    SHARD_UNAVAILABLE,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    MemserverError,
    OverloadedError,
    TableNotFoundError,
    UnavailableError,
    from_rpc_error,
    other_server,
    raised,
    retried,
    shard_error,
    tls_problem,
)
from memserver.api.types import METRICS, SHARDINGS, Restored, TableMeta
from memserver.api.usage import TableUsage
from memserver.api.v1 import memserver_pb2 as pb
from memserver.api.v1 import memserver_pb2_grpc as pb_grpc
from memserver.cluster.endpoint import (
    endpoint_file,
    is_host_port,
    live_endpoint,
    moved_to,
    stopped_since,
    this_clusters_record,
)
from memserver.loop import settle_grpc
from memserver.wire import (
    MAX_MESSAGE_BYTES,
    VALUE_DTYPES,
    as_tensor,
    check_float,
    check_wire_dtype,
    dtype_code,
    encode,
    shard_metadata,
    train_sample_limit,
    tune_malloc,
)

log = logging.getLogger(__name__)

#: gRPC's words for a call that found no server to talk to (matched by part): a coordinator
#: there that answered UNAVAILABLE itself gets no "is a cluster running there?" hint.
NO_CONNECTION = ("failed to connect", "Socket closed", "Connection reset", "Connection refused", "unreachable")

class TableMaps(collections.OrderedDict):
    """The shard maps a client holds, by table name, at most MAX_TABLE_MAPS: past it the least
    recently used goes (asked of the coordinator again if used again). A long-lived client that
    touched tables other processes dropped kept every map (a walkthrough: 300 after 300)."""

    def __setitem__(self, name: str, meta: TableMeta) -> None:
        super().__setitem__(name, meta)
        self.move_to_end(name)
        while len(self) > MAX_TABLE_MAPS:
            self.popitem(last=False)


#: Why a client cannot be pickled or copied (its class's name goes in).
NOT_PICKLED = ("a {} holds connections to the memory cluster and threads, so it cannot be pickled or copied: make "
               "one in each process that calls the cluster (a DataLoader worker: in its worker_init_fn, or lazily "
               "on first use in the dataset) rather than passing one in")

#: Shard maps a client keeps (TableMaps).
MAX_TABLE_MAPS = 1024


def _cancelling() -> bool:
    """Whether the running task was cancelled by someone (its `cancelling()` count), rather than
    its call ended under it."""
    task = asyncio.current_task()
    return bool(task is not None and getattr(task, "cancelling", lambda: 0)())  # (Python 3.11+; older: never)


class ClosedMidCall(FailedPreconditionError):
    """A call the client's close() ended in flight; `write`: said as a write (it may have applied)."""

    def __init__(self, message: str, write: bool) -> None:
        super().__init__(message)
        self.write = write


def _closed_mid_call(tags: WriteTags | None) -> FailedPreconditionError:
    """The error of a call the client's close() ended in flight (a bare CancelledError reached
    callers that cancelled nothing, a walkthrough's, and the writes among them had been applied)."""
    may = ("; as a write, it may have been applied by the shards it reached (sent again by a new client, it is a new "
           "write: it may apply twice)" if tags is not None else "")
    return ClosedMidCall(f"the client was closed while this call was in flight{may}", tags is not None)


def as_the_write(exc: MemserverError, tags: WriteTags | None) -> MemserverError:
    """A write's error where a call inside it (its table's map, asked again) was ended by close():
    said as the write's (it may have applied), not as that inner call's."""
    return _closed_mid_call(tags) if isinstance(exc, ClosedMidCall) and tags is not None and not exc.write else exc


def ended_by_close(outcome: Any) -> bool:
    """Whether a call's outcome, once the client is closed, is what the close did to it rather
    than a shard's answer: grpc.aio cancels its calls (CancelledError; the blocking client's
    "CANCELLED: Channel closed!"), a doorbell breaks its connection (UNAVAILABLE, which was retried
    and then refused as if the call had never been made, though its write had been applied)."""
    return isinstance(outcome, asyncio.CancelledError | concurrent.futures.CancelledError) or (
        isinstance(outcome, MemserverError) and outcome.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        and not getattr(outcome, "answered", False))


#: What a closed client says to a call.
CLOSED = "this client is closed (close(), or the end of its with-block): make a new one"

#: The smallest max_request_bytes a client takes (a request must carry a few rows: below it every
#: call went one id per request).
MIN_REQUEST_BYTES = 1024

#: Retry backoff (seconds): the first delay, doubled after each retry up to the cap.
RETRY_FIRST_DELAY, RETRY_MAX_DELAY = 0.1, 2.0
#: The longest timeout or retry window a client takes: gRPC fails a call at once past ~1e10 s.
MAX_SECONDS = 1e8


#: Seconds between the warnings of one call's retries (the first is said at once; each retry
#: warned before).
RETRY_WARN_SECONDS = 10.0
#: The error texts a call's retries remember having warned of (errors that alternate, e.g. two
#: shards' refusals, warn once each per RETRY_WARN_SECONDS, not on every retry).
RETRY_TEXTS = 8
#: A call that meets a shard's process restarted more than this many times while it is retried
#: stops retrying: a request that kills its shard (a faiss abort) was sent again to every new
#: process for the whole retry window, each restart rolling back the shard's tables without wal.
RESTARTS_PER_CALL = 1


class Backoff:
    """Jittered exponential backoff within `seconds` from now. `next()` is the next sleep, drawn
    from [delay/2, delay] (so clients refused together do not all come back together), the delay
    doubling from RETRY_FIRST_DELAY to RETRY_MAX_DELAY; None when that sleep would end past the
    deadline: give up."""

    def __init__(self, seconds: float, *, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None, start: float | None = None) -> None:
        self.clock = clock
        self.deadline = (clock() if start is None else start) + seconds  # `start`: a failure before this backoff
        self.delay = RETRY_FIRST_DELAY
        self.rng = rng or random.Random()

    def next(self) -> float | None:
        sleep = self.delay * (0.5 + 0.5 * self.rng.random())
        if self.clock() + sleep > self.deadline:
            return None
        self.delay = min(2 * self.delay, RETRY_MAX_DELAY)
        return sleep


#: drop_open_steps' resend: dropping again drops what is open by then (steps sent since too)
DROPS_AGAIN = "sending it again drops the steps open on every shard by then"


class AppliedBy:
    """The shards that answered one plain write (each applies its part on its own: only a training
    step is all-or-none across them), so that its error, when it fails for good, says where it was
    applied and what sending it again does: `resend`, TWICE (a push: applied twice there) or SAME
    (a write that sets values: sending it again completes it). A shard some of whose requests
    were answered (a write cut into parts) applied part of it. Bounded by the table's shards."""

    TWICE = "sending it again as a new call applies it twice there"
    SAME = "sending the same write again once every shard serves completes it (it sets the same values again)"

    @classmethod
    def backward(cls, gather: bool, step: int) -> str:
        """A bag_backward's: applied at once unless it is a step's part (`gather`) or a sync table's
        contribution (`step`: applied once every trainer committed, a resend refused)."""
        return "" if gather or step else cls.TWICE

    def __init__(self, resend: str) -> None:
        self.resend = resend
        self.whole: dict[int, str] = {}  # shard index -> address: every request of the shard's answered
        self.part: dict[int, str] = {}  # some answered (in some attempt), not all in one
        self.layout = 0  # the incarnation they answered for (a re-created table never got the write)

    def begin(self, meta: TableMeta) -> None:
        """An attempt on `meta`'s incarnation: what an earlier one answered is forgotten."""
        if meta.layout_id != self.layout:
            self.whole.clear()
            self.part.clear()
            self.layout = meta.layout_id

    def note(self, meta: TableMeta, calls: list[tuple[str, str, Any]], outcomes: list[Any]) -> None:
        """An attempt that failed somewhere: which shards answered all or some of their requests."""
        answered: dict[str, list[bool]] = {}
        for (address, _, _), o in zip(calls, outcomes):
            answered.setdefault(address, []).append(not isinstance(o, BaseException))
        for sh in meta.shards:
            got = answered.get(sh.address, [])
            if got and all(got):
                self.whole[sh.index] = sh.address
                self.part.pop(sh.index, None)
            elif any(got) and sh.index not in self.whole:
                self.part[sh.index] = sh.address

    def say(self, exc: MemserverError) -> None:
        if not (self.whole or self.part) or isinstance(exc, TableNotFoundError):  # (gone: nothing to send again)
            return

        def shards(held: dict[int, str]) -> str:  # by address, as `memserver status` lists them (its numbers
            # are not the table's slice numbers: an operator read "shard 1" as status's shard 1, the wrong one)
            return f"the shard{'s' if len(held) > 1 else ''} at " + ", ".join(
                f"{a} (slice {i})" for i, a in sorted(held.items()))

        said = [f"{shards(self.whole)} applied this write (answered it)"] if self.whole else []
        said += [f"{shards(self.part)} applied part of it (answered some of its requests)"] if self.part else []
        exc.details += (f"; {' and '.join(said)}, and the others may have too: a write is applied by each shard on its "
                        f"own, not all-or-none across them (docs/architecture.md, Known limits); {self.resend}")
        exc.args = (exc.details,)


def value_table_spec(name: str, num_rows: int, dim: int, *, sharding: str | None = None, optimizer: str = "adagrad",
                     lr: float = 0.01, dtype: str = "float32", init_std: float = 0.02, seed: int = 0, num_shards: int = 0,
                     eps: float | None = None, betas: tuple[float, float] = (0.9, 0.999), sync_workers: int = 0,
                     wal: bool = False, tier: str = "ram", cache_bytes: int = 0) -> pb.TableSpec:
    """The CreateTable spec of `create_table`'s arguments, each field's type and range checked here
    (InvalidArgumentError naming it); what the spec means is the coordinator's to check
    (memserver.server.catalog.validate_spec, which `memserver up --config` also runs first)."""
    check_ints(INT64, num_rows=num_rows, dim=dim, seed=seed, cache_bytes=cache_bytes)
    check_ints(INT32, num_shards=num_shards, sync_workers=sync_workers)
    for key, f in (("lr", lr), ("init_std", init_std), ("eps", eps), ("betas", betas[0]), ("betas", betas[1])):
        if f is not None and (isinstance(f, bool) or not isinstance(f, numbers.Real)):
            raise InvalidArgumentError(f"{key}: must be a number, got {f!r}")
    if sharding is not None and sharding not in SHARDINGS:
        raise InvalidArgumentError(f"sharding: expected 'rows' or 'cols', got {sharding!r}")
    if sync_workers < 0:  # (the spec would say "only meaningful with sync_updates", a field no caller sets)
        raise InvalidArgumentError(f"sync_workers: must be >= 0 (0: not a sync_updates table), got {sync_workers}")
    return pb.TableSpec(
        name=name,
        kind=pb.VALUE,
        num_rows=num_rows,
        dim=dim,
        sharding=SHARDINGS[sharding] if sharding else pb.SHARDING_UNSPECIFIED,
        optimizer=pb.OptimizerSpec(name=optimizer, lr=lr, eps=eps, beta1=betas[0], beta2=betas[1]),
        dtype=dtype_code(dtype, VALUE_DTYPES),
        init_std=init_std,
        seed=seed,
        num_shards=num_shards,
        sync_updates=sync_workers > 0,
        sync_workers=sync_workers,
        wal=wal,
        tier=tier,
        cache_bytes=cache_bytes,
    )


class AsyncMemoryClient:
    """asyncio client of a memserver cluster.

    `endpoint` is the coordinator's HOST:PORT; by default it is read from the endpoint file
    that `memserver up` writes. `wire_dtype` ("float32", "float16", "bfloat16") is the dtype
    rows and gradients travel in; math on the shards is always float32. On a 16-bit wire a
    finite gradient that would round to infinity (float16 past 65504, bfloat16 past 3.39e38)
    is refused before anything is sent, and a shard's answer to a lookup or bag that would (a
    rows table's partial sum too) comes back in float32 instead: a read answers the same finite
    values on every wire and sharding, to the wire's rounding.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout: float = 60.0,
        wire_dtype: str = "float32",
        client_id: str | None = None,
        max_request_bytes: int = ops.MAX_REQUEST_BYTES,
        retry_seconds: float = 60.0,
        token: str | None = None,
        tls: ClientTls | None = None,
        shm: bool | None = None,
    ) -> None:
        """`retry_seconds`: how long a call keeps retrying while a shard or the coordinator is
        UNAVAILABLE (restarting) or overloaded (OverloadedError) before it raises the error; 0 = do
        not retry. `token`: the cluster's read or write token (default: $MEMSERVER_TOKEN, else
        the endpoint file's).
        `tls`: speak TLS, trusting its CA (default: $MEMSERVER_TLS_CA, else the endpoint file's;
        none of them: plaintext; see client.channels.client_tls).
        `shm`: send the tensors of lookups, bags and searches to shards on this machine through
        shared memory (client.shm); default $MEMSERVER_SHM, on unless it is 0 (or false, off, no).
        With shared memory on, calls go by the shards' doorbells (no gRPC per call) unless
        $MEMSERVER_DOORBELL is 0."""
        for what, value, least in (("timeout", timeout, 0.0), ("retry_seconds", retry_seconds, None)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
                    or (value <= least if least is not None else value < 0) or value > MAX_SECONDS:  # (timeout=0:
                need = "above 0" if least is not None else ">= 0 (0: no retry)"  # every call failed; 1e10: gRPC's too)
                raise InvalidArgumentError(f"{what}: must be a number of seconds {need} and at most {MAX_SECONDS:.0e} "
                                           f"(~3 years), got {value!r}")
        if isinstance(max_request_bytes, bool) or not isinstance(max_request_bytes, numbers.Integral) or \
                not MIN_REQUEST_BYTES <= max_request_bytes <= MAX_MESSAGE_BYTES:
            raise InvalidArgumentError(f"max_request_bytes: must be an integer in [{MIN_REQUEST_BYTES}, "
                                       f"{MAX_MESSAGE_BYTES}] (the message limit), got {max_request_bytes!r}")
        tune_malloc()  # large calls build their messages in reused memory (see memserver.wire)
        if endpoint and not is_host_port(endpoint):  # (gRPC dials port 443 when none is given)
            raise InvalidArgumentError(f"endpoint: expected the coordinator's HOST:PORT, got {endpoint!r}")
        record = live_endpoint() if not endpoint else None
        self.endpoint = endpoint or record["endpoint"]
        # the endpoint file's record of this cluster, if one names it (the one just read, when the
        # client was given no endpoint): a stopped cluster is told from a restarting one by it (_retrying)
        self._home = (endpoint_file(), record) if record is not None else this_clusters_record(self.endpoint)
        if token is None:
            self.token = client_token(self.endpoint, record)
        else:  # ("": none sent)
            self.token = checked_token(token, "token") if token else token
        self.tls = tls if tls is not None else client_tls(self.endpoint, record)
        if self.token and self.tls is None and not self.endpoint.startswith(("127.", "localhost:", "[::1]:")):
            log.warning("sending the token to %s without TLS: anyone on the path can read it (give the cluster's "
                        "CA: tls=, $MEMSERVER_TLS_CA or an endpoint file of a cluster started with --tls-cert)",
                        self.endpoint)
        self.timeout = timeout
        self.retry_seconds = retry_seconds
        wire = dtype_code(wire_dtype, VALUE_DTYPES, what="wire_dtype")
        check_wire_dtype(wire)  # the shards' rule: the client refuses it before any call
        self.opts = OpOptions(wire_dtype=wire, max_request_bytes=max_request_bytes)
        self.session = ClientSession(client_id or uuid.uuid4().hex)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._methods: dict[str, dict[str, Any]] = {}  # address -> its DataPlane methods (client.transport)
        self.shm = ShmTransport(shm_enabled(shm), self._channel)
        self._tables = TableMaps()
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop of its first call: its channels'

    # -- plumbing ------------------------------------------------------------------------

    def _on_its_loop(self) -> None:
        """Refuse a call from another event loop than the first one's (a second asyncio.run): the
        client's channels belong to that loop (it said "Event loop is closed"). A closed client
        says it is closed first, from any loop."""
        if self._closed:
            raise FailedPreconditionError(CLOSED)
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif loop is not self._loop:
            raise FailedPreconditionError("this AsyncMemoryClient was first used on another event loop (an earlier "
                                          "asyncio.run?): its connections belong to that loop; make one client per "
                                          "loop (`async with AsyncMemoryClient(...)` inside the coroutine asyncio.run "
                                          "runs)")

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            if self._closed:  # (a call after close opened channels no one closed)
                raise FailedPreconditionError(CLOSED)
            ch = self._channels[address] = aio_channel(address, token=self.token, tls=self.tls)
        return ch

    @property
    def client_id(self) -> str:
        return self.session.client_id

    def tags(self) -> WriteTags:
        """The tags of one new write call (see client.ops.WriteTags)."""
        return WriteTags(self.session)

    async def _control(self, method: str, request: Any) -> Any:
        self._on_its_loop()
        self._follow()
        stub = pb_grpc.ControlPlaneStub(self._channel(self.endpoint))
        try:
            return await getattr(stub, method)(request, timeout=self.timeout)
        except asyncio.CancelledError:
            # close() ended it (grpc.aio cancels its calls): said as the data calls say it, not as a
            # cancellation of a task no one cancelled (a hunt); a task cancelled by its caller stays so
            if self._closed and not _cancelling():
                raise _closed_mid_call(None) from None
            raise
        except grpc.aio.AioRpcError as err:
            if self._closed and err.code() == grpc.StatusCode.CANCELLED:
                raise _closed_mid_call(None) from None
            where = f"coordinator {self.endpoint}"
            # the coordinator of a cluster this host's endpoint file names, its address answered by
            # another server: it restarted on a new port, which `up` writes there within seconds
            # (_follow): asked again, as a coordinator restarting is (a write, not retried, fails)
            if self._home is not None and (said := other_server(err, "coordinator", f"ControlPlane/{method}")):
                raise UnavailableError(f"the address answers, but not as a memserver coordinator: {said}",
                                       target=where) from None
            details = err.details() or ""
            if err.code() == grpc.StatusCode.UNAVAILABLE and not tls_problem(details) and NOT_HTTP2 not in details \
                    and not details.startswith(SHARD_UNAVAILABLE) and any(w in details for w in NO_CONNECTION):
                # a stale endpoint file (not the coordinator's own UNAVAILABLE: a table being replaced)
                where += ("; is a memserver cluster running there (or is its coordinator restarting)? `memserver up` "
                          "starts one")
                if self.tls is None and "Socket closed" in details:  # what a plaintext client meets at a TLS server
                    where += "; or it serves TLS: give this client its CA ($MEMSERVER_TLS_CA)"
            elif err.code() == grpc.StatusCode.UNIMPLEMENTED:  # a shard's address, or another gRPC server's
                where += ("; not a memserver coordinator (a shard's address?), or an older one: give the "
                          "coordinator's HOST:PORT, which `memserver status` and the endpoint file name")
            raise from_rpc_error(err, where) from None

    def _follow(self) -> bool:
        """Whether the coordinator moved, and this client now calls it where it went: the endpoint
        file this client's cluster was read from (or named in) names the same `memserver up`'s
        coordinator at another address (Ray restarted it, its port taken meanwhile, and `up` wrote
        the new one, having asked the coordinator there). Asked before every coordinator call (one
        small file read; a client with no such file reads none), not after a failed one: a call is
        never sent twice, and a client idle through the move does not call whoever took the old
        port. A client given an address no file of this host names cannot follow."""
        if self._home is None or (moved := moved_to(*self._home)) is None:
            return False
        path = self._home[0]
        log.warning("the coordinator of this cluster moved from %s to %s (it restarted, its port taken meanwhile: the "
                    "endpoint file %s says so); calling it there", self.endpoint, moved["endpoint"], path)
        self.endpoint, self._home = moved["endpoint"], (path, moved)
        return True

    async def _read_control(self, method: str, request: Any) -> Any:
        """A read-only coordinator call, retried while the coordinator restarts."""
        return await self._retrying(lambda: self._control(method, request))

    async def _retrying(self, call: Callable[[], Awaitable[Any]], on_retry: Callable[[], Awaitable[None]] | None = None,
                        retry: bool = True, failed: float | None = None,
                        fresh_map: bool = False) -> Any:
        """call(), again with backoff (Backoff) for up to retry_seconds while it fails with
        UNAVAILABLE or DEADLINE_EXCEEDED (then `on_retry` first: a fresh shard map) or is refused
        by an overloaded server (OverloadedError: the same map; the server is there, only busy).

        `timeout` bounds each attempt, `retry_seconds` the retries: an attempt that outlived its
        deadline (a partitioned host, a lost one before Ray notices) is sent again, reads as
        they are and writes with the same tags, so a write that did land is answered from the
        shard's session, never applied twice. `retry` False: one attempt.

        The retries' window counts from the call's first failure (`failed`: when an attempt made
        before this failed, MemoryClient's first, made without this loop), so a first attempt that
        waited out its whole deadline on a host gone without a word still leaves retry_seconds to
        find the shard where it moved (memtrain's 60 s deadline and 60 s of retries, counted from
        the first attempt, left none: a walkthrough's power cut). A call fails after about
        retry_seconds + 3 x timeout (the map asked between attempts has its own deadline).
        `fresh_map`: that failure was UNAVAILABLE or DEADLINE_EXCEEDED, so the first attempt here
        follows a fresh map (`on_retry`), as any retry of those does (an overloaded server's
        refusal keeps the map)."""
        backoff: Backoff | None = None if failed is None else Backoff(self.retry_seconds if retry else 0.0, start=failed)
        if fresh_map and on_retry is not None:  # the shard may have moved: its old address waits out a deadline
            await on_retry()
        # a call's retries warn once per error text, again after RETRY_WARN_SECONDS (texts kept: RETRY_TEXTS)
        warned: dict[str, float] = {}
        while True:
            try:
                return await call()
            except (UnavailableError, DeadlineExceededError, OverloadedError) as exc:
                if not retried(exc):  # the same handshake, the same server again
                    raise
                stopped = stopped_since(*self._home) if self._home and isinstance(exc, UnavailableError) else None
                if stopped:  # not restarting: no retry will reach it
                    raise type(exc)(f"{exc.details}; {stopped}", target=exc.target) from None
                if backoff is None:
                    backoff = Backoff(self.retry_seconds if retry else 0.0)
                sleep = backoff.next()
                if sleep is None:
                    raise
                now, text = time.monotonic(), str(exc)
                if isinstance(exc, OverloadedError):
                    log.info("%s; retrying in %.2fs", exc, sleep)
                elif now - warned.get(text, -math.inf) >= RETRY_WARN_SECONDS:
                    log.warning("%s; retrying (for up to %.0fs more)", exc, backoff.deadline - now)
                    warned.pop(text, None)
                    warned[text] = now  # (newest last: the oldest text goes first)
                    if len(warned) > RETRY_TEXTS:
                        del warned[next(iter(warned))]
                else:
                    log.debug("%s; retrying in %.2fs", exc, sleep)
                await asyncio.sleep(sleep)
                if on_retry is not None and not isinstance(exc, OverloadedError):
                    await on_retry()

    async def _data(self, address: str, method: str, request: bytes, server: int | None = None) -> Any:
        """A call to the shard at `address` by gRPC; `server`: the shard server it is meant for
        (memserver.wire.shard_metadata: another one refuses it)."""
        methods = self._methods.get(address)
        if methods is None:
            methods = self._methods[address] = transport.methods(self._channel(address))
        try:
            return await methods[method](request, timeout=self.timeout, metadata=shard_metadata(server))
        except grpc.aio.AioRpcError as err:
            raise shard_error(err, address, method) from None

    async def _rung(self, rung: tuple[Any, int], method: str) -> Any:
        """A call sent by a shard's doorbell (client.doorbell): its answer, waited for off the loop
        in its bell's own threads (a shard that stalls holds none another shard's calls need). A
        cancelled call is forgotten by the attempt's `transport.forget`, which ends that wait."""
        bell = rung[0]
        try:
            waited = asyncio.get_running_loop().run_in_executor(bell.waits, transport.answer, rung, method, self.timeout)
        except RuntimeError:  # its bell closed since the call went (its pool refuses new waits)
            raise UnavailableError(f"doorbell: {bell.broken or 'closed'}", target=bell.target) from None
        out = await waited
        if isinstance(out, BaseException):
            raise out
        return out

    async def table(self, name: str, *, refresh: bool = False) -> TableMeta:
        """The table's metadata and shard map (cached; `refresh` asks the coordinator again)."""
        if self._closed:  # (the cached map answered after close, as no other call does)
            raise FailedPreconditionError(CLOSED)
        if refresh or name not in self._tables:
            info = await self._read_control("GetShardMap", pb.GetShardMapRequest(name=name))
            self._tables[name] = TableMeta.from_proto(info)
        else:
            self._tables.move_to_end(name)  # (recently used: the last to go)
        return self._tables[name]

    async def _with_table(self, name: str, fn: Callable[[TableMeta], Awaitable[Any]], tags: WriteTags | None = None,
                          retry: bool = True, failed: float | None = None, fresh_map: bool = False,
                          refused: tuple[TableNotFoundError | FailedPreconditionError, TableMeta] | None = None
                          ) -> Any:
        """Run fn(meta). If the shards no longer know the table, or hold another incarnation of it
        (dropped and re-created, restored), refresh the map and run it once more, with new write
        tags (the write never reached the new table). While a shard is UNAVAILABLE (restarting,
        maybe at a new address), retry with a fresh shard map; writes keep their tags then.
        `refused`: the caller's own first attempt was refused so, on that map (the sync client's):
        the map is checked before anything is sent again (it sent the call twice more)."""

        failing: set[int] = set()  # shards this call's attempts found UNAVAILABLE (by index)

        async def anew(exc: TableNotFoundError | FailedPreconditionError, old: TableMeta) -> Any:
            """The map `old` was refused: compared with a fresh one (or one another call refreshed
            meanwhile: it raised, or fetched the map twice), sent again if that explains it."""
            if self._closed:  # (close() ended the call: said by `exc`, not by a refused map)
                raise exc
            if self._tables.get(name) is old:
                del self._tables[name]
            meta = await self.table(name)
            if meta.layout_id != old.layout_id:
                self.session.forget_layouts(name, keep=meta.layout_id)  # the old incarnation's slices
                if tags is not None:  # a new incarnation: the write never reached it
                    tags.reset()
            elif isinstance(exc, FailedPreconditionError):
                raise exc  # the map was current: the refusal is about something else
            # else the same table (a shard that lost it): retry with the same tags, so a shard
            # that applied the first attempt answers it instead of applying it again
            return await fn(meta)

        async def attempt() -> Any:
            nonlocal refused
            if refused is not None:
                (exc, used), refused = refused, None
                return await anew(exc, used)
            meta = await self.table(name)
            try:
                return await fn(meta)
            except UnavailableError as exc:
                failing.update(sh.index for sh in meta.shards if exc.target == f"shard {sh.address}")
                raise
            except (TableNotFoundError, FailedPreconditionError) as exc:
                return await anew(exc, meta)

        restarts: dict[int, list[int]] = {}  # shard index -> its pids in the maps this call refreshed
        layout = 0

        async def refresh() -> None:
            nonlocal layout
            try:  # the coordinator may be restarting too, cut off, or busy (every client asks it for a map
                # after a shard's restart): then keep the map we have (an overload refusal ended the call)
                new = TableMeta.from_proto(await self._control("GetShardMap", pb.GetShardMapRequest(name=name)))
            except (UnavailableError, DeadlineExceededError, OverloadedError) as exc:
                log.info("table %s: no fresh shard map from the coordinator (%s): the call goes on with the one it has",
                         name, exc)
                return
            self._moved(self._tables.get(name), new)
            self._tables[name] = new
            if new.layout_id != layout:  # (another incarnation: its processes are counted afresh)
                layout = new.layout_id
                restarts.clear()
            for now in new.shards:  # (from the first fresh map: a restart while the client idled is not counted)
                pids = restarts.setdefault(now.index, [now.pid])
                if pids[-1] != now.pid:  # the shard's process restarted while this call was retried
                    pids.append(now.pid)
                    if now.index in failing and len(pids) > RESTARTS_PER_CALL + 1:
                        raise UnavailableError(
                            f"table {name}: shard {now.index} ({now.address}) restarted {len(pids) - 1} times while "
                            f"this call was retried (pid {' -> '.join(map(str, pids))}): the call may be what stops "
                            "it, so it is not sent again; the shard's log says why it exited, `memserver status` "
                            "whether it serves", target=f"shard {now.address}")

        return await self._retrying(attempt, refresh, retry, failed, fresh_map)

    def _moved(self, old: TableMeta | None, new: TableMeta) -> None:
        """A shard found at a new address (Ray restarted it on another host, or on another port)
        moved for every table: the other tables' maps naming its old address (gone, or another
        shard server's now) are forgotten, so their next calls ask the
        coordinator where it is, instead of each waiting out a deadline at the old address first
        (a walkthrough's client of 6 tables paid 2 deadlines per table after the shard served)."""
        if old is None:
            return
        now = new.servers  # an address gone, or now another shard server's (two shards that swapped ports)

        def stale(a: str, server: int | None) -> bool:
            return a not in now or now[a] != server

        if any(stale(a, server) for a, server in old.servers.items()):
            for other, meta in list(self._tables.items()):
                if other != new.name and any(a in old.servers and stale(a, server) for a, server in meta.servers.items()):
                    del self._tables[other]

    async def _call(self, table: str, make_op: Callable[[TableMeta], Op], tags: WriteTags | None = None,
                    retry: bool = True, applies: str = "") -> Any:
        """Run the op for `table`'s shard map: its requests all at once over grpc.aio. `applies`: a
        write each shard applies on its own (not a step's part), AppliedBy.TWICE or SAME: when it
        fails for good after some shards answered, the error says which (AppliedBy)."""
        self._on_its_loop()
        first = True
        counted: set[tuple[str, int, int]] = set()  # reads a shard answered: not counted again on a retry
        applied = AppliedBy(applies) if applies else None

        async def run(meta: TableMeta) -> Any:
            nonlocal first
            if applied is not None:
                applied.begin(meta)
            if tags is not None:
                tags.begin_attempt(first)
                first = False
            if self.shm.loop is None:
                self.shm.loop = asyncio.get_running_loop()
            for again in (True, False):  # once more if a shard had lost its shared-memory region
                op = make_op(meta)
                calls = transport.recount(next(op), counted)
                sent = transport.prepare(calls, self.shm, meta.servers)
                outcomes: list[Any] = [None] * len(calls)
                rung: list[Any] = []
                try:  # every call to its end (each has a deadline): a shared-memory block is freed only then
                    rung = transport.ring(calls, sent, self.shm, self.timeout, meta.servers, block=False)  # (on the loop)
                    outcomes = await asyncio.gather(*(self._data(a, m, raw, meta.servers.get(a)) if r is None
                                                      else self._rung(r, m)
                                                      for (a, m, _), (raw, _), r in zip(calls, sent, rung)),
                                                    return_exceptions=True)
                    transport.note_counted(calls, outcomes, counted)
                    if again and transport.stale(sent, outcomes):
                        continue
                    if self._closed:  # close() ended these calls (the caller cancelled none): said as such
                        outcomes = [_closed_mid_call(tags) if ended_by_close(o) else o for o in outcomes]
                    errors = [o for o in outcomes if isinstance(o, BaseException)]
                    if errors:
                        if applied is not None:
                            applied.note(meta, calls, outcomes)
                        raise raised(errors, tags is not None and not self._closed)  # (closed: no retry reaches it)
                    if tags is not None:
                        self.session.answered(meta, [a for a, _, _ in calls], outcomes)
                    # before the blocks are released: shared-memory answers are views of them
                    return finish(op, transport.receive(sent, outcomes))
                finally:
                    transport.forget(rung, outcomes)
                    transport.release(sent, outcomes)
            raise AssertionError("unreachable")

        try:
            return await self._with_table(table, run, tags, retry)
        except MemserverError as exc:
            if (said := as_the_write(exc, tags)) is not exc:
                raise said from None
            if applied is not None:
                applied.say(exc)
            raise
        finally:
            if tags is not None:
                tags.close()

    async def close(self) -> None:
        """Detach the shared-memory regions and close the channels; returns once gRPC has ended
        every call of this client (memserver.loop.settle_grpc), so the loop may close at once.
        Later calls are refused (FAILED_PRECONDITION): no new channel opens from here on."""
        self._closed = True
        await self.shm.close()
        await asyncio.gather(*(ch.close() for ch in self._channels.values()))
        self._channels.clear()
        self._methods.clear()
        await settle_grpc()

    def __getstate__(self) -> dict[str, Any]:
        """Refused by name (it said "cannot pickle '_thread.lock' object"): a dataset holding a
        client, sent to spawned DataLoader workers, is pickled."""
        raise TypeError(NOT_PICKLED.format(type(self).__name__))

    async def __aenter__(self) -> AsyncMemoryClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- control plane -------------------------------------------------------------------

    async def create_table(
        self,
        name: str,
        num_rows: int,
        dim: int,
        *,
        sharding: str | None = None,
        optimizer: str = "adagrad",
        lr: float = 0.01,
        dtype: str = "float32",
        init_std: float = 0.02,
        seed: int = 0,
        num_shards: int = 0,
        eps: float | None = None,
        betas: tuple[float, float] = (0.9, 0.999),
        sync_workers: int = 0,
        wal: bool = False,
        tier: str = "ram",
        cache_bytes: int = 0,
        replace: bool = False,
    ) -> TableMeta:
        """Create a value table. `sharding` is "rows" or "cols" (None: the server's default).
        `replace`: a value table of that name is dropped and this one made instead, once the
        coordinator has accepted the spec (a bad spec leaves the old table as it was); else, or
        where the name is another kind's table, TableExistsError.
        `tier` "disk": the rows and their optimizer state live in files on the shards under a RAM
        cache of `cache_bytes` for the whole table (split over its shards; float32 only; 0: 1/8 of
        the table's records).
        `sync_workers` > 0 makes it a sync_updates table for that many data-parallel trainers.
        `wal`: log every write before acknowledging it, so a restarted shard loses none (see
        docs/architecture.md for what it costs); without it a restart returns the table to its
        latest checkpoint. `eps` None: the optimizer's default (0 is a value, as is a beta of 0:
        with eps 0, adagrad and adam turn a row whose gradient is all zero into NaN, as torch.optim
        does; a float32 table stores what its steps make, inf and NaN included, uncounted: only
        float16 tables count non-finite updates, `nonfinite_updates` in status)."""
        spec = value_table_spec(name, num_rows, dim, sharding=sharding, optimizer=optimizer, lr=lr, dtype=dtype,
                                init_std=init_std, seed=seed, num_shards=num_shards, eps=eps, betas=betas,
                                sync_workers=sync_workers, wal=wal, tier=tier, cache_bytes=cache_bytes)
        return await self._create(spec, replace)

    async def _create(self, spec: pb.TableSpec, replace: bool) -> TableMeta:
        """Every kind's create: the coordinator checks the spec, places and makes the slices."""
        info = await self._control("CreateTable", pb.CreateTableRequest(spec=spec, replace=replace))
        meta = self._tables[spec.name] = TableMeta.from_proto(info)
        self.session.forget_table(spec.name)  # a namesake's steps are not this table's
        return meta

    async def create_index(self, name: str, dim: int, *, index_factory: str = "Flat", metric: str = "ip",
                           payload_dim: int = 0, num_shards: int = 0, wal: bool = False,
                           replace: bool = False) -> TableMeta:
        """Create an index table: a faiss `index_factory` index ("Flat", "IVF1024,Flat",
        "IVF1024,PQ16", "HNSW32", ...) of `dim`-float vectors under your int64 ids, sharded by id,
        compared by `metric` ("ip": inner product, larger is better; "l2": squared distance), with
        `payload_dim` floats per id returned with hits. Trained kinds need `train_index` before `add`.
        `replace`: as for create_table (an index table of that name is dropped once the spec is
        accepted; another kind's is refused, TableExistsError)."""
        if metric not in METRICS:
            raise InvalidArgumentError(f"metric: expected 'ip' or 'l2', got {metric!r}")
        check_ints(INT64, dim=dim, payload_dim=payload_dim)
        check_ints(INT32, num_shards=num_shards)
        spec = pb.TableSpec(name=name, kind=pb.INDEX, dim=dim, index_factory=index_factory, metric=METRICS[metric],
                            payload_dim=payload_dim, num_shards=num_shards, wal=wal)
        return await self._create(spec, replace)

    async def train_index(self, name: str, sample: Any) -> dict[str, Any]:
        """Train the index's quantizer or codebooks ONCE on `sample` [m, dim] and install the result
        on every shard (the sharded index then equals one unsharded index trained the same way).
        Only an empty index can be trained. Returns {sample_rows, seconds}."""
        t = as_tensor(sample)
        if not t.dtype.is_floating_point:
            raise InvalidArgumentError(f"sample: dtype must be floating point, got {str(t.dtype).removeprefix('torch.')}")
        if t.dim() == 2 and t.shape[0] > (most := train_sample_limit(t.shape[1])):
            raise InvalidArgumentError(f"sample: {t.shape[0]:,} rows of {t.shape[1]} floats do not fit one request "
                                       f"({MAX_MESSAGE_BYTES >> 20} MiB); train on at most {most:,} rows (a random "
                                       "subset of the vectors)")
        check_float(t.detach().cpu(), "sample")  # (before the conversion: as add and search check theirs)
        r = await self._control("TrainIndex", pb.TrainIndexRequest(name=name, sample=encode(t.detach().cpu().float())))
        return {"sample_rows": r.sample_rows, "seconds": r.seconds}

    async def add(self, table: str, ids: Any, vectors: Any, payload: Any = None) -> int:
        """Upsert vectors [n, dim] (and payload rows [n, payload_dim]) under distinct int64 ids;
        an id that exists is replaced. Returns how many were added."""
        tags = self.tags()
        return await self._call(table, lambda meta: ops.add_op(meta, ids, vectors, payload, self.opts, tags), tags,
                                applies=AppliedBy.SAME)

    async def remove(self, table: str, ids: Any) -> int:
        """Remove ids from an index table (absent ones are ignored); returns how many were present."""
        tags = self.tags()
        return await self._call(table, lambda meta: ops.remove_op(meta, ids, self.opts, tags), tags,
                                applies=AppliedBy.SAME)

    async def search(self, table: str, queries: Any, k: int, *, nprobe: int | None = None, ef_search: int | None = None,
                     return_payload: bool = False) -> tuple[Any, ...]:
        """The k best hits of each query [B, dim] over every shard: (scores [B, k], ids [B, k]) and,
        with `return_payload`, payload [B, k, payload_dim]. A missing hit is id -1 (score -inf for
        ip, +inf for l2). `nprobe` (IVF) and `ef_search` (HNSW) apply to this call only."""
        s, i, p = await self._call(table, lambda meta: ops.search_op(meta, queries, k, nprobe, ef_search, return_payload,
                                                                     self.opts))
        out = (like(s, queries), like(i, queries))
        return (*out, like(p, queries)) if return_payload else out

    async def create_product_keys(self, name: str, values_table: str, heads: int, n_keys: int, knn: int, k_dim: int,
                                  d_in: int = 0, *, wal: bool = False, replace: bool = False) -> TableMeta:
        """Create a product-key table: the frozen addressing of a trained product-key memory layer
        (`heads` heads of `knn` slots over `n_keys`^2 slots, queries of `k_dim` per head). `d_in` > 0:
        it stores the layer's query network and `address` takes inputs [B, d_in]; 0: `address`
        takes the queries. `values_table` must be a value table of `n_keys`^2 rows (its slots'
        values, read by `pkm_lookup`). Load it with `load_product_keys`. One shard. `replace`: as
        for create_table."""
        check_ints(INT32, heads=heads, n_keys=n_keys, knn=knn, k_dim=k_dim, d_in=d_in)
        values = await self.table(values_table, refresh=True)
        if values.kind != "value":
            raise InvalidArgumentError(f"values_table: {values_table!r} is {values.a_kind}, not a value table")
        if values.num_rows != n_keys * n_keys:
            raise InvalidArgumentError(f"values_table: {values_table!r} has {values.num_rows} rows, n_keys^2 = {n_keys * n_keys}")
        spec = pb.TableSpec(name=name, kind=pb.PRODUCT_KEYS, pkm_heads=heads, pkm_n_keys=n_keys, pkm_knn=knn,
                            pkm_k_dim=k_dim, pkm_d_in=d_in, values_table=values_table, wal=wal)
        return await self._create(spec, replace)

    async def load_product_keys(self, name: str, keys: Any, query_weight: Any = None, query_bias: Any = None,
                                bn: dict[str, Any] | None = None) -> int:
        """Install a product-key table's sub-keys [heads, 2, n_keys, k_dim/2] and, when it was
        created with d_in, its query Linear (weight [heads*k_dim, d_in], bias) and optional
        BatchNorm applied in eval mode (`bn`: running_mean, running_var, weight, bias, eps).
        Replaces what was loaded; returns the number of sub-keys."""
        tags = self.tags()
        return await self._call(name, lambda meta: ops.load_product_keys_op(meta, keys, query_weight, query_bias, bn,
                                                                            tags), tags)

    async def address(self, name: str, queries: Any) -> tuple[Any, Any]:
        """Product-key addressing: (ids [B, heads*knn] int64 slot ids, weights [B, heads*knn]),
        each head's knn best slots and their softmax weights (see AddressRequest)."""
        ids, w = await self._call(name, lambda meta: ops.address_op(meta, queries, self.opts))
        return like(ids, queries), like(w, queries)

    async def pkm_lookup(self, name: str, queries: Any, *, count: bool = True) -> tuple[Any, Any, Any]:
        """`address`, then the weighted bag of the slots' values on the value table's shards:
        (ids, weights, bag [B, dim]), what the trained layer reads (before any Memory+ projection).
        A served read counts in the value table's slot statistics as a training read does; `count`
        False: it does not (an evaluation's, or a check of the layer's, as the eval-mode layer reads)."""
        ids, w = await self._call(name, lambda meta: ops.address_op(meta, queries, self.opts))
        keys = await self.table(name)
        out = await self._call(keys.values_table, lambda meta: ops.bag_op(ops.slots_table(keys, meta), ids, w, None,
                                                                           self.opts, count))
        return like(ids, queries), like(w, queries), like(out, queries)

    async def drop_table(self, name: str) -> None:
        """Drop the table from every shard: its rows, optimizer state, statistics and files (its
        write-ahead log, a disk table's files; checkpoints stay). TableNotFoundError if it is not there."""
        self._tables.pop(name, None)
        await self._control("DropTable", pb.DropTableRequest(name=name))
        self.session.forget_table(name)

    async def list_tables(self) -> list[TableMeta]:
        """Every table of the cluster (value, index and product-key tables), with its shard map."""
        resp = await self._read_control("ListTables", pb.ListTablesRequest())
        return [TableMeta.from_proto(t) for t in resp.tables]

    async def status(self) -> pb.StatusResponse:
        """The cluster's state as `memserver status` shows it: tables, and per shard its address,
        process, state, the tables it holds (rows, bytes, what each was recovered from, a disk
        table's cache), the calls it answered; memserver.cli.tables.status_dict makes it a dict."""
        return await self._read_control("Status", pb.StatusRequest())

    async def checkpoint(self, dir: str, step: int = 0, tables: list[str] | None = None) -> dict[str, Any]:
        """Make every shard write its slices as of now (call it at a step barrier); returns
        {path, step, bytes, tables, seconds}. Retried like a data-plane call (a shard restarting,
        an attempt past its deadline while a host is cut off, an overloaded coordinator): writing
        the same step again replaces each slice file and its record entry, then the manifest, so
        a trainer checkpoints through a lost host or a partition. `step` 0: one past the last step
        in `dir` (1 in a new one), never replacing an earlier checkpoint (a retry of such a call
        writes the same step: its retries carry the call's request_id)."""
        check_ints(INT64, step=step)
        request = pb.CheckpointRequest(dir=str(dir), step=step, tables=tables or [], request_id=uuid.uuid4().hex)
        r = await self._retrying(lambda: self._control("Checkpoint", request))
        self.session.saw_checkpoint(r.rebuilt)  # a rollback after this client's last write shows first here
        return {"path": r.path, "step": r.step, "bytes": r.bytes, "tables": list(r.tables), "seconds": r.seconds}

    async def check_checkpoint_dir(self, dir: str) -> str:
        """Whether the cluster would checkpoint to `dir` (its checkpoint root, the one rule of
        memserver.storage.checkpoint.under_root): the directory it resolves to, or
        PermissionDeniedError. Writes nothing."""
        request = pb.CheckpointRequest(dir=str(dir), dry_run=True)
        return (await self._retrying(lambda: self._control("Checkpoint", request))).path

    async def restore(self, dir: str, step: int = 0, *, replace: bool = False, num_shards: int = 0,
                      tables: list[str] | None = None, tier: str = "", cache_bytes: int = 0,
                      wal: bool | None = None) -> Restored:
        """Load tables from a checkpoint (when step is 0: the latest complete one; given `tables`,
        the latest that holds them; the answer's `.step` and `.path` say which), optionally
        into a different number of shards, and the value tables into another `tier` ("ram" or
        "disk": a table that outgrew its shards' memory) or `cache_bytes` ("" and 0: as saved);
        `wal` True/False: the tables log their writes or not (None: as saved). `replace`: live
        tables of those names, each of its checkpoint's kind, are dropped first (else, or where one
        is another kind's, TableExistsError, and nothing is dropped)."""
        check_ints(INT64, step=step, cache_bytes=cache_bytes)
        check_ints(INT32, num_shards=num_shards)
        if wal is not None and not isinstance(wal, bool):
            raise InvalidArgumentError(f"wal: True, False or None (as saved), got {wal!r}")
        r = await self._control("Restore", pb.RestoreRequest(dir=str(dir), step=step, replace=replace,
                                                             num_shards=num_shards, tables=tables or [], tier=tier,
                                                             cache_bytes=cache_bytes, wal=wal))
        metas = [TableMeta.from_proto(t) for t in r.tables]
        for m in metas:
            self._tables[m.name] = m
            self.session.forget_table(m.name)
        if tier and (other := [m.name for m in metas if m.kind == "value" and (m.tier or "ram") != tier]):
            raise FailedPreconditionError(f"tier: the cluster restored {other} but not as tier {tier!r}: its coordinator "
                                          "predates restore's tier (upgrade it)")
        if wal is not None and (other := [m.name for m in metas if m.wal != wal]):
            raise FailedPreconditionError(f"wal: the cluster restored {other} but not with wal={wal}: its coordinator "
                                          "predates restore's wal (upgrade it)")
        return Restored(metas, r.path, r.step)

    # -- data plane (the ops are client.ops'; see there for what each computes) ----------

    async def lookup(self, table: str, ids: Any, *, count: bool = True) -> Any:
        """Rows of `ids` (any shape) -> float32 array of shape ids.shape + (dim,). `count` False:
        an inspection read, not counted in the slots' hits."""
        return like(await self._call(table, lambda meta: ops.lookup_op(meta, ids, self.opts, count)), ids)

    async def bag(self, table: str, ids: Any, weights: Any, offsets: Any = None, *, count: bool = True) -> Any:
        """Weighted bags: out[b] = sum_j weights[b, j] * v[ids[b, j]] -> [B, dim] float32.

        ids/weights are [B, k], or 1-D with `offsets` [B] marking where each bag starts. `count`
        False: not counted in the slots' hits and weight mass (an evaluation's or inspection's read).
        """
        return like(await self._call(table, lambda meta: ops.bag_op(meta, ids, weights, offsets, self.opts, count)),
                    weights)

    async def bag_backward(self, table: str, ids: Any, weights: Any, grad_out: Any, offsets: Any = None, *,
                           defer_apply: bool = False, step: int = 0, gather: bool = False,
                           weight_grad: bool = True, layout: int = 0) -> Any:
        """Backward of `bag`: returns dL/dweights (shape of ids) and makes the shards apply
        weights * grad_out to the rows through the table's optimizer (exactly once).

        `defer_apply`: the shards answer before applying the update (they apply it before serving
        anything else), so the caller overlaps it with its next step; see docs/architecture.md.
        `step`: the trainer's step, which sync_updates tables use to gather all trainers' pushes.
        `gather`: this call is one part of `step`; dL/dw is computed on the values before the step
        and the update waits for `commit_step`, so any number of parts make one optimizer step.
        Without it, a call larger than `max_request_bytes` goes in several requests, each applied
        on its own: several optimizer steps, each later request's dL/dw on the values the earlier
        ones updated (gather it for one step); on a sync_updates table, where a call is the
        trainer's whole contribution, such a call is refused (InvalidArgumentError, nothing sent).
        `weight_grad` False (the caller does not use dL/dweights): the shards skip it; returns None.
        `layout` (not 0): the incarnation of the table (`table(name).layout_id`) the caller trains;
        FailedPreconditionError, and nothing sent, if the table was made anew since (a retry would
        otherwise follow the name to the new table and apply the update to another run's rows).
        A part's place in its step is taken when its coroutine starts, before it awaits anything:
        parts apply in the order their calls began (tasks in the order they first run; a direct
        await at once, so before tasks created earlier that have not run yet)."""
        return await self._bag_backward(self._backward_tags(table, ids, offsets, grad_out), table, ids, weights, grad_out,
                                        offsets, defer_apply=defer_apply, step=step, gather=gather,
                                        weight_grad=weight_grad, layout=layout)

    def _backward_tags(self, table: str, ids: Any, offsets: Any, grad_out: Any) -> WriteTags:
        """The write tags of a bag_backward call, its seqs taken now (WriteTags.reserve)."""
        return self.tags().reserve(table, ops.backward_requests(ids, offsets, grad_out, self.opts))

    async def _bag_backward(self, tags: WriteTags, table: str, ids: Any, weights: Any, grad_out: Any, offsets: Any,
                            *, defer_apply: bool, step: int, gather: bool, weight_grad: bool, layout: int) -> Any:
        try:  # (the seqs taken ahead are released however it ends: _call's own end, or a refusal before it)
            parts = self.session.step_parts(table, step) if gather else None
            op = lambda meta: ops.bag_backward_op(meta, ids, weights, grad_out, offsets, self.opts, tags, defer_apply,  # noqa: E731
                                                  step, parts, weight_grad, layout)
            grad_w = await self._call(table, op, tags, applies=AppliedBy.backward(gather, step))
        finally:
            tags.close()
        return None if grad_w is None else like(grad_w, weights)

    async def commit_step(self, table: str, step: int, *, defer_apply: bool = False, drop: bool = False,
                          layout: int = 0) -> int:
        """Apply this client's `gather` parts of `step` as one optimizer step (a sync_updates table:
        once every trainer committed, their mean), on every shard of the table or on none: two
        phases, PREPARE then COMMIT or ABORT (client.ops.commit_step_plan; one call on a table of
        one shard). Raises StepAbortedError, naming the shard, when a shard lacks a part it
        acknowledged: nothing of the step is applied anywhere. Returns the rows updated now.
        `drop`: this client met a non-finite gradient in the step (a GradScaler skips it): its parts
        are dropped, and a sync_updates table drops the whole step, every trainer's contribution.
        `layout` (not 0): the incarnation the caller trains; a table made anew since is
        FailedPreconditionError, the step not committed there (by default it is, with none of this
        client's parts, so a sync table's other trainers do not wait for it)."""
        plan = ops.commit_step_plan(self.session, table, step, len((await self.table(table)).shards), defer_apply, drop,
                                    layout)
        try:  # interrupted anywhere (a call out, or between calls): what the step needs is kept, not dropped
            make, tags, retry = next(plan)
            while True:
                try:
                    got: Any = await self._call(table, make, tags, retry=retry)
                except MemserverError as exc:  # the plan decides (abort, keep a decision to re-send)
                    got = exc
                try:
                    make, tags, retry = plan.send(got)
                except StopIteration as done:
                    return done.value
        except BaseException as exc:  # cancelled (the plan's own errors end it: nothing more to settle then)
            ops.settle_interrupted(plan, exc)
            raise

    async def drop_open_steps(self, table: str) -> dict[str, int]:
        """Drop every open step of `table` on its shards, every client's parts and commits: the
        remedy for a sync_updates table whose step waits for a trainer that is gone (`memserver
        status` warns of it), short of dropping the table. Nothing of those steps applies; a live
        client that commits one later is refused (its parts are gone). Stop the trainers first: a
        contribution prepared on a shard whose decision has not come is committed first, as its
        session's expiry would. Returns {"dropped": the most open steps one shard dropped,
        "committed": the most contributions one shard committed so}."""
        tags = self.tags()
        return await self._call(table, lambda meta: ops.drop_open_steps_op(meta, tags), tags, applies=DROPS_AGAIN)

    def abandon_step(self, table: str, step: int) -> int:
        """Forget the `gather` parts of `step` this client sent so far (a step that failed before
        its commit): the step's next commit lists only parts sent after this, and each shard drops
        the others when it prepares. Nothing is sent. Returns how many parts were forgotten (one
        per call, however many shards it reached)."""
        return self.session.forget_step(table, step)

    def rebuilds(self, table: str) -> tuple[int, str]:
        """How many times slices of `table` this client had written to came back from their files
        without their log (a table without `wal` whose shard restarted, or a sibling rolled back with
        it: writes acknowledged to this client were lost), and the latest as text ("" none). Seen
        on write answers and checkpoints (each is also logged as a warning); it only grows: a
        trainer compares it across its steps (trainer.memory.RemoteValues)."""
        return self.session.rebuilds(table)

    async def push_gradients(self, table: str, ids: Any, grads: Any) -> int:
        """Apply row gradients through the table's optimizer; duplicate ids are summed first.
        Returns the number of distinct rows updated."""
        tags = self.tags()
        return await self._call(table, lambda meta: ops.push_op(meta, ids, grads, self.opts, tags), tags,
                                applies=AppliedBy.TWICE)

    async def write_rows(self, table: str, ids: Any, rows: Any) -> int:
        """Overwrite rows (optimizer state is kept). Ids must be distinct."""
        tags = self.tags()
        return await self._call(table, lambda meta: ops.write_rows_op(meta, ids, rows, self.opts, tags), tags,
                                applies=AppliedBy.SAME)

    async def _plan(self, table: str, plan: ops.Plan) -> Any:
        """Run a plan's ops one after another (see ops.Plan)."""
        try:
            make = next(plan)
            while True:
                make = plan.send(await self._call(table, make))
        except StopIteration as done:
            return done.value

    async def record_triggers(self, table: str, ids: Any, weights: Any, positions: Any, contexts: Any, next_tokens: Any,
                              info: str = "") -> dict[str, int]:
        """Trigger records for the slots' top-contexts heaps (see ops.record_triggers_op);
        idempotent. Returns {"slots", "dropped"} summed over the shards."""
        return await self._call(table, lambda meta: ops.record_triggers_op(meta, ids, weights, positions, contexts,
                                                                           next_tokens, info, self.opts))

    async def triggers(self, table: str, ids: Any) -> dict[str, Any]:
        """Each slot's trigger records: weights [n, C], contexts [n, C, L], next [n, C], info (dict)."""
        out = await self._call(table, lambda meta: ops.triggers_op(meta, ids))
        return {k: v if k == "info" else like(v, ids) for k, v in out.items()}

    async def top_slots(self, table: str, by: str = "hits", n: int = 20, coldest: bool = False) -> tuple[Any, Any]:
        """The n hottest (coldest) slots by "hits", "mass", "updates" or "norm": (ids, values)
        numpy arrays, best first, ties by the smaller id."""
        ids, values = await self._plan(table, ops.top_slots_plan(by, n, coldest))
        return ids.numpy(), values.numpy()

    async def usage(self, table: str) -> TableUsage:
        """How the table's slots are used (memserver.api.usage): histograms; `.metrics()`."""
        return TableUsage(**await self._call(table, ops.usage_op))

    async def warm(self, table: str, ids: Any) -> int:
        """A hint that `ids` will be read soon: a disk table's shards read the pages of the rows
        their caches do not hold ahead, while the caller goes on, so the read (exact as ever)
        does not wait on the device. Changes nothing; a RAM table is sent nothing. Returns the
        rows handed to the shards' read-ahead threads, summed over them (a cols table's row is
        handed to each of its shards: counted once per shard)."""
        return await self._call(table, lambda meta: ops.warm_op(meta, ids, self.opts))

    async def slot_stats(self, table: str, ids: Any) -> dict[str, Any]:
        """Per-slot statistics: hits, weight_mass, updates, last_update (unix s), value_norm."""
        stats = await self._call(table, lambda meta: ops.slot_stats_op(meta, ids))
        return {k: like(v, ids) for k, v in stats.items()}
