"""Golden tests of the sidecar rule set, one per case Istio pins.

Each golden file is laid out as Istio's ``tools/istio-iptables/pkg/capture/run_test.go`` records a
run (every command line its stub executor saw, the restore input split into lines), and the
``cni-*`` cases as ``cni/pkg/plugin/plugin_dryrun_test.go`` compares them (the restore input alone).
The expected files follow the generation order of ``capture/run.go`` and were reviewed line by line
against it; ``cni-basic`` matches Istio's ``cni/pkg/plugin/testdata/basic.txt.golden`` rule for rule.
Case values not pinned by name (the ``tproxy`` interface, the excluded ports) are our own choice.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from istio_agent.cni.capture_config import CaptureConfig
from istio_agent.cni.rules import build, render, render_families
from istio_agent.config.env import ConfigError

GOLDEN = Path(__file__).parent / "golden"
BASE = CaptureConfig()
"""run_test.go's base: 15001/15006/15008, uid=gid=1337, mark 1337, table 133, no inbound ports."""
UID_GID = {"proxy_uid": ("3", "4"), "proxy_gid": ("1", "2")}
V6_NETS = {"ip_ranges_include": ("2001:db8::/32",), "ip_ranges_exclude": ("2001:db8::/32",)}

CASES: dict[str, dict[str, object]] = {
    "empty": {},
    "ipv6-empty-inbound-ports": {"enable_ipv6": True},
    "ip-range": {
        "ip_ranges_exclude": ("1.1.0.0/16",),
        "ip_ranges_include": ("9.9.0.0/16",),
        "redirect_dns": True,
        "dns_servers": ("127.0.0.53",),
        **UID_GID,
    },
    "tproxy": {
        "mode": "TPROXY",
        "inbound_ports": ("*",),
        "inbound_ports_exclude": (15020,),
        "ip_ranges_exclude": ("1.1.0.0/16",),
        "ip_ranges_include": ("9.9.0.0/16",),
        "redirect_dns": True,
        "dns_servers": ("127.0.0.53",),
        "exclude_interfaces": ("not-istio-nic",),
        "enable_ipv6": True,
    },
    "ipv6-inbound-ports": {"inbound_ports": ("4000", "5000"), "enable_ipv6": True},
    "ipv6-ipnets": {
        "inbound_ports": ("4000", "5000"),
        "outbound_ports_exclude": (6000, 7000),
        "enable_ipv6": True,
        **V6_NETS,
    },
    "ipv6-uid-gid": {
        "inbound_ports": ("4000", "5000"),
        "outbound_ports_exclude": (6000, 7000),
        "reroute_interfaces": ("eth0", "eth1"),
        "enable_ipv6": True,
        **UID_GID,
        **V6_NETS,
    },
    "ipv6-outbound-ports": {"outbound_ports": (32000, 31000), "enable_ipv6": True},
    "kube-virt-interfaces": {"reroute_interfaces": ("eth1", "eth2"), "ip_ranges_include": ("*",)},
    "ipnets": {"ip_ranges_include": ("10.0.0.0/8",)},
    "inbound-ports-include": {"inbound_ports": ("32000", "31000")},
    "inbound-ports-wildcard": {"inbound_ports": ("*",), "inbound_ports_exclude": (15090, 15021, 15020)},
    "inbound-ports-tproxy": {"mode": "TPROXY", "inbound_ports": ("32000", "31000")},
    "dns-uid-gid": {
        "redirect_dns": True,
        "dns_servers": ("127.0.0.53", "::127.0.0.53"),
        "enable_ipv6": True,
        **UID_GID,
    },
    "ipv6-dns-uid-gid": {"redirect_dns": True, "enable_ipv6": True, **UID_GID},
    "outbound-owner-groups": {"owner_groups_include": ("java", "202")},
    "outbound-owner-groups-exclude": {"owner_groups_exclude": ("888", "ftp")},
    "outbound-ports-include": {"outbound_ports": (32000, 31000)},
    "loopback-outbound-iprange": {"ip_ranges_include": ("127.1.2.3/32",)},
    "basic-exclude-nic": {"exclude_interfaces": ("not-istio-nic",)},
    "drop-invalid": {"drop_invalid": True},
    "host-ipv4-loopback-cidr": {"loopback_cidr": "127.0.0.1/8"},
}

CNI_BASIC = {
    "inbound_ports": ("*",),
    "inbound_ports_exclude": (15020, 15021, 15090),
    "outbound_ports_exclude": (15020,),
    "ip_ranges_include": ("*",),
}
"""What the istio-cni plugin computes for a plain injected pod (it sorts and adds the agent's ports)."""
CNI_CASES: dict[str, dict[str, object]] = {
    "cni-basic": CNI_BASIC,
    "cni-tproxy": {**CNI_BASIC, "mode": "TPROXY"},
    "cni-dns": {**CNI_BASIC, "redirect_dns": True, "capture_all_dns": True},
    "cni-include-exclude-ip": {
        **CNI_BASIC,
        "ip_ranges_include": ("127.0.0.0/8",),
        "ip_ranges_exclude": ("10.0.0.0/8",),
    },
    "cni-custom-uid": {**CNI_BASIC, "proxy_uid": ("1000670000",), "proxy_gid": ("1000670001",)},
}


def run_lines(config: CaptureConfig) -> str:
    """What run_test.go records: the saves before, the restore input per family, the saves after."""
    v4, v6 = render_families(config)
    lines = ["iptables-save", "ip6tables-save", *v4.splitlines()]
    if v6 is not None:
        lines.extend(v6.splitlines())
    lines.append("iptables-save")
    if v6 is not None:
        lines.append("ip6tables-save")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("name", sorted(CASES))
def test_capture_golden(name: str) -> None:
    config = dataclasses.replace(BASE, **CASES[name])  # type: ignore[arg-type]
    assert run_lines(config) == (GOLDEN / f"{name}.txt").read_text()


@pytest.mark.parametrize("name", sorted(CNI_CASES))
def test_cni_golden(name: str) -> None:
    config = dataclasses.replace(BASE, **CNI_CASES[name])  # type: ignore[arg-type]
    assert render(build(config).v4) == (GOLDEN / f"{name}.txt").read_text()


def test_excluding_every_destination_is_refused() -> None:
    with pytest.raises(ConfigError, match="OUTBOUND_IP_RANGES_EXCLUDE"):
        build(dataclasses.replace(BASE, ip_ranges_exclude=("*",)))


def test_building_is_pure() -> None:
    config = dataclasses.replace(BASE, **CASES["tproxy"])  # type: ignore[arg-type]
    assert render_families(config) == render_families(config)
