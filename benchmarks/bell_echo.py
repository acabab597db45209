"""The doorbell's transport floor: an echo on an abstract Unix socket speaking the doorbell's frames.

A doorbell call (client.doorbell, memserver.server.doorbell) is one request frame and one answer
frame on a Unix stream socket between the client and a shard's serving thread; with shared
memory the tensors are not in the frames, only where they are. The echo measures the frames'
part alone: a `BellEcho` binds an abstract Unix socket, accepts connections on a thread and
serves each on a thread of its own as the shard's doorbell does, reading a request frame
(memserver.wire.DOORBELL_HEAD, the method's name, the body) and sending back an answer frame
(memserver.wire.DOORBELL_REPLY and a body) with one `sendall`, as the shard's doorbell does. The
first 8 bytes of a request's body carry the answer body's size (little endian; a shorter body:
an empty answer), so the echo carries the very frame sizes of a shard's calls: the gRPC echo's
requests (benchmarks.echo.echo_request) as bodies. Answers are preallocated per size. It answers
the client's hello (any region id) with OK, so the client's own `client.doorbell.Bell` (the same
sends and reads as the client's calls) is its caller.

Run it in a Ray actor (`benchmarks.echo.echo_servers(n, cls=BellEcho)`: a process of its own,
at Ray's worker nice value, as a shard) or in this process (`BellEcho()`, then `close()`: for tests).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading
from collections.abc import Sequence
from typing import Any

from benchmarks.echo import Answers, asked
from memserver.wire import DOORBELL_HEAD as HEAD
from memserver.wire import DOORBELL_HELLO as HELLO
from memserver.wire import DOORBELL_REPLY as REPLY
from memserver.wire import recv_exact

HELLO_BYTES = HELLO.encode()


class BellEcho:
    """An echo of doorbell frames on an abstract Unix socket (see the module docstring)."""

    def __init__(self) -> None:
        self.name = f"memserver-bench-bell-{os.getpid()}-{secrets.token_hex(8)}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.sock.bind("\0" + self.name)
        self.sock.listen(16)
        self.answers = Answers()
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
                hello = body[:name_len] == HELLO_BYTES  # its body is a region id: an empty OK
                answer = self.answers[0 if hello else asked(memoryview(body)[name_len:])]
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


def connect(name: str) -> Any:
    """A client.doorbell.Bell to the echo named `name` (the client's own connection class)."""
    from client.doorbell import Bell

    return Bell(name, "bench-echo", f"bell echo {name}")


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
