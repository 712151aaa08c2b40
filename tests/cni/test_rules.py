"""Golden tests of the sidecar rule set: every case Istio 1.28 pins, against Istio's own files.

``golden/`` holds Istio's goldens byte for byte (``ISTIO_SOURCES`` there names each one's path and
git blob id at tag 1.28.10): ``<case>.txt`` is ``tools/istio-iptables/pkg/capture/testdata/<case>.golden``,
``cni-<case>.txt`` is ``cni/pkg/plugin/testdata/<case>.txt.golden``. The configs are those of
``tools/istio-iptables/pkg/capture/run_test.go`` (on ``constructTestConfig``, which is
``CaptureConfig()``) and, for the plugin, the pods of ``cni/pkg/plugin/plugin_dryrun_test.go`` put
through the plugin's own decision (``redirect.capture_config``). Our output is compared byte for byte,
stricter than Istio's helpers (``testutil.CompareContent`` trims surrounding blanks, the plugin test
compares table by table); nothing is rewritten on either side.

Cases Istio has no golden for are behaviour tests below that assert specific rules.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from istio_agent.cni.capture_config import CaptureConfig
from istio_agent.cni.redirect import capture_config
from istio_agent.cni.rules import build, render, render_families
from istio_agent.config.env import ConfigError
from tests.cni.istio_sources import drifted, manifest

GOLDEN = Path(__file__).parent / "golden"
BASE = CaptureConfig()
"""run_test.go's constructTestConfig: 15001/15006/15008, uid=gid=1337, mark 1337, table 133, no inbound ports."""
UID_GID = {"proxy_uid": ("3", "4"), "proxy_gid": ("1", "2")}
V6_NETS = {"ip_ranges_include": ("2001:db8::/32",), "ip_ranges_exclude": ("2001:db8::/32",)}
NOT_ISTIOS: dict[str, str] = {}
"""Files in golden/ that are not Istio's, and why they are still there (none: keep it so)."""

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

ISTIO_INIT: dict[str, object] = {
    "inbound_ports": ("*",),
    "inbound_ports_exclude": (15090, 15021, 15020),
    "ip_ranges_include": ("*",),
}
"""The injector's istio-init arguments: ``-i '*' -x "" -b '*' -d 15090,15021,15020`` (no ``-o``)."""

CUSTOM_UID = {"runAsUser": 1000670000, "runAsGroup": 1000670001}
STATUS = {"sidecar.istio.io/status": "true"}
CNI_CASES: dict[str, tuple[dict[str, str], dict[str, str], dict[str, int], str]] = {
    "basic": ({}, {}, {}, "basic"),
    "include-exclude-ip": (
        {
            "traffic.sidecar.istio.io/includeOutboundIPRanges": "127.0.0.0/8",
            "traffic.sidecar.istio.io/excludeOutboundIPRanges": "10.0.0.0/8",
        },
        {},
        {},
        "include-exclude-ip",
    ),
    "include-exclude-ports": (
        {
            "traffic.sidecar.istio.io/includeInboundPorts": "1111,2222",
            "traffic.sidecar.istio.io/excludeInboundPorts": "3333,4444",
            "traffic.sidecar.istio.io/excludeOutboundPorts": "5555,6666",
        },
        {},
        {},
        "include-exclude-ports",
    ),
    "tproxy": ({"sidecar.istio.io/interceptionMode": "TPROXY"}, {}, {}, "tproxy"),
    "DNS": ({}, {"ISTIO_META_DNS_CAPTURE": "true"}, {}, "dns"),
    "invalid-drop": ({}, {"INVALID_DROP": "true"}, {}, "invalid-drop"),
    "custom-uid": ({}, {}, CUSTOM_UID, "custom-uid"),
    "custom-uid-zero": ({}, {}, {"runAsUser": 0}, "basic"),
    "custom-uid-tproxy": (
        {"sidecar.istio.io/interceptionMode": "TPROXY"},
        {},
        CUSTOM_UID,
        "custom-uid-tproxy",
    ),
}
"""plugin_dryrun_test.go's TestIPTablesRuleGeneration: case -> (annotations besides the sidecar status,
istio-proxy's env, istio-proxy's securityContext, golden ``cni/pkg/plugin/testdata/<golden>.txt.golden``)."""


def dry_run_pod(annotations: dict[str, str], env: dict[str, str], security: dict[str, int]) -> dict[str, Any]:
    """buildFakeDryRunPod: containers test, istio-proxy (env, securityContext), istio-validate."""
    proxy = {
        "name": "istio-proxy",
        "env": [{"name": name, "value": value} for name, value in env.items()],
        "securityContext": security,
    }
    return {
        "metadata": {
            "name": "testPodName",
            "namespace": "testNSName",
            "annotations": {**STATUS, **annotations},
        },
        "spec": {"containers": [{"name": "test"}, proxy, {"name": "istio-validate"}]},
    }


def run_lines(config: CaptureConfig) -> str:
    """What run_test.go records (the stub's ExecutedAll): the saves, the restore input per family, the saves."""
    v4, v6 = render_families(config)
    lines = ["iptables-save", "ip6tables-save", *v4.splitlines()]
    if v6 is not None:
        lines.extend(v6.splitlines())
    lines.append("iptables-save")
    if v6 is not None:
        lines.append("ip6tables-save")
    return "\n".join(lines) + "\n"


