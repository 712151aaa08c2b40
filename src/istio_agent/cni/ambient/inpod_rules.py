"""Ambient's in-pod redirection rules: pure functions of the settings and the pod's overrides.

The rules and their order are Istio's (``cni/pkg/iptables/iptables.go`` ``AppendInpodRules``, and
``cni/pkg/nftables/nftables.go`` for native nftables), checked line for line against Istio's goldens.
In the pod's namespace, ztunnel listens on 15001 (outbound), 15006 (inbound plaintext), 15008
(HBONE) and 15053 (DNS); its own sockets carry mark 0x539, which no rule redirects. Kubelet's probes
arrive SNATed to 169.254.7.127 by the host (:mod:`istio_agent.cni.ambient.hostprobe`) and go straight
to the app. The rules are written with the sidecar's builders (:mod:`istio_agent.cni.rules` for
iptables-restore input, :mod:`istio_agent.cni.nftables.builder` for the ``nft -f`` transaction).
"""

from __future__ import annotations

from istio_agent.cni.ambient.settings import (
    DNS_PORT,
    INBOUND_PLAINTEXT_PORT,
    INBOUND_PORT,
    INPOD_MARK,
    INPOD_MASK,
    OUTBOUND_PORT,
    RESTORE_MASK,
    TPROXY_MARK,
    TPROXY_MASK,
    InpodSettings,
    PodRedirect,
    dns_capture,
    interface,
)
from istio_agent.cni.nftables.builder import Chain, NftRuleSet, table_lines
from istio_agent.cni.rules import RuleSet

PRERT, OUTPUT = "ISTIO_PRERT", "ISTIO_OUTPUT"
LOOPBACK_V4, LOOPBACK_V6 = "127.0.0.1/32", "::1/128"
NAT, MANGLE, RAW = "istio-ambient-nat", "istio-ambient-mangle", "istio-ambient-raw"
TABLES = (NAT, MANGLE, RAW)
"""The in-pod nft tables, in the transaction's order; the host's probe table is also ``NAT``."""
NFT_PRERT, NFT_OUTPUT = "istio-prerouting", "istio-output"
COUNTER = "counter"
CHAINS: dict[str, tuple[Chain, ...]] = {
    NAT: (
        Chain("prerouting", "type nat hook prerouting priority -100"),
        Chain("output", "type nat hook output priority -100"),
        Chain(NFT_PRERT),
        Chain(NFT_OUTPUT),
    ),
    MANGLE: (
        Chain("prerouting", "type filter hook prerouting priority -150"),
        Chain("output", "type route hook output priority -150"),
        Chain(NFT_PRERT),
        Chain(NFT_OUTPUT),
    ),
    RAW: (
        Chain("prerouting", "type filter hook prerouting priority -300"),
        Chain("output", "type filter hook output priority -300"),
        Chain(NFT_PRERT),
        Chain(NFT_OUTPUT),
    ),
}
"""Each table's chains in Istio's declaration order; a chain is declared when it holds a rule or is
jumped to. Priorities: dstnat -100, mangle -150, raw -300."""

_MARK = f"{INPOD_MARK:#x}/{INPOD_MASK:#x}"
_CONNMARK = f"{TPROXY_MARK:#x}/{TPROXY_MASK:#x}"


