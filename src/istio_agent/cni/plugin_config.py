"""The istio-cni plugin's entry in the node's CNI config: written by install-cni, read by the plugin.

One type for both sides, so the file install-cni writes is by construction what the plugin reads.
The field names and their order are Istio's (``cni/pkg/plugin/plugin.go``, ``Config``): install-cni's
standalone file is this object as it stands, and operators diff it against Istio's. The types are
NamedTuples rather than dataclasses: the plugin defines them on every ADD, and a dataclass costs
~0.5 ms of generated code at import (docs/performance.md, "CNI plugin ADD").
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from types import MappingProxyType
from typing import Any, NamedTuple

from istio_agent.config.document import Keys, Node, config_errors

PLUGIN_TYPE = "istio-cni"
CNI_VERSION = "0.3.1"
"""The cniVersion install-cni writes (Istio's); the plugin answers in whatever version it is called with."""
DEFAULT_RUN_DIR = "/var/run/istio-cni"


class PluginConfig(NamedTuple):
    """The Istio-specific keys of the plugin's network config."""

    plugin_log_level: str = "info"
    cni_agent_run_dir: str = DEFAULT_RUN_DIR
    ambient_enabled: bool = False
    enablement_selectors: tuple[dict[str, Any], ...] = ()
    exclude_namespaces: tuple[str, ...] = ()
    pod_namespace: str = ""
    native_nftables: bool = False
    enable_ambient_detection_retry: bool = False
    ipam: Mapping[str, Any] = MappingProxyType({})
    dns: Mapping[str, Any] = MappingProxyType({})
    add_timeout: timedelta | None = None
    """Our own key (not Istio's): the one budget of an ADD, API calls and rule programming included.
    Written only when set, so by default the entry is Istio's byte for byte."""

    def plugin_object(self, *, with_version: bool = True) -> dict[str, Any]:
        """The entry in Istio's key order; chained entries leave ``cniVersion`` to the list's."""
        entry: dict[str, Any] = {}
        if with_version:
            entry["cniVersion"] = CNI_VERSION
        entry.update(
            {
                "name": PLUGIN_TYPE,
                "type": PLUGIN_TYPE,
                "ipam": dict(self.ipam),
                "dns": dict(self.dns),
                "plugin_log_level": self.plugin_log_level,
                "cni_agent_run_dir": self.cni_agent_run_dir,
                "ambient_enabled": self.ambient_enabled,
                "enablement_selectors": list(self.enablement_selectors),
                # Go marshals a nil slice as null: Istio writes null when no namespace is excluded.
                "exclude_namespaces": list(self.exclude_namespaces) if self.exclude_namespaces else None,
                "pod_namespace": self.pod_namespace,
                "native_nftables": self.native_nftables,
                "enable_ambient_detection_retry": self.enable_ambient_detection_retry,
            }
        )
        if self.add_timeout is not None:
            entry["add_timeout"] = f"{self.add_timeout.total_seconds():g}s"
        return entry


class NetworkConfig(NamedTuple):
    """The network config a runtime hands the plugin on stdin: the standard keys and Istio's."""

    cni_version: str
    name: str
    type: str
    prev_result: Any
    """The previous plugin's result as given (None when istio-cni is first or alone)."""
    plugin: PluginConfig


_FIELDS = (
    "cniVersion",
    "name",
    "type",
    "prevResult",
    "plugin_log_level",
    "cni_agent_run_dir",
    "ambient_enabled",
    "enablement_selectors",
    "exclude_namespaces",
    "pod_namespace",
    "native_nftables",
    "enable_ambient_detection_retry",
    "add_timeout",
)


def parse_network_config(config: Mapping[str, Any]) -> NetworkConfig:
    """The plugin's view of its stdin config (a decoded JSON object); raises ConfigError naming the key.

    Keys are matched as Go's ``encoding/json`` matches them (any case; unknown keys, such as the
    legacy ``kubernetes`` block, ignored), so whatever Istio's plugin reads, this reads the same way.
    """
    node = Node(dict(config), "", config_errors("invalid network config: "))
    fields = node.fields(_FIELDS, Keys.GO_JSON)
    selectors = tuple(item.map() for item in fields["enablement_selectors"].items())
    timeout = fields["add_timeout"]
    plugin = PluginConfig(
        plugin_log_level=fields["plugin_log_level"].string("info") or "info",
        cni_agent_run_dir=fields["cni_agent_run_dir"].string(DEFAULT_RUN_DIR) or DEFAULT_RUN_DIR,
        ambient_enabled=_flag(fields["ambient_enabled"]),
        enablement_selectors=selectors,
        exclude_namespaces=fields["exclude_namespaces"].strings(),
        pod_namespace=fields["pod_namespace"].string(),
        native_nftables=_flag(fields["native_nftables"]),
        enable_ambient_detection_retry=_flag(fields["enable_ambient_detection_retry"]),
        add_timeout=None if timeout.is_null else timeout.duration(minimum=timedelta(milliseconds=1)),
    )
    return NetworkConfig(
        cni_version=fields["cniVersion"].string(),
        name=fields["name"].string(),
        type=fields["type"].string(),
        prev_result=fields["prevResult"].value,
        plugin=plugin,
    )


def _flag(node: Node) -> bool:
    return False if node.is_null else node.boolean()
