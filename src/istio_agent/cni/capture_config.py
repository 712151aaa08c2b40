"""The sidecar capture settings, read from istio-iptables' flags and their env equivalents.

Istio binds each flag but ``--envoy-port`` to the env var named like it (upper-cased, ``-`` -> ``_``):
the env var sets the default and the flag wins (``tools/istio-iptables/pkg/cmd/root.go``). A few
settings are env only.
Unlike Istio, which passes bad ports through to iptables-restore, every value is checked here so a
typo fails the init container with a message naming the flag, before any rule is written.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from istio_agent.config.env import ConfigError, Env, out_of_range, parse_go_bool, parse_go_int
from istio_agent.config.env import parse_go_duration as go_duration

WILDCARD = "*"
MODES = ("REDIRECT", "TPROXY")


@dataclass(frozen=True)
class Flag:
    """One istio-iptables flag: its long and short names and the env var that sets its default."""

    name: str
    short: str
    default: str
    help: str
    boolean: bool = False
    from_env: bool = True
    """Whether the env var sets the default: Istio binds every flag but ``envoy-port`` to one."""

    @property
    def env(self) -> str:
        return self.name.upper().replace("-", "_")


FLAGS = (
    Flag("envoy-port", "p", "15001", "port outbound traffic is redirected to", from_env=False),
    Flag("inbound-capture-port", "z", "15006", "port inbound traffic is redirected to"),
    Flag("inbound-tunnel-port", "e", "15008", "HBONE tunnel port, never captured"),
    Flag("proxy-uid", "u", "", "uid(s) of the proxy, comma separated (default 1337)"),
    Flag("proxy-gid", "g", "", "gid(s) of the proxy, comma separated (default: the uid)"),
    Flag("istio-inbound-interception-mode", "m", "REDIRECT", "REDIRECT or TPROXY"),
    Flag("istio-inbound-tproxy-mark", "t", "1337", "mark of TPROXY'd packets"),
    Flag("istio-inbound-tproxy-route-table", "r", "133", "route table of TPROXY'd packets"),
    Flag("istio-inbound-ports", "b", "", "inbound ports to capture, or '*'"),
    Flag("istio-local-exclude-ports", "d", "", "inbound ports not captured (with '*')"),
    Flag("istio-exclude-interfaces", "c", "", "interfaces whose traffic is never captured"),
    Flag("istio-service-cidr", "i", "", "outbound CIDRs to capture, or '*'"),
    Flag("istio-service-exclude-cidr", "x", "", "outbound CIDRs not captured"),
    Flag("istio-outbound-ports", "q", "", "outbound ports captured whatever the destination"),
    Flag("istio-local-outbound-ports-exclude", "o", "", "outbound ports not captured"),
    Flag("kube-virt-interfaces", "k", "", "interfaces whose inbound traffic is treated as outbound"),
    Flag("dry-run", "n", "false", "print the rules, change nothing", boolean=True),
    Flag(
        "redirect-dns",
        "",
        "",
        "capture DNS to the agent on 15053 (default ISTIO_META_DNS_CAPTURE)",
        boolean=True,
    ),
    Flag("capture-all-dns", "", "false", "capture DNS to any server, not only resolv.conf's", boolean=True),
    Flag("drop-invalid", "", "", "drop packets conntrack finds invalid (default INVALID_DROP)", boolean=True),
    Flag("dual-stack", "", "", "also capture IPv6 (default ISTIO_DUAL_STACK)", boolean=True),
    Flag("skip-rule-apply", "", "false", "do not apply rules", boolean=True),
    Flag("run-validation", "", "false", "validate that traffic is captured", boolean=True),
    Flag("cleanup-only", "", "false", "remove the rules and stop", boolean=True),
    Flag("iptables-probe-port", "", "15002", "port --run-validation dials to see it captured"),
    Flag("probe-timeout", "", "5s", "how long --run-validation tries (Go duration)"),
    Flag("network-namespace", "", "", "apply in this network namespace (a path) instead of the current one"),
    Flag("cni-mode", "", "false", "lock the namespace's own xtables lock, never the node's", boolean=True),
    Flag("reconcile", "", "false", "accepted: a differing Istio rule set is always replaced", boolean=True),
    Flag("force-apply", "", "false", "rewrite the rules even when they look in place", boolean=True),
    Flag("native-nftables", "", "false", "nftables rules (nft) instead of iptables", boolean=True),
    Flag("force-iptables-binary", "", "", "legacy or nft: use that iptables, whatever the node uses"),
)
IPTABLES_BINARIES = ("", "legacy", "nft")
"""--force-iptables-binary's values ("" = detect), as Istio's ``ValidateIptablesBinary``."""
ENV_DEFAULTS = {
    "redirect-dns": "ISTIO_META_DNS_CAPTURE",
    "drop-invalid": "INVALID_DROP",
    "dual-stack": "ISTIO_DUAL_STACK",
}
"""Flags whose default comes from a second, agent-wide env var when their own is unset."""


@dataclass(frozen=True)
class RunMode:
    """What the command is asked to do with the rule set, kept apart from what the rules depend on."""

    dry_run: bool
    skip_rule_apply: bool
    run_validation: bool
    cleanup_only: bool
    probe_port: int = 15002
    probe_timeout: float = 5.0
    network_namespace: Path | None = None
    """Apply inside this namespace (``--network-namespace``); None: the current one."""
    cni_mode: bool = False
    """Writes lock the namespace, not the node's ``/run/xtables.lock`` (Istio's CNI mode)."""
    reconcile: bool = False
    """Accepted for Istio's command line; replacing a differing rule set is what always happens."""
    force_apply: bool = False
    """Rewrite the rules even when the installed ones look identical (Istio's break-glass)."""
    native_nftables: bool = False
    iptables_binary: str = ""
    """``legacy`` or ``nft`` forces that iptables; "" detects it (``FORCE_IPTABLES_BINARY``)."""


