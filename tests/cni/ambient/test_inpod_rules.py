"""Golden tests of ambient's in-pod and host-probe rules, against Istio 1.28.10's own files.

``golden/ambient/{iptables,nftables}/`` hold Istio's ``cni/pkg/iptables/testdata`` and
``cni/pkg/nftables/testdata`` byte for byte (``ISTIO_SOURCES`` there: path and blob id). The settings
of each case are ``common_test.go``'s (``GetCommonInPodTestCases``, ``GetCommonHostTestCases``) on
``constructTestConfig`` (probe SNAT 169.254.7.127, and a made-up v6 SNAT address); the iptables host
test sets the real v6 one. The iptables text is what ``iptables_test.go`` records: the two saves of
the state check, then the restore input of v4 and, with IPv6, of v6, joined by newlines. Compared
byte for byte (Istio's ``CompareContent`` trims surrounding blanks; we do not).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from istio_agent.cni.ambient import hostprobe, inpod
from istio_agent.cni.ambient.inpod import InpodSettings, PodRedirect
from istio_agent.cni.rules import RuleSet, render
from istio_agent.config.env import ConfigError
from tests.cni.istio_sources import drifted, manifest

GOLDEN = Path(__file__).parents[1] / "golden" / "ambient"
TEST_SNAT_V6 = "e9ac:1e77:90ca:399f:4d6d:ece2:2f9b:3164"
"""constructTestConfig's HostProbeV6SNATAddress."""
BASE = InpodSettings(host_probe_snat_ipv6=TEST_SNAT_V6)
VIRTUAL = ("fake1s0f0", "fake1s0f1")
IN_POD: dict[str, tuple[dict[str, object], PodRedirect]] = {
    "default": ({"dns_capture": True}, PodRedirect()),
    "ingress": ({}, PodRedirect(ingress_mode=True)),
    "virtual_interfaces": ({}, PodRedirect(virtual_interfaces=VIRTUAL)),
    "ingress_and_virtual_interfaces": ({}, PodRedirect(ingress_mode=True, virtual_interfaces=VIRTUAL)),
    "dns_pod_enabled_and_off_globally": ({"dns_capture": False}, PodRedirect(dns_capture=True)),
    "dns_pod_disabled_and_on_globally": ({"dns_capture": True}, PodRedirect(dns_capture=False)),
}
"""GetCommonInPodTestCases: case -> (the global settings, the pod's overrides)."""
KUBELET_UID = "1000"
"""nftables_test.go's stubbed kubeletUIDProvider."""


def golden(kind: str, name: str, ipv6: bool) -> str:
    return (GOLDEN / kind / f"{name}{'_ipv6' if ipv6 else ''}.golden").read_text()


def recorded_run(rules: RuleSet, ipv6: bool) -> str:
    """iptables_test.go's ExecutedAll: the saves, then the restore input per family."""
    lines = ["iptables-save", "ip6tables-save", *render(rules.v4).splitlines()]
    if ipv6:
        lines += render(rules.v6).splitlines()
    return "\n".join(lines)


def settings(name: str, ipv6: bool) -> tuple[InpodSettings, PodRedirect]:
    overrides, pod = IN_POD[name]
    return dataclasses.replace(BASE, ipv6=ipv6, **overrides), pod  # type: ignore[arg-type]


@pytest.mark.parametrize("ipv6", [False, True], ids=["ipv4", "ipv6"])
@pytest.mark.parametrize("name", sorted(IN_POD))
def test_inpod_iptables_golden(name: str, ipv6: bool) -> None:
    config, pod = settings(name, ipv6)
    assert recorded_run(inpod.iptables_rules(config, pod), ipv6) == golden("iptables", name, ipv6)


@pytest.mark.parametrize("ipv6", [False, True], ids=["ipv4", "ipv6"])
@pytest.mark.parametrize("name", sorted(IN_POD))
def test_inpod_nftables_golden(name: str, ipv6: bool) -> None:
    config, pod = settings(name, ipv6)
    assert inpod.render_nft(inpod.nft_rules(config, pod)) == golden("nftables", name, ipv6)


