"""Three hosts for real: network namespaces on a bridge (tests/hosts.py), a Ray node in each, the
memory cluster's shards on two of them and a client on the third that knows the cluster only
through `memserver join-info`. Nothing here uses loopback between hosts: every call crosses a veth.

The cluster is started with no security flag at all: because its servers listen on their hosts'
addresses, tokens and TLS are on by themselves (memserver.cluster.secure)."""

from __future__ import annotations

import json
import os
import stat
import sys

import pytest

from tests import hosts as hosts_mod
from tests.conftest import TIMINGS

pytestmark = pytest.mark.skipif((why := hosts_mod.available()) is not None, reason=why or "")


@pytest.fixture(scope="module")
def cluster():
    with hosts_mod.Hosts(3) as hosts:
        mh = hosts_mod.MemoryHosts(hosts, shard_hosts=[1, 2], up_args=["--placement", "STRICT_SPREAD"])
        try:
            mh.start()
            yield mh
        finally:
            mh.stop()


def test_shards_on_two_hosts_serve_a_client_on_the_third_with_tokens_and_tls(cluster):
    hosts = cluster.hosts
    # the join-info file: mode 0600 (it grants the write token), and an endpoint file without a pid
    info = json.loads(cluster.join_file.read_text())
    assert stat.S_IMODE(os.stat(cluster.join_file).st_mode) == 0o600
    assert set(info) == {"endpoint", "token", "tls_ca", "tls_server_name"}
    assert info["endpoint"].startswith(hosts.addr(0) + ":") and info["token"] == cluster.record["token"]
    assert stat.S_IMODE(os.stat(cluster.data_dir / "tls" / "server-key.pem").st_mode) == 0o600

    out = hosts.work / "basic.json"
    r = hosts.run(0, [sys.executable, "-m", "tests.hosts_scenario", "basic", str(out)], env=cluster.client_env(),
                  check=False, timeout=240)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-5000:]}\nup.log:\n{hosts.log('up.log')}"
    res = json.loads(out.read_text())
    # status groups the shards by host: one shard on each of the two shard hosts, none on the client's
    assert [(h["host"], h["shards"]) for h in res["hosts"]] == [(hosts.addr(1), [0]), (hosts.addr(2), [1])] or \
        [(h["host"], h["shards"]) for h in res["hosts"]] == [(hosts.addr(1), [1]), (hosts.addr(2), [0])]
    assert all(h["data_dirs"] == [str(cluster.data_dir / f"shard-{h['shards'][0]:04d}")] for h in res["hosts"])
    assert sorted(a.rsplit(":", 1)[0] for a in res["shard_addresses"]) == [hosts.addr(1), hosts.addr(2)]
    # tables of both shardings and the trainer's table span both hosts, and equal the references
    assert res["rows_shards"] == res["cols_shards"] == res["train_table_shards"] == sorted(res["shard_addresses"])
    assert res["max_abs_err"] < 1e-4
    assert len(res["losses_remote"]) == 3 and res["max_loss_diff"] < 1e-4
    # on without any flag: no token -> UNAUTHENTICATED; plaintext -> the TLS port never answers
    assert res["no_token"] == "UnauthenticatedError"
    assert res["plaintext"] == "UNAVAILABLE"
    TIMINGS.append(f"3 hosts: Ray nodes {cluster.times['ray_nodes_s']:.0f}s, memserver up "
                   f"{cluster.times['memserver_up_s']:.0f}s, client checks {res['client_s']:.0f}s")


