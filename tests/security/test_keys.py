from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtensionOID, NameOID

from istio_agent.config import SecuritySettings
from istio_agent.security.keys import CsrError, KeyOptions, generate_csr

SPIFFE = "spiffe://cluster.local/ns/default/sa/app"


def check_csr(csr_pem: bytes, key_pem: bytes) -> tuple[x509.CertificateSigningRequest, object]:
    """Parse and verify a CSR; check the parts common to every CSR; return (csr, private key)."""
    assert csr_pem.startswith(b"-----BEGIN CERTIFICATE REQUEST-----\n")
    csr = x509.load_pem_x509_csr(csr_pem)
    assert csr.is_signature_valid
    key = serialization.load_pem_private_key(key_pem, password=None)
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    der = serialization.Encoding.DER
    assert csr.public_key().public_bytes(der, spki) == key.public_key().public_bytes(der, spki)
    # No CN; a single Organization attribute with an empty value.
    assert [(a.oid, a.value) for a in csr.subject] == [(NameOID.ORGANIZATION_NAME, "")]
    # Exactly one requested extension: a critical subjectAltName.
    assert [(e.oid, e.critical) for e in csr.extensions] == [(ExtensionOID.SUBJECT_ALTERNATIVE_NAME, True)]
    return csr, key


def sans(csr: x509.CertificateSigningRequest) -> list[x509.GeneralName]:
    return list(csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)


def test_rsa_default() -> None:
    csr_pem, key_pem = generate_csr(SPIFFE, KeyOptions())
    csr, key = check_csr(csr_pem, key_pem)
    assert key_pem.startswith(b"-----BEGIN RSA PRIVATE KEY-----\n")  # PKCS#1
    assert isinstance(key, rsa.RSAPrivateKey) and key.key_size == 2048
    assert isinstance(csr.signature_hash_algorithm, hashes.SHA256)
    assert sans(csr) == [x509.UniformResourceIdentifier(SPIFFE)]


@pytest.mark.parametrize(
    ("curve", "expected_curve", "expected_hash"),
    [
        ("P256", ec.SECP256R1, hashes.SHA256),
        ("P384", ec.SECP384R1, hashes.SHA384),
        ("P521", ec.SECP256R1, hashes.SHA256),  # anything else is P-256
        ("", ec.SECP256R1, hashes.SHA256),
    ],
)
def test_ecdsa(curve: str, expected_curve: type, expected_hash: type) -> None:
    csr_pem, key_pem = generate_csr(SPIFFE, KeyOptions(ecc_signature_algorithm="ECDSA", ecc_curve=curve))
    csr, key = check_csr(csr_pem, key_pem)
    assert key_pem.startswith(b"-----BEGIN EC PRIVATE KEY-----\n")  # SEC1
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert isinstance(key.curve, expected_curve)
    assert isinstance(csr.signature_hash_algorithm, expected_hash)
    assert sans(csr) == [x509.UniformResourceIdentifier(SPIFFE)]


@pytest.mark.parametrize(
    ("options", "key_type"),
    [
        (KeyOptions(pkcs8=True), rsa.RSAPrivateKey),
        (KeyOptions(pkcs8=True, ecc_signature_algorithm="ECDSA"), ec.EllipticCurvePrivateKey),
    ],
)
def test_pkcs8(options: KeyOptions, key_type: type) -> None:
    csr_pem, key_pem = generate_csr(SPIFFE, options)
    assert key_pem.startswith(b"-----BEGIN PRIVATE KEY-----\n")
    _, key = check_csr(csr_pem, key_pem)
    assert isinstance(key, key_type)


@pytest.mark.parametrize("algorithm", ["ED25519", "ecdsa", "RSA"])
def test_unsupported_signature_algorithm(algorithm: str) -> None:
    with pytest.raises(
        CsrError, match=r"^csr cert generation fails due to unsupported EC signature algorithm$"
    ):
        generate_csr(SPIFFE, KeyOptions(ecc_signature_algorithm=algorithm))


@pytest.mark.parametrize("size", [1024, 2047, -1])
def test_rsa_key_too_small(size: int) -> None:
    expected = rf"^requested key size does not meet the minimum required size of 2048 \(requested: {size}\)$"
    with pytest.raises(CsrError, match=expected):
        generate_csr(SPIFFE, KeyOptions(rsa_key_size=size))


def test_san_types() -> None:
    hosts = "spiffe://td/ns/a/sa/b,10.1.2.3,::ffff:192.0.2.7,2001:db8::1,app.example.com,*.example.org"
    csr, _ = check_csr(*generate_csr(hosts, KeyOptions(ecc_signature_algorithm="ECDSA")))
    assert sans(csr) == [
        x509.UniformResourceIdentifier("spiffe://td/ns/a/sa/b"),
        x509.IPAddress(ipaddress.IPv4Address("10.1.2.3")),
        x509.IPAddress(ipaddress.IPv4Address("192.0.2.7")),  # IPv4-mapped IPv6 -> 4 bytes, as Go does
        x509.IPAddress(ipaddress.IPv6Address("2001:db8::1")),
        x509.DNSName("app.example.com"),
        x509.DNSName("*.example.org"),
    ]


