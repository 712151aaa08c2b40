"""The one place that reads the environment: typed settings with Istio's names and defaults."""

from istio_agent.config.env import ConfigError, Env
from istio_agent.config.proxy_config import ProxyConfig
from istio_agent.config.security import SecuritySettings
from istio_agent.config.xds import XdsSettings

__all__ = ["ConfigError", "Env", "ProxyConfig", "SecuritySettings", "XdsSettings"]
