"""Workload key generation and the PKCS#10 CSR sent to the CA (Istio's CSR shape)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from istio_agent.config.security import MAX_RSA_KEY_SIZE, MIN_RSA_KEY_SIZE

if TYPE_CHECKING:
    from istio_agent.config import SecuritySettings

ECDSA = "ECDSA"
SPIFFE_PREFIX = "spiffe://"


class CsrError(ValueError):
    """The CSR could not be built from the given options or hosts."""


@dataclass(frozen=True)
class KeyOptions:
    """Key type and encoding of the workload key (WORKLOAD_RSA_KEY_SIZE, ECC_*, PKCS8_KEY)."""

    rsa_key_size: int = 2048
    ecc_signature_algorithm: str = ""
    ecc_curve: str = "P256"
    pkcs8: bool = False

    @classmethod
    def from_settings(cls, settings: SecuritySettings) -> KeyOptions:
        return cls(
            rsa_key_size=settings.rsa_key_size,
            ecc_signature_algorithm=settings.ecc_signature_algorithm,
            ecc_curve=settings.ecc_curve,
            pkcs8=settings.pkcs8_key,
        )


def _san(host: str, hosts: str) -> x509.GeneralName:
    """One SAN entry: an IP if it parses as one, a URI for ``spiffe://``, else a DNS name."""
    if not host:
        raise CsrError(f"invalid hosts {hosts!r} for the CSR: empty host name")
    if "%" not in host:  # Go's IP parser has no zones; such a host is a DNS name there too
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            pass
        else:
            # Go encodes IPv4-mapped IPv6 addresses as their 4-byte IPv4 form.
            if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
                return x509.IPAddress(ip.ipv4_mapped)
            return x509.IPAddress(ip)
    try:
        if host.startswith(SPIFFE_PREFIX):
            return x509.UniformResourceIdentifier(host)
        return x509.DNSName(host)
    except (ValueError, TypeError) as e:
        raise CsrError(f"invalid host {host!r} for the CSR: {e}") from None


_Key = rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey
_Digest = hashes.SHA256 | hashes.SHA384


def _new_key(options: KeyOptions) -> tuple[_Key, _Digest]:
    if options.ecc_signature_algorithm:
        if options.ecc_signature_algorithm != ECDSA:
            raise CsrError("csr cert generation fails due to unsupported EC signature algorithm")
        if options.ecc_curve == "P384":
            return ec.generate_private_key(ec.SECP384R1()), hashes.SHA384()
        return ec.generate_private_key(ec.SECP256R1()), hashes.SHA256()
    if options.rsa_key_size < MIN_RSA_KEY_SIZE:
        raise CsrError(
            f"requested key size does not meet the minimum required size of {MIN_RSA_KEY_SIZE} "
            f"(requested: {options.rsa_key_size})"
        )
    if options.rsa_key_size > MAX_RSA_KEY_SIZE:  # a bigger key pins a core for minutes (and Go refuses it)
        raise CsrError(
            f"requested key size exceeds the maximum size of {MAX_RSA_KEY_SIZE} (requested: {options.rsa_key_size})"
        )
    return rsa.generate_private_key(public_exponent=65537, key_size=options.rsa_key_size), hashes.SHA256()


def generate_csr(hosts: str, options: KeyOptions) -> tuple[bytes, bytes]:
    """A new private key and a CSR for ``hosts`` (comma-separated): ``(csr_pem, private_key_pem)``.

    CPU-bound (RSA key generation takes tens of milliseconds): call it from a worker thread.
    """
    names = [_san(host, hosts) for host in hosts.split(",")]
    key, digest = _new_key(options)
    # Istio's subject is a single Organization attribute with an empty value; cryptography accepts
    # an empty O, so the subject is the same (the CA ignores it and sets the identity from the SAN).
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "")])
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(subject)
        .add_extension(x509.SubjectAlternativeName(names), critical=True)
        .sign(key, digest)
    )
    if options.pkcs8:
        key_format = serialization.PrivateFormat.PKCS8
    else:  # "RSA PRIVATE KEY" (PKCS#1) or "EC PRIVATE KEY" (SEC1)
        key_format = serialization.PrivateFormat.TraditionalOpenSSL
    key_pem = key.private_bytes(serialization.Encoding.PEM, key_format, serialization.NoEncryption())
    return csr.public_bytes(serialization.Encoding.PEM), key_pem