def test_loadtest_from_two_hosts_merges_every_workers_latencies_exactly(cluster):
    """`memserver loadtest` in locust's distributed mode across hosts: the master in host 0, a
    worker in each shard host; the merged percentiles are those of the workers' latencies together,
    over tokens and TLS (a worker without the token gets UNAUTHENTICATED)."""
    from tests.test_loadtest import check_merged

    hosts = cluster.hosts
    args = ["--users", "4", "--spawn-rate", "4", "--duration", "3s", "--batch", "32", "--knn", "4", "--num-rows",
            "4096", "--dim", "16", "--mix", "bag:2,lookup:1,bag_backward:1"]
    res = cluster.loadtest(0, [1, 2], args, port=5557)
    assert res["rc"] == [0, 0, 0], "\n".join(log[-3000:] for log in res["logs"])
    master, workers = res["reports"][0], res["reports"][1:]
    check_merged(master, workers, res["npz"][0], res["npz"][1:])
    # one worker per shard host, each its own share; the table spans both shard hosts
    assert sorted(w["address"] for w in master["workers"].values()) == [hosts.addr(1), hosts.addr(2)]
    assert sorted(w["address"] for w in workers) == [hosts.addr(1), hosts.addr(2)]
    assert master["table"]["shards"] == 2 and master["endpoint"].startswith(hosts.addr(0) + ":")
    assert [w["users"] for w in workers] == [2, 2] and all(w["endpoint"] == master["endpoint"] for w in workers)
    TIMINGS.append(f"loadtest over 2 worker hosts: {master['requests']} requests in {master['elapsed_s']:.1f}s, "
                   f"p50 {master['total']['p50_ms']} ms, p99 {master['total']['p99_ms']} ms (batch 32 x knn 4)")

    # the same worker with the CA but not the token (its own way to the cluster): refused
    info = json.loads(cluster.join_file.read_text())
    ca = hosts.work / "ca-only.pem"
    ca.write_text(info["tls_ca"])
    no_token = hosts.env(MEMSERVER_HOME=str(hosts.work / "no-token-home"), MEMSERVER_ENDPOINT=info["endpoint"],
                         MEMSERVER_TLS_CA=str(ca), MEMSERVER_TLS_SERVER_NAME=info.get("tls_server_name") or "")
    res = cluster.loadtest(0, [2], ["--users", "1", "--duration", "1s", "--batch", "8", "--knn", "2", "--num-rows",
                                    "1024", "--dim", "8"], port=5558, worker_env=no_token)
    assert res["rc"][0] == 1 and res["reports"][0] is not None, res["logs"][0][-3000:]
    assert "UNAUTHENTICATED" in json.dumps(res["reports"][0]["errors"]), res["reports"][0]["errors"]
    assert res["reports"][0]["requests"] == 0


def test_harness_leaves_nothing_behind():
    """Processes, namespaces and the work directory go at close, also after a host's processes
    were killed mid-way; a run whose pytest died is swept by the next one."""
    import subprocess

    hosts = hosts_mod.Hosts(2)
    hosts.build()
    names = [hosts.ns(0), hosts.ns(1), hosts.bridge_ns]
    sleeper = hosts.popen(1, ["sleep", "600"])
    # `ip netns exec` enters the namespace after Popen returns: the pid shows there a moment later
    assert hosts_mod.wait_for("sleeper in host 1", lambda: hosts_mod._pids(hosts.ns(1)) or None, 10) == [sleeper.pid]
    assert hosts.run(0, ["ip", "-o", "-4", "addr", "show", "eth0"]).stdout.split()[3] == f"{hosts.addr(0)}/24"
    # the only route in a host is its subnet: nothing else is reachable
    routes = hosts.run(0, ["ip", "route"]).stdout.strip().splitlines()
    assert routes == [f"{hosts_mod.SUBNET}.0/24 dev eth0 proto kernel scope link src {hosts.addr(0)}"]
    # the partition switch: host 0 reaches host 1 with its cable in, not with it out
    assert hosts.reachable(0, 1)
    hosts.link(1, up=False)
    assert not hosts.reachable(0, 1)
    hosts.link(1, up=True)
    assert hosts_mod.wait_for("link up", lambda: hosts.reachable(0, 1) or None, 10)
    assert hosts.kill_host(1) == 1 and sleeper.wait(timeout=5) == -9
    work = hosts.work
    hosts.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names) and not work.exists()
    # a leftover of a run whose process is gone (pid 2^22 + 1 is above any pid_max default)
    stale = f"ms{(1 << 22) + 1}-1-h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    assert stale in hosts_mod.sweep()
    assert stale not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
