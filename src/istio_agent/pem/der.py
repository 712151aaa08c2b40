"""Strict DER (X.690): read the TLVs of a certificate, write those of a CSR.

Only what X.509 needs: low tag numbers, definite minimal lengths, minimal INTEGERs and OIDs. Any
deviation raises :class:`DerError`; the reader never loops without consuming input, so garbage
ends in that error, never in a crash or a hang.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

BOOLEAN = 0x01
INTEGER = 0x02
BIT_STRING = 0x03
OCTET_STRING = 0x04
NULL = 0x05
OID = 0x06
UTF8_STRING = 0x0C
PRINTABLE_STRING = 0x13
IA5_STRING = 0x16
UTC_TIME = 0x17
GENERALIZED_TIME = 0x18
SEQUENCE = 0x30
SET = 0x31
MAX_LENGTH_OCTETS = 4
"""Longer length fields would announce more than 4 GiB: no certificate is that large."""


class DerError(ValueError):
    """The bytes are not the DER expected here; the message says what and where (never the data)."""


def context(number: int, constructed: bool = False) -> int:
    """The tag of ``[number]`` (IMPLICIT primitive, or constructed for EXPLICIT and SEQUENCEs)."""
    return 0x80 | (0x20 if constructed else 0) | number


@dataclass(frozen=True, slots=True)
class Element:
    """One TLV: its tag byte, its contents, and its whole encoding (for signatures and comparisons)."""

    tag: int
    content: bytes
    encoding: bytes

    def reader(self) -> Reader:
        """The elements inside a constructed element."""
        if not self.tag & 0x20:
            raise DerError(f"element with tag 0x{self.tag:02x} is not constructed")
        return Reader(self.content)


class Reader:
    """Consecutive TLVs of a buffer, read one by one."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._pos = 0

    def at_end(self) -> bool:
        return self._pos >= len(self._data)

    def peek_tag(self) -> int | None:
        return None if self.at_end() else self._data[self._pos]

    def read(self, expected: int | None = None, what: str = "element") -> Element:
        """The next element; DerError when there is none or its tag is not ``expected``."""
        data, start = self._data, self._pos
        if start >= len(data):
            raise DerError(f"{what}: missing (end of data)")
        tag = data[start]
        if tag & 0x1F == 0x1F:
            raise DerError(f"{what}: high tag numbers are not supported")
        if expected is not None and tag != expected:
            raise DerError(f"{what}: expected tag 0x{expected:02x}, got 0x{tag:02x}")
        if start + 1 >= len(data):
            raise DerError(f"{what}: truncated length")
        first = data[start + 1]
        pos = start + 2
        if first < 0x80:
            length = first
        else:
            count = first & 0x7F
            if count == 0:
                raise DerError(f"{what}: indefinite length is not DER")
            if count > MAX_LENGTH_OCTETS or pos + count > len(data):
                raise DerError(f"{what}: truncated or oversized length")
            length = int.from_bytes(data[pos : pos + count], "big")
            if data[pos] == 0 or length < 0x80:
                raise DerError(f"{what}: length is not minimally encoded")
            pos += count
        end = pos + length
        if end > len(data):
            raise DerError(f"{what}: truncated ({length} bytes announced, {len(data) - pos} left)")
        self._pos = end
        return Element(tag, data[pos:end], data[start:end])

    def optional(self, tag: int, what: str = "element") -> Element | None:
        """The next element if it has ``tag``, else None (nothing consumed)."""
        return self.read(tag, what) if self.peek_tag() == tag else None

    def end(self, what: str) -> None:
        if not self.at_end():
            raise DerError(f"{what}: unexpected data after its last element")


def read_one(data: bytes, expected: int, what: str) -> Element:
    """``data`` as exactly one element with tag ``expected`` (no trailing bytes)."""
    reader = Reader(data)
    element = reader.read(expected, what)
    reader.end(what)
    return element


def integer(element: Element, what: str = "INTEGER") -> int:
    content = element.content
    if not content:
        raise DerError(f"{what}: empty INTEGER")
    if len(content) > 1 and (
        (content[0] == 0x00 and content[1] < 0x80) or (content[0] == 0xFF and content[1] >= 0x80)
    ):
        raise DerError(f"{what}: INTEGER is not minimally encoded")
    return int.from_bytes(content, "big", signed=True)


