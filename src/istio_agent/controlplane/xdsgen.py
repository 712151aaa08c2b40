"""xDS resources for one proxy, generated from the mesh file (pure functions: no I/O, no asyncio).

The shapes follow what istiod sends a sidecar, cut down to what a loopback dev mesh needs:
``outbound|<port>||<host>`` EDS clusters with Istio mTLS (SDS secrets ``default`` / ``ROOTCA``
served by the agent), an ``inbound|<appPort>||`` cluster to the local app, and listeners bound to
127.0.0.1 ports instead of iptables capture; or, for a workload whose traffic iptables captures
(``capture: true``), istiod's ``virtualOutbound`` listener on 15001 handing each connection to the
listener of its original destination, with ``PassthroughCluster`` for the rest.
Resources are built as protobuf-JSON dicts (the form the bootstrap module already uses for the same
TLS contexts) and parsed into messages, so there is one definition of each SDS shape.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2
from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2
from envoy.extensions.transport_sockets.tls.v3 import tls_pb2  # noqa: F401  (registers the TLS context types)
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from google.protobuf import json_format
from google.protobuf.message import Message

from istio_agent.bootstrap.sds import mtls_context
from istio_agent.controlplane import wasmgen
from istio_agent.controlplane.mesh import MeshConfig, Service, Workload
from istio_agent.protos import nds_pb2

CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
LISTENER_TYPE = "type.googleapis.com/envoy.config.listener.v3.Listener"
ROUTE_TYPE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
NAME_TABLE_TYPE = "type.googleapis.com/istio.networking.nds.v1.NameTable"
EXTENSION_CONFIG_TYPE = wasmgen.EXTENSION_CONFIG_TYPE
SNAPSHOT_TYPES = (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    LISTENER_TYPE,
    ROUTE_TYPE,
    NAME_TABLE_TYPE,
    EXTENSION_CONFIG_TYPE,
)
NAME_TABLE_RESOURCE = ""
"""The name of the one NameTable resource (Istio's NDS is a singleton)."""

LOOPBACK = "127.0.0.1"
WILDCARD = "0.0.0.0"
VIRTUAL_OUTBOUND = "virtualOutbound"
VIRTUAL_OUTBOUND_PORT = 15001
PASSTHROUGH_CLUSTER = "PassthroughCluster"
CONNECT_TIMEOUT = "10s"
KUBERNETES_REGISTRY = "Kubernetes"

_HCM = "envoy.filters.network.http_connection_manager"
_TCP_PROXY = "envoy.filters.network.tcp_proxy"
_ROUTER = "envoy.filters.http.router"
# Any-typed configs are parsed from "@type": their modules must be imported (registered) here.
HCM_TYPE = "type.googleapis.com/" + http_connection_manager_pb2.HttpConnectionManager.DESCRIPTOR.full_name
_TCP_PROXY_TYPE = "type.googleapis.com/" + tcp_proxy_pb2.TcpProxy.DESCRIPTOR.full_name
_ROUTER_TYPE = "type.googleapis.com/" + router_pb2.Router.DESCRIPTOR.full_name
_HTTP_OPTIONS = http_protocol_options_pb2.HttpProtocolOptions.DESCRIPTOR.full_name

Snapshot = dict[str, dict[str, Message]]
"""type_url -> resource name -> resource message (not wrapped in Any)."""


@dataclass(frozen=True)
class ProxyNode:
    """Who is asking, from the Envoy ``Node`` of the first discovery request."""

    id: str
    name: str
    namespace: str
    cluster: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    verified: bool = False
    """The caller proved an identity (TLS port): only then do WasmPlugins carry their pull secrets."""

    @classmethod
    def from_node(cls, node: base_pb2.Node) -> ProxyNode:
        """Name and namespace from metadata NAME / NAMESPACE, else from the id ``type~ip~name.ns~domain``."""
        metadata = json_format.MessageToDict(node.metadata) if node.HasField("metadata") else {}
        id_name, id_namespace = _parse_node_id(node.id)
        name = metadata.get("NAME")
        namespace = metadata.get("NAMESPACE")
        return cls(
            id=node.id,
            name=name if isinstance(name, str) and name else id_name,
            namespace=namespace if isinstance(namespace, str) and namespace else id_namespace,
            cluster=node.cluster,
            metadata=metadata,
        )


def _parse_node_id(node_id: str) -> tuple[str, str]:
    """(name, namespace) from Istio's service-node id; empty strings for parts that are missing."""
    parts = node_id.split("~")
    if len(parts) < 3:
        return "", ""
    name, dot, namespace = parts[2].rpartition(".")
    if dot:
        return name, namespace
    domain_namespace = parts[3].split(".")[0] if len(parts) > 3 else ""
    return parts[2], domain_namespace


def build_snapshot(mesh: MeshConfig, proxy: ProxyNode) -> Snapshot:
    """Everything ``proxy`` gets, by type; every type but ECDS (there only with WasmPlugins) is present
    so an empty SotW answer is possible.

    An unknown proxy (no workload with its name and namespace) gets clusters and endpoints for all
    services and the name table, but no listeners or routes.
    """
    workload = mesh.workload(proxy.name, proxy.namespace)
    clusters: dict[str, Message] = {}
    endpoints: dict[str, Message] = {}
    listeners: dict[str, Message] = {}
    routes: dict[str, Message] = {}
    for service in mesh.services:
        name = outbound_cluster_name(service)
        clusters[name] = parse_resource(_outbound_cluster(mesh, service), cluster_pb2.Cluster())
        endpoints[name] = parse_resource(load_assignment(mesh, service), endpoint_pb2.ClusterLoadAssignment())
    if workload is not None:
        if workload.services and not workload.proxyless:
            inbound = _inbound_cluster(mesh, workload)
            clusters[inbound["name"]] = parse_resource(inbound, cluster_pb2.Cluster())
            listener = _inbound_listener(mesh, workload)
            listeners[listener["name"]] = parse_resource(listener, listener_pb2.Listener())
        for port, service in _bindings(mesh, workload):
            listener = _outbound_listener(mesh, workload, service, port)
            listeners[listener["name"]] = parse_resource(listener, listener_pb2.Listener())
            if service.is_http:
                route = _outbound_route(service, port)
                routes[route["name"]] = parse_resource(route, route_pb2.RouteConfiguration())
        if workload.capture:
            clusters[PASSTHROUGH_CLUSTER] = parse_resource(_passthrough_cluster(), cluster_pb2.Cluster())
            for listener in _capture_listeners(mesh, workload):
                listeners[listener["name"]] = parse_resource(listener, listener_pb2.Listener())
            for route in _capture_routes(mesh, workload):
                routes[route["name"]] = parse_resource(route, route_pb2.RouteConfiguration())
    snapshot: Snapshot = {
        CLUSTER_TYPE: _sorted(clusters),
        ENDPOINT_TYPE: _sorted(endpoints),
        LISTENER_TYPE: _sorted(listeners),
        ROUTE_TYPE: _sorted(routes),
        NAME_TABLE_TYPE: {NAME_TABLE_RESOURCE: build_name_table(mesh)},
    }
    if mesh.wasm_plugins:
        # ECDS only where there is something to ask for (the ADS server defaults it to none).
        snapshot[EXTENSION_CONFIG_TYPE] = dict(
            wasmgen.extension_configs(
                mesh.wasm_plugins,
                proxy.namespace,
                pull_secrets=mesh.pull_secrets,
                verified=proxy.verified,
                istio_version=str(proxy.metadata.get("ISTIO_VERSION") or ""),
            )
        )
    return snapshot


def build_name_table(mesh: MeshConfig) -> nds_pb2.NameTable:
    """The NDS table: one Kubernetes entry per service with addresses, then ``nameTable`` verbatim over it.

    A service without VIPs resolves to its workloads' addresses; one with neither is left out (as
    istiod leaves out services without addresses), so its name is not answered with nothing.
    """
    table = nds_pb2.NameTable()
    for service in mesh.services:
        ips = service.addresses or _sorted_ips({w.address for w in mesh.backing_workloads(service)})
        if not ips:
            continue
        info = table.table[service.hostname]
        info.ips.extend(ips)
        info.registry = KUBERNETES_REGISTRY
        info.shortname = service.name
        info.namespace = service.namespace
    for host, entry in mesh.name_table.items():
        table.table[host].CopyFrom(
            nds_pb2.NameTable.NameInfo(
                ips=entry.ips,
                registry=entry.registry,
                shortname=entry.shortname,
                namespace=entry.namespace,
                alt_hosts=entry.alt_hosts,
            )
        )
    return table


# -- names ------------------------------------------------------------------------------------------


def outbound_cluster_name(service: Service) -> str:
    return f"outbound|{service.port}||{service.hostname}"


def inbound_cluster_name(app_port: int) -> str:
    return f"inbound|{app_port}||"


def outbound_listener_name(port: int) -> str:
    return f"{LOOPBACK}_{port}"


def inbound_listener_name(workload: Workload) -> str:
    return f"inbound_{workload.address}_{workload.inbound_port}"


# -- builders (protobuf-JSON dicts) -------------------------------------------------------------------


def ads_source() -> dict[str, Any]:
    return {"ads": {}, "initial_fetch_timeout": "0s", "resource_api_version": "V3"}


def socket_address(address: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": address, "port_value": port}}


def router_filters() -> list[dict[str, Any]]:
    return [{"name": _ROUTER, "typed_config": {"@type": _ROUTER_TYPE}}]


def route_to(cluster: str) -> dict[str, Any]:
    return {"match": {"prefix": "/"}, "route": {"cluster": cluster, "timeout": "0s"}}


def _outbound_cluster(mesh: MeshConfig, service: Service) -> dict[str, Any]:
    name = outbound_cluster_name(service)
    accounts = sorted({w.spiffe_id(mesh.trust_domain) for w in mesh.backing_workloads(service)})
    transport = mtls_context(downstream=False)
    context = transport["typed_config"]
    context["sni"] = f"outbound_.{service.port}_._.{service.hostname}"
    validation = context["common_tls_context"]["combined_validation_context"]["default_validation_context"]
    validation["match_typed_subject_alt_names"] = [
        {"san_type": "URI", "matcher": {"exact": account}} for account in accounts
    ]
    cluster: dict[str, Any] = {
        "name": name,
        "type": "EDS",
        "eds_cluster_config": {"eds_config": ads_source(), "service_name": name},
        "connect_timeout": CONNECT_TIMEOUT,
        "transport_socket": transport,
    }
    if service.protocol == "grpc":
        cluster["typed_extension_protocol_options"] = _http2_only()
    return cluster


def _http2_only() -> dict[str, Any]:
    """Upstream HTTP/2 (gRPC servers, proxyless ones included, speak nothing else)."""
    return {
        _HTTP_OPTIONS: {
            "@type": "type.googleapis.com/" + _HTTP_OPTIONS,
            "explicit_http_config": {"http2_protocol_options": {}},
        }
    }


def load_assignment(mesh: MeshConfig, service: Service) -> dict[str, Any]:
    addresses = {(w.address, w.endpoint_port) for w in mesh.backing_workloads(service) if w.endpoint_port}
    ordered = sorted(addresses, key=lambda pair: (_ip_key(pair[0]), pair[1]))
    assignment: dict[str, Any] = {"cluster_name": outbound_cluster_name(service), "endpoints": []}
    if ordered:
        assignment["endpoints"].append(
            {
                "locality": {},
                "lb_endpoints": [
                    {"endpoint": {"address": socket_address(address, port)}} for address, port in ordered
                ],
            }
        )
    return assignment


def _inbound_cluster(mesh: MeshConfig, workload: Workload) -> dict[str, Any]:
    assert workload.app_port is not None  # validated: a workload backing services has an appPort
    name = inbound_cluster_name(workload.app_port)
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": CONNECT_TIMEOUT,
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": socket_address(LOOPBACK, workload.app_port)}}]}
            ],
        },
    }
    services = [mesh.service(ref, workload.namespace) for ref in workload.services]
    if any(service is not None and service.protocol == "grpc" for service in services):
        cluster["typed_extension_protocol_options"] = _http2_only()
    return cluster


