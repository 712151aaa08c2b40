"""The DNS proxy's listeners: one UDP and one TCP server per listen address.

A query is answered from the name table when the table knows the name, and forwarded upstream
otherwise. UDP is read in batches (``istio_agent.dns.mmsg``): one readiness callback of the event
loop reads every query waiting, answers each question it has answered before from the bytes it sent
then (only the ID differs) with one more system call, and handles the rest right there, synchronously
(no task, no await). A forwarded UDP query takes the forwarder's short path (``Forwarder.forward_soon``,
the listener being its ``ForwardReceiver``); only queries that path cannot take become tasks. A
question forwarded before goes to that path without ``DnsResolver.answer`` (the listener looks it up
in ``forwarded_questions``), and a forwarded reply is sent before anything is counted.

Beyond Istio's agent: replies honour the client's size limit with TC (never SERVFAIL for size),
local replies carry OPT when the query did, the number of forwarded queries in flight and of TCP
connections is bounded, and TCP clients that stall are cut off, so one client cannot starve others.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeAlias

from istio_agent.dns import mmsg
from istio_agent.dns.mmsg import DatagramBatch, data_address
from istio_agent.dns.records import TYPE_A, TYPE_AAAA, TYPE_MX, Record
from istio_agent.dns.table import LookupTable, random_id, round_robin
from istio_agent.dns.upstream import Forwarder, UpstreamError
from istio_agent.dns.wire import (
    RCODE_FORMERR,
    RCODE_SERVFAIL,
    Query,
    Rejected,
    error_reply,
    local_reply,
    parse_query,
    servfail,
    truncate,
)
from istio_agent.log import scope
from istio_agent.metrics import PREFIX, Family, Registry

log = scope("dns")

TCP_LIMIT = 65535
MAX_PENDING_FORWARDS = 1024
"""Forwarded queries in flight; beyond this, new ones are dropped (the client retries), not queued."""
MAX_TCP_CONNECTIONS = 256
TCP_IDLE_TIMEOUT = 8.0
"""Between queries on a TCP connection, as the Go DNS library Istio uses."""
TCP_READ_TIMEOUT = 2.0
"""To read the rest of a query once its length prefix arrived (slowloris clients are cut off)."""
TCP_QUERIES_PER_CONNECTION = 128
TCP_CLOSE_TIMEOUT = 1.0
"""To flush the last answer on close; then the connection is dropped."""
MAX_REMEMBERED_REPLIES = 8192
"""Table answers, and parsed questions the table cannot answer, kept by question bytes (each up to
this many), so a repeated question skips parsing and lookup."""
UDP_BATCH = 64
"""Datagrams read (and replies sent) per system call."""
UDP_QUERY_SIZE = 4096
"""Longest UDP query read whole; a longer one gets FORMERR (a real query is a few hundred bytes)."""
UDP_BATCHES_PER_WAKEUP = 4
"""So that one busy socket cannot hold the event loop."""
_SHUFFLED = frozenset({TYPE_A, TYPE_AAAA, TYPE_MX})
_new_query: Callable[[type[Query], tuple[object, ...]], Query] = tuple.__new__

_RCODE_NAMES = {0: "NOERROR", 1: "FORMERR", 2: "SERVFAIL", 3: "NXDOMAIN", 4: "NOTIMP", 5: "REFUSED"}
_TYPE_NAMES = {1: "A", 2: "NS", 5: "CNAME", 6: "SOA", 12: "PTR", 15: "MX", 16: "TXT", 28: "AAAA", 33: "SRV"}
_TYPE_NAMES.update({64: "SVCB", 65: "HTTPS", 255: "ANY"})


class DnsStats:
    """Counters kept as plain ints on the hot path and exported on scrape.

    ``dns_requests_total`` is Istio's; ``dns_queries_total{qtype,rcode,source}`` (source: table,
    cache, upstream or local) and
    ``dns_name_table_size`` are ours.
    """

    def __init__(self) -> None:
        self.requests = 0
        self.queries: Counter[tuple[int, int, str]] = Counter()
        self.table_size: Callable[[], int] = lambda: 0

    def answered(self, qtype: int, rcode: int, source: str) -> None:
        self.queries[(qtype, rcode, source)] += 1

    def collect(self) -> Iterator[Family]:
        # Istio's agent counters have no _total added (see istio_agent.metrics): a gauge with the exact name.
        requests = Family(PREFIX + "dns_requests_total", "Total number of DNS requests.", "gauge")
        requests.add(self.requests)
        yield requests
        by_kind = Family(
            PREFIX + "dns_queries",
            "DNS replies by query type, response code and source (table, upstream, cache, local).",
            "counter",
        )
        for (qtype, rcode, source), count in sorted(self.queries.items()):
            qname, rname = _TYPE_NAMES.get(qtype, f"TYPE{qtype}"), _RCODE_NAMES.get(rcode, str(rcode))
            by_kind.add(count, (("qtype", qname), ("rcode", rname), ("source", source)), "_total")
        yield by_kind
        size = Family(
            PREFIX + "dns_name_table_size", "Names the DNS proxy answers from the NDS table.", "gauge"
        )
        size.add(self.table_size())
        yield size


Remembered: TypeAlias = tuple[bytes, int, tuple[int, int, str]]
"""A remembered table reply: its bytes after the ID, their address in memory, its metric labels."""


class _Failures:
    """Bugs that cost one query each: counted, and logged with their traceback, but not once per packet."""

    def __init__(self, what: str) -> None:
        self._what = what
        self.count = 0

    def record(self) -> None:
        """Call from an ``except`` block."""
        self.count += 1
        if self.count <= 10 or self.count % 1000 == 0:
            log.exception("%s failed (%d so far); the query is dropped", self._what, self.count)


def _rcode(reply: bytes) -> int:
    return reply[3] & 0x0F if len(reply) >= 4 else RCODE_SERVFAIL


class DnsResolver:
    """Decides each answer: the table, the upstream forwarder, or an error reply. Transport-agnostic."""

    def __init__(
        self,
        forwarder: Forwarder,
        *,
        respond_before_sync: bool = False,
        next_id: Callable[[], int] = random_id,
        stats: DnsStats | None = None,
    ) -> None:
        self._forwarder = forwarder
        self._respond_before_sync = respond_before_sync
        self._next_id = next_id
        self._table: LookupTable | None = None
        self._replies: dict[int | None, dict[bytes, Remembered]] = {}
        self._not_in_table: dict[bytes, Query] = {}
        """Questions the table could not answer, parsed, by their bytes after the ID (see ``_answer``)."""
        self._failures = _Failures("DNS query handling")
        self._caches = forwarder.caches
        self.forward_soon = forwarder.forward_soon
        """Forward a UDP query on the forwarder's short path (see ``Forwarder.forward_soon``)."""
        self.stats = stats or DnsStats()
        self.stats.table_size = lambda: len(self._table) if self._table is not None else 0

    @property
    def table(self) -> LookupTable | None:
        return self._table

    @table.setter
    def table(self, table: LookupTable | None) -> None:
        self._table = table
        for replies in self._replies.values():
            replies.clear()  # built from the old table; cleared in place, listeners hold the dicts
        self._not_in_table.clear()  # the new table may know them

    def forwarded_questions(self) -> dict[bytes, Query]:
        """Questions known to go upstream, parsed, by their bytes after the ID, so that a listener
        can forward a repeated one without asking ``answer``; empty for good when answers are cached
        (DNS_CACHE: the cache is asked first). The same dict for the resolver's life (cleared in place).
        """
        return self._not_in_table if not self._caches else {}

    def remembered(self, limit: int | None) -> dict[bytes, Remembered]:
        """Table replies by question (the query without its ID) for a transport's size limit.

        The same dict for the resolver's life (cleared in place), so a listener may keep it.
        """
        return self._replies.setdefault(limit, {})

    def oversized(self, data: bytes) -> bytes | None:
        """The reply to a UDP query too long to be read whole: FORMERR, None without a header."""
        self.stats.requests += 1
        reply = error_reply(data, RCODE_FORMERR)
        if reply is not None:
            self.stats.answered(0, RCODE_FORMERR, "local")
        return reply

    def answer_now(self, data: bytes, limit: int | None) -> bytes | Query | None:
        """A reply that needs no I/O, or the parsed query when it must go upstream, or None to drop.

        ``limit`` is the transport's size limit (None for UDP: the query's own EDNS limit applies).
        A bug costs the one query (dropped), never the listener; it is logged, but not once per packet.
        """
        try:
            return self.answer(data, limit)
        except Exception:
            self._failures.record()
            return None

    def answer(self, data: bytes, limit: int | None) -> bytes | Query | None:
        """As ``answer_now``, but a bug raises (the UDP listener counts it with its own)."""
        stats = self.stats
        question = data[2:]
        replies = self._replies.get(limit)
        known = replies.get(question) if replies is not None else None
        if known is not None:  # the same question as before: only the ID differs
            stats.requests += 1
            stats.queries[known[2]] += 1
            return data[:2] + known[0]
        asked = self._not_in_table.get(question)
        if asked is not None:  # asked before and not in the table: parsing and lookup are skipped
            stats.requests += 1
            # tuple.__new__ does what _replace(id=...) does without NamedTuple's Python-level __new__.
            query = _new_query(Query, ((data[0] << 8) | data[1], *asked[1:]))
            return self._cached(query, limit) if self._caches else query
        try:
            query = parse_query(data)
        except Rejected as rejected:
            if rejected.rcode is None:
                return None
            stats.requests += 1
            reply = error_reply(data, rejected.rcode)
            if reply is not None:
                stats.answered(0, rejected.rcode, "local")
            return reply
        stats.requests += 1
        table = self._table
        if table is None:
            if self._respond_before_sync:
                return self._cached(query, limit)
            stats.answered(query.qtype, RCODE_SERVFAIL, "local")
            return servfail(query)  # Istio: no table yet means SERVFAIL, not a guess
        answer = table.lookup(query.qname, query.qtype)
        if answer is None:
            if len(self._not_in_table) >= MAX_REMEMBERED_REPLIES:
                self._not_in_table.clear()
            self._not_in_table[data[2:]] = query  # the parse depends on these bytes alone
            return self._cached(query, limit)
        records: Sequence[Record] = answer.records
        shuffled = sum(record.rtype in _SHUFFLED for record in records) > 1
        if shuffled:
            records = round_robin(records, self._next_id)
        reply = local_reply(query, [record.wire for record in records])
        stats.answered(query.qtype, 0, "table")
        size_limit = query.udp_limit if limit is None else limit
        if len(reply) > size_limit:
            reply = truncate(reply, size_limit)
        if not shuffled:  # the same bytes for the same question until the table changes
            replies = self.remembered(limit)
            if len(replies) >= MAX_REMEMBERED_REPLIES:
                replies.clear()
            tail = reply[2:]
            replies[data[2:]] = (tail, data_address(tail), (query.qtype, 0, "table"))
        return reply

    def _cached(self, query: Query, limit: int | None) -> bytes | Query:
        """A DNS_CACHE hit answered at once, or the query back for forwarding."""
        reply = self._forwarder.cached(query)
        if reply is None:
            return query
        self.stats.answered(query.qtype, _rcode(reply), "cache")
        size_limit = query.udp_limit if limit is None else limit
        return reply if len(reply) <= size_limit else truncate(reply, size_limit)

    async def forward(self, data: bytes, query: Query, *, tcp: bool) -> bytes:
        """Forward upstream; SERVFAIL when every upstream failed (never a made-up NXDOMAIN)."""
        try:
            reply = await self._forwarder.forward(data, query, tcp=tcp, lookup_cache=False)
        except UpstreamError as err:
            return self.forwarded_reply(query, err, tcp=tcp)
        return self.forwarded_reply(query, reply, tcp=tcp)

    def forwarded_reply(self, query: Query, result: bytes | UpstreamError, *, tcp: bool) -> bytes:
        """The client's reply to a forwarded query (``client_reply``), counted."""
        reply = self.client_reply(query, result, TCP_LIMIT if tcp else query.udp_limit)
        self.count_forwarded(query, result)
        return reply

    def client_reply(self, query: Query, result: bytes | UpstreamError, limit: int) -> bytes:
        """The upstream's reply within the client's size ``limit``, or SERVFAIL when every upstream failed.

        Over the limit it is cut and marked TC, so the client retries over TCP.
        """
        if isinstance(result, UpstreamError):
            return servfail(query)
        if len(result) <= limit:
            return result
        try:
            return truncate(result, limit)
        except ValueError as err:  # DnsFormatError: the forwarder already checked it, so this is a bug
            log.warning("cannot truncate an upstream reply: %s", err)
            return servfail(query)

    def count_forwarded(self, query: Query, result: bytes | UpstreamError) -> None:
        """The metrics of a forwarded query's reply (the upstream's rcode, or SERVFAIL)."""
        if isinstance(result, UpstreamError):
            log.debug("upstream failed for a %s query: %s", _TYPE_NAMES.get(query.qtype, query.qtype), result)
            self.stats.answered(query.qtype, RCODE_SERVFAIL, "upstream")
        else:
            self.stats.answered(query.qtype, _rcode(result), "upstream")


