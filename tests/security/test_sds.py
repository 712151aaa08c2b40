"""The SDS server over a real Unix socket, driven by a real grpc.aio client.

The cases of Istio's ``security/pkg/nodeagent/sds/sdsservice_test.go`` and more (Delta, Fetch, pushes).
"""

from __future__ import annotations

import asyncio
import logging
import re
import stat
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.config.core.v3.base_pb2 import Node
from envoy.extensions.transport_sockets.tls.v3 import secret_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.secret.v3 import sds_pb2_grpc
from google.rpc import status_pb2

from istio_agent import uds
from istio_agent.config import Env, SecuritySettings
from istio_agent.metrics import PREFIX, Registry
from istio_agent.security.manager import SecretManager
from istio_agent.security.model import ROOT_CERT, WORKLOAD_KEY_CERT, SecretError, SecretItem
from istio_agent.security.sds import SECRET_TYPE_URL, SdsServer
from tests.uds_clients import idle_http2_client, silent_client

NODE = Node(id="sidecar~10.0.0.1~app-1.default~default.svc.cluster.local")
RESPONSE_WAIT = 5.0
"""Upper bound for an expected message; only hit when the test is failing."""
SILENCE_WAIT = 0.3
"""How long "no response" is observed; ordering checks after it make the assertion strict."""

# The server treats PEM as opaque bytes, so recognisable placeholders make assertions readable.
KEY_1 = b"-----BEGIN PRIVATE KEY-----\nkey-1\n-----END PRIVATE KEY-----\n"
CHAIN_1 = b"-----BEGIN CERTIFICATE-----\nchain-1\n-----END CERTIFICATE-----\n"
KEY_2 = b"-----BEGIN PRIVATE KEY-----\nkey-2\n-----END PRIVATE KEY-----\n"
CHAIN_2 = b"-----BEGIN CERTIFICATE-----\nchain-2\n-----END CERTIFICATE-----\n"
ROOT_1 = b"-----BEGIN CERTIFICATE-----\nroot-1\n-----END CERTIFICATE-----\n"


class FakeSecretProvider:
    """In-memory stand-in for the secret manager: a dict of items; unknown names are errors."""

    def __init__(self) -> None:
        self.items: dict[str, SecretItem] = {
            WORKLOAD_KEY_CERT: SecretItem(WORKLOAD_KEY_CERT, certificate_chain=CHAIN_1, private_key=KEY_1),
            ROOT_CERT: SecretItem(ROOT_CERT, root_cert=ROOT_1),
        }

    async def generate(self, resource_name: str) -> SecretItem:
        try:
            return self.items[resource_name]
        except KeyError:
            raise SecretError(f"no secret named {resource_name!r}") from None


class StreamClient:
    """One SDS stream (SotW or Delta); responses and the final error are collected in a queue."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.received: asyncio.Queue[Any] = asyncio.Queue()
        self._pump = asyncio.create_task(self._collect())

    async def _collect(self) -> None:
        try:
            while True:
                message = await self.call.read()
                if message is grpc.aio.EOF:
                    self.received.put_nowait(grpc.aio.EOF)
                    return
                self.received.put_nowait(message)
        except grpc.aio.AioRpcError as err:
            self.received.put_nowait(err)

    async def send(self, request: Any) -> None:
        await self.call.write(request)

    async def request(self, names: list[str], nonce: str = "", *, node: bool = True) -> None:
        await self.send(
            discovery_pb2.DiscoveryRequest(
                node=NODE if node else None,
                resource_names=names,
                response_nonce=nonce,
                type_url=SECRET_TYPE_URL,
            )
        )

    async def response(self) -> Any:
        message = await asyncio.wait_for(self.received.get(), RESPONSE_WAIT)
        if isinstance(message, grpc.aio.AioRpcError):
            raise AssertionError(f"stream failed: {message.code()} {message.details()}")
        assert message is not grpc.aio.EOF, "stream ended"
        return message

    async def error(self) -> grpc.aio.AioRpcError:
        message = await asyncio.wait_for(self.received.get(), RESPONSE_WAIT)
        assert isinstance(message, grpc.aio.AioRpcError), f"expected a stream error, got {message}"
        return message

    async def expect_silence(self) -> None:
        with pytest.raises(TimeoutError):
            message = await asyncio.wait_for(self.received.get(), SILENCE_WAIT)
            pytest.fail(f"unexpected message: {message}")

    async def close(self) -> None:
        self.call.cancel()
        await asyncio.gather(self._pump, return_exceptions=True)


def secrets_of(response: discovery_pb2.DiscoveryResponse) -> dict[str, secret_pb2.Secret]:
    result = {}
    for resource in response.resources:
        assert resource.type_url == SECRET_TYPE_URL
        secret = secret_pb2.Secret()
        assert resource.Unpack(secret)
        result[secret.name] = secret
    return result


def names_of(response: discovery_pb2.DiscoveryResponse) -> list[str]:
    return list(secrets_of(response))


def delta_secrets_of(response: discovery_pb2.DeltaDiscoveryResponse) -> dict[str, secret_pb2.Secret]:
    result = {}
    for resource in response.resources:
        secret = secret_pb2.Secret()
        assert resource.resource.Unpack(secret)
        assert secret.name == resource.name
        assert resource.version
        result[resource.name] = secret
    return result


@pytest.fixture
def provider() -> FakeSecretProvider:
    return FakeSecretProvider()


@pytest.fixture
def socket_path(tmp_path: Path) -> Path:
    return tmp_path / "run" / "workload-spiffe-uds" / "socket"


@pytest.fixture
def crl_path(tmp_path: Path) -> Path:
    return tmp_path / "crl" / "ca-crl.pem"


@pytest.fixture
def registry() -> Registry:
    """The server's own metrics registry: tests read absolute values, no global to diff."""
    return Registry()


