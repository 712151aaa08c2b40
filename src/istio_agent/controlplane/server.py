"""The local control plane process: Istio's CA service and ADS on a plaintext and a TLS port, like istiod.

Port layout mirrors istiod: 15010 plaintext, 15012 TLS with a serving certificate from our own CA,
so an agent pointed at either verifies and authenticates exactly as it would against istiod.

Both ports are the agent's gRPC server (:class:`~istio_agent.rpc.server.RpcServer`). The TLS one
terminates TLS itself with ``CERT_OPTIONAL``: istiod asks for a client certificate but does not
require one (token-only and certificate-only callers share the port), and each call reads the
verified certificate of its own connection (``Call.peer_certificate``). Both servers get every
service: the CA, ADS (:mod:`.ads`, fed by :mod:`.xdsgen` from the mesh file) and whatever
:meth:`ControlPlane.add_servicer_hook` adds.

ADS authentication follows istiod: on the TLS port the caller must prove an identity (token or
client certificate) that is the proxy's namespace and service account; the plaintext port, like
istiod's 15010, does not ask.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import math
import os
import socket
import ssl
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NoReturn

from cryptography import x509
from cryptography.exceptions import InvalidSignature

from istio_agent.config.xds import DEFAULT_KEEPALIVE_INTERVAL, DEFAULT_KEEPALIVE_TIMEOUT
from istio_agent.controlplane import DEFAULT_ADDRESS, DEFAULT_SECURE_ADDRESS
from istio_agent.controlplane.ads import AdsServer, PushObserver
from istio_agent.controlplane.ca import ROOT_CERT_FILE, InvalidCSR, LocalCA, SigningRefused
from istio_agent.controlplane.debug import DebugAccess, spiffe_namespace_account
from istio_agent.controlplane.mesh import MeshConfig, MeshError, parse_mesh, read_mesh_bytes
from istio_agent.controlplane.tokens import TokenError, TokenVerifier
from istio_agent.controlplane.xdsgen import ProxyNode, build_snapshot
from istio_agent.filewatch import FileWatcher
from istio_agent.http.listen import listening_socket
from istio_agent.log import report_failure, scope
from istio_agent.metrics import Registry
from istio_agent.protos import istio_ca_pb2
from istio_agent.rpc import Status
from istio_agent.rpc.call import Call
from istio_agent.rpc.server import RpcServer
from istio_agent.uds import ServerLimits

log = scope("controlplane")

SERVING_HOSTS = ("istiod.istio-system.svc", "istiod.istio-system", "istiod", "localhost")
DEFAULT_CERT_TTL = timedelta(hours=24)
MAX_CERT_TTL_SECONDS = 90 * 24 * 3600
AUTH_FAILURE = "request authenticate failure"
CREATE_CERTIFICATE = "/istio.v1.auth.IstioCertificateService/CreateCertificate"
MAX_CONCURRENT_STREAMS = 100_000
"""Per connection, istiod's default (``ISTIO_GPRC_MAXSTREAMS``, ``pilot/pkg/features/tuning.go``)."""
_MESH_DEBOUNCE = timedelta(milliseconds=50)


ServerHook = Callable[[RpcServer], None]
"""Adds methods to a gRPC server; called once for the plaintext and once for the TLS server."""
MeshListener = Callable[[MeshConfig], Awaitable[None] | None]
"""Called with each newly applied mesh config (not for the initial one, read it from ``mesh``)."""


class _PlaneMetrics:
    """The local control plane's CA metrics."""

    def __init__(self, registry: Registry) -> None:
        self.signed = registry.counter(
            "controlplane_certificates_signed", "Workload certificates signed by the local control plane CA."
        )
        self.refused = registry.counter(
            "controlplane_certificate_requests_failed",
            "CreateCertificate calls the local control plane refused, by gRPC status code.",
            ["code"],
        )


class ControlPlaneError(Exception):
    """The control plane cannot start (bad address, port in use); the message says which and why."""


