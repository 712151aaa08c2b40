"""LocalCA: the root is made once, CSRs are signed only for the caller's identity."""

from __future__ import annotations

import ipaddress
import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from istio_agent.controlplane.ca import InvalidCSR, LocalCA, SigningRefused, StateError

from . import make_csr, make_key, spiffe_csr, uri_sans

IDENTITY = "spiffe://cluster.local/ns/default/sa/sleep"


@pytest.fixture
def ca(tmp_path: Path) -> LocalCA:
    return LocalCA.load_or_create(tmp_path / "state", "cluster.local")


def test_root_is_made_once_with_istio_attributes(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = LocalCA.load_or_create(state, "example.org")
    assert stat.S_IMODE((state / "root-key.pem").stat().st_mode) == 0o600
    assert (state / "root-cert.pem").read_bytes() == first.root_pem

    root = x509.load_pem_x509_certificate(first.root_pem)
    assert root.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "Istio Local CA"
    assert root.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "example.org"
    assert root.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert root.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign
    lifetime = root.not_valid_after_utc - root.not_valid_before_utc
    assert timedelta(days=3649) < lifetime < timedelta(days=3651)

    # Loading again (even with another trust domain) gives the same root and signs with the same key.
    again = LocalCA.load_or_create(state, "other.org")
    assert again.root_pem == first.root_pem
    leaf = x509.load_pem_x509_certificate(
        again.sign_csr(spiffe_csr(make_key(), IDENTITY), IDENTITY, timedelta(hours=1))[0].encode()
    )
    leaf.verify_directly_issued_by(root)


def test_sign_returns_leaf_then_root_like_istiod(ca: LocalCA) -> None:
    key = make_key()
    chain = ca.sign_csr(spiffe_csr(key, IDENTITY), IDENTITY, timedelta(hours=2))

    assert len(chain) == 2
    assert chain[0].endswith("\n") and chain[0].startswith("-----BEGIN CERTIFICATE-----")
    assert chain[1].encode() == ca.root_pem

    leaf = x509.load_pem_x509_certificate(chain[0].encode())
    leaf.verify_directly_issued_by(ca.root_cert)
    assert leaf.public_key() == key.public_key()
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert san.critical and uri_sans(leaf) == [IDENTITY]
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    usage = leaf.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.digital_signature and usage.key_encipherment and not usage.key_cert_sign
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert leaf.serial_number > 0

    now = datetime.now(UTC)
    assert abs(leaf.not_valid_before_utc - (now - timedelta(minutes=1))) < timedelta(seconds=5)
    assert abs(leaf.not_valid_after_utc - (now + timedelta(hours=2))) < timedelta(seconds=5)


def test_serials_differ(ca: LocalCA) -> None:
    serials = {
        x509.load_pem_x509_certificate(
            ca.sign_csr(spiffe_csr(make_key(), IDENTITY), IDENTITY, timedelta(hours=1))[0].encode()
        ).serial_number
        for _ in range(3)
    }
    assert len(serials) == 3


@pytest.mark.parametrize(
    ("ttl", "expected"),
    [(timedelta(0), timedelta(seconds=1)), (timedelta(days=365), timedelta(days=90))],
)
def test_ttl_is_clamped(ca: LocalCA, ttl: timedelta, expected: timedelta) -> None:
    leaf = x509.load_pem_x509_certificate(
        ca.sign_csr(spiffe_csr(make_key(), IDENTITY), IDENTITY, ttl)[0].encode()
    )
    lifetime = leaf.not_valid_after_utc - leaf.not_valid_before_utc - timedelta(minutes=1)
    assert abs(lifetime - expected) <= timedelta(seconds=2)


def test_rsa_csr_is_signed(ca: LocalCA) -> None:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(IDENTITY)]), critical=True)
        .sign(key, hashes.SHA256())
        .public_bytes(serialization.Encoding.PEM)
    )
    leaf = x509.load_pem_x509_certificate(ca.sign_csr(csr, IDENTITY, timedelta(hours=1))[0].encode())
    assert leaf.public_key() == key.public_key()


def test_san_mismatch_is_refused(ca: LocalCA) -> None:
    other = "spiffe://cluster.local/ns/prod/sa/admin"
    with pytest.raises(SigningRefused) as err:
        ca.sign_csr(spiffe_csr(make_key(), other), IDENTITY, timedelta(hours=1))
    assert not isinstance(err.value, InvalidCSR)
    assert err.value.reason == f"CSR requests {other} but caller is {IDENTITY}"


