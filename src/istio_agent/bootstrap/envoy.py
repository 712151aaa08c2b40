"""Envoy's bootstrap (Istio's default template, tools/packaging/common/envoy_bootstrap.json) as a dict, and writing it.

The bootstrap gives Envoy its node identity and the static pieces it needs before xDS: the
``xds-grpc`` cluster to the agent's xDS proxy (UDS), ``sds-grpc`` to the agent's SDS server, the
``agent`` and ``prometheus_stats`` clusters behind the 15021 readiness and 15090 metrics listeners,
and the admin endpoint the agent uses for readiness, stats and draining; then what only exists
before xDS: stats tags and the inclusion list, tracer and statsd sink, runtime flags and the global
connection limit. Each top-level section is built by its own function.

Pod annotations that tune stats (``sidecar.istio.io/stats*``) are hints, as in Istio: a bad one is
logged and skipped, never a reason for Envoy to refuse its bootstrap.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from istio_agent.bootstrap.sds import sds_cluster
from istio_agent.config.bootstrap import BootstrapSettings
from istio_agent.config.env import ConfigError, parse_go_duration
from istio_agent.config.proxy_config import duration_json, split_host_port, substitute_host_ip
from istio_agent.files import write_atomic
from istio_agent.log import scope

log = scope("bootstrap")

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
EXTRA_STAT_TAGS_ANNOTATION = "sidecar.istio.io/extraStatTags"
INCLUSION_PREFIXES_ANNOTATION = "sidecar.istio.io/statsInclusionPrefixes"
INCLUSION_SUFFIXES_ANNOTATION = "sidecar.istio.io/statsInclusionSuffixes"
INCLUSION_REGEXPS_ANNOTATION = "sidecar.istio.io/statsInclusionRegexps"
HISTOGRAM_BUCKETS_ANNOTATION = "sidecar.istio.io/statsHistogramBuckets"
FLUSH_INTERVAL_ANNOTATION = "sidecar.istio.io/statsFlushInterval"
EVICTION_INTERVAL_ANNOTATION = "sidecar.istio.io/statsEvictionInterval"
# Stats Istio's readiness check and dashboards rely on; always included.
REQUIRED_PREFIXES = ("cluster_manager", "listener_manager", "server", "cluster.xds-grpc", "wasm")
RBAC_SUFFIXES = ("rbac.allowed", "rbac.denied", "shadow_allowed", "shadow_denied")
DRAIN_SUFFIX = "downstream_cx_active"  # counted by EXIT_ON_ZERO_ACTIVE_CONNECTIONS draining
ROUTE_STATS_REGEX = r"vhost\..*\.route\..*"  # stats of routes given a stat_prefix in a VirtualService
DEFAULT_FLUSH_INTERVAL = timedelta(seconds=5)
_TAG_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
# Istio's tag extraction (current form: istiod names clusters and HCM prefixes with a trailing ";").
_IP_OR_NAME = r"(?:[_.[:digit:]\w]*|[_\[\]aAbBcCdDeEfF[:digit:]\w\:]*)"
_LISTENER_ADDRESS = r"(?:[_.[:digit:]]*|[_\[\]aAbBcCdDeEfF[:digit:]]*)"
LEADING_STAT_TAGS: tuple[tuple[str, str], ...] = (
    ("cluster_name", r"^cluster(\.(.+);)"),
    ("http_conn_manager_prefix", rf"^http\.(({_IP_OR_NAME});\.)"),
    ("thread_name", r"^server(\.(.+))\.watchdog"),
    ("tcp_prefix", r"^tcp\.((.*?)\.)\w+?$"),
    ("response_code", r"_rq(_(\d{3}))$"),
    ("response_code_class", r"_rq(_(\dxx))$"),
    ("http_conn_manager_listener_prefix", rf"^listener(?=\.).*?\.http\.(({_LISTENER_ADDRESS})\.)"),
    ("listener_address", rf"^listener\.(({_LISTENER_ADDRESS})\.)"),
    ("mongo_prefix", r"^mongo\.(.+?)\.(collection|cmd|cx_|op_|delays_|decoding_)(.*?)$"),
)
TRAILING_STAT_TAGS: tuple[tuple[str, str], ...] = (
    ("cache", r"(cache\.(.+?)\.)"),
    ("component", r"(component\.(.+?)\.)"),
    ("tag", r"(tag\.(.+?);\.)"),
    ("wasm_filter", r"(wasm_filter\.(.+?)\.)"),
    ("authz_enforce_result", r"rbac(\.(allowed|denied))"),
    ("authz_dry_run_action", r"(\.istio_dry_run_(allow|deny)_)"),
    ("authz_dry_run_result", r"(\.shadow_(allowed|denied))"),
)
RUNTIME_DEFAULTS: dict[str, Any] = {
    "re2.max_program_size.error_level": "32768",
    "envoy.deprecated_features:envoy.config.listener.v3.Listener.hidden_envoy_deprecated_use_original_dst": True,
    "envoy.reloadable_features.http_reject_path_with_fragment": False,
    "envoy.reloadable_features.fixed_heap_use_allocated": True,
    "envoy.reloadable_features.coalesce_lb_rebuilds_on_batch_update": False,
}


def build_bootstrap(settings: BootstrapSettings) -> dict[str, Any]:
    """The Envoy bootstrap for these settings, in Envoy's JSON form (pure but for warnings logged).

    Raises ConfigError for a tracer address that does not parse once ``$(HOST_IP)`` is substituted.
    """
    bootstrap: dict[str, Any] = {
        "node": node(settings),
        "application_log_config": application_log_config(settings),
        "layered_runtime": layered_runtime(settings),
        "bootstrap_extensions": bootstrap_extensions(),
        "stats_config": stats_config(settings),
        "admin": admin(settings),
        "dynamic_resources": dynamic_resources(settings),
        "static_resources": {
            "clusters": static_clusters(settings) + tracing_clusters(settings),
            "listeners": static_listeners(settings),
        },
        "overload_manager": overload_manager(settings),
        "deferred_stat_options": {"enable_deferred_creation_stats": True},
    }
    optional = {
        "stats_flush_interval": _flush_interval(settings),
        "stats_eviction_interval": _eviction_interval(settings),
        "tracing": tracing(settings),
        "stats_sinks": stats_sinks(settings),
        "cluster_manager": cluster_manager(settings),
    }
    bootstrap.update((key, value) for key, value in optional.items() if value)
    return bootstrap


def write_bootstrap(settings: BootstrapSettings) -> Path:
    """Write ``<configPath>/envoy-rev.json`` atomically (directory 0700, as Istio) and return its path.

    With Lightstep tracing the access token is also written to ``lightstep_access_token.txt`` (as
    Istio) and, since the bootstrap then carries the token too, both files are owner-only.
    """
    path = settings.bootstrap_path
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    content = json.dumps(build_bootstrap(settings), indent=2)
    token = _lightstep_token(settings)
    if token:
        write_atomic(settings.lightstep_token_path, token, 0o600)
    write_atomic(path, content, 0o600 if token else 0o644)
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
    """Istio's runtime defaults, then ProxyConfig ``runtimeValues``.

    A value of ``""`` removes a default (Envoy has no "unset"); ``"true"``/``"false"`` become
    booleans, since Envoy no longer accepts feature flags as strings.
    """
    static = dict(RUNTIME_DEFAULTS)
    if not settings.strip_fragment_from_path:
        static["envoy.reloadable_features.http_strip_fragment_from_path_unsafe_if_disabled"] = "false"
    for key, value in settings.proxy_config.runtime_values.items():
        if value == "":
            static.pop(key, None)
        else:
            static[key] = {"true": True, "false": False}.get(value, value)
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


def stats_config(settings: BootstrapSettings) -> dict[str, Any]:
    """Istio's tag extraction (plus extra stat tags) and the list of stats Envoy keeps."""
    tags = [*LEADING_STAT_TAGS]
    tags += [(tag, rf"({tag}=\.=(.*?);\.;)") for tag in extra_stat_tags(settings)]
    tags += TRAILING_STAT_TAGS
    config: dict[str, Any] = {
        "use_all_default_tags": False,
        "stats_tags": [{"tag_name": name, "regex": regex} for name, regex in tags],
    }
    buckets = histogram_buckets(_annotations(settings).get(HISTOGRAM_BUCKETS_ANNOTATION))
    if buckets:
        config["histogram_bucket_settings"] = buckets
    config["stats_matcher"] = {"inclusion_list": {"patterns": inclusion_patterns(settings)}}
    return config


