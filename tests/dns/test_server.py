"""The resolver and listeners under hostile input: nothing escapes, nothing sticks, nobody starves."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator
from typing import Any

import dns.asyncquery
import dns.message
import dns.name
import dns.rcode
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from istio_agent.dns import server as dns_server
from istio_agent.dns.server import DnsResolver, DnsServer
from istio_agent.dns.table import LookupTable
from istio_agent.dns.upstream import Forwarder
from istio_agent.dns.wire import Query
from istio_agent.metrics import Registry
from istio_agent.protos import nds_pb2

pytestmark = pytest.mark.both_loops


def table(productpage_ip: str = "10.0.0.1") -> LookupTable:
    name_table = nds_pb2.NameTable()
    info = name_table.table["productpage.ns1.svc.cluster.local"]
    info.ips.extend([productpage_ip])
    info.registry, info.shortname, info.namespace = "Kubernetes", "productpage", "ns1"
    many = name_table.table["many.ns1.svc.cluster.local"]
    many.ips.extend(f"10.1.0.{i}" for i in range(1, 80))
    many.registry = "External"
    return LookupTable.build(
        name_table,
        proxy_namespace="ns1",
        proxy_domain="svc.cluster.local",
        search_domains=["ns1.svc.cluster.local"],
    )


def valid_query() -> bytes:
    return dns.message.make_query("productpage.", "A").to_wire()


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        st.binary(max_size=600),
        st.builds(
            lambda data, index, byte: data[:index] + bytes([byte]) + data[index + 1 :],
            st.just(valid_query()),
            st.integers(0, 40),
            st.integers(0, 255),
        ),
        st.builds(lambda data, cut: data[:cut], st.just(valid_query()), st.integers(0, 40)),
    ),
    st.sampled_from([None, 65535]),
)
def test_any_bytes_get_a_reply_a_query_or_nothing(data: bytes, limit: int | None) -> None:
    resolver = DnsResolver(Forwarder([], registry=Registry()))
    resolver.table = table()
    for _ in range(2):  # the second time through the remembered-reply path
        result = resolver.answer_now(data, limit)
        assert result is None or isinstance(result, bytes | Query)
        if isinstance(result, bytes):
            assert len(result) >= 12 and result[:2] == data[:2]
            assert len(result) <= (limit or 65535)


async def test_repeated_questions_reuse_replies_but_multi_address_answers_still_rotate() -> None:
    resolver = DnsResolver(Forwarder([], registry=Registry()))
    resolver.table = table()
    query = valid_query()
    first = resolver.answer_now(query, None)
    again = resolver.answer_now(b"\xab\xcd" + query[2:], None)
    assert isinstance(first, bytes) and isinstance(again, bytes)
    assert again[:2] == b"\xab\xcd" and again[2:] == first[2:]
    many = dns.message.make_query("many.ns1.svc.cluster.local.", "A", use_edns=0, payload=4096).to_wire()
    orders = {resolver.answer_now(many, None) for _ in range(20)}
    assert len(orders) > 1  # shuffled per query, never frozen into one remembered reply
    resolver.table = table("10.0.0.2")  # a new table forgets the remembered replies
    moved = dns.message.from_wire(resolver.answer_now(query, None))  # type: ignore[arg-type]
    assert [rd.to_text() for rd in moved.answer[0]] == ["10.0.0.2"]


def burst(names: list[str], rdtype: str = "A") -> list[bytes]:
    return [dns.message.make_query(name, rdtype, id=index).to_wire() for index, name in enumerate(names)]


def receive_all(sock: socket.socket, count: int) -> list[bytes]:
    sock.settimeout(5)
    return [sock.recv(65535) for _ in range(count)]


def table_resolver() -> DnsResolver:
    resolver = DnsResolver(Forwarder([], registry=Registry()))  # no upstream: forwarded names get SERVFAIL
    resolver.table = table()
    return resolver


@contextlib.asynccontextmanager
async def serving_on_loopback(resolver: DnsResolver) -> AsyncIterator[tuple[DnsServer, tuple[str, int]]]:
    """A server on a free UDP/TCP port of 127.0.0.1 and its UDP address, stopped afterwards."""
    server = DnsServer(resolver, [("127.0.0.1", 0)], registry=Registry())
    await server.start()
    try:
        yield server, ("127.0.0.1", server.bound[0][2])
    finally:
        await server.stop()


@pytest.mark.parametrize("batching", [True, False], ids=["batches", "one-by-one"])
async def test_a_burst_from_many_clients_gets_every_answer_each_to_its_client(batching: bool) -> None:
    """Queries waiting together are read together: hits, first-time names, errors and forwards mixed."""
    reference = table_resolver()
    names = ["productpage.", "productpage.ns1.", "PRODUCTPAGE.ns1.svc.cluster.local.", "other.example."]
    clients = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(3)]
    async with serving_on_loopback(table_resolver()) as (server, target):
        try:
            for _ in range(2):  # the second time every table question is a remembered reply
                server._udp[0]._batching = batching
                sent: list[list[bytes]] = []
                for client in clients:  # nothing is read until the test yields: they all wait together
                    queries = [*burst(names * 5), b"\x12\x34garbage", b"\x56\x78" + bytes(4999)]
                    for query in queries:
                        client.sendto(query, target)
                    sent.append(queries)
                for client, queries in zip(clients, sent, strict=True):
                    expected = len(queries) - 1  # the garbage is too short to answer
                    replies = await asyncio.to_thread(receive_all, client, expected)
                    by_id = {reply[:2]: reply for reply in replies}
                    assert len(by_id) == expected
                    for query in queries[:-2]:
                        reply = by_id[query[:2]]
                        if b"other" in query:
                            assert dns.message.from_wire(reply).rcode() == dns.rcode.SERVFAIL
                        else:
                            assert reply == reference.answer_now(query, None)  # byte for byte
                    oversized = dns.message.from_wire(by_id[b"\x56\x78"])
                    assert oversized.rcode() == dns.rcode.FORMERR
        finally:
            for client in clients:
                client.close()


async def test_the_listener_batches_under_load_and_goes_back_to_one_by_one() -> None:
    async with serving_on_loopback(table_resolver()) as (server, target):
        listener = server._udp[0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
            assert not listener._batching
            for query in burst(["productpage."] * 10):
                client.sendto(query, target)
            await asyncio.to_thread(receive_all, client, 10)
            assert listener._batching  # more than one was waiting
            client.sendto(valid_query(), target)
            await asyncio.to_thread(receive_all, client, 1)
            assert not listener._batching  # a batch of one: back to plain reads


async def test_without_recvmmsg_the_listener_reads_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dns_server.mmsg, "available", lambda: False)  # as on a 32-bit process or not Linux
    resolver = table_resolver()
    async with serving_on_loopback(resolver) as (server, target):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
            queries = burst(["productpage."] * 10)
            for query in queries:
                client.sendto(query, target)
            replies = await asyncio.to_thread(receive_all, client, 10)
        assert sorted(replies) == sorted(resolver.answer_now(query, None) for query in queries)
        assert not server._udp[0]._batching


@pytest.mark.parametrize("batching", [True, False], ids=["batches", "one-by-one"])
async def test_a_query_that_fails_costs_only_itself(monkeypatch: pytest.MonkeyPatch, batching: bool) -> None:
    resolver = table_resolver()
    real = resolver.forward_soon

    def forward_soon(data: bytes, query: Query, receiver: Any, client: Any) -> bool:
        if query.qname == "broken.example.":
            raise RuntimeError("a bug")
        return real(data, query, receiver, client)

    monkeypatch.setattr(resolver, "forward_soon", forward_soon)
    async with serving_on_loopback(resolver) as (server, target):
        server._udp[0]._batching = batching
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
            for query in burst(["productpage.", "broken.example.", "other.example.", "productpage."]):
                client.sendto(query, target)
            replies = await asyncio.to_thread(receive_all, client, 3)
        assert sorted(reply[:2] for reply in replies) == [b"\x00\x00", b"\x00\x02", b"\x00\x03"]
        assert len(server._pending) == 0  # the failed query did not stay counted as in flight


async def test_a_question_asked_again_skips_the_parse_yet_gets_its_own_id_and_a_new_table() -> None:
    resolver = DnsResolver(Forwarder([], registry=Registry()))
    resolver.table = table()
    query = dns.message.make_query("reviews.ns1.svc.cluster.local.", "A", id=1).to_wire()
    first = resolver.answer_now(query, None)
    assert isinstance(first, Query) and first.id == 1  # not in the table: to be forwarded
    again = resolver.answer_now(b"\x00\x07" + query[2:], None)
    assert isinstance(again, Query) and again.id == 7 and again._replace(id=1) == first
    name_table = nds_pb2.NameTable()
    info = name_table.table["reviews.ns1.svc.cluster.local"]
    info.ips.append("10.0.0.9")
    info.registry, info.shortname, info.namespace = "Kubernetes", "reviews", "ns1"
    resolver.table = LookupTable.build(
        name_table, proxy_namespace="ns1", proxy_domain="svc.cluster.local", search_domains=[]
    )
    answered = resolver.answer_now(b"\x00\x08" + query[2:], None)  # the new table knows it now
    assert isinstance(answered, bytes) and answered[:2] == b"\x00\x08"
    assert [rd.to_text() for rd in dns.message.from_wire(answered).answer[0]] == ["10.0.0.9"]


class Silent(asyncio.DatagramProtocol):
    """A fake upstream that never answers (a remote CA-style outage for DNS)."""


@pytest.fixture
async def silent_upstream() -> AsyncIterator[tuple[str, int]]:
    transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
        Silent, local_addr=("127.0.0.1", 0)
    )
    try:
        yield transport.get_extra_info("sockname")[:2]
    finally:
        transport.close()


async def test_a_flood_of_forwarded_queries_does_not_starve_table_answers(
    silent_upstream: tuple[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dns_server, "MAX_PENDING_FORWARDS", 50)
    forwarder = Forwarder([silent_upstream], timeout=5, registry=Registry())
    resolver = DnsResolver(forwarder)
    resolver.table = table()
    server = DnsServer(resolver, [("127.0.0.1", 0)], registry=Registry())
    await server.start()
    try:
        udp_port = server.bound[0][2]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as flood:
            for index in range(500):  # each waits 5 s for the silent upstream
                query = dns.message.make_query(f"name{index}.example.", "A")
                flood.sendto(query.to_wire(), ("127.0.0.1", udp_port))
        await asyncio.sleep(0.2)
        assert len(server._pending) <= 50  # bounded: the rest were dropped, not queued
        reply = await dns.asyncquery.udp(
            dns.message.make_query("productpage.", "A"), "127.0.0.1", port=udp_port, timeout=2
        )
        assert reply.rcode() == dns.rcode.NOERROR and reply.answer
    finally:
        await server.stop()
        forwarder.close()


async def test_tcp_garbage_and_stalls_cost_only_their_own_connection() -> None:
    resolver = DnsResolver(Forwarder([], registry=Registry()))
    resolver.table = table()
    server = DnsServer(resolver, [("127.0.0.1", 0)], registry=Registry())
    await server.start()
    try:
        tcp_port = server.bound[1][2]
        reader, writer = await asyncio.open_connection("127.0.0.1", tcp_port)
        writer.write(struct.pack("!H", 5) + b"\x00\x01\x02\x03\x04")  # a "query" shorter than a header
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 5) == b""  # dropped: the stream cannot be trusted
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", tcp_port)
        zero_questions = struct.pack("!HHHHHH", 7, 0x0100, 0, 0, 0, 0)
        writer.write(struct.pack("!H", len(zero_questions)) + zero_questions + b"\x00\x00")
        await writer.drain()
        length = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), 5))[0]
        reply = await reader.readexactly(length)
        assert reply[:2] == b"\x00\x07" and reply[3] & 0x0F == dns.rcode.FORMERR
        writer.close()
        query = dns.message.make_query("productpage.", "A")
        answer = await dns.asyncquery.tcp(query, "127.0.0.1", port=tcp_port, timeout=2)
        assert answer.answer
    finally:
        await server.stop()


def test_before_the_first_table_queries_get_servfail_or_go_upstream_on_port_53_as_root() -> None:
    query = valid_query()
    waiting = DnsResolver(Forwarder([], registry=Registry()))
    reply = waiting.answer_now(query, None)
    assert isinstance(reply, bytes) and reply[3] & 0x0F == dns.rcode.SERVFAIL
    forwarding = DnsResolver(Forwarder([], registry=Registry()), respond_before_sync=True)  # ":53" as root
    assert isinstance(forwarding.answer_now(query, None), Query)


def serving() -> list[asyncio.Task[object]]:
    """The DNS server's TCP connection handlers still running."""
    return [
        task
        for task in asyncio.all_tasks()
        if not task.done() and getattr(task.get_coro(), "__qualname__", "") == "DnsServer._serve_tcp"
    ]


