"""DNS wire codec: every rule of the pre-filter, reply building, truncation and reply validation,
cross-checked against dnspython in both directions, plus fuzzing for the "never crash" promise."""

from __future__ import annotations

import contextlib
import struct

import dns.edns
import dns.flags
import dns.message
import dns.name
import dns.opcode
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from istio_agent.dns import wire
from istio_agent.dns.records import TYPE_A, TYPE_AAAA, Record, encode_name

HOST = "productpage.default.svc.cluster.local."


def make_query(name: str = HOST, rdtype: str = "A", **kwargs: object) -> bytes:
    kwargs.setdefault("id", 0x4242)  # a fixed ID: parametrize ids must be the same in every xdist worker
    return dns.message.make_query(name, rdtype, **kwargs).to_wire()  # type: ignore[arg-type]


def header(data: bytes) -> tuple[int, ...]:
    return struct.unpack_from("!6H", data)


def set_counts(data: bytes, qd: int, an: int, ns: int, ar: int) -> bytes:
    return data[:4] + struct.pack("!4H", qd, an, ns, ar) + data[12:]


def raw_query(
    name_wire: bytes, flags: int = 0x0100, counts: tuple[int, int, int, int] = (1, 0, 0, 0)
) -> bytes:
    return struct.pack("!6H", 0x1234, flags, *counts) + name_wire + struct.pack("!HH", TYPE_A, 1)


OPT_ROOT = b"\x00" + struct.pack("!HHIH", 41, 4096, 0, 0)


def rejected(data: bytes) -> wire.Rejected:
    with pytest.raises(wire.Rejected) as info:
        wire.parse_query(data)
    return info.value


# --------------------------------------------------------------------------------------------------
# parse_query


def test_parse_plain_query_matches_dnspython() -> None:
    msg = dns.message.make_query("ProductPage.Default.svc.cluster.local.", "AAAA")
    msg.flags |= dns.flags.CD
    data = msg.to_wire()
    q = wire.parse_query(data)
    assert q.id == msg.id
    assert q.flags == msg.flags
    assert q.opcode == wire.OPCODE_QUERY
    assert q.qname == HOST
    assert q.qtype == TYPE_AAAA and q.qclass == 1
    assert q.question == data[12:]  # original case kept
    assert b"ProductPage" in q.question
    assert (q.edns, q.udp_limit, q.do_bit) == (False, 512, False)


@pytest.mark.parametrize(("payload", "limit"), [(4096, 4096), (1232, 1232), (512, 512), (100, 512), (0, 512)])
def test_parse_edns_payload_is_floored_at_512(payload: int, limit: int) -> None:
    q = wire.parse_query(make_query(use_edns=0, payload=payload))
    assert q.edns and q.udp_limit == limit and not q.do_bit


def test_parse_edns_do_bit_and_options() -> None:
    data = make_query(
        use_edns=0,
        payload=1400,
        want_dnssec=True,
        options=[
            dns.edns.GenericOption(10, b"cookie12"),
            dns.edns.GenericOption(8, b"\x00\x01\x18\x00\x0a\x00\x00"),
        ],
    )
    q = wire.parse_query(data)
    assert q.edns and q.do_bit and q.udp_limit == 1400


def test_parse_root_and_odd_labels() -> None:
    assert wire.parse_query(make_query(".", "NS")).qname == "."
    # A label containing a dot must not look like two labels (no false table hits).
    q = wire.parse_query(raw_query(b"\x05a.b\\c\x03svc\x00"))
    assert q.qname == "a\\.b\\\\c.svc."
    # Non-ASCII labels decode losslessly.
    q = wire.parse_query(raw_query(b"\x04\xc3\xa9X\xff\x00"))
    assert q.qname.encode("utf-8", "surrogateescape") == b"\xc3\xa9x\xff."