def _inbound_listener(mesh: MeshConfig, workload: Workload) -> dict[str, Any]:
    assert workload.inbound_port is not None and workload.app_port is not None  # validated
    cluster = inbound_cluster_name(workload.app_port)
    services = [mesh.service(ref, workload.namespace) for ref in workload.services]
    if all(service is not None and service.is_http for service in services):
        filter_config: dict[str, Any] = {
            "name": _HCM,
            "typed_config": {
                "@type": HCM_TYPE,
                "stat_prefix": f"inbound_{workload.inbound_port}",
                "forward_client_cert_details": "SANITIZE_SET",
                "set_current_client_cert_details": {"uri": True},
                "route_config": {
                    "name": cluster,
                    "virtual_hosts": [
                        {
                            "name": f"inbound|http|{workload.app_port}",
                            "domains": ["*"],
                            "routes": [route_to(cluster)],
                        }
                    ],
                },
                "http_filters": _http_filters(mesh, workload, workload.app_port, wasmgen.SERVER),
            },
        }
    else:
        filter_config = {
            "name": _TCP_PROXY,
            "typed_config": {"@type": _TCP_PROXY_TYPE, "stat_prefix": cluster, "cluster": cluster},
        }
    filters = [*_network_filters(mesh, workload, workload.app_port, wasmgen.SERVER), filter_config]
    return {
        "name": inbound_listener_name(workload),
        "address": socket_address(workload.address, workload.inbound_port),
        "traffic_direction": "INBOUND",
        "filter_chains": [
            {
                "filters": filters,
                "transport_socket": mtls_context(
                    downstream=True, peer_spiffe_prefix=f"spiffe://{mesh.trust_domain}/"
                ),
            }
        ],
    }


