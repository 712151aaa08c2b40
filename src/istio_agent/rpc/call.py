"""One call as the agent's handlers see it: messages in and out, who calls, and how it ends.

The handlers (the xDS stream core, the SDS fetch) are written against :class:`Call`, so they do
not depend on the gRPC library underneath. :class:`ServerCall` is a call on an
:class:`~istio_agent.rpc.server.RpcServer`; its messages go through :mod:`istio_agent.rpc.message`
(grpclib would read any length it is told, and copies a message whole on each way).
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Sequence
from typing import Any, NoReturn, Protocol

import grpclib.exceptions
import h2.exceptions
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.server import Stream

from istio_agent.rpc.codec import Codec
from istio_agent.rpc.message import MessageError, MessageReader, write_message


class Call(Protocol):
    """What a handler may do with its call."""

    def peer(self) -> str:
        """Who is calling, for logs: ``unix:``, ``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``."""
        ...

    def metadata(self) -> Sequence[tuple[str, str | bytes]]:
        """The request's metadata (lower-case keys; ``-bin`` values as bytes)."""
        ...

    def peer_certificate(self) -> bytes | None:
        """The client's TLS certificate (DER), or None (plaintext, or none presented)."""
        ...

    def __aiter__(self) -> AsyncIterator[Any]:
        """The client's messages until it half-closes."""
        ...

    async def send(self, message: Any) -> None:
        """Write one message; raises ``CallEnded`` when the client is gone."""
        ...

    async def abort(self, code: Status, details: str) -> NoReturn:
        """End the call with a status other than OK (never returns)."""
        ...


class CallEnded(Exception):
    """The call cannot carry messages any more: the client went away or reset the stream."""


class ServerCall:
    """A call on an RpcServer (a grpclib stream); see :class:`Call`."""

    def __init__(self, stream: Stream[Any, Any], request_type: Any, max_receive_bytes: int) -> None:
        self._stream = stream
        self._request_type = request_type
        self._codec = Codec()
        self._reader = MessageReader(max_receive_bytes)

    def peer(self) -> str:
        address = self._stream.peer.addr()
        if not isinstance(address, tuple) or len(address) < 2:
            return "unix:"
        host, port = address[0], address[1]
        return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"

    def metadata(self) -> Sequence[tuple[str, str | bytes]]:
        return list((self._stream.metadata or {}).items())

    def peer_certificate(self) -> bytes | None:
        transport = self._stream._stream.connection._transport  # grpclib keeps it on the connection
        ssl_object: ssl.SSLObject | None = transport.get_extra_info("ssl_object")
        return ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None

    async def recv(self) -> Any:
        """The next message, or None when the client has half-closed."""
        try:
            data = await self._reader.read(self._stream._stream)  # the h2 stream under grpclib's
        except MessageError as err:
            raise GRPCError(err.code, err.details) from None
        if data is None:
            return None
        self._stream._messages_received += 1
        try:
            return self._codec.decode(data, self._request_type)
        except Exception as err:  # protobuf's DecodeError, or a message of the wrong shape
            raise GRPCError(
                Status.INTERNAL, f"grpc: failed to unmarshal the received message: {err}"
            ) from None

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[Any]:
        while (message := await self.recv()) is not None:
            yield message

    async def send(self, message: Any) -> None:
        stream = self._stream
        try:
            if not stream._send_initial_metadata_done:
                await stream.send_initial_metadata()
            await write_message(stream._stream, self._codec.encode(message, stream._send_type))
            stream._send_message_done = True
            stream._messages_sent += 1
        except (h2.exceptions.ProtocolError, grpclib.exceptions.ProtocolError, ConnectionError) as err:
            raise CallEnded(str(err) or type(err).__name__) from err

    async def abort(self, code: Status, details: str) -> NoReturn:
        raise GRPCError(code, details)
