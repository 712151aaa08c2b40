"""``agentctl demo`` end to end: real processes, real Envoy, exit 0, a readable result table."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def test_demo_runs_and_cleans_up() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "istio_agent.cli.agentctl", "demo"],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "spiffe://cluster.local/ns/default/sa/httpbin" in out
    assert "200 OK 'hello from envoy'" in out
    assert "caller identity Envoy verified           spiffe://cluster.local/ns/default/sa/sleep" in out
    assert "stopped: envoy (exit 0), pilot-agent (exit 0), control plane (exit 0)" in out