def test_parse_accepts_notify_with_soa_and_two_additionals() -> None:
    msg = dns.message.make_query("example.com.", "SOA")
    msg.set_opcode(dns.opcode.NOTIFY)
    msg.answer.append(
        dns.rrset.from_text("example.com.", 60, "IN", "SOA", "ns.example.com. host.example.com. 1 2 3 4 5")
    )
    msg.use_edns(0, payload=1232)
    data = msg.to_wire()
    q = wire.parse_query(data)
    assert q.opcode == wire.OPCODE_NOTIFY and q.edns and q.udp_limit == 1232
    # ARCOUNT 2: OPT plus one ordinary record.
    extra = encode_name("x.example.com.") + struct.pack("!HHIH", TYPE_A, 1, 5, 4) + b"\x01\x02\x03\x04"
    data2 = set_counts(make_query(use_edns=0), 1, 0, 0, 2) + extra
    assert wire.parse_query(data2).edns


def test_drop_short_header_and_responses() -> None:
    assert rejected(b"").rcode is None
    assert rejected(make_query()[:11]).rcode is None
    response = dns.message.make_response(dns.message.make_query(HOST, "A")).to_wire()
    assert rejected(response).rcode is None


@pytest.mark.parametrize("opcode", [1, 2, 3, 5, 6, 15])
def test_notimp_for_other_opcodes(opcode: int) -> None:
    data = raw_query(b"\x01a\x00", flags=opcode << 11)
    assert rejected(data).rcode == wire.RCODE_NOTIMP


@pytest.mark.parametrize("counts", [(0, 0, 0, 0), (2, 0, 0, 0), (1, 2, 0, 0), (1, 0, 2, 0), (1, 0, 0, 3)])
def test_formerr_for_section_counts(counts: tuple[int, int, int, int]) -> None:
    assert rejected(set_counts(make_query(), *counts)).rcode == wire.RCODE_FORMERR


@pytest.mark.parametrize(
    "data",
    [
        raw_query(b"\x05abc")[:17],  # question cut inside the name
        raw_query(b"\x03abc\x00")[:-2],  # qtype/qclass missing
        raw_query(b"\xc0\x0c"),  # compression pointer in the question
        raw_query(b"\x43abc\x00"),  # extended label type
        raw_query(b"\x3f" + b"a" * 63) * 1,  # no terminator
        raw_query(b"".join(b"\x3f" + b"a" * 63 for _ in range(4)) + b"\x00"),  # 257-byte name
        set_counts(make_query(use_edns=0), 1, 0, 0, 2) + OPT_ROOT,  # two OPT records
        set_counts(make_query(), 1, 1, 0, 0) + OPT_ROOT,  # OPT in the answer section
        set_counts(make_query(), 1, 0, 0, 1) + b"\x01a\x00" + OPT_ROOT[1:],  # OPT owner not root
        set_counts(make_query(), 1, 0, 0, 1)
        + b"\x00"
        + struct.pack("!HHIH", 41, 512, 0, 3)
        + b"\x00\x0a\x00",
        set_counts(make_query(), 1, 0, 0, 1)
        + b"\x00"
        + struct.pack("!HHIH", 41, 512, 0, 4)
        + b"\x00\x0a\x00\x05",
        set_counts(make_query(), 1, 0, 0, 1)
        + b"\x00"
        + struct.pack("!HHIH", 41, 512, 0, 9),  # rdata past end
        set_counts(make_query(), 1, 0, 0, 1) + b"\x00\x00\x29",  # record header cut
        set_counts(make_query(), 1, 0, 0, 1) + b"\xc0\xff" + OPT_ROOT[1:],  # forward pointer in a record
        set_counts(make_query(), 1, 1, 0, 0)
        + b"\x00"
        + struct.pack("!HHIH", 5, 1, 0, 4)
        + b"\x01a\x00\x00",  # CNAME rdata longer than its name
    ],
)
def test_formerr_for_malformed_bodies(data: bytes) -> None:
    exc = rejected(data)
    assert exc.rcode == wire.RCODE_FORMERR
    assert str(exc)


def test_longest_legal_name_is_accepted() -> None:
    name = b"".join(b"\x3f" + b"a" * 63 for _ in range(3)) + b"\x3d" + b"b" * 61 + b"\x00"
    assert len(name) == 255
    q = wire.parse_query(raw_query(name))
    assert dns.name.from_text(q.qname).to_wire() == name


# --------------------------------------------------------------------------------------------------
# Replies we build


