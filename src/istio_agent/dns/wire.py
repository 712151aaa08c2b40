"""DNS message codec for the proxy: parse queries, build replies, truncate, validate upstream replies.

Only what the proxy needs is decoded. Queries take a fast label walk (they are on the hot path of every
lookup); replies from upstreams are parsed fully, because they are re-encoded when they must be truncated
and because a malformed upstream message must be caught here rather than handed to a client.

Every function raises only its documented exception for bad input (``Rejected`` from ``parse_query``,
``DnsFormatError`` elsewhere), so a hostile datagram can never take down anything but its own answer.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple

from istio_agent.dns.records import (
    TYPE_AFSDB,
    TYPE_CNAME,
    TYPE_DNAME,
    TYPE_KX,
    TYPE_MB,
    TYPE_MD,
    TYPE_MF,
    TYPE_MG,
    TYPE_MINFO,
    TYPE_MR,
    TYPE_MX,
    TYPE_NAPTR,
    TYPE_NS,
    TYPE_OPT,
    TYPE_PTR,
    TYPE_PX,
    TYPE_RP,
    TYPE_RT,
    TYPE_SOA,
    TYPE_SRV,
)

# Response codes (RFC 1035 §4.1.1).
RCODE_NOERROR = 0
RCODE_FORMERR = 1
RCODE_SERVFAIL = 2
RCODE_NXDOMAIN = 3
RCODE_NOTIMP = 4
RCODE_REFUSED = 5

# Header flag bits (second 16-bit word of the header).
FLAG_QR = 0x8000
FLAG_AA = 0x0400
FLAG_TC = 0x0200
FLAG_RD = 0x0100
FLAG_RA = 0x0080
FLAG_AD = 0x0020
FLAG_CD = 0x0010
OPCODE_SHIFT = 11
OPCODE_MASK = 0xF
RCODE_MASK = 0xF

OPCODE_QUERY = 0
OPCODE_NOTIFY = 4

EDNS_DO = 0x8000
"""DNSSEC OK bit in the OPT record's TTL field (RFC 3225)."""

HEADER_SIZE = 12
MIN_UDP_SIZE = 512
"""Largest UDP reply every client accepts (RFC 1035), and the limit without EDNS."""
MAX_MESSAGE_SIZE = 65535
"""Largest message over TCP (two-byte length prefix)."""
EDNS_PAYLOAD_SIZE = 1232
"""UDP payload size we advertise: fits the IPv6 minimum MTU without fragmentation (DNS flag day 2020)."""

_MAX_NAME = 255
_MAX_POINTER_HOPS = 127

_HEADER = struct.Struct("!6H")
_RR_FIXED = struct.Struct("!HHIH")
_U16 = struct.Struct("!H")
_QTAIL = struct.Struct("!HH")
_OPT_RECORD = struct.Struct("!BHHIH")


class DnsFormatError(ValueError):
    """A malformed DNS message; the message says what is wrong (never echoes payload bytes)."""


class QuestionMismatch(DnsFormatError):
    """A well-formed reply to another question: on a shared socket, a spoof to ignore, not a failure."""


class Rejected(Exception):
    """``parse_query`` refused the message: answer with ``rcode`` (FORMERR/NOTIMP), or drop it when None."""

    def __init__(self, rcode: int | None, reason: str) -> None:
        super().__init__(reason)
        self.rcode = rcode
        self.reason = reason


class Query(NamedTuple):
    """What the proxy needs from a query; ``question`` is kept verbatim to echo in replies."""

    id: int
    flags: int
    opcode: int
    qname: str
    qtype: int
    qclass: int
    question: bytes
    edns: bool
    udp_limit: int
    do_bit: bool
    edns_options: bool = False
    """The OPT record carries options (cookies, client subnet, ...): its reply is this client's own."""


# --------------------------------------------------------------------------------------------------
# Queries (hot path)


