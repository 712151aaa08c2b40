"""A ztunnel stand-in for the ZDS tests, written from ``zds.proto`` and ztunnel's own source.

It is not ztunnel: it proxies nothing. It speaks ZDS as ztunnel's ``src/inpod/`` does and is as
strict: ``workloadmanager.rs`` (connect, hello, one ack or nack per message, a read error nacked and
the connection ended), ``protocol.rs`` (one packet of at most 1024 bytes per message; an add must carry
exactly one fd, no other message may carry one), ``statemanager.rs`` (a new connection restarts the
snapshot; an add for a known uid in the same netns is a no-op, in another netns replaces the proxy; a
keep after ``SnapshotSent`` or a second ``SnapshotSent`` is a protocol error that stops ztunnel's
workload manager; ``SnapshotSent`` drops every workload the snapshot did not name; a delete before it
only forgets the uid for the snapshot) and ``netns.rs`` (a workload's netns is known by the inode and
device of the fd received; sockets are made by a thread that ``setns``-ed into it).

What it does for a workload is what a test can see: it opens TCP listeners inside the pod's network
namespace on ztunnel's in-pod ports (15001 outbound, 15006 inbound, 15008 HBONE; on [::] taking
IPv4 too, or 0.0.0.0 where the host has no IPv6, as ztunnel binds them), each answering a
connection with ``ztunnel-standin <uid> <port>\\n``, and closes them when the workload goes.

Use::

    zt = ZtunnelStandin(socket_path)
    await zt.connect()            # connect, say hello, serve messages in a task
    await zt.wait_snapshot()      # after SnapshotSent was acked
    zt.workloads                  # uid -> Workload (info, received fd, netns id, listeners)
    await zt.disconnect()         # the connection drops, the proxies stay (a reconnecting ztunnel)
    ZtunnelStandin(path, reconnect=True)  # connects again whenever the node agent ends the connection
    await zt.stop()               # ztunnel exits: connection and every proxy gone

Knobs for the timeout and error tests: ``ack`` (False: never answer), ``nack`` (uid -> error text
to answer an add with, as ztunnel answers a proxy it cannot start).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import ctypes
import os
import socket
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf.message import DecodeError

from istio_agent.protos import zds_pb2

PORTS = (15001, 15006, 15008)
"""ztunnel's in-pod listeners: outbound, inbound plaintext, inbound HBONE."""
_BUFFER = 1024
"""ztunnel's read buffer (``read_message``): a longer packet is truncated, hence refused."""
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass
class Workload:
    """A workload ztunnel runs a proxy for: what the add said, the fd it came with, the listeners."""

    uid: str
    info: zds_pb2.WorkloadInfo
    fd: int
    netns_id: tuple[int, int]
    """(st_dev, st_ino) of the received fd, ztunnel's ``NetnsID``."""
    servers: list[asyncio.Server] = field(default_factory=list)

    def close(self) -> None:
        for server in self.servers:
            server.close()
        os.close(self.fd)


