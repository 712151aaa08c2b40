"""A minimal HTTP/1.1 client for Envoy's admin interface (stats, drain, quit).

The admin calls the agent makes during start-up (readiness) and shutdown (drain) are tiny GETs and
POSTs to a loopback port. Doing them on asyncio streams keeps aiohttp, which costs about 100 ms to
import, off the start-up path, so the agent can serve Envoy's SDS and xDS while Envoy starts.
"""

from __future__ import annotations

import asyncio
import contextlib

MAX_BODY = 16 * 1024 * 1024
"""Admin answers the agent asks for are small (filtered stats); anything bigger is an error."""


class AdminError(Exception):
    """The admin call failed (connection, timeout, or a malformed answer); the message says which."""


async def admin_request(host: str, port: int, method: str, target: str, *, timeout: float) -> tuple[int, str]:
    """``method target`` against Envoy's admin; returns (status, body). Raises AdminError."""
    try:
        return await asyncio.wait_for(_exchange(host, port, method, target), timeout)
    except TimeoutError:
        raise AdminError(f"timeout after {timeout:g}s") from None
    except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as err:
        # ValueError: StreamReader's over-long line
        raise AdminError(str(err) or type(err).__name__) from None


async def _exchange(host: str, port: int, method: str, target: str) -> tuple[int, str]:
    reader, writer = await asyncio.open_connection(host.strip("[]"), port)
    try:
        authority = f"[{host.strip('[]')}]:{port}" if ":" in host else f"{host}:{port}"
        writer.write(
            f"{method} {target} HTTP/1.1\r\nHost: {authority}\r\nContent-Length: 0\r\n"
            "Connection: close\r\n\r\n".encode("latin-1")
        )
        status_line = await reader.readline()
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise AdminError(f"malformed status line {status_line[:100]!r}")
        status = int(parts[1])
        headers: dict[str, str] = {}
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        body = await _read_body(reader, headers)
        return status, body.decode("utf-8", errors="replace")
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        chunks = bytearray()
        while True:
            size_line = await reader.readline()
            text = size_line.split(b";", 1)[0].strip()
            if not text or any(c not in b"0123456789abcdefABCDEF" for c in text):
                raise AdminError(f"malformed chunk size {size_line[:50]!r}")
            size = int(text, 16)
            if size == 0:
                return bytes(chunks)
            if len(chunks) + size > MAX_BODY:
                raise AdminError(f"answer larger than {MAX_BODY} bytes")
            chunks += await reader.readexactly(size)
            await reader.readexactly(2)  # CRLF after each chunk
    length = headers.get("content-length")
    if length is not None:
        if not length.isdigit() or int(length) > MAX_BODY:
            raise AdminError(f"bad Content-Length {length[:20]!r}")
        return await reader.readexactly(int(length))
    body = bytearray()  # neither: the body runs to the end of the connection
    while chunk := await reader.read(65536):
        body += chunk
        if len(body) > MAX_BODY:
            raise AdminError(f"answer larger than {MAX_BODY} bytes")
    return bytes(body)
