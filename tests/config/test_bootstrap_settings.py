from __future__ import annotations

import ipaddress
import json
import logging
import re
from datetime import timedelta
from pathlib import Path

import pytest

from istio_agent import ISTIO_VERSION
from istio_agent.config import ConfigError, Env, ProxyConfig
from istio_agent.config.bootstrap import node_ips, split_log_level
from istio_agent.host import interface_addresses
from tests.bootstrap import FakeHost, make_settings


def write_pod_file(workdir: Path, name: str, text: str) -> None:
    path = workdir / "etc/istio/pod" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_defaults(tmp_path: Path) -> None:
    s = make_settings(tmp_path)
    assert s.proxy_type == "sidecar"
    assert s.node_id == "sidecar~10.1.1.0~v0.default~default.svc.cluster.local"
    assert s.ips[0] == "10.1.1.0"
    assert s.domain == "default.svc.cluster.local"
    assert s.service_cluster == "istio-proxy.default"
    assert (s.envoy_status_port, s.envoy_prometheus_port) == (15021, 15090)
    assert (s.proxy_admin_port, s.status_port) == (15000, 15020)
    assert s.delta_xds and s.skip_deprecated_logs and not s.enable_core_dump
    assert s.drain_duration == timedelta(seconds=45)
    assert s.termination_drain_duration == timedelta(seconds=5)
    assert s.file_flush_interval == timedelta(seconds=1)
    assert (s.log_level, s.component_log_level, s.concurrency) == ("warning", "", 0)
    assert s.config_path == tmp_path.absolute() / "etc/istio/proxy"
    assert s.bootstrap_path == s.config_path / "envoy-rev.json"
    assert s.xds_socket_path == s.config_path / "XDS"
    assert s.sds_socket_path == tmp_path / "var/run/secrets/workload-spiffe-uds/socket"
    assert s.profile_path == tmp_path / "var/lib/istio/data/envoy.prof"
    assert s.binary == Path("/usr/local/bin/envoy")  # resolved when Envoy starts (envoy.binary.envoy_to_run)
    assert (s.listener_host, s.prometheus_host, s.localhost) == ("0.0.0.0", "0.0.0.0", "127.0.0.1")
    assert s.metadata["ISTIO_VERSION"] == ISTIO_VERSION
    assert s.metadata["NAME"] == "v0" and s.metadata["NAMESPACE"] == "default"
    assert s.metadata["PILOT_SAN"] == ["istiod.istio-system.svc"]
    assert s.max_downstream_connections == 2147483647
    assert s.locality == {}


def test_explicit_domain_type_and_ports(tmp_path: Path) -> None:
    s = make_settings(
        tmp_path,
        env={"ENVOY_STATUS_PORT": "25021", "ENVOY_PROMETHEUS_PORT": "25090", "ISTIO_DELTA_XDS": "false"},
        proxy_config={"proxyAdminPort": 25000, "statusPort": 25020, "drainDuration": "10s"},
        proxy_type="router",
        domain="example.internal",
    )
    assert s.node_id == "router~10.1.1.0~v0.default~example.internal"
    assert (s.envoy_status_port, s.envoy_prometheus_port) == (25021, 25090)
    assert s.metadata["ENVOY_STATUS_PORT"] == 25021 and s.metadata["ENVOY_PROMETHEUS_PORT"] == 25090
    assert (s.proxy_admin_port, s.status_port) == (25000, 25020)
    assert s.admin_url == "http://127.0.0.1:25000"
    assert s.drain_duration == timedelta(seconds=10)
    assert not s.delta_xds


def test_empty_domain_uses_namespace(tmp_path: Path) -> None:
    assert make_settings(tmp_path, env={"POD_NAMESPACE": "prod"}).domain == "prod.svc.cluster.local"


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"ENVOY_STATUS_PORT": "abc"}, "ENVOY_STATUS_PORT"),
        ({"ENVOY_STATUS_PORT": "0"}, "ENVOY_STATUS_PORT"),
        ({"ENVOY_PROMETHEUS_PORT": "70000"}, "ENVOY_PROMETHEUS_PORT"),
        ({"ISTIO_DELTA_XDS": "maybe"}, "ISTIO_DELTA_XDS"),
        ({"ENVOY_SKIP_DEPRECATED_LOGS": "yes"}, "ENVOY_SKIP_DEPRECATED_LOGS"),
        ({"ISTIO_ENVOY_ENABLE_CORE_DUMP": "2"}, "ISTIO_ENVOY_ENABLE_CORE_DUMP"),
        ({"EXIT_ON_ZERO_ACTIVE_CONNECTIONS": "on"}, "EXIT_ON_ZERO_ACTIVE_CONNECTIONS"),
        ({"ISTIO_CPU_LIMIT": "two"}, "ISTIO_CPU_LIMIT"),
        ({"ISTIO_METAJSON_LABELS": "{not json"}, "ISTIO_METAJSON_LABELS"),
        ({"ISTIO_METAJSON_LABELS": '["a"]'}, "ISTIO_METAJSON_LABELS"),
        ({"ISTIO_METAJSON_LABELS": '{"replicas": 3}'}, "ISTIO_METAJSON_LABELS"),
        ({"ISTIO_METAJSON_EXTRA": "42"}, "ISTIO_METAJSON_EXTRA"),
    ],
)
def test_bad_env_values_name_the_variable(tmp_path: Path, env: dict[str, str], variable: str) -> None:
    with pytest.raises(ConfigError, match=variable):
        make_settings(tmp_path, env=env)


