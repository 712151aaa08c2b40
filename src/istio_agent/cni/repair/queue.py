"""The controller's work queue: Istio's ``controllers.Queue`` on client-go's rate-limited workqueue.

- A key waiting in the queue is there once, however often it is added; a key added while it is
  being handled is handled again afterwards (never twice at the same time).
- One worker, as in Istio: keys are handled one at a time, in the order they became due.
- A failure is retried with client-go's per-item exponential back-off (5 ms, doubling, at most
  1000 s) until ``max_attempts`` handlings failed (Istio's repair controller: 5); then it is dropped
  with an error line, until the key is added again by a change.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Hashable

log = logging.getLogger("istio.cni-agent")

BASE_DELAY = 0.005
MAX_DELAY = 1000.0


class WorkQueue:
    """Deduplicated keys handled by one worker (:meth:`run`), failures retried with back-off."""

    def __init__(
        self,
        name: str,
        handle: Callable[[Hashable], Awaitable[None]],
        *,
        max_attempts: int,
        base_delay: float = BASE_DELAY,
        max_delay: float = MAX_DELAY,
        describe: Callable[[Hashable], str] = str,
        expected: tuple[type[Exception], ...] = (),
    ) -> None:
        self.name = name
        self._handle = handle
        self._max_attempts = max_attempts
        self._base_delay = base_delay
        self._max_delay = max_delay
        self._describe = describe
        self._expected = expected
        """Failures the handler means to report; any other exception is logged with its traceback."""
        self._queue: deque[Hashable] = deque()
        self._dirty: set[Hashable] = set()
        self._processing: set[Hashable] = set()
        self._requeues: dict[Hashable, int] = {}
        self._ready = asyncio.Event()
        self._timers: set[asyncio.TimerHandle] = set()

    def add(self, key: Hashable) -> None:
        """Have ``key`` handled (once, however many times it is added before that)."""
        if key in self._dirty:
            return
        self._dirty.add(key)
        if key not in self._processing:
            self._queue.append(key)
            self._ready.set()

    def _add_later(self, key: Hashable) -> None:
        attempts = self._requeues.get(key, 0)
        self._requeues[key] = attempts + 1
        delay = min(self._base_delay * 2**attempts, self._max_delay)
        loop = asyncio.get_running_loop()

        def due() -> None:
            self._timers.discard(timer)
            self.add(key)

        timer = loop.call_later(delay, due)
        self._timers.add(timer)

    @property
    def idle(self) -> bool:
        """Nothing waiting, being handled or due for a retry."""
        return not self._queue and not self._processing and not self._timers

    async def run(self) -> None:
        """Handle keys until cancelled."""
        try:
            while True:
                while not self._queue:
                    self._ready.clear()
                    await self._ready.wait()
                key = self._queue.popleft()
                self._dirty.discard(key)
                self._processing.add(key)
                try:
                    await self._work(key)
                finally:
                    self._processing.discard(key)
                    if key in self._dirty:
                        self._queue.append(key)
        finally:
            for timer in self._timers:
                timer.cancel()
            self._timers.clear()

    async def _work(self, key: Hashable) -> None:
        try:
            await self._handle(key)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the handler's failure: retried, as Istio's queue does
            trace = not isinstance(err, self._expected)
            attempt = self._requeues.get(key, 0) + 1
            if attempt < self._max_attempts:
                log.error(
                    "%s: error handling %s, retrying (retry count: %d): %s",
                    self.name,
                    self._describe(key),
                    attempt,
                    err,
                    exc_info=trace,
                )
                self._add_later(key)
                return
            log.error(
                "%s: error handling %s, and retry budget exceeded: %s",
                self.name,
                self._describe(key),
                err,
                exc_info=trace,
            )
        self._requeues.pop(key, None)
