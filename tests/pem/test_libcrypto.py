"""Keys, signatures and certificate signatures through libcrypto, checked with ``cryptography``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
from cryptography.x509.oid import NameOID

from istio_agent.pem import certificate, libcrypto, signature
from tests.pem.test_certificate import CORPUS, ders_of
from tests.security.certs import key_to_pem, new_key

SPKI = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def generate(kind: str) -> libcrypto.PrivateKey:
    if kind == "rsa":
        return libcrypto.PrivateKey.generate_rsa(2048)
    return libcrypto.PrivateKey.generate_ec({"ec": "P-256", "ec384": "P-384"}[kind])


@pytest.mark.parametrize("kind", ["rsa", "ec", "ec384"])
@pytest.mark.parametrize("pkcs8", [False, True])
def test_exported_keys_load_in_cryptography(kind: str, pkcs8: bool) -> None:
    with generate(kind) as key:
        pem = key.to_pem(pkcs8)
        spki = key.public_key_der()
    label = "PRIVATE KEY" if pkcs8 else {"rsa": "RSA PRIVATE KEY"}.get(kind, "EC PRIVATE KEY")
    assert pem.startswith(f"-----BEGIN {label}-----\n".encode()) and pem.endswith(
        f"-----END {label}-----\n".encode()
    )
    loaded = serialization.load_pem_private_key(pem, password=None)
    if kind == "rsa":
        assert isinstance(loaded, rsa.RSAPrivateKey) and loaded.key_size == 2048
        assert loaded.public_key().public_numbers().e == 65537
    else:
        assert isinstance(loaded, ec.EllipticCurvePrivateKey)
        assert loaded.curve.name == {"ec": "secp256r1", "ec384": "secp384r1"}[kind]
    assert loaded.public_key().public_bytes(*SPKI) == spki


def test_rsa_key_size() -> None:
    with libcrypto.PrivateKey.generate_rsa(3072) as key:
        loaded = serialization.load_pem_private_key(key.to_pem(True), password=None)
    assert isinstance(loaded, rsa.RSAPrivateKey) and loaded.key_size == 3072


def test_bad_parameters_raise_with_openssl_reasons() -> None:
    expected = r"^(setting the EC key parameters|generating a key) failed: .*invalid curve"
    with pytest.raises(libcrypto.CryptoError, match=expected):
        libcrypto.PrivateKey.generate_ec("P-999")
    with pytest.raises(libcrypto.CryptoError, match=r"^looking up digest NOPE failed"), generate("ec") as key:
        key.sign(b"x", "NOPE")


@pytest.mark.parametrize(("kind", "digest"), [("rsa", "SHA256"), ("ec", "SHA256"), ("ec384", "SHA384")])
def test_our_signatures_verify_in_cryptography(kind: str, digest: str) -> None:
    data = b"to be signed" * 100
    with generate(kind) as key:
        sig = key.sign(data, digest)
        public = serialization.load_der_public_key(key.public_key_der())
    algorithm = getattr(hashes, digest)()
    if isinstance(public, rsa.RSAPublicKey):
        public.verify(sig, data, padding.PKCS1v15(), algorithm)
        with pytest.raises(InvalidSignature):
            public.verify(sig, data + b"!", padding.PKCS1v15(), algorithm)
    else:
        assert isinstance(public, ec.EllipticCurvePublicKey)
        public.verify(sig, data, ec.ECDSA(algorithm))
        with pytest.raises(InvalidSignature):
            public.verify(sig, data + b"!", ec.ECDSA(algorithm))


@pytest.mark.parametrize(
    ("kind", "digest"),
    [("rsa", "SHA256"), ("rsa", "SHA384"), ("rsa", "SHA512"), ("ec", "SHA256"), ("ec384", "SHA384")],
)
def test_cryptography_signatures_verify_with_us(kind: str, digest: str) -> None:
    data = b"signed elsewhere"
    key = new_key(kind)
    algorithm = getattr(hashes, digest)()
    if isinstance(key, rsa.RSAPrivateKey):
        sig = key.sign(data, padding.PKCS1v15(), algorithm)
    else:
        sig = key.sign(data, ec.ECDSA(algorithm))
    spki = key.public_key().public_bytes(*SPKI)
    assert libcrypto.verify(spki, sig, data, digest)
    assert not libcrypto.verify(spki, sig, data + b"!", digest)
    assert not libcrypto.verify(spki, sig[:-1] + bytes([sig[-1] ^ 1]), data, digest)
    assert not libcrypto.verify(spki, b"\x00garbage", data, digest)
    other = new_key(kind).public_key().public_bytes(*SPKI)
    assert not libcrypto.verify(other, sig, data, digest)


def test_pss_and_ed25519_verify_with_us() -> None:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    sig = key.sign(b"d", padding.PSS(padding.MGF1(hashes.SHA256()), 32), hashes.SHA256())
    spki = key.public_key().public_bytes(*SPKI)
    assert libcrypto.verify(spki, sig, b"d", "SHA256", libcrypto.Pss("SHA256", 32))
    assert not libcrypto.verify(spki, sig, b"d", "SHA256", libcrypto.Pss("SHA256", 20))
    ed = ed25519.Ed25519PrivateKey.generate()
    assert libcrypto.verify(ed.public_key().public_bytes(*SPKI), ed.sign(b"d"), b"d", None)


def test_unreadable_public_key_is_an_error() -> None:
    with pytest.raises(libcrypto.CryptoError, match=r"^reading the public key failed: .+"):
        libcrypto.verify(b"\x30\x03\x02\x01\x00", b"sig", b"data", "SHA256")


@pytest.mark.parametrize(("kind", "pkcs8"), [("ec", False), ("ec", True), ("rsa", False), ("rsa", True)])
def test_private_keys_from_cryptography_are_read(kind: str, pkcs8: bool) -> None:
    key = new_key(kind)
    pem = key_to_pem(key, pkcs8)
    der = serialization.load_pem_private_key(pem, None).private_bytes(
        serialization.Encoding.DER,
        serialization.PrivateFormat.PKCS8 if pkcs8 else serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )
    assert libcrypto.public_key_der_of(der) == key.public_key().public_bytes(*SPKI)


def test_unreadable_private_key_is_an_error_without_the_key() -> None:
    with pytest.raises(libcrypto.CryptoError, match=r"^reading the private key failed: ") as info:
        libcrypto.public_key_der_of(b"secret-material")
    assert "secret" not in str(info.value)


# -- certificate signatures ------------------------------------------------------------------------


def self_signed(key, sign=None) -> bytes:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "s")])
    now = datetime.now(UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(7)
        .not_valid_before(now)
        .not_valid_after(now + timedelta(days=1))
    )
    cert = sign(builder) if sign else builder.sign(key, hashes.SHA256())
    return cert.public_bytes(serialization.Encoding.DER)


@pytest.mark.parametrize(
    "make",
    [
        lambda: self_signed(new_key("ec")),
        lambda: self_signed(new_key("rsa")),
        lambda: (k := new_key("ec384"), self_signed(k, lambda b: b.sign(k, hashes.SHA384())))[1],
        lambda: (
            k := new_key("rsa"),
            self_signed(
                k,
                lambda b: b.sign(
                    k, hashes.SHA512(), rsa_padding=padding.PSS(padding.MGF1(hashes.SHA512()), 64)
                ),
            ),
        )[1],
        lambda: (k := ed25519.Ed25519PrivateKey.generate(), self_signed(k, lambda b: b.sign(k, None)))[1],
        lambda: (k := new_key("ec"), self_signed(k, lambda b: b.sign(k, hashes.SHA3_256())))[1],
        lambda: (k := new_key("rsa"), self_signed(k, lambda b: b.sign(k, hashes.SHA224())))[1],
    ],
    ids=["ec", "rsa", "ec384-sha384", "rsa-pss", "ed25519", "ec-sha3-256", "rsa-sha224"],
)
def test_certificate_signatures(make) -> None:
    cert = certificate.parse(make())
    assert signature.signed_by(cert, cert.spki)
    for kind in (
        "ec",
        "rsa",
    ):  # another key, of the same type or not: False, or an error for a key type mismatch
        other = certificate.parse(self_signed(new_key(kind)))
        try:
            assert not signature.signed_by(cert, other.spki)
        except libcrypto.CryptoError as e:
            assert "failed" in str(e)


def test_sha1_signatures_are_not_verified() -> None:
    # cryptography will not make one: take an old root of the OS trust store.
    roots = (certificate.parse(d) for path in CORPUS for d in ders_of(path))
    cert = next(c for c in roots if c.signature_algorithm_oid == "1.2.840.113549.1.1.5")
    with pytest.raises(signature.UnsupportedAlgorithm, match=r"1\.2\.840\.113549\.1\.1\.5 is not supported"):
        signature.signed_by(cert, cert.spki)


def test_unsupported_signature_algorithm() -> None:
    from cryptography.hazmat.primitives.asymmetric import dsa

    key = dsa.generate_private_key(2048)
    cert = certificate.parse(self_signed(key))
    with pytest.raises(
        signature.UnsupportedAlgorithm, match=r"signature algorithm 2\.16\.840\.1\.101\.3\.4\.3\.2"
    ):
        signature.signed_by(cert, cert.spki)


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.name)
def test_self_signed_roots_verify_as_cryptography_verifies_them(path: Path) -> None:
    for data in ders_of(path):
        theirs_cert = x509.load_der_x509_certificate(data)
        try:
            theirs_cert.verify_directly_issued_by(theirs_cert)
            theirs = True
        except (ValueError, TypeError, InvalidSignature):
            theirs = False
        ours_cert = certificate.parse(data)
        try:
            ours = signature.signed_by(ours_cert, ours_cert.spki) and ours_cert.subject == ours_cert.issuer
        except libcrypto.CryptoError:
            ours = False
        assert ours == theirs


def test_importing_does_no_work() -> None:
    probe = textwrap.dedent(
        """
        import json, sys
        import istio_agent.pem.libcrypto as lc
        before = [lc._loaded is None, "_ssl" in sys.modules]
        with lc.PrivateKey.generate_ec("P-256") as key:
            key.public_key_der()
        print(json.dumps(before + [lc._loaded is not None, "ctypes.util" in sys.modules, "cryptography" in sys.modules]))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=30
    )
    assert json.loads(done.stdout) == [True, False, True, False, False]


def test_the_mapped_library_is_found(tmp_path: Path) -> None:
    assert Path(libcrypto.mapped_libcrypto()).name.startswith("libcrypto")
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libssl.so.3\n")
    with pytest.raises(libcrypto.CryptoError, match="no libcrypto"):
        libcrypto.mapped_libcrypto(str(maps))
