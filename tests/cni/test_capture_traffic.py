"""Traffic in a pod namespace after applying the rules: where connections really land.

The pod (10.77.0.2) reaches the world through a peer namespace (10.77.0.1), which also owns
1.2.3.4, so a connection that is *not* captured lands on the peer's listener instead of the proxy's.
Listeners and clients are small processes (traffic_peer.py) run with the uid the case needs.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

import pytest

from istio_agent.cni.apply import apply_capture
from istio_agent.cni.capture_config import CaptureConfig
from istio_agent.cni.iptables import detect
from tests.cni.netns import POD_IP, Netns, needs_root, peer, pod_and_peer, run_peer

pytestmark = needs_root
PROXY, APP = 1337, 0
SIDECAR = CaptureConfig(
    inbound_ports=("*",), inbound_ports_exclude=(15090, 15021, 15020), ip_ranges_include=("*",)
)


@pytest.fixture
def pods() -> Iterator[tuple[Netns, Netns]]:
    with pod_and_peer() as (pod, other):
        other.ip("address", "add", "1.2.3.4/32", "dev", "lo")
        yield pod, other


def apply(pod: Netns, config: CaptureConfig = SIDECAR) -> None:
    apply_capture(config, netns=pod.path, backend=detect(os.environ))


def lands_on(listener: Netns, port: str, client: Netns, uid: int, host: str, dport: str) -> str:
    """Where a connection from ``client`` (as ``uid``) to host:dport ends up: the line printed by the
    listener on ``port`` in ``listener`` (``accepted <original ip> <original port>``). The listener
    runs as the proxy's uid, except on a privileged port (the real destination's)."""
    with peer(listener, PROXY if int(port) >= 1024 else APP, "listen", "tcp", port) as accepting:
        assert run_peer(client, uid, "connect", "tcp", host, dport) == "connected"
        return accepting.line()


def test_the_apps_outbound_connection_lands_on_the_proxy_with_its_original_destination(
    pods: tuple[Netns, Netns],
) -> None:
    pod, _ = pods
    apply(pod)
    assert lands_on(pod, "15001", pod, APP, "1.2.3.4", "80") == "accepted 1.2.3.4 80"


def test_an_inbound_connection_lands_on_the_inbound_port_with_the_pod_address(
    pods: tuple[Netns, Netns],
) -> None:
    pod, other = pods
    apply(pod)
    assert lands_on(pod, "15006", other, APP, POD_IP, "8080") == f"accepted {POD_IP} 8080"


def test_tproxy_inbound_keeps_the_original_destination_on_a_transparent_listener(
    pods: tuple[Netns, Netns],
) -> None:
    """TPROXY delivers without NAT, through the fwmark route table: the proxy's transparent socket
    (root here for IP_TRANSPARENT; Envoy has CAP_NET_ADMIN) sees the pod address as its own."""
    pod, other = pods
    apply(pod, dataclasses.replace(SIDECAR, mode="TPROXY"))
    with peer(pod, APP, "listen", "tproxy", "15006") as proxy:
        assert run_peer(other, APP, "connect", "tcp", POD_IP, "8080") == "connected"
        assert proxy.line() == f"accepted {POD_IP} 8080"


@pytest.mark.parametrize(
    ("uid", "config"),
    [
        (PROXY, SIDECAR),  # the proxy's own traffic
        (APP, dataclasses.replace(SIDECAR, outbound_ports_exclude=(80,))),
        (APP, dataclasses.replace(SIDECAR, ip_ranges_exclude=("1.2.3.4/32",))),
        (APP, dataclasses.replace(SIDECAR, ip_ranges_include=("10.96.0.0/12",))),
    ],
    ids=["uid-1337", "excluded-port", "excluded-cidr", "outside-included-cidr"],
)
def test_traffic_that_must_bypass_the_proxy_reaches_the_real_destination(
    pods: tuple[Netns, Netns], uid: int, config: CaptureConfig
) -> None:
    pod, other = pods
    apply(pod, config)
    assert lands_on(other, "80", pod, uid, "1.2.3.4", "80") == "accepted 1.2.3.4 80"


def test_dns_goes_to_the_agent_when_dns_capture_is_on(pods: tuple[Netns, Netns]) -> None:
    pod, _ = pods
    apply(pod, dataclasses.replace(SIDECAR, redirect_dns=True, capture_all_dns=True))
    with peer(pod, PROXY, "listen", "udp", "15053") as agent:
        run_peer(pod, APP, "send", "udp", "1.2.3.4", "53", "query")
        assert agent.line() == "received query"
