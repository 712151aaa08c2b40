"""The VM health-check loop: probe on a schedule, report state changes (Istio's
``pkg/istio-agent/health/health_check.go``).

Istiod only needs to hear about transitions (it keeps the WorkloadEntry's ``Healthy`` condition),
so the checker never heartbeats: it emits an event when a run of consecutive successes or failures
reaches its threshold *and* the state differs from the last one emitted. Istio dereferences a nil
error when a prober is unhealthy without one (gRPC NOT_SERVING); here that gets a placeholder.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence

from istio_agent.config.probes import ReadinessProbeConfig
from istio_agent.log import scope
from istio_agent.metrics import Registry
from istio_agent.probe.workload import HealthProber, ProbeOutcome, ProbeResult

log = scope("healthcheck")

UNHEALTHY_PLACEHOLDER = "health check failed without an error message"


class _CheckerMetrics:
    """The health checker's metrics."""

    def __init__(self, registry: Registry) -> None:
        self.events = registry.counter(
            "workload_health_events",
            "Workload health state changes reported to the control plane.",
            ["healthy"],
        )


class HealthChecker:
    """Runs the probers (first failure wins) and calls ``on_event(healthy, message)`` on transitions.

    ``message`` is empty when healthy. ``on_event`` is called on the event loop and must not block;
    an exception from it is logged and the loop goes on.
    """

    def __init__(
        self,
        config: ReadinessProbeConfig,
        probers: Sequence[HealthProber],
        on_event: Callable[[bool, str], None],
        *,
        registry: Registry,
    ) -> None:
        self._config = config
        self._metrics = _CheckerMetrics(registry)
        self._probers = list(probers)
        self._on_event = on_event
        self._stopped = asyncio.Event()
        self._successes = 0
        self._failures = 0
        self._bugs_logged: set[str] = set()
        self._last: bool | None = None  # last state emitted; None before the first event

    @property
    def healthy(self) -> bool | None:
        """The last state reported, ``None`` before the first event."""
        return self._last

    def stop(self) -> None:
        """End ``run()`` at its next wait (an in-flight probe is cancelled)."""
        self._stopped.set()

    async def run(self) -> None:
        """Wait the initial delay, probe at once, then once per period until ``stop()``."""
        loop = asyncio.get_running_loop()
        if not await self._wait(self._config.initial_delay):
            return
        period = self._config.period
        start = loop.time()
        ticks = 0
        while not self._stopped.is_set():
            outcome = await self._probe_unless_stopped()
            if outcome is None:
                return
            self._record(outcome)
            # A fixed-rate schedule like a ticker: a slow probe skips the ticks it overran.
            elapsed = loop.time() - start
            ticks = max(ticks + 1, int(elapsed // period) + 1)
            if not await self._wait(start + ticks * period - loop.time()):
                return

    async def _wait(self, seconds: float) -> bool:
        """False when stopped during the wait."""
        if self._stopped.is_set():
            return False
        if seconds > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(seconds):
                    await self._stopped.wait()
        return not self._stopped.is_set()

    async def _probe_unless_stopped(self) -> ProbeOutcome | None:
        """One round of probes, or None when ``stop()`` came first (the round is cancelled)."""
        task = asyncio.ensure_future(self._probe())
        stopper = asyncio.ensure_future(self._stopped.wait())
        try:
            await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            return None
        return task.result()

    async def _probe(self) -> ProbeOutcome:
        """All probers in order; the first that is not healthy decides."""
        for prober in self._probers:
            try:
                outcome = await prober.probe(self._config.timeout)
            except Exception as err:  # a broken prober (a bug) is a failed check, not a dead checker
                reason = f"{type(err).__name__}: {err}"
                if reason not in self._bugs_logged:  # loudly once, not on every period
                    self._bugs_logged.add(reason)
                    log.exception("health prober %r failed", prober)
                outcome = ProbeOutcome(ProbeResult.UNHEALTHY, reason)
            if not outcome.healthy:
                return outcome
        return ProbeOutcome(ProbeResult.HEALTHY)

    def _record(self, outcome: ProbeOutcome) -> None:
        if outcome.healthy:
            self._successes += 1
            self._failures = 0
            if self._successes >= self._config.success_threshold and self._last is not True:
                self._successes = 0
                self._emit(True, "")
        else:
            self._failures += 1
            self._successes = 0
            if self._failures >= self._config.failure_threshold and self._last is not False:
                self._failures = 0
                self._emit(False, outcome.error or UNHEALTHY_PLACEHOLDER)

    def _emit(self, healthy: bool, message: str) -> None:
        self._last = healthy
        self._metrics.events.labels(healthy=str(healthy).lower()).inc()
        if healthy:
            log.info("workload is healthy")
        else:
            log.info("workload is unhealthy: %s", message)
        try:
            self._on_event(healthy, message)
        except Exception:
            log.exception("health event handler failed")
