"""The Unix sockets Envoy connects to (SDS, the xDS proxy), listening before Envoy starts.

Envoy connects to both as soon as it has read its bootstrap. A socket that is bound and listening
takes those connections into the kernel's queue while the agent is still loading and starting the
servers behind it; a socket that is not there yet would make Envoy retry after its backoff. So the
agent binds both, starts Envoy, and only then imports and starts the servers, which serve the
connections already waiting.

The SDS server runs on :class:`~istio_agent.rpc.server.RpcServer`, which serves a socket bound by
someone else: its :class:`Listener` holds the listening socket. grpcio, which the xDS proxy still
runs on, cannot adopt one (its ``add_insecure_port`` binds the path itself), so the xDS proxy's
holds a grpc server bound with the options of the server that will run on it and not started
yet. This module imports nothing of the servers (no protos, no certificates). The SDS server and
the xDS proxy take one in ``start`` or bind their own through the same functions.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Generic, TypeVar, cast

import grpc

from istio_agent import uds
from istio_agent.config.xds import XdsSettings

SDS_MAX_CONCURRENT_STREAMS = 100000


T = TypeVar("T", socket.socket, grpc.aio.Server)


class Listener(Generic[T]):
    """``path`` listening and not served yet: connections wait in the kernel's queue.

    It holds the listening socket, or (grpcio) a server bound and not started. The server that
    takes it over (``take``) owns that from then on; until then ``close`` ends it.
    """

    def __init__(self, bound: T, path: Path) -> None:
        self.path = path
        self._bound: T | None = bound

    def take(self) -> T:
        """The socket or bound server, to serve; its new owner closes it."""
        bound, self._bound = self._bound, None
        if bound is None:
            raise RuntimeError(f"the listener on {self.path} was already taken or closed")
        return bound

    async def close(self) -> None:
        """Stop listening unless a server took the listener over (then a no-op).

        grpc closes a bound port only when a started server stops, so such a server is started
        first: no handler is registered, and the queued connections are closed with the socket.
        """
        bound, self._bound = self._bound, None
        if isinstance(bound, socket.socket):
            bound.close()
        elif bound is not None:
            await bound.start()
            await bound.stop(None)


class _BindOnly:
    """The server as ``uds.start_server_on`` sees it, with a start that does nothing.

    So binding keeps its one implementation (stale file replaced, directories made, the kernel's
    reason when the bind is refused, the socket opened to every user) and serving starts later.
    """

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    def add_insecure_port(self, address: str) -> int:
        return self._server.add_insecure_port(address)

    async def start(self) -> None:
        """Serving starts when the server that takes the listener over is ready."""

    async def stop(self, grace: float | None) -> None:
        await self._server.stop(grace)


async def listen(path: Path, options: list[tuple[str, int]], what: str) -> Listener[grpc.aio.Server]:
    """A grpc server with ``options`` listening on ``path``; raises OSError naming ``what`` as binding does."""
    server = grpc.aio.server(options=options)
    await uds.start_server_on(cast(grpc.aio.Server, _BindOnly(server)), path, what)
    return Listener(server, path)


async def listen_sds(path: Path) -> Listener[socket.socket]:
    """The SDS server's socket, listening; raises OSError naming the server, the path and why."""
    return Listener(uds.listen(path, "SDS server"), path)


def xds_limits(settings: XdsSettings) -> uds.ServerLimits:
    """The xDS proxy's limits: pings every GRPC_KEEPALIVE_INTERVAL, answers within GRPC_KEEPALIVE_TIMEOUT (Istio's)."""
    return uds.ServerLimits(
        keepalive_time=settings.keepalive_interval.total_seconds(),
        keepalive_timeout=settings.keepalive_timeout.total_seconds(),
    )


def xds_options(settings: XdsSettings, limits: uds.ServerLimits) -> list[tuple[str, int]]:
    """The xDS proxy's grpc options."""
    return [
        ("grpc.max_concurrent_streams", settings.max_streams),
        ("grpc.max_receive_message_length", settings.max_recv_bytes),
        *limits.grpc_options(),
    ]


async def listen_xds(
    settings: XdsSettings, limits: uds.ServerLimits | None = None
) -> Listener[grpc.aio.Server]:
    """The xDS proxy's socket (``settings.socket_path``), listening."""
    options = xds_options(settings, limits or xds_limits(settings))
    return await listen(settings.socket_path, options, "xDS proxy")
