"""One way for tests to serve an aiohttp app on a free loopback port (the fakes of apps and Envoy)."""

from __future__ import annotations

from aiohttp import web


async def serve_app(app: web.Application, shutdown_timeout: float = 60.0) -> tuple[web.AppRunner, int]:
    """Start ``app`` on 127.0.0.1 and a port the kernel picks; the caller cleans the runner up."""
    runner = web.AppRunner(app, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, int(runner.addresses[0][1])
