"""Our DER certificate reader reads what ``cryptography`` reads, and refuses garbage with DerError."""

from __future__ import annotations

import ipaddress
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import NameOID
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from istio_agent.pem import certificate, der, libcrypto, signature
from tests.pem.reference import our_facts, reference_facts
from tests.security.certs import issue, make_ca, new_key, with_negative_serial

CORPUS = sorted(p for p in Path("/etc/ssl/certs").glob("*.pem") if p.is_file())


def ders_of(path: Path) -> list[bytes]:
    import base64
    import re

    text = path.read_bytes()
    blocks = re.findall(rb"-----BEGIN CERTIFICATE-----(.*?)-----END CERTIFICATE-----", text, re.S)
    return [base64.b64decode(b"".join(block.split())) for block in blocks]


def assert_same(data: bytes) -> None:
    theirs, ours = reference_facts(data), our_facts(data)
    if "error" in theirs:
        assert "error" in ours, f"cryptography refuses ({theirs['error']}), we accept"
        return
    assert "error" not in ours, ours.get("error")
    if "extensions_error" in theirs:  # we read only subjectAltName and basicConstraints
        theirs = {
            k: v for k, v in theirs.items() if k not in ("uris", "dns", "ips", "is_ca", "extensions_error")
        }
        ours = {k: v for k, v in ours.items() if k not in ("uris", "dns", "ips", "is_ca", "extensions_error")}
    if isinstance(theirs["spki"], str):  # a key type cryptography cannot load: compare the rest
        del theirs["spki"], ours["spki"]
    assert ours == theirs


def test_the_corpus_is_there() -> None:
    assert len(CORPUS) > 50


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.name)
def test_os_trust_store_roots_read_as_cryptography_reads_them(path: Path) -> None:
    for data in ders_of(path):
        assert_same(data)


@pytest.fixture(scope="module")
def ca():
    return make_ca("root")


def der_of(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.DER)


def test_issued_leaves(ca) -> None:
    leaf = issue(
        *ca,
        uri_sans=["spiffe://cluster.local/ns/default/sa/app", "spiffe://td/x"],
        dns_sans=["app.example.com", "*.example.org"],
        common_name="leaf",
    )
    assert_same(der_of(leaf))
    assert_same(der_of(ca[1]))
    cert = certificate.parse(der_of(leaf))
    assert cert.subject_alt_names().uris == ("spiffe://cluster.local/ns/default/sa/app", "spiffe://td/x")
    assert cert.subject_alt_names().dns_names == ("app.example.com", "*.example.org")
    assert not cert.is_ca() and certificate.parse(der_of(ca[1])).is_ca()
    assert cert.subject.rfc4514_string() == "CN=leaf" and cert.issuer.rfc4514_string() == "CN=root"


def build(
    key,
    subject: x509.Name,
    *,
    sans: list[x509.GeneralName] | None = None,
    serial: int = 12345,
    not_before: datetime | None = None,
    not_after: datetime | None = None,
    is_ca: bool | None = None,
    digest=None,
) -> bytes:
    now = datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(serial)
        .not_valid_before(not_before or now)
        .not_valid_after(not_after or now + timedelta(days=1))
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=True)
    if is_ca is not None:
        builder = builder.add_extension(
            x509.BasicConstraints(ca=is_ca, path_length=0 if is_ca else None), True
        )
    return der_of(builder.sign(key, digest if digest is not None else hashes.SHA256()))


@pytest.mark.parametrize("kind", ["ec", "ec384", "rsa"])
def test_key_types_and_sans(kind: str) -> None:
    key = new_key(kind)
    sans: list[x509.GeneralName] = [
        x509.UniformResourceIdentifier("spiffe://td/ns/a/sa/b"),
        x509.IPAddress(ipaddress.IPv4Address("10.1.2.3")),
        x509.IPAddress(ipaddress.IPv6Address("2001:db8::1")),
        x509.DNSName("app.example.com"),
        x509.RFC822Name("a@example.com"),
    ]
    data = build(key, x509.Name([]), sans=sans, is_ca=False)
    assert_same(data)
    parsed = certificate.parse(data)
    assert parsed.subject_alt_names().ip_addresses == (
        ipaddress.IPv4Address("10.1.2.3"),
        ipaddress.IPv6Address("2001:db8::1"),
    )
    assert len(parsed.subject) == 0


def test_names_print_as_cryptography_prints_them() -> None:
    key = new_key()
    odd = x509.Name(
        [
            x509.RelativeDistinguishedName(
                [
                    x509.NameAttribute(NameOID.COMMON_NAME, "a+b"),
                    x509.NameAttribute(NameOID.SERIAL_NUMBER, "7"),
                ]
            ),
            x509.RelativeDistinguishedName(
                [x509.NameAttribute(NameOID.ORGANIZATION_NAME, ' #x, "y" <z>; \\ ')]
            ),
            x509.RelativeDistinguishedName([x509.NameAttribute(NameOID.COUNTRY_NAME, "DE")]),
            x509.RelativeDistinguishedName([x509.NameAttribute(NameOID.DOMAIN_COMPONENT, "example")]),
            x509.RelativeDistinguishedName([x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "Ünïcödé")]),
            x509.RelativeDistinguishedName([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "")]),
        ]
    )
    assert_same(build(key, odd))


