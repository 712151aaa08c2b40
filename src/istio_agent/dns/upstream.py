"""Forwarding of queries the name table cannot answer to the resolv.conf nameservers (Istio: pkg/dns/client/proxy.go).

The query goes out over the transport the client used (UDP in, UDP out; TCP in, TCP out), as
Istio's agent does. Beyond Istio: UDP queries share a small pool of long-lived sockets per upstream
and go out with a random ID of their own (``udp_pool``; Istio opens a socket per query and keeps the
client's ID), parallel mode with no servers fails at once instead of hanging, optional extra rounds
with a short backoff, a 64 KiB UDP receive buffer (a big reply is relayed and truncated for the
client by the server, not turned into SERVFAIL), and an optional answer cache.

This is on the latency path of every forwarded query. In the common setup (nameservers given as IP
addresses, sequential, no extra rounds) a UDP query takes one short path (``forward_soon``): the
listener hands the parsed query to one ``_UdpForward``, which sends it on a pooled socket; the pool's
reader callback hands the reply back to it, and it hands the outcome to the listener (a
``ForwardReceiver``) with the client's address, with no task, no coroutine, no closure and no extra
turn of the event loop. Failover and the metrics are that object's (one place), timeouts and the
reply check the pool's, the client's size limit (TC) the resolver's. Every other case goes through
the coroutine ``forward``; TCP attempts are a bare non-blocking socket driven by ``loop.sock_*``.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import random
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from istio_agent.dns.cache import AnswerCache
from istio_agent.dns.table import shuffle_by_ids
from istio_agent.dns.udp_pool import PoolClosed, PoolLimits, UdpPool, random_ids
from istio_agent.dns.wire import Query, check_reply
from istio_agent.log import scope
from istio_agent.metrics import Registry

log = scope("dns")

_T = TypeVar("_T")

RETRY_BACKOFF_INITIAL = 0.05
"""Pause before the first extra round (DNS_FORWARD_RETRIES); doubled each round up to the cap."""
RETRY_BACKOFF_MAX = 0.8


class UpstreamError(Exception):
    """Every upstream attempt failed; the caller answers SERVFAIL (never a made-up NXDOMAIN)."""

    def __init__(self, errors: Sequence[tuple[str, str]]) -> None:
        self.errors = list(errors)
        """(server, error) for every failed attempt, in the order they failed."""
        if self.errors:
            detail = "; ".join(f"{server}: {error}" for server, error in self.errors)
        else:
            detail = "no upstream nameservers configured"
        super().__init__(f"all upstream DNS servers failed: {detail}")


class ForwardReceiver(Protocol):
    """Who gets the outcome of a query forwarded on the short path (the UDP listener)."""

    def forwarded(self, parsed: Query, result: bytes | UpstreamError, client: Any) -> None:
        """Called once per query, with the ``client`` given to ``forward_soon``."""


# eq=False: compared and hashed by identity, since the pools are looked up by it on every query
# (a frozen dataclass's own __hash__ runs in Python).
@dataclass(frozen=True, eq=False)
class _Upstream:
    label: str
    """``host:port`` (``[v6]:port``), as logged."""
    host: str
    port: int
    family: int | None
    """Known for IP literals; None for a host name, resolved at each attempt."""


def _upstream(host: str, port: int) -> _Upstream:
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        family = None  # resolv.conf nameservers are not validated (as in Istio): resolve when used
    label = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return _Upstream(label, host, port, family)


def shuffled(items: Sequence[_T], next_id: Callable[[], int]) -> list[_T]:
    """A copy of ``items`` in the order Istio's per-query shuffle gives for the same ID sequence."""
    out = list(items)
    shuffle_by_ids(out, next_id)
    return out


class _AttemptFailed(Exception):
    """One attempt's failure, with a message safe to log (never payload bytes)."""


def _describe(err: BaseException, timeout: float) -> str:
    if isinstance(err, TimeoutError):
        return f"i/o timeout after {timeout:g}s"
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    return str(err) or type(err).__name__


