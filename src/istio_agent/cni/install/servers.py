"""install-cni's HTTP endpoints: ``/healthz`` and ``/readyz`` for kubelet, ``/metrics`` for Prometheus.

Istio (``cni/pkg/cmd/root.go``): the health server on :8000, where ``/healthz`` is always 200 and
``/readyz`` is 200 only while the install is in place; metrics on the monitoring port (15014). A
503 from ``/readyz`` carries the reason in its body (ours: Istio's is empty), so ``kubectl
describe`` on the istio-cni-node pod shows why it is not ready.
"""

from __future__ import annotations

from collections.abc import Callable

from istio_agent.http.messages import Request, Response, StreamResponse
from istio_agent.http.server import BaseSite, ServerRunner, TCPSite
from istio_agent.log import scope
from istio_agent.metrics import Registry

log = scope("cni-agent")

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


class Endpoint:
    """One HTTP listener serving a fixed set of paths."""

    def __init__(self, name: str, host: str, port: int, routes: dict[str, Callable[[], Response]]) -> None:
        self._name = name
        self._host = host
        self._requested_port = port
        self._routes = routes
        self._runner: ServerRunner | None = None
        self._site: BaseSite | None = None

    @property
    def port(self) -> int:
        return self._site.port if self._site is not None else 0

    async def start(self) -> None:
        """Listen; raises OSError naming the address when the port cannot be had."""
        runner = ServerRunner(self._handle)
        site = TCPSite(runner, self._host, self._requested_port)
        try:
            await site.start()
        except OSError as err:
            raise OSError(
                err.errno,
                f"{self._name} server cannot listen on {self._host or '*'}:{self._requested_port}: {err.strerror}",
            ) from None
        self._runner, self._site = runner, site
        log.info("%s server listening on %s:%d", self._name, self._host or "*", site.port)

    async def stop(self) -> None:
        runner, self._runner, self._site = self._runner, None, None
        if runner is not None:
            await runner.cleanup()

    async def _handle(self, request: Request) -> StreamResponse:
        route = self._routes.get(request.path)
        if route is None:
            return Response(404, text="404 page not found\n")
        if request.method not in ("GET", "HEAD"):
            return Response(405, text="method not allowed\n")
        return route()


def health_endpoint(host: str, port: int, readiness: Callable[[], tuple[bool, str]]) -> Endpoint:
    """``/healthz`` (alive: always 200) and ``/readyz`` (200 when ready, else 503 with the reason)."""

    def ready() -> Response:
        ok, reason = readiness()
        if ok:
            return Response(200, text="ok\n")
        return Response(503, text=f"not ready: {reason}\n")

    return Endpoint("health", host, port, {"/healthz": lambda: Response(200, text="ok\n"), "/readyz": ready})


def metrics_endpoint(host: str, port: int, registry: Registry) -> Endpoint:
    """``/metrics``: the registry in Prometheus' text format."""
    return Endpoint(
        "monitoring",
        host,
        port,
        {"/metrics": lambda: Response(200, body=registry.expose(), content_type=PROMETHEUS_TEXT)},
    )
