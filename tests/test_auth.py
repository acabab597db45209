"""Token authentication: a cluster started with tokens refuses calls without one (raw gRPC
channels, not the project's client), refuses writes with the read token, keeps health checks
open and reflection closed; the clients, the CLI and the load test's caller send the token."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from memserver.api.auth import AuthConfig, read_token_file
from memserver.api.errors import UnauthenticatedError
from memserver.api.v1 import memserver_pb2 as pb
from memserver.api.v1 import memserver_pb2_grpc as pb_grpc
from memserver.wire import encode
from tests.conftest import READ, WRITE


def test_roles_from_metadata():
    auth = AuthConfig.from_tokens(WRITE, READ)
    assert auth.role([("authorization", f"Bearer {WRITE}")]) == "write"
    assert auth.role([("authorization", f"Bearer {READ}")]) == "read"
    for md in ([], [("authorization", "Bearer nope")], [("authorization", WRITE)], [("x", f"Bearer {WRITE}")],
               [("authorization", "Bearer ")]):
        assert auth.role(md) is None
    assert WRITE not in repr(auth) and READ not in repr(auth)  # only digests are kept
    with pytest.raises(ValueError, match="must differ"):
        AuthConfig.from_tokens(WRITE, WRITE)


def test_token_files(tmp_path, caplog):
    w, r = "w" * 16, "r" * 16
    (tmp_path / "a.json").write_text(json.dumps({"write": w, "read": f" {r}\n"}))
    (tmp_path / "b").write_text(f"{w}\r\n{r}\n")
    (tmp_path / "c").write_text("only-write-token\n")
    for f in ("a.json", "b", "c"):
        (tmp_path / f).chmod(0o600)
    assert read_token_file(tmp_path / "a.json") == (w, r)  # stripped as clients strip (the server kept the spaces)
    assert read_token_file(tmp_path / "b") == (w, r)
    assert read_token_file(tmp_path / "c") == ("only-write-token", None)
    assert "other local users may read" not in caplog.text
    (tmp_path / "c").chmod(0o644)  # (accepted silently before: a security walkthrough)
    assert read_token_file(tmp_path / "c") == ("only-write-token", None)
    assert f"token file {tmp_path / 'c'} has mode 644: other local users may read its tokens; chmod 600 it" in caplog.text


def test_a_token_file_in_another_form_is_refused_naming_the_form(tmp_path):
    """A hunt: {"read": R} failed "--auth-token-file: 'write'"; a JSON array's text became the
    write token, and YAML's "write: W" lines, a token in quotes and a misspelt "reader" key were
    taken as they were, so a cluster started that every client's token failed. Each is refused,
    saying the form, and no token is in the message."""
    w, r = "w" * 20, "r" * 20
    form = r'a token file is a JSON object \{"write": "...", "read": "..."\}'
    for name, text, says in (("noread.json", json.dumps({"read": r}), form + r'.*; this one holds \{"read": "<string>"\}'),
                             ("list.json", json.dumps([w, r]), form + r'.*; this one holds \["<string>", "<string>"\]'),
                             ("typo.json", json.dumps({"write": w, "reader": r}), form),
                             ("askey.json", json.dumps({w: "write"}), form + r'.*; this one holds \{"<key 1>": "<string>"\}'),
                             ("bad.json", '{"write": ', "not valid JSON"),
                             # (a number's or a bool's value was printed: a token written unquoted)
                             ("number.json", '{"write": 98234759823475982347598234, "read": true, "x": null}',
                              form + r'.*; this one holds \{"write": "<number>", "read": "<bool>", "<key 3>": "<null>"\}'),
                             ("quoted", f'"{w}"', "not valid JSON|" + form),
                             ("yaml", f"write: {w}\nread: {r}\n", r"the write token holds spaces, quotes or a key"),
                             ("three", f"{w}\n{r}\n{r}\n", "3 lines; " + form)):
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o600)
        with pytest.raises(ValueError, match=says) as err:
            read_token_file(tmp_path / name)
        assert w not in str(err.value) and r not in str(err.value) and "982347" not in str(err.value)


@pytest.mark.parametrize("tokens, message", [
    ({"write": "a", "read": "b" * 16}, "the write token has 1 characters, fewer than 16"),
    ({"write": "w" * 16, "read": "short"}, "the read token has 5 characters, fewer than 16"),
    ({"write": "wörterbuch-token-1", "read": "r" * 16}, "a token is printable ASCII"),
    ({"write": "w" * 16 + "\x07", "read": "r" * 16}, "a token is printable ASCII"),
])
def test_a_token_file_no_client_could_use_or_anyone_could_guess_is_refused(tmp_path, tokens, message, monkeypatch,
                                                                           capsys):
    """A security walkthrough: a file of tokens "a" and "b" started an open-in-all-but-name cluster;
    a non-ASCII token, one no client can send, started a cluster no client could call; a token with
    surrounding spaces was kept as it was while clients stripped theirs, so every call was
    UNAUTHENTICATED. `up` now refuses such a file before Ray starts, naming it."""
    from memserver import cli

    (tmp_path / "t.json").write_text(json.dumps(tokens))
    (tmp_path / "t.json").chmod(0o600)
    with pytest.raises(ValueError, match=message):
        read_token_file(tmp_path / "t.json")
    monkeypatch.setenv("MEMSERVER_HOME", str(tmp_path))

    def no_ray(*args, **kwargs):  # (were the file taken, no cluster starts in the test's process)
        raise AssertionError("up went on to start Ray")

    monkeypatch.setattr("ray.init", no_ray)
    with pytest.raises(SystemExit) as err:
        cli.main(["up", "--auth-token-file", str(tmp_path / "t.json"), "--shards", "1"])
    assert err.value.code == 2 and f"--auth-token-file: {tmp_path / 't.json'}: " in capsys.readouterr().err
    with pytest.raises(ValueError, match="printable ASCII without surrounding spaces"):
        AuthConfig.from_tokens(" w ", None)


def raw_call(address, service, method, request, token=None):
    stub = (pb_grpc.ControlPlaneStub if service == "control" else pb_grpc.DataPlaneStub)(grpc.insecure_channel(address))
    metadata = [("authorization", f"Bearer {token}")] if token else None
    return getattr(stub, method)(request, metadata=metadata, timeout=30)


def status_of(call):
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def test_calls_without_the_right_token_are_refused(auth_cluster):
    ep = auth_cluster.endpoint
    shard = auth_cluster.shard_infos[0]["address"]
    for token in (None, "wrong"):
        code, text = status_of(lambda t=token: raw_call(ep, "control", "ListTables", pb.ListTablesRequest(), t))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in text and "wrong" not in text
        assert "new tokens at every start: an earlier `memserver join-info` file holds old ones" in text
        code, _ = status_of(lambda t=token: raw_call(shard, "data", "Lookup", pb.LookupRequest(table="x"), t))
        assert code == grpc.StatusCode.UNAUTHENTICATED
    # unparseable bytes are refused before they are parsed
    channel = grpc.insecure_channel(shard)
    junk = channel.unary_unary("/memserver.v1.DataPlane/Bag", request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as err:
        junk(b"\xff\x00garbage", timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # the read token: reads yes, writes no (PERMISSION_DENIED), on both services
    assert raw_call(ep, "control", "ListTables", pb.ListTablesRequest(), READ).tables == []
    spec = pb.TableSpec(name="t", num_rows=8, dim=2)
    code, text = status_of(lambda: raw_call(ep, "control", "CreateTable", pb.CreateTableRequest(spec=spec), READ))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "CreateTable" in text
    code, _ = status_of(lambda: raw_call(shard, "data", "BagBackward", pb.BagBackwardRequest(table="t"), READ))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    code, _ = status_of(lambda: raw_call(shard, "data", "RecordTriggers", pb.RecordTriggersRequest(table="t"), READ))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    # the write token passes (the call itself then fails for its own reason: no such table)
    code, _ = status_of(lambda: raw_call(shard, "data", "Lookup", pb.LookupRequest(table="x", ids=encode(np.zeros(1, np.int64))),
                                         WRITE))
    assert code == grpc.StatusCode.NOT_FOUND


def test_health_is_open_and_reflection_needs_a_token(auth_cluster):
    ch = grpc.insecure_channel(auth_cluster.endpoint)
    resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    # a Watch stream holds the server's memory for as long as its peer keeps it: a token's, not anyone's
    with pytest.raises(grpc.RpcError) as err:
        next(health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""), timeout=30))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""), timeout=30,
                                                 metadata=[("authorization", f"Bearer {READ}")])
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()
    refl = reflection_pb2_grpc.ServerReflectionStub(ch)
    ask = [reflection_pb2.ServerReflectionRequest(list_services="")]
    with pytest.raises(grpc.RpcError) as err:
        list(refl.ServerReflectionInfo(iter(ask), timeout=30))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    got = list(refl.ServerReflectionInfo(iter(ask), metadata=[("authorization", f"Bearer {READ}")], timeout=30))
    assert "memserver.v1.ControlPlane" in {s.name for s in got[0].list_services_response.service}


def test_clients_send_their_token(auth_cluster, monkeypatch, table_name, capsys):
    from client import AsyncMemoryClient, MemoryClient, PermissionDeniedError, UnauthenticatedError

    ep = auth_cluster.endpoint
    monkeypatch.delenv("MEMSERVER_TOKEN", raising=False)
    with MemoryClient(ep, token=WRITE, retry_seconds=0) as c:
        c.create_table(table_name, 16, 4, sharding="rows")
        c.write_rows(table_name, np.arange(3), np.ones((3, 4), np.float32))
        assert c.bag(table_name, np.arange(3)[None], np.ones((1, 3), np.float32))[0].tolist() == [3.0] * 4
    with MemoryClient(ep, token=READ, retry_seconds=0) as c:
        assert c.lookup(table_name, [0]).tolist() == [[1.0] * 4]
        with pytest.raises(PermissionDeniedError, match="read token"):
            c.write_rows(table_name, [0], np.zeros((1, 4), np.float32))
        with pytest.raises(PermissionDeniedError):
            c.drop_table(table_name)
    with MemoryClient(ep, retry_seconds=0) as c, pytest.raises(UnauthenticatedError):
        c.list_tables()
    monkeypatch.setenv("MEMSERVER_TOKEN", READ)  # found in the environment
    with MemoryClient(ep, retry_seconds=0) as c:
        assert table_name in [t.name for t in c.list_tables()]
    from memserver.cli import main as cli_main

    monkeypatch.setenv("MEMSERVER_TOKEN", "stale")  # the CLI says where a refused token came from
    with pytest.raises(SystemExit) as exc:
        cli_main(["status", "--endpoint", ep, "--timeout", "5"])
    assert exc.value.code == 1 and "the token sent was $MEMSERVER_TOKEN's" in capsys.readouterr().err
    monkeypatch.setenv("MEMSERVER_TOKEN", READ)

    import asyncio

    async def run():
        async with AsyncMemoryClient(ep, token=WRITE) as ac:
            await ac.drop_table(table_name)

    asyncio.run(run())


def test_load_test_caller_sends_the_token(auth_cluster, monkeypatch):
    from memserver.loadtest.caller import fetch_table

    monkeypatch.setenv("MEMSERVER_TOKEN", WRITE)
    from client import MemoryClient

    with MemoryClient(auth_cluster.endpoint) as c:
        c.create_table("authtest-load", 16, 4)
    try:
        assert fetch_table(auth_cluster.endpoint, "authtest-load", 30).num_rows == 16
        monkeypatch.setenv("MEMSERVER_TOKEN", "wrong")
        with pytest.raises(UnauthenticatedError) as err:  # the client's error of its status, naming the coordinator
            fetch_table(auth_cluster.endpoint, "authtest-load", 30)
        assert err.value.target == f"coordinator {auth_cluster.endpoint}"
    finally:
        monkeypatch.setenv("MEMSERVER_TOKEN", WRITE)
        with MemoryClient(auth_cluster.endpoint) as c:
            c.drop_table("authtest-load")


def test_memserver_up_with_tokens_and_tls(tmp_path, monkeypatch, cli_in_process):
    """`memserver up --auth --tls-cert --tls-key`: tokens and the CA in a private endpoint file,
    where the CLI finds them; raw channels get nowhere without TLS, or with TLS but no token.
    (`up` in a subprocess; the commands that only ask the cluster in this process.)"""
    from tests.certs import self_signed

    cert, key = self_signed(tmp_path)
    env = {**os.environ, "MEMSERVER_HOME": str(tmp_path), "RAY_DEDUP_LOGS": "0"}
    env.pop("MEMSERVER_TOKEN", None)
    env.pop("MEMSERVER_TLS_CA", None)
    monkeypatch.setenv("MEMSERVER_HOME", str(tmp_path))
    monkeypatch.delenv("MEMSERVER_TOKEN", raising=False)
    monkeypatch.delenv("MEMSERVER_TLS_CA", raising=False)

    def cli(*args, timeout=240):
        if args[0] != "up":
            return cli_in_process(args)
        return subprocess.run([sys.executable, "-m", "memserver.cli", *args], env=env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    assert "--tls-cert and --tls-key go together" in cli("up", "--tls-cert", str(cert)).stderr
    # a certificate that does not name what clients dial (127.0.0.1 here): refused, not "ready"
    named, named_key = self_signed(tmp_path, "named", ip=None, dns="memserver.internal")
    up = cli("up", "--detach", "--shards", "1", "--num-cpus", "1", "--tls-cert", str(named), "--tls-key", str(named_key))
    assert up.returncode != 0 and "clients cannot reach or verify the servers' TLS certificate" in up.stderr, up.stderr
    assert "--tls-server-name" in up.stderr and not (tmp_path / "endpoint.json").exists()
    up = cli("up", "--detach", "--shards", "1", "--num-cpus", "1", "--auth", "--tls-cert", str(cert), "--tls-key", str(key))
    assert up.returncode == 0, up.stderr
    try:
        path = tmp_path / "endpoint.json"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        rec = json.loads(path.read_text())
        assert rec["token"] and rec["read_token"] and rec["token"] != rec["read_token"]
        assert rec["tls_ca"] == cert.read_text()
        st = cli("status", "--json")  # the CLI finds the token and the CA in the endpoint file
        assert st.returncode == 0, st.stderr
        status = json.loads(st.stdout)
        assert status["endpoint"] == rec["endpoint"]
        code, _ = status_of(lambda: raw_call(rec["endpoint"], "control", "Status", pb.StatusRequest(), rec["token"]))
        assert code == grpc.StatusCode.UNAVAILABLE  # plaintext, even with the token
        shard = status["shards"][0]["address"]
        with grpc.secure_channel(rec["endpoint"], grpc.ssl_channel_credentials(cert.read_bytes())) as ch:
            code, _ = status_of(lambda: pb_grpc.ControlPlaneStub(ch).Status(pb.StatusRequest(), timeout=30))
            assert code == grpc.StatusCode.UNAUTHENTICATED  # TLS, but no token
        with grpc.secure_channel(shard, grpc.ssl_channel_credentials(cert.read_bytes())) as ch:
            code, _ = status_of(lambda: pb_grpc.DataPlaneStub(ch).Lookup(pb.LookupRequest(table="x"), timeout=30))
            assert code == grpc.StatusCode.UNAUTHENTICATED
        # checkpoints only below the root ($MEMSERVER_HOME here): elsewhere is refused, and nothing is written
        assert cli("create-table", "t", "--rows", "8", "--dim", "4").returncode == 0  # (a checkpoint of none is refused)
        outside = tmp_path.parent / f"{tmp_path.name}-outside"
        ck = cli("checkpoint", "--dir", str(outside))
        assert ck.returncode != 0 and "PERMISSION_DENIED" in ck.stderr and "checkpoint root" in ck.stderr
        assert not outside.exists()
        ck = cli("checkpoint", "--dir", str(tmp_path / "ck"), "--json")
        assert ck.returncode == 0, ck.stderr
        log = (tmp_path / "memserver.log").read_text()
        assert rec["token"] not in log and rec["read_token"] not in log  # never logged
    finally:
        down = cli("down")
        assert down.returncode == 0, down.stderr


def test_a_token_with_a_line_ending_is_sent_without_it_and_a_bad_one_is_refused_by_its_source(monkeypatch):
    """A token file with CRLF line endings gave every command a 50-line traceback from inside
    gRPC ("Illegal header value"; a security walkthrough)."""
    from client import InvalidArgumentError, MemoryClient
    from client.channels import client_token

    monkeypatch.setenv("MEMSERVER_TOKEN", "tok\r\n")
    assert client_token("127.0.0.1:1") == "tok"
    monkeypatch.setenv("MEMSERVER_TOKEN", "to\x01k")
    with pytest.raises(InvalidArgumentError, match=r"\$MEMSERVER_TOKEN: a token is printable ASCII"):
        client_token("127.0.0.1:1")
    monkeypatch.delenv("MEMSERVER_TOKEN")
    with pytest.raises(InvalidArgumentError, match="token: a token is printable ASCII"):
        MemoryClient("127.0.0.1:1", token="tök")
    with MemoryClient("127.0.0.1:1", token=" tok\n") as c:
        assert c.aio.token == "tok"
    with MemoryClient("127.0.0.1:1", token="") as c:  # none sent
        assert c.aio.token == ""


def test_with_tokens_what_the_servers_write_is_their_users_alone(auth_cluster, table_name, tmp_path_factory):
    """Checkpoints, logs and records of a cluster with tokens were mode 644 in 755 folders: every
    local user could read the values the tokens guard (a security walkthrough)."""
    import stat

    from client import MemoryClient

    root = tmp_path_factory.getbasetemp() / f"private-{table_name}"  # (inside the cluster's checkpoint root)
    with MemoryClient(auth_cluster.endpoint, token=WRITE, retry_seconds=0) as c:
        c.create_table(table_name, 16, 4, wal=True)
        c.write_rows(table_name, np.arange(3), np.ones((3, 4), np.float32))
        c.checkpoint(str(root), 1)
        c.drop_table(table_name)
    made = [p for p in root.rglob("*")]
    assert made and all(stat.S_IMODE(p.stat().st_mode) & 0o077 == 0 for p in made), \
        [(str(p), oct(stat.S_IMODE(p.stat().st_mode))) for p in made]