def _decode_qname(labels: list[bytes]) -> str:
    """Presentation form: lower-case (ASCII only, as DNS compares), dots and backslashes in labels escaped.

    Escaping keeps a label containing a ``.`` from masquerading as several labels (and so from matching a
    table entry it is not).
    """
    if not labels:
        return "."
    raw = b".".join(labels)
    if raw.count(b".") != len(labels) - 1 or b"\\" in raw:
        raw = b".".join(lab.replace(b"\\", b"\\\\").replace(b".", b"\\.") for lab in labels)
    raw = raw.lower() + b"."
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        return raw.decode("utf-8", "surrogateescape")


def _question_end(data: bytes, n: int) -> tuple[list[bytes], int] | None:
    """Walk the first question's labels (no compression allowed there); ``(labels, end)`` or None."""
    pos = HEADER_SIZE
    labels: list[bytes] = []
    while True:
        if pos >= n:
            return None
        length = data[pos]
        if length == 0:
            pos += 1
            break
        if length > 63:  # a compression pointer or an extended label type: not in a question we accept
            return None
        end = pos + 1 + length
        if end >= HEADER_SIZE + _MAX_NAME:  # stop early: the terminator would make it over 255 bytes
            return None
        labels.append(data[pos + 1 : end])
        pos = end
    if pos + 4 > n:
        return None
    return labels, pos + 4


def parse_query(data: bytes) -> Query:
    """Parse a query after the server-library pre-filter; raises ``Rejected`` only."""
    n = len(data)
    if n < HEADER_SIZE:
        raise Rejected(None, "message shorter than a DNS header")
    msg_id, flags, qdcount, ancount, nscount, arcount = _HEADER.unpack_from(data)
    if flags & FLAG_QR:
        raise Rejected(None, "message is a response")
    opcode = (flags >> OPCODE_SHIFT) & OPCODE_MASK
    if opcode != OPCODE_QUERY and opcode != OPCODE_NOTIFY:
        raise Rejected(RCODE_NOTIMP, f"opcode {opcode} not implemented")
    if qdcount != 1 or ancount > 1 or nscount > 1 or arcount > 2:
        raise Rejected(
            RCODE_FORMERR,
            f"unexpected section counts qd={qdcount} an={ancount} ns={nscount} ar={arcount}",
        )
    walked = _question_end(data, n)
    if walked is None:
        raise Rejected(RCODE_FORMERR, "malformed question")
    labels, qend = walked
    qtype, qclass = _QTAIL.unpack_from(data, qend - 4)
    edns = False
    udp_limit = MIN_UDP_SIZE
    do_bit = False
    edns_options = False
    if ancount or nscount or arcount:
        try:
            opt = _scan_query_records(data, qend, ancount + nscount, arcount)
        except DnsFormatError as exc:
            raise Rejected(RCODE_FORMERR, str(exc)) from None
        if opt is not None:
            edns = True
            payload, ttl, edns_options = opt
            udp_limit = payload if payload > MIN_UDP_SIZE else MIN_UDP_SIZE
            do_bit = bool(ttl & EDNS_DO)
    return Query(
        msg_id,
        flags,
        opcode,
        _decode_qname(labels),
        qtype,
        qclass,
        data[HEADER_SIZE:qend],
        edns,
        udp_limit,
        do_bit,
        edns_options,
    )


def _scan_query_records(
    data: bytes, pos: int, before_additional: int, arcount: int
) -> tuple[int, int, bool] | None:
    """Validate the few records a query may carry; (udp payload size, OPT ttl, has options) or None."""
    n = len(data)
    opt: tuple[int, int, bool] | None = None
    for index in range(before_additional + arcount):
        if pos < n and data[pos] == 0:  # root owner, the usual OPT case
            root_owner = True
            pos += 1
        else:
            labels, pos = _read_name(data, pos, n)
            root_owner = not labels
        rtype, rclass, ttl, start, end = _record_header(data, pos, n)
        if rtype == TYPE_OPT:
            if index < before_additional:
                raise DnsFormatError("OPT record outside the additional section")
            if opt is not None:
                raise DnsFormatError("more than one OPT record")
            if not root_owner:
                raise DnsFormatError("OPT record owner is not the root")
            _check_options(data, start, end)
            opt = (rclass, ttl, end > start)
        else:
            layout = _RDATA_LAYOUTS.get(rtype)
            if layout:
                _read_rdata(data, start, end, layout)
        pos = end
    return opt


