"""Test doubles for the xDS proxy tests: a scriptable fake istiod (real gRPC on loopback) and an Envoy-like client.

``FakeIstiod`` serves ADS (SotW and Delta). Each accepted stream is handed to the test as a
``FakeUpstreamStream``: the test reads what the proxy sent (``recv``), pushes responses (``send``),
ends the stream with a status (``abort``) or with OK (``close``), and observes how the stream ended
(``ended``). With ``auto_reply`` every request is answered with an empty response of its type.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from istio_agent.config import XdsSettings
from istio_agent.metrics import Registry
from istio_agent.xds.proxy import XdsProxy

WAIT = 5.0
"""Upper bound for something expected; only reached when a test is failing."""
SILENCE = 0.3
"""How long "nothing arrives" is observed; ordering checks after it make assertions strict."""

CDS = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
LDS = "type.googleapis.com/envoy.config.listener.v3.Listener"


@dataclass(frozen=True)
class _Abort:
    code: grpc.StatusCode
    details: str


_CLOSE = object()
_END = object()


class FakeUpstreamStream:
    """istiod's side of one upstream ADS stream opened by the proxy."""

    def __init__(self, context: grpc.aio.ServicerContext, delta: bool) -> None:
        self.delta = delta
        self.metadata = {key: value for key, value in context.invocation_metadata() or ()}
        auth = context.auth_context()
        self.peer_cert: bytes | None = (auth.get("x509_pem_cert") or [None])[0]
        self.requests: asyncio.Queue[Any] = asyncio.Queue()
        self.actions: asyncio.Queue[Any] = asyncio.Queue()
        self.ended = asyncio.Event()
        self.cancelled = False
        self.client_half_closed = asyncio.Event()

    async def recv(self, timeout: float = WAIT) -> Any:
        """The next request the proxy sent; fails the test when none comes."""
        item = await asyncio.wait_for(self.requests.get(), timeout)
        assert item is not _END, "the proxy half-closed the upstream stream"
        return item

    async def expect_silence(self, seconds: float = SILENCE) -> None:
        await asyncio.sleep(seconds)
        assert self.requests.empty(), f"unexpected request: {self.requests.get_nowait()}"

    async def send(self, response: Any) -> None:
        self.actions.put_nowait(response)

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.actions.put_nowait(_Abort(code, details))

    def close(self) -> None:
        self.actions.put_nowait(_CLOSE)


