"""From a pod object to the capture it needs: the rule set's settings (whether it needs any is
:func:`istio_agent.cni.pod.skip_reason`).

The annotations, their defaults and their checks are Istio's plugin
(``cni/pkg/plugin/kube.go``, ``cni/pkg/plugin/redirect.go``), so a pod gets the same rules whether
istio-init or istio-cni sets them up. One difference: a bad annotation is an error naming it (the
pod's sandbox fails), where Istio also fails but some values pass unchecked into iptables.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from istio_agent.cni.capture_config import WILDCARD, CaptureConfig, parse_cidr, read_capture_config, split
from istio_agent.cni.pod import PROXY_CONTAINER, env_flag, metadata, proxy_container
from istio_agent.config.env import ConfigError, Env

MODE = "sidecar.istio.io/interceptionMode"
INCLUDE_CIDRS = "traffic.sidecar.istio.io/includeOutboundIPRanges"
EXCLUDE_CIDRS = "traffic.sidecar.istio.io/excludeOutboundIPRanges"
INCLUDE_INBOUND = "traffic.sidecar.istio.io/includeInboundPorts"
EXCLUDE_INBOUND = "traffic.sidecar.istio.io/excludeInboundPorts"
INCLUDE_OUTBOUND = "traffic.sidecar.istio.io/includeOutboundPorts"
EXCLUDE_OUTBOUND = "traffic.sidecar.istio.io/excludeOutboundPorts"
EXCLUDE_INTERFACES = "traffic.sidecar.istio.io/excludeInterfaces"
REROUTE_INTERFACES = "istio.io/reroute-virtual-interfaces"
KUBEVIRT_INTERFACES = "traffic.sidecar.istio.io/kubevirtInterfaces"
AGENT_INBOUND_PORTS = "15020,15021,15090"
"""Always excluded from inbound capture: the agent's status, health and Envoy's Prometheus ports."""
DEFAULT_PROXY_ID = "1337"
PROXY_ENV_FILL_IN = (
    "ISTIO_OUTBOUND_OWNER_GROUPS",
    "ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE",
    "ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR",
)
"""What the plugin's own environment still decides, as in Istio (the rest comes from the pod)."""
_INTERFACE = re.compile(r"[a-zA-Z][a-zA-Z0-9_.\-]*")
_MAX_INTERFACE = 15


def annotation_ports(name: str, value: str) -> tuple[int, ...]:
    """A comma list of ports from annotation ``name``; ConfigError naming it for anything else."""
    ports = []
    for item in split(value):
        if not (item.isascii() and item.isdigit()) or not int(item) <= 65535:
            raise ConfigError(f"annotation {name}={value!r}: {item!r} is not a port (0-65535)")
        ports.append(int(item))
    return tuple(ports)


def _cidrs(name: str, value: str) -> tuple[str, ...]:
    """``*`` or a comma list of CIDRs, items not trimmed (Istio parses each as it stands)."""
    if value == WILDCARD:
        return (WILDCARD,)
    if value == "":
        return ()
    out = []
    for item in value.split(","):
        try:
            out.append(parse_cidr(item))
        except ValueError:
            raise ConfigError(f"annotation {name}={value!r}: {item!r} is not a CIDR") from None
    return tuple(out)


def _interfaces(name: str, value: str) -> tuple[str, ...]:
    names = split(value)
    for item in names:
        if len(item) > _MAX_INTERFACE or not _INTERFACE.fullmatch(item):
            raise ConfigError(f"annotation {name}={value!r}: {item!r} is not an interface name")
    return names


def _dedup(values: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(values))


def _proxy_id(container: Mapping[str, Any], key: str) -> str:
    """runAsUser / runAsGroup of istio-proxy; unset or 0 means 1337 (the proxy never runs as root)."""
    context = container.get("securityContext") or {}
    value = context.get(key) if isinstance(context, dict) else None
    if value is None or value == 0:
        return DEFAULT_PROXY_ID
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{PROXY_CONTAINER} securityContext.{key}={value!r} is not a numeric id")
    return str(value)


def capture_config(pod: Mapping[str, Any], env: Mapping[str, str]) -> CaptureConfig:
    """The sidecar rule set's settings for ``pod``; raises ConfigError naming a bad annotation.

    ``env`` is the plugin's own environment: only the owner-group and loopback variables are taken
    from it (read and checked as istio-iptables reads them).
    """
    annotations = metadata(pod, "annotations")
    proxy = proxy_container(pod) or {}

    def annotation(name: str, default: str) -> str:
        value = annotations.get(name)
        return value if isinstance(value, str) else default

    mode = annotation(MODE, "REDIRECT")
    if mode not in ("REDIRECT", "TPROXY"):
        raise ConfigError(f"annotation {MODE}={mode!r}: must be REDIRECT or TPROXY")
    inbound_raw = annotation(INCLUDE_INBOUND, WILDCARD)
    inbound = (
        (WILDCARD,)
        if inbound_raw.strip() == WILDCARD
        else tuple(str(port) for port in annotation_ports(INCLUDE_INBOUND, inbound_raw))
    )
    exclude_inbound_raw = annotation(EXCLUDE_INBOUND, "15020")
    exclude_inbound = _dedup(
        annotation_ports(EXCLUDE_INBOUND, exclude_inbound_raw)
        + annotation_ports(EXCLUDE_INBOUND, AGENT_INBOUND_PORTS)
    )
    reroute_name = REROUTE_INTERFACES if REROUTE_INTERFACES in annotations else KUBEVIRT_INTERFACES
    uid, gid = _proxy_id(proxy, "runAsUser"), _proxy_id(proxy, "runAsGroup")
    dns = env_flag(proxy, "ISTIO_META_DNS_CAPTURE")
    filled = read_capture_config({}, Env({k: v for k, v in env.items() if k in PROXY_ENV_FILL_IN}))
    return dataclasses.replace(
        filled,
        proxy_uid=(uid,),
        proxy_gid=(gid,),
        mode=mode,
        inbound_ports=inbound,
        inbound_ports_exclude=exclude_inbound,
        ip_ranges_include=_cidrs(INCLUDE_CIDRS, annotation(INCLUDE_CIDRS, WILDCARD)),
        ip_ranges_exclude=_cidrs(EXCLUDE_CIDRS, annotation(EXCLUDE_CIDRS, "")),
        outbound_ports=annotation_ports(INCLUDE_OUTBOUND, annotation(INCLUDE_OUTBOUND, "")),
        outbound_ports_exclude=annotation_ports(EXCLUDE_OUTBOUND, annotation(EXCLUDE_OUTBOUND, "15020")),
        exclude_interfaces=_interfaces(EXCLUDE_INTERFACES, annotation(EXCLUDE_INTERFACES, "")),
        reroute_interfaces=_interfaces(reroute_name, annotation(reroute_name, "")),
        redirect_dns=dns,
        capture_all_dns=dns,
        drop_invalid=env_flag(proxy, "INVALID_DROP"),
        enable_ipv6=env_flag(proxy, "ISTIO_DUAL_STACK"),
    )