@pytest.mark.parametrize(
    "sans",
    [None, [x509.DNSName("sleep.default.svc")], [x509.IPAddress(ipaddress.ip_address("10.0.0.1"))]],
)
def test_csr_without_uri_san_is_refused(ca: LocalCA, sans: list[x509.GeneralName] | None) -> None:
    with pytest.raises(SigningRefused, match="CSR has no URI SAN"):
        ca.sign_csr(make_csr(make_key(), sans), IDENTITY, timedelta(hours=1))


def test_csr_with_extra_sans_is_refused(ca: LocalCA) -> None:
    sans: list[x509.GeneralName] = [
        x509.UniformResourceIdentifier(IDENTITY),
        x509.DNSName("evil.example.com"),
    ]
    with pytest.raises(SigningRefused, match="exactly one URI SAN"):
        ca.sign_csr(make_csr(make_key(), sans), IDENTITY, timedelta(hours=1))
    two_uris: list[x509.GeneralName] = [
        x509.UniformResourceIdentifier(IDENTITY),
        x509.UniformResourceIdentifier("spiffe://cluster.local/ns/prod/sa/admin"),
    ]
    with pytest.raises(SigningRefused, match="exactly one URI SAN"):
        ca.sign_csr(make_csr(make_key(), two_uris), IDENTITY, timedelta(hours=1))


def test_csr_with_bad_signature_is_refused(ca: LocalCA) -> None:
    csr = x509.load_pem_x509_csr(spiffe_csr(make_key(), IDENTITY))
    der = bytearray(csr.public_bytes(serialization.Encoding.DER))
    der[-3] ^= 0x01  # inside the ECDSA signature's s value
    tampered = x509.load_der_x509_csr(bytes(der)).public_bytes(serialization.Encoding.PEM)
    with pytest.raises(InvalidCSR, match="CSR signature invalid"):
        ca.sign_csr(tampered, IDENTITY, timedelta(hours=1))


@pytest.mark.parametrize("csr", [b"", b"not a csr", b"-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END"])
def test_garbage_csr_is_invalid(ca: LocalCA, csr: bytes) -> None:
    with pytest.raises(InvalidCSR, match="not a PEM-encoded"):
        ca.sign_csr(csr, IDENTITY, timedelta(hours=1))


def test_weak_rsa_key_is_invalid(ca: LocalCA) -> None:
    key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(IDENTITY)]), critical=True)
        .sign(key, hashes.SHA256())
        .public_bytes(serialization.Encoding.PEM)
    )
    with pytest.raises(InvalidCSR, match="1024 bits"):
        ca.sign_csr(csr, IDENTITY, timedelta(hours=1))


def test_serving_cert_covers_names_and_ips(ca: LocalCA) -> None:
    key_pem, chain_pem = ca.issue_serving_cert(["istiod.istio-system.svc", "localhost", "127.0.0.1", "::1"])
    certs = x509.load_pem_x509_certificates(chain_pem)
    assert certs[-1] == ca.root_cert
    leaf = certs[0]
    leaf.verify_directly_issued_by(ca.root_cert)
    key = serialization.load_pem_private_key(key_pem, password=None)
    assert leaf.public_key() == key.public_key()
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["istiod.istio-system.svc", "localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    ]


def test_half_state_is_an_error(tmp_path: Path) -> None:
    state = tmp_path / "state"
    LocalCA.load_or_create(state, "cluster.local")
    (state / "root-cert.pem").unlink()
    with pytest.raises(StateError, match=r"root-key\.pem exists but .*root-cert\.pem does not"):
        LocalCA.load_or_create(state, "cluster.local")


def test_corrupt_state_is_an_error(tmp_path: Path) -> None:
    state = tmp_path / "state"
    LocalCA.load_or_create(state, "cluster.local")
    (state / "root-cert.pem").write_text("garbage")
    with pytest.raises(StateError, match="is not a PEM certificate"):
        LocalCA.load_or_create(state, "cluster.local")
    other = tmp_path / "other"
    LocalCA.load_or_create(other, "cluster.local")
    (state / "root-cert.pem").write_bytes((other / "root-cert.pem").read_bytes())
    with pytest.raises(StateError, match="does not belong to the key"):
        LocalCA.load_or_create(state, "cluster.local")
    (state / "root-key.pem").write_text("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
    with pytest.raises(StateError, match="not an unencrypted PEM private key") as err:
        LocalCA.load_or_create(state, "cluster.local")
    assert "AAAA" not in str(err.value)


def test_unwritable_state_dir_is_an_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StateError, match="cannot use state directory"):
        LocalCA.load_or_create(blocker / "state", "cluster.local")
