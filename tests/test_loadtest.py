"""`memserver loadtest`: the locust load against the session's cluster, its request builder, its
exact percentiles and its argument errors."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import memserver.cli as cli
from client.ops import ClientSession, WriteTags
from memserver.loadtest.caller import ShardCaller, fetch_table, setup_seconds
from memserver.loadtest.config import LoadConfig, parse_duration, parse_host_port, parse_mix
from memserver.loadtest.recorder import LatencyRecorder, percentile


def test_loadtest_reports_exact_numbers_and_drops_its_table(memory_cluster, client):
    mix = {"bag": 4, "lookup": 1, "bag_backward": 1}
    cmd = [sys.executable, "-m", "memserver.cli", "loadtest", "--endpoint", memory_cluster.endpoint, "--users", "2",
           "--spawn-rate", "2", "--duration", "3s", "--batch", "64", "--knn", "8", "--num-rows", "4096", "--dim", "32",
           "--mix", ",".join(f"{k}:{v}" for k, v in mix.items()), "--json"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr + run.stdout
    report = json.loads(run.stdout)
    assert report["failures"] == 0 and report["errors"] == {}, report["errors"]
    assert report["locust_exceptions"] == 0 and not report["interrupted"]
    assert report["users"] == 2 and report["users_reached"] == 2
    assert report["requests"] > 0 and report["rps"] > 0
    assert 0 < report["generator_cpu"] < 4  # (a share of one core; its threads may add up past 1)
    assert 2.5 <= report["elapsed_s"] < 30
    assert report["table"]["scratch"] and report["table"]["shards"] == 2 and report["table"]["sharding"] == "cols"
    assert set(report["per_type"]) == set(mix)
    assert sum(s["requests"] for s in report["per_type"].values()) == report["requests"]
    for name, s in [*report["per_type"].items(), ("total", report["total"])]:
        assert s["requests"] > 0 and s["failures"] == 0 and s["response_bytes"] > 0, name
        assert 0 < s["p50_ms"] <= s["p95_ms"] <= s["p99_ms"] <= s["max_ms"] < 10_000, (name, s)
    assert report["per_type"]["bag"]["requests"] > report["per_type"]["lookup"]["requests"]  # 4:1, hundreds of calls
    assert not [t.name for t in client.list_tables() if t.name == report["table"]["name"]]


def test_a_run_ended_by_max_requests_before_any_sample_counts_its_user(tmp_path):
    """5 requests take ~70 ms, less than the runner's 50 ms sampling needed to see a user: the
    report said 0 users. The users count themselves now (an in-process server: no Ray needed)."""
    from memserver.cluster.inprocess import InProcessServer

    with InProcessServer(2, data_dir=str(tmp_path / "data")) as server:
        cmd = [sys.executable, "-m", "memserver.cli", "loadtest", "--endpoint", server.endpoint, "--users", "1",
               "--duration", "3s", "--max-requests", "5", "--num-rows", "1024", "--dim", "8", "--batch", "8",
               "--knn", "4", "--json"]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr + run.stdout
    report = json.loads(run.stdout)
    assert report["requests"] == 5 and report["users_reached"] == 1, report


def test_a_run_longer_than_an_hour_keeps_its_users_for_its_whole_duration(tmp_path, monkeypatch):
    """`--duration 2h` gave the users the config's 3600 s cap (min of it and the duration): they
    stopped at one hour and the command exited 0 with nothing said (a hunt). The cap follows the
    duration (an in-process server: no Ray needed; the locust child is not started)."""
    import memserver.loadtest.run as run_module
    from memserver.cluster.inprocess import InProcessServer
    from memserver.loadtest.run import ScratchTable, run_loadtest

    seen = {}

    def child(env, args, timeout, save_latencies):  # where the locust child would start
        seen.update(max_seconds=float(env["MEMSERVER_MAX_SECONDS"]), kill_after=timeout)
        return LatencyRecorder().report(1.0, names=["bag"])

    monkeypatch.setattr(run_module, "_run_child", child)
    with InProcessServer(2, data_dir=str(tmp_path / "data")) as server:
        cfg = LoadConfig(endpoint=server.endpoint, table="(scratch)", mix=parse_mix("bag"), batch=2, knn=2, timeout=10)
        run_loadtest(cfg, 1, 1.0, parse_duration("2h"), scratch=ScratchTable(64, 4, "cols"))
    assert seen["max_seconds"] == 7200 + 10 + 5 and seen["kill_after"] > seen["max_seconds"], seen


def test_a_child_that_missed_the_stop_signal_is_told_again():
    """A whole-suite run: a SIGTERMed `loadtest` exited 0 and ran on. The parent's one SIGINT
    reached the locust child while it still imported (its handler not set yet) and was lost, so
    the run went on to its --duration. The parent says it again until the child exits."""
    from memserver.loadtest.run import stop_child

    script = ("import signal, sys, time\n"
              "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"  # (as a child that is not listening yet)
              "print('up', flush=True)\n"
              "time.sleep(1.5)\n"
              "signal.signal(signal.SIGINT, lambda *a: sys.exit(3))\n"
              "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "up\n"
        t0 = time.monotonic()
        assert stop_child(proc, 30.0, every=0.2) == 3
        assert time.monotonic() - t0 < 10
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_a_terminated_loadtest_drops_its_table(memory_cluster, client):
    """SIGTERM (what `timeout` and `kill` send) stops the run as Ctrl-C does: the scratch table is
    dropped (the default action left it in the cluster)."""
    import signal

    cmd = [sys.executable, "-m", "memserver.cli", "loadtest", "--endpoint", memory_cluster.endpoint, "--users", "1",
           "--duration", "60s", "--batch", "8", "--knn", "4", "--num-rows", "1024", "--dim", "8"]
    before = {t.name for t in client.list_tables()}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not {t.name for t in client.list_tables()} - before:  # the scratch table is made
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        time.sleep(3)  # the locust child is running
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert {t.name for t in client.list_tables()} == before, err[-2000:]


@pytest.mark.parametrize("sharding", ["rows", "cols"])
def test_shard_caller_answers_like_the_client(memory_cluster, client, table_name, sharding):
    """The load test sends the client's own ops over its own channels: the same answers."""
    meta = client.create_table(table_name, 1000, 16, sharding=sharding, optimizer="sgd", lr=0.1)
    cfg = LoadConfig(endpoint=memory_cluster.endpoint, table=table_name, batch=32, knn=5)
    assert fetch_table(cfg.endpoint, table_name, cfg.timeout) == meta
    caller = ShardCaller(meta, cfg)
    try:
        rng = np.random.default_rng(1)
        ids = torch.from_numpy(rng.integers(0, 1000, (32, 5)))
        ids[0, :2] = 7  # a duplicate
        w = torch.from_numpy(rng.random((32, 5), dtype=np.float32))
        rows, nbytes = caller.lookup(ids)
        assert nbytes > 0
        np.testing.assert_array_equal(rows.numpy(), client.lookup(table_name, ids.numpy()))
        out, _ = caller.bag(ids, w)
        np.testing.assert_allclose(out.numpy(), client.bag(table_name, ids.numpy(), w.numpy()), rtol=1e-6, atol=1e-7)
        g = torch.from_numpy(rng.standard_normal((32, 16), dtype=np.float32))
        grad_w, _ = caller.bag_backward(ids, w, g, WriteTags(ClientSession("test-loadtest")))
        np.testing.assert_allclose(grad_w.numpy(), torch.einsum("bd,bkd->bk", g, rows).numpy(), rtol=1e-5, atol=1e-6)
        assert not np.allclose(client.lookup(table_name, ids[0].numpy()), rows[0].numpy())  # the update was applied
    finally:
        caller.close()
        client.drop_table(table_name)


