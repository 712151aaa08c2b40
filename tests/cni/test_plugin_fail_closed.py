"""Failing closed where it matters: writing a mesh pod's rules fails inside its network namespace.

The real ``istio-cni`` executable, for an injected pod (from the FAKE Kubernetes API server,
``fake_kube.py``), in a network namespace the test creates: when ``iptables-restore`` refuses the
rules there, the runtime must get a CNI error result and a non-zero exit, or it would start the pod
without capture; and the namespace must hold none of Istio's rules, not even those of a family that
was written before the other one failed. The plugin exec'd is the venv's console script and the
bundle ``make cni-plugin`` builds (what install-cni's image ships, ``build/cni/bin``).

The refusal comes from STUBs of ``iptables-restore`` put first on ``PATH`` (``refusing_restores``):
they refuse each write (``--noflush``) as the real binary refuses a table it cannot commit, a
message naming the line on stderr and exit 1; anything else (the rollback's restore, every save) is
the real binary, in the pod's namespace.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import pytest

from tests.cni.fake_kube import FakeKube, sidecar_pod, start_fake_kube
from tests.cni.netns import Netns, needs_root, netns, pod_and_peer
from tests.cni.test_plugin_exec import PLUGIN as VENV_PLUGIN
from tests.cni.test_plugin_exec import Run

pytestmark = needs_root
FLAVORS = ("", "-nft", "-legacy")
FAILED_ADD = "istio-cni cmdAdd error"
"""The plugin's error log line, in its stderr."""
REDIRECT_LOG = "redirect set up in"
PREV_RESULT = {"cniVersion": "1.0.0", "ips": [{"address": "10.1.0.5/24"}], "dns": {}}
DUAL_STACK = {"ISTIO_DUAL_STACK": "true"}
BUNDLE = Path(__file__).resolve().parents[2] / "build" / "cni" / "bin" / "istio-cni"


def run_plugin(plugin: Path, run_dir: Path, pod_netns: Path, name: str = "app-1") -> Run:
    """One ADD of ``plugin`` for the pod ``default/<name>`` in ``pod_netns``, as a runtime execs it."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "CNI_COMMAND": "ADD",
        "CNI_CONTAINERID": "sandbox1",
        "CNI_NETNS": str(pod_netns),
        "CNI_IFNAME": "eth0",
        "CNI_PATH": "/opt/cni/bin",
        "CNI_ARGS": f"K8S_POD_NAMESPACE=default;K8S_POD_NAME={name}",
    }
    stdin = {
        "cniVersion": "1.0.0",
        "name": "k8s-pod-network",
        "type": "istio-cni",
        "cni_agent_run_dir": str(run_dir),
        "pod_namespace": "istio-system",
        "prevResult": PREV_RESULT,
    }
    start = time.monotonic()
    done = subprocess.run(
        [str(plugin)],
        input=json.dumps(stdin),
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return Run(done.returncode, done.stdout, done.stderr, time.monotonic() - start)


def refusing_restores(directory: Path, families: Sequence[str]) -> str:
    """STUBs of ``<family>-restore`` (every flavour) in ``directory``; the PATH that puts them first.

    Each refuses a write (``--noflush``) after reading its input; a restore without it (a
    rollback) runs the real binary found on today's PATH.
    """
    directory.mkdir()
    for family in families:
        for flavor in FLAVORS:
            name = f"{family}{flavor}-restore"
            real = shutil.which(name) or f"/nonexistent/{name}"
            stub = directory / name
            stub.write_text(
                "#!/bin/sh\n"
                'case " $* " in *" --noflush "*)\n'
                "    cat >/dev/null\n"
                f'    echo "{name}: line 2 failed (a STUB refusing every write)" >&2\n'
                "    exit 1;;\n"
                "esac\n"
                f'exec {real} "$@"\n'
            )
            stub.chmod(0o755)
    return f"{directory}{os.pathsep}{os.environ['PATH']}"


def istio_rules(space: Netns) -> list[str]:
    """Every line naming an ISTIO chain in the namespace, both families, both backends."""
    lines = []
    for family in ("iptables", "ip6tables"):
        for flavor in ("-nft", "-legacy"):
            saved = subprocess.run(
                ["ip", "netns", "exec", space.name, f"{family}{flavor}-save"],
                capture_output=True,
                text=True,
                check=False,
            ).stdout
            lines += [f"{family}{flavor}: {line}" for line in saved.splitlines() if "ISTIO" in line]
    return lines


@pytest.fixture
async def kube(tmp_path: Path) -> AsyncIterator[FakeKube]:
    """The FAKE API server with the injected pods: ``app-1`` and ``dual-1`` (ISTIO_DUAL_STACK)."""
    state = tmp_path / "ca"
    state.mkdir()
    fake, runner = await start_fake_kube(state)
    fake.add_pod(sidecar_pod("app-1"))
    fake.add_pod(sidecar_pod("dual-1", proxy_env=DUAL_STACK))
    try:
        yield fake
    finally:
        await runner.cleanup()


@pytest.fixture(params=["venv-script", "bundle"])
def plugin(request: pytest.FixtureRequest) -> Path:
    """The istio-cni exec'd: the venv's console script, or the bundle (a missing one fails, as in
    ``test_plugin_bundle.py``: ``make test`` builds it)."""
    executable: Path = VENV_PLUGIN if request.param == "venv-script" else BUNDLE
    if not executable.exists():
        pytest.fail(f"{executable} is missing: build it with `make cni-plugin` (`make test` does)")
    return executable


@pytest.fixture
def pod() -> Iterator[Netns]:
    with netns("failclosed") as space:
        yield space


def plugin_run_dir(tmp_path: Path, kube: FakeKube) -> Path:
    """A run dir with the kubeconfig install-cni writes."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "istio-cni-kubeconfig").write_text(kube.kubeconfig())
    return run_dir