def test_error_reply_keeps_id_opcode_rd_and_echoes_parsable_question() -> None:
    msg = dns.message.make_query("Foo.Example.", "TXT", use_edns=0)
    msg.id = 4242
    data = set_counts(msg.to_wire(), 1, 0, 0, 3)  # too many additionals
    reply = wire.error_reply(data, wire.RCODE_FORMERR)
    assert reply is not None
    parsed = dns.message.from_wire(reply)
    assert parsed.id == 4242
    assert parsed.rcode() == dns.rcode.FORMERR
    assert parsed.flags & dns.flags.QR and parsed.flags & dns.flags.RD
    assert not parsed.flags & (dns.flags.AA | dns.flags.RA | dns.flags.TC)
    assert str(parsed.question[0].name) == "Foo.Example."
    assert header(reply)[2:] == (1, 0, 0, 0)
    assert parsed.edns == -1


def test_error_reply_notimp_copies_opcode_and_omits_bad_question() -> None:
    data = raw_query(b"\xc0\x0c", flags=(5 << 11) | 0x0100)
    reply = wire.error_reply(data, wire.RCODE_NOTIMP)
    assert reply is not None
    parsed = dns.message.from_wire(reply)
    assert parsed.opcode() == 5 and parsed.rcode() == dns.rcode.NOTIMP
    assert parsed.flags & dns.flags.RD
    assert header(reply)[2:] == (0, 0, 0, 0) and len(reply) == 12
    assert wire.error_reply(b"\x12\x34\x01", wire.RCODE_FORMERR) is None
    # Twelve bytes of header that claim a question the message does not have.
    bare = wire.error_reply(struct.pack("!6H", 7, 0, 1, 0, 0, 0), wire.RCODE_FORMERR)
    assert bare is not None and header(bare) == (7, 0x8001, 0, 0, 0, 0)
    with pytest.raises(ValueError):
        wire.error_reply(data, 16)


def a_record(name: str, ip: int) -> bytes:
    return Record(name, TYPE_A, 30, bytes([10, 0, ip >> 8, ip & 0xFF])).wire


@pytest.mark.parametrize("edns", [False, True])
def test_local_reply_is_authoritative_and_edns_symmetric(edns: bool) -> None:
    msg = dns.message.make_query("ProductPage.default.svc.cluster.local.", "A", use_edns=0 if edns else False)
    msg.flags |= dns.flags.CD
    q = wire.parse_query(msg.to_wire())
    reply = wire.local_reply(q, [a_record(HOST, 1), a_record(HOST, 2)])
    parsed = dns.message.from_wire(reply)
    assert parsed.id == msg.id
    assert parsed.flags & dns.flags.QR and parsed.flags & dns.flags.AA
    assert parsed.flags & dns.flags.RD and parsed.flags & dns.flags.CD
    assert not parsed.flags & dns.flags.RA
    assert parsed.rcode() == dns.rcode.NOERROR
    assert str(parsed.question[0].name) == "ProductPage.default.svc.cluster.local."
    assert [r.address for r in parsed.answer[0]] == ["10.0.0.1", "10.0.0.2"]
    assert parsed.answer[0].ttl == 30
    if edns:
        assert parsed.edns == 0 and parsed.payload == wire.EDNS_PAYLOAD_SIZE and not parsed.options
        assert not parsed.ednsflags & dns.flags.DO
    else:
        assert parsed.edns == -1 and header(reply)[5] == 0


def test_local_reply_nodata_and_do_bit_echo() -> None:
    q = wire.parse_query(make_query(rdtype="AAAA", use_edns=0, want_dnssec=True))
    reply = wire.local_reply(q, [])
    parsed = dns.message.from_wire(reply)
    assert parsed.rcode() == dns.rcode.NOERROR and not parsed.answer
    assert parsed.ednsflags & dns.flags.DO
    assert header(reply)[2:] == (1, 0, 0, 1)


def test_local_reply_copies_notify_opcode() -> None:
    data = raw_query(encode_name(HOST), flags=(4 << 11))
    reply = wire.local_reply(wire.parse_query(data), [])
    assert dns.message.from_wire(reply).opcode() == dns.opcode.NOTIFY


