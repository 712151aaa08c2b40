"""xDS generators: resource names and shapes for a two-workload mesh, and real Envoy accepting them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2, config_source_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2
from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2, tls_pb2
from google.protobuf import json_format, struct_pb2

from istio_agent.bootstrap.sds import sds_cluster
from istio_agent.controlplane.mesh import MeshConfig, parse_mesh
from istio_agent.controlplane.xdsgen import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    LISTENER_TYPE,
    NAME_TABLE_TYPE,
    ROUTE_TYPE,
    ProxyNode,
    Snapshot,
    build_name_table,
    build_snapshot,
)
from istio_agent.envoy.binary import find_envoy
from istio_agent.protos import nds_pb2
from istio_agent.xds.flavour import resource_version

MESH = """
trustDomain: example.org
services:
  - name: a
    port: 8000
  - name: b
    port: 9000
    addresses: [10.96.0.20]
  - name: db
    namespace: data
    port: 5432
    protocol: tcp
workloads:
  - name: a-1
    serviceAccount: a
    services: [a]
    inboundPort: 15105
    appPort: 18070
    outbound:
      - service: b
        port: 15201
      - service: db.data
        port: 15202
  - name: b-1
    serviceAccount: b
    address: 127.0.0.3
    services: [b]
    inboundPort: 15106
    appPort: 18080
  - name: b-2
    serviceAccount: b-canary
    address: 127.0.0.2
    services: [b]
    inboundPort: 15107
    appPort: 18081
  - name: db-1
    namespace: data
    serviceAccount: db
    services: [db]
    inboundPort: 15108
    appPort: 15432
