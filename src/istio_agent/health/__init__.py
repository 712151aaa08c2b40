"""Workload health checks for VMs: ProxyConfig ``readinessProbe`` -> probers -> xDS health events."""

from istio_agent.health.checker import UNHEALTHY_PLACEHOLDER, HealthChecker
from istio_agent.health.config import (
    ExecCheck,
    GRPCCheck,
    HealthCheck,
    HTTPGetCheck,
    ReadinessProbeConfig,
    TCPCheck,
    parse_readiness_probe,
)
from istio_agent.health.probes import (
    EnvoyProber,
    ExecProber,
    GRPCProber,
    HealthProber,
    HTTPProber,
    ProbeOutcome,
    ProbeResult,
    TCPProber,
    build_probers,
    prober_for,
)

__all__ = [
    "UNHEALTHY_PLACEHOLDER",
    "EnvoyProber",
    "ExecCheck",
    "ExecProber",
    "GRPCCheck",
    "GRPCProber",
    "HTTPGetCheck",
    "HTTPProber",
    "HealthCheck",
    "HealthChecker",
    "HealthProber",
    "ProbeOutcome",
    "ProbeResult",
    "ReadinessProbeConfig",
    "TCPCheck",
    "TCPProber",
    "build_probers",
    "parse_readiness_probe",
    "prober_for",
]
