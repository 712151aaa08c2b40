"""The agent's Prometheus metrics, named as Istio's (``istio_agent_<name>``).

Istio exports its agent counters without the ``_total`` suffix (OpenCensus naming), and dashboards
query those names. prometheus-client always appends ``_total`` to a Counter, so counters here are
monotonic Gauges: the exposition name stays exactly Istio's. All metrics live in ``REGISTRY``,
which the status server merges into its scrape output.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Gauge, Histogram

PREFIX = "istio_agent_"
REGISTRY = CollectorRegistry(auto_describe=True)


def counter(name: str, documentation: str, labelnames: Sequence[str] = ()) -> Gauge:
    """A monotonically increasing metric; call ``.inc()`` only."""
    return Gauge(PREFIX + name, documentation, labelnames, registry=REGISTRY)


def gauge(name: str, documentation: str, labelnames: Sequence[str] = ()) -> Gauge:
    return Gauge(PREFIX + name, documentation, labelnames, registry=REGISTRY)


def histogram(
    name: str, documentation: str, labelnames: Sequence[str] = (), buckets: Sequence[float] | None = None
) -> Histogram:
    if buckets is None:
        return Histogram(PREFIX + name, documentation, labelnames, registry=REGISTRY)
    return Histogram(PREFIX + name, documentation, labelnames, registry=REGISTRY, buckets=buckets)


def sample(name: str, labels: dict[str, str] | None = None) -> float:
    """Current value of a metric sample (0 when never set); for tests and status output."""
    value = REGISTRY.get_sample_value(PREFIX + name, labels or {})
    return value or 0.0