"""

A = ProxyNode(id="sidecar~127.0.0.1~a-1.default~default.svc.cluster.local", name="a-1", namespace="default")
B = ProxyNode(id="sidecar~127.0.0.3~b-1.default~default.svc.cluster.local", name="b-1", namespace="default")
DB = ProxyNode(id="sidecar~127.0.0.1~db-1.data~data.svc.cluster.local", name="db-1", namespace="data")
STRANGER = ProxyNode(id="sidecar~10.0.0.1~x.y~y.svc.cluster.local", name="x", namespace="y")

OUT_A = "outbound|8000||a.default.svc.cluster.local"
OUT_B = "outbound|9000||b.default.svc.cluster.local"
OUT_DB = "outbound|5432||db.data.svc.cluster.local"


@pytest.fixture(scope="module")
def mesh() -> MeshConfig:
    return parse_mesh(MESH, Path("mesh.yaml"))


def typed(any_config: Any, message: Any) -> Any:
    assert any_config.Unpack(message), any_config.type_url
    return message


def test_proxy_a_names_and_types(mesh: MeshConfig) -> None:
    snapshot = build_snapshot(mesh, A)
    assert list(snapshot) == [CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE, NAME_TABLE_TYPE]
    assert list(snapshot[CLUSTER_TYPE]) == ["inbound|18070||", OUT_DB, OUT_A, OUT_B]
    assert list(snapshot[ENDPOINT_TYPE]) == [OUT_DB, OUT_A, OUT_B]
    assert list(snapshot[LISTENER_TYPE]) == ["127.0.0.1_15201", "127.0.0.1_15202", "inbound_127.0.0.1_15105"]
    assert list(snapshot[ROUTE_TYPE]) == ["15201"]
    assert list(snapshot[NAME_TABLE_TYPE]) == [""]
    assert isinstance(snapshot[CLUSTER_TYPE][OUT_B], cluster_pb2.Cluster)
    assert isinstance(snapshot[ENDPOINT_TYPE][OUT_B], endpoint_pb2.ClusterLoadAssignment)
    assert isinstance(snapshot[LISTENER_TYPE]["127.0.0.1_15201"], listener_pb2.Listener)
    assert isinstance(snapshot[ROUTE_TYPE]["15201"], route_pb2.RouteConfiguration)
    assert isinstance(snapshot[NAME_TABLE_TYPE][""], nds_pb2.NameTable)
    for resources in snapshot.values():
        for name, message in resources.items():
            assert message.IsInitialized()
            if not isinstance(message, nds_pb2.NameTable):
                field = "cluster_name" if isinstance(message, endpoint_pb2.ClusterLoadAssignment) else "name"
                assert getattr(message, field) == name


def test_outbound_cluster_is_eds_with_istio_mtls(mesh: MeshConfig) -> None:
    cluster = build_snapshot(mesh, A)[CLUSTER_TYPE][OUT_B]
    assert isinstance(cluster, cluster_pb2.Cluster)
    assert cluster.type == cluster_pb2.Cluster.EDS
    assert cluster.connect_timeout.seconds == 10
    eds = cluster.eds_cluster_config
    assert eds.service_name == OUT_B
    assert eds.eds_config.HasField("ads")
    assert eds.eds_config.initial_fetch_timeout.ToSeconds() == 0
    assert eds.eds_config.HasField("initial_fetch_timeout")
    assert eds.eds_config.resource_api_version == config_source_pb2.V3
    assert cluster.transport_socket.name == "envoy.transport_sockets.tls"
    tls = typed(cluster.transport_socket.typed_config, tls_pb2.UpstreamTlsContext())
    assert tls.sni == "outbound_.9000_._.b.default.svc.cluster.local"
    common = tls.common_tls_context
    [cert] = common.tls_certificate_sds_secret_configs
    assert cert.name == "default"
    source = cert.sds_config.api_config_source
    assert source.grpc_services[0].envoy_grpc.cluster_name == "sds-grpc"
    assert source.set_node_on_first_message_only
    validation = common.combined_validation_context
    assert validation.validation_context_sds_secret_config.name == "ROOTCA"
    sans = validation.default_validation_context.match_typed_subject_alt_names
    assert [(m.san_type, m.matcher.exact) for m in sans] == [
        (common_pb2.SubjectAltNameMatcher.URI, "spiffe://example.org/ns/default/sa/b"),
        (common_pb2.SubjectAltNameMatcher.URI, "spiffe://example.org/ns/default/sa/b-canary"),
    ]


def test_endpoints_and_inbound_cluster(mesh: MeshConfig) -> None:
    snapshot = build_snapshot(mesh, A)
    cla = snapshot[ENDPOINT_TYPE][OUT_B]
    assert isinstance(cla, endpoint_pb2.ClusterLoadAssignment)
    [group] = cla.endpoints
    addresses = [
        (e.endpoint.address.socket_address.address, e.endpoint.address.socket_address.port_value)
        for e in group.lb_endpoints
    ]
    assert addresses == [("127.0.0.2", 15107), ("127.0.0.3", 15106)]
    inbound = snapshot[CLUSTER_TYPE]["inbound|18070||"]
    assert isinstance(inbound, cluster_pb2.Cluster)
    assert inbound.type == cluster_pb2.Cluster.STATIC
    assert inbound.connect_timeout.seconds == 10
    [endpoint] = inbound.load_assignment.endpoints[0].lb_endpoints
    assert endpoint.endpoint.address.socket_address.address == "127.0.0.1"
    assert endpoint.endpoint.address.socket_address.port_value == 18070


def test_service_without_workloads_has_empty_assignment() -> None:
    mesh = parse_mesh("services: [{name: lonely, port: 80}]", Path("m"))
    cla = build_snapshot(mesh, STRANGER)[ENDPOINT_TYPE]["outbound|80||lonely.default.svc.cluster.local"]
    assert isinstance(cla, endpoint_pb2.ClusterLoadAssignment)
    assert list(cla.endpoints) == []


def test_outbound_http_listener_uses_rds(mesh: MeshConfig) -> None:
    snapshot = build_snapshot(mesh, A)
    listener = snapshot[LISTENER_TYPE]["127.0.0.1_15201"]
    assert isinstance(listener, listener_pb2.Listener)
    assert listener.address.socket_address.address == "127.0.0.1"
    assert listener.address.socket_address.port_value == 15201
    [chain] = listener.filter_chains
    assert not chain.HasField("transport_socket")
    [hcm_filter] = chain.filters
    hcm = typed(hcm_filter.typed_config, http_connection_manager_pb2.HttpConnectionManager())
    assert hcm.stat_prefix == "outbound_127.0.0.1_15201"
    assert hcm.rds.route_config_name == "15201"
    assert hcm.rds.config_source.HasField("ads")
    assert [f.name for f in hcm.http_filters] == ["envoy.filters.http.router"]
    route = snapshot[ROUTE_TYPE]["15201"]
    assert isinstance(route, route_pb2.RouteConfiguration)
    [vhost] = route.virtual_hosts
    assert vhost.name == "b.default.svc.cluster.local:9000"
    assert list(vhost.domains) == ["*"]
    assert vhost.routes[0].match.prefix == "/"
    assert vhost.routes[0].route.cluster == OUT_B


def test_outbound_tcp_listener(mesh: MeshConfig) -> None:
    listener = build_snapshot(mesh, A)[LISTENER_TYPE]["127.0.0.1_15202"]
    assert isinstance(listener, listener_pb2.Listener)
    [proxy_filter] = listener.filter_chains[0].filters
    assert proxy_filter.name == "envoy.filters.network.tcp_proxy"
    tcp = typed(proxy_filter.typed_config, tcp_proxy_pb2.TcpProxy())
    assert (tcp.stat_prefix, tcp.cluster) == (OUT_DB, OUT_DB)


def test_inbound_http_listener_requires_mesh_client_certs(mesh: MeshConfig) -> None:
    listener = build_snapshot(mesh, B)[LISTENER_TYPE]["inbound_127.0.0.3_15106"]
    assert isinstance(listener, listener_pb2.Listener)
    assert listener.address.socket_address.address == "127.0.0.3"
    assert listener.address.socket_address.port_value == 15106
    [chain] = listener.filter_chains
    tls = typed(chain.transport_socket.typed_config, tls_pb2.DownstreamTlsContext())
    assert tls.require_client_certificate.value is True
    common = tls.common_tls_context
    assert [c.name for c in common.tls_certificate_sds_secret_configs] == ["default"]
    assert common.combined_validation_context.validation_context_sds_secret_config.name == "ROOTCA"
    [san] = common.combined_validation_context.default_validation_context.match_typed_subject_alt_names
    assert san.matcher.prefix == "spiffe://example.org/"
    hcm = typed(chain.filters[0].typed_config, http_connection_manager_pb2.HttpConnectionManager())
    assert hcm.stat_prefix == "inbound_15106"
    assert hcm.forward_client_cert_details == http_connection_manager_pb2.HttpConnectionManager.SANITIZE_SET
    assert hcm.set_current_client_cert_details.uri
    assert hcm.route_config.name == "inbound|18080||"
    [vhost] = hcm.route_config.virtual_hosts
    assert (vhost.name, list(vhost.domains)) == ("inbound|http|18080", ["*"])
    assert vhost.routes[0].route.cluster == "inbound|18080||"


def test_proxy_b_has_no_outbound_listeners(mesh: MeshConfig) -> None:
    snapshot = build_snapshot(mesh, B)
    assert list(snapshot[LISTENER_TYPE]) == ["inbound_127.0.0.3_15106"]
    assert snapshot[ROUTE_TYPE] == {}
    assert "inbound|18080||" in snapshot[CLUSTER_TYPE]


def test_tcp_service_gets_tcp_inbound_listener(mesh: MeshConfig) -> None:
    listener = build_snapshot(mesh, DB)[LISTENER_TYPE]["inbound_127.0.0.1_15108"]
    assert isinstance(listener, listener_pb2.Listener)
    [proxy_filter] = listener.filter_chains[0].filters
    tcp = typed(proxy_filter.typed_config, tcp_proxy_pb2.TcpProxy())
    assert (tcp.stat_prefix, tcp.cluster) == ("inbound|15432||", "inbound|15432||")


def test_unknown_proxy_gets_clusters_endpoints_and_names_only(mesh: MeshConfig) -> None:
    snapshot = build_snapshot(mesh, STRANGER)
    assert list(snapshot[CLUSTER_TYPE]) == [OUT_DB, OUT_A, OUT_B]
    assert list(snapshot[ENDPOINT_TYPE]) == [OUT_DB, OUT_A, OUT_B]
    assert snapshot[LISTENER_TYPE] == {}
    assert snapshot[ROUTE_TYPE] == {}
    assert snapshot[NAME_TABLE_TYPE][""] == build_name_table(mesh)


def test_empty_mesh_has_every_type() -> None:
    snapshot = build_snapshot(parse_mesh("{}", Path("m")), STRANGER)
    assert snapshot == {
        CLUSTER_TYPE: {},
        ENDPOINT_TYPE: {},
        LISTENER_TYPE: {},
        ROUTE_TYPE: {},
        NAME_TABLE_TYPE: {"": nds_pb2.NameTable()},
    }


def test_name_table_generated_and_merged() -> None:
    mesh = parse_mesh(
        MESH
        + """