def extra_stat_tags(settings: BootstrapSettings) -> list[str]:
    """ProxyConfig ``extraStatTags`` then the annotation's, de-duplicated, first occurrence kept."""
    annotated = []
    for tag in _annotation_list(settings, EXTRA_STAT_TAGS_ANNOTATION):
        if _TAG_NAME.match(tag):
            annotated.append(tag)
        else:
            log.warning("ignoring stat tag %r from %s: not a valid tag name", tag, EXTRA_STAT_TAGS_ANNOTATION)
    tags = [tag for tag in settings.proxy_config.extra_stat_tags if tag] + annotated
    return list(dict.fromkeys(tags))


def inclusion_patterns(settings: BootstrapSettings) -> list[dict[str, Any]]:
    """``stats_matcher.inclusion_list`` in Istio's order.

    For each kind the annotation wins over ProxyConfig ``proxyStatsMatcher`` (they are not merged),
    then the required entries follow; ``{pod_ip}`` expands to one pattern per instance IP.
    """
    matcher = settings.proxy_config.proxy_stats_matcher
    suffixes = RBAC_SUFFIXES + ((DRAIN_SUFFIX,) if settings.exit_on_zero_active_connections else ())
    prefixes = _inclusion(
        settings,
        INCLUSION_PREFIXES_ANNOTATION,
        matcher.inclusion_prefixes if matcher else (),
        REQUIRED_PREFIXES,
    )
    suffix_list = _inclusion(
        settings, INCLUSION_SUFFIXES_ANNOTATION, matcher.inclusion_suffixes if matcher else (), suffixes
    )
    regexes = _inclusion(
        settings,
        INCLUSION_REGEXPS_ANNOTATION,
        matcher.inclusion_regexps if matcher else (),
        (ROUTE_STATS_REGEX,),
    )
    return [
        {"prefix": "reporter="},
        *({"prefix": prefix} for prefix in prefixes),
        *({"suffix": suffix} for suffix in suffix_list),
        *({"safe_regex": {"regex": regex}} for regex in regexes if _valid_regex(regex)),
        {"prefix": "component"},
        {"prefix": "istio"},
    ]


