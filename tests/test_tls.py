"""TLS: a server started with a certificate and key speaks only TLS; clients given the CA (or
finding it in the endpoint file) verify it; plaintext and a wrong CA get nowhere. Servers here
are started without Ray (the same start_server every shard and the coordinator use); the CLI's
--tls-cert/--tls-key end to end is in tests/test_auth.py."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from memserver.api.auth import AuthConfig
from memserver.api.v1 import memserver_pb2 as pb
from memserver.api.v1 import memserver_pb2_grpc as pb_grpc
from memserver.loop import LoopThread
from memserver.server.config import ServeConfig, TlsFiles
from memserver.server.grpcserver import DATA_PLANE, start_server
from tests.certs import self_signed

TOKEN = "tls-test-token"


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    """A DataPlane server (no tables) with TLS and a token, on 127.0.0.1."""
    import torch

    from memserver.server.dataplane import DataPlaneServicer

    d = tmp_path_factory.mktemp("tls")
    cert, key = self_signed(d)
    other_cert, _ = self_signed(d, "other")
    named_cert, named_key = self_signed(d, "named", ip=None, dns="memserver.test")  # a name, no address
    loop = LoopThread("tls-test")
    servicer = DataPlaneServicer(torch.device("cpu"), 1)
    servers = []
    for c, k in ((cert, key), (named_cert, named_key)):
        config = ServeConfig(auth=AuthConfig.from_tokens(TOKEN), tls=TlsFiles(str(c), str(k)))
        servers.append(loop.call(start_server(lambda s: pb_grpc.add_DataPlaneServicer_to_server(servicer, s),
                                              [DATA_PLANE], "127.0.0.1", config=config)))
    yield {"address": f"127.0.0.1:{servers[0][1]}", "ca": cert.read_bytes(), "other_ca": other_cert.read_bytes(),
           "named": f"127.0.0.1:{servers[1][1]}", "named_ca": named_cert.read_bytes()}
    for server, _ in servers:
        loop.call(server.stop(grace=0))


def lookup(channel, token=TOKEN):
    stub = pb_grpc.DataPlaneStub(channel)
    return stub.Lookup(pb.LookupRequest(table="nope"), metadata=[("authorization", f"Bearer {token}")], timeout=10)


def code_of(call):
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def test_tls_with_the_right_ca_reaches_the_server(tls_server):
    address, ca = tls_server["address"], tls_server["ca"]
    with grpc.secure_channel(address, grpc.ssl_channel_credentials(ca)) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert code_of(lambda: lookup(ch)) == grpc.StatusCode.NOT_FOUND  # served: the table does not exist
        assert code_of(lambda: lookup(ch, "wrong")) == grpc.StatusCode.UNAUTHENTICATED  # TLS does not replace tokens


def test_plaintext_and_a_wrong_ca_get_nowhere(tls_server):
    address, other_ca = tls_server["address"], tls_server["other_ca"]
    with grpc.insecure_channel(address) as ch:
        assert code_of(lambda: lookup(ch)) == grpc.StatusCode.UNAVAILABLE
    with grpc.secure_channel(address, grpc.ssl_channel_credentials(other_ca)) as ch:
        assert code_of(lambda: lookup(ch)) == grpc.StatusCode.UNAVAILABLE


def test_client_channels_speak_tls_given_the_ca(tls_server, monkeypatch, tmp_path):
    from client.channels import ClientTls, client_tls, sync_channel

    address, ca = tls_server["address"], tls_server["ca"]
    with sync_channel(address, token=TOKEN, tls=ClientTls(ca)) as ch:
        assert code_of(lambda: pb_grpc.DataPlaneStub(ch).Lookup(pb.LookupRequest(table="nope"), timeout=10)) \
            == grpc.StatusCode.NOT_FOUND
    (tmp_path / "ca.pem").write_bytes(ca)
    monkeypatch.setenv("MEMSERVER_TLS_CA", str(tmp_path / "ca.pem"))
    assert client_tls("anything:1") == ClientTls(ca)
    monkeypatch.setenv("MEMSERVER_TLS_CA", str(tmp_path / "nope.pem"))
    with pytest.raises(FileNotFoundError, match=r"\$MEMSERVER_TLS_CA: No such file or directory: '.*nope.pem'"):
        client_tls("anything:1")
    # a CA file that holds no certificate: empty (gRPC took b"" for the system's roots, trusting any
    # public CA), or the key given by mistake (every call retried for a minute as if the cluster were down)
    from client import InvalidArgumentError

    for name, held in (("empty.pem", b""), ("key.pem", b"-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n")):
        (tmp_path / name).write_bytes(held)
        monkeypatch.setenv("MEMSERVER_TLS_CA", str(tmp_path / name))
        with pytest.raises(InvalidArgumentError, match=rf"\$MEMSERVER_TLS_CA \(.*{name}\): the CA holds no PEM "
                                                       r"certificate \(a '-----BEGIN CERTIFICATE-----' block\)"):
            client_tls("anything:1")
    with pytest.raises(InvalidArgumentError, match="tls: the CA holds no PEM certificate .* got nothing"):
        ClientTls(b"")
    monkeypatch.delenv("MEMSERVER_TLS_CA")
    record = {"endpoint": address, "tls_ca": ca.decode(), "tls_server_name": "memserver.test"}
    assert client_tls(address, record) == ClientTls(ca, "memserver.test")
    assert client_tls("10.0.0.1:5", record) is None  # the file's CA is for the file's cluster only


def test_a_certificate_naming_a_dns_name_is_checked_for_that_name(tls_server):
    """Pods' addresses change: the certificate names a DNS name, and clients check for it."""
    from client.channels import ClientTls, sync_channel

    def lookup_code(tls):
        with sync_channel(tls_server["named"], retries=False, token=TOKEN, tls=tls) as ch:
            return code_of(lambda: pb_grpc.DataPlaneStub(ch).Lookup(pb.LookupRequest(table="nope"), timeout=10))

    assert lookup_code(ClientTls(tls_server["named_ca"], "memserver.test")) == grpc.StatusCode.NOT_FOUND
    assert lookup_code(ClientTls(tls_server["named_ca"])) == grpc.StatusCode.UNAVAILABLE  # 127.0.0.1 is not named
    assert lookup_code(ClientTls(tls_server["named_ca"], "other.test")) == grpc.StatusCode.UNAVAILABLE