def _record_header(data: bytes, pos: int, n: int) -> tuple[int, int, int, int, int]:
    """Type, class, TTL and the rdata's [start, end) of the record whose fixed part starts at ``pos``."""
    if pos + 10 > n:
        raise DnsFormatError("record header runs past end of message")
    rtype, rclass, ttl, rdlength = _RR_FIXED.unpack_from(data, pos)
    start = pos + 10
    end = start + rdlength
    if end > n:
        raise DnsFormatError("record data runs past end of message")
    return rtype, rclass, ttl, start, end


def _check_options(data: bytes, pos: int, end: int) -> None:
    """EDNS options are (code, length, value) triples that must tile the OPT rdata exactly."""
    while pos < end:
        if pos + 4 > end:
            raise DnsFormatError("truncated EDNS option")
        pos += 4 + _U16.unpack_from(data, pos + 2)[0]
    if pos != end:
        raise DnsFormatError("EDNS option runs past its record")


# --------------------------------------------------------------------------------------------------
# Replies built here


def _opt_record(payload: int, ttl: int = 0) -> bytes:
    return _OPT_RECORD.pack(0, TYPE_OPT, payload, ttl, 0)


def error_reply(data: bytes, rcode: int) -> bytes | None:
    """Reply ``rcode`` to a raw, possibly malformed request; None when there is no header to answer."""
    if not 0 <= rcode <= RCODE_MASK:
        raise ValueError(f"rcode {rcode} does not fit the header")
    n = len(data)
    if n < HEADER_SIZE:
        return None
    msg_id, flags, qdcount = struct.unpack_from("!3H", data)
    out_flags = FLAG_QR | (flags & ((OPCODE_MASK << OPCODE_SHIFT) | FLAG_RD | FLAG_CD)) | rcode
    question = b""
    if qdcount:
        walked = _question_end(data, n)
        if walked is not None:
            question = data[HEADER_SIZE : walked[1]]
    return _HEADER.pack(msg_id, out_flags, 1 if question else 0, 0, 0, 0) + question


def _reply(query: Query, extra_flags: int, answers: Sequence[bytes]) -> bytes:
    flags = FLAG_QR | (query.opcode << OPCODE_SHIFT) | (query.flags & (FLAG_RD | FLAG_CD)) | extra_flags
    if query.edns:
        opt = _opt_record(EDNS_PAYLOAD_SIZE, EDNS_DO if query.do_bit else 0)
        head = _HEADER.pack(query.id, flags, 1, len(answers), 0, 1)
        return b"".join((head, query.question, *answers, opt))
    head = _HEADER.pack(query.id, flags, 1, len(answers), 0, 0)
    return b"".join((head, query.question, *answers))


def local_reply(query: Query, answers: Sequence[bytes]) -> bytes:
    """Authoritative NOERROR answer from the name table; OPT(1232) iff the query had EDNS.

    ``answers`` are pre-encoded records (``Record.wire``). The DO bit is echoed as RFC 3225 requires.
    """
    return _reply(query, FLAG_AA | RCODE_NOERROR, answers)


def servfail(query: Query) -> bytes:
    """The request turned into a SERVFAIL reply: no records, no AA (OPT iff the query had EDNS)."""
    return _reply(query, RCODE_SERVFAIL, ())


def with_id(message: bytes, new_id: int) -> bytes:
    """``message`` with its ID replaced (the forwarder and the cache rewrite IDs)."""
    if len(message) < HEADER_SIZE:
        raise DnsFormatError("message shorter than a DNS header")
    return _U16.pack(new_id & 0xFFFF) + message[2:]


# --------------------------------------------------------------------------------------------------
# Full parsing of replies

