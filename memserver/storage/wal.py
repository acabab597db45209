"""The write-ahead log of one table slice: `wal-<lsn>.log` segments of records, each an applied
write as the request that caused it, appended and fsynced (group commit) before the shard
acknowledges the write.

A segment is named after the lsn of its first record (the log's `next_lsn` when it was opened),
and holds the records up to the next segment's name: after a checkpoint at lsn N, `rotate` opens
`wal-N.log` (possibly left empty), so the log after every checkpoint starts in a segment of its own.

Recovery (memserver.server.shard_actor) replays the records after the checkpoint it loaded
through the same code that applied them first, so the table, its optimizer state and the
exactly-once window come back as they were; `read_log` raises `LogGapError` when the log does
not continue where that checkpoint ends.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import shlex
import struct
import threading
import zlib
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

from memserver.storage.fsutil import fsync_dir

log = logging.getLogger(__name__)

#: Record header: magic, crc32 of (kind + payload), lsn, length of (kind + payload).
_HEADER = struct.Struct("<4sIQI")
_MAGIC = b"MSW1"
#: Record kinds: the request message each one carries.
BAG_BACKWARD, PUSH_GRADIENTS, WRITE_ROWS, COMMIT_STEP, ADD, REMOVE, LOAD_PRODUCT_KEYS = 1, 2, 3, 4, 5, 6, 7
#: The call each kind is (in messages).
RECORD_CALLS = {BAG_BACKWARD: "BagBackward", PUSH_GRADIENTS: "PushGradients", WRITE_ROWS: "WriteRows",
                COMMIT_STEP: "CommitStep", ADD: "Add", REMOVE: "Remove", LOAD_PRODUCT_KEYS: "LoadProductKeys"}


class LogGapError(RuntimeError):
    """The log does not hold every record from `expected` on: replaying it would silently lose
    acknowledged writes. `expected` is the lsn replay needs next (the checkpoint's lsn, or the one
    after the last record read), `found` the first lsn the log has after it (a record's, or the
    name of a later segment), or None when the log ends before `expected`."""

    def __init__(self, expected: int, found: int | None, where: str | os.PathLike[str] = "") -> None:
        self.expected, self.found, self.where = expected, found, str(where)
        after = f"continues at record {found}" if found is not None else "ends before it"
        super().__init__(f"write-ahead log {self.where}: record {expected} is missing (the log {after})")

    def __reduce__(self):  # picklable (it may cross a Ray actor boundary)
        return type(self), (self.expected, self.found, self.where)


class WriteAheadLog:
    """Append-only log of one table slice with group commit.

    `append` (on the shard's compute thread) writes a record and returns its log sequence number;
    a flusher thread fsyncs whatever has been written since its last fsync in one go and resolves
    the futures of every record that fsync covered, so concurrent writers share one disk flush.

    A failed write (disk full) or fsync stops the log: `failed` returns the error, `append`
    raises from then on, and no record after the failure is ever acknowledged. `close` may be
    called from any thread while another appends.
    """

    def __init__(self, directory: Path, next_lsn: int = 0) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.next_lsn = next_lsn  # the lsn the next record gets
        self.durable_lsn = next_lsn  # every record below this is on disk
        self.bytes_written = 0  # by this process (as `records_written` and `syncs`: the metrics' counters)
        self.records_written = 0
        self.syncs = 0
        self._cond = threading.Condition()
        self._waiters: list[tuple[int, Future[None]]] = []
        self._retired: list[int] = []  # descriptors of earlier segments: synced and closed by the flusher
        self._error: BaseException | None = None  # what stopped the log (see `failed`)
        self._broken_at: int | None = None  # no record at or after this lsn is ever acknowledged
        self._closed = False  # no more appends (close was called)
        self._done = False  # the flusher has exited: nothing more becomes durable
        self._fds_closed = False
        # what a killed process wrote and never fsynced is durable before anything counts on it: a
        # restart's replay took those records as on disk (a retry of one was acknowledged from them), and
        # a power loss then cut them, a gap before the new segment's records (the slice lost: a hunt)
        for _, path in _segments(self.dir):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self._fd, self._seg_size = self._open_segment(next_lsn)
        self._thread = threading.Thread(target=self._flush_loop, name=f"wal-{directory.name}", daemon=True)
        self._thread.start()

    def _open_segment(self, lsn: int) -> tuple[int, int]:
        """The descriptor of segment `lsn` (created if new) and its size."""
        fd = os.open(self.dir / f"wal-{lsn:016d}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            size = os.fstat(fd).st_size
            fsync_dir(self.dir)
        except BaseException:
            os.close(fd)
            raise
        return fd, size

    def _closed_error(self) -> OSError:
        return OSError(errno.EBADF, f"write-ahead log {self.dir} is closed")

    def append(self, kind: int, payload: bytes) -> int:
        """Write one record and return its lsn (not yet durable: see `durable`).

        Raises OSError: the log is closed ("... is closed"), failed earlier ("... failed
        earlier: ..."), or this write failed (the OSError of `os.write`, e.g. ENOSPC). A failed
        write leaves no part of its record in the log and stops the log (see `failed`)."""
        head = bytes([kind])
        crc = zlib.crc32(payload, zlib.crc32(head))
        with self._cond:
            if self._closed:
                raise self._closed_error()
            if self._error is not None:
                raise OSError(f"write-ahead log {self.dir} failed earlier: {self._error}")
            lsn = self.next_lsn
            record = b"".join((_HEADER.pack(_MAGIC, crc, lsn, 1 + len(payload)), head, payload))
            start = self._seg_size
            try:
                self._write_all(record)
            except OSError as exc:
                self._write_failed(exc, lsn, start)
                raise
            self._seg_size = start + len(record)
            self.next_lsn = lsn + 1
            self.bytes_written += len(record)
            self.records_written += 1
            self._cond.notify_all()
            return lsn

    def _write_all(self, record: bytes) -> None:
        view = memoryview(record)
        while view:
            n = os.write(self._fd, view)
            if n <= 0:
                raise OSError(errno.EIO, f"write-ahead log {self.dir}: a write of {len(view)} bytes wrote nothing")
            view = view[n:]

    def _write_failed(self, exc: OSError, lsn: int, start: int) -> None:
        """(holding the lock) Cut the partial record off and stop the log at `lsn`."""
        try:
            os.ftruncate(self._fd, start)
        except OSError:  # the torn bytes stay, but as the log's tail (nothing follows): recovery cuts them
            log.exception("write-ahead log %s: could not cut a partial record off", self.dir)
        log.error("write-ahead log %s: writing record %d failed (%s); no further write of this table is accepted",
                  self.dir, lsn, exc)
        exc.filename = exc.filename or str(self.dir)  # (os.write names no file: the call's error and status say where)
        # the call's error says what follows (a walkthrough resent the write after freeing space, and
        # every write was refused on): the log has stopped, and only a restart starts a new one
        exc.strerror = (f"{exc.strerror or os.strerror(exc.errno or errno.EIO)}; the table's write-ahead log stopped: its "
                        "writes are refused until the shard restarts (free or fix the disk first)")
        self._error = exc
        self._broken_at = lsn
        failed = [(n, f) for n, f in self._waiters if n >= lsn]  # futures of records never written
        self._waiters = [(n, f) for n, f in self._waiters if n < lsn]
        for _, f in failed:
            f.set_exception(exc)
        self._cond.notify_all()

    @property
    def failed(self) -> BaseException | None:
        """The write or fsync error that stopped this log (writes must then be refused), or None."""
        return self._error

    def durable(self, lsn: int) -> Future[None]:
        """A future that completes once every record up to `lsn` (inclusive) is fsynced. It fails
        with the log's error if that record is at or after a failed write or fsync, and with
        the "... is closed" OSError if the log was closed before the record was fsynced. Running
        from the start, so no waiter can cancel it: a gRPC write cancelled while it awaited this
        (its client gave up: `asyncio.wrap_future` passes the cancel on) left the log thread an
        InvalidStateError as it set the result, which killed it, and every later write of the
        table was refused "write-ahead log ... is closed" (a suite run caught it)."""
        fut: Future[None] = Future()
        fut.set_running_or_notify_cancel()
        with self._cond:
            if lsn < self.durable_lsn:
                fut.set_result(None)
            elif self._broken_at is not None and lsn >= self._broken_at and self._error is not None:
                fut.set_exception(self._error)
            elif self._done or (self._closed and lsn >= self.next_lsn):
                fut.set_exception(self._closed_error())
            else:
                self._waiters.append((lsn, fut))
                self._cond.notify_all()
        return fut

    def _flush_loop(self) -> None:
        try:
            self._flush_until_closed()
        finally:
            with self._cond:
                self._done = True
                left, self._waiters = self._waiters, []
                if self._closed:
                    self._close_fds()
            for _, f in left:  # nothing more becomes durable
                if not f.done():
                    f.set_exception(self._error if self._broken_at is not None and self._error else self._closed_error())

    def _flush_until_closed(self) -> None:
        while True:
            with self._cond:
                while not self._closed and self.durable_lsn == self.next_lsn and not self._retired:
                    self._cond.wait()
                if self.durable_lsn == self.next_lsn and not self._retired:
                    return  # closed, and everything written is on disk
                # Everything below `upto` is in the retired segments or the current one.
                upto, fd, retired, self._retired = self.next_lsn, self._fd, self._retired, []
            try:
                while retired:
                    os.fdatasync(retired[0])
                    os.close(retired.pop(0))
                os.fdatasync(fd)
            except OSError as exc:  # the disk failed: nothing after this point is acknowledged
                exc.filename = exc.filename or str(self.dir)
                log.exception("write-ahead log %s: fsync failed; no further write of this table is acknowledged", self.dir)
                with self._cond:
                    self._retired = retired + self._retired  # close() closes them
                    self._error = self._error or exc
                    self._broken_at = min(self.durable_lsn, self._broken_at if self._broken_at is not None else upto)
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
            if self._closed:
                raise self._closed_error()
            # the old segment whole on disk before a newer one exists: recovery takes a torn record only
            # at the end of the last segment (one torn here, before an empty new segment, lost the slice: a hunt)
            os.fsync(self._fd)
            fd, size = self._open_segment(self.next_lsn)
            self._retired.append(self._fd)
            self._fd, self._seg_size = fd, size
            self._cond.notify_all()
        self.durable(self.next_lsn - 1).result()  # everything in the old segment is on disk
        if drop_before is not None:
            segments = _segments(self.dir)
            for (_, path), (next_start, _) in zip(segments, segments[1:]):
                if next_start <= drop_before:  # every record of this segment is below drop_before
                    path.unlink(missing_ok=True)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the log: wait for an append in progress, refuse later ones ("... is closed"), fsync
        what was written and close the files. `durable` futures of records that final fsync covered
        complete, every other pending one fails (none is left waiting). Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
        with self._cond:
            if not self._thread.is_alive():
                self._close_fds()  # (the flusher did if it saw the log closed)
                return
            # An fsync that does not return: its descriptors stay open until it does (the flusher
            # then closes them), the records it covers are not acknowledged.
            log.error("write-ahead log %s: fsync still running after %.0f s at close", self.dir, timeout)
            left, self._waiters = self._waiters, []
        for _, f in left:
            f.set_exception(self._closed_error())

    def _close_fds(self) -> None:
        """(holding the lock, with no flush running) Close the segment descriptors once."""
        if self._fds_closed:
            return
        self._fds_closed = True
        for fd in [*self._retired, self._fd]:
            try:
                os.close(fd)
            except OSError:
                log.exception("write-ahead log %s: closing a segment failed", self.dir)
        self._retired = []


def reaches(directory: Path, lsn: int) -> bool:
    """Whether the log holds a segment starting at or after `lsn`: a checkpoint's rotate starts
    one at its position, so a log without one lost the records written after that checkpoint
    (replaying from an older one would end early without noticing)."""
    return any(start >= lsn for start, _ in _segments(directory))


def has_log(directory: Path) -> bool:
    """Whether a log is there: a table's log has a segment from its making on (WriteAheadLog
    opens one at once, and a cut keeps the newest), so none at all means it was removed."""
    return bool(_segments(directory))


def last_written(directory: Path) -> float:
    """When the log was last written (its newest segment's mtime; 0.0 without one): no record in
    it is younger."""
    segments = _segments(directory)
    return segments[-1][1].stat().st_mtime if segments else 0.0


def _segments(directory: Path) -> list[tuple[int, Path]]:
    out = []
    for p in directory.glob("wal-*.log"):
        try:
            out.append((int(p.stem.removeprefix("wal-")), p))
        except ValueError:
            continue
    return sorted(out)


def _scan(path: Path) -> Iterator[tuple[int, int, int, bytes]]:
    """(position, lsn, kind, payload) of each intact record of one segment, in order; stops at
    the first torn or damaged one. Streams the file: memory holds one record at a time."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        pos = 0
        while pos + _HEADER.size <= size:
            header = f.read(_HEADER.size)
            if len(header) != _HEADER.size:
                return
            magic, crc, lsn, length = _HEADER.unpack(header)
            if magic != _MAGIC or length < 1 or pos + _HEADER.size + length > size:
                return  # (a garbage length is never allocated)
            head = f.read(1)
            payload = f.read(length - 1)
            if len(head) != 1 or len(payload) != length - 1 or zlib.crc32(payload, zlib.crc32(head)) != crc:
                return
            yield pos, lsn, head[0], payload
            pos += _HEADER.size + length


def _intact_end(path: Path) -> tuple[int | None, int]:
    """(lsn after the last intact record or None if it has none, byte length of the intact records) of a segment."""
    end, good = None, 0
    for pos, lsn, _, payload in _scan(path):
        end, good = lsn + 1, pos + _HEADER.size + 1 + len(payload)
    return end, good


def read_log(directory: Path, start_lsn: int) -> Iterator[tuple[int, int, bytes]]:
    """Yield (lsn, kind, payload) of every record with lsn >= start_lsn, in order, streaming
    (memory holds one record). Segments holding only earlier records are not read.

    Raises LogGapError (possibly after yielding some records) when the records from start_lsn on
    are not contiguous: no record start_lsn and no segment named start_lsn (an empty log is fine
    for start_lsn 0), or a record or segment missing later. Raises RuntimeError when a record
    before the last segment is damaged. A torn record at the end of the last segment ends the
    log (call `repair_log` first to cut it, so that the log continues after the last record).
    """
    segments = _segments(directory)
    if not segments:
        if start_lsn != 0:
            raise LogGapError(start_lsn, None, directory)
        return
    # The segment holding start_lsn: the last one named at or before it (names are first lsns).
    first = max((i for i, (s, _) in enumerate(segments) if s <= start_lsn), default=0)
    reached = segments[first][0] == start_lsn  # a segment starts there (maybe empty, e.g. after rotate)
    expected = start_lsn
    for i in range(first, len(segments)):
        seg_start, path = segments[i]
        if seg_start > expected:
            raise LogGapError(expected, seg_start, directory)
        good = 0
        for pos, lsn, kind, payload in _scan(path):
            good = pos + _HEADER.size + 1 + len(payload)
            if lsn < expected:
                if i == first and lsn < start_lsn:
                    continue  # before start_lsn in the segment holding it
                raise RuntimeError(f"write-ahead log {path}: record {lsn} after record {expected - 1}; the log is damaged")
            if lsn != expected:
                raise LogGapError(expected, lsn, directory)
            reached = True
            yield lsn, kind, payload
            expected += 1
        if i != len(segments) - 1 and good != path.stat().st_size:
            raise RuntimeError(f"write-ahead log {path}: damaged record at byte {good} before the last segment")
    if not reached:
        raise LogGapError(start_lsn, None, directory)


def log_end(directory: Path) -> int:
    """The lsn after the last intact record of the log (where it continues): the last segment's
    name if it holds no intact record, 0 for an empty log. Reads only the last segment."""
    segments = _segments(directory)
    if not segments:
        return 0
    start, path = segments[-1]
    end, _ = _intact_end(path)
    return start if end is None else end


def repair_log(directory: Path) -> int:
    """Cut a torn record off the end of the log and return `log_end` (the lsn after the last
    intact record). Reads only the last segment, streaming.

    Only the tail can be torn (records are appended and fsynced in order; a failed write is cut
    by the writer) and a torn record was never acknowledged, so dropping it loses nothing. A
    damaged record followed by an intact one is not a torn tail but real corruption, which would
    lose acknowledged records: RuntimeError, nothing cut (as `read_log` raises on damage before
    the last segment).
    """
    segments = _segments(directory)
    if not segments:
        return 0
    start, path = segments[-1]
    end, good = _intact_end(path)
    size = path.stat().st_size
    if good != size:
        later = _next_intact(path, good)
        if later is not None:  # damage with acknowledged records after it: cutting would lose them
            raise RuntimeError(
                f"write-ahead log {path}: damaged record at byte {good}, followed by intact record {later[1]} at byte "
                f"{later[0]}: not a torn tail, so records after it may have been acknowledged. If the shard's host "
                f"lost power (then nothing after the damage was synced, so none of it was acknowledged), cut the log "
                f"there with the cluster down (`truncate -s {good} {shlex.quote(str(path))}`) and start it again; else restore the "
                "table from a checkpoint")
        if _whole_but_damaged(path, good, size):  # fsynced whole before it was acknowledged, then damaged
            raise RuntimeError(
                f"write-ahead log {path}: the last record, at byte {good}, is whole but does not match its checksum: "
                "it was damaged after it was written (a torn write leaves a record short, or zeros where it did not "
                "reach the disk), so it may have been acknowledged. If the shard's host lost power, cut it with the "
                f"cluster down (`truncate -s {good} {shlex.quote(str(path))}`) and start it again; else restore the "
                "table from a checkpoint")
        log.warning("write-ahead log %s: cutting %d bytes of a torn record (never acknowledged)", path, size - good)
        os.truncate(path, good)
    return start if end is None else end


#: The unit a write reaches the disk in: a record torn by a power loss has whole sectors of zeros
#: where its data did not get to the disk (the file's size did).
SECTOR = 512


def _whole_but_damaged(path: Path, at: int, size: int) -> bool:
    """Whether the bytes from `at` on (the segment's last, failing record) are one whole record,
    filling the file to its end, with no zeros where a torn write leaves them: a record that
    reached the disk whole and was damaged since, which its writer had fsynced and may have
    acknowledged. A torn one is short of its length, or has a sector of zeros (its size reached
    the disk, some of its data did not): any 512-byte-aligned piece of it from its first sector
    boundary to the end of the file, the last piece however short (or, for a record inside one
    sector, its body) all zeros."""
    if size - at < _HEADER.size:
        return False
    with open(path, "rb") as f:
        f.seek(at)
        magic, _, _, length = _HEADER.unpack(f.read(_HEADER.size))
        if magic != _MAGIC or at + _HEADER.size + length != size:
            return False
        first = -(-at // SECTOR) * SECTOR  # the record's first sector boundary
        if first >= size:  # the whole record inside one sector: its body
            return any(f.read(size - at - _HEADER.size))
        f.seek(first)
        for piece in range(first, size, SECTOR):
            if not any(f.read(min(SECTOR, size - piece))):
                return False
    return True


def _next_intact(path: Path, after: int) -> tuple[int, int] | None:
    """(byte, lsn) of the first intact record starting past byte `after` of a segment, or None:
    a torn tail has none (it is the one record being written), damage inside the log does.
    Looks at every place the record magic appears, through a mapping (memory holds one candidate
    record at a time)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size <= after + _HEADER.size:
            return None
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            at = m.find(_MAGIC, after + 1)
            while 0 <= at and at + _HEADER.size < size:
                _, crc, lsn, length = _HEADER.unpack_from(m, at)
                body_at = at + _HEADER.size
                if 1 <= length <= size - body_at and zlib.crc32(m[body_at : body_at + length]) == crc:
                    return at, lsn
                at = m.find(_MAGIC, at + 1)
    return None
