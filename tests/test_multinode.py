"""Placement of shards over Ray nodes: a simulated multi-node cluster (in a subprocess, see
tests/multinode_scenario.py), the placement group on the session's one-node cluster, the error
when shards cannot be placed, and the bind-address and GPU-device rules."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import memserver.cli as cli
from tests.conftest import TIMINGS

ROOT = Path(__file__).resolve().parents[1]


def test_shards_spread_over_nodes_and_serve_across_them():
    # RAY_TMPDIR: ray.cluster_utils writes the cluster's address into <tmp>/ray/ray_current_cluster,
    # which every later ray.init() on this machine would join; keep it private (and short: sockets).
    ray_tmp = tempfile.mkdtemp(prefix="msr-", dir="/tmp")
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_USAGE_STATS_ENABLED": "0", "MEMSERVER_BIND_HOST": "127.0.0.1"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "-m", "tests.multinode_scenario"], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the scenario's own process group: its `up` child too
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"multi-node scenario did not finish in 240 s\n{err[-3000:]}")
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, err[-5000:]
    r = json.loads(out.strip().splitlines()[-1])
    assert len(set(r["nodes"])) == 3  # head + 2 workers
    assert len(set(r["shard_nodes"])) == 2 and set(r["shard_nodes"]) <= set(r["nodes"])  # SPREAD: one per node
    assert all(a.startswith("127.0.0.1:") for a in r["shard_addresses"]) and r["endpoint"].startswith("127.0.0.1:")
    assert r["rows_shards"] == r["cols_shards"] == sorted(r["shard_addresses"])  # both tables span both nodes
    assert r["max_abs_err"] < 1e-4 and r["status_rows"] == 100 + 100 + 200 + 200
    assert r["secured"]  # several nodes: tokens and TLS on without any flag
    [pg] = r["placement_groups_while_up"]
    assert pg["strategy"] == "SPREAD" and pg["state"] == "CREATED" and pg["bundle_nodes"] == sorted(r["shard_nodes"])
    assert r["down_status"] == 0 and r["up_exit"] == 0, r["up_log_tail"]
    assert r["placement_groups_after_down"] == ["REMOVED"]
    t = r["times"]
    TIMINGS.append(f"multi-node scenario: 3 Ray nodes {t['ray_nodes_s']:.0f}s, memserver up {t['memserver_up_s']:.0f}s, "
                   f"checks {t['checks_s']:.0f}s, down {t['down_s']:.0f}s (cumulative)")


def test_one_node_cluster_uses_a_placement_group(memory_cluster):
    from ray.util import placement_group_table

    pg = placement_group_table(memory_cluster.placement_group)
    assert pg["strategy"] == "SPREAD" and pg["state"] == "CREATED"
    assert list(pg["bundles"].values()) == [{"CPU": 0.25}, {"CPU": 0.25}]
    assert len(set(pg["bundles_to_node_id"].values())) == 1  # one node: both bundles on it
    assert all(i["address"].startswith("127.0.0.1:") for i in memory_cluster.shard_infos)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"num_shards": 2, "shard_cpus": 0.25, "placement": "STRICT_SPREAD"}, ["STRICT_SPREAD needs 2 nodes", "CPU=0.25"]),
        ({"num_shards": 1, "shard_cpus": 0.25, "shard_gpus": 1}, ["CPU=0.25, GPU=1", "placement SPREAD"]),
        # a mixed cluster: one bundle per shard, each with its own GPUs
        ({"num_shards": 2, "shard_cpus": 0.25, "shard_gpus": [1, 0]}, ["of {CPU=0.25, GPU=1} / {CPU=0.25} with"]),
    ],
)
def test_unplaceable_shards_fail_clearly_and_release_everything(memory_cluster, kwargs, words, tmp_path, monkeypatch):
    """A placement Ray cannot make fails saying what to change, and leaves nothing behind: the pending
    placement group, the actors, the scratch data directory (made before the placement, it was left)."""
    import ray
    from ray.util import placement_group_table

    from memserver.cluster.launch import start_cluster

    monkeypatch.setenv("MEMSERVER_HOME", str(tmp_path))
    before = {k: v for k, v in placement_group_table().items() if v["state"] != "REMOVED"}
    with pytest.raises(RuntimeError, match="could not place") as err:
        start_cluster(**kwargs, name="unplaceable", placement_timeout=1)
    for word in (*words, "1 alive node", "--placement-timeout"):
        assert word in str(err.value)
    after = {k: v for k, v in placement_group_table().items() if v["state"] != "REMOVED"}
    assert after.keys() == before.keys()  # the pending group was removed
    assert list((tmp_path / "run").iterdir()) == []  # and the scratch data directory
    with pytest.raises(ValueError):
        ray.get_actor("unplaceable-coordinator")


def test_bad_placement_arguments(memory_cluster):
    from memserver.cluster.launch import start_cluster

    with pytest.raises(ValueError, match="placement must be one of SPREAD, STRICT_SPREAD, PACK"):
        start_cluster(1, placement="RANDOM")
    with pytest.raises(ValueError, match="shard_cpus > 0 or shard_gpus > 0"):
        start_cluster(1, shard_cpus=0)
    with pytest.raises(ValueError, match=r"one per shard \(2\), got 3"):
        start_cluster(2, shard_gpus=[1, 0, 0])


def test_shard_gpus_flag_is_one_number_or_one_per_shard(tmp_path):
    import argparse

    from memserver.cli.common import CliError
    from memserver.cli.lifecycle import add_parsers, cmd_up

    parser = argparse.ArgumentParser(prog="memserver")
    add_parsers(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["up", "--shard-gpus", "0.5"]).shard_gpus == 0.5
    assert parser.parse_args(["up", "--shard-gpus", "1,1,0,0"]).shard_gpus == [1.0, 1.0, 0.0, 0.0]
    for bad in ("x", "1,-1"):
        with pytest.raises(SystemExit):
            parser.parse_args(["up", "--shard-gpus", bad])
    with pytest.raises(CliError, match="--shard-gpus: one number for every shard, or one per shard \\(3\\), got 2"):
        cmd_up(parser.parse_args(["up", "--shards", "3", "--shard-gpus", "1,0"]))
    config = tmp_path / "c.yaml"
    for bad in ('"1,x"', "[1, 0]"):  # the config's shard_gpus: a string or a list, checked the same way
        config.write_text(f"shards: 3\nshard_gpus: {bad}\n")
        with pytest.raises(CliError, match=f"shard_gpus in {config}: "):  # (named by its key and file)
            cmd_up(parser.parse_args(["up", "--config", str(config)]))


def test_placement_flag_and_config_key(tmp_path):
    args = cli.build_parser().parse_args(["up", "--placement", "strict_spread", "--placement-timeout", "600"])
    assert args.placement == "STRICT_SPREAD" and args.placement_timeout == 600
    assert cli.build_parser().parse_args(["up"]).placement is None  # then the config's, else SPREAD
    path = tmp_path / "t.yaml"
    path.write_text("placement: pack\n")
    assert cli.load_config(str(path))["placement"] == "PACK"
    path.write_text("placement: everywhere\n")
    with pytest.raises(cli.CliError, match="placement .* must be one of SPREAD, STRICT_SPREAD, PACK"):
        cli.load_config(str(path))


def test_bind_host_rules(monkeypatch):
    """127.0.0.1 on one node; the node's own address on several; MEMSERVER_BIND_HOST over both.
    (No socket is opened: ray.nodes and the node address are stubbed.)"""
    import ray

    from memserver.server import rayutil

    monkeypatch.delenv(rayutil.BIND_HOST_ENV, raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.7")
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True}, {"Alive": False}])
    assert rayutil.bind_host() == "127.0.0.1"
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True}, {"Alive": True}])
    assert rayutil.bind_host() == "10.0.0.7"
    monkeypatch.setenv(rayutil.BIND_HOST_ENV, "127.0.0.1")
    assert rayutil.bind_host() == "127.0.0.1"
    for wildcard in ("0.0.0.0", "::", "[::]", "0", "0.0", "000.000.000.000", "::0", "0:0:0:0:0:0:0:0"):
        monkeypatch.setenv(rayutil.BIND_HOST_ENV, wildcard)
        with pytest.raises(ValueError, match="wildcard"):
            rayutil.bind_host()


def test_shard_rows_live_on_the_gpu_ray_assigned(monkeypatch):
    """A shard puts its tables on cuda exactly when Ray gave the actor a GPU (no GPU here:
    torch.cuda.is_available, being an actor and ray.get_gpu_ids are stubbed; nothing is
    allocated). The rule itself: tests/test_inprocess.py."""
    import ray
    import torch

    from memserver.server import rayutil
    from memserver.server.rayutil import shard_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(rayutil, "in_actor", lambda: True)
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [0])
    assert shard_device() == torch.device("cuda", 0) and rayutil.gpus() == 1.0
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [])
    assert shard_device().type == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [0])
    assert shard_device().type == "cpu"
