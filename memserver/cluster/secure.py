"""Secure by default: a cluster whose servers listen beyond loopback gets tokens and TLS by itself.

`start_cluster` asks `network_facing` where its servers will listen; when that is more than this
machine's loopback and the caller gave no tokens (or no TLS), it makes them here: a write and a
read token, and a self-signed certificate (its own CA) for the DNS name `SERVER_NAME` and every
alive node's address, written with its key (mode 0600) under the cluster's data directory, which
every node must read (memserver.server.config.TlsFiles: Ray replays actors' arguments, so the key
travels as a path, never as bytes). Clients check the certificate against the name, not the
address they dial (`grpc.ssl_target_name_override`), so a shard that Ray restarts on another host
is still verified. `memserver join-info` hands a client on another host the endpoint, the CA and
a token in one file.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path

from memserver.api.auth import AuthConfig, generate_token
from memserver.server.config import TlsFiles

#: The DNS name in every generated certificate; clients verify it whatever address they dial.
SERVER_NAME = "memserver"
#: How long a generated certificate is valid; `memserver up` makes a new one at each start.
CERT_DAYS = 365


def is_loopback(host: str) -> bool:
    """Whether `host` is an address of this machine's loopback (127.0.0.0/8, ::1, "localhost")."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it resolves to an interface clients on other hosts reach


_HOST = re.compile(r"(\[(?P<v6>[0-9a-f:.]+)\]|(?P<name>[^:\[\]@/\s]+))(:(?P<port>[0-9]{1,5}))?")


def name_of_host(host: str) -> str:
    """The name of a Host header ("localhost:8391" -> "localhost", "[::1]:80" -> "::1"); "" for
    one that is not a name and an optional port ("localhost:evil", "127.0.0.1:80@evil.com")."""
    m = _HOST.fullmatch(host.strip().lower())
    return "" if m is None else (m["v6"] or m["name"])


def loopback_host_header(host: str) -> bool:
    """Whether an HTTP request's Host header names this machine's loopback: what a page or metrics
    endpoint bound to loopback answers. Any other name reached it through DNS rebinding (a web
    site its user visited, whose name now resolves to 127.0.0.1), which reads what it serves."""
    return is_loopback(name_of_host(host))


def network_facing(host: str | None) -> bool:
    """Whether servers told to bind `host` listen beyond loopback (None: each on its node's
    address, which start_cluster chooses when the Ray cluster has several nodes)."""
    return host is None or not is_loopback(host)


def check_pair(cert_pem: bytes, key_pem: bytes) -> None:
    """Refuse (ValueError, saying which) a certificate file that holds no PEM certificate, a key
    file that holds no unencrypted PEM private key, or a key that is not the certificate's: a
    server given them would abort in gRPC's TLS setup with "Failed to bind"."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        cert = x509.load_pem_x509_certificate(cert_pem)  # the first of a chain: the server's own
    except ValueError as exc:
        raise ValueError(f"the certificate file holds no PEM certificate ({exc})") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"the key file holds no unencrypted PEM private key ({exc})") from None
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if key.public_key().public_bytes(*spki) != cert.public_key().public_bytes(*spki):
        raise ValueError("the key is not the certificate's (its public key differs from the one the certificate holds)")
    # every client's handshake would fail: said now, not after the cluster started (a walkthrough's
    # expired certificate was found a minute later, with a hint about its names)
    now = datetime.datetime.now(datetime.timezone.utc)
    if now > cert.not_valid_after_utc:
        raise ValueError(f"the certificate expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC: renew it (or check "
                         "this host's clock)")
    if now < cert.not_valid_before_utc:
        raise ValueError(f"the certificate is not valid until {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC: check "
                         "this host's clock, or the certificate's dates")


def self_signed(directory: str | os.PathLike[str], addresses: list[str]) -> tuple[TlsFiles, bytes]:
    """A fresh EC P-256 certificate for SERVER_NAME and `addresses`, its own CA, valid CERT_DAYS;
    returns the files (cert 0644, key 0600, written atomically) and the CA bytes clients trust."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    from memserver.storage.fsutil import atomic_write

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{SERVER_NAME} cluster CA")])
    now = datetime.datetime.now(datetime.timezone.utc)
    sans: list[x509.GeneralName] = [x509.DNSName(SERVER_NAME)]
    for a in dict.fromkeys(addresses):
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(a.strip("[]"))))
        except ValueError:
            sans.append(x509.DNSName(a))
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    atomic_write(d / "server-key.pem", lambda f: f.write(key_pem), mode=0o600)
    atomic_write(d / "server-cert.pem", lambda f: f.write(pem), mode=0o644)
    return TlsFiles(str(d / "server-cert.pem"), str(d / "server-key.pem")), pem


@dataclass(frozen=True)
class Security:
    """What a cluster's servers are started with, and what was made for them (for the endpoint
    file): `tokens` (write, read) and `ca`/`server_name` only when made here. `warning`: the line to
    log when servers face the network without tokens or TLS (--insecure)."""

    auth: AuthConfig | None
    tls: TlsFiles | None
    tokens: tuple[str, str] | None = None
    ca: bytes | None = None
    server_name: str | None = None
    warning: str = ""


def secure_defaults(host: str | None, auth: AuthConfig | None, tls: TlsFiles | None, insecure: bool,
                    tls_dir: str | os.PathLike[str], nodes: list[str]) -> Security:
    """The one rule: servers listening beyond loopback (`network_facing(host)`) get the tokens and
    TLS the caller did not give, made here (the certificate for SERVER_NAME, `host` and `nodes`,
    written under `tls_dir`), unless `insecure`, which makes none and says so."""
    missing = [what for what, given in (("tokens", auth), ("TLS", tls)) if given is None]
    if not network_facing(host) or not missing:
        return Security(auth, tls)
    where = host or "each node's address"
    if insecure:
        return Security(auth, tls, warning=f"INSECURE (--insecure): servers listen on {where} without "
                        f"{' or '.join(missing)}: anyone who reaches their ports can read and write every table")
    tokens, ca, name = None, None, None
    if auth is None:
        tokens = (generate_token(), generate_token())
        auth = AuthConfig.from_tokens(*tokens)
    if tls is None:
        tls, ca = self_signed(tls_dir, [*([host] if host else []), *nodes])
        name = SERVER_NAME
    return Security(auth, tls, tokens, ca, name)
