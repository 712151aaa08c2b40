"""How a relayed xDS stream ends: the status Envoy gets, the metric it counts as and the log line.

Upstream failures go to Envoy with istiod's code and a text naming the upstream, so Envoy's own
backoff drives reconnection; a failure repeated on every reconnect is logged once per run.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from istio_agent.log import scope
from istio_agent.rpc import Status
from istio_agent.xds.proxy_metrics import ProxyMetrics
from istio_agent.xds.proxy_stream import ProxyStream
from istio_agent.xds.upstream import UpstreamDialer

log = scope("xdsproxy")

_EXPECTED_UNAVAILABLE = ("client disconnected", "error reading from server: EOF", "transport is closing")
_EXPECTED_ANY = (
    "stream terminated by RST_STREAM with error code: NO_ERROR",
    "received prior goaway: code: NO_ERROR",
)


class UpstreamError(Exception):
    """istiod's side of the stream failed, with the status to pass on to Envoy."""

    def __init__(self, code: Status, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class DownstreamError(Exception):
    """Envoy's side of the stream broke (read or write failed), or sent a request refused with ``code``."""

    def __init__(self, details: str, code: Status | None = None) -> None:
        super().__init__(details)
        self.code = code


@dataclass(frozen=True)
class Outcome:
    """How a downstream stream ends: the status sent to Envoy (None: Envoy is gone, send nothing)."""

    code: Status | None = Status.OK
    details: str = ""


def classify(code: Status, details: str) -> str:
    """Istio's GRPCErrorType as a metric label: ``cancelled`` (graceful or expected) or ``error``."""
    if code in (Status.OK, Status.CANCELLED, Status.DEADLINE_EXCEEDED):
        return "cancelled"
    if code == Status.UNAVAILABLE and any(text in details for text in _EXPECTED_UNAVAILABLE):
        return "cancelled"
    if any(text in details for text in _EXPECTED_ANY):
        return "cancelled"
    return "error"


class Outcomes:
    """Settles every stream of one proxy; keeps the run of failed connection attempts across them."""

    def __init__(self, metrics: ProxyMetrics, dialer: UpstreamDialer) -> None:
        self._metrics = metrics
        self._dialer = dialer
        self._failed_attempts = 0
        self._last_failure = ""

    def dial_failed(self, error: Exception) -> Outcome:
        self._metrics.istiod_failures.inc()
        self._note_failure(str(error))
        return Outcome(Status.UNAVAILABLE, f"xDS upstream {self._dialer.describe()}: {error}")

    def settle(self, stream: ProxyStream, error: BaseException | None) -> Outcome:
        """Count and log how the stream ended; the status for Envoy."""
        name = f"{stream.flavour.name} xDS stream {stream.id}"
        if stream.stopping or isinstance(error, asyncio.CancelledError):
            return Outcome(Status.OK)
        if error is None:
            self._metrics.istiod_terminations.labels(type="cancelled").inc()
            log.debug("%s: upstream %s closed the stream", name, self._dialer.address)
            return Outcome(Status.OK)
        if isinstance(error, UpstreamError):
            details = f"xDS upstream {self._dialer.describe()}: {error.details}"
            kind = classify(error.code, error.details)
            if not stream.answered:
                self._metrics.istiod_failures.inc()
                self._note_failure(f"{error.code.name}: {error.details}")
            else:
                self._metrics.istiod_terminations.labels(type=kind).inc()
                level = log.debug if kind == "cancelled" else log.warning
                level(
                    "%s: upstream %s ended the stream: %s: %s",
                    name,
                    self._dialer.address,
                    error.code.name,
                    error.details,
                )
            return Outcome(error.code, details)
        if isinstance(error, DownstreamError):
            self._metrics.envoy_terminations.labels(type="error").inc()
            log.warning("%s: Envoy side failed: %s", name, error)
            return Outcome(error.code, str(error)) if error.code is not None else Outcome(None)
        log.error("%s: internal error", name, exc_info=error)
        return Outcome(Status.INTERNAL, f"xDS proxy internal error: {type(error).__name__}")

    def connected(self) -> None:
        """istiod answered: the run of failures (if any) is over."""
        if self._failed_attempts:
            log.info("connected to %s after %d failed attempts", self._dialer.address, self._failed_attempts)
        self._failed_attempts = 0
        self._last_failure = ""

    def _note_failure(self, reason: str) -> None:
        """First failure of a run at warning; the same failure again only at debug, with a count."""
        self._failed_attempts += 1
        if self._failed_attempts == 1 or reason != self._last_failure:
            log.warning("cannot connect to xDS upstream %s: %s", self._dialer.describe(), reason)
        else:
            log.debug(
                "still cannot connect to xDS upstream %s (%d failed attempts): %s",
                self._dialer.address,
                self._failed_attempts,
                reason,
            )
        self._last_failure = reason
