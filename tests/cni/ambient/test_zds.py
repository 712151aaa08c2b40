"""ZDS, the node agent's hand-off of pod network namespaces to ztunnel (Istio's
``cni/pkg/nodeagent/ztunnelserver*.go``; cases after ``ztunnelserver_linux_test.go``).

The wire contract is checked against Istio's own ``pkg/zdsapi/zds.proto`` (``golden/ambient/zds``).
The behaviour tests run the server against the ztunnel stand-in (``ztunnel_standin.py``) with real
network namespaces: the stand-in receives each pod's netns fd by ``SCM_RIGHTS`` and opens ztunnel's
listeners inside it, so a test checks the hand-off by connecting to them from inside the pod.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from istio_agent.cni.ambient.seqpacket import SeqpacketConnection, listen
from istio_agent.cni.ambient.zds import AckError, EnrolledPod, NoZtunnel, ZdsError, ZtunnelServer
from istio_agent.protos import zds_pb2
from tests.cni.ambient.ztunnel_standin import PORTS, ZtunnelStandin
from tests.cni.istio_sources import drifted
from tests.cni.netns import Netns, needs_root, netns

GOLDEN = Path(__file__).parents[1] / "golden" / "ambient" / "zds"
pytestmark = pytest.mark.both_loops  # the agent runs on uvloop


def _istios_descriptor(tmp_path: Path) -> descriptor_pb2.FileDescriptorProto:
    """Istio's zds.proto compiled to a descriptor (never loaded into protobuf's default pool)."""
    from grpc_tools import protoc

    out = tmp_path / "istio-zds.pb"
    assert protoc.main(["protoc", f"-I{GOLDEN}", f"--descriptor_set_out={out}", "zds.proto"]) == 0
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    (istios,) = files.file
    return istios


def _shape(proto: descriptor_pb2.FileDescriptorProto) -> dict[str, object]:
    """What the wire depends on: package, enums and their values, messages with fields and oneofs."""
    messages = {}
    for message in proto.message_type:
        fields = {
            f.name: (
                f.number,
                f.type,
                f.label,
                f.type_name,
                f.oneof_index if f.HasField("oneof_index") else None,
            )
            for f in message.field
        }
        messages[message.name] = {
            "fields": fields,
            "oneofs": [o.name for o in message.oneof_decl],
            "reserved": sorted((r.start, r.end) for r in message.reserved_range),
            "reserved_names": sorted(message.reserved_name),
        }
    enums = {e.name: {v.name: v.number for v in e.value} for e in proto.enum_type}
    return {"package": proto.package, "syntax": proto.syntax, "messages": messages, "enums": enums}


def test_the_golden_is_istios_zds_proto() -> None:
    assert drifted(GOLDEN) == {}


def test_our_zds_proto_is_istios_wire_contract(tmp_path: Path) -> None:
    ours = descriptor_pb2.FileDescriptorProto()
    zds_pb2.DESCRIPTOR.CopyToProto(ours)
    assert _shape(ours) == _shape(_istios_descriptor(tmp_path))
    assert zds_pb2.WorkloadRequest.DESCRIPTOR.full_name == "istio.workload.zds.WorkloadRequest"


# --- the server against the ztunnel stand-in, with real network namespaces ---------------------------

GREETING_TIMEOUT = 5.0
_NO_IPV6 = Path("/proc/sys/net/ipv6/conf/all/disable_ipv6")
IPV6 = _NO_IPV6.exists() and _NO_IPV6.read_text().strip() == "0"


@dataclass
class Node:
    """One node's ZDS server, the pods it has enrolled (its snapshot), and ztunnel's socket path."""

    socket_path: Path
    enrolled: dict[str, EnrolledPod]
    server: ZtunnelServer

    def pod(self, uid: str, space: Netns | None, name: str | None = None) -> EnrolledPod:
        """Enroll a pod in ``space`` (None: its netns is unknown)."""
        pod = EnrolledPod(uid, name or f"pod-{uid}", "default", "sa-" + uid, space.path if space else None)
        self.enrolled[uid] = pod
        return pod


@pytest.fixture
async def node(short_tmp: Path) -> AsyncIterator[Node]:
    enrolled: dict[str, EnrolledPod] = {}
    path = short_tmp / "ztunnel.sock"
    server = ZtunnelServer(
        path, snapshot=lambda: list(enrolled.values()), ack_timeout=1.0, accept_interval=0.01
    )
    await server.start()
    try:
        yield Node(path, enrolled, server)
    finally:
        await server.stop()


@pytest.fixture
async def ztunnels(node: Node) -> AsyncIterator[Callable[[], ZtunnelStandin]]:
    """Make ztunnel stand-ins on the node's socket; each is stopped at the end."""
    made: list[ZtunnelStandin] = []

    def make() -> ZtunnelStandin:
        made.append(ZtunnelStandin(node.socket_path))
        return made[-1]

    yield make
    for zt in made:
        await zt.stop()


