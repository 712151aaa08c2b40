"""Envoy's SecretDiscoveryService on a Unix socket: serves workload certificates and trust bundles.

StreamSecrets follows Istio's state-of-the-world rules exactly (see the reference, sds.md 2.2),
because Envoy's retry and ACK behaviour was tuned against them. DeltaSecrets and FetchSecrets,
which Istio leaves unimplemented, are served too so that delta-xDS clients and one-shot tools work.

Each stream has one consumer coroutine: requests (through a small bounded queue, so a chatty
client is back-pressured by gRPC flow control) and pushes (a set of pending names, so a burst of
rotations coalesces and memory stays bounded by the number of watched names) are handled one at
a time, requests first.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Generic, TypeVar

import grpc
from envoy.extensions.transport_sockets.tls.v3 import secret_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.secret.v3 import sds_pb2_grpc
from google.protobuf import any_pb2

from istio_agent import metrics
from istio_agent.log import scope
from istio_agent.security import uds
from istio_agent.security.model import ROOT_CERT, SecretItem, SecretProvider

log = scope("sds")

SECRET_TYPE_URL = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
FILE_ROOT_PREFIX = "file-root:"
MAX_CONCURRENT_STREAMS = 100000
REQUEST_QUEUE_SIZE = 8

sds_connections = metrics.gauge("sds_connections", "Number of open SDS streams.")
sds_pushes = metrics.counter("sds_pushes", "SDS responses sent, by cause (request or push).", ["type"])
sds_nacks = metrics.counter("sds_nacks", "SDS responses rejected by the client (NACK).")
sds_errors = metrics.counter("sds_errors", "SDS streams ended because a secret could not be generated.")

RequestT = TypeVar("RequestT")


class _GenerateError(Exception):
    """A requested secret could not be produced; ends the stream with status UNKNOWN."""


class _EndOfRequests:
    """Queue marker: the client half-closed the stream."""


_EOF = _EndOfRequests()


class _Stream(ABC, Generic[RequestT]):
    """Per-stream state shared by the SotW and Delta protocols: queued requests and pending pushes."""

    def __init__(self, stream_id: int) -> None:
        self.id = stream_id
        self.requests: asyncio.Queue[RequestT | _EndOfRequests] = asyncio.Queue(REQUEST_QUEUE_SIZE)
        self.pending_pushes: dict[str, None] = {}
        self.wake = asyncio.Event()
        self.opened = False
        self.last_nonce = ""

    @abstractmethod
    def watching(self, name: str) -> bool:
        """Whether a push of ``name`` concerns this stream."""

    @abstractmethod
    def watched_names(self) -> list[str]: ...

    def notify(self, name: str) -> None:
        """Queue a push of ``name`` if watched; never blocks (repeated pushes of a name coalesce)."""
        if self.watching(name):
            self.pending_pushes[name] = None
            self.wake.set()


class _SotwStream(_Stream[discovery_pb2.DiscoveryRequest]):
    def __init__(self, stream_id: int) -> None:
        super().__init__(stream_id)
        self.watch: list[str] | None = None

    def watching(self, name: str) -> bool:
        return self.watch is not None and name in self.watch

    def watched_names(self) -> list[str]:
        return list(self.watch or ())


class _DeltaStream(_Stream[discovery_pb2.DeltaDiscoveryRequest]):
    def __init__(self, stream_id: int) -> None:
        super().__init__(stream_id)
        self.subscribed: dict[str, str] = {}
        """Subscribed name -> version last sent ("" until sent)."""

    def watching(self, name: str) -> bool:
        return name in self.subscribed

    def watched_names(self) -> list[str]:
        return list(self.subscribed)


def _unique(names: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(names))


def _version_time() -> str:
    """Local time in RFC 3339 (``Z`` for UTC, like Go's time.RFC3339)."""
    now = datetime.now().astimezone().replace(microsecond=0)
    if now.utcoffset() == UTC.utcoffset(None):
        return now.strftime("%Y-%m-%dT%H:%M:%SZ")
    return now.isoformat()


class SdsServer:
    """gRPC SecretDiscoveryService on ``socket_path``, backed by a SecretProvider.

    Register ``on_secret_update`` as the secret manager's update callback so rotations reach Envoy.
    """

    def __init__(self, provider: SecretProvider, socket_path: Path, *, crl_path: Path | None = None) -> None:
        self._provider = provider
        self._socket_path = socket_path
        self._crl_path = crl_path
        self._server: grpc.aio.Server | None = None
        self._streams: dict[int, _Stream[Any]] = {}
        self._stream_ids = itertools.count(1)
        self._versions = itertools.count(1)

    @property
    def socket_path(self) -> Path:
        return self._socket_path

    @property
    def stream_count(self) -> int:
        return len(self._streams)

    async def start(self) -> None:
        """Bind the socket (replacing any old file), start serving, open it to every local user."""
        if self._server is not None:
            raise RuntimeError("SDS server already started")
        uds.prepare_socket_path(self._socket_path)
        server = grpc.aio.server(options=[("grpc.max_concurrent_streams", MAX_CONCURRENT_STREAMS)])
        sds_pb2_grpc.add_SecretDiscoveryServiceServicer_to_server(_Servicer(self), server)
        try:
            server.add_insecure_port(f"unix:{self._socket_path}")
            await server.start()
        except Exception as err:
            await server.stop(None)
            raise OSError(f"SDS server could not listen on {self._socket_path}: {err}") from err
        self._server = server
        uds.make_socket_accessible(self._socket_path)
        log.info("SDS server listening on %s", self._socket_path)

    async def stop(self, grace: float | None = 0.5) -> None:
        """Stop serving; open streams are closed after ``grace`` seconds. The socket file is left."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace)
            log.info("SDS server stopped")

    def on_secret_update(self, resource_name: str) -> None:
        """Fan a changed secret out to every open stream; streams not watching it ignore it."""
        for stream in list(self._streams.values()):
            stream.notify(resource_name)

    # --- building responses -------------------------------------------------------------------

    def _next_version(self) -> str:
        return f"{_version_time()}/{next(self._versions)}"

    def _is_root(self, name: str, item: SecretItem) -> bool:
        if item.is_root:
            return True
        return (name == ROOT_CERT or name.startswith(FILE_ROOT_PREFIX)) and not item.private_key

    def to_secret(self, name: str, item: SecretItem) -> secret_pb2.Secret:
        """Envoy's Secret for ``item`` served under ``name`` (sds.md 2.3)."""
        secret = secret_pb2.Secret(name=name)
        if self._is_root(name, item):
            context = secret.validation_context
            context.trusted_ca.inline_bytes = item.root_cert
            if self._crl_path is not None and self._crl_path.exists():
                context.crl.filename = str(self._crl_path)
        else:
            certificate = secret.tls_certificate
            certificate.certificate_chain.inline_bytes = item.certificate_chain
            certificate.private_key.inline_bytes = item.private_key
        return secret

    async def _generate(self, name: str) -> secret_pb2.Secret:
        try:
            return self.to_secret(name, await self._provider.generate(name))
        except asyncio.CancelledError:
            raise
        except Exception as err:
            sds_errors.inc()
            raise _GenerateError(f"failed to generate secret for {name}: {err}") from err

    async def _resources(self, names: list[str]) -> list[any_pb2.Any]:
        resources = []
        for name in names:
            resource = any_pb2.Any()
            resource.Pack(await self._generate(name))
            resources.append(resource)
        return resources

    async def _discovery_response(self, names: list[str]) -> discovery_pb2.DiscoveryResponse:
        return discovery_pb2.DiscoveryResponse(
            version_info=self._next_version(),
            resources=await self._resources(names),
            type_url=SECRET_TYPE_URL,
            nonce=str(uuid.uuid4()),
        )

    # --- stream plumbing ----------------------------------------------------------------------

    async def _run_stream(
        self,
        stream: _Stream[RequestT],
        kind: str,
        request_iterator: AsyncIterator[RequestT],
        context: grpc.aio.ServicerContext,
    ) -> None:
        """Consume requests and pushes of one stream serially until the client goes away."""
        self._streams[stream.id] = stream
        sds_connections.inc()
        reader = asyncio.create_task(self._read(stream, request_iterator), name=f"sds-reader-{stream.id}")
        try:
            while True:
                stream.wake.clear()
                if not stream.requests.empty():
                    request = stream.requests.get_nowait()
                    if isinstance(request, _EndOfRequests):
                        break
                    await self._handle(stream, kind, request, context)
                elif stream.pending_pushes:
                    name = next(iter(stream.pending_pushes))
                    del stream.pending_pushes[name]
                    if stream.watching(name):
                        await self._handle_push(stream, name, context)
                elif reader.done():
                    break
                else:
                    await stream.wake.wait()
        except _GenerateError as err:
            log.warning("SDS: stream %d: %s", stream.id, err)
            await context.abort(grpc.StatusCode.UNKNOWN, str(err))
        finally:
            reader.cancel()
            del self._streams[stream.id]
            sds_connections.dec()
            if stream.opened:
                log.info("SDS: connection closed id=%d resources=%s", stream.id, stream.watched_names())
            else:
                log.debug("SDS: stream %d closed before a valid request", stream.id)

    async def _read(self, stream: _Stream[RequestT], request_iterator: AsyncIterator[RequestT]) -> None:
        try:
            async for request in request_iterator:
                await stream.requests.put(request)
                stream.wake.set()
        except asyncio.CancelledError:
            raise
        except Exception as err:
            log.debug("SDS: stream %d read ended: %s", stream.id, err)
        else:
            await stream.requests.put(_EOF)
        finally:
            stream.wake.set()

    async def _handle(
        self, stream: _Stream[Any], kind: str, request: Any, context: grpc.aio.ServicerContext
    ) -> None:
        first = not stream.opened
        if first:
            if not (request.HasField("node") and request.node.id):
                log.warning("SDS: stream %d: missing node information", stream.id)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "missing node information")
            stream.opened = True
            requested = (
                request.resource_names_subscribe
                if isinstance(stream, _DeltaStream)
                else request.resource_names
            )
            log.info("SDS: new connection id=%d (%s) resources=%s", stream.id, kind, list(requested))
        if request.type_url and request.type_url != SECRET_TYPE_URL:
            log.debug("SDS: stream %d: type_url %r is not Secret; served anyway", stream.id, request.type_url)
        if isinstance(stream, _SotwStream):
            await self._handle_sotw(stream, request, context)
        elif isinstance(stream, _DeltaStream):
            await self._handle_delta(stream, request, context, first=first)

    async def _handle_push(self, stream: _Stream[Any], name: str, context: grpc.aio.ServicerContext) -> None:
        if isinstance(stream, _SotwStream):
            await self._send_sotw(stream, [name], context, "push")
        elif isinstance(stream, _DeltaStream):
            await self._send_delta(stream, [name], context, "push", only_changed=True)

    # --- state of the world -------------------------------------------------------------------

    async def _handle_sotw(
        self, stream: _SotwStream, request: discovery_pb2.DiscoveryRequest, context: grpc.aio.ServicerContext
    ) -> None:
        names = _unique(request.resource_names)
        if request.HasField("error_detail"):
            sds_nacks.inc()
            log.warning(
                "SDS: stream %d: NACK for %s (nonce %s): %s",
                stream.id,
                names,
                request.response_nonce,
                request.error_detail.message,
            )
            return
        if not names:
            log.debug("SDS: stream %d: unsubscribed", stream.id)
            stream.watch = None
            return
        if not request.response_nonce or stream.watch is None:
            stream.watch = names
            await self._send_sotw(stream, names, context, "request")
            return
        if request.response_nonce != stream.last_nonce:
            log.debug("SDS: stream %d: ignoring stale nonce %s", stream.id, request.response_nonce)
            return
        previous = set(stream.watch)
        stream.watch = names
        added = [name for name in names if name not in previous]
        if added:
            await self._send_sotw(stream, added, context, "request")

    async def _send_sotw(
        self, stream: _SotwStream, names: list[str], context: grpc.aio.ServicerContext, cause: str
    ) -> None:
        response = await self._discovery_response(names)
        await context.write(response)
        stream.last_nonce = response.nonce
        sds_pushes.labels(type=cause).inc()
        log.debug("SDS: stream %d: sent %s (%s) version %s", stream.id, names, cause, response.version_info)

    # --- delta --------------------------------------------------------------------------------

    async def _handle_delta(
        self,
        stream: _DeltaStream,
        request: discovery_pb2.DeltaDiscoveryRequest,
        context: grpc.aio.ServicerContext,
        *,
        first: bool,
    ) -> None:
        if request.response_nonce and request.HasField("error_detail"):
            sds_nacks.inc()
            log.warning(
                "SDS: stream %d: delta NACK (nonce %s): %s",
                stream.id,
                request.response_nonce,
                request.error_detail.message,
            )
        elif request.response_nonce and request.response_nonce != stream.last_nonce:
            log.debug("SDS: stream %d: stale delta nonce %s", stream.id, request.response_nonce)
        for name in request.resource_names_unsubscribe:
            stream.subscribed.pop(name, None)
        # Versions the client already holds matter only when the stream (re)starts.
        known: dict[str, str] = dict(request.initial_resource_versions) if first else {}
        wanted = []
        for name in _unique([*request.resource_names_subscribe, *known]):
            if name == "*":
                log.debug("SDS: stream %d: wildcard subscription ignored", stream.id)
                continue
            stream.subscribed[name] = known.get(name, "")
            wanted.append(name)
        if wanted:
            await self._send_delta(stream, wanted, context, "request", only_changed=bool(known))

    async def _send_delta(
        self,
        stream: _DeltaStream,
        names: list[str],
        context: grpc.aio.ServicerContext,
        cause: str,
        *,
        only_changed: bool,
    ) -> None:
        """Send ``names``; with ``only_changed`` skip those whose content the client already has."""
        resources = []
        for name in names:
            secret = await self._generate(name)
            version = hashlib.sha256(secret.SerializeToString(deterministic=True)).hexdigest()[:16]
            if only_changed and stream.subscribed.get(name) == version:
                continue
            resource = discovery_pb2.Resource(name=name, version=version)
            resource.resource.Pack(secret)
            resources.append(resource)
        if not resources:
            return
        response = discovery_pb2.DeltaDiscoveryResponse(
            system_version_info=self._next_version(),
            resources=resources,
            type_url=SECRET_TYPE_URL,
            nonce=str(uuid.uuid4()),
        )
        await context.write(response)
        stream.last_nonce = response.nonce
        for resource in resources:
            if resource.name in stream.subscribed:
                stream.subscribed[resource.name] = resource.version
        sds_pushes.labels(type=cause).inc()
        log.debug("SDS: delta stream %d: sent %s (%s)", stream.id, [r.name for r in resources], cause)

    # --- RPC entry points -----------------------------------------------------------------------

    async def _stream_secrets(
        self,
        request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        await self._run_stream(_SotwStream(next(self._stream_ids)), "sotw", request_iterator, context)

    async def _delta_secrets(
        self,
        request_iterator: AsyncIterator[discovery_pb2.DeltaDiscoveryRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        await self._run_stream(_DeltaStream(next(self._stream_ids)), "delta", request_iterator, context)

    async def _fetch_secrets(
        self, request: discovery_pb2.DiscoveryRequest, context: grpc.aio.ServicerContext
    ) -> discovery_pb2.DiscoveryResponse:
        names = _unique(request.resource_names)
        if request.type_url and request.type_url != SECRET_TYPE_URL:
            log.debug("SDS: fetch with unexpected type_url %r, answered as Secret", request.type_url)
        try:
            response = await self._discovery_response(names)
        except _GenerateError as err:
            log.warning("SDS: fetch: %s", err)
            await context.abort(grpc.StatusCode.UNKNOWN, str(err))
            raise  # abort raises; this keeps type checkers aware of it
        sds_pushes.labels(type="request").inc()
        return response


class _Servicer(sds_pb2_grpc.SecretDiscoveryServiceServicer):
    """Adapter from the generated service base class to SdsServer."""

    def __init__(self, server: SdsServer) -> None:
        self._server = server

    async def StreamSecrets(
        self,
        request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        await self._server._stream_secrets(request_iterator, context)

    async def DeltaSecrets(
        self,
        request_iterator: AsyncIterator[discovery_pb2.DeltaDiscoveryRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        await self._server._delta_secrets(request_iterator, context)

    async def FetchSecrets(
        self, request: discovery_pb2.DiscoveryRequest, context: grpc.aio.ServicerContext
    ) -> discovery_pb2.DiscoveryResponse:
        return await self._server._fetch_secrets(request, context)
