from __future__ import annotations

import dataclasses
import json
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.extensions.access_loggers.file.v3 import file_pb2  # noqa: F401  (registers Any types)
from envoy.extensions.filters.http.router.v3 import router_pb2  # noqa: F401
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2  # noqa: F401
from envoy.extensions.resource_monitors.downstream_connections.v3 import downstream_connections_pb2  # noqa: F401
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2  # noqa: F401
from google.protobuf import json_format
from udpa.type.v1 import typed_struct_pb2  # noqa: F401

from istio_agent.bootstrap.envoy import TEXT_LOG_FORMAT, build_bootstrap, write_bootstrap
from istio_agent.config.bootstrap import BootstrapSettings
from istio_agent.envoy.process import envoy_command
from tests.bootstrap import FakeHost, make_settings


def by_name(items: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in items}


def route_of(listener: dict[str, Any]) -> dict[str, Any]:
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    route: dict[str, Any] = manager["route_config"]["virtual_hosts"][0]["routes"][0]
    return route


def endpoint_address(cluster: dict[str, Any]) -> dict[str, Any]:
    address: dict[str, Any] = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"][
        "address"
    ]
    return address


# -- contents ----------------------------------------------------------------------------------------
def test_node_section(short_tmp: Path) -> None:
    settings = make_settings(short_tmp)
    node = build_bootstrap(settings)["node"]
    assert node["id"] == "sidecar~10.1.1.0~v0.default~default.svc.cluster.local"
    assert node["cluster"] == "istio-proxy.default"
    assert node["metadata"] == settings.metadata
    assert "locality" not in node


def test_locality_present_when_labelled(short_tmp: Path) -> None:
    settings = make_settings(
        short_tmp, env={"ISTIO_METAJSON_LABELS": '{"istio-locality": "r.z.s", "app": "a"}'}
    )
    node = build_bootstrap(settings)["node"]
    assert node["locality"] == {"region": "r", "zone": "z", "sub_zone": "s"}
    assert node["cluster"] == "a.default"


def test_dynamic_resources_delta_by_default(short_tmp: Path) -> None:
    dynamic = build_bootstrap(make_settings(short_tmp))["dynamic_resources"]
    for kind in ("lds_config", "cds_config"):
        assert dynamic[kind] == {"ads": {}, "initial_fetch_timeout": "0s", "resource_api_version": "V3"}
    assert dynamic["ads_config"] == {
        "api_type": "DELTA_GRPC",
        "set_node_on_first_message_only": True,
        "transport_api_version": "V3",
        "grpc_services": [{"envoy_grpc": {"cluster_name": "xds-grpc"}}],
    }


def test_state_of_the_world_when_delta_disabled(short_tmp: Path) -> None:
    sotw = build_bootstrap(make_settings(short_tmp, env={"ISTIO_DELTA_XDS": "false"}))
    assert sotw["dynamic_resources"]["ads_config"]["api_type"] == "GRPC"
    waypoint = build_bootstrap(
        make_settings(short_tmp, env={"ISTIO_DELTA_XDS": "false"}, proxy_type="waypoint")
    )
    assert waypoint["dynamic_resources"]["ads_config"]["api_type"] == "DELTA_GRPC"


