"""Keeping Envoy running: one run, or (beyond Istio, ``ENVOY_RESTART_ON_EXIT``) restarts with backoff.

Istio starts Envoy once and leaves recovery to the container's restart policy. A VM has no such
policy, so with ``restart=True`` an Envoy that exits on its own (crash, OOM kill, a stray SIGKILL)
is started again after an exponential backoff that resets once a run has lasted ``stable_after``
seconds. Each run gets a fresh bootstrap from ``launch`` (a generated file is deleted when its
Envoy exits). A stop (SIGTERM, ``/quitquitquit``) ends the loop at any point, even mid-backoff.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from istio_agent import goformat
from istio_agent.backoff import ExponentialBackoff
from istio_agent.envoy.process import EnvoyProcess
from istio_agent.log import scope
from istio_agent.metrics import Registry

log = scope("envoy")

RESTART_STABLE_AFTER = 60.0  # a run this long resets the backoff


Launcher = Callable[[], Awaitable[EnvoyProcess]]
"""Prepare one run of Envoy (writing its bootstrap) and return it, not yet started."""


class _SupervisorMetrics:
    """The Envoy supervisor's metrics."""

    def __init__(self, registry: Registry) -> None:
        self.restarts = registry.counter(
            "envoy_restarts",
            "Times the agent restarted Envoy after it exited on its own (ENVOY_RESTART_ON_EXIT).",
        )


class EnvoySupervisor:
    """Runs Envoy through ``launch`` and, when ``restart`` is set, starts it again when it exits on its own."""

    def __init__(
        self,
        launch: Launcher,
        *,
        restart: bool = False,
        backoff: ExponentialBackoff | None = None,
        stable_after: float = RESTART_STABLE_AFTER,
        registry: Registry,
    ) -> None:
        self._metrics = _SupervisorMetrics(registry)
        self._launch = launch
        self._restart = restart
        self._backoff = backoff or ExponentialBackoff(initial=1.0, multiplier=2.0, max_interval=60.0)
        self._stable_after = stable_after
        self._current: EnvoyProcess | None = None
        self._loop_task: asyncio.Task[int] | None = None
        self._stopping = asyncio.Event()
        self.restarts = 0

    @property
    def current(self) -> EnvoyProcess | None:
        """The Envoy of the latest run (None before ``start``)."""
        return self._current

    @property
    def pid(self) -> int | None:
        return self._current.pid if self._current else None

    @property
    def returncode(self) -> int | None:
        """Exit status of the latest run, None while it runs."""
        return self._current.returncode if self._current else None

    async def start(self) -> None:
        """Start the first run; raise EnvoyStartError when Envoy cannot be executed at all."""
        if self._loop_task is not None:
            raise RuntimeError("Envoy supervisor already started")
        process = await self._launch()
        await process.start()
        self._current = process
        self._loop_task = asyncio.get_running_loop().create_task(
            self._supervise(process), name="envoy-supervisor"
        )

    async def wait(self) -> int:
        """Wait until Envoy has exited for good (no restart follows) and return its last exit status."""
        if self._loop_task is None:
            raise RuntimeError("Envoy was not started")
        return await asyncio.shield(self._loop_task)

    async def drain_listeners(self, *, skip_exit: bool = False) -> None:
        """Ask the running Envoy to drain its listeners (see ``EnvoyProcess.drain_listeners``)."""
        if self._current is not None and not self._current.exited:
            await self._current.drain_listeners(skip_exit=skip_exit)

    async def drain_and_stop(self, graceful_drain: bool = True) -> int | None:
        """Stop for good: no more restarts; drain and kill the running Envoy (if any). Returns its status."""
        self._stopping.set()
        if self._loop_task is None:
            return None
        process = self._current
        if process is not None and not process.exited:
            await process.drain_and_stop(graceful_drain=graceful_drain)
        return await self.wait()

    async def _supervise(self, process: EnvoyProcess) -> int:
        loop = asyncio.get_running_loop()
        started = loop.time()
        while True:
            code = await process.wait()
            if self._stopping.is_set() or not self._restart:
                return code
            if loop.time() - started >= self._stable_after:
                self._backoff.reset()
            delay = self._backoff.next_delay()
            log.warning("Envoy exited (%s); restarting it in %.1fs", goformat.exit_text(code), delay)
            if await self._stopped_within(delay):
                return code
            try:
                replacement = await self._launch()
                await replacement.start()
            except OSError as err:  # the binary vanished (EnvoyStartError), the bootstrap cannot be written
                log.error("Restarting Envoy failed: %s", err)
                started = loop.time()
                continue  # back off again; `code` stays the last real exit
            self._current, process = replacement, replacement
            started = loop.time()
            self.restarts += 1
            self._metrics.restarts.inc()
            log.info("Envoy restarted (pid %s, restart %d)", replacement.pid, self.restarts)
            if self._stopping.is_set():  # a stop arrived while it was starting
                await replacement.kill()

    async def _stopped_within(self, delay: float) -> bool:
        """Wait ``delay`` seconds unless a stop comes first; True if it did."""
        try:
            async with asyncio.timeout(delay):
                await self._stopping.wait()
        except TimeoutError:
            return False
        return True