def histogram_buckets(raw: str | None) -> list[dict[str, Any]]:
    """``statsHistogramBuckets`` (JSON: stat prefix -> bucket bounds) as Envoy settings sorted by prefix."""
    if raw is None:
        return []
    try:
        doc = json.loads(raw)
    except ValueError as err:
        log.warning("ignoring %s: not valid JSON: %s", HISTOGRAM_BUCKETS_ANNOTATION, err)
        return []
    if not isinstance(doc, dict):
        log.warning(
            "ignoring %s: expected a JSON object of prefix to bucket list", HISTOGRAM_BUCKETS_ANNOTATION
        )
        return []
    settings = []
    for prefix in sorted(doc):
        bounds = doc[prefix]
        if not _valid_buckets(bounds):
            log.warning(
                "ignoring %s for %r: buckets must be distinct positive numbers",
                HISTOGRAM_BUCKETS_ANNOTATION,
                prefix,
            )
            continue
        settings.append({"match": {"prefix": prefix}, "buckets": [float(b) for b in bounds]})
    return settings


def _valid_buckets(bounds: Any) -> bool:
    if not isinstance(bounds, list) or not bounds:
        return False
    numbers = [b for b in bounds if isinstance(b, int | float) and not isinstance(b, bool)]
    return (
        len(numbers) == len(bounds)
        and all(math.isfinite(b) and b > 0 for b in numbers)
        and len(set(numbers)) == len(numbers)
    )


