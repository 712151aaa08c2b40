"""PEM and X.509 helpers for certificates coming from files and from the CA.

Pure functions, no I/O. PEM scanning follows Go's ``encoding/pem`` closely enough that the same
bundles keep the same certificates as in Istio: base64 is decoded strictly, a block that does not
decode is skipped and scanning resumes after it, and text outside blocks is ignored. Go also rejects
negative serial numbers, so we do too.

Certificates are read in Python (:mod:`.certificate`, over :mod:`.der`); key comparisons and
signature checks go through the libcrypto that Python's ``ssl`` already mapped
(:mod:`.libcrypto`, :mod:`.signature`): the agent loads no ``cryptography`` (issue 23, idle memory).
"""

from __future__ import annotations

import binascii
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from istio_agent.log import scope
from istio_agent.pem import certificate, libcrypto, signature
from istio_agent.pem.certificate import Certificate, Name
from istio_agent.pem.der import DerError

CERTIFICATE = "CERTIFICATE"

_BEGIN = re.compile(rb"^-----BEGIN ([^\r\n-]*)-----(?=[ \t]*\r?$)", re.MULTILINE)
_WHITESPACE = re.compile(rb"[ \t\r\n]+")
# Padded standard base64, as Go's decoder requires (Python's strict mode still allows extra "=").
_BASE64 = re.compile(rb"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?")


class PemError(ValueError):
    """A PEM / X.509 input was rejected; the message is the reason (never contains key material)."""


@dataclass(frozen=True)
class _Block:
    label: str
    text: bytes
    """From ``-----BEGIN`` to the end of the ``-----END ...-----`` marker, as in the input."""
    der: bytes | None
    """The decoded body, or None when it is not strict base64."""


def _scan(data: bytes) -> Iterator[_Block]:
    """Every BEGIN/END-delimited PEM block of ``data``, in order; text around the blocks is ignored.

    A BEGIN line without its END (or with another BEGIN before its END) is garbage: scanning resumes
    right after it, as Go does for a block it rejected.
    """
    pos = 0
    while (begin := _BEGIN.search(data, pos)) is not None:
        label = begin.group(1)
        end_marker = re.compile(rb"^-----END " + re.escape(label) + rb"-----(?=[ \t]*\r?$)", re.MULTILINE)
        end = end_marker.search(data, begin.end())
        if end is None or _BEGIN.search(data, begin.end(), end.start()) is not None:
            pos = begin.end()
            continue
        yield _Block(
            label=label.decode("ascii", "replace"),
            text=data[begin.start() : end.end()],
            der=_decode_body(data[begin.end() : end.start()]),
        )
        pos = end.end()


def _decode_body(body: bytes) -> bytes | None:
    """Strict base64 of a PEM body, skipping RFC 1421 ``Key: value`` headers (ended by a blank line)."""
    lines = body.splitlines()
    while lines and not lines[0].strip():
        lines.pop(0)
    if lines and b":" in lines[0]:
        try:
            blank = next(i for i, line in enumerate(lines) if not line.strip())
        except StopIteration:
            return None
        lines = lines[blank + 1 :]
    b64 = _WHITESPACE.sub(b"", b"".join(lines))
    if not _BASE64.fullmatch(b64):
        return None
    return binascii.a2b_base64(b64)


def encode_pem(der: bytes, label: str = CERTIFICATE) -> bytes:
    """Canonical PEM: 64-column base64, no headers, trailing newline."""
    b64 = binascii.b2a_base64(der, newline=False)
    lines = [b64[i : i + 64] for i in range(0, len(b64), 64)]
    head, tail = f"-----BEGIN {label}-----\n".encode(), f"-----END {label}-----\n".encode()
    return head + b"".join(line + b"\n" for line in lines) + tail


def _load_der(der: bytes) -> Certificate:
    try:
        cert = certificate.parse(der)
    except DerError as e:
        raise PemError(f"failed to parse X.509 certificate: {e}") from None
    if cert.serial_number < 0:  # Go refuses them (RFC 5280 wants positive serials)
        raise PemError("failed to parse X.509 certificate: negative serial number")
    return cert


