"""The agent's status server (port 15020): readiness, merged metrics, app probes, quit/drain, debug views.

One server binds the port at start-up and answers ``/healthz/ready`` from that moment on; there is
no second server and no hand-over. It loads only the HTTP server and readiness: the merged-metrics
and app-probe handlers are passed in as ``LazyHandler`` s (``status/lazy.py``) and built on first
use, so nothing they import (the HTTP/2 client, ...) is on the start-up path, where it would hold
up the SDS and xDS answers Envoy is waiting for. Behaviour: ``docs/status.md``; Istio's own is
``pilot/cmd/pilot-agent/status/server.go``.

Routing is one dispatch function so that every path answers exactly as Istio's Go mux does
(``404 page not found``, ``405 Method Not Allowed``, ``403`` for remote callers of loopback-only
endpoints), checked against the connection's real peer address.

Compression: responses a handler returns whole (``Response``) are compressed here per
``Accept-Encoding`` (gzip; zstd when a zstd module is importable) when the body is at least 1 KiB.
A streamed response (``StreamResponse``) is never touched — its headers are already on the wire;
a streaming handler compresses by itself (the metrics merger streams gzip at zlib level 1, using
:func:`negotiate_encoding`).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import socket
import zlib
from collections.abc import Awaitable, Callable
from types import ModuleType
from typing import Any

from istio_agent.http.messages import Handler, Request, Response, StreamResponse
from istio_agent.http.server import BaseSite, Limits, ServerRunner, SockSite, TCPSite
from istio_agent.log import scope
from istio_agent.metrics import Registry
from istio_agent.status.readiness import Readiness

log = scope("status")

MIN_COMPRESS_SIZE = 1024
GZIP_LEVEL = 6
SHUTDOWN_TIMEOUT = 2.0
NOT_FOUND = "404 page not found\n"
FORBIDDEN = "Only requests from localhost are allowed\n"
METHOD_NOT_ALLOWED = "Method Not Allowed\n"
TEXT = "text/plain"


@functools.cache
def _zstd() -> ModuleType | None:
    """zstd is optional (not a dependency): the stdlib module from 3.14, else the zstandard package."""
    for name in ("compression.zstd", "zstandard"):
        try:
            return __import__(name, fromlist=["compress"])
        except ImportError:
            continue
    return None


def is_loopback(address: str | None) -> bool:
    """127.0.0.0/8, ::1 or an IPv4-mapped loopback (``::ffff:127.x``); anything unparsable is remote."""
    if not address:
        return False
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0].strip("[]"))
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


def negotiate_encoding(accept_encoding: str, *, zstd: bool | None = None) -> str | None:
    """The content coding to use for an ``Accept-Encoding`` header: ``gzip``, ``zstd`` or None.

    q-values are honoured (q=0 refuses a coding); on equal q zstd is preferred; other codings
    (br, lz4, deflate, ...) are ignored. ``zstd`` defaults to whether a zstd module is available.
    """
    offered = {"gzip"}
    if zstd if zstd is not None else _zstd() is not None:
        offered.add("zstd")
    best: tuple[float, int, str] | None = None
    for part in accept_encoding.split(","):
        coding, *params = (item.strip() for item in part.split(";"))
        coding = coding.lower()
        if coding not in offered:
            continue
        q = 1.0
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value.strip())
                except ValueError:
                    q = 0.0
        if q <= 0:
            continue
        rank = (q, 1 if coding == "zstd" else 0, coding)
        if best is None or rank > best:
            best = rank
    return best[2] if best else None


def compress(request: Request, response: StreamResponse) -> None:
    """Compress a whole response in place when it is big enough and the client accepts a coding."""
    if response.prepared or not isinstance(response, Response):
        return  # streamed, or already on the wire (see module docstring)
    body = response.body
    if (
        request.method == "HEAD"
        or response.status < 200
        or response.status in (204, 304)
        or "Content-Encoding" in response.headers
        or len(body) < MIN_COMPRESS_SIZE
    ):
        return
    response.headers.add("Vary", "Accept-Encoding")
    coding = negotiate_encoding(request.headers.get("Accept-Encoding", ""))
    zstd = _zstd()
    if coding == "gzip":
        compressor = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
        response.body = compressor.compress(body) + compressor.flush()
    elif coding == "zstd" and zstd is not None:
        response.body = zstd.compress(bytes(body))
    else:
        return
    response.headers["Content-Encoding"] = coding


def _text(status: int, text: str) -> Response:
    return Response(status, text=text, content_type=TEXT)


class _StatusMetrics:
    """The status server's own metrics."""

    def __init__(self, registry: Registry) -> None:
        self.rejected = registry.counter(
            "status_rejected_connections",
            "Connections to the status port closed without serving a request, by reason "
            "(malformed_request, header_timeout, connection_limit).",
            ["reason"],
        )

    def reject(self, reason: str) -> None:
        self.rejected.labels(reason=reason).inc()


