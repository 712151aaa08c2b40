"""One HTTP/1.1 request over a blocking socket, for short-lived processes (the CNI plugin).

The same h11 engine as the agent's asyncio client (:class:`istio_agent.http.exchange.ClientExchange`),
driven by plain socket calls: a process that exists for one GET does not import asyncio for it
(~75-95 ms of the plugin's ADD, docs/performance.md). Every socket operation gets only what is left
of the caller's deadline; running out is ``TimeoutError``.
"""

from __future__ import annotations

import socket
import ssl
import time

import h11

from istio_agent.http.exchange import (
    DEFAULT_MAX_BODY,
    URL,
    BodyTooLarge,
    ClientExchange,
    ConnectError,
    Fetched,
    ProtocolError,
    default_tls,
    describe,
    request_fields,
)
from istio_agent.http.headers import Fields, Headers

READ_SIZE = 64 * 1024


def fetch(
    method: str,
    url: str | URL,
    *,
    deadline: float,
    headers: Headers | Fields | None = None,
    body: bytes = b"",
    max_body: int = DEFAULT_MAX_BODY,
    tls: ssl.SSLContext | None = None,
    unix_socket: str | None = None,
) -> Fetched:
    """The whole response to ``method url`` on a connection of its own, before ``deadline``
    (``time.monotonic()``); over the Unix socket ``unix_socket`` when given (the URL then names the
    host for the ``Host`` header only, as Go's ``http://unix/...``). Raises HTTPError (ConnectError,
    ProtocolError, BodyTooLarge) or TimeoutError."""
    target = url if isinstance(url, URL) else URL.parse(url)
    fields = request_fields(method, target, headers, body, keepalive=False)
    exchange = ClientExchange()
    parts = exchange.request(method, target.target, fields, body)
    connected = _connect_unix(unix_socket, deadline) if unix_socket else _connect(target, deadline, tls)
    with connected as sock:
        try:
            _settimeout(sock, deadline)
            sock.sendall(b"".join(parts))
        except TimeoutError:
            raise
        except OSError as err:
            raise ProtocolError(f"connection lost while sending the request: {describe(err)}") from None
        while True:
            event = _next_event(exchange, sock, deadline)
            if isinstance(event, h11.Response):
                break  # InformationalResponse (100, 103): the final answer follows
        exchange.check_head(event)
        content = bytearray()
        while not isinstance(chunk := _next_event(exchange, sock, deadline), h11.EndOfMessage):
            if isinstance(chunk, h11.Data):
                content += chunk.data
                if len(content) > max_body:
                    raise BodyTooLarge(f"response body exceeds the {max_body} byte cap")
    return Fetched(
        event.status_code,
        event.reason.decode("latin-1"),
        Headers.from_raw(event.headers.raw_items()),
        bytes(content),
    )


def _connect(url: URL, deadline: float, tls: ssl.SSLContext | None) -> socket.socket:
    """A connected socket (TLS for https, verified by ``tls`` or the system's roots)."""
    host = _host_name(url.host)
    try:
        sock = _open(host, url.port, deadline)
    except TimeoutError:
        raise
    except OSError as err:  # refused, unreachable, no such host
        raise ConnectError(url.address, err) from None
    if url.scheme != "https":
        return sock
    context = tls if tls is not None else default_tls()
    try:
        _settimeout(sock, deadline)
        return context.wrap_socket(sock, server_hostname=host)
    except TimeoutError:
        sock.close()
        raise
    except OSError as err:  # ssl.SSLError is an OSError: a certificate that does not verify
        sock.close()
        raise ConnectError(url.address, err) from None


def _connect_unix(path: str, deadline: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        _settimeout(sock, deadline)
        sock.connect(path)
    except TimeoutError:
        sock.close()
        raise
    except OSError as err:  # no such file, refused
        sock.close()
        raise ConnectError(path, err) from None
    return sock


def _host_name(host: str) -> str | bytes:
    """The host as the resolver and TLS take it: an ASCII name (or address) as bytes, since for a
    ``str`` both ``getaddrinfo`` and ``ssl`` run the IDNA codec, whose import (with ``stringprep``
    and ``unicodedata``) costs ~0.8 ms of the CNI plugin's ADD; only a non-ASCII name needs it."""
    return host.encode("ascii") if host.isascii() else host


def _open(host: str | bytes, port: int, deadline: float) -> socket.socket:
    """A TCP connection to the first of the host's addresses that answers, before ``deadline``
    (``socket.create_connection``'s loop, which takes the host only as ``str``)."""
    failure: OSError = OSError(f"no address for {host!r}")
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            _settimeout(sock, deadline)
            sock.connect(address)
        except TimeoutError:
            sock.close()
            raise
        except OSError as err:
            sock.close()
            failure = err
        else:
            return sock
    raise failure


def _next_event(exchange: ClientExchange, sock: socket.socket, deadline: float) -> h11.Event:
    while True:
        event = exchange.next_event()
        if event is not h11.NEED_DATA:
            return event  # type: ignore[return-value]
        try:
            _settimeout(sock, deadline)
            data = sock.recv(READ_SIZE)
        except TimeoutError:
            raise
        except OSError as err:
            raise ProtocolError(f"connection lost: {describe(err)}") from None
        exchange.receive(data)


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the deadline has passed")
    return left


def _settimeout(sock: socket.socket, deadline: float) -> None:
    sock.settimeout(_remaining(deadline))
