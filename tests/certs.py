"""A self-signed certificate made in the test (cryptography), for the TLS tests."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path


def self_signed(directory: Path, name: str = "server", ip: str | None = "127.0.0.1",
                dns: str = "localhost", expired: bool = False) -> tuple[Path, Path]:
    """(cert.pem, key.pem) of a fresh EC key, valid for `ip` (None: no address) and `dns` for one day
    (`expired`: the day before yesterday)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"memserver-test-{name}")])
    now = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=2 if expired else 0)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([*([x509.IPAddress(ipaddress.ip_address(ip))] if ip else []),
                                                    x509.DNSName(dns)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / f"{name}-cert.pem", directory / f"{name}-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return cert_path, key_path
