"""A WasmPlugin from the local control plane in real Envoy, connected directly (no agent): the inbound
listener's HTTP connection manager fetches the plugin over ECDS (SotW and Delta ADS) and the test
filter (tests/wasm/filter/add_header.wat, a file:// URL) adds ``x-wasm-plugin: <pluginConfig JSON>``;
a changed mesh file reaches Envoy as a new ECDS resource.

Envoy's mTLS certificates come from the agent's SDS server in this process, serving a test CA's
certificates, as the agent would serve the control plane's.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from istio_agent.bootstrap.sds import sds_cluster
from istio_agent.ctl.local import free_port
from istio_agent.metrics import Registry
from istio_agent.security.model import ROOT_CERT, WORKLOAD_KEY_CERT, SecretError, SecretItem
from istio_agent.security.sds import SdsServer
from tests.controlplane import started_plane
from tests.security.certs import issue, key_to_pem, make_ca, new_key, to_pem
from tests.wasm.wasm_filter import HEADER, add_header_module, running_envoy

__all__ = ["add_header_module"]  # the fixture, used by name

pytestmark = pytest.mark.e2e

TRUST_DOMAIN = "cluster.local"
WAIT = 30.0


class StaticSecrets:
    """The SDS server's provider: one workload certificate and its root."""

    def __init__(self, items: dict[str, SecretItem]) -> None:
        self.items = items

    async def generate(self, resource_name: str) -> SecretItem:
        try:
            return self.items[resource_name]
        except KeyError:
            raise SecretError(f"no secret named {resource_name!r}") from None


@dataclass
class Pki:
    """A mesh CA, the server workload's secrets and a client certificate of the trust domain."""

    secrets: StaticSecrets
    client_chain: Path
    client_key: Path
    root: Path


def make_pki(directory: Path) -> Pki:
    ca_key, ca = make_ca("mesh-root")
    server_key = new_key()
    server = issue(ca_key, ca, [f"spiffe://{TRUST_DOMAIN}/ns/default/sa/b"], server_key.public_key())
    client_key = new_key()
    client = issue(ca_key, ca, [f"spiffe://{TRUST_DOMAIN}/ns/default/sa/a"], client_key.public_key())
    root = directory / "root.pem"
    root.write_bytes(to_pem(ca))
    chain = directory / "client-chain.pem"
    chain.write_bytes(to_pem(client) + to_pem(ca))
    key = directory / "client-key.pem"
    key.write_bytes(key_to_pem(client_key))
    secrets = StaticSecrets(
        {
            WORKLOAD_KEY_CERT: SecretItem(
                WORKLOAD_KEY_CERT,
                certificate_chain=to_pem(server) + to_pem(ca),
                private_key=key_to_pem(server_key),
            ),
            ROOT_CERT: SecretItem(ROOT_CERT, root_cert=to_pem(ca)),
        }
    )
    return Pki(secrets, chain, key, root)


async def app_server(port: int) -> asyncio.Server:
    """The workload's application: 200 "app" to every request, one per connection."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\nconnection: close\r\n\r\napp")
            await writer.drain()
        writer.close()

    return await asyncio.start_server(answer, "127.0.0.1", port)


def mesh_yaml(module: Path, inbound: int, app: int, greeting: str) -> str:
    return f"""
trustDomain: {TRUST_DOMAIN}
services:
  - {{name: b, port: 8000}}
workloads:
  - name: b-1
    serviceAccount: b
    labels: {{app: b}}
    services: [b]
    inboundPort: {inbound}
    appPort: {app}
wasmPlugins:
  - name: add-header
    selector: {{matchLabels: {{app: b}}}}
    url: file://{module}
    pluginConfig: {{greeting: {greeting}}}
