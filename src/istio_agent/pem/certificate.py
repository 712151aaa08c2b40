"""An X.509 certificate read from DER in Python: the facts the agent and agentctl use.

RFC 5280's structure, read strictly (:mod:`.der`). Like Go's ``crypto/x509`` (what Istio parses with)
it refuses a certificate whose inner and outer signature algorithms differ and one that repeats an
extension. Names compare as ``cryptography``'s do (attribute type and decoded value, RDN by RDN) and
print in its RFC 4514 form, which is what agentctl has always shown.
"""

from __future__ import annotations

import hashlib
import ipaddress
from dataclasses import dataclass, field
from datetime import datetime

from istio_agent.pem import der
from istio_agent.pem.der import DerError, Element

SUBJECT_ALT_NAME = "2.5.29.17"
BASIC_CONSTRAINTS = "2.5.29.19"

_SHORT_NAMES = {
    "2.5.4.3": "CN",
    "2.5.4.7": "L",
    "2.5.4.8": "ST",
    "2.5.4.10": "O",
    "2.5.4.11": "OU",
    "2.5.4.6": "C",
    "2.5.4.9": "STREET",
    "0.9.2342.19200300.100.1.25": "DC",
    "0.9.2342.19200300.100.1.1": "UID",
}
"""The attribute types RFC 4514 strings name by keyword; the others appear as dotted OIDs."""

_CODECS = {
    der.UTF8_STRING: "utf-8",
    der.PRINTABLE_STRING: "ascii",
    der.IA5_STRING: "ascii",
    0x12: "ascii",  # NumericString
    0x1A: "ascii",  # VisibleString
    0x14: "latin-1",  # T61String
    0x1E: "utf-16-be",  # BMPString
    0x1C: "utf-32-be",  # UniversalString
}

_ESCAPES = {
    "\\": "\\\\",
    '"': '\\"',
    "+": "\\+",
    ",": "\\,",
    ";": "\\;",
    "<": "\\<",
    ">": "\\>",
    "\0": "\\00",
}


def _escape(value: str | bytes) -> str:
    """An RFC 4514 attribute value: special characters escaped, bytes as ``#`` and hex."""
    if isinstance(value, bytes):
        return "#" + value.hex() if value else ""
    if not value:
        return ""
    text = "".join(_ESCAPES.get(char, char) for char in value)
    if text[0] == "#" or (text[0] == " " and len(text) > 1):
        text = "\\" + text
    if text[-1] == " ":
        text = text[:-1] + "\\ "
    return text


Attribute = tuple[str, str | bytes]
"""An attribute type (dotted OID) and its value (text, or bytes for a BIT STRING)."""


@dataclass(frozen=True)
class Name:
    """A distinguished name: its RDNs in encoded order, each a tuple of attributes."""

    rdns: tuple[tuple[Attribute, ...], ...]
    encoding: bytes = field(compare=False, repr=False)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Name):
            return NotImplemented
        return [frozenset(rdn) for rdn in self.rdns] == [frozenset(rdn) for rdn in other.rdns]

    def __hash__(self) -> int:
        return hash(tuple(frozenset(rdn) for rdn in self.rdns))

    def __len__(self) -> int:
        """The number of attributes (an empty name has none)."""
        return sum(len(rdn) for rdn in self.rdns)

    def rfc4514_string(self) -> str:
        """``CN=leaf,O=Example`` (last RDN first, ``+`` inside a multi-valued RDN)."""
        return ",".join(
            "+".join(f"{_SHORT_NAMES.get(oid, oid)}={_escape(value)}" for oid, value in rdn)
            for rdn in reversed(self.rdns)
        )


@dataclass(frozen=True)
class Extension:
    oid: str
    critical: bool
    value: bytes
    """The contents of extnValue's OCTET STRING (the extension's own DER)."""


@dataclass(frozen=True)
class SubjectAltNames:
    uris: tuple[str, ...] = ()
    dns_names: tuple[str, ...] = ()
    ip_addresses: tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, ...] = ()


