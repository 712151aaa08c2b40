"""Envoy config dumps of secrets, built the way Envoy's admin writes them, with certificates made here.

``cert`` makes a certificate with an exact serial and dates, so tables can be compared with
istioctl's golden outputs (``istioctl/pkg/writer/envoy/configdump/testdata/secret/*/output``).
"""

from __future__ import annotations

import base64
from datetime import UTC, datetime
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.x509.oid import NameOID

from istio_agent.ctl.secrets import SECRETS_DUMP_TYPE, SPIFFE_VALIDATOR_TYPE
from tests.security.certs import PrivateKey, new_key, to_pem

SECRET_TYPE = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"


def when(text: str) -> datetime:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)


class Issued:
    """A certificate and its key (so it can issue others)."""

    def __init__(self, cert: x509.Certificate, key: PrivateKey) -> None:
        self.cert, self.key = cert, key

    @property
    def pem(self) -> bytes:
        return to_pem(self.cert)


def cert(
    serial: int,
    not_before: str,
    not_after: str,
    *,
    ca: bool = False,
    issuer: Issued | None = None,
    uri: str | None = None,
    name: str = "",
) -> Issued:
    key = new_key()
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, name or f"cert {serial:x}")])
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer.cert.subject if issuer else subject)
        .public_key(key.public_key())
        .serial_number(serial)
        .not_valid_before(when(not_before))
        .not_valid_after(when(not_after))
    )
    if ca:
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
    if uri:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(uri)]), critical=False
        )
    return Issued(builder.sign(issuer.key if issuer else key, hashes.SHA256()), key)


def inline(data: bytes) -> dict[str, str]:
    return {"inline_bytes": base64.b64encode(data).decode()}


def tls_secret(name: str, chain: bytes) -> dict[str, Any]:
    return {
        "@type": SECRET_TYPE,
        "name": name,
        "tls_certificate": {
            "certificate_chain": inline(chain),
            "private_key": {"inline_string": "[redacted]"},
        },
    }


def root_secret(name: str, bundle: bytes) -> dict[str, Any]:
    return {"@type": SECRET_TYPE, "name": name, "validation_context": {"trusted_ca": inline(bundle)}}


def spiffe_secret(name: str, domains: dict[str, bytes]) -> dict[str, Any]:
    trust_domains = [{"name": domain, "trust_bundle": inline(bundle)} for domain, bundle in domains.items()]
    return {
        "@type": SECRET_TYPE,
        "name": name,
        "validation_context": {
            "custom_validator_config": {
                "name": "envoy.tls.cert_validator.spiffe",
                "typed_config": {"@type": SPIFFE_VALIDATOR_TYPE, "trust_domains": trust_domains},
            }
        },
    }


def entry(secret: dict[str, Any], version: str = "2023-05-15T01:32:52Z/1") -> dict[str, Any]:
    return {
        "name": secret["name"],
        "version_info": version,
        "last_updated": "2023-05-15T01:32:53Z",
        "secret": secret,
    }


def dump(active: list[dict[str, Any]] = (), warming: list[dict[str, Any]] = ()) -> dict[str, Any]:  # type: ignore[assignment]
    section: dict[str, Any] = {"@type": SECRETS_DUMP_TYPE}
    if active:
        section["dynamic_active_secrets"] = [entry(s) for s in active]
    if warming:
        section["dynamic_warming_secrets"] = [{"name": s["name"], "secret": s} for s in warming]
    return {
        "configs": [
            {"@type": "type.googleapis.com/envoy.admin.v3.BootstrapConfigDump"},
            section,
        ]
    }
