"""Envoy's bootstrap (Istio's default template, reference lifecycle.md §6) as a dict, and writing it.

The bootstrap gives Envoy its node identity and the static pieces it needs before xDS: the
``xds-grpc`` cluster to the agent's xDS proxy (UDS), ``sds-grpc`` to the agent's SDS server, the
``agent`` and ``prometheus_stats`` clusters behind the 15021 readiness and 15090 metrics listeners,
and the admin endpoint the agent uses for readiness, stats and draining. Each top-level section is
built by its own function so later options (tracing, stats sinks, stats tags) slot in beside them.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from istio_agent.bootstrap.sds import sds_cluster
from istio_agent.config.bootstrap import BootstrapSettings

XDS_CLUSTER = "xds-grpc"
AGENT_CLUSTER = "agent"
PROMETHEUS_CLUSTER = "prometheus_stats"
HCM = "envoy.filters.network.http_connection_manager"
HCM_TYPE = (
    "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
)
ROUTER_TYPE = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
TYPED_STRUCT = "type.googleapis.com/udpa.type.v1.TypedStruct"
TEXT_LOG_FORMAT = "%Y-%m-%dT%T.%fZ\t%l\tenvoy %n %g:%#\t%v\tthread=%t"
JSON_LOG_FORMAT = {
    "time": "%Y-%m-%dT%T.%fZ",
    "level": "%l",
    "scope": "envoy %n",
    "msg": "%j",
    "caller": "%g:%#",
    "thread": "%t",
}
RUNTIME_DEFAULTS: dict[str, Any] = {
    "re2.max_program_size.error_level": "32768",
    "envoy.deprecated_features:envoy.config.listener.v3.Listener.hidden_envoy_deprecated_use_original_dst": True,
    "envoy.reloadable_features.http_reject_path_with_fragment": False,
    "envoy.reloadable_features.fixed_heap_use_allocated": True,
    "envoy.reloadable_features.coalesce_lb_rebuilds_on_batch_update": False,
}


def build_bootstrap(settings: BootstrapSettings) -> dict[str, Any]:
    """The Envoy bootstrap for these settings, in Envoy's JSON form (pure)."""
    return {
        "node": node(settings),
        "application_log_config": application_log_config(settings),
        "layered_runtime": layered_runtime(settings),
        "bootstrap_extensions": bootstrap_extensions(),
        "stats_config": stats_config(),
        "admin": admin(settings),
        "dynamic_resources": dynamic_resources(settings),
        "static_resources": {
            "clusters": static_clusters(settings),
            "listeners": static_listeners(settings),
        },
        "overload_manager": overload_manager(settings),
    }


def write_bootstrap(settings: BootstrapSettings) -> Path:
    """Write ``<configPath>/envoy-rev.json`` atomically (directory 0700, as Istio) and return its path."""
    path = settings.bootstrap_path
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    content = json.dumps(build_bootstrap(settings), indent=2)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as file:
            file.write(content)
        os.chmod(temp, 0o644)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    return path


# -- sections ---------------------------------------------------------------------------------------
def node(settings: BootstrapSettings) -> dict[str, Any]:
    result: dict[str, Any] = {
        "id": settings.node_id,
        "cluster": settings.service_cluster,
        "metadata": settings.metadata,
    }
    if settings.locality:
        result["locality"] = dict(settings.locality)
    return result


def application_log_config(settings: BootstrapSettings) -> dict[str, Any]:
    """Envoy's own log lines in Istio's format (JSON with ``--log_as_json``)."""
    if settings.log_as_json:
        return {"log_format": {"json_format": dict(JSON_LOG_FORMAT)}}
    return {"log_format": {"text_format": TEXT_LOG_FORMAT}}


def layered_runtime(settings: BootstrapSettings) -> dict[str, Any]:
    static = dict(RUNTIME_DEFAULTS)
    if not settings.strip_fragment_from_path:
        static["envoy.reloadable_features.http_strip_fragment_from_path_unsafe_if_disabled"] = "false"
    return {
        "layers": [
            {"name": "global config", "static_layer": static},
            {"name": "admin", "admin_layer": {}},
        ]
    }


def bootstrap_extensions() -> list[dict[str, Any]]:
    """The internal listener extension (used by waypoints/HBONE configs pushed over xDS)."""
    return [
        {
            "name": "envoy.bootstrap.internal_listener",
            "typed_config": {
                "@type": TYPED_STRUCT,
                "type_url": "type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3.InternalListener",
                "value": {"buffer_size_kb": 64},
            },
        }
    ]


def stats_config() -> dict[str, Any]:
    """Basic stats config; Istio's tag regexes and inclusion list come with the stats work."""
    return {"use_all_default_tags": False}


