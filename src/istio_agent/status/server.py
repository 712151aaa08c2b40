"""The agent's status server (port 15020, lifecycle.md §4): readiness, metrics, app probes, quit/drain, ndsz.

Routing is one dispatch function rather than aiohttp's router so that every path answers exactly as
Istio's Go mux does (``404 page not found``, ``405 Method Not Allowed``, ``403`` for remote callers
of loopback-only endpoints). Metrics and app-probe handlers come from their own modules.

Compression: responses the handler returns whole (``web.Response``) are compressed here per
``Accept-Encoding`` (gzip; zstd when a zstd module is importable) when the body is at least 1 KiB.
A streamed response (one the handler prepared itself) is never touched by the middleware — its
headers are already on the wire; a streaming handler compresses by itself (the metrics merger
streams gzip at zlib level 1, using :func:`negotiate_encoding`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
from collections.abc import Awaitable, Callable
from types import ModuleType
from typing import Any

from aiohttp import hdrs, web

from istio_agent.log import scope
from istio_agent.status.readiness import Readiness

log = scope("status")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

MIN_COMPRESS_SIZE = 1024
SHUTDOWN_TIMEOUT = 2.0
NOT_FOUND = "404 page not found\n"
FORBIDDEN = "Only requests from localhost are allowed\n"
METHOD_NOT_ALLOWED = "Method Not Allowed\n"
TEXT = "text/plain"


def _load_zstd() -> ModuleType | None:
    # zstd is optional (not a dependency): the stdlib module from 3.14, else the zstandard package.
    for name in ("compression.zstd", "zstandard"):
        try:
            return __import__(name, fromlist=["compress"])
        except ImportError:
            continue
    return None


_ZSTD = _load_zstd()


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
    if zstd if zstd is not None else _ZSTD is not None:
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


@web.middleware
async def compression_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    response = await handler(request)
    if response.prepared or not isinstance(response, web.Response):
        return response  # streamed: already on the wire (see module docstring)
    body = response.body
    if (
        request.method == hdrs.METH_HEAD
        or response.status < 200
        or response.status in (204, 304)
        or hdrs.CONTENT_ENCODING in response.headers
        or not isinstance(body, bytes | bytearray)
    ):
        return response
    if len(body) < MIN_COMPRESS_SIZE:
        return response
    response.headers.add(hdrs.VARY, hdrs.ACCEPT_ENCODING)
    coding = negotiate_encoding(request.headers.get(hdrs.ACCEPT_ENCODING, ""))
    if coding == "gzip":
        response.enable_compression(web.ContentCoding.gzip)
    elif coding == "zstd" and _ZSTD is not None:
        response.body = _ZSTD.compress(bytes(body))
        response.headers[hdrs.CONTENT_ENCODING] = "zstd"
    return response


def _text(status: int, text: str) -> web.Response:
    return web.Response(status=status, text=text, content_type=TEXT)


class StatusServer:
    """HTTP server on the agent's status port; ``start()`` binds, ``close_listener()`` stops accepting."""

    def __init__(
        self,
        host: str,
        port: int,
        readiness: Readiness,
        *,
        metrics: Handler | None = None,
        app_probes: Handler | None = None,
        ndsz: Callable[[], dict[str, Any] | None] | None = None,
        on_quit: Callable[[], None] | None = None,
        on_drain: Callable[[], Awaitable[None]] | None = None,
        metrics_localhost_only: bool = False,
    ) -> None:
        self._host = host
        self._requested_port = port
        self._readiness = readiness
        self._metrics = metrics
        self._app_probes = app_probes
        self._ndsz_view = ndsz
        self._on_quit = on_quit
        self._on_drain = on_drain
        self._metrics_localhost_only = metrics_localhost_only
        self._runner: web.AppRunner | None = None
        self._site: web.BaseSite | None = None
        self._port = 0
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        """The bound port (the requested one, or the one picked for port 0); 0 before start()."""
        return self._port

    async def start(self, sock: socket.socket | None = None) -> None:
        """Bind (or serve on ``sock``, already listening); raise OSError naming the address if binding fails."""
        if self._runner is not None:
            raise RuntimeError("status server already started")
        app = web.Application(middlewares=[compression_middleware])
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=SHUTDOWN_TIMEOUT)
        await runner.setup()
        site: web.BaseSite
        if sock is not None:
            site = web.SockSite(runner, sock)
        else:
            site = web.TCPSite(runner, self._host, self._requested_port)
        try:
            await site.start()
        except OSError as err:
            await runner.cleanup()
            raise OSError(
                err.errno,
                f"status server cannot listen on {self._host}:{self._requested_port}: {err.strerror}",
            ) from None
        self._runner, self._site = runner, site
        addresses: list[Any] = runner.addresses
        self._port = int(addresses[0][1]) if addresses else self._requested_port
        log.info("status server listening on %s:%d", self._host, self._port)

    @property
    def protocol_factory(self) -> Callable[[], asyncio.Protocol]:
        """aiohttp's protocol factory, for connections accepted before this server started (status/early.py)."""
        if self._runner is None or self._runner.server is None:
            raise RuntimeError("status server not started")
        server = self._runner.server
        return lambda: server()

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
    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if path == "/healthz/ready":
            return await self._ready(request)
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
        return _text(404, NOT_FOUND)

    async def _ready(self, request: web.Request) -> web.Response:
        error = await self._readiness.check()
        if error is None:
            return web.Response(status=200)
        # Istio answers 503 with an empty body; the reason is what users look for, so we send it.
        return _text(503, error + "\n")

    def _local_post_error(self, request: web.Request) -> web.Response | None:
        if not is_loopback(request.remote):
            return _text(403, FORBIDDEN)
        if request.method != hdrs.METH_POST:
            return _text(405, METHOD_NOT_ALLOWED)
        return None

    async def _send_ok(self, request: web.Request) -> web.Response:
        """Write ``200 OK`` completely before acting, so the caller sees the answer even if we exit."""
        response = _text(200, "OK")
        await response.prepare(request)
        await response.write_eof()
        return response

    async def _quit(self, request: web.Request) -> web.StreamResponse:
        error = self._local_post_error(request)
        if error is not None:
            return error
        response = await self._send_ok(request)
        log.info("handling /quitquitquit, notifying pilot-agent to exit")
        if self._on_quit is not None:
            try:
                self._on_quit()
            except Exception:
                log.exception("/quitquitquit callback failed")
        return response

    async def _drain(self, request: web.Request) -> web.StreamResponse:
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
        except Exception:
            log.exception("/drain callback failed")

    def _ndsz(self, request: web.Request) -> web.Response:
        if not is_loopback(request.remote):
            return _text(403, FORBIDDEN)
        view = self._ndsz_view() if self._ndsz_view is not None else None
        if view is None:  # DNS proxy off, or no table yet
            return web.Response(status=404, text="{}", content_type="application/json")
        return web.Response(text=json.dumps(view, indent=2), content_type="application/json")