@dataclass(frozen=True)
class CaptureConfig:
    """What the sidecar rule set depends on; defaults are istio-iptables' own."""

    proxy_port: int = 15001
    inbound_capture_port: int = 15006
    inbound_tunnel_port: int = 15008
    proxy_uid: tuple[str, ...] = ("1337",)
    proxy_gid: tuple[str, ...] = ("1337",)
    mode: str = "REDIRECT"
    tproxy_mark: str = "1337"
    tproxy_route_table: str = "133"
    inbound_ports: tuple[str, ...] = ()
    """Ports to capture inbound; ``("*",)`` is every port."""
    inbound_ports_exclude: tuple[int, ...] = ()
    exclude_interfaces: tuple[str, ...] = ()
    reroute_interfaces: tuple[str, ...] = ()
    ip_ranges_include: tuple[str, ...] = ()
    """CIDRs to capture outbound; ``("*",)`` is every destination."""
    ip_ranges_exclude: tuple[str, ...] = ()
    outbound_ports: tuple[int, ...] = ()
    outbound_ports_exclude: tuple[int, ...] = ()
    owner_groups_include: tuple[str, ...] = (WILDCARD,)
    owner_groups_exclude: tuple[str, ...] = ()
    loopback_cidr: str = "127.0.0.1/32"
    redirect_dns: bool = False
    capture_all_dns: bool = False
    dns_servers: tuple[str, ...] = ()
    drop_invalid: bool = False
    enable_ipv6: bool = False
    """Also render the IPv6 rule set (ip6tables-restore input)."""

    @property
    def tproxy(self) -> bool:
        return self.mode == "TPROXY"


def split(value: str) -> tuple[str, ...]:
    """A comma list, blanks dropped (``"6000,7000,"`` is two ports), as Istio splits its lists."""
    return tuple(item.strip() for item in value.split(",") if item.strip())


def _port(name: str, raw: str) -> int:
    try:
        value = parse_go_int(raw)
    except ValueError:
        raise ConfigError(f"invalid value {raw!r} for {name}: not a port number") from None
    problem = out_of_range(value, 1, 65535)
    if problem is not None:
        raise ConfigError(f"invalid value {raw!r} for {name}: {problem}")
    return value


def _ports(name: str, raw: str) -> tuple[int, ...]:
    return tuple(_port(name, item) for item in split(raw))


