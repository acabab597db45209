"""benchmarks.shard_profile's reading of py-spy's output: idle samples are not busy time, each
thread's samples stand for the whole run, and a function counts once per sample (inclusive)."""

from __future__ import annotations

import pytest

from benchmarks.shard_profile import summarise

LOOP = "thread (11): shard0-grpc;Thread.run (threading.py:982);BaseEventLoop.run_forever (asyncio/base_events.py:607)"
WORK = "thread (12): shard-compute_0;Thread.run (threading.py:982);_worker (concurrent/futures/thread.py:83)"


def test_busy_time_per_call_from_raw_samples():
    lines = [
        f"{LOOP};BaseEventLoop._run_once (a.py:1);EpollSelector.select (selectors.py:468) 70\n",  # idle
        f"{LOOP};BaseEventLoop._run_once (a.py:1);Handle._run (events.py:80);f (x.py:1);f (x.py:2) 30\n",
        f"{WORK} 50\n",  # the compute thread waiting in its queue
        f"{WORK};_WorkItem.run (thread.py:58);embedding_bag (functional.py:1) 50\n",
        "thread (13): ray_io;poll (x.py:1) 100\n",  # not a shard thread: ignored
        "garbage\n",
    ]
    got = summarise(lines, calls=10, seconds=2.0, top=10)
    # 100 samples over 2 s: 20 ms each; 10 calls: 2 ms of a call per sample
    assert got["loop"]["samples"] == 100 and got["compute"]["samples"] == 100
    assert got["loop"]["busy_ms_per_call"] == pytest.approx(30 * 2.0 / 100 / 10 * 1e3)
    assert got["compute"]["busy_ms_per_call"] == pytest.approx(50 * 2.0 / 100 / 10 * 1e3)
    loop = dict(got["loop"]["functions"])
    assert loop["f"] == pytest.approx(loop["Handle._run"])  # twice on the stack, counted once
    assert "EpollSelector.select" not in loop and "Thread.run" not in loop
    assert dict(got["compute"]["functions"])["embedding_bag"] == pytest.approx(100.0)  # all its busy time
