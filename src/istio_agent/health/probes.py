"""Workload health probers for VM readiness checks (Istio: pkg/istio-agent/health/health_probers.go).

Each prober answers one probe with a ``ProbeOutcome``. Error strings follow Istio's so that the
message istiod puts on the WorkloadEntry's ``Healthy`` condition reads the same. HTTP probes come
from 127.0.0.6 (``::6``) like the status server's app probes, so a capturing sidecar lets them
through; the socket helpers are shared with ``istio_agent.status.probes``.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import os
import signal
import socket
import ssl
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from istio_agent import goformat
from istio_agent.config.probes import (
    Check,
    ExecCheck,
    GRPCCheck,
    HTTPGetCheck,
    ReadinessProbeConfig,
    TCPCheck,
)
from istio_agent.envoy.readiness import EnvoyReadiness
from istio_agent.http.client import URL, Client, ConnectError, HTTPError
from istio_agent.http.headers import Headers
from istio_agent.log import scope
from istio_agent.status.probes import ProbeSource, decode_health_status, encode_health_request

log = scope("healthcheck")

USER_AGENT = "istio-probe/1.0"
GRPC_CONFIG_NIL = "grpc health check config is nil"
_HEALTH_CHECK = "/grpc.health.v1.Health/Check"
_SERVING = 1
_MAX_REDIRECTS = 10
_REDIRECT_CODES = frozenset({301, 302, 303, 307, 308})


# Go's names for the signals a probe command typically dies of (`signal: killed`).
class ProbeResult(enum.Enum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class ProbeOutcome:
    """A probe's result; ``error`` may be ``None`` even when unhealthy (e.g. gRPC NOT_SERVING)."""

    result: ProbeResult
    error: str | None = None

    @property
    def healthy(self) -> bool:
        return self.result is ProbeResult.HEALTHY


HEALTHY = ProbeOutcome(ProbeResult.HEALTHY)


def _unhealthy(error: str | None) -> ProbeOutcome:
    return ProbeOutcome(ProbeResult.UNHEALTHY, error)


class HealthProber(Protocol):
    """One workload health condition."""

    async def probe(self, timeout: float) -> ProbeOutcome: ...


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _error_text(err: BaseException) -> str:
    if isinstance(err, OSError) and err.errno:
        return os.strerror(err.errno).lower()
    return str(err) or type(err).__name__


def _dial_error(address: str, host: str, err: OSError) -> str:
    """Go's net.Dial error text: ``dial tcp 1.2.3.4:80: connect: connection refused``."""
    if isinstance(err, socket.gaierror):
        return f"dial tcp: lookup {host}: {(err.strerror or 'no such host').lower()}"
    return f"dial tcp {address}: connect: {_error_text(err)}"


class EnvoyProber:
    """Envoy has its config and is LIVE (the status server's readiness check, without the termination check)."""

    def __init__(self, readiness: EnvoyReadiness) -> None:
        self._readiness = readiness

    async def probe(self, timeout: float) -> ProbeOutcome:
        # EnvoyReadiness bounds its own admin calls; `timeout` is ignored, as in Istio.
        error = await self._readiness.check()
        return HEALTHY if error is None else _unhealthy(error)


class HTTPProber:
    """``httpGet``: GET, following redirects, healthy iff the final status is in [200, 400)."""

    def __init__(self, check: HTTPGetCheck, default_host: str) -> None:
        host = check.host or default_host
        self._url = URL.parse(f"{check.scheme}://{_host_port(host, check.port)}{check.path}")
        self._headers = Headers(check.headers)  # a `Host` header becomes the request's host
        if "User-Agent" not in self._headers:
            self._headers["User-Agent"] = USER_AGENT
        self._headers["Connection"] = "close"
        self._source = ProbeSource()
        tls = ssl.create_default_context()
        tls.check_hostname = False
        tls.verify_mode = ssl.CERT_NONE  # as Istio: health probes do not verify certificates
        self._client = Client(tls=tls, socket_factory=self._source.open_socket)

    @property
    def url(self) -> URL:
        return self._url

    async def probe(self, timeout: float) -> ProbeOutcome:
        try:
            async with asyncio.timeout(timeout):
                status = await self._get()
        except TimeoutError:
            return _unhealthy(
                f'Get "{self._url}": context deadline exceeded (Client.Timeout exceeded while awaiting headers)'
            )
        except ConnectError as err:
            return _unhealthy(
                f'Get "{self._url}": {_dial_error(self._url.address, self._url.host, err.os_error)}'
            )
        except (HTTPError, OSError) as err:
            return _unhealthy(f'Get "{self._url}": {_error_text(err)}')
        if 200 <= status < 400:
            return HEALTHY
        return _unhealthy(f"status code was not from [200,400), bad code {status}")

    async def _get(self) -> int:
        try:
            return await self._get_once()
        except ConnectError as err:
            # 127.0.0.6 cannot reach a non-local destination: retry from the default source.
            if not _source_unusable(err.os_error) or not self._source.active(_family(self._url)):
                raise
            self._source.disable(_family(self._url), err.os_error)
        return await self._get_once()

    async def _get_once(self) -> int:
        url = self._url
        for _ in range(_MAX_REDIRECTS + 1):
            async with self._client.stream("GET", url, headers=self._headers) as response:
                status, location = response.status, response.headers.get("Location")
            if status not in _REDIRECT_CODES or location is None:
                return status
            url = url.join(location)
        raise HTTPError(f"stopped after {_MAX_REDIRECTS} redirects")


