"""The xDS proxy's metrics (Istio's names), counted into the registry the proxy is given."""

from __future__ import annotations

from istio_agent.metrics import Registry


class ProxyMetrics:
    """One set per proxy; the relay and the outcome classes count into it."""

    def __init__(self, registry: Registry) -> None:
        self.istiod_failures = registry.counter(
            "istiod_connection_failures", "Upstream xDS streams that failed before istiod answered."
        )
        self.istiod_terminations = registry.counter(
            "istiod_connection_terminations", "Upstream xDS streams that ended, by kind.", ["type"]
        )
        self.envoy_terminations = registry.counter(
            "envoy_connection_terminations", "Downstream xDS streams ended by Envoy, by kind.", ["type"]
        )
        self.requests = registry.counter(
            "xds_proxy_requests", "xDS requests sent to istiod (Envoy's and the agent's)."
        )
        self.responses = registry.counter("xds_proxy_responses", "xDS responses received from istiod.")
        self.recv_max = registry.gauge(
            "pilot_xds_recv_max", "Largest xDS request received from Envoy, in bytes."
        )
        self.connections = registry.gauge("xds_proxy_connections", "Open downstream xDS streams.")
        self.nacks = registry.counter(
            "xds_proxy_nacks", "Responses rejected by Envoy (NACKs seen on the way up).", ["type_url"]
        )
        self.pushes = registry.counter("xds_proxy_pushes", "Responses forwarded to Envoy.", ["type_url"])
        self._largest_request = 0

    def request_size(self, size: int) -> None:
        """The gauge holds the largest request over every stream, so the maximum lives here."""
        if size > self._largest_request:
            self._largest_request = size
            self.recv_max.set(size)