@pytest.mark.parametrize("edns", [False, True])
def test_servfail(edns: bool) -> None:
    q = wire.parse_query(make_query(use_edns=0 if edns else False))
    parsed = dns.message.from_wire(wire.servfail(q))
    assert parsed.rcode() == dns.rcode.SERVFAIL
    assert not parsed.flags & (dns.flags.AA | dns.flags.RA)
    assert parsed.flags & dns.flags.QR and parsed.flags & dns.flags.RD
    assert not parsed.answer and not parsed.authority and not parsed.additional
    assert (parsed.edns == 0) is edns


def test_with_id() -> None:
    data = make_query()
    assert wire.with_id(data, 0xBEEF)[:2] == b"\xbe\xef" and wire.with_id(data, 0xBEEF)[2:] == data[2:]
    with pytest.raises(wire.DnsFormatError):
        wire.with_id(b"\x00", 1)


# --------------------------------------------------------------------------------------------------
# Truncation


def big_reply(count: int, edns: bool, name: str = HOST) -> tuple[bytes, list[bytes]]:
    q = wire.parse_query(make_query(name, use_edns=0 if edns else False))
    answers = [a_record(name.lower(), i) for i in range(count)]
    return wire.local_reply(q, answers), answers


def addresses(reply: bytes) -> list[str]:
    parsed = dns.message.from_wire(reply)
    return [rd.address for rrset in parsed.answer for rd in rrset]


def test_truncate_returns_fitting_reply_unchanged() -> None:
    reply, _ = big_reply(3, edns=False)
    assert wire.truncate(reply, 512) is reply
    assert wire.truncate(reply, 10) is reply  # limits below 512 mean 512


def test_truncate_compression_alone_avoids_tc() -> None:
    reply, _ = big_reply(20, edns=False)
    assert len(reply) > 512
    out = wire.truncate(reply, 512)
    assert len(out) <= 512
    assert not header(out)[1] & wire.FLAG_TC
    assert addresses(out) == addresses(reply)


def test_truncate_many_a_records_without_edns() -> None:
    reply, _ = big_reply(200, edns=False)
    out = wire.truncate(reply, 512)
    assert len(out) <= 512
    parsed = dns.message.from_wire(out)
    assert parsed.flags & dns.flags.TC
    kept = addresses(out)
    assert 0 < len(kept) < 200
    assert kept == addresses(reply)[: len(kept)]  # a prefix, in order
    assert len(out) + 16 > 512  # as many as fit
    assert parsed.edns == -1
    assert header(out)[3] == len(kept)


def test_truncate_keeps_opt_with_edns() -> None:
    reply, _ = big_reply(300, edns=True)
    out = wire.truncate(reply, 1232)
    assert 1232 - 16 < len(out) <= 1232
    parsed = dns.message.from_wire(out)
    assert parsed.flags & dns.flags.TC
    assert parsed.edns == 0 and parsed.payload == 1232
    assert header(out)[5] == 1
    # Over TCP everything fits.
    assert wire.truncate(reply, 65535) is reply


def test_truncate_keeps_tc_already_set_and_sections_in_order() -> None:
    query = dns.message.make_query("Example.com.", "MX", use_edns=0, payload=512)
    resp = dns.message.make_response(query)
    resp.flags |= dns.flags.TC
    resp.answer.append(
        dns.rrset.from_text_list(
            "Example.com.", 300, "IN", "MX", [f"{i} mail{i}.example.com." for i in range(10)]
        )
    )
    resp.answer.append(dns.rrset.from_text("Example.com.", 300, "IN", "CNAME", "alias.example.com."))
    resp.authority.append(
        dns.rrset.from_text_list("example.com.", 300, "IN", "NS", [f"ns{i}.example.net." for i in range(40)])
    )
    resp.additional.append(
        dns.rrset.from_text_list("ns1.example.net.", 300, "IN", "A", [f"192.0.2.{i}" for i in range(50)])
    )
    data = resp.to_wire(max_size=65535)
    assert len(data) > 512
    out = wire.truncate(data, 512)
    assert len(out) <= 512
    parsed = dns.message.from_wire(out)
    assert parsed.flags & dns.flags.TC
    assert parsed.edns == 0
    # Names inside rdata survive re-encoding (they were compressed against the old layout).
    assert parsed.answer[0] == resp.answer[0]
    assert parsed.answer[1] == resp.answer[1]
    assert 0 < len(parsed.authority[0]) < 40
    assert not parsed.additional  # nothing after the first dropped record is kept
    assert str(parsed.question[0].name) == "Example.com."


