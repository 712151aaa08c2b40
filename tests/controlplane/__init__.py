"""Tests of the local control plane; shared helpers that build CSRs the way Istio's agent does."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from istio_agent.controlplane.server import ControlPlane
from istio_agent.metrics import Registry


def make_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def make_csr(
    key: ec.EllipticCurvePrivateKey,
    sans: list[x509.GeneralName] | None,
) -> bytes:
    """A PEM CSR with an empty-ish subject and (when given) a critical SAN extension, as the agent sends."""
    builder = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(x509.oid.NameOID.ORGANIZATION_NAME, "")])
    )
    if sans is not None:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=True)
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def spiffe_csr(key: ec.EllipticCurvePrivateKey, identity: str) -> bytes:
    return make_csr(key, [x509.UniformResourceIdentifier(identity)])


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def uri_sans(cert: x509.Certificate) -> list[str]:
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return san.get_values_for_type(x509.UniformResourceIdentifier)


@asynccontextmanager
async def started_plane(
    directory: Path, mesh_yaml: str = "trustDomain: cluster.local\n", **options: Any
) -> AsyncIterator[ControlPlane]:
    """A control plane on free loopback ports serving ``mesh_yaml`` (an empty mesh), state in ``directory``."""
    mesh = directory / "mesh.yaml"
    mesh.write_text(mesh_yaml)
    plane = ControlPlane(
        mesh,
        directory / "state",
        address="127.0.0.1:0",
        secure_address="127.0.0.1:0",
        registry=Registry(),
        **options,
    )
    await plane.start()
    try:
        yield plane
    finally:
        await plane.stop(0)
