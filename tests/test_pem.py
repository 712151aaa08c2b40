from __future__ import annotations

import base64
import logging
from datetime import UTC, datetime, timedelta

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from istio_agent.pem import (
    Certificate,
    CertificateSummary,
    PemError,
    certificate_identities,
    chain_problem,
    concat_certs,
    leaf_not_after,
    load_key_cert_pair,
    merge_root_bundles,
    parse_certificate,
    parse_root_bundle,
    public_keys_match,
    split_pem_blocks,
    validate_signed_chain,
)
from tests.security.certs import issue, key_to_pem, make_ca, new_key, pem_block, to_pem, with_negative_serial

SPIFFE = "spiffe://cluster.local/ns/default/sa/app"


def ours(cert: x509.Certificate) -> Certificate:
    """The same certificate as our reader gives it."""
    return parse_certificate(to_pem(cert))


def reformat(pem: bytes, width: int = 76, newline: bytes = b"\r\n") -> bytes:
    """The same certificate with a different (still valid) PEM layout."""
    der = x509.load_pem_x509_certificate(pem).public_bytes(Encoding.DER)
    b64 = base64.b64encode(der)
    lines = [b64[i : i + width] for i in range(0, len(b64), width)]
    return newline.join([b"-----BEGIN CERTIFICATE-----", *lines, b"-----END CERTIFICATE-----", b""])


@pytest.fixture(scope="module")
def ca():
    return make_ca("root")


@pytest.fixture(scope="module")
def certs(ca):
    """Three distinct valid certificates (PEM)."""
    ca_key, ca_cert = ca
    return [to_pem(ca_cert)] + [
        to_pem(issue(ca_key, ca_cert, uri_sans=[f"spiffe://td/ns/n/sa/{i}"])) for i in (1, 2)
    ]


# -- split_pem_blocks ------------------------------------------------------------------------------


def test_split_empty() -> None:
    assert split_pem_blocks(b"") == []
    assert split_pem_blocks(b"no pem here\n") == []


def test_split_keeps_block_text_and_ignores_garbage(certs: list[bytes]) -> None:
    odd = reformat(certs[1])
    data = b"# comment\n" + certs[0] + b"between\n" + odd + certs[2] + b"trailing garbage -----BEGIN nothing"
    assert split_pem_blocks(data) == [certs[0].rstrip(b"\n"), odd.rstrip(b"\r\n"), certs[2].rstrip(b"\n")]


def test_split_ignores_other_types_and_unterminated_blocks(certs: list[bytes]) -> None:
    key = key_to_pem(new_key())
    unterminated = b"-----BEGIN CERTIFICATE-----\nMIIB\n"
    assert split_pem_blocks(key + unterminated + certs[0]) == [certs[0].rstrip(b"\n")]
    assert split_pem_blocks(certs[0] + unterminated) == [certs[0].rstrip(b"\n")]


# -- parse_certificate -----------------------------------------------------------------------------


def test_parse_certificate(certs: list[bytes]) -> None:
    cert = parse_certificate(certs[1])
    assert certificate_identities(cert) == ["spiffe://td/ns/n/sa/1"]
    assert parse_certificate(certs[1] + certs[2]) == cert  # the first block wins
    assert parse_certificate(certs[1] + b"\n\n") == cert  # trailing newlines tolerated
    assert parse_certificate(certs[1].decode()) == cert  # chain elements are str
    assert parse_certificate(reformat(certs[1])) == cert


def test_parse_certificate_skips_non_certificate_blocks(certs: list[bytes]) -> None:
    assert parse_certificate(key_to_pem(new_key()) + certs[0]) == parse_certificate(certs[0])


def test_parse_certificate_with_pem_headers(certs: list[bytes]) -> None:
    lines = certs[0].split(b"\n")
    with_headers = b"\n".join([lines[0], b"Comment: hello", b"", *lines[1:]])
    assert parse_certificate(with_headers) == parse_certificate(certs[0])


@pytest.mark.parametrize("data", [b"", b"garbage", b"-----BEGIN CERTIFICATE-----\nMIIB\n"])
def test_parse_certificate_no_pem(data: bytes) -> None:
    with pytest.raises(PemError, match=r"^invalid PEM encoded certificate$"):
        parse_certificate(data)


