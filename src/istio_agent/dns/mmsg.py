"""Batches of datagrams in and out of one UDP socket with Linux's ``recvmmsg`` and ``sendmmsg``.

Why: the DNS proxy answers a table hit with ~1 µs of Python, but a datagram callback per query cost
an event-loop wake-up, a receive, a send, and the client's address turned into a ``(host, port)``
tuple and parsed back (~12 µs of CPU per query against dnsmasq's ~8). With these, one readiness
callback reads up to ``size`` queries in one system call and sends their replies in one more, and a
reply goes back to the raw ``sockaddr`` its query came from without ever becoming a Python object.

The two calls are not in Python's standard library, so they are called through ctypes. Every
structure is allocated once per socket; the hot path reads and writes their fields through
memoryviews, because one ctypes attribute access per field would cost more than batching saves.
"""

from __future__ import annotations

import ctypes
import errno
import socket
import struct
from collections.abc import Callable, Mapping
from typing import TypeVar

_Extra = TypeVar("_Extra")

_SOCKADDR_SIZE = 128
"""sizeof(struct sockaddr_storage): room for any address family."""
_MSG_DONTWAIT = 0x40
_MSG_TRUNC = 0x20


class _Iovec(ctypes.Structure):
    _fields_ = (("base", ctypes.c_void_p), ("len", ctypes.c_size_t))


class _Msghdr(ctypes.Structure):
    _fields_ = (
        ("name", ctypes.c_void_p),
        ("namelen", ctypes.c_uint32),
        ("iov", ctypes.c_void_p),
        ("iovlen", ctypes.c_size_t),
        ("control", ctypes.c_void_p),
        ("controllen", ctypes.c_size_t),
        ("flags", ctypes.c_int),
    )


class _Mmsghdr(ctypes.Structure):
    _fields_ = (("hdr", _Msghdr), ("len", ctypes.c_uint))


_WORD = ctypes.sizeof(ctypes.c_void_p)
_HEADER_SIZE = ctypes.sizeof(_Mmsghdr)
# Field positions in the memoryviews: pointers and sizes as words ("P"), 32-bit fields as "I".
_NAME = _Msghdr.name.offset // _WORD
_NAMELEN = _Msghdr.namelen.offset // 4
_FLAGS = _Msghdr.flags.offset // 4
_LEN = _Mmsghdr.len.offset // 4
_HEADER_WORDS = _HEADER_SIZE // _WORD
_HEADER_INTS = _HEADER_SIZE // 4
_IOV_WORDS = ctypes.sizeof(_Iovec) // _WORD


_Functions = tuple[Callable[..., int], Callable[..., int]]
_loaded: list[_Functions | None] = []
"""libc's recvmmsg and sendmmsg once looked up (None: not there); empty until the first use, so
importing this module does no work (issue 23: nothing at import time)."""


def _libc_functions() -> _Functions | None:
    if not _loaded:
        _loaded.append(_look_up_libc())
    return _loaded[0]


def _look_up_libc() -> _Functions | None:
    # PyDLL: the calls never block (MSG_DONTWAIT, a non-blocking socket), so the GIL is kept
    # instead of being released and taken back twice per batch.
    try:
        libc = ctypes.PyDLL(None, use_errno=True)
        recvmmsg, sendmmsg = libc.recvmmsg, libc.sendmmsg
    except (OSError, AttributeError):
        return None
    recvmmsg.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int, ctypes.c_void_p)
    recvmmsg.restype = ctypes.c_int
    sendmmsg.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int)
    sendmmsg.restype = ctypes.c_int
    return recvmmsg, sendmmsg


def available() -> bool:
    """recvmmsg and sendmmsg can be called (Linux's libc, a 64-bit process); loads libc at the first call."""
    return _WORD == 8 and _libc_functions() is not None


def data_address(data: bytes) -> int:
    """Where ``data``'s bytes are in memory, so a batch can send them without a copy.

    Valid while ``data`` lives: CPython never moves an object, and bytes are immutable.
    """
    address = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value
    assert address is not None
    return address


def address_tuple(raw: bytes | memoryview) -> tuple[str, int] | tuple[str, int, int, int]:
    """A ``sockaddr_in``/``sockaddr_in6`` as the tuple Python's socket module would give for it."""
    (family,) = struct.unpack_from("=H", raw)
    port = int.from_bytes(raw[2:4], "big")
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, bytes(raw[4:8])), port
    if family == socket.AF_INET6:
        flowinfo = int.from_bytes(raw[4:8], "big")
        (scope_id,) = struct.unpack("=I", raw[24:28])
        return socket.inet_ntop(socket.AF_INET6, bytes(raw[8:24])), port, flowinfo, scope_id
    raise ValueError(f"not an IP socket address (family {family})")