def iptables_rules(settings: InpodSettings, pod: PodRedirect) -> RuleSet:
    """The in-pod rules of both families, in ``AppendInpodRules``' order (v6 applied only with IPv6).

    Raises ConfigError for an interface name iptables would misread.
    """
    virtual = tuple(interface(name) for name in pod.virtual_interfaces)
    dns = dns_capture(settings, pod)
    rules = RuleSet()

    def versioned(table: str, chain: str, v4: str, v6: str, *params: str) -> None:
        """One rule per family, ``{}`` in the parameters being that family's address."""
        for value, family in ((v4, {"v6": False}), (v6, {"v4": False})):
            rules.append(table, chain, *(value if p == "{}" else p for p in params), **family)

    rules.append("mangle", "PREROUTING", "-j", PRERT)
    rules.append("mangle", "OUTPUT", "-j", OUTPUT)
    rules.append("nat", "OUTPUT", "-j", OUTPUT)
    if dns:
        rules.append("raw", "PREROUTING", "-j", PRERT)
        rules.append("raw", "OUTPUT", "-j", OUTPUT)
    rules.append("nat", "PREROUTING", "-j", PRERT)
    for name in virtual:  # TCP in on a virtual interface is outbound traffic: straight to 15001
        rules.append(
            "nat", PRERT, "-i", name, "-p", "tcp", "-j", "REDIRECT", "--to-ports", str(OUTBOUND_PORT)
        )
        rules.append("nat", PRERT, "-i", name, "-p", "tcp", "-j", "RETURN")
    snat_v4, snat_v6 = settings.host_probe_snat_ipv4, settings.host_probe_snat_ipv6
    not_marked = ("-m", "mark", "!", "--mark", _MARK)
    if not pod.ingress_mode:
        rules.append(
            "mangle", PRERT, "-m", "mark", "--mark", _MARK, "-j", "CONNMARK", "--set-xmark", _CONNMARK
        )
        versioned("nat", PRERT, snat_v4, snat_v6, "-s", "{}", "-p", "tcp", "-m", "tcp", "-j", "ACCEPT")
    versioned("nat", OUTPUT, snat_v4, snat_v6, "-d", "{}", "-p", "tcp", "-m", "tcp", "-j", "ACCEPT")
    if not pod.ingress_mode:
        versioned(
            "nat", PRERT, LOOPBACK_V4, LOOPBACK_V6, "!", "-d", "{}", "-p", "tcp", "!", "--dport",
            str(INBOUND_PORT), *not_marked, "-j", "REDIRECT", "--to-ports", str(INBOUND_PLAINTEXT_PORT),
        )  # fmt: skip
    restore = f"{RESTORE_MASK:#x}"
    rules.append(
        "mangle", OUTPUT, "-m", "connmark", "--mark", _CONNMARK, "-j", "CONNMARK", "--restore-mark",
        "--nfmask", restore, "--ctmask", restore,
    )  # fmt: skip
    if dns:
        rules.append(
            "nat", OUTPUT, "!", "-o", "lo", "-p", "udp", *not_marked, "-m", "udp", "--dport", "53",
            "-j", "REDIRECT", "--to-port", str(DNS_PORT),
        )  # fmt: skip
        versioned(
            "nat", OUTPUT, LOOPBACK_V4, LOOPBACK_V6, "!", "-d", "{}", "-p", "tcp", "--dport", "53",
            *not_marked, "-j", "REDIRECT", "--to-ports", str(DNS_PORT),
        )  # fmt: skip
        # ztunnel's queries upstream and their answers get a conntrack zone of their own (istio#33469)
        rules.append(
            "raw", OUTPUT, "-p", "udp", "-m", "mark", "--mark", _MARK, "-m", "udp", "--dport", "53",
            "-j", "CT", "--zone", "1",
        )  # fmt: skip
        rules.append(
            "raw", PRERT, "-p", "udp", *not_marked, "-m", "udp", "--sport", "53", "-j", "CT", "--zone", "1"
        )
    rules.append("nat", OUTPUT, "-p", "tcp", "-m", "mark", "--mark", _CONNMARK, "-j", "ACCEPT")
    versioned("nat", OUTPUT, LOOPBACK_V4, LOOPBACK_V6, "!", "-d", "{}", "-o", "lo", "-j", "ACCEPT")
    versioned(
        "nat", OUTPUT, LOOPBACK_V4, LOOPBACK_V6, "!", "-d", "{}", "-p", "tcp", *not_marked,
        "-j", "REDIRECT", "--to-ports", str(OUTBOUND_PORT),
    )  # fmt: skip
    return rules