def test_parse_certificate_strict_base64(certs: list[bytes]) -> None:
    lines = certs[0].split(b"\n")
    lines[2] = lines[2][:10] + b"-" + lines[2][11:]
    with pytest.raises(PemError, match=r"^invalid PEM encoded certificate$"):
        parse_certificate(b"\n".join(lines))
    for padding in (b"=", b"===="):  # extra padding, which Python's strict mode would still accept
        with pytest.raises(PemError, match=r"^invalid PEM encoded certificate$"):
            parse_certificate(certs[0].replace(b"\n-----END", padding + b"\n-----END"))


def test_parse_certificate_not_x509() -> None:
    with pytest.raises(PemError, match=r"^failed to parse X.509 certificate: "):
        parse_certificate(pem_block(b"\x30\x03\x02\x01\x05"))


def test_parse_certificate_negative_serial(ca) -> None:
    with pytest.raises(PemError, match=r"failed to parse X.509 certificate: negative serial number"):
        parse_certificate(with_negative_serial(ca[1]))


# -- parse_root_bundle -----------------------------------------------------------------------------


def test_root_bundle_keeps_valid_certs(ca, certs: list[bytes], caplog: pytest.LogCaptureFixture) -> None:
    negative = with_negative_serial(issue(*ca))
    not_x509 = pem_block(b"\x30\x03\x02\x01\x05")
    data = certs[0] + negative + certs[1] + not_x509 + certs[2]
    with caplog.at_level(logging.WARNING, logger="istio.cache"):
        out = parse_root_bundle(data, "roots.pem")
    assert out == b"".join(certs)
    reasons = [r.getMessage() for r in caplog.records if r.name == "istio.cache"]
    assert len(reasons) == 2
    assert "negative serial number" in reasons[0] and "roots.pem" in reasons[0]
    assert "failed to parse X.509 certificate" in reasons[1]


def test_root_bundle_stray_dash_in_base64(certs: list[bytes]) -> None:
    broken = certs[1].split(b"\n")
    broken[3] = b"-" + broken[3][1:]
    assert parse_root_bundle(certs[0] + b"\n".join(broken), "invalidpem.pem") == certs[0]


def test_root_bundle_block_after_unterminated_block_is_kept(certs: list[bytes]) -> None:
    assert parse_root_bundle(b"-----BEGIN CERTIFICATE-----\nMIIB\n" + certs[0], "f") == certs[0]


def test_root_bundle_is_canonical_pem(certs: list[bytes]) -> None:
    assert parse_root_bundle(b"junk\n" + reformat(certs[0]) + b"junk", "f") == certs[0]


def test_root_bundle_drops_private_keys_without_logging_them(
    certs: list[bytes], caplog: pytest.LogCaptureFixture
) -> None:
    key = key_to_pem(new_key())
    with caplog.at_level(logging.WARNING, logger="istio.cache"):
        assert parse_root_bundle(key + certs[0], "f") == certs[0]
    body = key.split(b"\n")[1].decode()
    assert "EC PRIVATE KEY" in caplog.text
    assert body not in caplog.text


@pytest.mark.parametrize("data", [b"", b"\n \n"])
def test_root_bundle_empty_file(data: bytes) -> None:
    with pytest.raises(PemError, match=r"^failed to parse root certs from file /x/root.pem: file is empty$"):
        parse_root_bundle(data, "/x/root.pem")


def test_root_bundle_without_valid_certs(ca) -> None:
    with pytest.raises(PemError, match=r"no PEM encoded certificate found"):
        parse_root_bundle(b"not a pem file", "f")
    with pytest.raises(PemError, match=r"^failed to parse root certs from file f: .*negative serial number"):
        parse_root_bundle(with_negative_serial(ca[1]), "f")


# -- concat / merge --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("certs", "expected"),
    [([], b""), (["a"], b"a"), (["a", "b"], b"a\nb"), (["a\n", "b"], b"a\nb"), (["a", "b\n"], b"a\nb\n")],
)
def test_concat_certs(certs: list[str], expected: bytes) -> None:
    assert concat_certs(certs) == expected


