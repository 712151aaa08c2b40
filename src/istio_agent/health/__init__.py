"""Workload health checks for VMs: ProxyConfig ``readinessProbe`` -> probers -> xDS health events.

Modules: ``config`` (parse the probe), ``probes`` (HTTP, TCP, gRPC, exec), ``checker`` (the loop).
Nothing is imported here, so parsing the configuration at start-up does not load the HTTP client.
"""