def boolean(element: Element, what: str = "BOOLEAN") -> bool:
    if element.content not in (b"\x00", b"\xff"):
        raise DerError(f"{what}: BOOLEAN is not 0x00 or 0xff")
    return element.content == b"\xff"


def object_identifier(element: Element, what: str = "OBJECT IDENTIFIER") -> str:
    """Dotted form (``2.5.29.17``)."""
    content = element.content
    if not content or content[-1] & 0x80:
        raise DerError(f"{what}: truncated OBJECT IDENTIFIER")
    arcs: list[int] = []
    value = 0
    fresh = True
    for byte in content:
        if fresh and byte == 0x80:
            raise DerError(f"{what}: OBJECT IDENTIFIER arc is not minimally encoded")
        value = value << 7 | byte & 0x7F
        fresh = not byte & 0x80
        if fresh:
            arcs.append(value)
            value = 0
    first = min(arcs[0] // 40, 2)
    return ".".join(str(arc) for arc in (first, arcs[0] - 40 * first, *arcs[1:]))


def bit_string(element: Element, what: str = "BIT STRING") -> bytes:
    """The bytes of a BIT STRING that holds whole octets (signatures, public keys)."""
    content = element.content
    if not content:
        raise DerError(f"{what}: empty BIT STRING")
    if content[0] != 0:
        raise DerError(f"{what}: BIT STRING with unused bits")
    return content[1:]


def time(element: Element, what: str = "time") -> datetime:
    """UTCTime (``YYMMDDHHMMSSZ``, years 1950-2049) or GeneralizedTime (``YYYYMMDDHHMMSSZ``), as UTC."""
    text = element.content
    if element.tag == UTC_TIME and len(text) == 13:
        digits, century = text[:12], None
    elif element.tag == GENERALIZED_TIME and len(text) == 15:
        digits, century = text[2:14], int(text[:2]) if text[:2].isdigit() else -1
    else:
        raise DerError(f"{what}: not a DER UTCTime or GeneralizedTime")
    if not text.endswith(b"Z") or not digits.isdigit() or not digits.isascii() or century == -1:
        raise DerError(f"{what}: not a DER UTCTime or GeneralizedTime")
    year, month, day, hour, minute, second = (int(digits[i : i + 2]) for i in range(0, 12, 2))
    if century is None:
        year += 1900 if year >= 50 else 2000
    else:
        year += 100 * century
    try:
        return datetime(year, month, day, hour, minute, second, tzinfo=UTC)
    except ValueError as e:
        raise DerError(f"{what}: {e}") from None


# -- writing ---------------------------------------------------------------------------------------


def encode(tag: int, content: bytes) -> bytes:
    """One TLV with a minimal definite length."""
    length = len(content)
    if length < 0x80:
        return bytes((tag, length)) + content
    octets = length.to_bytes((length.bit_length() + 7) // 8, "big")
    return bytes((tag, 0x80 | len(octets))) + octets + content


def sequence(*elements: bytes) -> bytes:
    return encode(SEQUENCE, b"".join(elements))


def set_of(*elements: bytes) -> bytes:
    """A SET OF: DER orders its elements by their encodings."""
    return encode(SET, b"".join(sorted(elements)))


def encode_integer(value: int) -> bytes:
    magnitude = value if value >= 0 else ~value  # the bits besides the sign bit
    return encode(INTEGER, value.to_bytes(magnitude.bit_length() // 8 + 1, "big", signed=True))


def encode_oid(dotted: str) -> bytes:
    arcs = [int(arc) for arc in dotted.split(".")]
    out = bytearray()
    for arc in [40 * arcs[0] + arcs[1], *arcs[2:]]:
        chunk = [arc & 0x7F]
        arc >>= 7
        while arc:
            chunk.append(0x80 | arc & 0x7F)
            arc >>= 7
        out += bytes(reversed(chunk))
    return encode(OID, bytes(out))


def encode_bit_string(data: bytes) -> bytes:
    return encode(BIT_STRING, b"\x00" + data)