@pytest.fixture
def spaces() -> Iterator[Callable[[], Netns]]:
    """Fresh network namespaces (lo up), deleted at the end."""
    with ExitStack() as stack:
        yield lambda: stack.enter_context(netns("zds"))


def _greeting(space: Netns, port: int, host: str = "127.0.0.1") -> str:
    """What answers on <host>:<port> inside ``space`` ("refused" when nothing listens)."""
    sock = space.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.settimeout(GREETING_TIMEOUT)
        try:
            sock.connect((host, port))
        except ConnectionRefusedError:
            return "refused"
        return sock.makefile().readline().strip()
    finally:
        sock.close()


async def greetings(space: Netns, host: str = "127.0.0.1") -> list[str]:
    """The answers of ztunnel's three in-pod ports inside ``space`` (a thread: the stand-in answers on this loop)."""
    return [await asyncio.to_thread(_greeting, space, port, host) for port in PORTS]


def served(uid: str) -> list[str]:
    return [f"ztunnel-standin {uid} {port}" for port in PORTS]


def fds_on(path: Path) -> list[int]:
    """This process's open descriptors on the file at ``path`` (a netns: same device and inode)."""
    target = os.stat(path)
    found = []
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            status = os.stat(f"/proc/self/fd/{name}")
            if (status.st_dev, status.st_ino) == (target.st_dev, target.st_ino):
                found.append(int(name))
    return found


@needs_root
async def test_hello_then_a_snapshot_hands_each_pods_netns_to_ztunnel(
    node: Node, ztunnels: Callable[[], ZtunnelStandin], spaces: Callable[[], Netns]
) -> None:
    one, two = spaces(), spaces()
    node.pod("uid-1", one)
    node.pod("uid-2", two)
    zt = ztunnels()
    assert not node.server.connected
    await zt.connect()
    await zt.wait_snapshot()

    assert sorted(zt.received[:2]) == [("add", "uid-1"), ("add", "uid-2")]
    assert zt.received[2:] == [("snapshot", "")]
    assert zt.errors == []
    assert node.server.connected
    assert await greetings(one) == served("uid-1")
    assert await greetings(two) == served("uid-2")
    if IPV6:
        assert await greetings(two, "::1") == served("uid-2")
    for uid, space in (("uid-1", one), ("uid-2", two)):
        workload = zt.workloads[uid]
        assert (workload.info.name, workload.info.namespace, workload.info.service_account) == (
            f"pod-{uid}",
            "default",
            f"sa-{uid}",
        )
        # the fd came through the kernel: the stand-in's own descriptor on the pod's netns, the only
        # one left once the agent closed the one it sent
        assert os.fstat(workload.fd).st_ino == os.stat(space.path).st_ino
        assert fds_on(space.path) == [workload.fd]