def test_bad_proxy_type(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="invalid proxy Type: gateway"):
        make_settings(tmp_path, proxy_type="gateway")


def test_bad_global_connection_limit(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="ISTIO_META_GLOBAL_DOWNSTREAM_MAX_CONNECTIONS"):
        make_settings(
            tmp_path, proxy_config={"proxyMetadata": {"ISTIO_META_GLOBAL_DOWNSTREAM_MAX_CONNECTIONS": "x"}}
        )
    s = make_settings(
        tmp_path, proxy_config={"proxyMetadata": {"ISTIO_META_GLOBAL_DOWNSTREAM_MAX_CONNECTIONS": "100"}}
    )
    assert s.max_downstream_connections == 100


# -- log levels ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("proxy_log_level", "component", "expected"),
    [
        ("info", "", ("info", "")),
        ("info,warn", "", ("warn", "")),
        ("warning", "misc:error", ("warning", "misc:error")),
        ("info,misc:error,upstream:debug", "misc:warn", ("info", "misc:error,upstream:debug")),
        ("upstream:debug,misc:error", "", ("", "upstream:debug,misc:error")),
        ("info,a:b:c", "", ("info", "")),
    ],
)
def test_split_log_level(proxy_log_level: str, component: str, expected: tuple[str, str]) -> None:
    assert split_log_level(proxy_log_level, component) == expected


def test_invalid_log_levels_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="--proxyLogLevel"):
        split_log_level("loud")
    with pytest.raises(ConfigError, match="--proxyLogLevel"):
        split_log_level("info,misc:loud")
    with pytest.raises(ConfigError, match="--proxyComponentLogLevel"):
        split_log_level("info", "misc")


def test_log_levels_reach_settings(tmp_path: Path) -> None:
    s = make_settings(
        tmp_path, log_level="debug,misc:error", component_log_level="upstream:info", log_as_json=True
    )
    assert (s.log_level, s.component_log_level, s.log_as_json) == ("debug", "misc:error", True)


# -- concurrency ---------------------------------------------------------------------------------------
def test_concurrency_from_cpu_limit_and_flag(tmp_path: Path) -> None:
    assert make_settings(tmp_path, env={"ISTIO_CPU_LIMIT": "3"}).concurrency == 3
    assert make_settings(tmp_path, env={"ISTIO_CPU_LIMIT": "3"}, concurrency=5).concurrency == 5
    with pytest.raises(ConfigError, match="--concurrency"):
        make_settings(tmp_path, concurrency=-1)


# -- IPs ---------------------------------------------------------------------------------------------
def test_node_ips_order_and_dedupe() -> None:
    interfaces = [("eth0", "10.0.0.5"), ("eth0", "fd00::5"), ("eth1", "10.0.0.6")]
    assert node_ips("10.0.0.6", interfaces, set()) == ("10.0.0.6", "10.0.0.5", "fd00::5")


def test_node_ips_ignores_unparsable_instance_ip(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="istio.bootstrap")
    assert node_ips("not-an-ip", [("eth0", "10.0.0.5")], set()) == ("10.0.0.5",)
    assert "INSTANCE_IP" in caplog.text


def test_node_ips_fall_back_to_loopback() -> None:
    assert node_ips("", [], set()) == ("127.0.0.1", "::1")
    assert node_ips("10.1.1.1", [], set()) == ("10.1.1.1", "127.0.0.1", "::1")


def test_node_ips_exclude_interfaces() -> None:
    interfaces = [("eth0", "10.0.0.5"), ("net1", "192.168.9.9")]
    assert node_ips("", interfaces, {"net1"}) == ("10.0.0.5",)


