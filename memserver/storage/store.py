"""What a shard keeps on disk, per table slice, so a restarted process can serve it again.

Per shard, under the cluster's data directory, one folder per table slice holds `table.json`
(the slice's spec and place in its table, the files it was restored from, if any, and its
latest checkpoints with the write-ahead-log position each one covers) and, for tables created
with `wal`, the log segments (memserver.storage.wal).

Recovery loads the newest checkpoint whose manifest exists, else the restore files, else the
seeded initial values (a pure function of the spec), and replays the log after it.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

from memserver.api.errors import FailedPreconditionError
from memserver.api.types import LOCK_FILE, check_table_name
from memserver.api.v1 import memserver_pb2 as pb
from memserver.storage.checkpoint import MANIFEST
from memserver.storage.fsutil import atomic_write

log = logging.getLogger(__name__)

# LOCK_FILE: the file in each shard's folder whose lock says a shard serves from it (and its pid who).
#: A restarted shard waiting for its folder's lock tries it this often, and logs that it waits this often.
LOCK_POLL_SECONDS, LOCK_SAY_SECONDS = 1.0, 30.0
#: Checkpoints remembered per slice (recovery falls back to an older one if the newest is incomplete).
KEEP_CHECKPOINTS = 3


class ShardStore:
    """The on-disk state of one shard: a folder per table slice (see the module docstring)."""

    def __init__(self, root: str | os.PathLike[str], index: int, *, wait: bool = False) -> None:
        """`wait`: this shard is a restart of one that may still hold the folder (see `_take`)."""
        self.dir = Path(root) / f"shard-{index:04d}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = self._take(self.dir / LOCK_FILE, wait)

    @staticmethod
    def _take(path: Path, wait: bool = False) -> int:
        """An exclusive lock on the folder for this process's life (or `close`): a second shard on
        it (a second `up` on the same --data-dir) would append to the same logs and files. The
        kernel drops it when the holder dies, so a restarted shard takes it again.

        `wait`: a shard Ray restarted waits for the holder instead of refusing: its earlier process,
        cut off with its host (a partition longer than Ray's health checks: Ray starts the shard
        elsewhere while the old one lives on, and stops it once its host is back), must not write
        beside it, and a refusal made the restart fail for good (Ray does not retry a failed
        start; a walkthrough's shard never served again). Said in the log every LOCK_SAY_SECONDS."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        said = -math.inf
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                if not wait:
                    os.close(fd)
                    raise FailedPreconditionError(f"data directory {path.parent} is in use by another memserver shard "
                                                  f"(pid {holder}); stop that cluster, or give this one another "
                                                  "--data-dir") from None
                if time.monotonic() - said >= LOCK_SAY_SECONDS:
                    said = time.monotonic()
                    log.warning("data directory %s is held by pid %s (this shard's earlier process, on a host cut off?): "
                                "waiting for it to stop before serving", path.parent, holder)
                time.sleep(LOCK_POLL_SECONDS)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        return fd

    def close(self) -> None:
        """Let go of the folder's lock (the shard stopped)."""
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1

    def table_dir(self, name: str) -> Path:
        """The folder of table `name` in this shard's directory; a name that is no table name
        (`..`, `a/b`, "") is refused, so a drop or a record never reaches another folder."""
        return self.dir / check_table_name(name)

    def records(self) -> tuple[list[dict[str, Any]], dict[str, str]]:
        """(the table records here, table name -> why its record cannot be read)."""
        out, unreadable = [], {}
        for p in sorted(self.dir.glob("*/table.json")):
            try:
                record = json.loads(p.read_text())
                if not isinstance(record, dict) or record.get("name") != p.parent.name:
                    raise ValueError(f"not the record of table {p.parent.name!r}")
                out.append(record)
            except (OSError, ValueError) as exc:
                log.error("unreadable table record %s: %s", p, exc)
                unreadable[p.parent.name] = f"its record {p} cannot be read ({exc})"
        return out, unreadable

    def remove_unfinished(self) -> tuple[list[tuple[str, int]], list[str]]:
        """Remove the table folders a create left before it recorded its table (a slice is recorded
        once allocated; a shard killed while a disk table's files were made left 199 MB nobody
        listed, for good: a walkthrough): a table's name, no record, and nothing in it but what
        a create makes first, all of it rebuilt by any create or restart (a disk table's working
        files, empty log segments, a record's temporary). Any other folder without a record is
        kept (an operator's copy, a table whose record was moved aside, a log with records):
        returned by name to be said. Returns ([(name, bytes removed)], [names kept])."""
        removed, kept = [], []
        for d in sorted(self.dir.iterdir()):
            try:
                if not d.is_dir() or d.is_symlink() or (d / "table.json").exists():
                    continue
                if not _a_table_name(d.name) or not all(_made_by_a_create(d, f) for f in d.rglob("*")):
                    kept.append(d.name)
                    continue
                nbytes = sum(f.lstat().st_size for f in d.rglob("*") if f.is_file())
                shutil.rmtree(d)
                removed.append((d.name, nbytes))
            except OSError:  # unreadable: left as it is (the shard starts whatever the folder holds)
                kept.append(d.name)
        return removed, kept

    def record(self, name: str) -> dict[str, Any] | None:
        path = self.table_dir(name) / "table.json"
        return json.loads(path.read_text()) if path.exists() else None

    def save(self, record: dict[str, Any]) -> None:
        d = self.table_dir(record["name"])
        atomic_write(d / "table.json", lambda f: f.write(json.dumps(record, indent=1).encode()))

    def drop(self, name: str) -> None:
        shutil.rmtree(self.table_dir(name), ignore_errors=True)


def _a_table_name(name: str) -> bool:
    try:
        check_table_name(name)
    except ValueError:
        return False
    return True


def _made_by_a_create(table_dir: Path, f: Path) -> bool:
    """Whether `f` (below `table_dir`) is what a create makes before its record: nothing a
    restart or a restore would not make again."""
    rel = f.relative_to(table_dir)
    if f.is_symlink():
        return False
    if f.is_dir():
        return rel == Path("disk")
    return (rel in (Path("disk/rows.dat"), Path("disk/stats.dat")) or rel.name.startswith(".table.json.tmp-")
            or (rel.parent == Path(".") and rel.name.startswith("wal-") and rel.suffix == ".log" and f.stat().st_size == 0))


def held_slices(root: str | os.PathLike[str]) -> dict[int, list[str]]:
    """The tables a data directory keeps slices of, by shard index (what a restart recovers)."""
    held: dict[int, list[str]] = {}
    for p in Path(root).glob("shard-*/*/table.json"):
        try:
            index = int(p.parent.parent.name.removeprefix("shard-"))
        except ValueError:
            continue
        held.setdefault(index, []).append(p.parent.name)
    return held


def check_data_dir(root: str | os.PathLike[str], num_shards: int) -> None:
    """Refuse (ValueError) to start `num_shards` shards on a data directory whose tables have
    slices kept by more shards: shard i loads only `shard-i`, so the slices of the others would
    be left out and their tables with them (and a new table of the same name would meet a
    stale slice). More shards than before is fine: the new ones start empty."""
    if not os.fspath(root):  # (Path("") is ".": the current directory, unsaid)
        raise ValueError("data directory: an empty path (it would be the current directory); give a directory's path")
    path = Path(root)
    if path.exists() and not path.is_dir():
        raise ValueError(f"data directory {path}: not a directory")
    existing = path.absolute()
    while not existing.exists():  # what the shards will create their directories in
        existing = existing.parent
    if not existing.is_dir():  # (a file on the way: access() would call it unwritable)
        raise ValueError(f"data directory {path}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):  # (a read-only mount too: access() says EROFS)
        raise ValueError(f"data directory {path}: {existing} is not writable here (a read-only mount, or "
                         "permissions); the shards keep their records and logs there")
    if not path.exists():  # made and removed here, as the shards would make it: a path no one can make
        # (under /proc) failed inside a shard; a refused `up` leaves nothing behind. One level at a
        # time, each removed only if still empty: nothing another process put there goes
        full = Path(os.path.abspath(path))  # ("m/../e" as the shards resolve it)
        missing = [p for p in (full, *full.parents) if not p.exists()][::-1]
        made: list[Path] = []
        try:
            for level in missing:
                level.mkdir()
                made.append(level)
        except OSError as exc:
            raise ValueError(f"data directory {path}: cannot be made ({exc.strerror})") from None
        finally:
            for level in reversed(made):
                with contextlib.suppress(OSError):
                    level.rmdir()
    for lock in sorted(path.glob(f"shard-*/{LOCK_FILE}")):  # a folder a running shard serves: said before any starts
        try:
            os.close(ShardStore._take(lock))  # free: let go at once
        except FailedPreconditionError as exc:
            raise ValueError(exc.details) from None
    held = held_slices(path)
    beyond = {i: names for i, names in held.items() if i >= num_shards}
    if beyond:  # each shard with its own tables (one name over all of them said that it kept them all)
        def kept(names: list[str]) -> str:
            names = sorted(names)
            return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")

        shards = [f"shard-{i:04d} keeps {kept(beyond[i])}" for i in sorted(beyond)]
        shards = shards[:3] + ([f"and {len(shards) - 3} more"] if len(shards) > 3 else [])
        raise ValueError(f"data directory {path} holds table slices of {max(held) + 1} shards ({'; '.join(shards)}); "
                         f"start at least {max(held) + 1} shards on it, or give another data directory")


def table_record(spec: bytes, info: bytes, num_shards: int, base_files: list[dict[str, Any]] | None) -> dict[str, Any]:
    """A new slice's record: serialized TableSpec and ShardInfo, and the files it was restored from."""
    return {
        "name": pb.TableSpec.FromString(spec).name,
        "spec": base64.b64encode(spec).decode(),
        "info": base64.b64encode(info).decode(),
        "num_shards": num_shards,
        "base_files": base_files or [],
        "checkpoints": [],
    }


def committed(checkpoint: dict[str, Any]) -> bool:
    """Whether a slice checkpoint belongs to a complete checkpoint (its manifest was written)."""
    return (Path(checkpoint["file"]).parent.parent / MANIFEST).exists()


def committed_checkpoints(record: dict[str, Any]) -> list[dict[str, Any]]:
    """A slice's checkpoints that belong to complete checkpoints, oldest first (at most
    KEEP_CHECKPOINTS). One whose file is gone since stays listed: its recovery fails as a damaged
    file's does (skipping it brought one slice back from an older step than its siblings, or a
    table without a log back as its initial values, and said nothing)."""
    return [c for c in record.get("checkpoints", []) if committed(c)]


def latest_committed(record: dict[str, Any]) -> dict[str, Any] | None:
    done = committed_checkpoints(record)
    return done[-1] if done else None