def test_truncate_without_drop_keeps_tc_clear_and_soa_srv_intact() -> None:
    query = dns.message.make_query("_http._tcp.example.com.", "SRV")
    resp = dns.message.make_response(query)
    resp.answer.append(
        dns.rrset.from_text_list(
            "_http._tcp.example.com.",
            60,
            "IN",
            "SRV",
            [f"0 5 80 host{i}.example.com." for i in range(10)],
        )
    )
    resp.authority.append(
        dns.rrset.from_text("example.com.", 60, "IN", "SOA", "ns.example.com. admin.example.com. 1 2 3 4 5")
    )
    # Encode uncompressed so that only re-encoding with compression makes it fit.
    data = resp.to_wire()
    expanded = _uncompressed(resp)
    assert len(expanded) > 512 >= len(data)
    out = wire.truncate(expanded, 512)
    assert len(out) <= 512 and not header(out)[1] & wire.FLAG_TC
    parsed = dns.message.from_wire(out)
    assert parsed.answer == resp.answer and parsed.authority == resp.authority


def _uncompressed(msg: dns.message.Message) -> bytes:
    """Wire form without any compression (our own encoder, for test input)."""
    out = bytearray(struct.pack("!6H", msg.id, msg.flags, len(msg.question), 0, 0, 0))
    counts = []
    for rrset in msg.question:
        out += rrset.name.to_wire() + struct.pack("!HH", rrset.rdtype, rrset.rdclass)
    for section in (msg.answer, msg.authority, msg.additional):
        n = 0
        for rrset in section:
            for rd in rrset:
                rdata = rd.to_wire()
                out += rrset.name.to_wire() + struct.pack(
                    "!HHIH", rrset.rdtype, rrset.rdclass, rrset.ttl, len(rdata)
                )
                out += rdata
                n += 1
        counts.append(n)
    struct.pack_into("!3H", out, 6, *counts)
    return bytes(out)


def test_truncate_oversized_opt_options_become_bare_opt() -> None:
    reply, _ = big_reply(1, edns=False)
    opt = b"\x00" + struct.pack("!HHIH", 41, 4096, 0, 604) + struct.pack("!HH", 65001, 600) + b"x" * 600
    data = set_counts(reply, 1, 1, 0, 1) + opt
    out = wire.truncate(data, 512)
    assert len(out) <= 512
    parsed = dns.message.from_wire(out)
    assert parsed.edns == 0 and not parsed.options and parsed.payload == 4096
    assert not parsed.flags & dns.flags.TC  # the answer still fits


def test_truncate_rejects_unparsable_reply() -> None:
    reply, _ = big_reply(100, edns=False)
    with pytest.raises(wire.DnsFormatError):
        wire.truncate(reply[:-3], 512)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.from_regex(r"[a-z]{1,20}", fullmatch=True), min_size=1, max_size=60, unique=True),
    st.sampled_from([512, 700, 1232]),
    st.booleans(),
)
def test_truncate_property_matches_dnspython(labels: list[str], limit: int, edns: bool) -> None:
    query = dns.message.make_query("q.example.", "A", use_edns=0 if edns else False)
    resp = dns.message.make_response(query)
    for i, label in enumerate(labels):
        resp.answer.append(dns.rrset.from_text(f"q{i}.example.", 60, "IN", "CNAME", f"{label}.example."))
        resp.additional.append(dns.rrset.from_text(f"{label}.example.", 60, "IN", "A", f"192.0.2.{i}"))
    data = _uncompressed(resp)
    if edns:
        qd, an, ns, ar = header(data)[2:]
        data = set_counts(data, qd, an, ns, ar + 1) + OPT_ROOT
    out = wire.truncate(data, limit)
    assert len(out) <= limit
    parsed = dns.message.from_wire(out)
    got = [(r.name, rd) for r in parsed.answer + parsed.additional for rd in r]
    want = [(r.name, rd) for r in resp.answer + resp.additional for rd in r]
    assert got == want[: len(got)]
    assert bool(parsed.flags & dns.flags.TC) == (len(got) < len(want))
    assert (parsed.edns == 0) is edns


