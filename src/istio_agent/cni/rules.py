"""The sidecar capture rule set: a pure function of the config, rendered as iptables-restore input.

The order of the rules is Istio's (``tools/istio-iptables/pkg/capture/run.go``, its ``Run``), and so
is the rendering (``tools/istio-iptables/pkg/builder/iptables_builder_impl.go``): the order is what
the kernel evaluates, and what Istio's golden rule sets pin line for line.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from istio_agent.cni.capture_config import WILDCARD, CaptureConfig
from istio_agent.config.env import ConfigError

INBOUND = "ISTIO_INBOUND"
REDIRECT = "ISTIO_REDIRECT"
IN_REDIRECT = "ISTIO_IN_REDIRECT"
OUTPUT = "ISTIO_OUTPUT"
OUTPUT_DNS = "ISTIO_OUTPUT_DNS"
DIVERT = "ISTIO_DIVERT"
TPROXY = "ISTIO_TPROXY"
DROP = "ISTIO_DROP"
OUTBOUND_MARK = "1338"
DNS_PORT = "15053"
BUILTIN = frozenset({"INPUT", "OUTPUT", "FORWARD", "PREROUTING", "POSTROUTING", "ACCEPT", "RETURN", "DROP"})


@dataclass(frozen=True)
class Rule:
    """One rule: appended to its chain, or inserted at ``position`` (1-based)."""

    table: str
    chain: str
    params: tuple[str, ...]
    position: int | None = None

    def __post_init__(self) -> None:
        # iptables-restore input is one rule per line, split on blanks: a parameter with a blank or
        # a control character (a newline: "COMMIT\n*filter\n...") would write rules nobody asked for.
        for param in (self.table, self.chain, *self.params):
            if not param or any(ch.isspace() or not ch.isprintable() for ch in param):
                raise ConfigError(
                    f"refusing rule parameter {param!r}: empty, or blanks or control characters"
                )

    def render(self) -> str:
        if self.position is None:
            return " ".join(("-A", self.chain, *self.params))
        return " ".join(("-I", self.chain, str(self.position), *self.params))


@dataclass
class RuleSet:
    """The rules of each family, in generation order."""

    v4: list[Rule] = field(default_factory=list)
    v6: list[Rule] = field(default_factory=list)

    def append(self, table: str, chain: str, *params: str, v4: bool = True, v6: bool = True) -> None:
        if v4:
            self.v4.append(Rule(table, chain, params))
        if v6:
            self.v6.append(Rule(table, chain, params))

    def insert(self, table: str, chain: str, position: int, *params: str) -> None:
        self.v4.append(Rule(table, chain, params, position))
        self.v6.append(Rule(table, chain, params, position))


@dataclass(frozen=True)
class _Family:
    """What differs between the v4 and v6 rules: the loopback and bind addresses, the CIDRs."""

    v4: bool
    loopback: str
    bind: str
    include: tuple[str, ...]
    exclude: tuple[str, ...]
    dns_servers: tuple[str, ...]

    @property
    def include_wildcard(self) -> bool:
        return WILDCARD in self.include


def _families(config: CaptureConfig) -> tuple[_Family, _Family]:
    """Split the CIDR and DNS server lists by family; ``*`` is the wildcard of both."""

    def by_version(values: tuple[str, ...], version: int) -> tuple[str, ...]:
        return tuple(v for v in values if v == WILDCARD or ipaddress.ip_interface(v).version == version)

    if WILDCARD in config.ip_ranges_exclude:
        raise ConfigError("invalid value for OUTBOUND_IP_RANGES_EXCLUDE: '*' would exclude every destination")
    servers_v4 = tuple(s for s in config.dns_servers if ipaddress.ip_address(s).version == 4)
    servers_v6 = tuple(s for s in config.dns_servers if ipaddress.ip_address(s).version == 6)
    return (
        _Family(
            True,
            config.loopback_cidr,
            "127.0.0.6/32",
            by_version(config.ip_ranges_include, 4),
            by_version(config.ip_ranges_exclude, 4),
            servers_v4,
        ),
        _Family(
            False,
            "::1/128",
            "::6/128",
            by_version(config.ip_ranges_include, 6),
            by_version(config.ip_ranges_exclude, 6),
            servers_v6,
        ),
    )


def build(config: CaptureConfig) -> RuleSet:
    """The whole sidecar rule set for ``config``, both families (v6 is rendered only when enabled)."""
    v4, v6 = _families(config)
    dns = config.redirect_dns and (config.capture_all_dns or bool(config.dns_servers))
    rules = RuleSet()
    tables = ("nat", "mangle") if config.tproxy else ("nat",)
    for name in config.exclude_interfaces:
        for table in tables:
            rules.append(table, "PREROUTING", "-i", name, "-j", "RETURN")
            rules.append(table, "OUTPUT", "-o", name, "-j", "RETURN")
    for name in config.reroute_interfaces:
        rules.insert("nat", "PREROUTING", 1, "-i", name, "-j", "RETURN")
    if config.drop_invalid:
        rules.append("mangle", "PREROUTING", "-m", "conntrack", "--ctstate", "INVALID", "-j", DROP)
        rules.append("mangle", DROP, "-j", "DROP")
    rules.append("nat", INBOUND, "-p", "tcp", "--dport", str(config.inbound_tunnel_port), "-j", "RETURN")
    rules.append("nat", REDIRECT, "-p", "tcp", "-j", "REDIRECT", "--to-ports", str(config.proxy_port))
    rules.append(
        "nat", IN_REDIRECT, "-p", "tcp", "-j", "REDIRECT", "--to-ports", str(config.inbound_capture_port)
    )
    _inbound(rules, config, v4, v6)
    rules.append("nat", "OUTPUT", "-j", OUTPUT)
    for port in config.outbound_ports_exclude:
        rules.append("nat", OUTPUT, "-p", "tcp", "--dport", str(port), "-j", "RETURN")
        rules.append("nat", OUTPUT, "-p", "udp", "--dport", str(port), "-j", "RETURN")
    for family in (v4, v6):
        rules.append(
            "nat", OUTPUT, "-o", "lo", "-s", family.bind, "-j", "RETURN", v4=family.v4, v6=not family.v4
        )
    _owners(rules, config, v4, v6, dns)
    if dns:
        _dns(rules, config, v4, v6)
    for family in (v4, v6):
        only = {"v4": family.v4, "v6": not family.v4}
        rules.append("nat", OUTPUT, "-d", family.loopback, "-j", "RETURN", **only)
        for cidr in family.exclude:
            rules.append("nat", OUTPUT, "-d", cidr, "-j", "RETURN", **only)
    for port in config.outbound_ports:
        rules.append("nat", OUTPUT, "-p", "tcp", "--dport", str(port), "-j", REDIRECT)
    for family in (v4, v6):
        _outbound_ranges(rules, config, family)
    if config.tproxy:
        _tproxy_marks(rules, config, v4, v6)
    return rules


def _inbound(rules: RuleSet, config: CaptureConfig, v4: _Family, v6: _Family) -> None:
    """Inbound capture, only when some inbound port is: nat REDIRECT or mangle TPROXY."""
    if not config.inbound_ports:
        return
    table = "nat"
    mark = config.tproxy_mark
    if config.tproxy:
        table = "mangle"
        rules.append(table, DIVERT, "-j", "MARK", "--set-mark", mark)
        rules.append(table, DIVERT, "-j", "ACCEPT")
        for family in (v4, v6):
            rules.append(
                table, TPROXY, "!", "-d", family.loopback, "-p", "tcp", "-j", "TPROXY",
                "--tproxy-mark", f"{mark}/0xffffffff", "--on-port", str(config.inbound_capture_port),
                v4=family.v4, v6=not family.v4,
            )  # fmt: skip
    rules.append(table, "PREROUTING", "-p", "tcp", "-j", INBOUND)
    if config.inbound_ports == (WILDCARD,):
        for excluded in config.inbound_ports_exclude:
            rules.append(table, INBOUND, "-p", "tcp", "--dport", str(excluded), "-j", "RETURN")
        _capture_inbound(rules, config, table, ())
        return
    for port in config.inbound_ports:
        _capture_inbound(rules, config, table, ("--dport", port))


def _capture_inbound(rules: RuleSet, config: CaptureConfig, table: str, match: tuple[str, ...]) -> None:
    if config.tproxy:
        established = ("-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED")
        rules.append(table, INBOUND, "-p", "tcp", *match, *established, "-j", DIVERT)
        rules.append(table, INBOUND, "-p", "tcp", *match, "-j", TPROXY)
    else:
        rules.append(table, INBOUND, "-p", "tcp", *match, "-j", IN_REDIRECT)


def _owners(rules: RuleSet, config: CaptureConfig, v4: _Family, v6: _Family, dns: bool) -> None:
    """The proxy's own traffic: loopback to itself goes inbound, the rest leaves uncaptured."""
    loopback_included = any(
        cidr != WILDCARD and ipaddress.ip_interface(cidr).ip.is_loopback
        for cidr in (*v4.include, *v6.include)
    )
    tunnel = str(config.inbound_tunnel_port)
    for option, ids in (("--uid-owner", config.proxy_uid), ("--gid-owner", config.proxy_gid)):
        multiport = dns and option == "--uid-owner"
        not_ports = (
            ("-m", "multiport", "!", "--dports", f"53,{tunnel}") if multiport else ("!", "--dport", tunnel)
        )
        for owner in ids:
            for family in (v4, v6):
                rules.append(
                    "nat", OUTPUT, "-o", "lo", "!", "-d", family.loopback, "-p", "tcp", *not_ports,
                    "-m", "owner", option, owner, "-j", IN_REDIRECT, v4=family.v4, v6=not family.v4,
                )  # fmt: skip
            if not loopback_included:
                dns_port = ("-p", "tcp", "!", "--dport", "53") if dns else ()
                rules.append(
                    "nat", OUTPUT, "-o", "lo", *dns_port, "-m", "owner", "!", option, owner, "-j", "RETURN"
                )
            rules.append("nat", OUTPUT, "-m", "owner", option, owner, "-j", "RETURN")
    if config.owner_groups_include == (WILDCARD,):
        for group in config.owner_groups_exclude:
            rules.append("nat", OUTPUT, "-m", "owner", "--gid-owner", group, "-j", "RETURN")
    else:
        matches = [
            p for group in config.owner_groups_include for p in ("-m", "owner", "!", "--gid-owner", group)
        ]
        rules.append("nat", OUTPUT, *matches, "-j", "RETURN")


