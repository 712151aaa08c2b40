"""Agent start-up decisions (Istio: pkg/istio-agent/agent.go) and the agent serving SDS end to end in-process."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.transport_sockets.tls.v3 import secret_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.secret.v3 import sds_pb2_grpc

from istio_agent.agent import Agent, AgentSettings, plan_sds
from istio_agent.config import ConfigError, Env, SecuritySettings, XdsSettings
from istio_agent.config.probes import parse_readiness_probe
from istio_agent.metrics import Registry
from istio_agent.security.manager import SecretManager
from istio_agent.security.sds import SdsServer
from istio_agent.xds.proxy import XdsProxy
from istio_agent.xds.types import HEALTH_INFO
from tests.security.certs import issue, key_to_pem, make_ca, new_key, to_pem
from tests.security.fakes import FakeCA
from tests.xds import CDS, LDS, EnvoyStream, FakeIstiod


def settings_for(workdir: Path, **env: str) -> SecuritySettings:
    return SecuritySettings.from_env(Env({"POD_NAMESPACE": "ns", "SERVICE_ACCOUNT": "sa", **env}), workdir)


class EmptyProvider:
    async def generate(self, resource_name: str):  # type: ignore[no-untyped-def]
        raise AssertionError("not used")


async def test_default_plan_uses_the_ca(short_tmp: Path) -> None:
    plan = await plan_sds(settings_for(short_tmp))
    assert plan.socket_path == short_tmp / "var/run/secrets/workload-spiffe-uds/socket"
    assert plan.uses_ca and not plan.serve_only_files


async def test_healthy_external_socket_means_files_only(short_tmp: Path) -> None:
    settings = settings_for(short_tmp)
    external = SdsServer(EmptyProvider(), settings.sds_socket_path, registry=Registry())  # type: ignore[arg-type]
    await external.start()
    try:
        plan = await plan_sds(settings)
        assert plan.serve_only_files and not plan.uses_ca
        assert plan.socket_path == short_tmp / "var/run/secrets/credential-uds/files-socket"
    finally:
        await external.stop()


async def test_stale_socket_is_removed(short_tmp: Path) -> None:
    settings = settings_for(short_tmp)
    settings.sds_socket_path.parent.mkdir(parents=True)
    server = await asyncio.start_unix_server(lambda r, w: None, path=str(settings.sds_socket_path))
    server.close()
    await server.wait_closed()
    settings.sds_socket_path.touch(exist_ok=True)
    plan = await plan_sds(settings)
    assert plan.uses_ca
    assert not settings.sds_socket_path.exists()


async def test_non_default_socket_without_server_is_an_error(short_tmp: Path) -> None:
    with pytest.raises(ConfigError, match="non-default SDS socket path"):
        await plan_sds(settings_for(short_tmp, WORKLOAD_IDENTITY_SOCKET_FILE="spire.sock"))


async def test_workload_credentials_are_served_without_a_ca(short_tmp: Path) -> None:
    ca_key, ca_cert = make_ca()
    key = new_key("ec")
    leaf = issue(
        ca_key, ca_cert, uri_sans=["spiffe://cluster.local/ns/ns/sa/sa"], public_key=key.public_key()
    )
    creds = short_tmp / "var/run/secrets/workload-spiffe-credentials"
    creds.mkdir(parents=True)
    (creds / "cert-chain.pem").write_bytes(to_pem(leaf))
    (creds / "key.pem").write_bytes(key_to_pem(key))
    (creds / "root-cert.pem").write_bytes(to_pem(ca_cert))
    # CA_ADDR points nowhere: contacting it would fail the test.
    settings = settings_for(short_tmp, CA_ADDR="127.0.0.1:1")
    plan = await plan_sds(settings)
    assert not plan.uses_ca and plan.settings.file_mounted_certs

    async with Agent(AgentSettings(security=settings), registry=Registry()):
        secrets = await fetch(settings.sds_socket_path, ["default", "ROOTCA"])
    assert secrets["default"].tls_certificate.certificate_chain.inline_bytes == to_pem(leaf)
    assert secrets["ROOTCA"].validation_context.trusted_ca.inline_bytes.strip() == to_pem(ca_cert).strip()


async def fetch(socket: Path, names: list[str]) -> dict[str, secret_pb2.Secret]:
    """One SotW SDS request for ``names`` over the socket, as Envoy sends it."""
    async with grpc.aio.insecure_channel(f"unix:{socket}") as channel:
        stub = sds_pb2_grpc.SecretDiscoveryServiceStub(channel)
        call = stub.StreamSecrets()
        await call.write(
            discovery_pb2.DiscoveryRequest(
                node=base_pb2.Node(id="sidecar~127.0.0.1~a.ns~ns.svc.cluster.local"),
                resource_names=names,
                type_url="type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret",
            )
        )
        response = await asyncio.wait_for(call.read(), 10)
        call.cancel()
    secrets = {}
    for resource in response.resources:
        secret = secret_pb2.Secret()
        resource.Unpack(secret)
        secrets[secret.name] = secret
    return secrets


async def test_vm_health_checks_reach_istiod_over_the_xds_proxy(short_tmp: Path) -> None:
    """readinessProbe (tcpSocket to a closed port) -> unhealthy HealthInformation upstream after the first LDS."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    istiod = await FakeIstiod().start()
    try:
        settings = settings_for(short_tmp, CA_ADDR="127.0.0.1:15010")  # plaintext: no root file needed
        xds = XdsSettings(
            socket_path=short_tmp / "etc/istio/proxy/XDS", discovery_address=istiod.address, plaintext=True
        )
        health = parse_readiness_probe({"tcpSocket": {"port": port, "host": "127.0.0.1"}, "periodSeconds": 1})
        # No CA is reachable: only the xDS side and the health checks matter here.
        agent = Agent(
            AgentSettings(security=settings, xds=xds, health=health, serve_sds=False), registry=Registry()
        )
        await agent.start()
        try:
            async with grpc.aio.insecure_channel(f"unix:{xds.socket_path}") as channel:
                envoy = EnvoyStream(channel)
                await envoy.send(CDS)
                upstream = await istiod.next_stream()
                assert (await upstream.recv()).type_url == CDS
                await envoy.send(LDS)
                assert (await upstream.recv()).type_url == LDS
                report = await upstream.recv()
                assert report.type_url == HEALTH_INFO
                assert report.error_detail.code == 13
                assert "127.0.0.1" in report.error_detail.message
                await envoy.close()
        finally:
            await agent.stop()
    finally:
        await istiod.stop()