def test_static_clusters(short_tmp: Path) -> None:
    settings = make_settings(short_tmp, proxy_config={"proxyAdminPort": 25000, "statusPort": 25020})
    clusters = by_name(build_bootstrap(settings)["static_resources"]["clusters"])
    assert list(clusters) == ["prometheus_stats", "agent", "sds-grpc", "xds-grpc"]
    assert endpoint_address(clusters["prometheus_stats"])["socket_address"]["port_value"] == 25000
    assert endpoint_address(clusters["agent"])["socket_address"] == {
        "protocol": "TCP",
        "address": "127.0.0.1",
        "port_value": 25020,
    }
    assert clusters["prometheus_stats"]["connect_timeout"] == "0.250s"
    assert endpoint_address(clusters["sds-grpc"]) == {"pipe": {"path": str(settings.sds_socket_path)}}
    xds = clusters["xds-grpc"]
    assert endpoint_address(xds) == {"pipe": {"path": str(short_tmp.absolute() / "etc/istio/proxy/XDS")}}
    assert xds["connect_timeout"] == "1s"
    assert xds["max_requests_per_connection"] == 1
    assert xds["upstream_connection_options"] == {"tcp_keepalive": {"keepalive_time": 300}}
    thresholds = xds["circuit_breakers"]["thresholds"]
    assert [t["priority"] for t in thresholds] == ["DEFAULT", "HIGH"]
    assert all(
        t["max_connections"] == t["max_pending_requests"] == t["max_requests"] == 100000 for t in thresholds
    )
    options = xds["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    assert options["explicit_http_config"] == {"http2_protocol_options": {}}


def test_static_listeners(short_tmp: Path) -> None:
    settings = make_settings(short_tmp, env={"ENVOY_STATUS_PORT": "25021", "ENVOY_PROMETHEUS_PORT": "25090"})
    listeners = by_name(build_bootstrap(settings)["static_resources"]["listeners"])
    assert list(listeners) == ["0.0.0.0_25090", "0.0.0.0_25021"]
    stats, ready = listeners["0.0.0.0_25090"], listeners["0.0.0.0_25021"]
    assert stats["address"]["socket_address"] == {
        "protocol": "TCP",
        "address": "0.0.0.0",
        "port_value": 25090,
    }
    assert route_of(stats) == {
        "match": {"prefix": "/stats/prometheus"},
        "route": {"cluster": "prometheus_stats"},
    }
    assert route_of(ready) == {"match": {"prefix": "/healthz/ready"}, "route": {"cluster": "agent"}}
    for listener in (stats, ready):
        assert listener["ignore_global_conn_limit"] is True
        assert listener["bypass_overload_manager"] is True
    prefixes = [
        listener["filter_chains"][0]["filters"][0]["typed_config"]["stat_prefix"]
        for listener in (stats, ready)
    ]
    assert prefixes == ["stats", "agent"]


def test_listener_host_is_configurable(short_tmp: Path) -> None:
    listeners = build_bootstrap(make_settings(short_tmp, listener_host="127.0.0.1"))["static_resources"][
        "listeners"
    ]
    assert [listener["name"] for listener in listeners] == ["127.0.0.1_15090", "127.0.0.1_15021"]
    assert {listener["address"]["socket_address"]["address"] for listener in listeners} == {"127.0.0.1"}


def test_admin_runtime_and_limits(short_tmp: Path) -> None:
    bootstrap = build_bootstrap(make_settings(short_tmp, proxy_config={"proxyAdminPort": 25000}))
    admin = bootstrap["admin"]
    assert admin["address"]["socket_address"]["address"] == "127.0.0.1"
    assert admin["address"]["socket_address"]["port_value"] == 25000
    assert admin["access_log"][0]["typed_config"]["path"] == "/dev/null"
    assert admin["profile_path"] == str(short_tmp / "var/lib/istio/data/envoy.prof")
    layers = bootstrap["layered_runtime"]["layers"]
    assert [layer["name"] for layer in layers] == ["global config", "admin"]
    assert layers[0]["static_layer"]["re2.max_program_size.error_level"] == "32768"
    assert layers[0]["static_layer"]["envoy.reloadable_features.http_reject_path_with_fragment"] is False
    assert layers[1] == {"name": "admin", "admin_layer": {}}
    assert bootstrap["stats_config"]["use_all_default_tags"] is False
    monitor = bootstrap["overload_manager"]["resource_monitors"][0]
    assert monitor["name"] == "envoy.resource_monitors.global_downstream_max_connections"
    assert monitor["typed_config"]["max_active_downstream_connections"] == 2147483647
    extension = bootstrap["bootstrap_extensions"][0]
    assert extension["name"] == "envoy.bootstrap.internal_listener"
    assert extension["typed_config"]["value"] == {"buffer_size_kb": 64}


def test_strip_fragment_runtime_flag(short_tmp: Path) -> None:
    settings = make_settings(short_tmp, env={"HTTP_STRIP_FRAGMENT_FROM_PATH_UNSAFE_IF_DISABLED": "false"})
    static = build_bootstrap(settings)["layered_runtime"]["layers"][0]["static_layer"]
    assert static["envoy.reloadable_features.http_strip_fragment_from_path_unsafe_if_disabled"] == "false"


def test_log_format_text_and_json(short_tmp: Path) -> None:
    text = build_bootstrap(make_settings(short_tmp))["application_log_config"]
    assert text == {"log_format": {"text_format": TEXT_LOG_FORMAT}}
    as_json = build_bootstrap(make_settings(short_tmp, log_as_json=True))["application_log_config"]
    assert set(as_json["log_format"]["json_format"]) == {"time", "level", "scope", "msg", "caller", "thread"}


def test_write_bootstrap_atomically(short_tmp: Path) -> None:
    settings = make_settings(short_tmp)
    path = write_bootstrap(settings)
    assert path == short_tmp.absolute() / "etc/istio/proxy/envoy-rev.json"
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert json.loads(path.read_text()) == json.loads(json.dumps(build_bootstrap(settings)))
    changed = dataclasses.replace(settings, node_id="router~1.2.3.4~x.y~y.svc.cluster.local")
    assert write_bootstrap(changed) == path
    assert json.loads(path.read_text())["node"]["id"] == "router~1.2.3.4~x.y~y.svc.cluster.local"
    assert [p.name for p in path.parent.iterdir()] == ["envoy-rev.json"]  # no temporary files left


# -- every variant is a valid Envoy bootstrap --------------------------------------------------------
def _ipv6_only(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> BootstrapSettings:
    return make_settings(short_tmp, env={"INSTANCE_IP": "fd00::7"}, host=FakeHost([("eth0", "fd00::7")]))


def _with_override(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> BootstrapSettings:
    (short_tmp / "override.yaml").write_text("stats_flush_interval: 10s\n")
    return make_settings(short_tmp, env={"ISTIO_BOOTSTRAP_OVERRIDE": "override.yaml"})


VARIANTS: dict[str, Callable[[Path, pytest.MonkeyPatch], BootstrapSettings]] = {
    "delta": lambda d, m: make_settings(d),
    "sotw": lambda d, m: make_settings(d, env={"ISTIO_DELTA_XDS": "false"}),
    "json-logs": lambda d, m: make_settings(d, log_as_json=True),
    "custom-ports": lambda d, m: make_settings(
        d,
        env={"ENVOY_STATUS_PORT": "25021", "ENVOY_PROMETHEUS_PORT": "25090"},
        proxy_config={"proxyAdminPort": 25000, "statusPort": 25020},
        listener_host="127.0.0.1",
    ),
    "router-levels": lambda d, m: make_settings(
        d, proxy_type="router", log_level="info,misc:error,upstream:debug", concurrency=2
    ),
    "labels-locality": lambda d, m: make_settings(
        d,
        env={"ISTIO_METAJSON_LABELS": '{"app": "a", "istio-locality": "r.z"}', "ISTIO_META_CLUSTER_ID": "c1"},
        proxy_config={"proxyMetadata": {"ISTIO_META_GLOBAL_DOWNSTREAM_MAX_CONNECTIONS": "1000"}},
    ),
    "no-fragment-strip": lambda d, m: make_settings(
        d,
        env={
            "HTTP_STRIP_FRAGMENT_FROM_PATH_UNSAFE_IF_DISABLED": "false",
            "ENVOY_SKIP_DEPRECATED_LOGS": "false",
        },
    ),
    "ipv6-only": _ipv6_only,
    "override": _with_override,
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_bootstrap_parses_as_envoy_proto(
    variant: str, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bootstrap = build_bootstrap(VARIANTS[variant](short_tmp, monkeypatch))
    message = json_format.ParseDict(json.loads(json.dumps(bootstrap)), bootstrap_pb2.Bootstrap())
    assert message.node.id == bootstrap["node"]["id"]
    assert len(message.static_resources.clusters) == 4


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_envoy_validates_bootstrap(variant: str, short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = VARIANTS[variant](short_tmp, monkeypatch)
    command = [*envoy_command(settings, write_bootstrap(settings)), "--mode", "validate"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert " OK" in done.stdout


def test_envoy_rejects_a_broken_bootstrap(short_tmp: Path) -> None:
    """The validation above can fail: a dangling cluster reference is refused."""
    settings = make_settings(short_tmp)
    bootstrap = build_bootstrap(settings)
    bootstrap["dynamic_resources"]["ads_config"]["grpc_services"][0]["envoy_grpc"]["cluster_name"] = "nope"
    path = short_tmp / "broken.json"
    path.write_text(json.dumps(bootstrap))
    command = [*envoy_command(settings, path), "--mode", "validate"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode != 0
    assert "Unknown gRPC client cluster 'nope'" in done.stdout + done.stderr
