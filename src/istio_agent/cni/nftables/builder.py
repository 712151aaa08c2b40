"""The sidecar capture rule set as nftables rules: a pure function of the config, and its rendering.

Istio's ``tools/istio-nftables/pkg/capture/run.go`` (``Run``) decides the rules and their order,
and its ``addIstioTableRules`` turns them into one transaction; :func:`render` writes that
transaction as Istio's tests dump it (``knftables.Transaction.String``), which is also the ``nft -f``
input. The config is the iptables builder's (:class:`CaptureConfig`), split into families by the
same code (``rules._families``), so both backends read a setting the same way.

Differences from the iptables rules are Istio's: three ``inet`` tables hold both families (a v6 rule
is only added with IPv6 on, but a rule without an address matches both), every rule counts packets,
the DNS jumps are not per family, and an insert at a position past the chain's end is an append.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from istio_agent.cni.capture_config import WILDCARD, CaptureConfig
from istio_agent.cni.rules import _families, _Family
from istio_agent.config.env import ConfigError

NAT, MANGLE, RAW = "istio-proxy-nat", "istio-proxy-mangle", "istio-proxy-raw"
TABLES = (NAT, MANGLE, RAW)
"""Istio's tables, in the order the transaction writes them; nothing else is ever touched."""
PREROUTING, OUTPUT = "prerouting", "output"
INBOUND, OUTPUT_CHAIN, OUTPUT_DNS = "istio-inbound", "istio-output", "istio-output-dns"
REDIRECT, IN_REDIRECT = "istio-redirect", "istio-in-redirect"
DIVERT, TPROXY, DROP = "istio-divert", "istio-tproxy", "istio-drop"
COUNTER = "counter"
OUTBOUND_MARK = "1338"
DNS_PORT = "15053"
LOOPBACK_V6, BIND_V4, BIND_V6 = "::1/128", "127.0.0.6/32", "::6/128"
ZONE_1, ZONE_2 = "ct zone set 1", "ct zone set 2"


@dataclass(frozen=True)
class Chain:
    """A chain of one table; a base chain names its hook (``type nat hook output priority -100``)."""

    name: str
    hook: str | None = None

    def declaration(self, table: str) -> str:
        spec = f" {{ {self.hook} ; }}" if self.hook else ""
        return f"add chain inet {table} {self.name}{spec}"


CHAINS: dict[str, tuple[Chain, ...]] = {
    NAT: (
        Chain(PREROUTING, "type nat hook prerouting priority -100"),
        Chain(OUTPUT, "type nat hook output priority -100"),
        Chain(INBOUND),
        Chain(REDIRECT),
        Chain(IN_REDIRECT),
        Chain(OUTPUT_CHAIN),
        Chain(OUTPUT_DNS),
    ),
    MANGLE: (
        Chain(PREROUTING, "type filter hook prerouting priority -150"),
        Chain(OUTPUT, "type route hook output priority -150"),
        Chain(DIVERT),
        Chain(TPROXY),
        Chain(INBOUND),
        Chain(DROP),
    ),
    RAW: (
        Chain(PREROUTING, "type filter hook prerouting priority -300"),
        Chain(OUTPUT, "type filter hook output priority -300"),
        Chain(INBOUND),
        Chain(OUTPUT_DNS),
    ),
}
"""Each table's chains in declaration order (``run.go``: ``addIstio{Nat,Mangle,Raw}TableRules``);
only those holding a rule are declared. Priorities: dstnat -100, mangle -150, raw -300."""


@dataclass(frozen=True)
class NftRule:
    """One rule of a chain, appended, or inserted before the rule at ``index`` (0-based)."""

    table: str
    chain: str
    expr: str
    index: int | None = None


