"""The upstream forwarder against fake nameservers on loopback (real UDP and TCP sockets)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import dns.message
import dns.rcode
import dns.rrset
import pytest

from istio_agent.ctl.local import free_port
from istio_agent.dns.cache import AnswerCache
from istio_agent.dns.udp_pool import PoolLimits, Sent, UdpPool, random_ids
from istio_agent.dns.upstream import Forwarder, UpstreamError, _UdpForward, shuffled
from istio_agent.dns.wire import parse_query
from istio_agent.metrics import Registry
from tests.dns import sample

Respond = Callable[[bytes], list[bytes]]


def make_query(name: str = "www.example.com.", qtype: str = "A", qid: int = 0x1234, **kw: Any) -> bytes:
    return dns.message.make_query(name, qtype, id=qid, **kw).to_wire()


def make_reply(
    query: bytes, *, ips: tuple[str, ...] = ("10.0.0.1",), rcode: int = dns.rcode.NOERROR, ttl: int = 300
) -> bytes:
    request = dns.message.from_wire(query)
    reply = dns.message.make_response(request)
    reply.set_rcode(rcode)
    if rcode == dns.rcode.NOERROR and ips:
        reply.answer.append(dns.rrset.from_text_list(request.question[0].name, ttl, "IN", "A", list(ips)))
    return reply.to_wire()


def answer(*ips: str, rcode: int = dns.rcode.NOERROR) -> Respond:
    return lambda query: [make_reply(query, ips=ips or ("10.0.0.1",), rcode=rcode)]


def silent(query: bytes) -> list[bytes]:
    return []


def garbage(query: bytes) -> list[bytes]:
    """Right ID, so it is not mistaken for a stray datagram, but not a DNS reply."""
    return [query[:2] + b"\xff" * 9]


def answer_ips(reply: bytes) -> list[str]:
    return [rdata.address for rrset in dns.message.from_wire(reply).answer for rdata in rrset]


class FakeUpstream:
    """A fake nameserver on 127.0.0.1, UDP and TCP on one port, whose replies the test scripts.

    ``respond(query)`` gives the messages to send back, in order (none: never answer); ``delay``
    holds them back; ``spoof(query)`` is sent first from another port of the same host.
    """

    def __init__(self, respond: Respond, *, delay: float = 0.0, spoof: Respond | None = None) -> None:
        self.respond = respond
        self.delay = delay
        self.spoof = spoof
        self.queries: list[tuple[str, bytes]] = []
        self.sources: list[tuple[str | int, ...]] = []
        """The address each UDP query came from (the forwarder's socket)."""
        self.tcp_abandoned = asyncio.Event()
        """Set when a TCP client hung up before it got its answer (it was cancelled)."""
        self.port = 0
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        fake = self

        class Protocol(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
                fake.queries.append(("udp", data))
                fake.sources.append(addr)
                fake._spawn(fake._udp_reply(data, addr))

        for _ in range(20):
            port = free_port()
            try:
                self._udp, _ = await loop.create_datagram_endpoint(Protocol, local_addr=("127.0.0.1", port))
                self._tcp = await asyncio.start_server(self._serve_tcp, "127.0.0.1", port)
            except OSError:
                if self._udp is not None:
                    self._udp.close()
                continue
            self.port = port
            return
        raise RuntimeError("no free port for a fake upstream")

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _udp_reply(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        if self.spoof is not None:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as other:
                for message in self.spoof(data):
                    other.sendto(message, addr)
        if self.delay:
            await asyncio.sleep(self.delay)
        assert self._udp is not None
        for message in self.respond(data):
            self._udp.sendto(message, addr)

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            (length,) = struct.unpack("!H", await reader.readexactly(2))
            data = await reader.readexactly(length)
            self.queries.append(("tcp", data))
            if self.delay:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.delay):
                        await reader.read(1)  # returns b"" at once when the client hangs up
                        self.tcp_abandoned.set()
                        return
            for message in self.respond(data):
                writer.write(struct.pack("!H", len(message)) + message)
            await writer.drain()
            await reader.read(1)  # until the client closes
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        if self._udp is not None:
            self._udp.close()
        if self._tcp is not None:
            self._tcp.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@pytest.fixture(autouse=True)
def close_forwarders(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every forwarder a test makes closes its pooled sockets at the end, as DnsProxy.stop does."""
    made: list[Forwarder] = []
    original = Forwarder.__init__

    def init(self: Forwarder, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(Forwarder, "__init__", init)
    yield
    for forwarder in made:
        forwarder.close()


@pytest.fixture
async def fakes() -> AsyncIterator[Callable[..., Any]]:
    started: list[FakeUpstream] = []

    async def make(respond: Respond, **kw: Any) -> FakeUpstream:
        fake = FakeUpstream(respond, **kw)
        await fake.start()
        started.append(fake)
        return fake

    yield make
    for fake in started:
        await fake.stop()


def fixed_ids(*values: int) -> Callable[[], int]:
    """An ID source that repeats ``values`` forever (to pin the per-query shuffle)."""
    state = {"i": 0}

    def next_id() -> int:
        value = values[state["i"] % len(values)]
        state["i"] += 1
        return value

    return next_id


async def forward(forwarder: Forwarder, query: bytes, *, tcp: bool = False) -> bytes:
    return await forwarder.forward(query, parse_query(query), tcp=tcp)


# --- the happy path and metrics --------------------------------------------------------------------


async def test_udp_query_is_forwarded_with_its_own_id_and_the_reply_relayed(fakes: Any) -> None:
    registry = Registry()
    fake = await fakes(answer("10.1.2.3"))
    forwarder = Forwarder([fake.address], timeout=2, registry=registry)
    query = make_query("WwW.Example.COM.", qid=0xBEEF, use_edns=0, want_dnssec=True)
    before = (
        sample(registry, "dns_upstream_requests_total"),
        sample(registry, "dns_upstream_request_duration_seconds_count"),
    )

    reply = await forward(forwarder, query)

    [(transport, sent)] = fake.queries
    assert (transport, sent[2:]) == ("udp", query[2:])  # same case, flags and OPT; a random ID of its own
    assert reply[:2] == query[:2]
    assert answer_ips(reply) == ["10.1.2.3"]
    assert reply[:2] == b"\xbe\xef"
    assert sample(registry, "dns_upstream_requests_total") == before[0] + 1
    assert sample(registry, "dns_upstream_request_duration_seconds_count") == before[1] + 1


async def test_tcp_in_tcp_out(fakes: Any) -> None:
    fake = await fakes(answer("10.9.9.9"))
    forwarder = Forwarder([fake.address], timeout=2, registry=Registry())
    query = make_query()
    reply = await forward(forwarder, query, tcp=True)
    assert fake.queries == [("tcp", query)]
    assert answer_ips(reply) == ["10.9.9.9"]


async def test_big_reply_over_tcp(fakes: Any) -> None:
    ips = tuple(f"10.0.{i // 250}.{i % 250}" for i in range(200))
    fake = await fakes(lambda q: [make_reply(q, ips=ips)])
    reply = await forward(Forwarder([fake.address], timeout=2, registry=Registry()), make_query(), tcp=True)
    assert len(reply) > 3000
    assert len(answer_ips(reply)) == 200


async def test_big_udp_reply_is_relayed_whole(fakes: Any) -> None:
    """Beyond Istio: a 3000-byte datagram is received in full (the server truncates it for the client)."""
    ips = tuple(f"10.0.{i // 250}.{i % 250}" for i in range(200))
    fake = await fakes(lambda q: [make_reply(q, ips=ips)])
    query = make_query()  # no EDNS: Istio would read 512 bytes of it and fail
    reply = await forward(Forwarder([fake.address], timeout=2, registry=Registry()), query)
    assert len(reply) > 3000
    assert len(answer_ips(reply)) == 200


# --- anti-spoofing and bad replies ---------------------------------------------------------------


async def test_udp_reply_with_wrong_id_is_ignored(fakes: Any) -> None:
    def wrong_id_first(query: bytes) -> list[bytes]:
        bad = bytearray(make_reply(query, ips=("6.6.6.6",)))
        bad[0] ^= 0xFF
        return [bytes(bad), make_reply(query, ips=("10.0.0.7",))]

    fake = await fakes(wrong_id_first)
    reply = await forward(Forwarder([fake.address], timeout=2, registry=Registry()), make_query())
    assert answer_ips(reply) == ["10.0.0.7"]


async def test_udp_reply_from_another_address_is_ignored(fakes: Any) -> None:
    fake = await fakes(answer("10.0.0.8"), spoof=answer("6.6.6.6"), delay=0.05)
    reply = await forward(Forwarder([fake.address], timeout=2, registry=Registry()), make_query())
    assert answer_ips(reply) == ["10.0.0.8"]


async def test_garbage_fails_the_attempt_without_waiting_for_the_timeout(
    fakes: Any, caplog: pytest.LogCaptureFixture
) -> None:
    fake = await fakes(garbage)
    forwarder = Forwarder([fake.address], timeout=5, registry=Registry())
    start = time.monotonic()
    with caplog.at_level(logging.INFO, logger="istio.dns"), pytest.raises(UpstreamError) as failed:
        await forward(forwarder, make_query())
    assert time.monotonic() - start < 2
    assert failed.value.errors[0][0] == f"127.0.0.1:{fake.port}"
    assert any(
        r.getMessage().startswith(f"upstream failure: 127.0.0.1:{fake.port}: ") for r in caplog.records
    )


async def test_reply_to_another_question_is_rejected(fakes: Any) -> None:
    fake = await fakes(lambda q: [make_reply(make_query("evil.example.", qid=0x1234))])
    with pytest.raises(UpstreamError):  # ignored as a spoof, so the attempt times out
        await forward(
            Forwarder([fake.address], timeout=0.3, registry=Registry()),
            make_query("www.example.com.", qid=0x1234),
        )


async def test_tcp_reply_with_wrong_id_is_an_error(fakes: Any) -> None:
    def wrong_id(query: bytes) -> list[bytes]:
        bad = bytearray(make_reply(query))
        bad[1] ^= 0xFF
        return [bytes(bad)]

    fake = await fakes(wrong_id)
    with pytest.raises(UpstreamError, match="ID"):
        await forward(Forwarder([fake.address], timeout=5, registry=Registry()), make_query(), tcp=True)


# --- timeouts, failures, failover ----------------------------------------------------------------


async def test_silent_server_times_out(fakes: Any) -> None:
    registry = Registry()
    fake = await fakes(silent)
    before = (
        sample(registry, "dns_upstream_failures_total"),
        sample(registry, "dns_upstream_request_duration_seconds_count"),
    )
    start = time.monotonic()
    with pytest.raises(UpstreamError, match="timeout") as failed:
        await forward(Forwarder([fake.address], timeout=0.3, registry=registry), make_query())
    assert 0.25 < time.monotonic() - start < 1.5
    assert failed.value.errors == [(f"127.0.0.1:{fake.port}", "i/o timeout after 0.3s")]
    assert sample(registry, "dns_upstream_failures_total") == before[0] + 1
    assert sample(registry, "dns_upstream_request_duration_seconds_count") == before[1] + 1


async def test_tcp_silent_server_times_out(fakes: Any) -> None:
    fake = await fakes(silent)
    with pytest.raises(UpstreamError, match="timeout"):
        await forward(Forwarder([fake.address], timeout=0.3, registry=Registry()), make_query(), tcp=True)


async def test_refused_port_fails_fast() -> None:
    port = free_port()  # nothing listens there
    start = time.monotonic()
    with pytest.raises(UpstreamError) as failed:
        await forward(Forwarder([("127.0.0.1", port)], timeout=5, registry=Registry()), make_query())
    assert time.monotonic() - start < 2
    assert "refused" in str(failed.value).lower()


async def test_error_message_lists_every_server(fakes: Any) -> None:
    quiet, broken = await fakes(silent), await fakes(garbage)
    forwarder = Forwarder([quiet.address, broken.address], timeout=0.3, registry=Registry())
    with pytest.raises(UpstreamError) as failed:
        await forward(forwarder, make_query())
    assert sorted(server for server, _ in failed.value.errors) == sorted(
        [f"127.0.0.1:{quiet.port}", f"127.0.0.1:{broken.port}"]
    )
    text = str(failed.value)
    assert f"127.0.0.1:{quiet.port}: i/o timeout" in text
    assert f"127.0.0.1:{broken.port}: " in text


async def test_sequential_fails_over_on_transport_error(fakes: Any) -> None:
    quiet, good = await fakes(silent), await fakes(answer("10.0.0.2"))
    # Two servers: an odd ID keeps resolv.conf order, so the silent one is asked first.
    forwarder = Forwarder(
        [quiet.address, good.address], timeout=0.3, next_id=fixed_ids(1), registry=Registry()
    )
    reply = await forward(forwarder, make_query())
    assert answer_ips(reply) == ["10.0.0.2"]
    assert len(quiet.queries) == 1 and len(good.queries) == 1


@pytest.mark.parametrize("rcode", [dns.rcode.SERVFAIL, dns.rcode.REFUSED, dns.rcode.NXDOMAIN])
async def test_sequential_does_not_fail_over_on_rcode(fakes: Any, rcode: int) -> None:
    failing, good = await fakes(answer(rcode=rcode)), await fakes(answer("10.0.0.2"))
    forwarder = Forwarder(
        [failing.address, good.address], timeout=2, next_id=fixed_ids(1), registry=Registry()
    )
    reply = await forward(forwarder, make_query())
    assert dns.message.from_wire(reply).rcode() == rcode
    assert good.queries == []


async def test_sequential_order_is_shuffled_per_query(fakes: Any) -> None:
    servers = [await fakes(answer(f"10.0.0.{i}")) for i in range(3)]
    forwarder = Forwarder([s.address for s in servers], timeout=2, registry=Registry())
    firsts = {answer_ips(await forward(forwarder, make_query(qid=i)))[0] for i in range(60)}
    assert firsts == {"10.0.0.0", "10.0.0.1", "10.0.0.2"}


async def test_injected_ids_pin_the_order(fakes: Any) -> None:
    first, second = await fakes(answer("10.0.0.1")), await fakes(answer("10.0.0.2"))
    keep = Forwarder([first.address, second.address], next_id=fixed_ids(1), registry=Registry())
    swap = Forwarder([first.address, second.address], next_id=fixed_ids(2), registry=Registry())
    assert answer_ips(await forward(keep, make_query())) == ["10.0.0.1"]
    assert answer_ips(await forward(swap, make_query())) == ["10.0.0.2"]


def test_shuffle_follows_the_id_sequence() -> None:
    assert shuffled([], fixed_ids(0)) == []
    assert shuffled(["a"], fixed_ids(0)) == ["a"]
    assert shuffled(["a", "b"], fixed_ids(3)) == ["a", "b"]  # two entries: swap on an even ID
    assert shuffled(["a", "b"], fixed_ids(4)) == ["b", "a"]
    # Three entries: before each round the bound 3 * (id % 4 + 1) is drawn anew (here 3 every time);
    # a round draws q then p, and p == q bumps p to the next index.
    ids = [0, 1, 1, 0, 0, 2, 0, 0, 1, 0]  # swaps (1,2), (0,2), (0,1), then 3 < 3 stops the loop
    used: list[int] = []

    def next_id() -> int:
        used.append(ids[len(used)])
        return used[-1]

    items = ["a", "b", "c"]
    assert shuffled(items, next_id) == ["c", "b", "a"]
    assert used == ids
    assert items == ["a", "b", "c"]  # a copy is shuffled, not the input


# --- parallel ------------------------------------------------------------------------------------


async def test_parallel_first_reply_wins(fakes: Any) -> None:
    slow, fast = await fakes(answer("10.0.0.1"), delay=3), await fakes(answer("10.0.0.2"))
    forwarder = Forwarder([slow.address, fast.address], parallel=True, timeout=5, registry=Registry())
    start = time.monotonic()
    reply = await forward(forwarder, make_query())
    assert time.monotonic() - start < 1.5
    assert answer_ips(reply) == ["10.0.0.2"]
    assert len(slow.queries) == 1  # everyone was asked at once


async def test_parallel_any_rcode_wins(fakes: Any) -> None:
    failing, slow = await fakes(answer(rcode=dns.rcode.SERVFAIL)), await fakes(answer("10.0.0.2"), delay=0.5)
    forwarder = Forwarder([slow.address, failing.address], parallel=True, timeout=5, registry=Registry())
    reply = await forward(forwarder, make_query())
    assert dns.message.from_wire(reply).rcode() == dns.rcode.SERVFAIL


async def test_parallel_errors_do_not_win(fakes: Any) -> None:
    broken, slow = await fakes(garbage), await fakes(answer("10.0.0.2"), delay=0.3)
    forwarder = Forwarder([broken.address, slow.address], parallel=True, timeout=5, registry=Registry())
    assert answer_ips(await forward(forwarder, make_query())) == ["10.0.0.2"]


async def test_parallel_cancels_the_losers(fakes: Any) -> None:
    slow, fast = await fakes(answer("10.0.0.1"), delay=5), await fakes(answer("10.0.0.2"))
    forwarder = Forwarder([slow.address, fast.address], parallel=True, timeout=10, registry=Registry())
    reply = await forward(forwarder, make_query(), tcp=True)
    assert answer_ips(reply) == ["10.0.0.2"]
    async with asyncio.timeout(2):
        await slow.tcp_abandoned.wait()  # its connection was closed long before it would answer


async def test_parallel_all_failing(fakes: Any) -> None:
    a, b = await fakes(silent), await fakes(garbage)
    forwarder = Forwarder([a.address, b.address], parallel=True, timeout=0.3, registry=Registry())
    with pytest.raises(UpstreamError) as failed:
        await forward(forwarder, make_query())
    assert len(failed.value.errors) == 2


@pytest.mark.parametrize("parallel", [False, True])
async def test_zero_servers_fail_at_once(parallel: bool) -> None:
    registry = Registry()
    """Beyond Istio: parallel mode with no nameservers does not hang the query."""
    forwarder = Forwarder([], parallel=parallel, timeout=5, retries=3, registry=registry)
    before = sample(registry, "dns_upstream_failures_total")
    async with asyncio.timeout(1):
        with pytest.raises(UpstreamError, match="no upstream nameservers"):
            await forward(forwarder, make_query())
    assert sample(registry, "dns_upstream_failures_total") == before + 1


# --- retries -------------------------------------------------------------------------------------


def fail_first(times: int) -> Respond:
    """Garbage for the first ``times`` queries, then a good answer."""
    seen = {"n": 0}

    def respond(query: bytes) -> list[bytes]:
        seen["n"] += 1
        return garbage(query) if seen["n"] <= times else [make_reply(query, ips=("10.0.0.5",))]

    return respond


async def test_no_retries_by_default(fakes: Any) -> None:
    fake = await fakes(fail_first(1))
    with pytest.raises(UpstreamError):
        await forward(Forwarder([fake.address], timeout=2, registry=Registry()), make_query())
    assert len(fake.queries) == 1


@pytest.mark.parametrize("tcp", [False, True])
async def test_retries_add_rounds(fakes: Any, tcp: bool) -> None:
    fake = await fakes(fail_first(2))
    reply = await forward(
        Forwarder([fake.address], timeout=2, retries=2, registry=Registry()), make_query(), tcp=tcp
    )
    assert answer_ips(reply) == ["10.0.0.5"]
    assert len(fake.queries) == 3


async def test_retries_exhausted(fakes: Any) -> None:
    a, b = await fakes(garbage), await fakes(garbage)
    forwarder = Forwarder([a.address, b.address], timeout=2, retries=2, registry=Registry())
    with pytest.raises(UpstreamError) as failed:
        await forward(forwarder, make_query())
    assert len(failed.value.errors) == 6  # every attempt of every round is reported
    assert len(a.queries) == 3 and len(b.queries) == 3


def test_bad_settings_are_rejected() -> None:
    with pytest.raises(ValueError, match="timeout"):
        Forwarder([("127.0.0.1", 53)], timeout=0, registry=Registry())
    with pytest.raises(ValueError, match="retries"):
        Forwarder([("127.0.0.1", 53)], retries=-1, registry=Registry())


def test_server_labels() -> None:
    forwarder = Forwarder([("10.0.0.1", 53), ("fd00::1", 5353)], registry=Registry())
    assert forwarder.servers == ["10.0.0.1:53", "[fd00::1]:5353"]


# --- with the answer cache -----------------------------------------------------------------------


async def test_cached_answer_skips_the_upstream(fakes: Any) -> None:
    registry = Registry()
    fake = await fakes(answer("10.0.0.3"))
    forwarder = Forwarder([fake.address], timeout=2, cache=AnswerCache(registry=registry), registry=registry)
    before = sample(registry, "dns_upstream_requests_total")
    await forward(forwarder, make_query("www.example.com.", qid=1))
    second = make_query("WWW.example.COM.", qid=2)
    reply = await forward(forwarder, second)
    assert len(fake.queries) == 1
    assert sample(registry, "dns_upstream_requests_total") == before + 1  # a hit is not an upstream request
    assert reply[:2] == b"\x00\x02"
    assert str(dns.message.from_wire(reply).question[0].name) == "WWW.example.COM."  # the client's case
    assert answer_ips(reply) == ["10.0.0.3"]


async def test_servfail_is_not_cached(fakes: Any) -> None:
    fake = await fakes(answer(rcode=dns.rcode.SERVFAIL))
    forwarder = Forwarder(
        [fake.address], timeout=2, cache=AnswerCache(registry=Registry()), registry=Registry()
    )
    for qid in (1, 2):
        await forward(forwarder, make_query(qid=qid))
    assert len(fake.queries) == 2


# --- the UDP socket pool -------------------------------------------------------------------------


def ports(fake: FakeUpstream) -> list[int]:
    return [int(addr[1]) for addr in fake.sources]


def open_sockets(forwarder: Forwarder) -> int:
    return sum(pool.open_sockets for pool in forwarder._pools.values())


async def test_reply_to_another_question_is_ignored_and_the_right_one_taken(fakes: Any) -> None:
    registry = Registry()

    def other_question_first(query: bytes) -> list[bytes]:
        spoof = make_reply(query[:2] + make_query("evil.example.")[2:], ips=("6.6.6.6",))
        return [spoof, make_reply(query, ips=("10.0.0.9",))]

    fake = await fakes(other_question_first)
    forwarder = Forwarder([fake.address], timeout=2, registry=registry)
    before = sample(registry, "dns_upstream_unmatched_replies_total")
    reply = await forward(forwarder, make_query())
    assert answer_ips(reply) == ["10.0.0.9"]
    assert sample(registry, "dns_upstream_unmatched_replies_total") == before + 1
    forwarder.close()


@pytest.mark.both_loops
async def test_many_concurrent_queries_share_few_sockets(fakes: Any) -> None:
    def by_name(query: bytes) -> list[bytes]:
        index = int(str(dns.message.from_wire(query).question[0].name).split(".")[0][1:])
        return [make_reply(query, ips=(f"10.1.{index // 250}.{index % 250}",))]

    fake = await fakes(by_name, delay=0.02)  # replies come back out of order, all in flight at once
    forwarder = Forwarder(
        [fake.address], timeout=5, pool_limits=PoolLimits(sockets=2, queries=1000), registry=Registry()
    )
    queries = [make_query(f"q{i}.example.", qid=i) for i in range(120)]  # within the fake's receive buffer
    replies = await asyncio.gather(*(forward(forwarder, query) for query in queries))
    for i, reply in enumerate(replies):
        assert reply[:2] == i.to_bytes(2, "big")  # the client's ID again
        assert answer_ips(reply) == [f"10.1.{i // 250}.{i % 250}"]
    assert len(set(ports(fake))) <= 2
    assert open_sockets(forwarder) <= 2
    forwarder.close()
    assert open_sockets(forwarder) == 0


async def test_an_id_in_flight_on_the_socket_is_not_reused(fakes: Any) -> None:
    fake = await fakes(answer("10.0.0.4"), delay=0.1)
    forwarder = Forwarder(
        [fake.address],
        timeout=2,
        pool_limits=PoolLimits(sockets=1),
        query_ids=fixed_ids(7, 7, 7, 9),
        registry=Registry(),
    )
    first, second = await asyncio.gather(
        forward(forwarder, make_query(qid=1)), forward(forwarder, make_query(qid=2))
    )
    assert [query[:2] for _, query in fake.queries] == [b"\x00\x07", b"\x00\x09"]
    assert (first[:2], second[:2]) == (b"\x00\x01", b"\x00\x02")
    forwarder.close()


async def test_a_socket_is_replaced_after_its_queries(fakes: Any) -> None:
    fake = await fakes(answer("10.0.0.6"))
    forwarder = Forwarder(
        [fake.address], timeout=2, pool_limits=PoolLimits(sockets=1, queries=3), registry=Registry()
    )
    for qid in range(7):
        await forward(forwarder, make_query(qid=qid))
    used = ports(fake)
    assert used[0] == used[1] == used[2] != used[3]
    assert used[3] == used[4] == used[5] != used[6]
    assert open_sockets(forwarder) == 1  # each replaced socket was closed
    forwarder.close()


async def test_a_socket_is_replaced_after_its_lifetime(fakes: Any) -> None:
    fake = await fakes(answer("10.0.0.6"))
    forwarder = Forwarder(
        [fake.address], timeout=2, pool_limits=PoolLimits(sockets=1, lifetime=0.05), registry=Registry()
    )
    await forward(forwarder, make_query(qid=1))
    await forward(forwarder, make_query(qid=2))
    await asyncio.sleep(0.06)
    await forward(forwarder, make_query(qid=3))
    used = ports(fake)
    assert used[0] == used[1] != used[2]
    forwarder.close()


@pytest.mark.both_loops
async def test_a_replaced_socket_stays_open_for_its_queries_in_flight(fakes: Any) -> None:
    fake = await fakes(answer("10.0.0.7"), delay=0.2)
    forwarder = Forwarder(
        [fake.address], timeout=2, pool_limits=PoolLimits(sockets=1, queries=1), registry=Registry()
    )
    first = asyncio.ensure_future(forward(forwarder, make_query(qid=1)))
    await asyncio.sleep(0.05)
    second = asyncio.ensure_future(forward(forwarder, make_query(qid=2)))  # replaces the first one's socket
    await asyncio.sleep(0.05)
    assert open_sockets(forwarder) == 2
    assert answer_ips(await first) == ["10.0.0.7"] and answer_ips(await second) == ["10.0.0.7"]
    assert len(set(ports(fake))) == 2
    assert open_sockets(forwarder) == 1  # the retired one closed once its query ended
    forwarder.close()


async def test_a_late_reply_is_dropped_and_counted(fakes: Any) -> None:
    registry = Registry()
    fake = await fakes(answer("10.0.0.8"), delay=0.3)
    forwarder = Forwarder([fake.address], timeout=0.1, pool_limits=PoolLimits(sockets=1), registry=registry)
    before = sample(registry, "dns_upstream_unmatched_replies_total")
    with pytest.raises(UpstreamError, match="timeout"):
        await forward(forwarder, make_query(qid=1))
    for _ in range(50):
        if sample(registry, "dns_upstream_unmatched_replies_total") > before:
            break
        await asyncio.sleep(0.02)
    assert sample(registry, "dns_upstream_unmatched_replies_total") == before + 1
    fake.delay = 0
    reply = await forward(forwarder, make_query("other.example.", qid=2))  # the same socket answers on
    assert reply[:2] == b"\x00\x02" and answer_ips(reply) == ["10.0.0.8"]
    assert len(set(ports(fake))) == 1
    forwarder.close()


async def test_closing_fails_the_queries_in_flight(fakes: Any) -> None:
    fake = await fakes(silent)
    forwarder = Forwarder([fake.address], timeout=5, registry=Registry())
    query = asyncio.ensure_future(forward(forwarder, make_query()))
    await asyncio.sleep(0.05)
    forwarder.close()
    with pytest.raises(UpstreamError, match="closed"):
        await query
    assert open_sockets(forwarder) == 0


@pytest.mark.both_loops
async def test_the_pools_one_timer_keeps_every_querys_own_deadline(fakes: Any) -> None:
    """A later query with a shorter timeout is not held to the earlier one's; no timeout: no expiry."""
    quiet = await fakes(silent)
    pool = UdpPool(
        socket.AF_INET, quiet.address, limits=PoolLimits(), ids=random_ids(), unmatched=lambda: None
    )
    loop = asyncio.get_running_loop()
    started = loop.time()
    ended: dict[str, float] = {}

    def waiter(name: str) -> Callable[[bytes | OSError | ValueError], None]:
        def on_reply(result: bytes | OSError | ValueError) -> None:
            assert isinstance(result, TimeoutError), result
            ended[name] = loop.time() - started
            if name == "short":  # sending again from the timer's own callback keeps the others' deadlines
                pool.send(make_query(qid=3), waiter("again"), timeout=0.3)

        return on_reply

    try:
        pool.send(make_query(qid=1), waiter("long"), timeout=1.0)
        pool.send(make_query(qid=2), waiter("short"), timeout=0.1)
        forever = pool.send(make_query(qid=4), waiter("never"))
        await asyncio.sleep(1.4)
        assert sorted(ended, key=ended.__getitem__) == ["short", "again", "long"]
        assert 0.08 < ended["short"] < 0.4 and 0.35 < ended["again"] < 0.8 and 0.95 < ended["long"] < 1.4
        forever.forget()
    finally:
        pool.close()


@pytest.mark.both_loops
async def test_the_pools_timer_runs_a_few_times_for_many_timeouts(fakes: Any) -> None:
    """uvloop may fire a timer a rounding error early: that must not make the timer spin until due."""
    quiet = await fakes(silent)
    pool = UdpPool(
        socket.AF_INET, quiet.address, limits=PoolLimits(), ids=random_ids(), unmatched=lambda: None
    )
    runs, expire = [], pool._expire

    def counted() -> None:
        runs.append(1)
        expire()

    pool._expire = counted  # type: ignore[method-assign]
    outcomes: list[str] = []
    try:
        for qid in range(10):
            pool.send(
                make_query(qid=qid), lambda result: outcomes.append(type(result).__name__), timeout=0.05
            )
            await asyncio.sleep(0.003)
        await asyncio.sleep(0.3)
        assert outcomes == ["TimeoutError"] * 10
        assert len(runs) <= 10  # before the fix: ~200 on uvloop for these ten
    finally:
        pool.close()


async def test_a_retired_socket_closes_when_its_last_query_times_out(fakes: Any) -> None:
    quiet = await fakes(silent)
    limits = PoolLimits(sockets=1, queries=1)
    pool = UdpPool(socket.AF_INET, quiet.address, limits=limits, ids=random_ids(), unmatched=lambda: None)
    try:
        pool.send(make_query(qid=1), lambda result: None, timeout=0.05)
        pool.send(make_query(qid=2), lambda result: None)  # retires the first socket
        assert pool.open_sockets == 2
        await asyncio.sleep(0.2)  # the first query timed out, and its waiter never called forget()
        assert pool.open_sockets == 1
    finally:
        pool.close()


def test_bad_pool_limits_are_rejected() -> None:
    with pytest.raises(ValueError, match="pool limits"):
        PoolLimits(sockets=0)
    with pytest.raises(ValueError, match="pool limits"):
        PoolLimits(lifetime=0)


# --- the callback path (forward_soon): UDP without a task ------------------------------------------


class Receiver:
    """A ``ForwardReceiver`` that calls ``on_done`` with the outcome, and checks the client it gets back."""

    def __init__(self, on_done: Callable[[bytes | UpstreamError], None], client: object = None) -> None:
        self.on_done = on_done
        self.client = client

    def forwarded(self, parsed: Any, result: bytes | UpstreamError, client: object) -> None:
        assert client is self.client
        self.on_done(result)


async def forward_on_callbacks(forwarder: Forwarder, query: bytes) -> bytes:
    """``forward_soon`` as the UDP listener uses it; raises its UpstreamError."""
    done: asyncio.Future[bytes | UpstreamError] = asyncio.get_running_loop().create_future()
    client = ("127.0.0.1", 5353)
    assert forwarder.forward_soon(query, parse_query(query), Receiver(done.set_result, client), client)
    result = await done
    if isinstance(result, UpstreamError):
        raise result
    return result


@pytest.mark.both_loops
async def test_callbacks_relay_the_reply_with_the_clients_id_and_count_it(fakes: Any) -> None:
    registry = Registry()
    fake = await fakes(answer("10.1.2.3"))
    forwarder = Forwarder([fake.address], timeout=2, registry=registry)
    query = make_query("WwW.Example.COM.", qid=0xBEEF, use_edns=0)
    before = (
        sample(registry, "dns_upstream_requests_total"),
        sample(registry, "dns_upstream_request_duration_seconds_count"),
    )
    reply = await forward_on_callbacks(forwarder, query)
    [(transport, sent)] = fake.queries
    assert (transport, sent[2:]) == ("udp", query[2:]) and sent[:2] != b"" and reply[:2] == b"\xbe\xef"
    assert answer_ips(reply) == ["10.1.2.3"]
    assert sample(registry, "dns_upstream_requests_total") == before[0] + 1
    assert sample(registry, "dns_upstream_request_duration_seconds_count") == before[1] + 1


async def test_callbacks_fail_over_after_a_timeout_and_a_late_reply_is_dropped(fakes: Any) -> None:
    registry = Registry()
    slow, good = await fakes(answer("10.0.0.1"), delay=0.4), await fakes(answer("10.0.0.2"))
    forwarder = Forwarder([slow.address, good.address], timeout=0.2, next_id=fixed_ids(1), registry=registry)
    before = sample(registry, "dns_upstream_unmatched_replies_total")
    started = time.monotonic()
    reply = await forward_on_callbacks(forwarder, make_query())
    assert answer_ips(reply) == ["10.0.0.2"] and 0.15 < time.monotonic() - started < 1.5
    for _ in range(50):  # the slow server's reply arrives after its query gave up on it
        if sample(registry, "dns_upstream_unmatched_replies_total") > before:
            break
        await asyncio.sleep(0.02)
    assert sample(registry, "dns_upstream_unmatched_replies_total") == before + 1


async def test_callbacks_fail_with_every_servers_error(fakes: Any) -> None:
    registry = Registry()
    quiet, broken = await fakes(silent), await fakes(garbage)
    forwarder = Forwarder([quiet.address, broken.address], timeout=0.3, registry=registry)
    before = sample(registry, "dns_upstream_failures_total")
    with pytest.raises(UpstreamError) as failed:
        await forward_on_callbacks(forwarder, make_query())
    assert sorted(server for server, _ in failed.value.errors) == sorted(
        [f"127.0.0.1:{quiet.port}", f"127.0.0.1:{broken.port}"]
    )
    assert sample(registry, "dns_upstream_failures_total") == before + 1


async def test_callbacks_stop_at_once_when_the_forwarder_closes(fakes: Any) -> None:
    first, second = await fakes(silent), await fakes(answer("10.0.0.2"))
    forwarder = Forwarder(
        [first.address, second.address], timeout=5, next_id=fixed_ids(1), registry=Registry()
    )
    pending = asyncio.ensure_future(forward_on_callbacks(forwarder, make_query()))
    await asyncio.sleep(0.05)
    forwarder.close()
    with pytest.raises(UpstreamError, match="closed"):
        await pending
    assert second.queries == [] and open_sockets(forwarder) == 0  # no other server was tried


@pytest.mark.both_loops
async def test_a_forwarded_query_leaves_nothing_for_the_garbage_collector(fakes: Any) -> None:
    """Each query freed by reference counting: a cycle per query made the collector run every ~40."""
    quiet, good = await fakes(silent), await fakes(answer("10.0.0.2"))
    forwarder = Forwarder(
        [quiet.address, good.address], timeout=0.05, next_id=fixed_ids(1), registry=Registry()
    )
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):  # each times out on the quiet server, then is answered by the good one
            assert answer_ips(await forward_on_callbacks(forwarder, make_query())) == ["10.0.0.2"]
        left = [type(o).__name__ for o in gc.get_objects() if isinstance(o, (_UdpForward, Sent))]
    finally:
        gc.enable()
    assert left == []


@pytest.mark.parametrize(
    ("servers", "options"),
    [
        ([("127.0.0.1", 53)], {"retries": 1}),
        ([("127.0.0.1", 53), ("127.0.0.2", 53)], {"parallel": True}),
        ([("dns.example", 53)], {}),
        ([], {}),
    ],
    ids=["retries", "parallel", "host-name", "no-servers"],
)
async def test_callbacks_are_declined_where_the_coroutine_path_is_needed(
    servers: list[tuple[str, int]], options: dict[str, Any]
) -> None:
    forwarder = Forwarder(servers, registry=Registry(), **options)
    query = make_query()
    assert not forwarder.forward_soon(query, parse_query(query), Receiver(lambda result: None), None)


async def test_callbacks_answer_once_even_when_the_receiver_fails(fakes: Any) -> None:
    fake = await fakes(answer("10.0.0.1"))
    forwarder = Forwarder([fake.address], timeout=0.2, registry=Registry())
    calls: list[str] = []

    def on_done(result: bytes | UpstreamError) -> None:
        calls.append(type(result).__name__)
        raise RuntimeError("a receiver with a bug")

    query = make_query()
    assert forwarder.forward_soon(query, parse_query(query), Receiver(on_done), None)
    await asyncio.sleep(0.5)  # past the timeout: it must not fire a second answer
    assert calls == ["bytes"]
