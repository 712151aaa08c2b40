"""A UDP listener whose table hits never touch the event loop.

A dedicated thread blocks in ``recvfrom_into`` on a preallocated buffer, looks the question (the
query without its ID) up in the dict of prebuilt replies, and sends the reply with the query's ID
in front; both syscalls release the GIL. Per hit that is two syscalls and a dict lookup, where the
event loop's datagram callback cost an epoll round, a context copy, address conversion and a
transport call per packet. Anything that is not a prebuilt reply (a first question, a forwarded
name, a malformed packet) is handed to the event loop with ``call_soon_threadsafe`` and answered
there exactly as before, which is also what fills the dict.

Hits are counted in the listener's own Counter (one increment on the thread, no lock); the
resolver's stats add it up on scrape.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections import Counter
from collections.abc import Callable

from istio_agent.log import scope

log = scope("dns")

Address = tuple[str | int, ...]
StatsKey = tuple[int, int, str]
Replies = dict[bytes, tuple[bytes, StatsKey]]
"""Question bytes (the query from offset 2) -> (reply from offset 2, its metrics key)."""

RECEIVE_BUFFER = 65535
"""The largest UDP payload: a query is never cut short (EDNS queries may exceed 512 bytes)."""
JOIN_TIMEOUT = 2.0


class UdpListener:
    """One bound UDP socket served by one thread; ``on_miss(listener, data, addr)`` runs on the event loop."""

    def __init__(
        self,
        sock: socket.socket,
        replies: Replies,
        on_miss: Callable[[UdpListener, bytes, Address], None],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.sock = sock
        self.counts: Counter[StatsKey] = Counter()
        """Hits answered on the thread; written only by the thread."""
        self._replies = replies
        self._on_miss = on_miss
        self._loop = loop
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name=f"dns-udp-{self.port}", daemon=True)

    @classmethod
    def bind(
        cls,
        host: str,
        port: int,
        replies: Replies,
        on_miss: Callable[[UdpListener, bytes, Address], None],
        loop: asyncio.AbstractEventLoop,
    ) -> UdpListener:
        """A blocking UDP socket bound to host:port (0: any free port); raises OSError when it cannot be."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
        return cls(sock, replies, on_miss, loop)

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def start(self) -> None:
        self._thread.start()

    def send(self, reply: bytes, addr: Address) -> None:
        """Send from the event loop: never blocks it (a full socket buffer drops the reply; the client retries)."""
        if self._stopping:
            return
        try:
            self.sock.sendto(reply, socket.MSG_DONTWAIT, addr)
        except OSError as err:
            log.debug("DNS UDP reply not sent: %s", err)

    def _serve(self) -> None:
        buffer = bytearray(RECEIVE_BUFFER)
        view = memoryview(buffer)
        receive, send = self.sock.recvfrom_into, self.sock.sendto
        replies, counts = self._replies, self.counts
        hand_over, on_miss = self._loop.call_soon_threadsafe, self._on_miss
        while True:
            try:
                while True:  # the per-packet path: no attribute lookups, no flag checks
                    size, addr = receive(buffer)
                    known = replies.get(view[2:size].tobytes())
                    if known is not None:
                        counts[known[1]] += 1  # before sending: a reply a client saw is counted
                        send(buffer[:2] + known[0], addr)
                    elif addr is None and self._stopping:
                        return  # stop() shut the socket down: the receive returned nothing
                    else:
                        hand_over(on_miss, self, view[:size].tobytes(), addr)
            except OSError as err:  # e.g. ICMP port unreachable from a client that went away
                if self._stopping:
                    return
                log.debug("DNS UDP socket error: %s", err)
            except RuntimeError:  # the event loop is closed: nothing can answer a miss any more
                return

    def stop(self) -> None:
        """Wake the thread (shutdown makes a blocked receive return), join it, close the socket."""
        self._stopping = True
        with contextlib.suppress(OSError):  # ENOTCONN on an unconnected socket, yet a blocked receive wakes
            self.sock.shutdown(socket.SHUT_RDWR)
        if self._thread.is_alive():
            self._thread.join(JOIN_TIMEOUT)
            if self._thread.is_alive():
                log.warning("the DNS UDP thread on port %d did not stop in %.0fs", self.port, JOIN_TIMEOUT)
        self.sock.close()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()
