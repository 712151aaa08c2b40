"""The host side of ambient's probe handling: which node-local connections to a pod get SNATed.

Kubelet probes a pod from the node; kube-proxy forwards outside traffic from the node too, so inside
the pod both would come from a node address. Istio tells them apart on the host
(``cni/pkg/iptables/iptables.go`` ``AppendHostRules``, ``cni/pkg/nftables/nftables.go``
``CreateHostRulesForHealthChecks``): a TCP connection from a local socket (iptables ``-m owner
--socket-exists``; nft: kubelet's uid) to an enrolled pod's IP (the set ``istio-inpod-probes-v4``/
``-v6``) leaves with source 169.254.7.127, which the in-pod rules let through uncaptured. Pure
functions here; :mod:`istio_agent.cni.ambient.hostprobe` applies them.
"""

from __future__ import annotations

from istio_agent.cni.ambient.inpod_rules import COUNTER, NAT
from istio_agent.cni.ambient.settings import PROBE_SET, InpodSettings
from istio_agent.cni.nftables.builder import Chain, NftRuleSet, table_lines
from istio_agent.cni.rules import RuleSet

POSTRT = "ISTIO_POSTRT"
SET_V4, SET_V6 = f"{PROBE_SET}-v4", f"{PROBE_SET}-v6"
POSTROUTING = Chain("postrouting", "type nat hook postrouting priority 100")
"""The host table's one chain (srcnat priority)."""


def iptables_rules(settings: InpodSettings) -> RuleSet:
    """ISTIO_POSTRT, jumped to first thing in nat POSTROUTING; the v6 rule only with IPv6."""
    rules = RuleSet()
    rules.insert("nat", "POSTROUTING", 1, "-j", POSTRT)
    local_tcp_to = ("-m", "owner", "--socket-exists", "-p", "tcp", "-m", "set", "--match-set")
    rules.append(
        "nat", POSTRT, *local_tcp_to, SET_V4, "dst", "-j", "SNAT", "--to-source",
        settings.host_probe_snat_ipv4, v6=False,
    )  # fmt: skip
    if settings.ipv6:
        rules.append(
            "nat", POSTRT, *local_tcp_to, SET_V6, "dst", "-j", "SNAT", "--to-source",
            settings.host_probe_snat_ipv6, v4=False,
        )  # fmt: skip
    return rules


def nft_rules(settings: InpodSettings, kubelet_uid: str) -> NftRuleSet:
    """The host's postrouting SNAT of kubelet's connections to enrolled pods (nft has no
    ``--socket-exists``: Istio matches kubelet's uid instead)."""
    if not kubelet_uid.isascii() or not kubelet_uid.isdigit():
        raise ValueError(f"kubelet uid {kubelet_uid!r} is not a number")
    rules = NftRuleSet(ipv6=settings.ipv6, tables={NAT: []})
    kubelet_tcp = ("meta l4proto tcp", "skuid", kubelet_uid)
    rules.append(NAT, POSTROUTING.name, *kubelet_tcp, "ip", "daddr", f"@{SET_V4}", COUNTER, "snat", "to",
                 settings.host_probe_snat_ipv4)  # fmt: skip
    rules.append_v6(NAT, POSTROUTING.name, *kubelet_tcp, "ip6", "daddr", f"@{SET_V6}", COUNTER, "snat", "to",
                    settings.host_probe_snat_ipv6)  # fmt: skip
    return rules


def render_nft(rules: NftRuleSet) -> str:
    """The host rules' transaction (the sets are made apart, :func:`nft_sets`)."""
    return "".join(f"{line}\n" for line in table_lines(NAT, rules.tables[NAT], (POSTROUTING,)))


def nft_sets(settings: InpodSettings) -> str:
    """The transaction making the host table and its probe sets (``host_sets.go``), idempotently."""
    comment = 'comment "UUID of the pods that are part of ambient mesh" ;'
    lines = [f"add table inet {NAT}", f"add set inet {NAT} {SET_V4} {{ type ipv4_addr ; {comment} }}"]
    if settings.ipv6:
        lines.append(f"add set inet {NAT} {SET_V6} {{ type ipv6_addr ; {comment} }}")
    return "".join(f"{line}\n" for line in lines)
