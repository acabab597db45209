"""The client's side of a shard's doorbell (memserver.server.doorbell has the protocol): data-plane
calls to a shard on this machine as frames on a Unix socket, their tensors in the client's
shared-memory region with that shard (client.shm), no gRPC per call.

A `Bell` is one connection, opened once the region is attached (client.shm.ShmTransport) and
said hello to with the region's id. Any thread may send on it (`send`, under a lock) and wait
for its answer (`wait`): whichever waiter finds no one reading becomes the reader and hands
the answers it reads to their waiters (leader/follower), so two calls to two shards from one
thread are both in flight before either is waited for. A call not answered by its deadline
raises DeadlineExceededError (its block is abandoned, as after a gRPC deadline) and its late
answer is dropped. A connection that breaks fails every call waiting on it UNAVAILABLE and is
not used again (the client's retry sends those calls by gRPC while the region is attached anew).

Bounds: at most MAX_OUTSTANDING calls whose answers are unread per connection, those given up
included (more go by gRPC), so the shard's queue of answers never fills (it holds twice that) and
it always goes back to reading requests; a request waits for room in the socket at most until its
deadline (then it goes by gRPC, or, cut off mid-frame, breaks the connection). A connection that
is interrupted mid-frame (a signal's exception) is broken, never read or written again out of
step, and one inherited across fork is not used by the child (its calls go by gRPC).
"""

from __future__ import annotations

import math
import os
import select
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from memserver.api.errors import DeadlineExceededError, UnavailableError
from memserver.api.v1 import memserver_pb2 as pb
from memserver.wire import DOORBELL_HEAD as HEAD
from memserver.wire import DOORBELL_HELLO as HELLO
from memserver.wire import DOORBELL_MAX_REQUEST as MAX_REQUEST_BYTES
from memserver.wire import DOORBELL_REPLY as REPLY
from memserver.wire import MAX_MESSAGE_BYTES, peer_pid, recv_exact

#: Calls on one connection whose answers are unread (those given up too), at most.
MAX_OUTSTANDING = 32
#: The longest one poll() waits (its C int of milliseconds, ~24.8 days); a longer wait polls again.
MAX_POLL_MS = 2**31 - 1
#: Seconds the hello may take.
HELLO_SECONDS = 5.0
#: Seconds a started answer may take to come whole, at least (or the reading call's deadline).
FRAME_SECONDS = 2.0
_STATUS = {c.value[0]: c for c in grpc.StatusCode}
#: The data-plane methods' names as a frame carries them, encoded once (any other: per call).
_NAMES = {m.name: m.name.encode() for m in pb.DESCRIPTOR.services_by_name["DataPlane"].methods}


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    got = recv_exact(sock, n)
    if got is None:
        raise ConnectionError("the shard closed its doorbell")
    return got


