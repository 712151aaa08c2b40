"""xDS: the stream core every xDS server uses, the proxy between Envoy and istiod, its dialer, the agent's types."""

from istio_agent.xds.handlers import NameTableHandler, ProxyConfigHandler
from istio_agent.xds.proxy import TypeHandler, XdsProxy
from istio_agent.xds.upstream import DialError, UpstreamDialer

__all__ = ["DialError", "NameTableHandler", "ProxyConfigHandler", "TypeHandler", "UpstreamDialer", "XdsProxy"]