def assert_failed_closed(code: int, result: dict[str, object], netns_path: Path, command: str) -> None:
    assert code == 1, result
    assert result["code"] == 999, result
    message = str(result["msg"])
    assert message.startswith(f"cannot set up the redirect in {netns_path}: "), message
    failed = rf"{command}(-nft|-legacy)?-restore --noflush failed \(exit status 1\): "
    assert re.search(failed + r"\S+: line 2 failed \(a STUB refusing every write\)", message), message


async def test_a_refused_restore_fails_the_add_in_the_plugin(
    tmp_path: Path, kube: FakeKube, pod: Netns, plugin: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", refusing_restores(tmp_path / "stubs", ("iptables", "ip6tables")))
    run = await asyncio.to_thread(run_plugin, plugin, plugin_run_dir(tmp_path, kube), pod.path)
    assert_failed_closed(run.code, run.json, pod.path, "iptables")
    assert FAILED_ADD in run.stderr and "Traceback" not in run.stderr
    assert istio_rules(pod) == []


async def test_an_ipv6_refusal_takes_the_ipv4_rules_back_and_fails_the_add(
    tmp_path: Path, kube: FakeKube, plugin: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dual-stack pod: IPv4's rules are written, IPv6's refused; the ADD fails and IPv4's are gone."""
    monkeypatch.setenv("PATH", refusing_restores(tmp_path / "stubs", ("ip6tables",)))
    with pod_and_peer(ipv6=True) as (dual, _):
        run = await asyncio.to_thread(
            run_plugin, plugin, plugin_run_dir(tmp_path, kube), dual.path, name="dual-1"
        )
        assert_failed_closed(run.code, run.json, dual.path, "ip6tables")
        assert "the rules before were restored" in str(run.json["msg"])
        assert REDIRECT_LOG not in run.stderr
        assert istio_rules(dual) == []


async def test_without_the_stubs_the_same_adds_succeed(
    tmp_path: Path, kube: FakeKube, pod: Netns, plugin: Path
) -> None:
    """The control: the pods and namespaces above get their rules when nothing refuses them."""
    run_dir = plugin_run_dir(tmp_path, kube)
    run = await asyncio.to_thread(run_plugin, plugin, run_dir, pod.path)
    assert run.code == 0, run.stdout + run.stderr
    assert any("-j ISTIO_REDIRECT" in line for line in istio_rules(pod))
    with pod_and_peer(ipv6=True) as (dual, _):
        run = await asyncio.to_thread(run_plugin, plugin, run_dir, dual.path, name="dual-1")
        assert run.code == 0, run.stdout + run.stderr
        assert any(line.startswith("ip6tables") and "ISTIO_REDIRECT" in line for line in istio_rules(dual))
