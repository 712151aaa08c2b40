"""Envoy's SecretDiscoveryService on a Unix socket: serves workload certificates and trust bundles.

StreamSecrets follows Istio's state-of-the-world rules exactly
(``security/pkg/nodeagent/sds/sdsservice.go``; see docs/security.md), because Envoy's retry and
ACK behaviour was tuned against them. DeltaSecrets and FetchSecrets, which Istio leaves
unimplemented, are served too so that delta-xDS clients and one-shot tools work.

The streams run on the project's xDS stream core (:mod:`istio_agent.xds.stream`): each has one
worker that handles requests (through a small bounded queue, so a chatty client is back-pressured
by gRPC flow control) and pushes (one pending slot per secret name, so a burst of rotations
coalesces and memory stays bounded by the number of watched names) one at a time, requests first.
This module supplies what is SDS's own: secrets from the secret manager, Istio's version strings,
its metrics and log lines.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path

from envoy.extensions.transport_sockets.tls.v3 import secret_pb2
from envoy.service.discovery.v3 import discovery_pb2

from istio_agent import uds
from istio_agent.envoy import sockets
from istio_agent.log import scope
from istio_agent.metrics import Registry
from istio_agent.rpc import Status
from istio_agent.rpc.call import Call
from istio_agent.rpc.server import RpcServer
from istio_agent.security.model import ROOT_CERT, SecretError, SecretItem, SecretProvider
from istio_agent.xds.flavour import (
    DELTA,
    SOTW,
    Flavour,
    Request,
    Resources,
    Response,
    new_nonce,
    resource_version,
    unique,
)
from istio_agent.xds.stream import Change, Source, Stream, StreamError, StreamServer, require_node
from istio_agent.xds.watch import Policy, Watch

log = scope("sds")

SDS_SERVICE = "envoy.service.secret.v3.SecretDiscoveryService"
SECRET_TYPE_URL = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
FILE_ROOT_PREFIX = "file-root:"


def _version_time() -> str:
    """Local time in RFC 3339 (``Z`` for UTC, like Go's time.RFC3339)."""
    now = datetime.now().astimezone().replace(microsecond=0)
    if now.utcoffset() == UTC.utcoffset(None):
        return now.strftime("%Y-%m-%dT%H:%M:%SZ")
    return now.isoformat()


class _SdsMetrics:
    """The SDS server's metrics."""

    def __init__(self, registry: Registry) -> None:
        self.connections = registry.gauge("sds_connections", "Number of open SDS streams.")
        self.pushes = registry.counter(
            "sds_pushes", "SDS responses sent, by cause (request or push).", ["type"]
        )
        self.nacks = registry.counter("sds_nacks", "SDS responses rejected by the client (NACK).")
        self.errors = registry.counter(
            "sds_errors", "SDS streams ended because a secret could not be generated."
        )


class _Secrets(Source[None, str]):
    """SDS on the stream core: one Secret type whatever a request names; pushes are secret names."""

    policy = Policy(ack_sends_added_only=True)

    def __init__(self, provider: SecretProvider, crl_path: Path | None, metrics: _SdsMetrics) -> None:
        self._metrics = metrics
        self._provider = provider
        self._crl_path = crl_path
        self._versions = itertools.count(1)

    def next_version(self) -> str:
        """Istio's version string: local time and a process-wide counter, new for every response."""
        return f"{_version_time()}/{next(self._versions)}"

    # -- secrets -------------------------------------------------------------------------------------

    def _is_root(self, name: str, item: SecretItem) -> bool:
        if item.is_root:
            return True
        return (name == ROOT_CERT or name.startswith(FILE_ROOT_PREFIX)) and not item.private_key

    def to_secret(self, name: str, item: SecretItem) -> secret_pb2.Secret:
        """Envoy's Secret for ``item`` served under ``name`` (see docs/security.md)."""
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

    async def secrets(self, names: Iterable[str], *, versioned: bool = False) -> Resources:
        """The secrets ``names``, in order; StreamError (UNKNOWN) when one cannot be generated.

        ``versioned``: with content versions (Delta needs them; SotW versions whole responses).
        """
        secrets: dict[str, secret_pb2.Secret] = {}
        for name in names:
            try:
                item = await self._provider.generate(name)
            except SecretError as err:
                self._metrics.errors.inc()
                raise StreamError(Status.UNKNOWN, f"failed to generate secret for {name}: {err}") from err
            secrets[name] = self.to_secret(name, item)
        versions = {name: resource_version(secret) for name, secret in secrets.items()} if versioned else {}
        return Resources(list(secrets), secrets, versions)

    # -- the stream core's questions -----------------------------------------------------------------

    async def open(self, request: Request, call: Call, flavour: Flavour) -> None:
        require_node(request)

    def opened(self, stream: Stream[None, str], request: Request) -> None:
        self._metrics.connections.inc()
        names = stream.flavour.requested_names(request)
        log.info("SDS: new connection id=%d (%s) resources=%s", stream.id, stream.flavour.label, names)

    def closed(self, stream: Stream[None, str]) -> None:
        self._metrics.connections.dec()
        watch = stream.watches.get(SECRET_TYPE_URL)
        names = list(watch.names) if watch is not None else []
        log.info("SDS: connection closed id=%d resources=%s", stream.id, names)

    def watched_type(self, stream: Stream[None, str], type_url: str) -> str:
        # One watch per stream, whatever the request's type (as Istio's SDS server).
        if type_url and type_url != SECRET_TYPE_URL:
            log.debug("SDS: stream %d: type_url %r is not Secret; served anyway", stream.id, type_url)
        return SECRET_TYPE_URL

    async def resources(
        self, stream: Stream[None, str], type_url: str, names: Sequence[str] | None
    ) -> Resources:
        return await self.secrets(names or (), versioned=stream.flavour.delta)

    def version(self, type_url: str, versions: Iterable[tuple[str, str]]) -> str:
        return self.next_version()

    def changes(self, stream: Stream[None, str], event: str) -> Iterable[Change]:
        return [(SECRET_TYPE_URL, [event])]

    def sending(self, stream: Stream[None, str], response: Response, names: list[str], cause: str) -> None:
        self._metrics.pushes.labels(type=cause).inc()
        if stream.flavour is SOTW:
            log.debug(
                "SDS: stream %d: sent %s (%s) version %s", stream.id, names, cause, response.version_info
            )
        else:
            log.debug("SDS: delta stream %d: sent %s (%s)", stream.id, names, cause)

    def nacked(self, stream: Stream[None, str], request: Request, watch: Watch | None) -> None:
        self._metrics.nacks.inc()
        message = request.error_detail.message
        if isinstance(request, discovery_pb2.DiscoveryRequest):
            names = unique(request.resource_names)
            log.warning(
                "SDS: stream %d: NACK for %s (nonce %s): %s",
                stream.id,
                names,
                request.response_nonce,
                message,
            )
        else:
            log.warning(
                "SDS: stream %d: delta NACK (nonce %s): %s", stream.id, request.response_nonce, message
            )


class SdsServer:
    """gRPC SecretDiscoveryService on ``socket_path``, backed by a SecretProvider.

    Register ``on_secret_update`` as the secret manager's update callback so rotations reach Envoy.
    """

    def __init__(
        self,
        provider: SecretProvider,
        socket_path: Path,
        *,
        crl_path: Path | None = None,
        registry: Registry,
        limits: uds.ServerLimits | None = None,
        listener: sockets.Listener | None = None,
    ) -> None:
        """``limits``: how long connections that do nothing are kept (``uds.ServerLimits``' defaults).

        ``listener``: the socket, already listening (bound before Envoy started, with its own limits);
        without one, ``start`` binds ``socket_path``.
        """
        self._socket_path = listener.path if listener is not None else socket_path
        self._limits = limits or uds.ServerLimits()
        self._listener = listener
        self._metrics = _SdsMetrics(registry)
        self._secrets = _Secrets(provider, crl_path, self._metrics)
        self._streams: StreamServer[None, str] = StreamServer(
            self._secrets, name="sds", log=log, describe="SDS server"
        )
        self._server: RpcServer | None = None

    @property
    def socket_path(self) -> Path:
        return self._socket_path

    @property
    def stream_count(self) -> int:
        return len(self._streams)

    async def start(self) -> None:
        """Serve on the listener, or bind the socket (replacing any old file, open to every local user) and serve."""
        if self._server is not None:
            raise RuntimeError("SDS server already started")
        listener, self._listener = self._listener, None
        if listener is None:
            listener = await sockets.listen_sds(self._socket_path)
        server = RpcServer(limits=self._limits, max_concurrent_streams=sockets.SDS_MAX_CONCURRENT_STREAMS)
        self._streams.add_to(server, SDS_SERVICE, {"StreamSecrets": SOTW, "DeltaSecrets": DELTA})
        server.add_unary(
            f"/{SDS_SERVICE}/FetchSecrets",
            self.fetch,
            discovery_pb2.DiscoveryRequest,
            discovery_pb2.DiscoveryResponse,
        )
        await server.start(sock=listener.take())
        self._server = server
        log.info("SDS server listening on %s", self._socket_path)

    async def stop(self, grace: float | None = 0.5) -> None:
        """Stop serving; open streams are closed after ``grace`` seconds, then the socket file removed."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace)
            self._socket_path.unlink(missing_ok=True)  # as Go's listener (and grpcio) remove theirs
            log.info("SDS server stopped")

    def on_secret_update(self, resource_name: str) -> None:
        """Fan a changed secret out to every open stream watching it (repeated pushes of a name coalesce)."""
        for stream in self._streams.streams():
            if stream.watching(SECRET_TYPE_URL, resource_name):
                stream.push(resource_name, key=resource_name)

    # --- FetchSecrets ---------------------------------------------------------------------------

    async def fetch(
        self, request: discovery_pb2.DiscoveryRequest, call: Call
    ) -> discovery_pb2.DiscoveryResponse:
        """One SotW response for every name asked for; no node needed, nothing watched."""
        if request.type_url and request.type_url != SECRET_TYPE_URL:
            log.debug("SDS: fetch with unexpected type_url %r, answered as Secret", request.type_url)
        try:
            resources = await self._secrets.secrets(unique(request.resource_names))
        except StreamError as err:
            log.warning("SDS: fetch: %s", err.details)
            await call.abort(err.code, err.details)
        response = SOTW.response(
            SECRET_TYPE_URL,
            resources.pick(resources.names),
            version=self._secrets.next_version(),
            nonce=new_nonce(),
        )
        self._metrics.pushes.labels(type="request").inc()
        return response