def _bindings(mesh: MeshConfig, workload: Workload) -> list[tuple[int, Service]]:
    """The workload's outbound ports with their (validated, so known) services."""
    result = []
    for binding in workload.outbound:
        service = mesh.service(binding.service, workload.namespace)
        if service is not None:
            result.append((binding.port, service))
    return result


def _outbound_listener(mesh: MeshConfig, workload: Workload, service: Service, port: int) -> dict[str, Any]:
    name = outbound_listener_name(port)
    cluster = outbound_cluster_name(service)
    if service.is_http:
        filter_config: dict[str, Any] = {
            "name": _HCM,
            "typed_config": {
                "@type": HCM_TYPE,
                "stat_prefix": f"outbound_{name}",
                "rds": {"config_source": ads_source(), "route_config_name": str(port)},
                "http_filters": _http_filters(mesh, workload, service.port, wasmgen.CLIENT),
            },
        }
    else:
        filter_config = {
            "name": _TCP_PROXY,
            "typed_config": {"@type": _TCP_PROXY_TYPE, "stat_prefix": cluster, "cluster": cluster},
        }
    filters = [*_network_filters(mesh, workload, service.port, wasmgen.CLIENT), filter_config]
    return {
        "name": name,
        "address": socket_address(LOOPBACK, port),
        "traffic_direction": "OUTBOUND",
        "filter_chains": [{"filters": filters}],
    }