"""


def bootstrap(control_plane_port: int, sds_socket: Path, api_type: str) -> dict[str, Any]:
    """Envoy on ADS from the control plane's plaintext port, SDS from the socket."""
    # the SDS cluster's static HTTP/2 settings, aimed at the control plane's port instead of a socket
    endpoint = {"address": {"socket_address": {"address": "127.0.0.1", "port_value": control_plane_port}}}
    xds_cluster = {
        **sds_cluster(sds_socket),
        "name": "xds-grpc",
        "load_assignment": {
            "cluster_name": "xds-grpc",
            "endpoints": [{"lb_endpoints": [{"endpoint": endpoint}]}],
        },
    }
    ads = {"ads": {}, "resource_api_version": "V3"}
    return {
        "node": {
            "id": "sidecar~127.0.0.1~b-1.default~default.svc.cluster.local",
            "cluster": "b.default",
            "metadata": {"NAME": "b-1", "NAMESPACE": "default", "ISTIO_VERSION": "1.28.0"},
        },
        "dynamic_resources": {
            "ads_config": {
                "api_type": api_type,
                "transport_api_version": "V3",
                "grpc_services": [{"envoy_grpc": {"cluster_name": "xds-grpc"}}],
            },
            "cds_config": ads,
            "lds_config": ads,
        },
        "static_resources": {"clusters": [xds_cluster, sds_cluster(sds_socket)]},
    }


async def get_over_mtls(port: int, pki: Pki) -> tuple[str, dict[str, str], bytes]:
    """One request to the inbound listener with a client certificate of the trust domain."""
    context = ssl.create_default_context(cafile=str(pki.root))
    context.check_hostname = False  # the server's certificate names a SPIFFE identity only
    context.load_cert_chain(pki.client_chain, pki.client_key)
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
    try:
        writer.write(b"GET / HTTP/1.1\r\nhost: b\r\nconnection: close\r\n\r\n")
        await writer.drain()
        data = await reader.read()
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, body


async def header_becomes(port: int, pki: Pki, expected: str) -> dict[str, str]:
    """Requests until the response carries ``x-wasm-plugin: expected`` (Envoy applies ECDS updates
    asynchronously); the last response's headers."""
    headers: dict[str, str] = {}
    async with asyncio.timeout(WAIT):
        while True:
            with contextlib.suppress(OSError, ssl.SSLError):
                status, headers, body = await get_over_mtls(port, pki)
                assert status.startswith("HTTP/1.1 200"), (status, headers, body)
                assert body == b"app"
                if headers.get(HEADER) == expected:
                    return headers
            await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def running_envoy_async(directory: Path, config: dict[str, Any]) -> AsyncIterator[str]:
    """:func:`running_envoy` with its blocking start and stop in a thread, so this loop keeps serving."""
    manager = running_envoy(directory, config)
    address = await asyncio.to_thread(manager.__enter__)
    try:
        yield address
    finally:
        await asyncio.to_thread(manager.__exit__, None, None, None)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("api_type", ["GRPC", "DELTA_GRPC"])
async def test_envoy_runs_the_wasm_plugin_of_the_mesh_file(
    add_header_module: Path, short_tmp: Path, api_type: str
) -> None:
    pki = make_pki(short_tmp)
    sds = SdsServer(pki.secrets, short_tmp / "sds.sock", registry=Registry())
    await sds.start()
    inbound, app = free_port(), free_port()
    server = await app_server(app)
    try:
        yaml = mesh_yaml(add_header_module, inbound, app, "hello")
        async with contextlib.AsyncExitStack() as stack:
            plane = await stack.enter_async_context(started_plane(short_tmp, yaml))
            await stack.enter_async_context(
                running_envoy_async(short_tmp, bootstrap(plane.port, sds.socket_path, api_type))
            )
            await header_becomes(inbound, pki, '{"greeting":"hello"}')
            (short_tmp / "mesh.yaml").write_text(mesh_yaml(add_header_module, inbound, app, "again"))
            await header_becomes(inbound, pki, '{"greeting":"again"}')
    finally:
        server.close()
        await server.wait_closed()
        await sds.stop(0)
