"""A loopback TCP relay that counts the connections it accepts: a window on how often a client dials."""

from __future__ import annotations

import asyncio
import contextlib


class CountingRelay:
    """Listens on 127.0.0.1 and relays every connection to ``target_port``; ``accepted`` counts them.

    It relays bytes and never looks into them, so TLS goes end to end: a client that fails the
    handshake with the server behind it is still counted, once per attempt.
    """

    def __init__(self, target_port: int) -> None:
        self._target_port = target_port
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.WriteTransport] = set()
        self.accepted = 0
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> CountingRelay:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def stop(self) -> None:
        """Stop listening and cut every relayed connection (each relay then ends on its own)."""
        if self._server is None:
            return
        self._server.close()
        while self._open:
            self._open.pop().abort()
        await self._server.wait_closed()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self._open.add(writer.transport)
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self._target_port)
        except OSError:
            self._open.discard(writer.transport)
            writer.transport.abort()
            return
        self._open.add(upstream_writer.transport)
        await asyncio.gather(_pump(reader, upstream_writer), _pump(upstream_reader, writer))
        for transport in (writer.transport, upstream_writer.transport):
            self._open.discard(transport)
            transport.abort()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError):
        while data := await reader.read(64 * 1024):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
