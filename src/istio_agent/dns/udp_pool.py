"""Forwarded UDP queries share a small pool of long-lived sockets per upstream, as dnsmasq does.

Why: a fresh socket per query (socket, connect, epoll registration, close) cost ~70 µs of CPU on
the latency path of every forwarded query. Here a query is one ``send`` on a socket that is already
open and registered, and its reply is handed over by a reader callback that stays registered for the
socket's life.

Spoofing resistance stays what a socket per query gave, plus a random ID:

- every socket is connected to its upstream, which binds it to a random ephemeral port and makes the
  kernel drop datagrams from any other address;
- every query goes out with a fresh random ID (from the OS's random source) that no other query in
  flight on that socket has; the reply carries the client's own ID again;
- a datagram is taken as the reply only when its ID is in flight on that socket and its question is
  the query's; anything else (a spoof, a stray, a reply that came after its query timed out) is
  dropped and counted;
- a socket is replaced after ``queries`` queries or ``lifetime`` seconds, so the ports keep moving;
  a replaced socket stays open until its last query in flight has ended.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import math
import os
import socket
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

from istio_agent.dns.wire import DnsFormatError, QuestionMismatch, check_reply
from istio_agent.log import scope

log = scope("dns")

OnReply: TypeAlias = Callable[[bytes | OSError | DnsFormatError], None]
"""Called once with the reply (the client's ID restored), or with why there will be none."""


class PoolClosed(OSError):
    """The forwarder was closed while a query was in flight: no other upstream should be tried."""


UDP_RECEIVE_BUFFER = 65535
"""A whole datagram: a big reply is relayed and truncated for the client by the server."""
_READS_PER_WAKEUP = 64
"""Datagrams read per readiness callback, so one busy socket cannot hold the event loop."""
_CLOCK_SLACK = 0.001
"""A deadline this close is due (uvloop's timer resolution)."""
_EXPIRY_GRAIN = 0.01
"""Timeouts due within this of each other are handled by one run of the pool's timer."""


@dataclass(frozen=True)
class PoolLimits:
    """How many sockets an upstream's pool keeps, and when one is replaced."""

    sockets: int = 32
    queries: int = 256
    """Queries sent on one socket before it is replaced."""
    lifetime: float = 60.0
    """Seconds a socket is used for new queries before it is replaced."""

    def __post_init__(self) -> None:
        if self.sockets < 1 or self.queries < 1 or self.lifetime <= 0:
            raise ValueError(f"UDP pool limits must be positive, got {self}")


def random_ids() -> Callable[[], int]:
    """16-bit query IDs from the OS's random source, drawn in batches (one syscall per 2,048 IDs).

    ``next`` on a chain of batches: taking an ID runs no Python code (on the latency path of every
    forwarded query), only drawing a batch does.
    """
    batches = iter(lambda: array("H", os.urandom(4096)), None)
    return functools.partial(next, itertools.chain.from_iterable(batches))


class _Channel:
    """One connected socket and the queries in flight on it, by the ID they went out with."""

    __slots__ = ("closed", "expires", "pending", "retired", "sock", "uses")

    def __init__(self, sock: socket.socket, expires: float) -> None:
        self.sock = sock
        self.expires = expires
        self.uses = 0
        self.retired = False
        self.closed = False
        self.pending: dict[int, Sent] = {}
        """The queries in flight, by the ID they went out with."""


class Sent:
    """A query in flight on a pool socket: what its reply must match, and who waits for it.

    A plain object rather than closures: the forwarded-query path makes one per query, and the
    waiter usually keeps it, so it must not hold the waiter once the query ended (no reference
    cycle left for the garbage collector to find).
    """

    __slots__ = ("_channel", "_id", "_on_reply", "_pool", "client_id", "deadline", "question", "wire")

    def __init__(
        self,
        pool: UdpPool,
        channel: _Channel,
        qid: int,
        wire: bytes,
        client_id: bytes,
        on_reply: OnReply,
        question: bytes | None,
    ) -> None:
        self._pool = pool
        self._channel = channel
        self._id = qid
        self._on_reply: OnReply | None = on_reply
        self.client_id = client_id
        self.wire = wire
        """The query as sent: the pool's random ID, then the client's bytes."""
        self.question = question
        self.deadline = math.inf
        """When the pool times the query out (``loop.time()``); never unless ``send`` got a timeout."""

    def settle(self, result: bytes | OSError | DnsFormatError) -> None:
        """The query's outcome to its waiter, once; a failing waiter costs this query, not the reader.

        The waiter first (it answers the client), then the ID is freed: nothing the waiter does can
        meet this query again, since the pool runs no callback of its own from inside the waiter's.
        """
        on_reply, self._on_reply = self._on_reply, None
        try:
            if on_reply is not None:
                on_reply(result)
        except Exception:
            log.exception("DNS forwarding: handling an upstream reply failed")
        finally:
            self.forget()

    def forget(self) -> None:
        """Stop waiting: the ID is freed and the waiter is not called any more (idempotent)."""
        self._on_reply = None
        channel = self._channel
        pending = channel.pending
        if pending.get(self._id) is self:
            del pending[self._id]
        if channel.retired and not pending:
            self._pool._close(channel)


class UdpPool:
    """The sockets that forward UDP queries to one upstream address, created as queries need them."""

    def __init__(
        self,
        family: int,
        address: Any,
        *,
        limits: PoolLimits,
        ids: Callable[[], int],
        unmatched: Callable[[], None],
    ) -> None:
        self.family = family
        self.address = address
        self._limits = limits
        self._ids = ids
        self._unmatched = unmatched
        """Called for each datagram that answers no query in flight (spoofed, stray or late)."""
        self._slots: list[_Channel | None] = [None] * limits.sockets
        self._open: set[_Channel] = set()
        """Every socket not yet closed: those in slots and retired ones with queries in flight."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._expiry: asyncio.Handle | None = None
        """The pool's one timer, at the earliest deadline of the queries in flight (``_expiry_at``)."""
        self._expiry_at = math.inf

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the pool's sockets are registered with (set by the first ``send``)."""
        assert self._loop is not None
        return self._loop

    @property
    def open_sockets(self) -> int:
        return len(self._open)

    def send(
        self, query: bytes, on_reply: OnReply, question: bytes | None = None, timeout: float | None = None
    ) -> Sent:
        """Send ``query``; ``on_reply`` is called at most once with its outcome, never from here.

        ``question``: the query's ``Query.question`` if the caller parsed it (a cheaper reply check).
        ``timeout``: seconds after which ``on_reply`` gets a TimeoutError (the pool's one timer, see
        ``_expire``); without it the caller bounds the wait itself. ``forget()`` on what this
        returns frees the query's ID and makes sure ``on_reply`` is not called any more. Raises
        OSError when the query cannot be sent (a full send buffer counts: UDP, another upstream may
        do better). ``close()`` ends every query in flight with PoolClosed.
        """
        # Only what the datagram needs comes before the send (this is on the query's latency); the
        # record of the query in flight is made after it, before the loop can read a reply.
        loop = self._loop
        if loop is None or not loop.is_running():  # (on Python 3.11 get_running_loop costs a getpid())
            loop = asyncio.get_running_loop()
        now = loop.time()
        qid = self._ids()
        channel = self._slots[qid % len(self._slots)] if loop is self._loop else None
        if channel is None or channel.uses >= self._limits.queries or now >= channel.expires:
            channel = self._channel(loop, qid, now)
        pending = channel.pending
        while qid in pending:
            qid = self._ids()
        wire = qid.to_bytes(2, "big") + query[2:]
        channel.sock.send(wire)
        channel.uses += 1
        sent = pending[qid] = Sent(self, channel, qid, wire, query[:2], on_reply, question)
        if timeout is not None:
            deadline = sent.deadline = now + timeout
            if deadline < self._expiry_at:
                self._expire_by(loop, deadline)
        return sent

    async def exchange(self, query: bytes) -> bytes:
        """The upstream's reply to ``query``, with the client's ID; raises OSError or DnsFormatError.

        No timeout of its own: the caller bounds the wait, and a cancelled wait frees the ID.
        """
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        def settle(result: bytes | OSError | DnsFormatError) -> None:
            if not future.done():
                if isinstance(result, bytes):
                    future.set_result(result)
                else:
                    future.set_exception(result)

        sent = self.send(query, settle)
        try:
            return await future
        finally:
            sent.forget()

    def _channel(self, loop: asyncio.AbstractEventLoop, random_id: int, now: float) -> _Channel:
        """The socket for the next query, picked by the query's random ID (so at random), opened anew.

        ``send`` takes the slot's socket itself while it is open, fresh and on this loop; this is
        the rest: a first socket, a new loop, or a socket that served its queries or its time.
        """
        if loop is not self._loop:
            self.close()  # sockets are registered with one loop (a new loop: tests, a restart)
            self._loop = loop
        index = random_id % len(self._slots)
        channel = self._slots[index]
        if channel is None or channel.uses >= self._limits.queries or now >= channel.expires:
            if channel is not None:
                self._retire(channel)
            channel = self._slots[index] = self._new_channel(loop)
        return channel

    def _expire_by(self, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        """Make sure the pool's timer fires no later than ``deadline``."""
        if deadline < self._expiry_at:
            if self._expiry is not None:
                self._expiry.cancel()
            self._expiry = loop.call_at(deadline, self._expire)
            self._expiry_at = deadline

    def _expire(self) -> None:
        """Time out every query past its deadline; then sleep until the next deadline, if any.

        One timer for the pool instead of one per query (a timer and its cancel cost ~3 µs of every
        forwarded query on uvloop). While queries end before their deadlines this runs about once
        per timeout; when an upstream stops answering, at most once per ``_EXPIRY_GRAIN``. Each run
        scans the queries in flight (bounded by the server's limit on forwarded queries).
        """
        self._expiry, self._expiry_at = None, math.inf
        loop = self._loop
        if loop is None or not self._open:
            return  # closed
        # uvloop's timers have a millisecond's resolution and may fire a rounding error early.
        now = loop.time() + _CLOCK_SLACK
        expired: list[Sent] = []
        next_deadline = math.inf
        for channel in self._open:
            for sent in channel.pending.values():
                if sent.deadline <= now:
                    expired.append(sent)
                elif sent.deadline < next_deadline:
                    next_deadline = sent.deadline
        for sent in expired:
            sent.settle(TimeoutError())  # the waiter may send again (and set the timer)
        if next_deadline != math.inf and self._open:  # (a waiter may have closed the pool)
            self._expire_by(loop, max(next_deadline, now + _EXPIRY_GRAIN))

    def _new_channel(self, loop: asyncio.AbstractEventLoop) -> _Channel:
        sock = socket.socket(self.family, socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            sock.connect(self.address)  # a random ephemeral port; other senders' datagrams are dropped
        except OSError:
            sock.close()
            raise
        channel = _Channel(sock, loop.time() + self._limits.lifetime)
        loop.add_reader(sock.fileno(), self._readable, channel)
        self._open.add(channel)
        return channel

    def _readable(self, channel: _Channel) -> None:
        sock, pending = channel.sock, channel.pending
        for _ in range(_READS_PER_WAKEUP):
            if channel.closed:
                return  # a query that ended on the last reply let a retired socket close
            try:
                data = sock.recv(UDP_RECEIVE_BUFFER)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:
                # An ICMP error for this connected socket (the upstream's port is closed, no route):
                # every query in flight on it went to that upstream, so each gets the error now.
                for waiting in list(pending.values()):
                    waiting.settle(OSError(err.errno, err.strerror))
                continue
            sent = pending.get((data[0] << 8) | data[1]) if len(data) >= 2 else None
            if sent is None:
                self._unmatched()
                continue
            try:
                check_reply(sent.wire, data, sent.question)
            except QuestionMismatch:
                self._unmatched()  # right port and ID, another question: a spoof; keep waiting
                continue
            except DnsFormatError as err:
                sent.settle(err)  # from the upstream with its ID but broken: fail fast
                continue
            sent.settle(sent.client_id + data[2:])
            if not pending:
                # Nothing else in flight: anything still queued is stray and is read at the next
                # wake-up. Not reading on until EAGAIN saves a system call and an exception per reply.
                return

    def _retire(self, channel: _Channel) -> None:
        channel.retired = True
        if not channel.pending:
            self._close(channel)

    def _close(self, channel: _Channel) -> None:
        if channel not in self._open:
            return
        self._open.discard(channel)
        channel.closed = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(channel.sock.fileno())
        channel.sock.close()

    def close(self) -> None:
        """Close every socket at once; queries still in flight fail with an OSError."""
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry, self._expiry_at = None, math.inf
        loop_alive = self._loop is not None and not self._loop.is_closed()
        for channel in list(self._open):
            if loop_alive:  # a closed loop cannot run what waits on the queries
                for sent in list(channel.pending.values()):
                    sent.settle(PoolClosed("the DNS forwarder was closed"))
            self._close(channel)
        self._slots = [None] * len(self._slots)