@dataclass
class NftRuleSet:
    """The rules of each Istio table, in generation order (inserts included where they were made)."""

    ipv6: bool
    tables: dict[str, list[NftRule]] = field(default_factory=lambda: {table: [] for table in TABLES})

    def append(self, table: str, chain: str, *params: str) -> None:
        self.tables[table].append(NftRule(table, chain, " ".join(params)))

    def append_v6(self, table: str, chain: str, *params: str) -> None:
        """A rule only for IPv6 pods (``AppendV6RuleIfSupported``)."""
        if self.ipv6:
            self.append(table, chain, *params)

    def insert(self, table: str, chain: str, index: int, *params: str, v6: bool = False) -> None:
        if not v6 or self.ipv6:
            self.tables[table].append(NftRule(table, chain, " ".join(params), index))


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*", re.ASCII)
_NUMBER = re.compile(r"[0-9]+", re.ASCII)


def _interface(name: str) -> str:
    """An interface name as a bare nft word; anything nft would read otherwise is refused."""
    if len(name) > 15 or not _NAME.fullmatch(name):
        raise ConfigError(f"invalid interface name {name!r} for an nftables rule: letters, digits, '_.-'")
    return name


def _owner(value: str, what: str) -> str:
    """A uid, gid or group (a number, or a group name for the owner-group lists)."""
    if _NUMBER.fullmatch(value) or (what == "group" and _NAME.fullmatch(value)):
        return value
    raise ConfigError(f"invalid {what} {value!r} for an nftables rule")


def _number(value: object, what: str) -> str:
    text = str(value)
    if not _NUMBER.fullmatch(text):
        raise ConfigError(f"invalid {what} {text!r} for an nftables rule: not a number")
    return text


@dataclass(frozen=True)
class _Settings:
    """The config's values as they are written into rules, each checked once."""

    proxy_port: str
    inbound_port: str
    tunnel_port: str
    uids: tuple[str, ...]
    gids: tuple[str, ...]
    mark: str
    loopback: str
    exclude_interfaces: tuple[str, ...]
    reroute_interfaces: tuple[str, ...]
    inbound_ports: tuple[str, ...]
    inbound_exclude: tuple[str, ...]
    outbound_ports: tuple[str, ...]
    outbound_exclude: tuple[str, ...]
    groups_include: tuple[str, ...]
    groups_exclude: tuple[str, ...]


def _settings(config: CaptureConfig) -> _Settings:
    def ports(values: tuple[object, ...], what: str) -> tuple[str, ...]:
        return tuple(_number(value, what) for value in values)

    inbound = config.inbound_ports
    return _Settings(
        proxy_port=_number(config.proxy_port, "proxy port"),
        inbound_port=_number(config.inbound_capture_port, "inbound capture port"),
        tunnel_port=_number(config.inbound_tunnel_port, "inbound tunnel port"),
        uids=tuple(_owner(uid, "uid") for uid in config.proxy_uid),
        gids=tuple(_owner(gid, "gid") for gid in config.proxy_gid),
        mark=_number(config.tproxy_mark, "TPROXY mark"),
        loopback=str(ipaddress.ip_interface(config.loopback_cidr)),
        exclude_interfaces=tuple(_interface(name) for name in config.exclude_interfaces),
        reroute_interfaces=tuple(_interface(name) for name in config.reroute_interfaces),
        inbound_ports=inbound if inbound == (WILDCARD,) else ports(inbound, "inbound port"),
        inbound_exclude=ports(config.inbound_ports_exclude, "excluded inbound port"),
        outbound_ports=ports(config.outbound_ports, "outbound port"),
        outbound_exclude=ports(config.outbound_ports_exclude, "excluded outbound port"),
        groups_include=tuple(g if g == WILDCARD else _owner(g, "group") for g in config.owner_groups_include),
        groups_exclude=tuple(_owner(group, "group") for group in config.owner_groups_exclude),
    )


