"""Traffic through ambient's in-pod rules: where connections land, in a pod wired to a peer.

A pod namespace (10.77.0.2, fd77::2) joined to a peer (10.77.0.1, fd77::1) that stands for the rest
of the network and, for the probe case, for the node. Plain, unmarked listeners stand in for
ztunnel on 15001 (outbound), 15006 (inbound plaintext), 15008 (HBONE) and 15053 (DNS) inside the
pod; ztunnel's own outbound connection is a socket with ``SO_MARK`` 0x539, as ztunnel marks its
sockets. With each backend (iptables-legacy, iptables-nft, native nftables):

- an app connection from the pod to any address lands on 15001, ``SO_ORIGINAL_DST`` the address;
- ztunnel's marked connection reaches the peer directly;
- a connection from the peer to the pod's IP lands on 15006 (original destination kept), except to
  15008, which reaches the 15008 listener directly;
- a kubelet-like probe from the node, SNATed to 169.254.7.127 by the host rules, reaches the app's
  port directly;
- with DNS capture, a query to any resolver lands on 15053.
"""

from __future__ import annotations

import dataclasses
import socket
import struct
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from istio_agent.cni.ambient.hostprobe import HostProbeRules
from istio_agent.cni.ambient.inpod import InpodSettings, PodRedirect, apply_inpod
from istio_agent.cni.ambient.settings import INPOD_MARK, SNAT_V4, SNAT_V6
from tests.cni.ambient.test_hostprobe import HOST_V6, POD_V6
from tests.cni.ambient.test_inpod_apply import FLAVORS, with_backend
from tests.cni.netns import PEER_IP, POD_IP, Netns, needs_root, pod_and_peer

pytestmark = needs_root
SO_ORIGINAL_DST = 80
"""netfilter's getsockopt, at SOL_IP for v4 and SOL_IPV6 (IP6T_SO_ORIGINAL_DST) for v6."""
TIMEOUT = 3.0
ZTUNNEL_PORTS = (15001, 15006, 15008)


@dataclasses.dataclass
class Pod:
    """The pod and peer namespaces, the in-pod settings, and ztunnel's stand-in listeners."""

    pod: Netns
    peer: Netns
    settings: InpodSettings
    listeners: dict[int, socket.socket]
    v6: bool

    @property
    def family(self) -> socket.AddressFamily:
        return socket.AF_INET6 if self.v6 else socket.AF_INET

    @property
    def pod_ip(self) -> str:
        return POD_V6 if self.v6 else POD_IP

    @property
    def peer_ip(self) -> str:
        return HOST_V6 if self.v6 else PEER_IP

    def listen(self, space: Netns, port: int, kind: socket.SocketKind = socket.SOCK_STREAM) -> socket.socket:
        sock = space.socket(self.family, kind)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("::" if self.v6 else "0.0.0.0", port))
        if kind == socket.SOCK_STREAM:
            sock.listen(4)
        sock.settimeout(TIMEOUT)
        return sock


@pytest.fixture(params=FLAVORS)
def flavor(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=[False, True], ids=["ipv4", "ipv6"])
def wired(request: pytest.FixtureRequest, flavor: str) -> Iterator[Pod]:
    v6 = bool(request.param)
    with pod_and_peer(ipv6=True) as (pod, peer), ExitStack() as stack:
        pod.ip("-6", "route", "add", "default", "via", HOST_V6)
        for space, other, addresses in ((peer, pod, (POD_IP, POD_V6)), (pod, peer, (PEER_IP, HOST_V6))):
            mac = other.exec("cat", "/sys/class/net/eth0/address").strip()
            for address in addresses:
                space.ip("neigh", "replace", address, "lladdr", mac, "dev", "eth0", "nud", "permanent")
        settings = with_backend(InpodSettings(dns_capture=True, ipv6=v6), flavor)
        apply_inpod(pod.path, settings, PodRedirect())
        wiring = Pod(pod, peer, settings, {}, v6)
        for port in ZTUNNEL_PORTS:
            wiring.listeners[port] = stack.enter_context(wiring.listen(pod, port))
        yield wiring


def original_dst(conn: socket.socket, v6: bool) -> tuple[str, int]:
    """Where the client meant to connect; in a namespace that tracks no connections (the peer), the
    address it reached."""
    try:
        return _original_dst(conn, v6)
    except FileNotFoundError:  # no conntrack entry
        host, port = conn.getsockname()[:2]
        return str(host), int(port)


