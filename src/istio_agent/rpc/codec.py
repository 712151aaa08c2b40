"""How messages cross the wire: protobuf messages, or bytes passed through as they came."""

from __future__ import annotations

from typing import Any

from grpclib.encoding.base import CodecBase

RAW_TYPES = (bytes, bytearray)


class Codec(CodecBase):
    """Protobuf for message types; ``bytes`` or ``bytearray`` as the type passes a message through
    undecoded.

    The xDS relay forwards istiod's responses to Envoy as bytes: decoding and re-encoding a push
    of thousands of clusters would cost time and a second copy of it. A message is received into a
    ``bytearray`` (:mod:`istio_agent.rpc.message`): ``bytearray`` as the type hands out that buffer
    itself, ``bytes`` an immutable copy of it. Sending, any bytes-like message (a ``memoryview``
    too) is written as it is, without a copy.
    """

    __content_subtype__ = "proto"

    def encode(self, message: Any, message_type: Any) -> Any:
        if message_type in RAW_TYPES:
            if isinstance(message, (bytes, bytearray, memoryview)):
                return message
            raise TypeError(f"message is {type(message).__name__}, not bytes-like")
        if not isinstance(message, message_type):
            raise TypeError(f"message is {type(message).__name__}, not {message_type.__name__}")
        data: bytes = message.SerializeToString()
        return data

    def decode(self, data: Any, message_type: Any) -> Any:
        if message_type is bytearray:
            return data if isinstance(data, bytearray) else bytearray(data)
        if message_type is bytes:
            return bytes(data)
        return message_type.FromString(data)