def build(config: CaptureConfig) -> NftRuleSet:
    """The whole sidecar rule set for ``config`` in ``run.go``'s order; raises ConfigError."""
    for server in config.dns_servers:
        try:
            ipaddress.ip_address(server)
        except ValueError:
            raise ConfigError(f"invalid DNS server {server!r}: not an IP address") from None
    v4, v6 = _families(config)
    values = _settings(config)
    # Unlike run.go, IPv6 servers of an IPv4 pod do not count: their rules are left out, and the
    # jumps to the then empty DNS chains would make nft refuse the whole transaction.
    servers = (*v4.dns_servers, *(v6.dns_servers if config.enable_ipv6 else ()))
    dns = config.redirect_dns and (config.capture_all_dns or bool(servers))
    rules = NftRuleSet(ipv6=config.enable_ipv6)
    _exclude_interfaces(rules, config, values)
    for name in values.reroute_interfaces:
        rules.insert(NAT, PREROUTING, 0, "iifname", name, COUNTER, "return")
    if config.drop_invalid:
        rules.append(MANGLE, PREROUTING, "meta l4proto tcp", "ct state", "invalid", COUNTER, "jump", DROP)
        rules.append(MANGLE, DROP, COUNTER, "drop")
    rules.append(NAT, INBOUND, "meta l4proto tcp", "tcp dport", values.tunnel_port, COUNTER, "return")
    rules.append(NAT, REDIRECT, "meta l4proto tcp", COUNTER, "redirect to", ":" + values.proxy_port)
    rules.append(NAT, IN_REDIRECT, "meta l4proto tcp", COUNTER, "redirect to", ":" + values.inbound_port)
    _inbound(rules, config, values)
    rules.append(NAT, OUTPUT, COUNTER, "jump", OUTPUT_CHAIN)
    for port in values.outbound_exclude:
        rules.append(NAT, OUTPUT_CHAIN, "tcp dport", port, COUNTER, "return")
        rules.append(NAT, OUTPUT_CHAIN, "udp dport", port, COUNTER, "return")
    rules.append(NAT, OUTPUT_CHAIN, "oifname", "lo", "ip saddr", BIND_V4, COUNTER, "return")
    rules.append_v6(NAT, OUTPUT_CHAIN, "oifname", "lo", "ip6 saddr", BIND_V6, COUNTER, "return")
    _owners(rules, values, v4, v6, dns)
    _owner_groups(rules, values)
    if dns:
        _dns(rules, config, values, v4, v6)
    rules.append(NAT, OUTPUT_CHAIN, "ip daddr", values.loopback, COUNTER, "return")
    rules.append_v6(NAT, OUTPUT_CHAIN, "ip6 daddr", LOOPBACK_V6, COUNTER, "return")
    for cidr in v4.exclude:
        rules.append(NAT, OUTPUT_CHAIN, "ip daddr", cidr, COUNTER, "return")
    for cidr in v6.exclude:
        rules.append_v6(NAT, OUTPUT_CHAIN, "ip6 daddr", cidr, COUNTER, "return")
    for port in values.outbound_ports:
        rules.append(NAT, OUTPUT_CHAIN, "tcp dport", port, COUNTER, "jump", REDIRECT)
    _outbound_ranges(rules, values, v4, v6)
    if config.tproxy:
        _tproxy_marks(rules, values)
    return rules


def _exclude_interfaces(rules: NftRuleSet, config: CaptureConfig, values: _Settings) -> None:
    """Traffic of the excluded interfaces is never captured (nat, and mangle for TPROXY)."""
    for table in (NAT, MANGLE) if config.tproxy else (NAT,):
        for name in values.exclude_interfaces:
            rules.append(table, PREROUTING, "iifname", name, COUNTER, "return")
            rules.append(table, OUTPUT, "oifname", name, COUNTER, "return")


