"""The agent's metrics, named as Istio's (``istio_agent_<name>``), and their Prometheus text exposition.

Istio exports its agent counters without the ``_total`` suffix (OpenCensus naming) and dashboards
query those names, so a counter here is exposed as a monotonic gauge: the name stays exactly Istio's.

This is a small registry of our own rather than prometheus-client: the agent needs gauges, one
histogram, a collector hook for counters kept as plain integers on hot paths (DNS), and the text
format 0.0.4 that the status server merges with Envoy's and the application's metrics. That is a
couple of hundred lines, where prometheus-client costs an idle sidecar 3 MB of memory (it loads an
HTTP server, WSGI and urllib with it).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, cast

PREFIX = "istio_agent_"
DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
"""Prometheus' usual latency buckets, in seconds."""

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Labels
    value: float


@dataclass
class Family:
    """One metric as exposed: ``# HELP``, ``# TYPE`` and its samples."""

    name: str
    documentation: str
    type: str  # "gauge", "counter" or "histogram"
    samples: list[Sample] = field(default_factory=list)

    def add(self, value: float, labels: Labels = (), suffix: str = "") -> None:
        self.samples.append(Sample(self.name + suffix, labels, value))


class Collector(Protocol):
    """Anything that produces families when the registry is scraped (e.g. counters kept as plain ints)."""

    def collect(self) -> Iterable[Family]: ...


class _Value:
    """One time series; updates may come from any thread."""

    __slots__ = ("_lock", "value")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        with self._lock:
            self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        with self._lock:
            self.value -= amount

    def set(self, value: float) -> None:
        self.value = float(value)


class _Buckets:
    """One histogram series: cumulative counts per upper bound, plus sum and count."""

    __slots__ = ("_bounds", "_lock", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._lock = threading.Lock()
        self._bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        with self._lock:
            self.sum += value
            for index, bound in enumerate(self._bounds):
                if value <= bound:
                    self.counts[index] += 1
                    break


class _Metric:
    """What gauges and histograms share: a name, help text and one series per label combination."""

    type = ""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._series: dict[tuple[str, ...], object] = {}
        self._lock = threading.Lock()
        if not self.labelnames:
            self._series[()] = self._new_series()

    def _new_series(self) -> object:
        raise NotImplementedError

    def collect(self) -> Family:
        raise NotImplementedError

    def _child(self, *values: object, **by_name: object) -> object:
        if by_name:
            if values or set(by_name) != set(self.labelnames):
                raise ValueError(f"{self.name}: labels must be {self.labelnames}, got {sorted(by_name)}")
            values = tuple(by_name[name] for name in self.labelnames)
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: {len(self.labelnames)} label values needed, got {len(values)}")
        key = tuple(str(value) for value in values)
        series = self._series.get(key)
        if series is None:
            with self._lock:
                series = self._series.setdefault(key, self._new_series())
        return series

    def _only(self) -> object:
        if self.labelnames:
            raise ValueError(f"{self.name} has labels {self.labelnames}: use .labels(...)")
        return self._series[()]

    def _items(self) -> list[tuple[Labels, object]]:
        with self._lock:
            series = list(self._series.items())
        return [(tuple(zip(self.labelnames, key, strict=True)), value) for key, value in sorted(series)]


class Gauge(_Metric):
    """A value that goes up and down (or, made by :meth:`Registry.counter`, only up)."""

    type = "gauge"

    def _new_series(self) -> _Value:
        return _Value()

    def labels(self, *values: object, **by_name: object) -> _Value:
        child = self._child(*values, **by_name)
        assert isinstance(child, _Value)
        return child

    def inc(self, amount: float = 1.0) -> None:
        self._value().inc(amount)

    def dec(self, amount: float = 1.0) -> None:
        self._value().dec(amount)

    def set(self, value: float) -> None:
        self._value().set(value)

    @property
    def value(self) -> float:
        """The current value of a metric without labels (``.labels(...).value`` with them)."""
        return self._value().value

    def _value(self) -> _Value:
        value = self._only()
        assert isinstance(value, _Value)
        return value

    def collect(self) -> Family:
        family = Family(self.name, self.documentation, self.type)
        for labels, series in self._items():
            assert isinstance(series, _Value)
            family.add(series.value, labels)
        return family


class Histogram(_Metric):
    """Observations counted into buckets (cumulative ``_bucket{le=...}``, ``_sum`` and ``_count``)."""

    type = "histogram"

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float]
    ) -> None:
        self.bounds = (*sorted(float(bound) for bound in buckets if bound != math.inf), math.inf)
        super().__init__(name, documentation, labelnames)

    def _new_series(self) -> _Buckets:
        return _Buckets(self.bounds)

    def labels(self, *values: object, **by_name: object) -> _Buckets:
        child = self._child(*values, **by_name)
        assert isinstance(child, _Buckets)
        return child

    def observe(self, value: float) -> None:
        series = self._only()
        assert isinstance(series, _Buckets)
        series.observe(value)

    def collect(self) -> Family:
        family = Family(self.name, self.documentation, self.type)
        for labels, series in self._items():
            assert isinstance(series, _Buckets)
            cumulative = 0
            for bound, count in zip(self.bounds, series.counts, strict=True):
                cumulative += count
                family.add(cumulative, (*labels, ("le", format_value(bound))), "_bucket")
            family.add(cumulative, labels, "_count")
            family.add(series.sum, labels, "_sum")
        return family