def test_merge_dedupes_and_sorts(certs: list[bytes]) -> None:
    ordered = sorted(c.rstrip(b"\n") for c in certs)
    merged = merge_root_bundles(certs[2] + certs[0], certs[1] + certs[0], b"")
    assert merged == b"\n".join(ordered)
    assert not merged.endswith(b"\n")
    assert merge_root_bundles(merged, merged) == merged


def test_merge_single_bundle_loses_trailing_newline(certs: list[bytes]) -> None:
    assert merge_root_bundles(certs[0]) == certs[0].rstrip(b"\n")
    assert merge_root_bundles(b"") == b""


def test_merge_same_cert_formatted_differently_is_a_duplicate(certs: list[bytes]) -> None:
    assert merge_root_bundles(certs[0], reformat(certs[0])) == certs[0].rstrip(b"\n")


def test_merge_drops_undecodable_blocks(certs: list[bytes]) -> None:
    broken = b"-----BEGIN CERTIFICATE-----\nMI-B\n-----END CERTIFICATE-----\n"
    assert merge_root_bundles(broken + certs[0]) == certs[0].rstrip(b"\n")


# -- leaf / identity / keys ------------------------------------------------------------------------


def test_leaf_not_after(ca) -> None:
    expiry = datetime(2031, 5, 6, 7, 8, 9, tzinfo=UTC)
    leaf = issue(*ca, not_after=expiry)
    assert leaf_not_after(to_pem(leaf) + to_pem(ca[1])) == expiry
    assert leaf_not_after(to_pem(leaf)).tzinfo is not None
    with pytest.raises(PemError, match=r"invalid PEM encoded certificate"):
        leaf_not_after(b"nothing")


def test_certificate_identities(ca) -> None:
    leaf = issue(*ca, uri_sans=[SPIFFE, "spiffe://x/y"], dns_sans=["app.example.com"])
    assert certificate_identities(ours(leaf)) == [SPIFFE, "spiffe://x/y"]
    assert certificate_identities(ours(ca[1])) == []


@pytest.mark.parametrize(("kind", "pkcs8"), [("ec", False), ("ec", True), ("rsa", False), ("rsa", True)])
def test_public_keys_match(ca, kind: str, pkcs8: bool) -> None:
    key = new_key(kind)
    leaf = ours(issue(*ca, public_key=key.public_key()))
    assert public_keys_match(key_to_pem(key, pkcs8), leaf)
    assert not public_keys_match(key_to_pem(new_key(kind), pkcs8), leaf)


def test_public_keys_match_bad_key_never_echoes_it(ca) -> None:
    with pytest.raises(PemError, match=r"no PEM PRIVATE KEY block found"):
        public_keys_match(b"secret-material", ours(ca[1]))
    broken = b"-----BEGIN PRIVATE KEY-----\nc2VjcmV0LW1hdGVyaWFs\n-----END PRIVATE KEY-----\n"
    with pytest.raises(PemError, match=r"failed to parse private key") as info:
        public_keys_match(broken, ours(ca[1]))
    assert "c2VjcmV0" not in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__


# -- validate_signed_chain ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def signed(ca):
    """(key_pem, leaf_pem, root_pem) of a good CA response."""
    key = new_key()
    leaf = issue(*ca, uri_sans=[SPIFFE], public_key=key.public_key())
    return key_to_pem(key), to_pem(leaf).decode(), to_pem(ca[1]).decode()


def test_validate_accepts_leaf_and_root(signed) -> None:
    key_pem, leaf, root = signed
    validate_signed_chain([leaf, root], key_pem, SPIFFE)