@dataclass(frozen=True, eq=False)
class Certificate:
    """A parsed certificate; equal to another when their DER is the same."""

    der: bytes
    tbs: bytes
    """The DER of TBSCertificate: what the signature covers."""
    version: int
    """0 for v1, 2 for v3 (the encoded value, as in the certificate)."""
    serial_number: int
    signature_algorithm: Element
    """The outer AlgorithmIdentifier SEQUENCE (its OID and parameters decide how to verify)."""
    signature: bytes
    issuer: Name
    subject: Name
    not_valid_before_utc: datetime
    not_valid_after_utc: datetime
    spki: bytes
    """The DER of SubjectPublicKeyInfo (what ``i2d_PUBKEY`` writes for the same key)."""
    extensions: tuple[Extension, ...]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Certificate) and other.der == self.der

    def __hash__(self) -> int:
        return hash(self.der)

    @property
    def signature_algorithm_oid(self) -> str:
        return der.object_identifier(self.signature_algorithm.reader().read(der.OID))

    @property
    def sha256_fingerprint(self) -> str:
        return hashlib.sha256(self.der).hexdigest()

    def extension(self, oid: str) -> Extension | None:
        return next((e for e in self.extensions if e.oid == oid), None)

    def subject_alt_names(self) -> SubjectAltNames:
        """The URI, DNS and IP entries of subjectAltName (empty without one); DerError when malformed."""
        extension = self.extension(SUBJECT_ALT_NAME)
        return SubjectAltNames() if extension is None else _general_names(extension.value)

    def is_ca(self) -> bool:
        """BasicConstraints' cA flag (False without the extension); DerError when malformed."""
        extension = self.extension(BASIC_CONSTRAINTS)
        if extension is None:
            return False
        body = der.read_one(extension.value, der.SEQUENCE, "basicConstraints").reader()
        flag = body.optional(der.BOOLEAN, "basicConstraints cA")
        if flag is not None and not der.boolean(flag, "basicConstraints cA"):
            raise DerError("basicConstraints cA: FALSE is the default and must be omitted in DER")
        length = body.optional(der.INTEGER, "basicConstraints pathLenConstraint")
        if length is not None and der.integer(length, "basicConstraints pathLenConstraint") < 0:
            raise DerError("basicConstraints pathLenConstraint: negative")
        body.end("basicConstraints")
        return flag is not None


def _ia5(element: Element, what: str) -> str:
    try:
        return element.content.decode("ascii")
    except UnicodeDecodeError:
        raise DerError(f"{what}: not an IA5String (non-ASCII byte)") from None


def _general_names(value: bytes) -> SubjectAltNames:
    names = der.read_one(value, der.SEQUENCE, "subjectAltName").reader()
    uris: list[str] = []
    dns: list[str] = []
    ips: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    while not names.at_end():
        name = names.read(what="subjectAltName entry")
        if name.tag == der.context(6):
            uris.append(_ia5(name, "subjectAltName URI"))
        elif name.tag == der.context(2):
            dns.append(_ia5(name, "subjectAltName DNS name"))
        elif name.tag == der.context(7):
            if len(name.content) not in (4, 16):
                raise DerError(f"subjectAltName IP address: {len(name.content)} bytes")
            ips.append(ipaddress.ip_address(name.content))
        elif name.tag & 0xC0 != 0x80:
            raise DerError(f"subjectAltName entry: tag 0x{name.tag:02x} is not a GeneralName")
    return SubjectAltNames(tuple(uris), tuple(dns), tuple(ips))


def _attribute_value(element: Element) -> str | bytes:
    if element.tag == der.BIT_STRING:
        return der.bit_string(element, "name attribute")
    codec = _CODECS.get(element.tag)
    if codec is None:
        raise DerError(f"name attribute: unsupported string type 0x{element.tag:02x}")
    try:
        return element.content.decode(codec)
    except UnicodeDecodeError:
        raise DerError(f"name attribute: invalid {codec} string") from None


