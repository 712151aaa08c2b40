"""End to end: grpcio's own xDS client and server, configured only by the local control plane.

No agent: each process gets a gRPC bootstrap written here by hand (what the agent writes for the
``grpc-agent`` template: node metadata ``GENERATOR=grpc``, a ``file_watcher`` certificate provider
over certificates the control plane's CA signed, the server listener name template). The server is
``grpc.server(..., xds=True)`` with ``xds_server_credentials``; the client dials ``xds:///`` with
``xds_channel_credentials``. grpcio reads the bootstrap once per process, so each side runs in its
own subprocess. The server answers with what its TLS stack saw of the caller, so the test checks
that the call went over mTLS and that the server saw the client's SPIFFE identity.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

import pytest
from google.protobuf import json_format

from istio_agent.controlplane.ca import LocalCA
from istio_agent.controlplane.mesh import load_mesh
from istio_agent.controlplane.xdsgen import CLUSTER_TYPE, ENDPOINT_TYPE, ProxyNode, build_snapshot
from istio_agent.ctl.local import free_port, port_open, wait_until
from istio_agent.envoy.binary import find_envoy
from istio_agent.security.keys import KeyOptions, generate_csr
from tests.e2e.grpc_apps import (
    CLIENT_ID,
    SERVER_ID,
    SERVICE_HOST,
    SERVICE_PORT,
    TRUST_DOMAIN,
    call_once,
    mesh_yaml,
    refused,
    start_server,
)
from tests.e2e.harness import ControlPlane

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def issue_certs(ca: LocalCA, directory: Path, identity: str) -> Path:
    """key.pem, cert-chain.pem and root-cert.pem as the agent keeps them in OUTPUT_CERTS."""
    directory.mkdir(parents=True)
    csr, key = generate_csr(identity, KeyOptions(ecc_signature_algorithm="ECDSA"))
    chain = ca.sign_csr(csr, identity, timedelta(hours=1))
    (directory / "key.pem").write_bytes(key)
    (directory / "cert-chain.pem").write_text("".join(chain))
    (directory / "root-cert.pem").write_text(chain[-1])
    return directory


def write_bootstrap(path: Path, xds_port: int, name: str, certs: Path) -> Path:
    """A gRPC bootstrap shaped like the one the agent writes (pkg/istio-agent/grpcxds/grpc_bootstrap.go)."""
    bootstrap: dict[str, Any] = {
        "xds_servers": [
            {
                "server_uri": f"127.0.0.1:{xds_port}",
                "channel_creds": [{"type": "insecure"}],
                "server_features": ["xds_v3"],
            }
        ],
        "node": {
            "id": f"sidecar~127.0.0.1~{name}.default~default.svc.cluster.local",
            "metadata": {"GENERATOR": "grpc", "NAME": name, "NAMESPACE": "default"},
            "locality": {},
        },
        "certificate_providers": {
            "default": {
                "plugin_name": "file_watcher",
                "config": {
                    "certificate_file": str(certs / "cert-chain.pem"),
                    "private_key_file": str(certs / "key.pem"),
                    "ca_certificate_file": str(certs / "root-cert.pem"),
                    "refresh_interval": "900s",
                },
            }
        },
        "server_listener_resource_name_template": "xds.istio.io/grpc/lds/inbound/%s",
    }
    path.write_text(json.dumps(bootstrap, indent=2))
    return path


class Mesh:
    """The control plane, a proxyless server process and the bootstraps, in one test directory."""

    def __init__(self, base: Path, server_account: str = "echo") -> None:
        self.base = base
        self.server_port = free_port()
        self.control_plane = ControlPlane(base, TRUST_DOMAIN)
        self.control_plane.mesh_file.write_text(mesh_yaml(self.server_port, server_account))
        self.server: subprocess.Popen[str] | None = None
        self.server_log: IO[str] | None = None

    def start(self) -> None:
        self.control_plane.start()
        ca = LocalCA.load_or_create(self.control_plane.state_dir, TRUST_DOMAIN)
        server_certs = issue_certs(ca, self.base / "echo-certs", SERVER_ID)
        self.client_certs = issue_certs(ca, self.base / "client-certs", CLIENT_ID)
        bootstrap = write_bootstrap(
            self.base / "echo-bootstrap.json", self.control_plane.port, "echo-1", server_certs
        )
        self.server_log = (self.base / "server.log").open("w")
        self.server = start_server(bootstrap, self.server_port, self.server_log)

    def call(self, *targets: str, name: str = "client-1", timeout: float = 30) -> dict[str, Any]:
        """Call each target from a fresh client process; target -> what the server saw, or "error"."""
        bootstrap = write_bootstrap(
            self.base / f"{name}-bootstrap.json", self.control_plane.port, name, self.client_certs
        )
        return call_once(bootstrap, *targets, timeout=timeout)

    def stop(self) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.terminate()
            try:
                self.server.wait(10)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait()
        self.control_plane.stop()
        if self.server_log is not None:
            self.server_log.close()


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[Mesh]:
    running = Mesh(tmp_path)
    try:
        running.start()
        yield running
    finally:
        running.stop()


def test_proxyless_call_over_mtls_carries_the_client_identity(mesh: Mesh) -> None:
    fqdn = f"xds:///{SERVICE_HOST}:{SERVICE_PORT}"
    short = f"xds:///echo:{SERVICE_PORT}"
    results = mesh.call(fqdn, short)
    for target in (fqdn, short):
        seen = results[target]
        assert "error" not in seen, (target, seen, (mesh.base / "server.log").read_text()[-3000:])
        assert seen["transport_security_type"] == ["tls"]
        assert seen["security_level"] == ["TSI_PRIVACY_AND_INTEGRITY"]
        assert seen["peer_spiffe_id"] == [CLIENT_ID]
        assert seen["x509_subject_alternative_name"] == [CLIENT_ID]


def test_server_requires_mtls(mesh: Mesh) -> None:
    """The inbound listener requires a client certificate: a plaintext caller is refused, while a
    mesh client in the same run gets through (so the server was serving)."""
    direct = f"127.0.0.1:{mesh.server_port}"
    fqdn = f"xds:///{SERVICE_HOST}:{SERVICE_PORT}"
    results = mesh.call(fqdn, direct, timeout=5)
    assert results[fqdn].get("peer_spiffe_id") == [CLIENT_ID], results[fqdn]
    assert refused(results[direct]), results[direct]


def test_server_identity_not_in_the_mesh_file_is_refused(tmp_path: Path) -> None:
    """The client checks the server's SAN against the service's workloads: a server with another
    identity (the mesh file says the workload runs as ``other``) gets no call."""
    running = Mesh(tmp_path, server_account="other")
    try:
        running.start()
        results = running.call(f"xds:///{SERVICE_HOST}:{SERVICE_PORT}", timeout=5)
    finally:
        running.stop()
    assert refused(results[f"xds:///{SERVICE_HOST}:{SERVICE_PORT}"]), results


def envoy_bootstrap(mesh: Mesh, listen_port: int) -> dict[str, Any]:
    """Envoy with the cluster the control plane gives a sidecar for ``echo``, endpoints inline and the
    SDS secrets swapped for the same certificate files (no agent here), behind a plaintext listener."""
    snapshot = build_snapshot(load_mesh(mesh.control_plane.mesh_file), ProxyNode("x", "client-1", "default"))
    name = f"outbound|{SERVICE_PORT}||{SERVICE_HOST}"
    cluster = json_format.MessageToDict(snapshot[CLUSTER_TYPE][name], preserving_proto_field_name=True)
    del cluster["eds_cluster_config"]
    cluster["type"] = "STATIC"
    cluster["load_assignment"] = json_format.MessageToDict(
        snapshot[ENDPOINT_TYPE][name], preserving_proto_field_name=True
    )
    common = cluster["transport_socket"]["typed_config"]["common_tls_context"]
    validation = common.pop("combined_validation_context")["default_validation_context"]
    del common["tls_certificate_sds_secret_configs"]
    certs = mesh.client_certs
    common["tls_certificates"] = [
        {
            "certificate_chain": {"filename": str(certs / "cert-chain.pem")},
            "private_key": {"filename": str(certs / "key.pem")},
        }
    ]
    common["validation_context"] = {**validation, "trusted_ca": {"filename": str(certs / "root-cert.pem")}}
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "test",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "echo",
                    "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": {"cluster": name}}],
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
    listener = {
        "name": "test",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen_port}},
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
        ],
    }
    return {"static_resources": {"clusters": [cluster], "listeners": [listener]}}


def test_sidecar_cluster_reaches_the_proxyless_server(mesh: Mesh) -> None:
    """A sidecar calling a proxyless server: the Envoy cluster for a grpc service (HTTP/2, Istio
    mTLS with SNI and the server's SAN) to the endpoint at the workload's appPort."""
    listen_port = free_port()
    config = mesh.base / "envoy.json"
    config.write_text(json.dumps(envoy_bootstrap(mesh, listen_port)))
    with (mesh.base / "envoy.log").open("w") as log:
        envoy = subprocess.Popen(
            [str(find_envoy()), "-c", str(config), "--base-id", str(free_port()), "--log-level", "warning"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_until(lambda: port_open(listen_port), 20, "Envoy to listen")
            # The proxyless call first: it waits until the server has its listener and serves.
            fqdn = f"xds:///{SERVICE_HOST}:{SERVICE_PORT}"
            results = mesh.call(fqdn, f"127.0.0.1:{listen_port}", timeout=20)
        finally:
            envoy.terminate()
            envoy.wait(10)
    assert "error" not in results[fqdn], results
    seen = results[f"127.0.0.1:{listen_port}"]
    assert seen.get("peer_spiffe_id") == [CLIENT_ID], seen
    assert seen["ssl_requested_server_name"] == [f"outbound_.{SERVICE_PORT}_._.{SERVICE_HOST}"]