def test_a_call_deadline_below_a_connections_set_up_time_still_connects(memory_cluster, client, table_name):
    """--timeout bounds each call, not the set-up: a load test of 3 ms calls connected with that
    deadline and sometimes ended in grpc.FutureTimeoutError's traceback."""
    meta = client.create_table(table_name, 100, 4)
    cfg = LoadConfig(endpoint=memory_cluster.endpoint, table=table_name, batch=4, knn=2, timeout=1e-6)
    caller = ShardCaller(fetch_table(cfg.endpoint, table_name, setup_seconds(cfg.timeout)), cfg)
    try:
        assert caller.meta == meta
        caller.connect()  # new channels, not ready within 1 us: connected within the set-up time
    finally:
        caller.close()
        client.drop_table(table_name)


@pytest.mark.parametrize("host", ["127.0.0.1", "192.0.2.1"])  # a port in use; an address not this host's
def test_a_master_address_it_cannot_listen_on_is_one_line(memory_cluster, host):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        cmd = [sys.executable, "-m", "memserver.cli", "loadtest", "--endpoint", memory_cluster.endpoint,
               "--expect-workers", "1", "--master-bind", f"{host}:{port}", "--duration", "1s", "--wait", "5s",
               "--num-rows", "64", "--dim", "4", "--batch", "2", "--knn", "2"]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert run.returncode == 1, run.stderr
    why = "Address already in use" if host == "127.0.0.1" else "Cannot assign requested address"
    assert f"memserver: error: --master-bind {host}:{port}: cannot listen there ({why})\n" in run.stderr
    assert "Traceback" not in run.stderr and "the locust process failed" not in run.stderr, run.stderr
    assert "memserver loadtest: error" not in run.stderr  # said once, by the command (not by its locust child too)


def test_the_locust_child_run_by_hand_says_its_error(tmp_path):
    """(Its error goes in its report for `memserver loadtest` to say; run by hand it said nothing.)"""
    report = tmp_path / "r.json"
    run = subprocess.run([sys.executable, "-m", "memserver.loadtest.distributed", "--worker-of", f"127.0.0.1:{_free_port()}",
                          "--wait", "1", "--report", str(report)], capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL, env={**os.environ, "MEMSERVER_HOME": str(tmp_path)})
    assert run.returncode == 2
    said = json.loads(report.read_text())["error"]
    assert said.startswith("--worker-of: no locust master answered") and f"memserver loadtest: error: {said}" in run.stderr


def test_exact_percentiles():
    rec = LatencyRecorder()
    for ms in np.random.default_rng(0).permutation(np.arange(1, 101, dtype=np.float64)):
        rec.on_request(request_type="grpc", name="bag", response_time=ms, response_length=10)
    rec.on_request(request_type="grpc", name="lookup", response_time=5.0, response_length=0, exception=TimeoutError("late"))
    r = rec.report(elapsed_s=2.0, names=["bag", "lookup", "bag_backward"])
    bag = r["per_type"]["bag"]
    assert (bag["p50_ms"], bag["p95_ms"], bag["p99_ms"], bag["max_ms"]) == (50, 95, 99, 100)
    assert bag["requests"] == 100 and bag["rps"] == 50 and bag["response_bytes"] == 1000
    assert r["per_type"]["lookup"]["failures"] == 1 and r["per_type"]["lookup"]["p50_ms"] is None
    assert bag["ok_rps"] == 50 and r["per_type"]["lookup"]["ok_rps"] == 0 and r["per_type"]["lookup"]["rps"] == 0.5
    assert r["per_type"]["bag_backward"]["requests"] == 0
    assert (r["requests"], r["failures"]) == (101, 1)
    assert r["errors"] == {"lookup: TimeoutError: late": 1}