def _record_failure(
    server: _Upstream, err: BaseException, timeout: float, errors: list[tuple[str, str]]
) -> None:
    message = _describe(err, timeout)
    log.info("upstream failure: %s: %s", server.label, message)
    errors.append((server.label, message))


class _ForwarderMetrics:
    """The forwarder's metrics."""

    def __init__(self, registry: Registry) -> None:
        self.requests = registry.counter(
            "dns_upstream_requests_total", "Total number of DNS requests forwarded to upstream servers."
        )
        self.failures = registry.counter(
            "dns_upstream_failures_total",
            "Total number of DNS requests for which every upstream server failed.",
        )
        self.duration = registry.histogram(
            "dns_upstream_request_duration_seconds",
            "Time spent forwarding a DNS request upstream, over all attempts.",
            buckets=(0.001, 0.005, 0.01, 0.1, 1, 5),
        )
        self.unmatched = registry.counter(
            "dns_upstream_unmatched_replies_total",
            "UDP datagrams from an upstream that answer no query in flight (late, stray or spoofed), dropped.",
        )


class Forwarder:
    """Sends a client's query to the upstream nameservers and returns the first usable reply."""

    def __init__(
        self,
        servers: Sequence[tuple[str, int]],
        *,
        parallel: bool = False,
        timeout: float = 5.0,
        retries: int = 0,
        cache: AnswerCache | None = None,
        next_id: Callable[[], int] | None = None,
        pool_limits: PoolLimits | None = None,
        query_ids: Callable[[], int] | None = None,
        registry: Registry,
    ) -> None:
        self._metrics = _ForwarderMetrics(registry)
        if timeout <= 0:
            raise ValueError(f"DNS forward timeout must be positive, got {timeout}")
        if retries < 0:
            raise ValueError(f"DNS forward retries must not be negative, got {retries}")
        self._servers = [_upstream(host, port) for host, port in servers]
        self._parallel = parallel
        self._timeout = timeout
        self._retries = retries
        self._cache = cache
        self._next_id = next_id or functools.partial(random.getrandbits, 16)
        """Orders the servers as Istio's per-query shuffle does (query IDs come from the OS instead)."""
        self._pool_limits = pool_limits or PoolLimits()
        self._query_ids = query_ids or random_ids()
        """The IDs UDP queries go out with (injected by tests to force a collision)."""
        self._pools: dict[_Upstream, UdpPool] = {}
        self._callbacks_only = (
            bool(self._servers)
            and retries == 0
            and not (parallel and len(self._servers) > 1)
            and all(server.family is not None for server in self._servers)
        )
        """Whether ``forward_soon`` can forward UDP queries (see the module's docstring)."""

    def close(self) -> None:
        """Close the pooled UDP sockets; a later query opens new ones."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    @property
    def servers(self) -> list[str]:
        """The upstreams as ``host:port`` labels, in configuration order."""
        return [server.label for server in self._servers]

    @property
    def caches(self) -> bool:
        """Whether answers are cached (DNS_CACHE); without a cache ``cached()`` is always None."""
        return self._cache is not None

    def cached(self, parsed: Query) -> bytes | None:
        """The answer cache's reply for this query (DNS_CACHE), or None; no I/O, so callers answer at once."""
        return self._cache.get(parsed) if self._cache is not None else None

    async def forward(self, query: bytes, parsed: Query, *, tcp: bool, lookup_cache: bool = True) -> bytes:
        """The upstream reply to ``query`` (any rcode), checked against it; raises UpstreamError.

        ``lookup_cache=False``: the caller already asked ``cached()`` (the reply is still stored).
        """
        cache = self._cache
        if cache is not None and lookup_cache:
            hit = cache.get(parsed)
            if hit is not None:
                return hit
        self._metrics.requests.inc()
        started = time.perf_counter()
        try:
            reply = await self._exchange(query, tcp)
        except UpstreamError:
            self._finished(parsed, started, None)
            raise
        self._finished(parsed, started, reply)
        return reply

    def forward_soon(self, query: bytes, parsed: Query, receiver: ForwardReceiver, client: Any) -> bool:
        """Forward a UDP query on the short path; False (nothing done) when ``forward`` must be used.

        ``receiver.forwarded(parsed, reply or UpstreamError, client)`` is called once: from the pool's
        reader callback or timer, or from here when no server could be sent to. An exception it
        raises is logged, never raised here. As ``forward(..., lookup_cache=False)``: the caller
        already asked ``cached()``.
        """
        if not self._callbacks_only:
            return False
        _UdpForward(self, query, parsed, receiver, client).send()
        return True

    def _finished(self, parsed: Query, started: float, reply: bytes | None) -> None:
        """Metrics and cache of a forwarded query, whichever path it took."""
        self._metrics.duration.observe(time.perf_counter() - started)
        if reply is None:
            self._metrics.failures.inc()
        elif self._cache is not None:
            self._cache.put(parsed, reply)

    async def _exchange(self, query: bytes, tcp: bool) -> bytes:
        if not self._servers:
            raise UpstreamError([])  # beyond Istio: parallel mode with no servers does not hang
        errors: list[tuple[str, str]] = []
        delay = RETRY_BACKOFF_INITIAL
        for attempt_round in range(self._retries + 1):
            if attempt_round:
                await asyncio.sleep(delay)  # a pause between rounds, not a wait for an event
                delay = min(delay * 2, RETRY_BACKOFF_MAX)
            if self._parallel and len(self._servers) > 1:
                reply = await self._parallel_round(query, tcp, errors)
            else:
                reply = await self._sequential_round(query, tcp, errors)
            if reply is not None:
                return reply
        raise UpstreamError(errors)

    async def _sequential_round(self, query: bytes, tcp: bool, errors: list[tuple[str, str]]) -> bytes | None:
        # The first reply without a transport or format error wins whatever its rcode: no failover on
        # SERVFAIL/REFUSED/NXDOMAIN, as in Istio.
        for server in shuffled(self._servers, self._next_id):
            reply = await self._attempt(server, query, tcp, errors)
            if reply is not None:
                return reply
        return None

    async def _parallel_round(self, query: bytes, tcp: bool, errors: list[tuple[str, str]]) -> bytes | None:
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(self._attempt(server, query, tcp, errors)) for server in self._servers]
        pending: set[asyncio.Task[bytes | None]] = set(tasks)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in tasks:  # configuration order breaks ties
                    if task in done:
                        reply = task.result()
                        if reply is not None:
                            return reply
            return None
        finally:
            for task in pending:
                task.cancel()  # a cancelled query frees its ID on its pooled socket

    async def _attempt(
        self, server: _Upstream, query: bytes, tcp: bool, errors: list[tuple[str, str]]
    ) -> bytes | None:
        """One exchange with one server; a failure is logged and recorded, and gives None."""
        try:
            async with asyncio.timeout(self._timeout):
                if tcp:
                    return await self._exchange_tcp(server, query)
                return await self._exchange_udp(server, query)
        except (OSError, TimeoutError, ValueError, _AttemptFailed) as err:  # ValueError: DnsFormatError
            _record_failure(server, err, self._timeout, errors)
            return None

    async def _address(self, server: _Upstream, kind: int) -> tuple[int, Any]:
        if server.family is not None:
            return server.family, (server.host, server.port)
        infos = await asyncio.get_running_loop().getaddrinfo(server.host, server.port, type=kind)
        if not infos:
            raise _AttemptFailed(f"no address for {server.host}")
        family, _, _, _, address = infos[0]
        return family, address

    def _pool(self, server: _Upstream, family: int, address: Any) -> UdpPool:
        """The pool for ``server``, opened (or reopened, when its host name moved) for ``address``."""
        pool = self._pools.get(server)
        if pool is None or (pool.family, pool.address) != (family, address):
            if pool is not None:
                pool.close()  # the host name now resolves elsewhere
            pool = self._pools[server] = UdpPool(
                family,
                address,
                limits=self._pool_limits,
                ids=self._query_ids,
                unmatched=self._metrics.unmatched.inc,
            )
        return pool

    def _literal_pool(self, server: _Upstream) -> UdpPool:
        """The pool for a server given as an IP address (no resolving, so no await)."""
        pool = self._pools.get(server)
        if pool is None:
            assert server.family is not None
            pool = self._pool(server, server.family, (server.host, server.port))
        return pool

    async def _exchange_udp(self, server: _Upstream, query: bytes) -> bytes:
        if server.family is not None:
            pool = self._literal_pool(server)
        else:
            pool = self._pool(server, *await self._address(server, socket.SOCK_DGRAM))
        return await pool.exchange(query)

    async def _exchange_tcp(self, server: _Upstream, query: bytes) -> bytes:
        loop = asyncio.get_running_loop()
        family, address = await self._address(server, socket.SOCK_STREAM)
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await loop.sock_connect(sock, address)
            await loop.sock_sendall(sock, struct.pack("!H", len(query)) + query)
            (length,) = struct.unpack("!H", await _receive_exactly(loop, sock, 2))
            reply = await _receive_exactly(loop, sock, length)
            if reply[:2] != query[:2]:
                raise _AttemptFailed("reply ID does not match the query")
            check_reply(query, reply)
            return reply
        finally:
            sock.close()


