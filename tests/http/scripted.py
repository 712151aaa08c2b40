"""A loopback server that answers every connection with fixed bytes: what a client must survive."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

Scripted = Callable[[bytes | None], Awaitable[tuple[int, list[bytes]]]]
"""Starts a server answering ``bytes`` (None: never answers); returns its port and the request heads."""


@pytest.fixture(name="scripted")
async def scripted_fixture() -> AsyncIterator[Scripted]:
    servers: list[asyncio.Server] = []

    async def start(answer: bytes | None) -> tuple[int, list[bytes]]:
        heads: list[bytes] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            heads.append(await reader.readuntil(b"\r\n\r\n"))
            if answer is None:
                await asyncio.sleep(10)  # never answers
            writer.write(answer or b"")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        servers.append(server)
        return server.sockets[0].getsockname()[1], heads

    yield start
    for server in servers:
        server.close()