def test_duration_and_mix_parsing():
    assert parse_duration("30s") == 30 and parse_duration("2m") == 120 and parse_duration("500ms") == 0.5
    assert parse_duration("1.5") == 1.5 and parse_duration("1h") == 3600
    for bad in ("", "abc", "30x", "-1s", "0s", "1d", "25h", "s"):
        with pytest.raises(ValueError):
            parse_duration(bad)
    assert parse_mix("bag:8, lookup ,bag_backward:0") == {"bag": 8.0, "lookup": 1.0}
    for bad in ("bag:x", "bog:1", "bag:0", "bag:-1", "", "bag:nan"):
        with pytest.raises(ValueError):
            parse_mix(bad)


def test_config_travels_through_the_environment():
    cfg = LoadConfig(endpoint="127.0.0.1:1", table="t", mix=parse_mix("bag:3,lookup:0.5"), batch=7, knn=3,
                     wire_dtype="bfloat16", timeout=2.5, max_requests=10, max_seconds=4)
    assert LoadConfig.from_env(cfg.to_env()) == cfg
    with pytest.raises(ValueError, match="MEMSERVER_BATCH"):
        LoadConfig.from_env({**cfg.to_env(), "MEMSERVER_BATCH": "many"})
    with pytest.raises(ValueError, match="wire_dtype"):
        LoadConfig(endpoint="127.0.0.1:1", table="t", wire_dtype="float64")


def test_a_scratch_table_dropped_by_someone_else_leaves_the_report_standing(memory_cluster, client):
    """The table gone before the run's end (dropped by someone else): the figures gathered are
    still printed, with the failed drop said beside them (it threw the whole report away)."""
    cmd = [sys.executable, "-m", "memserver.cli", "loadtest", "--endpoint", memory_cluster.endpoint, "--users", "1",
           "--duration", "12s", "--batch", "8", "--knn", "4", "--num-rows", "1024", "--dim", "8", "--json"]
    before = {t.name for t in client.list_tables()}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (made := {t.name for t in client.list_tables()} - before):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        (scratch,) = made
        while not client.slot_stats(scratch, np.arange(1024))["hits"].sum() > 8 * 4 + 8:  # the load (not only the
            # warm-up's bag and lookup) has reached it
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        client.drop_table(scratch)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-2000:]
    report = json.loads(out or "null") or pytest.fail(err[-3000:])
    assert report["table"]["name"] == scratch and report["table"]["scratch"]
    said = f"the scratch table {scratch} was dropped by someone else during the run: its later calls failed"
    assert report["scratch_drop_error"] == said  # (it said to drop the table that was gone)
    assert f"memserver: error: {said}" in err
    assert report["failures"], report  # the calls after the drop are counted as failed