class _UdpForward:
    """One UDP query on the short path: the servers in Istio's per-query order, one attempt each.

    The pool calls ``_reply`` with each attempt's outcome; the first reply (any rcode) or the last
    failure goes to the receiver, then the metrics are counted, off the client's latency.
    """

    __slots__ = (
        "_client",
        "_errors",
        "_forwarder",
        "_next",
        "_order",
        "_parsed",
        "_query",
        "_receiver",
        "_server",
        "_started",
    )

    def __init__(
        self, forwarder: Forwarder, query: bytes, parsed: Query, receiver: ForwardReceiver, client: Any
    ) -> None:
        self._forwarder = forwarder
        self._query = query
        self._parsed = parsed
        self._receiver = receiver
        self._client = client
        servers = forwarder._servers
        self._order = servers if len(servers) == 1 else shuffled(servers, forwarder._next_id)
        self._next = 0
        self._errors: list[tuple[str, str]] = []
        self._server: _Upstream | None = None
        self._started = time.perf_counter()

    def send(self) -> None:
        """Send to the next server; when none is left (or none could be sent to), finish with the errors."""
        forwarder, order = self._forwarder, self._order
        while self._next < len(order):
            server = order[self._next]
            self._next += 1
            pool = forwarder._pools.get(server) or forwarder._literal_pool(server)
            try:
                pool.send(self._query, self._reply, self._parsed.question, forwarder._timeout)
            except OSError as err:
                _record_failure(server, err, forwarder._timeout, self._errors)
                continue
            self._server = server
            return
        self._reply(UpstreamError(self._errors))

    def _reply(self, result: bytes | OSError | ValueError | UpstreamError) -> None:
        """An attempt's outcome from the pool, once (a reply, an error, a TimeoutError), or the
        end of the servers from ``send``: the receiver gets a reply or the last failure, then the
        metrics are counted, off the client's latency.

        The pool forgets the query after this returns: nothing is left to cancel.
        """
        if not isinstance(result, bytes):
            outcome = self._failed(result)
            if outcome is None:
                return  # sent to the next server
            result = outcome
        try:
            self._receiver.forwarded(self._parsed, result, self._client)
        except Exception:  # a bug in the receiver costs this query's answer, not the metrics or the pool
            log.exception("DNS forwarding: answering the client failed")
        forwarder = self._forwarder
        forwarder._metrics.requests.inc()
        forwarder._finished(self._parsed, self._started, result if isinstance(result, bytes) else None)

    def _failed(self, error: OSError | ValueError | UpstreamError) -> UpstreamError | None:
        """After a failed attempt: the next server is tried (None), or the failure to deliver."""
        if isinstance(error, UpstreamError):
            return error
        assert self._server is not None
        if isinstance(error, PoolClosed):  # the agent is stopping: no other upstream
            self._errors.append((self._server.label, str(error)))
            return UpstreamError(self._errors)
        _record_failure(self._server, error, self._forwarder._timeout, self._errors)
        self.send()
        return None


async def _receive_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = await loop.sock_recv(sock, size - len(data))
        if not chunk:
            raise _AttemptFailed("connection closed before a full reply")
        data += chunk
    return data
