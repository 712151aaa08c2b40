"""The xDS stream core: one engine that serves SotW and Delta streams for every xDS server of the project.

The SDS server (:mod:`istio_agent.security.sds`), the local control plane's ADS
(:mod:`istio_agent.controlplane.ads`) and the debug tap are thin sources (:class:`Source`) on a
:class:`StreamServer`, as Istio serves SDS and ADS from one stream loop (``pilot/pkg/xds/ads.go``,
``pilot/pkg/xds/delta.go``, reused by ``security/pkg/nodeagent/sds/sdsservice.go``).

Each stream runs three tasks. The gRPC handler reads the first request and lets the source
accept it (node, identity), then waits. A reader puts requests into a small bounded queue, so gRPC
flow control back-pressures a chatty client. A worker is the only task that changes the stream's
state or writes to it: it handles queued requests first, then pending pushes, one at a time.
:meth:`Stream.push` only files an event in a slot per key (the newest event for a key wins) and
returns, so a client that stops reading stalls its own worker and nobody else's, and the memory a
stream holds is bounded by its keys.

What was sent for a type (nonce, version) is recorded when a response is built, before it is
written; the worker writes it before it reads the next request, so an ACK can only match a nonce
the client could have received. How requests change what a client watches is
:mod:`istio_agent.xds.watch`.

A source answers three questions: which resources exist for a type and names
(:meth:`Source.resources`), what version a response carries (:meth:`Source.version`), and what a
push event changed (:meth:`Source.changes`); it may also answer query types, requests served once
each and never watched (:meth:`Source.answer`, e.g. istiod's ``istio.io/debug/syncz``). Answers may
be awaited (a slow one holds up only its own stream) and may fail: no answer (None) leaves the
stream open, a :class:`StreamError` ends that stream alone. The debug tap, for example, forwards
every ``istio.io/debug/*`` query to istiod::

    class DebugTap(Source[None, None]):
        def __init__(self, istiod: Upstream) -> None:
            self._istiod = istiod

        async def open(self, request, call, flavour) -> None:
            return None  # istioctl's node is not needed: istiod sees the pod's own

        def is_query(self, type_url: str) -> bool:
            return type_url.startswith("istio.io/debug")

        async def answer(self, stream, request) -> Reply | None:
            try:
                response = await self._istiod.query(request)  # may take seconds
            except UpstreamError as err:
                raise StreamError(Status.UNAVAILABLE, str(err)) from err
            if response is None:
                return None  # timed out: nothing to send, the stream stays open
            return Reply([Resource("", r) for r in response.resources], response.version_info)

``tests/xds/test_stream.py`` runs a tap like this one; the agent's is :mod:`istio_agent.xds.tap`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from envoy.config.core.v3 import base_pb2
from google.protobuf.message import DecodeError
from grpclib.exceptions import GRPCError

from istio_agent.rpc import Status
from istio_agent.rpc.call import Call, CallEnded
from istio_agent.rpc.server import RpcServer, ServerCall
from istio_agent.xds.flavour import SOTW, Flavour, Request, Resource, Resources, Response, new_nonce
from istio_agent.xds.watch import Decision, Policy, Verdict, Watch, delta_request, sotw_request

C = TypeVar("C")
"""What a source keeps per stream (the proxy's identity, its snapshot, ...)."""
E = TypeVar("E")
"""A push event (a changed secret's name, a new mesh, ...)."""

REQUEST_QUEUE_SIZE = 8
READ_ERRORS = (CallEnded, DecodeError)
"""What reading a stream raises when the client has gone away or sent something unreadable."""
NO_RESOURCES = Resources((), {}, {})
Change = tuple[str, Sequence[str] | None]
"""A type a push changed, with the names it changed (None: any of them)."""


class StreamError(Exception):
    """Ends one stream with ``code`` and ``details`` (never with key material or tokens in them)."""

    def __init__(self, code: Status, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


def require_node(request: Request) -> None:
    """Istio's rule for a stream's first request: a node with an id (Envoy sends it only then)."""
    if not (request.HasField("node") and request.node.id):
        raise StreamError(Status.INVALID_ARGUMENT, "missing node information")


@dataclass(frozen=True)
class Reply:
    """A query's answer: the resources of one response and its version."""

    resources: Sequence[Resource]
    version: str = ""
    control_plane: base_pb2.ControlPlane | None = None
    """Who answered, when not this server (a relayed answer keeps istiod's identity)."""


@dataclass(slots=True)
class _Outgoing:
    response: Response
    names: list[str]
    cause: str


class Stream(Generic[C, E]):
    """One open stream: its client's watches, its request queue and its pending pushes."""

    def __init__(self, stream_id: int, flavour: Flavour, data: C, queue_size: int) -> None:
        self.id = stream_id
        self.flavour = flavour
        self.data = data
        """What the source returned from :meth:`Source.open`."""
        self.watches: dict[str, Watch] = {}
        self.last_error: str | None = None
        """The most recent NACK message on any type of this stream."""
        self.pending: dict[Hashable, E] = {}
        self.requests: asyncio.Queue[Request] = asyncio.Queue(queue_size)
        self.reader_done = False
        self.wake = asyncio.Event()
        self.done = asyncio.Event()
        """Set when the stream should end: the worker finished, or the server is closing."""
        self.tasks: list[asyncio.Task[None]] = []
        self.failure: StreamError | None = None

    def push(self, event: E, key: Hashable = None) -> None:
        """File ``event`` for the worker; never blocks. A pending event with the same key is replaced."""
        self.pending[key] = event
        self.wake.set()

    def watching(self, type_url: str, name: str) -> bool:
        watch = self.watches.get(type_url)
        return watch is not None and watch.wants(name)


class Source(Generic[C, E]):
    """What a server built on :class:`StreamServer` supplies; every method has a harmless default."""

    policy = Policy()
    control_plane: base_pb2.ControlPlane | None = None
    """Set on every response (istiod identifies itself this way)."""

    async def open(self, request: Request, call: Call, flavour: Flavour) -> C:
        """Accept a stream by its first request; raise StreamError (or abort ``call``) to refuse it."""
        raise NotImplementedError

    def opened(self, stream: Stream[C, E], request: Request) -> None:
        """The stream is registered (its first request is queued)."""

    def stream_policy(self, stream: Stream[C, E]) -> Policy:
        """The protocol rules for this stream: :attr:`policy` unless a client kind needs others."""
        return self.policy

    def closed(self, stream: Stream[C, E]) -> None:
        """The stream is gone; called before any await, so it runs even when the handler is cancelled."""

    def is_query(self, type_url: str) -> bool:
        """Whether requests of this type are queries: each answered by :meth:`answer`, never watched."""
        return False

    async def answer(self, stream: Stream[C, E], request: Request) -> Reply | None:
        """The answer to a query (None: nothing to send); raise StreamError to end the stream."""
        return None

    def watched_type(self, stream: Stream[C, E], type_url: str) -> str | None:
        """The type a request subscribes to or acknowledges, or None to drop the request."""
        return None

    async def resources(self, stream: Stream[C, E], type_url: str, names: Sequence[str] | None) -> Resources:
        """The resources of ``type_url`` among ``names`` (None: all of them), in the order to send them.

        Names that do not exist are left out; raise StreamError to end the stream instead.
        """
        return NO_RESOURCES

    def version(self, type_url: str, versions: Iterable[tuple[str, str]]) -> str:
        """The version of a response: SotW's ``version_info`` for the resources it carries, Delta's
        ``system_version_info`` for all the client holds after it (``versions``: (name, version) pairs,
        consumed only if needed)."""
        return ""

    def changes(self, stream: Stream[C, E], event: E) -> Iterable[Change]:
        """What a pushed event changed for this stream, in the order responses should go out."""
        return ()

    def sending(self, stream: Stream[C, E], response: Response, names: list[str], cause: str) -> None:
        """``response`` (carrying ``names``) is about to be written, so the client cannot see it before
        this returns (count it here); ``cause`` is "request", "push" or "query"."""

    def sent(self, stream: Stream[C, E], response: Response, names: list[str], cause: str) -> None:
        """``response`` was written (gRPC took it: time it here); not called when the client is gone."""

    def acked(self, stream: Stream[C, E], watch: Watch) -> None:
        """The client accepted the last response of ``watch``'s type."""

    def nacked(self, stream: Stream[C, E], request: Request, watch: Watch | None) -> None:
        """The client rejected a response: the last one of ``watch``'s type, or (None) an older one."""


class StreamServer(Generic[C, E]):
    """Serves the streams of one xDS service from a :class:`Source`; gRPC handlers call :meth:`serve`.

    Served on an :class:`RpcServer` (:meth:`add_to`).

    ``name`` prefixes log lines and task names; ``describe`` names the server in stream errors.
    """

    def __init__(
        self,
        source: Source[C, E],
        *,
        name: str,
        log: logging.Logger,
        describe: str,
        queue_size: int = REQUEST_QUEUE_SIZE,
    ) -> None:
        self._source = source
        self._name = name.lower()
        self._prefix = name.upper()
        self._log = log
        self._describe = describe
        self._queue_size = queue_size
        self._streams: dict[int, Stream[C, E]] = {}
        self._ids = itertools.count(1)
        self._closing = False

    def add_to(self, server: RpcServer, service: str, streams: Mapping[str, Flavour]) -> None:
        """Serve ``service``'s ``streams`` (method name -> flavour) on ``server``."""
        for method, flavour in streams.items():
            server.add_stream(
                f"/{service}/{method}",
                self._rpc_handler(flavour),
                flavour.request_type,
                flavour.response_type,
            )

    def _rpc_handler(self, flavour: Flavour) -> Callable[[ServerCall], Awaitable[None]]:
        async def serve(call: ServerCall) -> None:
            await self.serve(flavour, call)

        return serve

    @property
    def closing(self) -> bool:
        return self._closing

    def streams(self) -> list[Stream[C, E]]:
        """The open streams, oldest first."""
        return list(self._streams.values())

    def __len__(self) -> int:
        return len(self._streams)

    async def close(self) -> None:
        """End every stream with OK and wait until their tasks are gone; new streams are refused."""
        self._closing = True
        streams = list(self._streams.values())
        tasks = [task for stream in streams for task in stream.tasks]
        for stream in streams:
            stream.done.set()  # each handler returns, which ends its stream with OK
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- one stream ----------------------------------------------------------------------------------

    async def serve(self, flavour: Flavour, call: Call) -> None:
        """Serve one stream until the client is done, the server closes or the stream fails.

        Even a stream refused (the server closing, a bad first request) has its first request read
        first: grpcio's client reports a stream reset after its status as INTERNAL when the server
        had not read what the client was sending (seen with grpclib's reset, which HTTP/2 allows)."""
        iterator = aiter(call)
        try:
            first = await anext(iterator)
        except StopAsyncIteration:
            return
        try:
            data = await self._source.open(first, call, flavour)
        except StreamError as err:
            self._log.warning(
                "%s: %s stream from %s refused: %s", self._prefix, flavour.label, call.peer(), err.details
            )
            await call.abort(err.code, err.details)
        if self._closing:
            await call.abort(Status.UNAVAILABLE, f"{self._describe} is shutting down")

        stream: Stream[C, E] = Stream(next(self._ids), flavour, data, self._queue_size)
        stream.requests.put_nowait(first)
        stream.tasks = [
            asyncio.create_task(self._read(stream, iterator), name=f"{self._name}-reader-{stream.id}"),
            asyncio.create_task(self._work(stream, call), name=f"{self._name}-worker-{stream.id}"),
        ]
        stream.tasks[1].add_done_callback(lambda _: stream.done.set())
        self._streams[stream.id] = stream
        self._source.opened(stream, first)
        try:
            await stream.done.wait()
        finally:
            # Bookkeeping before any await: gRPC may cancel this handler again while it cleans up.
            del self._streams[stream.id]
            self._source.closed(stream)
            for task in stream.tasks:
                task.cancel()
            await asyncio.gather(*stream.tasks, return_exceptions=True)
        if stream.failure is not None:
            await call.abort(stream.failure.code, stream.failure.details)

    async def _read(self, stream: Stream[C, E], requests: AsyncIterator[Request]) -> None:
        try:
            async for request in requests:
                await stream.requests.put(request)
                stream.wake.set()
        except GRPCError as err:  # a message refused as it was read (too large, undecodable)
            self._log.warning("%s: stream %d: %s", self._prefix, stream.id, err.message)
            stream.failure = StreamError(err.status, err.message or "")
            stream.done.set()
        except READ_ERRORS as err:
            self._log.debug("%s: stream %d: read ended: %s", self._prefix, stream.id, err)
        finally:
            stream.reader_done = True
            stream.wake.set()

    async def _work(self, stream: Stream[C, E], call: Call) -> None:
        """The stream's only writer: requests first, then pending pushes, until the client is done."""
        while True:
            stream.wake.clear()
            try:
                if not stream.requests.empty():
                    outgoing = await self._on_request(stream, stream.requests.get_nowait())
                elif stream.pending:
                    key = next(iter(stream.pending))
                    outgoing = await self._on_push(stream, stream.pending.pop(key))
                elif stream.reader_done:
                    return
                else:
                    await stream.wake.wait()
                    continue
            except StreamError as failure:
                self._log.warning("%s: stream %d: %s", self._prefix, stream.id, failure.details)
                stream.failure = failure
                return
            except Exception:
                # A bug, not a client's doing: said once with its traceback; the other streams go on.
                self._log.exception("%s: stream %d: internal error", self._prefix, stream.id)
                stream.failure = StreamError(Status.INTERNAL, f"internal error in the {self._describe}")
                return
            for out in outgoing:
                self._source.sending(stream, out.response, out.names, out.cause)
                try:
                    await call.send(out.response)
                except CallEnded as err:  # the client is gone; the handler ends the stream
                    self._log.debug("%s: stream %d: write failed: %s", self._prefix, stream.id, err)
                    return
                self._source.sent(stream, out.response, out.names, out.cause)

    # -- requests ------------------------------------------------------------------------------------

    async def _on_request(self, stream: Stream[C, E], request: Request) -> list[_Outgoing]:
        source = self._source
        if source.is_query(request.type_url):
            return await self._on_query(stream, request)
        type_url = source.watched_type(stream, request.type_url)
        if type_url is None:
            return []
        rules = sotw_request if stream.flavour is SOTW else delta_request
        decision = rules(stream.watches, type_url, request, source.stream_policy(stream))
        self._note(stream, request, type_url, decision)
        if decision.send is None or decision.watch is None:
            return []
        out = await self._respond(
            stream, decision.watch, decision.send.names, "request", decision.send.always
        )
        return [out] if out is not None else []

    def _note(self, stream: Stream[C, E], request: Request, type_url: str, decision: Decision) -> None:
        """Tell the source about ACKs and NACKs; log what is ignored."""
        verdict = decision.verdict
        if verdict is Verdict.ACK and decision.watch is not None:
            self._source.acked(stream, decision.watch)
        elif verdict is Verdict.NACK:
            if decision.watch is not None:
                stream.last_error = decision.watch.error
            self._source.nacked(stream, request, decision.watch)
        elif verdict is Verdict.STALE:
            self._log.debug(
                "%s: stream %d: stale nonce %s for %s",
                self._prefix,
                stream.id,
                request.response_nonce,
                type_url,
            )
        elif verdict is Verdict.UNSUBSCRIBE and decision.watch is not None:
            self._log.debug("%s: stream %d: unsubscribed from %s", self._prefix, stream.id, type_url)

    async def _on_query(self, stream: Stream[C, E], request: Request) -> list[_Outgoing]:
        if request.response_nonce or request.HasField("error_detail"):
            return []  # the client acknowledging an answer: nothing to track
        reply = await self._source.answer(stream, request)
        if reply is None:
            return []
        response = stream.flavour.response(
            request.type_url,
            reply.resources,
            version=reply.version,
            nonce=new_nonce(),
            control_plane=reply.control_plane or self._source.control_plane,
        )
        return [_Outgoing(response, [r.name for r in reply.resources], "query")]

    # -- pushes --------------------------------------------------------------------------------------

    async def _on_push(self, stream: Stream[C, E], event: E) -> list[_Outgoing]:
        """A response for each watched type the event changed (in the source's order)."""
        outgoing = []
        for type_url, names in self._source.changes(stream, event):
            watch = stream.watches.get(type_url)
            if watch is None:
                continue
            if names is not None:
                names = [name for name in names if watch.wants(name)]
                if not names:
                    continue
            out = await self._respond(stream, watch, names, "push", always=False)
            if out is not None:
                outgoing.append(out)
        return outgoing

    # -- responses -----------------------------------------------------------------------------------

    async def _respond(
        self, stream: Stream[C, E], watch: Watch, names: Sequence[str] | None, cause: str, always: bool
    ) -> _Outgoing | None:
        if stream.flavour is SOTW:
            return await self._sotw(stream, watch, names, cause, only_if_changed=cause == "push")
        return await self._delta(stream, watch, names, cause, always=always)

    async def _sotw(
        self,
        stream: Stream[C, E],
        watch: Watch,
        names: Sequence[str] | None,
        cause: str,
        *,
        only_if_changed: bool,
    ) -> _Outgoing | None:
        """``names`` of the watch (None: all it wants; a wildcard watch always gets everything)."""
        if watch.wildcard:
            names = None
        elif names is None:
            names = list(watch.names)
        found = await self._source.resources(stream, watch.type_url, names)
        versions = found.versions
        version = self._source.version(watch.type_url, ((name, versions[name]) for name in found.names))
        if only_if_changed and watch.sent_nonce and version == watch.version:
            return None
        nonce = new_nonce()
        response = stream.flavour.response(
            watch.type_url,
            found.pick(found.names),
            version=version,
            nonce=nonce,
            control_plane=self._source.control_plane,
        )
        watch.sent(nonce, version, len(found.names))
        return _Outgoing(response, list(found.names), cause)

    async def _delta(
        self, stream: Stream[C, E], watch: Watch, names: Sequence[str] | None, cause: str, *, always: bool
    ) -> _Outgoing | None:
        """What changed among ``names`` (None: all the watch wants) since the client's versions."""
        if names is None and not watch.wildcard:
            names = list(watch.names)
        held = watch.client_versions
        found = NO_RESOURCES
        if names is None or names:
            found = await self._source.resources(stream, watch.type_url, names)
        versions = found.versions
        changed = [name for name in found.names if held.get(name) != versions[name]]
        candidates = held if names is None else [name for name in names if name in held]
        removed = sorted(name for name in candidates if name not in found.messages)
        if not (changed or removed or always):
            return None
        for name in changed:
            held[name] = versions[name]
        for name in removed:
            del held[name]
        version = self._source.version(watch.type_url, held.items())
        nonce = new_nonce()
        response = stream.flavour.response(
            watch.type_url,
            found.pick(changed),
            version=version,
            nonce=nonce,
            removed=removed,
            control_plane=self._source.control_plane,
        )
        watch.sent(nonce, version, len(held))
        return _Outgoing(response, changed, cause)
