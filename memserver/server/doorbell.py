"""A shard's doorbell: data-plane calls from clients on its own machine without gRPC
(client.doorbell is the other side; docs/architecture.md "The doorbell").

A client that has attached a shared-memory region (memserver.server.shm) learns, in the attach's
answer, the name of this shard's doorbell: an abstract Unix stream socket (no file anywhere; it
goes with the process). It connects and says hello with the region's id, the 128-bit secret only
it learnt through its token-checked AttachRegion call, and the shard checks that the peer the
kernel reports (SO_PEERCRED) is the process that attached the region. From then on the client
sends any DataPlane call but AttachRegion as one frame, the call's request message whose tensors
are spans of the region (or inline, for small ones), and one serving thread per connection, not
the asyncio loop, reads it, runs the call's plan (DataPlaneServicer.serve_steps: the same checks
and kernels as gRPC's handler, the compiled kernels releasing the GIL), writes the answer's
tensors into the region and sends back a frame that says where. No HTTP/2, no grpc.aio, no event
loop hop per call. A call that must wait (its table's checkpoint file being written, its write's
log not on disk yet) is parked (`_Parked`): the connection's third thread finishes and answers it
once its wait is over, and the serving thread goes on with the connection's later calls (a
client has one connection per shard for all its threads: a write waiting for a checkpoint held
them all, other tables' too, where over gRPC they went on). So calls in flight together on one
connection may be answered, and a parked write applied, after later ones, as over gRPC; the
client matches answers by call id.

Every guarantee of the gRPC path holds: the calls run with the role of the token the region was
attached with (the read token's region takes reads only); each call is admitted by the server's
Admission (the same limits and refusals); writes carry their tags (exactly once) and are
answered once logged durably; stale layouts are refused; a call carries its deadline, and one
that cannot start before it is refused with nothing done (the client abandons its block at the
deadline either way); every call is counted in the server's metrics, and errors get their
statuses from the one table (memserver.server.grpcserver.status_of).

Frames (little-endian): a request is `HEAD` (body length, call id, deadline as the machine's
monotonic clock in seconds, 0: none, method name length) then the method's name and the
request's bytes; an answer is `REPLY` (body length, call id, status code) then the answer's bytes
(OK) or the status text. The hello is a request of method HELLO whose body is the region id. A
request body is at most MAX_REQUEST_BYTES (the client sends larger calls by gRPC); a connection
that breaks the protocol is closed.

Answers are sent by the serving thread itself when the socket takes the whole frame at once, else
by a writer thread per connection, from a queue of at most MAX_QUEUED (`_Answers`), so the
serving thread keeps reading requests while an answer waits for the client to read: neither side
can block sending to the other for good (an answer may be large: inline tensors).

Bounds: at most MAX_CONNECTIONS connections in all (room for one per attachable region,
MAX_REGIONS, plus MAX_HELLOS; a region may have more: a client reconnecting), of which at most
MAX_HELLOS still saying hello, each within HELLO_SECONDS in all; each has two threads, and a
third from its first parked call until it ends (at most MAX_PARKED parked at once: the serving thread waits past that;
each still admitted, its region leased, until it ends). A
connection ends when its region is detached (the client's AttachRegion stream ended), when the
client closes it or dies, or when the shard stops, and is then forgotten (its parked calls end
CANCELLED, nothing more done: a write that waited for its checkpoint is not applied, and the
client sends it again with its tag). Nothing is left behind: the socket has no file, its threads
are daemons.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as futures_wait
from typing import Any

import grpc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from memserver.api.auth import READ_METHODS
from memserver.api.errors import InvalidArgumentError, PermissionDeniedError, UnavailableError
from memserver.core.table import set_threads
from memserver.server.admission import Admission
from memserver.server.dataplane import Wait, finish
from memserver.server.grpcserver import DATA_PLANE, CallMetrics, parse_request, request_parser, status_of
from memserver.server.shm import MAX_REGIONS, Attached, Regions
from memserver.wire import DOORBELL_HEAD as HEAD
from memserver.wire import DOORBELL_HELLO as HELLO
from memserver.wire import DOORBELL_MAX_REQUEST as MAX_REQUEST_BYTES
from memserver.wire import DOORBELL_REPLY as REPLY
from memserver.wire import check_enums, peer_pid, recv_exact, to_bytes

log = logging.getLogger(__name__)

Bytes = bytes | memoryview
_HELLO = HELLO.encode()

#: Connections still saying hello at once, and connections in all (room for one per attachable region more).
MAX_HELLOS = 8
MAX_CONNECTIONS = MAX_REGIONS + MAX_HELLOS
#: Connections of one region at once (a client holds one; room for its next while the last ends):
#: one process could otherwise take every connection and leave the other clients to gRPC.
MAX_CONNECTIONS_PER_REGION = 4
#: Seconds a new connection has to say its whole hello.
HELLO_SECONDS = 2.0
#: Answers of one connection waiting for the client to read them (the client has at most
#: client.doorbell.MAX_OUTSTANDING calls in flight, so this is never reached by a client of ours).
MAX_QUEUED = 64
#: Calls of one connection parked at once (`_Parked`: waiting for their table's checkpoint file or
#: their write's log); past it the serving thread waits for one to end (the client has at most
#: client.doorbell.MAX_OUTSTANDING calls in flight, so this is never reached by a client of ours).
MAX_PARKED = 32
#: Seconds a connection's end waits for its writer thread to send the answers still queued (a
#: client reading them slowly), before they are dropped and the socket is shut down.
WRITER_GRACE = 10.0



def _join(attached: Attached, conn: socket.socket) -> bool:
    """Count a connection among its region's (shut down when the region is detached), unless the
    region has MAX_CONNECTIONS_PER_REGION already: counted and checked at once, since hellos
    checked before any was counted let 7 connections past a limit of 4 (a review)."""
    with attached.lock:
        if len(attached.doorbells) >= MAX_CONNECTIONS_PER_REGION:  # (one detached since: _serve ends it)
            return False
        attached.doorbells.add(conn)
        return True


def _frame(call_id: int, code: grpc.StatusCode, body: Bytes) -> list[memoryview]:
    """An answer's frame: its head and its body as they are (a large inline answer is not copied)."""
    return [memoryview(REPLY.pack(len(body), call_id, code.value[0])), memoryview(body)]


