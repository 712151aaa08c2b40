"""The agent in proxyless gRPC mode (Istio's grpc-agent template): no Envoy, no SDS server, certificates
in OUTPUT_CERTS kept fresh, the gRPC bootstrap written, readiness on both (pkg/istio-agent/agent.go)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import any_pb2, json_format, struct_pb2

from istio_agent.agent import Agent, AgentSettings
from istio_agent.config import ConfigError, Env, SecuritySettings, XdsSettings
from istio_agent.config.grpc import GrpcBootstrapSettings
from istio_agent.config.status import StatusSettings
from istio_agent.metrics import Registry
from istio_agent.protos import proxy_config_pb2
from istio_agent.xds.types import PROXY_CONFIG
from tests.security.fakes import FakeCA, pem
from tests.xds import CDS, LDS, EnvoyStream, FakeIstiod

CERT_FILES = ("cert-chain.pem", "key.pem", "root-cert.pem")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class GatedCA(FakeCA):
    """A fake CA that signs only once the test opens the gate."""

    def __init__(self, identity: str) -> None:
        super().__init__()
        self.identity_override = identity
        self.gate = asyncio.Event()
        self.gate.set()

    async def csr_sign(self, csr_pem: bytes, ttl: timedelta) -> list[str]:
        await self.gate.wait()
        return await super().csr_sign(csr_pem, ttl)


def proxyless(workdir: Path, istiod: str = "127.0.0.1:1", **env: str) -> AgentSettings:
    """The settings the CLI makes for DISABLE_ENVOY with OUTPUT_CERTS under ``workdir``."""
    environ = {
        "POD_NAMESPACE": "ns",
        "SERVICE_ACCOUNT": "sa",
        "CA_ADDR": "127.0.0.1:1",  # never dialled: the fake CA answers
        "OUTPUT_CERTS": str(workdir / "var/lib/istio/data"),
        **env,
    }
    security = SecuritySettings.from_env(Env(environ), workdir)
    xds = XdsSettings(socket_path=workdir / "etc/istio/proxy/XDS", discovery_address=istiod, plaintext=True)
    grpc_bootstrap = GrpcBootstrapSettings(
        path=workdir / "etc/istio/proxy/grpc-bootstrap.json",
        node_id="sidecar~127.0.0.1~app.ns~ns.svc.cluster.local",
        metadata={"NAMESPACE": "ns", "GENERATOR": "grpc"},
        xds_socket=xds.socket_path,
        discovery_address=istiod,
        cert_dir=security.output_certs,
    )
    return AgentSettings(
        security=security,
        xds=xds,
        status=StatusSettings(port=free_port(), host="127.0.0.1"),
        serve_sds=False,
        grpc_bootstrap=grpc_bootstrap,
        workdir=workdir,
    )


async def eventually(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never met"
        await asyncio.sleep(0.05)


async def test_proxyless_runs_no_envoy_and_no_sds_and_writes_what_grpc_needs(short_tmp: Path) -> None:
    settings = proxyless(short_tmp)
    ca = GatedCA(settings.security.spiffe_id)
    async with Agent(settings, ca_client=lambda _s: ca, registry=Registry()) as agent:
        assert agent.envoy is None and agent.sds_server is None
        assert not settings.security.sds_socket_path.exists()
        out = settings.security.output_certs
        assert out is not None
        # Certificates arrive without any SDS request (the prewarm), all three files.
        await eventually(lambda: all((out / name).exists() for name in CERT_FILES))
        assert sorted(p.name for p in out.iterdir()) == sorted(CERT_FILES)
        assert b"BEGIN CERTIFICATE" in (out / "cert-chain.pem").read_bytes()
        assert (out / "root-cert.pem").read_bytes().strip() == pem(ca.root).encode().strip()
        bootstrap = json.loads(settings.grpc_bootstrap.path.read_text())  # type: ignore[union-attr]
        assert bootstrap["xds_servers"][0]["server_uri"] == f"unix://{short_tmp}/etc/istio/proxy/XDS"
        assert bootstrap["node"]["metadata"]["GENERATOR"] == "grpc"
        provider = bootstrap["certificate_providers"]["default"]["config"]
        assert provider["certificate_file"] == str(out / "cert-chain.pem")
        assert agent.readiness is not None
        assert await agent.readiness.check() is None


async def test_readiness_names_the_missing_file_then_becomes_ready(short_tmp: Path) -> None:
    settings = proxyless(short_tmp)
    ca = GatedCA(settings.security.spiffe_id)
    ca.gate.clear()  # the CA does not answer yet: no certificates
    async with Agent(settings, ca_client=lambda _s: ca, registry=Registry()) as agent:
        assert agent.readiness is not None
        out = settings.security.output_certs
        assert out is not None
        assert await agent.readiness.check() == f"{out / 'cert-chain.pem'} does not exist"
        ca.gate.set()
        await eventually(lambda: (out / "root-cert.pem").exists())
        assert await agent.readiness.check() is None


async def test_readiness_says_when_the_bootstrap_does_not_load(short_tmp: Path) -> None:
    settings = proxyless(short_tmp)
    ca = GatedCA(settings.security.spiffe_id)
    async with Agent(settings, ca_client=lambda _s: ca, registry=Registry()) as agent:
        assert agent.readiness is not None
        path = settings.grpc_bootstrap.path  # type: ignore[union-attr]
        path.write_text("{corrupt")  # before readiness ever loaded it
        error = await agent.readiness.check()
        assert error is not None and error.startswith(f"failed loading {path}: ")


async def test_certificates_are_rotated_in_output_certs(short_tmp: Path) -> None:
    settings = proxyless(short_tmp, SECRET_TTL="2s")
    ca = GatedCA(settings.security.spiffe_id)
    async with Agent(settings, ca_client=lambda _s: ca, registry=Registry()):
        out = settings.security.output_certs
        assert out is not None
        await eventually(lambda: (out / "key.pem").exists() and (out / "cert-chain.pem").exists())
        first_key, first_chain = (out / "key.pem").read_bytes(), (out / "cert-chain.pem").read_bytes()
        await eventually(lambda: (out / "key.pem").read_bytes() != first_key, timeout=10)
        await eventually(lambda: (out / "cert-chain.pem").read_bytes() != first_chain, timeout=5)
        assert ca.calls >= 2


async def test_output_certs_not_writable_is_a_start_error_naming_the_path(short_tmp: Path) -> None:
    blocker = short_tmp / "file"
    blocker.write_text("not a directory")
    settings = proxyless(short_tmp, OUTPUT_CERTS=str(blocker / "data"))
    with pytest.raises(
        ConfigError, match=rf"OUTPUT_CERTS {blocker}/data is not writable: {blocker}/data: Not a directory"
    ):
        await Agent(settings, ca_client=lambda s: GatedCA(s.spiffe_id), registry=Registry()).start()


async def test_a_bootstrap_that_cannot_be_written_stops_the_start(short_tmp: Path) -> None:
    settings = proxyless(short_tmp)
    blocker = short_tmp / "file"
    blocker.write_text("not a directory")
    assert settings.grpc_bootstrap is not None
    settings = dataclasses.replace(
        settings, grpc_bootstrap=dataclasses.replace(settings.grpc_bootstrap, path=blocker / "b.json")
    )
    agent = Agent(settings, ca_client=lambda s: GatedCA(s.spiffe_id), registry=Registry())
    with pytest.raises(
        ConfigError, match=rf"failed generating gRPC XDS bootstrap {blocker}/b.json: {blocker}"
    ):
        await agent.start()
    assert not settings.xds.socket_path.exists()  # type: ignore[union-attr]  # what had started was stopped


@dataclass
class Running:
    """A proxyless agent started against a recording istiod, its certificates written."""

    settings: AgentSettings
    istiod: FakeIstiod
    bootstrap: Path
    xds_socket: Path


@asynccontextmanager
async def running_proxyless(workdir: Path, *, pcds: bool = False) -> AsyncIterator[Running]:
    istiod = await FakeIstiod().start()
    try:
        settings = proxyless(workdir, istiod=istiod.address)
        xds, bootstrap, out = settings.xds, settings.grpc_bootstrap, settings.security.output_certs
        assert xds is not None and bootstrap is not None and out is not None
        if pcds:
            settings = dataclasses.replace(settings, xds=dataclasses.replace(xds, pcds_enabled=True))
        ca = GatedCA(settings.security.spiffe_id)
        async with Agent(settings, ca_client=lambda _s: ca, registry=Registry()):
            await eventually(lambda: all((out / name).exists() for name in CERT_FILES))
            yield Running(settings, istiod, bootstrap.path, xds.socket_path)
    finally:
        await istiod.stop()


async def test_the_apps_ads_stream_is_relayed_with_its_own_node(short_tmp: Path) -> None:
    """The gRPC app's node (GENERATOR=grpc) reaches istiod untouched; the proxy adds no Node of its own."""
    async with (
        running_proxyless(short_tmp) as agent,
        grpc.aio.insecure_channel(f"unix:{agent.xds_socket}") as channel,
    ):
        app = EnvoyStream(channel)
        node = json.loads(agent.bootstrap.read_text())["node"]
        metadata = struct_pb2.Struct()
        json_format.ParseDict(node["metadata"], metadata)
        await app.send(CDS, node=base_pb2.Node(id=node["id"], metadata=metadata))
        upstream = await agent.istiod.next_stream()
        request = await upstream.recv()
        assert request.type_url == CDS
        assert request.node.id == node["id"]
        assert request.node.metadata.fields["GENERATOR"].string_value == "grpc"
        await app.close()


