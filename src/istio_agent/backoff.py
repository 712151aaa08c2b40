"""Exponential backoff with jitter, as Istio's agent uses for pre-warm and reconnect loops."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class ExponentialBackoff:
    """Delays of ``initial * multiplier**n`` capped at ``max_interval``, each randomised by ``±randomization``.

    Istio's defaults (500 ms, x1.5, ±50 %, 60 s cap, never gives up) keep a crowd of agents from
    hammering a recovering CA in lockstep.
    """

    initial: float = 0.5
    multiplier: float = 1.5
    randomization: float = 0.5
    max_interval: float = 60.0
    rng: Callable[[], float] = field(default=random.random, repr=False)
    _current: float = field(default=0.0, init=False, repr=False)

    def next_delay(self) -> float:
        self._current = (
            self.initial if self._current == 0 else min(self._current * self.multiplier, self.max_interval)
        )
        spread = self._current * self.randomization
        return max(0.0, self._current - spread + 2 * spread * self.rng())

    def reset(self) -> None:
        self._current = 0.0
