"""The bootstrap pieces that connect Envoy to the agent's SDS server.

Istio's bootstrap names the cluster ``sds-grpc`` and points it at the agent's Unix socket; TLS
contexts then reference secrets ``default`` and ``ROOTCA`` through it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SDS_CLUSTER = "sds-grpc"
SECRET_TYPE = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"


def sds_cluster(socket_path: Path | str) -> dict[str, Any]:
    """A static HTTP/2 cluster reaching the agent's SDS socket."""
    return {
        "name": SDS_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": SDS_CLUSTER,
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": {"pipe": {"path": str(socket_path)}}}}]}
            ],
        },
    }


def sds_secret_config(name: str, *, delta: bool = False) -> dict[str, Any]:
    """An SdsSecretConfig for ``name`` served by the agent (node sent on the first message only)."""
    return {
        "name": name,
        "sds_config": {
            "api_config_source": {
                "api_type": "DELTA_GRPC" if delta else "GRPC",
                "grpc_services": [{"envoy_grpc": {"cluster_name": SDS_CLUSTER}}],
                "set_node_on_first_message_only": True,
                "transport_api_version": "V3",
            },
            "initial_fetch_timeout": "0s",
            "resource_api_version": "V3",
        },
    }


def mtls_context(
    *,
    downstream: bool,
    peer_spiffe_prefix: str | None = None,
    alpn: list[str] | None = None,
    delta: bool = False,
) -> dict[str, Any]:
    """A TLS context using ``default`` as our certificate and ``ROOTCA`` to verify the peer.

    ``peer_spiffe_prefix`` (e.g. ``spiffe://cluster.local/``) restricts accepted peer identities;
    ``delta`` subscribes with Delta SDS instead of state-of-the-world.
    """
    validation: dict[str, Any] = {}
    if peer_spiffe_prefix:
        validation["match_typed_subject_alt_names"] = [
            {"san_type": "URI", "matcher": {"prefix": peer_spiffe_prefix}}
        ]
    common: dict[str, Any] = {
        "tls_certificate_sds_secret_configs": [sds_secret_config("default", delta=delta)],
        "combined_validation_context": {
            "default_validation_context": validation,
            "validation_context_sds_secret_config": sds_secret_config("ROOTCA", delta=delta),
        },
    }
    if alpn:
        common["alpn_protocols"] = alpn
    kind = "DownstreamTlsContext" if downstream else "UpstreamTlsContext"
    context: dict[str, Any] = {
        "@type": f"type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.{kind}",
        "common_tls_context": common,
    }
    if downstream:
        context["require_client_certificate"] = True
    return {"name": "envoy.transport_sockets.tls", "typed_config": context}