class StatusServer:
    """HTTP server on the agent's status port; ``start()`` binds, ``close_listener()`` stops accepting.

    It listens on every address by default, so anyone who can reach the pod can send it anything:
    ``limits`` (the HTTP stack's defaults unless given) bound what a client can hold, and malformed
    or stalled connections are counted in ``istio_agent_status_rejected_connections``, never logged
    above debug.
    """

    def __init__(
        self,
        host: str,
        port: int,
        readiness: Readiness,
        *,
        metrics: Handler | None = None,
        app_probes: Handler | None = None,
        ndsz: Callable[[], dict[str, Any] | None] | None = None,
        secrets: Callable[[], dict[str, Any] | None] | None = None,
        on_quit: Callable[[], None] | None = None,
        on_drain: Callable[[], Awaitable[None]] | None = None,
        metrics_localhost_only: bool = False,
        limits: Limits | None = None,
        registry: Registry,
    ) -> None:
        self._host = host
        self._requested_port = port
        self._readiness = readiness
        self._metrics = metrics
        self._app_probes = app_probes
        self._ndsz_view = ndsz
        self._secrets_view = secrets
        self._on_quit = on_quit
        self._on_drain = on_drain
        self._metrics_localhost_only = metrics_localhost_only
        self._limits = limits
        self._own_metrics = _StatusMetrics(registry)
        self._runner: ServerRunner | None = None
        self._site: BaseSite | None = None
        self._port = 0
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        """The bound port (the requested one, or the one picked for port 0); 0 before start()."""
        return self._port

    async def start(self, sock: socket.socket | None = None) -> None:
        """Bind (or serve ``sock``, already listening: see ``http/listen.py``) and serve.

        Raises OSError naming the address if binding fails.
        """
        if self._runner is not None:
            raise RuntimeError("status server already started")
        runner = ServerRunner(
            self._handle,
            limits=self._limits,
            shutdown_timeout=SHUTDOWN_TIMEOUT,
            on_reject=self._own_metrics.reject,
        )
        site: BaseSite = (
            SockSite(runner, sock) if sock is not None else TCPSite(runner, self._host, self._requested_port)
        )
        try:
            await site.start()
        except OSError as err:
            raise OSError(
                err.errno,
                f"status server cannot listen on {self._host}:{self._requested_port}: {err.strerror}",
            ) from None
        self._runner, self._site = runner, site
        self._port = site.port
        log.info("status server listening on %s:%d", self._host, self._port)

    async def close_listener(self) -> None:
        """Stop accepting connections at once (on SIGTERM 15020 refuses during the drain)."""
        if self._site is not None:
            site, self._site = self._site, None
            await site.stop()

    async def stop(self) -> None:
        """Close the listener, cancel pending drain callbacks, and finish in-flight requests (bounded)."""
        await self.close_listener()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    # -- routing ---------------------------------------------------------------------------------------
    async def _handle(self, request: Request) -> StreamResponse:
        response = await self._dispatch(request)
        compress(request, response)
        return response

    async def _dispatch(self, request: Request) -> StreamResponse:
        path = request.path
        if path == "/healthz/ready":
            return await self._ready()
        if path in ("/stats/prometheus", "/metrics"):
            if self._metrics_localhost_only and not is_loopback(request.remote):
                return _text(403, FORBIDDEN)
            if self._metrics is None:
                return _text(404, NOT_FOUND)
            return await self._metrics(request)
        if path.startswith(("/app-health/", "/app-lifecycle/")):
            if self._app_probes is None:
                return _text(404, NOT_FOUND)
            return await self._app_probes(request)
        if path == "/quitquitquit":
            return await self._quit(request)
        if path == "/drain":
            return await self._drain(request)
        if path == "/debug/ndsz":
            return self._ndsz(request)
        if path == "/debug/secrets":
            return self._secrets(request)
        return _text(404, NOT_FOUND)

    async def _ready(self) -> Response:
        error = await self._readiness.check()
        if error is None:
            return Response(200)
        # Istio answers 503 with an empty body; the reason is what users look for, so we send it.
        return _text(503, error + "\n")

    def _local_post_error(self, request: Request) -> Response | None:
        if not is_loopback(request.remote):
            return _text(403, FORBIDDEN)
        if request.method != "POST":
            return _text(405, METHOD_NOT_ALLOWED)
        return None

    async def _send_ok(self, request: Request) -> Response:
        """Write ``200 OK`` completely before acting, so the caller sees the answer even if we exit."""
        response = _text(200, "OK")
        await response.prepare(request)
        return response

    async def _quit(self, request: Request) -> StreamResponse:
        error = self._local_post_error(request)
        if error is not None:
            return error
        response = await self._send_ok(request)
        log.info("handling /quitquitquit, notifying pilot-agent to exit")
        if self._on_quit is not None:
            try:
                self._on_quit()
            except Exception:  # the answer is sent; a failing callback is logged, not re-raised
                log.exception("/quitquitquit callback failed")
        return response

    async def _drain(self, request: Request) -> StreamResponse:
        error = self._local_post_error(request)
        if error is not None:
            return error
        response = await self._send_ok(request)
        log.info("handling /drain, starting Envoy listener drain")
        if self._on_drain is not None:
            task = asyncio.get_running_loop().create_task(
                self._run_drain(self._on_drain), name="status-drain"
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return response

    @staticmethod
    async def _run_drain(on_drain: Callable[[], Awaitable[None]]) -> None:
        try:
            await on_drain()
        except Exception:  # runs detached: nobody else would see it
            log.exception("/drain callback failed")

    def _ndsz(self, request: Request) -> Response:
        if not is_loopback(request.remote):
            return _text(403, FORBIDDEN)
        view = self._ndsz_view() if self._ndsz_view is not None else None
        if view is None:  # DNS proxy off, or no table yet
            return Response(404, text="{}", content_type="application/json")
        return Response(text=json.dumps(view, indent=2), content_type="application/json")

    def _secrets(self, request: Request) -> Response:
        """What the agent holds (certificates' public facts, never keys), for ``proxy-config secret --diff``."""
        if not is_loopback(request.remote):
            return _text(403, FORBIDDEN)
        if request.method not in ("GET", "HEAD"):
            return _text(405, METHOD_NOT_ALLOWED)
        view = self._secrets_view() if self._secrets_view is not None else None
        if view is None:  # no secret manager (yet)
            return Response(404, text="{}", content_type="application/json")
        return Response(text=json.dumps(view, indent=2), content_type="application/json")