nameTable:
  db.example.com: {ips: [10.0.0.5], registry: External, shortname: db, namespace: ext, altHosts: [db]}
  b.default.svc.cluster.local: {ips: ["fd00::5"], registry: Kubernetes}
""",
        Path("m"),
    )
    table = build_name_table(mesh).table
    assert set(table) == {
        "a.default.svc.cluster.local",
        "b.default.svc.cluster.local",
        "db.data.svc.cluster.local",
        "db.example.com",
    }
    a = table["a.default.svc.cluster.local"]
    assert (list(a.ips), a.registry, a.shortname, a.namespace) == (
        ["127.0.0.1"],
        "Kubernetes",
        "a",
        "default",
    )
    db = table["db.data.svc.cluster.local"]
    assert (list(db.ips), db.shortname, db.namespace) == (["127.0.0.1"], "db", "data")
    b = table["b.default.svc.cluster.local"]  # replaced verbatim, not merged field by field
    assert (list(b.ips), b.registry, b.shortname, b.namespace) == (["fd00::5"], "Kubernetes", "", "")
    ext = table["db.example.com"]
    assert (list(ext.ips), ext.registry, ext.shortname, ext.namespace, list(ext.alt_hosts)) == (
        ["10.0.0.5"],
        "External",
        "db",
        "ext",
        ["db"],
    )


def test_name_table_uses_vips_then_sorted_workload_addresses() -> None:
    mesh = parse_mesh(MESH, Path("m"))
    table = build_name_table(mesh).table
    assert list(table["b.default.svc.cluster.local"].ips) == ["10.96.0.20"]
    without_vip = parse_mesh(MESH.replace("    addresses: [10.96.0.20]\n", ""), Path("m"))
    assert list(build_name_table(without_vip).table["b.default.svc.cluster.local"].ips) == [
        "127.0.0.2",
        "127.0.0.3",
    ]
    lonely = parse_mesh("services: [{name: s, port: 80}]", Path("m"))
    assert dict(build_name_table(lonely).table) == {}


def serialize(snapshot: Snapshot) -> list[tuple[str, str, bytes]]:
    return [
        (type_url, name, message.SerializeToString(deterministic=True))
        for type_url, resources in snapshot.items()
        for name, message in resources.items()
    ]


def test_deterministic_and_versions_follow_content(mesh: MeshConfig) -> None:
    first, second = build_snapshot(mesh, A), build_snapshot(parse_mesh(MESH, Path("other")), A)
    assert serialize(first) == serialize(second)
    version = resource_version(first[CLUSTER_TYPE][OUT_B])
    assert len(version) == 16 and int(version, 16) >= 0
    assert version == resource_version(second[CLUSTER_TYPE][OUT_B])
    changed = build_snapshot(
        parse_mesh(MESH.replace("serviceAccount: b-canary", "serviceAccount: c"), Path("m")), A
    )
    assert resource_version(changed[CLUSTER_TYPE][OUT_B]) != version
    assert resource_version(changed[CLUSTER_TYPE][OUT_A]) == resource_version(first[CLUSTER_TYPE][OUT_A])
    assert resource_version(first[NAME_TABLE_TYPE][""]) == resource_version(changed[NAME_TABLE_TYPE][""])
    moved = build_snapshot(parse_mesh(MESH.replace("address: 127.0.0.2", "address: 127.0.0.9"), Path("m")), A)
    assert resource_version(moved[ENDPOINT_TYPE][OUT_B]) != resource_version(first[ENDPOINT_TYPE][OUT_B])


def node(node_id: str, **metadata: object) -> base_pb2.Node:
    message = base_pb2.Node(id=node_id, cluster="a.default")
    if metadata:
        message.metadata.CopyFrom(json_format.ParseDict(metadata, struct_pb2.Struct()))
    return message


def test_proxy_node_from_metadata() -> None:
    proxy = ProxyNode.from_node(
        node(
            "sidecar~127.0.0.1~ignored.other~other.svc.cluster.local",
            NAME="a-1",
            NAMESPACE="default",
            LABELS={"app": "a"},
        )
    )
    assert (proxy.name, proxy.namespace, proxy.cluster) == ("a-1", "default", "a.default")
    assert proxy.id == "sidecar~127.0.0.1~ignored.other~other.svc.cluster.local"
    assert proxy.metadata["LABELS"] == {"app": "a"}


def test_proxy_node_from_id() -> None:
    proxy = ProxyNode.from_node(node("sidecar~127.0.0.1~b-1.pod.shop~shop.svc.cluster.local"))
    assert (proxy.name, proxy.namespace, proxy.metadata) == ("b-1.pod", "shop", {})
    assert ProxyNode.from_node(node("sidecar~1.2.3.4~pod~ns.svc.cluster.local", NAME=5)).namespace == "ns"
    assert ProxyNode.from_node(node("sidecar~1.2.3.4~pod~ns.svc.cluster.local", NAME=5)).name == "pod"
    assert (ProxyNode.from_node(node("garbage")).name, ProxyNode.from_node(node("garbage")).namespace) == (
        "",
        "",
    )


def test_proxy_node_finds_its_workload(mesh: MeshConfig) -> None:
    proxy = ProxyNode.from_node(node("sidecar~127.0.0.1~a-1.default~default.svc.cluster.local"))
    assert list(build_snapshot(mesh, proxy)[LISTENER_TYPE]) == list(build_snapshot(mesh, A)[LISTENER_TYPE])


# -- real Envoy ------------------------------------------------------------------------------------


def to_json(message: Any) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def static_bootstrap(snapshot: Snapshot, sds_socket: Path) -> dict[str, Any]:
    """The snapshot as static resources: EDS clusters get their assignment inline, HCMs their routes."""
    routes = {name: to_json(route) for name, route in snapshot[ROUTE_TYPE].items()}
    clusters = [sds_cluster(sds_socket)]
    for name, cluster in snapshot[CLUSTER_TYPE].items():
        config = to_json(cluster)
        if config.get("type") == "EDS":
            del config["eds_cluster_config"]
            config["type"] = "STATIC"
            config["load_assignment"] = to_json(snapshot[ENDPOINT_TYPE][name])
        clusters.append(config)
    listeners = []
    for listener in snapshot[LISTENER_TYPE].values():
        config = to_json(listener)
        for chain in config["filter_chains"]:
            for network_filter in chain["filters"]:
                typed_config = network_filter["typed_config"]
                if "rds" in typed_config:
                    typed_config["route_config"] = routes[typed_config.pop("rds")["route_config_name"]]
        listeners.append(config)
    return {
        "node": {"id": "sidecar~127.0.0.1~validate.default~default.svc.cluster.local", "cluster": "validate"},
        "static_resources": {"clusters": clusters, "listeners": listeners},
    }


def envoy_validate(bootstrap: dict[str, Any], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Real Envoy's ``--mode validate`` on a bootstrap."""
    config = tmp_path / "envoy.json"
    config.write_text(json.dumps(bootstrap))
    return subprocess.run(
        [str(find_envoy()), "--mode", "validate", "-c", str(config), "--log-level", "warning"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.mark.parametrize("proxy", [A, B, DB], ids=["a", "b", "db"])
def test_real_envoy_accepts_the_config(mesh: MeshConfig, proxy: ProxyNode, tmp_path: Path) -> None:
    snapshot = build_snapshot(mesh, proxy)
    assert snapshot[LISTENER_TYPE], "the proxy must have listeners for this test to mean anything"
    result = envoy_validate(static_bootstrap(snapshot, tmp_path / "sds.sock"), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_real_envoy_rejects_a_broken_config(mesh: MeshConfig, tmp_path: Path) -> None:
    """The validation test can fail: a route to a cluster that does not exist is refused."""
    bootstrap = static_bootstrap(build_snapshot(mesh, A), tmp_path / "sds.sock")
    bootstrap["static_resources"]["clusters"] = [
        c for c in bootstrap["static_resources"]["clusters"] if c["name"] != OUT_B
    ]
    result = envoy_validate(bootstrap, tmp_path)
    assert result.returncode != 0
    assert f"unknown cluster '{OUT_B}'" in result.stdout + result.stderr


# -- a workload whose traffic iptables captures -------------------------------------------------------

CAPTURED_MESH = (
    MESH
    + """
  - name: sleep
    serviceAccount: sleep
    address: 10.22.0.2
    capture: true
"""
)
SLEEP = ProxyNode(
    id="sidecar~10.22.0.2~sleep.default~default.svc.cluster.local", name="sleep", namespace="default"
)


@pytest.fixture(scope="module")
def captured() -> Snapshot:
    return build_snapshot(parse_mesh(CAPTURED_MESH, Path("mesh.yaml")), SLEEP)


def test_a_captured_workload_gets_the_capture_listeners_and_no_loopback_ones(captured: Snapshot) -> None:
    # HTTP services by port on 0.0.0.0, the headless TCP service by its workload's address
    assert list(captured[LISTENER_TYPE]) == [
        "0.0.0.0_8000",
        "0.0.0.0_9000",
        "127.0.0.1_5432",
        "virtualOutbound",
    ]
    assert list(captured[ROUTE_TYPE]) == ["8000", "9000"]
    passthrough = captured[CLUSTER_TYPE]["PassthroughCluster"]
    assert isinstance(passthrough, cluster_pb2.Cluster)
    assert passthrough.type == cluster_pb2.Cluster.ORIGINAL_DST
    assert passthrough.lb_policy == cluster_pb2.Cluster.CLUSTER_PROVIDED


def test_virtual_outbound_hands_connections_to_their_original_destination(captured: Snapshot) -> None:
    virtual = captured[LISTENER_TYPE]["virtualOutbound"]
    assert isinstance(virtual, listener_pb2.Listener)
    assert (virtual.address.socket_address.address, virtual.address.socket_address.port_value) == (
        "0.0.0.0",
        15001,
    )
    assert virtual.use_original_dst.value is True
    [chain] = virtual.filter_chains
    tcp = typed(chain.filters[0].typed_config, tcp_proxy_pb2.TcpProxy())
    assert tcp.cluster == "PassthroughCluster"

    for name in ("0.0.0.0_9000", "127.0.0.1_5432"):  # reached only through virtualOutbound
        listener = captured[LISTENER_TYPE][name]
        assert isinstance(listener, listener_pb2.Listener)
        assert listener.bind_to_port.value is False
    db = captured[LISTENER_TYPE]["127.0.0.1_5432"]
    assert isinstance(db, listener_pb2.Listener)
    assert typed(db.filter_chains[0].filters[0].typed_config, tcp_proxy_pb2.TcpProxy()).cluster == OUT_DB


def test_captured_http_routes_by_the_names_and_addresses_a_caller_uses(captured: Snapshot) -> None:
    listener = captured[LISTENER_TYPE]["0.0.0.0_9000"]
    assert isinstance(listener, listener_pb2.Listener)
    hcm = typed(
        listener.filter_chains[0].filters[0].typed_config, http_connection_manager_pb2.HttpConnectionManager()
    )
    assert (hcm.stat_prefix, hcm.rds.route_config_name) == ("outbound_0.0.0.0_9000", "9000")
    route = captured[ROUTE_TYPE]["9000"]
    assert isinstance(route, route_pb2.RouteConfiguration)
    service, allow_any = route.virtual_hosts
    assert service.name == "b.default.svc.cluster.local:9000"
    assert list(service.domains) == [
        "b.default.svc.cluster.local", "b.default.svc.cluster.local:9000", "b.default.svc", "b.default.svc:9000",
        "b.default", "b.default:9000", "b", "b:9000", "10.96.0.20", "10.96.0.20:9000",
    ]  # fmt: skip
    assert service.routes[0].route.cluster == OUT_B
    assert (list(allow_any.domains), allow_any.routes[0].route.cluster) == (["*"], "PassthroughCluster")


def test_real_envoy_accepts_the_capture_config(captured: Snapshot, tmp_path: Path) -> None:
    result = envoy_validate(static_bootstrap(captured, tmp_path / "sds.sock"), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