def _dns(rules: RuleSet, config: CaptureConfig, v4: _Family, v6: _Family) -> None:
    """DNS to the agent's proxy on 15053, in its own conntrack zones so replies are not confused."""
    tcp53, udp53 = ("-p", "tcp", "--dport", "53"), ("-p", "udp", "--dport", "53")
    to_agent_tcp, to_agent_udp = (
        ("-j", "REDIRECT", "--to-ports", DNS_PORT),
        ("-j", "REDIRECT", "--to-port", DNS_PORT),
    )
    zone1, zone2 = ("-j", "CT", "--zone", "1"), ("-j", "CT", "--zone", "2")
    rules.append("raw", "OUTPUT", "-j", OUTPUT_DNS)
    for family in (v4, v6):
        if config.capture_all_dns or family.dns_servers:
            rules.append("nat", OUTPUT, "-j", OUTPUT_DNS, v4=family.v4, v6=not family.v4)
    _to_agent(rules, config, v4, v6, tcp53, to_agent_tcp)
    _to_agent(rules, config, v4, v6, udp53, to_agent_udp)
    for option, ids in (("--uid-owner", config.proxy_uid), ("--gid-owner", config.proxy_gid)):
        for owner in ids:
            rules.append("raw", OUTPUT_DNS, *udp53, "-m", "owner", option, owner, *zone1)
            rules.append(
                "raw", OUTPUT_DNS, "-p", "udp", "--sport", DNS_PORT, "-m", "owner", option, owner, *zone2
            )
    for family in (v4, v6):
        if config.capture_all_dns or family.dns_servers:
            rules.append("raw", "PREROUTING", "-j", INBOUND, v4=family.v4, v6=not family.v4)
    if config.capture_all_dns:
        rules.append("raw", OUTPUT_DNS, *udp53, *zone2)
        rules.append("raw", INBOUND, "-p", "udp", "--sport", "53", *zone1)
        return
    for family in (v4, v6):
        for server in family.dns_servers:
            address = f"{server}/{32 if family.v4 else 128}"
            rules.append("raw", OUTPUT_DNS, *udp53, "-d", address, *zone2, v4=family.v4, v6=not family.v4)
            rules.append(
                "raw",
                INBOUND,
                "-p",
                "udp",
                "--sport",
                "53",
                "-s",
                address,
                *zone1,
                v4=family.v4,
                v6=not family.v4,
            )