# --------------------------------------------------------------------------------------------------
# check_reply and ttl_offsets


def upstream_reply() -> tuple[bytes, bytes]:
    query = dns.message.make_query("WWW.example.com.", "A", use_edns=0)
    resp = dns.message.make_response(query)
    resp.answer.append(dns.rrset.from_text("www.example.com.", 120, "IN", "CNAME", "web.example.com."))
    resp.answer.append(
        dns.rrset.from_text_list("web.example.com.", 90, "IN", "A", ["192.0.2.1", "192.0.2.2"])
    )
    resp.authority.append(dns.rrset.from_text("example.com.", 3600, "IN", "NS", "ns.example.com."))
    resp.additional.append(dns.rrset.from_text("ns.example.com.", 45, "IN", "A", "192.0.2.53"))
    return query.to_wire(), resp.to_wire()


def test_check_reply_accepts_real_replies() -> None:
    query, reply = upstream_reply()
    wire.check_reply(query, reply)
    # Case randomisation (0x20) in the echoed question is fine, so is a reply without a question.
    resp = dns.message.from_wire(reply)
    resp.question[0].name = dns.name.from_text("www.EXAMPLE.com.")
    wire.check_reply(query, resp.to_wire())
    wire.check_reply(query, set_counts(reply[:12], 0, 0, 0, 0))


def _outcome(check: object, *args: object) -> str:
    try:
        check(*args)  # type: ignore[operator]
    except wire.DnsFormatError as err:
        return f"rejected: {err}"
    return "accepted"


@settings(max_examples=1500, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), min_size=1, max_size=4),
    st.integers(0, 200),
)
def test_the_fast_reply_walk_decides_as_the_full_parse(changes: list[tuple[int, int]], cut: int) -> None:
    """check_reply's walk (the usual reply) accepts and rejects exactly what the full parse does."""
    query, reply = upstream_reply()
    body_start = len(query) - 11  # the query's question, then its OPT (11 bytes): records follow
    mutated = bytearray(reply)
    for offset, value in changes:  # anything after the question: records, names, pointers, OPT
        mutated[body_start + offset % (len(reply) - body_start)] = value
    data = bytes(mutated[: len(mutated) - cut % 40])
    counts = struct.unpack_from("!3H", data, 6)
    assert _outcome(wire._skip_records, data, body_start, counts) == _outcome(wire._parse, data)


@settings(max_examples=1000, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), max_size=4),
    st.integers(0, 200),
)
def test_a_known_question_decides_as_walking_the_query(changes: list[tuple[int, int]], cut: int) -> None:
    """check_reply given the parsed question (the forwarder's case) decides as when it walks the query."""
    query, reply = upstream_reply()
    mutated = bytearray(reply)
    for offset, value in changes:  # anywhere from the flags on: counts, question, records
        mutated[2 + offset % (len(reply) - 2)] = value
    data = bytes(mutated[: len(mutated) - cut % 40])
    question = wire.parse_query(query).question
    assert _outcome(wire.check_reply, query, data, question) == _outcome(wire.check_reply, query, data)


def _reply_with(query: bytes, body: bytes, counts: tuple[int, int, int, int]) -> bytes:
    return query[:2] + struct.pack("!H", 0x8180) + struct.pack("!4H", *counts) + body


QUESTION = encode_name("a.example.") + struct.pack("!HH", TYPE_A, 1)  # occupies offsets 12..27