def _send(sock: socket.socket, parts: list[memoryview], wait: bool = True) -> list[memoryview]:
    """Send the parts of a frame; what is left unsent ([] when all went): all of it when `wait`,
    else what the socket's buffer takes now (the rest to send later, first)."""
    while parts:
        try:
            sent = sock.sendmsg(parts) if wait else sock.sendmsg(parts, [], socket.MSG_DONTWAIT)
        except BlockingIOError:
            return parts
        while parts and sent >= len(parts[0]):
            sent -= len(parts.pop(0))
        if parts:
            parts[0] = parts[0][sent:]
    return parts


def _reply(sock: socket.socket, call_id: int, code: grpc.StatusCode, body: bytes) -> None:
    """Send an answer's whole frame (the hello's)."""
    _send(sock, _frame(call_id, code, body))


class _Answers:
    """A connection's answers, in whole frames. The serving thread sends an answer itself when the
    socket's buffer takes the whole frame at once (the common case: no hop to another thread on a
    call's path); what does not fit goes to the connection's writer thread, first in its queue,
    and the answers after it wait there too, so the serving thread never blocks sending and goes
    on reading requests while the client reads a large answer: neither side can block the other
    for good. One sender at a time (`busy`), so frames never interleave.

    Bounds: at most MAX_QUEUED frames wait for the writer (the serving thread waits past that,
    before it sends its own answer and before it reads the next request: `room`), plus the answers
    of parked calls (`_Parked`: at most MAX_PARKED, never waiting: their thread serves the others). The serving thread and the parked calls' thread add answers; only the
    writer takes them, and only while no one else sends (it took a frame queued while the serving
    thread sent another, when only that thread added). `queued` is called for each answer that
    waits for the writer (a client slow to read: memserver_doorbell_answers_queued)."""

    def __init__(self, conn: socket.socket, queued: Callable[[], None]) -> None:
        self.conn, self.queued = conn, queued
        self.cond = threading.Condition()
        self.queue: deque[list[memoryview]] = deque()
        self.busy = False  # someone is sending a frame: the serving thread (now) or the writer
        self.closed = False  # no more answers: the writer sends what waits and ends
        self.broken = False  # sending failed: the connection is shut down, answers dropped

    def send(self, call_id: int, code: grpc.StatusCode, body: Bytes, wait: bool = True) -> None:
        """An answer: sent now if it can be, else queued for the writer (`wait`: for room in the
        queue first, the serving thread's answers)."""
        frame = _frame(call_id, code, body)
        with self.cond:
            while wait and len(self.queue) >= MAX_QUEUED and not self.broken:
                self.cond.wait()
            if self.broken:
                return
            if self.busy or self.queue:
                self.queue.append(frame)
                self.cond.notify_all()
                queued = True
            else:
                self.busy, queued = True, False
        if queued:
            self.queued()
            return
        try:
            rest = _send(self.conn, frame, wait=False)
        except OSError:
            self._break()
            return
        with self.cond:
            if rest:  # the writer finishes this frame before any other (and is the sender from now on)
                self.queue.appendleft(rest)
            self.busy = False
            if self.queue:  # (only then: waking the idle writer after every answer cost a context switch each)
                self.cond.notify_all()
        if rest:
            self.queued()

    def room(self) -> None:
        """The serving thread's, before it reads the next request: wait while MAX_QUEUED answers
        wait for the writer. A parked call's answer is queued without waiting (its thread serves
        the others) and its place given back: without this, a peer that sent writes parked on their
        log and read no answer grew the queue without end (a review: 590 frames)."""
        with self.cond:
            while len(self.queue) >= MAX_QUEUED and not self.broken:
                self.cond.wait()

    def write(self) -> None:
        """The writer thread: send what is queued, in order, until closed and empty; on a broken
        connection, end it (the reader exits)."""
        while True:
            with self.cond:
                while not self.broken and (self.busy or (not self.queue and not self.closed)):
                    self.cond.wait()
                if not self.queue or self.broken:
                    return
                frame = self.queue.popleft()
                self.busy = True
                self.cond.notify_all()  # room in the queue
            try:
                _send(self.conn, frame)
            except OSError:
                self._break()
                return
            with self.cond:
                self.busy = False
                self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def _break(self) -> None:
        with self.cond:
            self.broken = True
            self.queue.clear()
            self.cond.notify_all()
        try:
            self.conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class _Call:
    """A parked call: its steps (off_loop_steps), its id, and what it waits for now."""

    __slots__ = ("steps", "call_id", "wait")

    def __init__(self, steps: Generator[Wait, None, tuple[grpc.StatusCode, bytes]], call_id: int, wait: Wait) -> None:
        self.steps, self.call_id, self.wait = steps, call_id, wait


