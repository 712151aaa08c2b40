"""Settings of the gRPC xDS bootstrap the agent writes for proxyless gRPC apps.

Istio writes it whenever ``GRPC_XDS_BOOTSTRAP`` is non-empty (its default is
``./etc/istio/proxy/grpc-bootstrap.json``), for Envoy sidecars too (pkg/istio-agent/agent.go).
The node is the one Envoy's bootstrap announces (``BootstrapSettings``), so both are built by one path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from istio_agent.config.bootstrap import BootstrapSettings
from istio_agent.config.env import Env
from istio_agent.config.security import SecuritySettings
from istio_agent.config.xds import XdsSettings

GRPC_BOOTSTRAP_VARIABLE = "GRPC_XDS_BOOTSTRAP"
DEFAULT_GRPC_BOOTSTRAP = "./etc/istio/proxy/grpc-bootstrap.json"


@dataclass(frozen=True)
class GrpcBootstrapSettings:
    """What the gRPC bootstrap is made of; paths absolute."""

    path: Path
    node_id: str
    metadata: Mapping[str, Any] = field(default_factory=dict)
    locality: Mapping[str, str] = field(default_factory=dict)
    xds_socket: Path | None = None  # None: gRPC talks to discovery_address directly
    discovery_address: str = ""
    cert_dir: Path | None = None  # OUTPUT_CERTS: None writes no certificate provider

    @classmethod
    def from_settings(
        cls, path: Path, node: BootstrapSettings, xds: XdsSettings | None, security: SecuritySettings
    ) -> GrpcBootstrapSettings:
        """The node of Envoy's bootstrap, the agent's XDS socket and OUTPUT_CERTS."""
        socket, address = None, node.proxy_config.discovery_address
        if xds is not None:
            socket, address = xds.socket_path.absolute(), xds.discovery_address
        return cls(
            path=path,
            node_id=node.node_id,
            metadata=node.metadata,
            locality=node.locality,
            xds_socket=socket,
            discovery_address=address,
            cert_dir=security.output_certs,
        )


def grpc_bootstrap_path(env: Env, workdir: Path) -> Path | None:
    """``GRPC_XDS_BOOTSTRAP`` resolved under the working directory; None when set to empty (not written)."""
    raw = env.text(GRPC_BOOTSTRAP_VARIABLE, DEFAULT_GRPC_BOOTSTRAP)
    if not raw:
        return None
    return (workdir / raw).absolute()