_MetricT = TypeVar("_MetricT", bound=_Metric)


class Registry:
    """The metrics of one agent (tests make their own), exposed as Prometheus text."""

    def __init__(self, prefix: str = PREFIX) -> None:
        self.prefix = prefix
        """Put before every name: ``istio_agent_`` for the agent, ``istio_`` for install-cni (``istio_cni_...``)."""
        self._metrics: dict[str, _Metric] = {}
        self._collectors: list[Collector] = []
        self._lock = threading.Lock()

    def gauge(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Gauge:
        return self._add(Gauge(self.prefix + name, documentation, labelnames))

    def counter(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Gauge:
        """A monotonically increasing metric (call ``.inc()`` only), exposed as a gauge under Istio's name."""
        return self.gauge(name, documentation, labelnames)

    def histogram(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = DEFAULT_BUCKETS,
    ) -> Histogram:
        return self._add(Histogram(self.prefix + name, documentation, labelnames, buckets))

    def _add(self, metric: _MetricT) -> _MetricT:
        """Register ``metric``, or return the one of that name already registered if it is the same kind.

        So every instance of a subsystem built on one registry counts into the same series, as
        module-level metrics would, while a test gives its instance a registry of its own.
        """
        with self._lock:
            existing = self._metrics.get(metric.name)
            if existing is None:
                self._metrics[metric.name] = metric
                return metric
        if type(existing) is not type(metric) or existing.labelnames != metric.labelnames:
            raise ValueError(
                f"metric {metric.name} is already registered as a {existing.type} with labels {existing.labelnames}"
            )
        return cast(_MetricT, existing)  # the same class as metric, checked above

    def register(self, collector: Collector) -> None:
        with self._lock:
            self._collectors.append(collector)

    def unregister(self, collector: Collector) -> None:
        """Stop collecting from ``collector`` (nothing happens if it was not registered)."""
        with self._lock:
            if collector in self._collectors:
                self._collectors.remove(collector)

    def families(self) -> Iterator[Family]:
        with self._lock:
            metrics, collectors = list(self._metrics.values()), list(self._collectors)
        for metric in metrics:
            yield metric.collect()
        for collector in collectors:
            yield from collector.collect()

    def expose(self) -> bytes:
        """Prometheus text format 0.0.4."""
        lines: list[str] = []
        for family in self.families():
            lines.append(f"# HELP {family.name} {_escape_help(family.documentation)}")
            lines.append(f"# TYPE {family.name} {family.type}")
            for sample in family.samples:
                labels = ",".join(f'{key}="{_escape_label(value)}"' for key, value in sample.labels)
                series = f"{sample.name}{{{labels}}}" if labels else sample.name
                lines.append(f"{series} {format_value(sample.value)}")
        return ("\n".join(lines) + "\n").encode() if lines else b""

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """The value of one sample by its full name (``istio_agent_...``), or None when there is none."""
        wanted = sorted((labels or {}).items())
        for family in self.families():
            for sample in family.samples:
                if sample.name == name and sorted(sample.labels) == wanted:
                    return sample.value
        return None


def format_value(value: float) -> str:
    """A sample value as Prometheus' text format writes it (``+Inf``, ``NaN``, else the float's repr)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_label(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


REGISTRY = Registry()
"""The process's default registry: what a subsystem counts into when it is given none (the agent
gives each subsystem its own registry; tests give theirs)."""
