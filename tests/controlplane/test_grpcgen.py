"""Proxyless gRPC resources: names answered as asked, the shapes grpc's xDS client and server need,
and the ADS server answering a GENERATOR=grpc node by name (not wildcard) on a real gRPC stream."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from envoy.config.core.v3.base_pb2 import Node
from envoy.config.endpoint.v3.endpoint_pb2 import ClusterLoadAssignment
from envoy.config.listener.v3.listener_pb2 import Listener
from google.protobuf import json_format
from google.protobuf.message import Message

from istio_agent.controlplane.grpcgen import (
    SERVER_LISTENER_PREFIX,
    build_grpc_resources,
    dialled_names,
    is_grpc_node,
    split_host_port,
)
from istio_agent.controlplane.mesh import MeshConfig, parse_mesh
from istio_agent.controlplane.xdsgen import ProxyNode, Snapshot, build_snapshot
from istio_agent.xds.types import CLUSTER, ENDPOINT, LISTENER, NAME_TABLE, ROUTE
from tests.controlplane.test_ads import Harness, names_of, unpack

MESH = """
services:
  - name: echo
    port: 7070
    protocol: grpc
    addresses: [10.96.0.70]
  - name: web
    namespace: other
    port: 8080
workloads:
  - name: echo-1
    serviceAccount: echo
    address: 127.0.0.2
    proxyless: true
    services: [echo]
    appPort: 17070
  - name: echo-2
    serviceAccount: echo-canary
    proxyless: true
    services: [echo]
    appPort: 17071
  - name: client-1
    serviceAccount: client
    proxyless: true
  - name: web-1
    namespace: other
    services: [web]
    inboundPort: 15006
    appPort: 18080
