"""The agent's status server (port 15020): readiness, merged metrics, app probes, quit/drain, debug."""

from istio_agent.status.readiness import (
    DnsReadiness,
    EnvoyReadiness,
    GrpcBootstrapReadiness,
    Prober,
    Readiness,
)
from istio_agent.status.server import Handler, StatusServer, is_loopback

__all__ = [
    "DnsReadiness",
    "EnvoyReadiness",
    "GrpcBootstrapReadiness",
    "Handler",
    "Prober",
    "Readiness",
    "StatusServer",
    "is_loopback",
]
