"""A minimal asyncio HTTP/2 client for app probes: one request per connection.

grpcio cannot bind a source address, yet Istio probes HTTPS apps over h2 when they negotiate it
and sends every probe from 127.0.0.6. This client does just what a probe needs: dial through
``dial`` (the caller's socket factory decides the source address; optional TLS with ALPN), one
request, a capped response, and a gRPC unary call on top.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from urllib.parse import unquote

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings

from istio_agent.http.dial import SocketFactory, Stream, open_stream

_READ_SIZE = 65536
_DEFAULT_MAX_GRPC_MESSAGE = 4 * 1024 * 1024  # gRPC's default maximum receive size
# Request headers that are connection-specific in HTTP/1.1 and forbidden in HTTP/2 (RFC 9113 8.2.2).
_CONNECTION_HEADERS = frozenset(
    {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "host"}
)


class H2Error(Exception):
    """The HTTP/2 exchange failed (protocol error, reset stream, connection closed early)."""


@dataclass(frozen=True)
class Response:
    """A response; ``body`` holds at most the requested number of bytes, ``truncated`` when the
    server sent more (reading stops there, without waiting for the rest)."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes
    trailers: tuple[tuple[str, str], ...] = ()
    truncated: bool = False

    def header(self, name: str) -> str | None:
        """First value of a response header (names are lower case in HTTP/2)."""
        return _first(self.headers, name)

    def trailer(self, name: str) -> str | None:
        return _first(self.trailers, name)


def _first(fields: tuple[tuple[str, str], ...], name: str) -> str | None:
    name = name.lower()
    return next((value for key, value in fields if key == name), None)


def _decode(fields: Sequence[tuple[bytes | str, bytes | str]]) -> tuple[tuple[str, str], ...]:
    return tuple((_text(name), _text(value)) for name, value in fields)


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


async def open_connection(
    host: str,
    port: int,
    *,
    tls: ssl.SSLContext | None = None,
    socket_factory: SocketFactory | None = None,
) -> Connection:
    """Dial ``host:port`` (TLS when ``tls`` is given: ALPN and verification are the context's).

    Connect errors are the socket's ``OSError`` (of the last address tried); a failed handshake
    is an ``ssl.SSLError`` or, when the server just drops the connection, a ``ConnectionError``.
    """
    return Connection(await open_stream(host, port, tls=tls, socket_factory=socket_factory))