@pytest.mark.parametrize("ipv6", [False, True], ids=["ipv4", "ipv6"])
def test_hostprobe_iptables_golden(ipv6: bool) -> None:
    config = InpodSettings(dns_capture=True, ipv6=ipv6)  # the real v6 SNAT address, as that test sets
    assert recorded_run(hostprobe.iptables_rules(config), ipv6) == golden("iptables", "hostprobe", ipv6)


@pytest.mark.parametrize("ipv6", [False, True], ids=["ipv4", "ipv6"])
def test_hostprobe_nftables_golden(ipv6: bool) -> None:
    config = dataclasses.replace(BASE, dns_capture=True, ipv6=ipv6)
    text = hostprobe.render_nft(hostprobe.nft_rules(config, KUBELET_UID))
    assert text == golden("nftables", "hostprobe", ipv6)


def test_every_golden_is_istios_file() -> None:
    """Each golden is Istio's file byte for byte, and every case of Istio's has its golden."""
    names = {f"{case}{suffix}.golden" for case in [*IN_POD, "hostprobe"] for suffix in ("", "_ipv6")}
    for kind in ("iptables", "nftables"):
        sources = manifest(GOLDEN / kind)
        assert drifted(GOLDEN / kind) == {}
        assert {path.name for path in (GOLDEN / kind).glob("*.golden")} == set(sources) == names
        assert {s.istio_path for s in sources.values()} == {f"cni/pkg/{kind}/testdata/{n}" for n in names}


# -- the pod's annotations (net.go's getPodLevelTrafficOverrides) ----------------------------------


def test_pod_redirect_from_annotations() -> None:
    pod = PodRedirect.from_annotations(
        {
            "ambient.istio.io/bypass-inbound-capture": "true",
            "ambient.istio.io/dns-capture": "false",
            "istio.io/reroute-virtual-interfaces": " eth1, ,eth2 ,",
        }
    )
    assert pod == PodRedirect(ingress_mode=True, virtual_interfaces=("eth1", "eth2"), dns_capture=False)
    assert PodRedirect.from_annotations({}) == PodRedirect()
    assert PodRedirect.from_annotations({"ambient.istio.io/dns-capture": "1"}).dns_capture is True


def test_a_non_boolean_annotation_is_ignored_as_in_istio() -> None:
    """CheckBooleanAnnotation: only booleans count; anything else is as if unset (a warning)."""
    pod = PodRedirect.from_annotations(
        {"ambient.istio.io/bypass-inbound-capture": "yes", "ambient.istio.io/dns-capture": "maybe"}
    )
    assert pod == PodRedirect()


def test_pod_dns_override_beats_the_global_setting() -> None:
    on = InpodSettings(dns_capture=True)
    off = InpodSettings(dns_capture=False)
    assert inpod.dns_capture(on, PodRedirect()) is True
    assert inpod.dns_capture(off, PodRedirect()) is False
    assert inpod.dns_capture(on, PodRedirect(dns_capture=False)) is False
    assert inpod.dns_capture(off, PodRedirect(dns_capture=True)) is True


@pytest.mark.parametrize("name", ["a" * 16, "eth0;x", "-eth0", "eth 0"])
def test_a_bad_virtual_interface_is_refused_for_both_backends(name: str) -> None:
    pod = PodRedirect(virtual_interfaces=(name,))
    with pytest.raises(ConfigError, match="interface"):
        inpod.iptables_rules(InpodSettings(), pod)
    with pytest.raises(ConfigError, match="interface"):
        inpod.nft_rules(InpodSettings(), pod)


def test_building_is_pure() -> None:
    config, pod = settings("default", True)
    assert inpod.iptables_rules(config, pod) == inpod.iptables_rules(config, pod)
    assert inpod.render_nft(inpod.nft_rules(config, pod)) == inpod.render_nft(inpod.nft_rules(config, pod))
