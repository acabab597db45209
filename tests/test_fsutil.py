"""atomic_write holds Ctrl-C and SIGTERM until the file is in place (memserver.storage.fsutil)."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from memserver.storage.fsutil import atomic_write


@pytest.fixture
def sigterm_calls():
    """SIGTERM's handler for the test: counts its calls, restored after."""
    calls: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    yield calls
    signal.signal(signal.SIGTERM, before)


def test_a_signal_during_a_write_waits_for_the_file_then_reaches_its_handler(tmp_path, sigterm_calls):
    """memtrain's SIGTERM raised inside torch.save's zip writer: the writer failed on its end record
    (RuntimeError, exit 1 and a traceback) instead of the run stopping cleanly (the suite caught one)."""
    seen_inside = []

    def write(f) -> None:
        f.write(b"a" * 1000)
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # bytecodes enough for a handler to run, were it not held
            seen_inside.append(len(sigterm_calls))
        f.write(b"b" * 1000)

    atomic_write(tmp_path / "f", write)
    assert max(seen_inside) == 0 and sigterm_calls == [signal.SIGTERM]
    assert (tmp_path / "f").read_bytes() == b"a" * 1000 + b"b" * 1000


def test_ctrl_c_during_a_write_raises_after_it(tmp_path):
    def write(f) -> None:
        f.write(b"x")
        signal.raise_signal(signal.SIGINT)
        f.write(b"y")

    with pytest.raises(KeyboardInterrupt):
        atomic_write(tmp_path / "f", write)
    assert (tmp_path / "f").read_bytes() == b"xy"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back


def test_a_second_signal_goes_through_at_once(tmp_path):
    """(A write that hangs can still be stopped.)"""
    def write(f) -> None:
        f.write(b"x")
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)
        f.write(b"y")  # not reached

    with pytest.raises(KeyboardInterrupt):
        atomic_write(tmp_path / "f", write)
    assert not (tmp_path / "f").exists() and not list(tmp_path.iterdir())  # nothing half-written left


def test_off_the_main_thread_nothing_is_held(tmp_path):
    done = []
    t = threading.Thread(target=lambda: (atomic_write(tmp_path / "f", lambda f: f.write(b"z")), done.append(1)))
    t.start()
    t.join()
    assert done == [1] and (tmp_path / "f").read_bytes() == b"z"