@needs_root
async def test_add_and_delete_while_ztunnel_is_connected(
    node: Node, ztunnels: Callable[[], ZtunnelStandin], spaces: Callable[[], Netns]
) -> None:
    space = spaces()
    zt = ztunnels()
    await zt.connect()
    await zt.wait_snapshot()
    assert zt.workloads == {}

    await node.server.add(node.pod("uid-1", space))
    assert zt.received[-1] == ("add", "uid-1")
    assert await greetings(space) == served("uid-1")

    del node.enrolled["uid-1"]
    await node.server.delete("uid-1")
    assert zt.received[-1] == ("del", "uid-1")
    assert zt.workloads == {}
    assert await greetings(space) == ["refused"] * 3
    assert fds_on(space.path) == []
    assert node.server.connected


@needs_root
async def test_a_restarted_ztunnel_gets_the_same_pods_again(
    node: Node, ztunnels: Callable[[], ZtunnelStandin], spaces: Callable[[], Netns]
) -> None:
    one, two = spaces(), spaces()
    node.pod("uid-1", one)
    node.pod("uid-2", two)
    first = ztunnels()
    await first.connect()
    await first.wait_snapshot()
    await first.stop()  # ztunnel exits: its proxies go
    assert await greetings(one) == ["refused"] * 3
    await _until(lambda: not node.server.connected)

    second = ztunnels()
    await second.connect()
    await second.wait_snapshot()
    assert sorted(second.received) == [("add", "uid-1"), ("add", "uid-2"), ("snapshot", "")]
    assert await greetings(one) == served("uid-1")
    assert await greetings(two) == served("uid-2")


@needs_root
async def test_a_pod_deleted_while_ztunnel_was_away_is_not_in_the_snapshot_and_ztunnel_drops_it(
    node: Node, ztunnels: Callable[[], ZtunnelStandin], spaces: Callable[[], Netns]
) -> None:
    kept, gone = spaces(), spaces()
    node.pod("uid-kept", kept)
    node.pod("uid-gone", gone)
    zt = ztunnels()
    await zt.connect()
    await zt.wait_snapshot()
    await zt.disconnect()  # the connection drops, ztunnel's proxies stay
    await _until(lambda: not node.server.connected)

    del node.enrolled["uid-gone"]
    await node.server.delete("uid-gone")  # nobody to tell: nothing happens
    assert await greetings(gone) == served("uid-gone")

    zt.received.clear()
    await zt.connect()
    await zt.wait_snapshot()
    assert zt.received == [("add", "uid-kept"), ("snapshot", "")]
    assert set(zt.workloads) == {"uid-kept"}
    assert await greetings(gone) == ["refused"] * 3
    assert await greetings(kept) == served("uid-kept")  # the same proxy: an add in the same netns is a no-op


@needs_root
async def test_ztunnel_reconnects_to_a_restarted_node_agent_and_keeps_its_proxies(
    node: Node, spaces: Callable[[], Netns]
) -> None:
    space = spaces()
    node.pod("uid-1", space)
    zt = ZtunnelStandin(node.socket_path, reconnect=True)
    try:
        await zt.connect()
        await zt.wait_snapshot()
        await node.server.stop()
        await zt.wait_disconnected()
        zt.received.clear()
        restarted = ZtunnelServer(node.socket_path, snapshot=lambda: list(node.enrolled.values()))
        await restarted.start()
        try:
            await zt.wait_snapshot()
            assert zt.received == [("add", "uid-1"), ("snapshot", "")]
            assert restarted.connected
            assert await greetings(space) == served("uid-1")
        finally:
            await restarted.stop()
    finally:
        await zt.stop()


@needs_root
async def test_an_add_for_a_known_pod_in_another_netns_moves_its_proxy(
    node: Node, ztunnels: Callable[[], ZtunnelStandin], spaces: Callable[[], Netns]
) -> None:
    before, after = spaces(), spaces()
    zt = ztunnels()
    await zt.connect()
    await zt.wait_snapshot()
    await node.server.add(node.pod("uid-1", before))
    await node.server.add(node.pod("uid-1", before))  # the same netns: nothing changes
    assert await greetings(before) == served("uid-1")
    await node.server.add(node.pod("uid-1", after))
    assert await greetings(before) == ["refused"] * 3
    assert await greetings(after) == served("uid-1")
    assert fds_on(before.path) == []


