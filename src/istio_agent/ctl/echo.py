"""A tiny HTTP application for demos and end-to-end tests: it answers with what it received.

The interesting part of the answer is the request headers, in particular
``x-forwarded-client-cert``: the callee's Envoy sets it to the caller's verified SPIFFE identity,
so the demo can show who called whom across the mesh. Run as
``python -m istio_agent.ctl.echo --name b --port 18080``.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from aiohttp import web


def make_app(name: str) -> web.Application:
    """The echo application: ``/metrics`` is Prometheus text, every other path a JSON echo of the request."""
    served = 0

    async def metrics(_request: web.Request) -> web.Response:
        text = (
            "# HELP echo_requests_total Requests the echo app answered.\n"
            "# TYPE echo_requests_total counter\n"
            f'echo_requests_total{{app="{name}"}} {served}\n'
        )
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def echo(request: web.Request) -> web.Response:
        nonlocal served
        served += 1
        body = await request.read()
        return web.json_response(
            {
                "app": name,
                "method": request.method,
                "path": request.path_qs,
                "headers": dict(request.headers),
                "body_bytes": len(body),
            }
        )

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_route("*", "/{tail:.*}", echo)
    return app


async def serve(name: str, host: str, port: int) -> None:
    """Serve until SIGINT/SIGTERM; prints one line once the port accepts connections."""
    runner = web.AppRunner(make_app(name), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    print(f"echo app {name!r} listening on {host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="echo", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--name", required=True, help="name reported in every answer")
    parser.add_argument("--port", required=True, type=int, help="TCP port to listen on")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.name, args.host, args.port))


if __name__ == "__main__":
    main()