class ZtunnelStandin:
    """One ztunnel on one node: connects to the node agent's ZDS socket and runs workloads."""

    def __init__(
        self,
        socket_path: Path | str,
        *,
        ports: Sequence[int] = PORTS,
        hello: bool = True,
        reconnect: bool = False,
    ) -> None:
        self.socket_path = socket_path
        self.reconnect = reconnect
        """Connect again when the node agent ends the connection, as ztunnel's workload manager does."""
        self.ports = tuple(ports)
        self.send_hello = hello
        self.ack = True
        """False: read messages but never answer (the agent's ack timeout)."""
        self.nack: dict[str, str] = {}
        """uid -> error: answer an add of that uid with this error, as a proxy that failed to start."""
        self.workloads: dict[str, Workload] = {}
        self.received: list[tuple[str, str]] = []
        """(kind, uid) of every message read, in order: ("add", uid), ("keep", uid), ("del", uid), ("snapshot", "")."""
        self.errors: list[str] = []
        """Why messages were refused (nacked), in order."""
        self.protocol_error: str | None = None
        """Set when ztunnel would have stopped its workload manager (it exits)."""
        self.snapshot_received = False
        self._snapshot_names: set[str] = set()
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Condition()

    @property
    def connected(self) -> bool:
        return self._sock is not None

    async def connect(self, timeout: float = 10.0) -> None:
        """Connect (as ztunnel's ``packet::connect``, retrying while there is no listener, as its
        workload manager does), say hello, and serve the connection in a task."""
        where = str(self.socket_path)
        where = "\0" + where[1:] if where.startswith("@") else where
        async with asyncio.timeout(timeout):
            while True:
                sock = socket.socket(
                    socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC
                )
                try:
                    sock.connect(where)
                    break
                except (FileNotFoundError, ConnectionRefusedError, BlockingIOError):
                    sock.close()
                    await asyncio.sleep(0.01)
        self._sock = sock
        self.snapshot_received = False  # statemanager.rs reset_snapshot
        self._snapshot_names.clear()
        if self.send_hello:
            await self.send_raw(zds_pb2.ZdsHello(version=zds_pb2.V1).SerializeToString())
        self._task = asyncio.create_task(self._serve(sock))

    async def disconnect(self) -> None:
        """Drop the connection; the workloads keep running (ztunnel reconnects and gets a snapshot)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._close_socket()

    async def stop(self) -> None:
        """ztunnel exits: the connection and every workload's listeners go."""
        await self.disconnect()
        for workload in self.workloads.values():
            workload.close()
        self.workloads.clear()
        await self._notify()

    async def send_raw(self, data: bytes, fds: Sequence[int] = ()) -> None:
        """Send one packet as is (a test's garbage, or a hello)."""
        assert self._sock is not None, "not connected"
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        loop = asyncio.get_running_loop()
        while True:
            try:
                self._sock.sendmsg([data], ancillary, socket.MSG_NOSIGNAL)
                return
            except BlockingIOError:
                await _wait_fd(self._sock.fileno(), loop.add_writer, loop.remove_writer)

    async def wait_for(self, condition: Callable[[ZtunnelStandin], bool], timeout: float = 10.0) -> None:
        """Wait until ``condition(self)`` holds (checked after every message and state change)."""
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(lambda: condition(self))

    async def wait_snapshot(self, timeout: float = 10.0) -> None:
        await self.wait_for(lambda zt: zt.snapshot_received, timeout)

    async def wait_disconnected(self, timeout: float = 10.0) -> None:
        await self.wait_for(lambda zt: not zt.connected, timeout)

    def _close_socket(self) -> None:
        self.snapshot_received = False  # a snapshot belongs to its connection
        if self._sock is not None:
            if self._sock.fileno() >= 0:  # the loop must not keep watching a number the kernel will reuse
                loop = asyncio.get_running_loop()
                loop.remove_reader(self._sock.fileno())
                loop.remove_writer(self._sock.fileno())
            self._sock.close()
            self._sock = None

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _serve(self, sock: socket.socket) -> None:
        try:
            while True:
                try:
                    message = await self._read(sock)
                except _ReadError as err:  # workloadmanager.rs: nack, then the stream ends
                    self.errors.append(str(err))
                    await self._answer(f"failure to read message : {err}")
                    return
                if message is None:  # the node agent closed the connection
                    return
                try:
                    await self._process(*message)
                except _ProxyError as err:  # nack, keep the connection
                    self.errors.append(str(err))
                    await self._answer(f"failure to start proxy : {err}")
                    continue
                except _ProtocolViolation as err:  # nack, and ztunnel stops its workload manager
                    self.errors.append(str(err))
                    self.protocol_error = str(err)
                    await self._answer(f"failure to process message : {err}")
                    return
                await self._answer("")
        except OSError as err:
            self.errors.append(f"connection failed: {err}")
        finally:
            if self._task is asyncio.current_task():  # ended by the node agent (or a refusal), not by us
                self._task = None
                self._close_socket()
                if self.reconnect and self.protocol_error is None:
                    self._task = asyncio.create_task(self._connect_again())
            await self._notify()

    async def _connect_again(self) -> None:
        await asyncio.sleep(0.01)
        await self.connect(timeout=60.0)

    async def _answer(self, error: str) -> None:
        if not self.ack:
            return
        await self.send_raw(zds_pb2.WorkloadResponse(ack=zds_pb2.Ack(error=error)).SerializeToString())

    async def _read(self, sock: socket.socket) -> tuple[zds_pb2.WorkloadRequest, int | None] | None:
        """One request and its fd, as ztunnel's ``read_message`` + ``get_workload_data`` take it."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                data, ancdata, flags, _ = sock.recvmsg(
                    _BUFFER, socket.CMSG_SPACE(4 * 8), socket.MSG_CMSG_CLOEXEC
                )
                break
            except BlockingIOError:
                await _wait_fd(sock.fileno(), loop.add_reader, loop.remove_reader)
        fds: list[int] = []
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", payload[: len(payload) - len(payload) % 4]))
        if not data:
            _close(fds)
            return None
        try:
            if len(fds) > 1:
                raise _ReadError(f"Expected 1 FD, got {len(fds)}")
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise _ReadError("received truncated message")
            try:
                request = zds_pb2.WorkloadRequest.FromString(data)
            except DecodeError as err:
                raise _ReadError(f"decode: {err}") from None
            kind = request.WhichOneof("payload")
            if kind is None:
                raise _ReadError("no payload")
            if kind == "add" and not fds:
                raise _ReadError("No control message")
            if kind != "add" and fds:
                raise _ReadError("Unexpected control message")
        except _ReadError:
            _close(fds)
            raise
        return request, (fds[0] if fds else None)

    async def _process(self, request: zds_pb2.WorkloadRequest, fd: int | None) -> None:
        kind = request.WhichOneof("payload")
        try:
            if kind == "add":
                assert fd is not None
                self.received.append(("add", request.add.uid))
                owned, fd = fd, None
                await self._add(request.add, owned)  # takes the fd: keeps it or closes it
            elif kind == "keep":
                self.received.append(("keep", request.keep.uid))
                if self.snapshot_received:
                    raise _ProtocolViolation("pod keep received after snapshot")
                self._snapshot_names.add(request.keep.uid)
            elif kind == "del":
                uid = getattr(request, "del").uid
                self.received.append(("del", uid))
                if not self.snapshot_received:
                    self._snapshot_names.discard(uid)
                elif (workload := self.workloads.pop(uid, None)) is not None:
                    workload.close()
            else:
                self.received.append(("snapshot", ""))
                if self.snapshot_received:
                    raise _ProtocolViolation("pod snapshot received already")
                for uid in [uid for uid in self.workloads if uid not in self._snapshot_names]:
                    self.workloads.pop(uid).close()
                self._snapshot_names.clear()
                self.snapshot_received = True
        finally:
            if fd is not None:
                os.close(fd)
            await self._notify()

    async def _add(self, add: zds_pb2.AddWorkload, fd: int) -> None:
        if not add.HasField("workload_info"):
            os.close(fd)
            raise _ProtocolViolation("workload_info is required but not present")
        if not self.snapshot_received:
            self._snapshot_names.add(add.uid)
        status = os.fstat(fd)
        netns_id = (status.st_dev, status.st_ino)
        existing = self.workloads.get(add.uid)
        if existing is not None:
            if existing.netns_id == netns_id:
                os.close(fd)
                return
            self.workloads.pop(add.uid).close()
        if add.uid in self.nack:
            os.close(fd)
            raise _ProxyError(self.nack[add.uid])
        workload = Workload(add.uid, add.workload_info, fd, netns_id)
        try:
            for listener in _listeners_in(fd, self.ports):
                workload.servers.append(
                    await asyncio.start_server(_greeter(add.uid, listener), sock=listener)
                )
        except OSError as err:
            workload.close()
            raise _ProxyError(str(err)) from None
        self.workloads[add.uid] = workload


class _ReadError(Exception):
    """A packet ztunnel cannot read as a request (it nacks and ends the connection)."""


class _ProxyError(Exception):
    """A workload whose proxy could not start (ztunnel nacks and retries later)."""


class _ProtocolViolation(Exception):
    """A request the protocol forbids here (ztunnel nacks and stops)."""


def _greeter(
    uid: str, listener: socket.socket
) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    port = listener.getsockname()[1]

    async def greet(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(f"ztunnel-standin {uid} {port}\n".encode())
        with contextlib.suppress(OSError):
            await writer.drain()
        writer.close()

    return greet


def _listeners_in(netns_fd: int, ports: Sequence[int]) -> list[socket.socket]:
    """Listening TCP sockets on each port made inside the netns of ``netns_fd`` by a thread that
    entered it (netns.rs ``InpodNetns::run``); the sockets stay in that netns whoever uses them."""
    made: list[socket.socket] = []
    failure: list[OSError] = []

    def body() -> None:
        try:
            if _libc.setns(netns_fd, _CLONE_NEWNET) != 0:
                errno = ctypes.get_errno()
                raise OSError(errno, f"setns: {os.strerror(errno)}")
            for port in ports:
                made.append(_wildcard_listener(port))
        except OSError as err:
            failure.append(err)

    thread = threading.Thread(target=body, name="ztunnel-standin-netns")
    thread.start()
    thread.join()
    if failure:
        for sock in made:
            sock.close()
        raise failure[0]
    return made


def _wildcard_listener(port: int) -> socket.socket:
    """ztunnel's ``bind_wildcard``: [::] taking IPv4 too where the netns has IPv6, else 0.0.0.0."""
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        host = "::"
    except OSError:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        host = "0.0.0.0"
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if sock.family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
        sock.listen(16)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


async def _wait_fd(fd: int, add: Callable[..., object], remove: Callable[[int], object]) -> None:
    ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    add(fd, wake)
    try:
        await ready
    finally:
        remove(fd)


def _close(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