def sample(registry: Registry, name: str, **labels: str) -> float:
    return registry.sample(PREFIX + name, labels) or 0.0


@pytest.fixture
async def server(
    provider: FakeSecretProvider, socket_path: Path, crl_path: Path, registry: Registry
) -> AsyncIterator[SdsServer]:
    sds = SdsServer(provider, socket_path, crl_path=crl_path, registry=registry)
    await sds.start()
    yield sds
    await sds.stop(None)


@pytest.fixture
async def channel(server: SdsServer, socket_path: Path) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"unix:{socket_path}") as chan:
        yield chan


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> sds_pb2_grpc.SecretDiscoveryServiceStub:
    return sds_pb2_grpc.SecretDiscoveryServiceStub(channel)


@pytest.fixture
async def open_stream(stub: sds_pb2_grpc.SecretDiscoveryServiceStub) -> AsyncIterator[Any]:
    """Factory of SotW streams, all cancelled at teardown."""
    streams: list[StreamClient] = []

    def factory() -> StreamClient:
        streams.append(StreamClient(stub.StreamSecrets()))
        return streams[-1]

    yield factory
    for stream in streams:
        await stream.close()


@pytest.fixture
async def open_delta(stub: sds_pb2_grpc.SecretDiscoveryServiceStub) -> AsyncIterator[Any]:
    streams: list[StreamClient] = []

    def factory() -> StreamClient:
        streams.append(StreamClient(stub.DeltaSecrets()))
        return streams[-1]

    yield factory
    for stream in streams:
        await stream.close()


async def wait_for_streams(server: SdsServer, count: int) -> None:
    """The server registers a stream when its first message arrives; wait until it has."""
    while server.stream_count != count:
        await asyncio.sleep(0.01)


# --- state of the world: requests and ACKs ----------------------------------------------------------


async def test_request_default_then_ack_is_silent(open_stream: Any) -> None:
    stream = open_stream()
    await stream.request([WORKLOAD_KEY_CERT])
    response = await stream.response()

    assert response.type_url == SECRET_TYPE_URL
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(Z|[+-]\d\d:\d\d)/\d+", response.version_info)
    assert uuid.UUID(response.nonce).version == 4
    secret = secrets_of(response)[WORKLOAD_KEY_CERT]
    assert secret.tls_certificate.certificate_chain.inline_bytes == CHAIN_1
    assert secret.tls_certificate.private_key.inline_bytes == KEY_1
    assert not secret.HasField("validation_context")

    await stream.request([WORKLOAD_KEY_CERT], response.nonce)
    await stream.expect_silence()


