"""Compare our certificate reader with ``cryptography``'s (the independent reference)."""

from __future__ import annotations

import warnings
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from istio_agent.pem import certificate


def reference_facts(data: bytes) -> dict[str, Any]:
    """What cryptography reads from DER ``data``: the fields our Certificate has, or an ``error`` per part."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            cert = x509.load_der_x509_certificate(data)
        except ValueError as e:
            return {"error": str(e)}
        facts: dict[str, Any] = {
            "serial": cert.serial_number,
            "version": cert.version.value,
            "subject": cert.subject.rfc4514_string(),
            "issuer": cert.issuer.rfc4514_string(),
            "subject_len": len(cert.subject),
            "not_before": cert.not_valid_before_utc,
            "not_after": cert.not_valid_after_utc,
            "tbs": cert.tbs_certificate_bytes,
            "signature": cert.signature,
            "signature_oid": cert.signature_algorithm_oid.dotted_string,
            "self_issued": cert.subject == cert.issuer,
        }
        try:
            facts["spki"] = cert.public_key().public_bytes(
                serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        except Exception as e:  # an unsupported key type: not ours to compare
            facts["spki"] = f"error: {e}"
        try:
            extensions = cert.extensions
        except Exception as e:  # DuplicateExtension is not a ValueError
            facts["extensions_error"] = str(e)
            return facts
        try:
            san = extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            facts["uris"] = tuple(san.get_values_for_type(x509.UniformResourceIdentifier))
            facts["dns"] = tuple(san.get_values_for_type(x509.DNSName))
            facts["ips"] = tuple(san.get_values_for_type(x509.IPAddress))
        except x509.ExtensionNotFound:
            facts["uris"], facts["dns"], facts["ips"] = (), (), ()
        try:
            facts["is_ca"] = extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        except x509.ExtensionNotFound:
            facts["is_ca"] = False
        return facts


def our_facts(data: bytes) -> dict[str, Any]:
    try:
        cert = certificate.parse(data)
    except certificate.DerError as e:
        return {"error": str(e)}
    facts: dict[str, Any] = {
        "serial": cert.serial_number,
        "version": cert.version,
        "subject": cert.subject.rfc4514_string(),
        "issuer": cert.issuer.rfc4514_string(),
        "subject_len": len(cert.subject),
        "not_before": cert.not_valid_before_utc,
        "not_after": cert.not_valid_after_utc,
        "tbs": cert.tbs,
        "signature": cert.signature,
        "signature_oid": cert.signature_algorithm_oid,
        "self_issued": cert.subject == cert.issuer,
        "spki": cert.spki,
    }
    try:
        sans = cert.subject_alt_names()
        facts["uris"], facts["dns"], facts["ips"] = sans.uris, sans.dns_names, sans.ip_addresses
        facts["is_ca"] = cert.is_ca()
    except certificate.DerError as e:
        facts["extensions_error"] = str(e)
    return facts