class _Parked:
    """A connection's calls that must wait (their table's checkpoint file being written, their
    write's log not on disk yet), handed off by the serving thread, which goes on with the
    connection's later calls: it waited in the call before, and a client has one connection per
    shard for all its threads, so a write waiting for its table's checkpoint held every later call
    of that client to the shard, other tables' too, for the whole save (over gRPC they went on).
    One thread per connection, started with its first parked call (it stays until the connection
    ends: every write to a table with `wal` parks on its log), waits for all of them at once
    and takes each on when its wait is over (done, or its deadline passed: the steps say which),
    computing where the call does (set_threads) and answering it (`answer`) at its end.

    Bounds: at most MAX_PARKED at once (the serving thread waits past that). A parked call stays
    admitted (Admission) and its region leased until it ends. `close` (the connection's end): those
    still waiting end CANCELLED, nothing more done (a write that waited for its checkpoint is not
    applied; the client retries it with its tag); one being taken on is finished first."""

    def __init__(self, threads: int, answer: Callable[[int, grpc.StatusCode, bytes], None]) -> None:
        self.threads, self.answer = threads, answer
        self.cond = threading.Condition()
        self.calls: list[_Call] = []  # waiting (not being taken on)
        self.count = 0  # parked and not ended: those waiting and the one being taken on
        self.wake: Future[None] = Future()  # done: the thread looks at `calls` again
        self.closed = False
        self.thread: threading.Thread | None = None

    def park(self, call: _Call) -> None:
        """The serving thread's: hand `call` off (waiting first while MAX_PARKED are)."""
        with self.cond:
            while self.count >= MAX_PARKED and not self.closed:
                self.cond.wait()
            if self.closed:
                call.steps.close()
                return
            self.count += 1
            self.calls.append(call)
            self._wake()
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="doorbell-parked", daemon=True)
                self.thread.start()

    def _wake(self) -> None:
        if not self.wake.done():
            self.wake.set_result(None)

    def _run(self) -> None:
        set_threads(self.threads)  # a call taken on computes here
        while True:
            with self.cond:
                if self.closed:
                    left, self.calls = self.calls, []
                    break
                if self.wake.done():
                    self.wake = Future()
                calls, wake = list(self.calls), self.wake
            untils = [c.wait.until for c in calls if c.wait.until is not None]
            futures_wait([c.wait.done for c in calls] + [wake],
                         None if not untils else max(0.0, min(untils) - time.monotonic()), FIRST_COMPLETED)
            now = time.monotonic()
            ready = [c for c in calls if c.wait.done.done() or (c.wait.until is not None and now >= c.wait.until)]
            with self.cond:
                self.calls = [c for c in self.calls if c not in ready]
            for call in ready:
                self._step(call)
        for call in left:
            call.steps.close()

    def _step(self, call: _Call) -> None:
        """Take `call` on until it waits again (parked again) or ends (answered)."""
        try:
            call.wait = call.steps.send(None)
        except StopIteration as end:
            code, out = end.value
            self.answer(call.call_id, code, out)
        except BaseException:  # (off_loop_steps answers every error: a bug) the call ends unanswered
            log.exception("doorbell: a parked call failed")
        else:
            with self.cond:
                if not self.closed:
                    self.calls.append(call)
                    return
            call.steps.close()
        with self.cond:
            self.count -= 1
            self.cond.notify_all()

    def close(self) -> None:
        """The connection's end: the calls still waiting end (CANCELLED), the thread exits."""
        with self.cond:
            self.closed = True
            self._wake()
            self.cond.notify_all()
            thread = self.thread
        if thread is not None:
            thread.join()