def _as_bytes(data: bytes | str) -> bytes:
    return data.encode() if isinstance(data, str) else data


def split_pem_blocks(data: bytes) -> list[bytes]:
    """The CERTIFICATE blocks of a bundle, BEGIN to END marker, body text exactly as in the input."""
    return [block.text for block in _scan(data) if block.label == CERTIFICATE]


def parse_certificate(pem: bytes | str) -> Certificate:
    """The first CERTIFICATE block of ``pem`` as an X.509 certificate.

    Other PEM types before it (e.g. a key) are skipped, but a first certificate block that is not
    valid base64 is an error: a corrupt leaf must not be silently replaced by the next certificate.
    """
    for block in _scan(_as_bytes(pem)):
        if block.label != CERTIFICATE:
            continue
        if block.der is None:
            break
        return _load_der(block.der)
    raise PemError("invalid PEM encoded certificate")


def parse_root_bundle(data: bytes, source: str) -> bytes:
    """The valid certificates of a root bundle file, re-encoded as canonical PEM and concatenated.

    Blocks that do not decode or are not X.509 certificates are dropped (the reason is logged), so
    one bad certificate in an OS or mounted bundle does not take the others down with it.
    """
    log = scope("cache")
    certs: list[bytes] = []
    errors: list[str] = []
    for index, block in enumerate(_scan(data)):
        if block.label != CERTIFICATE:
            reason = f"block {index} is a {block.label!r} PEM block, not a CERTIFICATE"
        elif block.der is None:
            reason = f"block {index}: invalid PEM encoded certificate (bad base64)"
        else:
            try:
                _load_der(block.der)
            except PemError as e:
                reason = f"block {index}: {e}"
            else:
                certs.append(encode_pem(block.der))
                continue
        errors.append(reason)
        log.warning("ignoring root certificate from %s: %s", source, reason)
    if not certs:
        if not data.strip():
            detail = "file is empty"
        else:
            detail = "; ".join(errors) if errors else "no PEM encoded certificate found"
        raise PemError(f"failed to parse root certs from file {source}: {detail}")
    return b"".join(certs)


def concat_certs(certs: Sequence[str]) -> bytes:
    """The CA's chain elements joined as Istio does: a newline between elements lacking one."""
    out: list[str] = []
    for cert in certs:
        if out and not out[-1].endswith("\n"):
            out.append("\n")
        out.append(cert)
    return "".join(out).encode()


def merge_root_bundles(*bundles: bytes) -> bytes:
    """The union of root bundles: certificates de-duplicated, sorted, joined by one newline.

    Istio sorts and de-duplicates the text of each block; we do the same on canonical PEM (which
    equals the block text for well-formed input) so that the same certificate formatted differently
    is still a duplicate. Blocks that do not decode are dropped: Envoy would reject the whole bundle.
    """
    unique: set[bytes] = set()
    for bundle in bundles:
        for block in _scan(bundle):
            if block.label != CERTIFICATE:
                continue
            if block.der is None:
                scope("cache").warning("dropping a trust bundle certificate that is not valid PEM")
                continue
            unique.add(encode_pem(block.der).strip(b"\n"))
    return b"\n".join(sorted(unique))


def leaf_not_after(chain_pem: bytes | str) -> datetime:
    """Expiry (UTC) of the first certificate of a chain."""
    return parse_certificate(chain_pem).not_valid_after_utc


def certificate_identities(cert: Certificate) -> list[str]:
    """The URI SANs of a certificate (SPIFFE identities); [] when it has no SAN extension."""
    try:
        return list(cert.subject_alt_names().uris)
    except DerError as e:
        raise PemError(f"failed to read the certificate's subject alternative names: {e}") from None


def parse_certificates(data: bytes | str) -> list[Certificate]:
    """Every CERTIFICATE block of a chain or bundle, in order; PemError when one does not parse or none is there."""
    certs = []
    for index, block in enumerate(b for b in _scan(_as_bytes(data)) if b.label == CERTIFICATE):
        if block.der is None:
            raise PemError(f"certificate {index}: invalid PEM encoded certificate (bad base64)")
        try:
            certs.append(_load_der(block.der))
        except PemError as e:
            raise PemError(f"certificate {index}: {e}") from None
    if not certs:
        raise PemError("no PEM encoded certificate found")
    return certs


