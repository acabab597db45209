"""Atomic, durable file writes: the one way the project puts a file in place."""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _put_back(handlers: list[tuple[int, Any]]) -> None:
    """signal.signal(s, h) for each, every one even if a signal put back first raises meanwhile."""
    if handlers:
        try:
            signal.signal(*handlers[0])
        finally:
            _put_back(handlers[1:])


@contextlib.contextmanager
def signals_held(signums: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> Iterator[None]:
    """Ctrl-C and SIGTERM wait until the block ends, then reach the handlers they would have had
    (in `signums`' order: SIGTERM's first, so memtrain says terminated), also when the block
    raises: a KeyboardInterrupt (or memtrain's Terminated) raised inside torch.save's zip writer
    left the writer to fail on its end record, a RuntimeError ("unexpected pos") with a traceback
    and exit 1 where memtrain stops cleanly (the suite caught one). A second one of the same
    signal goes through at once (a write that hangs can still be stopped). Nested blocks hold
    once (the outer one). The main thread only: elsewhere no handler can be set, and no signal is
    delivered."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    before: list[tuple[int, Any]] = []

    def hold(signum: int, frame: Any) -> None:
        if signum in pending:  # the user insists
            _put_back(before)
            signal.raise_signal(signum)
        else:
            pending.append(signum)

    hold.holds = True  # type: ignore[attr-defined]
    try:
        for s in signums:
            now = signal.getsignal(s)
            # (None: a handler set outside Python, which could not be put back; a hold: an outer block's)
            if now is not None and not getattr(now, "holds", False):
                before.append((s, now))
                signal.signal(s, hold)
        yield
    finally:
        _put_back(before)
        for s in signums:  # (a signal's handler that raises ends the loop: the first such one is the news)
            if s in pending:
                signal.raise_signal(s)


def atomic_write(path: Path, write: Callable[[IO[bytes]], Any], mode: int | None = None) -> None:
    """write(file object) into a temporary file, fsync it, rename it into place, fsync the folder:
    a reader sees the old file or the whole new one, and after a crash the new one is there.
    `mode`: the file's permissions from its creation on (a key is never readable by others).
    Ctrl-C and SIGTERM wait for it (signals_held); a second one that breaks the write raises
    itself, not the error it caused in `write` (torch.save's RuntimeError)."""
    with signals_held():
        try:
            _atomic_write(path, write, mode)
        except Exception as exc:
            if isinstance(exc.__context__, KeyboardInterrupt):
                raise exc.__context__ from None
            raise


def _atomic_write(path: Path, write: Callable[[IO[bytes]], Any], mode: int | None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary(path)
    tmp.unlink(missing_ok=True)  # a name planted there (a link out of a checkpoint root) is never followed:
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666 if mode is None else mode)
    if mode is not None:
        os.fchmod(fd, mode)  # the umask cannot take bits away
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, an error of `write`: the part written goes (it holds disk space)
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def temporary(path: Path, pid: int | None = None) -> Path:
    """atomic_write's temporary for `path`: named after the writer's host and pid, so a checkpoint
    folder shared by several hosts tells whose it is."""
    return path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid() if pid is None else pid}")


def remove_stale_temporaries(path: Path) -> int:
    """Remove atomic_write's temporaries of `path` left by writers of this host that are gone (a
    shard killed mid-checkpoint: each holds up to a whole file's space, and a retry under a new
    pid never reused it); returns how many. Only `path`'s own (one writer at a time writes a given
    file), never another host's (its pids are not this host's to judge) or a live process's."""
    from memserver.cluster.endpoint import pid_alive

    removed = 0
    head = temporary(path, 0).name[:-1]  # ".NAME.tmp-HOST-"
    for tmp in path.parent.glob(glob.escape(head) + "*"):
        pid = tmp.name[len(head):]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            tmp.unlink(missing_ok=True)
            removed += 1
    return removed
