"""The write-ahead log of one table slice: `wal-<lsn>.log` segments of records, each an applied
write as the request that caused it, appended and fsynced (group commit) before the shard
acknowledges the write.

Recovery (memserver.server.shard_actor) replays the records after the checkpoint it loaded
through the same code that applied them first, so the table, its optimizer state and the
exactly-once window come back as they were.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

from memserver.storage.fsutil import fsync_dir

log = logging.getLogger(__name__)

#: Record header: magic, crc32 of (kind + payload), lsn, payload length.
_HEADER = struct.Struct("<4sIQI")
_MAGIC = b"MSW1"
#: Record kinds: the request message each one carries.
BAG_BACKWARD, PUSH_GRADIENTS, WRITE_ROWS = 1, 2, 3


class WriteAheadLog:
    """Append-only log of one table slice with group commit.

    `append` (on the shard's compute thread) writes a record and returns its log sequence number;
    a flusher thread fsyncs whatever has been written since its last fsync in one go and resolves
    the futures of every record that fsync covered, so concurrent writers share one disk flush.
    """

    def __init__(self, directory: Path, next_lsn: int = 0) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.next_lsn = next_lsn  # the lsn the next record gets
        self.durable_lsn = next_lsn  # every record below this is on disk
        self.bytes_written = 0
        self.syncs = 0
        self._cond = threading.Condition()
        self._waiters: list[tuple[int, Future[None]]] = []
        self._retired: list[int] = []  # descriptors of earlier segments: synced and closed by the flusher
        self._error: BaseException | None = None
        self._closed = False
        self._fd = self._open_segment(next_lsn)
        self._thread = threading.Thread(target=self._flush_loop, name=f"wal-{directory.name}", daemon=True)
        self._thread.start()

    def _open_segment(self, lsn: int) -> int:
        fd = os.open(self.dir / f"wal-{lsn:016d}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        fsync_dir(self.dir)
        return fd

    def append(self, kind: int, payload: bytes) -> int:
        """Write one record (not yet durable: see `durable`)."""
        with self._cond:
            if self._error is not None:
                raise OSError(f"write-ahead log {self.dir} failed earlier: {self._error}")
            lsn = self.next_lsn
            body = bytes([kind]) + payload
            os.write(self._fd, _HEADER.pack(_MAGIC, zlib.crc32(body), lsn, len(body)) + body)
            self.next_lsn = lsn + 1
            self.bytes_written += _HEADER.size + len(body)
            self._cond.notify()
            return lsn

    @property
    def failed(self) -> BaseException | None:
        """The fsync error that stopped this log (writes must then be refused), or None."""
        return self._error

    def durable(self, lsn: int) -> Future[None]:
        """A future that completes once every record up to `lsn` (inclusive) is fsynced; it fails
        if an fsync failed (then nothing after it is acknowledged)."""
        fut: Future[None] = Future()
        with self._cond:
            if self._error is not None:
                fut.set_exception(self._error)
            elif lsn < self.durable_lsn:
                fut.set_result(None)
            else:
                self._waiters.append((lsn, fut))
                self._cond.notify()
        return fut

    def _flush_loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and self.durable_lsn == self.next_lsn and not self._retired:
                    self._cond.wait()
                if self._closed and self.durable_lsn == self.next_lsn and not self._retired:
                    return
                # Everything below `upto` is in the retired segments or the current one.
                upto, fd, retired, self._retired = self.next_lsn, self._fd, self._retired, []
            try:
                for old in retired:
                    os.fdatasync(old)
                    os.close(old)
                os.fdatasync(fd)
            except OSError as exc:  # the disk failed: nothing after this point is acknowledged
                log.exception("write-ahead log %s: fsync failed; no further write of this table is acknowledged", self.dir)
                with self._cond:
                    self._error = exc
                    failed, self._waiters = self._waiters, []
                for _, f in failed:
                    f.set_exception(exc)
                return
            with self._cond:
                self.syncs += 1
                self.durable_lsn = max(self.durable_lsn, upto)
                done = [(n, f) for n, f in self._waiters if n < upto]
                self._waiters = [(n, f) for n, f in self._waiters if n >= upto]
            for _, f in done:
                f.set_result(None)

    def rotate(self, drop_before: int | None) -> None:
        """Start a new segment at `next_lsn` (called at a checkpoint) and delete the segments that
        only hold records below `drop_before` (the newest complete checkpoint's position)."""
        with self._cond:
            self._retired.append(self._fd)
            self._fd = self._open_segment(self.next_lsn)
            self._cond.notify()
        self.durable(self.next_lsn - 1).result()  # everything in the old segment is on disk
        if drop_before is not None:
            segments = _segments(self.dir)
            for (_, path), (next_start, _) in zip(segments, segments[1:]):
                if next_start <= drop_before:  # every record of this segment is below drop_before
                    path.unlink(missing_ok=True)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=30)
        for fd in [*self._retired, self._fd]:
            os.close(fd)
        self._retired = []


def _segments(directory: Path) -> list[tuple[int, Path]]:
    out = []
    for p in directory.glob("wal-*.log"):
        try:
            out.append((int(p.stem.removeprefix("wal-")), p))
        except ValueError:
            continue
    return sorted(out)


def _scan(path: Path) -> Iterator[tuple[int, int, int, bytes]]:
    """(position, lsn, kind, payload) of each intact record of one segment; stops at a torn one."""
    data = path.read_bytes()
    pos = 0
    while pos + _HEADER.size <= len(data):
        magic, crc, lsn, length = _HEADER.unpack_from(data, pos)
        body = data[pos + _HEADER.size : pos + _HEADER.size + length]
        if magic != _MAGIC or len(body) != length or zlib.crc32(body) != crc:
            return
        yield pos, lsn, body[0], body[1:]
        pos += _HEADER.size + length


def read_log(directory: Path, start_lsn: int) -> Iterator[tuple[int, int, bytes]]:
    """Yield (lsn, kind, payload) of every intact record with lsn >= start_lsn, in order.

    Call `repair_log` first: it cuts a torn tail, so every record read here is whole.
    """
    expected = None
    for _, path in _segments(directory):
        for _, lsn, kind, payload in _scan(path):
            if expected is not None and lsn != expected:
                raise RuntimeError(f"write-ahead log {path}: lsn {lsn} follows {expected - 1}; the log is damaged")
            expected = lsn + 1
            if lsn >= start_lsn:
                yield lsn, kind, payload


def repair_log(directory: Path) -> int:
    """Cut a torn record off the end of the log and return the lsn after the last intact record.

    Only the tail can be torn (records are appended and fsynced in order) and a torn record was
    never acknowledged, so dropping it loses nothing. A damaged record before the last segment's
    end is real corruption and raises.
    """
    end = 0
    segments = _segments(directory)
    for i, (start, path) in enumerate(segments):
        size = path.stat().st_size
        good = 0
        for pos, lsn, _, payload in _scan(path):
            good = pos + _HEADER.size + 1 + len(payload)
            end = lsn + 1
        if good != size:
            if i != len(segments) - 1:
                raise RuntimeError(f"write-ahead log {path}: damaged record at byte {good} before the last segment")
            log.warning("write-ahead log %s: cutting %d bytes of a torn record (never acknowledged)", path, size - good)
            os.truncate(path, good)
        end = max(end, start)
    return end
