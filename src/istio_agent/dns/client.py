"""A minimal blocking DNS client for tools (the demo, benchmarks): one question, one UDP exchange.

Tests use dnspython; the agent's own tools use this so that a production install needs nothing more.
"""

from __future__ import annotations

import ipaddress
import random
import socket
import struct
import time
from typing import NamedTuple

from istio_agent.dns.records import CLASS_IN, TYPE_A, TYPE_AAAA, TYPE_CNAME, encode_name
from istio_agent.dns.wire import FLAG_AA, RCODE_MASK, _Name, _parse, check_reply


class AnswerRecord(NamedTuple):
    owner: str
    rtype: int
    ttl: int
    value: str
    """An address (A/AAAA), a target name (CNAME), or the record data in hex."""


class Lookup(NamedTuple):
    rcode: int
    authoritative: bool
    answers: list[AnswerRecord]


def build_query(name: str, qtype: int = TYPE_A, query_id: int | None = None) -> bytes:
    """A recursive query for ``name`` without EDNS."""
    ident = random.getrandbits(16) if query_id is None else query_id
    return (
        struct.pack("!6H", ident, 0x0100, 1, 0, 0, 0)
        + encode_name(name)
        + struct.pack("!HH", qtype, CLASS_IN)
    )


def lookup(host: str, port: int, name: str, qtype: int = TYPE_A, timeout: float = 2.0) -> Lookup | None:
    """Ask ``host:port`` once over UDP; None when no valid answer came within ``timeout``."""
    query = build_query(name, qtype)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    deadline = time.monotonic() + timeout
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((host, port))
            sock.send(query)
            while (remaining := deadline - time.monotonic()) > 0:
                sock.settimeout(remaining)
                reply = sock.recv(65535)
                try:
                    check_reply(query, reply)
                except ValueError:
                    continue  # not the answer to this query
                return decode(reply)
        except OSError:  # timeout, ICMP port unreachable, ...
            return None
    return None


def decode(reply: bytes) -> Lookup:
    """The response code, AA bit and answer records of a reply (raises DnsFormatError if malformed)."""
    message = _parse(reply)
    answers = []
    for record in message.answer:
        owner = ".".join(label.decode("ascii", "backslashreplace") for label in record.name) + "."
        answers.append(AnswerRecord(owner, record.rtype, record.ttl, _value(record.rtype, record.rdata)))
    return Lookup(message.flags & RCODE_MASK, bool(message.flags & FLAG_AA), answers)


def _value(rtype: int, rdata: tuple[bytes | _Name, ...]) -> str:
    if rtype in (TYPE_A, TYPE_AAAA) and len(rdata) == 1 and isinstance(rdata[0], bytes):
        return str(ipaddress.ip_address(rdata[0]))
    if rtype == TYPE_CNAME and len(rdata) == 1 and isinstance(rdata[0], _Name):
        return ".".join(label.decode("ascii", "backslashreplace") for label in rdata[0].labels) + "."
    return b"".join(part if isinstance(part, bytes) else b"" for part in rdata).hex()
