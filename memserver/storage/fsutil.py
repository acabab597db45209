"""Atomic, durable file writes: the one way the project puts a file in place."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[IO[bytes]], Any], mode: int | None = None) -> None:
    """write(file object) into a temporary file, fsync it, rename it into place, fsync the folder:
    a reader sees the old file or the whole new one, and after a crash the new one is there.
    `mode`: the file's permissions from its creation on (a key is never readable by others)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
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


def remove_stale_temporaries(path: Path) -> int:
    """Remove atomic_write's temporaries of `path` left by writers that are gone (a shard killed
    mid-checkpoint: each holds up to a whole file's space, and a retry under a new pid never
    reused it); returns how many. Only `path`'s own (one writer at a time writes a given file), and
    not those of a process alive on this host."""
    from memserver.cluster.endpoint import pid_alive

    removed = 0
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.tmp-*"):
        pid = tmp.name.rpartition(".tmp-")[2]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            tmp.unlink(missing_ok=True)
            removed += 1
    return removed
