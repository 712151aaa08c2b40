"""The agent's gRPC client: a channel to one target, unary calls and bidirectional streams.

grpclib's client (:class:`grpclib.client.Channel`) connects, writes headers and messages and keeps
the connection pinged; this module reads the responses itself and turns every way a call can fail
into one :class:`RpcError` with a gRPC status, as grpc-go reports them to Istio's agent:

- a status in the trailers, or in a trailers-only response (grpclib raises that one from
  ``recv_initial_metadata``), is the call's status;
- a server that ends a bidi stream before the client has half-closed (istiod does on errors) and
  then resets it (``RST_STREAM NO_ERROR``, as HTTP/2 allows) still gives its status and the
  messages sent before it: grpclib would report only the reset, and needs the client's side ended
  before it reads trailers;
- no connection (refused, reset, TLS handshake failed, ping unanswered, GOAWAY) is UNAVAILABLE with
  the reason, a deadline passed is DEADLINE_EXCEEDED.

A channel connects when its first call needs it and never reconnects on its own: a channel whose
calls have ended does not dial again (grpc's channels reconnect in the background).
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re
import ssl
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpclib.client
import h2.errors
import h2.exceptions
from grpclib.config import Configuration
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError, StreamTerminatedError
from grpclib.exceptions import ProtocolError as GrpclibProtocolError
from grpclib.metadata import USER_AGENT, decode_grpc_message, encode_timeout

from istio_agent.rpc.codec import Codec
from istio_agent.rpc.message import MessageError, MessageReader, write_message

Metadata = Sequence[tuple[str, str]]
"""Request metadata: lower-case keys, printable ASCII values (``-bin`` keys are not supported)."""

CONNECT_TIMEOUT = 20.0
"""Seconds for a connection (and its TLS handshake) to be made: grpc-go's minimum connect timeout."""
DEFAULT_MAX_RECEIVE_BYTES = 4 * 1024 * 1024
"""The largest response a call accepts unless told otherwise: grpc's default
(grpc-go's ``defaultClientMaxReceiveMessageSize``, grpcio's ``max_receive_message_length``)."""
WINDOW_BYTES = 1024 * 1024
"""The receive window of each stream and of the connection: Istio's agent dials istiod with 1 MiB
(pilot/pkg/grpc/grpc.go ``ClientOptions``); grpclib's default is 4 MiB. It bounds what the server
may send ahead of the reader, which the agent holds until it reads it."""

# grpc-go's status for a stream reset by its peer (internal/transport/http_util.go http2ErrConvTab).
_RESET_CODES = {
    "NO_ERROR": Status.INTERNAL,
    "PROTOCOL_ERROR": Status.INTERNAL,
    "INTERNAL_ERROR": Status.INTERNAL,
    "FLOW_CONTROL_ERROR": Status.INTERNAL,
    "SETTINGS_TIMEOUT": Status.INTERNAL,
    "STREAM_CLOSED": Status.INTERNAL,
    "FRAME_SIZE_ERROR": Status.INTERNAL,
    "REFUSED_STREAM": Status.UNAVAILABLE,
    "CANCEL": Status.CANCELLED,
    "COMPRESSION_ERROR": Status.INTERNAL,
    "CONNECT_ERROR": Status.INTERNAL,
    "ENHANCE_YOUR_CALM": Status.RESOURCE_EXHAUSTED,
    "INADEQUATE_SECURITY": Status.PERMISSION_DENIED,
    "HTTP_1_1_REQUIRED": Status.INTERNAL,
}
# HTTP status of a response that is not gRPC (gRPC's doc/http-grpc-status-mapping.md).
_HTTP_CODES = {
    "400": Status.INTERNAL,
    "401": Status.UNAUTHENTICATED,
    "403": Status.PERMISSION_DENIED,
    "404": Status.UNIMPLEMENTED,
    "429": Status.UNAVAILABLE,
    "502": Status.UNAVAILABLE,
    "503": Status.UNAVAILABLE,
    "504": Status.UNAVAILABLE,
}


