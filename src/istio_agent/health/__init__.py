"""Workload health checks for VMs: ProxyConfig ``readinessProbe`` -> probers -> xDS health events.

Modules: ``probes`` (HTTP, TCP, gRPC, exec), ``checker`` (the loop); the probe itself is parsed by
``istio_agent.config.probes``. Nothing is imported here, so parsing the configuration at start-up
does not load the HTTP client.
"""
