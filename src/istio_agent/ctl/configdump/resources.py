"""Envoy resources out of a dump's sections, read as the Go types istioctl unmarshals them into."""

from __future__ import annotations

from typing import Any

from istio_agent.ctl.configdump import descriptors
from istio_agent.ctl.configdump.messages import MessageError, Msg, read
from istio_agent.ctl.configdump.source import ConfigDumpError

CLUSTER = "envoy.config.cluster.v3.Cluster"
LISTENER = "envoy.config.listener.v3.Listener"
ROUTE = "envoy.config.route.v3.RouteConfiguration"
LOAD_ASSIGNMENT = "envoy.config.endpoint.v3.ClusterLoadAssignment"


def as_message(full_name: str, raw: Any) -> Msg:
    """An ``Any``'s content read as ``full_name`` (istioctl forces the v3 type URL before unmarshalling)."""
    desc = descriptors.message(full_name)
    if desc is None:
        raise ConfigDumpError(f"unknown message type {full_name}")
    body = {k: v for k, v in raw.items() if k != "@type"} if isinstance(raw, dict) else raw
    try:
        node = read(desc, body)
    except MessageError as err:
        raise ConfigDumpError(f"unmarshal {full_name}: {err}") from None
    except RecursionError:
        raise ConfigDumpError(f"unmarshal {full_name}: nested too deeply") from None
    assert isinstance(node, Msg)
    return node


def section_message(kind: str, raw: dict[str, Any]) -> Msg:
    """A dump section (``ClustersConfigDump``…) read as its admin type."""
    return as_message(f"envoy.admin.v3.{kind}", raw)


def dig(node: Any, *path: str | int) -> Any:
    """``node[path…]``, or None when a step is missing (Go's nil-safe getters)."""
    for step in path:
        if isinstance(step, int):
            node = node[step] if isinstance(node, list) and -len(node) <= step < len(node) else None
        else:
            node = node.get(step) if isinstance(node, dict) else None
        if node is None:
            return None
    return node


def text(node: Any, *path: str | int) -> str:
    value = dig(node, *path)
    return value if isinstance(value, str) else ""


def number(node: Any, *path: str | int) -> int:
    value = dig(node, *path)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def describe_management(metadata: Any) -> str:
    """VIRTUAL SERVICE / DESTINATION RULE: ``name.namespace`` of the Istio config an item came from."""
    config = dig(metadata, "filterMetadata", "istio", "config")
    if config is None:
        return ""
    value = getattr(config, "inner", config)
    path = value if isinstance(value, str) else ""
    if path.startswith("/apis/networking.istio.io/"):
        pieces = path.split("/")
        return f"{pieces[7]}.{pieces[5]}" if len(pieces) == 8 else ""
    return "<unknown>"


def parse_subset_key(key: str) -> tuple[str, str, str, int]:
    """(direction, subset, hostname, port) of ``dir|port|subset|host`` (or ``outbound_.port_.subset_.host``)."""
    sep = "_." if key.startswith(("outbound_", "inbound_")) else "|"
    direction = subset = hostname = ""
    port = 0
    parts = key.split(sep, 1)
    if len(parts) < 2:
        return direction, subset, hostname, port
    direction, rest = parts
    parts = rest.split(sep, 1)
    if len(parts) < 2:
        return direction, subset, hostname, port
    port = atoi(parts[0]) or 0
    parts = parts[1].split(sep, 1)
    if len(parts) < 2:
        return direction, subset, hostname, port
    subset, rest = parts
    if sep in rest:
        return direction, subset, hostname, port
    return direction, subset, rest, port


def safely_parse_subset_key(key: str) -> tuple[str, str, str, int]:
    if len(key.split("|")) > 3:
        return parse_subset_key(key)
    return "", "", key, 0


def atoi(value: str) -> int | None:
    """Go's ``strconv.Atoi``: an optional sign and decimal digits, else None."""
    body = value[1:] if value[:1] in "+-" else value
    if not body or not body.isascii() or not body.isdigit():
        return None
    return int(value)


def subset_key_less(a: str, b: str) -> bool:
    """istioctl's order of clusters and load assignments: host, subset, port, direction."""
    ad, asub, aname, aport = safely_parse_subset_key(a)
    bd, bsub, bname, bport = safely_parse_subset_key(b)
    if aname == bname:
        if asub == bsub:
            if aport == bport:
                return ad < bd
            return aport < bport
        return asub < bsub
    return aname < bname


def raw(node: Any, *path: str) -> Any:
    """A step through Envoy's JSON as written (proto names), taking the JSON (camel) name too."""
    for step in path:
        if not isinstance(node, dict):
            return None
        camel = step.split("_")[0] + "".join(part[:1].upper() + part[1:] for part in step.split("_")[1:])
        node = node.get(step) if node.get(step) is not None else node.get(camel)
    return node