"""
ECHO = "echo.default.svc.cluster.local"
ECHO_CLUSTER = f"outbound|7070||{ECHO}"
WEB_CLUSTER = "outbound|8080||web.other.svc.cluster.local"
SERVER_NAME = SERVER_LISTENER_PREFIX + "127.0.0.2:17070"


def parse(text: str = MESH) -> MeshConfig:
    return parse_mesh(text, Path("mesh.yaml"))


def proxy(name: str = "client-1", namespace: str = "default") -> ProxyNode:
    return ProxyNode(
        id=f"sidecar~127.0.0.1~{name}.{namespace}~{namespace}.svc.cluster.local",
        name=name,
        namespace=namespace,
        metadata={"GENERATOR": "grpc", "NAME": name, "NAMESPACE": namespace},
    )


def generate(type_url: str, names: list[str], node: ProxyNode | None = None) -> dict[str, dict[str, Any]]:
    """name -> the resource as protobuf JSON (field names as in the proto)."""
    resources = build_grpc_resources(parse(), node or proxy(), type_url, names)
    return {name: to_dict(message) for name, message in resources.items()}


def to_dict(message: Message) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


# -- names ------------------------------------------------------------------------------------------


def test_is_grpc_node_reads_the_generator_metadata() -> None:
    assert is_grpc_node(proxy())
    assert not is_grpc_node(ProxyNode(id="x", name="a", namespace="default", metadata={"GENERATOR": "envoy"}))
    assert not is_grpc_node(ProxyNode(id="x", name="a", namespace="default"))


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("echo:7070", ("echo", 7070)),
        ("echo.default.svc.cluster.local:7070", (ECHO, 7070)),
        ("echo", ("echo", None)),
        ("[::1]:80", ("::1", 80)),
        ("::1", ("::1", None)),
        ("echo:http", ("echo:http", None)),
    ],
)
def test_split_host_port(name: str, expected: tuple[str, int | None]) -> None:
    assert split_host_port(name) == expected


def test_client_listeners_answer_exactly_the_names_asked_for() -> None:
    asked = [
        f"{ECHO}:7070",
        "echo:7070",
        "echo.default:7070",
        "echo.default.svc:7070",
        "echo",  # no port: the service's one port
        "web.other:8080",  # another namespace by name.namespace
        "echo:7071",  # wrong port
        "nope:7070",  # no such service
        "web:8080",  # short name resolves in the client's own namespace only
    ]
    listeners = generate(LISTENER, asked)
    assert list(listeners) == asked[:6]
    for name, route in [
        (f"{ECHO}:7070", ECHO_CLUSTER),
        ("echo", ECHO_CLUSTER),
        ("web.other:8080", WEB_CLUSTER),
    ]:
        listener = listeners[name]
        assert listener["name"] == name
        assert "filter_chains" not in listener
        hcm = listener["api_listener"]["api_listener"]
        assert hcm["@type"].endswith("HttpConnectionManager")
        assert hcm["rds"]["route_config_name"] == route
        assert "ads" in hcm["rds"]["config_source"]
        assert [f["name"] for f in hcm["http_filters"]] == ["envoy.filters.http.router"]
    assert listeners["echo:7070"]["address"]["socket_address"] == {
        "address": "10.96.0.70",
        "port_value": 7070,
    }


def test_server_listener_requires_mtls_and_answers_locally() -> None:
    listeners = generate(LISTENER, [SERVER_NAME], proxy("echo-1"))
    listener = listeners[SERVER_NAME]
    assert listener["address"]["socket_address"] == {"address": "127.0.0.2", "port_value": 17070}
    assert "listener_filters" not in listener and "use_original_dst" not in listener  # gRPC NACKs them
    (chain,) = listener["filter_chains"]
    socket = chain["transport_socket"]
    assert socket["name"] == "envoy.transport_sockets.tls"
    tls = socket["typed_config"]
    assert tls["@type"].endswith("DownstreamTlsContext")
    assert tls["require_client_certificate"] is True
    common = tls["common_tls_context"]
    assert common["tls_certificate_provider_instance"] == {
        "instance_name": "default",
        "certificate_name": "default",
    }
    validation = common["combined_validation_context"]["default_validation_context"]
    assert validation["ca_certificate_provider_instance"] == {
        "instance_name": "default",
        "certificate_name": "ROOTCA",
    }
    (hcm_filter,) = chain["filters"]
    hcm = hcm_filter["typed_config"]
    (vhost,) = hcm["route_config"]["virtual_hosts"]
    (route,) = vhost["routes"]
    assert vhost["domains"] == ["*"]
    assert route == {"match": {"prefix": "/"}, "non_forwarding_action": {}}
    assert [f["name"] for f in hcm["http_filters"]] == ["envoy.filters.http.router"]


@pytest.mark.parametrize(
    ("name", "node"),
    [
        (SERVER_LISTENER_PREFIX + "127.0.0.2:17071", "echo-1"),  # not the port the workload serves on
        (SERVER_LISTENER_PREFIX + "127.0.0.2", "echo-1"),  # no port
        (SERVER_NAME, "client-1"),  # a workload that backs no service
        (SERVER_NAME, "ghost"),  # a node the mesh file does not know
    ],
)
def test_server_listener_only_where_the_workload_serves(name: str, node: str) -> None:
    assert generate(LISTENER, [name], proxy(node)) == {}


def test_server_listener_keeps_the_address_grpc_listens_on() -> None:
    wildcard = SERVER_LISTENER_PREFIX + "[::]:17070"
    listener = generate(LISTENER, [wildcard], proxy("echo-1"))[wildcard]
    assert listener["address"]["socket_address"] == {"address": "::", "port_value": 17070}


def test_route_has_every_name_the_service_is_dialled_by() -> None:
    routes = generate(ROUTE, [ECHO_CLUSTER, "outbound|1||nope.default.svc.cluster.local"])
    (vhost,) = routes[ECHO_CLUSTER]["virtual_hosts"]
    assert set(vhost["domains"]) >= {
        ECHO,
        f"{ECHO}:7070",
        "echo",
        "echo:7070",
        "echo.default:7070",
        "10.96.0.70:7070",
    }
    assert vhost["routes"][0]["route"]["cluster"] == ECHO_CLUSTER
    assert list(routes) == [ECHO_CLUSTER]


def test_short_name_domain_only_from_the_services_namespace() -> None:
    service = parse().service("web", "other")
    assert service is not None
    assert "web:8080" in dialled_names(service, "other")
    assert "web:8080" not in dialled_names(service, "default")
    assert "web.other:8080" in dialled_names(service, "default")


def test_cluster_is_eds_over_ads_with_mtls_through_the_certificate_provider() -> None:
    clusters = generate(CLUSTER, [ECHO_CLUSTER, "outbound|7070|v1|" + ECHO, "inbound|7070||"])
    assert list(clusters) == [ECHO_CLUSTER]  # subsets and inbound clusters are not served
    cluster = clusters[ECHO_CLUSTER]
    assert cluster["type"] == "EDS"
    assert cluster["eds_cluster_config"]["service_name"] == ECHO_CLUSTER
    assert "ads" in cluster["eds_cluster_config"]["eds_config"]
    socket = cluster["transport_socket"]
    assert socket["name"] == "envoy.transport_sockets.tls"
    common = socket["typed_config"]["common_tls_context"]
    assert socket["typed_config"]["@type"].endswith("UpstreamTlsContext")
    certificate = {"instance_name": "default", "certificate_name": "default"}
    root = {"instance_name": "default", "certificate_name": "ROOTCA"}
    assert common["tls_certificate_provider_instance"] == certificate
    assert common["tls_certificate_certificate_provider_instance"] == certificate  # older gRPC releases
    combined = common["combined_validation_context"]
    assert combined["validation_context_certificate_provider_instance"] == root
    validation = combined["default_validation_context"]
    assert validation["ca_certificate_provider_instance"] == root
    assert validation["match_subject_alt_names"] == [
        {"exact": "spiffe://cluster.local/ns/default/sa/echo"},
        {"exact": "spiffe://cluster.local/ns/default/sa/echo-canary"},
    ]


def test_endpoints_are_the_proxyless_app_ports_with_weights() -> None:
    assignment = generate(ENDPOINT, [ECHO_CLUSTER])[ECHO_CLUSTER]
    (locality,) = assignment["endpoints"]
    assert locality["load_balancing_weight"] == 2  # gRPC ignores a locality without a weight
    assert [
        (
            e["endpoint"]["address"]["socket_address"]["address"],
            e["endpoint"]["address"]["socket_address"]["port_value"],
        )
        for e in locality["lb_endpoints"]
    ] == [("127.0.0.1", 17071), ("127.0.0.2", 17070)]
    assert {e["load_balancing_weight"] for e in locality["lb_endpoints"]} == {1}


def test_unserved_types_are_empty() -> None:
    assert generate(NAME_TABLE, [""]) == {}


def test_envoy_snapshot_reaches_proxyless_endpoints_over_http2() -> None:
    """An Envoy sidecar calling a proxyless server: endpoints at the appPort, HTTP/2 upstream."""
    envoy_node = ProxyNode(
        id="sidecar~127.0.0.1~web-1.other~other.svc.cluster.local", name="web-1", namespace="other"
    )
    snapshot = build_snapshot(parse(), envoy_node)
    cluster = to_dict(snapshot[CLUSTER][ECHO_CLUSTER])
    options = cluster["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    assert "http2_protocol_options" in options["explicit_http_config"]
    assignment = to_dict(snapshot[ENDPOINT][ECHO_CLUSTER])
    ports = [
        e["endpoint"]["address"]["socket_address"]["port_value"]
        for e in assignment["endpoints"][0]["lb_endpoints"]
    ]
    assert ports == [17071, 17070]
    assert "typed_extension_protocol_options" not in to_dict(snapshot[CLUSTER][WEB_CLUSTER])


def test_envoy_snapshot_for_a_proxyless_workload_has_no_inbound() -> None:
    snapshot = build_snapshot(parse(), ProxyNode(id="x", name="echo-1", namespace="default"))
    assert snapshot[LISTENER] == {}
    assert not any(name.startswith("inbound|") for name in snapshot[CLUSTER])


# -- over ADS -----------------------------------------------------------------------------------------


def node(name: str, generator: str | None = "grpc", namespace: str = "default") -> Node:
    result = Node(id=f"sidecar~127.0.0.1~{name}.{namespace}~{namespace}.svc.cluster.local")
    result.metadata["NAME"] = name
    result.metadata["NAMESPACE"] = namespace
    if generator is not None:
        result.metadata["GENERATOR"] = generator
    return result


class RealHarness(Harness):
    """test_ads's harness serving the real generators (Envoy snapshots and proxyless by name)."""

    def snapshot(self, config: MeshConfig, proxy: ProxyNode) -> Snapshot:
        self.calls.append((config, proxy.id))
        return build_snapshot(config, proxy)


