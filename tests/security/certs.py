"""Test certificates made with ``cryptography``: CAs, issued leaves, PEM helpers.

EC P-256 keys by default (fast). Example::

    ca_key, ca = make_ca()
    key = new_key()
    leaf = issue(ca_key, ca, uri_sans=["spiffe://td/ns/default/sa/app"], public_key=key.public_key())
    chain = [to_pem(leaf).decode(), to_pem(ca).decode()]
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPrivateKeyTypes, PublicKeyTypes
from cryptography.x509.oid import NameOID

PrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


def new_key(kind: str = "ec") -> PrivateKey:
    """A fresh key: ``"ec"`` (P-256), ``"ec384"`` or ``"rsa"`` (2048 bits)."""
    if kind == "ec":
        return ec.generate_private_key(ec.SECP256R1())
    if kind == "ec384":
        return ec.generate_private_key(ec.SECP384R1())
    if kind == "rsa":
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)
    raise ValueError(f"unknown key kind {kind!r}")


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]) if common_name else x509.Name([])


def _serial() -> int:
    return secrets.randbits(63) | 1 << 62  # positive, fixed length


def make_ca(
    common_name: str = "root",
    parent: tuple[CertificateIssuerPrivateKeyTypes, x509.Certificate] | None = None,
    not_after: datetime | None = None,
) -> tuple[PrivateKey, x509.Certificate]:
    """A CA key and certificate: self-signed, or an intermediate signed by ``parent`` (key, cert)."""
    key = new_key()
    now = datetime.now(UTC)
    issuer_key, issuer_name = (key, _name(common_name)) if parent is None else (parent[0], parent[1].subject)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(_serial())
        .not_valid_before(now - timedelta(hours=1))
        .not_valid_after(not_after or now + timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(issuer_key, hashes.SHA256())
    )
    return key, cert


def issue(
    ca_key: CertificateIssuerPrivateKeyTypes,
    ca_cert: x509.Certificate,
    uri_sans: Sequence[str] = (),
    public_key: PublicKeyTypes | None = None,
    not_after: datetime | None = None,
    not_before: datetime | None = None,
    dns_sans: Sequence[str] = (),
    common_name: str = "",
) -> x509.Certificate:
    """A leaf certificate signed by the CA (for a throwaway key when ``public_key`` is None)."""
    now = datetime.now(UTC)
    if public_key is None:
        public_key = new_key().public_key()
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(public_key)  # type: ignore[arg-type]
        .serial_number(_serial())
        .not_valid_before(not_before or now - timedelta(hours=1))
        .not_valid_after(not_after or now + timedelta(days=1))
    )
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(u) for u in uri_sans]
    sans += [x509.DNSName(d) for d in dns_sans]
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca_key, hashes.SHA256())


def to_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def key_to_pem(key: PrivateKey, pkcs8: bool = False) -> bytes:
    """``RSA/EC PRIVATE KEY`` (traditional) or ``PRIVATE KEY`` (PKCS#8), unencrypted."""
    fmt = serialization.PrivateFormat.PKCS8 if pkcs8 else serialization.PrivateFormat.TraditionalOpenSSL
    return key.private_bytes(serialization.Encoding.PEM, fmt, serialization.NoEncryption())


@dataclass
class MeshCA:
    """A mesh CA whose certificate is on disk as the root that verifies istiod."""

    ca_key: PrivateKey
    ca: x509.Certificate
    root: Path

    @classmethod
    def on_disk(cls, directory: Path, common_name: str = "istiod-root") -> MeshCA:
        ca_key, ca = make_ca(common_name)
        root = directory / "root-cert.pem"
        root.write_bytes(to_pem(ca))
        return cls(ca_key, ca, root)

    def client_pair(self, directory: Path, *, not_after: datetime | None = None) -> tuple[Path, Path]:
        """A workload certificate (chain with the CA) written as PROV_CERT holds it:
        ``directory/cert-chain.pem`` and ``directory/key.pem``; returns those two paths."""
        key = new_key()
        cert = issue(
            self.ca_key,
            self.ca,
            uri_sans=["spiffe://cluster.local/ns/default/sa/vm"],
            public_key=key.public_key(),
            not_after=not_after,
            not_before=datetime.now(UTC) - timedelta(days=2) if not_after else None,
        )
        chain, key_path = directory / "cert-chain.pem", directory / "key.pem"
        chain.write_bytes(to_pem(cert) + to_pem(self.ca))
        key_path.write_bytes(key_to_pem(key))
        return chain, key_path


def with_negative_serial(cert: x509.Certificate) -> bytes:
    """PEM of a copy of ``cert`` whose serial number is negative (signature no longer valid).

    ``cryptography`` refuses to build such a certificate, so the DER serial is patched in place.
    """
    der = cert.public_bytes(serialization.Encoding.DER)
    serial = cert.serial_number.to_bytes(8, "big")
    needle = b"\x02\x08" + serial
    assert der.count(needle) == 1, "serial not found exactly once"
    patched = der.replace(needle, b"\x02\x08" + bytes([serial[0] | 0x80]) + serial[1:])
    return pem_block(patched)


def pem_block(der: bytes, label: str = "CERTIFICATE") -> bytes:
    """Any DER as a PEM block (e.g. non-certificate content under a CERTIFICATE label)."""
    b64 = base64.b64encode(der).decode()
    body = "\n".join(b64[i : i + 64] for i in range(0, len(b64), 64))
    return f"-----BEGIN {label}-----\n{body}\n-----END {label}-----\n".encode()
