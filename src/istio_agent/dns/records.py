"""Resource records the proxy answers with, encoded once when the name table is built.

Answers are precomputed wire bytes so that serving a table hit is a dictionary lookup and a join.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

# Record types and classes (RFC 1035, RFC 3596, RFC 6891).
TYPE_A = 1
TYPE_NS = 2
TYPE_CNAME = 5
TYPE_SOA = 6
TYPE_PTR = 12
TYPE_MX = 15
TYPE_TXT = 16
TYPE_AAAA = 28
TYPE_SRV = 33
TYPE_MD = 3
TYPE_MF = 4
TYPE_MB = 7
TYPE_MG = 8
TYPE_MR = 9
TYPE_MINFO = 14
TYPE_RP = 17
TYPE_AFSDB = 18
TYPE_RT = 21
TYPE_PX = 26
TYPE_NAPTR = 35
TYPE_KX = 36
TYPE_DNAME = 39
TYPE_OPT = 41
TYPE_AXFR = 252
TYPE_IXFR = 251
TYPE_ANY = 255
CLASS_IN = 1

TTL = 30
"""Every locally answered record has TTL 30 (Istio's defaultTTLInSeconds)."""


class DnsNameError(ValueError):
    """A name that cannot be put on the wire (label over 63 bytes, name over 255)."""


def encode_name(name: str) -> bytes:
    """Wire form of an absolute name (``"a.b."`` or ``"a.b"``), uncompressed; ``"."`` is the root."""
    labels = name.rstrip(".").split(".") if name.strip(".") else []
    out = bytearray()
    for label in labels:
        raw = label.encode("utf-8", "surrogateescape")  # labels are octets; undecodable ones round-trip
        if not raw or len(raw) > 63:
            raise DnsNameError(f"invalid DNS name {name!r}: empty or over-long label")
        out.append(len(raw))
        out += raw
    out.append(0)
    if len(out) > 255:
        raise DnsNameError(f"invalid DNS name {name!r}: longer than 255 bytes")
    return bytes(out)


class Record(NamedTuple):
    """One resource record. ``name`` is a lower-case FQDN with the trailing dot."""

    name: str
    rtype: int
    ttl: int
    rdata: bytes

    @property
    def wire(self) -> bytes:
        """Uncompressed wire form: owner, type, class IN, TTL, rdlength, rdata."""
        return (
            encode_name(self.name)
            + struct.pack("!HHIH", self.rtype, CLASS_IN, self.ttl, len(self.rdata))
            + self.rdata
        )
