"""The ``grpc`` check: ``grpc.health.v1.Health/Check`` over plaintext HTTP/2, from the probe source.

grpcio cannot bind a source address, so the call goes over ``istio_agent.http.h2client`` like the
HTTPS-h2 probes, and every gRPC probe, kubelet's and the VM's, comes from 127.0.0.6 like the rest.
The messages are the project's copy of grpc's (``protos/health.proto``: the same fields, so the same
bytes), in a package of their own so that a process which also loads grpcio-health-checking's
``grpc.health.v1`` holds both without a clash in protobuf's pool; the agent needs no grpcio for them.
"""

from __future__ import annotations

import asyncio

from google.protobuf.message import DecodeError

from istio_agent.http import h2client
from istio_agent.probe.source import ProbeSource
from istio_agent.probe.tcp import host_port
from istio_agent.protos.health_pb2 import HealthCheckRequest, HealthCheckResponse

SERVING = HealthCheckResponse.SERVING
_CHECK = "/grpc.health.v1.Health/Check"


class HealthResponseError(ValueError):
    """The application answered OK with something that is not a ``HealthCheckResponse``."""


async def check(
    source: ProbeSource,
    host: str,
    port: int,
    service: str,
    *,
    user_agent: str | None = None,
    deadline: float | None = None,
) -> int:
    """The serving status ``host:port`` reports for ``service`` (``SERVING`` is healthy).

    The server is told what is left until ``deadline`` (event-loop time: the ``when()`` of the
    caller's ``asyncio.timeout``, which enforces it) as ``grpc-timeout``. Raises ``OSError`` when
    the connection fails, ``h2client.GrpcError`` for a non-OK status, ``h2client.H2Error`` for a
    broken exchange and ``HealthResponseError`` for an answer that does not decode.
    """
    connection = await source.dial(
        host, lambda: h2client.open_connection(host, port, socket_factory=source.open_socket)
    )
    remaining = None if deadline is None else max(0.0, deadline - asyncio.get_running_loop().time())
    async with connection:
        answer = await h2client.grpc_unary(
            connection,
            _CHECK,
            HealthCheckRequest(service=service).SerializeToString(),
            authority=host_port(host, port),
            user_agent=user_agent,
            timeout=remaining,
        )
    try:
        return HealthCheckResponse.FromString(answer).status
    except DecodeError as err:
        raise HealthResponseError(f"malformed health check response: {err}") from None