def test_exclude_interfaces_annotation_is_honoured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_pod_file(tmp_path, "annotations", 'traffic.sidecar.istio.io/excludeInterfaces="net1, other"\n')
    s = make_settings(
        tmp_path, env={"INSTANCE_IP": ""}, host=FakeHost([("eth0", "10.0.0.5"), ("net1", "192.168.9.9")])
    )
    assert s.ips == ("10.0.0.5",)
    assert s.node_id.startswith("sidecar~10.0.0.5~")


def test_interface_addresses_are_usable_ips() -> None:
    for name, ip in interface_addresses():
        address = ipaddress.ip_address(ip)
        assert not (address.is_loopback or address.is_link_local or address.is_unspecified), (name, ip)


def test_ipv6_only_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = make_settings(tmp_path, env={"INSTANCE_IP": "fd00::7"}, host=FakeHost([("eth0", "fd00::7")]))
    assert s.ips == ("fd00::7",) and s.ipv6_only
    assert (s.localhost, s.listener_host) == ("::1", "::")
    assert s.admin_url == "http://[::1]:15000"


# -- pod files and metadata --------------------------------------------------------------------------
def test_labels_file_and_metajson(tmp_path: Path) -> None:
    write_pod_file(tmp_path, "labels", 'app="reviews"\npod-template-hash="abc"\nistio-locality="r1.z1"\n')
    write_pod_file(tmp_path, "annotations", 'kubectl.kubernetes.io/default-container="app"\n')
    s = make_settings(tmp_path, env={"ISTIO_METAJSON_LABELS": '{"app":"old","version":"v1"}'})
    assert s.metadata["LABELS"] == {"app": "reviews", "version": "v1", "istio-locality": "r1/z1"}
    assert s.metadata["ANNOTATIONS"] == {"kubectl.kubernetes.io/default-container": "app"}
    assert s.metadata["app"] == "old"  # raw METAJSON keys at the top level, as Istio
    assert s.service_cluster == "reviews.default"
    assert s.locality == {"region": "r1", "zone": "z1"}


def test_bad_labels_file_is_a_config_error(tmp_path: Path) -> None:
    write_pod_file(tmp_path, "labels", "app=unquoted\n")
    with pytest.raises(ConfigError, match="labels"):
        make_settings(tmp_path)


def test_env_metadata_over_proxy_metadata(tmp_path: Path) -> None:
    s = make_settings(
        tmp_path,
        env={
            "ISTIO_META_WORKLOAD_NAME": "from-env",
            "ISTIO_META_CLUSTER_ID": "Kubernetes",
            "DNS_PROXY_ADDR": ":15053",
        },
        proxy_config={"proxyMetadata": {"ISTIO_META_WORKLOAD_NAME": "from-pc", "ISTIO_META_NETWORK": "n1"}},
    )
    assert s.metadata["WORKLOAD_NAME"] == "from-env"
    assert s.metadata["NETWORK"] == "n1"
    assert s.metadata["CLUSTER_ID"] == "Kubernetes"
    assert s.metadata["DNS_PROXY_ADDR"] == ":15053"
    assert s.service_cluster == "from-env.default"
    assert s.metadata["PROXY_CONFIG"]["proxyMetadata"] == {
        "ISTIO_META_WORKLOAD_NAME": "from-pc",
        "ISTIO_META_NETWORK": "n1",
    }


def test_pilot_san_only_under_mutual_tls(tmp_path: Path) -> None:
    s = make_settings(
        tmp_path, proxy_config={"controlPlaneAuthPolicy": "NONE", "discoveryAddress": "cp:15010"}
    )
    assert "PILOT_SAN" not in s.metadata
    s = make_settings(tmp_path, proxy_config={"discoveryAddress": "localhost:15012"})
    assert s.metadata["PILOT_SAN"] == ["istiod.istio-system.svc"]


def test_metrics_localhost_only_binds_prometheus_listener_locally(tmp_path: Path) -> None:
    s = make_settings(tmp_path, proxy_config={"proxyMetadata": {"METRICS_LOCALHOST_ACCESS_ONLY": "true"}})
    assert (s.prometheus_host, s.listener_host) == ("127.0.0.1", "0.0.0.0")


def test_listener_host_override(tmp_path: Path) -> None:
    s = make_settings(tmp_path, listener_host="127.0.0.1")
    assert (s.listener_host, s.prometheus_host) == ("127.0.0.1", "127.0.0.1")


def test_binary_path_when_it_exists(tmp_path: Path) -> None:
    binary = tmp_path / "my-envoy"
    binary.write_text("#!/bin/sh\n")
    assert make_settings(tmp_path, proxy_config={"binaryPath": str(binary)}).binary == binary


