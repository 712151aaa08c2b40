"""gRPC for the agent on grpclib: pure Python over h2, the HTTP/2 library the agent already loads.

grpcio's C core costs ~10 MB of the agent's memory and cannot serve a socket bound by someone else
(the agent binds Envoy's sockets before Envoy starts, docs/architecture.md). grpclib does both, but
leaves to its user what a server reachable by every local process needs: a deadline for the
HTTP/2 handshake, closing idle connections, a policy for clients' pings and a maximum message
size. :mod:`istio_agent.rpc.server` adds them; :mod:`istio_agent.rpc.call` is the call as the
agent's handlers see it.

grpcio stays in the tests, as the client and server real applications use.
"""

from grpclib.const import Status

__all__ = ["Status"]