@dataclass(frozen=True)
class CertificateSummary:
    """What operators compare about a certificate: never key material, only public facts and a fingerprint."""

    serial_number: str
    """Lowercase hex without padding, as Go's ``%x`` of the serial (istioctl's SERIAL NUMBER)."""
    subject: str
    issuer: str
    not_before: datetime
    not_after: datetime
    is_ca: bool
    uris: tuple[str, ...]
    dns_names: tuple[str, ...]
    sha256: str
    """Hex SHA-256 of the DER encoding (the certificate's fingerprint)."""

    @classmethod
    def of(cls, cert: Certificate) -> CertificateSummary:
        try:
            is_ca = cert.is_ca()
        except DerError:
            is_ca = False
        try:
            sans = cert.subject_alt_names()
            uris, dns_names = sans.uris, sans.dns_names
        except DerError:
            uris, dns_names = (), ()
        return cls(
            serial_number=format(cert.serial_number, "x"),
            subject=cert.subject.rfc4514_string(),
            issuer=cert.issuer.rfc4514_string(),
            not_before=cert.not_valid_before_utc,
            not_after=cert.not_valid_after_utc,
            is_ca=is_ca,
            uris=uris,
            dns_names=dns_names,
            sha256=cert.sha256_fingerprint,
        )

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CertificateSummary:
        """The inverse of ``as_json`` (what ``/debug/secrets`` sends); missing fields are empty."""

        def moment(key: str) -> datetime:
            try:
                return datetime.strptime(str(data.get(key, "")), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
            except ValueError:
                return datetime.min.replace(tzinfo=UTC)

        return cls(
            serial_number=str(data.get("serial_number", "")),
            subject=str(data.get("subject", "")),
            issuer=str(data.get("issuer", "")),
            not_before=moment("not_before"),
            not_after=moment("not_after"),
            is_ca=bool(data.get("is_ca", False)),
            uris=tuple(str(u) for u in data.get("uris") or ()),
            dns_names=tuple(str(d) for d in data.get("dns_names") or ()),
            sha256=str(data.get("sha256", "")),
        )

    def as_json(self) -> dict[str, object]:
        return {
            "serial_number": self.serial_number,
            "subject": self.subject,
            "issuer": self.issuer,
            "not_before": rfc3339(self.not_before),
            "not_after": rfc3339(self.not_after),
            "is_ca": self.is_ca,
            "uris": list(self.uris),
            "dns_names": list(self.dns_names),
            "sha256": self.sha256,
        }


def rfc3339(moment: datetime) -> str:
    """Go's ``time.RFC3339`` of a UTC time: ``2023-05-16T01:32:52Z`` (istioctl's NOT AFTER / NOT BEFORE)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def chain_problem(chain: Sequence[Certificate], anchors: Sequence[Certificate], now: datetime) -> str | None:
    """Why ``chain`` (leaf first) does not lead to one of ``anchors``, or None when it does.

    Each step must be signed by its issuer (found in the rest of the chain, or among the anchors)
    and every certificate above the leaf must be valid at ``now`` (the leaf's own validity is
    reported separately). A certificate equal to an anchor ends the walk.
    """
    anchor_ders = {a.der for a in anchors}
    current, rest = chain[0], list(chain[1:])
    for _ in range(len(chain) + 1):
        if current is not chain[0] and current.der in anchor_ders:
            return None
        for anchor in anchors:
            if _issued_by(current, anchor):
                return None
        issuer = next((c for c in rest if _issued_by(current, c)), None)
        if issuer is None:
            return (
                f"no certificate of the trust bundle issued {_describe(current.subject)} "
                f"(its issuer is {_describe(current.issuer)})"
            )
        rest.remove(issuer)
        if not issuer.not_valid_before_utc <= now <= issuer.not_valid_after_utc:
            return f"issuer {_describe(issuer.subject)} is not valid now (not after {rfc3339(issuer.not_valid_after_utc)})"
        current = issuer
    return "the chain does not end at a certificate of the trust bundle"


def _issued_by(cert: Certificate, issuer: Certificate) -> bool:
    if cert.issuer != issuer.subject:
        return False
    try:
        return signature.signed_by(cert, issuer.spki)
    except (DerError, libcrypto.CryptoError):
        return False


def _private_key_spki(pem: bytes) -> bytes:
    """The SubjectPublicKeyInfo of the first ``... PRIVATE KEY`` block (PKCS#1, SEC1 or PKCS#8).

    Errors never echo the key.
    """
    block = next((b for b in _scan(pem) if b.label.endswith("PRIVATE KEY")), None)
    if block is None:
        raise PemError("failed to parse private key: no PEM PRIVATE KEY block found")
    if block.label == "ENCRYPTED PRIVATE KEY" or re.search(rb"^Proc-Type:[^\n]*ENCRYPTED", block.text, re.M):
        raise PemError("failed to parse private key: it is encrypted")
    if block.der is None:
        raise PemError(f"failed to parse private key: invalid {block.label} block")
    try:
        return libcrypto.public_key_der_of(block.der)
    except libcrypto.CryptoError:
        raise PemError(f"failed to parse private key: invalid {block.label} block") from None


def public_keys_match(private_key_pem: bytes, cert: Certificate) -> bool:
    """Whether the certificate was issued for this private key; PemError when either key is unreadable."""
    ours = _private_key_spki(private_key_pem)
    if cert.spki == ours:
        return True
    try:  # the same key may be encoded differently in the certificate: compare OpenSSL's encodings
        return libcrypto.normalized_public_key(cert.spki) == ours
    except libcrypto.CryptoError as e:
        raise PemError(f"unsupported public key in certificate: {e}") from None


def _describe(name: Name) -> str:
    return f"'{name.rfc4514_string()}'" if len(name) else "an empty name"


def validate_signed_chain(
    chain: Sequence[str], private_key_pem: bytes, expected_identity: str, now: datetime | None = None
) -> None:
    """Refuse a CA response that cannot serve as our workload certificate.

    Stricter than Istio (which only checks the length and that the leaf parses): the leaf must be
    for our key and our identity, unexpired, and issued by the next element, so a misconfigured CA
    is reported here instead of as TLS handshake failures later.
    """
    if len(chain) < 2:
        raise PemError(
            f"invalid empty CertChain: the CA returned {len(chain)} certificate(s), "
            "expected at least 2 (the signed certificate followed by its issuers)"
        )
    for index, element in enumerate(chain):
        try:
            parse_certificate(element)
        except PemError as e:
            raise PemError(
                f"element {index} of the certificate chain from CA is not a certificate: {e}"
            ) from None
    leaf = parse_certificate(chain[0])
    if not public_keys_match(private_key_pem, leaf):
        raise PemError("certificate from CA does not match our private key")
    identities = certificate_identities(leaf)
    if expected_identity not in identities:
        got = ", ".join(identities) if identities else "no URI SAN"
        raise PemError(f"certificate from CA is for {got}, expected {expected_identity}")
    now = now or datetime.now(UTC)
    if leaf.not_valid_after_utc <= now:
        raise PemError(f"certificate from CA already expired at {leaf.not_valid_after_utc.isoformat()}")
    # The next element may itself be a bundle (e.g. several roots during a root rotation).
    issuers = [block.der for block in _scan(chain[1].encode()) if block.label == CERTIFICATE and block.der]
    subjects = []
    for der in issuers:
        try:
            subjects.append(_load_der(der).subject)
        except PemError:
            continue
    if leaf.issuer not in subjects:
        raise PemError(
            f"certificate chain from CA is broken: the certificate is issued by {_describe(leaf.issuer)}, "
            f"but the next element of the chain has subject {_describe(parse_certificate(chain[1]).subject)}"
        )


def load_key_cert_pair(cert_pem: bytes, key_pem: bytes) -> None:
    """Check that a key/cert pair is usable together (the cert's leaf is for that key)."""
    try:
        cert = parse_certificate(cert_pem)
    except PemError as e:
        raise PemError(f"certificate: {e}") from None
    if not public_keys_match(key_pem, cert):
        raise PemError("private key does not match the public key of the certificate")