class RpcError(Exception):
    """A call that did not end with OK: its gRPC status and the text that came with it."""

    def __init__(self, code: Status, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


def tls_context(
    root: bytes | None = None,
    client_cert: tuple[str, str] | None = None,
) -> ssl.SSLContext:
    """A TLS client context for gRPC: ALPN ``h2``, TLS 1.2 or later, the server's name verified.

    ``root``: PEM roots to trust (None: the OS trust store); ``client_cert``: ``(chain, key)``
    file paths of a certificate to present. ssl.SSLError/OSError when they cannot be loaded.
    """
    if root is None:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    else:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.load_verify_locations(cadata=root.decode("ascii"))
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["h2"])
    if client_cert is not None:
        chain, key = client_cert
        context.load_cert_chain(chain, key)
    return context


def parse_target(target: str) -> tuple[str | None, int | None, str | None]:
    """``(host, port, None)`` for ``host:port`` / ``[v6]:port``, ``(None, None, path)`` for ``unix:path``."""
    if target.startswith("unix:"):
        path = target[len("unix:") :]
        if path.startswith("//"):
            path = path[2:]
        return None, None, path
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"target {target!r} is not host:port or unix:path")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        ipaddress.IPv6Address(host)
    return host, int(port), None


class Channel:
    """Calls to one target over one HTTP/2 connection, made when a call first needs it.

    ``keepalive_time``: ping every that many seconds while a call is open (also when it carries no
    data) and close the connection when a ping is not answered within ``keepalive_timeout``.
    ``server_name``: the TLS name to verify instead of the target's host.
    ``max_receive_bytes``: the largest response its calls accept (a call may say otherwise); a
    larger one ends the call with RESOURCE_EXHAUSTED before it is read, as gRPC's clients do.
    """

    def __init__(
        self,
        target: str,
        *,
        ssl_context: ssl.SSLContext | None = None,
        server_name: str | None = None,
        keepalive_time: float | None = None,
        keepalive_timeout: float = 20.0,
        max_receive_bytes: int = DEFAULT_MAX_RECEIVE_BYTES,
    ) -> None:
        host, port, path = parse_target(target)
        self.target = target
        self.max_receive_bytes = max_receive_bytes
        config = Configuration(
            _keepalive_time=keepalive_time,
            _keepalive_timeout=keepalive_timeout,
            _keepalive_permit_without_calls=False,
            _http2_max_pings_without_data=0,
            _http2_min_sent_ping_interval_without_data=(keepalive_time or 1.0) / 2,
            ssl_target_name_override=server_name or None,
            http2_connection_window_size=WINDOW_BYTES,
            http2_stream_window_size=WINDOW_BYTES,
        )
        self._channel = grpclib.client.Channel(
            host, port, path=path, ssl=ssl_context, codec=Codec(), config=config
        )

    async def unary(
        self,
        path: str,
        request: Any,
        response_type: Any,
        *,
        metadata: Metadata | None = None,
        timeout: float | None = None,
        max_receive_bytes: int | None = None,
    ) -> Any:
        """One request, one response; RpcError for any other end."""
        call = BidiStream(
            self,
            path,
            type(request),
            response_type,
            metadata,
            timeout,
            unary=True,
            max_receive_bytes=max_receive_bytes,
        )
        try:
            await call.send(request)
            response = await call.recv()
            if response is None:
                raise RpcError(Status.UNIMPLEMENTED, "the server ended the call without a response")
            if await call.recv() is not None:
                raise RpcError(Status.UNIMPLEMENTED, "the server sent more than one response")
            return response
        finally:
            call.close()

    def stream(
        self,
        path: str,
        request_type: Any,
        response_type: Any,
        *,
        metadata: Metadata | None = None,
        max_receive_bytes: int | None = None,
    ) -> BidiStream:
        """A bidirectional stream; it opens with its first ``send``. ``max_receive_bytes``: the
        largest response it accepts (the channel's by default), as grpc's ``MaxCallRecvMsgSize``."""
        return BidiStream(
            self,
            path,
            request_type,
            response_type,
            metadata,
            None,
            max_receive_bytes=max_receive_bytes,
        )

    def close(self) -> None:
        """Close the connection; calls still open on it end with UNAVAILABLE."""
        self._channel.close()


