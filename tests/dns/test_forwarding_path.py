"""A forwarded UDP query end to end through the listener's short path, on real loopback sockets.

The path (listener → forwarder → pool → upstream, and back) is one chain of calls per query; these
tests pin what it must keep from the layered path it replaced: the servers' order and failover after
a timeout, SERVFAIL when every server failed, the client's size limit (TC, so the client retries
over TCP), the bound on queries in flight, and every metric counted once per query.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import dns.flags
import dns.message
import dns.rcode
import pytest

from istio_agent.dns.cache import AnswerCache
from istio_agent.dns.server import DnsResolver, DnsServer
from istio_agent.dns.table import LookupTable
from istio_agent.dns.upstream import Forwarder
from istio_agent.metrics import PREFIX, Registry
from istio_agent.protos import nds_pb2
from tests.dns.test_upstream import FakeUpstream, answer, fixed_ids, silent

pytestmark = pytest.mark.both_loops


def empty_table() -> LookupTable:
    return LookupTable.build(
        nds_pb2.NameTable(), proxy_namespace="ns1", proxy_domain="svc.cluster.local", search_domains=()
    )


@pytest.fixture
async def fakes() -> AsyncIterator[Callable[..., Any]]:
    started: list[FakeUpstream] = []

    async def make(respond: Any, **kw: Any) -> FakeUpstream:
        fake = FakeUpstream(respond, **kw)
        await fake.start()
        started.append(fake)
        return fake

    yield make
    for fake in started:
        await fake.stop()


@asynccontextmanager
async def serving(
    forwarder: Forwarder, registry: Registry
) -> AsyncIterator[tuple[DnsServer, tuple[str, int]]]:
    resolver = DnsResolver(forwarder)
    resolver.table = empty_table()
    server = DnsServer(resolver, [("127.0.0.1", 0)], registry=registry)
    await server.start()
    try:
        yield server, ("127.0.0.1", server.bound[0][2])
    finally:
        stats = resolver.stats
        await server.stop()  # (unregisters the resolver's counters: keep them readable for the test)
        registry.register(stats)
        forwarder.close()


async def ask(
    target: tuple[str, int], query: dns.message.Message, timeout: float = 3.0
) -> dns.message.Message:
    def exchange() -> bytes:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
            client.settimeout(timeout)
            client.sendto(query.to_wire(), target)
            return client.recv(65535)

    return dns.message.from_wire(await asyncio.to_thread(exchange), ignore_trailing=True)


def metric(registry: Registry, name: str, **labels: str) -> float:
    return registry.sample(PREFIX + name, labels or None) or 0.0


async def test_failover_in_order_after_a_timeout_and_each_metric_once(fakes: Any) -> None:
    quiet, good = await fakes(silent), await fakes(answer("10.0.0.2"))
    registry = Registry()
    # fixed_ids(1) pins Istio's per-query shuffle of two servers to: the quiet one first.
    forwarder = Forwarder([quiet.address, good.address], timeout=0.2, next_id=fixed_ids(1), registry=registry)
    async with serving(forwarder, registry) as (_, target):
        query = dns.message.make_query("www.example.com.", "A", id=0x4242)
        reply = await ask(target, query)
    assert reply.id == 0x4242 and reply.rcode() == dns.rcode.NOERROR
    assert [rdata.address for rrset in reply.answer for rdata in rrset] == ["10.0.0.2"]
    assert len(quiet.queries) == 1 and len(good.queries) == 1  # one attempt each, the quiet one first
    assert metric(registry, "dns_requests_total") == 1
    assert metric(registry, "dns_upstream_requests_total") == 1  # once per client query, not per attempt
    assert metric(registry, "dns_upstream_failures_total") == 0
    assert metric(registry, "dns_upstream_request_duration_seconds_count") == 1
    assert metric(registry, "dns_upstream_request_duration_seconds_sum") >= 0.15  # the timeout is in it
    assert metric(registry, "dns_queries_total", qtype="A", rcode="NOERROR", source="upstream") == 1


async def test_every_server_failing_gives_servfail_and_counts_a_failure(fakes: Any) -> None:
    first, second = await fakes(silent), await fakes(silent)
    registry = Registry()
    forwarder = Forwarder([first.address, second.address], timeout=0.1, registry=registry)
    async with serving(forwarder, registry) as (server, target):
        query = dns.message.make_query("gone.example.com.", "AAAA", id=7)
        reply = await ask(target, query)
        assert len(server._pending) == 0  # nothing left counted in flight
    assert reply.id == 7 and reply.rcode() == dns.rcode.SERVFAIL
    assert len(first.queries) == 1 and len(second.queries) == 1
    assert metric(registry, "dns_upstream_requests_total") == 1
    assert metric(registry, "dns_upstream_failures_total") == 1
    assert metric(registry, "dns_queries_total", qtype="AAAA", rcode="SERVFAIL", source="upstream") == 1


async def test_a_reply_over_the_clients_limit_is_cut_with_tc_for_a_tcp_retry(fakes: Any) -> None:
    many = tuple(f"198.51.100.{i}" for i in range(1, 61))  # 60 A records: over 512 bytes
    upstream = await fakes(answer(*many))
    registry = Registry()
    forwarder = Forwarder([upstream.address], timeout=1, registry=registry)
    async with serving(forwarder, registry) as (_, target):
        plain = await ask(target, dns.message.make_query("many.example.com.", "A", id=1))
        big = await ask(
            target, dns.message.make_query("many.example.com.", "A", id=2, use_edns=0, payload=4096)
        )
    assert plain.flags & dns.flags.TC and len(plain.to_wire()) <= 512 and plain.rcode() == dns.rcode.NOERROR
    assert not big.flags & dns.flags.TC and len(big.answer[0]) == 60
    assert metric(registry, "dns_queries_total", qtype="A", rcode="NOERROR", source="upstream") == 2


async def test_replies_reach_each_client_when_many_are_in_flight(fakes: Any) -> None:
    upstream = await fakes(answer("10.9.9.9"), delay=0.05)
    registry = Registry()
    forwarder = Forwarder([upstream.address], timeout=2, registry=registry)
    async with serving(forwarder, registry) as (server, target):
        queries = [dns.message.make_query(f"n{i}.example.com.", "A", id=i) for i in range(40)]
        replies = await asyncio.gather(*(ask(target, query) for query in queries))
        assert len(server._pending) == 0
    assert sorted(reply.id for reply in replies) == list(range(40))
    assert all(str(reply.question[0].name) == f"n{reply.id}.example.com." for reply in replies)
    assert metric(registry, "dns_upstream_requests_total") == 40


async def test_a_question_asked_again_goes_upstream_with_its_own_id_until_the_table_knows_it(
    fakes: Any,
) -> None:
    """The listener forwards a question it has forwarded before without asking the resolver again:
    each client still gets its own ID, each query is counted, and once the table knows the name
    (a new NDS push) the same question is answered from the table and not forwarded."""
    upstream = await fakes(answer("10.0.0.9"))
    registry = Registry()
    forwarder = Forwarder([upstream.address], timeout=1, registry=registry)
    async with serving(forwarder, registry) as (server, target):
        first = await ask(target, dns.message.make_query("later.ns1.svc.cluster.local.", "A", id=11))
        again = await ask(target, dns.message.make_query("later.ns1.svc.cluster.local.", "A", id=12))
        assert [first.id, again.id] == [11, 12] and len(upstream.queries) == 2
        assert metric(registry, "dns_requests_total") == 2
        assert metric(registry, "dns_queries_total", qtype="A", rcode="NOERROR", source="upstream") == 2
        table = nds_pb2.NameTable()
        table.table["later.ns1.svc.cluster.local"].ips.append("10.1.1.1")
        server.resolver.table = LookupTable.build(
            table, proxy_namespace="ns1", proxy_domain="svc.cluster.local", search_domains=()
        )
        local = await ask(target, dns.message.make_query("later.ns1.svc.cluster.local.", "A", id=13))
    assert local.id == 13 and [r.address for rrset in local.answer for r in rrset] == ["10.1.1.1"]
    assert len(upstream.queries) == 2  # not forwarded any more
    assert metric(registry, "dns_requests_total") == 3


async def test_with_dns_cache_a_question_asked_again_is_a_cache_hit(fakes: Any) -> None:
    """DNS_CACHE: the listener's shortcut for known questions must not skip the cache."""
    upstream = await fakes(answer("10.0.0.8"))
    registry = Registry()
    forwarder = Forwarder(
        [upstream.address], timeout=1, cache=AnswerCache(registry=registry), registry=registry
    )
    async with serving(forwarder, registry) as (_, target):
        first = await ask(target, dns.message.make_query("cached.example.com.", "A", id=21))
        again = await ask(target, dns.message.make_query("cached.example.com.", "A", id=22))
    assert [first.id, again.id] == [21, 22] and len(upstream.queries) == 1
    assert metric(registry, "dns_queries_total", qtype="A", rcode="NOERROR", source="cache") == 1
