"""The HTTP/1.1 client's I/O-free part: whole responses, errors, and one h11 exchange (URLs: url.py).

h11 is sans-I/O, so one request/response engine serves both clients: the asyncio client
(:mod:`istio_agent.http.client`, the agent's) and the blocking one (:mod:`istio_agent.http.blocking`,
for short-lived processes such as the CNI plugin, which must not pay for importing asyncio). This
module imports neither asyncio nor sockets.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass

import h11

from istio_agent.http.headers import Fields, Headers
from istio_agent.http.url import URL, HTTPError

MAX_HEAD = 64 * 1024
DEFAULT_MAX_BODY = 16 * 2**20
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class ConnectError(HTTPError):
    """Dialing (TCP connect, or the TLS handshake) failed; ``os_error`` is why."""

    def __init__(self, address: str, os_error: OSError) -> None:
        self.address = address
        self.os_error = os_error
        super().__init__(f"cannot connect to {address}: {describe(os_error)}")


class ProtocolError(HTTPError):
    """The response was malformed, or the connection broke before it was complete."""


class BodyTooLarge(HTTPError):
    """The response body is larger than the caller's cap."""


@dataclass(frozen=True)
class Fetched:
    """A whole response; ``truncated`` when the body was cut at the caller's cap."""

    status: int
    reason: str
    headers: Headers
    body: bytes
    truncated: bool = False

    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")


def request_fields(
    method: str, url: URL, headers: Headers | Fields | None, body: bytes, *, keepalive: bool
) -> Headers:
    """The header fields sent: ``Host`` first unless given, the caller's, ``Content-Length`` for a
    body, and ``Connection: close`` unless the connection is to be kept."""
    given = headers if isinstance(headers, Headers) else Headers(headers)
    fields = Headers()
    if "Host" not in given:
        fields.add("Host", url.authority)
    for name, value in given.items():
        fields.add(name, value)
    if (body or method in _BODY_METHODS) and "Content-Length" not in fields:
        fields["Content-Length"] = str(len(body))
    if not keepalive and "Connection" not in fields:
        fields["Connection"] = "close"
    return fields


class ClientExchange:
    """One connection's h11 state: the request's bytes out, the response's events in."""

    def __init__(self, max_head: int = MAX_HEAD) -> None:
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=max_head)
        self.max_head = max_head

    def request(self, method: str, target: str, headers: Headers, body: bytes = b"") -> list[bytes]:
        """The request's bytes to send; HTTPError when it cannot be written (bad method, header)."""
        try:
            parts = [
                self.h11.send(
                    h11.Request(method=method, target=target.encode("latin-1"), headers=headers.raw())
                )
            ]
            if body:
                parts.extend(self.h11.send_with_data_passthrough(h11.Data(data=body)) or [])
            parts.append(self.h11.send(h11.EndOfMessage()))
        except (h11.LocalProtocolError, UnicodeEncodeError) as err:
            raise HTTPError(f"invalid request: {err}") from None
        return parts

    def next_event(self) -> h11.Event | type[h11.NEED_DATA]:
        """The next response event, or NEED_DATA; a malformed or cut-short response is ProtocolError."""
        try:
            event = self.h11.next_event()
        except h11.RemoteProtocolError as err:
            if err.error_status_hint == 431:
                raise ProtocolError(f"response head larger than {self.max_head} bytes") from None
            raise ProtocolError(f"malformed response: {err}") from None
        if event is h11.PAUSED or isinstance(event, h11.ConnectionClosed):
            raise ProtocolError("connection closed before the response was complete")
        return event  # type: ignore[return-value]

    def receive(self, data: bytes) -> None:
        """Bytes read from the connection (b"": it ended)."""
        self.h11.receive_data(data)

    def check_head(self, response: h11.Response) -> None:
        """h11 bounds only a head still incomplete: a complete one is measured here."""
        if sum(len(name) + len(value) + 4 for name, value in response.headers.raw_items()) > self.max_head:
            raise ProtocolError(f"response head larger than {self.max_head} bytes")


_TLS: ssl.SSLContext | None = None


def default_tls() -> ssl.SSLContext:
    """A verifying client context, made once (loading the system's roots takes a few ms)."""
    global _TLS
    if _TLS is None:
        _TLS = ssl.create_default_context()
    return _TLS


def describe(err: BaseException) -> str:
    """An OSError's reason as the system says it (asyncio's connect errors carry a longer text)."""
    if isinstance(err, OSError) and not isinstance(err, ssl.SSLError):
        if err.errno and err.errno > 0:
            return os.strerror(err.errno)
        if err.strerror:  # socket.gaierror: "Name or service not known"
            return err.strerror
    return str(err) or type(err).__name__
