"""`memserver loadtest`: the locust load against the session's cluster, its request builder, its
exact percentiles and its argument errors."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import memserver.cli as cli
from client.ops import ClientSession, WriteTags
from memserver.loadtest.caller import ShardCaller, fetch_table
from memserver.loadtest.config import LoadConfig, parse_duration, parse_mix
from memserver.loadtest.recorder import LatencyRecorder


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
    assert report["requests"] > 0 and report["rps"] > 0
    assert 2.5 <= report["elapsed_s"] < 30
    assert report["table"]["scratch"] and report["table"]["shards"] == 2 and report["table"]["sharding"] == "cols"
    assert set(report["per_type"]) == set(mix)
    assert sum(s["requests"] for s in report["per_type"].values()) == report["requests"]
    for name, s in [*report["per_type"].items(), ("total", report["total"])]:
        assert s["requests"] > 0 and s["failures"] == 0 and s["response_bytes"] > 0, name
        assert 0 < s["p50_ms"] <= s["p95_ms"] <= s["p99_ms"] <= s["max_ms"] < 10_000, (name, s)
    assert report["per_type"]["bag"]["requests"] > report["per_type"]["lookup"]["requests"]  # 4:1, hundreds of calls
    assert not [t.name for t in client.list_tables() if t.name == report["table"]["name"]]


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


@pytest.mark.parametrize(
    "args, message",
    [
        (["--duration", "abc"], "--duration: expected a time like 30s"),
        (["--duration", "0s"], "--duration: must be more than zero"),
        (["--duration", "5 parsecs"], "--duration"),
        (["--mix", "bag:1,scan:2"], "--mix: unknown call 'scan'"),
        (["--users", "0"], "--users must be at least 1"),
        (["--table", "t", "--dim", "8"], "cannot be used with --table"),
    ],
)
def test_bad_loadtest_flags_are_named(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.setenv("MEMSERVER_HOME", str(tmp_path))  # no cluster: the flags fail before one is needed
    with pytest.raises(SystemExit) as exit_:
        cli.main(["loadtest", *args])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert "locust" not in sys.modules and "gevent" not in sys.modules  # no monkey patching in the CLI process


def test_loadtest_without_a_cluster_says_how_to_start_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEMSERVER_HOME", str(tmp_path))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["loadtest", "--duration", "1s"])
    assert exit_.value.code == 2 and "memserver up" in capsys.readouterr().err
