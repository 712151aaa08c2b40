"""The answer cache: what is cached, for how long, and how hits come back (injected clock)."""

from __future__ import annotations

from typing import Any

import dns.edns
import dns.flags
import dns.message
import dns.rcode
import dns.rrset
import pytest

from istio_agent.dns.cache import AnswerCache, cacheable_ttl
from istio_agent.dns.wire import Query, parse_query
from istio_agent.metrics import Registry
from tests.dns import sample

SOA = "ns1.example.com. hostmaster.example.com. 1 7200 900 1209600 {minimum}"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def query(name: str = "www.example.com.", qtype: str = "A", qid: int = 1, **kw: Any) -> bytes:
    return dns.message.make_query(name, qtype, id=qid, **kw).to_wire()


def parsed(name: str = "www.example.com.", qtype: str = "A", qid: int = 1, **kw: Any) -> Query:
    return parse_query(query(name, qtype, qid, **kw))


def reply(
    request: bytes,
    *,
    answers: tuple[tuple[int, str, str], ...] = ((300, "A", "10.0.0.1"),),
    soa: tuple[int, int] | None = None,
    rcode: int = dns.rcode.NOERROR,
    tc: bool = False,
) -> bytes:
    """A reply to ``request``: ``answers`` as (ttl, type, rdata); ``soa`` as (ttl, minimum) in authority."""
    message = dns.message.from_wire(request)
    response = dns.message.make_response(message)
    response.set_rcode(rcode)
    name = message.question[0].name
    for ttl, rtype, rdata in answers:
        response.answer.append(dns.rrset.from_text(name, ttl, "IN", rtype, rdata))
    if soa is not None:
        ttl, minimum = soa
        response.authority.append(
            dns.rrset.from_text("example.com.", ttl, "IN", "SOA", SOA.format(minimum=minimum))
        )
    if tc:
        response.flags |= dns.flags.TC
    return response.to_wire()


def ttls(message: bytes) -> list[int]:
    decoded = dns.message.from_wire(message)
    return [rrset.ttl for section in (decoded.answer, decoded.authority) for rrset in section]


def test_hit_has_the_clients_id_and_ttls_aged_in_whole_seconds() -> None:
    clock = Clock()
    cache = AnswerCache(clock=clock, registry=Registry())
    cache.put(parsed(qid=7), reply(query(qid=7)))

    hit = cache.get(parsed(qid=0xABCD))
    assert hit is not None
    assert hit[:2] == b"\xab\xcd"
    assert ttls(hit) == [300]

    clock.now += 10.9
    hit = cache.get(parsed(qid=2))
    assert hit is not None
    assert ttls(hit) == [290]  # whole seconds elapsed, rounded down
    assert [r.address for r in dns.message.from_wire(hit).answer[0]] == ["10.0.0.1"]

    clock.now += 289  # 299.9 s after the answer came
    assert cache.get(parsed()) is not None
    clock.now += 0.1  # 300 s: expired
    assert cache.get(parsed()) is None
    assert len(cache) == 0


def test_entry_lives_for_the_smallest_ttl() -> None:
    clock = Clock()
    cache = AnswerCache(clock=clock, registry=Registry())
    q = query("multi.example.com.")
    cache.put(parse_query(q), reply(q, answers=((300, "A", "10.0.0.1"), (40, "TXT", '"x"'))))
    clock.now += 39.5
    hit = cache.get(parse_query(q))
    assert hit is not None
    assert sorted(ttls(hit)) == [1, 261]
    clock.now += 0.5
    assert cache.get(parse_query(q)) is None


def test_nxdomain_lives_for_the_soa_minimum() -> None:
    clock = Clock()
    cache = AnswerCache(clock=clock, registry=Registry())
    q = query("nope.example.com.")
    cache.put(parse_query(q), reply(q, answers=(), soa=(600, 60), rcode=dns.rcode.NXDOMAIN))
    clock.now += 30
    hit = cache.get(parse_query(q))
    assert hit is not None
    decoded = dns.message.from_wire(hit)
    assert decoded.rcode() == dns.rcode.NXDOMAIN
    # The SOA is served with the negative lifetime min(600, 60), aged: a client caching the NXDOMAIN
    # for min(SOA TTL, MINIMUM) keeps it no longer than the upstream allowed in total.
    assert decoded.authority[0].ttl == 30
    assert decoded.authority[0][0].minimum == 60  # the SOA's data is untouched
    clock.now += 30
    assert cache.get(parse_query(q)) is None


def test_nodata_lives_for_the_soa_ttl_when_smaller() -> None:
    clock = Clock()
    cache = AnswerCache(clock=clock, registry=Registry())
    q = query("v4only.example.com.", "AAAA")
    cache.put(parse_query(q), reply(q, answers=(), soa=(20, 3600)))
    clock.now += 19.9
    assert cache.get(parse_query(q)) is not None
    clock.now += 0.1
    assert cache.get(parse_query(q)) is None


