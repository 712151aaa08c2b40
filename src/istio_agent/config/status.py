"""Settings of the agent's status server (port 15020), from Istio's env names and ProxyConfig."""

from __future__ import annotations

from dataclasses import dataclass, field

from istio_agent.config.env import Env
from istio_agent.config.probes import AppProber, parse_app_probers
from istio_agent.config.prometheus import PrometheusTargets, parse_prometheus_annotations
from istio_agent.config.proxy_config import ProxyConfig


@dataclass(frozen=True)
class StatusSettings:
    port: int
    host: str = "0.0.0.0"
    metrics_localhost_only: bool = False
    merge_envoy_stats: bool = True
    prometheus: PrometheusTargets | None = None
    app_probers: dict[str, AppProber] = field(default_factory=dict)
    pod_ip: str = "127.0.0.1"
    probe_keepalive: bool = False
    http2_probing: bool = True

    @property
    def enabled(self) -> bool:
        """statusPort 0 disables the status server, as in Istio."""
        return self.port > 0

    @classmethod
    def from_env(cls, env: Env, proxy_config: ProxyConfig, proxy_type: str = "sidecar") -> StatusSettings:
        """Read and validate; a bad ISTIO_KUBE_APP_PROBERS / ISTIO_PROMETHEUS_ANNOTATIONS is a ConfigError."""
        port = proxy_config.status_port
        probers_text = env.text("ISTIO_KUBE_APP_PROBERS")
        prometheus = None
        # Istio merges application metrics for sidecars only; "set but empty" is not "unset".
        if proxy_type == "sidecar" and "ISTIO_PROMETHEUS_ANNOTATIONS" in env:
            prometheus = parse_prometheus_annotations(env.text("ISTIO_PROMETHEUS_ANNOTATIONS"), port)
        legacy_localhost = env.flag("REWRITE_PROBE_LEGACY_LOCALHOST_DESTINATION")
        return cls(
            port=port,
            metrics_localhost_only=env.flag("METRICS_LOCALHOST_ACCESS_ONLY"),
            merge_envoy_stats=env.flag("PILOT_AGENT_MERGE_ENVOY_STATS", True),
            prometheus=prometheus,
            app_probers=parse_app_probers(probers_text) if probers_text.strip() else {},
            pod_ip="localhost" if legacy_localhost else (env.text("INSTANCE_IP") or "127.0.0.1"),
            probe_keepalive=env.flag("ENABLE_PROBE_KEEPALIVE_CONNECTIONS"),
            http2_probing=env.flag("ISTIO_ENABLE_HTTP2_PROBING", True),
        )