@needs_root
async def test_a_pod_whose_netns_is_unknown_is_kept(
    node: Node, ztunnels: Callable[[], ZtunnelStandin], spaces: Callable[[], Netns]
) -> None:
    space = spaces()
    node.pod("uid-1", space)
    zt = ztunnels()
    await zt.connect()
    await zt.wait_snapshot()
    await zt.disconnect()
    await _until(lambda: not node.server.connected)

    node.pod("uid-1", None)  # the agent restarted and could not find the pod's netns
    node.pod("uid-2", None)
    node.enrolled["uid-3"] = EnrolledPod("uid-3", "pod-3", "default", "sa", Path("/proc/self/no-such-netns"))
    zt.received.clear()
    await zt.connect()
    await zt.wait_snapshot()
    assert zt.received == [("keep", "uid-1"), ("keep", "uid-2"), ("keep", "uid-3"), ("snapshot", "")]
    assert zt.errors == []
    assert await greetings(space) == served("uid-1")


async def test_add_with_no_ztunnel_connected_fails_and_delete_does_nothing(node: Node) -> None:
    with pytest.raises(NoZtunnel, match="no ztunnel connection"):
        await node.server.add(EnrolledPod("uid-1", "pod", "default", "sa", Path("/proc/self/ns/net")))
    await node.server.delete("uid-1")


@needs_root
async def test_an_error_ack_fails_the_add_and_keeps_the_connection(
    node: Node, ztunnels: Callable[[], ZtunnelStandin], spaces: Callable[[], Netns]
) -> None:
    space = spaces()
    zt = ztunnels()
    zt.nack["uid-1"] = "no room for this proxy"
    await zt.connect()
    await zt.wait_snapshot()
    with pytest.raises(AckError, match="no room for this proxy"):
        await node.server.add(node.pod("uid-1", space))
    assert node.server.connected
    await node.server.add(node.pod("uid-2", spaces()))
    assert set(zt.workloads) == {"uid-2"}


@needs_root
async def test_an_error_ack_in_the_snapshot_is_logged_and_the_snapshot_goes_on(
    node: Node,
    ztunnels: Callable[[], ZtunnelStandin],
    spaces: Callable[[], Netns],
    caplog: pytest.LogCaptureFixture,
) -> None:
    node.pod("uid-1", spaces())
    node.pod("uid-2", spaces())
    zt = ztunnels()
    zt.nack["uid-1"] = "cannot start"
    await zt.connect()
    await zt.wait_snapshot()
    assert set(zt.workloads) == {"uid-2"}
    assert "add-workload: got ack error uid=uid-1" in caplog.text
    assert node.server.connected


@needs_root
async def test_a_ztunnel_that_never_acks_the_snapshot_is_disconnected(
    node: Node, ztunnels: Callable[[], ZtunnelStandin], spaces: Callable[[], Netns]
) -> None:
    node.pod("uid-1", spaces())
    zt = ztunnels()
    zt.ack = False
    started = time.monotonic()
    await zt.connect()
    await zt.wait_disconnected()  # the agent gave up on the ack and closed the connection
    assert 1.0 <= time.monotonic() - started < 3.0
    assert zt.received == [("add", "uid-1")]
    assert not node.server.connected
    assert fds_on(node.enrolled["uid-1"].netns or Path()) == [zt.workloads["uid-1"].fd]


@needs_root
async def test_an_update_not_acked_in_time_fails_but_keeps_the_connection(
    node: Node, ztunnels: Callable[[], ZtunnelStandin], spaces: Callable[[], Netns]
) -> None:
    zt = ztunnels()
    await zt.connect()
    await zt.wait_snapshot()
    zt.ack = False
    started = time.monotonic()
    with pytest.raises(ZdsError, match="did not ack within"):
        await node.server.add(node.pod("uid-1", spaces()))
    assert 1.0 <= time.monotonic() - started < 3.0
    assert node.server.connected  # as Istio: a late ack is not a dead connection


