"""ControlPlane over real gRPC on loopback: token and client-certificate auth, TLS, mesh reloads."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from istio_agent.controlplane.ca import LocalCA
from istio_agent.controlplane.mesh import MeshConfig
from istio_agent.controlplane.server import ControlPlane, ControlPlaneError
from istio_agent.controlplane.tokens import mint_token
from istio_agent.controlplane.xdsgen import CLUSTER_TYPE
from istio_agent.metrics import Registry
from istio_agent.protos import istio_ca_pb2
from istio_agent.rpc.call import Call
from istio_agent.rpc.server import RpcServer
from tests.grpc_stubs import istio_ca_pb2_grpc

from . import key_pem, make_key, spiffe_csr, started_plane, uri_sans

SLEEP = "spiffe://example.org/ns/default/sa/sleep"
SERVER_NAME = "istiod.istio-system.svc"


def write_mesh(path: Path, trust_domain: str) -> None:
    path.write_text(f"trustDomain: {trust_domain}\nservices: []\nnameTable: {{}}\n")


@pytest.fixture
def mesh_file(tmp_path: Path) -> Path:
    path = tmp_path / "mesh" / "mesh.yaml"
    path.parent.mkdir()
    write_mesh(path, "example.org")
    return path


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
async def plane(mesh_file: Path, state: Path) -> AsyncIterator[ControlPlane]:
    """A started control plane with a metrics registry of its own."""
    cp = ControlPlane(
        mesh_file, state, address="127.0.0.1:0", secure_address="127.0.0.1:0", registry=Registry()
    )
    await cp.start()
    try:
        yield cp
    finally:
        await cp.stop(0)


def token(state: Path, namespace: str = "default", account: str = "sleep") -> str:
    return mint_token(state, namespace, account)


def plaintext(plane: ControlPlane) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(f"127.0.0.1:{plane.port}")


def tls(
    plane: ControlPlane,
    server_name: str | None = SERVER_NAME,
    client: tuple[ec.EllipticCurvePrivateKey, str] | None = None,
) -> grpc.aio.Channel:
    """A TLS channel verifying the server against the root the control plane wrote."""
    root = plane.root_cert_path.read_bytes()
    if client is None:
        creds = grpc.ssl_channel_credentials(root)
    else:
        creds = grpc.ssl_channel_credentials(root, key_pem(client[0]), client[1].encode())
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.aio.secure_channel(f"127.0.0.1:{plane.secure_port}", creds, options=options)


async def create(
    channel: grpc.aio.Channel,
    csr: bytes,
    bearer: str | None = None,
    validity: int = 3600,
) -> list[str]:
    metadata = [("clusterid", "Kubernetes")]
    if bearer is not None:
        metadata.append(("authorization", f"Bearer {bearer}"))
    stub = istio_ca_pb2_grpc.IstioCertificateServiceStub(channel)
    request = istio_ca_pb2.IstioCertificateRequest(csr=csr.decode(), validity_duration=validity)
    response = await stub.CreateCertificate(request, metadata=metadata, timeout=5)
    return list(response.cert_chain)


def leaf_of(chain: list[str]) -> x509.Certificate:
    return x509.load_pem_x509_certificate(chain[0].encode())


async def test_root_written_and_token_auth_over_plaintext(plane: ControlPlane, state: Path) -> None:
    root_pem = (state / "root-cert.pem").read_bytes()
    assert plane.root_cert_path == state / "root-cert.pem"
    key = make_key()
    async with plaintext(plane) as channel:
        chain = await create(channel, spiffe_csr(key, SLEEP), token(state))
    assert len(chain) == 2 and chain[1].encode() == root_pem
    leaf = leaf_of(chain)
    assert uri_sans(leaf) == [SLEEP]
    assert leaf.public_key() == key.public_key()
    leaf.verify_directly_issued_by(x509.load_pem_x509_certificate(root_pem))
    lifetime = leaf.not_valid_after_utc - leaf.not_valid_before_utc
    assert abs(lifetime - timedelta(hours=1, minutes=1)) < timedelta(seconds=3)
    assert plane.metrics.signed.value == 1


@pytest.mark.parametrize("server_name", [SERVER_NAME, None, "localhost", "istiod"])
async def test_token_auth_over_tls(plane: ControlPlane, state: Path, server_name: str | None) -> None:
    # server_name None: connect to 127.0.0.1 and verify the IP SAN.
    async with tls(plane, server_name) as channel:
        chain = await create(channel, spiffe_csr(make_key(), SLEEP), token(state))
    assert uri_sans(leaf_of(chain)) == [SLEEP]


async def test_tls_rejects_a_wrong_server_name(plane: ControlPlane) -> None:
    async with tls(plane, "evil.example.com") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await create(channel, spiffe_csr(make_key(), SLEEP))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_zero_validity_means_24h(plane: ControlPlane, state: Path) -> None:
    async with plaintext(plane) as channel:
        chain = await create(channel, spiffe_csr(make_key(), SLEEP), token(state), validity=0)
    leaf = leaf_of(chain)
    lifetime = leaf.not_valid_after_utc - leaf.not_valid_before_utc
    assert abs(lifetime - timedelta(hours=24, minutes=1)) < timedelta(seconds=3)


@pytest.mark.parametrize("secure", [False, True])
async def test_no_credentials_is_unauthenticated(plane: ControlPlane, secure: bool) -> None:
    async with tls(plane) if secure else plaintext(plane) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await create(channel, spiffe_csr(make_key(), SLEEP))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert err.value.details() == ("request authenticate failure: no bearer token and no client certificate")
    assert plane.metrics.refused.labels(code="UNAUTHENTICATED").value == 1  # its own registry: no diffing


async def test_bad_token_is_unauthenticated(plane: ControlPlane, tmp_path: Path) -> None:
    foreign = mint_token(tmp_path / "elsewhere", "default", "sleep")
    async with plaintext(plane) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await create(channel, spiffe_csr(make_key(), SLEEP), foreign)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert err.value.details() == "request authenticate failure: token signature is invalid"
        assert foreign not in err.value.details()

        stub = istio_ca_pb2_grpc.IstioCertificateServiceStub(channel)
        request = istio_ca_pb2.IstioCertificateRequest(csr=spiffe_csr(make_key(), SLEEP).decode())
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.CreateCertificate(request, metadata=[("authorization", "Basic dXNlcjpwdw==")])
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "not a bearer token" in (err.value.details() or "")


async def test_wrong_identity_csr_is_permission_denied(plane: ControlPlane, state: Path) -> None:
    admin = "spiffe://example.org/ns/kube-system/sa/admin"
    async with plaintext(plane) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await create(channel, spiffe_csr(make_key(), admin), token(state))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert err.value.details() == f"CSR requests {admin} but caller is {SLEEP}"


async def test_garbage_csr_is_invalid_argument(plane: ControlPlane, state: Path) -> None:
    async with plaintext(plane) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await create(channel, b"hello", token(state))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a PEM-encoded" in (err.value.details() or "")


async def _workload_cert(plane: ControlPlane, state: Path) -> tuple[ec.EllipticCurvePrivateKey, str]:
    key = make_key()
    async with plaintext(plane) as channel:
        chain = await create(channel, spiffe_csr(key, SLEEP), token(state))
    return key, "".join(chain)


async def test_client_certificate_auth_over_tls(plane: ControlPlane, state: Path) -> None:
    client = await _workload_cert(plane, state)
    new_key = make_key()
    async with tls(plane, client=client) as channel:
        chain = await create(channel, spiffe_csr(new_key, SLEEP))
        assert uri_sans(leaf_of(chain)) == [SLEEP]
        assert leaf_of(chain).public_key() == new_key.public_key()

        # The certificate proves only its own identity.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await create(channel, spiffe_csr(make_key(), "spiffe://example.org/ns/default/sa/other"))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED

        # An invalid token does not spoil a valid certificate (istiod tries every authenticator).
        chain = await create(channel, spiffe_csr(make_key(), SLEEP), bearer="garbage")
        assert uri_sans(leaf_of(chain)) == [SLEEP]


async def test_token_wins_over_client_certificate(plane: ControlPlane, state: Path) -> None:
    client = await _workload_cert(plane, state)
    other = "spiffe://example.org/ns/prod/sa/api"
    async with tls(plane, client=client) as channel:
        chain = await create(channel, spiffe_csr(make_key(), other), token(state, "prod", "api"))
    assert uri_sans(leaf_of(chain)) == [other]


async def test_foreign_client_certificate_fails_the_handshake(
    plane: ControlPlane, state: Path, tmp_path: Path
) -> None:
    foreign_ca = LocalCA.load_or_create(tmp_path / "foreign", "example.org")
    key = make_key()
    chain = foreign_ca.sign_csr(spiffe_csr(key, SLEEP), SLEEP, timedelta(hours=1))
    async with tls(plane, client=(key, "".join(chain))) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await create(channel, spiffe_csr(make_key(), SLEEP), token(state))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_mesh_reload(plane: ControlPlane, state: Path, mesh_file: Path) -> None:
    assert plane.mesh.trust_domain == "example.org"
    assert plane.mesh.raw["services"] == []
    reloaded: asyncio.Queue[MeshConfig] = asyncio.Queue()
    plane.add_mesh_listener(reloaded.put_nowait)

    write_mesh(mesh_file, "new.example")
    config = await asyncio.wait_for(reloaded.get(), 5)
    assert config.trust_domain == "new.example" and plane.mesh is config
    new_identity = "spiffe://new.example/ns/default/sa/sleep"
    async with plaintext(plane) as channel:
        chain = await create(channel, spiffe_csr(make_key(), new_identity), token(state))
        assert uri_sans(leaf_of(chain)) == [new_identity]

        # A broken file keeps the last good config (the watcher calls reload_mesh on each change).
        mesh_file.write_text("trustDomain: [unclosed\n")
        assert await plane.reload_mesh() is False
        assert plane.mesh is config
        chain = await create(channel, spiffe_csr(make_key(), new_identity), token(state))
        assert uri_sans(leaf_of(chain)) == [new_identity]

    # Fixing the file is picked up again.
    write_mesh(mesh_file, "third.example")
    config = await asyncio.wait_for(reloaded.get(), 5)
    assert config.trust_domain == "third.example"
    assert reloaded.empty()


async def test_invalid_trust_domain_and_missing_file_keep_last_good(
    plane: ControlPlane, mesh_file: Path
) -> None:
    current = plane.mesh
    mesh_file.write_text("trustDomain: 'Not A Domain'\n")
    assert await plane.reload_mesh() is False
    mesh_file.unlink()
    assert await plane.reload_mesh() is False
    assert plane.mesh is current


async def test_servicer_hook_registers_on_both_servers(mesh_file: Path, state: Path) -> None:
    async def echo(request: bytes, call: Call) -> bytes:
        return b"echo:" + request

    def hook(server: RpcServer) -> None:
        server.add_unary("/test.Echo/Echo", echo, bytes, bytes)  # bytes: passed through undecoded

    cp = ControlPlane(
        mesh_file, state, address="127.0.0.1:0", secure_address="127.0.0.1:0", registry=Registry()
    )
    cp.add_servicer_hook(hook)
    await cp.start()
    try:
        with pytest.raises(RuntimeError):
            cp.add_servicer_hook(hook)
        for make in (plaintext, tls):
            async with make(cp) as channel:
                assert await channel.unary_unary("/test.Echo/Echo")(b"hi", timeout=5) == b"echo:hi"
    finally:
        await cp.stop(0)


async def test_port_in_use_is_a_clear_error(mesh_file: Path, state: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for address, secure in ((f"127.0.0.1:{port}", "127.0.0.1:0"), ("127.0.0.1:0", f"127.0.0.1:{port}")):
            cp = ControlPlane(mesh_file, state, address=address, secure_address=secure, registry=Registry())
            with pytest.raises(
                ControlPlaneError, match=f"cannot listen on 127.0.0.1:{port}: Address already in use"
            ):
                await cp.start()


async def test_bad_address_is_a_clear_error(mesh_file: Path, state: Path) -> None:
    cp = ControlPlane(mesh_file, state, address="localhost", registry=Registry())
    with pytest.raises(ControlPlaneError, match="expected HOST:PORT"):
        await cp.start()


async def test_stop_closes_both_ports(plane: ControlPlane, state: Path) -> None:
    ports = (plane.port, plane.secure_port)
    await plane.stop(0)
    for port in ports:
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", port)
    await plane.stop(0)  # idempotent


async def _first_cds(
    channel: grpc.aio.Channel,
    namespace: str,
    metadata: tuple[tuple[str, str], ...] = (),
    *,
    name: str = "sleep",
    service_account: str = "",
) -> Any:
    """Open ADS as sidecar ``name`` in ``namespace`` (claiming ``service_account`` when given) and
    return the first response (or raise the stream's error)."""
    stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
    node = base_pb2.Node(id=f"sidecar~127.0.0.1~{name}.{namespace}~{namespace}.svc.cluster.local")
    node.metadata.update({"NAME": name, "NAMESPACE": namespace})
    if service_account:
        node.metadata.update({"SERVICE_ACCOUNT": service_account})
    call = stub.StreamAggregatedResources(metadata=metadata)
    await call.write(discovery_pb2.DiscoveryRequest(node=node, type_url=CLUSTER_TYPE))
    try:
        return await asyncio.wait_for(call.read(), 10)
    finally:
        call.cancel()


async def test_ads_on_the_tls_port_needs_an_identity_from_the_proxys_namespace(
    plane: ControlPlane, state: Path
) -> None:
    async with tls(plane) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as anonymous:
            await _first_cds(channel, "default")
        assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "no bearer token and no client certificate" in (anonymous.value.details() or "")

        bearer = (("authorization", f"Bearer {token(state)}"),)
        response = await _first_cds(channel, "default", bearer)
        assert response.type_url == CLUSTER_TYPE

        with pytest.raises(grpc.aio.AioRpcError) as elsewhere:
            await _first_cds(channel, "prod", bearer)
        assert elsewhere.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert elsewhere.value.details() == (
            f"authorization failed: no identities ([{SLEEP}]) matched prod/"  # istiod's words
        )


WEB_AND_OTHER = """\
trustDomain: cluster.local
workloads:
- {name: web, serviceAccount: web}
- {name: other, serviceAccount: other}
"""


async def test_ads_on_the_tls_port_needs_the_proxys_service_account(tmp_path: Path) -> None:
    async with started_plane(tmp_path, WEB_AND_OTHER) as plane, tls(plane) as channel:
        web = (("authorization", f"Bearer {token(tmp_path / 'state', 'default', 'web')}"),)
        identity = "spiffe://cluster.local/ns/default/sa/web"
        with pytest.raises(grpc.aio.AioRpcError) as claims_other:  # istiod's check, in its words
            await _first_cds(channel, "default", web, name="web", service_account="other")
        assert claims_other.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert claims_other.value.details() == (
            f"authorization failed: no identities ([{identity}]) matched default/other"
        )
        with pytest.raises(grpc.aio.AioRpcError) as names_other:  # other's workload, no claim
            await _first_cds(channel, "default", web, name="other")
        assert names_other.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert names_other.value.details() == (
            f"authorization failed: no identities ([{identity}]) matched default/other "
            "(the service account of workload other.default)"
        )
        own = await _first_cds(channel, "default", web, name="web", service_account="web")
        assert own.type_url == CLUSTER_TYPE
        unclaimed = await _first_cds(channel, "default", web, name="web")
        assert unclaimed.type_url == CLUSTER_TYPE


async def test_ads_on_the_plaintext_port_does_not_authenticate(plane: ControlPlane) -> None:
    async with plaintext(plane) as channel:
        response = await _first_cds(channel, "default")
    assert response.type_url == CLUSTER_TYPE


async def test_mesh_reload_pushes_to_connected_proxies(plane: ControlPlane, mesh_file: Path) -> None:
    async with plaintext(plane) as channel:
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
        node = base_pb2.Node(id="sidecar~127.0.0.1~sleep.default~default.svc.cluster.local")
        call = stub.StreamAggregatedResources()
        await call.write(discovery_pb2.DiscoveryRequest(node=node, type_url=CLUSTER_TYPE))
        first = await asyncio.wait_for(call.read(), 10)
        assert list(first.resources) == []
        await call.write(
            discovery_pb2.DiscoveryRequest(
                type_url=CLUSTER_TYPE, version_info=first.version_info, response_nonce=first.nonce
            )
        )
        mesh_file.write_text("trustDomain: example.org\nservices:\n- {name: b, port: 8000}\n")
        pushed = await asyncio.wait_for(call.read(), 10)
        call.cancel()
    names = [cluster_pb2.Cluster.FromString(resource.value).name for resource in pushed.resources]
    assert names == ["outbound|8000||b.default.svc.cluster.local"]


def _listening_ports() -> set[int]:
    """The TCP ports this process listens on (its sockets in /proc/net/tcp{,6} in state LISTEN)."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = fd.readlink()
        except OSError:
            continue
        if str(target).startswith("socket:["):
            inodes.add(str(target)[len("socket:[") : -1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: TCP_LISTEN
                ports.add(int(fields[1].rpartition(":")[2], 16))
    return ports


async def test_the_plane_listens_on_exactly_its_two_ports(tmp_path: Path) -> None:
    """No hidden loopback server behind the TLS port: TLS is terminated by the gRPC server itself."""
    before = _listening_ports()
    async with started_plane(tmp_path) as plane:
        assert _listening_ports() - before == {plane.port, plane.secure_port}


async def test_tls_callers_identities_come_from_their_own_connections(
    plane: ControlPlane, state: Path
) -> None:
    """Two clients with different certificates, connected at once, are each who their certificate says."""
    web = "spiffe://example.org/ns/default/sa/web"
    sleep_client = await _workload_cert(plane, state)
    web_key = make_key()
    async with plaintext(plane) as channel:
        web_client = (
            web_key,
            "".join(await create(channel, spiffe_csr(web_key, web), token(state, "default", "web"))),
        )
    async with tls(plane, client=sleep_client) as as_sleep, tls(plane, client=web_client) as as_web:
        for _ in range(3):  # interleaved, over both connections kept open
            sleep_chain, web_chain = await asyncio.gather(
                create(as_sleep, spiffe_csr(make_key(), SLEEP)), create(as_web, spiffe_csr(make_key(), web))
            )
            assert uri_sans(leaf_of(sleep_chain)) == [SLEEP]
            assert uri_sans(leaf_of(web_chain)) == [web]
        for channel, foreign in ((as_sleep, web), (as_web, SLEEP)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await create(channel, spiffe_csr(make_key(), foreign))
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize("secure", [False, True])
async def test_a_message_over_grpcs_default_maximum_is_resource_exhausted(
    plane: ControlPlane, state: Path, secure: bool
) -> None:
    """4 MiB, gRPC's default maximum, as the grpcio servers before had it."""
    csr = spiffe_csr(make_key(), SLEEP) + b"#" * (4 * 1024 * 1024)
    async with (tls if secure else plaintext)(plane) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await create(channel, csr, token(state))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_more_streams_than_http2s_usual_hundred_share_one_connection(plane: ControlPlane) -> None:
    """istiod allows 100000 concurrent streams per connection (ISTIO_GPRC_MAXSTREAMS); a server
    announcing h2's default 100 would hold the 101st stream of a load test until another ends."""
    async with plaintext(plane) as channel:
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
        calls = [stub.StreamAggregatedResources() for _ in range(120)]
        node = base_pb2.Node(id="sidecar~127.0.0.1~sleep.default~default.svc.cluster.local")

        async def first(call: Any) -> Any:
            await call.write(discovery_pb2.DiscoveryRequest(node=node, type_url=CLUSTER_TYPE))
            return await call.read()

        try:
            responses = await asyncio.wait_for(asyncio.gather(*(first(call) for call in calls)), 10)
            assert {response.type_url for response in responses} == {CLUSTER_TYPE}
        finally:
            for call in calls:
                call.cancel()
