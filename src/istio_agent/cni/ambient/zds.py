"""The node agent's ZDS server: hands enrolled pods' network namespaces to ztunnel.

As Istio's ``cni/pkg/nodeagent/ztunnelserver.go`` and ``ztunnelserver_linux.go`` (the protocol is
``pkg/zdsapi/zds.proto``, our ``protos/zds.proto``): the node agent listens on a ``SOCK_SEQPACKET``
Unix socket (``ZTUNNEL_UDS_ADDRESS``, default ``/var/run/ztunnel/ztunnel.sock``) and ztunnel connects.
On each connection ztunnel sends ``ZdsHello``; the agent answers with the snapshot, an
``AddWorkload`` per enrolled pod with the pod's netns fd passed by ``SCM_RIGHTS`` (a ``KeepWorkload``
when its netns cannot be opened), then ``SnapshotSent``; ztunnel then drops the workloads it was not
sent, so a pod deleted while no ztunnel was connected is simply absent. Later adds and deletes go to
the connection one at a time. Every request waits for ztunnel's ``Ack`` (``ack_timeout``, Istio's 5 s
read/write deadline) before the next is sent: acks are matched to requests by order only.

Several ztunnels may be connected at once (during a ztunnel upgrade the old and the new one are): as
Istio does, an add goes to the newest connection, a delete to every connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf.message import DecodeError

from istio_agent.cni.ambient.seqpacket import PacketError, SeqpacketConnection, address, listen
from istio_agent.log import scope
from istio_agent.protos import zds_pb2

log = scope("cni-agent")

DEFAULT_SOCKET = Path("/var/run/ztunnel/ztunnel.sock")
"""Istio's ``--ztunnel-uds-address`` default."""
ACK_TIMEOUT = 5.0
"""Istio's ``readWriteDeadline``: for the hello, for each write and for each ack."""
ACCEPT_INTERVAL = 0.2
"""Istio accepts at most 5 connections a second, so a ztunnel reconnecting in a loop cannot exhaust us."""


@dataclass(frozen=True)
class EnrolledPod:
    """A pod in the mesh as ztunnel knows it: Kubernetes uid, who it is, and its network namespace.

    ``netns`` is opened when the pod is sent (and closed once sent); None, or a path that no longer
    opens, means its namespace is unknown (after a restart that could not find it): the snapshot then
    sends a keep, as Istio does, so ztunnel keeps a proxy it already runs.
    """

    uid: str
    name: str
    namespace: str
    service_account: str
    netns: Path | None


class ZdsError(Exception):
    """ztunnel did not take a request: no connection, connection lost, no ack in time, or an ack error."""


class NoZtunnel(ZdsError):
    """No ztunnel is connected; the pod goes in the next ztunnel's snapshot."""


class AckError(ZdsError):
    """ztunnel answered with an error ack (its message is the error)."""


class _ProtocolError(Exception):
    """ztunnel sent something the protocol does not allow; the connection is closed."""


@dataclass
class _Request:
    """One update for a connection: the message, an open netns fd to pass (owned here), the answer."""

    message: zds_pb2.WorkloadRequest
    fd: int | None
    answer: asyncio.Future[zds_pb2.WorkloadResponse] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None

    def fail(self, error: BaseException) -> None:
        self.close()
        if not self.answer.done():
            self.answer.set_exception(error)
            self.answer.exception()  # retrieved: a caller that gave up leaves no "never retrieved" warning


