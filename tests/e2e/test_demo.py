"""``agentctl demo`` end to end: real processes, real Envoys, exit 0, a readable result table."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from istio_agent.ctl.local import wait_until

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
    assert "a         spiffe://cluster.local/ns/default/sa/a" in out
    assert "b         spiffe://cluster.local/ns/default/sa/b" in out
    assert "HTTP 200 from app 'b'" in out
    assert "    URI=spiffe://cluster.local/ns/default/sa/a" in out
    assert "a         clusters   outbound|8000||b.default.svc.cluster.local" in out
    assert "b.                            127.0.0.1 (TTL 30)  authoritative" in out  # a's DNS proxy
    assert "stopped: pilot-agent a (exit 0), app a (exit 0), pilot-agent b (exit 0), app b (exit 0)" in out
    assert "control plane (exit 0)" in out


def test_demo_keep_leaves_the_mesh_running_and_says_how_to_stop_it() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "istio_agent.cli.agentctl", "demo", "--keep"],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("left running in "))
    pids = [int(pid) for pid in line.partition("kill ")[2].split()]
    base = Path(line.removeprefix("left running in ").partition(" ")[0])
    assert len(pids) == 5
    try:
        for pid in pids:
            os.kill(pid, 0)  # all alive
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        wait_until(lambda: not any(_alive(pid) for pid in pids), 30, "the demo's processes to stop")
        shutil.rmtree(base, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_demo_with_a_wasm_plugin_shows_it_at_work() -> None:
    from tests.wasm.wasm_filter import add_header_wasm

    module = add_header_wasm()
    done = subprocess.run(
        [sys.executable, "-m", "istio_agent.cli.agentctl", "demo", "--wasm", str(module)],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "WasmPlugin default/demo-headers (http://127.0.0.1:" in out
    assert 'x-wasm-plugin on the response: {"demo":"hello from Wasm"}' in out
    for workload in ("a", "b"):
        assert f"{workload}         extensions.istio.io/wasmplugin/default.demo-headers  /tmp/ia-demo-" in out
    assert "/var/lib/istio/data/" in out


def test_demo_refuses_a_file_that_is_not_wasm(tmp_path: Path) -> None:
    bogus = tmp_path / "plugin.wasm"
    bogus.write_text("not wasm")
    done = subprocess.run(
        [sys.executable, "-m", "istio_agent.cli.agentctl", "demo", "--wasm", str(bogus)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode != 0
    assert "is not a Wasm module" in done.stderr
