"""Dialing for both HTTP clients: a chosen source address, TLS with ALPN, and a quick close.

Probes must come from 127.0.0.6 (see ``istio_agent.probe.source``), so the caller may supply the
socket factory that binds it; everything else (Envoy's admin API, ``pilot-agent wait``) uses the
default.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Callable

SocketFactory = Callable[[int, int, int], socket.socket]
"""Makes an unconnected socket for ``(family, type, proto)``; may bind it to a source address."""
AddressCheck = Callable[[str], None]
"""Vets a resolved IP address before it is dialled; raises (any exception) to refuse it."""

CLOSE_TIMEOUT = 0.1
"""How long close() lets the transport flush before dropping it."""
STREAM_LIMIT = 2**16


async def connect(
    host: str,
    port: int,
    socket_factory: SocketFactory | None = None,
    *,
    check_address: AddressCheck | None = None,
) -> socket.socket:
    """A connected non-blocking socket to the first address of ``host`` that accepts.

    Raises the ``OSError`` of the last address tried (``socket.gaierror`` when ``host`` does not resolve).
    With ``check_address``, each resolved address is vetted before it is dialled (after resolution, so
    a name cannot smuggle in a refused address): refused ones are skipped, and when every address is
    refused, the check's first exception is raised.
    """
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    last: OSError | None = None
    refused: Exception | None = None
    make = socket_factory or socket.socket
    for family, kind, proto, _, address in infos:
        if check_address is not None:
            try:
                check_address(str(address[0]))
            except Exception as err:
                refused = refused or err
                continue
        sock = make(family, kind, proto)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, address)
        except OSError as err:
            sock.close()
            last = err
            continue
        except BaseException:
            sock.close()
            raise
        return sock
    if last is None and refused is not None:
        raise refused
    raise last or OSError(f"no address for {host}")


class Stream:
    """A connected byte stream (plaintext or TLS) with what the clients ask of it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, tls: bool) -> None:
        self.reader = reader
        self.writer = writer
        self.tls = tls

    @property
    def alpn(self) -> str | None:
        """The protocol the server picked via ALPN (``None``: plaintext or no ALPN)."""
        ssl_object = self.writer.get_extra_info("ssl_object")
        return ssl_object.selected_alpn_protocol() if ssl_object is not None else None

    @property
    def peer(self) -> tuple[str, int]:
        name = self.writer.get_extra_info("peername")
        return (str(name[0]), int(name[1]))

    @property
    def closing(self) -> bool:
        return self.writer.is_closing() or self.reader.at_eof()

    def abort(self) -> None:
        """Drop the connection at once (after a failure or cancellation)."""
        self.writer.transport.abort()

    async def close(self) -> None:
        """Close without waiting long for the peer (for TLS, its close_notify).

        The answer is already in: a peer that never completes the TLS shutdown must not turn a
        successful exchange into a timeout (Go's client does not wait either).
        """
        self.writer.close()
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT):
                await self.writer.wait_closed()
        except (OSError, TimeoutError):
            self.abort()


async def open_stream(
    host: str,
    port: int,
    *,
    tls: ssl.SSLContext | None = None,
    server_hostname: str | None = None,
    socket_factory: SocketFactory | None = None,
    check_address: AddressCheck | None = None,
) -> Stream:
    """Dial ``host:port`` (TLS when ``tls`` is given: ALPN and verification are the context's).

    Connect errors are the socket's ``OSError``; a failed handshake is an ``ssl.SSLError`` or, when
    the server just drops the connection, a ``ConnectionError``. SNI is ``server_hostname``, by
    default the dialled name (the ssl module leaves it out for IP literals). ``check_address``: see
    ``connect``.
    """
    sock = await connect(host, port, socket_factory, check_address=check_address)
    try:
        reader, writer = await asyncio.open_connection(
            sock=sock,
            ssl=tls,
            server_hostname=(server_hostname or host) if tls is not None else None,
            limit=STREAM_LIMIT,
        )
    except BaseException:
        sock.close()
        raise
    return Stream(reader, writer, tls=tls is not None)
