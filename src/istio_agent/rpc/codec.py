"""How messages cross the wire: protobuf messages, or bytes passed through as they came."""

from __future__ import annotations

from typing import Any

from grpclib.encoding.base import CodecBase


class Codec(CodecBase):
    """Protobuf for message types; ``bytes`` as the type passes a message through undecoded.

    The xDS relay forwards istiod's responses to Envoy as bytes: decoding and re-encoding a push
    of thousands of clusters would cost time and a second copy of it.
    """

    __content_subtype__ = "proto"

    def encode(self, message: Any, message_type: Any) -> bytes:
        if message_type is bytes:
            return bytes(message)
        if not isinstance(message, message_type):
            raise TypeError(f"message is {type(message).__name__}, not {message_type.__name__}")
        data: bytes = message.SerializeToString()
        return data

    def decode(self, data: bytes, message_type: Any) -> Any:
        if message_type is bytes:
            return data
        return message_type.FromString(data)
