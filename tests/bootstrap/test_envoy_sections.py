"""The bootstrap sections beyond the basics: stats tags/matcher, runtime, limits, tracing, sinks."""

from __future__ import annotations

import json
import logging
import re
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.metrics.v3 import stats_pb2  # noqa: F401  (registers Any types)
from envoy.config.trace.v3 import datadog_pb2, opentelemetry_pb2, zipkin_pb2  # noqa: F401
from envoy.extensions.access_loggers.file.v3 import file_pb2  # noqa: F401
from envoy.extensions.filters.http.router.v3 import router_pb2  # noqa: F401
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2  # noqa: F401
from envoy.extensions.resource_monitors.downstream_connections.v3 import downstream_connections_pb2  # noqa: F401
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2  # noqa: F401
from google.protobuf import json_format
from udpa.type.v1 import typed_struct_pb2  # noqa: F401

from istio_agent.bootstrap.envoy import build_bootstrap, write_bootstrap
from istio_agent.config import ConfigError
from istio_agent.config.bootstrap import BootstrapSettings
from istio_agent.envoy.process import envoy_command
from tests.bootstrap import make_settings

REQUIRED_PREFIXES = ["cluster_manager", "listener_manager", "server", "cluster.xds-grpc", "wasm"]
RBAC_SUFFIXES = ["rbac.allowed", "rbac.denied", "shadow_allowed", "shadow_denied"]
ROUTE_REGEX = r"vhost\..*\.route\..*"


def annotate(workdir: Path, annotations: dict[str, str]) -> None:
    """Write a downward-API annotations file (``key="quoted value"`` lines)."""
    path = workdir / "etc/istio/pod/annotations"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{key}={json.dumps(value)}\n" for key, value in annotations.items()))


