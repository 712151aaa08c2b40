"""istio-agent: a Python implementation of Istio's workload agent and node agent."""

__version__ = "0.1.0"

ISTIO_VERSION = "1.28.0"
"""The Istio release whose agent behaviour we follow; reported to istiod as node metadata
``ISTIO_VERSION``, which istiod uses to decide which proxy features it may configure."""
