"""The istio-cni plugin's entry in the node's CNI config: written by install-cni, read by the plugin.

One type for both sides, so the file install-cni writes is by construction what the plugin reads.
The field names and their order are Istio's (``cni/pkg/plugin/plugin.go``, ``Config``): install-cni's
standalone file is this object as it stands, and operators diff it against Istio's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PLUGIN_TYPE = "istio-cni"
CNI_VERSION = "0.3.1"
"""The cniVersion install-cni writes (Istio's); the plugin answers in whatever version it is called with."""
DEFAULT_RUN_DIR = "/var/run/istio-cni"


@dataclass(frozen=True)
class PluginConfig:
    """The Istio-specific keys of the plugin's network config."""

    plugin_log_level: str = "info"
    cni_agent_run_dir: str = DEFAULT_RUN_DIR
    ambient_enabled: bool = False
    enablement_selectors: tuple[dict[str, Any], ...] = ()
    exclude_namespaces: tuple[str, ...] = ()
    pod_namespace: str = ""
    native_nftables: bool = False
    enable_ambient_detection_retry: bool = False
    ipam: dict[str, Any] = field(default_factory=dict)
    dns: dict[str, Any] = field(default_factory=dict)

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
        return entry