def test_validate_accepts_intermediates_and_root_bundles(ca) -> None:
    other_root = make_ca("other-root")[1]
    inter_key, inter = make_ca("intermediate", parent=ca)
    key = new_key("rsa")
    leaf = issue(inter_key, inter, uri_sans=[SPIFFE], public_key=key.public_key())
    chain = [to_pem(leaf).decode(), to_pem(inter).decode(), to_pem(ca[1]).decode()]
    validate_signed_chain(chain, key_to_pem(key, pkcs8=True), SPIFFE)
    # Root bundle as the next element, our issuer not first in it (root rotation).
    leaf2 = issue(*ca, uri_sans=[SPIFFE], public_key=key.public_key())
    bundle = (to_pem(other_root) + to_pem(ca[1])).decode()
    validate_signed_chain([to_pem(leaf2).decode(), bundle], key_to_pem(key), SPIFFE)


@pytest.mark.parametrize("count", [0, 1])
def test_validate_refuses_short_chain(signed, count: int) -> None:
    key_pem, leaf, root = signed
    with pytest.raises(PemError, match=rf"^invalid empty CertChain: the CA returned {count} certificate"):
        validate_signed_chain([leaf, root][:count], key_pem, SPIFFE)


@pytest.mark.parametrize("index", [0, 1])
def test_validate_refuses_non_certificates(signed, index: int) -> None:
    key_pem, leaf, root = signed
    chain = [leaf, root]
    chain[index] = "not a certificate"
    with pytest.raises(
        PemError, match=rf"^element {index} of the certificate chain from CA is not a certificate"
    ):
        validate_signed_chain(chain, key_pem, SPIFFE)


def test_validate_refuses_other_key(signed) -> None:
    _, leaf, root = signed
    with pytest.raises(PemError, match=r"^certificate from CA does not match our private key$"):
        validate_signed_chain([leaf, root], key_to_pem(new_key()), SPIFFE)


def test_validate_refuses_other_identity(ca, signed) -> None:
    key_pem, leaf, root = signed
    with pytest.raises(
        PemError, match=rf"^certificate from CA is for {SPIFFE}, expected spiffe://td/ns/x/sa/y$"
    ):
        validate_signed_chain([leaf, root], key_pem, "spiffe://td/ns/x/sa/y")
    key = new_key()
    no_san = to_pem(issue(*ca, public_key=key.public_key())).decode()
    with pytest.raises(PemError, match=rf"^certificate from CA is for no URI SAN, expected {SPIFFE}$"):
        validate_signed_chain([no_san, root], key_to_pem(key), SPIFFE)


def test_validate_refuses_expired_leaf(ca, signed) -> None:
    key_pem, leaf, root = signed
    later = parse_certificate(leaf).not_valid_after_utc + timedelta(seconds=1)
    with pytest.raises(PemError, match=r"^certificate from CA already expired at "):
        validate_signed_chain([leaf, root], key_pem, SPIFFE, now=later)
    key = new_key()
    now = datetime.now(UTC)
    expired = issue(
        *ca,
        uri_sans=[SPIFFE],
        public_key=key.public_key(),
        not_before=now - timedelta(hours=2),
        not_after=now - timedelta(hours=1),
    )
    with pytest.raises(PemError, match=r"already expired"):
        validate_signed_chain([to_pem(expired).decode(), root], key_to_pem(key), SPIFFE)


def test_validate_refuses_broken_chain(signed) -> None:
    key_pem, leaf, _ = signed
    stranger = to_pem(make_ca("stranger")[1]).decode()
    with pytest.raises(
        PemError,
        match=r"^certificate chain from CA is broken: the certificate is issued by 'CN=root'.*'CN=stranger'",
    ):
        validate_signed_chain([leaf, stranger], key_pem, SPIFFE)


# -- load_key_cert_pair ----------------------------------------------------------------------------


def test_load_key_cert_pair(ca, signed) -> None:
    key_pem, leaf, root = signed
    load_key_cert_pair((leaf + root).encode(), key_pem)
    with pytest.raises(PemError, match=r"private key does not match"):
        load_key_cert_pair(leaf.encode(), key_to_pem(new_key()))
    with pytest.raises(PemError, match=r"^certificate: invalid PEM encoded certificate$"):
        load_key_cert_pair(b"", key_pem)
    with pytest.raises(PemError, match=r"failed to parse private key"):
        load_key_cert_pair(leaf.encode(), b"")


# -- chain_problem ---------------------------------------------------------------------------------


