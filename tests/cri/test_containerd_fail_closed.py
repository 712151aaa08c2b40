"""Failing closed under a real container runtime: when istio-cni cannot program a mesh pod, containerd's
RunPodSandbox fails, so the kubelet never starts the pod without its capture, and the sandbox it
began leaves nothing behind (no sandbox, network namespace, shim, plugin process, pod IP or veth).

- the API server answers 500 to every pod GET: the plugin asks again every second until its 30 s
  deadline (Istio's bound), then fails the ADD;
- the API server is down (nothing listens where the kubeconfig points): the same;
- ``iptables-restore`` refuses the rules in the sandbox's namespace: STUBs first on containerd's
  PATH (the plugins inherit it) refuse every write while the test's switch file exists, as the real
  binary refuses a table it cannot commit; the runtime gets the plugin's CNI error. Without the
  switch the same pod's sandbox gets its rules (the control).

A plugin that returned success in any of these cases would let RunPodSandbox succeed: these tests fail.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from tests.cri.cluster import NOTHING_LEFT, CriNode, cri_node, injected_pod, leftovers, saved_rules
from tests.cri.conditions import cannot_run

REASON = cannot_run()
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(REASON is not None, reason=REASON or "")]
PLUGIN_FAILED = 'plugin type="istio-cni" name="istio-cni" failed (add)'
"""How containerd's CNI library reports the plugin's error result, then its message (the entry's
name is the one install-cni gives it)."""
ADD_BUDGET = 30
"""The plugin's deadline for an ADD (``DEFAULT_ADD_TIMEOUT``; install-cni writes no ``add_timeout``)."""
STUB_MESSAGE = "line 2 failed (a STUB refusing every write)"


def write_refusing_restores(directory: Path, switch: Path) -> None:
    """STUBs of every ``iptables-restore`` flavour: while ``switch`` exists each write (``--noflush``)
    is refused after reading its input; otherwise, and for a restore without it (a rollback), the
    real binary runs."""
    directory.mkdir()
    for family in ("iptables", "ip6tables"):
        for flavor in ("", "-nft", "-legacy"):
            name = f"{family}{flavor}-restore"
            real = shutil.which(name, path="/usr/sbin:/sbin:/usr/bin") or f"/nonexistent/{name}"
            stub = directory / name
            stub.write_text(
                "#!/bin/sh\n"
                f'if [ -e {switch} ]; then case " $* " in *" --noflush "*)\n'
                "    cat >/dev/null\n"
                f'    echo "{name}: {STUB_MESSAGE}" >&2\n'
                "    exit 1;;\n"
                "esac; fi\n"
                f'exec {real} "$@"\n'
            )
            stub.chmod(0o755)


@pytest.fixture(scope="module")
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ia-cri-", dir="/tmp"))  # short: Unix socket paths
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def cri(base: Path) -> Iterator[CriNode]:
    """A node whose containerd finds the refusing STUBs first on its PATH (refusing only when switched on)."""
    write_refusing_restores(base / "stubs", base / "refuse-writes")
    with cri_node(base / "node", path_prefix=[base / "stubs"]) as node:
        yield node


def run_refused(cri: CriNode, name: str, timeout: float) -> grpc.RpcError:
    """RunPodSandbox for the pod, which must fail; its error."""
    with pytest.raises(grpc.RpcError) as refused:
        sandbox = cri.containerd.run_pod_sandbox(name, timeout=timeout)
        cri.containerd.stop_pod_sandbox(sandbox.id)
        cri.containerd.remove_pod_sandbox(sandbox.id)
    return refused.value


def refused_for_500(cri: CriNode) -> str:
    """The error of RunPodSandbox while the API server answers every pod GET with 500."""
    cri.kube.add_pod(injected_pod("status-500"))
    cri.kube.failures[:] = [500] * (ADD_BUDGET + 10)
    try:
        return run_refused(cri, "status-500", timeout=ADD_BUDGET + 30).details()
    finally:
        cri.kube.failures.clear()


def refused_for_down() -> str:
    """The error of RunPodSandbox on a node of its own whose API server went down for good."""
    base = Path(tempfile.mkdtemp(prefix="ia-cri-", dir="/tmp"))
    try:
        with cri_node(base) as down:
            down.kube.add_pod(injected_pod("hello-down"))
            down.stop_api_server()
            details = run_refused(down, "hello-down", timeout=ADD_BUDGET + 30).details()
            assert leftovers(down) == NOTHING_LEFT
            return details
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.timeout(ADD_BUDGET + 60)
def test_an_api_server_answering_500_or_down_fails_the_sandbox_and_leaves_nothing(cri: CriNode) -> None:
    """Both at once, on two nodes: the plugin spends its whole deadline asking in each."""
    with ThreadPoolExecutor(2) as pool:
        status_500, down = pool.submit(refused_for_500, cri), pool.submit(refused_for_down)
        status_500_details, down_details = status_500.result(), down.result()
    assert PLUGIN_FAILED in status_500_details, status_500_details
    assert "500 Internal Server Error" in status_500_details
    assert "the ADD deadline is reached" in status_500_details
    assert len(cri.kube.requests) > 10  # asked again and again within the deadline
    assert leftovers(cri) == NOTHING_LEFT
    assert PLUGIN_FAILED in down_details, down_details
    assert "connection refused" in down_details.lower()
    assert "the ADD deadline is reached" in down_details


def test_a_refused_iptables_restore_fails_the_sandbox_with_the_plugins_error(
    cri: CriNode, base: Path
) -> None:
    cri.kube.add_pod(injected_pod("refused-1"))
    switch = base / "refuse-writes"
    switch.touch()
    try:
        error = run_refused(cri, "refused-1", timeout=60)
    finally:
        switch.unlink()
    assert PLUGIN_FAILED in error.details(), error.details()
    assert "cannot set up the redirect in " in error.details()
    assert STUB_MESSAGE in error.details()
    assert leftovers(cri) == NOTHING_LEFT

    sandbox = cri.containerd.run_pod_sandbox("refused-1")  # the control: nothing refuses now
    try:
        assert any("ISTIO_REDIRECT" in saved for saved in saved_rules(sandbox.netns).values())
    finally:
        cri.containerd.stop_pod_sandbox(sandbox.id)
        cri.containerd.remove_pod_sandbox(sandbox.id)
    assert leftovers(cri) == NOTHING_LEFT