def _to_agent(
    rules: RuleSet,
    config: CaptureConfig,
    v4: _Family,
    v6: _Family,
    match: tuple[str, ...],
    target: tuple[str, ...],
) -> None:
    """DNS of one protocol to the agent: to any server with capture-all, else to each known server."""
    if config.capture_all_dns:
        rules.append("nat", OUTPUT_DNS, *match, *target)
        return
    for family in (v4, v6):
        for server in family.dns_servers:
            dest = ("-d", f"{server}/{32 if family.v4 else 128}")
            rules.append("nat", OUTPUT_DNS, *match, *dest, *target, v4=family.v4, v6=not family.v4)


def _outbound_ranges(rules: RuleSet, config: CaptureConfig, family: _Family) -> None:
    """Outbound capture by destination; traffic from the reroute interfaces is treated the same."""
    only = {"v4": family.v4, "v6": not family.v4}
    if family.include_wildcard:
        rules.append("nat", OUTPUT, "-j", REDIRECT, **only)
        for name in config.reroute_interfaces:
            _insert_one(rules, family, "nat", "PREROUTING", 1, "-i", name, "-j", REDIRECT)
        return
    for cidr in family.include:
        for name in config.reroute_interfaces:
            _insert_one(rules, family, "nat", "PREROUTING", 1, "-i", name, "-d", cidr, "-j", REDIRECT)
        rules.append("nat", OUTPUT, "-d", cidr, "-j", REDIRECT, **only)


