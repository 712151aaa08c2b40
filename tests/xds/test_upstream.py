"""The upstream dialer against a fake istiod on loopback: its options, and the shared credentials at work.

The credential rules themselves (token, root, client certificate) are tested in tests/security/test_istiod.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest
from cryptography import x509
from envoy.service.discovery.v3 import discovery_pb2

from istio_agent.config import XdsSettings
from istio_agent.rpc import Status
from istio_agent.rpc.channel import RpcError
from istio_agent.xds.flavour import ADS_SERVICE, SOTW
from istio_agent.xds.upstream import DialError, UpstreamDialer
from tests.security.certs import MeshCA, issue, key_to_pem, make_ca, new_key, to_pem
from tests.xds import CDS, WAIT, FakeIstiod, FakeUpstreamStream

ISTIOD_NAME = "istiod.istio-system.svc"


@pytest.fixture
def pki(tmp_path: Path) -> MeshCA:
    return MeshCA.on_disk(tmp_path)


async def start_istiod(pki: MeshCA, *, require_client_cert: bool) -> FakeIstiod:
    server_key = new_key()
    cert = issue(pki.ca_key, pki.ca, dns_sans=[ISTIOD_NAME], public_key=server_key.public_key())
    fake = FakeIstiod(
        tls=(key_to_pem(server_key), to_pem(cert) + to_pem(pki.ca)),
        client_ca=to_pem(pki.ca),
        require_client_cert=require_client_cert,
        auto_reply=True,
    )
    return await fake.start()


@pytest.fixture
async def tls_istiod(pki: MeshCA) -> AsyncIterator[FakeIstiod]:
    """istiod with TLS that does not ask for a client certificate (the token authenticates)."""
    fake = await start_istiod(pki, require_client_cert=False)
    yield fake
    await fake.stop()


@pytest.fixture
async def mtls_istiod(pki: MeshCA) -> AsyncIterator[FakeIstiod]:
    """istiod that requires a client certificate issued by the mesh CA."""
    fake = await start_istiod(pki, require_client_cert=True)
    yield fake
    await fake.stop()


def tls_settings(address: str, root: Path | None, **changes: object) -> XdsSettings:
    fields: dict[str, object] = {
        "socket_path": Path("/unused/XDS"),
        "discovery_address": address,
        "plaintext": False,
        "root_ca": root,
        "server_name": ISTIOD_NAME,
    }
    fields.update(changes)
    return XdsSettings(**fields)  # type: ignore[arg-type]


async def roundtrip(dialer: UpstreamDialer, istiod: FakeIstiod) -> FakeUpstreamStream:
    """Dial, open an ADS stream with the dialer's metadata, get one answer; istiod's view of the stream."""
    channel = dialer.dial()
    sotw = (discovery_pb2.DiscoveryRequest, discovery_pb2.DiscoveryResponse)
    try:
        call = channel.stream(f"/{ADS_SERVICE}/{SOTW.method}", *sotw, metadata=dialer.metadata())
        async with asyncio.timeout(WAIT):
            await call.send(discovery_pb2.DiscoveryRequest(type_url=CDS))
            answer = await call.recv()
        assert answer.type_url == CDS
        await call.cancel()
        return await istiod.next_stream()
    finally:
        channel.close()


# -- options --------------------------------------------------------------------------------------
async def test_channels_follow_settings() -> None:
    settings = tls_settings(
        "istiod:15012", None, keepalive_interval=timedelta(seconds=7), keepalive_timeout=timedelta(seconds=3)
    )
    channel = UpstreamDialer(settings).dial()
    config = channel._channel._config
    assert (config._keepalive_time, config._keepalive_timeout) == (7.0, 3.0)
    assert config._http2_max_pings_without_data == 0  # an idle ADS stream keeps pinging
    assert config.ssl_target_name_override == ISTIOD_NAME
    channel.close()
    plain = UpstreamDialer(XdsSettings(Path("/x"), "istiod:15010", plaintext=True)).dial()
    assert plain._channel._config.ssl_target_name_override is None
    plain.close()


def test_describe_names_address_and_server_name() -> None:
    assert UpstreamDialer(tls_settings("10.0.0.1:15012", None)).describe() == (
        f"10.0.0.1:15012 (TLS, server name {ISTIOD_NAME})"
    )
    assert (
        UpstreamDialer(XdsSettings(Path("/x"), "a:15010", plaintext=True)).describe() == "a:15010 (plaintext)"
    )


# -- TLS ------------------------------------------------------------------------------------------
async def test_plaintext_dial_works(tmp_path: Path) -> None:
    token = tmp_path / "istio-token"
    token.write_text("jwt\n")
    istiod = await FakeIstiod(auto_reply=True).start()
    try:
        settings = XdsSettings(Path("/x"), istiod.address, plaintext=True, cluster_id="k", token_path=token)
        stream = await roundtrip(UpstreamDialer(settings), istiod)
        assert stream.metadata["clusterid"] == "k"
        assert stream.metadata["authorization"] == "Bearer jwt"
    finally:
        await istiod.stop()


async def test_tls_verifies_istiod_and_presents_client_cert(
    tmp_path: Path, pki: MeshCA, mtls_istiod: FakeIstiod
) -> None:
    chain, key = pki.client_pair(tmp_path)
    dialer = UpstreamDialer(tls_settings(mtls_istiod.address, pki.root, client_cert=chain, client_key=key))
    stream = await roundtrip(dialer, mtls_istiod)
    assert stream.peer_cert is not None
    assert x509.load_pem_x509_certificate(stream.peer_cert) == x509.load_pem_x509_certificate(
        chain.read_bytes()
    )


async def test_without_client_cert_mtls_istiod_refuses(pki: MeshCA, mtls_istiod: FakeIstiod) -> None:
    """The counterpart of the test above: the certificate is what makes the handshake succeed."""
    with pytest.raises(RpcError) as failed:
        await roundtrip(UpstreamDialer(tls_settings(mtls_istiod.address, pki.root)), mtls_istiod)
    assert failed.value.code == Status.UNAVAILABLE


def _spoil(problem: str, pki: MeshCA, directory: Path) -> tuple[Path, Path]:
    chain, key = pki.client_pair(directory)
    if problem == "garbage":
        chain.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    elif problem == "wrong-key":
        key.write_bytes(key_to_pem(new_key()))
    return chain, key


@pytest.mark.parametrize("problem", ["garbage", "wrong-key"])
async def test_broken_client_cert_does_not_break_the_stream(
    tmp_path: Path, pki: MeshCA, tls_istiod: FakeIstiod, problem: str
) -> None:
    """Handed to gRPC, such a pair would fail every connection; skipped, the token can still authenticate."""
    chain, key = _spoil(problem, pki, tmp_path)
    dialer = UpstreamDialer(tls_settings(tls_istiod.address, pki.root, client_cert=chain, client_key=key))
    await roundtrip(dialer, tls_istiod)


async def test_root_is_read_at_each_dial(tmp_path: Path, pki: MeshCA, tls_istiod: FakeIstiod) -> None:
    root = tmp_path / "xds-root.pem"
    root.write_bytes(to_pem(make_ca("some-other-root")[1]))
    dialer = UpstreamDialer(tls_settings(tls_istiod.address, root))
    with pytest.raises(RpcError) as failed:
        await roundtrip(dialer, tls_istiod)
    assert failed.value.code == Status.UNAVAILABLE
    assert "CERTIFICATE_VERIFY_FAILED" in failed.value.details
    root.write_bytes(pki.root.read_bytes())  # the mounted root is replaced: the next stream uses it
    await roundtrip(dialer, tls_istiod)


def test_missing_root_is_a_dial_error(tmp_path: Path) -> None:
    dialer = UpstreamDialer(tls_settings("istiod:15012", tmp_path / "absent.pem"))
    with pytest.raises(DialError, match=r"absent\.pem"):
        dialer.dial()


def test_root_without_certificates_is_a_dial_error(tmp_path: Path) -> None:
    root = tmp_path / "root.pem"
    root.write_text("no certificates here\n")
    with pytest.raises(DialError, match=r"root\.pem"):
        UpstreamDialer(tls_settings("istiod:15012", root)).dial()


async def test_system_roots_dial_without_a_root_file() -> None:
    UpstreamDialer(tls_settings("istiod:15012", None)).dial().close()