async def test_ack_adding_root_sends_only_root(open_stream: Any, crl_path: Path) -> None:
    stream = open_stream()
    await stream.request([WORKLOAD_KEY_CERT])
    first = await stream.response()

    await stream.request([WORKLOAD_KEY_CERT, ROOT_CERT], first.nonce)
    second = await stream.response()
    assert names_of(second) == [ROOT_CERT]
    root = secrets_of(second)[ROOT_CERT]
    assert root.validation_context.trusted_ca.inline_bytes == ROOT_1
    assert not root.validation_context.HasField("crl")  # no CRL file yet
    assert not root.HasField("tls_certificate")
    assert second.nonce != first.nonce
    assert second.version_info != first.version_info

    await stream.request([WORKLOAD_KEY_CERT, ROOT_CERT], second.nonce)
    await stream.expect_silence()
    # Removing a name on ACK is silent too.
    await stream.request([ROOT_CERT], second.nonce)
    await stream.expect_silence()


async def test_nonceless_requests_each_answered_with_their_names(open_stream: Any) -> None:
    stream = open_stream()
    await stream.request([ROOT_CERT])
    assert names_of(await stream.response()) == [ROOT_CERT]
    await stream.request([WORKLOAD_KEY_CERT])
    assert names_of(await stream.response()) == [WORKLOAD_KEY_CERT]


async def test_repeated_nonceless_request_answered_twice(open_stream: Any) -> None:
    stream = open_stream()
    await stream.request([ROOT_CERT])
    first = await stream.response()
    await stream.request([ROOT_CERT])
    second = await stream.response()
    assert names_of(first) == names_of(second) == [ROOT_CERT]
    assert first.nonce != second.nonce


async def test_initial_request_answers_all_names_in_request_order(open_stream: Any) -> None:
    stream = open_stream()
    await stream.request([ROOT_CERT, WORKLOAD_KEY_CERT, ROOT_CERT])
    assert names_of(await stream.response()) == [ROOT_CERT, WORKLOAD_KEY_CERT]


async def test_parallel_streams_get_their_own_resource(open_stream: Any) -> None:
    first, second = open_stream(), open_stream()
    await first.request([WORKLOAD_KEY_CERT])
    await second.request([ROOT_CERT])
    assert names_of(await first.response()) == [WORKLOAD_KEY_CERT]
    assert names_of(await second.response()) == [ROOT_CERT]
    await first.expect_silence()
    await second.expect_silence()


async def test_second_stream_causes_no_traffic_on_first(open_stream: Any) -> None:
    first = open_stream()
    await first.request([WORKLOAD_KEY_CERT])
    ack = await first.response()
    await first.request([WORKLOAD_KEY_CERT], ack.nonce)

    second = open_stream()
    await second.request([WORKLOAD_KEY_CERT])
    assert names_of(await second.response()) == [WORKLOAD_KEY_CERT]
    await first.expect_silence()


async def test_reconnect_with_previous_nonce_gets_full_response(open_stream: Any) -> None:
    old = open_stream()
    await old.request([WORKLOAD_KEY_CERT, ROOT_CERT])
    previous = await old.response()

    # The old stream still open: a new stream with the old nonce is a fresh stream.
    still_open = open_stream()
    await still_open.request([WORKLOAD_KEY_CERT, ROOT_CERT], previous.nonce)
    assert names_of(await still_open.response()) == [WORKLOAD_KEY_CERT, ROOT_CERT]

    await old.close()
    reconnected = open_stream()
    await reconnected.send(
        discovery_pb2.DiscoveryRequest(
            node=NODE,
            resource_names=[WORKLOAD_KEY_CERT, ROOT_CERT],
            response_nonce=previous.nonce,
            version_info=previous.version_info,
        )
    )
    assert names_of(await reconnected.response()) == [WORKLOAD_KEY_CERT, ROOT_CERT]


async def test_two_fresh_connections_each_get_full_response(server: SdsServer, socket_path: Path) -> None:
    async with (
        grpc.aio.insecure_channel(f"unix:{socket_path}") as one,
        grpc.aio.insecure_channel(f"unix:{socket_path}") as two,
    ):
        streams = [
            StreamClient(sds_pb2_grpc.SecretDiscoveryServiceStub(chan).StreamSecrets()) for chan in (one, two)
        ]
        for stream in streams:
            await stream.request([WORKLOAD_KEY_CERT, ROOT_CERT])
        for stream in streams:
            assert names_of(await stream.response()) == [WORKLOAD_KEY_CERT, ROOT_CERT]
        for stream in streams:
            await stream.close()


