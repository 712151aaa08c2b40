"""The tools' DNS client: decoding answers, and asking a real server."""

from __future__ import annotations

import socket

import dns.flags
import dns.message
import dns.rrset

from istio_agent.dns.client import AnswerRecord, decode, lookup
from istio_agent.dns.records import TYPE_A, TYPE_AAAA, TYPE_CNAME, TYPE_TXT
from tests.fixtures.dnsmasq import DnsAddress


def test_decode_reads_rcode_aa_and_answers() -> None:
    reply = dns.message.make_response(dns.message.make_query("a.example.", "A"))
    reply.flags |= dns.flags.AA
    for rdtype, rdata in (("CNAME", "b.example."), ("A", "10.0.0.1"), ("AAAA", "fd00::1"), ("TXT", '"hi"')):
        reply.answer.append(dns.rrset.from_text("a.example.", 30, "IN", rdtype, rdata))
    decoded = decode(reply.to_wire())
    assert decoded.rcode == 0 and decoded.authoritative
    assert decoded.answers == [
        AnswerRecord("a.example.", TYPE_CNAME, 30, "b.example."),
        AnswerRecord("a.example.", TYPE_A, 30, "10.0.0.1"),
        AnswerRecord("a.example.", TYPE_AAAA, 30, "fd00::1"),
        AnswerRecord("a.example.", TYPE_TXT, 30, b"\x02hi".hex()),
    ]


def test_lookup_against_dnsmasq_and_a_silent_port(dnsmasq_upstream: DnsAddress) -> None:
    answer = lookup(*dnsmasq_upstream, "www.upstream.test")
    assert answer is not None and [r.value for r in answer.answers] == ["192.0.2.10"]
    missing = lookup(*dnsmasq_upstream, "nowhere.upstream.test")
    assert missing is not None and missing.rcode == 3 and not missing.answers
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:
        silent.bind(("127.0.0.1", 0))
        assert lookup("127.0.0.1", silent.getsockname()[1], "x.example", timeout=0.2) is None
