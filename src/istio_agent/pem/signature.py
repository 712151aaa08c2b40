"""Which digest and padding a certificate's signature algorithm means, and its verification.

RSA PKCS#1 v1.5 and ECDSA with SHA-2 or SHA-3, RSASSA-PSS and Ed25519/Ed448: what ``cryptography``'s
``verify_directly_issued_by`` verified for us before. SHA-1 signatures are refused, as it and Go
(``x509.InsecureAlgorithmError``) refuse them; DSA was never used by a mesh. Anything else is
:class:`UnsupportedAlgorithm`.
"""

from __future__ import annotations

from istio_agent.pem import der, libcrypto
from istio_agent.pem.certificate import Certificate
from istio_agent.pem.der import DerError

_HASHES = {
    "2.16.840.1.101.3.4.2.4": "SHA224",
    "2.16.840.1.101.3.4.2.1": "SHA256",
    "2.16.840.1.101.3.4.2.2": "SHA384",
    "2.16.840.1.101.3.4.2.3": "SHA512",
    "2.16.840.1.101.3.4.2.7": "SHA3-224",
    "2.16.840.1.101.3.4.2.8": "SHA3-256",
    "2.16.840.1.101.3.4.2.9": "SHA3-384",
    "2.16.840.1.101.3.4.2.10": "SHA3-512",
}
_SCHEMES: dict[str, str | None] = {
    "1.2.840.113549.1.1.14": "SHA224",  # sha224WithRSAEncryption
    "1.2.840.113549.1.1.11": "SHA256",
    "1.2.840.113549.1.1.12": "SHA384",
    "1.2.840.113549.1.1.13": "SHA512",
    "2.16.840.1.101.3.4.3.13": "SHA3-224",  # id-rsassa-pkcs1-v1_5-with-sha3-224
    "2.16.840.1.101.3.4.3.14": "SHA3-256",
    "2.16.840.1.101.3.4.3.15": "SHA3-384",
    "2.16.840.1.101.3.4.3.16": "SHA3-512",
    "1.2.840.10045.4.3.1": "SHA224",  # ecdsa-with-SHA224
    "1.2.840.10045.4.3.2": "SHA256",
    "1.2.840.10045.4.3.3": "SHA384",
    "1.2.840.10045.4.3.4": "SHA512",
    "2.16.840.1.101.3.4.3.9": "SHA3-224",  # id-ecdsa-with-sha3-224
    "2.16.840.1.101.3.4.3.10": "SHA3-256",
    "2.16.840.1.101.3.4.3.11": "SHA3-384",
    "2.16.840.1.101.3.4.3.12": "SHA3-512",
    "1.3.101.112": None,  # Ed25519: no separate digest
    "1.3.101.113": None,  # Ed448
}
RSASSA_PSS = "1.2.840.113549.1.1.10"
MGF1 = "1.2.840.113549.1.1.8"


class UnsupportedAlgorithm(libcrypto.CryptoError):
    """The signature algorithm is not one we verify."""


def _hash_of(algorithm: der.Element, what: str) -> str:
    oid = der.object_identifier(algorithm.reader().read(der.OID, what), what)
    if oid not in _HASHES:
        raise UnsupportedAlgorithm(f"{what}: unsupported hash algorithm {oid}")
    return _HASHES[oid]


def _pss(parameters: der.Element) -> tuple[str, libcrypto.Pss]:
    """RSASSA-PSS-params (RFC 4055): hash, MGF1 hash and salt length (their SHA-1 defaults refused)."""
    body = parameters.reader()
    salt = 20
    field = body.optional(der.context(0, True), "PSS hash")
    if field is None:
        raise UnsupportedAlgorithm("RSASSA-PSS with SHA-1 is not supported")
    digest = _hash_of(der.read_one(field.content, der.SEQUENCE, "PSS hash"), "PSS hash")
    field = body.optional(der.context(1, True), "PSS mask")
    if field is None:
        raise UnsupportedAlgorithm("RSASSA-PSS with MGF1 over SHA-1 is not supported")
    mask = der.read_one(field.content, der.SEQUENCE, "PSS mask").reader()
    if der.object_identifier(mask.read(der.OID, "PSS mask")) != MGF1:
        raise UnsupportedAlgorithm("RSASSA-PSS: unsupported mask generation function")
    mgf1_digest = _hash_of(mask.read(der.SEQUENCE, "PSS MGF1 hash"), "PSS MGF1 hash")
    if (field := body.optional(der.context(2, True), "PSS salt")) is not None:
        salt = der.integer(der.read_one(field.content, der.INTEGER, "PSS salt"), "PSS salt")
    field = body.optional(der.context(3, True), "PSS trailer")
    if field is not None and der.integer(der.read_one(field.content, der.INTEGER, "PSS trailer")) != 1:
        raise UnsupportedAlgorithm("RSASSA-PSS: unsupported trailer field")
    body.end("RSASSA-PSS parameters")
    if not 0 <= salt < 1 << 16:
        raise DerError("RSASSA-PSS: salt length out of range")
    return digest, libcrypto.Pss(mgf1_digest, salt)


def signed_by(cert: Certificate, issuer_spki: bytes) -> bool:
    """Whether ``cert``'s signature verifies with the public key ``issuer_spki`` (DER).

    UnsupportedAlgorithm for an algorithm we do not verify; DerError for malformed parameters.
    """
    algorithm = cert.signature_algorithm.reader()
    oid = der.object_identifier(algorithm.read(der.OID, "signature algorithm"))
    pss = None
    if oid == RSASSA_PSS:
        digest: str | None
        digest, pss = _pss(algorithm.read(der.SEQUENCE, "RSASSA-PSS parameters"))
    elif oid in _SCHEMES:
        digest = _SCHEMES[oid]
    else:
        raise UnsupportedAlgorithm(f"signature algorithm {oid} is not supported")
    return libcrypto.verify(issuer_spki, cert.signature, cert.tbs, digest, pss)