class Connection:
    """One client connection carrying exactly one HTTP/2 request; use as an async context manager."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.scheme = "https" if stream.tls else "http"
        self._h2: h2.connection.H2Connection | None = None

    @property
    def alpn(self) -> str | None:
        """The protocol the server picked via ALPN (``None``: plaintext or no ALPN)."""
        return self.stream.alpn

    @property
    def peer(self) -> tuple[str, int]:
        return self.stream.peer

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is None:
            await self.close()
        else:
            self.abort()

    def abort(self) -> None:
        """Drop the connection at once (after a failure or cancellation)."""
        self.stream.abort()

    async def close(self) -> None:
        """Say GOAWAY (when HTTP/2 was started) and close without waiting for the peer's TLS close_notify."""
        with contextlib.suppress(OSError, h2.exceptions.H2Error):
            if self._h2 is not None:
                self._h2.close_connection()
                self.stream.writer.write(self._h2.data_to_send())
        await self.stream.close()

    async def request(
        self,
        method: str,
        path: str,
        *,
        authority: str,
        headers: Sequence[tuple[str, str]] = (),
        body: bytes = b"",
        max_body: int | None = None,
    ) -> Response:
        """Send one request and read its response, keeping at most ``max_body`` body bytes.

        Connection-specific HTTP/1.1 headers are dropped; ``te`` is kept only as ``trailers``.
        The body must fit the peer's initial flow-control window (probe bodies are tiny).
        """
        if self._h2 is not None:
            raise H2Error("one request per connection")
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        self._h2 = conn
        fields = [(":method", method), (":scheme", self.scheme), (":authority", authority), (":path", path)]
        for name, value in headers:
            lower = name.lower()
            if not lower or lower.startswith(":"):
                raise H2Error(f"invalid request header name {name!r}")
            if lower in _CONNECTION_HEADERS or (lower == "te" and value.strip().lower() != "trailers"):
                continue
            fields.append((lower, value))
        try:
            conn.initiate_connection()
            # No server push: pushed streams would take connection window we never give back.
            conn.update_settings({h2.settings.SettingCodes.ENABLE_PUSH: 0})
            stream_id = conn.get_next_available_stream_id()
            conn.send_headers(stream_id, fields, end_stream=not body)
            if body:
                if len(body) > conn.local_flow_control_window(stream_id):
                    raise H2Error("request body exceeds the HTTP/2 flow-control window")
                size = conn.max_outbound_frame_size
                for start in range(0, len(body), size):
                    chunk = body[start : start + size]
                    conn.send_data(stream_id, chunk, end_stream=start + size >= len(body))
        except h2.exceptions.H2Error as err:
            raise H2Error(f"invalid request: {err}") from None
        await self._flush()
        return await self._read_response(stream_id, max_body)

    async def _flush(self) -> None:
        assert self._h2 is not None
        data = self._h2.data_to_send()
        if data:
            self.stream.writer.write(data)
            await self.stream.writer.drain()

    async def _read_response(self, stream_id: int, max_body: int | None) -> Response:
        assert self._h2 is not None
        conn = self._h2
        status: int | None = None
        headers: tuple[tuple[str, str], ...] = ()
        trailers: tuple[tuple[str, str], ...] = ()
        body = bytearray()
        while True:
            try:
                data = await self.stream.reader.read(_READ_SIZE)
            except ConnectionError as err:
                raise H2Error(f"connection lost before the response was complete: {err}") from None
            if not data:
                raise H2Error("connection closed before the response was complete")
            try:
                events = conn.receive_data(data)
            except h2.exceptions.H2Error as err:
                raise H2Error(f"HTTP/2 protocol error: {err}") from None
            for event in events:
                if isinstance(event, h2.events.ResponseReceived) and event.stream_id == stream_id:
                    headers = _decode(event.headers or [])
                    status = _status(headers)
                elif isinstance(event, h2.events.DataReceived):
                    # Every stream's DATA is acknowledged, or the connection window could run dry.
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                    if event.stream_id != stream_id:
                        continue
                    body += event.data or b""
                    if max_body is not None and len(body) > max_body:
                        assert status is not None  # h2 rejects DATA before HEADERS
                        return Response(status, headers, bytes(body[:max_body]), trailers, truncated=True)
                elif isinstance(event, h2.events.TrailersReceived) and event.stream_id == stream_id:
                    trailers = _decode(event.headers or [])
                elif isinstance(event, h2.events.StreamEnded) and event.stream_id == stream_id:
                    if status is None:  # pragma: no cover - h2 rejects a stream ending without headers
                        raise H2Error("stream ended without response headers")
                    return Response(status, headers, bytes(body), trailers)
                elif isinstance(event, h2.events.StreamReset) and event.stream_id == stream_id:
                    raise H2Error(f"stream reset by the server (error code {_code(event.error_code)})")
                elif isinstance(event, h2.events.ConnectionTerminated):
                    raise H2Error(f"connection closed by the server (GOAWAY {_code(event.error_code)})")
            await self._flush()


def _status(headers: tuple[tuple[str, str], ...]) -> int:
    value = _first(headers, ":status")
    if value is None or not value.isdigit():
        raise H2Error(f"invalid :status {value!r}")
    return int(value)


def _code(code: object) -> str:
    name = getattr(code, "name", None)
    return str(name) if name else str(code)


# --- gRPC --------------------------------------------------------------------------------------