@pytest.mark.parametrize(
    ("body", "counts", "why"),
    [
        (
            QUESTION + b"\xc0\x1c" + struct.pack("!HHIH", 1, 1, 5, 4) + b"\x01\x02\x03\x04",
            (1, 1, 0, 0),
            "backwards",
        ),
        (QUESTION + b"\xc0\x0c\xc0\x1c", (1, 1, 0, 0), "past end|backwards"),
        (
            QUESTION + b"\x01x\xc0\x1c" + struct.pack("!HHIH", 1, 1, 5, 4) + b"\x01\x02\x03\x04",
            (1, 1, 0, 0),
            "backwards",
        ),
        (QUESTION + b"\x00" + struct.pack("!HHIH", 1, 1, 5, 9) + b"\x01\x02", (1, 1, 0, 0), "past end"),
        (QUESTION + b"\x00" + struct.pack("!HHIH", 5, 1, 5, 2) + b"\xc0\x30", (1, 1, 0, 0), "backwards"),
        (QUESTION + b"\x41abc\x00" + struct.pack("!HHIH", 1, 1, 5, 0), (1, 1, 0, 0), "label type"),
        (QUESTION, (1, 1, 0, 0), "past end"),
        (QUESTION[:-1], (1, 0, 0, 0), "past end"),
        (encode_name("b.example.") + struct.pack("!HH", TYPE_A, 1), (1, 0, 0, 0), "question"),
        (QUESTION + QUESTION, (2, 0, 0, 0), "question"),
        (QUESTION + OPT_ROOT + OPT_ROOT, (1, 0, 0, 2), "more than one OPT"),
        (QUESTION + OPT_ROOT, (1, 0, 1, 0), "outside the additional"),
    ],
)
def test_check_reply_rejects_malformed(body: bytes, counts: tuple[int, int, int, int], why: str) -> None:
    query = raw_query(encode_name("a.example."))
    reply = _reply_with(query, body, counts)
    with pytest.raises(wire.DnsFormatError, match=why):
        wire.check_reply(query, reply)


def test_check_reply_rejects_loops_long_names_and_mismatches() -> None:
    query, reply = upstream_reply()
    with pytest.raises(wire.DnsFormatError, match="ID"):
        wire.check_reply(query, wire.with_id(reply, (header(reply)[0] + 1) & 0xFFFF))
    with pytest.raises(wire.DnsFormatError, match="QR"):
        wire.check_reply(query, query)
    with pytest.raises(wire.DnsFormatError, match="shorter"):
        wire.check_reply(query, reply[:11])
    # Self-pointer and a two-step loop.
    q = raw_query(encode_name("a.example."))
    for name in (b"\xc0\x1c", b"\x01x\xc0\x1c"):
        with pytest.raises(wire.DnsFormatError, match="backwards"):
            wire.check_reply(
                q, _reply_with(q, QUESTION + name + struct.pack("!HHIH", 1, 1, 5, 0), (1, 1, 0, 0))
            )
    # A name assembled from pointers that exceeds 255 bytes.
    chunk_offsets = []
    body = bytearray(QUESTION)
    for i in range(5):
        chunk_offsets.append(12 + len(body))
        body += b"\x3f" + bytes([97 + i]) * 63
        body += struct.pack("!H", 0xC000 | chunk_offsets[-2]) if i else b"\x00"
        body += struct.pack("!HHIH", 1, 1, 5, 0)
    reply2 = _reply_with(q, bytes(body), (1, 5, 0, 0))
    with pytest.raises(wire.DnsFormatError, match="255"):
        wire.check_reply(q, reply2)


def test_check_reply_bounds_pointer_chains() -> None:
    q = raw_query(encode_name("a.example."))
    # A root-owned record at offset 28 whose opaque rdata is a chain of pointers, each to the one before
    # (the first to that root byte); a second record's owner enters the chain at its far end.
    root = 12 + len(QUESTION)
    rdata_start = root + 1 + 10
    blob = b"".join(
        struct.pack("!H", 0xC000 | (root if i == 0 else rdata_start + 2 * (i - 1))) for i in range(130)
    )
    body = QUESTION + b"\x00" + struct.pack("!HHIH", 99, 1, 5, len(blob)) + blob
    owner = struct.pack("!H", 0xC000 | (rdata_start + 2 * 129))
    reply = _reply_with(q, body + owner + struct.pack("!HHIH", 1, 1, 5, 0), (1, 2, 0, 0))
    with pytest.raises(wire.DnsFormatError, match="too many"):
        wire.check_reply(q, reply)
    # A short chain is a legal (if silly) name.
    owner = struct.pack("!H", 0xC000 | (rdata_start + 2 * 9))
    wire.check_reply(q, _reply_with(q, body + owner + struct.pack("!HHIH", 1, 1, 5, 0), (1, 2, 0, 0)))


