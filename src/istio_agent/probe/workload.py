"""VM health checks (ProxyConfig ``readinessProbe``): each check's outcome as Istio reports it.

Istio's are ``pkg/istio-agent/health/health_probers.go``. Each prober answers one probe with a
``ProbeOutcome`` whose error text follows Go's (``dial tcp 10.0.0.5:80: connect: connection
refused``), so the message istiod puts on the WorkloadEntry's ``Healthy`` condition reads the same.
The checks are run by this package's probers, from the probe source address like app probes.
"""

from __future__ import annotations

import asyncio
import enum
import os
import socket
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Protocol

from istio_agent import goformat
from istio_agent.config.probes import (
    Check,
    ExecCheck,
    GRPCCheck,
    HTTPGetCheck,
    ReadinessProbeConfig,
    TCPCheck,
)
from istio_agent.http.client import URL, ConnectError, HTTPError
from istio_agent.http.headers import Headers
from istio_agent.probe import command, tcp
from istio_agent.probe.http_get import HTTPGetProber, Redirects
from istio_agent.probe.source import ProbeSource
from istio_agent.probe.tcp import host_port

USER_AGENT = "istio-probe/1.0"
GRPC_CONFIG_NIL = "grpc health check config is nil"


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


class ReadinessCheck(Protocol):
    """A readiness condition: ``None`` when met, else why not (``envoy.readiness.EnvoyReadiness``)."""

    def check(self) -> Awaitable[str | None]: ...


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

    def __init__(self, readiness: ReadinessCheck) -> None:
        self._readiness = readiness

    async def probe(self, timeout: float) -> ProbeOutcome:
        # The readiness check bounds its own admin calls; `timeout` is ignored, as in Istio.
        error = await self._readiness.check()
        return HEALTHY if error is None else _unhealthy(error)


class HTTPProber:
    """``httpGet``: GET, following redirects, healthy iff the final status is in [200, 400)."""

    def __init__(self, check: HTTPGetCheck, default_host: str) -> None:
        host = check.host or default_host
        self._url = URL.parse(f"{check.scheme}://{host_port(host, check.port)}{check.path}")
        self._headers = Headers(check.headers)  # a `Host` header becomes the request's host
        if "User-Agent" not in self._headers:
            self._headers["User-Agent"] = USER_AGENT
        self._headers["Connection"] = "close"
        self._http = HTTPGetProber(ProbeSource())  # HTTP/1.1 only, no keep-alive, as Istio's

    @property
    def url(self) -> URL:
        return self._url

    async def probe(self, timeout: float) -> ProbeOutcome:
        try:
            async with asyncio.timeout(timeout):
                answer = await self._http.get(self._url, self._headers, redirects=Redirects.FOLLOW)
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
        if 200 <= answer.status < 400:
            return HEALTHY
        return _unhealthy(f"status code was not from [200,400), bad code {answer.status}")


class TCPProber:
    """``tcpSocket``: healthy iff a connection opens within the timeout."""

    def __init__(self, check: TCPCheck, default_host: str) -> None:
        self._host = (check.host or default_host).strip("[]")
        self._port = check.port
        self._address = host_port(self._host, self._port)
        self._source = ProbeSource()

    async def probe(self, timeout: float) -> ProbeOutcome:
        try:
            async with asyncio.timeout(timeout):
                await tcp.connect(self._source, self._host, self._port)
        except TimeoutError:
            return _unhealthy(f"dial tcp {self._address}: i/o timeout")
        except OSError as err:
            return _unhealthy(_dial_error(self._address, self._host, err))
        return HEALTHY


class GRPCProber:
    """``grpc``: ``grpc.health.v1.Health/Check`` with the service; only SERVING is healthy."""

    def __init__(self, check: GRPCCheck | None, default_host: str) -> None:
        self._check = check
        self._host = default_host
        self._source = ProbeSource()

    async def probe(self, timeout: float) -> ProbeOutcome:
        check = self._check
        if check is None:
            return ProbeOutcome(ProbeResult.UNKNOWN, GRPC_CONFIG_NIL)
        from istio_agent.http import h2client  # loaded by the first gRPC check only
        from istio_agent.probe import grpc_health

        try:
            async with asyncio.timeout(timeout) as deadline:
                status = await grpc_health.check(
                    self._source,
                    self._host,
                    check.port,
                    check.service,
                    user_agent=USER_AGENT,
                    deadline=deadline.when(),
                )
        except TimeoutError:
            return _unhealthy(f"health rpc probe timed out after {goformat.duration(timeout)}")
        except OSError as err:
            address = host_port(self._host, check.port)
            return _unhealthy(
                f"failed to connect health check grpc service on port {check.port}: "
                f"{_dial_error(address, self._host, err)}"
            )
        except h2client.GrpcError as err:
            if err.code == h2client.UNIMPLEMENTED:
                return _unhealthy(
                    "this server does not implement the grpc health protocol (grpc.health.v1.Health): "
                    f"{err.message}"
                )
            return _unhealthy(f"health rpc probe failed with status {err.code_name}: {err.message}")
        except (h2client.H2Error, grpc_health.HealthResponseError) as err:
            return _unhealthy(f"health rpc probe failed: {err}")
        # NOT_SERVING, UNKNOWN, SERVICE_UNKNOWN: unhealthy without an error, as in Istio.
        return HEALTHY if status == grpc_health.SERVING else _unhealthy(None)


class ExecProber:
    """``exec``: run the command; healthy iff it exits 0 before the timeout (its process group is
    killed at the timeout)."""

    def __init__(self, check: ExecCheck) -> None:
        self._command = check.command

    async def probe(self, timeout: float) -> ProbeOutcome:
        try:
            code = await command.run(self._command, timeout)
        except command.CommandTimeout as err:
            return _unhealthy(f"command timeout exceeded: {goformat.exit_text(err.returncode)}")
        except FileNotFoundError:
            return _unhealthy(f'exec: "{self._command[0]}": executable file not found in $PATH')
        except OSError as err:
            return _unhealthy(f"fork/exec {self._command[0]}: {_error_text(err)}")
        return HEALTHY if code == 0 else _unhealthy(goformat.exit_text(code))


def build_probers(
    config: ReadinessProbeConfig,
    *,
    default_host: str = "localhost",
    envoy: ReadinessCheck | None = None,
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