async def test_unsubscribe_is_silent_and_stops_pushes(server: SdsServer, open_stream: Any) -> None:
    stream = open_stream()
    await stream.request([WORKLOAD_KEY_CERT])
    response = await stream.response()
    await stream.request([], response.nonce)
    await stream.expect_silence()

    server.on_secret_update(WORKLOAD_KEY_CERT)
    await stream.expect_silence()
    # With the watch gone, a request carrying the old nonce is answered as an initial request.
    await stream.request([ROOT_CERT], response.nonce)
    assert names_of(await stream.response()) == [ROOT_CERT]


async def test_nack_is_counted_and_not_answered(open_stream: Any, registry: Registry) -> None:
    stream = open_stream()
    await stream.request([WORKLOAD_KEY_CERT])
    response = await stream.response()
    await stream.send(
        discovery_pb2.DiscoveryRequest(
            resource_names=[WORKLOAD_KEY_CERT],
            response_nonce=response.nonce,
            error_detail=status_pb2.Status(code=3, message="bad certificate"),
        )
    )
    await stream.expect_silence()
    assert sample(registry, "sds_nacks") == 1


async def test_stale_nonce_is_ignored(open_stream: Any) -> None:
    stream = open_stream()
    await stream.request([WORKLOAD_KEY_CERT])
    response = await stream.response()
    await stream.request([WORKLOAD_KEY_CERT, ROOT_CERT], "not-the-last-nonce")
    await stream.expect_silence()
    # The stale request did not change the watch: the real ACK still adds ROOTCA.
    await stream.request([WORKLOAD_KEY_CERT, ROOT_CERT], response.nonce)
    assert names_of(await stream.response()) == [ROOT_CERT]


async def test_other_type_url_is_answered_as_secret(open_stream: Any) -> None:
    stream = open_stream()
    await stream.send(
        discovery_pb2.DiscoveryRequest(
            node=NODE,
            resource_names=[ROOT_CERT],
            type_url="type.googleapis.com/envoy.config.cluster.v3.Cluster",
        )
    )
    response = await stream.response()
    assert response.type_url == SECRET_TYPE_URL
    assert names_of(response) == [ROOT_CERT]


async def test_missing_node_is_invalid_argument(open_stream: Any, server: SdsServer) -> None:
    stream = open_stream()
    await stream.request([WORKLOAD_KEY_CERT], node=False)
    err = await stream.error()
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "missing node information"

    empty_id = open_stream()
    await empty_id.send(discovery_pb2.DiscoveryRequest(node=Node(cluster="c"), resource_names=[ROOT_CERT]))
    assert (await empty_id.error()).code() == grpc.StatusCode.INVALID_ARGUMENT
    await wait_for_streams(server, 0)


async def test_node_needed_only_on_first_message(open_stream: Any) -> None:
    stream = open_stream()
    await stream.request([WORKLOAD_KEY_CERT])
    await stream.response()
    await stream.request([ROOT_CERT], node=False)
    assert names_of(await stream.response()) == [ROOT_CERT]


async def test_client_half_close_ends_stream_ok(open_stream: Any, server: SdsServer) -> None:
    stream = open_stream()
    await stream.request([ROOT_CERT])
    await stream.response()
    await stream.call.done_writing()
    assert await asyncio.wait_for(stream.received.get(), RESPONSE_WAIT) is grpc.aio.EOF
    assert await stream.call.code() == grpc.StatusCode.OK
    await wait_for_streams(server, 0)


# --- errors -------------------------------------------------------------------------------------------


async def test_unknown_secret_fails_stream_then_succeeds_once_added(
    open_stream: Any, provider: FakeSecretProvider, registry: Registry
) -> None:
    stream = open_stream()
    await stream.request(["spiffe-other"])
    err = await stream.error()
    assert err.code() == grpc.StatusCode.UNKNOWN
    assert err.details().startswith("failed to generate secret for spiffe-other: ")
    assert "no secret named" in err.details()
    assert sample(registry, "sds_errors") == 1

    provider.items["spiffe-other"] = SecretItem("spiffe-other", certificate_chain=CHAIN_2, private_key=KEY_2)
    retry = open_stream()
    await retry.request(["spiffe-other"])
    secret = secrets_of(await retry.response())["spiffe-other"]
    assert secret.tls_certificate.certificate_chain.inline_bytes == CHAIN_2


