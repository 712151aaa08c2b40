"""xDS type URLs the proxy treats specially (everything else is relayed by prefix)."""

from __future__ import annotations

TYPE_PREFIX = "type.googleapis.com/"
ENVOY_TYPE_PREFIX = TYPE_PREFIX + "envoy."

LISTENER = TYPE_PREFIX + "envoy.config.listener.v3.Listener"
CLUSTER = TYPE_PREFIX + "envoy.config.cluster.v3.Cluster"
ENDPOINT = TYPE_PREFIX + "envoy.config.endpoint.v3.ClusterLoadAssignment"
ROUTE = TYPE_PREFIX + "envoy.config.route.v3.RouteConfiguration"
SECRET = TYPE_PREFIX + "envoy.extensions.transport_sockets.tls.v3.Secret"
EXTENSION_CONFIG = TYPE_PREFIX + "envoy.config.core.v3.TypedExtensionConfig"
WORKLOAD = TYPE_PREFIX + "istio.workload.Workload"
"""Ambient's workload type: not an ``envoy.`` type, yet relayed (ztunnel consumes it)."""

NAME_TABLE = TYPE_PREFIX + "istio.networking.nds.v1.NameTable"
PROXY_CONFIG = TYPE_PREFIX + "istio.mesh.v1alpha1.ProxyConfig"
HEALTH_INFO = TYPE_PREFIX + "istio.v1.HealthInformation"


def is_forwardable(type_url: str) -> bool:
    """Whether a response of this type may go to Envoy (other types would only make it NACK)."""
    return type_url.startswith(ENVOY_TYPE_PREFIX) or type_url == WORKLOAD