class BidiStream:
    """One call: ``send``/``recv`` (None once the server ended with OK), ``done_writing``, ``cancel``.

    ``status`` is the call's end, once known: ``(Status, details)``.
    """

    def __init__(
        self,
        channel: Channel,
        path: str,
        request_type: Any,
        response_type: Any,
        metadata: Metadata | None,
        timeout: float | None,
        *,
        unary: bool = False,
        max_receive_bytes: int | None = None,
    ) -> None:
        self._channel = channel
        self._response_type = response_type
        self._unary = unary
        self._deadline = asyncio.get_running_loop().time() + timeout if timeout is not None else None
        cardinality = Cardinality.UNARY_UNARY if unary else Cardinality.STREAM_STREAM
        self._path = path
        self._metadata = list(metadata or ())
        self._call = channel._channel.request(path, cardinality, request_type, response_type)
        self._started = False
        self._opened = asyncio.Event()
        """Set once the request is sent or the call has failed before: ``recv`` waits for it."""
        self._released = False
        self._headers_read = False
        self._reader = MessageReader(
            channel.max_receive_bytes if max_receive_bytes is None else max_receive_bytes
        )
        """Keeps a message read in part: a read interrupted by the stream's end resumes it."""
        self.status: tuple[Status, str] | None = None

    # -- writing -------------------------------------------------------------------------------------
    async def send(self, message: Any) -> None:
        """Write one message (a unary call's only one ends the client's side)."""
        if self.status is not None:
            self._raise_ended()
        try:
            async with self._timeout():
                await self._start()
                await self._write(message)
        except Exception as err:
            self._fail(err)
            self._raise_ended()

    async def _write(self, message: Any) -> None:
        """grpclib's ``send_message``, with the message written by :func:`write_message`."""
        call = self._call
        if call._end_done:
            raise RpcError(Status.INTERNAL, "the client has ended its side of the call")
        with call._wrapper:  # woken when the stream is reset or the connection lost
            data = call._codec.encode(message, call._send_type)
            await write_message(call._stream, data, end=self._unary)
        call._send_message_done = True
        call._messages_sent += 1
        if self._unary:
            call._end_done = True

    async def done_writing(self) -> None:
        """Half-close: no more messages from the client; responses keep coming."""
        if self.status is not None or self._unary:
            return
        try:
            await self._start()
            await self._call.end()
        except Exception as err:
            self._fail(err)
            self._raise_ended()

    async def cancel(self) -> None:
        """End the call from the client's side (RST_STREAM CANCEL); its status becomes CANCELLED."""
        if self.status is None:
            self.status = (Status.CANCELLED, "the client cancelled the call")
        self._opened.set()
        if self._started:
            if self._call._stream.closable:
                self._call._stream.reset_nowait(h2.errors.ErrorCodes.CANCEL)
            # Wake a recv or send waiting in another task: it ends with this status.
            self._call._wrapper.cancel(StreamTerminatedError("the client cancelled the call"))
        self.close()

    def done(self) -> bool:
        return self.status is not None

    def close(self) -> None:
        """Let go of the HTTP/2 stream (reset if the server has not ended it)."""
        if self._started and not self._released:
            self._released = True
            if self._call._stream.closable:
                self._call._stream.reset_nowait(h2.errors.ErrorCodes.CANCEL)
            self._call._release_stream()

    async def _start(self) -> None:
        if self._started:
            return
        await self._call.__aenter__()  # the wrapper that wakes this call's waits when it ends
        async with asyncio.timeout(CONNECT_TIMEOUT):
            protocol = await self._channel._channel.__connect__()
        await self._send_headers(protocol)
        self._started = True
        self._opened.set()

    async def _send_headers(self, protocol: Any) -> None:
        """The request's headers, as grpclib's ``send_request`` writes them, but with metadata values
        checked as gRPC does: grpclib refuses an empty one, and Istio sends ``clusterid`` empty."""
        call, channel = self._call, self._channel._channel
        headers = [
            (":method", "POST"),
            (":scheme", channel._scheme),
            (":path", self._path),
            (":authority", channel._authority),
        ]
        if self._deadline is not None:
            remaining = max(self._deadline - asyncio.get_running_loop().time(), 0.001)
            headers.append(("grpc-timeout", encode_timeout(remaining)))
        headers += [("te", "trailers"), ("content-type", "application/grpc"), ("user-agent", USER_AGENT)]
        for key, value in self._metadata:
            if not _is_metadata(key, value):
                raise RpcError(Status.INTERNAL, f"invalid metadata {key!r}")
            headers.append((key, value))
        with call._wrapper:
            stream = protocol.processor.connection.create_stream(wrapper=call._wrapper)
            release = await stream.send_request(headers, _processor=protocol.processor)
        call._stream = stream
        call._release_stream = release
        call._send_request_done = True
        call.peer = stream.connection.get_peer()

    # -- reading -------------------------------------------------------------------------------------
    async def recv(self) -> Any:
        """The next message; None when the server ended the call with OK; RpcError otherwise."""
        if self.status is not None:
            self._raise_unless_ok()
            return None
        if not self._started:
            await self._opened.wait()  # the first send opens the stream
            if self.status is not None:
                self._raise_unless_ok()
                return None
        try:
            async with self._timeout():
                if not self._headers_read:
                    await self._read_headers()
                if self.status is None:
                    message = await self._read_message()
                    if message is not None:
                        return message
                    await self._read_trailers()
        except Exception as err:
            self._fail(err)
        self._raise_unless_ok()
        return None

    async def _read_headers(self) -> None:
        raw = self._call._stream
        if raw.headers is None:
            await self._wait(raw.recv_headers, lambda: raw.headers is not None)
        self._headers_read = True
        headers = dict(raw.headers or ())
        http_status = headers.get(":status")
        if http_status != "200":
            code = _HTTP_CODES.get(str(http_status), Status.UNKNOWN)
            self.status = (code, f"unexpected HTTP status code received from server: {http_status}")
        elif "grpc-status" in headers:  # trailers-only: the call ended without messages
            self.status = _status_of(headers)

    async def _read_message(self) -> Any:
        raw = self._call._stream
        try:
            data = await self._wait(lambda: self._reader.read(raw), lambda: raw.trailers is not None)
        except MessageError as err:
            self.close()  # the call ends here: RST_STREAM CANCEL, as grpc-go's client does
            raise RpcError(err.code, err.details) from None
        if data is None:
            return None
        self._call._messages_received += 1
        raw.connection.messages_received += 1
        try:
            return self._call._codec.decode(data, self._response_type)
        except Exception as err:
            raise RpcError(
                Status.INTERNAL, f"grpc: failed to unmarshal the received message: {err}"
            ) from None

    async def _read_trailers(self) -> None:
        raw = self._call._stream
        if raw.trailers is None:
            await self._wait(raw.recv_trailers, lambda: raw.trailers is not None)
        self.status = _status_of(dict(raw.trailers or ()))

    async def _wait(self, read: Callable[[], Awaitable[Any]], ended: Callable[[], bool]) -> Any:
        """``read()`` inside grpclib's wrapper, which wakes it when the stream is reset or the
        connection lost; when the server had ended the stream first (``ended()``: its trailers are
        in), what it sent before is all buffered and is read without it."""
        if not ended():
            try:
                with self._call._wrapper:
                    return await read()
            except StreamTerminatedError:
                if not ended():
                    raise
                _uncancel()  # the wrapper woke this task with cancel(): that cancellation is spent
        return await read()  # an interrupted read left what it had taken in the buffer

    # -- ending --------------------------------------------------------------------------------------
    def _timeout(self) -> Any:
        return asyncio.timeout_at(self._deadline)

    def _fail(self, err: BaseException) -> None:
        """Record why the call ended, unless the server's own status is known."""
        self._opened.set()
        if isinstance(err, StreamTerminatedError):
            _uncancel()
        if self.status is not None:
            return
        raw = getattr(self._call, "_stream", None)
        trailers = getattr(raw, "trailers", None)
        if trailers is not None:
            self.status = _status_of(dict(trailers))
            return
        self.status = self._status_of_error(err)

    def _status_of_error(self, err: BaseException) -> tuple[Status, str]:
        if isinstance(err, RpcError):
            return err.code, err.details
        if isinstance(err, GRPCError):
            return err.status, err.message or ""
        deadline = self._deadline
        if isinstance(err, TimeoutError) and deadline is not None and self._past(deadline):
            return Status.DEADLINE_EXCEEDED, "context deadline exceeded"
        if isinstance(err, StreamTerminatedError):
            return _terminated(str(err))
        if isinstance(err, ssl.SSLError):
            reason = err.reason or str(err)
            return Status.UNAVAILABLE, (
                f'connection error: desc = "transport: authentication handshake failed: {reason}: {err}"'
            )
        if isinstance(err, TimeoutError):
            return Status.UNAVAILABLE, f"connection error: dial {self._channel.target}: i/o timeout"
        if isinstance(err, OSError):
            # asyncio words a refused connection "Connect call failed (address)": the errno says why
            reason = os.strerror(err.errno) if err.errno else str(err) or type(err).__name__
            reason = reason.lower()
            return Status.UNAVAILABLE, f"connection error: dial {self._channel.target}: {reason}"
        if isinstance(err, (GrpclibProtocolError, h2.exceptions.ProtocolError)):
            return Status.INTERNAL, f"HTTP/2 protocol error: {err or type(err).__name__}"
        return Status.UNKNOWN, f"{type(err).__name__}: {err}"

    @staticmethod
    def _past(deadline: float) -> bool:
        return asyncio.get_running_loop().time() >= deadline - 0.001

    def _raise_unless_ok(self) -> None:
        if self.status is not None and self.status[0] is not Status.OK:
            raise RpcError(*self.status)

    def _raise_ended(self) -> None:
        assert self.status is not None
        code, details = self.status
        if code is Status.OK:
            raise RpcError(Status.UNAVAILABLE, "the server ended the stream")
        raise RpcError(code, details)