@pytest.mark.parametrize(
    ("not_before", "not_after"),
    [
        (datetime(1950, 1, 1, tzinfo=UTC), datetime(2049, 12, 31, 23, 59, 59, tzinfo=UTC)),  # UTCTime
        (datetime(1999, 12, 31, tzinfo=UTC), datetime(2050, 1, 1, tzinfo=UTC)),  # GeneralizedTime after
        (datetime(2000, 2, 29, tzinfo=UTC), datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC)),
    ],
)
def test_times(not_before: datetime, not_after: datetime) -> None:
    data = build(new_key(), x509.Name([]), not_before=not_before, not_after=not_after)
    assert_same(data)
    parsed = certificate.parse(data)
    assert (parsed.not_valid_before_utc, parsed.not_valid_after_utc) == (not_before, not_after)


@pytest.mark.parametrize("serial", [1, 127, 128, 255, 256, 2**63, 2**159 - 1])
def test_serials(serial: int) -> None:
    assert_same(build(new_key(), x509.Name([]), serial=serial))


def test_negative_serial_is_read(ca) -> None:
    import base64

    pem = with_negative_serial(ca[1])
    data = base64.b64decode(b"".join(pem.split(b"\n")[1:-2]))
    assert certificate.parse(data).serial_number < 0
    assert_same(data)


def test_long_form_lengths() -> None:
    # A 4096-bit RSA key and many SANs: two- and three-byte long-form lengths.
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=4096)
    sans: list[x509.GeneralName] = [x509.DNSName(f"host-{i}.example.com") for i in range(3000)]
    data = build(key, x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "x" * 64)]), sans=sans)
    assert len(data) > 65536
    assert_same(data)


def test_trailing_data_is_refused(ca) -> None:
    with pytest.raises(der.DerError, match="unexpected data"):
        certificate.parse(der_of(ca[1]) + b"\x00")


def test_equality_is_by_der(ca) -> None:
    data = der_of(ca[1])
    assert certificate.parse(data) == certificate.parse(bytes(data))
    assert certificate.parse(data) != certificate.parse(der_of(issue(*ca)))


# -- mangled input ----------------------------------------------------------------------------------

SEED = der_of(
    x509.CertificateBuilder()
    .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "seed")]))
    .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "seed")]))
    .public_key(new_key().public_key())
    .serial_number(99)
    .not_valid_before(datetime(2024, 1, 1, tzinfo=UTC))
    .not_valid_after(datetime(2025, 1, 1, tzinfo=UTC))
    .add_extension(
        x509.SubjectAlternativeName(
            [x509.UniformResourceIdentifier("spiffe://a/b"), x509.IPAddress(ipaddress.IPv4Address("1.2.3.4"))]
        ),
        critical=False,
    )
    .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
    .sign(new_key(), hashes.SHA256())
)


def read_everything(data: bytes) -> None:
    """Parse, touch every lazily read part and verify; only DerError or CryptoError may come out."""
    try:
        cert = certificate.parse(data)
        cert.subject_alt_names()
        cert.is_ca()
        cert.subject.rfc4514_string()
        assert cert.signature_algorithm_oid
        signature.signed_by(cert, cert.spki)  # garbage keys and signatures reach libcrypto
    except (der.DerError, libcrypto.CryptoError):
        pass


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    edits=st.lists(st.tuples(st.integers(0, len(SEED) - 1), st.integers(0, 255)), min_size=1, max_size=6),
    cut=st.integers(0, len(SEED)),
)
def test_mangled_der_raises_der_error_only(edits: list[tuple[int, int]], cut: int) -> None:
    data = bytearray(SEED)
    for index, value in edits:
        data[index] = value
    read_everything(bytes(data))
    read_everything(bytes(data[:cut]))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_raise_der_error_only(data: bytes) -> None:
    read_everything(data)
    read_everything(b"\x30\x82" + data)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "missing"),
        (b"\x30\x80\x00\x00", "indefinite length"),
        (b"\x30\x81\x05", "not minimally encoded"),
        (b"\x30\x85\x01\x00\x00\x00\x00", "oversized"),
        (b"\x30\x05\x00", "truncated"),
        (b"\x1f\x01\x00", "high tag"),
        (b"\x02\x01\x05", "expected tag 0x30"),
    ],
)
def test_malformed_headers(data: bytes, message: str) -> None:
    with pytest.raises(der.DerError, match=message):
        certificate.parse(data)


def test_der_integers_and_oids() -> None:
    element = der.Reader(der.encode_integer(-129)).read(der.INTEGER)
    assert der.integer(element) == -129
    for value in (0, 1, 127, 128, 255, 256, -1, -128, 2**64):
        assert der.integer(der.Reader(der.encode_integer(value)).read()) == value
    with pytest.raises(der.DerError, match="not minimally"):
        der.integer(der.Reader(b"\x02\x02\x00\x01").read())
    for oid in ("2.5.29.17", "1.2.840.113549.1.1.11", "2.999.3", "0.9.2342.19200300.100.1.25"):
        assert der.object_identifier(der.Reader(der.encode_oid(oid)).read()) == oid
    with pytest.raises(der.DerError):
        der.object_identifier(der.Reader(b"\x06\x02\x80\x01").read())