class FakeIstiod(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    """A scriptable ADS server on 127.0.0.1: plaintext, or TLS with the given (key, chain).

    gRPC Python either requires and verifies a client certificate (``require_client_cert``, against
    ``client_ca``) or does not ask for one at all.
    """

    def __init__(
        self,
        *,
        tls: tuple[bytes, bytes] | None = None,
        client_ca: bytes | None = None,
        require_client_cert: bool = False,
        auto_reply: bool = False,
        port: int = 0,
    ) -> None:
        self._tls = tls
        self._client_ca = client_ca
        self._require_client_cert = require_client_cert
        self.auto_reply = auto_reply
        self._port = port
        self.port = 0
        self.streams: asyncio.Queue[FakeUpstreamStream] = asyncio.Queue()
        self.all_streams: list[FakeUpstreamStream] = []
        self._server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> FakeIstiod:
        server = grpc.aio.server()
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(self, server)
        target = f"127.0.0.1:{self._port}"
        if self._tls is None:
            self.port = server.add_insecure_port(target)
        else:
            key, chain = self._tls
            credentials = grpc.ssl_server_credentials(
                [(key, chain)],
                root_certificates=self._client_ca,
                require_client_auth=self._require_client_cert,
            )
            self.port = server.add_secure_port(target, credentials)
        await server.start()
        self._server = server
        return self

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(None)
            self._server = None

    async def next_stream(self, timeout: float = WAIT) -> FakeUpstreamStream:
        return await asyncio.wait_for(self.streams.get(), timeout)

    async def StreamAggregatedResources(self, request_iterator: AsyncIterator[Any], context: Any) -> None:
        await self._serve(request_iterator, context, delta=False)

    async def DeltaAggregatedResources(self, request_iterator: AsyncIterator[Any], context: Any) -> None:
        await self._serve(request_iterator, context, delta=True)

    async def _serve(self, requests: AsyncIterator[Any], context: Any, delta: bool) -> None:
        stream = FakeUpstreamStream(context, delta)
        self.all_streams.append(stream)
        self.streams.put_nowait(stream)
        reader = asyncio.create_task(self._read(stream, requests))
        try:
            while True:
                action = await stream.actions.get()
                if action is _CLOSE:
                    return
                if isinstance(action, _Abort):
                    await context.abort(action.code, action.details)
                await context.write(action)
        except asyncio.CancelledError:
            stream.cancelled = True
            raise
        finally:
            reader.cancel()
            stream.ended.set()

    async def _read(self, stream: FakeUpstreamStream, requests: AsyncIterator[Any]) -> None:
        try:
            async for request in requests:
                stream.requests.put_nowait(request)
                if self.auto_reply:
                    stream.actions.put_nowait(response_for(request, delta=stream.delta))
        finally:
            stream.requests.put_nowait(_END)
            stream.client_half_closed.set()


def response_for(request: Any, *, delta: bool, nonce: str = "n1", version: str = "v1") -> Any:
    """An empty response of the request's type."""
    if delta:
        return discovery_pb2.DeltaDiscoveryResponse(type_url=request.type_url, nonce=nonce)
    return discovery_pb2.DiscoveryResponse(type_url=request.type_url, nonce=nonce, version_info=version)


class EnvoyStream:
    """Envoy's side of one ADS stream to the proxy (SotW or Delta); responses collected in a queue."""

    def __init__(self, channel: grpc.aio.Channel, *, delta: bool = False) -> None:
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
        self.delta = delta
        self.call: Any = stub.DeltaAggregatedResources() if delta else stub.StreamAggregatedResources()
        self.received: asyncio.Queue[Any] = asyncio.Queue()
        self._pump = asyncio.create_task(self._collect())

    async def _collect(self) -> None:
        try:
            while True:
                message = await self.call.read()
                self.received.put_nowait(message)
                if message is grpc.aio.EOF:
                    return
        except grpc.aio.AioRpcError as err:
            self.received.put_nowait(err)
        except asyncio.CancelledError:
            self.received.put_nowait(asyncio.CancelledError())

    def request(self, type_url: str, **fields: Any) -> Any:
        message = discovery_pb2.DeltaDiscoveryRequest if self.delta else discovery_pb2.DiscoveryRequest
        return message(type_url=type_url, **fields)

    async def send(self, type_url: str, **fields: Any) -> Any:
        request = self.request(type_url, **fields)
        with contextlib.suppress(grpc.aio.AioRpcError):  # ended already: recv() / status() say how
            await self.call.write(request)
        return request

    async def recv(self, timeout: float = WAIT) -> Any:
        """The next response; fails the test on an error or the end of the stream."""
        item = await asyncio.wait_for(self.received.get(), timeout)
        assert not isinstance(item, grpc.aio.AioRpcError), f"stream failed: {item.code()} {item.details()}"
        assert item is not grpc.aio.EOF, "stream ended"
        return item

    async def status(self, timeout: float = WAIT) -> tuple[grpc.StatusCode, str]:
        """How the stream ended (skipping any responses still queued)."""
        while True:
            item = await asyncio.wait_for(self.received.get(), timeout)
            if isinstance(item, grpc.aio.AioRpcError):
                return item.code(), item.details() or ""
            if item is grpc.aio.EOF:
                return grpc.StatusCode.OK, ""

    async def expect_silence(self, seconds: float = SILENCE) -> None:
        await asyncio.sleep(seconds)
        assert self.received.empty(), f"unexpected message: {self.received.get_nowait()}"

    async def close(self) -> None:
        self.call.cancel()
        self._pump.cancel()
        await asyncio.gather(self._pump, return_exceptions=True)


@asynccontextmanager
async def running(
    settings: XdsSettings, handlers: tuple[Any, ...] = (), channel_options: Sequence[tuple[str, Any]] = ()
) -> AsyncIterator[tuple[XdsProxy, grpc.aio.Channel]]:
    """A started xDS proxy and Envoy's channel to its socket (``channel_options``: Envoy's settings)."""
    registry = Registry()  # the proxy's own: tests read absolute values
    proxy = XdsProxy(settings, handlers=handlers, registry=registry)
    proxy.registry = registry  # type: ignore[attr-defined]
    await proxy.start()
    channel = grpc.aio.insecure_channel(f"unix:{proxy.socket_path}", options=list(channel_options))
    try:
        yield proxy, channel
    finally:
        await channel.close()
        await proxy.stop()