class _Forwards:
    """Forwarded queries in flight over all of a server's listeners: tasks, and queries on callbacks."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[None]] = set()
        self.callbacks = 0

    def __len__(self) -> int:
        return len(self.tasks) + self.callbacks


class _UdpListener:
    """One UDP socket served from the event loop's reader callback, a batch of datagrams at a time."""

    def __init__(self, sock: socket.socket, resolver: DnsResolver, pending: _Forwards) -> None:
        self.sock = sock
        self._fd = sock.fileno()
        self._resolver = resolver
        self._remembered = resolver.remembered(None)
        self._forwarded = resolver.forwarded_questions()
        self._forward_soon = resolver.forward_soon
        self._pending = pending
        # Without recvmmsg (not Linux, a 32-bit process) the listener reads one datagram at a time.
        self._batch = DatagramBatch(UDP_BATCH, UDP_QUERY_SIZE) if mmsg.available() else None
        self._failures = _Failures("DNS UDP query handling")
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._fd, self._readable)
        self._batching = False
        self._closed = False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._loop.remove_reader(self._fd)
            self.sock.close()

    def _readable(self) -> None:
        """Under load, batches; otherwise one datagram at a time, which answers a lone query sooner.

        A batch costs two ctypes calls (~15 µs more than ``recvfrom`` and ``sendto`` for one query
        on a cold cache), so batching starts when a wake-up finds more than one query waiting and
        stops when a batch holds only one.
        """
        if self._batching and self._batch is not None:
            self._read_batches(self._batch)
            return
        recvfrom = self.sock.recvfrom  # one datagram at a time, here: no call more before the first
        for read in range(UDP_BATCH):
            try:
                data, addr = recvfrom(UDP_QUERY_SIZE + 1)
            except BlockingIOError:
                self._batching = read > 1 and self._batch is not None
                return
            except OSError as err:  # e.g. ICMP port unreachable from a client that went away
                log.debug("DNS UDP socket error: %s", err)
                continue
            self._answer_one(data, addr, oversized=len(data) > UDP_QUERY_SIZE)
        self._batching = self._batch is not None

    def _read_batches(self, batch: DatagramBatch) -> None:
        for _ in range(UDP_BATCHES_PER_WAKEUP):
            try:
                count = batch.receive(self._fd)
            except OSError as err:  # e.g. ICMP port unreachable from a client that went away
                log.debug("DNS UDP socket error: %s", err)
                continue
            if count:
                self._answer(batch, count)
            if count < batch.size:
                self._batching = count > 1
                return

    def _answer(self, batch: DatagramBatch, count: int) -> None:
        """Remembered questions first, all in one send; then the others, one by one."""
        answered, others = batch.reply_known(count, self._remembered)
        if answered:
            stats = self._resolver.stats
            stats.requests += len(answered)
            stats.queries.update(answered)  # each answer's (qtype, rcode, source)
            batch.send(self._fd)
        for i in others:  # after the send: an answer below may clear what the batch still sends
            self._answer_one(batch.datagram(i), batch.sender(i), oversized=batch.truncated(i))

    def _answer_one(self, data: bytes, addr: tuple[str | int, ...], *, oversized: bool) -> None:
        """Answer, or forward on the short path; a bug costs the one query, never the rest of its batch."""
        resolver = self._resolver
        try:
            asked = None if oversized else self._forwarded.get(data[2:])
            if asked is not None:  # as ``answer`` does for it, without a call more before the send
                resolver.stats.requests += 1
                query = _new_query(Query, ((data[0] << 8) | data[1], *asked[1:]))
            else:
                result = resolver.oversized(data) if oversized else resolver.answer(data, None)
                if result is None:
                    return
                if isinstance(result, bytes):
                    self._send(result, addr)
                    return
                query = result
            pending = self._pending
            if len(pending.tasks) + pending.callbacks >= MAX_PENDING_FORWARDS:
                return  # overloaded: dropping lets the client retry; queueing would only add latency
            pending.callbacks += 1  # until ``forwarded``, which the forwarder calls once
            try:
                forwarding = self._forward_soon(data, query, self, addr)
            except BaseException:
                pending.callbacks -= 1  # raised before sending: ``forwarded`` will not be called
                raise
            if not forwarding:
                pending.callbacks -= 1
                task = self._loop.create_task(self._forward(data, query, addr))
                pending.tasks.add(task)
                task.add_done_callback(pending.tasks.discard)
        except Exception:
            self._failures.record()

    def forwarded(self, parsed: Query, result: bytes | UpstreamError, client: Any) -> None:
        """The forwarder's outcome for a query this listener forwarded on the short path: the
        client's reply first, then the bookkeeping."""
        resolver = self._resolver
        if isinstance(result, bytes) and len(result) <= parsed.udp_limit:
            reply = result  # the usual case: the reply as it came, nothing to decide
        else:
            reply = resolver.client_reply(parsed, result, parsed.udp_limit)
        try:  # as ``_send``, without a call more before the system call (a closed socket raises)
            self.sock.sendto(reply, client)
        except OSError as err:
            log.debug("DNS UDP reply not sent: %s", err)
        self._pending.callbacks -= 1
        resolver.count_forwarded(parsed, result)

    async def _forward(self, data: bytes, query: Query, addr: tuple[str | int, ...]) -> None:
        try:
            reply = await self._resolver.forward(data, query, tcp=False)
        except Exception:
            log.exception("DNS forwarding failed")
            reply = servfail(query)
        self._send(reply, addr)

    def _send(self, reply: bytes, addr: tuple[str | int, ...]) -> None:
        if self._closed:
            return
        try:
            self.sock.sendto(reply, addr)
        except OSError as err:  # a full send buffer or a gone client: UDP, the client retries
            log.debug("DNS UDP reply not sent: %s", err)


