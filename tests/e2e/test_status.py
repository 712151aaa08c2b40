"""End to end: the agent's status server next to a real Envoy: readiness, Envoy's 15021, metrics, quit."""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from istio_agent.ctl.local import wait_until
from istio_agent.ctl.localmesh import LocalMesh, Service, Workload

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def get(port: int, path: str, method: str = "GET", timeout: float = 3) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def status(port: int, path: str = "/healthz/ready") -> tuple[int, str] | None:
    try:
        return get(port, path)
    except OSError:
        return None  # not listening


@pytest.fixture
def mesh(short_tmp: Path) -> Iterator[LocalMesh]:
    local = LocalMesh(short_tmp, [Service("b", 8000)], [Workload("b", short_tmp / "b", backs=["b"])])
    try:
        yield local
    finally:
        local.stop()


def test_readiness_follows_config_then_fails_at_once_on_sigterm(mesh: LocalMesh) -> None:
    b = mesh.workload("b")
    mesh.start_controlplane()
    mesh.stop_controlplane()  # the state dir (root, token key) exists, but no control plane runs
    mesh.start_workload(b)
    agent = mesh.processes.children["pilot-agent b"]

    seen: list[tuple[int, str] | None] = []

    def not_ready_with_reason() -> bool:
        seen.append(status(b.ports["status"]))
        return seen[-1] is not None and seen[-1][0] == 503 and "config not received" in seen[-1][1]

    try:
        wait_until(not_ready_with_reason, 30, "readiness to say that no config was received")
    except TimeoutError as err:
        raise TimeoutError(
            f"{err}; last answers {seen[-3:]}; agent log:\n{mesh.processes.log_tail('pilot-agent b', 40)}"
        ) from None
    assert "is Istiod running?" in (seen[-1] or (0, ""))[1]

    mesh.start_controlplane()
    wait_until(lambda: status(b.ports["status"]) == (200, ""), 60, "readiness to turn 200")
    assert status(b.ports["envoy_status"]) == (200, "")  # kubelet's view through Envoy's 15021

    code, body = get(b.ports["status"], "/stats/prometheus")
    assert code == 200
    assert "istio_agent_startup_duration_seconds" in body
    assert "envoy_cluster_manager_active_clusters" in body  # Envoy's stats through its 15090 listener

    agent.send_signal(signal.SIGTERM)
    started = time.monotonic()
    wait_until(lambda: status(b.ports["status"]) is None, 5, "15020 to close at once")
    through_envoy = status(b.ports["envoy_status"])
    assert through_envoy is None or through_envoy[0] == 503
    assert time.monotonic() - started < 5
    assert agent.wait(15) == 0


def test_quitquitquit_stops_the_agent_without_draining(mesh: LocalMesh) -> None:
    b = mesh.workload("b")
    mesh.start_controlplane()
    mesh.start_workload(b)
    wait_until(lambda: status(b.ports["status"]) == (200, ""), 60, "readiness to turn 200")
    agent = mesh.processes.children["pilot-agent b"]
    assert get(b.ports["status"], "/quitquitquit", method="POST") == (200, "OK")
    assert agent.wait(10) == 0
    assert "Agent already drained, exiting immediately" in (b.workdir / "agent.log").read_text()


def test_metrics_merge_the_agent_envoy_and_the_app(short_tmp: Path) -> None:
    b = Workload("b", short_tmp / "b", backs=["b"])
    annotations = json.dumps({"scrape": "true", "port": str(b.ports["app"]), "path": "/metrics"})
    local = LocalMesh(
        short_tmp, [Service("b", 8000)], [b], agent_env={"ISTIO_PROMETHEUS_ANNOTATIONS": annotations}
    )
    try:
        local.start_controlplane()
        local.start_workload(b)
        wait_until(lambda: status(b.ports["status"]) == (200, ""), 60, "readiness to turn 200")
        code, body = get(b.ports["status"], "/stats/prometheus")
        assert code == 200
        agent_at = body.index("istio_agent_scrapes_total")
        envoy_at = body.index("envoy_cluster_manager_active_clusters")
        app_at = body.index('echo_requests_total{app="b"}')
        assert agent_at < envoy_at < app_at  # Istio's order: agent, Envoy, application
        # The agent's own section comes first, so it shows how the previous scrape went.
        _, again = get(b.ports["status"], "/stats/prometheus")
        assert 'istio_agent_scrape_target_up{target="envoy"} 1.0' in again
        assert f'istio_agent_scrape_target_up{{target="app:{b.ports["app"]}/metrics"}} 1.0' in again
    finally:
        local.stop()
