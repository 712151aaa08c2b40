from __future__ import annotations

from datetime import timedelta

import pytest

from istio_agent.config import ProxyConfig, node
from istio_agent.config.node import MetadataSources, build_metadata


# -- service node ------------------------------------------------------------------------------------
def test_service_node_sidecar() -> None:
    assert (
        node.service_node("sidecar", ["10.1.1.0"], "v0", "default", "default.svc.cluster.local")
        == "sidecar~10.1.1.0~v0.default~default.svc.cluster.local"
    )


def test_service_node_router() -> None:
    assert (
        node.service_node("router", ["10.3.3.3"], "gw-1", "istio-system", "istio-system.svc.cluster.local")
        == "router~10.3.3.3~gw-1.istio-system~istio-system.svc.cluster.local"
    )


def test_service_node_uses_only_the_first_ip() -> None:
    ips = ["10.3.3.3", "10.4.4.4", "10.5.5.5", "10.6.6.6"]
    assert node.service_node("sidecar", ips, "foo", "bar", "bar.svc.cluster.local") == (
        "sidecar~10.3.3.3~foo.bar~bar.svc.cluster.local"
    )


def test_service_node_without_ips() -> None:
    assert node.service_node("sidecar", [], "a", "b", "d") == "sidecar~~a.b~d"


# -- service cluster ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("configured", "labels", "workload", "namespace", "expected"),
    [
        ("reviews", {"app": "ignored"}, "w", "ns", "reviews"),
        ("istio-proxy", {"app": "productpage"}, "w", "ns", "productpage.ns"),
        ("", {"app.kubernetes.io/name": "ratings"}, "", "ns", "ratings.ns"),
        ("", {"service.istio.io/canonical-name": "canon"}, "", "ns", "canon.ns"),
        ("", {"app": "first", "app.kubernetes.io/name": "second"}, "", "ns", "first.ns"),
        ("istio-proxy", {}, "details-v1", "ns", "details-v1.ns"),
        ("istio-proxy", {}, "", "ns", "istio-proxy.ns"),
        ("istio-proxy", {}, "", "", "istio-proxy"),
    ],
)
def test_service_cluster_fallbacks(
    configured: str, labels: dict[str, str], workload: str, namespace: str, expected: str
) -> None:
    assert node.service_cluster(configured, labels, workload, namespace) == expected


# -- downward API files ------------------------------------------------------------------------------
def test_parse_downward_api_round_trip() -> None:
    text = 'app="foo"\nversion="v1"\nmulti="line1\\nline2"\nequals="a=b=c"\nquote="say \\"hi\\""\n'
    assert node.parse_downward_api(text) == {
        "app": "foo",
        "version": "v1",
        "multi": "line1\nline2",
        "equals": "a=b=c",
        "quote": 'say "hi"',
    }


def test_parse_downward_api_skips_lines_without_equals() -> None:
    assert node.parse_downward_api('\n\ngarbage\nkey="v"') == {"key": "v"}


def test_parse_downward_api_json_annotation() -> None:
    text = 'sidecar.istio.io/status="{\\"initContainers\\":[\\"istio-init\\"]}"\n'
    assert node.parse_downward_api(text) == {"sidecar.istio.io/status": '{"initContainers":["istio-init"]}'}


@pytest.mark.parametrize(
    ("quoted", "expected"),
    [
        ('"plain"', "plain"),
        ('""', ""),
        ('"tab\\there"', "tab\there"),
        ('"\\x41\\101\\u00e9\\U0001F600"', "AAé😀"),
        ('"ünïcode"', "ünïcode"),
        ('"back\\\\slash"', "back\\slash"),
    ],
)
def test_go_unquote(quoted: str, expected: str) -> None:
    assert node.go_unquote(quoted) == expected


@pytest.mark.parametrize("bad", ["unquoted", '"open', '"bad \\q escape"', '"inner " quote"', '"\\400"'])
def test_go_unquote_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        node.go_unquote(bad)


def test_parse_downward_api_names_the_bad_key() -> None:
    with pytest.raises(ValueError, match="'broken'"):
        node.parse_downward_api('good="x"\nbroken=notquoted\n')


# -- locality, SAN, ProxyConfig JSON -----------------------------------------------------------------
def test_locality_from_label() -> None:
    assert node.locality("regionA.zoneB.sub_zoneC") == {
        "region": "regionA",
        "zone": "zoneB",
        "sub_zone": "sub_zoneC",
    }
    assert node.locality("us-east1/us-east1-b") == {"region": "us-east1", "zone": "us-east1-b"}
    assert node.locality("") == {}


def test_pilot_san() -> None:
    assert node.pilot_san("istiod.istio-system.svc:15012") == "istiod.istio-system.svc"
    assert node.pilot_san("localhost:15012") == "istiod.istio-system.svc"
    assert node.pilot_san("[::1]:15012") == "::1"


def test_proxy_config_json_is_camel_case_protobuf_json() -> None:
    config = ProxyConfig().overlay(
        {"proxyMetadata": {"A": "1"}, "terminationDrainDuration": "1.5s", "statusPort": 0}, "test"
    )
    assert node.proxy_config_json(config) == {
        "binaryPath": "/usr/local/bin/envoy",
        "configPath": "./etc/istio/proxy",
        "controlPlaneAuthPolicy": "MUTUAL_TLS",
        "discoveryAddress": "istiod.istio-system.svc:15012",
        "drainDuration": "45s",
        "proxyAdminPort": 15000,
        "proxyMetadata": {"A": "1"},
        "serviceCluster": "istio-proxy",
        "terminationDrainDuration": "1.500s",
    }


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (timedelta(0), "0s"),
        (timedelta(seconds=45), "45s"),
        (timedelta(milliseconds=250), "0.250s"),
        (timedelta(microseconds=1500), "0.001500s"),
        (timedelta(minutes=2), "120s"),
    ],
)
def test_duration_json(value: timedelta, expected: str) -> None:
    assert node.duration_json(value) == expected