_GRPC_CODES = (
    "OK",
    "Canceled",
    "Unknown",
    "InvalidArgument",
    "DeadlineExceeded",
    "NotFound",
    "AlreadyExists",
    "PermissionDenied",
    "ResourceExhausted",
    "FailedPrecondition",
    "Aborted",
    "OutOfRange",
    "Unimplemented",
    "Internal",
    "Unavailable",
    "DataLoss",
    "Unauthenticated",
)
UNKNOWN = 2
DEADLINE_EXCEEDED = 4
RESOURCE_EXHAUSTED = 8
UNIMPLEMENTED = 12
INTERNAL = 13
UNAVAILABLE = 14
# HTTP status -> gRPC code for a response that is not a gRPC response (gRPC's http-grpc-status-mapping).
_HTTP_TO_GRPC = {400: INTERNAL, 401: 16, 403: 7, 404: UNIMPLEMENTED, 429: UNAVAILABLE, 502: UNAVAILABLE}
_HTTP_TO_GRPC.update({503: UNAVAILABLE, 504: UNAVAILABLE})


class GrpcError(Exception):
    """A gRPC call that ended with a non-OK status; ``str()`` reads like grpc-go's error."""

    def __init__(self, code: int, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"rpc error: code = {self.code_name} desc = {message}")

    @property
    def code_name(self) -> str:
        return _GRPC_CODES[self.code] if 0 <= self.code < len(_GRPC_CODES) else f"Code({self.code})"


def _grpc_timeout(seconds: float) -> str:
    """``grpc-timeout`` header value: at most 8 digits, in milliseconds (or seconds when longer)."""
    millis = max(1, int(seconds * 1000))
    return f"{millis}m" if millis < 100_000_000 else f"{min(int(seconds), 99_999_999)}S"


async def grpc_unary(
    conn: Connection,
    method: str,
    message: bytes,
    *,
    authority: str,
    user_agent: str | None = None,
    timeout: float | None = None,
    max_message: int = _DEFAULT_MAX_GRPC_MESSAGE,
) -> bytes:
    """Call the unary gRPC ``method`` (``/package.Service/Method``) with a serialized message.

    Returns the serialized response; a non-OK status (trailers, or headers for a trailers-only
    response, or a non-gRPC HTTP answer) raises ``GrpcError``. ``timeout`` only tells the server
    (``grpc-timeout``); the caller enforces it.
    """
    headers = [("content-type", "application/grpc"), ("te", "trailers")]
    if user_agent:
        headers.append(("user-agent", user_agent))
    if timeout is not None:
        headers.append(("grpc-timeout", _grpc_timeout(timeout)))
    frame = b"\x00" + len(message).to_bytes(4, "big") + message
    response = await conn.request(
        "POST", method, authority=authority, headers=headers, body=frame, max_body=max_message + 5
    )
    grpc_status = response.trailer("grpc-status") or response.header("grpc-status")
    if response.status != 200:
        code = _HTTP_TO_GRPC.get(response.status, UNKNOWN)
        raise GrpcError(code, f"unexpected HTTP status code received from server: {response.status}")
    content_type = response.header("content-type") or ""
    if not content_type.startswith("application/grpc"):
        raise GrpcError(UNKNOWN, f"unexpected content-type {content_type!r}")
    if response.truncated:
        raise GrpcError(RESOURCE_EXHAUSTED, f"response larger than {max_message} bytes")
    if grpc_status is None:
        raise GrpcError(INTERNAL, "server closed the stream without sending trailers")
    if not grpc_status.isdigit():
        raise GrpcError(UNKNOWN, f"invalid grpc-status {grpc_status!r}")
    if int(grpc_status) != 0:
        detail = response.trailer("grpc-message") or response.header("grpc-message") or ""
        raise GrpcError(int(grpc_status), unquote(detail))
    return _single_message(response.body)


def _single_message(body: bytes) -> bytes:
    """The one length-prefixed message of a unary response."""
    if len(body) < 5:
        raise GrpcError(INTERNAL, "no response message")
    if body[0] != 0:
        raise GrpcError(INTERNAL, "compressed response although no compression was offered")
    length = int.from_bytes(body[1:5], "big")
    if len(body) != 5 + length:
        raise GrpcError(INTERNAL, "malformed response message framing")
    return body[5:]