@pytest.mark.parametrize(
    "args, message",
    [
        (["--duration", "abc"], "--duration: expected a time like 30s"),
        (["--duration", "0s"], "--duration: must be more than zero"),
        (["--duration", "-1s"], "--duration: expected a time like 30s, 2m or 500ms, got '-1s'"),  # (not argparse's
        # "expected one argument": a walkthrough)
        (["--duration", "5 parsecs"], "--duration"),
        (["--mix", "bag:1,scan:2"], "--mix: unknown call 'scan'"),
        (["--users", "0"], "--users must be at least 1"),
        (["--spawn-rate", "inf"], "--spawn-rate must be a number more than 0, got inf"),
        (["--spawn-rate", "nan"], "--spawn-rate must be a number more than 0, got nan"),
        (["--table", "t", "--dim", "8"], "cannot be used with --table"),
        # (a hunt: each finite, their sum inf, every call then failed; "" was refused as "(scratch)")
        (["--mix", "bag:1e308,lookup:1e308"], "--mix: the weights of 'bag:1e308,lookup:1e308' sum beyond"),
        (["--mix", "bag:1e308,bag:1e308"], "sum beyond a float's range"),
        (["--table", ""], "--table: give a table name, or leave --table out for a scratch table"),
        (["--worker-of", "127.0.0.1:5557", "--users", "8"], "--worker-of: --users belong(s) to the master"),
        (["--worker-of", "127.0.0.1:5557", "--users", "4", "--duration", "30s"],  # (their defaults: taken silently)
         "--worker-of: --users, --duration belong(s) to the master"),
        (["--worker-of", "0.0.0.0"], "--worker-of: 0.0.0.0 is a wildcard"),
        (["--expect-workers", "2", "--master-bind", "*:5557"], "--master-bind: * is a wildcard"),
        (["--expect-workers", "4", "--users", "2"], "--users (2) must be at least --expect-workers (4)"),
        (["--master-bind", "127.0.0.1"], "--master-bind: only with --expect-workers"),
        (["--wait", "soon"], "--wait: expected a time"),
        (["--knn", "100000"], "--batch 256 x --knn 100000 ids and weights make 292 MiB per message"),
        (["--batch", "100000", "--dim", "512"], "--batch 100000 x dim 512 rows make 195 MiB per message"),
        (["--save-latencies", "/nonexistent/x.npz"], "--save-latencies: the directory /nonexistent does not exist"),
        (["--save-latencies", "/"], "--save-latencies: / is a directory"),
    ],
)
def test_bad_loadtest_flags_are_named(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.setenv("MEMSERVER_HOME", str(tmp_path))  # no cluster: the flags fail before one is needed
    with pytest.raises(SystemExit) as exit_:
        cli.main(["loadtest", *args])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert "locust" not in sys.modules and "gevent" not in sys.modules  # no monkey patching in the CLI process


def test_a_lookup_only_mix_is_sized_by_its_ids_not_by_knn(tmp_path, monkeypatch, capsys):
    """`--mix lookup --batch 200000` was refused for "--batch 200000 x --knn 32 ids and weights"
    (73 MiB), though a lookup sends no weights and uses no --knn: 1.6 MB of ids, 6.4 MB of rows (a
    hunt). Each kind of call is sized by what it sends and gets."""
    from memserver.loadtest.caller import check_call_size

    check_call_size(200_000, 32, 8, mix=["lookup"])
    with pytest.raises(ValueError, match="--batch 200000 x --knn 32 ids and weights make 73 MiB"):
        check_call_size(200_000, 32, 8, mix=["lookup", "bag"])  # a bag in the mix: its ids and weights count
    with pytest.raises(ValueError, match="--batch 10000000 ids make 76 MiB"):
        check_call_size(10_000_000, 1, 1, mix=["lookup"])
    monkeypatch.setenv("MEMSERVER_HOME", str(tmp_path))  # no cluster: refused by that, after the flags
    with pytest.raises(SystemExit) as exit_:
        cli.main(["loadtest", "--mix", "lookup", "--batch", "200000", "--dim", "8", "--duration", "1s"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--knn" not in err and "memserver up" in err, err


def test_loadtest_without_a_cluster_says_how_to_start_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEMSERVER_HOME", str(tmp_path))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["loadtest", "--duration", "1s"])
    assert exit_.value.code == 2 and "memserver up" in capsys.readouterr().err


def test_loadtest_refuses_an_index_table_before_any_load(memory_cluster, client, table_name, capsys):
    client.create_index(table_name, 8)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["loadtest", "--endpoint", memory_cluster.endpoint, "--table", table_name, "--duration", "1s"])
    assert exit_.value.code == 2
    assert f"--table: {table_name} is an index table; loadtest calls bag" in capsys.readouterr().err
    assert "locust" not in sys.modules


@pytest.mark.parametrize("shape,message", [
    (["--num-rows", "1", "--sharding", "rows"], "--num-rows: 1 rows cannot be split over 2 shards (the scratch table "
     "takes every shard of the cluster): give --num-rows >= 2, or --sharding cols"),
    (["--dim", "1"], "--dim: 1 columns cannot be split over 2 shards (the scratch table takes every shard of the "
     "cluster): give --dim >= 2, or --sharding rows")])
def test_a_scratch_table_the_cluster_cannot_split_is_said_in_the_flags(memory_cluster, client, capsys, shape, message):
    """(The catalog's words, "give num_shards <= 1", named no flag of loadtest's.)"""
    before = {t.name for t in client.list_tables()}
    with pytest.raises(SystemExit) as exit_:
        cli.main(["loadtest", "--endpoint", memory_cluster.endpoint, "--duration", "1s", "--batch", "1", "--knn", "1",
                  *shape])
    assert exit_.value.code == 2
    assert f"memserver: error: {message}\n" in capsys.readouterr().err
    assert {t.name for t in client.list_tables()} == before and "locust" not in sys.modules


def test_loadtest_refuses_bag_backward_on_a_sync_table(memory_cluster, client, table_name, capsys):
    """(A walkthrough: each of the load's bag_backward calls was its client's whole contribution to
    step 0 of a sync_updates table: all but the first refused, the first left waiting for good.)"""
    from memserver.loadtest.caller import check_table

    client.create_table(table_name, 64, 8, sync_workers=2)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["loadtest", "--endpoint", memory_cluster.endpoint, "--table", table_name, "--duration", "1s"])
    assert exit_.value.code == 2
    assert (f"--table: {table_name} is a sync_updates table of 2 trainers, whose updates apply as steps every trainer "
            "commits; loadtest's bag_backward calls are no such steps: leave bag_backward out of --mix") \
        in capsys.readouterr().err
    assert "locust" not in sys.modules
    check_table(client.table(table_name), 8, 4, mix=("bag", "lookup"))  # reads are fine


def test_a_worker_with_no_master_gives_up_after_its_wait(tmp_path):
    """locust alone would retry its master for 5 minutes; --wait bounds the connection too."""
    port = _free_port()  # nothing listens there
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "memserver.cli", "loadtest", "--worker-of", f"127.0.0.1:{port}",
                          "--wait", "2s", "--json"], capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL,
                         env={**os.environ, "MEMSERVER_HOME": str(tmp_path), "MEMSERVER_ENDPOINT": "127.0.0.1:1"})
    assert run.returncode == 1, run.stderr
    said = f"--worker-of: no locust master answered at 127.0.0.1:{port} within 2 s"
    assert said in run.stderr
    assert said in json.loads(run.stdout)["error"]  # --json: the failure on stdout too (it printed nothing there)
    assert "Traceback" not in run.stderr and time.monotonic() - t0 < 60