# -- bootstrap override --------------------------------------------------------------------------------
@pytest.mark.parametrize(("host_ip", "expected"), [("10.0.0.9", "10.0.0.9"), ("fd00::9", "[fd00::9]")])
def test_bootstrap_override_becomes_json_with_host_ip(tmp_path: Path, host_ip: str, expected: str) -> None:
    (tmp_path / "override.yaml").write_text("tracing_address: $(HOST_IP):9411\nlayer: {a: 1}\n")
    s = make_settings(tmp_path, env={"ISTIO_BOOTSTRAP_OVERRIDE": "override.yaml", "HOST_IP": host_ip})
    assert json.loads(s.config_yaml) == {"tracing_address": f"{expected}:9411", "layer": {"a": 1}}


def test_unreadable_bootstrap_override_is_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="istio.bootstrap")
    s = make_settings(tmp_path, env={"ISTIO_BOOTSTRAP_OVERRIDE": str(tmp_path / "missing.yaml")})
    assert s.config_yaml == ""
    assert "bootstrap override" in caplog.text


# -- ProxyConfig fields used by the bootstrap --------------------------------------------------------
def test_new_proxy_config_fields_overlay(tmp_path: Path) -> None:
    mesh = tmp_path / "mesh"
    mesh.write_text(
        "defaultConfig:\n"
        "  extraStatTags: [a, b]\n"
        "  proxyStatsMatcher: {inclusionPrefixes: [p1], inclusionSuffixes: [s1]}\n"
        "  proxyMetadata: {SOME: file}\n"
        "  runtimeValues: {x: '1'}\n"
        "  tracing: {zipkin: {address: 'z:9411'}, sampling: 10}\n"
        "  concurrency: 4\n"
    )
    env = Env(
        {
            "PROXY_CONFIG": json.dumps(
                {
                    "extraStatTags": ["c"],
                    "proxyStatsMatcher": {"inclusionPrefixes": ["p2"]},
                    "proxyMetadata": {"ENV": "env"},
                    "runtimeValues": {"y": True},
                    "statsdUdpAddress": "statsd:8125",
                    "meshId": "mesh1",
                    "holdApplicationUntilProxyStarts": True,
                    "interceptionMode": "TPROXY",
                    "readinessProbe": {"httpGet": {"path": "/ready", "port": 8080}, "periodSeconds": 5},
                    "gatewayTopology": {"numTrustedProxies": 2},
                }
            )
        }
    )
    annotations = {"proxy.istio.io/config": "proxyMetadata: {ANNOTATION: anno}\nconcurrency: 0\n"}
    config = ProxyConfig.load(env, mesh, annotations)
    assert config.extra_stat_tags == ("c",)  # lists replaced, not appended
    assert config.proxy_stats_matcher is not None
    assert config.proxy_stats_matcher.inclusion_prefixes == ("p2",)
    assert config.proxy_stats_matcher.inclusion_suffixes == ()  # the message is replaced whole
    assert config.proxy_metadata == {"SOME": "file", "ENV": "env", "ANNOTATION": "anno"}  # maps merge
    assert config.runtime_values == {"y": "true"}  # replaced; YAML/JSON booleans read as text
    assert config.tracing is not None
    assert (config.tracing.tracer, config.tracing.address, config.tracing.sampling) == (
        "zipkin",
        "z:9411",
        10.0,
    )
    assert config.statsd_udp_address == "statsd:8125"
    assert config.mesh_id == "mesh1"
    assert config.hold_application_until_proxy_starts is True
    assert config.interception_mode == "TPROXY"
    assert config.readiness_probe == {"httpGet": {"path": "/ready", "port": 8080}, "periodSeconds": 5}
    assert config.concurrency == 0  # the annotation wins, and an explicit 0 is kept


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({"concurrency": "two"}, "concurrency"),
        ({"concurrency": True}, "concurrency"),
        ({"extraStatTags": "a,b"}, "extraStatTags"),
        ({"extraStatTags": ["ok", "bad(tag"]}, "extraStatTags"),
        ({"proxyStatsMatcher": ["p"]}, "proxyStatsMatcher"),
        ({"proxyStatsMatcher": {"inclusionPrefixes": [1]}}, "proxyStatsMatcher.inclusionPrefixes"),
        ({"proxyStatsMatcher": {"inclusionRegexps": ["(open"]}}, "proxyStatsMatcher.inclusionRegexps"),
        ({"tracing": "zipkin"}, "tracing"),
        ({"tracing": {"zipkin": {"address": "no-port"}}}, "tracing.zipkin.address"),
        ({"tracing": {"datadog": {}}}, "tracing.datadog.address"),
        ({"tracing": {"zipkin": {"address": "z:1"}, "datadog": {"address": "d:1"}}}, "only one tracer"),
        ({"tracing": {"sampling": 200}}, "tracing.sampling"),
        ({"tracing": {"lightstep": {"address": "l:1", "accessToken": 5}}}, "tracing.lightstep.accessToken"),
        ({"statsdUdpAddress": "statsd"}, "statsdUdpAddress"),
        ({"statsdUdpAddress": 8125}, "statsdUdpAddress"),
        ({"runtimeValues": ["a"]}, "runtimeValues"),
        ({"runtimeValues": {"a": {"b": 1}}}, "runtimeValues.a"),
        ({"readinessProbe": "yes"}, "readinessProbe"),
        ({"meshId": 3}, "meshId"),
        ({"holdApplicationUntilProxyStarts": "yes"}, "holdApplicationUntilProxyStarts"),
        ({"interceptionMode": "MAGIC"}, "interceptionMode"),
        ({"connectionSettings": {"globalDownstreamConnectionLimit": -1}}, "globalDownstreamConnectionLimit"),
        ({"proxyMetadata": {"A": ["x"]}}, "proxyMetadata.A"),
    ],
)
def test_bad_proxy_config_field_names_it(doc: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(field)):
        ProxyConfig().overlay(doc, "PROXY_CONFIG")


