"""The health-check loop: transitions only, thresholds, placeholder messages, stop()."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Sequence

import pytest
from aiohttp import web

from istio_agent.config.probes import ExecCheck, HTTPGetCheck, ReadinessProbeConfig, TCPCheck
from istio_agent.health.checker import UNHEALTHY_PLACEHOLDER, HealthChecker
from istio_agent.metrics import Registry
from istio_agent.probe.workload import HEALTHY, ProbeOutcome, ProbeResult, build_probers
from tests.aiohttp_apps import serve_app

pytestmark = pytest.mark.timeout(20)

PERIOD = 0.05


class Events:
    """Collects events; lets a test await the n-th one."""

    def __init__(self) -> None:
        self.items: list[tuple[bool, str]] = []
        self._changed = asyncio.Event()

    def __call__(self, healthy: bool, message: str) -> None:
        self.items.append((healthy, message))
        self._changed.set()

    async def wait_for(self, count: int) -> None:
        async with asyncio.timeout(10):
            while len(self.items) < count:
                self._changed.clear()
                await self._changed.wait()


class Scripted:
    """A prober replaying outcomes, then repeating the last; signals each probe."""

    def __init__(self, outcomes: Sequence[ProbeOutcome]) -> None:
        self._outcomes = list(outcomes)
        self.calls = 0
        self.timeouts: list[float] = []
        self.probed = asyncio.Event()

    async def probe(self, timeout: float) -> ProbeOutcome:
        self.timeouts.append(timeout)
        outcome = self._outcomes[min(self.calls, len(self._outcomes) - 1)]
        self.calls += 1
        self.probed.set()
        return outcome

    async def wait_calls(self, count: int) -> None:
        async with asyncio.timeout(10):
            while self.calls < count:
                self.probed.clear()
                await self.probed.wait()


def bad(message: str | None = "down") -> ProbeOutcome:
    return ProbeOutcome(ProbeResult.UNHEALTHY, message)


def config(**overrides: float) -> ReadinessProbeConfig:
    values: dict[str, float] = {"period": PERIOD, "timeout": 0.5}
    values.update(overrides)
    return ReadinessProbeConfig(
        check=ExecCheck(("true",)),
        initial_delay=values.get("initial_delay", 0.0),
        timeout=values["timeout"],
        period=values["period"],
        success_threshold=int(values.get("success_threshold", 1)),
        failure_threshold=int(values.get("failure_threshold", 1)),
    )


async def run_until(checker: HealthChecker, done: asyncio.Future[None] | asyncio.Task[None]) -> None:
    task = asyncio.create_task(checker.run())
    try:
        await done
    finally:
        checker.stop()
        async with asyncio.timeout(5):
            await task


# --- real probers -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_tcp_unhealthy_healthy_unhealthy() -> None:
    port = free_port()
    events = Events()
    cfg = ReadinessProbeConfig(check=TCPCheck(port=port), period=PERIOD, timeout=0.5)
    checker = HealthChecker(cfg, build_probers(cfg, default_host="127.0.0.1"), events, registry=Registry())
    task = asyncio.create_task(checker.run())
    try:
        await events.wait_for(1)
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", port)
        await events.wait_for(2)
        server.close()
        await server.wait_closed()
        await events.wait_for(3)
        # Let a few more periods pass with the port still closed: no repeated event.
        await asyncio.sleep(PERIOD * 4)
    finally:
        checker.stop()
        await task
    assert [healthy for healthy, _ in events.items] == [False, True, False]
    assert events.items[0][1] == f"dial tcp 127.0.0.1:{port}: connect: connection refused"
    assert events.items[1] == (True, "")
    assert checker.healthy is False


@pytest.fixture
async def flapping_app() -> AsyncIterator[int]:
    """Answers 200 and 500 alternately."""
    count = {"n": 0}

    async def handler(request: web.Request) -> web.Response:
        count["n"] += 1
        return web.Response(status=200 if count["n"] % 2 else 500)

    app = web.Application()
    app.router.add_get("/", handler)
    runner, port = await serve_app(app)
    try:
        yield port
    finally:
        await runner.cleanup()


async def test_http_alternating_gives_four_alternating_events(flapping_app: int) -> None:
    events = Events()
    cfg = ReadinessProbeConfig(check=HTTPGetCheck(port=flapping_app), period=PERIOD, timeout=0.5)
    checker = HealthChecker(cfg, build_probers(cfg, default_host="127.0.0.1"), events, registry=Registry())
    waiter = asyncio.ensure_future(events.wait_for(4))
    await run_until(checker, waiter)
    assert events.items[:4] == [
        (True, ""),
        (False, "status code was not from [200,400), bad code 500"),
        (True, ""),
        (False, "status code was not from [200,400), bad code 500"),
    ]


# --- scripted probers ---------------------------------------------------------------------------


async def test_only_transitions_are_emitted() -> None:
    prober = Scripted([HEALTHY, HEALTHY, bad(), bad(), HEALTHY, HEALTHY, HEALTHY])
    events = Events()
    checker = HealthChecker(config(), [prober], events, registry=Registry())
    await run_until(checker, asyncio.ensure_future(prober.wait_calls(9)))
    assert events.items == [(True, ""), (False, "down"), (True, "")]


async def test_thresholds() -> None:
    # success_threshold 3: the first event waits for three successes; failure_threshold 2:
    # a single failure between successes is not reported.
    prober = Scripted(
        [HEALTHY, HEALTHY, bad("a"), HEALTHY, HEALTHY, HEALTHY, bad("b"), HEALTHY, bad("c"), bad("d")]
    )
    events = Events()
    checker = HealthChecker(
        config(success_threshold=3, failure_threshold=2), [prober], events, registry=Registry()
    )
    await run_until(checker, asyncio.ensure_future(prober.wait_calls(12)))
    assert events.items == [(True, ""), (False, "d")]


async def test_first_failing_prober_wins_and_later_probers_are_skipped() -> None:
    first = Scripted([bad("envoy not ready"), HEALTHY])
    second = Scripted([bad("app down"), HEALTHY])
    events = Events()
    checker = HealthChecker(config(timeout=0.7), [first, second], events, registry=Registry())
    await run_until(checker, asyncio.ensure_future(events.wait_for(2)))
    # Round 1: `first` fails (event) and `second` is skipped; round 2: `second` fails, but the state is
    # unchanged (no event); round 3: both pass.
    assert events.items == [(False, "envoy not ready"), (True, "")]
    assert first.timeouts[0] == 0.7
    assert second.calls == first.calls - 1


async def test_unhealthy_without_error_gets_placeholder() -> None:
    prober = Scripted([bad(None)])
    events = Events()
    checker = HealthChecker(config(), [prober], events, registry=Registry())
    await run_until(checker, asyncio.ensure_future(events.wait_for(1)))
    assert events.items == [(False, UNHEALTHY_PLACEHOLDER)]


async def test_raising_prober_and_raising_callback_do_not_kill_the_loop() -> None:
    class Broken:
        calls = 0

        async def probe(self, timeout: float) -> ProbeOutcome:
            self.calls += 1
            if self.calls == 1:
                raise RuntimeError("boom")
            return HEALTHY

    seen: list[tuple[bool, str]] = []
    done = asyncio.get_running_loop().create_future()

    def on_event(healthy: bool, message: str) -> None:
        seen.append((healthy, message))
        if len(seen) == 2:
            done.set_result(None)
        raise ValueError("handler bug")

    checker = HealthChecker(config(), [Broken()], on_event, registry=Registry())
    await run_until(checker, done)
    assert seen == [(False, "RuntimeError: boom"), (True, "")]


async def test_initial_delay_then_immediate_probe() -> None:
    prober = Scripted([HEALTHY])
    events = Events()
    loop = asyncio.get_running_loop()
    checker = HealthChecker(config(initial_delay=0.3, period=30), [prober], events, registry=Registry())
    started = loop.time()
    task = asyncio.create_task(checker.run())
    await events.wait_for(1)
    elapsed = loop.time() - started
    checker.stop()
    await task
    assert elapsed >= 0.3
    assert prober.calls == 1  # period 30 s: only the immediate probe ran


async def test_stop_during_initial_delay_and_during_probe() -> None:
    prober = Scripted([HEALTHY])
    checker = HealthChecker(config(initial_delay=60), [prober], Events(), registry=Registry())
    task = asyncio.create_task(checker.run())
    await asyncio.sleep(0)
    checker.stop()
    async with asyncio.timeout(2):
        await task
    assert prober.calls == 0

    entered = asyncio.Event()
    cancelled = asyncio.Event()

    class Hanging:
        async def probe(self, timeout: float) -> ProbeOutcome:
            entered.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise
            return HEALTHY

    events = Events()
    checker = HealthChecker(config(timeout=60), [Hanging()], events, registry=Registry())
    task = asyncio.create_task(checker.run())
    await entered.wait()
    checker.stop()
    async with asyncio.timeout(2):
        await task
    assert cancelled.is_set()
    assert events.items == []


async def test_a_broken_prober_is_logged_with_its_traceback_once(caplog: pytest.LogCaptureFixture) -> None:
    class AlwaysBroken:
        calls = 0

        async def probe(self, timeout: float) -> ProbeOutcome:
            self.calls += 1
            raise RuntimeError("boom")

    prober = AlwaysBroken()
    checker = HealthChecker(config(), [prober], lambda healthy, message: None, registry=Registry())
    task = asyncio.get_running_loop().create_task(checker.run())
    while prober.calls < 3:
        await asyncio.sleep(0.01)
    checker.stop()
    await task
    tracebacks = [
        record for record in caplog.records if record.exc_info and "boom" in str(record.exc_info[1])
    ]
    assert len(tracebacks) == 1  # a bug shows once, loudly; later periods fail the check quietly
