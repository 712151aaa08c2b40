"""The DNS proxy as the agent runs it: real UDP/TCP listeners, a real dnsmasq upstream, dnspython as the client."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import dns.asyncquery
import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import pytest

from istio_agent.config.dns import DnsSettings
from istio_agent.dns.proxy import BUILD_IN_THREAD_FROM, SAVED_TABLE, DnsProxy, DnsStartError, listen_addresses
from istio_agent.dns.resolvconf import ResolvConf
from istio_agent.metrics import Registry
from istio_agent.protos import nds_pb2
from tests.dns import sample
from tests.dns.conftest import MANY_COUNT, MANY_NAME

pytestmark = pytest.mark.both_loops


NAMESPACE = "ns1"


def name_table() -> nds_pb2.NameTable:
    table = nds_pb2.NameTable()
    for host, ips in {
        "productpage.ns1.svc.cluster.local": ["10.0.0.1"],
        "reviews.ns2.svc.cluster.local": ["10.0.0.2", "fd00::2"],
    }.items():
        info = table.table[host]
        info.ips.extend(ips)
        info.registry = "Kubernetes"
        info.shortname, info.namespace = host.split(".")[:2]
    table.table["www.mesh.example"].ips.append("10.0.0.3")
    table.table["www.mesh.example"].registry = "External"
    return table


def settings(resolv_conf: Path, **overrides: object) -> DnsSettings:
    values: dict[str, object] = {
        "enabled": True,
        "listen_address": "127.0.0.1:0",
        "resolv_conf": resolv_conf,
        "forward_timeout": 2.0,
        "proxy_namespace": NAMESPACE,
        "proxy_domain": "svc.cluster.local",
    }
    values.update(overrides)
    return DnsSettings(**values)  # type: ignore[arg-type]


@pytest.fixture
def registry() -> Registry:
    return Registry()


@pytest.fixture
async def proxy(upstream_resolv_conf: Path, tmp_path: Path, registry: Registry) -> AsyncIterator[DnsProxy]:
    dns_proxy = DnsProxy(settings(upstream_resolv_conf), workdir=tmp_path, registry=registry)
    await dns_proxy.start()
    try:
        yield dns_proxy
    finally:
        await dns_proxy.stop()


def ports(proxy: DnsProxy) -> tuple[int, int]:
    assert proxy.server is not None
    bound = {protocol: port for protocol, _, port in proxy.server.bound}
    return bound["udp"], bound["tcp"]


async def ask(
    proxy: DnsProxy, name: str, rdtype: str = "A", *, tcp: bool = False, **kwargs: object
) -> dns.message.Message:
    udp_port, tcp_port = ports(proxy)
    query = dns.message.make_query(name, rdtype, **kwargs)  # type: ignore[arg-type]
    if tcp:
        return await dns.asyncquery.tcp(query, "127.0.0.1", port=tcp_port, timeout=5)
    return await dns.asyncquery.udp(query, "127.0.0.1", port=udp_port, timeout=5)


def addresses(reply: dns.message.Message) -> list[str]:
    return sorted(rd.to_text() for rrset in reply.answer for rd in rrset if rrset.rdtype in (1, 28))


async def test_before_the_first_table_mesh_names_get_servfail(proxy: DnsProxy) -> None:
    reply = await ask(proxy, "productpage.")
    assert reply.rcode() == dns.rcode.SERVFAIL and not proxy.ready


@pytest.mark.parametrize("tcp", [False, True], ids=["udp", "tcp"])
async def test_mesh_names_from_the_table_and_the_rest_from_upstream(proxy: DnsProxy, tcp: bool) -> None:
    proxy.update(name_table())
    short = await ask(proxy, "productpage.", tcp=tcp)
    assert addresses(short) == ["10.0.0.1"]
    assert short.flags & dns.flags.AA and not short.flags & dns.flags.RA
    assert short.answer[0].ttl == 30
    assert addresses(await ask(proxy, "reviews.ns2.", "AAAA", tcp=tcp)) == ["fd00::2"]
    nodata = await ask(proxy, "www.mesh.example.", "AAAA", tcp=tcp)
    assert (nodata.rcode(), nodata.answer) == (dns.rcode.NOERROR, [])
    forwarded = await ask(proxy, "www.upstream.test.", tcp=tcp)
    assert (
        addresses(forwarded) == ["192.0.2.10"] and forwarded.flags & dns.flags.RA
    )  # dnsmasq sets RA; we never do
    missing = await ask(proxy, "nowhere.upstream.test.", tcp=tcp)
    assert missing.rcode() == dns.rcode.NXDOMAIN  # upstream's own answer, relayed
    txt = await ask(proxy, "txt.upstream.test.", "TXT", tcp=tcp)
    assert txt.answer and txt.answer[0].rdtype == dns.rdatatype.TXT


async def test_a_big_upstream_answer_is_truncated_over_udp_and_whole_over_tcp(proxy: DnsProxy) -> None:
    proxy.update(name_table())
    udp = await ask(proxy, MANY_NAME + ".")
    assert udp.flags & dns.flags.TC and len(addresses(udp)) < MANY_COUNT
    tcp = await ask(proxy, MANY_NAME + ".", tcp=True)
    assert len(addresses(tcp)) == MANY_COUNT and not tcp.flags & dns.flags.TC
    edns = await ask(proxy, MANY_NAME + ".", use_edns=0, payload=4096)
    assert len(addresses(edns)) == MANY_COUNT and not edns.flags & dns.flags.TC


async def test_malformed_datagrams_get_formerr_or_nothing(proxy: DnsProxy) -> None:
    udp_port, _ = ports(proxy)
    loop = asyncio.get_running_loop()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        sock.connect(("127.0.0.1", udp_port))
        zero_questions = struct.pack("!HHHHHH", 0x1234, 0x0100, 0, 0, 0, 0)
        await loop.sock_sendall(sock, zero_questions)
        reply = await asyncio.wait_for(loop.sock_recv(sock, 512), 5)
        assert reply[:2] == b"\x12\x34" and reply[3] & 0x0F == dns.rcode.FORMERR
        await loop.sock_sendall(sock, b"\x00\x01\x02")  # shorter than a header: dropped
        await loop.sock_sendall(sock, zero_questions)  # the proxy is still answering
        reply = await asyncio.wait_for(loop.sock_recv(sock, 512), 5)
        assert reply[:2] == b"\x12\x34"


async def test_a_stalled_tcp_client_does_not_block_others(proxy: DnsProxy) -> None:
    proxy.update(name_table())
    _, tcp_port = ports(proxy)
    stalled = [await asyncio.open_connection("127.0.0.1", tcp_port) for _ in range(5)]
    for _, writer in stalled:
        writer.write(b"\xff\xff\x00")  # promises 65535 bytes, sends one
    assert addresses(await ask(proxy, "productpage.", tcp=True)) == ["10.0.0.1"]
    for _, writer in stalled:
        writer.close()


async def test_the_table_survives_a_restart(upstream_resolv_conf: Path, tmp_path: Path) -> None:
    first = DnsProxy(settings(upstream_resolv_conf), workdir=tmp_path, registry=Registry())
    await first.start()
    first.update(name_table())
    await first.stop()
    # in a pod only the istio-data volume (/var/lib/istio/data) is writable and outlives a restart
    written = [path.relative_to(tmp_path) for path in (tmp_path / "var").rglob("*") if path.is_file()]
    assert written == [Path("var/lib/istio/data/dns-name-table.pb")] == [SAVED_TABLE]
    second = DnsProxy(settings(upstream_resolv_conf), workdir=tmp_path, registry=Registry())
    await second.start()
    try:
        assert addresses(await ask(second, "productpage.")) == ["10.0.0.1"]
        assert not second.ready  # readiness still waits for this run's first table
        assert second.ndsz() is None
    finally:
        await second.stop()


async def test_metrics_count_queries_by_type_and_rcode(proxy: DnsProxy, registry: Registry) -> None:
    before = sample(registry, "dns_requests_total")
    proxy.update(name_table())
    await ask(proxy, "productpage.")
    await ask(proxy, "nowhere.upstream.test.")
    assert sample(registry, "dns_requests_total") == before + 2
    assert sample(registry, "dns_queries_total", {"qtype": "A", "rcode": "NOERROR", "source": "table"}) >= 1
    assert (
        sample(registry, "dns_queries_total", {"qtype": "A", "rcode": "NXDOMAIN", "source": "upstream"}) >= 1
    )
    assert sample(registry, "dns_name_table_size") > 0


async def test_bad_start_up_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DnsStartError, match=r"failed to start local DNS server: .*missing\.conf"):
        DnsProxy(settings(tmp_path / "missing.conf"), workdir=tmp_path, registry=Registry())
    resolv = tmp_path / "resolv.conf"
    resolv.write_text("nameserver 127.0.0.1\n")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        busy = DnsProxy(
            settings(resolv, listen_address=f"127.0.0.1:{taken.getsockname()[1]}"),
            workdir=tmp_path,
            registry=Registry(),
        )
        with pytest.raises(DnsStartError, match=r"failed to start local DNS server: .*127\.0\.0\.1"):
            await busy.start()


def test_localhost_follows_the_nameserver_families() -> None:
    v4 = ResolvConf(nameservers=(("10.0.0.10", 53),), search=())
    v6 = ResolvConf(nameservers=(("fd00::10", 53),), search=())
    both = ResolvConf(nameservers=(("10.0.0.10", 53), ("fd00::10", 53)), search=())
    none = ResolvConf(nameservers=(), search=())
    assert listen_addresses("localhost:15053", v4) == [("127.0.0.1", 15053)]
    assert listen_addresses("localhost:15053", v6) == [("::1", 15053)]
    assert listen_addresses("localhost:15053", both) == [("127.0.0.1", 15053), ("::1", 15053)]
    assert listen_addresses("localhost:15053", none) == [("127.0.0.1", 15053)]
    assert listen_addresses("0.0.0.0:53", v6) == [("0.0.0.0", 53)]


def big_table(count: int, first_ip: str) -> nds_pb2.NameTable:
    table = nds_pb2.NameTable()
    for index in range(count):
        info = table.table[f"svc{index}.ns1.svc.cluster.local"]
        info.ips.append(first_ip if index == 0 else f"10.2.{index // 250}.{index % 250}")
        info.registry, info.shortname, info.namespace = "Kubernetes", f"svc{index}", NAMESPACE
    return table


async def test_a_big_table_is_built_aside_and_a_newer_table_wins(proxy: DnsProxy) -> None:
    proxy.update(name_table())
    building = proxy.update(big_table(BUILD_IN_THREAD_FROM + 500, "10.9.9.9"))
    assert building is not None
    assert addresses(await ask(proxy, "productpage.")) == ["10.0.0.1"]  # the old table answers meanwhile
    await building
    assert addresses(await ask(proxy, "svc0.")) == ["10.9.9.9"]
    older = proxy.update(big_table(BUILD_IN_THREAD_FROM + 500, "10.8.8.8"))
    assert proxy.update(name_table()) is None  # small: installed at once
    assert older is not None
    await older
    assert addresses(await ask(proxy, "productpage.")) == ["10.0.0.1"]  # the older big one was dropped
    assert (await ask(proxy, "svc0.")).rcode() == dns.rcode.NXDOMAIN


async def test_with_dns_cache_a_repeated_upstream_name_is_answered_by_the_agent(
    upstream_resolv_conf: Path, tmp_path: Path
) -> None:
    registry = Registry()
    cached = DnsProxy(settings(upstream_resolv_conf, cache=True), workdir=tmp_path, registry=registry)
    await cached.start()
    try:
        cached.update(name_table())
        hits = sample(registry, "dns_queries_total", {"qtype": "A", "rcode": "NOERROR", "source": "cache"})
        upstream = sample(registry, "dns_upstream_requests_total")
        first = await ask(cached, "www.upstream.test.")
        second = await ask(cached, "WWW.upstream.test.", tcp=True)
        assert addresses(first) == addresses(second) == ["192.0.2.10"]
        assert str(second.question[0].name) == "WWW.upstream.test."  # the client's spelling
        assert sample(registry, "dns_upstream_requests_total") == upstream + 1
        assert (
            sample(registry, "dns_queries_total", {"qtype": "A", "rcode": "NOERROR", "source": "cache"})
            == hits + 1
        )
    finally:
        await cached.stop()