def _family(url: URL) -> int:
    return socket.AF_INET6 if ":" in url.host else socket.AF_INET


def _source_unusable(err: OSError) -> bool:
    return err.errno in (errno.EINVAL, errno.EADDRNOTAVAIL, errno.ENETUNREACH)


class TCPProber:
    """``tcpSocket``: healthy iff a connection opens within the timeout."""

    def __init__(self, check: TCPCheck, default_host: str) -> None:
        self._host = check.host or default_host
        self._port = check.port
        self._address = _host_port(self._host, self._port)

    async def probe(self, timeout: float) -> ProbeOutcome:
        try:
            async with asyncio.timeout(timeout):
                _, writer = await asyncio.open_connection(self._host.strip("[]"), self._port)
        except TimeoutError:
            return _unhealthy(f"dial tcp {self._address}: i/o timeout")
        except OSError as err:
            return _unhealthy(_dial_error(self._address, self._host, err))
        writer.close()
        # The peer may reset a connection we only opened to prove it is accepted.
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return HEALTHY


class GRPCProber:
    """``grpc``: ``grpc.health.v1.Health/Check`` with the service; only SERVING is healthy.

    grpcio cannot bind a source address, so gRPC probes come from the default source.
    """

    def __init__(self, check: GRPCCheck | None, default_host: str) -> None:
        self._check = check
        self._target = _host_port(default_host, check.port) if check is not None else ""

    async def probe(self, timeout: float) -> ProbeOutcome:
        check = self._check
        if check is None:
            return ProbeOutcome(ProbeResult.UNKNOWN, GRPC_CONFIG_NIL)
        options: list[tuple[str, Any]] = [
            ("grpc.primary_user_agent", USER_AGENT),
            ("grpc.enable_http_proxy", 0),
            ("grpc.enable_retries", 0),
        ]
        try:
            async with (
                asyncio.timeout(timeout),
                grpc.aio.insecure_channel(self._target, options=options) as channel,
            ):
                call = channel.unary_unary(_HEALTH_CHECK)
                try:
                    response = await call(encode_health_request(check.service), wait_for_ready=False)
                except grpc.aio.AioRpcError as err:
                    # UNAVAILABLE without ever reaching READY: the connection itself failed.
                    if err.code() is grpc.StatusCode.UNAVAILABLE and (
                        channel.get_state() is not grpc.ChannelConnectivity.READY
                    ):
                        return _unhealthy(
                            f"failed to connect health check grpc service on port {check.port}: {err.details()}"
                        )
                    raise
        except TimeoutError:
            return _unhealthy(f"health rpc probe timed out after {goformat.duration(timeout)}")
        except grpc.aio.AioRpcError as err:
            code = err.code()
            if code is grpc.StatusCode.UNIMPLEMENTED:
                return _unhealthy(
                    "this server does not implement the grpc health protocol (grpc.health.v1.Health): "
                    f"{err.details()}"
                )
            return _unhealthy(
                f"health rpc probe failed with status {goformat.status_code_name(code)}: {err.details()}"
            )
        try:
            status = decode_health_status(response)
        except Exception as err:
            return _unhealthy(f"health rpc probe failed: {err}")
        # NOT_SERVING, UNKNOWN, SERVICE_UNKNOWN: unhealthy without an error, as in Istio.
        return HEALTHY if status == _SERVING else _unhealthy(None)


class ExecProber:
    """``exec``: run the command; healthy iff it exits 0 before the timeout.

    Beyond Istio: the command gets its own process group and the whole group is killed on timeout,
    so a shell's children do not outlive the probe.
    """

    def __init__(self, check: ExecCheck) -> None:
        self._command = check.command

    async def probe(self, timeout: float) -> ProbeOutcome:
        try:
            process = await asyncio.create_subprocess_exec(
                *self._command,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
                start_new_session=True,
            )
        except FileNotFoundError:
            return _unhealthy(f'exec: "{self._command[0]}": executable file not found in $PATH')
        except OSError as err:
            return _unhealthy(f"fork/exec {self._command[0]}: {_error_text(err)}")
        try:
            async with asyncio.timeout(timeout):
                code = await process.wait()
        except TimeoutError:
            _kill_group(process.pid)
            code = await process.wait()
            return _unhealthy(f"command timeout exceeded: {goformat.exit_text(code)}")
        except asyncio.CancelledError:
            _kill_group(process.pid)
            raise
        if code == 0:
            return HEALTHY
        return _unhealthy(goformat.exit_text(code))


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def build_probers(
    config: ReadinessProbeConfig,
    *,
    default_host: str = "localhost",
    envoy: EnvoyReadiness | None = None,
) -> list[HealthProber]:
    """The probers the checker runs in order: Envoy readiness first (when Envoy runs), then the probe.

    ``default_host`` is the first proxy IP (``localhost`` when there is none or with the legacy
    localhost setting); it is used when the probe names no host, and always for gRPC.
    """
    probers: list[HealthProber] = []
    if envoy is not None:
        probers.append(EnvoyProber(envoy))
    probers.append(prober_for(config.check, default_host))
    return probers


def prober_for(check: Check, default_host: str) -> HealthProber:
    """The prober of one configured check."""
    if isinstance(check, HTTPGetCheck):
        return HTTPProber(check, default_host)
    if isinstance(check, TCPCheck):
        return TCPProber(check, default_host)
    if isinstance(check, GRPCCheck):
        return GRPCProber(check, default_host)
    return ExecProber(check)