class DatagramBatch:
    """Preallocated buffers for up to ``size`` datagrams in, and up to ``size`` replies out.

    A received datagram ``i`` is ``data[i * datagram_size :][: lengths[i]]``; a datagram longer than
    ``datagram_size`` arrives cut, with ``truncated(i)`` true. Replies are queued with ``reply_known``
    as two pieces (two bytes of the query, e.g. its ID, then any bytes object) and sent with
    ``send``; the batch keeps the queued objects alive until then.
    """

    def __init__(self, size: int = 64, datagram_size: int = 4096) -> None:
        functions = _libc_functions() if _WORD == 8 else None
        if functions is None:
            raise OSError(errno.ENOSYS, "recvmmsg/sendmmsg are not available on this system")
        self.size = size
        self.datagram_size = datagram_size
        self._data = ctypes.create_string_buffer(size * datagram_size)
        self.data = memoryview(self._data).cast("B")
        self._names = ctypes.create_string_buffer(size * _SOCKADDR_SIZE)
        self.names = memoryview(self._names).cast("B")
        self._received = (_Mmsghdr * size)()
        self._receive_iovs = (_Iovec * size)()
        self._replies = (_Mmsghdr * size)()
        self._reply_iovs = (_Iovec * (2 * size))()
        self._receive_ints = memoryview(self._received).cast("B").cast("I")
        self._reply_words = memoryview(self._replies).cast("B").cast("P")
        self._reply_ints = memoryview(self._replies).cast("B").cast("I")
        self._reply_iov_words = memoryview(self._reply_iovs).cast("B").cast("P")
        data, names = ctypes.addressof(self._data), ctypes.addressof(self._names)
        self._data_addresses = [data + i * datagram_size for i in range(size)]
        self._name_addresses = [names + i * _SOCKADDR_SIZE for i in range(size)]
        for i in range(size):
            self._receive_iovs[i].base, self._receive_iovs[i].len = self._data_addresses[i], datagram_size
            header = self._received[i].hdr
            header.name, header.namelen = self._name_addresses[i], _SOCKADDR_SIZE
            header.iov, header.iovlen = ctypes.addressof(self._receive_iovs[i]), 1
            reply = self._replies[i].hdr
            reply.iov, reply.iovlen = ctypes.addressof(self._reply_iovs[2 * i]), 2
        self.lengths: list[int] = []
        """Lengths of the datagrams the last ``receive`` read, by index."""
        self._queued = 0
        self._keep: list[bytes] = []
        self._recvmmsg, self._sendmmsg = functions

    def receive(self, fd: int) -> int:
        """Read what is waiting (up to ``size`` datagrams) without blocking; 0 when nothing is.

        Raises OSError for an error the socket reports (e.g. ECONNREFUSED after an ICMP error).
        """
        self._queued = 0  # replies queued for the last batch's senders never go to this one's
        self._keep.clear()
        ints = self._receive_ints
        for i in range(len(self.lengths)):  # the kernel wrote each used slot's address length
            ints[i * _HEADER_INTS + _NAMELEN] = _SOCKADDR_SIZE
        while True:
            count: int = self._recvmmsg(fd, ctypes.addressof(self._received), self.size, _MSG_DONTWAIT, None)
            if count >= 0:
                break
            code = ctypes.get_errno()
            if code == errno.EINTR:
                continue
            self.lengths = []
            if code in (errno.EAGAIN, errno.EWOULDBLOCK):
                return 0
            raise OSError(code, f"recvmmsg: {errno.errorcode.get(code, code)}")
        self.lengths = [ints[i * _HEADER_INTS + _LEN] for i in range(count)]
        return count

    def truncated(self, i: int) -> bool:
        return bool(self._receive_ints[i * _HEADER_INTS + _FLAGS] & _MSG_TRUNC)

    def datagram(self, i: int) -> bytes:
        start = i * self.datagram_size
        return bytes(self.data[start : start + self.lengths[i]])

    def sender(self, i: int) -> tuple[str, int] | tuple[str, int, int, int]:
        start = i * _SOCKADDR_SIZE
        return address_tuple(self.names[start : start + self._receive_ints[i * _HEADER_INTS + _NAMELEN]])

    def reply_known(
        self, count: int, replies: Mapping[bytes, tuple[bytes, int, _Extra]]
    ) -> tuple[list[_Extra], list[int]]:
        """Queue a reply to each of the first ``count`` datagrams that ``replies`` knows.

        ``replies`` maps a datagram's bytes after its first two (a DNS query without its ID) to
        ``(tail, address of tail's bytes, extra)``; the reply is the datagram's first two bytes, then
        ``tail``. A datagram that fills its slot (it may have been cut) is not looked up. Returns the
        ``extra`` of every reply queued, and the indexes of the other datagrams. One call per batch
        with the loop inside: a method call per datagram cost as much as the rest of its answer.
        """
        size, data, lengths = self.datagram_size, self.data, self.lengths
        received, names, addresses = self._receive_ints, self._name_addresses, self._data_addresses
        words, ints, iov = self._reply_words, self._reply_ints, self._reply_iov_words
        keep, queued = self._keep.append, self._queued
        extras: list[_Extra] = []
        others: list[int] = []
        for i in range(count):
            length = lengths[i]
            start = i * size
            known = replies.get(bytes(data[start + 2 : start + length])) if length < size else None
            if known is None:
                others.append(i)
                continue
            tail = known[0]
            keep(tail)  # alive until sent
            words[queued * _HEADER_WORDS + _NAME] = names[i]
            ints[queued * _HEADER_INTS + _NAMELEN] = received[i * _HEADER_INTS + _NAMELEN]
            k = 2 * queued * _IOV_WORDS
            iov[k] = addresses[i]
            iov[k + 1] = 2
            iov[k + 2] = known[1]
            iov[k + 3] = len(tail)
            queued += 1
            extras.append(known[2])
        self._queued = queued
        return extras, others

    def send(self, fd: int) -> int:
        """Send the queued replies; a reply the kernel refuses is dropped (UDP). Returns how many went."""
        queued, sent, start = self._queued, 0, 0
        base = ctypes.addressof(self._replies)
        while start < queued:
            count: int = self._sendmmsg(fd, base + start * _HEADER_SIZE, queued - start, _MSG_DONTWAIT)
            if count > 0:
                sent += count
                start += count
            elif ctypes.get_errno() != errno.EINTR:
                start += 1  # this one cannot go (buffer full, a bad address): drop it, send the rest
        self._queued = 0
        self._keep.clear()
        return sent