def _inbound(rules: NftRuleSet, config: CaptureConfig, values: _Settings) -> None:
    """Inbound capture, only when some inbound port is: nat redirect, or mangle TPROXY."""
    if not values.inbound_ports:
        return
    wildcard = values.inbound_ports == (WILDCARD,)
    if not config.tproxy:
        rules.append(NAT, PREROUTING, "meta l4proto tcp", COUNTER, "jump", INBOUND)
        if wildcard:
            for port in values.inbound_exclude:
                rules.append(NAT, INBOUND, "meta l4proto tcp", "tcp dport", port, COUNTER, "return")
            rules.append(NAT, INBOUND, "meta l4proto tcp", COUNTER, "jump", IN_REDIRECT)
            return
        for port in values.inbound_ports:
            rules.append(NAT, INBOUND, "meta l4proto tcp", "tcp dport", port, COUNTER, "jump", IN_REDIRECT)
        return
    mark, port_to = values.mark, ":" + values.inbound_port
    rules.append(MANGLE, DIVERT, COUNTER, "meta mark set", mark)
    rules.append(MANGLE, DIVERT, COUNTER, "accept")
    rules.append(
        MANGLE, TPROXY, "meta l4proto tcp", "ip daddr", "!=", values.loopback,
        "tproxy ip to", port_to, "meta mark set", mark, COUNTER, "accept",
    )  # fmt: skip
    rules.append_v6(
        MANGLE, TPROXY, "meta l4proto tcp", "ip6 daddr", "!=", LOOPBACK_V6,
        "tproxy ip6 to", port_to, "meta mark set", mark, COUNTER, "accept",
    )  # fmt: skip
    rules.append(MANGLE, PREROUTING, "meta l4proto tcp", COUNTER, "jump", INBOUND)
    established = "ct state related,established"
    if wildcard:
        for port in values.inbound_exclude:
            rules.append(MANGLE, INBOUND, "meta l4proto tcp", "tcp dport", port, COUNTER, "return")
        rules.append(MANGLE, INBOUND, "meta l4proto tcp", established, COUNTER, "jump", DIVERT)
        rules.append(MANGLE, INBOUND, "meta l4proto tcp", COUNTER, "jump", TPROXY)
        return
    for port in values.inbound_ports:
        rules.append(
            MANGLE, INBOUND, "meta l4proto tcp", established, "tcp dport", port, COUNTER, "jump", DIVERT
        )
        rules.append(MANGLE, INBOUND, "meta l4proto tcp", "tcp dport", port, COUNTER, "jump", TPROXY)


def _owners(rules: NftRuleSet, values: _Settings, v4: _Family, v6: _Family, dns: bool) -> None:
    """The proxy's own traffic: loopback to itself goes inbound, the rest leaves uncaptured."""
    loopback_included = any(
        cidr != WILDCARD and ipaddress.ip_interface(cidr).ip.is_loopback
        for cidr in (*v4.include, *v6.include)
    )
    tunnel = values.tunnel_port
    for match, ids in (("skuid", values.uids), ("skgid", values.gids)):
        not_ports = f"{{ 53, {tunnel} }}" if dns and match == "skuid" else tunnel
        for owner in ids:
            for daddr, loopback, add in (
                ("ip daddr", values.loopback, rules.append),
                ("ip6 daddr", LOOPBACK_V6, rules.append_v6),
            ):
                add(
                    NAT, OUTPUT_CHAIN, "oifname", "lo", "meta l4proto tcp", daddr, "!=", loopback,
                    "tcp dport", "!=", not_ports, match, owner, COUNTER, "jump", IN_REDIRECT,
                )  # fmt: skip
            if not loopback_included:
                dns_port = ("meta l4proto tcp", "tcp dport != 53") if dns else ()
                rules.append(
                    NAT, OUTPUT_CHAIN, "oifname lo", *dns_port, match, "!=", owner, COUNTER, "return"
                )
            rules.append(NAT, OUTPUT_CHAIN, match, owner, COUNTER, "return")


