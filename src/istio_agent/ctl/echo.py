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

from istio_agent.http.messages import Handler, Request, Response, StreamResponse
from istio_agent.http.server import ServerRunner, TCPSite


def make_handler(name: str) -> Handler:
    """The echo application: ``/metrics`` is Prometheus text, every other path a JSON echo of the request."""
    served = 0

    async def handle(request: Request) -> StreamResponse:
        nonlocal served
        if request.path == "/metrics" and request.method in ("GET", "HEAD"):
            text = (
                "# HELP echo_requests_total Requests the echo app answered.\n"
                "# TYPE echo_requests_total counter\n"
                f'echo_requests_total{{app="{name}"}} {served}\n'
            )
            return Response(text=text, content_type="text/plain")
        served += 1
        body = await request.read()
        return Response.json(
            {
                "app": name,
                "method": request.method,
                "path": request.target,
                "headers": dict(request.headers.items()),
                "body_bytes": len(body),
            }
        )

    return handle


async def serve(name: str, host: str, port: int) -> None:
    """Serve until SIGINT/SIGTERM; prints one line once the port accepts connections."""
    runner = ServerRunner(make_handler(name))
    await TCPSite(runner, host, port).start()
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