def _original_dst(conn: socket.socket, v6: bool) -> tuple[str, int]:
    if v6:
        raw = conn.getsockopt(socket.IPPROTO_IPV6, SO_ORIGINAL_DST, 28)
        port, packed = struct.unpack_from("!2xH4x16s", raw)
        return socket.inet_ntop(socket.AF_INET6, packed), port
    raw = conn.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, packed = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(packed), port


def connect_from(
    wiring: Pod, space: Netns, host: str, port: int, *, mark: int | None = None
) -> socket.socket:
    client = space.socket(wiring.family)
    if mark is not None:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)
    client.settimeout(TIMEOUT)
    client.connect((host, port))
    return client


def lands_on(wiring: Pod, listener: socket.socket) -> tuple[tuple[str, int], str]:
    """The next connection ``listener`` accepts: (its original destination, its source address)."""
    conn, peer = listener.accept()
    with conn:
        return original_dst(conn, wiring.v6), str(peer[0])


def nothing_else_accepts(wiring: Pod, *ports: int) -> None:
    for port in ports:
        wiring.listeners[port].settimeout(0.2)
        with pytest.raises(TimeoutError):
            wiring.listeners[port].accept()
        wiring.listeners[port].settimeout(TIMEOUT)


def test_an_app_connection_to_anywhere_lands_on_15001_with_its_destination(wired: Pod) -> None:
    far = "2001:db8::1" if wired.v6 else "1.2.3.4"
    for host, port in ((far, 80), (wired.peer_ip, 9000)):
        with connect_from(wired, wired.pod, host, port):
            assert lands_on(wired, wired.listeners[15001])[0] == (host, port)
    nothing_else_accepts(wired, 15006, 15008)


def test_ztunnels_marked_connection_is_not_redirected(wired: Pod) -> None:
    upstream = wired.listen(wired.peer, 9000)
    with upstream, connect_from(wired, wired.pod, wired.peer_ip, 9000, mark=INPOD_MARK):
        (_, source) = lands_on(wired, upstream)
    assert source == wired.pod_ip
    nothing_else_accepts(wired, 15001)


def test_inbound_to_the_pod_lands_on_15006_except_hbone_to_15008(wired: Pod) -> None:
    with connect_from(wired, wired.peer, wired.pod_ip, 8080):
        destination, source = lands_on(wired, wired.listeners[15006])
    assert (destination, source) == ((wired.pod_ip, 8080), wired.peer_ip)
    with connect_from(wired, wired.peer, wired.pod_ip, 15008):
        destination, source = lands_on(wired, wired.listeners[15008])
    assert (destination, source) == ((wired.pod_ip, 15008), wired.peer_ip)
    nothing_else_accepts(wired, 15001, 15006)


def test_a_snated_probe_reaches_the_app_port_directly(wired: Pod) -> None:
    """The peer as the node: its host rules SNAT its own connection to the enrolled pod."""
    host = dataclasses.replace(wired.settings, ipv6=True)
    rules = HostProbeRules(host, netns=wired.peer.path, kubelet_uid="0")  # the test's sockets: uid 0
    rules.install()
    rules.add_pod_ips([POD_IP, POD_V6], uid="pod-uid")
    app = wired.listen(wired.pod, 8080)
    with app, connect_from(wired, wired.peer, wired.pod_ip, 8080) as client:
        client.sendall(b"ping")
        conn, peer = app.accept()
        with conn:
            assert conn.recv(4) == b"ping"
            conn.sendall(b"pong")  # the reply finds its way back through the SNAT
        assert client.recv(4) == b"pong"
    assert str(peer[0]) == (SNAT_V6 if wired.v6 else SNAT_V4)
    nothing_else_accepts(wired, 15006)


def test_dns_to_any_resolver_lands_on_15053(wired: Pod) -> None:
    resolver = "2001:db8::53" if wired.v6 else "8.8.8.8"
    dns = wired.listen(wired.pod, 15053, socket.SOCK_DGRAM)
    with dns, wired.pod.socket(wired.family, socket.SOCK_DGRAM) as client:
        client.sendto(b"query", (resolver, 53))
        assert dns.recv(64) == b"query"
