"""istiod's admission of a node id: ``type~ip~name.namespace~domain`` with an application node type.

istiod parses the id of every ADS stream's first request (``ParseServiceNodeWithMetadata`` in
``pilot/pkg/model/context.go``) and ends the stream with InvalidArgument and the parse error before
anything else is looked at, debug questions included. The local control plane refuses the same ids
with the same words, so a tool that works against it works against istiod.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Any

from istio_agent.goformat import go_quote

NODE_TYPES = ("sidecar", "router", "waypoint", "ztunnel")
"""istiod's application node types (``pkg/model/proxy.go``), in its order (its error lists them so)."""


def node_id_error(node_id: str, metadata: Mapping[str, Any]) -> str | None:
    """istiod's error for this node id and metadata (its exact text), or None when it is accepted."""
    parts = node_id.split("~")
    if len(parts) != 4:
        return f"missing parts in the service node {go_quote(node_id)}"
    if parts[0] not in NODE_TYPES:
        return f"invalid node type (valid types: [{' '.join(NODE_TYPES)}]) in the service node {go_quote(node_id)}"
    if not _valid_instance_ips(metadata.get("INSTANCE_IPS")) and not _is_ip(parts[1]):
        return "no valid IP address in the service node id or metadata"
    return None


def _valid_instance_ips(value: Any) -> bool:
    """INSTANCE_IPS as istiod reads it: a comma-separated string whose every item is an IP."""
    if not isinstance(value, str) or not value:
        return False
    return all(_is_ip(item) for item in value.split(","))


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
