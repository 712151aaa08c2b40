"""The agent's own metrics registry: Istio's names, and text that Prometheus' own parser reads back."""

from __future__ import annotations

import math
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from istio_agent.metrics import Registry


def parsed(registry: Registry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample as prometheus-client (an independent implementation) parses the exposition."""
    text = registry.expose().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_counters_keep_istios_names_without_total() -> None:
    registry = Registry()
    registry.counter("num_outgoing_requests", "Requests to the CA.", ["request_type"]).labels("csr").inc()
    registry.gauge("sds_connections", "Open streams.").inc(3)
    text = registry.expose().decode()
    assert "# TYPE istio_agent_num_outgoing_requests gauge" in text
    assert 'istio_agent_num_outgoing_requests{request_type="csr"} 1.0' in text
    assert "istio_agent_sds_connections 3.0" in text
    assert registry.sample("istio_agent_num_outgoing_requests", {"request_type": "csr"}) == 1.0
    assert registry.sample("istio_agent_num_outgoing_requests", {"request_type": "other"}) is None


def test_label_values_and_help_are_escaped() -> None:
    registry = Registry()
    gauge = registry.gauge("weird", "Help with \\ and\na newline.", ["type_url"])
    gauge.labels(type_url='a"b\\c\nd').set(2)
    assert parsed(registry) == {("istio_agent_weird", (("type_url", 'a"b\\c\nd'),)): 2.0}
    assert "# HELP istio_agent_weird Help with \\\\ and\\na newline." in registry.expose().decode()


def test_histogram_buckets_are_cumulative() -> None:
    registry = Registry()
    histogram = registry.histogram("upstream_seconds", "Latency.", buckets=(0.1, 1.0))
    for value in (0.05, 0.5, 0.5, 7):
        histogram.observe(value)
    samples = parsed(registry)
    assert samples[("istio_agent_upstream_seconds_bucket", (("le", "0.1"),))] == 1
    assert samples[("istio_agent_upstream_seconds_bucket", (("le", "1.0"),))] == 3
    assert samples[("istio_agent_upstream_seconds_bucket", (("le", "+Inf"),))] == 4
    assert samples[("istio_agent_upstream_seconds_count", ())] == 4
    assert samples[("istio_agent_upstream_seconds_sum", ())] == pytest.approx(8.05)


def test_special_values_and_collectors() -> None:
    registry = Registry()
    registry.gauge("inf", "x").set(math.inf)
    registry.gauge("nan", "x").set(math.nan)

    class Ints:
        def collect(self):  # type: ignore[no-untyped-def]
            from istio_agent.metrics import Family

            family = Family("istio_agent_plain", "Kept as an int.", "gauge")
            family.add(7)
            yield family

    collector = Ints()
    registry.register(collector)
    samples = parsed(registry)
    assert samples[("istio_agent_inf", ())] == math.inf
    assert math.isnan(samples[("istio_agent_nan", ())])
    assert samples[("istio_agent_plain", ())] == 7
    registry.unregister(collector)
    registry.unregister(collector)  # twice is harmless
    assert ("istio_agent_plain", ()) not in parsed(registry)


def test_mistakes_are_refused() -> None:
    registry = Registry()
    gauge = registry.gauge("labelled", "x", ["a", "b"])
    with pytest.raises(ValueError, match="2 label values needed"):
        gauge.labels("only-one")
    with pytest.raises(ValueError, match="labels must be"):
        gauge.labels(a="1", c="2")
    with pytest.raises(ValueError, match=r"use \.labels"):
        gauge.inc()
    assert registry.gauge("labelled", "same metric", ["a", "b"]) is gauge  # one series set per name
    with pytest.raises(ValueError, match="already registered as a gauge with labels"):
        registry.gauge("labelled", "other labels", ["a"])
    with pytest.raises(ValueError, match="already registered"):
        registry.histogram("labelled", "another kind")


def test_increments_from_many_threads_are_not_lost() -> None:
    registry = Registry()
    counter = registry.counter("hits", "x")

    def hammer() -> None:
        for _ in range(10_000):
            counter.inc()

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert registry.sample("istio_agent_hits") == 40_000