class Doorbell:
    """One shard's doorbell: a listening socket, an accepting thread and a thread per connection.
    `servicer`: the shard's DataPlaneServicer (its regions, plans and tables); `admission` and
    `metrics`: the gRPC server's, so both paths count against the same limits and in the same
    series. Its metrics (register on a registry): `memserver_doorbell_connections`,
    `memserver_doorbell_calls_total`, `memserver_doorbell_refused_total{why}` and
    `memserver_doorbell_answers_queued_total`."""

    def __init__(self, servicer: Any, admission: Admission | None = None, metrics: CallMetrics | None = None) -> None:
        self.servicer = servicer
        self.regions: Regions = servicer.regions
        self.admission, self.metrics = admission, metrics
        self.name = f"memserver-doorbell-{os.getpid()}-{secrets.token_hex(8)}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.sock.bind("\0" + self.name)  # abstract: no file, gone with the process
        self.sock.listen(16)
        #: connections -> calls served on each (written by the connection's thread alone: no lock)
        self.conns: dict[socket.socket, int] = {}
        self.ended = 0  # calls of the connections that ended
        self.queued = 0  # answers that waited for a connection's writer thread
        self.hellos = 0  # connections not past their hello yet
        self.refused: dict[str, int] = {}
        self.lock = threading.Lock()  # conns' keys, ended, queued, hellos, refused
        self.closed = False
        self.parsers = {name: request_parser(DATA_PLANE, name) for name in servicer.PLANS}
        self.thread = threading.Thread(target=self._accept, name="doorbell-accept", daemon=True)
        self.thread.start()

    def _queued(self) -> None:
        with self.lock:
            self.queued += 1

    def _refuse(self, why: str) -> None:
        with self.lock:
            self.refused[why] = self.refused.get(why, 0) + 1

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                if self.closed:
                    return
                log.exception("doorbell: accept failed")
                time.sleep(0.1)
                continue
            with self.lock:
                full = len(self.conns) >= MAX_CONNECTIONS or self.hellos >= MAX_HELLOS
                if not full:
                    self.conns[conn] = 0
                    self.hellos += 1
            if full:
                self._refuse("connections")
                try:  # said (a fresh socket takes a small frame at once), not a bare close: "Broken pipe"
                    conn.sendmsg(_frame(0, grpc.StatusCode.RESOURCE_EXHAUSTED, b"doorbell: too many connections "
                                        b"(saying hello, or in all) at this shard now: call again later"),
                                 [], socket.MSG_DONTWAIT)
                except OSError:
                    pass
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="doorbell", daemon=True).start()

    def _hello(self, conn: socket.socket) -> tuple[str, Attached] | None:
        """The connection's region, once its hello names one attached by the peer process."""
        deadline = time.monotonic() + HELLO_SECONDS  # for the whole hello, however it trickles in
        try:
            head = recv_exact(conn, HEAD.size, deadline)
            if head is None:  # closed, or no whole hello in time
                self._refuse("protocol")
                return None
            size, call_id, _, name_len = HEAD.unpack(head)
            if size > 64 or name_len > 32:
                self._refuse("protocol")
                return None
            body = recv_exact(conn, name_len + size, deadline)
            if body is None or body[:name_len] != _HELLO:  # (None: as above)
                self._refuse("protocol")
                return None
            region_id = body[name_len:].decode(errors="replace")
            attached = self.regions.by_id.get(region_id)
            if attached is None or attached.detached or peer_pid(conn) != attached.pid:
                denied = True
            elif not _join(attached, conn):
                self._refuse("connections")
                _reply(conn, call_id, grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"doorbell: this region has {MAX_CONNECTIONS_PER_REGION} connections already".encode())
                return None
            else:
                denied = False
                try:
                    _reply(conn, call_id, grpc.StatusCode.OK, b"")
                except OSError:
                    with attached.lock:
                        attached.doorbells.discard(conn)
                    raise
                conn.settimeout(None)
        except OSError:  # its time ran out mid-read, or the peer went
            self._refuse("protocol")
            return None
        if denied:  # not a region the peer attached: say nothing more than that (counted once, said or not)
            self._refuse("region")
            try:
                _reply(conn, call_id, grpc.StatusCode.PERMISSION_DENIED, b"doorbell: not a region this process attached")
            except OSError:
                pass
            return None
        return region_id, attached

    def _serve(self, conn: socket.socket) -> None:
        answers = _Answers(conn, self._queued)

        def answer(call_id: int, code: grpc.StatusCode, out: bytes) -> None:  # a parked call's
            answers.send(call_id, code, out, wait=False)  # (bounded by MAX_PARKED: its thread serves the others)
            self.servicer.drain_now()

        parked = _Parked(self.servicer.threads, answer)
        writer: threading.Thread | None = None
        attached: Attached | None = None
        try:
            try:
                hello = self._hello(conn)
            finally:
                with self.lock:
                    self.hellos -= 1
            if hello is None:
                return
            region_id, attached = hello
            set_threads(self.servicer.threads)  # as the compute thread: per-thread settings (torch, numba)
            writer = threading.Thread(target=answers.write, name="doorbell-writer", daemon=True)
            writer.start()
            with attached.lock:
                if attached.detached:  # detached since the hello: its connections are ended
                    return
            log.debug("doorbell: pid %d connected (region %s..., %s role)", attached.pid, region_id[:8], attached.role)
            allowed, in_region = self._checks(region_id, attached)
            servicer, admission, metrics, parsers = self.servicer, self.admission, self.metrics, self.parsers
            while not attached.detached:
                answers.room()  # (a peer that reads no answer is not read from either)
                head = recv_exact(conn, HEAD.size)
                if head is None:
                    return
                size, call_id, deadline, name_len = HEAD.unpack(head)
                if size > MAX_REQUEST_BYTES:
                    self._refuse("protocol")
                    log.warning("doorbell: pid %d sent a %d-byte request (at most %d); closing", attached.pid, size,
                                MAX_REQUEST_BYTES)
                    return
                body = recv_exact(conn, name_len + size)
                if body is None:
                    return
                name = body[:name_len].decode(errors="replace")
                steps = off_loop_steps(servicer, admission, metrics, name, parsers.get(name),
                                       memoryview(body)[name_len:], deadline or None, before=allowed, check=in_region)
                self.conns[conn] += 1
                try:
                    wait = next(steps)
                except StopIteration as end:
                    code, out = end.value
                    answers.send(call_id, code, out)  # waits only past MAX_QUEUED unsent answers
                    servicer.drain_now()  # deferred work after the answer, as gRPC's path does
                else:  # it waits (its table's checkpoint file, its write's log): not this connection's later calls
                    parked.park(_Call(steps, call_id, wait))
                    servicer.drain_now()
        except OSError:
            return
        finally:
            parked.close()  # before the answers close: a call being taken on is answered first
            if writer is not None:
                answers.close()
                writer.join(WRITER_GRACE)
                if writer.is_alive():  # a peer that half-closed and reads nothing: its answers are dropped,
                    answers._break()  # the blocked send woken (else the thread and its answers stayed for good)
                    writer.join(WRITER_GRACE)
            if attached is not None:
                with attached.lock:
                    attached.doorbells.discard(conn)
            with self.lock:
                self.ended += self.conns.pop(conn)
            conn.close()

    @staticmethod
    def _checks(region_id: str, attached: Attached) -> tuple[Callable[[str], None], Callable[[Any], None]]:
        """A connection's checks of each call (serve_off_loop's `before` and `check`), made once:
        its region's role allows the call; its tensors are in that region, still attached."""
        read_only = attached.role == "read"

        def allowed(name: str) -> None:
            if read_only and name not in READ_METHODS:
                raise PermissionDeniedError(f"{name}: the region was attached with the read token, which may not "
                                            "make this call; it needs the write token")

        def in_region(request: Any) -> None:
            if "shm" in request.DESCRIPTOR.fields_by_name and request.HasField("shm") and \
                    request.shm.region != region_id:
                raise InvalidArgumentError("shm.region: not the region this doorbell connection was opened for")
            if attached.detached:
                raise UnavailableError("doorbell: the region was detached; call again (by gRPC)")

        return allowed, in_region

    @property
    def calls(self) -> int:
        """Calls served, by every connection there has been."""
        with self.lock:
            return self.ended + sum(self.conns.values())

    def close(self) -> None:
        """Stop accepting and end every connection (their threads exit)."""
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        with self.lock:
            conns = list(self.conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def collect(self) -> Any:
        g = GaugeMetricFamily("memserver_doorbell_connections", "Clients on this node connected to the shard's doorbell")
        c = CounterMetricFamily("memserver_doorbell_calls", "Calls served by the doorbell (also in memserver_requests_total)")
        r = CounterMetricFamily("memserver_doorbell_refused", "Doorbell connections refused, by why", labels=["why"])
        q = CounterMetricFamily("memserver_doorbell_answers_queued", "Doorbell answers that waited for their "
                                "connection's writer thread (the socket full: a client slow to read); the others "
                                "were sent by the thread that served the call")
        with self.lock:
            g.add_metric([], len(self.conns))
            c.add_metric([], self.ended + sum(self.conns.values()))
            q.add_metric([], self.queued)
            for why, n in self.refused.items():
                r.add_metric([why], n)
        yield from (g, c, r, q)


def serve_off_loop(servicer: Any, admission: Admission | None, metrics: CallMetrics | None, name: str,
                   parse: Callable[[bytes], Any] | None, read: Bytes | Callable[[], Bytes | None],
                   deadline: float | None, *, before: Callable[[str], None] | None = None,
                   check: Callable[[Any], None] | None = None) -> tuple[grpc.StatusCode, bytes]:
    """A data-plane call served on the calling thread, not the event loop: `off_loop_steps` run to
    their end here, each wait waited out. Returns the status and the answer's bytes, or the status
    text. The thread-pool server benchmarks.grpc_designs measures."""
    return finish(off_loop_steps(servicer, admission, metrics, name, parse, read, deadline, before=before,
                                 check=check))


def off_loop_steps(servicer: Any, admission: Admission | None, metrics: CallMetrics | None, name: str,
                   parse: Callable[[bytes], Any] | None, read: Bytes | Callable[[], Bytes | None],
                   deadline: float | None, *, before: Callable[[str], None] | None = None,
                   check: Callable[[Any], None] | None = None) -> Generator[Wait, None, tuple[grpc.StatusCode, bytes]]:
    """A data-plane call served off the event loop, in steps: the steps of
    grpcserver.ErrorsAndMetrics (`before(name)`, admitted, the request read (`read`: its bytes, or
    what reads them once admitted, None: nothing sent), parsed by the servers' one reader (`parse`
    None: not a call served here), enums checked, `check`, run by DataPlaneServicer.serve_steps,
    errors by status_of, counted in the metrics). Yields where the call waits (serve_steps), still
    admitted meanwhile; returns the status and the answer's bytes, or the status text. Closed
    before its end (its doorbell connection ended), it is counted CANCELLED, its admission and
    region given back, nothing more done. The doorbell's calls (`serve_off_loop` otherwise)."""
    t0 = time.perf_counter()
    request: Any = None
    entered, size, for_token = False, 0, False
    code, out = grpc.StatusCode.CANCELLED, b""  # (closed while it waited)
    try:
        try:
            if parse is None:
                raise InvalidArgumentError(f"{name!r} is not a call served here ({', '.join(servicer.PLANS)})")
            if before is not None:
                try:
                    before(name)
                except PermissionDeniedError:  # the token's role: an auth failure, as Authenticate counts it
                    for_token = True
                    raise
            if admission is not None:
                admission.enter(name)  # before the request is read
                entered = True
            raw = read() if callable(read) else read
            if raw is None:
                raise InvalidArgumentError(f"request: no {name} request was sent")
            if admission is not None:
                admission.take(name, len(raw))
                size = len(raw)
            request = parse_request(parse, raw, name)
            raw = None
            check_enums(request)
            if check is not None:
                check(request)
            code, out = grpc.StatusCode.OK, to_bytes((yield from servicer.serve_steps(name, request, deadline)))
        except Exception as exc:
            code, text = status_of(exc, name, request, metrics)
            out = text.encode()
    finally:
        if entered and admission is not None:
            admission.leave(size)
        if metrics is not None and for_token:
            metrics.refused(name, code.name)
        elif metrics is not None:
            metrics.observe(name if parse is not None else "other", getattr(request, "table", ""), code.name,
                            time.perf_counter() - t0)
    return code, out
