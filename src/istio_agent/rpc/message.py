"""gRPC's length-prefixed messages on a grpclib HTTP/2 stream, read and written without copying them whole.

The server's calls and the client's streams both use this module, so the 5-byte prefix is parsed
and the maximum enforced in one place. grpclib's own paths hold a large message several times: on
receive the DATA chunks until they are joined, then the join; on send the message with its prefix
prepended (a copy), cut into frames. Here:

- :class:`MessageReader` reads the prefix, refuses a length over the maximum before a byte of the
  message is buffered, then copies each DATA chunk into one ``bytearray`` of the announced length
  as it arrives, dropping the chunk. The chunks are acknowledged (WINDOW_UPDATE) as they are taken,
  as grpclib's ``Buffer.read`` does, so the peer's window opens as the message is read;
- :func:`write_message` sends the prefix with the first bytes of the payload, then memoryview
  slices of the payload, each no larger than the peer's frame size, the stream's send window and
  :data:`MAX_FRAME_BYTES`.

h2 still copies each frame as it serialises it (hyperframe's ``DataFrame.serialize``), and asyncio's
transport buffers what the socket does not take at once until ``pause_writing``; both are bounded
by a frame or the transport's high-water mark, not by the message.

grpclib internals used (pinned ``grpclib>=0.4.9,<0.5``): ``protocol.Stream.buffer`` (its
``_unacked`` queue of ``UnackedData``, its ``_acked`` deque and ``_ack_callback``),
``window_updated``, ``connection.write_ready`` and the h2 connection and transport behind them.
"""

from __future__ import annotations

import time
from typing import Any

from grpclib.const import Status
from grpclib.protocol import AckedData, Buffer, Stream, UnackedData

PREFIX_BYTES = 5
"""The compressed flag, then the message's length (big-endian uint32)."""

MAX_FRAME_BYTES = 64 * 1024
"""The largest DATA frame sent, whatever the peer allows: h2 copies a frame while framing it and
asyncio's transport may buffer it whole, so a frame as large as the message (grpcio announces
16 MiB frames and opens a wide window) would cost copies of the whole message."""