_KEY = re.compile(r"[0-9a-z_.\-]+")
_VALUE = re.compile(r"[ !-~]*")  # printable ASCII and space; may be empty
_RESERVED = frozenset({"te", "content-type", "user-agent"})


def _is_metadata(key: str, value: str) -> bool:
    return (
        bool(_KEY.fullmatch(key))
        and not key.startswith(("grpc-", ":"))
        and key not in _RESERVED
        and not key.endswith("-bin")
        and bool(_VALUE.fullmatch(value))
    )


def _uncancel() -> None:
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        task.uncancel()


def _status_of(headers: dict[str, str]) -> tuple[Status, str]:
    value = headers.get("grpc-status")
    if value is None:
        return Status.UNKNOWN, "the server ended the stream without a grpc-status"
    try:
        code = Status(int(value))
    except ValueError:
        return Status.UNKNOWN, f"invalid grpc-status: {value!r}"
    message = headers.get("grpc-message")
    return code, decode_grpc_message(message) if message else ""


def _terminated(reason: str) -> tuple[Status, str]:
    """grpc-go's status and words for a stream grpclib saw end without a status."""
    if reason.startswith("Stream reset by remote party"):
        name = reason.rpartition(".")[2] if "ErrorCodes." in reason else reason.rpartition(" ")[2]
        code = _RESET_CODES.get(name, Status.INTERNAL)
        return code, f"stream terminated by RST_STREAM with error code: {name}"
    if reason.startswith("Received GOAWAY"):
        name = reason.rpartition(".")[2] if "ErrorCodes." in reason else reason.rpartition(" ")[2]
        return Status.UNAVAILABLE, f"received prior goaway: code: {name}"
    if reason == "Connection lost":
        return Status.UNAVAILABLE, "error reading from server: EOF"
    if reason == "Connection closed":
        return Status.UNAVAILABLE, "transport is closing"
    return Status.UNAVAILABLE, reason