# -- lifecycle: a stack of started subsystems -----------------------------------------------------------
def fake_ca_for(settings: SecuritySettings) -> FakeCA:
    ca = FakeCA()
    ca.identity_override = settings.spiffe_id
    return ca


async def test_a_fake_ca_can_be_swapped_in(short_tmp: Path) -> None:
    cas: list[FakeCA] = []

    def factory(settings: SecuritySettings) -> FakeCA:
        cas.append(fake_ca_for(settings))
        return cas[-1]

    settings = settings_for(short_tmp, CA_ADDR="127.0.0.1:1")  # never dialled: the fake answers
    async with Agent(AgentSettings(security=settings), ca_client=factory, registry=Registry()):
        secrets = await fetch(settings.sds_socket_path, ["default"])
    assert b"BEGIN CERTIFICATE" in secrets["default"].tls_certificate.certificate_chain.inline_bytes
    assert cas[0].calls >= 1 and cas[0].closed  # stopping the agent closed the CA client


async def test_stop_is_the_reverse_of_start_and_every_step_runs(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    stopped: list[str] = []
    original = {"sds": SdsServer.stop, "manager": SecretManager.stop, "xds": XdsProxy.stop}

    async def sds_stop(self: SdsServer, *args: object) -> None:
        stopped.append("sds")
        await original["sds"](self)
        raise RuntimeError("SDS stop broke")

    async def manager_stop(self: SecretManager) -> None:
        stopped.append("manager")
        await original["manager"](self)

    async def xds_stop(self: XdsProxy) -> None:
        stopped.append("xds")
        await original["xds"](self)

    monkeypatch.setattr(SdsServer, "stop", sds_stop)
    monkeypatch.setattr(SecretManager, "stop", manager_stop)
    monkeypatch.setattr(XdsProxy, "stop", xds_stop)
    settings = settings_for(short_tmp, CA_ADDR="127.0.0.1:1")
    xds = XdsSettings(
        socket_path=short_tmp / "etc/istio/proxy/XDS", discovery_address="127.0.0.1:1", plaintext=True
    )
    agent = Agent(AgentSettings(security=settings, xds=xds), ca_client=fake_ca_for, registry=Registry())
    await agent.start()
    await agent.stop()
    assert stopped == ["xds", "sds", "manager"]  # started manager, sds, xds; the SDS failure did not stop it
    assert "stopping the SDS server failed" in caplog.text and "SDS stop broke" in caplog.text


async def test_a_start_that_fails_stops_what_had_started(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def refuse(self: XdsProxy) -> None:
        raise OSError("xDS proxy could not listen")

    monkeypatch.setattr(XdsProxy, "start", refuse)
    cas: list[FakeCA] = []

    def factory(settings: SecuritySettings) -> FakeCA:
        cas.append(fake_ca_for(settings))
        return cas[-1]

    settings = settings_for(short_tmp, CA_ADDR="127.0.0.1:1")
    xds = XdsSettings(
        socket_path=short_tmp / "etc/istio/proxy/XDS", discovery_address="127.0.0.1:1", plaintext=True
    )
    agent = Agent(AgentSettings(security=settings, xds=xds), ca_client=factory, registry=Registry())
    with pytest.raises(OSError, match="could not listen"):
        await agent.start()
    assert cas[0].closed  # the secret manager was stopped (it closes the CA client)
    with pytest.raises(grpc.aio.AioRpcError):  # and so was the SDS server
        await asyncio.wait_for(fetch(settings.sds_socket_path, ["default"]), 5)


async def test_the_mock_credential_fetcher_authenticates_xds_too(short_tmp: Path) -> None:
    istiod = await FakeIstiod().start()
    try:
        settings = settings_for(short_tmp, CA_ADDR="127.0.0.1:1", CREDENTIAL_FETCHER_TYPE="Mock")
        xds = XdsSettings(
            socket_path=short_tmp / "etc/istio/proxy/XDS", discovery_address=istiod.address, plaintext=True
        )
        async with (
            Agent(AgentSettings(security=settings, xds=xds), ca_client=fake_ca_for, registry=Registry()),
            grpc.aio.insecure_channel(f"unix:{xds.socket_path}") as channel,
        ):
            envoy = EnvoyStream(channel)
            await envoy.send(CDS)
            upstream = await istiod.next_stream()
            assert upstream.metadata.get("authorization") == "Bearer test_token"  # as the CA gets it
            await envoy.close()
    finally:
        await istiod.stop()
