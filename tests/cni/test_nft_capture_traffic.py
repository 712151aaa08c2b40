"""Traffic in a pod namespace after applying the nftables rules: where connections really land.

The same checks as ``test_capture_traffic.py`` makes of the iptables rules, with the same pod, peer
and helpers: a connection that is not captured lands on the peer (which owns 1.2.3.4) instead of
the proxy's listener.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Iterator

import pytest

from istio_agent.cni.capture_config import CaptureConfig
from istio_agent.cni.nftables.apply import apply_nft_capture
from tests.cni.netns import POD_IP, Netns, needs_root, peer, pod_and_peer, run_peer
from tests.cni.test_capture_traffic import APP, PROXY, SIDECAR, lands_on

pytestmark = [
    needs_root,
    pytest.mark.skipif(shutil.which("nft") is None, reason="needs nft (Debian nftables)"),
]


@pytest.fixture
def pods() -> Iterator[tuple[Netns, Netns]]:
    with pod_and_peer() as (pod, other):
        other.ip("address", "add", "1.2.3.4/32", "dev", "lo")
        yield pod, other


def apply(pod: Netns, config: CaptureConfig = SIDECAR) -> None:
    assert apply_nft_capture(config, netns=pod.path).action == "applied"
    assert pod.exec("iptables-nft-save").count("-A") == 0  # nothing of it is iptables' (nft -f only)


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
    pod, other = pods
    apply(pod, dataclasses.replace(SIDECAR, mode="TPROXY"))
    with peer(pod, APP, "listen", "tproxy", "15006") as proxy:
        assert run_peer(other, APP, "connect", "tcp", POD_IP, "8080") == "connected"
        assert proxy.line() == f"accepted {POD_IP} 8080"


@pytest.mark.parametrize(
    ("uid", "config"),
    [
        (PROXY, SIDECAR),
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
    """The plugin's DNS capture (every server, a case no Istio golden pins)."""
    pod, _ = pods
    apply(pod, dataclasses.replace(SIDECAR, redirect_dns=True, capture_all_dns=True))
    with peer(pod, PROXY, "listen", "udp", "15053") as agent:
        run_peer(pod, APP, "send", "udp", "1.2.3.4", "53", "query")
        assert agent.line() == "received query"