def _outbound_route(service: Service, port: int) -> dict[str, Any]:
    return {
        "name": str(port),
        "virtual_hosts": [
            {
                "name": f"{service.hostname}:{service.port}",
                "domains": ["*"],
                "routes": [route_to(outbound_cluster_name(service))],
            }
        ],
    }


# -- capture (a workload whose traffic iptables redirects to 15001) -----------------------------------


def _passthrough_cluster() -> dict[str, Any]:
    """Where a captured connection to no mesh service goes: its original destination (ALLOW_ANY)."""
    return {
        "name": PASSTHROUGH_CLUSTER,
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": CONNECT_TIMEOUT,
    }


def _tcp_proxy(stat_prefix: str, cluster: str) -> dict[str, Any]:
    return {
        "name": _TCP_PROXY,
        "typed_config": {"@type": _TCP_PROXY_TYPE, "stat_prefix": stat_prefix, "cluster": cluster},
    }


def _capture_listeners(mesh: MeshConfig, workload: Workload) -> list[dict[str, Any]]:
    """istiod's ``virtualOutbound`` on 15001 (``use_original_dst``: Envoy hands the connection to the
    listener of its original destination) and those listeners, not bound to a port: ``0.0.0.0_<port>``
    for HTTP services (routes by Host, RDS ``<port>``), ``<address>_<port>`` for TCP ones."""
    listeners: dict[str, dict[str, Any]] = {}
    for service in mesh.services:
        if service.is_http:
            name = f"{WILDCARD}_{service.port}"
            hcm = {
                "@type": HCM_TYPE,
                "stat_prefix": f"outbound_{name}",
                "rds": {"config_source": ads_source(), "route_config_name": str(service.port)},
                "http_filters": _http_filters(mesh, workload, service.port, wasmgen.CLIENT),
            }
            filters = [
                *_network_filters(mesh, workload, service.port, wasmgen.CLIENT),
                {"name": _HCM, "typed_config": hcm},
            ]
            listeners[name] = _unbound_listener(name, WILDCARD, service.port, filters)
        else:
            cluster = outbound_cluster_name(service)
            for address in _service_addresses(mesh, service):
                name = f"{address}_{service.port}"
                network = _network_filters(mesh, workload, service.port, wasmgen.CLIENT)
                listeners[name] = _unbound_listener(
                    name, address, service.port, [*network, _tcp_proxy(cluster, cluster)]
                )
    virtual = {
        "name": VIRTUAL_OUTBOUND,
        "address": socket_address(WILDCARD, VIRTUAL_OUTBOUND_PORT),
        "use_original_dst": True,
        "traffic_direction": "OUTBOUND",
        "filter_chains": [
            {
                "name": "virtualOutbound-catchall-tcp",
                "filters": [_tcp_proxy(PASSTHROUGH_CLUSTER, PASSTHROUGH_CLUSTER)],
            }
        ],
    }
    return [virtual, *listeners.values()]


