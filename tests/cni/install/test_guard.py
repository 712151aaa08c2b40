"""The conflict guard: when repeated repairs of the same file are a fight, and how long to stay out of it."""

from __future__ import annotations

import pytest

from istio_agent.cni.install.guard import ConflictGuard, GuardSettings, Throttle


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_repairs_spread_out_never_back_off() -> None:
    clock = Clock()
    guard = ConflictGuard(GuardSettings(repairs=3, window=10, backoff=5), clock)
    for _ in range(10):
        assert guard.record_repair() is None
        clock.now += 6  # at most two within any 10 s window


def test_a_burst_backs_off_retries_once_then_doubles() -> None:
    clock = Clock()
    guard = ConflictGuard(GuardSettings(repairs=3, window=10, backoff=5, max_backoff=12), clock)
    assert guard.record_repair() is None
    assert guard.record_repair() is None
    assert guard.record_repair() == 5
    assert guard.remaining() == 5
    clock.now += 5
    assert guard.remaining() == 0
    assert guard.record_repair() is None  # the one retry after the back-off
    clock.now += 1
    assert guard.record_repair() == 10  # removed again right away: twice as long
    clock.now += 10
    assert guard.record_repair() is None
    clock.now += 1
    assert guard.record_repair() == 12  # capped


def test_quiet_after_a_retry_starts_over() -> None:
    clock = Clock()
    guard = ConflictGuard(GuardSettings(repairs=2, window=10, backoff=5), clock)
    guard.record_repair()
    assert guard.record_repair() == 5
    clock.now += 5
    assert guard.record_repair() is None  # retry
    clock.now += 60  # the other side stopped
    assert guard.record_repair() is None
    assert guard.repairs_in_window() == 1
    assert guard.record_repair() == 5  # the base back-off again, not a doubled one


async def test_the_throttle_delays_and_warns_about_a_conflicting_component(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    throttle = Throttle(interval=5.0, max_sleep=0.001, warn_after=5, clock=clock)
    for _ in range(6):
        await throttle.wait("/host/etc/cni/net.d/05-cilium.conflist")  # the clock stands still: all too soon
    assert not caplog.records
    await throttle.wait("/host/etc/cni/net.d/05-cilium.conflist")
    (record,) = caplog.records
    assert "reconciled multiple times in a short period of time" in record.getMessage()
    assert "cni.exclusive=false" in record.getMessage()
    clock.now += 3600  # a quiet hour: no delay, the count starts over
    caplog.clear()
    await throttle.wait("/host/etc/cni/net.d/10-calico.conflist")
    assert not caplog.records
