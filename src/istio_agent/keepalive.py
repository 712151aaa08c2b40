"""gRPC keepalive as Istio sets it: the one place that says what the agent's channels and servers do.

Istio's client pings after ``interval`` without activity and drops a connection whose ping is not
answered within ``timeout`` (``pilot/pkg/grpc/grpc.go`` ``ClientOptions``; the values are
GRPC_KEEPALIVE_INTERVAL and GRPC_KEEPALIVE_TIMEOUT, ``config/xds.py``). An idle ADS stream sends no
data for long periods and is pinged all the same. Its servers ping the same way and, so that such
clients are not turned away, accept a client's pings down to half the interval
(``ServerOptions``: ``EnforcementPolicy{MinTime: Time / 2}``). gRPC's C-core default allows one
ping per 5 minutes on a connection that carries no data, and answers the third early ping with
``GOAWAY ENHANCE_YOUR_CALM ("too_many_pings")``, which ends every stream on it: an idle ADS stream
with 30 s pings was reset every 90-120 s before the servers set this.

The agent's channels (:class:`istio_agent.rpc.channel.Channel`) and servers
(:class:`istio_agent.rpc.server.RpcServer`) are grpclib's, configured from these rules.
"""

from __future__ import annotations

MIN_CLIENT_PING_FRACTION = 0.5
"""A server accepts a client's pings down to this fraction of its own keepalive interval."""


def min_client_ping_interval(interval: float) -> float:
    """Seconds a server lets pass between a client's pings before they count as too many."""
    return interval * MIN_CLIENT_PING_FRACTION
