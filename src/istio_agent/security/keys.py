"""Workload key generation and the PKCS#10 CSR sent to the CA (Istio's CSR shape).

The key is made and the request signed by the libcrypto Python's ``ssl`` already mapped
(``pem/libcrypto.py``); the request itself is DER written here (RFC 2986), the same bytes the
``cryptography`` builder produced before, so the agent loads no ``cryptography`` (issue 23).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import TYPE_CHECKING

from istio_agent.config.security import MAX_RSA_KEY_SIZE, MIN_RSA_KEY_SIZE
from istio_agent.pem import der, encode_pem
from istio_agent.pem.libcrypto import CryptoError, PrivateKey

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


ORGANIZATION_NAME = "2.5.4.10"
SUBJECT_ALT_NAME = "2.5.29.17"
EXTENSION_REQUEST = "1.2.840.113549.1.9.14"
_SIGNATURE_ALGORITHMS = {
    # digest -> AlgorithmIdentifier; RSA's carries NULL parameters, ECDSA's none (RFC 4055, RFC 5758)
    ("RSA", "SHA256"): der.sequence(der.encode_oid("1.2.840.113549.1.1.11"), der.encode(der.NULL, b"")),
    ("EC", "SHA256"): der.sequence(der.encode_oid("1.2.840.10045.4.3.2")),
    ("EC", "SHA384"): der.sequence(der.encode_oid("1.2.840.10045.4.3.3")),
}
_URI, _DNS, _IP = der.context(6), der.context(2), der.context(7)


def _ascii(host: str, kind: str) -> bytes:
    try:
        return host.encode("ascii")
    except UnicodeEncodeError:
        raise CsrError(
            f"invalid host {host!r} for the CSR: a {kind} must be an A-label (ASCII) string; "
            "encode unicode names with IDNA first"
        ) from None


def _san(host: str, hosts: str) -> bytes:
    """One SAN entry (GeneralName DER): an IP if it parses as one, a URI for ``spiffe://``, else a DNS name."""
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
                return der.encode(_IP, ip.ipv4_mapped.packed)
            return der.encode(_IP, ip.packed)
    if host.startswith(SPIFFE_PREFIX):
        return der.encode(_URI, _ascii(host, "URI"))
    return der.encode(_DNS, _ascii(host, "DNS name"))


def _new_key(options: KeyOptions) -> tuple[PrivateKey, str, str]:
    """A new key, its type (``RSA``/``EC``) and the digest its CSR is signed with."""
    if options.ecc_signature_algorithm:
        if options.ecc_signature_algorithm != ECDSA:
            raise CsrError("csr cert generation fails due to unsupported EC signature algorithm")
        if options.ecc_curve == "P384":
            return PrivateKey.generate_ec("P-384"), "EC", "SHA384"
        return PrivateKey.generate_ec("P-256"), "EC", "SHA256"
    if options.rsa_key_size < MIN_RSA_KEY_SIZE:
        raise CsrError(
            f"requested key size does not meet the minimum required size of {MIN_RSA_KEY_SIZE} "
            f"(requested: {options.rsa_key_size})"
        )
    if options.rsa_key_size > MAX_RSA_KEY_SIZE:  # a bigger key pins a core for minutes (and Go refuses it)
        raise CsrError(
            f"requested key size exceeds the maximum size of {MAX_RSA_KEY_SIZE} (requested: {options.rsa_key_size})"
        )
    return PrivateKey.generate_rsa(options.rsa_key_size), "RSA", "SHA256"


def _request_info(public_key: bytes, names: list[bytes]) -> bytes:
    """CertificationRequestInfo: version 0, Istio's subject, the key, and a critical SAN extension request.

    Istio's subject is a single Organization attribute with an empty value (the CA ignores it and
    sets the identity from the SAN); it is a UTF8String, as the ``cryptography`` builder wrote it.
    """
    subject = der.sequence(
        der.set_of(der.sequence(der.encode_oid(ORGANIZATION_NAME), der.encode(der.UTF8_STRING, b"")))
    )
    san = der.sequence(
        der.encode_oid(SUBJECT_ALT_NAME),
        der.encode(der.BOOLEAN, b"\xff"),  # critical
        der.encode(der.OCTET_STRING, der.sequence(*names)),
    )
    extension_request = der.sequence(der.encode_oid(EXTENSION_REQUEST), der.set_of(der.sequence(san)))
    attributes = der.encode(der.context(0, constructed=True), extension_request)
    return der.sequence(der.encode_integer(0), subject, public_key, attributes)


def generate_csr(hosts: str, options: KeyOptions) -> tuple[bytes, bytes]:
    """A new private key and a CSR for ``hosts`` (comma-separated): ``(csr_pem, private_key_pem)``.

    CPU-bound (RSA 2048 key generation takes 0.1-0.2 s with OpenSSL 3.0): call it from a worker thread.
    """
    names = [_san(host, hosts) for host in hosts.split(",")]
    try:
        key, key_type, digest = _new_key(options)
        with key:
            info = _request_info(key.public_key_der(), names)
            signature = key.sign(info, digest)
            # PKCS#8 "PRIVATE KEY", or "RSA PRIVATE KEY" (PKCS#1) / "EC PRIVATE KEY" (SEC1)
            key_pem = key.to_pem(pkcs8=options.pkcs8)
    except CryptoError as e:
        raise CsrError(f"csr cert generation failed: {e}") from None
    request = der.sequence(info, _SIGNATURE_ALGORITHMS[key_type, digest], der.encode_bit_string(signature))
    return encode_pem(request, "CERTIFICATE REQUEST"), key_pem