class AuthenticationError(Exception):
    """The caller proved no identity; ``reason`` lists what was tried (never the token itself)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Caller:
    """An authenticated caller: its SPIFFE identity and how it proved it."""

    identity: str
    method: str  # "token" or "client certificate"


def parse_address(text: str) -> tuple[str, int]:
    """Split ``host:port`` / ``[v6]:port`` (empty host = all interfaces); ValueError when invalid."""
    host, sep, port_text = text.strip().rpartition(":")
    if not sep or not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError(f"invalid address {text!r}: expected HOST:PORT (port 0 picks a free port)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"invalid address {text!r}: write IPv6 hosts in brackets, e.g. [::1]:15010")
    return host or "0.0.0.0", int(port_text)


def format_address(host: str, port: int) -> str:
    """``host:port``, bracketing IPv6 hosts."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (no SO_REUSEPORT: a second control plane fails to bind)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise ControlPlaneError(f"cannot listen on {format_address(host, port)}: {err.strerror}") from None
    try:
        return listening_socket(str(infos[0][4][0]), port)
    except OSError as err:
        reason = os.strerror(err.errno) if err.errno else str(err)
        raise ControlPlaneError(f"cannot listen on {format_address(host, port)}: {reason}") from None


def _bearer_token(metadata: Sequence[Any] | None) -> str | None:
    """The token of the first ``authorization`` header, ``""`` when it is not a bearer token."""
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
            scheme, _, token = text.strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


def _metadata_value(metadata: Sequence[Any] | None, name: str) -> str:
    for key, value in metadata or ():
        if key == name:
            return value.decode("latin-1") if isinstance(value, bytes) else str(value)
    return ""


def certificate_identity(cert: x509.Certificate, root: x509.Certificate) -> str:
    """The SPIFFE identity of a client certificate issued by ``root``; ValueError saying why not."""
    try:
        cert.verify_directly_issued_by(root)
    except (ValueError, TypeError, InvalidSignature):
        raise ValueError("not issued by this control plane's CA") from None
    now = datetime.now(UTC)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise ValueError("expired or not yet valid")
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (x509.ExtensionNotFound, ValueError):
        raise ValueError("has no URI SAN") from None
    uris = [
        uri for uri in san.get_values_for_type(x509.UniformResourceIdentifier) if uri.startswith("spiffe://")
    ]
    if len(uris) != 1:
        raise ValueError(f"must have exactly one spiffe:// URI SAN, has {len(uris)}")
    return uris[0]


class _CertificateService:
    """``istio.v1.auth.IstioCertificateService``: authenticate the caller, sign its CSR."""

    def __init__(self, plane: ControlPlane) -> None:
        self._plane = plane

    def add_to(self, server: RpcServer) -> None:
        server.add_unary(
            CREATE_CERTIFICATE,
            self.create_certificate,
            istio_ca_pb2.IstioCertificateRequest,
            istio_ca_pb2.IstioCertificateResponse,
        )

    async def create_certificate(
        self, request: istio_ca_pb2.IstioCertificateRequest, call: Call
    ) -> istio_ca_pb2.IstioCertificateResponse:
        try:
            caller = self._plane.authenticate(call)
        except AuthenticationError as err:
            log.warning("certificate request from %s refused: %s: %s", call.peer(), AUTH_FAILURE, err.reason)
            await self._abort(call, Status.UNAUTHENTICATED, f"{AUTH_FAILURE}: {err.reason}")
        seconds = request.validity_duration
        ttl = DEFAULT_CERT_TTL if seconds <= 0 else timedelta(seconds=min(seconds, MAX_CERT_TTL_SECONDS))
        try:
            chain = self._plane.ca.sign_csr(request.csr.encode("utf-8"), caller.identity, ttl)
        except InvalidCSR as err:
            log.warning("certificate request from %s refused: %s", caller.identity, err.reason)
            await self._abort(call, Status.INVALID_ARGUMENT, err.reason)
        except SigningRefused as err:
            log.warning("certificate request from %s refused: %s", caller.identity, err.reason)
            await self._abort(call, Status.PERMISSION_DENIED, err.reason)
        self._plane.metrics.signed.inc()
        cluster = _metadata_value(call.metadata(), "clusterid")
        log.info(
            "signed certificate for %s (authenticated by %s, ttl %ds%s)",
            caller.identity,
            caller.method,
            ttl.total_seconds(),
            f", cluster {cluster[:64]!r}" if cluster else "",
        )
        return istio_ca_pb2.IstioCertificateResponse(cert_chain=chain)

    async def _abort(self, call: Call, code: Status, details: str) -> NoReturn:
        self._plane.metrics.refused.labels(code=code.name).inc()
        await call.abort(code, details)