async def test_a_tcp_client_that_stops_reading_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dns_server, "TCP_READ_TIMEOUT", 0.3)
    monkeypatch.setattr(dns_server, "TCP_CLOSE_TIMEOUT", 0.3)
    name_table = nds_pb2.NameTable()
    info = name_table.table["big.example"]
    info.ips.extend(f"10.{i >> 8}.{i & 255}.1" for i in range(3000))
    info.registry = "External"
    resolver = DnsResolver(Forwarder([], registry=Registry()))
    resolver.table = LookupTable.build(name_table, proxy_namespace="", proxy_domain="", search_domains=[])
    server = DnsServer(resolver, [("127.0.0.1", 0)], registry=Registry())
    await server.start()
    clients = []
    try:
        query = dns.message.make_query("big.example.", "A").to_wire()
        for _ in range(3):  # each asks for ~50 KiB answers 128 times and never reads one
            client = socket.socket()
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            client.connect(("127.0.0.1", server.bound[1][2]))
            client.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                client.send((struct.pack("!H", len(query)) + query) * 128)
            clients.append(client)
        await asyncio.sleep(0.2)
        assert len(serving()) == 3
        for _ in range(50):
            if not serving():
                break
            await asyncio.sleep(0.1)
        assert not serving() and not server._connections  # dropped once writes stalled, not left waiting
    finally:
        await asyncio.wait_for(server.stop(), 5)
        for client in clients:
            client.close()


def test_odd_labels_never_match_a_wildcard_and_go_upstream() -> None:
    name_table = nds_pb2.NameTable()
    for host, ip in (("*.wildcard", "10.0.0.1"), ("*.foo.wildcard", "10.0.0.2")):
        name_table.table[host].ips.append(ip)
        name_table.table[host].registry = "External"
    resolver = DnsResolver(Forwarder([], registry=Registry()))
    resolver.table = LookupTable.build(name_table, proxy_namespace="", proxy_domain="", search_domains=[])
    plain = resolver.answer_now(dns.message.make_query("x.foo.wildcard.", "A").to_wire(), None)
    assert isinstance(plain, bytes) and "10.0.0.2" in dns.message.from_wire(plain).to_text()
    for labels in ([b"x.foo", b"wildcard"], [b"\xff", b"wildcard"], [b"\\" * 63, b"wildcard"]):
        name = dns.name.Name([*labels, b""])
        result = resolver.answer_now(dns.message.make_query(name, "A").to_wire(), None)
        assert isinstance(result, Query)  # forwarded, never a wrong wildcard or an exception
