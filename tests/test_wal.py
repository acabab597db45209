"""The write-ahead log alone (no shard): failed writes, close while appending, gaps, streaming reads."""

from __future__ import annotations

import errno
import os
import pickle
import threading
import time
import tracemalloc

import pytest

import memserver.storage.wal as walmod
from memserver.storage.wal import PUSH_GRADIENTS, LogGapError, WriteAheadLog, log_end, read_log, repair_log


def _lsns(directory, start=0):
    return [lsn for lsn, _, _ in read_log(directory, start)]


def _segment(directory, lsn):
    return directory / f"wal-{lsn:016d}.log"


# -- a failed write -------------------------------------------------------------------------


def test_a_short_write_then_a_full_disk_leaves_only_whole_records(tmp_path, monkeypatch):
    wal = WriteAheadLog(tmp_path)
    for i in range(3):
        wal.append(PUSH_GRADIENTS, b"before-%d" % i)
    before = wal.durable(2)  # pending or done: either way it must complete normally
    never = wal.durable(3)  # the record that will not be written
    real_write, calls = os.write, []

    def disk_full(fd, data):  # writes half the record, then the disk is full
        if fd != wal._fd:
            return real_write(fd, data)
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(walmod.os, "write", disk_full)
    with pytest.raises(OSError) as raised:
        wal.append(PUSH_GRADIENTS, b"x" * 1000)
    monkeypatch.undo()
    assert raised.value.errno == errno.ENOSPC
    assert raised.value.filename == str(tmp_path)  # (os.write names none: the shard's status and error say where)
    assert str(raised.value) == (f"[Errno {errno.ENOSPC}] No space left on device; the table's write-ahead log stopped: "
                                 "its writes are refused until the shard restarts (free or fix the disk first): "
                                 f"'{tmp_path}'")
    record = walmod._HEADER.size + 1 + 1000
    assert calls == [record, record - record // 2]  # the rest of the record was tried after the short write
    assert isinstance(wal.failed, OSError) and wal.failed.errno == errno.ENOSPC
    with pytest.raises(OSError, match="failed earlier"):
        wal.append(PUSH_GRADIENTS, b"refused")
    assert wal.next_lsn == 3
    before.result(10)
    wal.durable(2).result(10)
    with pytest.raises(OSError) as lost:
        never.result(10)
    assert lost.value.errno == errno.ENOSPC
    with pytest.raises(OSError):
        wal.durable(3).result(10)
    wal.close()

    seg = _segment(tmp_path, 0)
    size = seg.stat().st_size
    assert list(read_log(tmp_path, 0)) == [(i, PUSH_GRADIENTS, b"before-%d" % i) for i in range(3)]
    assert repair_log(tmp_path) == 3
    assert seg.stat().st_size == size  # nothing was left to cut
    wal = WriteAheadLog(tmp_path, 3)
    assert wal.append(PUSH_GRADIENTS, b"after") == 3
    wal.durable(3).result(10)
    wal.close()
    assert _lsns(tmp_path) == [0, 1, 2, 3]


def test_a_write_that_writes_nothing_fails_the_log(tmp_path, monkeypatch):
    wal = WriteAheadLog(tmp_path)
    wal.append(PUSH_GRADIENTS, b"ok")
    monkeypatch.setattr(walmod.os, "write", lambda fd, data: 0)
    with pytest.raises(OSError, match="wrote nothing"):
        wal.append(PUSH_GRADIENTS, b"lost")
    monkeypatch.undo()
    assert wal.failed is not None
    wal.durable(0).result(10)
    wal.close()
    assert _lsns(tmp_path) == [0]


# -- close while another thread appends ---------------------------------------------------


def test_close_while_another_thread_appends(tmp_path):
    for round_ in range(20):
        directory = tmp_path / f"r{round_}"
        wal = WriteAheadLog(directory)
        lsns, futures, errors = [], [], []
        started = threading.Event()

        def writer(wal=wal, lsns=lsns, futures=futures, errors=errors, started=started):
            try:
                while True:
                    lsn = wal.append(PUSH_GRADIENTS, b"p" * 200)
                    lsns.append(lsn)
                    futures.append(wal.durable(lsn))
                    started.set()
            except OSError as exc:
                if "is closed" not in str(exc):
                    errors.append(exc)
            except BaseException as exc:  # noqa: B036 - anything else is a failure of the test
                errors.append(exc)
            finally:
                started.set()

        t = threading.Thread(target=writer)
        t.start()
        assert started.wait(10)
        time.sleep(0.0005 * (round_ % 5))
        beyond = wal.durable(10**9)  # a record never written: must fail, not hang
        wal.close()
        t.join(10)
        assert not t.is_alive(), "the appending thread hangs"
        assert errors == []
        with pytest.raises(OSError, match="is closed"):
            wal.append(PUSH_GRADIENTS, b"late")
        with pytest.raises(OSError, match="is closed"):
            beyond.result(10)
        for f in futures:  # every record appended before close was fsynced by the final flush
            assert f.exception(timeout=10) is None
        assert lsns == list(range(len(lsns))) and lsns
        assert _lsns(directory) == lsns
        wal.close()  # twice is fine


# -- gaps ------------------------------------------------------------------------------------


def test_a_waiter_that_gives_up_leaves_the_log_working(tmp_path, monkeypatch):
    """A gRPC write cancelled while it awaited its record's fsync (`asyncio.wrap_future` passes
    the cancel on to the future) cancelled the future under the log's thread, which then died of
    InvalidStateError setting its result: every later write of the table was refused "write-ahead
    log ... is closed" (a suite run). The future runs from the start: no waiter cancels it."""
    import asyncio

    slow = threading.Event()
    real = os.fdatasync
    monkeypatch.setattr(walmod.os, "fdatasync", lambda fd: slow.wait(5) and real(fd))
    wal = WriteAheadLog(tmp_path)
    pending = wal.durable(wal.append(PUSH_GRADIENTS, b"a"))

    async def give_up() -> None:
        waiter = asyncio.ensure_future(asyncio.wrap_future(pending))
        await asyncio.sleep(0.05)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter

    asyncio.run(give_up())
    assert not pending.cancelled()
    slow.set()
    pending.result(10)
    wal.durable(wal.append(PUSH_GRADIENTS, b"b")).result(10)  # the log still takes and fsyncs writes
    assert wal.failed is None and _lsns(tmp_path) == [0, 1]
    wal.close()


def _three_segments(directory):
    """wal-0: 0-2, wal-3: 3-4, wal-5: 5 (two checkpoints, at lsn 3 and 5)."""
    wal = WriteAheadLog(directory)
    for _ in range(3):
        wal.append(PUSH_GRADIENTS, b"a")
    wal.rotate(None)
    for _ in range(2):
        wal.append(PUSH_GRADIENTS, b"b")
    wal.rotate(None)
    wal.durable(wal.append(PUSH_GRADIENTS, b"c")).result(10)
    wal.close()


def test_a_missing_middle_segment_is_a_gap(tmp_path):
    _three_segments(tmp_path)
    _segment(tmp_path, 3).unlink()
    got = []
    with pytest.raises(LogGapError) as gap:
        for lsn, _, _ in read_log(tmp_path, 0):
            got.append(lsn)
    assert got == [0, 1, 2]
    assert (gap.value.expected, gap.value.found) == (3, 5)
    with pytest.raises(LogGapError) as gap:
        list(read_log(tmp_path, 4))
    assert (gap.value.expected, gap.value.found) == (4, 5)
    assert _lsns(tmp_path, 5) == [5]  # a checkpoint at 5 needs nothing before it
    again = pickle.loads(pickle.dumps(gap.value))
    assert isinstance(again, LogGapError) and (again.expected, again.found) == (4, 5)


def test_a_log_that_starts_after_the_checkpoint_is_a_gap(tmp_path):
    _three_segments(tmp_path)
    _segment(tmp_path, 0).unlink()
    with pytest.raises(LogGapError) as gap:
        list(read_log(tmp_path, 0))
    assert (gap.value.expected, gap.value.found) == (0, 3)
    assert _lsns(tmp_path, 3) == [3, 4, 5]


def test_a_log_that_ends_before_the_checkpoint_is_a_gap(tmp_path):
    _three_segments(tmp_path)
    for start in (6, 9):  # no segment there: the one rotate made at the checkpoint is lost
        with pytest.raises(LogGapError) as gap:
            list(read_log(tmp_path, start))
        assert (gap.value.expected, gap.value.found) == (start, None)
    with pytest.raises(LogGapError):
        list(read_log(tmp_path / "none", 2))
    assert list(read_log(tmp_path / "none", 0)) == []  # a log never written


def test_a_checkpoint_then_rotate_is_no_gap(tmp_path):
    wal = WriteAheadLog(tmp_path)
    for _ in range(3):
        wal.append(PUSH_GRADIENTS, b"a")
    lsn = wal.next_lsn  # the checkpoint's position
    wal.rotate(None)
    wal.close()
    assert _lsns(tmp_path, lsn) == []  # the empty segment wal-3 says the log goes on at 3
    assert log_end(tmp_path) == repair_log(tmp_path) == 3
    wal = WriteAheadLog(tmp_path, 3)
    wal.append(PUSH_GRADIENTS, b"b")
    wal.rotate(3)  # checkpoint at 4, the one at 3 complete: wal-0 goes
    wal.close()
    assert sorted(p.name for p in tmp_path.glob("wal-*.log")) == ["wal-0000000000000003.log", "wal-0000000000000004.log"]
    assert _lsns(tmp_path, 3) == [3] and _lsns(tmp_path, 4) == []
    with pytest.raises(LogGapError):  # what the deleted segment held is gone
        list(read_log(tmp_path, 0))


def test_a_rotate_and_a_restart_make_what_the_log_holds_durable_before_going_on(tmp_path, monkeypatch):
    """Two orders a power loss could break (a hunt): `rotate` made the new segment before the old
    one's tail was fsynced (a torn record then sat before the last segment: the slice unrecoverable),
    and a restart's log took the segments a killed process had written, never fsynced, as durable
    (a retry acknowledged from them; then a gap before the new segment). Each is fsynced first now."""
    events: list[tuple[str, str]] = []
    real_fsync, real_open = os.fsync, os.open

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def opened(path, flags, *args):
        if flags & os.O_CREAT:
            events.append(("create", str(path)))
        return real_open(path, flags, *args)

    wal = WriteAheadLog(tmp_path)
    wal.append(PUSH_GRADIENTS, b"a")
    monkeypatch.setattr(walmod.os, "fsync", fsync)
    monkeypatch.setattr(walmod.os, "open", opened)
    wal.rotate(None)
    old, new = str(_segment(tmp_path, 0)), str(_segment(tmp_path, 1))
    assert events.index(("fsync", old)) < events.index(("create", new)), events
    wal.append(PUSH_GRADIENTS, b"b")  # (written, not waited for: a process killed now)
    events.clear()
    again = WriteAheadLog(tmp_path, 2)  # the restart, after its replay of records 0 and 1
    assert ("fsync", old) in events and ("fsync", new) in events, events
    assert events.index(("fsync", new)) < events.index(("create", str(_segment(tmp_path, 2)))), events
    again.close()
    monkeypatch.undo()
    wal.close()


def test_damage_before_the_last_segment_is_not_cut(tmp_path):
    _three_segments(tmp_path)
    seg = _segment(tmp_path, 3)
    data = bytearray(seg.read_bytes())
    data[-1] ^= 0xFF
    seg.write_bytes(bytes(data))
    assert repair_log(tmp_path) == 6  # only the last segment's tail is ever cut
    assert seg.stat().st_size == len(data)
    with pytest.raises(RuntimeError, match="damaged"):
        list(read_log(tmp_path, 0))


@pytest.mark.parametrize("where", ["payload", "header"])
def test_damage_inside_the_last_segment_is_not_cut_as_a_torn_tail(tmp_path, where):
    """Zeros over a record in the middle of the last segment (its payload, or its header so its
    length is lost too): the acknowledged records after it are intact, so this is corruption,
    refused with the place, and nothing is cut (the log was cut there, losing them silently)."""
    wal = WriteAheadLog(tmp_path)
    for i in range(10):
        wal.append(PUSH_GRADIENTS, b"record %d " % i * 50)
    wal.durable(9).result(10)
    wal.close()
    seg = _segment(tmp_path, 0)
    data = bytearray(seg.read_bytes())
    record = len(data) // 10
    at = 4 * record + (walmod._HEADER.size + 20 if where == "payload" else 0)
    data[at : at + 16] = bytes(16)
    seg.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match=f"damaged record at byte {4 * record}, followed by intact record 5 at "
                                           f"byte {5 * record}: not a torn tail"):
        repair_log(tmp_path)
    assert seg.read_bytes() == bytes(data)
    data[-3:] = bytes(3)  # and damage at the very end, after the middle's: still refused
    seg.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match="not a torn tail"):
        repair_log(tmp_path)