async def test_push_of_removed_secret_fails_stream(
    server: SdsServer, open_stream: Any, provider: FakeSecretProvider
) -> None:
    stream = open_stream()
    await stream.request([WORKLOAD_KEY_CERT])
    await stream.response()
    del provider.items[WORKLOAD_KEY_CERT]
    server.on_secret_update(WORKLOAD_KEY_CERT)
    err = await stream.error()
    assert err.code() == grpc.StatusCode.UNKNOWN
    assert "failed to generate secret for default" in err.details()


async def test_error_on_one_stream_leaves_others_alone(server: SdsServer, open_stream: Any) -> None:
    healthy = open_stream()
    await healthy.request([ROOT_CERT])
    await healthy.response()

    failing = open_stream()
    await failing.request(["does-not-exist"])
    assert (await failing.error()).code() == grpc.StatusCode.UNKNOWN

    await wait_for_streams(server, 1)
    await healthy.request([WORKLOAD_KEY_CERT])
    assert names_of(await healthy.response()) == [WORKLOAD_KEY_CERT]


async def test_error_message_never_contains_key_material(
    server: SdsServer, open_stream: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="istio.sds")
    stream = open_stream()
    await stream.request([WORKLOAD_KEY_CERT, ROOT_CERT])
    await stream.response()
    server.on_secret_update(WORKLOAD_KEY_CERT)
    await stream.response()
    await stream.close()
    await wait_for_streams(server, 0)

    assert "SDS: new connection" in caplog.text
    assert "SDS: connection closed" in caplog.text
    for secret in (b"key-1", b"chain-1", b"root-1"):
        assert secret.decode() not in caplog.text


# --- pushes ------------------------------------------------------------------------------------------


async def test_push_reaches_only_streams_watching_the_name(
    server: SdsServer, open_stream: Any, provider: FakeSecretProvider, registry: Registry
) -> None:
    both, default_only, root_only = open_stream(), open_stream(), open_stream()
    await both.request([WORKLOAD_KEY_CERT, ROOT_CERT])
    await default_only.request([WORKLOAD_KEY_CERT])
    await root_only.request([ROOT_CERT])
    for stream in (both, default_only, root_only):
        await stream.response()
    assert server.stream_count == 3

    provider.items[WORKLOAD_KEY_CERT] = SecretItem(
        WORKLOAD_KEY_CERT, certificate_chain=CHAIN_2, private_key=KEY_2
    )
    server.on_secret_update(WORKLOAD_KEY_CERT)

    for stream in (both, default_only):
        pushed = await stream.response()
        assert names_of(pushed) == [WORKLOAD_KEY_CERT]
        secret = secrets_of(pushed)[WORKLOAD_KEY_CERT]
        assert secret.tls_certificate.certificate_chain.inline_bytes == CHAIN_2
        assert secret.tls_certificate.private_key.inline_bytes == KEY_2
    await root_only.expect_silence()
    assert sample(registry, "sds_pushes", type="push") == 2


async def test_push_of_unwatched_name_is_ignored(server: SdsServer, open_stream: Any) -> None:
    stream = open_stream()
    await stream.request([ROOT_CERT])
    await stream.response()
    server.on_secret_update("file-cert:/a~/b")
    await stream.expect_silence()


async def test_burst_of_pushes_coalesces(server: SdsServer, open_stream: Any) -> None:
    stream = open_stream()
    await stream.request([WORKLOAD_KEY_CERT])
    first = await stream.response()
    for _ in range(1000):
        server.on_secret_update(WORKLOAD_KEY_CERT)
    pushed = await stream.response()
    assert names_of(pushed) == [WORKLOAD_KEY_CERT]
    assert pushed.nonce != first.nonce
    await stream.expect_silence()


async def test_pending_pushes_stay_bounded_by_watched_names(server: SdsServer, open_stream: Any) -> None:
    stream = open_stream()
    await stream.request([WORKLOAD_KEY_CERT])
    await stream.response()
    for i in range(10_000):
        server.on_secret_update(f"unwatched-{i}")
        server.on_secret_update(WORKLOAD_KEY_CERT)
    # White-box: nothing is queued for names the stream does not watch.
    [state] = server._streams.streams()
    assert list(state.pending) == [WORKLOAD_KEY_CERT]
    assert names_of(await stream.response()) == [WORKLOAD_KEY_CERT]
    await stream.expect_silence()


