"""Secure by default (memserver.cluster.secure) and `memserver join-info`: the rule, the files it
makes and their modes, the certificate a client checks by name, and the join-info file. The whole
path on real hosts is tests/test_hosts.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from memserver.api.auth import AuthConfig
from memserver.cluster.endpoint import join_info, write_endpoint
from memserver.cluster.secure import SERVER_NAME, is_loopback, network_facing, secure_defaults
from memserver.server.config import TlsFiles

ROOT = Path(__file__).resolve().parents[1]


def test_which_addresses_face_the_network():
    for host in ("127.0.0.1", "127.5.0.1", "::1", "[::1]", "localhost"):
        assert is_loopback(host) and not network_facing(host)
    for host in ("10.213.0.12", "192.168.1.4", "fe80::1", "node-3.cluster.local"):
        assert not is_loopback(host) and network_facing(host)
    assert network_facing(None)  # each server on its own node's address


def test_loopback_changes_nothing(tmp_path):
    sec = secure_defaults("127.0.0.1", None, None, False, tmp_path / "tls", [])
    assert (sec.auth, sec.tls, sec.tokens, sec.ca, sec.warning) == (None, None, None, None, "")
    assert not (tmp_path / "tls").exists()


def test_network_facing_servers_get_tokens_and_a_certificate(tmp_path):
    from cryptography import x509

    sec = secure_defaults(None, None, None, False, tmp_path / "tls", ["10.213.0.11", "10.213.0.12"])
    write, read = sec.tokens
    assert write != read and sec.auth == AuthConfig.from_tokens(write, read)
    assert sec.server_name == SERVER_NAME and sec.warning == ""
    key, cert = Path(sec.tls.key), Path(sec.tls.cert)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and cert.read_bytes() == sec.ca
    sans = x509.load_pem_x509_certificate(sec.ca).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == [SERVER_NAME]
    assert [str(a) for a in sans.get_values_for_type(x509.IPAddress)] == ["10.213.0.11", "10.213.0.12"]
    # only what is missing is made: given tokens stay, a certificate is still made (and the reverse)
    given = AuthConfig.from_tokens("w" * 8)
    sec2 = secure_defaults("10.0.0.5", given, None, False, tmp_path / "tls2", [])
    assert sec2.auth is given and sec2.tokens is None and sec2.ca is not None
    files = TlsFiles("c.pem", "k.pem")
    sec3 = secure_defaults("10.0.0.5", None, files, False, tmp_path / "tls3", [])
    assert sec3.tls is files and sec3.tokens is not None and sec3.ca is None and not (tmp_path / "tls3").exists()


def test_insecure_makes_nothing_and_says_so(tmp_path):
    sec = secure_defaults("10.0.0.5", None, None, True, tmp_path / "tls", [])
    assert sec.auth is None and sec.tls is None and not (tmp_path / "tls").exists()
    assert sec.warning.startswith("INSECURE") and "10.0.0.5" in sec.warning and "tokens or TLS" in sec.warning


def test_a_certificate_made_for_the_name_is_checked_by_the_name(tmp_path):
    """A client dials 127.0.0.1 and checks the certificate against SERVER_NAME (a shard Ray moved
    to another host has another address): accepted; against another name: refused."""
    import grpc
    import torch

    from client.channels import ClientTls, sync_channel
    from memserver.api.v1 import memserver_pb2 as pb
    from memserver.api.v1 import memserver_pb2_grpc as pb_grpc
    from memserver.loop import LoopThread
    from memserver.server.config import ServeConfig
    from memserver.server.dataplane import DataPlaneServicer
    from memserver.server.grpcserver import serve_on

    sec = secure_defaults("10.9.9.9", None, None, False, tmp_path / "tls", [])  # not this machine's address
    loop = LoopThread("secure-test")
    server, port = serve_on(loop, lambda s: pb_grpc.add_DataPlaneServicer_to_server(DataPlaneServicer(torch.device("cpu")), s),
                            ["memserver.v1.DataPlane"], "127.0.0.1", config=ServeConfig(auth=sec.auth, tls=sec.tls))
    try:
        def lookup(name: str) -> str:
            with sync_channel(f"127.0.0.1:{port}", retries=False, token=sec.tokens[0],
                              tls=ClientTls(sec.ca, name)) as ch:
                try:
                    pb_grpc.DataPlaneStub(ch).Lookup(pb.LookupRequest(table="nope"), timeout=10)
                except grpc.RpcError as exc:
                    return exc.code().name
            return "OK"

        assert lookup(SERVER_NAME) == "NOT_FOUND"  # through TLS and the token check to the handler
        assert lookup("someone-else") == "UNAVAILABLE"  # the certificate does not name it
    finally:
        loop.call(server.stop(None))
        loop.stop()


def test_join_info_carries_one_token_and_the_ca():
    rec = {"endpoint": "10.213.0.11:5000", "pid": 7, "token": "W", "read_token": "R", "tls_ca": "PEM",
           "tls_server_name": "memserver", "shards": ["x"], "ray_address": "y"}
    assert join_info(rec) == {"endpoint": "10.213.0.11:5000", "token": "W", "tls_ca": "PEM", "tls_server_name": "memserver"}
    assert join_info(rec, read_only=True)["token"] == "R"
    with pytest.raises(ValueError, match="no read token"):
        join_info({**rec, "read_token": None}, read_only=True)
    assert join_info({"endpoint": "127.0.0.1:1", "pid": 1}) == {"endpoint": "127.0.0.1:1"}


PEM = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"  # (a CA as clients take it: a PEM block)


def test_join_info_command_writes_mode_0600_and_down_leaves_it(tmp_path):
    from memserver.cluster.endpoint import started_at

    up = {"pid": os.getpid(), "pid_start": started_at(os.getpid())}  # (this process plays the running `up`)
    home = tmp_path / "home"
    write_endpoint({"endpoint": "10.213.0.11:5000", **up, "token": "W", "read_token": "R",
                    "tls_ca": PEM}, home / "endpoint.json")
    env = {**os.environ, "MEMSERVER_HOME": str(home)}
    env.pop("MEMSERVER_ENDPOINT_FILE", None)
    out = tmp_path / "join.json"
    with open(out, "w") as f:  # `memserver join-info > join.json`, under a permissive umask
        os.chmod(out, 0o644)
        r = subprocess.run([sys.executable, "-m", "memserver.cli", "join-info"], stdout=f, stderr=subprocess.PIPE,
                           env=env, cwd=ROOT, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert json.loads(out.read_text()) == {"endpoint": "10.213.0.11:5000", "token": "W", "tls_ca": PEM}
    o = tmp_path / "ro.json"
    (tmp_path / "ro.tmp").write_text("a user's notes")  # (the file's writer removed a .tmp of its name: a hunt)
    r = subprocess.run([sys.executable, "-m", "memserver.cli", "join-info", "--read-only", "-o", "ro.json"],
                       capture_output=True, env=env, cwd=tmp_path, text=True, timeout=60)
    assert r.returncode == 0 and "only this host reaches" not in r.stderr
    assert f"export MEMSERVER_ENDPOINT_FILE={o}\n" in r.stderr  # absolute: it works from any folder
    assert stat.S_IMODE(o.stat().st_mode) == 0o600 and json.loads(o.read_text())["token"] == "R"
    assert (tmp_path / "ro.tmp").read_text() == "a user's notes" and not list(tmp_path.glob(".ro.json.*"))
    # a cluster on loopback: the file would send other hosts to their own loopback, so it says so
    write_endpoint({"endpoint": "127.0.0.1:5000", **up}, home / "endpoint.json")
    r = subprocess.run([sys.executable, "-m", "memserver.cli", "join-info"], capture_output=True, env=env, cwd=ROOT,
                       text=True, timeout=60)
    assert r.returncode == 0 and json.loads(r.stdout) == {"endpoint": "127.0.0.1:5000"}
    assert "note: the cluster listens on 127.0.0.1, which only this host reaches" in r.stderr, r.stderr
    write_endpoint({"endpoint": "10.213.0.11:5000", **up, "token": "W", "read_token": "R",
                    "tls_ca": PEM}, home / "endpoint.json")
    # on the client's host the file is the endpoint file: clients read it, `down` stops nothing
    # (it reads only $MEMSERVER_HOME/endpoint.json, what an `up` there wrote)
    env2 = {**env, "MEMSERVER_ENDPOINT_FILE": str(out), "MEMSERVER_HOME": str(tmp_path / "client-home")}
    r = subprocess.run([sys.executable, "-m", "memserver.cli", "down"], capture_output=True, env=env2, cwd=ROOT,
                       text=True, timeout=60)
    assert r.returncode == 0 and "no memserver is running" in r.stdout and out.exists()
    from client.channels import client_tls, client_token

    os.environ["MEMSERVER_ENDPOINT_FILE"] = str(out)
    try:
        assert client_token(None) == "W" and client_tls(None).ca == PEM.encode()
    finally:
        del os.environ["MEMSERVER_ENDPOINT_FILE"]


def test_join_info_writes_no_token_into_another_users_file_or_through_a_link(tmp_path):
    """`join-info > FILE` over a file another user made kept it theirs (mode 0600, their owner:
    they read the token), and `-o LINK` wrote through a link someone left at the path, replacing
    the link's target (a hunt, both as user nobody in /tmp)."""
    from memserver.cluster.endpoint import started_at

    up = {"pid": os.getpid(), "pid_start": started_at(os.getpid())}
    home = tmp_path / "home"
    write_endpoint({"endpoint": "10.213.0.11:5000", **up, "token": "W"}, home / "endpoint.json")
    env = {**os.environ, "MEMSERVER_HOME": str(home)}
    env.pop("MEMSERVER_ENDPOINT_FILE", None)
    theirs = tmp_path / "theirs.json"
    theirs.write_text("x")
    os.chown(theirs, 65534, 65534)  # (the tests run as root: user nobody's file)
    with open(theirs, "a") as f:
        r = subprocess.run([sys.executable, "-m", "memserver.cli", "join-info"], stdout=f, stderr=subprocess.PIPE,
                           env=env, cwd=ROOT, text=True, timeout=60)
    assert r.returncode == 2 and "is nobody's" in r.stderr and "nothing written: use -o FILE" in r.stderr, r.stderr
    assert theirs.read_text() == "x"
    twice = tmp_path / "twice.json"
    twice.write_text("")
    os.link(twice, tmp_path / "other-name.json")
    with open(twice, "w") as f:
        r = subprocess.run([sys.executable, "-m", "memserver.cli", "join-info"], stdout=f, stderr=subprocess.PIPE,
                           env=env, cwd=ROOT, text=True, timeout=60)
    assert r.returncode == 2 and "with 2 names" in r.stderr and twice.read_text() == "", r.stderr
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    (tmp_path / "link.json").symlink_to(victim)
    r = subprocess.run([sys.executable, "-m", "memserver.cli", "join-info", "-o", "link.json"], capture_output=True,
                       env=env, cwd=tmp_path, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert victim.read_text() == "mine" and not (tmp_path / "link.json").is_symlink()
    assert json.loads((tmp_path / "link.json").read_text())["token"] == "W"


def test_status_groups_shards_by_host_and_shows_a_moved_one():
    from memserver.cli.tables import hosts_of

    def shard(i, address, node, moved="", gpus=0.0):
        return {"index": i, "address": address, "node_id": node, "data_dir": f"/nfs/data/shard-{i:04d}",
                "moved_from": moved, "gpus": gpus}

    hosts = hosts_of([shard(0, "10.213.0.13:5001", "n3"), shard(1, "10.213.0.14:5002", "n4", moved="10.213.0.12"),
                      shard(2, "10.213.0.13:5003", "n3", gpus=1.0), shard(3, "[fe80::1]:5004", "n6")])
    assert [(h["host"], h["shards"], h["node_ids"], h["gpus"]) for h in hosts] == [
        ("10.213.0.13", [0, 2], ["n3"], 1.0), ("10.213.0.14", [1], ["n4"], 0.0), ("fe80::1", [3], ["n6"], 0.0)]
    assert hosts[1]["moved_here"] == [{"shard": 1, "from": "10.213.0.12"}] and hosts[0]["moved_here"] == []
    assert hosts[0]["data_dirs"] == ["/nfs/data/shard-0000", "/nfs/data/shard-0002"]


def test_down_after_a_killed_up_stops_what_it_left_running(tmp_path, monkeypatch, capsys):
    """A `memserver up` killed by SIGKILL (the OOM killer) left Ray's agents running for good. Its
    endpoint file records what it started, [pid, start time] each: `down` stops those still
    running with the same start time (a reused pid is never hit), and says so."""
    import memserver.cli as cli
    from memserver.cluster.endpoint import descendants, started_at

    monkeypatch.setenv("MEMSERVER_HOME", str(tmp_path))
    monkeypatch.delenv("MEMSERVER_ENDPOINT_FILE", raising=False)
    left = subprocess.Popen(["sleep", "60"])
    bystander = subprocess.Popen(["sleep", "60"])  # recorded with another start time: a reused pid
    started = [left, bystander]
    gone = subprocess.Popen(["true"])
    gone.wait()
    try:
        assert [left.pid, started_at(left.pid)] in descendants(os.getpid())
        write_endpoint({"endpoint": "127.0.0.1:1", "pid": gone.pid, "host": socket.gethostname(),
                        "processes": [[left.pid, started_at(left.pid)], [bystander.pid, started_at(bystander.pid) + 1]]},
                       tmp_path / "endpoint.json")
        assert cli.main(["down"]) == 0
        assert "and stopped 1 process(es) it had left running" in capsys.readouterr().out
        assert left.wait(timeout=10) == -signal.SIGTERM
        assert bystander.poll() is None
        # an `up` refused for its flags stops them too (it checked its flags first and left them)
        again = subprocess.Popen(["sleep", "60"])
        started.append(again)
        write_endpoint({"endpoint": "127.0.0.1:1", "pid": gone.pid, "host": socket.gethostname(),
                        "processes": [[again.pid, started_at(again.pid)]]}, tmp_path / "endpoint.json")
        with pytest.raises(SystemExit):
            cli.main(["up", "--shards", "0"])
        assert again.wait(timeout=10) == -signal.SIGTERM
    finally:
        for p in started:
            p.kill()
            p.wait()