@pytest.mark.parametrize("how", ["flipped", "zero sectors", "100 zero bytes", "300 zero bytes", "short"])
def test_a_whole_last_record_that_fails_its_checksum_is_damage_not_a_torn_tail(tmp_path, how):
    """The last record reached the disk whole (its writer fsynced it, then acknowledged it) and a
    few of its bytes changed since: it was cut as "a torn record (never acknowledged)", an
    acknowledged write lost without a word, one shard of a cols table without it. Now it is
    refused with the cut to make by hand (as damage inside the log is). A torn write still is cut:
    one short of its length, or with sectors of zeros where its data did not reach the disk."""
    wal = WriteAheadLog(tmp_path)
    for i in range(3):
        wal.append(PUSH_GRADIENTS, os.urandom(3000) if i == 2 else b"small %d" % i)
    wal.durable(2).result(10)
    wal.close()
    seg = _segment(tmp_path, 0)
    data = bytearray(seg.read_bytes())
    last = len(data) - walmod._HEADER.size - 1 - 3000
    if how == "flipped":
        data[last + 1500 : last + 1504] = b"\xff\xff\xff\xff"
    elif how == "zero sectors":
        data[-1024:] = bytes(1024)
    elif how.endswith("zero bytes"):  # a tail shorter than a sector (a 4 KiB block the record reached into)
        n = int(how.split()[0])
        data = data[: len(data) - len(data) % 512 - n] + bytes(n + len(data) % 512)
    else:
        data = data[:-10]
    seg.write_bytes(bytes(data))
    if how == "flipped":
        with pytest.raises(RuntimeError, match=f"the last record, at byte {last}, is whole but does not match its "
                                               f"checksum: .*cut it with the cluster down \\(`truncate -s {last} "):
            repair_log(tmp_path)
        assert seg.read_bytes() == bytes(data)  # nothing cut
    else:
        assert repair_log(tmp_path) == 2 and seg.stat().st_size == last