def _owner_groups(rules: NftRuleSet, values: _Settings) -> None:
    """ISTIO_OUTBOUND_OWNER_GROUPS[_EXCLUDE]: only some groups' traffic is captured."""
    if values.groups_include == (WILDCARD,):
        for group in values.groups_exclude:
            rules.append(NAT, OUTPUT_CHAIN, "skgid", group, COUNTER, "return")
        return
    none_of = [part for group in values.groups_include for part in ("skgid", "!=", group)]
    rules.append(NAT, OUTPUT_CHAIN, *none_of, COUNTER, "return")


def _dns(rules: NftRuleSet, config: CaptureConfig, values: _Settings, v4: _Family, v6: _Family) -> None:
    """DNS to the agent's proxy on 15053, in its own conntrack zones (``SetupDNSRedir``)."""
    to_agent = (COUNTER, "redirect", "to", ":" + DNS_PORT)
    rules.append(RAW, OUTPUT, COUNTER, "jump", OUTPUT_DNS)
    rules.append(NAT, OUTPUT_CHAIN, COUNTER, "jump", OUTPUT_DNS)  # a usable server, or capture-all
    for proto in ("tcp", "udp"):
        if config.capture_all_dns:
            l4 = ("meta l4proto tcp",) if proto == "tcp" else ()
            rules.append(NAT, OUTPUT_DNS, *l4, f"{proto} dport", "53", *to_agent)
            continue
        for server in v4.dns_servers:
            rules.append(NAT, OUTPUT_DNS, "ip daddr", f"{server}/32", f"{proto} dport", "53", *to_agent)
        for server in v6.dns_servers:
            rules.append_v6(NAT, OUTPUT_DNS, "ip6 daddr", f"{server}/128", f"{proto} dport", "53", *to_agent)
    for match, ids in (("skuid", values.uids), ("skgid", values.gids)):
        for owner in ids:
            rules.append(RAW, OUTPUT_DNS, "udp dport 53", "meta", match, owner, COUNTER, ZONE_1)
            rules.append(RAW, OUTPUT_DNS, "udp sport", DNS_PORT, "meta", match, owner, COUNTER, ZONE_2)
    rules.append(RAW, PREROUTING, COUNTER, "jump", INBOUND)
    if config.capture_all_dns:
        rules.append(RAW, OUTPUT_DNS, "udp dport 53", COUNTER, ZONE_2)
        rules.append(RAW, INBOUND, "udp sport 53", COUNTER, ZONE_1)
        return
    for family, add in ((v4, rules.append), (v6, rules.append_v6)):
        ip, bits = ("ip", 32) if family.v4 else ("ip6", 128)
        for server in family.dns_servers:
            address = f"{server}/{bits}"
            add(RAW, OUTPUT_DNS, "udp dport 53", f"{ip} daddr", address, COUNTER, ZONE_2)
            add(RAW, INBOUND, "udp sport 53", f"{ip} saddr", address, COUNTER, ZONE_1)


def _outbound_ranges(rules: NftRuleSet, values: _Settings, v4: _Family, v6: _Family) -> None:
    """Outbound capture by destination; traffic from the reroute interfaces is treated the same."""
    if v4.include_wildcard or v6.include_wildcard:
        rules.append(NAT, OUTPUT_CHAIN, COUNTER, "jump", REDIRECT)
        for name in values.reroute_interfaces:
            rules.insert(NAT, PREROUTING, 0, "iifname", name, COUNTER, "jump", REDIRECT)
        return
    for family, add in ((v4, rules.append), (v6, rules.append_v6)):
        daddr = "ip daddr" if family.v4 else "ip6 daddr"
        for cidr in family.include:
            for name in values.reroute_interfaces:
                to_proxy = (daddr, cidr, COUNTER, "jump", REDIRECT)
                rules.insert(NAT, PREROUTING, 0, "iifname", name, *to_proxy, v6=not family.v4)
            add(NAT, OUTPUT_CHAIN, daddr, cidr, COUNTER, "jump", REDIRECT)


