"""istio-cni under a real container runtime: containerd's CRI plugin runs the pod sandboxes, the kubelet's
calls come from a CRI client (``containerd.py``), and the node is set up as Istio's chart sets it up
(``cluster.py``: install-cni chains the self-contained plugin from ``build/cni/bin`` into the node's
bridge conflist). containerd, not the test, creates each sandbox's network namespace and passes
``K8S_POD_NAME``, ``K8S_POD_NAMESPACE`` and the namespace's path to the plugins.

- an injected pod (Istio's injector output, ``testdata/hello.yaml.cni.injected``) gets Istio's rules
  (``testdata/basic.txt.golden``) in its sandbox, and a connection from inside it reaches a listener
  on 15001 with its original destination;
- pods the plugin leaves alone (an excluded namespace, no injection) get none;
- StopPodSandbox and RemovePodSandbox succeed (the CNI DEL) and leave nothing behind, also for 20
  sandboxes created at once.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.cni.as_user import as_user
from tests.cni.netns import PEER_SCRIPT, SYSTEM_PYTHON, in_netns
from tests.cri.cluster import (
    NOTHING_LEFT,
    CriNode,
    cri_node,
    injected_pod,
    istio_reference,
    leftovers,
    plain_pod,
    saved_rules,
)
from tests.cri.conditions import cannot_run
from tests.cri.containerd import Sandbox, pb

REASON = cannot_run()
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(REASON is not None, reason=REASON or "")]
PROXY_UID, APP_UID = 1337, 1000
VIP, SERVICE_PORT = "10.96.0.10", "8000"
"""A service address nothing routes: only a captured connection reaches a listener."""
CONCURRENT = 20


@pytest.fixture(scope="module")
def cri() -> Iterator[CriNode]:
    """One node for the module (containerd, install-cni, the FAKE API server: ~2 s to start)."""
    base = Path(tempfile.mkdtemp(prefix="ia-cri-", dir="/tmp"))  # short: Unix socket paths
    try:
        with cri_node(base) as node:
            yield node
    finally:
        shutil.rmtree(base, ignore_errors=True)


@contextmanager
def sandboxes(cri: CriNode) -> Iterator[list[Sandbox]]:
    """Sandboxes the test runs go into the list; whatever happens, they are stopped and removed."""
    made: list[Sandbox] = []
    try:
        yield made
    finally:
        for sandbox in made:
            cri.containerd.stop_pod_sandbox(sandbox.id)
            cri.containerd.remove_pod_sandbox(sandbox.id)


def peer(netns: Path, uid: int, *args: str) -> subprocess.Popen[str]:
    """``tests/cni/traffic_peer.py`` in the sandbox's namespace as ``uid``, as a container of the pod runs."""
    script = [SYSTEM_PYTHON, "-I", "-S", str(PEER_SCRIPT), *args]
    argv = in_netns(netns, [*as_user(uid, (Path(SYSTEM_PYTHON), PEER_SCRIPT)), *script])
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def line_of(process: subprocess.Popen[str]) -> str:
    assert process.stdout is not None
    return process.stdout.readline().strip()


def assert_istio_rules(sandbox: Sandbox) -> None:
    """The sandbox holds exactly Istio's rules for the pod, IPv4 only, in one backend."""
    rules = saved_rules(sandbox.netns)
    assert len(rules) == 1 and next(iter(rules)).startswith("iptables-"), rules
    command, saved = next(iter(rules.items()))
    assert saved == istio_reference(command)


def test_an_injected_pod_gets_istios_rules_and_its_outbound_connection_reaches_15001(cri: CriNode) -> None:
    cri.kube.add_pod(injected_pod("hello-1"))
    with sandboxes(cri) as made:
        sandbox = cri.containerd.run_pod_sandbox("hello-1")
        made.append(sandbox)
        status = cri.containerd.runtime.PodSandboxStatus(
            pb.PodSandboxStatusRequest(pod_sandbox_id=sandbox.id)
        )
        assert status.status.state == pb.SANDBOX_READY
        assert sandbox.ip.startswith("10.22.0.")
        assert cri.kube.requests == ["/api/v1/namespaces/default/pods/hello-1"]
        assert_istio_rules(sandbox)

        proxy = peer(sandbox.netns, PROXY_UID, "listen", "tcp", "15001")
        try:
            assert line_of(proxy) == "ready"
            app = peer(sandbox.netns, APP_UID, "connect", "tcp", VIP, SERVICE_PORT)
            assert line_of(app) == "connected"
            assert line_of(proxy) == f"accepted {VIP} {SERVICE_PORT}"
        finally:
            proxy.kill()
            proxy.wait()
    assert leftovers(cri) == NOTHING_LEFT  # StopPodSandbox and RemovePodSandbox succeeded above


@pytest.mark.parametrize(
    "pod",
    [injected_pod("hello-system", "kube-system"), plain_pod("plain-1")],
    ids=["excluded-namespace", "not-injected"],
)
def test_a_pod_the_plugin_skips_gets_no_rules(cri: CriNode, pod: dict[str, object]) -> None:
    cri.kube.add_pod(pod)
    meta = pod["metadata"]
    assert isinstance(meta, dict)
    with sandboxes(cri) as made:
        sandbox = cri.containerd.run_pod_sandbox(meta["name"], meta["namespace"])
        made.append(sandbox)
        assert sandbox.ip.startswith("10.22.0.")  # the chain ran: bridge's address, passed on by istio-cni
        assert saved_rules(sandbox.netns) == {}
    assert leftovers(cri) == NOTHING_LEFT


def test_sandboxes_created_concurrently_all_get_their_rules_and_leave_nothing(cri: CriNode) -> None:
    names = [f"burst-{index}" for index in range(CONCURRENT)]
    for name in names:
        cri.kube.add_pod(injected_pod(name))
    with sandboxes(cri) as made, ThreadPoolExecutor(CONCURRENT) as pool:
        start = time.monotonic()
        made += pool.map(cri.containerd.run_pod_sandbox, names)
        created = time.monotonic() - start
        assert sorted(s.name for s in made) == sorted(names)
        assert len({s.ip for s in made}) == CONCURRENT
        for sandbox in made:
            assert_istio_rules(sandbox)
        start = time.monotonic()
        list(pool.map(cri.containerd.stop_pod_sandbox, [s.id for s in made]))
        list(pool.map(cri.containerd.remove_pod_sandbox, [s.id for s in made]))
        removed = time.monotonic() - start
        made.clear()
    print(f"{CONCURRENT} sandboxes: created in {created:.2f} s, stopped and removed in {removed:.2f} s")
    assert leftovers(cri) == NOTHING_LEFT
