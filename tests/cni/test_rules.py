"""Golden tests of the sidecar rule set, one per case Istio pins.

Each golden file is laid out as Istio's ``tools/istio-iptables/pkg/capture/run_test.go`` records a
run (the saves, the restore input per family, the saves), and the ``cni-*`` cases as
``cni/pkg/plugin/plugin_dryrun_test.go`` compares them (the restore input alone); the case values are
those tests' configs. ``golden/istio/`` keeps Istio's own file for a case, verbatim, named
``<case>@<istio commit>.golden``; ``test_istio_file_is_our_golden`` brings it to the current layout
(``istio_layout``, one rewrite per later Istio change) and requires our golden to equal it line for
line. The goldens with no usable Istio file are listed in ``NOT_FROM_ISTIO`` with the reason.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from istio_agent.cni.capture_config import CaptureConfig
from istio_agent.cni.rules import build, render, render_families
from istio_agent.config.env import ConfigError
from tests.cni.istio_layout import to_current_layout

GOLDEN = Path(__file__).parent / "golden"
ISTIO = GOLDEN / "istio"
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
        "inbound_ports_exclude": (6000, 7000),
        "reroute_interfaces": ("eth0", "eth1"),
        "enable_ipv6": True,
        **V6_NETS,
    },
    "ipv6-uid-gid": {
        "inbound_ports": ("4000", "5000"),
        "inbound_ports_exclude": (6000, 7000),
        "reroute_interfaces": ("eth0", "eth1"),
        "enable_ipv6": True,
        **UID_GID,
        **V6_NETS,
    },
    "ipv6-outbound-ports": {"outbound_ports": (32000, 31000), "enable_ipv6": True},
    "kube-virt-interfaces": {"reroute_interfaces": ("eth1", "eth2"), "ip_ranges_include": ("*",)},
    "ipnets": {"ip_ranges_include": ("10.0.0.0/8",)},
    "inbound-ports-include": {"inbound_ports": ("32000", "31000")},
    "inbound-ports-wildcard": {"inbound_ports": ("*",)},
    "inbound-ports-wildcard-tproxy": {"mode": "TPROXY", "inbound_ports": ("*",)},
    "ipv6-virt-interfaces": {
        "inbound_ports": ("4000", "5000"),
        "reroute_interfaces": ("eth0", "eth1"),
        "enable_ipv6": True,
    },
    "ipnets-with-kube-virt-interfaces": {
        "reroute_interfaces": ("eth1", "eth2"),
        "ip_ranges_include": ("10.0.0.0/8",),
    },
    "ipv6-dns-outbound-owner-groups": {
        "redirect_dns": True,
        "enable_ipv6": True,
        "owner_groups_include": ("java", "202"),
    },
    "ipv6-dns-outbound-owner-groups-exclude": {
        "redirect_dns": True,
        "enable_ipv6": True,
        "owner_groups_exclude": ("888", "ftp"),
    },
    "inbound-wildcard-exclude": {"inbound_ports": ("*",), "inbound_ports_exclude": (22, 80, 443)},
    "outbound-ports-exclude": {"outbound_ports_exclude": (22, 80, 443)},
    "outbound-ports-exclude-single": {"outbound_ports_exclude": (22,)},
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
    "loopback-outbound-iprange": {
        "ip_ranges_include": ("127.1.2.3/32",),
        "redirect_dns": True,
        "dns_servers": ("127.0.0.53",),
        **UID_GID,
    },
    "basic-exclude-nic": {"exclude_interfaces": ("not-istio-nic",)},
    "drop-invalid": {"drop_invalid": True},
    "host-ipv4-loopback-cidr": {"loopback_cidr": "127.0.0.1/8"},
}

CNI_BASIC: dict[str, object] = {
    "inbound_ports": ("*",),
    "inbound_ports_exclude": (15020, 15021, 15090),
    "outbound_ports_exclude": (15020,),
    "ip_ranges_include": ("*",),
}
"""What the istio-cni plugin computes for a plain injected pod (it sorts and adds the agent's ports)."""
CUSTOM_UID = {"proxy_uid": ("1000670000",), "proxy_gid": ("1000670001",)}
CNI_CASES: dict[str, dict[str, object]] = {
    "cni-basic": CNI_BASIC,
    "cni-tproxy": {**CNI_BASIC, "mode": "TPROXY"},
    "cni-dns": {**CNI_BASIC, "redirect_dns": True, "capture_all_dns": True},
    "cni-include-exclude-ip": {
        **CNI_BASIC,
        "ip_ranges_include": ("127.0.0.0/8",),
        "ip_ranges_exclude": ("10.0.0.0/8",),
    },
    "cni-custom-uid": {**CNI_BASIC, **CUSTOM_UID},
    "cni-custom-uid-tproxy": {**CNI_BASIC, **CUSTOM_UID, "mode": "TPROXY"},
    "cni-include-exclude-ports": {
        "inbound_ports": ("1111", "2222"),
        "inbound_ports_exclude": (3333, 4444),
        "outbound_ports_exclude": (5555, 6666),
        "ip_ranges_include": ("*",),
    },
    "cni-invalid-drop": {**CNI_BASIC, "drop_invalid": True},
}


NOT_FROM_ISTIO = {
    "ip-range": "Istio's stored versions put the DNS rules in OUTPUT/ISTIO_OUTPUT (before the "
    "ISTIO_OUTPUT_DNS chain); reviewed against them and against dns-uid-gid's v4 half",
    "ipv6-dns-uid-gid": "Istio's stored versions predate 'no DNS server and no capture-all turns DNS "
    "capture off' (run.go); ours has no DNS rule, the rest equals ipv6-uid-gid's owner rules",
    "ipv6-dns-outbound-owner-groups": "as ipv6-dns-uid-gid: DNS off without servers; the v4 half "
    "equals outbound-owner-groups",
    "ipv6-dns-outbound-owner-groups-exclude": "as ipv6-dns-uid-gid: DNS off without servers; the v4 "
    "half equals outbound-owner-groups-exclude",
    "drop-invalid": "Istio's stored versions jump straight to DROP; run.go now uses the ISTIO_DROP chain",
    "cni-invalid-drop": "as drop-invalid (the plugin's invalid-drop.txt.golden is of the same age)",
    "istio-init-default": "tests/cli's --dry-run output for the injector's istio-init arguments; "
    "Istio has no golden for it: cni-basic's rules with -d kept in the given order, no -o",
}
"""Goldens not compared with an Istio file, and why (each reviewed by hand against run.go)."""


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


@pytest.mark.parametrize("path", sorted(ISTIO.glob("*.golden")), ids=lambda path: path.stem)
def test_istio_file_is_our_golden(path: Path) -> None:
    name = path.stem.split("@")[0]
    assert to_current_layout(path.read_text()) == (GOLDEN / f"{name}.txt").read_text()


def test_every_golden_is_compared_or_excused() -> None:
    goldens = {path.stem for path in GOLDEN.glob("*.txt")}
    compared = {path.stem.split("@")[0] for path in ISTIO.glob("*.golden")}
    assert goldens == set(CASES) | set(CNI_CASES) | {"istio-init-default"}
    assert compared.isdisjoint(NOT_FROM_ISTIO)
    assert goldens == compared | set(NOT_FROM_ISTIO)


def test_excluding_every_destination_is_refused() -> None:
    with pytest.raises(ConfigError, match="OUTBOUND_IP_RANGES_EXCLUDE"):
        build(dataclasses.replace(BASE, ip_ranges_exclude=("*",)))


def test_building_is_pure() -> None:
    config = dataclasses.replace(BASE, **CASES["tproxy"])  # type: ignore[arg-type]
    assert render_families(config) == render_families(config)


def test_dns_to_several_servers_redirects_all_tcp_then_all_udp() -> None:
    """run.go's SetupDNSRedir loops the servers once for tcp, then once for udp."""
    config = dataclasses.replace(BASE, redirect_dns=True, dns_servers=("10.0.0.10", "10.0.0.11"))
    dns = [
        rule.render() for rule in build(config).v4 if rule.chain == "ISTIO_OUTPUT_DNS" and rule.table == "nat"
    ]
    assert dns == [
        "-A ISTIO_OUTPUT_DNS -p tcp --dport 53 -d 10.0.0.10/32 -j REDIRECT --to-ports 15053",
        "-A ISTIO_OUTPUT_DNS -p tcp --dport 53 -d 10.0.0.11/32 -j REDIRECT --to-ports 15053",
        "-A ISTIO_OUTPUT_DNS -p udp --dport 53 -d 10.0.0.10/32 -j REDIRECT --to-port 15053",
        "-A ISTIO_OUTPUT_DNS -p udp --dport 53 -d 10.0.0.11/32 -j REDIRECT --to-port 15053",
    ]


def test_v6_gets_the_dns_jump_only_with_v6_servers() -> None:
    """raw OUTPUT and the zone rules go to both families; nat and raw PREROUTING jumps only where servers are."""
    config = dataclasses.replace(BASE, redirect_dns=True, dns_servers=("10.0.0.10",), enable_ipv6=True)
    v6 = [(rule.table, rule.render()) for rule in build(config).v6]
    assert ("raw", "-A OUTPUT -j ISTIO_OUTPUT_DNS") in v6
    assert ("nat", "-A ISTIO_OUTPUT -j ISTIO_OUTPUT_DNS") not in v6
    assert ("raw", "-A PREROUTING -j ISTIO_INBOUND") not in v6


def test_a_rule_parameter_with_blanks_or_control_characters_is_refused() -> None:
    """The last guard for the restore input: one rule per line, split on blanks."""
    from istio_agent.cni.rules import Rule

    for bad in ("1.2.3.4/32\nCOMMIT", "a b", "", "x\x00"):
        with pytest.raises(ConfigError, match="refusing rule parameter"):
            Rule("nat", "ISTIO_OUTPUT", ("-d", bad, "-j", "RETURN"))