Labels = tuple[bytes, ...]


class _Name(NamedTuple):
    """A domain name inside rdata; ``compress`` says whether RFC 3597 lets us compress it on output."""

    labels: Labels
    compress: bool


class _RR(NamedTuple):
    name: Labels
    rtype: int
    rclass: int
    ttl: int
    rdata: tuple[bytes | _Name, ...]
    ttl_offset: int


class _Message(NamedTuple):
    msg_id: int
    flags: int
    questions: list[tuple[Labels, bytes]]
    answer: list[_RR]
    authority: list[_RR]
    additional: list[_RR]


def _read_name(data: bytes, pos: int, n: int) -> tuple[Labels, int]:
    """Decode a possibly compressed name at ``pos``; returns (labels, offset after the name in place).

    A pointer must point before the start of the run of labels it ends, so every hop moves strictly
    backwards and loops are impossible; hops are bounded too, so a chain cannot cost more than a name.
    """
    labels: list[bytes] = []
    wire_len = 1
    after = -1
    run_start = pos
    hops = 0
    while True:
        if pos >= n:
            raise DnsFormatError("name runs past end of message")
        length = data[pos]
        if length == 0:
            pos += 1
            break
        kind = length & 0xC0
        if kind == 0xC0:
            if pos + 1 >= n:
                raise DnsFormatError("compression pointer runs past end of message")
            target = ((length & 0x3F) << 8) | data[pos + 1]
            if target >= run_start:
                raise DnsFormatError("compression pointer does not point backwards")
            hops += 1
            if hops > _MAX_POINTER_HOPS:
                raise DnsFormatError("too many compression pointers in a name")
            if after < 0:
                after = pos + 2
            pos = run_start = target
            continue
        if kind:
            raise DnsFormatError("unsupported label type")
        end = pos + 1 + length
        if end > n:
            raise DnsFormatError("label runs past end of message")
        wire_len += length + 1
        if wire_len > _MAX_NAME:
            raise DnsFormatError("name longer than 255 bytes")
        labels.append(data[pos + 1 : end])
        pos = end
    return tuple(labels), (after if after >= 0 else pos)


# Rdata layouts with embedded names: "N" compressible name (RFC 1035 types), "n" name that may arrive
# compressed but must go out uncompressed (RFC 3597 §4), "s" character-string, int = fixed bytes.
_Layout = tuple[str | int, ...]
_RDATA_LAYOUTS: dict[int, _Layout] = {
    TYPE_NS: ("N",),
    TYPE_MD: ("N",),
    TYPE_MF: ("N",),
    TYPE_CNAME: ("N",),
    TYPE_MB: ("N",),
    TYPE_MG: ("N",),
    TYPE_MR: ("N",),
    TYPE_PTR: ("N",),
    TYPE_SOA: ("N", "N", 20),
    TYPE_MINFO: ("N", "N"),
    TYPE_MX: (2, "N"),
    TYPE_RP: ("n", "n"),
    TYPE_AFSDB: (2, "n"),
    TYPE_RT: (2, "n"),
    TYPE_PX: (2, "n", "n"),
    TYPE_SRV: (6, "n"),
    TYPE_NAPTR: (4, "s", "s", "s", "n"),
    TYPE_KX: (2, "n"),
    TYPE_DNAME: ("n",),
}


def _read_rdata(data: bytes, start: int, end: int, layout: _Layout) -> tuple[bytes | _Name, ...]:
    parts: list[bytes | _Name] = []
    pos = start
    for item in layout:
        if isinstance(item, int):
            nxt = pos + item
            if nxt > end:
                raise DnsFormatError("record data shorter than its type requires")
            parts.append(data[pos:nxt])
            pos = nxt
        elif item == "s":
            if pos >= end or pos + 1 + data[pos] > end:
                raise DnsFormatError("character-string runs past its record")
            nxt = pos + 1 + data[pos]
            parts.append(data[pos:nxt])
            pos = nxt
        else:
            labels, pos = _read_name(data, pos, end)
            parts.append(_Name(labels, item == "N"))
    if pos != end:
        raise DnsFormatError("record data length does not match its contents")
    return tuple(parts)