class Bell:
    """One connection to a shard's doorbell, for the region `region_id` (see the module docstring).
    `target`: where the calls go, for error messages ("shard HOST:PORT")."""

    def __init__(self, name: str, region_id: str, target: str, pid: int = 0) -> None:
        """`pid` (not 0): the shard's process, which the attach named: the hello, which carries the
        region's secret id, goes to a listener of that pid alone (0: a shard that does not say)."""
        self.target = target
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(HELLO_SECONDS)
            sock.connect("\0" + name)
            if pid and (peer := peer_pid(sock)) != pid:  # (an abstract name is anyone's to bind once freed)
                raise ConnectionError(f"its listener is process {peer}, not the shard's {pid}: not used")
            body = region_id.encode()
            try:
                sock.sendall(HEAD.pack(len(body), 0, 0, len(HELLO)) + HELLO.encode() + body)
            except (BrokenPipeError, ConnectionResetError):  # refused at once: its answer says why, if it came
                pass
            size, _, code = REPLY.unpack(_recv_exact(sock, REPLY.size))
            text = _recv_exact(sock, size)
            if code != 0:
                raise ConnectionError(f"refused: {text.decode(errors='replace')}")
            sock.settimeout(None)  # blocking from now on: the reader polls before it reads
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        # poll, not select: select refuses a descriptor numbered 1024 or more, which a trainer with
        # many files and sockets open reaches (a walkthrough: every doorbell call broke)
        self.poller = select.poll()
        self.poller.register(sock, select.POLLIN)
        self._sock_fd = sock.fileno()
        # `forget` wakes the reader through this pair: a caller that gave up (an asyncio call
        # cancelled) must not hold a thread until its deadline. Socket objects, not raw numbers:
        # once closed they refuse use instead of reaching a descriptor the number now names
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.wake_w.setblocking(False)
        self._wake_fd = self.wake_r.fileno()
        self.poller.register(self._wake_fd, select.POLLIN)
        self._readable = select.poll()  # the socket alone: the rest of a started answer
        self._readable.register(sock, select.POLLIN)
        self.closed = False
        # where the asyncio client waits for this bell's answers: its own threads (at most one per
        # call in flight), so a stalled shard holds none that other shards' calls need
        self.waits = ThreadPoolExecutor(max_workers=MAX_OUTSTANDING, thread_name_prefix="memserver-bell")
        self.pid = os.getpid()  # a child of a fork shares the socket: it must not use it
        self.next_id = 1
        self.send_lock = threading.Lock()
        self.cond = threading.Condition()
        self.waiting: set[int] = set()  # calls sent and not given up
        self.answers: dict[int, tuple[int, bytes]] = {}
        self.unread = 0  # calls sent whose answers are not read yet (given up ones too)
        self.reading = False
        self.broken: str = ""  # why the connection is unusable ("" while it works)
        self.calls = 0

    @property
    def alive(self) -> bool:
        return not self.broken and os.getpid() == self.pid

    def send(self, method: str, raw: bytes, timeout: float | None, block: bool = True) -> int | None:
        """Send a call; its ticket for `wait`, or None: send it by gRPC (too large, too many in
        flight, the connection broken, or not sent by the call's deadline). `block` False (an
        event loop's thread, which must never wait on the shard): None too when another call holds
        the socket or none of the frame fits in it now; a frame that went in part is finished by
        one of this bell's threads (the shard reads requests whenever it is not computing)."""
        if len(raw) > MAX_REQUEST_BYTES or not self.alive:
            return None
        until = None if timeout is None else time.monotonic() + timeout  # one machine, one clock
        # counted: calls whose answers are unread, given up ones too (the shard answers each: were
        # they not counted, its answers to them could fill its queue and stop it reading requests
        # while this side, sending, reads none: a review), and answers read and never collected.
        # (A glance without the lock; the count that decides is taken under it below.)
        if self.unread + len(self.answers) >= MAX_OUTSTANDING and block:  # (not on an event loop: a started
            self._drain()  # answer is read whole) answers of calls given up, read now if no one is reading
        name = _NAMES.get(method) or method.encode()
        if not (self.send_lock.acquire(timeout=-1 if until is None else max(0.0, until - time.monotonic())) if block
                else self.send_lock.acquire(blocking=False)):
            return None  # another call's request holds the socket past this one's deadline (or now: not blocking)
        handed = False  # the frame's rest went to a thread, which releases the lock
        try:
            with self.cond:
                if self.unread + len(self.answers) >= MAX_OUTSTANDING or self.broken:
                    return None
                call_id = self.next_id
                self.next_id += 1
                self.waiting.add(call_id)
                self.unread += 1
            frame = [memoryview(HEAD.pack(len(raw), call_id, until or 0.0, len(name))), memoryview(name),
                     memoryview(raw)]
            try:
                if block:
                    went = self._send_frame(frame, until)
                else:
                    went, handed = self._send_start(frame, until)
                if not went:  # the deadline came (or, not blocking, no room) before any byte went
                    with self.cond:
                        self.waiting.discard(call_id)
                        self.unread -= 1
                    return None
            except BaseException as exc:  # noqa: BLE001 - interrupted mid-frame too: out of step for good
                self._break(f"sending failed ({exc!r})")
                if not isinstance(exc, OSError):
                    raise
                return call_id  # wait() raises UNAVAILABLE: the call may or may not have gone
        finally:
            if not handed:
                self.send_lock.release()
        self.calls += 1
        return call_id

    def _send_start(self, frame: list[memoryview], until: float | None) -> tuple[bool, bool]:
        """What of the frame the socket takes now, never waiting: (any of it went, the rest handed
        to a thread that sends it and then releases `send_lock`)."""
        try:
            sent = self.sock.sendmsg(frame, [], socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False, False
        if sent == 0:
            return False, False
        while frame and sent >= len(frame[0]):
            sent -= len(frame.pop(0))
        if not frame:
            return True, False
        frame[0] = frame[0][sent:]
        try:
            self.waits.submit(self._send_rest, frame, until)
        except RuntimeError:  # the bell closed meanwhile (its pool shut down): the frame stays cut off
            self._break("closed with a request part sent")
            return True, False  # (its wait: UNAVAILABLE)
        return True, True

    def _send_rest(self, frame: list[memoryview], until: float | None) -> None:
        try:
            if not self._send_frame(frame, until):  # (none of the rest by the deadline: cut off all the same)
                raise TimeoutError("the call's deadline came with its request part sent")
        except BaseException as exc:  # noqa: BLE001 - cut off mid-frame: out of step for good (its waiter: UNAVAILABLE)
            self._break(f"sending failed ({exc!r})")
        finally:
            self.send_lock.release()

    def _send_frame(self, frame: list[memoryview], until: float | None) -> bool:
        """The whole frame (never half: what is cut off mid-frame raises, and the caller breaks the
        connection), waiting for room at most until `until`; False: none of it went by then."""
        started, writable = False, None
        while frame:
            try:
                sent = self.sock.sendmsg(frame, [], socket.MSG_DONTWAIT)
            except BlockingIOError:  # the shard is not reading now (busy serving a call): wait for room
                sent = 0
            started = started or sent > 0
            while frame and sent >= len(frame[0]):
                sent -= len(frame.pop(0))
            if frame:
                frame[0] = frame[0][sent:]
                left = None if until is None else until - time.monotonic()
                if left is not None and left <= 0:
                    if not started:
                        return False
                    raise TimeoutError("the call's deadline came with its request part sent")
                if writable is None:
                    writable = select.poll()
                    writable.register(self._sock_fd, select.POLLOUT)
                writable.poll(_poll_ms(left))
        return True

    def _drain(self) -> None:
        """Read the answers already here (no wait), unless another thread is reading: those of calls
        given up count against MAX_OUTSTANDING until read, and nobody waits to read them."""
        with self.cond:
            if self.reading or self.broken:
                return
            self.reading = True
        try:
            while not self.broken:
                with self.cond:
                    before = self.unread
                if not before:
                    break
                self._read_one(0.0)
                with self.cond:
                    self.cond.notify_all()  # (an answer filed for a waiter: it need not wait for the drain's end)
                    if self.unread == before:
                        break
        finally:
            with self.cond:
                self.reading = False
                self.cond.notify_all()

    def forget(self, call_id: int) -> None:
        """A call nobody will wait for (its caller failed before waiting, or gave up: a cancelled
        asyncio call): drop it and its answer, and end a wait for it at once. (It counts in
        `unread` until its answer, which the shard sends all the same, is read.)"""
        with self.cond:
            self.waiting.discard(call_id)
            self.answers.pop(call_id, None)
            self.cond.notify_all()
        try:
            self.wake_w.send(b"\0")
        except OSError:  # full (a wake-up is pending anyway) or closed
            pass

    def wait(self, call_id: int, timeout: float | None) -> tuple[grpc.StatusCode, bytes]:
        """The call's status and answer bytes (or status text). Raises DeadlineExceededError past
        `timeout` seconds and UnavailableError if the connection breaks first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        looked = False  # (an answer already in the socket is taken even with no time left: one look)
        while True:
            with self.cond:
                while True:
                    got = self.answers.pop(call_id, None)
                    if got is not None:
                        return _STATUS.get(got[0], grpc.StatusCode.UNKNOWN), got[1]
                    if self.broken:
                        self.waiting.discard(call_id)
                        if deadline is not None and time.monotonic() >= deadline:  # (its answer stalled past it)
                            raise DeadlineExceededError(f"doorbell: no answer before the call's deadline "
                                                        f"({self.broken})", target=self.target)
                        raise UnavailableError(f"doorbell: {self.broken}", target=self.target)
                    if call_id not in self.waiting:  # forgotten: its caller is gone
                        raise DeadlineExceededError("doorbell: the caller gave the call up", target=self.target)
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0 and (looked or self.reading):
                        self.waiting.discard(call_id)  # its answer, if it comes, is dropped
                        raise DeadlineExceededError("doorbell: no answer before the call's deadline", target=self.target)
                    if not self.reading:
                        self.reading = True
                        break
                    self.cond.wait(left)
            looked = True
            try:
                self._read_one(None if left is None else max(0.0, left))
            finally:
                with self.cond:
                    self.reading = False
                    self.cond.notify_all()

    def _read_one(self, timeout: float | None) -> None:
        """Read one answer (waiting at most `timeout` for it to start) and file it for its waiter."""
        try:
            ready = self.poller.poll(_poll_ms(timeout))
            if any(fd == self._wake_fd for fd, _ in ready):
                try:
                    self.wake_r.recv(4096)
                except OSError:  # (empty, or closed by `close`)
                    pass
            if not any(fd == self._sock_fd for fd, _ in ready):
                return
            # a started answer is read whole (the shard sends it at once), by the reader's deadline
            # or FRAME_SECONDS from now, the later: a shard stopped mid-answer held its caller for good
            until = None if timeout is None else time.monotonic() + max(timeout, FRAME_SECONDS)
            size, call_id, code = REPLY.unpack(self._recv_by(REPLY.size, until))
            if size > 2 * MAX_MESSAGE_BYTES or not 0 < call_id < self.next_id:
                raise ValueError(f"an answer frame of {size} bytes for call {call_id}: out of step")
            body = self._recv_by(size, until)
        except BaseException as exc:  # noqa: BLE001 - interrupted mid-frame too: out of step for good
            self._break(f"the connection to the shard broke ({exc!r})")
            if not isinstance(exc, (OSError, ValueError)):
                raise
            return
        with self.cond:
            self.unread -= 1
            if call_id in self.waiting:
                self.waiting.discard(call_id)
                self.answers[call_id] = (code, body)

    def _recv_by(self, n: int, until: float | None) -> bytes:
        """n bytes of a started frame, waiting for them until `until` at most (None: no end);
        TimeoutError past it (the caller breaks the connection: it is out of step)."""
        if until is None:
            return _recv_exact(self.sock, n)
        if n == 0:
            return b""
        try:  # (the usual: the shard sent the frame at once, all here: taken as it came, no poll, no copy)
            first = self.sock.recv(n, socket.MSG_DONTWAIT)
        except BlockingIOError:
            first = b""
        else:
            if not first:
                raise ConnectionError("the shard closed its doorbell")
        if len(first) == n:
            return first
        buf = bytearray(n)
        buf[:len(first)] = first
        view, got = memoryview(buf), len(first)
        while got < n:
            left = until - time.monotonic()
            if left <= 0 or not self._readable.poll(_poll_ms(left)):
                raise TimeoutError(f"the shard stopped mid-answer ({got} of {n} bytes came)")
            k = self.sock.recv_into(view[got:], n - got, socket.MSG_DONTWAIT)
            if k == 0:
                raise ConnectionError("the shard closed its doorbell")
            got += k
        return bytes(buf)

    def _break(self, why: str) -> None:
        with self.cond:
            if not self.broken:
                self.broken = why
            self.cond.notify_all()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def call(self, method: str, raw: bytes, timeout: float | None) -> tuple[grpc.StatusCode, bytes] | None:
        """send + wait in one; None: send it by gRPC."""
        ticket = self.send(method, raw, timeout)
        return None if ticket is None else self.wait(ticket, timeout)

    def close(self) -> None:
        """Idempotent (a retired region's unmap may run again)."""
        with self.cond:
            if self.closed:
                return
            self.closed = True
        self._break("closed by the client")
        self.sock.close()
        self.waits.shutdown(wait=False)
        self.wake_r.close()
        self.wake_w.close()



def _poll_ms(seconds: float | None) -> int | None:
    """A wait in seconds as poll() takes it (None: no end): a client's timeout above poll's limit
    raised OverflowError and broke the shard's connection on every call (TCP took it)."""
    return None if seconds is None else min(math.ceil(max(0.0, seconds) * 1000), MAX_POLL_MS)