def test_unreadable_tls_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="TLS key file .*missing-key.pem"):
        TlsFiles(str(tmp_path / "c.pem"), str(tmp_path / "missing-key.pem")).read()


def test_a_key_that_is_not_the_certificates_is_refused_before_anything_starts(tmp_path):
    """check_pair, and `memserver up` with it before Ray starts: one line naming the flags, where
    the shard used to abort in gRPC's TLS setup ("Failed to bind") with the cause only in the log."""
    import os
    import subprocess
    import sys

    from memserver.cluster.secure import check_pair
    from tests.certs import self_signed

    cert, key = self_signed(tmp_path, "a")
    _, other_key = self_signed(tmp_path, "b")
    check_pair(cert.read_bytes(), key.read_bytes())
    old_cert, old_key = self_signed(tmp_path, "old", expired=True)  # (found a minute after the cluster started)
    for c, k, says in ((cert, other_key, "the key is not the certificate's"), (key, key, "holds no PEM certificate"),
                       (cert, cert, "holds no unencrypted PEM private key"),
                       (old_cert, old_key, r"the certificate expired on 20\d\d-\d\d-\d\d \d\d:\d\d UTC: renew it")):
        with pytest.raises(ValueError, match=says):
            check_pair(c.read_bytes(), k.read_bytes())
    env = {**os.environ, "MEMSERVER_HOME": str(tmp_path)}
    up = subprocess.run([sys.executable, "-m", "memserver.cli", "up", "--shards", "1", "--tls-cert", str(cert),
                         "--tls-key", str(other_key)], env=env, capture_output=True, text=True, timeout=120)
    assert up.returncode == 2 and "--tls-cert/--tls-key: the key is not the certificate's" in up.stderr, up.stderr
    assert "Traceback" not in up.stderr and "starting an embedded Ray head" not in up.stderr