class MessageError(Exception):
    """A message that cannot be read: its gRPC status and grpc-go's words for it."""

    def __init__(self, code: Status, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


def too_large(size: int, limit: int) -> MessageError:
    return MessageError(
        Status.RESOURCE_EXHAUSTED, f"grpc: received message larger than max ({size} vs. {limit})"
    )


class MessageReader:
    """The messages of one stream, in order; ``read`` again after an interrupted read resumes it.

    ``max_bytes``: the largest message accepted (RESOURCE_EXHAUSTED over it).
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._prefix = bytearray(PREFIX_BYTES)
        self._prefix_filled = 0
        self._message: bytearray | None = None
        self._filled = 0

    async def read(self, stream: Stream) -> bytearray | None:
        """The next message (a new bytearray, the caller's to keep), or None when the stream ended
        cleanly between messages; MessageError when it cannot be read."""
        buffer = stream.buffer
        while self._prefix_filled < PREFIX_BYTES:
            taken = await read_into(buffer, self._prefix, self._prefix_filled)
            if not taken:
                if self._prefix_filled == 0:
                    return None
                raise MessageError(Status.INTERNAL, "the stream ended inside a message")
            self._prefix_filled += taken
        if self._message is None:
            if self._prefix[0]:
                raise MessageError(
                    Status.INTERNAL, "grpc: compressed flag set with identity or empty encoding"
                )
            size = int.from_bytes(self._prefix[1:], "big")
            if size > self.max_bytes:
                raise too_large(size, self.max_bytes)
            self._message = bytearray(size)
            self._filled = 0
        message = self._message
        while self._filled < len(message):
            taken = await read_into(buffer, message, self._filled)
            if not taken:
                raise MessageError(Status.INTERNAL, "the stream ended inside a message")
            self._filled += taken
        self._message = None
        self._prefix_filled = 0
        return message


async def read_into(buffer: Buffer, target: bytearray, offset: int) -> int:
    """Copy the stream's next bytes into ``target[offset:]``: what is already received, or, when
    nothing is, the next chunk to arrive. The count copied; 0 once the stream has ended.

    Nothing is taken from the buffer across the one ``await``, so a cancelled read loses nothing.
    """
    with memoryview(target) as whole:
        view = whole[offset:]
        copied = _take_ready(buffer, view)
        while not copied:
            if buffer._eof and buffer._unacked.empty():
                return 0
            data, size, ack_size = await buffer._unacked.get()
            if not ack_size and not size:
                if buffer._eof and buffer._unacked.empty():
                    return 0  # the end of the stream (grpclib's marker)
                continue  # an empty DATA frame
            buffer._ack_callback(ack_size)
            copied = _place(buffer, view, memoryview(data), size)
            copied += _take_ready(buffer, view[copied:])
        view.release()
        return copied


def _take_ready(buffer: Buffer, view: memoryview) -> int:
    """Copy what is received already (left over from a previous read, then queued) without waiting."""
    copied = 0
    while copied < len(view) and buffer._acked:
        chunk, size = buffer._acked.popleft()
        buffer._acked_size -= size
        copied += _place(buffer, view[copied:], chunk, size)
    while copied < len(view) and not buffer._unacked.empty():
        data, size, ack_size = buffer._unacked.get_nowait()
        if not ack_size and not size:
            if buffer._eof and buffer._unacked.empty():
                buffer._unacked.put_nowait(UnackedData(b"", 0, 0))  # keep the marker for the next read
                break
            continue
        buffer._ack_callback(ack_size)
        copied += _place(buffer, view[copied:], memoryview(data), size)
    return copied


def _place(buffer: Buffer, view: memoryview, chunk: memoryview, size: int) -> int:
    """Copy as much of ``chunk`` as fits in ``view``; the rest goes back to the front of the buffer."""
    count = min(size, len(view))
    view[:count] = chunk[:count]
    if count < size:
        buffer._acked.appendleft(AckedData(chunk[count:], size - count))
        buffer._acked_size += size - count
    return count


async def write_message(stream: Stream, payload: Any, *, end: bool = False) -> None:
    """Send ``payload`` (bytes-like) as one gRPC message, END_STREAM on its last frame if ``end``.

    Frames are cut to the peer's maximum frame size and the stream's send window; when the window
    is closed this waits for the peer's WINDOW_UPDATE (or its new SETTINGS), as grpclib does.
    """
    assert stream.id is not None
    h2 = stream._h2_connection
    with memoryview(payload) as whole:
        body = whole.cast("B") if whole.format != "B" or whole.ndim != 1 else whole
        prefix = b"\x00" + len(body).to_bytes(4, "big")
        position = -PREFIX_BYTES  # negative: inside the prefix
        total = len(body)
        while True:
            await stream.connection.write_ready.wait()
            window = h2.local_flow_control_window(stream.id)
            if window <= 0:  # it can be negative after the peer lowered its initial window
                stream.window_updated.clear()
                await stream.window_updated.wait()
                continue
            count = min(window, h2.max_outbound_frame_size, MAX_FRAME_BYTES, total - position)
            if position < 0:
                head = prefix[position + PREFIX_BYTES : min(PREFIX_BYTES, position + PREFIX_BYTES + count)]
                chunk: Any = head + body[: count - len(head)] if count > len(head) else head
            else:
                chunk = body[position : position + count]
            position += count
            last = position == total
            h2.send_data(stream.id, chunk, end_stream=end and last)
            stream._transport.write(h2.data_to_send())
            stream.data_sent += count
            stream.connection.data_sent += count
            stream.connection.data_send_process()
            if last:
                break
        if body is not whole:
            body.release()
    stream.connection.messages_sent += 1
    stream.connection.last_message_sent = time.monotonic()
