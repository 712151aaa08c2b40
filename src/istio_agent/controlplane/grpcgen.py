"""xDS for proxyless gRPC nodes (node metadata ``GENERATOR=grpc``): what grpc's xDS client and server expect.

The shapes follow istiod's gRPC generator (``pilot/pkg/networking/grpcgen/``). Unlike Envoy, gRPC
subscribes to every type by name, so resources are built for the names asked for (pure functions:
no I/O, no asyncio):

* LDS ``<host>:<port>`` (or ``<host>``): an API listener whose HTTP connection manager takes its
  routes over RDS; ``<host>`` may be the service's FQDN or a Kubernetes short form
  (``name``, ``name.ns``, ``name.ns.svc``), as the DNS search path would resolve it.
* LDS ``xds.istio.io/grpc/lds/inbound/<ip>:<port>``: a gRPC server's listener, mTLS required,
  an inline route with ``non_forwarding_action`` (the server answers itself).
* RDS / CDS / EDS ``outbound|<port>||<hostname>``: one virtual host for every name the service is
  dialled by; an EDS cluster with mTLS through the bootstrap's certificate provider instance
  ``default``; the endpoints from the mesh file.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from google.protobuf.message import Message

from istio_agent.controlplane.mesh import MeshConfig, Service
from istio_agent.controlplane.xdsgen import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    HCM_TYPE,
    LISTENER_TYPE,
    ROUTE_TYPE,
    ProxyNode,
    ads_source,
    load_assignment,
    outbound_cluster_name,
    parse_resource,
    route_to,
    router_filters,
    socket_address,
)

GENERATOR_KEY = "GENERATOR"
GRPC_GENERATOR = "grpc"
SERVER_LISTENER_PREFIX = "xds.istio.io/grpc/lds/inbound/"
"""gRPC's ``server_listener_resource_name_template`` in the bootstrap the agent writes, without ``%s``."""
CERTIFICATE_PROVIDER = "default"
"""The bootstrap's ``certificate_providers`` instance (the agent's OUTPUT_CERTS file_watcher)."""
TLS_TRANSPORT_SOCKET = "envoy.transport_sockets.tls"
"""gRPC accepts a transport socket only under exactly this name."""

_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3."
_UNSPECIFIED_ADDRESS = "0.0.0.0"


def is_grpc_node(proxy: ProxyNode) -> bool:
    """Whether istiod would pick its gRPC generator for this node (metadata ``GENERATOR=grpc``)."""
    return proxy.metadata.get(GENERATOR_KEY) == GRPC_GENERATOR


def build_grpc_resources(
    mesh: MeshConfig, proxy: ProxyNode, type_url: str, names: Sequence[str]
) -> dict[str, Message]:
    """The resources of ``type_url`` among ``names`` that exist for ``proxy``; unknown names are left out,
    so gRPC sees them as not existing (istiod leaves them out likewise)."""
    builder = _BUILDERS.get(type_url)
    if builder is None:
        return {}
    build, message_type = builder
    result: dict[str, Message] = {}
    for name in names:
        document = build(mesh, proxy, name)
        if document is not None:
            result[name] = parse_resource(document, message_type())
    return result


# -- names ------------------------------------------------------------------------------------------


def split_host_port(name: str) -> tuple[str, int | None]:
    """``host:port`` (``[v6]:port``) as (host, port); a name without a numeric port is (name, None)."""
    host, colon, port = name.rpartition(":")
    if not colon or not port.isdigit() or (":" in host and not host.startswith("[")):
        return name, None
    return host.removeprefix("[").removesuffix("]"), int(port)


def service_for_host(mesh: MeshConfig, host: str, namespace: str) -> Service | None:
    """The service ``host`` names from ``namespace``: its FQDN, ``name``, ``name.ns`` or ``name.ns.svc``."""
    for service in mesh.services:
        if host == service.hostname:
            return service
    labels = host.split(".")
    if len(labels) == 1:
        return mesh.service(host, namespace)
    if len(labels) == 2 or (len(labels) == 3 and labels[2] == "svc"):
        return mesh.service(f"{labels[0]}.{labels[1]}", namespace)
    return None


def service_for_cluster(mesh: MeshConfig, name: str) -> Service | None:
    """The service of an ``outbound|<port>||<hostname>`` name (subsets are not served)."""
    for service in mesh.services:
        if name == outbound_cluster_name(service):
            return service
    return None


def dialled_names(service: Service, proxy_namespace: str) -> list[str]:
    """Every authority a client in ``proxy_namespace`` may dial ``service`` by (the route's domains)."""
    hosts = [
        service.hostname,
        f"{service.name}.{service.namespace}.svc",
        f"{service.name}.{service.namespace}",
    ]
    if proxy_namespace == service.namespace:
        hosts.append(service.name)
    hosts.extend(service.addresses)
    port = str(service.port)
    result = []
    for host in hosts:
        result.append(host)
        result.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    return result


# -- builders (protobuf-JSON dicts) -------------------------------------------------------------------


