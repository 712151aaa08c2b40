"""End to end: Envoy's lifecycle under ``pilot-agent proxy`` — graceful drain, crashes, restarts, exit codes.

Workload ``a`` calls service ``b`` through its Envoy; ``b``'s application is a slow aiohttp app in
this test process (1.5 s per answer) so requests are still in flight when ``b``'s agent gets SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from istio_agent.ctl.local import wait_until
from istio_agent.ctl.localmesh import LocalMesh, Service, Workload
from tests.procs import running

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

SLOW_ANSWER = 1.5


def proxy_config(mesh: LocalMesh, workload: Workload, **extra: Any) -> str:
    """PROXY_CONFIG as LocalMesh sets it, with overrides (drain durations, binaryPath)."""
    config = {
        "discoveryAddress": mesh.discovery_address,
        "proxyAdminPort": workload.ports["admin"],
        "statusPort": workload.ports["status"],
        "terminationDrainDuration": "1s",
        **extra,
    }
    return json.dumps(config)


def start_agent(mesh: LocalMesh, workload: Workload, **env: str) -> subprocess.Popen[bytes]:
    """Start only the workload's pilot-agent (no echo app) with extra environment."""
    workload.workdir.mkdir(parents=True, exist_ok=True)
    workload.prepare(mesh.state_dir)
    environ = workload.env(mesh.discovery_address)
    environ.update(env)
    return mesh.processes.start(
        f"pilot-agent {workload.name}",
        workload.agent_command(),
        workload.workdir / "agent.log",
        cwd=workload.workdir,
        env=environ,
    )


def envoy_pid(agent_pid: int) -> int | None:
    """The agent's Envoy child, from /proc (no psutil)."""
    children: list[int] = []
    for task in Path(f"/proc/{agent_pid}/task").glob("*/children"):
        try:
            children += [int(pid) for pid in task.read_text().split()]
        except OSError:
            continue
    for pid in children:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and Path(argv[0].decode()).name == "envoy":
            return pid
    return None


def admin_up(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=1):
            return True
    except (OSError, urllib.error.URLError):
        return False


def call_ok(port: int, timeout: float = 5) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/hello", timeout=timeout) as response:
            return response.status == 200
    except OSError:
        return False


def wait_for_routes(mesh: LocalMesh, a: Workload, b: Workload) -> None:
    mesh.wait_for_config(
        a, lambda seen: f"127.0.0.1_{a.outbound_port('b')}" in seen["listeners"], "its outbound listener"
    )
    mesh.wait_for_config(b, lambda seen: any(n.startswith("inbound_") for n in seen["listeners"]), "inbound")


def log_of(workload: Workload) -> str:
    return (workload.workdir / "agent.log").read_text()


@pytest.fixture
def mesh(short_tmp: Path) -> Iterator[LocalMesh]:
    local = LocalMesh(
        short_tmp,
        [Service("b", 8000)],
        [Workload("a", short_tmp / "a", calls=["b"]), Workload("b", short_tmp / "b", backs=["b"])],
    )
    try:
        yield local
    finally:
        local.stop()


class SlowApp:
    """b's application: answers after SLOW_ANSWER seconds; ``all_in`` is set once ``expected`` are in flight."""

    def __init__(self, port: int, expected: int) -> None:
        self.port, self.expected = port, expected
        self.in_flight = 0
        self.answered = 0
        self.all_in = asyncio.Event()
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        self.in_flight += 1
        if request.path == "/slow" and self.in_flight >= self.expected:
            self.all_in.set()
        try:
            if request.path == "/slow":
                await asyncio.sleep(SLOW_ANSWER)
            self.answered += 1
            return web.Response(text="done")
        finally:
            self.in_flight -= 1

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


