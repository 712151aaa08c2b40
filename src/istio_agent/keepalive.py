"""gRPC keepalive as Istio sets it, for the agent's channels and for every gRPC server of ours.

Istio's client pings after ``interval`` without activity and drops a connection whose ping is not
answered within ``timeout`` (``pilot/pkg/grpc/grpc.go`` ``ClientOptions``). Its servers ping the
same way and, so that such clients are not turned away, accept a client's pings down to half the
interval (``ServerOptions``: ``EnforcementPolicy{MinTime: Time / 2}``). gRPC's C-core default
allows one ping per 5 minutes on a connection that carries no data, and answers the third
early ping with ``GOAWAY ENHANCE_YOUR_CALM ("too_many_pings")``, which ends every stream on it: an
idle ADS stream with 30 s pings was reset every 90-120 s before the servers set this.
"""

from __future__ import annotations

from datetime import timedelta

GrpcOptions = list[tuple[str, int]]

# C-core's channel argument names (grpc/impl/channel_arg_names.h). A misspelt name is ignored
# silently, so they are written once, here.
_TIME = "grpc.keepalive_time_ms"
_TIMEOUT = "grpc.keepalive_timeout_ms"
_MIN_RECV_PING_INTERVAL = "grpc.http2.min_ping_interval_without_data_ms"


def _ms(value: timedelta) -> int:
    return int(value.total_seconds() * 1000)


def client_options(interval: timedelta, timeout: timedelta) -> GrpcOptions:
    """A channel's keepalive: ping after ``interval`` of silence, give up after ``timeout``."""
    return [(_TIME, _ms(interval)), (_TIMEOUT, _ms(timeout))]


def server_options(interval: timedelta, timeout: timedelta) -> GrpcOptions:
    """A server's keepalive: its own pings as a client's, and clients' pings accepted down to ``interval / 2``."""
    return [*client_options(interval, timeout), (_MIN_RECV_PING_INTERVAL, _ms(interval) // 2)]