def test_a_ramp_longer_than_the_run_is_reported(capsys):
    """The report's header names the users that ran, and says why fewer than asked for did."""
    from memserver.cli.loadtest import print_load_report

    report = {**_recorder({"bag": [1.0, 2.0]}).report(3.0, names=["bag"]), "interrupted": False, "users": 20,
              "users_reached": 3, "spawn_rate": 1.0, "duration_s": 3.0, "endpoint": "127.0.0.1:1",
              "table": {"name": "t", "num_rows": 8, "dim": 4, "sharding": "cols", "shards": 1, "scratch": True},
              "config": {"batch": 1, "knn": 1, "wire_dtype": "float32"}}
    print_load_report(report)
    out = " ".join(capsys.readouterr().out.split())
    assert "3 users for 3.0 s, batch 1 x knn 1" in out
    print_load_report({**report, "config": {**report["config"], "mix": {"lookup": 1}}})  # (no bag: no knn)
    assert "3 users for 3.0 s, 1 id per lookup, wire float32" in " ".join(capsys.readouterr().out.split())
    assert "3 of the 20 users asked for ran at once: at --spawn-rate 1/s they take 20.0 s to start" in out
    assert "the load generator was busy" not in out and "as the load generator saw each call" in out
    # a generator that used its core: its latencies are mostly its own (a walkthrough: p50 114 ms at
    # the generator where the shards' own histograms put Bag under 0.5 ms)
    print_load_report({**report, "generator_cpu": 0.94})
    out = " ".join(capsys.readouterr().out.split())
    assert "the load generator was busy 94% of a core: its users share one process, so the latencies below are " \
           "mostly time its calls waited in it" in out


# distributed: every worker's latencies merged on the master

def _recorder(latencies: dict[str, list[float]], failures: int = 0) -> LatencyRecorder:
    rec = LatencyRecorder()
    for name, ms in latencies.items():
        for x in ms:
            rec.on_request(request_type="grpc", name=name, response_time=x, response_length=3)
    for _ in range(failures):
        rec.on_request(request_type="grpc", name="bag", response_time=1.0, response_length=0, exception=TimeoutError("t"))
    return rec


_MS = st.floats(min_value=0.001, max_value=1e4, allow_nan=False)
_WORKER = st.fixed_dictionaries({}, optional={n: st.lists(_MS, max_size=40) for n in ("bag", "lookup", "bag_backward")})


@settings(max_examples=60, deadline=None)
@given(workers=st.lists(st.tuples(_WORKER, st.integers(0, 3)), min_size=1, max_size=5))
def test_merged_percentiles_are_those_of_every_latency_together(workers):
    """The master's merge of the workers' messages: its report equals that of one recorder that
    saw every response (percentiles of the concatenation), per call and in total."""
    merged, union = LatencyRecorder(), LatencyRecorder()
    for lat, fails in workers:
        rec = _recorder(lat, fails)
        merged.merge(LatencyRecorder.from_message(rec.to_message()))
        for name, ms in lat.items():
            for x in ms:
                union.on_request(request_type="grpc", name=name, response_time=x, response_length=3)
        for _ in range(fails):
            union.on_request(request_type="grpc", name="bag", response_time=1.0, response_length=0,
                             exception=TimeoutError("t"))
    names = ["bag", "lookup", "bag_backward"]
    assert merged.report(2.0, names) == union.report(2.0, names)
    every = np.sort(np.array([x for lat, _ in workers for ms in lat.values() for x in ms]))
    if len(every):
        assert merged.report(2.0)["total"]["p99_ms"] == round(percentile(every, 99), 4)


def test_a_workers_message_is_bounded_and_checked():
    rec = LatencyRecorder(max_samples=5)
    for i in range(12):
        rec.on_request(request_type="grpc", name="bag" if i % 2 else "lookup", response_time=float(i), response_length=1)
    msg = rec.to_message()
    assert sum(len(b) for b in msg["ok"].values()) == 5 * 8  # at most max_samples x 8 bytes of latencies
    assert rec.report()["dropped"] == 7 and rec.report()["requests"] == 5
    back = LatencyRecorder.from_message(msg, max_samples=5)
    assert back.report(1.0) == rec.report(1.0)
    with pytest.raises(ValueError, match="more than the bound of 4"):
        LatencyRecorder.from_message(msg, max_samples=4)
    for bad in ({}, {**msg, "ok": {"bag": b"1234567"}}, {**msg, "failures": {"bag": -1}}, {**msg, "ok": [1]},
                {**msg, "errors": {"x": "many"}}):
        with pytest.raises(ValueError):
            LatencyRecorder.from_message(bad)


def test_a_workers_message_with_impossible_figures_is_refused():
    """The master took NaN and negative latencies (NaN percentiles, printed by --json as invalid
    JSON), a negative or NaN `dropped` / `elapsed_s` and True as a count of 1 from its
    unauthenticated port (a hunt): each is a ValueError, which the master reports as a rejected
    worker, as it does the other malformed messages."""
    msg = _recorder({"bag": [1.0, 2.0]}, failures=1).to_message()
    LatencyRecorder.from_message(msg)  # (the good one)
    bad_ms = [np.array([1.0, x]).tobytes() for x in (np.nan, np.inf, -1.0)]
    for bad in ([{**msg, "ok": {"bag": raw}} for raw in bad_ms] +
                [{**msg, "dropped": x} for x in (-5, True, 1.5, "3", None)] +
                [{**msg, "elapsed_s": x} for x in (math.nan, math.inf, -1.0, True, "2")] +
                [{**msg, "failures": {"bag": True}}, {**msg, "bytes": {"bag": False}}]):
        with pytest.raises(ValueError):
            LatencyRecorder.from_message(bad)