def test_non_spiffe_uri_is_a_dns_name() -> None:
    csr, _ = check_csr(*generate_csr("http://example.com", KeyOptions(ecc_signature_algorithm="ECDSA")))
    assert sans(csr) == [x509.DNSName("http://example.com")]


@pytest.mark.parametrize("hosts", ["", "a,,b", "a,"])
def test_empty_host_is_an_error(hosts: str) -> None:
    with pytest.raises(CsrError, match=r"empty host name"):
        generate_csr(hosts, KeyOptions(ecc_signature_algorithm="ECDSA"))


def test_options_from_settings(tmp_path: Path) -> None:
    settings = SecuritySettings(
        workdir=tmp_path, rsa_key_size=4096, ecc_signature_algorithm="ECDSA", ecc_curve="P384", pkcs8_key=True
    )
    assert KeyOptions.from_settings(settings) == KeyOptions(
        rsa_key_size=4096, ecc_signature_algorithm="ECDSA", ecc_curve="P384", pkcs8=True
    )
    assert KeyOptions.from_settings(SecuritySettings(workdir=tmp_path)) == KeyOptions()


def cryptography_csr(
    hosts: str, key_pem: bytes, digest: hashes.HashAlgorithm
) -> x509.CertificateSigningRequest:
    """The CSR the previous implementation built with cryptography, for the same key and hosts."""
    names: list[x509.GeneralName] = []
    for host in hosts.split(","):
        try:
            ip = ipaddress.ip_address(host)
            mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
            names.append(x509.IPAddress(mapped or ip))
        except ValueError:
            names.append(
                x509.UniformResourceIdentifier(host) if host.startswith("spiffe://") else x509.DNSName(host)
            )
    key = serialization.load_pem_private_key(key_pem, password=None)
    return (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "")]))
        .add_extension(x509.SubjectAlternativeName(names), critical=True)
        .sign(key, digest)  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("options", "digest"),
    [
        (KeyOptions(), hashes.SHA256()),
        (KeyOptions(pkcs8=True), hashes.SHA256()),
        (KeyOptions(rsa_key_size=3072), hashes.SHA256()),
        (KeyOptions(ecc_signature_algorithm="ECDSA"), hashes.SHA256()),
        (KeyOptions(ecc_signature_algorithm="ECDSA", pkcs8=True), hashes.SHA256()),
        (KeyOptions(ecc_signature_algorithm="ECDSA", ecc_curve="P384"), hashes.SHA384()),
    ],
    ids=["rsa", "rsa-pkcs8", "rsa-3072", "p256", "p256-pkcs8", "p384"],
)
def test_request_info_is_byte_for_byte_the_previous_one(
    options: KeyOptions, digest: hashes.HashAlgorithm
) -> None:
    hosts = "spiffe://td/ns/a/sa/b,10.1.2.3,::ffff:192.0.2.7,2001:db8::1,app.example.com"
    csr_pem, key_pem = generate_csr(hosts, options)
    csr, _ = check_csr(csr_pem, key_pem)
    assert csr.tbs_certrequest_bytes == cryptography_csr(hosts, key_pem, digest).tbs_certrequest_bytes
    assert type(csr.signature_hash_algorithm) is type(digest)
    if not options.ecc_signature_algorithm:  # RSA PKCS#1 v1.5 signatures are deterministic
        assert csr.signature == cryptography_csr(hosts, key_pem, digest).signature


@pytest.mark.parametrize("host", ["bücher.example", "spiffe://td/ns/ä/sa/b"])
def test_non_ascii_host_is_an_error(host: str) -> None:
    with pytest.raises(CsrError, match=rf"^invalid host {host!r} for the CSR: .*A-label"):
        generate_csr(host, KeyOptions(ecc_signature_algorithm="ECDSA"))


def test_rsa_key_too_large() -> None:
    with pytest.raises(
        CsrError, match=r"^requested key size exceeds the maximum size of \d+ \(requested: 100000\)$"
    ):
        generate_csr(SPIFFE, KeyOptions(rsa_key_size=100000))


def test_making_a_csr_loads_no_cryptography() -> None:
    import json
    import subprocess
    import sys

    probe = (
        "import json, sys\n"
        "from istio_agent.security.keys import KeyOptions, generate_csr\n"
        "import istio_agent.pem\n"
        "generate_csr('spiffe://td/ns/a/sa/b', KeyOptions())\n"
        "generate_csr('spiffe://td/ns/a/sa/b', KeyOptions(ecc_signature_algorithm='ECDSA'))\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'cryptography')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert json.loads(done.stdout) == []