class _Connection:
    """One connected ztunnel: its socket, its queue of updates, and what it has said."""

    def __init__(self, channel: SeqpacketConnection, ack_timeout: float) -> None:
        self.channel = channel
        self.id = uuid.uuid4()
        self.ack_timeout = ack_timeout
        self.updates: asyncio.Queue[_Request] = asyncio.Queue()
        self.hello: zds_pb2.ZdsHello | None = None

    async def read_hello(self) -> zds_pb2.ZdsHello:
        async with asyncio.timeout(self.ack_timeout):
            packet = await self._packet()
        try:
            return zds_pb2.ZdsHello.FromString(packet)
        except DecodeError as err:
            raise _ProtocolError(f"not a ZdsHello: {err}") from None

    async def exchange(self, message: zds_pb2.WorkloadRequest, fd: int | None) -> zds_pb2.WorkloadResponse:
        """Send ``message`` (with ``fd``) and wait for its ack. OSError: the write failed;
        TimeoutError: no answer in time; _ProtocolError: the answer is not an ack."""
        async with asyncio.timeout(self.ack_timeout):
            await self.channel.send(message.SerializeToString(), () if fd is None else (fd,))
        async with asyncio.timeout(self.ack_timeout):
            packet = await self._packet()
        try:
            response = zds_pb2.WorkloadResponse.FromString(packet)
        except DecodeError as err:
            raise _ProtocolError(f"not a WorkloadResponse: {err}") from None
        if response.WhichOneof("payload") != "ack":
            raise _ProtocolError("a WorkloadResponse without an ack")
        return response

    async def _packet(self) -> bytes:
        try:
            packet = await self.channel.receive(max_fds=0)
        except PacketError as err:
            raise _ProtocolError(str(err)) from None
        if packet is None:
            raise EOFError("ztunnel closed the connection")
        return packet.data


