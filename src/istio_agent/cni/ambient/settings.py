"""What ambient's traffic redirection is made of: the node-wide settings and a pod's own overrides.

The values are Istio's (``cni/pkg/config/config.go``): ztunnel's ports and marks must match what
ztunnel expects, so they are constants, not settings. A pod changes its own redirection with three
annotations (``cni/pkg/nodeagent/net.go``, ``getPodLevelTrafficOverrides``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from istio_agent.cni.iptables import Backend
from istio_agent.config.env import ConfigError, parse_go_bool
from istio_agent.logline import Scope

log = Scope("cni")

INPOD_MARK = 0x539
"""The mark ztunnel puts on its own sockets (1337): its traffic is never redirected again."""
INPOD_MASK = 0xFFF
TPROXY_MARK = 0x111
"""The connmark of connections ztunnel made into the pod, and the mark their replies get back."""
TPROXY_MASK = 0xFFF
RESTORE_MASK = 0xFFFFFFFF
ROUTE_TABLE = 100
"""``ip rule fwmark 0x111/0xfff pref 32764 lookup 100``: replies to ztunnel's spoofed connections stay local."""
MARK_RULE_PRIORITY = 32764
DNS_PORT = 15053
INBOUND_PORT = 15008
"""ztunnel's HBONE port: reached directly, never redirected."""
OUTBOUND_PORT = 15001
INBOUND_PLAINTEXT_PORT = 15006
PROBE_SET = "istio-inpod-probes"
"""The host's set of enrolled pod IPs (``-v4`` and ``-v6``), whose node-local probes are SNATed."""
SNAT_V4 = "169.254.7.127"
SNAT_V6 = "fd16:9254:7127:1337:ffff:ffff:ffff:ffff"

BYPASS_INBOUND = "ambient.istio.io/bypass-inbound-capture"
DNS_CAPTURE = "ambient.istio.io/dns-capture"
REROUTE_INTERFACES = "istio.io/reroute-virtual-interfaces"

_INTERFACE = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]*", re.ASCII)
_MAX_INTERFACE = 15


@dataclass(frozen=True)
class InpodSettings:
    """The node agent's settings for every pod (Istio's ``AmbientConfig``)."""

    dns_capture: bool = False
    """``AMBIENT_DNS_CAPTURE``: DNS to ztunnel's proxy on 15053, unless a pod says otherwise."""
    ipv6: bool = False
    """``AMBIENT_IPV6`` (Istio's ``EnableIPv6``): v6 rules, routes and probe set too."""
    reconcile: bool = True
    """``AMBIENT_RECONCILE_POD_RULES_ON_STARTUP``: a pod holding other Istio rules gets ours instead;
    off, such a pod is an error (Istio warns, then its restore fails on the existing chains)."""
    native_nftables: bool = False
    """``NATIVE_NFTABLES`` (``global.nativeNftables``): nft tables ``inet istio-ambient-*`` instead of iptables."""
    host_probe_snat_ipv4: str = SNAT_V4
    host_probe_snat_ipv6: str = SNAT_V6
    force_apply: bool = False
    """``FORCE_APPLY``: rules that look in place are written anew."""
    iptables_backend: Backend | None = None
    """The iptables flavour, detected once in the node's namespace and used in every pod (as Istio
    commits to the host's binaries); None: detected at each apply, in the caller's namespace."""


@dataclass(frozen=True)
class PodRedirect:
    """One pod's overrides of the redirection (Istio's ``PodLevelOverrides``)."""

    ingress_mode: bool = False
    """``ambient.istio.io/bypass-inbound-capture``: inbound is not captured (ingress-like workloads)."""
    virtual_interfaces: tuple[str, ...] = ()
    """``istio.io/reroute-virtual-interfaces``: TCP arriving on these is treated as outbound (KubeVirt…)."""
    dns_capture: bool | None = None
    """``ambient.istio.io/dns-capture``: None follows the node's setting."""

    @classmethod
    def from_annotations(cls, annotations: Mapping[str, str]) -> PodRedirect:
        """The overrides a pod's annotations ask for; a non-boolean value is ignored with a warning,
        as Istio's ``CheckBooleanAnnotation`` does. Interface names are checked when rules are built."""
        virtual = annotations.get(REROUTE_INTERFACES, "")
        return cls(
            ingress_mode=bool(_boolean(annotations, BYPASS_INBOUND)),
            virtual_interfaces=tuple(name.strip() for name in virtual.split(",") if name.strip()),
            dns_capture=_boolean(annotations, DNS_CAPTURE),
        )


def _boolean(annotations: Mapping[str, str], name: str) -> bool | None:
    raw = annotations.get(name)
    if raw is None:
        return None
    try:
        if raw == raw.strip():  # strconv.ParseBool takes no blanks; parse_go_bool would strip them
            return parse_go_bool(raw)
    except ValueError:
        pass
    log.warning("annotation %s=%r found, but only boolean values are supported, ignoring", name, raw)
    return None


def dns_capture(settings: InpodSettings, pod: PodRedirect) -> bool:
    """Whether the pod's DNS goes to ztunnel: its annotation, else the node's setting."""
    return settings.dns_capture if pod.dns_capture is None else pod.dns_capture


def interface(name: str) -> str:
    """A virtual interface name as it goes into a rule; anything iptables or nft would misread is refused."""
    if len(name) > _MAX_INTERFACE or not _INTERFACE.fullmatch(name):
        raise ConfigError(
            f"invalid interface {name!r} in {REROUTE_INTERFACES}: at most {_MAX_INTERFACE} letters, "
            "digits and '_.-', starting with a letter"
        )
    return name