def _tproxy_marks(rules: NftRuleSet, values: _Settings) -> None:
    """TPROXY'd connections keep their mark, and the proxy's own replies to the app are marked 1338."""
    mark = values.mark
    rules.append(MANGLE, PREROUTING, "meta l4proto tcp", "mark", mark, COUNTER, "ct mark set mark")
    rules.append(MANGLE, OUTPUT, "oifname", "lo", "meta l4proto tcp", "mark", mark, COUNTER, "return")
    for match, ids in (("skuid", values.uids), ("skgid", values.gids)):
        for owner in ids:
            for daddr, loopback, add in (
                ("ip daddr", values.loopback, rules.append),
                ("ip6 daddr", LOOPBACK_V6, rules.append_v6),
            ):
                add(
                    MANGLE, OUTPUT, "oifname", "lo", "meta l4proto tcp", daddr, "!=", loopback,
                    match, owner, COUNTER, "meta mark set", OUTBOUND_MARK,
                )  # fmt: skip
    rules.append(MANGLE, OUTPUT, "meta l4proto tcp", "ct mark", mark, COUNTER, "meta mark set ct mark")
    from_lo = ("iifname lo", "meta l4proto tcp")
    rules.insert(MANGLE, INBOUND, 0, "meta l4proto tcp", "mark", mark, COUNTER, "return")
    rules.insert(MANGLE, INBOUND, 1, *from_lo, "ip saddr", BIND_V4, COUNTER, "return")
    rules.insert(MANGLE, INBOUND, 1, *from_lo, "ip6 saddr", BIND_V6, COUNTER, "return", v6=True)
    rules.insert(MANGLE, INBOUND, 2, *from_lo, "mark !=", OUTBOUND_MARK, COUNTER, "return")


def table_lines(
    table: str, rules: list[NftRule], chains: Sequence[Chain] | None = None, *, jump_targets: bool = False
) -> list[str]:
    """One table's part of the transaction: add and flush it, declare its chains, add the rules.

    Empty when no rule lands in the table (Istio then leaves the table alone). An insert whose
    index is past the rules the chain holds by then becomes an append, as nft refuses it otherwise.
    ``chains``: the table's chains in declaration order (default: the sidecar tables', ``CHAINS``);
    only those holding a rule are declared and, with ``jump_targets``, also those a rule jumps to
    (Istio's ambient ``cni/pkg/nftables/nftables.go`` declares an empty chain that is jumped to).
    """
    used = {rule.chain for rule in rules}
    if jump_targets:
        used |= {words[i + 1] for words in (r.expr.split() for r in rules) for i in _jumps(words)}
    chains = [chain for chain in (CHAINS[table] if chains is None else chains) if chain.name in used]
    if not chains:
        return []
    lines = [f"add table inet {table}", f"flush table inet {table}"]
    lines += [chain.declaration(table) for chain in chains]
    held: dict[str, int] = {}
    for rule in rules:
        count = held.get(rule.chain, 0)
        if rule.index is None or rule.index >= count:
            lines.append(f"add rule inet {table} {rule.chain} {rule.expr}")
        else:
            lines.append(f"insert rule inet {table} {rule.chain} index {rule.index} {rule.expr}")
        held[rule.chain] = count + 1
    return lines


def _jumps(words: list[str]) -> list[int]:
    """Where ``jump`` is followed by a chain name in a rule's words."""
    return [i for i, word in enumerate(words[:-1]) if word == "jump"]


def render(rules: NftRuleSet) -> str:
    """The transaction ``nft -f`` applies: the tables in order nat, mangle, raw (Istio's dump form)."""
    lines = [line for table in TABLES for line in table_lines(table, rules.tables[table])]
    return "".join(f"{line}\n" for line in lines)


def render_config(config: CaptureConfig) -> str:
    """The dry-run text for ``config`` (raises ConfigError): what ``--native-nftables`` would apply."""
    return render(build(config))