def test_master_sends_settings_but_never_the_endpoint():
    """The master/worker channel is plaintext: no endpoint (a worker's token goes only where the
    worker's own endpoint file says), no token; the worker's own endpoint wins."""
    from memserver.loadtest.config import LoadConfig as Cfg

    cfg = Cfg(endpoint="10.0.0.1:50051", table="t", batch=7, max_requests=9)
    sent = {k: v for k, v in cfg.to_env().items() if k != "MEMSERVER_ENDPOINT"}
    code = ("import json, sys; from memserver.loadtest import distributed as d; "
            "print(json.dumps(d.config_message(d.LoadConfig.from_env(json.loads(sys.argv[1])))))")
    run = subprocess.run([sys.executable, "-c", code, json.dumps(cfg.to_env())], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "MEMSERVER_TOKEN": "secret"})
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == sent
    code = ("import json, sys; from memserver.loadtest import distributed as d; "
            "print(d.worker_config({**json.loads(sys.argv[1]), 'MEMSERVER_ENDPOINT': 'evil:1'}, "
            "{'MEMSERVER_ENDPOINT': '10.0.0.2:50051'}))")
    run = subprocess.run([sys.executable, "-c", code, json.dumps(sent)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "endpoint='10.0.0.2:50051'" in run.stdout and "batch=7" in run.stdout and "evil" not in run.stdout


def test_master_address_parsing():
    assert parse_host_port("10.0.0.1:6000") == ("10.0.0.1", 6000) and parse_host_port("h") == ("h", 5557)
    for bad in ("0.0.0.0:1", "*:5557", ":1", "h:x", "h:0", "h:70000"):
        with pytest.raises(ValueError):
            parse_host_port(bad)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _union(paths) -> dict[str, np.ndarray]:
    out: dict[str, list[np.ndarray]] = {}
    for p in paths:
        with np.load(p) as z:
            for name in z.files:
                out.setdefault(name, []).append(z[name])
    return {name: np.sort(np.concatenate(a)) for name, a in out.items()}


def check_merged(master: dict, workers: list[dict], master_npz, worker_npzs) -> None:
    """The master's report is exact over the union of the workers' latencies (shared with
    tests/test_hosts.py)."""
    assert master["failures"] == 0 and master["errors"] == {} and master["missing_workers"] == []
    assert master["rejected_workers"] == {} and master["locust_exceptions"] == 0
    assert all(w["sent"] and w["failures"] == 0 and w["requests"] > 0 for w in workers)
    assert master["requests"] == sum(w["requests"] for w in workers) == \
        sum(w["requests"] for w in master["workers"].values())
    assert sorted(w["requests"] for w in master["workers"].values()) == sorted(w["requests"] for w in workers)
    union = _union(worker_npzs)
    merged = _union([master_npz])
    assert union.keys() == merged.keys() and all(np.array_equal(union[n], merged[n]) for n in union)
    every = np.sort(np.concatenate(list(union.values())))
    assert master["total"]["requests"] == len(every)
    for key, q in (("p50_ms", 50), ("p95_ms", 95), ("p99_ms", 99)):
        assert master["total"][key] == round(percentile(every, q), 4), key
        for name, ms in union.items():
            assert master["per_type"][name][key] == round(percentile(ms, q), 4), (name, key)
    assert master["total"]["max_ms"] == round(float(every[-1]), 4)


def test_loadtest_master_merges_two_local_workers_exactly(memory_cluster, client, tmp_path):
    port = _free_port()
    ep = memory_cluster.endpoint
    cli_ = [sys.executable, "-m", "memserver.cli", "loadtest"]
    master = subprocess.Popen(
        [*cli_, "--endpoint", ep, "--expect-workers", "2", "--master-bind", f"127.0.0.1:{port}", "--users", "2",
         "--spawn-rate", "2", "--duration", "3s", "--batch", "32", "--knn", "4", "--num-rows", "2048", "--dim", "16",
         "--mix", "bag:2,lookup:1,bag_backward:1", "--wait", "60s", "--json", "--save-latencies", str(tmp_path / "m.npz")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    saved = [tmp_path / "w0.npz", tmp_path / "w1.latencies"]  # written as named (not w1.latencies.npz)
    workers = [subprocess.Popen([*cli_, "--worker-of", f"127.0.0.1:{port}", "--endpoint", ep, "--wait", "60s", "--json",
                                 "--save-latencies", str(saved[i])],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
               for i in range(2)]
    try:
        out, err = master.communicate(timeout=240)
        w_out = [w.communicate(timeout=60) for w in workers]
    finally:
        for p in (master, *workers):
            if p.poll() is None:
                p.kill()
    assert master.returncode == 0, err[-4000:] + out[:1500] + "".join(e[-2000:] for _, e in w_out)
    assert all(w.returncode == 0 for w in workers), [e[-3000:] for _, e in w_out]
    report = json.loads(out)
    reports = [json.loads(o) for o, _ in w_out]
    check_merged(report, reports, tmp_path / "m.npz", saved)
    assert report["expect_workers"] == 2 and len(report["workers"]) == 2 and report["table"]["scratch"]
    assert all(w["users"] == 1 and w["config"]["batch"] == 32 and w["table"]["name"] == report["table"]["name"]
               for w in reports)  # the master's settings reached both workers
    assert 2.5 <= report["elapsed_s"] < 60
    assert not [t.name for t in client.list_tables() if t.name == report["table"]["name"]]


def test_a_master_stops_when_its_workers_reach_max_requests(memory_cluster, client, tmp_path):
    """--max-requests ends a distributed run too (the master waited out --duration), and req/s is
    over the workers' own span (it was over the master's whole wait: 10 req/s for 265)."""
    port = _free_port()
    ep = memory_cluster.endpoint
    cli_ = [sys.executable, "-m", "memserver.cli", "loadtest"]
    t0 = time.monotonic()
    master = subprocess.Popen(
        [*cli_, "--endpoint", ep, "--expect-workers", "1", "--master-bind", f"127.0.0.1:{port}", "--users", "2",
         "--duration", "120s", "--max-requests", "60", "--batch", "16", "--knn", "4", "--num-rows", "2048", "--dim", "16",
         "--wait", "60s", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    worker = subprocess.Popen([*cli_, "--worker-of", f"127.0.0.1:{port}", "--endpoint", ep, "--wait", "60s", "--json"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        out, err = master.communicate(timeout=240)
        w_out, w_err = worker.communicate(timeout=60)
    finally:
        for p in (master, worker):
            if p.poll() is None:
                p.kill()
    assert master.returncode == 0 and worker.returncode == 0, err[-3000:] + w_err[-3000:]
    assert time.monotonic() - t0 < 100  # not the 120 s of --duration
    report, own = json.loads(out), json.loads(w_out)
    assert report["requests"] == own["requests"] == 60
    (w,) = report["workers"].values()
    assert report["elapsed_s"] == w["elapsed_s"] == own["elapsed_s"] and report["rps"] == pytest.approx(own["rps"], rel=1e-2)  # its span, rounded to ms


def test_plain_locust_master_and_workers_merge_the_same_way(memory_cluster, client, table_name, tmp_path):
    """`locust -f deploy/locustfile.py --master / --worker`: the workers have no MEMSERVER_TABLE
    (the master's settings reach them), the master logs the same merge."""
    client.create_table(table_name, 2048, 16)
    port = _free_port()
    locust_bin = os.path.join(os.path.dirname(sys.executable), "locust")
    env = {**os.environ, "MEMSERVER_ENDPOINT": memory_cluster.endpoint}
    master = subprocess.Popen(
        [locust_bin, "-f", "deploy/locustfile.py", "--master", "--master-bind-host", "127.0.0.1", "--master-bind-port",
         str(port), "--headless", "-u", "2", "-r", "2", "-t", "3s", "--expect-workers", "2",
         "--expect-workers-max-wait", "60"],
        env={**env, "MEMSERVER_TABLE": table_name, "MEMSERVER_BATCH": "16", "MEMSERVER_KNN": "4"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    workers = [subprocess.Popen([locust_bin, "-f", "deploy/locustfile.py", "--worker", "--master-host", "127.0.0.1",
                                 "--master-port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, stdin=subprocess.DEVNULL) for _ in range(2)]
    try:
        _, err = master.communicate(timeout=240)
        w_err = [w.communicate(timeout=60)[1] for w in workers]
    finally:
        for p in (master, *workers):
            if p.poll() is None:
                p.kill()
        client.drop_table(table_name)

    def exact(log: str) -> dict:
        at = log.rindex("exact latencies (ms): ") + len("exact latencies (ms): ")
        return json.JSONDecoder().raw_decode(log[at:])[0]

    assert master.returncode == 0, err[-4000:]
    report = exact(err)
    own = [exact(e) for e in w_err]  # each worker logs its own share
    assert report["failures"] == 0 and report["missing_workers"] == [] and len(report["workers"]) == 2
    assert report["requests"] > 0 and report["requests"] == sum(r["requests"] for r in own) == \
        sum(w["requests"] for w in report["workers"].values())
    assert report["total"]["max_ms"] == max(r["total"]["max_ms"] for r in own)


def test_plain_locust_on_a_table_that_does_not_exist_stops_at_once(memory_cluster, tmp_path):
    """Every user's first call failed (NOT_FOUND) with a traceback each, and locust then ran its
    whole --run-time sending nothing, exit 1 at the end: it stops at once, saying why in one line,
    with `memserver loadtest`'s exit status for a table that does not exist (2: the command was wrong)."""
    locust_bin = os.path.join(os.path.dirname(sys.executable), "locust")
    env = {**os.environ, "MEMSERVER_ENDPOINT": memory_cluster.endpoint, "MEMSERVER_TABLE": "no-such-table"}
    t0 = time.monotonic()
    done = subprocess.run([locust_bin, "-f", "deploy/locustfile.py", "--headless", "-u", "3", "-r", "3", "-t", "60s"],
                          env=env, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.count("the load cannot start: ") == 1 and "table 'no-such-table' does not exist" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert time.monotonic() - t0 < 45  # not the 60 s asked for
    # a table of another kind: refused by the load's own check (ValueError), 2 as under memserver loadtest
    from client import MemoryClient

    with MemoryClient(memory_cluster.endpoint) as client:
        client.create_index("locust-not-values", 4)
        try:
            env["MEMSERVER_TABLE"] = "locust-not-values"
            done = subprocess.run([locust_bin, "-f", "deploy/locustfile.py", "--headless", "-u", "1", "-r", "1", "-t",
                                   "60s"], env=env, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
        finally:
            client.drop_table("locust-not-values")
    assert done.returncode == 2 and "--table: locust-not-values is an index table" in done.stderr, done.stderr[-3000:]


def test_a_scratch_table_gets_one_untimed_call_of_each_kind_before_the_load(memory_cluster, client, monkeypatch):
    """A fresh install's shards compile a kernel at its first call (15-18 s), which the first
    timed calls waited out: a first load test failed DEADLINE_EXCEEDED (a walkthrough). The
    scratch table has had one call of each kind in the mix, untimed, when the load starts."""
    import memserver.loadtest.run as run_module
    from memserver.loadtest.run import ScratchTable, run_loadtest

    seen = {}

    def child(env, args, timeout, save_latencies):  # where the locust child would start
        table = env["MEMSERVER_TABLE"]
        stats = client.slot_stats(table, np.arange(64))
        seen.update(table=table, hits=int(stats["hits"].sum()), updates=int(stats["updates"].sum()))
        return LatencyRecorder().report(1.0, names=["bag"])

    monkeypatch.setattr(run_module, "_run_child", child)
    cfg = LoadConfig(endpoint=memory_cluster.endpoint, table="(scratch)", mix=parse_mix("bag:8,lookup:1,bag_backward:1"),
                     batch=3, knn=2)
    run_loadtest(cfg, 1, 1.0, 1.0, scratch=ScratchTable(64, 4, "cols"))
    assert seen["hits"] == 3 * 2 + 3  # one bag of 3 x 2 ids, one lookup of 3
    assert seen["updates"] > 0  # one bag_backward
    assert seen["table"] not in {t.name for t in client.list_tables()}  # dropped after, as ever


def test_a_scratch_table_the_cluster_could_not_drop_is_said_with_the_command_to_drop_it():
    """The other failure of the drop (the cluster stopped, a shard unreachable): the table may
    still be there, so the report says how to drop it."""
    from client import UnavailableError
    from memserver.loadtest.run import _drop_scratch

    class Gone:
        def drop_table(self, table):
            raise UnavailableError("coordinator 127.0.0.1:1: connection refused")

    said = _drop_scratch(Gone(), "loadtest-x")
    assert said == ("the scratch table loadtest-x was not dropped: UNAVAILABLE: coordinator 127.0.0.1:1: connection "
                    "refused; drop it with `memserver drop-table loadtest-x` once the cluster serves it")


_DROPPED_DURING_THE_RUN = """
import sys, tempfile
import memserver.cli as cli
import memserver.loadtest.run as run
from client import MemoryClient
from memserver.cluster.inprocess import InProcessServer
from memserver.loadtest.recorder import LatencyRecorder


def child(env, args, timeout, save_latencies):  # where the locust child would run: the table goes meanwhile
    with MemoryClient(env["MEMSERVER_ENDPOINT"]) as c:
        c.drop_table(env["MEMSERVER_TABLE"])
    return {**LatencyRecorder().report(1.0, names=["bag"]), "interrupted": False, "locust_exceptions": 0}


run._run_child = child
with tempfile.TemporaryDirectory() as tmp, InProcessServer(2, data_dir=tmp) as server:
    code = cli.main(["loadtest", "--endpoint", server.endpoint, "--mix", "bag", "--duration", "1s", "--num-rows", "64",
                     "--dim", "4", "--batch", "2", "--knn", "2", "--json"])
sys.exit(code)
"""


def test_a_failed_scratch_drop_is_said_once():
    """The drop's error was logged by the run and printed again by the command: the same long
    text twice on stderr (a hunt). The command says it (an in-process server: no Ray needed)."""
    run = subprocess.run([sys.executable, "-c", _DROPPED_DURING_THE_RUN], capture_output=True, text=True, timeout=240,
                         stdin=subprocess.DEVNULL)
    assert run.returncode == 1, run.stderr[-3000:]
    said = json.loads(run.stdout)["scratch_drop_error"]
    assert said.endswith("was dropped by someone else during the run: its later calls failed")
    assert run.stderr.count(said) == 1 and f"memserver: error: {said}" in run.stderr, run.stderr[-3000:]


def test_a_worker_has_its_message_handlers_before_it_connects():
    """A master that has all its workers sends the test's config at once; a worker registered its
    handlers only after connecting, so a config that came first was dropped ("Unknown message type
    received: memserver_config") and the worker waited its whole bound for a test (a suite run,
    across hosts). They are in place before the connection now. (In a child: locust's gevent
    patches the process that imports it.)"""
    code = textwrap.dedent("""
        import json
        import locust
        from locust import runners
        from locust.env import Environment
        from memserver.loadtest import distributed, user

        seen = {}
        runners.WorkerRunner.connect_to_master = lambda self: seen.update(self.custom_messages)  # (no master here)
        env = Environment(user_classes=[user.MemserverUser], events=locust.events)
        runner = distributed._connect_worker(env, ("127.0.0.1", 9), 0.5)
        print(json.dumps({"handlers": sorted(seen), "kept": distributed.setup(env) is env.memserver_distributed}))
        runner.greenlet.kill(block=True)
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])  # (the names distributed.CONFIG and COLLECT hold)
    assert {"memserver_config", "memserver_collect"} <= set(got["handlers"]) and got["kept"], got