def nft_rules(settings: InpodSettings, pod: PodRedirect) -> NftRuleSet:
    """The in-pod nftables rules (both families in ``inet`` tables), in ``nftables.go``'s order.

    Raises ConfigError for an interface name nft would misread.
    """
    virtual = tuple(interface(name) for name in pod.virtual_interfaces)
    dns = dns_capture(settings, pod)
    rules = NftRuleSet(ipv6=settings.ipv6, tables={table: [] for table in TABLES})
    mark, mask, connmark = f"{INPOD_MARK:#x}", f"{INPOD_MASK:#x}", f"{TPROXY_MARK:#x}"
    rules.append(MANGLE, "prerouting", "jump", NFT_PRERT)
    rules.append(MANGLE, "output", "jump", NFT_OUTPUT)
    rules.append(NAT, "output", "jump", NFT_OUTPUT)
    if dns:
        rules.append(RAW, "prerouting", "jump", NFT_PRERT)
        rules.append(RAW, "output", "jump", NFT_OUTPUT)
    rules.append(NAT, "prerouting", "jump", NFT_PRERT)
    for name in virtual:
        tcp_in = ("iifname", name, "meta l4proto tcp", COUNTER)
        rules.append(NAT, NFT_PRERT, *tcp_in, "redirect to", f":{OUTBOUND_PORT}")
        rules.append(NAT, NFT_PRERT, *tcp_in, "return")
    snat_v4, snat_v6 = settings.host_probe_snat_ipv4, settings.host_probe_snat_ipv6
    if not pod.ingress_mode:
        rules.append(
            MANGLE, NFT_PRERT, f"meta mark & {mask} ==", mark, COUNTER,
            "ct mark set ct mark & 0xfffff000 | ", connmark,
        )  # fmt: skip
        rules.append(NAT, NFT_PRERT, "meta l4proto tcp", "ip saddr", snat_v4, COUNTER, "accept")
        rules.append_v6(NAT, NFT_PRERT, "meta l4proto tcp", "ip6 saddr", snat_v6, COUNTER, "accept")
    rules.append(NAT, NFT_OUTPUT, "meta l4proto tcp", "ip daddr", snat_v4, COUNTER, "accept")
    rules.append_v6(NAT, NFT_OUTPUT, "meta l4proto tcp", "ip6 daddr", snat_v6, COUNTER, "accept")
    not_marked = ("mark and", mask, "!=", mark, COUNTER)
    if not pod.ingress_mode:
        to_inbound = ("redirect to", f":{INBOUND_PLAINTEXT_PORT}")
        not_hbone = ("tcp dport", "!=", str(INBOUND_PORT))
        # Istio's v4 rule has "mark and 0xfff " before "!=": two blanks, kept to match its transaction
        rules.append(
            NAT, NFT_PRERT, "ip daddr", "!=", LOOPBACK_V4, *not_hbone, f"mark and {mask} ", "!=", mark,
            COUNTER, *to_inbound,
        )  # fmt: skip
        rules.append_v6(
            NAT, NFT_PRERT, "ip6 daddr", "!=", LOOPBACK_V6, *not_hbone, f"mark and {mask}", "!=", mark,
            COUNTER, *to_inbound,
        )  # fmt: skip
    rules.append(
        MANGLE,
        NFT_OUTPUT,
        "ct mark and",
        f"{TPROXY_MASK:#x}",
        "==",
        connmark,
        COUNTER,
        "meta mark set ct mark",
    )
    if dns:
        to_dns = ("redirect to", f":{DNS_PORT}")
        rules.append(NAT, NFT_OUTPUT, "oifname", "!=", "lo", "mark and", mask, "!=", mark, "udp dport", "53",
                     COUNTER, *to_dns)  # fmt: skip
        rules.append(NAT, NFT_OUTPUT, "ip daddr", "!=", LOOPBACK_V4, "tcp dport", "53", *not_marked, *to_dns)
        rules.append_v6(
            NAT, NFT_OUTPUT, "ip6 daddr", "!=", LOOPBACK_V6, "tcp dport", "53", *not_marked, *to_dns
        )
        rules.append(RAW, NFT_OUTPUT, "udp dport", "53", "meta mark and", mask, "==", mark, COUNTER,
                     "ct zone set", "1")  # fmt: skip
        rules.append(RAW, NFT_PRERT, "udp sport", "53", "meta mark and", mask, "!=", mark, COUNTER,
                     "ct zone set", "1")  # fmt: skip
    rules.append(NAT, NFT_OUTPUT, "meta l4proto tcp", "mark and", f"{TPROXY_MASK:#x}", "==", connmark,
                 COUNTER, "accept")  # fmt: skip
    rules.append(NAT, NFT_OUTPUT, "oifname", "lo", "ip daddr", "!=", LOOPBACK_V4, COUNTER, "accept")
    rules.append_v6(NAT, NFT_OUTPUT, "oifname", "lo", "ip6 daddr", "!=", LOOPBACK_V6, COUNTER, "accept")
    to_outbound = ("redirect to", f":{OUTBOUND_PORT}")
    rules.append(
        NAT, NFT_OUTPUT, "meta l4proto tcp", "ip daddr", "!=", LOOPBACK_V4, *not_marked, *to_outbound
    )
    rules.append_v6(
        NAT, NFT_OUTPUT, "meta l4proto tcp", "ip6 daddr", "!=", LOOPBACK_V6, *not_marked, *to_outbound
    )
    return rules


def render_nft(rules: NftRuleSet) -> str:
    """The ``nft -f`` transaction, tables in order nat, mangle, raw (Istio's dump form)."""
    lines = [
        line
        for table in TABLES
        for line in table_lines(table, rules.tables.get(table, []), CHAINS[table], jump_targets=True)
    ]
    return "".join(f"{line}\n" for line in lines)
