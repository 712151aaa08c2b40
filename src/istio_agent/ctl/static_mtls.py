"""Static Envoy bootstraps for tests and benchmarks (no xDS).

``mtls_bootstrap``: one mTLS listener whose certificates come from the agent over SDS (``default`` +
``ROOTCA``) and a direct response naming the verified caller — where only the certificate side is
under test. ``direct_response_bootstrap``: admin plus one plain HTTP listener, the least Envoy
needs to be ready — the "Envoy alone" floor of the start-up benchmark and readiness tests.
"""

from __future__ import annotations

from typing import Any

from istio_agent.bootstrap.sds import mtls_context, sds_cluster

SDS_SOCKET = "./var/run/secrets/workload-spiffe-uds/socket"
TRUST_DOMAIN = "cluster.local"


def mtls_bootstrap(
    node_id: str, cluster: str, admin_port: int, listener_port: int, *, delta_sds: bool = False
) -> dict[str, Any]:
    """Envoy with one mTLS listener (``default`` + ``ROOTCA`` over SDS) that echoes the verified caller."""
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "inbound",
        "forward_client_cert_details": "SANITIZE_SET",
        "set_current_client_cert_details": {"uri": True},
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "all",
                    "domains": ["*"],
                    "routes": [
                        {
                            "match": {"prefix": "/"},
                            "direct_response": {
                                "status": 200,
                                "body": {"inline_string": "hello from envoy"},
                            },
                            "response_headers_to_add": [
                                {
                                    "header": {
                                        "key": "x-peer-identity",
                                        "value": "%DOWNSTREAM_PEER_URI_SAN%",
                                    },
                                }
                            ],
                        }
                    ],
                }
            ]
        },
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            }
        ],
    }
    return {
        "node": {"id": node_id, "cluster": cluster},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {
            "clusters": [sds_cluster(SDS_SOCKET)],
            "listeners": [
                {
                    "name": "inbound-mtls",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": listener_port}},
                    "filter_chains": [
                        {
                            "transport_socket": mtls_context(
                                downstream=True,
                                peer_spiffe_prefix=f"spiffe://{TRUST_DOMAIN}/",
                                delta=delta_sds,
                            ),
                            "filters": [
                                {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                            ],
                        }
                    ],
                }
            ],
        },
    }


def direct_response_bootstrap(admin_port: int, listener_port: int, name: str = "static") -> dict[str, Any]:
    """Admin on ``admin_port`` and one HTTP listener on ``listener_port`` answering 200 to everything."""
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
        ".HttpConnectionManager",
        "stat_prefix": name,
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "all",
                    "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "direct_response": {"status": 200}}],
                }
            ]
        },
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            }
        ],
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {
            "listeners": [
                {
                    "name": name,
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": listener_port}},
                    "filter_chains": [
                        {
                            "filters": [
                                {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                            ]
                        }
                    ],
                }
            ]
        },
    }
