"""The gRPC xDS bootstrap for proxyless gRPC apps (Istio: pkg/istio-agent/grpcxds/grpc_bootstrap.go).

A gRPC app with ``GRPC_XDS_BOOTSTRAP`` pointing at this file dials ``xds:///`` targets itself: its
xDS client reads the server to talk to (the agent's XDS socket, which relays to istiod), the node it
announces (the same metadata Envoy would send, with ``GENERATOR=grpc`` so istiod answers with the
resources gRPC understands), the ``default`` certificate provider over the files the agent keeps
fresh in OUTPUT_CERTS, and the name of its inbound listener resource.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from istio_agent.config.grpc import GrpcBootstrapSettings
from istio_agent.config.security import CERT_CHAIN_FILE, KEY_FILE, ROOT_CERT_FILE
from istio_agent.files import write_atomic

GENERATOR = "grpc"
"""Forced into the node metadata whatever ISTIO_META_GENERATOR says: istiod picks its generator by it."""
SERVER_LISTENER_TEMPLATE = "xds.istio.io/grpc/lds/inbound/%s"
"""gRPC's xDS server asks for this listener with ``%s`` replaced by ``IP:port``."""
CERT_PROVIDER = "default"
FILE_WATCHER = "file_watcher"
REFRESH_INTERVAL = "900s"
"""How often gRPC re-reads the certificate files (15 minutes, a protobuf JSON duration)."""
FILE_MODE = 0o644
DIRECTORY_MODE = 0o700


def server_uri(xds_socket: Path | None, discovery_address: str) -> str:
    """The agent's XDS socket as a gRPC target (``unix:///abs/path``), else istiod's address."""
    if xds_socket is None:
        return discovery_address
    return f"unix://{xds_socket.absolute()}"


def grpc_node(node_id: str, metadata: Mapping[str, Any], locality: Mapping[str, str]) -> dict[str, Any]:
    """The node as Istio writes it (Go's encoding/json of Envoy's ``core.Node``, keys in its order).

    ``locality`` is always present and ``UserAgentVersionType`` is ``null``: Istio's file has both
    (the oneof carries no JSON tag), and gRPC ignores what it does not know.
    """
    meta = {**metadata, "GENERATOR": GENERATOR}
    return {
        "id": node_id,
        "metadata": {key: meta[key] for key in sorted(meta)},
        "locality": dict(locality),
        "UserAgentVersionType": None,
    }


def certificate_providers(cert_dir: Path) -> dict[str, Any]:
    """The ``default`` file_watcher provider over the three files the agent writes to OUTPUT_CERTS."""
    return {
        CERT_PROVIDER: {
            "plugin_name": FILE_WATCHER,
            "config": {
                "certificate_file": str(cert_dir / CERT_CHAIN_FILE),
                "private_key_file": str(cert_dir / KEY_FILE),
                "ca_certificate_file": str(cert_dir / ROOT_CERT_FILE),
                "refresh_interval": REFRESH_INTERVAL,
            },
        }
    }


def build_grpc_bootstrap(settings: GrpcBootstrapSettings) -> dict[str, Any]:
    """The bootstrap as a dict, fields in the order Istio writes them."""
    bootstrap: dict[str, Any] = {
        "xds_servers": [
            {
                "server_uri": server_uri(settings.xds_socket, settings.discovery_address),
                "channel_creds": [{"type": "insecure"}],
                "server_features": ["xds_v3"],
            }
        ],
        "node": grpc_node(settings.node_id, settings.metadata, settings.locality),
    }
    if settings.cert_dir is not None:
        bootstrap["certificate_providers"] = certificate_providers(settings.cert_dir)
    bootstrap["server_listener_resource_name_template"] = SERVER_LISTENER_TEMPLATE
    return bootstrap


def write_grpc_bootstrap(settings: GrpcBootstrapSettings) -> Path:
    """Write the bootstrap atomically (directory 0700, file 0644, 2-space JSON, as Istio); raises OSError."""
    path = settings.path
    path.parent.mkdir(mode=DIRECTORY_MODE, parents=True, exist_ok=True)
    write_atomic(path, json.dumps(build_grpc_bootstrap(settings), indent=2), FILE_MODE)
    return path