def _flush_interval(settings: BootstrapSettings) -> str:
    """``stats_flush_interval``, only when annotated (Envoy's default is Istio's 5 s)."""
    interval = _annotated_interval(settings, FLUSH_INTERVAL_ANNOTATION)
    return duration_json(interval) if interval is not None else ""


def _eviction_interval(settings: BootstrapSettings) -> str:
    """``stats_eviction_interval`` when annotated and a whole multiple of the flush interval (Envoy's rule)."""
    eviction = _annotated_interval(settings, EVICTION_INTERVAL_ANNOTATION)
    if eviction is None:
        return ""
    flush = _annotated_interval(settings, FLUSH_INTERVAL_ANNOTATION) or DEFAULT_FLUSH_INTERVAL
    if _micros(eviction) % _micros(flush):
        log.warning(
            "ignoring %s: must be a multiple of the stats flush interval", EVICTION_INTERVAL_ANNOTATION
        )
        return ""
    return duration_json(eviction)


def _annotated_interval(settings: BootstrapSettings, annotation: str) -> timedelta | None:
    raw = _annotations(settings).get(annotation)
    if raw is None:
        return None
    try:
        interval = parse_go_duration(raw)
    except ValueError as err:
        log.warning("ignoring %s: %s", annotation, err)
        return None
    if not timedelta(milliseconds=1) <= interval < timedelta(seconds=300):
        log.warning("ignoring %s=%s: must be at least 1ms and under 300s", annotation, raw)
        return None
    return interval


def _micros(value: timedelta) -> int:
    return round(value.total_seconds() * 1_000_000)


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
    """The agent-facing clusters; ``alt_stat_name`` ends in ``;`` like istiod's, for the cluster_name tag."""
    clusters = [
        _tcp_cluster(PROMETHEUS_CLUSTER, settings.localhost, settings.proxy_admin_port),
        _tcp_cluster(AGENT_CLUSTER, settings.localhost, settings.status_port),
        sds_cluster(settings.sds_socket_path),
        xds_cluster(settings),
    ]
    return [{"name": c["name"], "alt_stat_name": f"{c['name']};", **c} for c in clusters]


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


# -- tracing, sinks, cluster manager ----------------------------------------------------------------
TRACER_CLUSTERS = {"zipkin": "zipkin", "lightstep": "lightstep", "datadog": "datadog_agent"}


