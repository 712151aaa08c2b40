"""Repair in place for real (root): a pod network namespace the test creates, a ``sleep`` in it as the
pause process, found through the real /proc by its IP, and the plugin's rules programmed into it by
the repair controller, which watches the FAKE API server (``fake_kube.py``). Afterwards the pod has
exactly the rules the plugin would have given it, and istio-validation, which exited 126, passes."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from istio_agent.cni.check import check_capture
from istio_agent.cni.install.settings import RepairSettings
from istio_agent.cni.kube import KubeClient, parse_kubeconfig
from istio_agent.cni.redirect import capture_config
from istio_agent.cni.repair.controller import RepairController
from istio_agent.cni.repair.informer import reflector_backoff
from istio_agent.cni.repair.podnetns import NetnsNotFound, find_pod_netns
from istio_agent.metrics import Registry
from tests.cni.fake_kube import FakeKube, sidecar_pod, start_fake_kube, validation_crashlooping
from tests.cni.netns import Netns, needs_root, netns
from tests.cni.test_istio_iptables_netns import istio_iptables

pytestmark = [needs_root]
PROC = Path("/proc")


def unique_ip() -> str:
    """An address no other test's namespace holds (the scan looks at every process of the machine)."""
    return f"10.{random.randint(240, 254)}.{random.randint(0, 255)}.{random.randint(2, 254)}"


@contextmanager
def pod_with_pause(ip: str) -> Iterator[tuple[Netns, list[subprocess.Popen[bytes]]]]:
    """A namespace with ``ip`` on an interface and a first ``sleep`` (the "pause" process) in it;
    more processes may be started in it through the yielded list's owner."""
    with netns("repair") as space:
        space.ip("link", "add", "eth0", "type", "veth", "peer", "name", "veth-peer")  # both ends inside
        space.ip("address", "add", f"{ip}/32", "dev", "eth0")
        for link in ("eth0", "veth-peer"):
            space.ip("link", "set", link, "up")
        processes: list[subprocess.Popen[bytes]] = []
        try:
            processes.append(start_in(space))
            yield space, processes
        finally:
            for process in processes:
                process.kill()
                process.wait()


def start_in(space: Netns) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(["ip", "netns", "exec", space.name, "sleep", "120"])
    deadline = time.monotonic() + 5
    while os.stat(f"/proc/{process.pid}/ns/net").st_ino != os.stat(space.path).st_ino:  # exec'd inside
        assert time.monotonic() < deadline, "the sleep did not enter its namespace"
        time.sleep(0.01)
    return process


def test_the_oldest_process_of_the_namespace_holding_the_pod_ip_is_found() -> None:
    ip, decoy_ip = unique_ip(), unique_ip()
    with pod_with_pause(ip) as (space, processes), pod_with_pause(decoy_ip):
        time.sleep(0.05)  # start times are counted in clock ticks (10 ms)
        processes.append(start_in(space))  # istio-validation, say: younger than the pause process
        found = find_pod_netns(ip, PROC)
        assert found == PROC / str(processes[0].pid) / "ns" / "net"
        assert os.stat(found).st_ino == os.stat(space.path).st_ino
    with pytest.raises(NetnsNotFound, match="failed to find network namespace"):
        find_pod_netns(ip, PROC)  # the pod is gone


@pytest.mark.parametrize("ip", ["", "10.0.0.300", "pod"])
def test_a_pod_ip_that_does_not_parse_is_an_error(ip: str) -> None:
    with pytest.raises(NetnsNotFound, match="failed to parse addr"):
        find_pod_netns(ip, PROC)


def test_an_unreadable_proc_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(NetnsNotFound, match="read procs"):
        find_pod_netns("10.1.1.1", tmp_path / "missing")


@pytest.fixture
async def fake(tmp_path: Path) -> AsyncIterator[FakeKube]:
    kube, runner = await start_fake_kube(tmp_path)
    try:
        yield kube
    finally:
        await runner.cleanup()


async def until(condition: object, what: str, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds}s: {what}")
        await asyncio.sleep(0.05)


async def test_a_pod_without_rules_is_repaired_in_place(fake: FakeKube) -> None:
    ip = unique_ip()
    pod = sidecar_pod(
        "broken", node_name="node-1", annotations={"traffic.sidecar.istio.io/excludeInboundPorts": "9000"}
    )
    with pod_with_pause(ip) as (space, processes):
        expected = capture_config(pod, {})
        before = await asyncio.to_thread(check_capture, expected, space.path)
        assert before.installed_rules == 0
        failed = await asyncio.to_thread(
            istio_iptables, space, "--run-validation", "--skip-rule-apply", "--probe-timeout=300ms", uid=1337
        )
        assert failed.returncode == 126  # what the kubelet then reports for istio-validation
        pod["status"] = validation_crashlooping(ip)
        fake.add_pod(pod)
        found: list[Path] = []

        def find(pod_ip: str, proc: Path) -> Path:
            found.append(find_pod_netns(pod_ip, proc))
            return found[-1]

        registry = Registry(prefix="istio_")
        client = KubeClient(parse_kubeconfig(fake.kubeconfig(), "test"))
        settings = RepairSettings(repair_pods=True, node_name="node-1", host_proc_dir=PROC)
        repair = RepairController(
            settings, client, registry, find_netns=find, backoff=reflector_backoff(0.05, 0.2)
        )
        task = asyncio.create_task(repair.run())
        try:
            counter = repair.repaired_total.labels(type="repair", result="success")
            await until(lambda: counter.value == 1 or task.done(), "the pod is repaired")
            assert not task.done()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert found == [PROC / str(processes[0].pid) / "ns" / "net"]  # the pause process's
        after = await asyncio.to_thread(check_capture, expected, space.path)
        assert after.matches and after.installed_rules == after.expected_rules > 0, after.differences
        passed = await asyncio.to_thread(
            istio_iptables, space, "--run-validation", "--skip-rule-apply", uid=1337
        )
        assert passed.returncode == 0, passed.stdout + passed.stderr  # the pod's next restart succeeds