@pytest.mark.parametrize(
    "kind",
    ["nxdomain-without-soa", "nodata-without-soa", "servfail", "refused", "truncated", "zero-ttl", "garbage"],
)
def test_not_cached(kind: str) -> None:
    q = query()
    message = {
        "nxdomain-without-soa": lambda: reply(q, answers=(), rcode=dns.rcode.NXDOMAIN),
        "nodata-without-soa": lambda: reply(q, answers=()),
        "servfail": lambda: reply(q, answers=(), rcode=dns.rcode.SERVFAIL),
        "refused": lambda: reply(q, answers=(), rcode=dns.rcode.REFUSED),
        "truncated": lambda: reply(q, tc=True),
        "zero-ttl": lambda: reply(q, answers=((0, "A", "10.0.0.1"),)),
        "garbage": lambda: q[:2] + b"\x81\x80" + b"\x00\x01" * 4 + b"\xff" * 7,
    }[kind]()
    cache = AnswerCache(registry=Registry())
    assert cacheable_ttl(message) is None
    cache.put(parse_query(q), message)
    assert len(cache) == 0
    assert cache.get(parse_query(q)) is None


def test_key_is_case_insensitive_and_echoes_the_clients_case() -> None:
    cache = AnswerCache(clock=Clock(), registry=Registry())
    cache.put(parsed("www.example.com."), reply(query("www.example.com.")))
    hit = cache.get(parsed("WwW.ExAmPlE.cOm.", qid=9))
    assert hit is not None
    assert str(dns.message.from_wire(hit).question[0].name) == "WwW.ExAmPlE.cOm."


def test_key_separates_type_class_do_bit_and_edns() -> None:
    cache = AnswerCache(clock=Clock(), registry=Registry())
    plain = query()
    cache.put(parse_query(plain), reply(plain))
    assert cache.get(parsed(qtype="AAAA")) is None
    assert (
        cache.get(parse_query(dns.message.make_query("www.example.com.", "A", "CH", id=1).to_wire())) is None
    )
    assert cache.get(parsed(use_edns=0)) is None  # no OPT came back for a query without one
    assert cache.get(parsed(use_edns=0, want_dnssec=True)) is None
    assert cache.get(parsed("other.example.com.")) is None
    assert cache.get(parsed()) is not None


def test_opt_record_is_not_aged() -> None:
    clock = Clock()
    cache = AnswerCache(clock=clock, registry=Registry())
    q = query(use_edns=0, want_dnssec=True, payload=1232)
    response = dns.message.make_response(dns.message.from_wire(q))
    response.answer.append(dns.rrset.from_text("www.example.com.", 300, "IN", "A", "10.0.0.1"))
    response.use_edns(0, dns.flags.DO, 1232)
    cache.put(parse_query(q), response.to_wire())
    clock.now += 100
    hit = cache.get(parse_query(q))
    assert hit is not None
    decoded = dns.message.from_wire(hit)
    assert decoded.answer[0].ttl == 200
    assert decoded.ednsflags & dns.flags.DO  # the OPT "TTL" (flags) was left alone
    assert decoded.edns == 0 and decoded.payload == 1232


def test_bounded_size_evicts_the_oldest() -> None:
    cache = AnswerCache(max_entries=2, clock=Clock(), registry=Registry())
    names = ["a.example.", "b.example.", "c.example."]
    for name in names:
        cache.put(parsed(name), reply(query(name)))
    assert len(cache) == 2
    assert cache.get(parsed("a.example.")) is None
    assert cache.get(parsed("b.example.")) is not None
    assert cache.get(parsed("c.example.")) is not None


def test_replacing_an_entry_refreshes_it() -> None:
    clock = Clock()
    cache = AnswerCache(max_entries=2, clock=clock, registry=Registry())
    cache.put(parsed("a.example."), reply(query("a.example."), answers=((10, "A", "10.0.0.1"),)))
    cache.put(parsed("b.example."), reply(query("b.example.")))
    clock.now += 5
    cache.put(parsed("a.example."), reply(query("a.example."), answers=((10, "A", "10.0.0.2"),)))
    cache.put(parsed("c.example."), reply(query("c.example.")))  # evicts b, now the oldest
    assert cache.get(parsed("b.example.")) is None
    hit = cache.get(parsed("a.example."))
    assert hit is not None
    assert ttls(hit) == [10]
    assert [r.address for r in dns.message.from_wire(hit).answer[0]] == ["10.0.0.2"]


def test_hit_and_miss_counters() -> None:
    registry = Registry()
    cache = AnswerCache(clock=Clock(), registry=registry)
    hits, misses = sample(registry, "dns_cache_hits_total"), sample(registry, "dns_cache_misses_total")
    assert cache.get(parsed("count.example.")) is None
    cache.put(parsed("count.example."), reply(query("count.example.")))
    assert cache.get(parsed("count.example.")) is not None
    assert cache.get(parsed("count.example.")) is not None
    assert sample(registry, "dns_cache_hits_total") == hits + 2
    assert sample(registry, "dns_cache_misses_total") == misses + 1


def test_bad_size_is_rejected() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        AnswerCache(max_entries=0, registry=Registry())


def test_cd_bit_and_edns_options_keep_replies_apart() -> None:
    cache = AnswerCache(registry=Registry())
    plain = query("www.example.com.")
    cache.put(parse_query(plain), reply(plain))
    checking_disabled = dns.message.make_query("www.example.com.", "A")
    checking_disabled.flags |= dns.flags.CD
    assert cache.get(parse_query(checking_disabled.to_wire())) is None
    with_cookie = dns.message.make_query(
        "cookie.example.com.", "A", use_edns=0, options=[dns.edns.GenericOption(10, b"12345678")]
    ).to_wire()
    cache.put(parse_query(with_cookie), reply(with_cookie))
    assert len(cache) == 1  # a reply to a query with EDNS options is that client's own