def _ids(name: str, raw: str) -> tuple[str, ...]:
    """Numeric uids/gids: iptables' owner match takes names too, but a proxy's id is a number."""
    values = split(raw)
    for item in values:
        try:
            problem = out_of_range(parse_go_int(item), 0, 2**32 - 2)
        except ValueError:
            problem = "not a numeric id"
        if problem is not None:
            raise ConfigError(f"invalid value {raw!r} for {name}: {item!r} is {problem}")
    return values


def parse_cidr(item: str) -> str:
    """One CIDR as written (host bits kept, as Go's ``netip.ParsePrefix`` keeps them); ValueError.

    The one check for every CIDR that reaches a rule (flags, env, pod annotations). Like Go's
    parser it refuses an IPv6 zone (``fe80::1%eth0/64``): Python's would keep the zone, text and all,
    and that text would land in the iptables-restore input.
    """
    if "/" not in item:
        raise ValueError(f"{item!r} is not a CIDR (address/bits)")
    if "%" in item:
        raise ValueError(f"{item!r}: a zone cannot be part of a CIDR")
    return str(ipaddress.ip_interface(item))


def _cidrs(name: str, raw: str) -> tuple[str, ...]:
    """CIDRs as written, or ``*``."""
    out = []
    for item in split(raw):
        if item == WILDCARD:
            out.append(item)
            continue
        try:
            out.append(parse_cidr(item))
        except ValueError as err:
            raise ConfigError(f"invalid value {raw!r} for {name}: {err}") from None
    return tuple(out)


class _Reader:
    """A flag's raw value: the command line, else its env var, else its (env-given) default."""

    def __init__(self, given: Mapping[str, str | None], env: Env) -> None:
        self._given = given
        self._env = env
        self._flags = {flag.name: flag for flag in FLAGS}

    def raw(self, name: str) -> tuple[str, str]:
        """The raw value and where it came from (``--flag`` or ``ENV``), for error messages."""
        flag = self._flags[name]
        value = self._given.get(name)
        if value is not None:
            return value, f"--{name}"
        if flag.from_env and flag.env in self._env:
            return self._env.text(flag.env), flag.env
        second = ENV_DEFAULTS.get(name)
        if second is not None and second in self._env:
            return self._env.text(second), second
        return flag.default, f"--{name}"

    def boolean(self, name: str) -> bool:
        raw, source = self.raw(name)
        if raw == "":
            return False
        try:
            return parse_go_bool(raw)
        except ValueError as err:
            raise ConfigError(f"invalid value for {source}: {err}") from None


def read_capture_config(given: Mapping[str, str | None], env: Env) -> CaptureConfig:
    """The validated config from the flags given (``None`` = not on the command line) and the env."""
    read = _Reader(given, env)

    def text(name: str) -> tuple[str, str]:
        raw, source = read.raw(name)
        return raw.strip(), source

    def port(name: str) -> int:
        raw, source = text(name)
        return _port(source, raw)

    def ports(name: str) -> tuple[int, ...]:
        raw, source = text(name)
        return _ports(source, raw)

    def cidrs(name: str) -> tuple[str, ...]:
        raw, source = text(name)
        return _cidrs(source, raw)

    mode, source = text("istio-inbound-interception-mode")
    if mode not in MODES:
        raise ConfigError(f"invalid value {mode!r} for {source}: must be REDIRECT or TPROXY")
    uid_raw, uid_source = text("proxy-uid")
    uids = _ids(uid_source, uid_raw) or ("1337",)
    gid_raw, gid_source = text("proxy-gid")
    gids = _ids(gid_source, gid_raw) or uids
    inbound_raw, inbound_source = text("istio-inbound-ports")
    inbound = (
        (WILDCARD,) if inbound_raw == WILDCARD else tuple(str(p) for p in _ports(inbound_source, inbound_raw))
    )
    groups_in = split(env.text("ISTIO_OUTBOUND_OWNER_GROUPS", WILDCARD)) or (WILDCARD,)
    groups_out = split(env.text("ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE"))
    if groups_in != (WILDCARD,) and groups_out:
        raise ConfigError(
            "only one of ISTIO_OUTBOUND_OWNER_GROUPS and ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE may be set"
        )
    loopback = _loopback_cidr(env.text("ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR", "127.0.0.1/32"))
    mark, mark_source = text("istio-inbound-tproxy-mark")
    table, table_source = text("istio-inbound-tproxy-route-table")
    proxy, inbound_capture, tunnel = (
        port(name) for name in ("envoy-port", "inbound-capture-port", "inbound-tunnel-port")
    )
    dns, all_dns, drop_invalid, ipv6 = (
        read.boolean(name) for name in ("redirect-dns", "capture-all-dns", "drop-invalid", "dual-stack")
    )
    return CaptureConfig(
        proxy_port=proxy,
        inbound_capture_port=inbound_capture,
        inbound_tunnel_port=tunnel,
        proxy_uid=uids,
        proxy_gid=gids,
        mode=mode,
        tproxy_mark=_ids(mark_source, mark)[0] if split(mark) else "1337",
        tproxy_route_table=_ids(table_source, table)[0] if split(table) else "133",
        inbound_ports=inbound,
        inbound_ports_exclude=ports("istio-local-exclude-ports"),
        exclude_interfaces=split(text("istio-exclude-interfaces")[0]),
        reroute_interfaces=split(text("kube-virt-interfaces")[0]),
        ip_ranges_include=cidrs("istio-service-cidr"),
        ip_ranges_exclude=cidrs("istio-service-exclude-cidr"),
        outbound_ports=ports("istio-outbound-ports"),
        outbound_ports_exclude=ports("istio-local-outbound-ports-exclude"),
        owner_groups_include=groups_in,
        owner_groups_exclude=groups_out,
        loopback_cidr=loopback,
        redirect_dns=dns,
        capture_all_dns=all_dns,
        drop_invalid=drop_invalid,
        enable_ipv6=ipv6,
    )