class DnsServer:
    """UDP and TCP listeners for every listen address, all answering through one resolver."""

    def __init__(
        self, resolver: DnsResolver, addresses: Sequence[tuple[str, int]], *, registry: Registry
    ) -> None:
        self.resolver = resolver
        self._registry = registry
        self._addresses = list(addresses)
        self._udp: list[_UdpListener] = []
        self._tcp: list[asyncio.Server] = []
        self._pending = _Forwards()
        self._connections: set[asyncio.Task[None]] = set()
        self.bound: list[tuple[str, str, int]] = []
        """(protocol, host, port) actually bound, in Istio's order: udp a1, tcp a1, udp a2, ..."""

    async def start(self) -> None:
        """Bind every listener; raises OSError naming the address when one cannot be bound."""
        try:
            for host, port in self._addresses:
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                sock = socket.socket(family, socket.SOCK_DGRAM)
                try:
                    sock.setblocking(False)
                    sock.bind((host, port))
                    self._udp.append(_UdpListener(sock, self.resolver, self._pending))
                except BaseException:
                    sock.close()
                    raise
                self.bound.append(("udp", host, sock.getsockname()[1]))
                server = await asyncio.start_server(
                    self._serve_tcp, host, port, family=family, reuse_address=True, limit=TCP_LIMIT + 2
                )
                self._tcp.append(server)
                self.bound.append(("tcp", host, server.sockets[0].getsockname()[1]))
        except OSError as err:
            await self.stop()
            raise OSError(err.errno, f"cannot listen on {host}:{port}: {err.strerror or err}") from None
        self._registry.register(self.resolver.stats)
        log.info("DNS proxy listening on %s", ", ".join(f"{p} {h}:{n}" for p, h, n in self.bound))

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._connections) >= MAX_TCP_CONNECTIONS:
            writer.transport.abort()
            return
        self._connections.add(task)  # counted until the socket is really closed
        try:
            await self._tcp_queries(reader, writer)
        except (OSError, asyncio.IncompleteReadError, TimeoutError, ConnectionError):
            writer.transport.abort()  # the client went away or stalled: nothing to flush to it
        finally:
            writer.close()
            try:  # a client that stopped reading would keep an orderly close waiting forever
                async with asyncio.timeout(TCP_CLOSE_TIMEOUT):
                    await writer.wait_closed()
            except (OSError, TimeoutError):
                writer.transport.abort()
            self._connections.discard(task)

    async def _tcp_queries(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(TCP_QUERIES_PER_CONNECTION):
            try:
                async with asyncio.timeout(TCP_IDLE_TIMEOUT):
                    prefix = await reader.readexactly(2)
            except asyncio.IncompleteReadError as err:
                if not err.partial:
                    return  # clean close between queries
                raise
            (length,) = struct.unpack("!H", prefix)
            if length == 0:
                return
            async with asyncio.timeout(TCP_READ_TIMEOUT):
                data = await reader.readexactly(length)
            result = self.resolver.answer_now(data, TCP_LIMIT)
            if result is None:
                return  # unparsable: the stream cannot be trusted any more
            reply = (
                result if isinstance(result, bytes) else await self.resolver.forward(data, result, tcp=True)
            )
            writer.write(struct.pack("!H", len(reply)) + reply)
            async with asyncio.timeout(TCP_READ_TIMEOUT):
                await writer.drain()

    async def stop(self) -> None:
        for listener in self._udp:
            listener.close()
        for server in self._tcp:
            server.close()
        tasks = [*self._pending.tasks, *self._connections]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for server in self._tcp:
            await server.wait_closed()
        self._udp.clear()
        self._tcp.clear()
        self._registry.unregister(self.resolver.stats)