def _name(element: Element, what: str) -> Name:
    rdns: list[tuple[Attribute, ...]] = []
    reader = element.reader()
    while not reader.at_end():
        rdn = reader.read(der.SET, f"{what} RDN").reader()
        attributes: list[Attribute] = []
        while not rdn.at_end():
            pair = rdn.read(der.SEQUENCE, f"{what} attribute").reader()
            oid = der.object_identifier(pair.read(der.OID, f"{what} attribute type"))
            attributes.append((oid, _attribute_value(pair.read(what=f"{what} attribute value"))))
            pair.end(f"{what} attribute")
        if not attributes:
            raise DerError(f"{what}: empty RDN")
        rdns.append(tuple(attributes))
    return Name(tuple(rdns), element.encoding)


def _extensions(element: Element | None) -> tuple[Extension, ...]:
    if element is None:
        return ()
    found: list[Extension] = []
    reader = der.read_one(element.content, der.SEQUENCE, "extensions").reader()
    while not reader.at_end():
        body = reader.read(der.SEQUENCE, "extension").reader()
        oid = der.object_identifier(body.read(der.OID, "extension id"))
        critical = body.optional(der.BOOLEAN, "extension critical")
        if critical is not None and not der.boolean(critical, "extension critical"):
            raise DerError("extension critical: FALSE is the default and must be omitted in DER")
        value = body.read(der.OCTET_STRING, "extension value").content
        body.end("extension")
        if any(e.oid == oid for e in found):
            raise DerError(f"duplicate extension {oid}")
        found.append(Extension(oid, critical is not None, value))
    return tuple(found)


def parse(data: bytes) -> Certificate:
    """The certificate whose DER is ``data``; DerError with the reason when it is not one."""
    outer = der.read_one(data, der.SEQUENCE, "certificate").reader()
    tbs_element = outer.read(der.SEQUENCE, "tbsCertificate")
    algorithm = outer.read(der.SEQUENCE, "signatureAlgorithm")
    signature = der.bit_string(outer.read(der.BIT_STRING, "signatureValue"), "signatureValue")
    outer.end("certificate")

    tbs = tbs_element.reader()
    version = 0
    if (explicit := tbs.optional(der.context(0, constructed=True), "version")) is not None:
        version = der.integer(der.read_one(explicit.content, der.INTEGER, "version"), "version")
        if version not in (0, 1, 2):
            raise DerError(f"{version} is not a valid X509 version")
    serial = der.integer(tbs.read(der.INTEGER, "serialNumber"), "serialNumber")
    inner_algorithm = tbs.read(der.SEQUENCE, "signature")
    if inner_algorithm.encoding != algorithm.encoding:
        raise DerError("inner and outer signature algorithm identifiers don't match")
    issuer = _name(tbs.read(der.SEQUENCE, "issuer"), "issuer")
    validity = tbs.read(der.SEQUENCE, "validity").reader()
    not_before = der.time(validity.read(what="notBefore"), "notBefore")
    not_after = der.time(validity.read(what="notAfter"), "notAfter")
    validity.end("validity")
    subject = _name(tbs.read(der.SEQUENCE, "subject"), "subject")
    spki = tbs.read(der.SEQUENCE, "subjectPublicKeyInfo")
    tbs.optional(der.context(1), "issuerUniqueID")
    tbs.optional(der.context(2), "subjectUniqueID")
    extensions = _extensions(tbs.optional(der.context(3, constructed=True), "extensions"))
    tbs.end("tbsCertificate")
    return Certificate(
        der=data,
        tbs=tbs_element.encoding,
        version=version,
        serial_number=serial,
        signature_algorithm=algorithm,
        signature=signature,
        issuer=issuer,
        subject=subject,
        not_valid_before_utc=not_before,
        not_valid_after_utc=not_after,
        spki=spki.encoding,
        extensions=extensions,
    )