async def test_in_flight_requests_complete_when_sigterm_arrives(mesh: LocalMesh) -> None:
    a, b = mesh.workload("a"), mesh.workload("b")
    requests = 6
    app = SlowApp(b.ports["app"], requests)
    await app.start()
    try:
        await asyncio.to_thread(mesh.start_controlplane)
        await asyncio.to_thread(mesh.start_workload, a)
        agent_b = await asyncio.to_thread(
            start_agent, mesh, b, PROXY_CONFIG=proxy_config(mesh, b, terminationDrainDuration="3s")
        )
        await asyncio.to_thread(wait_for_routes, mesh, a, b)
        url = f"http://127.0.0.1:{a.outbound_port('b')}"
        await asyncio.to_thread(wait_until, lambda: call_ok(a.outbound_port("b")), 30, "a to reach b")

        timeout = aiohttp.ClientTimeout(total=15)
        connector = aiohttp.TCPConnector(force_close=True)  # one connection per request
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

            async def slow_call() -> tuple[int, str]:
                async with session.get(f"{url}/slow") as response:
                    return response.status, await response.text()

            calls = [asyncio.ensure_future(slow_call()) for _ in range(requests)]
            await asyncio.wait_for(app.all_in.wait(), 10)  # every request has reached the app
            agent_b.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            results = await asyncio.gather(*calls)
        assert results == [(200, "done")] * requests
        assert time.monotonic() - signalled < 3  # they finished during the drain, not after a restart
        code = await asyncio.to_thread(agent_b.wait, 20)
        stopped_after = time.monotonic() - signalled
    finally:
        await app.stop()
    assert code == 0
    assert 2.5 <= stopped_after < 15  # terminationDrainDuration (3 s), then SIGKILL
    text = log_of(b)
    assert "Agent draining Proxy for termination" in text
    assert "Graceful termination period is 3s" in text
    assert "Envoy aborted normally" in text
    assert "Envoy exited with error" not in text


async def test_exit_on_zero_active_connections_stops_once_requests_are_done(mesh: LocalMesh) -> None:
    a, b = mesh.workload("a"), mesh.workload("b")
    requests = 3
    app = SlowApp(b.ports["app"], requests)
    await app.start()
    try:
        await asyncio.to_thread(mesh.start_controlplane)
        await asyncio.to_thread(mesh.start_workload, a)
        config = proxy_config(mesh, b, terminationDrainDuration="60s", drainDuration="20s")
        agent_b = await asyncio.to_thread(
            start_agent,
            mesh,
            b,
            PROXY_CONFIG=config,
            EXIT_ON_ZERO_ACTIVE_CONNECTIONS="true",
            MINIMUM_DRAIN_DURATION="0.5s",
        )
        await asyncio.to_thread(wait_for_routes, mesh, a, b)
        url = f"http://127.0.0.1:{a.outbound_port('b')}"
        await asyncio.to_thread(wait_until, lambda: call_ok(a.outbound_port("b")), 30, "a to reach b")
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=15), connector=connector
        ) as session:

            async def slow_call() -> int:
                async with session.get(f"{url}/slow") as response:
                    await response.read()
                    return response.status

            calls = [asyncio.ensure_future(slow_call()) for _ in range(requests)]
            await asyncio.wait_for(app.all_in.wait(), 10)
            agent_b.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            assert await asyncio.gather(*calls) == [200] * requests
        # a's Envoy keeps its idle pooled connection to b open (Envoy does not close idle HTTP/1.1
        # connections on a drain): b waits for it, and stops once a's Envoy is gone.
        await asyncio.to_thread(wait_until, lambda: "There are still" in log_of(b), 10, "a poll")
        assert agent_b.poll() is None
        assert await asyncio.to_thread(mesh.processes.stop, "pilot-agent a") == 0
        code = await asyncio.to_thread(agent_b.wait, 30)
        stopped_after = time.monotonic() - signalled
    finally:
        await app.stop()
    assert code == 0
    text = log_of(b)
    assert "There are no more active connections" in text, text[-3000:]
    assert "after the drain began" not in text
    assert stopped_after < 15  # neither terminationDrainDuration (60 s) nor the 20 s bound


def test_envoy_killed_makes_the_agent_exit_with_an_error(mesh: LocalMesh) -> None:
    b = mesh.workload("b")
    mesh.start_controlplane()
    mesh.start_workload(b)
    agent = mesh.processes.children["pilot-agent b"]
    wait_until(lambda: admin_up(b.ports["admin"]), 30, "b's Envoy admin")
    pid = envoy_pid(agent.pid)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    assert agent.wait(20) == 1
    text = log_of(b)
    assert "Envoy exited with error: signal: killed" in text
    assert "out of memory" in text
    assert "the agent exits with status 1" in text
    assert not (b.workdir / "etc/istio/proxy/envoy-rev.json").exists()


