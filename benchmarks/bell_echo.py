"""The doorbell's transport floor: an echo on an abstract Unix socket speaking the doorbell's frames.

A doorbell call (client.doorbell, memserver.server.doorbell) is one request frame and one answer
frame on a Unix stream socket between the client and a shard's serving thread; with shared
memory the tensors are not in the frames, only where they are. The echo measures the frames'
part alone: a `BellEcho` binds an abstract Unix socket, accepts connections on a thread and
serves each on a thread of its own as the shard's doorbell does, reading a request frame
(memserver.wire.DOORBELL_HEAD, the method's name, the body) and sending back an answer frame
(memserver.wire.DOORBELL_REPLY and a body) with one `sendall`, as the shard's doorbell does. The
first 8 bytes of a request's body carry the answer body's size (little endian; a shorter body:
an empty answer), so the echo carries the very frame sizes of a shard's calls. Answers are
preallocated per size. It answers the client's hello (any region id) with OK, so the client's
own `client.doorbell.Bell` (the same sends and reads as the client's calls) is its caller.

Run it in a Ray actor (`bell_echoes`: a process of its own, at Ray's worker nice value, as a
shard) or in this process (`BellEcho()`, then `close()`: for tests).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from memserver.wire import DOORBELL_HEAD as HEAD
from memserver.wire import DOORBELL_HELLO as HELLO
from memserver.wire import DOORBELL_REPLY as REPLY
from memserver.wire import recv_exact

#: A request body's header: the answer body's size in bytes.
HEADER_BYTES = 8
HELLO_BYTES = HELLO.encode()


class BellEcho:
    """An echo of doorbell frames on an abstract Unix socket (see the module docstring)."""

    def __init__(self) -> None:
        self.name = f"memserver-bench-bell-{os.getpid()}-{secrets.token_hex(8)}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.sock.bind("\0" + self.name)
        self.sock.listen(16)
        self.answers: dict[int, bytes] = {0: b""}
        self.conns: set[socket.socket] = set()
        self.lock = threading.Lock()
        self.closed = False
        self.thread = threading.Thread(target=self._accept, name="bench-bell-accept", daemon=True)
        self.thread.start()

    def address(self) -> str:
        """The socket's abstract name (what a Bell connects to)."""
        return self.name

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                self.conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="bench-bell", daemon=True).start()

    def _answer(self, n: int) -> bytes:
        answer = self.answers.get(n)
        if answer is None:
            answer = self.answers[n] = bytes(n)
        return answer

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                head = recv_exact(conn, HEAD.size)
                if head is None:
                    return
                size, call_id, _, name_len = HEAD.unpack(head)
                body = recv_exact(conn, name_len + size)
                if body is None:
                    return
                raw = memoryview(body)[name_len:]
                hello = body[:name_len] == HELLO_BYTES  # its body is a region id: an empty OK
                n = int.from_bytes(raw[:HEADER_BYTES], "little") if len(raw) >= HEADER_BYTES and not hello else 0
                answer = self._answer(n)
                conn.sendall(REPLY.pack(len(answer), call_id, 0) + answer)  # as the shard's _reply
        except OSError:
            return
        finally:
            with self.lock:
                self.conns.discard(conn)
            conn.close()

    def close(self) -> None:
        """Stop accepting and end every connection."""
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        with self.lock:
            conns = list(self.conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


def echo_body(request_bytes: int, answer_bytes: int) -> bytes:
    """A request body of `request_bytes` (at least the header) asking for `answer_bytes` back."""
    return answer_bytes.to_bytes(HEADER_BYTES, "little") + bytes(max(0, request_bytes - HEADER_BYTES))


def connect(name: str) -> Any:
    """A client.doorbell.Bell to the echo named `name` (the client's own connection class)."""
    from client.doorbell import Bell

    return Bell(name, "bench-echo", f"bell echo {name}")


@contextlib.contextmanager
def bell_echoes(n: int, num_cpus: float = 0.25) -> Iterator[list[str]]:
    """`n` echo actors (one process each, like `n` shards); yields their socket names, kills them
    on exit. Needs Ray up (benchmarks.common.local_cluster / init_ray)."""
    import ray

    actors = [ray.remote(BellEcho).options(num_cpus=num_cpus).remote() for _ in range(n)]
    try:
        yield ray.get([a.address.remote() for a in actors])
    finally:
        for a in actors:
            ray.kill(a)


def ring_all(calls: Sequence[tuple[Any, str, bytes]], timeout: float = 60.0) -> list[tuple[Any, bytes]]:
    """Send every call (bell, method, body) at once, then wait for each answer, as the client's
    transport does (client.transport.ring, then answer): [(status, answer body)]."""
    tickets = []
    for bell, method, body in calls:
        ticket = bell.send(method, body, timeout)
        if ticket is None:
            raise RuntimeError(f"{bell.target}: the doorbell would not take the call (broken, or too large)")
        tickets.append(ticket)
    return [bell.wait(t, timeout) for (bell, _, _), t in zip(calls, tickets)]
