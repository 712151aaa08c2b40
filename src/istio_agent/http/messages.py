"""What a server handler sees and answers: ``Request``, ``Response`` (whole) and ``StreamResponse``.

A handler returns a response; the server sends it unless the handler already did. A handler that
must act only after its answer is on the wire (``/quitquitquit``) calls ``await response.prepare(request)``
first; a streaming handler prepares a ``StreamResponse`` and writes to it, each write waiting until
the client has taken the data (back-pressure).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, Protocol
from urllib.parse import parse_qsl, unquote, urlsplit

from istio_agent.http.headers import Fields, Headers


class RequestBodyTooLarge(Exception):
    """The request body is larger than the server's limit (answered 413 unless the handler catches it)."""


class Channel(Protocol):
    """The connection a request came on (implemented by the server)."""

    async def receive_body(self) -> bytes:
        """The next piece of the request body; ``b""`` at its end."""
        ...

    async def start_response(self, response: StreamResponse, body: bytes | None) -> None:
        """Send the head, and with ``body`` also that body and the end of the response."""
        ...

    async def send_body(self, data: bytes | bytearray | memoryview) -> None: ...

    async def end_response(self) -> None: ...


class Request:
    """One request: its head, the peer it came from, and its body (read on demand, capped)."""

    def __init__(
        self,
        method: str,
        target: str,
        headers: Headers | Fields | None = None,
        *,
        http_version: str = "1.1",
        peer: tuple[str, int] | None = None,
        channel: Channel | None = None,
        max_body: int = 2**20,
    ) -> None:
        self.method = method
        self.target = target
        self.headers = headers if isinstance(headers, Headers) else Headers(headers)
        self.http_version = http_version
        self.peer = peer
        self.channel = channel
        self.max_body = max_body
        if target.startswith("/") or "://" not in target:
            raw_path, _, self.query_string = target.partition("?")
        else:  # absolute form: GET http://host/path HTTP/1.1
            parts = urlsplit(target)
            raw_path, self.query_string = parts.path or "/", parts.query
        self.raw_path = raw_path
        self.path = unquote(raw_path)
        self._body: bytes | None = None

    @property
    def remote(self) -> str | None:
        """The peer's address (the real one: loopback-only paths are checked against it)."""
        return self.peer[0] if self.peer else None

    @property
    def query(self) -> dict[str, str]:
        """Query parameters (the first value of each)."""
        query: dict[str, str] = {}
        for key, value in parse_qsl(self.query_string, keep_blank_values=True):
            query.setdefault(key, value)
        return query

    async def read(self) -> bytes:
        """The whole body; raises RequestBodyTooLarge past ``max_body`` bytes."""
        if self._body is None:
            body = bytearray()
            if self.channel is not None:
                while chunk := await self.channel.receive_body():
                    body += chunk
                    if len(body) > self.max_body:
                        raise RequestBodyTooLarge(f"request body larger than {self.max_body} bytes")
            self._body = bytes(body)
        return self._body

    def __repr__(self) -> str:
        return f"<Request {self.method} {self.target}>"


class StreamResponse:
    """A response whose body is written piece by piece after ``prepare()``.

    Without a Content-Length header the body is sent chunked (or until close to an HTTP/1.0 client).
    """

    def __init__(
        self,
        status: int = 200,
        *,
        reason: str | None = None,
        headers: Headers | Fields | None = None,
        content_type: str | None = None,
    ) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers if isinstance(headers, Headers) else Headers(headers)
        if content_type is not None:
            self.headers["Content-Type"] = content_type
        self._channel: Channel | None = None
        self._ended = False

    @property
    def prepared(self) -> bool:
        return self._channel is not None

    @property
    def content_type(self) -> str | None:
        return self.headers.get("Content-Type")

    async def prepare(self, request: Request) -> None:
        """Send the status line and headers."""
        self._channel = self._bind(request)
        await self._channel.start_response(self, None)

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        """Send a piece of the body; returns once the transport has taken it (back-pressure).

        The data is copied before this returns: the caller may change its buffer afterwards.
        """
        if self._channel is None:
            raise RuntimeError("write() before prepare()")
        if data:
            await self._channel.send_body(data)

    async def write_eof(self) -> None:
        """End the body (once; later calls do nothing)."""
        if self._channel is None:
            raise RuntimeError("write_eof() before prepare()")
        if not self._ended:
            self._ended = True
            await self._channel.end_response()

    def _bind(self, request: Request) -> Channel:
        if self._channel is not None:
            raise RuntimeError("response already prepared")
        if request.channel is None:
            raise RuntimeError("the request has no connection to answer on")
        return request.channel


class Response(StreamResponse):
    """A whole response; ``prepare()`` sends it completely (head and body in one write)."""

    def __init__(
        self,
        status: int = 200,
        *,
        body: bytes = b"",
        text: str | None = None,
        content_type: str | None = None,
        charset: str = "utf-8",
        reason: str | None = None,
        headers: Headers | Fields | None = None,
    ) -> None:
        if text is not None:
            body = text.encode(charset)
            content_type = content_type or "text/plain"
            if "charset=" not in content_type:
                content_type = f"{content_type}; charset={charset}"
        super().__init__(status, reason=reason, headers=headers, content_type=content_type)
        self.body = body

    @classmethod
    def json(cls, data: Any, *, status: int = 200, indent: int | None = None) -> Response:
        return cls(status, body=json.dumps(data, indent=indent).encode(), content_type="application/json")

    async def prepare(self, request: Request) -> None:
        self._channel = self._bind(request)
        self._ended = True
        await self._channel.start_response(self, self.body)

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        raise RuntimeError("a whole Response is sent with its body; use StreamResponse to stream")


Handler = Callable[[Request], Awaitable[StreamResponse]]
"""A request handler: returns the response (sent by the server unless the handler prepared it)."""
