"""Unix ``SOCK_SEQPACKET`` sockets on the event loop, with file descriptors passed by ``SCM_RIGHTS``.

ZDS (Istio's ``cni/pkg/nodeagent/ztunnelserver_linux.go``, ztunnel's ``src/inpod/packet.rs``) sends
one protobuf message per packet, so a packet is a message: no framing. asyncio's ``sock_recv`` cannot
say that a packet was cut short nor return ancillary data, hence this module: non-blocking
``recvmsg``/``sendmsg`` woken by the loop's reader and writer callbacks, no threads. A packet larger
than :data:`MAX_PACKET` (the 1024 bytes both Istio and ztunnel read into) or carrying more
descriptors than asked for is refused with :class:`PacketError`, never half-read.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

MAX_PACKET = 1024
"""Bytes read per packet: Istio's ``readProto`` and ztunnel's ``read_message`` use this buffer."""
_FD_SIZE = array.array("i").itemsize
_MAX_FDS_READ = 16
"""Room for this many descriptors when reading, so an extra one is seen (and closed), not cut off."""


class PacketError(Exception):
    """A packet that cannot be taken as one message: cut short, or with unexpected descriptors."""


@dataclass
class Packet:
    """One packet: its bytes and the descriptors that came with it (the receiver owns and closes them)."""

    data: bytes
    fds: list[int] = field(default_factory=list)

    def close_fds(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []


def address(path: Path | str) -> str:
    """The socket address of ``path``; a leading ``@`` names an abstract socket, as Go writes it."""
    text = str(path)
    return "\0" + text[1:] if text.startswith("@") else text


def listen(path: Path | str, backlog: int = 128) -> socket.socket:
    """A non-blocking listening socket at ``path``, replacing a file left there by an earlier run
    (as Istio's ``newZtunnelServer`` removes it before listening)."""
    where = address(path)
    if not where.startswith("\0"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(where)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        sock.bind(where)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class SeqpacketConnection:
    """One connected ``SOCK_SEQPACKET`` socket on the running loop: whole packets in and out."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock

    @classmethod
    async def connect(cls, path: Path | str) -> SeqpacketConnection:
        """Connect to the listener at ``path`` (a Unix connect completes at once or is refused)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.setblocking(False)
            sock.connect(address(path))
        except BaseException:
            sock.close()
            raise
        return cls(sock)

    @classmethod
    async def accept(cls, listener: socket.socket) -> SeqpacketConnection:
        """The next connection on ``listener`` (a non-blocking listening socket)."""
        sock, _ = await asyncio.get_running_loop().sock_accept(listener)
        return cls(sock)

    @property
    def closed(self) -> bool:
        return self.sock.fileno() < 0

    def close(self) -> None:
        """Close the socket, first dropping any reader or writer the loop still has for it: a
        descriptor number the kernel reuses must not inherit them."""
        fd = self.sock.fileno()
        if fd >= 0:
            with contextlib.suppress(RuntimeError):  # no running loop: nothing registered
                loop = asyncio.get_running_loop()
                loop.remove_reader(fd)
                loop.remove_writer(fd)
        self.sock.close()

    async def send(self, data: bytes, fds: Sequence[int] = ()) -> None:
        """Send ``data`` as one packet, with ``fds`` as ``SCM_RIGHTS`` (the kernel duplicates them: the
        caller still owns and closes its own). Raises OSError when the peer is gone."""
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        while True:
            try:
                self.sock.sendmsg([data], ancillary, socket.MSG_NOSIGNAL)
                return
            except (BlockingIOError, InterruptedError):
                await self._ready(
                    asyncio.get_running_loop().add_writer, asyncio.get_running_loop().remove_writer
                )

    async def receive(self, *, max_fds: int = 1) -> Packet | None:
        """The next packet, or None when the peer closed the connection (a zero-length read, as Istio
        and ztunnel take it). Raises PacketError for a packet over :data:`MAX_PACKET` bytes or with
        more than ``max_fds`` descriptors (those that came are closed), OSError when the socket fails."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                data, ancdata, flags, _ = self.sock.recvmsg(
                    MAX_PACKET, socket.CMSG_SPACE(_MAX_FDS_READ * _FD_SIZE), socket.MSG_CMSG_CLOEXEC
                )
                break
            except (BlockingIOError, InterruptedError):
                await self._ready(loop.add_reader, loop.remove_reader)
        packet = Packet(data, _fds(ancdata))
        problem = None
        if flags & socket.MSG_TRUNC:
            problem = f"truncated message (over {MAX_PACKET} bytes)"
        elif flags & socket.MSG_CTRUNC:
            problem = "truncated control message"
        elif len(packet.fds) > max_fds:
            problem = f"expected at most {max_fds} fd(s), got {len(packet.fds)}"
        if problem is not None:
            packet.close_fds()
            raise PacketError(problem)
        if not packet.data and not packet.fds:
            return None
        return packet

    async def readable(self) -> None:
        """Wait until a packet (or the end of the connection) can be read."""
        loop = asyncio.get_running_loop()
        await self._ready(loop.add_reader, loop.remove_reader)

    async def _ready(
        self,
        add: Callable[..., object],
        remove: Callable[[int], object],
    ) -> None:
        fd = self.sock.fileno()
        if fd < 0:
            raise OSError("socket is closed")
        ready = asyncio.get_running_loop().create_future()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        add(fd, wake)
        try:
            await ready
        finally:
            remove(fd)


def _fds(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % _FD_SIZE
            fds.extend(array.array("i", data[:usable]))
    return fds
