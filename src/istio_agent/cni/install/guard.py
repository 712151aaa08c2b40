"""Not fighting another component over the CNI config: Istio's throttle, and our back-off when a fight is certain.

When two agents each rewrite the same file (Cilium with ``cni.exclusive=true`` drops every entry
it did not write, cilium#30614, istio#49538), Istio's install-cni re-inserts its entry forever,
throttled to about once a second, logging a warning and never becoming ready. :class:`ConflictGuard`
notices the pattern (our entry removed again and again within a window), and install-cni then
stops editing the file for a growing back-off: one clear log line, a metric and a readiness
reason, instead of a rewrite loop that hides what is wrong.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from istio_agent.log import scope

log = scope("cni-agent")


class Throttle:
    """Istio's reconcile throttle: a pass at most every ``interval``, delaying by at most ``max_sleep``."""

    def __init__(
        self,
        interval: float = 5.0,
        max_sleep: float = 1.0,
        warn_after: int = 5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._interval = interval
        self._max_sleep = max_sleep
        self._warn_after = warn_after
        self._clock = clock
        self._next = 0.0
        self._hits = 0

    async def wait(self, path: str) -> None:
        now = self._clock()
        if now < self._next:
            self._hits += 1
            if self._hits > self._warn_after:
                hint = (
                    " Hint: Cilium CNI was detected; ensure 'cni.exclusive=false' in the Cilium configuration."
                    if "cilium" in path
                    else ""
                )
                log.warning(
                    "Configuration has been reconciled multiple times in a short period of time. This may be due "
                    "to a conflicting component constantly reverting our work.%s",
                    hint,
                )
            await asyncio.sleep(min(self._next - now, self._max_sleep))
        else:
            self._hits = 0
        self._next = max(self._clock(), self._next) + self._interval


@dataclass(frozen=True)
class GuardSettings:
    """When a run of repairs is a fight, and how long to stay out of it."""

    repairs: int = 5
    """Repairs of the same file within ``window`` that make a fight."""
    window: float = 60.0
    backoff: float = 30.0
    """The first back-off; each fight right after a back-off doubles it, up to ``max_backoff``."""
    max_backoff: float = 600.0


class ConflictGuard:
    """Counts repairs of a file we had written; says when to stop repairing and for how long."""

    def __init__(
        self, settings: GuardSettings = GuardSettings(), clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self._clock = clock
        self._repairs: deque[float] = deque()
        self._backoff = settings.backoff
        self._until = 0.0
        self._probing = False
        """A back-off has ended: the next repair is the one retry."""
        self._retried_at = float("-inf")

    def record_repair(self) -> float | None:
        """Record that our entry has to be put back; the back-off to observe now, or None to repair."""
        now = self._clock()
        window = self.settings.window
        if self._probing:
            self._probing = False
            self._retried_at = now
            return None
        if now - self._retried_at <= window:
            return self._start(now)  # removed again right after the retry: the other side is still at it
        if self._retried_at > float("-inf"):
            self._retried_at = float("-inf")
            self._backoff = self.settings.backoff  # quiet for a window after the retry: start over
        while self._repairs and now - self._repairs[0] > window:
            self._repairs.popleft()
        self._repairs.append(now)
        if len(self._repairs) >= self.settings.repairs:
            return self._start(now)
        return None

    def _start(self, now: float) -> float:
        duration = self._backoff
        self._backoff = min(self._backoff * 2, self.settings.max_backoff)
        self._until = now + duration
        self._probing = True
        self._repairs.clear()
        return duration

    def remaining(self) -> float:
        """Seconds left of the current back-off (0 when not backing off)."""
        return max(0.0, self._until - self._clock())

    def repairs_in_window(self) -> int:
        return len(self._repairs)
