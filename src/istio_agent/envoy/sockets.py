"""The Unix sockets Envoy connects to (SDS, the xDS proxy), listening before Envoy starts.

Envoy connects to both as soon as it has read its bootstrap. A socket that is bound and listening
takes those connections into the kernel's queue while the agent is still loading and starting the
servers behind it; a socket that is not there yet would make Envoy retry after its backoff. So the
agent binds both, starts Envoy, and only then imports and starts the servers, which serve the
connections already waiting.

Both servers run on :class:`~istio_agent.rpc.server.RpcServer`, which serves a socket bound by
someone else: a :class:`Listener` holds the listening socket until its server takes it. This
module imports nothing of the servers (no protos, no certificates, no gRPC). The SDS server and
the xDS proxy take one in ``start`` or bind their own through the same functions.
"""

from __future__ import annotations

import socket
from pathlib import Path

from istio_agent import uds
from istio_agent.config.xds import XdsSettings

SDS_MAX_CONCURRENT_STREAMS = 100000


class Listener:
    """A Unix socket listening on ``path`` and not served yet: connections wait in the kernel's queue.

    The server that takes it over (``take``) owns the socket from then on; until then ``close`` ends it.
    """

    def __init__(self, sock: socket.socket, path: Path) -> None:
        self.path = path
        self._sock: socket.socket | None = sock

    def take(self) -> socket.socket:
        """The listening socket, to serve; its new owner closes it."""
        sock, self._sock = self._sock, None
        if sock is None:
            raise RuntimeError(f"the listener on {self.path} was already taken or closed")
        return sock

    async def close(self) -> None:
        """Stop listening (queued connections are closed, the file removed) unless a server took it over."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
            self.path.unlink(missing_ok=True)


async def listen_sds(path: Path) -> Listener:
    """The SDS server's socket, listening; raises OSError naming the server, the path and why."""
    return Listener(uds.listen(path, "SDS server"), path)


def xds_limits(settings: XdsSettings) -> uds.ServerLimits:
    """The xDS proxy's limits: pings every GRPC_KEEPALIVE_INTERVAL, answers within GRPC_KEEPALIVE_TIMEOUT (Istio's)."""
    return uds.ServerLimits(
        keepalive_time=settings.keepalive_interval.total_seconds(),
        keepalive_timeout=settings.keepalive_timeout.total_seconds(),
    )


async def listen_xds(settings: XdsSettings) -> Listener:
    """The xDS proxy's socket (``settings.socket_path``), listening."""
    return Listener(uds.listen(settings.socket_path, "xDS proxy"), settings.socket_path)