def test_chain_problem_accepts_chains_to_an_anchor(ca) -> None:
    inter_key, inter = make_ca("intermediate", parent=ca)
    leaf = issue(inter_key, inter, uri_sans=[SPIFFE])
    now = datetime.now(UTC)
    assert chain_problem([ours(leaf), ours(inter)], [ours(ca[1])], now) is None
    assert chain_problem([ours(leaf), ours(inter), ours(ca[1])], [ours(ca[1])], now) is None
    assert chain_problem([ours(leaf)], [ours(inter)], now) is None


def test_chain_problem_with_rsa_keys() -> None:
    from cryptography.hazmat.primitives import hashes

    root_key = new_key("rsa")
    name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "rsa-root")])
    now = datetime.now(UTC)
    root = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(root_key.public_key())
        .serial_number(5)
        .not_valid_before(now - timedelta(hours=1))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(root_key, hashes.SHA384())
    )
    leaf = issue(root_key, root, uri_sans=[SPIFFE], public_key=new_key("rsa").public_key())
    assert chain_problem([ours(leaf)], [ours(root)], now) is None
    assert (
        chain_problem([ours(leaf)], [ours(make_ca("rsa-root")[1])], now) is not None
    )  # same name, other key


def test_chain_problem_reports_a_bad_signature_and_an_unknown_issuer(ca) -> None:
    now = datetime.now(UTC)
    leaf = to_pem(issue(*ca, uri_sans=[SPIFFE]))
    der = x509.load_pem_x509_certificate(leaf).public_bytes(Encoding.DER)
    tampered = parse_certificate(pem_block(der[:-3] + bytes([der[-3] ^ 0xFF]) + der[-2:]))
    assert chain_problem([tampered], [ours(ca[1])], now) == (
        "no certificate of the trust bundle issued an empty name (its issuer is 'CN=root')"
    )
    stranger = ours(make_ca("stranger")[1])
    assert "its issuer is 'CN=root'" in (chain_problem([parse_certificate(leaf)], [stranger], now) or "")


def test_chain_problem_reports_an_expired_issuer(ca) -> None:
    now = datetime.now(UTC)
    inter_key, inter = make_ca("old-intermediate", parent=ca, not_after=now + timedelta(hours=1))
    leaf = issue(inter_key, inter)
    later = now + timedelta(hours=2)
    problem = chain_problem([ours(leaf), ours(inter)], [ours(ca[1])], later)
    assert problem is not None and problem.startswith("issuer 'CN=old-intermediate' is not valid now")


# -- summaries -------------------------------------------------------------------------------------


def test_certificate_summary_matches_cryptography(ca) -> None:
    from cryptography.hazmat.primitives import hashes

    leaf = issue(*ca, uri_sans=[SPIFFE], dns_sans=["a.example.com"], common_name='leaf, "quoted"')
    summary = CertificateSummary.of(ours(leaf))
    assert summary.serial_number == format(leaf.serial_number, "x")
    assert summary.subject == leaf.subject.rfc4514_string() == 'CN=leaf\\, \\"quoted\\"'
    assert summary.issuer == "CN=root"
    assert (summary.not_before, summary.not_after) == (leaf.not_valid_before_utc, leaf.not_valid_after_utc)
    assert (summary.is_ca, summary.uris, summary.dns_names) == (False, (SPIFFE,), ("a.example.com",))
    assert summary.sha256 == leaf.fingerprint(hashes.SHA256()).hex()
    assert CertificateSummary.of(ours(ca[1])).is_ca


# -- private keys ----------------------------------------------------------------------------------


def test_encrypted_private_keys_are_refused_without_a_prompt(ca) -> None:
    from cryptography.hazmat.primitives import serialization

    key = new_key()
    pkcs8 = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"pw"),
    )
    assert pkcs8.startswith(b"-----BEGIN ENCRYPTED PRIVATE KEY-----")
    traditional = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.BestAvailableEncryption(b"pw"),
    )
    assert b"Proc-Type: 4,ENCRYPTED" in traditional
    for pem in (pkcs8, traditional):
        with pytest.raises(PemError, match=r"^failed to parse private key: it is encrypted$"):
            public_keys_match(pem, ours(ca[1]))
