"""EnvoySupervisor: one run, or restarts with backoff (ENVOY_RESTART_ON_EXIT), with stand-in processes."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from istio_agent.backoff import ExponentialBackoff
from istio_agent.bootstrap.envoy import write_bootstrap
from istio_agent.config.bootstrap import BootstrapSettings
from istio_agent.ctl.local import free_port
from istio_agent.envoy.process import EnvoyProcess, EnvoyStartError
from istio_agent.envoy.supervisor import EnvoySupervisor
from istio_agent.metrics import Registry
from tests.bootstrap import make_settings


@pytest.fixture
def envoy_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="istio.envoy")
    return caplog


async def eventually(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Poll ``check`` (state of child processes the test cannot await directly) until it holds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


class RecordingBackoff(ExponentialBackoff):
    """No jitter, and remembers each delay it handed out."""

    def __init__(self, initial: float) -> None:
        super().__init__(initial=initial, multiplier=2.0, randomization=0.0, max_interval=10.0)
        self.delays: list[float] = []

    def next_delay(self) -> float:
        delay = super().next_delay()
        self.delays.append(delay)
        return delay


class Runs:
    """A launcher over a stand-in Envoy script: writes the bootstrap per run, as the agent does."""

    def __init__(self, workdir: Path, script: str) -> None:
        binary = workdir / "fake-envoy"
        # $1 $2 are "-c <bootstrap>": each run records its number and whether its bootstrap existed.
        binary.write_text(
            "#!/bin/sh\n"
            f'cd "{workdir}"\n'
            "n=$(( $(cat count 2>/dev/null || echo 0) + 1 )); echo $n > count\n"
            '[ -f "$2" ] && echo "$n" >> bootstraps\n'
            f"{script}\n"
        )
        binary.chmod(0o755)
        self.workdir = workdir
        self.settings: BootstrapSettings = dataclasses.replace(
            make_settings(workdir, proxy_config={"proxyAdminPort": free_port()}), binary=binary
        )
        self.launched: list[EnvoyProcess] = []
        self.fail_next = 0

    async def __call__(self) -> EnvoyProcess:
        if self.fail_next:
            self.fail_next -= 1
            raise OSError("cannot write the bootstrap (test)")
        process = EnvoyProcess(self.settings, await asyncio.to_thread(write_bootstrap, self.settings))
        self.launched.append(process)
        return process

    @property
    def bootstraps_seen(self) -> list[str]:
        path = self.workdir / "bootstraps"
        return path.read_text().split() if path.exists() else []


async def test_without_restart_the_first_exit_is_final(
    short_tmp: Path, envoy_logs: pytest.LogCaptureFixture
) -> None:
    runs = Runs(short_tmp, "exit 3")
    supervisor = EnvoySupervisor(runs, restart=False, backoff=RecordingBackoff(0.01), registry=Registry())
    await supervisor.start()
    assert supervisor.pid is not None
    assert await asyncio.wait_for(supervisor.wait(), 10) == 3
    assert len(runs.launched) == 1 and supervisor.restarts == 0
    assert supervisor.returncode == 3
    assert "Envoy exited with error: exit status 3" in envoy_logs.text
    assert "restarting" not in envoy_logs.text
    assert await supervisor.drain_and_stop() == 3  # nothing left to stop


async def test_restarts_with_growing_backoff_and_a_fresh_bootstrap(
    short_tmp: Path, envoy_logs: pytest.LogCaptureFixture
) -> None:
    runs = Runs(short_tmp, 'if [ "$n" -lt 4 ]; then exit 3; fi; exec sleep 60')
    backoff = RecordingBackoff(0.05)
    supervisor = EnvoySupervisor(runs, restart=True, backoff=backoff, registry=Registry())
    await supervisor.start()
    first_pid = supervisor.pid
    await eventually(lambda: supervisor.restarts == 3, "three restarts")  # the fourth run stays up
    assert supervisor.restarts == 3
    assert backoff.delays == [0.05, 0.1, 0.2]
    assert supervisor.pid not in (None, first_pid)
    assert supervisor.returncode is None  # the current run is alive
    await eventually(lambda: len(runs.bootstraps_seen) == 4, "the fourth run to check its bootstrap")
    assert runs.bootstraps_seen == ["1", "2", "3", "4"]  # each run had its (re-written) bootstrap
    assert envoy_logs.text.count("Envoy exited with error: exit status 3") == 3
    assert "Envoy exited (exit status 3); restarting it in 0.1s" in envoy_logs.text
    assert "Envoy restarted" in envoy_logs.text

    started = time.monotonic()
    assert await supervisor.drain_and_stop(graceful_drain=False) == -signal.SIGKILL
    assert time.monotonic() - started < 5
    assert await supervisor.wait() == -signal.SIGKILL
    assert not runs.settings.bootstrap_path.exists()
    assert len(runs.launched) == 4


async def test_a_long_run_resets_the_backoff(short_tmp: Path) -> None:
    runs = Runs(short_tmp, 'if [ "$n" -lt 4 ]; then sleep 0.3; exit 1; fi; exec sleep 60')
    backoff = RecordingBackoff(0.05)
    supervisor = EnvoySupervisor(runs, restart=True, backoff=backoff, stable_after=0.1, registry=Registry())
    await supervisor.start()
    await eventually(lambda: supervisor.restarts == 3, "three restarts")
    assert backoff.delays == [0.05, 0.05, 0.05]  # every run lasted longer than stable_after
    await supervisor.drain_and_stop(graceful_drain=False)


async def test_stop_during_the_backoff_wait(short_tmp: Path, envoy_logs: pytest.LogCaptureFixture) -> None:
    runs = Runs(short_tmp, "exit 2")
    supervisor = EnvoySupervisor(runs, restart=True, backoff=RecordingBackoff(30.0), registry=Registry())
    await supervisor.start()
    await eventually(lambda: "restarting it in 30.0s" in envoy_logs.text, "the backoff wait")
    started = time.monotonic()
    assert await asyncio.wait_for(supervisor.drain_and_stop(), 5) == 2
    assert time.monotonic() - started < 2
    assert len(runs.launched) == 1 and supervisor.restarts == 0


async def test_a_failed_restart_is_retried(short_tmp: Path, envoy_logs: pytest.LogCaptureFixture) -> None:
    runs = Runs(short_tmp, 'if [ "$n" -lt 2 ]; then exit 1; fi; exec sleep 60')
    backoff = RecordingBackoff(0.05)
    supervisor = EnvoySupervisor(runs, restart=True, backoff=backoff, registry=Registry())
    await supervisor.start()
    runs.fail_next = 2  # the next two launches fail (e.g. the bootstrap cannot be written)
    await eventually(lambda: supervisor.restarts == 1, "a restart")
    assert envoy_logs.text.count("Restarting Envoy failed: cannot write the bootstrap") == 2
    assert backoff.delays == [0.05, 0.1, 0.2]
    assert supervisor.restarts == 1 and supervisor.returncode is None
    assert await supervisor.drain_and_stop(graceful_drain=False) == -signal.SIGKILL


async def test_an_envoy_that_cannot_be_executed_fails_start(short_tmp: Path) -> None:
    runs = Runs(short_tmp, "exit 0")
    not_executable = short_tmp / "missing-envoy"
    not_executable.write_text("not a program\n")  # found (a file), but exec fails
    runs.settings = dataclasses.replace(runs.settings, binary=not_executable)
    supervisor = EnvoySupervisor(runs, restart=True, registry=Registry())
    with pytest.raises(EnvoyStartError, match="missing-envoy"):
        await supervisor.start()
    with pytest.raises(RuntimeError, match="not started"):
        await supervisor.wait()
    assert await supervisor.drain_and_stop() is None


async def test_drain_listeners_goes_to_the_running_envoy_only(short_tmp: Path) -> None:
    runs = Runs(short_tmp, "exit 0")
    supervisor = EnvoySupervisor(runs, registry=Registry())
    await supervisor.drain_listeners()  # not started: nothing to do, no error
    await supervisor.start()
    assert await asyncio.wait_for(supervisor.wait(), 10) == 0
    await supervisor.drain_listeners(skip_exit=True)  # exited: no request, no error
