"""The one place that reads the environment: typed settings with Istio's names and defaults.

The settings types are loaded on first use (PEP 562): a short-lived command that needs only
``config.env`` or ``config.document`` (the istio-cni plugin, exec'd per pod) must not pay for
ProxyConfig and the security settings at start-up.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from istio_agent.config.env import ConfigError, Env
    from istio_agent.config.proxy_config import ProxyConfig
    from istio_agent.config.security import SecuritySettings
    from istio_agent.config.xds import XdsSettings

__all__ = ["ConfigError", "Env", "ProxyConfig", "SecuritySettings", "XdsSettings"]

_HOMES = {
    "ConfigError": "env",
    "Env": "env",
    "ProxyConfig": "proxy_config",
    "SecuritySettings": "security",
    "XdsSettings": "xds",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value