def test_envoy_restarted_when_asked(mesh: LocalMesh) -> None:
    a, b = mesh.workload("a"), mesh.workload("b")
    mesh.agent_env = {"ENVOY_RESTART_ON_EXIT": "true"}
    mesh.start_controlplane()
    for workload in (a, b):
        mesh.start_workload(workload)
    wait_for_routes(mesh, a, b)
    wait_until(lambda: call_ok(a.outbound_port("b")), 30, "a to reach b")
    agent = mesh.processes.children["pilot-agent b"]
    first = envoy_pid(agent.pid)
    assert first is not None

    os.kill(first, signal.SIGKILL)
    wait_until(lambda: envoy_pid(agent.pid) not in (None, first), 20, "a new Envoy for b")
    wait_until(lambda: admin_up(b.ports["admin"]), 30, "b's new Envoy admin")
    wait_until(lambda: call_ok(a.outbound_port("b")), 30, "a to reach b through b's new Envoy")
    assert agent.poll() is None
    text = log_of(b)
    assert "Envoy exited with error: signal: killed" in text
    assert "restarting it in" in text and "Envoy restarted" in text

    agent.send_signal(signal.SIGTERM)
    assert agent.wait(20) == 0
    assert not admin_up(b.ports["admin"])


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz/ready", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def test_envoy_dies_with_a_killed_agent_and_a_new_agent_starts(mesh: LocalMesh) -> None:
    b = mesh.workload("b")
    mesh.start_controlplane()
    mesh.start_workload(b)
    agent = mesh.processes.children["pilot-agent b"]
    wait_until(lambda: mesh.processes.alive("pilot-agent b") and ready(b.ports["status"]), 60, "b ready")
    orphan = envoy_pid(agent.pid)
    assert orphan is not None
    try:
        agent.kill()  # SIGKILL: the agent gets no chance to stop Envoy itself
        agent.wait(10)
        wait_until(lambda: not running(orphan), 3, "Envoy to die with its agent")

        second = start_agent(mesh, b)
        wait_until(
            lambda: mesh.processes.alive("pilot-agent b") and ready(b.ports["status"]), 60, "b ready again"
        )
        assert envoy_pid(second.pid) is not None  # ready through its own Envoy, not a leftover one
        assert "address already in use" not in log_of(b).lower()
    finally:
        if running(orphan):
            os.kill(orphan, signal.SIGKILL)


# -- exit codes with a stand-in Envoy (no real Envoy needed) -----------------------------------------
def fake_envoy(directory: Path, script: str, executable: bool = True) -> Path:
    path = directory / "fake-envoy"
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755 if executable else 0o644)
    return path


@pytest.mark.parametrize(
    ("script", "expected", "message"),
    [
        ("exit 0", 0, "Envoy exited normally"),
        ("exit 3", 1, "Envoy exited with error: exit status 3"),
        ("kill -TERM $$", 1, "Envoy exited with error: signal: terminated"),
    ],
    ids=["clean", "error", "signal"],
)
def test_agent_exit_code_follows_envoy(
    mesh: LocalMesh, short_tmp: Path, script: str, expected: int, message: str
) -> None:
    b = mesh.workload("b")
    mesh.start_controlplane()
    binary = fake_envoy(short_tmp, f"sleep 0.5; {script}")
    agent = start_agent(mesh, b, PROXY_CONFIG=proxy_config(mesh, b, binaryPath=str(binary)))
    assert agent.wait(30) == expected
    assert message in log_of(b)


def test_envoy_that_cannot_start_exits_255(mesh: LocalMesh, short_tmp: Path) -> None:
    b = mesh.workload("b")
    mesh.start_controlplane()
    binary = fake_envoy(short_tmp, "exit 0", executable=False)
    agent = start_agent(mesh, b, PROXY_CONFIG=proxy_config(mesh, b, binaryPath=str(binary)))
    assert agent.wait(30) == 255
    text = log_of(b)
    assert f"failed to start Envoy {binary}" in text
