"""A throwaway certificate authority for TLS tests: a CA, a server certificate for 127.0.0.1 and
client certificates, written as PEM files; a daemon's TLS arguments."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _issue(
    name: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
    *,
    ca: bool = False,
    ip: str | None = None,
) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer_name, signer = issuer if issuer else (subject, key)
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ip:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]), critical=False
        )
    return builder.sign(signer, hashes.SHA256())


def make_pki(directory: Path) -> tuple[Path, Pair, Pair]:
    """(CA certificate, server pair for 127.0.0.1, client pair), all signed by the CA."""
    ca, server, [client] = make_pki_for(directory, ("engine",))
    return ca, server, client


def make_pki_for(directory: Path, clients: Sequence[str]) -> tuple[Path, Pair, list[Pair]]:
    """(CA certificate, server pair for 127.0.0.1, a pair for each of `clients`, by name), all
    signed by the CA."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _issue("ecd test CA", ca_key, None, ca=True)
    pairs = []
    for name, ip in (("ecd", "127.0.0.1"), *((client, None) for client in clients)):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _issue(name, key, (ca_cert.subject, ca_key), ip=ip)
        pair = Pair(directory / f"{name}.crt", directory / f"{name}.key")
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        pair.key.write_bytes(_key_pem(key))
        pairs.append(pair)
    ca_path = directory / "ca.crt"
    ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    return ca_path, pairs[0], pairs[1:]


def tls_args(port: int, server: Pair, client_ca: Path | None = None) -> tuple[str, ...]:
    """A daemon's arguments for TLS on 127.0.0.1:port, mutual with `client_ca`."""
    mutual = ("--tls-client-ca", str(client_ca)) if client_ca else ()
    return ("--max-bytes", "64MiB", "--tcp", f"127.0.0.1:{port}", "--tls-cert",
            str(server.cert), "--tls-key", str(server.key), *mutual)  # fmt: skip
