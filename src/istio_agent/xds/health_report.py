"""The workload's health as the xDS proxy reports it to istiod (Istio's ``istio.io/health`` requests)."""

from __future__ import annotations

from envoy.service.discovery.v3 import discovery_pb2

from istio_agent.xds import types
from istio_agent.xds.flavour import DELTA, Flavour, Request, error_detail


class HealthReport:
    """The latest report, kept so that every later stream sends it after its first LDS request."""

    def __init__(self) -> None:
        self._requests: tuple[discovery_pb2.DiscoveryRequest, discovery_pb2.DeltaDiscoveryRequest] | None = (
            None
        )

    def update(self, healthy: bool, message: str = "") -> None:
        detail = error_detail(None if healthy else message)
        self._requests = (
            discovery_pb2.DiscoveryRequest(type_url=types.HEALTH_INFO, error_detail=detail),
            discovery_pb2.DeltaDiscoveryRequest(type_url=types.HEALTH_INFO, error_detail=detail),
        )

    def request(self, flavour: Flavour) -> Request | None:
        """The report as a request of the stream's flavour; None before the first report."""
        if self._requests is None:
            return None
        return self._requests[1] if flavour is DELTA else self._requests[0]
