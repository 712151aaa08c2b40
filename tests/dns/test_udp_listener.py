"""UDP table hits answered on the listener thread: the same bytes as the event loop's path, misses
handed over to the loop, counted in the metrics, and a thread that stops with the server."""

from __future__ import annotations

import asyncio
import socket
import threading

import dns.edns
import dns.flags
import dns.message
import dns.rcode
import pytest

from istio_agent.dns.server import DnsResolver, DnsServer
from istio_agent.dns.table import LookupTable
from istio_agent.dns.upstream import Forwarder
from istio_agent.metrics import Registry
from istio_agent.protos import nds_pb2

pytestmark = pytest.mark.both_loops


def table() -> LookupTable:
    name_table = nds_pb2.NameTable()
    info = name_table.table["productpage.ns1.svc.cluster.local"]
    info.ips.extend(["10.0.0.1"])
    info.registry, info.shortname, info.namespace = "Kubernetes", "productpage", "ns1"
    big = name_table.table["big.ns1.svc.cluster.local"]
    big.ips.extend(f"fd00::{i:x}" for i in range(1, 60))  # rotated, and too big for 512 bytes
    big.registry, big.shortname, big.namespace = "Kubernetes", "big", "ns1"
    return LookupTable.build(
        name_table,
        proxy_namespace="ns1",
        proxy_domain="svc.cluster.local",
        search_domains=["ns1.svc.cluster.local"],
    )


async def exchange(port: int, query: bytes) -> bytes:
    """Send one datagram, wait for one (blocking socket in a thread: the test must not need the loop)."""

    def ask() -> bytes:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
            client.settimeout(3)
            client.sendto(query, ("127.0.0.1", port))
            return client.recv(65535)

    return await asyncio.to_thread(ask)


def hits(server: DnsServer) -> int:
    return sum(listener.counts.total() for listener in server._udp)


QUERIES = [
    dns.message.make_query("productpage.ns1.svc.cluster.local.", "A"),
    dns.message.make_query("PrOdUcTpAgE.", "A"),  # case is echoed from the question
    dns.message.make_query("productpage.", "A", use_edns=0, payload=1232),  # OPT in the reply
    dns.message.make_query("productpage.", "A", use_edns=0, options=[dns.edns.ECSOption("10.0.0.0", 8)]),
    dns.message.make_query("productpage.", "AAAA"),  # NOERROR, no data
]


async def test_thread_answers_are_the_bytes_the_loop_built_for_the_first_question() -> None:
    resolver = DnsResolver(Forwarder([]))
    resolver.table = table()
    reference = DnsResolver(Forwarder([]))  # what the event-loop path answers, computed directly
    reference.table = table()
    server = DnsServer(resolver, [("127.0.0.1", 0)], registry=Registry())
    await server.start()
    try:
        port = server.bound[0][2]
        for query in QUERIES:
            wire = bytearray(query.to_wire())
            before = hits(server)
            for query_id in (0x1234, 0xBEEF, 0x0001):
                wire[:2] = query_id.to_bytes(2, "big")
                expected = reference.answer_now(bytes(wire), None)
                assert isinstance(expected, bytes)
                assert await exchange(port, bytes(wire)) == expected
            assert hits(server) == before + 2  # the first went through the loop, the repeats not
        before = hits(server)
        for payload in (None, 4096):  # several addresses are rotated: always built anew, on the loop
            big = dns.message.make_query("big.", "AAAA", use_edns=payload is not None, payload=payload or 512)
            reply = dns.message.from_wire(await exchange(port, big.to_wire()))
            assert bool(reply.flags & dns.flags.TC) == (payload is None)
        assert hits(server) == before
    finally:
        await server.stop()


async def test_misses_are_handed_to_the_loop_and_everything_is_counted() -> None:
    registry = Registry()
    resolver = DnsResolver(Forwarder([], timeout=0.3))
    resolver.table = table()
    server = DnsServer(resolver, [("127.0.0.1", 0)], registry=registry)
    await server.start()
    try:
        port = server.bound[0][2]
        known = QUERIES[0].to_wire()
        for _ in range(3):
            await exchange(port, known)
        unknown = dns.message.make_query("elsewhere.example.", "A").to_wire()
        reply = dns.message.from_wire(await exchange(port, unknown))  # no upstream: SERVFAIL from the loop
        assert reply.rcode() == dns.rcode.SERVFAIL
        assert hits(server) == 2
        text = registry.expose().decode()
        assert "dns_requests_total 4.0\n" in text  # two hits on the thread, two on the loop
        assert 'qtype="A",rcode="NOERROR",source="table"} 3.0\n' in text
        assert 'qtype="A",rcode="SERVFAIL",source="upstream"} 1.0\n' in text
    finally:
        await server.stop()
    stats = resolver.stats
    assert stats.listener_counts == [] and stats.requests == 4  # folded in: totals never go back


async def test_stop_joins_the_thread_and_frees_the_port() -> None:
    resolver = DnsResolver(Forwarder([]))
    resolver.table = table()
    server = DnsServer(resolver, [("127.0.0.1", 0)], registry=Registry())
    await server.start()
    port = server.bound[0][2]
    listeners = list(server._udp)
    names = {thread.name for thread in threading.enumerate()}
    assert f"dns-udp-{port}" in names
    await exchange(port, QUERIES[0].to_wire())
    await server.stop()
    assert not any(listener.running for listener in listeners)
    assert f"dns-udp-{port}" not in {thread.name for thread in threading.enumerate()}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as again:
        again.bind(("127.0.0.1", port))
