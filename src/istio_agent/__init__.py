"""istio-agent: a Python implementation of Istio's workload agent and node agent."""

__version__ = "0.1.0"