def patterns(bootstrap: dict[str, Any]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = bootstrap["stats_config"]["stats_matcher"]["inclusion_list"]["patterns"]
    return found


def tag_names(bootstrap: dict[str, Any]) -> list[str]:
    return [tag["tag_name"] for tag in bootstrap["stats_config"]["stats_tags"]]


def static_layer(bootstrap: dict[str, Any]) -> dict[str, Any]:
    layer: dict[str, Any] = bootstrap["layered_runtime"]["layers"][0]["static_layer"]
    return layer


def connection_limit(bootstrap: dict[str, Any]) -> int:
    limit: int = bootstrap["overload_manager"]["resource_monitors"][0]["typed_config"][
        "max_active_downstream_connections"
    ]
    return limit


def clusters(bootstrap: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {cluster["name"]: cluster for cluster in bootstrap["static_resources"]["clusters"]}


# -- stats tags --------------------------------------------------------------------------------------
def test_default_stats_tags_in_istio_order(short_tmp: Path) -> None:
    bootstrap = build_bootstrap(make_settings(short_tmp))
    assert tag_names(bootstrap) == [
        "cluster_name",
        "http_conn_manager_prefix",
        "thread_name",
        "tcp_prefix",
        "response_code",
        "response_code_class",
        "http_conn_manager_listener_prefix",
        "listener_address",
        "mongo_prefix",
        "cache",
        "component",
        "tag",
        "wasm_filter",
        "authz_enforce_result",
        "authz_dry_run_action",
        "authz_dry_run_result",
    ]
    tags = {tag["tag_name"]: tag["regex"] for tag in bootstrap["stats_config"]["stats_tags"]}
    assert tags["cluster_name"] == r"^cluster(\.(.+);)"
    assert tags["http_conn_manager_prefix"] == (
        r"^http\.(((?:[_.[:digit:]\w]*|[_\[\]aAbBcCdDeEfF[:digit:]\w\:]*));\.)"
    )
    assert tags["response_code"] == r"_rq(_(\d{3}))$"
    # The regexes extract what Istio's do from stat names istiod produces (";"-terminated names).
    match = re.match(tags["cluster_name"], "cluster.outbound|80||a.b.svc.cluster.local;.upstream_rq_total")
    assert match is not None and match.group(2) == "outbound|80||a.b.svc.cluster.local"
    assert bootstrap["stats_config"]["use_all_default_tags"] is False


def test_static_clusters_have_tag_friendly_stat_names(short_tmp: Path) -> None:
    found = clusters(build_bootstrap(make_settings(short_tmp)))
    assert {name: cluster["alt_stat_name"] for name, cluster in found.items()} == {
        "prometheus_stats": "prometheus_stats;",
        "agent": "agent;",
        "sds-grpc": "sds-grpc;",
        "xds-grpc": "xds-grpc;",
    }


def test_extra_stat_tags_from_proxy_config_and_annotation_deduplicated(short_tmp: Path) -> None:
    annotate(short_tmp, {"sidecar.istio.io/extraStatTags": "dlp_status,dlp_success,,dlp_error,bad(tag"})
    bootstrap = build_bootstrap(make_settings(short_tmp, proxy_config={"extraStatTags": ["dlp_success", ""]}))
    names = tag_names(bootstrap)
    assert names[9:12] == ["dlp_success", "dlp_status", "dlp_error"]  # after mongo_prefix, before cache
    assert names[12] == "cache"
    assert "bad(tag" not in names
    regex = next(t["regex"] for t in bootstrap["stats_config"]["stats_tags"] if t["tag_name"] == "dlp_status")
    assert regex == r"(dlp_status=\.=(.*?);\.;)"
    assert re.search(regex, "istio_requests_total.dlp_status=.=ok;.;") is not None


# -- stats matcher -----------------------------------------------------------------------------------
def test_default_inclusion_list(short_tmp: Path) -> None:
    assert patterns(build_bootstrap(make_settings(short_tmp))) == [
        {"prefix": "reporter="},
        *({"prefix": p} for p in REQUIRED_PREFIXES),
        *({"suffix": s} for s in RBAC_SUFFIXES),
        {"safe_regex": {"regex": ROUTE_REGEX}},
        {"prefix": "component"},
        {"prefix": "istio"},
    ]


def test_inclusion_suffixes_with_exit_on_zero_active_connections(short_tmp: Path) -> None:
    found = patterns(
        build_bootstrap(make_settings(short_tmp, env={"EXIT_ON_ZERO_ACTIVE_CONNECTIONS": "true"}))
    )
    suffixes = [p["suffix"] for p in found if "suffix" in p]
    assert suffixes == [*RBAC_SUFFIXES, "downstream_cx_active"]


def test_route_regex_matches_route_stats() -> None:
    assert re.fullmatch(ROUTE_REGEX, "vhost.reviews.route.my_route.upstream_rq_200")
    assert not re.fullmatch(ROUTE_REGEX, "cluster.reviews.upstream_rq_200")


def test_proxy_config_stats_matcher(short_tmp: Path) -> None:
    matcher = {
        "inclusionPrefixes": ["upstream_cx", "http.{pod_ip}_"],
        "inclusionSuffixes": ["upstream_rq_time"],
        "inclusionRegexps": ["http.*_8080.*"],
    }
    settings = make_settings(
        short_tmp, env={"INSTANCE_IP": "10.1.1.0"}, proxy_config={"proxyStatsMatcher": matcher}
    )
    ips = list(dict.fromkeys(settings.ips))
    found = patterns(build_bootstrap(settings))
    assert found == [
        {"prefix": "reporter="},
        {"prefix": "upstream_cx"},
        *({"prefix": f"http.{ip}_"} for ip in ips),
        *({"prefix": p} for p in REQUIRED_PREFIXES),
        {"suffix": "upstream_rq_time"},
        *({"suffix": s} for s in RBAC_SUFFIXES),
        {"safe_regex": {"regex": "http.*_8080.*"}},
        {"safe_regex": {"regex": ROUTE_REGEX}},
        {"prefix": "component"},
        {"prefix": "istio"},
    ]
    assert found[2] == {"prefix": "http.10.1.1.0_"}


def test_annotation_replaces_proxy_config_per_kind(short_tmp: Path) -> None:
    annotate(
        short_tmp,
        {
            "sidecar.istio.io/statsInclusionPrefixes": "prefix1,prefix2",
            "sidecar.istio.io/statsInclusionRegexps": r"http.[0-9]*\.[0-9]*_8080.downstream_rq_time,(unclosed",
        },
    )
    matcher = {"inclusionPrefixes": ["from_pc"], "inclusionSuffixes": ["suffix_pc"]}
    found = patterns(build_bootstrap(make_settings(short_tmp, proxy_config={"proxyStatsMatcher": matcher})))
    assert [p["prefix"] for p in found if "prefix" in p] == [
        "reporter=",
        "prefix1",
        "prefix2",
        *REQUIRED_PREFIXES,
        "component",
        "istio",
    ]
    assert [p["suffix"] for p in found if "suffix" in p] == ["suffix_pc", *RBAC_SUFFIXES]  # not annotated
    assert [p["safe_regex"]["regex"] for p in found if "safe_regex" in p] == [
        r"http.[0-9]*\.[0-9]*_8080.downstream_rq_time",
        ROUTE_REGEX,
    ]  # the invalid regex is dropped, not handed to Envoy


# -- histogram buckets, flush and eviction intervals -------------------------------------------------
def test_histogram_buckets_sorted_by_prefix(short_tmp: Path) -> None:
    annotate(
        short_tmp,
        {
            "sidecar.istio.io/statsHistogramBuckets": json.dumps(
                {"istio": [1, 5, 10], "envoy": [1, 2.5], "bad": [0, -1], "empty": []}
            )
        },
    )
    config = build_bootstrap(make_settings(short_tmp))["stats_config"]
    assert config["histogram_bucket_settings"] == [
        {"match": {"prefix": "envoy"}, "buckets": [1.0, 2.5]},
        {"match": {"prefix": "istio"}, "buckets": [1.0, 5.0, 10.0]},
    ]
    assert list(config) == [
        "use_all_default_tags",
        "stats_tags",
        "histogram_bucket_settings",
        "stats_matcher",
    ]


def test_bad_histogram_annotation_is_a_warning(short_tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="istio.bootstrap")
    annotate(short_tmp, {"sidecar.istio.io/statsHistogramBuckets": "{not json"})
    assert "histogram_bucket_settings" not in build_bootstrap(make_settings(short_tmp))["stats_config"]
    assert "statsHistogramBuckets" in caplog.text


def test_no_intervals_unless_annotated(short_tmp: Path) -> None:
    bootstrap = build_bootstrap(make_settings(short_tmp))
    assert "stats_flush_interval" not in bootstrap
    assert "stats_eviction_interval" not in bootstrap


@pytest.mark.parametrize(
    ("annotations", "flush", "eviction"),
    [
        ({"sidecar.istio.io/statsFlushInterval": "10s"}, "10s", None),
        ({"sidecar.istio.io/statsFlushInterval": "1m"}, "60s", None),
        ({"sidecar.istio.io/statsFlushInterval": "500ms"}, "0.500s", None),
        ({"sidecar.istio.io/statsFlushInterval": "soon"}, None, None),
        ({"sidecar.istio.io/statsEvictionInterval": "10s"}, None, "10s"),  # multiple of the 5 s default
        ({"sidecar.istio.io/statsEvictionInterval": "7s"}, None, None),
        (
            {
                "sidecar.istio.io/statsFlushInterval": "2.005s",
                "sidecar.istio.io/statsEvictionInterval": "4.010s",
            },
            "2.005s",
            "4.010s",
        ),
        (
            {"sidecar.istio.io/statsFlushInterval": "3s", "sidecar.istio.io/statsEvictionInterval": "10s"},
            "3s",
            None,
        ),
    ],
)
def test_flush_and_eviction_intervals(
    short_tmp: Path, annotations: dict[str, str], flush: str | None, eviction: str | None
) -> None:
    annotate(short_tmp, annotations)
    bootstrap = build_bootstrap(make_settings(short_tmp))
    assert bootstrap.get("stats_flush_interval") == flush
    assert bootstrap.get("stats_eviction_interval") == eviction


# -- runtime values ----------------------------------------------------------------------------------
def test_runtime_values_merge(short_tmp: Path) -> None:
    runtime = {
        "re2.max_program_size.error_level": "",  # "" removes a default
        "envoy.reloadable_features.fixed_heap_use_allocated": "false",  # booleans become booleans
        "my.flag": "true",
        "my.number": "42",
    }
    layer = static_layer(build_bootstrap(make_settings(short_tmp, proxy_config={"runtimeValues": runtime})))
    assert "re2.max_program_size.error_level" not in layer
    assert layer["envoy.reloadable_features.fixed_heap_use_allocated"] is False
    assert layer["my.flag"] is True
    assert layer["my.number"] == "42"
    assert layer["envoy.reloadable_features.http_reject_path_with_fragment"] is False  # other defaults kept


# -- overload manager --------------------------------------------------------------------------------
META_LIMIT = "ISTIO_META_GLOBAL_DOWNSTREAM_MAX_CONNECTIONS"
RUNTIME_LIMIT = "overload.global_downstream_max_connections"


@pytest.mark.parametrize(
    ("proxy_config", "expected"),
    [
        ({}, 2147483647),
        ({"runtimeValues": {RUNTIME_LIMIT: "5000"}}, 5000),
        ({"proxyMetadata": {META_LIMIT: "20000"}, "runtimeValues": {RUNTIME_LIMIT: "5000"}}, 20000),
        (
            {
                "connectionSettings": {"globalDownstreamConnectionLimit": 25000},
                "proxyMetadata": {META_LIMIT: "20000"},
                "runtimeValues": {RUNTIME_LIMIT: "5000"},
            },
            25000,
        ),
        (
            {
                "connectionSettings": {"globalDownstreamConnectionLimit": 0},
                "proxyMetadata": {META_LIMIT: "7"},
            },
            7,
        ),
    ],
)
def test_global_connection_limit_precedence(
    short_tmp: Path, proxy_config: dict[str, Any], expected: int
) -> None:
    assert connection_limit(build_bootstrap(make_settings(short_tmp, proxy_config=proxy_config))) == expected


def test_bad_runtime_connection_limit_names_the_key(short_tmp: Path) -> None:
    with pytest.raises(ConfigError, match=r"runtimeValues overload\.global_downstream_max_connections"):
        make_settings(short_tmp, proxy_config={"runtimeValues": {RUNTIME_LIMIT: "many"}})


# -- tracing -----------------------------------------------------------------------------------------
def test_zipkin(short_tmp: Path) -> None:
    bootstrap = build_bootstrap(
        make_settings(
            short_tmp, proxy_config={"tracing": {"zipkin": {"address": "zipkin.istio-system:9411"}}}
        )
    )
    assert bootstrap["tracing"] == {
        "http": {
            "name": "envoy.tracers.zipkin",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.config.trace.v3.ZipkinConfig",
                "collector_cluster": "zipkin",
                "collector_endpoint": "/api/v2/spans",
                "collector_endpoint_version": "HTTP_JSON",
                "trace_id_128bit": True,
                "shared_span_context": False,
            },
        }
    }
    zipkin = clusters(bootstrap)["zipkin"]
    assert zipkin["type"] == "STRICT_DNS"
    assert zipkin["dns_refresh_rate"] == "30s"
    assert zipkin["dns_lookup_family"] == "V4_ONLY"
    assert zipkin["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"] == {
        "socket_address": {"address": "zipkin.istio-system", "port_value": 9411}
    }


def test_datadog_service_name_is_the_node_cluster(short_tmp: Path) -> None:
    settings = make_settings(
        short_tmp,
        env={"ISTIO_METAJSON_LABELS": '{"app": "reviews"}', "HOST_IP": "10.0.0.9"},
        proxy_config={"tracing": {"datadog": {"address": "$(HOST_IP):8126"}}},
    )
    bootstrap = build_bootstrap(settings)
    assert bootstrap["tracing"]["http"]["name"] == "envoy.tracers.datadog"
    assert bootstrap["tracing"]["http"]["typed_config"] == {
        "@type": "type.googleapis.com/envoy.config.trace.v3.DatadogConfig",
        "collector_cluster": "datadog_agent",
        "service_name": "reviews.default",
    }
    address = clusters(bootstrap)["datadog_agent"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    assert address["endpoint"]["address"]["socket_address"] == {"address": "10.0.0.9", "port_value": 8126}


def test_host_ip_placeholder_without_host_ip_is_an_error(short_tmp: Path) -> None:
    settings = make_settings(short_tmp, proxy_config={"tracing": {"datadog": {"address": "$(HOST_IP):8126"}}})
    with pytest.raises(ConfigError, match=r"tracing\.datadog\.address.*HOST_IP"):
        build_bootstrap(settings)


def test_lightstep_token_file_and_otlp_tracer(short_tmp: Path) -> None:
    token = "s3cr3t-token"
    settings = make_settings(
        short_tmp,
        proxy_config={
            "tracing": {"lightstep": {"address": "lightstep-satellite:8080", "accessToken": token}}
        },
    )
    path = write_bootstrap(settings)
    token_file = settings.lightstep_token_path
    assert token_file == settings.config_path / "lightstep_access_token.txt"
    assert token_file.read_text() == token
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # the bootstrap carries the token too
    bootstrap = json.loads(path.read_text())
    assert bootstrap["tracing"]["http"]["name"] == "envoy.tracers.opentelemetry"
    config = bootstrap["tracing"]["http"]["typed_config"]
    assert config["grpc_service"] == {
        "envoy_grpc": {"cluster_name": "lightstep"},
        "initial_metadata": [{"key": "lightstep-access-token", "value": token}],
    }
    assert config["service_name"] == "istio-proxy.default"
    assert "http2_protocol_options" in json.dumps(clusters(bootstrap)["lightstep"])
    # the token is not sent to istiod in node metadata
    assert token not in json.dumps(bootstrap["node"]["metadata"])
    assert bootstrap["node"]["metadata"]["PROXY_CONFIG"]["tracing"] == {
        "lightstep": {"address": "lightstep-satellite:8080"}
    }


def test_no_tracing_by_default_and_ignored_tracers(short_tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert "tracing" not in build_bootstrap(make_settings(short_tmp))
    caplog.set_level(logging.WARNING, logger="istio.config")
    bootstrap = build_bootstrap(make_settings(short_tmp, proxy_config={"tracing": {"stackdriver": {}}}))
    assert "tracing" not in bootstrap
    assert list(clusters(bootstrap)) == ["prometheus_stats", "agent", "sds-grpc", "xds-grpc"]
    assert "stackdriver" in caplog.text


# -- statsd, cluster manager, deferred stats ---------------------------------------------------------
def test_statsd_sink_resolved_to_an_ip(short_tmp: Path) -> None:
    bootstrap = build_bootstrap(make_settings(short_tmp, proxy_config={"statsdUdpAddress": "localhost:8125"}))
    sink = bootstrap["stats_sinks"][0]
    assert sink["name"] == "envoy.stat_sinks.statsd"
    assert sink["typed_config"]["address"]["socket_address"] in (
        {"protocol": "UDP", "address": "127.0.0.1", "port_value": 8125},
        {"protocol": "UDP", "address": "::1", "port_value": 8125},
    )


def test_unresolvable_statsd_is_dropped_with_a_warning(
    short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="istio.config")
    settings = make_settings(short_tmp, proxy_config={"statsdUdpAddress": "no-such-host.invalid:8125"})
    assert settings.statsd_address == ""
    assert "stats_sinks" not in build_bootstrap(settings)
    assert "statsdUdpAddress" in caplog.text


def test_cluster_manager_only_with_outlier_log_path(short_tmp: Path) -> None:
    assert "cluster_manager" not in build_bootstrap(make_settings(short_tmp))
    settings = make_settings(short_tmp, outlier_log_path="/dev/stdout")
    bootstrap = build_bootstrap(settings)
    assert bootstrap["cluster_manager"] == {
        "enable_deferred_cluster_creation": True,
        "outlier_detection": {"event_log_path": "/dev/stdout"},
    }
    assert bootstrap["node"]["metadata"]["OUTLIER_LOG_PATH"] == "/dev/stdout"


def test_deferred_stat_creation_always_on(short_tmp: Path) -> None:
    bootstrap = build_bootstrap(make_settings(short_tmp))
    assert bootstrap["deferred_stat_options"] == {"enable_deferred_creation_stats": True}


# -- every variant is accepted by Envoy ---------------------------------------------------------------
ALL_STATS_ANNOTATIONS = {
    "sidecar.istio.io/extraStatTags": "dlp_status,dlp_error",
    "sidecar.istio.io/statsInclusionPrefixes": "prefix1,http.{pod_ip}_",
    "sidecar.istio.io/statsInclusionSuffixes": "upstream_rq_time,downstream_cx_total",
    "sidecar.istio.io/statsInclusionRegexps": r"http.[0-9]*\.[0-9]*_8080.downstream_rq_time",
    "sidecar.istio.io/statsHistogramBuckets": '{"istio": [1, 5, 10], "envoy": [1, 2.5]}',
    "sidecar.istio.io/statsFlushInterval": "2.005s",
    "sidecar.istio.io/statsEvictionInterval": "4.010s",
}


def _annotated(workdir: Path, annotations: dict[str, str], **options: Any) -> BootstrapSettings:
    annotate(workdir, annotations)
    return make_settings(workdir, **options)


VARIANTS: dict[str, Callable[[Path], BootstrapSettings]] = {
    "zipkin": lambda d: make_settings(d, proxy_config={"tracing": {"zipkin": {"address": "zipkin:9411"}}}),
    "datadog": lambda d: make_settings(
        d, env={"HOST_IP": "10.0.0.9"}, proxy_config={"tracing": {"datadog": {"address": "$(HOST_IP):8126"}}}
    ),
    "lightstep": lambda d: make_settings(
        d, proxy_config={"tracing": {"lightstep": {"address": "ls:8080", "accessToken": "t0ken"}}}
    ),
    "statsd": lambda d: make_settings(d, proxy_config={"statsdUdpAddress": "127.0.0.1:8125"}),
    "stats-matcher-and-tags": lambda d: _annotated(
        d,
        ALL_STATS_ANNOTATIONS,
        env={"EXIT_ON_ZERO_ACTIVE_CONNECTIONS": "true"},
        proxy_config={
            "extraStatTags": ["dlp_success", "dlp_status"],
            "proxyStatsMatcher": {"inclusionPrefixes": ["upstream_cx"], "inclusionSuffixes": ["x_total"]},
        },
    ),
    "eviction-only": lambda d: _annotated(d, {"sidecar.istio.io/statsEvictionInterval": "120s"}),
    "overload-limits": lambda d: make_settings(
        d,
        proxy_config={
            "connectionSettings": {"globalDownstreamConnectionLimit": 25000},
            "proxyMetadata": {META_LIMIT: "20000"},
            "runtimeValues": {RUNTIME_LIMIT: "5000"},
        },
    ),
    "runtime-values": lambda d: make_settings(
        d,
        proxy_config={
            "runtimeValues": {
                "re2.max_program_size.error_level": "",
                "envoy.reloadable_features.fixed_heap_use_allocated": "false",
                "envoy.resource_limits.listener.example.connection_limit": "100",
            }
        },
    ),
    "outlier-log": lambda d: make_settings(
        d, outlier_log_path="/dev/stdout", proxy_config={"concurrency": 2}
    ),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_parses_as_envoy_proto(variant: str, short_tmp: Path) -> None:
    bootstrap = build_bootstrap(VARIANTS[variant](short_tmp))
    message = json_format.ParseDict(json.loads(json.dumps(bootstrap)), bootstrap_pb2.Bootstrap())
    assert message.node.id == bootstrap["node"]["id"]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_envoy_validates_variant(variant: str, short_tmp: Path) -> None:
    settings = VARIANTS[variant](short_tmp)
    command = [*envoy_command(settings, write_bootstrap(settings)), "--mode", "validate"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert " OK" in done.stdout


def test_envoy_rejects_a_bad_eviction_interval(short_tmp: Path) -> None:
    """The validation above can fail on these sections: Envoy checks the eviction/flush ratio itself."""
    settings = make_settings(short_tmp)
    bootstrap = build_bootstrap(settings)
    bootstrap["stats_flush_interval"], bootstrap["stats_eviction_interval"] = "3s", "10s"
    path = short_tmp / "broken.json"
    path.write_text(json.dumps(bootstrap))
    command = [*envoy_command(settings, path), "--mode", "validate"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode != 0
    assert "stats_eviction_interval must be a multiple" in done.stdout + done.stderr