# -- streaming reads -------------------------------------------------------------------------


def test_many_records_and_a_torn_tail_read_back(tmp_path):
    wal = WriteAheadLog(tmp_path)
    payloads = [os.urandom(i % 97) for i in range(5000)]
    for i, p in enumerate(payloads):
        wal.append(1 + i % 4, p)
        if i % 1000 == 999:
            wal.rotate(None)
    wal.durable(4999).result(10)
    wal.close()
    last = sorted(tmp_path.glob("wal-*.log"))[-1]
    with open(last, "ab") as f:
        f.write(walmod._HEADER.pack(walmod._MAGIC, 0, 5000, 10**9))  # a torn record claiming 1 GB
    assert list(read_log(tmp_path, 0)) == [(i, 1 + i % 4, p) for i, p in enumerate(payloads)]
    assert log_end(tmp_path) == 5000
    assert repair_log(tmp_path) == 5000
    assert last.stat().st_size == 0  # (the last segment, opened by the final rotate, held only the torn record)
    assert _lsns(tmp_path, 4321)[:2] == [4321, 4322]


def test_reading_a_large_log_holds_one_record_at_a_time(tmp_path):
    wal = WriteAheadLog(tmp_path)
    payload = bytes(range(256)) * 4096  # 1 MiB
    for i in range(50):
        wal.append(PUSH_GRADIENTS, payload[i:] + payload[:i])
    wal.close()
    tracemalloc.start()
    try:
        assert repair_log(tmp_path) == 50
        n = 0
        for lsn, _, p in read_log(tmp_path, 0):
            assert lsn == n and len(p) == len(payload) and p[:1] == payload[n : n + 1]
            n += 1
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert n == 50
    assert peak < 5 * 2**20, f"peak {peak / 2**20:.1f} MiB while reading a 50 MiB log"


def test_the_logs_counters_count_what_this_process_appended(tmp_path):
    """The metrics' records, bytes and fsyncs of a log count alike, from this process's start: the
    records counter read the log's position, so after a restart it said 3 records beside 0 bytes
    and 0 fsyncs (a hunt)."""
    wal = WriteAheadLog(tmp_path, 3)  # a restart's log, 3 records replayed
    assert (wal.records_written, wal.bytes_written, wal.syncs) == (0, 0, 0)
    wal.durable(wal.append(PUSH_GRADIENTS, b"abc")).result()
    assert wal.records_written == 1 and wal.next_lsn == 4 and wal.bytes_written > 0 and wal.syncs >= 1
    wal.close()