@pytest.fixture
async def ads() -> AsyncIterator[RealHarness]:
    harness = RealHarness(parse())
    await harness.start()
    yield harness
    await harness.stop()


async def test_grpc_node_gets_listeners_and_clusters_by_name(
    ads: RealHarness, caplog: pytest.LogCaptureFixture
) -> None:
    client = ads.sotw(node("client-1"))
    lds = await client.subscribe(LISTENER, ["echo:7070", "nope:1"])
    assert names_of(lds) == ["echo:7070"]  # not wildcard: only what was asked for
    assert "asked for Listener the mesh file has nothing for: nope:1" in caplog.text
    await client.request(LISTENER, ["echo:7070", f"{ECHO}:7070"], lds.nonce, version=lds.version_info)
    again = await client.response(LISTENER)
    assert names_of(again) == sorted(["echo:7070", f"{ECHO}:7070"])
    await client.ack(again, ["echo:7070", f"{ECHO}:7070"])
    cds = await client.subscribe(CLUSTER, [ECHO_CLUSTER])
    assert names_of(cds) == [ECHO_CLUSTER]
    eds = await client.subscribe(ENDPOINT, [ECHO_CLUSTER])
    assert names_of(eds) == [ECHO_CLUSTER]

    # The mesh changes only the endpoints: EDS is pushed; LDS and CDS are unchanged and not resent.
    await ads.ads.update_mesh(parse(MESH.replace("appPort: 17071", "appPort: 17072")))
    pushed = await client.response(ENDPOINT)
    ports = [
        e.endpoint.address.socket_address.port_value
        for e in unpack(pushed.resources[0], ClusterLoadAssignment()).endpoints[0].lb_endpoints
    ]
    assert ports == [17072, 17070]
    await client.ack(pushed, [ECHO_CLUSTER])
    await client.barrier()


async def test_grpc_server_gets_its_inbound_listener(ads: RealHarness) -> None:
    client = ads.sotw(node("echo-1"))
    lds = await client.subscribe(LISTENER, [SERVER_NAME])
    (resource,) = lds.resources
    assert unpack(resource, Listener()).name == SERVER_NAME


async def test_envoy_node_on_the_same_server_still_gets_wildcard_listeners(ads: RealHarness) -> None:
    client = ads.sotw(node("web-1", generator=None, namespace="other"))
    lds = await client.subscribe(LISTENER, [])
    assert names_of(lds) == ["inbound_127.0.0.1_15006"]
