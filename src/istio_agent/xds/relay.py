"""One downstream xDS stream relayed to its own upstream stream to istiod.

There are no queues but one: each direction awaits the write on the other side, so a slow reader
is back-pressured through gRPC flow control. Writes to one upstream call are serialised by the
stream's lock, shared with the agent's own requests (ACKs, NDS/PCDS, health, debug questions).
istiod's responses are relayed as the bytes received (see :mod:`istio_agent.xds.wire`), held once:
the buffer a response was received into is what is written to Envoy, in slices of it
(:mod:`istio_agent.rpc.message`); only the agent's own types are decoded, and ECDS, whose remote
Wasm modules the agent fetches first (:mod:`istio_agent.xds.extension_configs`): those responses are
converted in a task of their own, in order, so a slow registry holds back no other type. They wait
for it in the stream's one queue, which holds only ECDS responses (small: one filter config each)
while their modules are fetched.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from google.protobuf import any_pb2
from google.protobuf.message import DecodeError
from grpclib.exceptions import GRPCError

from istio_agent.istiod.dial import MAX_RECEIVE_BYTES
from istio_agent.log import scope
from istio_agent.rpc import Status
from istio_agent.rpc.call import Call, CallEnded
from istio_agent.rpc.channel import BidiStream, Channel, RpcError
from istio_agent.xds import types
from istio_agent.xds.extension_configs import ConversionRefused, ExtensionConfigs
from istio_agent.xds.flavour import ADS_SERVICE, Flavour, Request
from istio_agent.xds.health_report import HealthReport
from istio_agent.xds.outcome import DownstreamError, Outcome, Outcomes, UpstreamError
from istio_agent.xds.proxy_metrics import ProxyMetrics
from istio_agent.xds.proxy_stream import ProxyStream
from istio_agent.xds.questions import DEBUG_TYPE_PREFIX, DebugQuestions
from istio_agent.xds.upstream import DialError, UpstreamDialer
from istio_agent.xds.wire import RawResponse

log = scope("xdsproxy")

UPSTREAM_MAX_RECEIVE_BYTES = MAX_RECEIVE_BYTES
"""The largest response istiod may send: Istio's agent opens its upstream with
``grpc.MaxCallRecvMsgSize(math.MaxInt32)`` (pkg/istio-agent/xds_proxy.go), not gRPC's 4 MiB; set on
the call too, since the relay is handed its channel."""


class TypeHandler(Protocol):
    """An agent-owned type: its responses go to ``handle`` instead of Envoy."""

    type_url: str

    def handle(self, resource: any_pb2.Any) -> None:
        """Consume the resource; raise ValueError(text) to NACK it."""


def _open_upstream(flavour: Flavour, channel: Channel, metadata: list[tuple[str, str]]) -> BidiStream:
    """The upstream stream; requests go encoded, responses arrive undecoded, each in the one buffer
    it was received into (``bytearray``: see :mod:`istio_agent.rpc.message`), which is what is
    written to Envoy (see :class:`RawResponse`)."""
    return channel.stream(
        f"/{ADS_SERVICE}/{flavour.method}",
        flavour.request_type,
        bytearray,
        metadata=metadata,
        max_receive_bytes=UPSTREAM_MAX_RECEIVE_BYTES,
    )


@dataclass(frozen=True, eq=False)
class Relay:
    """The request and response pumps of every stream of one proxy, and the parts they report to."""

    dialer: UpstreamDialer
    handlers: Mapping[str, TypeHandler]
    """The agent's own types by URL: their responses are handled here and ACKed, not forwarded."""
    metrics: ProxyMetrics
    health: HealthReport
    questions: DebugQuestions
    outcomes: Outcomes
    extension_configs: ExtensionConfigs | None = None
    """Converts ECDS responses (remote Wasm made local); None: ECDS is relayed as it comes."""

    async def run(
        self, stream: ProxyStream, downstream: Call, first: Request, requests: AsyncIterator[Request]
    ) -> Outcome:
        """Relay until either side ends the stream (``first`` read from ``downstream`` already, the
        rest from ``requests``); the upstream is closed whatever happens."""
        try:
            channel = self.dialer.dial()
        except DialError as err:
            return self.outcomes.dial_failed(err)
        try:
            stream.call = _open_upstream(stream.flavour, channel, self.dialer.metadata())
            stream.tasks = (
                asyncio.create_task(
                    self._pump_requests(stream, first, requests), name=f"xds-{stream.id}-requests"
                ),
                asyncio.create_task(
                    self._pump_responses(stream, downstream), name=f"xds-{stream.id}-responses"
                ),
                asyncio.create_task(self._pump_health(stream), name=f"xds-{stream.id}-health"),
            )
            if self.extension_configs is not None:
                stream.tasks += (
                    asyncio.create_task(
                        self._pump_extension_configs(stream, downstream, self.extension_configs),
                        name=f"xds-{stream.id}-ecds",
                    ),
                )
            return self.outcomes.settle(stream, await self._first_outcome(stream))
        finally:
            # Shielded: a second cancellation (server stopping) must not leave the channel open.
            await asyncio.shield(self._close_upstream(stream, channel))

    async def send(self, stream: ProxyStream, request: Request) -> None:
        """Write one request upstream (Envoy's or the agent's); UpstreamError when istiod's side failed."""
        async with stream.lock:
            if stream.half_closed:
                log.debug(
                    "stream %d: not sending %s after Envoy closed its side", stream.id, request.type_url
                )
                return
            try:
                await stream.call.send(request)
            except RpcError as err:
                raise self._upstream_error(stream, err) from None
        self.metrics.requests.inc()

    async def _first_outcome(self, stream: ProxyStream) -> BaseException | None:
        """The exception that ends the relay, or None when istiod ended the stream with OK."""
        responses = stream.tasks[1]
        pending = set(stream.tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task.cancelled():
                    return asyncio.CancelledError()  # stop(): end the stream cleanly
                error = task.exception()
                if error is not None:
                    return error
                if task is responses:
                    return None
                # Envoy half-closed its side: keep relaying what istiod still sends.
        return None

    async def _close_upstream(self, stream: ProxyStream, channel: Channel) -> None:
        for task in stream.tasks:
            task.cancel()
        if stream.tasks:
            await asyncio.gather(*stream.tasks, return_exceptions=True)
        if stream.call is not None and not stream.call.done():
            await stream.call.cancel()
            self.metrics.istiod_terminations.labels(type="cancelled").inc()
        channel.close()

    # -- request path: Envoy -> istiod ----------------------------------------------------------------
    async def _pump_requests(
        self, stream: ProxyStream, first: Request, requests: AsyncIterator[Request]
    ) -> None:
        request = first
        while True:
            self._observe(stream, request)
            await self.send(stream, request)
            if not stream.initial_sent and request.type_url == types.LISTENER:
                await self._send_initial_requests(stream)
            try:
                request = await anext(requests)
            except StopAsyncIteration:
                break
            except CallEnded as err:
                raise DownstreamError(f"read failed: {err}") from None
            except GRPCError as err:  # a request refused as it was read (too large, undecodable)
                raise DownstreamError(f"request refused: {err.message}", err.status) from None
        # Envoy half-closed: pass it on; istiod ends the stream and so do we.
        stream.half_closed = True
        async with stream.lock:
            if not stream.call.done():
                try:
                    await stream.call.done_writing()
                except RpcError as err:
                    raise self._upstream_error(stream, err) from None

    def _observe(self, stream: ProxyStream, request: Request) -> None:
        self.metrics.request_size(request.ByteSize())
        if request.type_url == types.EXTENSION_CONFIG and not stream.flavour.delta and request.version_info:
            stream.extension_config_version = request.version_info
        if request.HasField("error_detail"):
            self.metrics.nacks.labels(type_url=request.type_url).inc()
            log.debug("Envoy rejected %s: %s", request.type_url, request.error_detail.message)

    async def _send_initial_requests(self, stream: ProxyStream) -> None:
        """After the first LDS request: subscribe to the agent's own types, then report health."""
        order = [types.NAME_TABLE, types.PROXY_CONFIG]
        order += [url for url in self.handlers if url not in order]
        for type_url in order:
            if type_url in self.handlers:
                await self.send(stream, stream.flavour.agent_request(type_url))
        stream.initial_sent = True
        health = self.health.request(stream.flavour)
        if health is not None:
            await self.send(stream, health)

    async def _pump_health(self, stream: ProxyStream) -> None:
        while True:
            await stream.health_wake.wait()
            stream.health_wake.clear()
            health = self.health.request(stream.flavour)
            # Before the first LDS request the report waits: it is sent with the initial requests.
            if stream.initial_sent and health is not None:
                await self.send(stream, health)

    @staticmethod
    def _upstream_error(stream: ProxyStream, err: RpcError) -> UpstreamError:
        status = stream.call.status
        if status is not None and status[0] is Status.OK:  # istiod had ended the stream with OK
            return UpstreamError(Status.UNAVAILABLE, f"stream closed while sending: {err.details}")
        return UpstreamError(err.code, err.details)

    # -- response path: istiod -> Envoy ---------------------------------------------------------------
    async def _pump_responses(self, stream: ProxyStream, downstream: Call) -> None:
        call: BidiStream = stream.call
        while True:
            try:
                data = await call.recv()
            except RpcError as err:
                raise UpstreamError(err.code, err.details) from None
            if data is None:
                return
            await self._relay_response(stream, downstream, data)
            # Let go of this push before receiving the next (SotW sends CDS and EDS back to back):
            # a loop variable would keep it alive while the next one is read.
            del data

    async def _relay_response(self, stream: ProxyStream, downstream: Call, data: bytearray) -> None:
        """One response from istiod: to Envoy, to the agent's own handler, or to a debug question.

        ``data`` is the buffer the response was received into, written to Envoy as it is."""
        response = RawResponse.decode(data)
        if response.malformed:
            raise UpstreamError(Status.INTERNAL, f"malformed response: {response.malformed}")
        if not stream.answered:
            stream.answered = True
            self.outcomes.connected()
        self.metrics.responses.inc()
        handler = self.handlers.get(response.type_url)
        if response.type_url.startswith(DEBUG_TYPE_PREFIX):
            self.questions.answer(stream, response)
        elif handler is not None:
            await self._handle_agent_type(stream, handler, response)
        elif not types.is_forwardable(response.type_url):
            log.debug("skipping forwarding type url %s to Envoy: not a valid Envoy type", response.type_url)
        elif response.type_url == types.EXTENSION_CONFIG and self.extension_configs is not None:
            stream.extension_configs.put_nowait(data)
        else:
            await self._forward(downstream, response.type_url, response.data)

    async def _forward(self, downstream: Call, type_url: str, data: bytes | bytearray) -> None:
        try:
            await downstream.send(data)
        except CallEnded as err:
            raise DownstreamError(f"write failed: {err}") from None
        self.metrics.pushes.labels(type_url=type_url).inc()

    async def _pump_extension_configs(
        self, stream: ProxyStream, downstream: Call, converter: ExtensionConfigs
    ) -> None:
        """ECDS responses, one after another: their Wasm modules fetched and made local, then to
        Envoy; a response that cannot be converted is NACKed to istiod instead (Istio's
        rewriteAndForward), with the last version Envoy accepted."""
        flavour = stream.flavour
        while True:
            data = await stream.extension_configs.get()
            try:
                response = flavour.response_type.FromString(data)
            except DecodeError as err:
                raise UpstreamError(
                    Status.INTERNAL, f"malformed {types.EXTENSION_CONFIG} response: {err}"
                ) from None
            del data
            resources = (
                [entry.resource for entry in response.resources] if flavour.delta else response.resources
            )
            try:
                converted = await converter.convert(list(resources))
            except ConversionRefused as err:
                log.warning("rejecting ECDS response from istiod: %s", err)
                nack = flavour.reply(response, str(err))
                if not flavour.delta:
                    nack.version_info = stream.extension_config_version
                await self.send(stream, nack)
                continue
            for index, resource in enumerate(converted):
                target = response.resources[index]
                (target.resource if flavour.delta else target).CopyFrom(resource)
            await self._forward(downstream, response.type_url, response.SerializeToString())

    async def _handle_agent_type(self, stream: ProxyStream, handler: TypeHandler, raw: RawResponse) -> None:
        try:
            response = stream.flavour.response_type.FromString(raw.data)
        except DecodeError as err:
            raise UpstreamError(Status.INTERNAL, f"malformed {raw.type_url} response: {err}") from None
        resource = stream.flavour.first_resource(response)
        if resource is None:
            log.debug("empty %s response from istiod: nothing to do, no ACK", response.type_url)
            return
        error: str | None = None
        try:
            handler.handle(resource)
        except ValueError as err:
            error = str(err) or type(err).__name__
        except Exception as err:
            log.exception("handler for %s failed", response.type_url)
            error = f"{type(err).__name__}: {err}"
        if error is not None:
            log.warning("rejecting %s from istiod: %s", response.type_url, error)
        await self.send(stream, stream.flavour.reply(response, error))
