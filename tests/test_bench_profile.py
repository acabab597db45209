"""benchmarks.shard_profile's and benchmarks.gpu_profile's reading of py-spy's output: idle samples are not busy time, each
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


def test_gpu_profile_reads_a_step_from_the_trainer_and_the_shards_busy_time():
    """benchmarks.gpu_profile: the trainer's main thread counts whole (waits are step time), an
    autograd thread only inside a Python backward; a shard thread waiting for a request, a
    connection or in a C call at its entry is idle; ms = share of the ticks x the step's p50."""
    from benchmarks.gpu_profile import summarise as step_summary

    main = "thread (1): MainThread;<module> (x.py:1);train (train.py:1)"
    grad = "thread (2): pt_autograd_0"
    bell = "thread (3): doorbell;Thread.run (threading.py:1);Doorbell._serve (doorbell.py:1)"
    trainer = [f"{main};Tensor.backward (t.py:1);_engine_run_backward (g.py:1) 60\n",
               f"{main};GPT.forward (m.py:1) 40\n",
               f"{grad};BackwardCFunction.apply (f.py:1);_Bag.backward (b.py:1);Bell._read_one (d.py:1) 50\n",
               f"{grad} 50\n"]  # the autograd thread between backwards
    got = step_summary(trainer, step_ms=20.0, top=20, trainer=True)
    assert got["ms_per_step"] == pytest.approx(20.0)  # every main-thread tick: 100 ticks of 0.2 ms
    funcs = dict(got["functions"])
    assert funcs["_engine_run_backward"] == pytest.approx(12.0) and funcs["GPT.forward"] == pytest.approx(8.0)
    assert funcs["_Bag.backward"] == pytest.approx(10.0)  # beside the main thread's wait, not added to it
    shards = [f"{bell};recv_exact (wire.py:1) 70\n",  # waiting for a request
              f"{bell};serve_off_loop (d.py:2);ValueTable.bag (t.py:1) 30\n",
              "thread (4): MainThread;<module> (<string>:1) 100\n",  # the process waiting on its stdin
              "thread (5): Thread-1 (_poll_wrapper);Thread.run (threading.py:1) 100\n",  # gRPC's poller
              "thread (7): Thread-2;BaseServer.serve_forever (s.py:1);_PollLikeSelector.select (s.py:2) 100\n",  # metrics
              "thread (6): doorbell-accept;Thread.run (threading.py:1);Doorbell._accept (d.py:1);socket.accept (s.py:1) 100\n"]
    got = step_summary(shards, step_ms=10.0, top=20, trainer=False)
    assert got["ms_per_step"] == pytest.approx(3.0)  # 30 of 100 ticks busy
    assert dict(got["functions"])["ValueTable.bag"] == pytest.approx(3.0)