async def test_a_late_ack_is_an_unexpected_message_and_closes_the_connection(node: Node) -> None:
    # as Istio's keepalive read finds it: acks are matched by order, so one that comes late cannot be trusted
    client = await _hello(node)
    try:
        assert await _request(client) == "snapshot_sent"
        adding = asyncio.create_task(
            node.server.add(EnrolledPod("uid-1", "p", "ns", "sa", Path("/proc/self/ns/net")))
        )
        assert await _request(client, answer=False) == "add"
        with pytest.raises(ZdsError, match="did not ack within"):
            await adding
        assert node.server.connections == 1
        await client.send(zds_pb2.WorkloadResponse(ack=zds_pb2.Ack()).SerializeToString())
        async with asyncio.timeout(5):
            assert await client.receive() is None
        assert node.server.connections == 0
    finally:
        client.close()


async def test_a_hello_of_another_version_is_taken_with_a_warning(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    # Istio's server reads the version and logs it; it refuses nothing on it
    client = await SeqpacketConnection.connect(node.socket_path)
    try:
        await client.send(b"\x08\x02")  # ZdsHello{version: 2}, a version this proto does not know
        assert await _request(client) == "snapshot_sent"
        assert node.server.connected
        assert "ztunnel hello has version 2, expected V1" in caplog.text
    finally:
        client.close()


async def test_a_failing_snapshot_source_closes_the_connection_not_the_server(
    short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    calls = []

    def snapshot() -> list[EnrolledPod]:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("pod cache not ready")
        return []

    node = Node(
        short_tmp / "zt.sock", {}, ZtunnelServer(short_tmp / "zt.sock", snapshot=snapshot, accept_interval=0)
    )
    await node.server.start()
    try:
        first = await _hello(node)
        async with asyncio.timeout(5):
            assert await first.receive() is None
        first.close()
        second = await _hello(node)
        assert await _request(second) == "snapshot_sent"
        second.close()
        assert "failed to handle ztunnel connection" in caplog.text
        assert "pod cache not ready" in caplog.text
    finally:
        await node.server.stop()


async def test_connections_are_accepted_at_most_five_a_second(short_tmp: Path) -> None:
    server = ZtunnelServer(short_tmp / "zt.sock", snapshot=list)  # Istio's rate: one every 0.2 s
    await server.start()
    clients = []
    try:
        started = time.monotonic()
        clients = [await _hello(Node(short_tmp / "zt.sock", {}, server)) for _ in range(3)]
        for client in clients:
            assert await _request(client) == "snapshot_sent"
        assert time.monotonic() - started >= 0.4
        assert server.connections == 3
    finally:
        for client in clients:
            client.close()
        await server.stop()


async def test_a_ztunnel_that_says_no_hello_is_disconnected(node: Node) -> None:
    silent = await SeqpacketConnection.connect(node.socket_path)
    try:
        started = time.monotonic()
        async with asyncio.timeout(5):
            assert await silent.receive() is None
        assert 1.0 <= time.monotonic() - started < 3.0
    finally:
        silent.close()


@pytest.mark.parametrize(
    "hello",
    [
        pytest.param(b"\xff\xff\xff\xff", id="garbage"),
        pytest.param(b"\x0a" * 2000, id="oversized"),
    ],
)
async def test_a_bad_hello_closes_that_connection_only(node: Node, hello: bytes) -> None:
    bad = await SeqpacketConnection.connect(node.socket_path)
    try:
        await bad.send(hello)
        async with asyncio.timeout(5):
            assert await bad.receive() is None  # closed by the agent
    finally:
        bad.close()
    good = await _hello(node)
    try:
        assert await _request(good) == "snapshot_sent"
    finally:
        good.close()


async def test_a_descriptor_sent_to_the_agent_closes_that_connection(node: Node) -> None:
    client = await SeqpacketConnection.connect(node.socket_path)
    fd = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        await client.send(zds_pb2.ZdsHello(version=zds_pb2.V1).SerializeToString(), (fd,))
        async with asyncio.timeout(5):
            assert await client.receive() is None
        assert len(fds_on(Path("/proc/self/ns/net"))) == 1  # ours: the agent closed the one it got
    finally:
        os.close(fd)
        client.close()


async def test_input_while_idle_and_a_wrong_answer_close_the_connection(node: Node) -> None:
    idle = await _hello(node)
    try:
        assert await _request(idle) == "snapshot_sent"
        await idle.send(zds_pb2.WorkloadResponse(ack=zds_pb2.Ack()).SerializeToString())  # unasked
        async with asyncio.timeout(5):
            assert await idle.receive() is None
    finally:
        idle.close()
    await _until(lambda: node.server.connections == 0)

    node.enrolled["uid-1"] = EnrolledPod("uid-1", "pod", "default", "sa", None)
    wrong = await _hello(node)
    try:
        assert await _request(wrong, answer=False) == "keep"
        await wrong.send(zds_pb2.ZdsHello(version=zds_pb2.V1).SerializeToString())  # not an ack
        async with asyncio.timeout(5):
            assert await wrong.receive() is None
    finally:
        wrong.close()


async def test_connected_follows_ztunnels_hello_and_its_connection(node: Node) -> None:
    assert not node.server.connected
    client = await SeqpacketConnection.connect(node.socket_path)
    await _until(lambda: node.server.connections == 1)
    assert not node.server.connected  # no hello yet
    await client.send(zds_pb2.ZdsHello(version=zds_pb2.V1).SerializeToString())
    assert await _request(client) == "snapshot_sent"
    assert node.server.connected
    client.close()
    await _until(lambda: not node.server.connected and node.server.connections == 0)


async def test_adds_go_to_the_newest_ztunnel_and_deletes_to_every_one(node: Node) -> None:
    older, newer = await _hello(node), await _hello(node)
    try:
        for client in (older, newer):
            assert await _request(client) == "snapshot_sent"
        await _until(lambda: node.server.connections == 2)
        adding = asyncio.create_task(
            node.server.add(EnrolledPod("uid-1", "p", "ns", "sa", Path("/proc/self/ns/net")))
        )
        assert await _request(newer) == "add"
        await adding
        deleting = asyncio.create_task(node.server.delete("uid-1"))
        assert await _request(older) == "del"
        assert await _request(newer) == "del"
        await deleting
        newer.close()
        await _until(lambda: node.server.connections == 1)
        adding = asyncio.create_task(
            node.server.add(EnrolledPod("uid-2", "p", "ns", "sa", Path("/proc/self/ns/net")))
        )
        assert await _request(older) == "add"  # falls back to the one left
        await adding
    finally:
        older.close()
        newer.close()


async def test_stop_closes_connections_fails_waiting_requests_and_removes_the_socket(node: Node) -> None:
    client = await _hello(node)
    try:
        assert await _request(client) == "snapshot_sent"
        adding = asyncio.create_task(
            node.server.add(EnrolledPod("uid-1", "p", "ns", "sa", Path("/proc/self/ns/net")))
        )
        await _request(client, answer=False)
        await node.server.stop()
        with pytest.raises(ZdsError, match="connection closed"):
            async with asyncio.timeout(5):
                await adding
        async with asyncio.timeout(5):
            assert await client.receive() is None
        assert not node.socket_path.exists()
    finally:
        client.close()


async def test_a_socket_file_left_behind_is_replaced(short_tmp: Path) -> None:
    path = short_tmp / "ztunnel.sock"
    path.write_text("left by an earlier run")
    server = ZtunnelServer(path, snapshot=list)
    await server.start()
    try:
        client = await _hello(Node(path, {}, server))
        assert await _request(client) == "snapshot_sent"
        client.close()
    finally:
        await server.stop()


# --- the stand-in is as strict as ztunnel ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_bytes", "with_fd", "error"),
    [
        pytest.param(
            zds_pb2.WorkloadRequest(add=zds_pb2.AddWorkload(uid="u")),
            False,
            "No control message",
            id="add-no-fd",
        ),
        pytest.param(
            zds_pb2.WorkloadRequest(keep=zds_pb2.KeepWorkload(uid="u")),
            True,
            "Unexpected control message",
            id="keep-fd",
        ),
        pytest.param(zds_pb2.WorkloadRequest(), False, "no payload", id="empty-payload"),
        pytest.param(
            zds_pb2.WorkloadRequest(
                add=zds_pb2.AddWorkload(uid="u" * 1100, workload_info=zds_pb2.WorkloadInfo())
            ),
            True,
            "received truncated message",
            id="oversized",
        ),
    ],
)
async def test_the_standin_refuses_what_ztunnel_refuses(
    short_tmp: Path, request_bytes: zds_pb2.WorkloadRequest, with_fd: bool, error: str
) -> None:
    listener = listen(short_tmp / "zt.sock")
    zt = ZtunnelStandin(short_tmp / "zt.sock")
    try:
        await zt.connect()
        agent = await SeqpacketConnection.accept(listener)
        hello = await agent.receive()
        assert hello is not None and zds_pb2.ZdsHello.FromString(hello.data).version == zds_pb2.V1
        fd = os.open("/proc/self/ns/net", os.O_RDONLY)
        try:
            # an empty request would be an empty packet, the end of the connection: one unknown field instead
            payload = request_bytes.SerializeToString() or b"\x78\x00"
            await agent.send(payload, (fd,) if with_fd else ())
        finally:
            os.close(fd)
        answer = await agent.receive()
        assert answer is not None
        assert error in zds_pb2.WorkloadResponse.FromString(answer.data).ack.error
        assert await agent.receive() is None  # and ztunnel ends the connection
        agent.close()
    finally:
        await zt.stop()
        listener.close()


async def _hello(node: Node) -> SeqpacketConnection:
    client = await SeqpacketConnection.connect(node.socket_path)
    await client.send(zds_pb2.ZdsHello(version=zds_pb2.V1).SerializeToString())
    return client


async def _request(client: SeqpacketConnection, *, answer: bool = True) -> str | None:
    """Read one request as a bare ztunnel would (closing any fd), ack it; its payload kind."""
    async with asyncio.timeout(5):
        packet = await client.receive()
    assert packet is not None, "the agent closed the connection"
    packet.close_fds()
    kind = zds_pb2.WorkloadRequest.FromString(packet.data).WhichOneof("payload")
    if answer:
        await client.send(zds_pb2.WorkloadResponse(ack=zds_pb2.Ack()).SerializeToString())
    return kind


async def _until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


@pytest.mark.parametrize(
    ("after_snapshot", "error"),
    [
        pytest.param(
            zds_pb2.WorkloadRequest(keep=zds_pb2.KeepWorkload(uid="u")),
            "pod keep received after snapshot",
            id="keep",
        ),
        pytest.param(
            zds_pb2.WorkloadRequest(snapshot_sent=zds_pb2.SnapshotSent()),
            "pod snapshot received already",
            id="snapshot",
        ),
    ],
)
async def test_the_standin_stops_on_what_ztunnel_takes_for_a_protocol_error(
    short_tmp: Path, after_snapshot: zds_pb2.WorkloadRequest, error: str
) -> None:
    listener = listen(short_tmp / "zt.sock")
    zt = ZtunnelStandin(short_tmp / "zt.sock", reconnect=True)
    try:
        await zt.connect()
        agent = await SeqpacketConnection.accept(listener)
        assert await agent.receive() is not None  # hello
        for message, expected in (
            (zds_pb2.WorkloadRequest(snapshot_sent=zds_pb2.SnapshotSent()), ""),
            (after_snapshot, error),
        ):
            await agent.send(message.SerializeToString())
            answer = await agent.receive()
            assert answer is not None
            assert expected in zds_pb2.WorkloadResponse.FromString(answer.data).ack.error
            assert bool(expected) == bool(zds_pb2.WorkloadResponse.FromString(answer.data).ack.error)
        assert await agent.receive() is None
        assert zt.protocol_error == error
        await asyncio.sleep(0.1)
        assert not zt.connected  # ztunnel's workload manager stopped: no reconnection
        agent.close()
    finally:
        await zt.stop()
        listener.close()