def admin(settings: BootstrapSettings) -> dict[str, Any]:
    return {
        "access_log": [
            {
                "name": "envoy.access_loggers.file",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                    "path": "/dev/null",
                },
            }
        ],
        "profile_path": str(settings.profile_path),
        "address": _socket_address(settings.localhost, settings.proxy_admin_port),
    }


def dynamic_resources(settings: BootstrapSettings) -> dict[str, Any]:
    """LDS and CDS over one ADS stream to ``xds-grpc``; Delta unless ISTIO_DELTA_XDS=false (waypoints always)."""
    delta = settings.delta_xds or settings.proxy_type == "waypoint"
    via_ads = {"ads": {}, "initial_fetch_timeout": "0s", "resource_api_version": "V3"}
    return {
        "lds_config": dict(via_ads),
        "cds_config": dict(via_ads),
        "ads_config": {
            "api_type": "DELTA_GRPC" if delta else "GRPC",
            "set_node_on_first_message_only": True,
            "transport_api_version": "V3",
            "grpc_services": [{"envoy_grpc": {"cluster_name": XDS_CLUSTER}}],
        },
    }


def static_clusters(settings: BootstrapSettings) -> list[dict[str, Any]]:
    return [
        _tcp_cluster(PROMETHEUS_CLUSTER, settings.localhost, settings.proxy_admin_port),
        _tcp_cluster(AGENT_CLUSTER, settings.localhost, settings.status_port),
        sds_cluster(settings.sds_socket_path),
        xds_cluster(settings),
    ]


def xds_cluster(settings: BootstrapSettings) -> dict[str, Any]:
    """HTTP/2 to the agent's xDS proxy socket; one stream per connection, generous circuit breakers."""
    limits = {"max_connections": 100000, "max_pending_requests": 100000, "max_requests": 100000}
    return {
        "name": XDS_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {
            "cluster_name": XDS_CLUSTER,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": {"pipe": {"path": str(settings.xds_socket_path)}}}}
                    ]
                }
            ],
        },
        "circuit_breakers": {
            "thresholds": [{"priority": "DEFAULT", **limits}, {"priority": "HIGH", **limits}]
        },
        "upstream_connection_options": {"tcp_keepalive": {"keepalive_time": 300}},
        "max_requests_per_connection": 1,
        "typed_extension_protocol_options": {
            HTTP_OPTIONS: {
                "@type": f"type.googleapis.com/{HTTP_OPTIONS}",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
    }


def static_listeners(settings: BootstrapSettings) -> list[dict[str, Any]]:
    """15090 (Envoy's Prometheus stats) and 15021 (readiness, answered by the agent)."""
    return [
        _http_listener(
            settings.prometheus_host,
            settings.envoy_prometheus_port,
            stat_prefix="stats",
            prefix="/stats/prometheus",
            cluster=PROMETHEUS_CLUSTER,
        ),
        _http_listener(
            settings.listener_host,
            settings.envoy_status_port,
            stat_prefix="agent",
            prefix="/healthz/ready",
            cluster=AGENT_CLUSTER,
        ),
    ]


def overload_manager(settings: BootstrapSettings) -> dict[str, Any]:
    """The global downstream connection limit (the static listeners above are exempt from it)."""
    return {
        "resource_monitors": [
            {
                "name": "envoy.resource_monitors.global_downstream_max_connections",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections"
                    ".v3.DownstreamConnectionsConfig",
                    "max_active_downstream_connections": settings.max_downstream_connections,
                },
            }
        ]
    }


# -- helpers ----------------------------------------------------------------------------------------
def _socket_address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"protocol": "TCP", "address": host, "port_value": port}}


def _tcp_cluster(name: str, host: str, port: int) -> dict[str, Any]:
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "0.250s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _socket_address(host, port)}}]}],
        },
    }


def _http_listener(host: str, port: int, *, stat_prefix: str, prefix: str, cluster: str) -> dict[str, Any]:
    """A plaintext HTTP listener routing one path prefix to one cluster, outside connection limits."""
    manager = {
        "@type": HCM_TYPE,
        "codec_type": "AUTO",
        "stat_prefix": stat_prefix,
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "backend",
                    "domains": ["*"],
                    "routes": [{"match": {"prefix": prefix}, "route": {"cluster": cluster}}],
                }
            ]
        },
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER_TYPE}}],
    }
    return {
        "name": f"{host}_{port}",
        "address": _socket_address(host, port),
        "ignore_global_conn_limit": True,
        "bypass_overload_manager": True,
        "filter_chains": [{"filters": [{"name": HCM, "typed_config": manager}]}],
    }