def usable_dns_servers(hosts: Iterable[str]) -> tuple[str, ...]:
    """The servers a rule can name: IP addresses without a zone (``fe80::1%eth0`` has no /128 form)."""
    usable = []
    for host in hosts:
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            continue
        if isinstance(address, ipaddress.IPv6Address) and address.scope_id:
            continue
        usable.append(host)
    return tuple(usable)


def read_run_mode(given: Mapping[str, str | None], env: Env) -> RunMode:
    """What to do and where: the flags that do not change the rules themselves."""
    read = _Reader(given, env)
    names = ("dry-run", "skip-rule-apply", "run-validation", "cleanup-only")
    port_raw, port_source = read.raw("iptables-probe-port")
    timeout_raw, timeout_source = read.raw("probe-timeout")
    try:
        timeout = go_duration(timeout_raw.strip()).total_seconds()
    except ValueError as err:
        raise ConfigError(f"invalid value {timeout_raw!r} for {timeout_source}: {err}") from None
    dry_run, skip, validation, cleanup = (read.boolean(name) for name in names)
    binary, binary_source = read.raw("force-iptables-binary")
    if binary.strip() not in IPTABLES_BINARIES:
        raise ConfigError(f"invalid value {binary!r} for {binary_source}: must be legacy or nft")
    netns = read.raw("network-namespace")[0].strip()
    return RunMode(
        dry_run,
        skip,
        validation,
        cleanup,
        _port(port_source, port_raw.strip()),
        timeout,
        network_namespace=Path(netns) if netns else None,
        cni_mode=read.boolean("cni-mode"),
        reconcile=read.boolean("reconcile"),
        force_apply=read.boolean("force-apply"),
        native_nftables=read.boolean("native-nftables"),
        iptables_binary=binary.strip(),
    )


def _loopback_cidr(raw: str) -> str:
    """ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR must be an IPv4 loopback CIDR with a /8../32 prefix, as Istio checks."""
    name = "ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR"
    try:
        network = ipaddress.ip_interface(raw.strip())
    except ValueError as err:
        raise ConfigError(f"invalid value for {name}={raw!r}: {err}") from None
    if network.version != 4 or not network.ip.is_loopback or "/" not in raw:
        raise ConfigError(f"invalid value for {name}={raw!r}: not an IPv4 loopback CIDR")
    problem = out_of_range(network.network.prefixlen, 8, 32)
    if problem is not None:
        raise ConfigError(f"invalid value for {name}={raw!r}: prefix length {problem}")
    return str(network)