def test_bad_annotation_overlay_names_the_annotation() -> None:
    with pytest.raises(ConfigError, match=r"proxy\.istio\.io/config: concurrency"):
        ProxyConfig.load(Env({}), None, {"proxy.istio.io/config": "concurrency: lots"})


def test_null_resets_a_field() -> None:
    config = ProxyConfig().overlay({"extraStatTags": ["a"], "tracing": {"zipkin": {"address": "z:1"}}}, "a")
    config = config.overlay({"extraStatTags": None, "tracing": None}, "b")
    assert config.extra_stat_tags == () and config.tracing is None


def test_proxy_config_metadata_json_includes_new_fields(tmp_path: Path) -> None:
    s = make_settings(
        tmp_path,
        proxy_config={
            "concurrency": 0,
            "extraStatTags": ["a"],
            "proxyStatsMatcher": {"inclusionSuffixes": ["s"]},
            "runtimeValues": {"k": "v"},
            "holdApplicationUntilProxyStarts": False,
            "connectionSettings": {"globalDownstreamConnectionLimit": 10},
        },
    )
    doc = s.metadata["PROXY_CONFIG"]
    assert doc["concurrency"] == 0 and doc["holdApplicationUntilProxyStarts"] is False
    assert doc["extraStatTags"] == ["a"]
    assert doc["proxyStatsMatcher"] == {"inclusionSuffixes": ["s"]}
    assert doc["runtimeValues"] == {"k": "v"}
    assert doc["connectionSettings"] == {"globalDownstreamConnectionLimit": 10}
    assert list(doc) == sorted(doc)
    assert "tracing" not in doc and "readinessProbe" not in doc


def test_concurrency_precedence(tmp_path: Path) -> None:
    cpu = {"ISTIO_CPU_LIMIT": "3"}
    assert make_settings(tmp_path, env=cpu).concurrency == 3
    assert make_settings(tmp_path, env=cpu, proxy_config={"concurrency": 2}).concurrency == 2
    assert make_settings(tmp_path, env=cpu, proxy_config={"concurrency": 0}).concurrency == 0
    assert make_settings(tmp_path, env=cpu, proxy_config={"concurrency": 2}, concurrency=5).concurrency == 5


def test_statsd_address_resolution(tmp_path: Path) -> None:
    s = make_settings(
        tmp_path, env={"HOST_IP": "127.0.0.1"}, proxy_config={"statsdUdpAddress": "$(HOST_IP):8125"}
    )
    assert s.statsd_address == "127.0.0.1:8125"
    s = make_settings(tmp_path, proxy_config={"statsdUdpAddress": "[::1]:8125"})
    assert s.statsd_address == "[::1]:8125"


def test_outlier_log_path_setting(tmp_path: Path) -> None:
    s = make_settings(tmp_path, outlier_log_path="/dev/stdout")
    assert s.outlier_log_path == "/dev/stdout"
    assert s.metadata["OUTLIER_LOG_PATH"] == "/dev/stdout"
    assert "OUTLIER_LOG_PATH" not in make_settings(tmp_path).metadata
