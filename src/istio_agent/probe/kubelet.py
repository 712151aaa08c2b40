"""Kubelet's app probes on the status port: ``/app-health/...`` and ``/app-lifecycle/...``.

With mTLS (or traffic capture) kubelet cannot probe the application directly, so the injector
points the probes at the agent, which replays the original probe (``ISTIO_KUBE_APP_PROBERS``)
against the pod IP and answers kubelet with the outcome as an HTTP status (Istio's
``pilot/cmd/pilot-agent/status/server.go``): the app's own status and body for ``httpGet`` (a 3xx
is 200), 200 or 500 for ``tcpSocket`` and ``grpc``. The checks are run by this package's probers.
"""

from __future__ import annotations

import asyncio

from istio_agent.config.probes import AppProber, GRPCCheck, HTTPGetCheck
from istio_agent.http import h2client
from istio_agent.http.client import URL, HTTPError
from istio_agent.http.headers import Headers
from istio_agent.http.messages import Request, Response
from istio_agent.log import scope
from istio_agent.probe import grpc_health, tcp
from istio_agent.probe.http_get import HTTPGetProber, Redirects
from istio_agent.probe.source import ProbeSource
from istio_agent.probe.tcp import host_port

log = scope("healthcheck")

MAX_BODY = 10 * 1024
# Beyond Istio: timeoutSeconds 0 means "no timeout" there, which lets a hung application pin a
# probe (and its socket) forever; we cap every probe at 60 s instead.
MAX_TIMEOUT = 60.0
# Request headers not copied to the application: the body is never forwarded and the agent
# decides connection reuse itself.
_NOT_COPIED = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade"}
)


class AppProbes:
    """The status server's handler for ``/app-health/...`` and ``/app-lifecycle/...`` paths.

    ``pod_ip`` is where probes go (INSTANCE_IP, or ``localhost`` with
    REWRITE_PROBE_LEGACY_LOCALHOST_DESTINATION); the check's own ``host`` is ignored, as in Istio.
    """

    def __init__(
        self,
        probers: dict[str, AppProber],
        *,
        pod_ip: str,
        status_port: int,
        keepalive: bool = False,
        http2: bool = True,
    ) -> None:
        self._probers = dict(probers)
        self._pod_ip = pod_ip
        self._status_port = status_port
        self._keepalive = keepalive
        self._source = ProbeSource()
        # http2: ISTIO_ENABLE_HTTP2_PROBING, offer h2 to HTTPS apps
        self._http = HTTPGetProber(self._source, keepalive=keepalive, http2=http2)

    async def close(self) -> None:
        """Close pooled connections (only pooled with keep-alive)."""
        await self._http.aclose()

    async def handle(self, request: Request) -> Response:
        prober = self._probers.get(request.path)
        if prober is None:
            return Response(400, text=f"app prober config does not exists for {request.path}")
        check = prober.check
        timeout = _timeout(prober)
        try:
            async with asyncio.timeout(timeout) as deadline:
                if isinstance(check, HTTPGetCheck):
                    return await self._http_get(request, check)
                if isinstance(check, GRPCCheck):
                    return await self._grpc(request, check, deadline)
                await tcp.connect(self._source, self._pod_ip, check.port)
                return Response(200)
        except TimeoutError:
            log.info("app probe %s timed out after %ss", request.path, timeout)
        except h2client.GrpcError as err:
            if err.code == h2client.UNIMPLEMENTED:
                log.info(
                    "app probe %s failed: server does not implement the grpc health protocol "
                    "(grpc.health.v1.Health): %s",
                    request.path,
                    err,
                )
            else:
                log.info("app probe %s failed: grpc probe failed: %s", request.path, err)
        except (OSError, HTTPError, h2client.H2Error, ValueError) as err:
            log.info("app probe %s failed: %s", request.path, err or type(err).__name__)
        return Response(500)

    async def _http_get(self, request: Request, check: HTTPGetCheck) -> Response:
        """The app's status and (capped) body; a 3xx, followed or not, is 200."""
        scheme = "https" if check.https else "http"
        url = URL.parse(f"{scheme}://{host_port(self._pod_ip, check.port)}{check.path}")
        headers = Headers()
        for name, value in request.headers.items():
            if name.lower() not in _NOT_COPIED:
                headers.add(name, value)
        if not self._keepalive:
            headers["Connection"] = "close"
        host = self._host_header(request, check.port)
        if host:
            headers["Host"] = host
        answer = await self._http.get(url, headers, redirects=Redirects.SAME_HOST, max_body=MAX_BODY)
        if 300 <= answer.status < 400:
            return Response(200)
        return Response(answer.status, body=answer.body)

    def _host_header(self, request: Request, app_port: int) -> str | None:
        """Incoming Host, with the status port replaced by the application port."""
        host = request.headers.get("Host")
        if not host:
            return None
        name, sep, port = host.rpartition(":")
        if sep and not name.endswith("]") and ":" in name:
            return host  # bare IPv6 literal without a port
        if sep and port == str(self._status_port):
            return f"{name}:{app_port}"
        return host

    async def _grpc(self, request: Request, check: GRPCCheck, deadline: asyncio.Timeout) -> Response:
        """200 when the app answers SERVING (kubelet's User-Agent is passed on)."""
        status = await grpc_health.check(
            self._source,
            self._pod_ip,
            check.port,
            check.service,
            user_agent=request.headers.get("User-Agent"),
            deadline=deadline.when(),
        )
        if status != grpc_health.SERVING:
            log.info("app probe %s failed: gRPC health status %s", request.path, status)
            return Response(500)
        return Response(200)


def _timeout(prober: AppProber) -> float:
    seconds = prober.timeout_seconds
    return MAX_TIMEOUT if seconds <= 0 else min(float(seconds), MAX_TIMEOUT)