def _parse(data: bytes, decode_rdata: bool = True) -> _Message:
    """Parse a whole message (any direction); raises ``DnsFormatError`` on any inconsistency."""
    n = len(data)
    if n < HEADER_SIZE:
        raise DnsFormatError("message shorter than a DNS header")
    msg_id, flags, qdcount, ancount, nscount, arcount = _HEADER.unpack_from(data)
    pos = HEADER_SIZE
    questions: list[tuple[Labels, bytes]] = []
    for _ in range(qdcount):
        labels, pos = _read_name(data, pos, n)
        if pos + 4 > n:
            raise DnsFormatError("question runs past end of message")
        questions.append((labels, data[pos : pos + 4]))
        pos += 4
    sections: list[list[_RR]] = []
    opt_seen = False
    for section, count in enumerate((ancount, nscount, arcount)):
        records: list[_RR] = []
        for _ in range(count):
            name, pos = _read_name(data, pos, n)
            rtype, rclass, ttl, start, end = _record_header(data, pos, n)
            if rtype == TYPE_OPT:
                if section != 2:
                    raise DnsFormatError("OPT record outside the additional section")
                if opt_seen:
                    raise DnsFormatError("more than one OPT record")
                if name:
                    raise DnsFormatError("OPT record owner is not the root")
                opt_seen = True
                _check_options(data, start, end)
            layout = _RDATA_LAYOUTS.get(rtype) if decode_rdata else None
            rdata = _read_rdata(data, start, end, layout) if layout else (data[start:end],)
            records.append(_RR(name, rtype, rclass, ttl, rdata, pos + 4))
            pos = end
        sections.append(records)
    return _Message(msg_id, flags, questions, sections[0], sections[1], sections[2])


