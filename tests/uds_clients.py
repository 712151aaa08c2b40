"""Clients of the agent's Unix-socket gRPC servers that do nothing: they measure when the server hangs up."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import h2.config
import h2.connection


async def _closed_after(sock: socket.socket, began: float, timeout: float) -> float | None:
    """Seconds from ``began`` until the server closed ``sock`` (everything it sends is ignored), or None."""
    loop = asyncio.get_running_loop()

    async def until_eof() -> float:
        while True:
            try:
                if not await loop.sock_recv(sock, 65536):
                    return time.monotonic() - began
            except ConnectionError:
                return time.monotonic() - began

    try:
        return await asyncio.wait_for(until_eof(), timeout)
    except TimeoutError:
        return None


async def silent_client(path: Path, timeout: float) -> float | None:
    """Connect and never send a byte (not even the HTTP/2 preface): seconds until the server closed."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, str(path))
        return await _closed_after(sock, time.monotonic(), timeout)


async def idle_http2_client(path: Path, timeout: float) -> float | None:
    """Complete the HTTP/2 handshake, then open no stream: seconds until the server closed."""
    loop = asyncio.get_running_loop()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.setblocking(False)
        await loop.sock_connect(sock, str(path))
        connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        connection.initiate_connection()
        await loop.sock_sendall(sock, connection.data_to_send())
        began = time.monotonic()
        # The server's settings need an ACK for the handshake to complete: answer them once.
        connection.receive_data(await asyncio.wait_for(loop.sock_recv(sock, 65536), timeout))
        await loop.sock_sendall(sock, connection.data_to_send())
        return await _closed_after(sock, began, timeout)
