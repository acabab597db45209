"""Atomic, durable file writes: the one way the project puts a file in place."""

from __future__ import annotations

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
    with os.fdopen(fd, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
