"""xDS proxy (SotW + Delta) between Envoy and istiod, its upstream dialer, and the agent-handled types."""

from istio_agent.xds.handlers import NameTableHandler, ProxyConfigHandler
from istio_agent.xds.proxy import TypeHandler, XdsProxy
from istio_agent.xds.upstream import DialError, UpstreamDialer

__all__ = ["DialError", "NameTableHandler", "ProxyConfigHandler", "TypeHandler", "UpstreamDialer", "XdsProxy"]