class _Writer:
    """Message encoder with RFC 1035 §4.1.4 name compression (case-preserving: exact suffix matches)."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.targets: dict[Labels, int] = {}
        self.added: list[Labels] = []

    def name(self, labels: Labels, compress: bool = True) -> None:
        buf = self.buf
        for i in range(len(labels)):
            suffix = labels[i:]
            if compress:
                target = self.targets.get(suffix)
                if target is not None:
                    buf += _U16.pack(0xC000 | target)
                    return
            offset = len(buf)
            if offset < 0x4000 and suffix not in self.targets:
                self.targets[suffix] = offset
                self.added.append(suffix)
            buf.append(len(labels[i]))
            buf += labels[i]
        buf.append(0)

    def record(self, rr: _RR) -> None:
        self.name(rr.name)
        fixed_at = len(self.buf)
        self.buf += _RR_FIXED.pack(rr.rtype, rr.rclass, rr.ttl, 0)
        start = len(self.buf)
        for part in rr.rdata:
            if isinstance(part, _Name):
                self.name(part.labels, part.compress)
            else:
                self.buf += part
        _U16.pack_into(self.buf, fixed_at + 8, len(self.buf) - start)

    def mark(self) -> tuple[int, int]:
        return len(self.buf), len(self.added)

    def rollback(self, mark: tuple[int, int]) -> None:
        size, added = mark
        del self.buf[size:]
        for suffix in self.added[added:]:
            del self.targets[suffix]
        del self.added[added:]


def truncate(reply: bytes, limit: int) -> bytes:
    """Fit ``reply`` into ``limit`` bytes (RFC 2181 §9, RFC 6891); limits are clamped to 512..65535.

    A reply that fits is returned unchanged. Otherwise it is re-encoded with name compression and the
    longest prefix of answer, then authority, then additional records that fits is kept (the OPT record
    always stays, last); TC is set when anything was dropped and kept when already set.
    """
    limit = min(max(limit, MIN_UDP_SIZE), MAX_MESSAGE_SIZE)
    if len(reply) <= limit:
        return reply
    msg = _parse(reply)
    opt = next((rr for rr in msg.additional if rr.rtype == TYPE_OPT), None)
    opt_size = 0
    if opt is not None:
        opt_size = 11 + sum(len(p) for p in opt.rdata if isinstance(p, bytes))
        if HEADER_SIZE + sum(_name_size(q[0]) + 4 for q in msg.questions) + opt_size > limit:
            opt = opt._replace(rdata=(b"",))  # its options alone would not fit: keep the bare OPT
            opt_size = 11
    writer = _Writer()
    writer.buf += bytes(HEADER_SIZE)
    for labels, tail in msg.questions:
        writer.name(labels)
        writer.buf += tail
    budget = limit - opt_size
    if len(writer.buf) > budget:
        raise DnsFormatError("question section alone exceeds the size limit")
    kept = [0, 0, 0]
    dropped = False
    for index, section in enumerate((msg.answer, msg.authority, msg.additional)):
        for rr in section:
            if rr.rtype == TYPE_OPT:
                continue
            if dropped:
                break
            mark = writer.mark()
            writer.record(rr)
            if len(writer.buf) > budget:
                writer.rollback(mark)
                dropped = True
                break
            kept[index] += 1
    if opt is not None:
        writer.record(opt)
        kept[2] += 1
    flags = msg.flags | FLAG_TC if dropped else msg.flags
    _HEADER.pack_into(writer.buf, 0, msg.msg_id, flags, len(msg.questions), *kept)
    return bytes(writer.buf)


def _name_size(labels: Labels) -> int:
    return 1 + sum(len(label) + 1 for label in labels)


def _skip_name(data: bytes, pos: int, n: int) -> int:
    """Check a possibly compressed name as ``_read_name`` does, without decoding it; its end in place."""
    wire_len = 1
    after = -1
    run_start = pos
    hops = 0
    while True:
        if pos >= n:
            raise DnsFormatError("name runs past end of message")
        length = data[pos]
        if not length:
            return after if after >= 0 else pos + 1
        if length >= 0xC0:
            if pos + 1 >= n:
                raise DnsFormatError("compression pointer runs past end of message")
            target = ((length & 0x3F) << 8) | data[pos + 1]
            if target >= run_start:
                raise DnsFormatError("compression pointer does not point backwards")
            hops += 1
            if hops > _MAX_POINTER_HOPS:
                raise DnsFormatError("too many compression pointers in a name")
            if after < 0:
                after = pos + 2
            pos = run_start = target
            continue
        if length > 63:
            raise DnsFormatError("unsupported label type")
        pos += 1 + length
        if pos > n:
            raise DnsFormatError("label runs past end of message")
        wire_len += length + 1
        if wire_len > _MAX_NAME:
            raise DnsFormatError("name longer than 255 bytes")


def _skip_records(data: bytes, pos: int, counts: tuple[int, int, int], checked_name: int = -1) -> None:
    """Check the answer, authority and additional records from ``pos`` as ``_parse`` does (names,
    bounds, names inside record data, the OPT record's place, uniqueness, owner and options), but
    without building anything: a forwarded reply is relayed as it came.

    ``checked_name``: where a name already known to be valid starts (the question's, once it was
    compared with the query's), so an owner that is just a pointer to it needs no walk (the usual
    answer record).
    """
    n = len(data)
    answers, authority, additional = counts
    additional_from = answers + authority
    opt_seen = False
    for index in range(additional_from + additional):  # one flat loop: cheaper than one per section
        owner = pos
        if pos + 1 < n and data[pos] >= 0xC0 and ((data[pos] & 0x3F) << 8 | data[pos + 1]) == checked_name:
            pos += 2  # a pointer back to a checked name, as _skip_name would find it
        else:
            pos = _skip_name(data, pos, n)
        if pos + 10 > n:
            raise DnsFormatError("record header runs past end of message")
        start = pos + 10
        end = start + ((data[pos + 8] << 8) | data[pos + 9])
        if end > n:
            raise DnsFormatError("record data runs past end of message")
        rtype = (data[pos] << 8) | data[pos + 1]
        if rtype == TYPE_OPT:
            if index < additional_from:
                raise DnsFormatError("OPT record outside the additional section")
            if opt_seen:
                raise DnsFormatError("more than one OPT record")
            if data[owner] and _read_name(data, owner, n)[0]:  # a root owner may be compressed
                raise DnsFormatError("OPT record owner is not the root")
            opt_seen = True
            _check_options(data, start, end)
        else:
            layout = _RDATA_LAYOUTS.get(rtype)
            if layout is not None:
                _skip_rdata(data, start, end, layout)
        pos = end


def _skip_rdata(data: bytes, pos: int, end: int, layout: _Layout) -> None:
    """Check record data with embedded names as ``_read_rdata`` does, without decoding it."""
    for item in layout:
        if isinstance(item, int):
            pos += item
            if pos > end:
                raise DnsFormatError("record data shorter than its type requires")
        elif item == "s":
            if pos >= end or pos + 1 + data[pos] > end:
                raise DnsFormatError("character-string runs past its record")
            pos += 1 + data[pos]
        else:
            pos = _skip_name(data, pos, end)
    if pos != end:
        raise DnsFormatError("record data length does not match its contents")


def check_reply(query: bytes, reply: bytes, question: bytes | None = None) -> None:
    """Raise ``DnsFormatError`` unless ``reply`` is a well-formed response to ``query``.

    Beyond the ID and QR bit, a reply that carries a question must carry the query's (case-insensitive),
    so a stray or spoofed datagram for another name is not relayed.

    On the latency path of every forwarded query, so the usual reply (one question, the query's as
    sent, case aside) is checked by comparing bytes and walking its records with the same checks as
    ``_parse`` but without building them (``_skip_records``). Any other reply gets the full parse.
    ``question`` is ``Query.question`` of ``query`` (its bytes ``query[12:end]``) when the caller
    parsed it: where the question ends is then known without walking the query's name again.
    """
    if len(reply) < HEADER_SIZE:
        raise DnsFormatError("reply shorter than a DNS header")
    if len(query) < HEADER_SIZE:
        raise DnsFormatError("query shorter than a DNS header")
    if reply[:2] != query[:2]:
        raise DnsFormatError("reply ID does not match the query")
    if not reply[2] & 0x80:
        raise DnsFormatError("reply does not have the QR bit set")
    _, _, qdcount, ancount, nscount, arcount = _HEADER.unpack_from(reply)
    if qdcount == 1:
        if not question:
            asked = _question_end(query, len(query))
            end = asked[1] if asked is not None else 0
            question = query[HEADER_SIZE:end]
        else:
            end = HEADER_SIZE + len(question)
        if end:
            name_end = end - 4
            if (
                reply.startswith(question, HEADER_SIZE)
                or (  # the question as sent, or in another case
                    reply[HEADER_SIZE:name_end].lower() == query[HEADER_SIZE:name_end].lower()
                    and reply[name_end:end] == query[name_end:end]
                )
            ):
                _skip_records(reply, end, (ancount, nscount, arcount), HEADER_SIZE)
                return
    msg = _parse(reply)
    if msg.questions:
        asked = _question_end(query, len(query))
        if asked is not None:
            labels, qend = asked
            got_labels, got_tail = msg.questions[0]
            if (
                len(msg.questions) != 1
                or got_tail != query[qend - 4 : qend]
                or len(got_labels) != len(labels)
                or any(got.lower() != want.lower() for got, want in zip(got_labels, labels, strict=True))
            ):
                raise QuestionMismatch("reply question does not match the query")


def ttl_offsets(reply: bytes) -> list[int]:
    """Offsets of the TTL field of every record except OPT, so a cache can age TTLs in place."""
    msg = _parse(reply, decode_rdata=False)
    return [
        rr.ttl_offset
        for section in (msg.answer, msg.authority, msg.additional)
        for rr in section
        if rr.rtype != TYPE_OPT
    ]
