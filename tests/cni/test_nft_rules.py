"""Golden tests of the nftables rule set: every case of Istio's ``tools/istio-nftables`` run_test.go.

``golden/nftables/`` holds Istio's own files, verbatim (see the README there); the configs below are
run_test.go's ``getCommonTestCases`` on ``constructTestConfig`` (15001/15006/15008, uid=gid=1337,
mark 1337, route table 133, owner groups ``*``, loopback 127.0.0.1/32), which is ``CaptureConfig()``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from istio_agent.cni.capture_config import CaptureConfig
from istio_agent.cni.nftables.builder import build, render, render_config
from istio_agent.config.env import ConfigError

GOLDEN = Path(__file__).parent / "golden" / "nftables"
UID_GID = {"proxy_uid": ("3", "4"), "proxy_gid": ("1", "2")}
V6_NETS = {"ip_ranges_include": ("2001:db8::/32",), "ip_ranges_exclude": ("2001:db8::/32",)}

CASES: dict[str, dict[str, object]] = {
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
    "ipv6-virt-interfaces": {
        "inbound_ports": ("4000", "5000"),
        "reroute_interfaces": ("eth0", "eth1"),
        "enable_ipv6": True,
    },
    "ipv6-ipnets": {
        "inbound_ports": ("4000", "5000"),
        "inbound_ports_exclude": (6000, 7000),  # "6000,7000,": blanks dropped
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
    "empty": {},
    "kube-virt-interfaces": {"reroute_interfaces": ("eth1", "eth2"), "ip_ranges_include": ("*",)},
    "ipnets": {"ip_ranges_include": ("10.0.0.0/8",)},
    "ipnets-with-kube-virt-interfaces": {
        "reroute_interfaces": ("eth1", "eth2"),
        "ip_ranges_include": ("10.0.0.0/8",),
    },
    "inbound-ports-include": {"inbound_ports": ("32000", "31000")},
    "inbound-ports-wildcard": {"inbound_ports": ("*",)},
    "inbound-ports-tproxy": {"inbound_ports": ("32000", "31000"), "mode": "TPROXY"},
    "inbound-ports-wildcard-tproxy": {"inbound_ports": ("*",), "mode": "TPROXY"},
    "inbound-ports-empty-tproxy": {"mode": "TPROXY"},
    "dns-uid-gid": {
        "redirect_dns": True,
        "dns_servers": ("127.0.0.53", "::127.0.0.53"),
        "enable_ipv6": True,
        **UID_GID,
    },
    "ipv6-dns-uid-gid": {"enable_ipv6": True, "redirect_dns": True, **UID_GID},
    "outbound-owner-groups": {"owner_groups_include": ("java", "202")},
    "outbound-owner-groups-exclude": {"owner_groups_exclude": ("888", "ftp")},
    "ipv6-dns-outbound-owner-groups": {
        "enable_ipv6": True,
        "redirect_dns": True,
        "owner_groups_include": ("java", "202"),
    },
    "ipv6-dns-outbound-owner-groups-exclude": {
        "enable_ipv6": True,
        "redirect_dns": True,
        "owner_groups_exclude": ("888", "ftp"),
    },
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


def case_config(name: str) -> CaptureConfig:
    return dataclasses.replace(CaptureConfig(), **CASES[name])  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(CASES))
def test_istio_golden(name: str) -> None:
    assert render(build(case_config(name))) == (GOLDEN / f"{name}.golden").read_text()


def test_every_istio_golden_has_its_case() -> None:
    assert {path.stem for path in GOLDEN.glob("*.golden")} == set(CASES)


def test_the_dry_run_is_the_transaction() -> None:
    config = case_config("tproxy")
    assert render_config(config) == render(build(config))


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"exclude_interfaces": ("eth0;flush ruleset",)}, "eth0;flush ruleset"),
        ({"reroute_interfaces": ("eth0\nadd table inet x",)}, "eth0\\nadd table inet x"),
        ({"exclude_interfaces": ("eth+",)}, "eth+"),
        ({"owner_groups_include": ("java }",)}, "java }"),
        ({"proxy_uid": ("1337 counter",)}, "1337 counter"),
        ({"inbound_ports": ("80;",)}, "80;"),
        ({"tproxy_mark": "0x539"}, "0x539"),
        ({"ip_ranges_exclude": ("*",)}, "OUTBOUND_IP_RANGES_EXCLUDE"),
        ({"redirect_dns": True, "dns_servers": ("dns.local",)}, "dns.local"),
    ],
)
def test_a_value_nft_would_misread_is_refused_naming_it(change: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match="invalid") as caught:
        build(dataclasses.replace(CaptureConfig(), **change))  # type: ignore[arg-type]
    assert named in str(caught.value)


def test_dns_servers_of_a_family_that_is_off_do_not_turn_dns_capture_on() -> None:
    """Only IPv6 servers in an IPv4 pod: Istio's run.go jumps to istio-output-dns and raw
    istio-inbound although their only rules would be IPv6 ones it leaves out, and ``nft`` refuses the
    jumps to chains that were never declared. Here, as with no server at all, DNS capture is off."""
    only_v6 = dataclasses.replace(CaptureConfig(), redirect_dns=True, dns_servers=("fd00::10",))
    assert render(build(only_v6)) == (GOLDEN / "empty.golden").read_text()
    both = dataclasses.replace(only_v6, dns_servers=("fd00::10", "10.0.0.10"))
    assert "ip daddr 10.0.0.10/32 udp dport 53 counter redirect to :15053" in render(build(both))
    assert "fd00::10" not in render(build(both))
