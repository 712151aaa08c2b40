"""Workload health checks for VMs: ProxyConfig ``readinessProbe`` -> probes -> xDS health events.

``checker`` is the loop (schedule, thresholds, transitions); the probe is parsed by
``istio_agent.config.probes`` and run by ``istio_agent.probe.workload``. Nothing is imported here,
so parsing the configuration at start-up does not load the HTTP client.
"""