def tracing_clusters(settings: BootstrapSettings) -> list[dict[str, Any]]:
    """The cluster the configured tracer reports to (STRICT_DNS: tracer addresses are usually names)."""
    tracer = settings.proxy_config.tracing
    if tracer is None or not tracer.tracer:
        return []
    name = TRACER_CLUSTERS[tracer.tracer]
    host, port = _tracer_address(settings)
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STRICT_DNS",
        "respect_dns_ttl": True,
        "dns_lookup_family": "V6_ONLY" if settings.ipv6_only else "V4_ONLY",
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}
                    ]
                }
            ],
        },
    }
    if tracer.tracer == "zipkin":
        cluster["dns_refresh_rate"] = "30s"
    if tracer.tracer == "lightstep":  # OTLP over gRPC
        cluster["typed_extension_protocol_options"] = {
            HTTP_OPTIONS: {
                "@type": f"type.googleapis.com/{HTTP_OPTIONS}",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    return [cluster]


def tracing(settings: BootstrapSettings) -> dict[str, Any]:
    """Envoy's HTTP tracer: Zipkin (v2 JSON, 128-bit ids), Datadog, or Lightstep.

    Envoy dropped its Lightstep tracer; Lightstep ingests OTLP, so Lightstep is configured as the
    OpenTelemetry tracer with the access token as the ``lightstep-access-token`` gRPC header.
    """
    tracer = settings.proxy_config.tracing
    if tracer is None or not tracer.tracer:
        return {}
    cluster = TRACER_CLUSTERS[tracer.tracer]
    if tracer.tracer == "zipkin":
        config: dict[str, Any] = {
            "@type": "type.googleapis.com/envoy.config.trace.v3.ZipkinConfig",
            "collector_cluster": cluster,
            "collector_endpoint": "/api/v2/spans",
            "collector_endpoint_version": "HTTP_JSON",
            "trace_id_128bit": True,
            "shared_span_context": False,
        }
        name = "envoy.tracers.zipkin"
    elif tracer.tracer == "datadog":
        config = {
            "@type": "type.googleapis.com/envoy.config.trace.v3.DatadogConfig",
            "collector_cluster": cluster,
            "service_name": settings.service_cluster,
        }
        name = "envoy.tracers.datadog"
    else:
        grpc: dict[str, Any] = {"envoy_grpc": {"cluster_name": cluster}}
        if tracer.access_token:
            grpc["initial_metadata"] = [{"key": "lightstep-access-token", "value": tracer.access_token}]
        config = {
            "@type": "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig",
            "grpc_service": grpc,
            "service_name": settings.service_cluster,
        }
        name = "envoy.tracers.opentelemetry"
    return {"http": {"name": name, "typed_config": config}}


def stats_sinks(settings: BootstrapSettings) -> list[dict[str, Any]]:
    """A statsd sink when ``statsdUdpAddress`` resolved (Envoy's statsd sink needs an IP)."""
    if not settings.statsd_address:
        return []
    host, port = split_host_port(settings.statsd_address)
    return [
        {
            "name": "envoy.stat_sinks.statsd",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.config.metrics.v3.StatsdSink",
                "address": {"socket_address": {"protocol": "UDP", "address": host, "port_value": port}},
            },
        }
    ]


def cluster_manager(settings: BootstrapSettings) -> dict[str, Any]:
    """Only with ``--outlierLogPath``: the outlier event log (and deferred cluster creation, as Istio)."""
    if not settings.outlier_log_path:
        return {}
    return {
        "enable_deferred_cluster_creation": True,
        "outlier_detection": {"event_log_path": settings.outlier_log_path},
    }


def _tracer_address(settings: BootstrapSettings) -> tuple[str, int]:
    tracer = settings.proxy_config.tracing
    assert tracer is not None
    address = substitute_host_ip(tracer.address, settings.host_ip)
    try:
        return split_host_port(address)
    except ValueError as err:
        hint = " (HOST_IP is not set)" if "$(HOST_IP)" in tracer.address and not settings.host_ip else ""
        raise ConfigError(f"tracing.{tracer.tracer}.address: {err}{hint}") from None


def _lightstep_token(settings: BootstrapSettings) -> str:
    tracer = settings.proxy_config.tracing
    return tracer.access_token if tracer is not None and tracer.tracer == "lightstep" else ""


# -- helpers ----------------------------------------------------------------------------------------
def _annotations(settings: BootstrapSettings) -> Mapping[str, str]:
    annotations = settings.metadata.get("ANNOTATIONS")
    return annotations if isinstance(annotations, Mapping) else {}


def _annotation_list(settings: BootstrapSettings, annotation: str) -> list[str]:
    return [item for item in _annotations(settings).get(annotation, "").split(",") if item]


def _inclusion(
    settings: BootstrapSettings, annotation: str, configured: Sequence[str], required: Sequence[str]
) -> list[str]:
    chosen = _annotation_list(settings, annotation) or [item for item in configured if item]
    expanded: list[str] = []
    for pattern in [*chosen, *required]:
        if "{pod_ip}" in pattern:
            expanded += [pattern.replace("{pod_ip}", ip) for ip in dict.fromkeys(settings.ips)]
        else:
            expanded.append(pattern)
    return expanded


def _valid_regex(pattern: str) -> bool:
    try:
        re.compile(pattern)
    except re.error as err:
        log.warning("ignoring stats inclusion regex %r: %s", pattern, err)
        return False
    return True


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