class ZtunnelServer:
    """The ZDS server; ``connected`` says whether a ztunnel is connected and has said hello.

    ``snapshot()`` is asked, when a ztunnel has said hello, for every pod currently enrolled.
    """

    def __init__(
        self,
        socket_path: Path | str = DEFAULT_SOCKET,
        *,
        snapshot: Callable[[], Sequence[EnrolledPod]],
        ack_timeout: float = ACK_TIMEOUT,
        accept_interval: float = ACCEPT_INTERVAL,
    ) -> None:
        self.socket_path = socket_path
        self.ack_timeout = ack_timeout
        self.accept_interval = accept_interval
        self._snapshot = snapshot
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._connections: list[_Connection] = []
        self._serving: set[asyncio.Task[None]] = set()

    @property
    def connected(self) -> bool:
        """Whether a ztunnel is connected and has said hello."""
        return any(conn.hello is not None for conn in self._connections)

    @property
    def connections(self) -> int:
        """Open ztunnel connections, counted from accept as Istio's ``ztunnel_connected`` gauge counts them."""
        return len(self._connections)

    async def start(self) -> None:
        """Listen on the socket (a file left by an earlier run is replaced) and accept ztunnels."""
        self._listener = listen(self.socket_path)
        self._accepting = asyncio.create_task(self._accept_loop(self._listener), name="zds-accept")
        log.info("ztunnel server listening on %s", self.socket_path)

    async def stop(self) -> None:
        """Stop accepting, close every ztunnel connection (failing what waits on one), remove the socket."""
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
            self._accepting = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            where = address(self.socket_path)
            if not where.startswith("\0"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(where)
        tasks = list(self._serving)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def add(self, pod: EnrolledPod) -> None:
        """Hand ``pod`` with its netns to the newest ztunnel and wait for the ack.

        Raises :class:`NoZtunnel` when none is connected (as Istio's ``PodAdded``: the pod stays
        enrolled and goes in the next ztunnel's snapshot), :class:`AckError` when ztunnel refused it,
        :class:`ZdsError` when the connection failed or the ack did not come in time, OSError when the
        pod's netns cannot be opened.
        """
        if not self._connections:
            raise NoZtunnel("no ztunnel connection")
        conn = self._connections[-1]
        if pod.netns is None:
            raise ZdsError(f"pod {pod.namespace}/{pod.name} has no network namespace to send")
        fd = os.open(pod.netns, os.O_RDONLY | os.O_CLOEXEC)
        message = zds_pb2.WorkloadRequest(add=zds_pb2.AddWorkload(uid=pod.uid, workload_info=_info(pod)))
        log.info(
            "sending pod add to ztunnel uid=%s pod=%s/%s conn_uuid=%s",
            pod.uid,
            pod.namespace,
            pod.name,
            conn.id,
        )
        response = await self._send(conn, _Request(message, fd))
        if response.ack.error:
            log.error("failed to add workload uid=%s: %s", pod.uid, response.ack.error)
            raise AckError(response.ack.error)

    async def delete(self, uid: str) -> None:
        """Tell every connected ztunnel to drop the pod ``uid`` and wait for their acks.

        With no ztunnel connected this does nothing (the pod is absent from the next snapshot). As
        Istio's ``PodDeleted``, an error ack is not an error here; a connection that fails or does not
        ack in time is (:class:`ZdsError`, after every connection was tried).
        """
        message = zds_pb2.WorkloadRequest(**{"del": zds_pb2.DelWorkload(uid=uid)})
        log.debug("sending delete pod to all ztunnels: %s", uid)
        results = await asyncio.gather(
            *(self._send(conn, _Request(message, None)) for conn in list(self._connections)),
            return_exceptions=True,
        )
        errors = [result for result in results if isinstance(result, BaseException)]
        if errors:
            raise ZdsError("; ".join(str(error) for error in errors))

    async def _send(self, conn: _Connection, request: _Request) -> zds_pb2.WorkloadResponse:
        if conn not in self._connections:
            request.fail(ZdsError("ztunnel connection closed"))
        else:
            conn.updates.put_nowait(request)
        return await request.answer

    async def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                channel = await SeqpacketConnection.accept(listener)
            except OSError as err:
                log.error("failed to accept ztunnel connection: %s", err)
            else:
                task = asyncio.create_task(self._serve(channel), name="zds-conn")
                self._serving.add(task)
                task.add_done_callback(self._serving.discard)
            await asyncio.sleep(self.accept_interval)

    async def _serve(self, channel: SeqpacketConnection) -> None:
        conn = _Connection(channel, self.ack_timeout)
        self._connections.append(conn)
        log.info("new ztunnel connected conn_uuid=%s, total connected: %s", conn.id, len(self._connections))
        pending: asyncio.Task[_Request] | None = None
        readable: asyncio.Future[None] | None = None
        try:
            hello = await conn.read_hello()
            if hello.version != zds_pb2.V1:
                log.warning("ztunnel hello has version %s, expected V1 conn_uuid=%s", hello.version, conn.id)
            log.info("received hello from ztunnel version=%s conn_uuid=%s", hello.version, conn.id)
            conn.hello = hello
            await self._send_snapshot(conn)
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(conn.updates.get())
                readable = asyncio.ensure_future(channel.readable())
                done, _ = await asyncio.wait({pending, readable}, return_when=asyncio.FIRST_COMPLETED)
                readable.cancel()  # and wait for it to unregister its reader before anything reads
                with contextlib.suppress(asyncio.CancelledError):
                    await readable
                if readable in done:
                    # ztunnel speaks only to answer: anything now is the end of the connection or an error
                    if await channel.receive(max_fds=0) is None:
                        log.info("ztunnel closed the connection conn_uuid=%s", conn.id)
                        return
                    raise _ProtocolError("ztunnel protocol error, unexpected message")
                request, pending = pending.result(), None
                await self._update(conn, request)
        except asyncio.CancelledError:
            raise
        except EOFError:
            log.info("ztunnel closed the connection conn_uuid=%s", conn.id)
        except TimeoutError:
            log.error("ztunnel did not answer within %ss, closing conn_uuid=%s", self.ack_timeout, conn.id)
        except (_ProtocolError, PacketError) as err:
            log.error("bad message from ztunnel, closing the connection conn_uuid=%s: %s", conn.id, err)
        except OSError as err:
            log.error("ztunnel connection failed conn_uuid=%s: %s", conn.id, err)
        except Exception as err:  # a bug here ends this connection (ztunnel reconnects), never the server
            log.error("failed to handle ztunnel connection conn_uuid=%s: %r", conn.id, err, exc_info=True)
        finally:
            self._connections.remove(conn)
            gone = ZdsError("ztunnel connection closed")
            if pending is not None:
                if pending.done() and not pending.cancelled():
                    pending.result().fail(gone)
                pending.cancel()
            while not conn.updates.empty():
                conn.updates.get_nowait().fail(gone)
            if readable is not None:  # unregister its reader before the descriptor is closed and reused
                readable.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await readable
            channel.close()
            log.info(
                "ztunnel disconnected conn_uuid=%s, total connected: %s", conn.id, len(self._connections)
            )

    async def _update(self, conn: _Connection, request: _Request) -> None:
        """Send one update and hand its outcome to the caller. As Istio: an ack that does not come in
        time fails the request but keeps the connection; a failed write ends the connection; an error
        ack is the caller's to judge. Stricter than Istio: an answer that is not an ack ends it too."""
        try:
            response = await conn.exchange(request.message, request.fd)
        except asyncio.CancelledError:
            request.fail(ZdsError("ztunnel connection closed"))
            raise
        except TimeoutError:
            log.warning("timed out waiting for valid ztunnel response conn_uuid=%s", conn.id)
            request.fail(ZdsError(f"ztunnel did not ack within {self.ack_timeout}s"))
            return
        except OSError as err:
            log.error("ztunnel connection broken/unwritable, disposing of this connection: %s", err)
            request.fail(ZdsError(f"ztunnel connection failed: {err}"))
            raise
        except (_ProtocolError, EOFError) as err:
            request.fail(ZdsError(f"ztunnel connection failed: {err}"))
            raise
        request.close()
        if response.ack.error:
            log.error("ztunnel responded with an ack error: %s", response.ack.error)
        if not request.answer.done():
            request.answer.set_result(response)

    async def _send_snapshot(self, conn: _Connection) -> None:
        """Every enrolled pod (add with its netns fd, or keep), then SnapshotSent, each acked in turn.
        Any failure but an error ack ends the connection; ztunnel reconnects and gets a new snapshot."""
        for pod in self._snapshot():
            fd = _open_netns(pod)
            try:
                if fd is not None:
                    log.info(
                        "sending pod to ztunnel as part of snapshot uid=%s pod=%s/%s",
                        pod.uid,
                        pod.namespace,
                        pod.name,
                    )
                    message = zds_pb2.WorkloadRequest(
                        add=zds_pb2.AddWorkload(uid=pod.uid, workload_info=_info(pod))
                    )
                else:
                    log.info("netns is not available for pod, sending 'keep' to ztunnel uid=%s", pod.uid)
                    message = zds_pb2.WorkloadRequest(keep=zds_pb2.KeepWorkload(uid=pod.uid))
                response = await conn.exchange(message, fd)
            finally:
                if fd is not None:
                    os.close(fd)
            if response.ack.error:
                log.error("add-workload: got ack error uid=%s: %s", pod.uid, response.ack.error)
        response = await conn.exchange(zds_pb2.WorkloadRequest(snapshot_sent=zds_pb2.SnapshotSent()), None)
        if response.ack.error:
            log.error("snap-sent: got ack error: %s", response.ack.error)
        log.debug("snapshot sent to ztunnel conn_uuid=%s", conn.id)


def _info(pod: EnrolledPod) -> zds_pb2.WorkloadInfo:
    return zds_pb2.WorkloadInfo(name=pod.name, namespace=pod.namespace, service_account=pod.service_account)


def _open_netns(pod: EnrolledPod) -> int | None:
    if pod.netns is None:
        return None
    try:
        return os.open(pod.netns, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as err:
        log.warning("cannot open netns %s of pod uid=%s: %s", pod.netns, pod.uid, err.strerror)
        return None
