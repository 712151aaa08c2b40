"""The repair controller inside the real ``install-cni`` process, configured as Istio's chart does
(``REPAIR_*`` variables), talking to the FAKE API server (``fake_kube.py``) with the service
account install-cni writes into the plugin's kubeconfig; stopped with install-cni by SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest

from tests.cli.test_install_cni import free_port
from tests.cni.fake_kube import (
    TOKEN,
    FakeKube,
    sidecar_pod,
    start_fake_kube,
    validation_crashlooping,
    validation_passed,
)
from tests.cni.install.layout import Node, install_cni_args

LABEL = "cni.istio.io/uninitialized"


@pytest.fixture
async def fake(tmp_path: Path) -> AsyncIterator[FakeKube]:
    state = tmp_path / "ca"
    state.mkdir()
    kube, runner = await start_fake_kube(state)
    try:
        yield kube
    finally:
        await runner.cleanup()


class InstallCni:
    """install-cni on ``node`` with the API server at the fake's port; its output read by a thread."""

    def __init__(self, root: Path, fake: FakeKube, env: dict[str, str], *extra: str) -> None:
        root.mkdir()
        node = Node(root)
        (node.sa / "ca.crt").write_bytes(fake.ca_pem)
        (node.sa / "token").write_text(TOKEN)
        node.put("calico.conflist", "10-calico.conflist")
        environ = {
            **os.environ,
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(fake.port),
            **env,
        }
        args = [*install_cni_args(node), *extra]
        self.process = subprocess.Popen(args, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self._lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.append(line.decode(errors="replace"))

    def log(self) -> str:
        return "".join(self._lines)

    async def until(self, condition: Callable[[], bool], what: str, seconds: float = 20.0) -> None:
        deadline = time.monotonic() + seconds
        while not condition():
            assert self.process.poll() is None, f"install-cni exited: {self.log()}"
            assert time.monotonic() < deadline, f"not within {seconds}s: {what}\n{self.log()}"
            await asyncio.sleep(0.05)

    async def terminate(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while self.process.poll() is None:
            assert time.monotonic() < deadline, f"install-cni did not exit on SIGTERM: {self.log()}"
            await asyncio.sleep(0.05)
        self._reader.join(timeout=5)
        return self.process.returncode

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def broken(name: str, node: str) -> dict[str, object]:
    pod = sidecar_pod(name, node_name=node)
    pod["status"] = validation_crashlooping("10.9.1.2")
    return pod


async def test_install_cni_labels_the_broken_pods_of_its_node(tmp_path: Path, fake: FakeKube) -> None:
    fake.add_pod(broken("broken", "node-1"))
    fake.add_pod(broken("elsewhere", "node-2"))
    healthy = sidecar_pod("healthy", node_name="node-1")
    healthy["status"] = validation_passed("10.9.1.3")
    fake.add_pod(healthy)
    monitoring = free_port()
    env = {
        "REPAIR_LABEL_PODS": "true",
        "REPAIR_NODE_NAME": "node-1",
        "REPAIR_SIDECAR_ANNOTATION": "sidecar.istio.io/status",
    }
    agent = InstallCni(tmp_path / "node", fake, env, f"--monitoring-port={monitoring}")
    try:
        labelled = lambda: LABEL in fake.pods[("default", "broken")]["metadata"]["labels"]  # noqa: E731
        await agent.until(labelled, "the broken pod is labelled")
        await agent.until(lambda: len(fake.events) == 1, "the event is recorded")
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{monitoring}/metrics") as response,
        ):
            metrics = await response.text()
        assert 'istio_cni_repair_pods_repaired_total{type="label",result="success"} 1' in metrics
        assert fake.pods[("default", "elsewhere")]["metadata"]["labels"] == {}
        assert fake.pods[("default", "healthy")]["metadata"]["labels"] == {}
        (event,) = fake.events.values()
        assert (event["reason"], event["message"]) == ("LabelBrokenPod", "pod detected as broken, labeled")
        assert "starting CNI sidecar repair controller" in agent.log()
        assert await agent.terminate() == 0
    finally:
        agent.kill()
    assert "Traceback" not in agent.log()
    lists = [path for method, path in fake.calls if method == "GET" and "watch" not in path]
    assert lists == ["/api/v1/pods?fieldSelector=spec.nodeName%3Dnode-1"]


async def test_without_a_mode_the_controller_does_not_start(tmp_path: Path, fake: FakeKube) -> None:
    fake.add_pod(broken("broken", "node-1"))
    agent = InstallCni(tmp_path / "node", fake, {"REPAIR_NODE_NAME": "node-1"})
    try:
        await agent.until(lambda: "not started" in agent.log(), "the controller says it is not started")
        await asyncio.sleep(0.5)
        assert await agent.terminate() == 0
    finally:
        agent.kill()
    assert fake.calls == [] and fake.pods[("default", "broken")]["metadata"]["labels"] == {}
    disabled = InstallCni(tmp_path / "node2", fake, {"REPAIR_ENABLED": "false", "REPAIR_REPAIR_PODS": "true"})
    try:
        await disabled.until(lambda: "CNI repair controller is disabled" in disabled.log(), "disabled")
        assert await disabled.terminate() == 0
    finally:
        disabled.kill()
    assert fake.calls == []