def test_a_tls_key_other_users_may_read_is_warned_of_as_a_token_file_is(tmp_path, caplog):
    """`up` warned of a token file other local users may read, not of a --tls-key so (a hunt)."""
    import argparse
    import logging

    from memserver.cli.lifecycle import _tls
    from tests.certs import self_signed

    cert, key = self_signed(tmp_path, "a")
    args = argparse.Namespace(tls_cert=str(cert), tls_key=str(key), tls_ca=None, tls_server_name=None)
    key.chmod(0o600)
    with caplog.at_level(logging.WARNING):
        assert _tls(args).key == str(key)
    assert "other local users may read" not in caplog.text
    key.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        _tls(args)
    assert f"--tls-key {key} has mode 644: other local users may read the servers' private key; chmod 600 it" \
        in caplog.text


def test_secret_files_other_users_may_read_are_among_ups_notes(tmp_path):
    """A hunt: the warnings of a token file or --tls-key other local users may read went to the
    log alone, so a detached `up` (whose terminal sees its notes, never its log) never showed
    them. They are among the notes `up` keeps in its record and a detached `up` prints."""
    import argparse

    from memserver.cli.lifecycle import _readable_secrets
    from tests.certs import self_signed

    _, key = self_signed(tmp_path, "a")
    tokens = tmp_path / "tokens"
    tokens.write_text("w\n")
    args = argparse.Namespace(auth_token_file=str(tokens), tls_key=str(key))
    for f in (tokens, key):
        f.chmod(0o600)
    assert _readable_secrets(args) == []
    for f in (tokens, key):
        f.chmod(0o640)
    assert _readable_secrets(args) == [
        f"token file {tokens} has mode 640: other local users may read its tokens; chmod 600 it",
        f"--tls-key {key} has mode 640: other local users may read the servers' private key; chmod 600 it"]
    assert _readable_secrets(argparse.Namespace(auth_token_file=None, tls_key=None)) == []


def test_a_client_whose_handshake_fails_says_what_to_fix_at_once(tls_server, tmp_path):
    """A client with the wrong CA, one whose certificate names another address, one speaking TLS
    to a plaintext server, or a server whose certificate expired: the handshake fails the same way every time, so the client raises
    TlsError (an UnavailableError) at once, not after its retry_seconds, naming the fix. A
    plaintext client at a TLS server hears only "Socket closed": it retries, then says TLS may be why."""
    import time

    from client import MemoryClient, TlsError, UnavailableError
    from client.channels import ClientTls

    loop = LoopThread("plain-test")
    plain_server, port = loop.call(start_server(lambda s: None, [DATA_PLANE], "127.0.0.1"))
    plain = f"127.0.0.1:{port}"
    old_cert, old_key = self_signed(tmp_path, "expired", expired=True)
    old_server, old_port = loop.call(start_server(lambda s: None, [DATA_PLANE], "127.0.0.1",
                                                  config=ServeConfig(tls=TlsFiles(str(old_cert), str(old_key)))))
    cases = ((tls_server["address"], ClientTls(tls_server["other_ca"]), "is not signed by the CA this client trusts"),
             (tls_server["named"], ClientTls(tls_server["named_ca"]), "does not name what this client checks"),
             (plain, ClientTls(tls_server["ca"]), "the server does not speak TLS"),
             (f"127.0.0.1:{old_port}", ClientTls(old_cert.read_bytes()), "the server's certificate has expired"))
    try:
        for address, tls, says in cases:
            with MemoryClient(address, token=TOKEN, tls=tls, timeout=5, retry_seconds=30) as client:
                t0 = time.monotonic()
                with pytest.raises(TlsError, match=f"the TLS handshake failed: .*{says}") as err:
                    client.lookup("t", [1])
                assert time.monotonic() - t0 < 5 and isinstance(err.value, UnavailableError)
                assert "is a memserver cluster running there" not in str(err.value)
        with MemoryClient(tls_server["address"], token=TOKEN, timeout=5, retry_seconds=1) as client:
            with pytest.raises(UnavailableError, match="or it serves TLS: give this client its CA") as err:
                client.lookup("t", [1])
            assert not isinstance(err.value, TlsError)
    finally:
        loop.call(plain_server.stop(grace=0))
        loop.call(old_server.stop(grace=0))