def rules_of(config: CaptureConfig, table: str, chain: str) -> list[str]:
    """The rendered IPv4 rules of one chain, in order."""
    return [rule.render() for rule in build(config).v4 if (rule.table, rule.chain) == (table, chain)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_capture_golden(name: str) -> None:
    config = dataclasses.replace(BASE, **CASES[name])  # type: ignore[arg-type]
    assert run_lines(config) == (GOLDEN / f"{name}.txt").read_text()


@pytest.mark.parametrize("name", sorted(CNI_CASES))
def test_cni_golden(name: str) -> None:
    annotations, env, security, golden = CNI_CASES[name]
    config = capture_config(dry_run_pod(annotations, env, security), {})
    assert render(build(config).v4) == (GOLDEN / f"cni-{golden}.txt").read_text()


def test_every_golden_is_istios_file() -> None:
    """Each golden is Istio's file byte for byte, and each of Istio 1.28's cases has its golden."""
    sources = manifest(GOLDEN)
    assert drifted(GOLDEN) == {}
    assert {path.name for path in GOLDEN.glob("*.txt")} == set(sources) | set(NOT_ISTIOS)
    expected = {f"{name}.txt": f"tools/istio-iptables/pkg/capture/testdata/{name}.golden" for name in CASES}
    for *_, golden in CNI_CASES.values():
        expected[f"cni-{golden}.txt"] = f"cni/pkg/plugin/testdata/{golden}.txt.golden"
    assert {name: source.istio_path for name, source in sources.items()} == expected


# -- cases Istio has no golden for: specific rules ------------------------------------------------


@pytest.mark.parametrize("ports", [(22,), (22, 80, 443)])
def test_excluded_outbound_ports_return_tcp_then_udp_each_before_the_rest(ports: tuple[int, ...]) -> None:
    """run.go (1.28): one tcp and one udp RETURN per excluded port, in the order given, first in
    ISTIO_OUTPUT; no ``-m multiport`` (Istio pull request 59544 grouped them; closed unmerged)."""
    output = rules_of(dataclasses.replace(BASE, outbound_ports_exclude=ports), "nat", "ISTIO_OUTPUT")
    expected = [
        f"-A ISTIO_OUTPUT -p {proto} --dport {port} -j RETURN" for port in ports for proto in ("tcp", "udp")
    ]
    assert output[: len(expected)] == expected
    assert output[len(expected)] == "-A ISTIO_OUTPUT -o lo -s 127.0.0.6/32 -j RETURN"
    assert not any("multiport" in rule for rule in output)


def test_excluded_inbound_ports_with_a_wildcard_return_in_the_order_given() -> None:
    """run.go (1.28): after the tunnel port, one tcp RETURN per excluded port, then the redirect."""
    config = dataclasses.replace(BASE, inbound_ports=("*",), inbound_ports_exclude=(443, 22, 80))
    assert rules_of(config, "nat", "ISTIO_INBOUND") == [
        "-A ISTIO_INBOUND -p tcp --dport 15008 -j RETURN",
        "-A ISTIO_INBOUND -p tcp --dport 443 -j RETURN",
        "-A ISTIO_INBOUND -p tcp --dport 22 -j RETURN",
        "-A ISTIO_INBOUND -p tcp --dport 80 -j RETURN",
        "-A ISTIO_INBOUND -p tcp -j ISTIO_IN_REDIRECT",
    ]


def test_istio_init_rules() -> None:
    """The injector's istio-init arguments give Istio's basic plugin rules but for the port
    exclusions: inbound in the order the injector passes them (the plugin puts the pod's first, then
    15020,15021,15090), and no excluded outbound port (the plugin excludes 15020 by default)."""
    exclusion = re.compile(
        r"-A ISTIO_INBOUND -p tcp --dport (15020|15021|15090) -j RETURN|-A ISTIO_OUTPUT -p (tcp|udp) --dport"
    )
    ours = render(build(dataclasses.replace(BASE, **ISTIO_INIT)).v4).splitlines()  # type: ignore[arg-type]
    istio = (GOLDEN / "cni-basic.txt").read_text().splitlines()
    assert [line for line in ours if not exclusion.match(line)] == [
        line for line in istio if not exclusion.match(line)
    ]
    assert [line for line in ours if exclusion.match(line)] == [
        "-A ISTIO_INBOUND -p tcp --dport 15090 -j RETURN",
        "-A ISTIO_INBOUND -p tcp --dport 15021 -j RETURN",
        "-A ISTIO_INBOUND -p tcp --dport 15020 -j RETURN",
    ]
    assert [line for line in istio if exclusion.match(line)] == [
        "-A ISTIO_INBOUND -p tcp --dport 15020 -j RETURN",
        "-A ISTIO_INBOUND -p tcp --dport 15021 -j RETURN",
        "-A ISTIO_INBOUND -p tcp --dport 15090 -j RETURN",
        "-A ISTIO_OUTPUT -p tcp --dport 15020 -j RETURN",
        "-A ISTIO_OUTPUT -p udp --dport 15020 -j RETURN",
    ]


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