async def test_push_nonce_is_the_one_to_ack(server: SdsServer, open_stream: Any) -> None:
    stream = open_stream()
    await stream.request([WORKLOAD_KEY_CERT])
    first = await stream.response()
    server.on_secret_update(WORKLOAD_KEY_CERT)
    pushed = await stream.response()
    # Acking the push (the last nonce sent) with an added name answers just that name.
    await stream.request([WORKLOAD_KEY_CERT, ROOT_CERT], pushed.nonce)
    assert names_of(await stream.response()) == [ROOT_CERT]
    # The first nonce is now stale.
    await stream.request([WORKLOAD_KEY_CERT, ROOT_CERT, "x"], first.nonce)
    await stream.expect_silence()


# --- secret mapping -----------------------------------------------------------------------------------


async def test_root_secret_carries_crl_when_file_exists(open_stream: Any, crl_path: Path) -> None:
    crl_path.parent.mkdir(parents=True)
    crl_path.write_text("-----BEGIN X509 CRL-----\n")
    stream = open_stream()
    await stream.request([ROOT_CERT, WORKLOAD_KEY_CERT])
    secrets = secrets_of(await stream.response())
    assert secrets[ROOT_CERT].validation_context.crl.filename == str(crl_path)
    assert not secrets[WORKLOAD_KEY_CERT].HasField("validation_context")


async def test_file_root_names_map_to_validation_context(
    open_stream: Any, provider: FakeSecretProvider
) -> None:
    name = "file-root:/etc/ssl/bundle.pem"
    # Even an item not flagged as root is served as a trust bundle under a file-root name.
    provider.items[name] = SecretItem(name, root_cert=ROOT_1, certificate_chain=b"")
    provider.items["file-cert:/c~/k"] = SecretItem(
        "file-cert:/c~/k", certificate_chain=CHAIN_2, private_key=KEY_2
    )
    stream = open_stream()
    await stream.request([name, "file-cert:/c~/k"])
    secrets = secrets_of(await stream.response())
    assert secrets[name].validation_context.trusted_ca.inline_bytes == ROOT_1
    assert secrets["file-cert:/c~/k"].tls_certificate.private_key.inline_bytes == KEY_2


async def test_file_root_naming_a_non_certificate_is_answered_with_an_error(
    tmp_path: Path, socket_path: Path, registry: Registry, caplog: pytest.LogCaptureFixture
) -> None:
    """With the real secret manager: the stream hung for the 10 s a half-written file is retried."""
    not_a_certificate = tmp_path / "passwd"
    not_a_certificate.write_text("root:x:0:0:root:/root:/bin/bash\n")
    name = f"file-root:{not_a_certificate}"
    manager = SecretManager(SecuritySettings.from_env(Env({}), tmp_path), None, registry=registry)
    sds = SdsServer(manager, socket_path, crl_path=None, registry=registry)
    await manager.start()
    await sds.start()
    try:
        async with grpc.aio.insecure_channel(f"unix:{socket_path}") as channel:
            stream = StreamClient(sds_pb2_grpc.SecretDiscoveryServiceStub(channel).StreamSecrets())
            await stream.request([name])
            err = await stream.error()  # within RESPONSE_WAIT
            await stream.close()
    finally:
        await sds.stop(None)
        await manager.stop()
    assert err.code() == grpc.StatusCode.UNKNOWN
    assert f"failed to load {not_a_certificate}: " in err.details()
    assert "no PEM encoded certificate found" in err.details()
    logged = [
        r for r in caplog.records if r.levelno >= logging.WARNING and str(not_a_certificate) in r.getMessage()
    ]
    assert len(logged) == 1, [r.getMessage() for r in logged]


# --- FetchSecrets -------------------------------------------------------------------------------------


async def test_fetch_secrets_returns_all_names_without_node(
    stub: sds_pb2_grpc.SecretDiscoveryServiceStub,
) -> None:
    response = await stub.FetchSecrets(
        discovery_pb2.DiscoveryRequest(resource_names=[WORKLOAD_KEY_CERT, ROOT_CERT])
    )
    assert response.type_url == SECRET_TYPE_URL
    assert response.nonce
    secrets = secrets_of(response)
    assert list(secrets) == [WORKLOAD_KEY_CERT, ROOT_CERT]
    assert secrets[ROOT_CERT].validation_context.trusted_ca.inline_bytes == ROOT_1


