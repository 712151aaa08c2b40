"""The debug tap's questions to istiod, asked on the workload's own upstream stream.

istiod then sees the workload's identity, as with Istio's tap. One question at a time, as in
Istio: the waiting state is a single slot, filled when the question is sent and answered by the
response pump when a response of the asked type arrives on the same stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf.message import DecodeError

from istio_agent.log import scope
from istio_agent.xds.flavour import DELTA, Flavour, Request
from istio_agent.xds.outcome import UpstreamError
from istio_agent.xds.proxy_stream import ProxyStream
from istio_agent.xds.wire import RawResponse

log = scope("xdsproxy")

DEBUG_TYPE_PREFIX = "istio.io/debug"

Send = Callable[[ProxyStream, Request], Awaitable[None]]
"""Writes a request on a stream's upstream call (raises UpstreamError)."""


class TapError(Exception):
    """A debug question could not be asked on the workload's connection to istiod."""


class TapTimeout(TapError):
    """istiod did not answer a debug question in time (or the stream ended first)."""


@dataclass(eq=False)
class _TapWait:
    stream_id: int
    type_url: str
    answer: asyncio.Future[discovery_pb2.DiscoveryResponse]


def as_sotw_response(flavour: Flavour, raw: RawResponse) -> discovery_pb2.DiscoveryResponse:
    """A debug answer in SotW form whatever the stream's flavour (Istio's tap converts Delta too)."""
    if not flavour.delta:
        return discovery_pb2.DiscoveryResponse.FromString(raw.data)
    delta = discovery_pb2.DeltaDiscoveryResponse.FromString(raw.data)
    return discovery_pb2.DiscoveryResponse(
        version_info=delta.system_version_info,
        resources=[resource.resource for resource in delta.resources],
        type_url=delta.type_url,
        nonce=delta.nonce,
        control_plane=delta.control_plane if delta.HasField("control_plane") else None,
    )


class DebugQuestions:
    """The one question in flight; ``streams`` is the proxy's live table of streams (newest last)."""

    def __init__(self, streams: dict[int, ProxyStream], upstream: Callable[[], str]) -> None:
        self._streams = streams
        self._upstream = upstream
        self._lock = asyncio.Lock()
        self._wait: _TapWait | None = None

    async def ask(
        self, request: discovery_pb2.DiscoveryRequest, timeout: float, send: Send
    ) -> discovery_pb2.DiscoveryResponse:
        """istiod's answer to ``request``, asked on the newest stream with ``send``.

        The asker's node is dropped: the stream has identified itself already. The answer is not
        ACKed. Raises :class:`TapError` when no stream is open and :class:`TapTimeout` when istiod
        does not answer within ``timeout`` seconds."""
        try:
            async with asyncio.timeout(timeout):
                return await self._ask(request, send)
        except TimeoutError:
            raise TapTimeout(f"istiod did not answer {request.type_url} within {timeout:g}s") from None

    async def _ask(
        self, request: discovery_pb2.DiscoveryRequest, send: Send
    ) -> discovery_pb2.DiscoveryResponse:
        async with self._lock:
            stream = next(
                (s for s in reversed(self._streams.values()) if s.call is not None and not s.half_closed),
                None,
            )
            if stream is None:
                raise TapError("proxy not connected to Istiod")
            names = list(request.resource_names)
            question: Request = (
                discovery_pb2.DeltaDiscoveryRequest(type_url=request.type_url, resource_names_subscribe=names)
                if stream.flavour is DELTA
                else discovery_pb2.DiscoveryRequest(type_url=request.type_url, resource_names=names)
            )
            wait = _TapWait(stream.id, request.type_url, asyncio.get_running_loop().create_future())
            self._wait = wait
            ended = asyncio.create_task(stream.finished.wait())
            try:
                try:
                    await send(stream, question)
                except UpstreamError as err:
                    raise TapError(f"xDS upstream {self._upstream()}: {err.details}") from None
                await asyncio.wait((wait.answer, ended), return_when=asyncio.FIRST_COMPLETED)
                if wait.answer.done():
                    return wait.answer.result()
                raise TapTimeout(f"the stream to istiod ended before it answered {request.type_url}")
            finally:
                self._wait = None
                ended.cancel()

    def answer(self, stream: ProxyStream, raw: RawResponse) -> None:
        """A debug response from istiod: the answer to the question in flight, or dropped."""
        wait = self._wait
        if wait is None or wait.stream_id != stream.id or wait.type_url != raw.type_url or wait.answer.done():
            log.debug("tap response %s arrived too late; discarding", raw.type_url)
            return
        try:
            wait.answer.set_result(as_sotw_response(stream.flavour, raw))
        except DecodeError as err:
            wait.answer.set_exception(TapError(f"malformed {raw.type_url} response from istiod: {err}"))