def _insert_one(rules: RuleSet, family: _Family, table: str, chain: str, position: int, *params: str) -> None:
    (rules.v4 if family.v4 else rules.v6).append(Rule(table, chain, params, position))


def _tproxy_marks(rules: RuleSet, config: CaptureConfig, v4: _Family, v6: _Family) -> None:
    """TPROXY'd connections keep their mark, and the proxy's own replies to the app are marked 1338."""
    mark = config.tproxy_mark
    rules.append(
        "mangle", "PREROUTING", "-p", "tcp", "-m", "mark", "--mark", mark, "-j", "CONNMARK", "--save-mark"
    )
    rules.append("mangle", "OUTPUT", "-p", "tcp", "-o", "lo", "-m", "mark", "--mark", mark, "-j", "RETURN")
    for option, ids in (("--uid-owner", config.proxy_uid), ("--gid-owner", config.proxy_gid)):
        for owner in ids:
            for family in (v4, v6):
                rules.append(
                    "mangle", "OUTPUT", "!", "-d", family.loopback, "-p", "tcp", "-o", "lo",
                    "-m", "owner", option, owner, "-j", "MARK", "--set-mark", OUTBOUND_MARK,
                    v4=family.v4, v6=not family.v4,
                )  # fmt: skip
    rules.append(
        "mangle", "OUTPUT", "-p", "tcp", "-m", "connmark", "--mark", mark, "-j", "CONNMARK", "--restore-mark"
    )
    rules.insert("mangle", INBOUND, 1, "-p", "tcp", "-m", "mark", "--mark", mark, "-j", "RETURN")
    for family in (v4, v6):
        _insert_one(
            rules, family, "mangle", INBOUND, 2, "-p", "tcp", "-s", family.bind, "-i", "lo", "-j", "RETURN"
        )
    rules.insert(
        "mangle",
        INBOUND,
        3,
        "-p",
        "tcp",
        "-i",
        "lo",
        "-m",
        "mark",
        "!",
        "--mark",
        OUTBOUND_MARK,
        "-j",
        "RETURN",
    )


def render(rules: list[Rule]) -> str:
    """iptables-restore input for one family: tables by name, each with its chains declared, then COMMIT."""
    lines: list[str] = []
    for table in sorted({rule.table for rule in rules}):
        in_table = [rule for rule in rules if rule.table == table]
        chains: list[str] = []
        for rule in in_table:
            if rule.chain not in BUILTIN and rule.chain not in chains:
                chains.append(rule.chain)
        for rule in in_table:
            target = rule.params[-1] if len(rule.params) >= 2 and rule.params[-2] == "-j" else None
            if target is not None and target not in BUILTIN and target not in chains:
                chains.append(target)
        lines.append(f"* {table}")
        lines.extend(f"-N {chain}" for chain in chains)
        lines.extend(rule.render() for rule in in_table)
        lines.append("COMMIT")
    return "".join(f"{line}\n" for line in lines)


def render_families(config: CaptureConfig) -> tuple[str, str | None]:
    """The v4 restore input, and the v6 one when IPv6 is enabled."""
    rules = build(config)
    return render(rules.v4), (render(rules.v6) if config.enable_ipv6 else None)