async def test_the_agents_own_types_still_work_next_to_a_grpc_app(short_tmp: Path) -> None:
    """PCDS (PROXY_CONFIG_XDS_AGENT) is subscribed on the app's stream, handled by the agent and ACKed,
    never forwarded to the app, which only sees its own types."""
    async with (
        running_proxyless(short_tmp, pcds=True) as agent,
        grpc.aio.insecure_channel(f"unix:{agent.xds_socket}") as channel,
    ):
        app = EnvoyStream(channel)
        await app.send(LDS, resource_names=["echo.ns.svc.cluster.local:8080"])
        upstream = await agent.istiod.next_stream()
        assert (await upstream.recv()).type_url == LDS
        assert (await upstream.recv()).type_url == PROXY_CONFIG  # the agent's own subscription
        resource = any_pb2.Any()
        resource.Pack(proxy_config_pb2.ProxyConfig(ca_certificates_pem=[pem(FakeCA().root)]))
        await upstream.send(
            discovery_pb2.DiscoveryResponse(type_url=PROXY_CONFIG, nonce="pc-1", resources=[resource])
        )
        ack = await upstream.recv()
        assert (ack.type_url, ack.response_nonce) == (PROXY_CONFIG, "pc-1")
        assert not ack.HasField("error_detail")
        await upstream.send(discovery_pb2.DiscoveryResponse(type_url=LDS, nonce="lds-1"))
        first = await app.recv()
        assert (first.type_url, first.nonce) == (LDS, "lds-1")  # the PCDS push never reached the app
        await app.close()