# -- metadata ----------------------------------------------------------------------------------------
def test_env_wins_over_proxy_metadata_and_prefix_is_stripped() -> None:
    meta = build_metadata(
        MetadataSources(
            proxy_metadata={
                "ISTIO_META_OWNER": "from-proxy-config",
                "ISTIO_META_MESH_ID": "m1",
                "OTHER": "x",
            },
            meta_env={"OWNER": "from-env", "WORKLOAD_NAME": "details-v1"},
        )
    )
    assert meta["OWNER"] == "from-env"
    assert meta["MESH_ID"] == "m1"
    assert meta["WORKLOAD_NAME"] == "details-v1"
    assert "OTHER" not in meta and "ISTIO_META_OWNER" not in meta


def test_metajson_is_merged_at_top_level_and_sets_labels() -> None:
    meta = build_metadata(
        MetadataSources(
            meta_json={
                "LABELS": {"app": "test", "version": "v1alpha1", "istio-locality": "regionA.zoneB"},
                "EXTRA": {"k": "v", "n": 3},
            }
        )
    )
    assert meta["app"] == "test" and meta["version"] == "v1alpha1" and meta["k"] == "v" and meta["n"] == 3
    # raw keys stay unsanitised; LABELS carries the sanitised locality
    assert meta["istio-locality"] == "regionA.zoneB"
    assert meta["LABELS"] == {"app": "test", "version": "v1alpha1", "istio-locality": "regionA/zoneB"}
    assert meta["STATIC_LABELS"] == {"app": "test", "version": "v1alpha1", "istio-locality": "regionA.zoneB"}


def test_pod_labels_file_overlays_metajson_labels_without_pod_template_hash() -> None:
    meta = build_metadata(
        MetadataSources(
            meta_json={"LABELS": {"app": "from-env", "team": "a"}},
            pod_labels={"app": "from-file", "pod-template-hash": "6944fb884d", "version": "v2"},
            pod_annotations={"sidecar.istio.io/inject": "true"},
        )
    )
    assert meta["LABELS"] == {"app": "from-file", "team": "a", "version": "v2"}
    assert meta["ANNOTATIONS"] == {"sidecar.istio.io/inject": "true"}


def test_no_labels_no_annotations_keys() -> None:
    meta = build_metadata(MetadataSources(pod_labels={}, pod_annotations={}))
    assert "LABELS" not in meta and "ANNOTATIONS" not in meta and "STATIC_LABELS" not in meta


def test_typed_fields() -> None:
    meta = build_metadata(
        MetadataSources(
            meta_env={"INSTANCE_IPS": "spoofed", "CLUSTER_ID": "Kubernetes"},
            dns_proxy_addr="localhost:15053",
            istio_version="0.1.0",
            instance_ips=["10.1.1.1", "10.1.1.1", "fd00::1"],
            envoy_status_port=15121,
            envoy_prometheus_port=15190,
            pod_name="v0",
            namespace="default",
            service_account="bookinfo",
            pilot_san=["istiod.istio-system.svc"],
            workload_identity_socket_file="socket",
            proxy_config={"statusPort": 15020},
            exit_on_zero_active_connections=True,
            skip_deprecated_logs=True,
        )
    )
    assert meta["INSTANCE_IPS"] == "10.1.1.1,fd00::1"
    assert meta["ENVOY_STATUS_PORT"] == 15121 and meta["ENVOY_PROMETHEUS_PORT"] == 15190
    assert meta["ISTIO_VERSION"] == "0.1.0"
    assert meta["DNS_PROXY_ADDR"] == "localhost:15053"
    assert (meta["NAME"], meta["NAMESPACE"], meta["SERVICE_ACCOUNT"]) == ("v0", "default", "bookinfo")
    assert meta["CLUSTER_ID"] == "Kubernetes"
    assert meta["PILOT_SAN"] == ["istiod.istio-system.svc"]
    assert meta["WORKLOAD_IDENTITY_SOCKET_FILE"] == "socket"
    assert meta["PROXY_CONFIG"] == {"statusPort": 15020}
    assert meta["EXIT_ON_ZERO_ACTIVE_CONNECTIONS"] == "true"
    assert meta["ENVOY_SKIP_DEPRECATED_LOGS"] == "true"


def test_optional_fields_are_omitted() -> None:
    meta = build_metadata(MetadataSources(istio_version="0.1.0"))
    for key in (
        "NAME",
        "NAMESPACE",
        "SERVICE_ACCOUNT",
        "CLUSTER_ID",
        "PILOT_SAN",
        "EXIT_ON_ZERO_ACTIVE_CONNECTIONS",
        "ENVOY_SKIP_DEPRECATED_LOGS",
        "DNS_PROXY_ADDR",
    ):
        assert key not in meta


def test_explicit_istio_version_is_kept() -> None:
    assert build_metadata(MetadataSources(istio_version="0.1.0"))["ISTIO_VERSION"] == "0.1.0"
    explicit = build_metadata(MetadataSources(meta_env={"ISTIO_VERSION": "1.24.0"}, istio_version="0.1.0"))
    assert explicit["ISTIO_VERSION"] == "1.24.0"