def _listener(mesh: MeshConfig, proxy: ProxyNode, name: str) -> dict[str, Any] | None:
    if name.startswith(SERVER_LISTENER_PREFIX):
        return _server_listener(mesh, proxy, name)
    host, port = split_host_port(name)
    service = service_for_host(mesh, host, proxy.namespace)
    if service is None or (port is not None and port != service.port):
        return None
    address = service.addresses[0] if service.addresses else _UNSPECIFIED_ADDRESS
    return {
        "name": name,
        "address": socket_address(address, service.port),
        "api_listener": {
            "api_listener": {
                "@type": HCM_TYPE,
                "rds": {"config_source": ads_source(), "route_config_name": outbound_cluster_name(service)},
                "http_filters": router_filters(),
            }
        },
    }


def _server_listener(mesh: MeshConfig, proxy: ProxyNode, name: str) -> dict[str, Any] | None:
    """The listener a gRPC server asks for by its listening address: only where the node's workload serves."""
    host, port = split_host_port(name.removeprefix(SERVER_LISTENER_PREFIX))
    workload = mesh.workload(proxy.name, proxy.namespace)
    if port is None or workload is None or not workload.services or workload.endpoint_port != port:
        return None
    hcm = {
        "@type": HCM_TYPE,
        "stat_prefix": "inbound",
        "route_config": {
            "name": "inbound",
            "virtual_hosts": [
                {
                    "name": "inbound",
                    "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "non_forwarding_action": {}}],
                }
            ],
        },
        "http_filters": router_filters(),
    }
    return {
        "name": name,
        "address": socket_address(host, port),
        "filter_chains": [
            {
                "name": "inbound-mtls",
                "filters": [{"name": "inbound-hcm-mtls", "typed_config": hcm}],
                "transport_socket": {
                    "name": TLS_TRANSPORT_SOCKET,
                    "typed_config": {
                        "@type": _TLS + "DownstreamTlsContext",
                        "common_tls_context": common_tls_context([]),
                        "require_client_certificate": True,
                    },
                },
            }
        ],
    }


def _route(mesh: MeshConfig, proxy: ProxyNode, name: str) -> dict[str, Any] | None:
    service = service_for_cluster(mesh, name)
    if service is None:
        return None
    return {
        "name": name,
        "virtual_hosts": [
            {
                "name": f"{service.hostname}:{service.port}",
                "domains": dialled_names(service, proxy.namespace),
                "routes": [route_to(name)],
            }
        ],
    }


def _cluster(mesh: MeshConfig, proxy: ProxyNode, name: str) -> dict[str, Any] | None:
    service = service_for_cluster(mesh, name)
    if service is None:
        return None
    identities = sorted({w.spiffe_id(mesh.trust_domain) for w in mesh.backing_workloads(service)})
    return {
        "name": name,
        "type": "EDS",
        "eds_cluster_config": {"eds_config": ads_source(), "service_name": name},
        "lb_policy": "ROUND_ROBIN",
        "transport_socket": {
            "name": TLS_TRANSPORT_SOCKET,
            "typed_config": {
                "@type": _TLS + "UpstreamTlsContext",
                "common_tls_context": common_tls_context(identities),
            },
        },
    }


def _endpoints(mesh: MeshConfig, proxy: ProxyNode, name: str) -> dict[str, Any] | None:
    """The service's endpoints, with weights: gRPC drops a locality without one (istiod sets them)."""
    service = service_for_cluster(mesh, name)
    if service is None:
        return None
    assignment = load_assignment(mesh, service)
    for locality in assignment["endpoints"]:
        for endpoint in locality["lb_endpoints"]:
            endpoint["load_balancing_weight"] = 1
        locality["load_balancing_weight"] = len(locality["lb_endpoints"])
    return assignment


def common_tls_context(peer_identities: list[str]) -> dict[str, Any]:
    """Certificates from the bootstrap's provider instance; the peer must be one of ``peer_identities``
    (any identity the root signed when empty).

    Both the current fields (``tls_certificate_provider_instance``, ``ca_certificate_provider_instance``)
    and the deprecated ones older gRPC releases read are set, as istiod does.
    """
    certificate = {"instance_name": CERTIFICATE_PROVIDER, "certificate_name": "default"}
    root = {"instance_name": CERTIFICATE_PROVIDER, "certificate_name": "ROOTCA"}
    validation: dict[str, Any] = {"ca_certificate_provider_instance": root}
    if peer_identities:
        validation["match_subject_alt_names"] = [{"exact": identity} for identity in peer_identities]
    return {
        "tls_certificate_provider_instance": certificate,
        "tls_certificate_certificate_provider_instance": certificate,
        "combined_validation_context": {
            "default_validation_context": validation,
            "validation_context_certificate_provider_instance": root,
        },
    }


_Builder = Callable[[MeshConfig, ProxyNode, str], "dict[str, Any] | None"]
_BUILDERS: dict[str, tuple[_Builder, type[Message]]] = {
    LISTENER_TYPE: (_listener, listener_pb2.Listener),
    ROUTE_TYPE: (_route, route_pb2.RouteConfiguration),
    CLUSTER_TYPE: (_cluster, cluster_pb2.Cluster),
    ENDPOINT_TYPE: (_endpoints, endpoint_pb2.ClusterLoadAssignment),
}