class ControlPlane:
    """The local control plane: CA service on ``address`` (plaintext) and ``secure_address`` (TLS).

    Extension points for the ADS side: :meth:`add_servicer_hook` (add methods to both gRPC
    servers), :meth:`add_mesh_listener` (hear about reloads), :attr:`mesh` and :meth:`authenticate`.
    """

    def __init__(
        self,
        mesh_path: Path,
        state_dir: Path,
        address: str = DEFAULT_ADDRESS,
        secure_address: str = DEFAULT_SECURE_ADDRESS,
        *,
        push_observer: PushObserver | None = None,
        registry: Registry,
        keepalive_interval: timedelta = DEFAULT_KEEPALIVE_INTERVAL,
        keepalive_timeout: timedelta = DEFAULT_KEEPALIVE_TIMEOUT,
        debug_access: DebugAccess | None = None,
    ) -> None:
        """``keepalive_interval`` / ``keepalive_timeout``: istiod's ``--keepaliveInterval`` and
        ``--keepaliveTimeout``; clients may ping down to half the interval, as istiod allows.
        ``debug_access``: who may ask syncz and config_dump (default: istiod's defaults)."""
        self._debug_access = debug_access
        self._mesh_path = mesh_path
        # istiod's servers (pilot/pkg/grpc/grpc.go ServerOptions) ping every interval, accept
        # clients' pings down to half of it, and close no connection for being idle.
        self._limits = ServerLimits(
            idle_timeout=math.inf,
            keepalive_time=keepalive_interval.total_seconds(),
            keepalive_timeout=keepalive_timeout.total_seconds(),
        )
        self._registry = registry
        self.metrics = _PlaneMetrics(registry)
        self._push_observer = push_observer
        self._ads: AdsServer | None = None
        self._state_dir = state_dir
        self._address = address
        self._secure_address = secure_address
        self._hooks: list[ServerHook] = []
        self._mesh_listeners: list[MeshListener] = []
        self._mesh: MeshConfig | None = None
        self._mesh_bytes: bytes | None = None
        self._ca: LocalCA | None = None
        self._verifier: TokenVerifier | None = None
        self._servers: list[RpcServer] = []
        self._port: int | None = None
        self._secure_port: int | None = None
        self._watcher: FileWatcher | None = None
        self._reload: asyncio.Task[None] | None = None
        self._reload_again = False
        self._started = False

    # -- extension points -------------------------------------------------------------------

    def add_servicer_hook(self, hook: ServerHook) -> None:
        """Have ``hook(server)`` add methods to both gRPC servers; call before :meth:`start`."""
        if self._started:
            raise RuntimeError("add_servicer_hook must be called before start()")
        self._hooks.append(hook)

    def add_mesh_listener(self, listener: MeshListener) -> None:
        """Call ``listener(config)`` after each successful mesh reload (errors in it are logged)."""
        self._mesh_listeners.append(listener)

    @property
    def mesh(self) -> MeshConfig:
        if self._mesh is None:
            raise RuntimeError("control plane not started")
        return self._mesh

    @property
    def ca(self) -> LocalCA:
        if self._ca is None:
            raise RuntimeError("control plane not started")
        return self._ca

    @property
    def ads(self) -> AdsServer:
        if self._ads is None:
            raise RuntimeError("control plane not started")
        return self._ads

    @property
    def root_cert_path(self) -> Path:
        return self._state_dir / ROOT_CERT_FILE

    @property
    def port(self) -> int:
        """The bound plaintext port (useful with port 0)."""
        if self._port is None:
            raise RuntimeError("control plane not started")
        return self._port

    @property
    def secure_port(self) -> int:
        """The bound TLS port (useful with port 0)."""
        if self._secure_port is None:
            raise RuntimeError("control plane not started")
        return self._secure_port

    def peer_certificate(self, call: Call) -> x509.Certificate | None:
        """The TLS client certificate the caller's connection presented (verified in the handshake)."""
        der = call.peer_certificate()
        try:
            return x509.load_der_x509_certificate(der) if der else None
        except ValueError:
            return None

    def authenticate(self, call: Call) -> Caller:
        """Who is calling: a bearer token first, then a client certificate (as istiod tries both)."""
        failures: list[str] = []
        token = _bearer_token(call.metadata())
        if token == "":
            failures.append("authorization header is not a bearer token")
        elif token is not None:
            try:
                identity = self._token_verifier.verify(token)
                return Caller(identity.spiffe_id(self.mesh.trust_domain), "token")
            except TokenError as err:
                failures.append(err.reason)
        cert = self.peer_certificate(call)
        if cert is not None:
            try:
                return Caller(certificate_identity(cert, self.ca.root_cert), "client certificate")
            except ValueError as err:
                failures.append(f"client certificate {err}")
        if not failures:
            failures.append("no bearer token and no client certificate")
        raise AuthenticationError("; ".join(failures))

    async def authorize_proxy(self, call: Call, proxy: ProxyNode) -> str:
        """ADS admission on the TLS port, as istiod's: an authenticated caller whose identity is the
        proxy's namespace and service account (see :meth:`admission_refusal`). Returns that identity.
        The plaintext port, like istiod's 15010, does not ask (its ADS is added without it)."""
        try:
            caller = self.authenticate(call)
        except AuthenticationError as err:
            await call.abort(Status.UNAUTHENTICATED, f"authentication failure: {err.reason}")
        refusal = self.admission_refusal(caller.identity, proxy)
        if refusal is not None:
            log.warning("Unauthorized XDS: %s with identity [%s]: %s", call.peer(), caller.identity, refusal)
            await call.abort(Status.PERMISSION_DENIED, f"authorization failed: {refusal}")
        return caller.identity

    def admission_refusal(self, identity: str, proxy: ProxyNode) -> str | None:
        """Why ``identity`` may not get ``proxy``'s configuration (istiod's words), or None.

        istiod (``checkConnectionIdentity`` in ``pilot/pkg/xds``) requires the identity's namespace
        to be the proxy's namespace and, when the node claims one (metadata ``SERVICE_ACCOUNT``),
        its service account to be that one. Here a proxy gets the configuration of the mesh
        workload its node names, so the identity must also be that workload's service account:
        otherwise a token for ``web`` would get ``other``'s listeners by naming ``other`` and
        claiming no service account.
        """
        claimed = proxy.metadata.get("SERVICE_ACCOUNT")
        claimed = claimed if isinstance(claimed, str) else ""
        namespace, account = spiffe_namespace_account(identity) or ("", "")
        mismatch = (proxy.namespace and namespace != proxy.namespace) or (claimed and account != claimed)
        if not account or mismatch:
            return f"no identities ([{identity}]) matched {proxy.namespace}/{claimed}"
        workload = self.mesh.workload(proxy.name, proxy.namespace)
        if workload is not None and account != workload.service_account:
            return (
                f"no identities ([{identity}]) matched {proxy.namespace}/{workload.service_account} "
                f"(the service account of workload {workload.name}.{workload.namespace})"
            )
        return None

    @property
    def _token_verifier(self) -> TokenVerifier:
        if self._verifier is None:
            raise RuntimeError("control plane not started")
        return self._verifier

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the mesh and CA, write the root, then listen; ControlPlaneError/MeshError/StateError."""
        if self._started:
            raise RuntimeError("control plane already started")
        self._started = True
        try:
            await self._start()
        except BaseException:
            await self._shutdown(0)
            raise

    async def _start(self) -> None:
        try:
            plain_host, plain_port = parse_address(self._address)
            tls_host, tls_port = parse_address(self._secure_address)
        except ValueError as err:
            raise ControlPlaneError(str(err)) from None
        self._mesh_bytes = read_mesh_bytes(self._mesh_path)
        self._mesh = parse_mesh(self._mesh_bytes, self._mesh_path)
        # The CA writes state_dir/root-cert.pem; it exists before any port is open.
        self._ca = await asyncio.to_thread(LocalCA.load_or_create, self._state_dir, self._mesh.trust_domain)
        self._verifier = await asyncio.to_thread(TokenVerifier, self._state_dir)
        tls_context = self._tls_context(await self._serving_hosts(tls_host))
        self._ads = AdsServer(
            self._mesh,
            build_snapshot,
            authorize=self.authorize_proxy,
            observer=self._push_observer,
            registry=self._registry,
            debug_access=self._debug_access,
        )

        self._port = await self._serve(plain_host, plain_port, None)
        self._secure_port = await self._serve(tls_host, tls_port, tls_context)
        await self._start_watching()
        log.info(
            "control plane serving CA and ADS on %s (plaintext) and %s (TLS), trust domain %s, root %s",
            format_address(plain_host, self._port),
            format_address(tls_host, self._secure_port),
            self._mesh.trust_domain,
            self.root_cert_path,
        )

    async def stop(self, grace: float = 1.0) -> None:
        """Stop accepting, let in-flight calls finish for up to ``grace`` seconds, then close everything."""
        if self._started:
            await self._shutdown(grace)

    async def __aenter__(self) -> ControlPlane:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def _shutdown(self, grace: float) -> None:
        self._started = False
        await self._stop_watching()
        if self._ads is not None:
            await self._ads.close()
        servers, self._servers = self._servers, []
        await asyncio.gather(*(server.stop(grace) for server in servers))

    async def _serve(self, host: str, port: int, tls: ssl.SSLContext | None) -> int:
        """Serve every service on ``host:port`` (TLS when ``tls`` is given); the port bound."""
        sock = _listen(host, port)
        server = RpcServer(limits=self._limits, max_concurrent_streams=MAX_CONCURRENT_STREAMS)
        _CertificateService(self).add_to(server)
        self.ads.add_to(server, authorize=tls is not None)
        for hook in self._hooks:
            hook(server)
        self._servers.append(server)
        port = int(sock.getsockname()[1])
        await server.start(sock=sock, ssl_context=tls)  # closes the socket if it cannot start
        return port

    async def _serving_hosts(self, listen_host: str) -> list[str]:
        """Names and IPs the serving certificate covers: istiod's names plus what we listen on."""
        hosts = [*SERVING_HOSTS, "127.0.0.1", "::1"]
        wildcard = listen_host in ("0.0.0.0", "::")
        names = [socket.gethostname()] if wildcard else [listen_host]
        for name in names:
            hosts.append(name)
            with contextlib.suppress(OSError):
                for info in await asyncio.get_running_loop().getaddrinfo(name, None, type=socket.SOCK_STREAM):
                    hosts.append(str(ipaddress.ip_address(str(info[4][0]).split("%")[0])))
        return [host for host in dict.fromkeys(hosts) if host not in ("0.0.0.0", "::")]

    def _tls_context(self, hosts: list[str]) -> ssl.SSLContext:
        key_pem, chain_pem = self.ca.issue_serving_cert(hosts)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.verify_mode = ssl.CERT_OPTIONAL  # istiod: verify a client certificate if one is given
        context.load_verify_locations(cadata=self.ca.root_pem.decode("ascii"))
        context.set_alpn_protocols(["h2"])
        # ssl only loads keys from files: a private temporary file, removed as soon as it is read.
        fd, name = tempfile.mkstemp(prefix=".serving-", suffix=".pem", dir=self._state_dir)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(key_pem + chain_pem)
            context.load_cert_chain(name)
        finally:
            os.unlink(name)
        return context

    # -- mesh file ------------------------------------------------------------------------------

    async def reload_mesh(self) -> bool:
        """Re-read the mesh file; a bad file keeps the last good config. True when a new config applies."""
        try:
            data = read_mesh_bytes(self._mesh_path)
        except MeshError as err:
            log.error("%s; keeping the last good mesh config", err)
            return False
        if data == self._mesh_bytes:
            return False
        self._mesh_bytes = data
        try:
            config = parse_mesh(data, self._mesh_path)
        except MeshError as err:
            log.error("%s; keeping the last good mesh config", err)
            return False
        if config == self._mesh:
            return False
        previous, self._mesh = self._mesh, config
        if previous is not None and previous.trust_domain != config.trust_domain:
            log.info("mesh trust domain changed from %s to %s", previous.trust_domain, config.trust_domain)
        log.info("reloaded mesh file %s", self._mesh_path)
        if self._ads is not None:
            await self._ads.update_mesh(config)
        for listener in list(self._mesh_listeners):
            try:
                result = listener(config)
                if result is not None:
                    await result
            except Exception:
                log.exception("mesh listener failed")
        return True

    async def _start_watching(self) -> None:
        """Reload the mesh file whenever it changes (the agent's file watcher: atomic replaces, symlinks)."""
        watcher = FileWatcher(self._mesh_file_changed, debounce=_MESH_DEBOUNCE, registry=self._registry)
        watcher.watch("mesh", [self._mesh_path])
        await watcher.start()
        self._watcher = watcher
        await self.reload_mesh()  # catches an edit made between the first read and the watch

    def _mesh_file_changed(self, _resource: str) -> None:
        if self._reload is None or self._reload.done():
            self._reload = asyncio.get_running_loop().create_task(
                self._reload_until_current(), name="mesh-reload"
            )
            self._reload.add_done_callback(report_failure(log, "reloading the mesh file"))
        else:
            self._reload_again = True  # a reload is running: read the file once more when it ends

    async def _reload_until_current(self) -> None:
        while True:
            self._reload_again = False
            await self.reload_mesh()
            if not self._reload_again:
                return

    async def _stop_watching(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            await watcher.stop()
        reload, self._reload = self._reload, None
        if reload is not None:
            reload.cancel()
            await asyncio.gather(reload, return_exceptions=True)