def test_ttl_offsets_point_at_every_ttl_except_opt() -> None:
    _, reply = upstream_reply()
    offsets = wire.ttl_offsets(reply)
    assert len(offsets) == 5  # CNAME, 2 A, NS, glue A; not OPT
    assert [struct.unpack_from("!I", reply, o)[0] for o in offsets] == [120, 90, 90, 3600, 45]
    aged = bytearray(reply)
    for o in offsets:
        struct.pack_into("!I", aged, o, 7)
    parsed = dns.message.from_wire(bytes(aged))
    assert {r.ttl for r in parsed.answer + parsed.authority + parsed.additional} == {7}
    assert parsed.edns == 0
    with pytest.raises(wire.DnsFormatError):
        wire.ttl_offsets(reply[:-1])


# --------------------------------------------------------------------------------------------------
# Fuzzing: only the documented exceptions, whatever the input


def _exercise(data: bytes) -> None:
    try:
        q = wire.parse_query(data)
    except wire.Rejected as exc:
        assert exc.rcode in (None, wire.RCODE_FORMERR, wire.RCODE_NOTIMP)
        if exc.rcode is None and len(data) >= 12:
            assert data[2] & 0x80
    else:
        for reply in (wire.local_reply(q, [a_record(HOST, 1)]), wire.servfail(q)):
            wire.check_reply(data, reply)
            assert wire.truncate(reply, 512) is not None
    reply_or_none = wire.error_reply(data, wire.RCODE_FORMERR)
    if reply_or_none is not None:
        assert wire.ttl_offsets(reply_or_none) == []  # well-formed, counts consistent
        assert reply_or_none[:2] == data[:2]
        if (data[2] >> 3) & 0xF == 0:  # dnspython applies UPDATE/zone semantics to other opcodes
            dns.message.from_wire(reply_or_none)
    for fn in (lambda: wire.check_reply(make_query(), data), lambda: wire.truncate(data, 512)):
        with contextlib.suppress(wire.DnsFormatError):
            fn()
    try:
        offsets = wire.ttl_offsets(data)
    except wire.DnsFormatError:
        pass
    else:
        assert all(12 <= o <= len(data) - 4 for o in offsets)


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=600))
def test_fuzz_random_bytes(data: bytes) -> None:
    _exercise(data)


SEEDS = [
    make_query(),
    make_query(use_edns=0, want_dnssec=True, options=[dns.edns.GenericOption(10, b"12345678")]),
    upstream_reply()[1],
    big_reply(40, edns=True)[0],
]


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "set", "cut", "insert", "pointer"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if not data:
            break
        if op == "flip":
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            data[pos] = draw(st.integers(0, 255))
        elif op == "cut":
            del data[pos:]
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=4))
        else:
            data[pos : pos + 2] = struct.pack("!H", 0xC000 | draw(st.integers(0, len(data) + 4)))
    return bytes(data)


@settings(max_examples=1500, deadline=None)
@given(mutated(), st.sampled_from([512, 1232]))
def test_fuzz_mutated_messages(data: bytes, limit: int) -> None:
    _exercise(data)
    try:
        out = wire.truncate(data, limit)
    except wire.DnsFormatError:
        return
    assert out is data or len(out) <= limit


def test_check_reply_compares_the_question_label_by_label() -> None:
    asked = dns.message.make_query(dns.name.Name([b"a.b", b"c", b""]), "A", id=7)
    other = dns.message.make_query(dns.name.Name([b"a", b"b.c", b""]), "A", id=7)  # same text, other labels
    reply = dns.message.make_response(other).to_wire()
    with pytest.raises(wire.DnsFormatError, match="question does not match"):
        wire.check_reply(asked.to_wire(), reply)
    same = dns.message.make_query(dns.name.Name([b"A.B", b"C", b""]), "A", id=7)
    wire.check_reply(asked.to_wire(), dns.message.make_response(same).to_wire())  # case does not matter