def _unbound_listener(name: str, address: str, port: int, filters: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "name": name,
        "address": socket_address(address, port),
        "bind_to_port": False,
        "traffic_direction": "OUTBOUND",
        "filter_chains": [{"filters": filters}],
    }


def _capture_routes(mesh: MeshConfig, workload: Workload) -> list[dict[str, Any]]:
    """One route configuration per HTTP port: a virtual host per service, by every name the caller may
    use (the short ones in its own namespace) and address, with and without the port; the rest passes
    through (``allow_any``)."""
    by_port: dict[int, list[dict[str, Any]]] = {}
    for service in mesh.services:
        if not service.is_http:
            continue
        names = [service.hostname, f"{service.name}.{service.namespace}.svc", service.ref]
        if service.namespace == workload.namespace:
            names.append(service.name)
        names += _service_addresses(mesh, service)
        domains = [f"{name}{suffix}" for name in names for suffix in ("", f":{service.port}")]
        by_port.setdefault(service.port, []).append(
            {
                "name": f"{service.hostname}:{service.port}",
                "domains": domains,
                "routes": [route_to(outbound_cluster_name(service))],
            }
        )
    allow_any = {"name": "allow_any", "domains": ["*"], "routes": [route_to(PASSTHROUGH_CLUSTER)]}
    return [
        {"name": str(port), "virtual_hosts": [*hosts, allow_any]} for port, hosts in sorted(by_port.items())
    ]


def _service_addresses(mesh: MeshConfig, service: Service) -> list[str]:
    """What callers connect to: the service's VIPs, else (headless) its workloads' addresses."""
    return list(service.addresses) or _sorted_ips({w.address for w in mesh.backing_workloads(service)})


# -- WasmPlugins -------------------------------------------------------------------------------------


def _http_filters(mesh: MeshConfig, workload: Workload, port: int, mode: str) -> list[dict[str, Any]]:
    """The HTTP WasmPlugins of this listener (fetched over ECDS), then the router."""
    plugins = wasmgen.listener_plugins(
        mesh.wasm_plugins, workload.namespace, workload.labels, port=port, mode=mode, network=False
    )
    return [*(wasmgen.discovery_filter(plugin) for plugin in plugins), *router_filters()]


def _network_filters(mesh: MeshConfig, workload: Workload, port: int, mode: str) -> list[dict[str, Any]]:
    """The NETWORK WasmPlugins of this listener, which go before its terminal filter."""
    plugins = wasmgen.listener_plugins(
        mesh.wasm_plugins, workload.namespace, workload.labels, port=port, mode=mode, network=True
    )
    return [wasmgen.discovery_filter(plugin) for plugin in plugins]


# -- helpers ------------------------------------------------------------------------------------------


def parse_resource(document: dict[str, Any], message: Message) -> Message:
    return json_format.ParseDict(document, message)


def _sorted(resources: dict[str, Message]) -> dict[str, Message]:
    return {name: resources[name] for name in sorted(resources)}


def _ip_key(address: str) -> tuple[int, int]:
    ip = ipaddress.ip_address(address)
    return ip.version, int(ip)


def _sorted_ips(addresses: set[str]) -> list[str]:
    return sorted(addresses, key=_ip_key)