async def test_fetch_secrets_error(stub: sds_pb2_grpc.SecretDiscoveryServiceStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.FetchSecrets(discovery_pb2.DiscoveryRequest(resource_names=["nope"]))
    assert info.value.code() == grpc.StatusCode.UNKNOWN
    assert info.value.details().startswith("failed to generate secret for nope: ")


# --- DeltaSecrets -------------------------------------------------------------------------------------


def delta_request(
    subscribe: Sequence[str] = (),
    unsubscribe: Sequence[str] = (),
    nonce: str = "",
    **kwargs: Any,
) -> discovery_pb2.DeltaDiscoveryRequest:
    return discovery_pb2.DeltaDiscoveryRequest(
        type_url=SECRET_TYPE_URL,
        resource_names_subscribe=subscribe,
        resource_names_unsubscribe=unsubscribe,
        response_nonce=nonce,
        **kwargs,
    )


async def test_delta_subscribe_ack_push_unsubscribe(
    server: SdsServer, open_delta: Any, provider: FakeSecretProvider
) -> None:
    stream = open_delta()
    await stream.send(delta_request([WORKLOAD_KEY_CERT], node=NODE))
    first = await stream.response()
    assert first.type_url == SECRET_TYPE_URL
    assert first.system_version_info
    assert uuid.UUID(first.nonce).version == 4
    secret = delta_secrets_of(first)[WORKLOAD_KEY_CERT]
    assert secret.tls_certificate.private_key.inline_bytes == KEY_1

    await stream.send(delta_request(nonce=first.nonce))  # ACK
    await stream.expect_silence()

    await stream.send(delta_request([ROOT_CERT], nonce=first.nonce))  # ACK + subscribe
    added = await stream.response()
    assert list(delta_secrets_of(added)) == [ROOT_CERT]

    provider.items[WORKLOAD_KEY_CERT] = SecretItem(
        WORKLOAD_KEY_CERT, certificate_chain=CHAIN_2, private_key=KEY_2
    )
    server.on_secret_update(WORKLOAD_KEY_CERT)
    pushed = await stream.response()
    assert (
        delta_secrets_of(pushed)[WORKLOAD_KEY_CERT].tls_certificate.certificate_chain.inline_bytes == CHAIN_2
    )
    assert pushed.resources[0].version != first.resources[0].version

    # A push whose content did not change is not re-sent.
    server.on_secret_update(WORKLOAD_KEY_CERT)
    await stream.expect_silence()

    await stream.send(delta_request(unsubscribe=[WORKLOAD_KEY_CERT], nonce=pushed.nonce))
    await stream.expect_silence()
    provider.items[WORKLOAD_KEY_CERT] = SecretItem(
        WORKLOAD_KEY_CERT, certificate_chain=CHAIN_1, private_key=KEY_1
    )
    server.on_secret_update(WORKLOAD_KEY_CERT)
    await stream.expect_silence()
    server.on_secret_update(ROOT_CERT)  # still subscribed, but unchanged
    await stream.expect_silence()


async def test_delta_initial_resource_versions(open_delta: Any) -> None:
    first = open_delta()
    await first.send(delta_request([WORKLOAD_KEY_CERT, ROOT_CERT], node=NODE))
    versions = {r.name: r.version for r in (await first.response()).resources}
    await first.close()

    # Reconnect: the client holds the current ROOTCA and an outdated default.
    again = open_delta()
    await again.send(
        delta_request(
            [WORKLOAD_KEY_CERT, ROOT_CERT],
            node=NODE,
            initial_resource_versions={ROOT_CERT: versions[ROOT_CERT], WORKLOAD_KEY_CERT: "outdated"},
        )
    )
    response = await again.response()
    assert list(delta_secrets_of(response)) == [WORKLOAD_KEY_CERT]
    assert response.resources[0].version == versions[WORKLOAD_KEY_CERT]

    # All up to date: nothing to send.
    fresh = open_delta()
    await fresh.send(delta_request(node=NODE, initial_resource_versions=versions))
    await fresh.expect_silence()


async def test_delta_empty_first_request_means_nothing_yet(open_delta: Any) -> None:
    stream = open_delta()
    await stream.send(delta_request(node=NODE))
    await stream.expect_silence()
    await stream.send(delta_request([ROOT_CERT]))
    assert list(delta_secrets_of(await stream.response())) == [ROOT_CERT]


async def test_delta_nack_is_counted_and_not_answered(open_delta: Any, registry: Registry) -> None:
    stream = open_delta()
    await stream.send(delta_request([WORKLOAD_KEY_CERT], node=NODE))
    response = await stream.response()
    await stream.send(delta_request(nonce=response.nonce, error_detail=status_pb2.Status(message="bad")))
    await stream.expect_silence()
    assert sample(registry, "sds_nacks") == 1


async def test_delta_requires_node_and_reports_generation_errors(open_delta: Any) -> None:
    no_node = open_delta()
    await no_node.send(delta_request([ROOT_CERT]))
    assert (await no_node.error()).code() == grpc.StatusCode.INVALID_ARGUMENT

    unknown = open_delta()
    await unknown.send(delta_request(["missing"], node=NODE))
    err = await unknown.error()
    assert err.code() == grpc.StatusCode.UNKNOWN
    assert err.details().startswith("failed to generate secret for missing: ")


# --- server lifecycle ---------------------------------------------------------------------------------


async def test_socket_and_directory_modes(server: SdsServer, socket_path: Path) -> None:
    assert stat.S_ISSOCK(socket_path.stat().st_mode)
    assert stat.S_IMODE(socket_path.stat().st_mode) == 0o666
    assert stat.S_IMODE(socket_path.parent.stat().st_mode) == 0o750


async def test_stale_socket_file_is_replaced_at_start(
    provider: FakeSecretProvider, socket_path: Path
) -> None:
    socket_path.parent.mkdir(parents=True)
    socket_path.write_text("stale")
    sds = SdsServer(provider, socket_path, registry=Registry())
    await sds.start()
    try:
        assert stat.S_ISSOCK(socket_path.stat().st_mode)
        async with grpc.aio.insecure_channel(f"unix:{socket_path}") as chan:
            response = await sds_pb2_grpc.SecretDiscoveryServiceStub(chan).FetchSecrets(
                discovery_pb2.DiscoveryRequest(resource_names=[ROOT_CERT])
            )
        assert names_of(response) == [ROOT_CERT]
    finally:
        await sds.stop(None)


async def test_connection_gauge_and_stop_closes_streams(
    server: SdsServer, open_stream: Any, socket_path: Path, registry: Registry
) -> None:
    streams = [open_stream(), open_stream()]
    for stream in streams:
        await stream.request([ROOT_CERT])
        await stream.response()
    assert server.stream_count == 2
    assert sample(registry, "sds_connections") == 2

    await server.stop(0.1)
    for stream in streams:
        await stream.error()
    assert server.stream_count == 0
    assert sample(registry, "sds_connections") == 0


async def test_request_counter(open_stream: Any, registry: Registry) -> None:
    stream = open_stream()
    await stream.request([ROOT_CERT])
    await stream.response()
    assert sample(registry, "sds_pushes", type="request") == 1


# --- connections that do nothing --------------------------------------------------------------------


async def test_connections_that_do_nothing_are_closed_and_streams_are_kept(
    provider: FakeSecretProvider, socket_path: Path
) -> None:
    limits = uds.ServerLimits(handshake_timeout=0.3, idle_timeout=0.5)
    sds = SdsServer(provider, socket_path, limits=limits, registry=Registry())
    await sds.start()
    try:
        silent, idle = await asyncio.gather(silent_client(socket_path, 5), idle_http2_client(socket_path, 5))
        assert silent is not None and silent < 3, (
            "a client that never sent the HTTP/2 preface stayed connected"
        )
        assert idle is not None and idle < 3, "a connection without a call stayed open"
        async with grpc.aio.insecure_channel(f"unix:{socket_path}") as chan:
            stream = StreamClient(sds_pb2_grpc.SecretDiscoveryServiceStub(chan).StreamSecrets())
            try:
                await stream.request([WORKLOAD_KEY_CERT])
                first = await stream.response()
                await asyncio.sleep(1)  # a quiet stream is not an idle connection
                await stream.request([WORKLOAD_KEY_CERT, ROOT_CERT], first.nonce)
                assert names_of(await stream.response()) == [ROOT_CERT]
            finally:
                await stream.close()
    finally:
        await sds.stop(None)
