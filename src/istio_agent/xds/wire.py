"""Just enough of the protobuf wire format to route an xDS response without decoding it.

The proxy forwards istiod's responses to Envoy as the bytes it received: decoding a 5,000-cluster
push into Python objects and encoding it again would cost time and two extra copies of the
largest message. Routing needs only ``type_url`` (field 4 of both DiscoveryResponse and
DeltaDiscoveryResponse), found by skipping over the other top-level fields.
"""

from __future__ import annotations

from dataclasses import dataclass

TYPE_URL_FIELD = 4
_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5


class WireError(ValueError):
    """The bytes are not a well-formed protobuf message."""


def _varint(data: bytes | bytearray, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise WireError("truncated or overlong varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def string_field(data: bytes | bytearray, number: int) -> str:
    """The last value of top-level string field ``number`` ("" when absent); WireError when malformed."""
    value: bytes | bytearray = b""
    pos = 0
    end = len(data)
    while pos < end:
        key, pos = _varint(data, pos)
        field, kind = key >> 3, key & 7
        if kind == _LENGTH:
            length, pos = _varint(data, pos)
            if pos + length > end:
                raise WireError(f"field {field} runs past the end of the message")
            if field == number:
                value = data[pos : pos + length]
            pos += length
        elif kind == _VARINT:
            _, pos = _varint(data, pos)
        elif kind == _FIXED64:
            pos += 8
        elif kind == _FIXED32:
            pos += 4
        else:
            raise WireError(f"unsupported wire type {kind} in field {field}")
        if pos > end:
            raise WireError("message is truncated")
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise WireError(f"field {number} is not UTF-8") from None


@dataclass(frozen=True)
class RawResponse:
    """An encoded DiscoveryResponse or DeltaDiscoveryResponse, with its type URL read off the wire."""

    data: bytes | bytearray  # the relay's receive buffer, handed on to Envoy as is
    type_url: str
    malformed: str = ""

    @classmethod
    def decode(cls, data: bytes | bytearray) -> RawResponse:
        try:
            return cls(data, string_field(data, TYPE_URL_FIELD))
        except WireError as err:
            return cls(data, "", str(err))

    def encode(self) -> bytes | bytearray:
        return self.data
