"""An independent HTTP server (aiohttp) on loopback for the client tests: the "aio" fixture."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

Serve = Callable[..., Awaitable[int]]
"""Starts a server for a handler (any path; TCPSite options as keywords); returns its port."""


@pytest.fixture(name="aio")
async def aio_fixture() -> AsyncIterator[Serve]:
    runners: list[web.AppRunner] = []

    async def start(handler: Callable[[web.Request], Awaitable[web.StreamResponse]], **site: object) -> int:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        runner = web.AppRunner(app, shutdown_timeout=0.5)
        await runner.setup()
        tcp = web.TCPSite(runner, "127.0.0.1", 0, **site)  # type: ignore[arg-type]
        await tcp.start()
        runners.append(runner)
        return int(runner.addresses[0][1])

    yield start
    for runner in runners:
        await runner.cleanup()
