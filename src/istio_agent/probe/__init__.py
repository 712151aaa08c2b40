"""Probing the application: the checks of kubelet's app probes and of the VM health checks.

One prober per kind of check, used by both callers:

- ``source``: probe sockets bound to 127.0.0.6 / ``::6``, and the fallback where that cannot reach;
- ``http_get``: GET with redirects, HTTP/1.1, or HTTP/2 when an HTTPS app picks it via ALPN;
- ``tcp``: a connection opens; ``grpc_health``: ``grpc.health.v1.Health/Check``; ``command``: exec.

and one adapter per caller:

- ``kubelet``: ``/app-health/...`` on the status port, the app's answer as an HTTP status;
- ``workload``: VM health checks, each outcome with Istio's error text, for ``health.checker``.

Nothing is imported here: the status server loads these on the first app probe.
"""
