"""What the plugin's process imports per ADD: each module is paid for on every pod sandbox of a node.

Issue 21's goal for a pod the plugin leaves alone is an ADD p50 <= 50 ms, of which the interpreter
takes ~7 ms and ``ssl`` + ``h11`` (the project's one HTTP engine, needed for the pod GET) ~15 ms, so
what else the path imports is measured (docs/performance.md, "CNI plugin ADD"). These tests pin
what was taken off it: the ``logging`` package (the plugin writes Istio's log line itself,
``istio_agent.logline``), asyncio, ``pathlib``/``urllib.parse`` and the IDNA codec, and dataclasses
of our own (each one's ``@dataclass`` costs ~0.5 ms of generated code at import).

The real ``istio-cni`` entry point runs in a fresh interpreter (the venv's: the same modules as the
bundle's), against the FAKE API server, and reports ``sys.modules`` as it exits.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.cni.fake_kube import FakeKube, sidecar_pod, start_fake_kube
from tests.cni.test_plugin_exec import PREV_RESULT

RUN_AND_LIST = """
import atexit, gc, os, sys
listing = sys.argv.pop(1)
def _write(extra):
    with open(listing, "w") as out:
        out.write("\\n".join(sorted(sys.modules) + extra + (["(gc enabled)"] if gc.isenabled() else [])))
atexit.register(_write, ["(teardown ran)"])
_exit = os._exit
def _listing_exit(code):
    _write([])
    _exit(code)
os._exit = _listing_exit
from istio_agent.cni.plugin_main import main
main()
"""
OFF_THE_PATH = ("logging", "asyncio", "concurrent.futures", "pathlib", "urllib.parse", "encodings.idna")
"""Not imported by an ADD that GETs the pod and leaves it alone."""
GC_ENABLED = "(gc enabled)"
"""Listed with the modules when the cyclic collector still runs at exit."""
TEARDOWN = "(teardown ran)"
"""Listed when the process exited through the interpreter's teardown (atexit ran)."""
MARKERS = {GC_ENABLED, TEARDOWN}
NOT_OURS_YET = {"istio_agent.config.document.Node", "istio_agent.http.exchange.Fetched"}
"""Dataclasses on that path in modules this change does not own (docs/performance.md says what they cost)."""


@pytest.fixture
async def kube(tmp_path: Path) -> AsyncIterator[FakeKube]:
    state = tmp_path / "ca"
    state.mkdir()
    fake, runner = await start_fake_kube(state)
    (tmp_path / "istio-cni-kubeconfig").write_text(fake.kubeconfig())
    try:
        yield fake
    finally:
        await runner.cleanup()


async def add(tmp_path: Path, pod_args: str, **extra: object) -> tuple[set[str], str, str]:
    """One ADD in a fresh interpreter: the modules loaded when it exited, its stdout and stderr."""
    listed = tmp_path / "modules.txt"
    config = {
        "cniVersion": "1.0.0",
        "name": "k8s-pod-network",
        "type": "istio-cni",
        "cni_agent_run_dir": str(tmp_path),
        "pod_namespace": "istio-system",
        "exclude_namespaces": ["istio-system"],
        "prevResult": PREV_RESULT,
        **extra,
    }
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "CNI_COMMAND": "ADD",
        "CNI_CONTAINERID": "abc123",
        "CNI_NETNS": str(tmp_path),
        "CNI_IFNAME": "eth0",
        "CNI_PATH": "/opt/cni/bin",
        "CNI_ARGS": f"IgnoreUnknown=1;{pod_args}",
        "DRY_RUN_FILE_PATH": str(tmp_path / "rules.txt"),
    }
    done = await asyncio.to_thread(  # the fake API server answers on this test's event loop
        subprocess.run,
        [sys.executable, "-I", "-c", RUN_AND_LIST, str(listed)],
        input=json.dumps(config).encode(),
        env=env,
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()
    return set(listed.read_text().split("\n")), done.stdout.decode(), done.stderr.decode()


def our_dataclasses(modules: set[str]) -> set[str]:
    """The dataclasses defined by our modules among ``modules`` (imported here to look at them)."""
    import importlib

    found = set()
    for name in sorted(m for m in modules if m.startswith("istio_agent")):
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if isinstance(value, type) and value.__module__ == name and "__dataclass_fields__" in vars(value):
                found.add(f"{name}.{attr}")
    return found


async def test_a_pod_without_injection_is_read_without_logging_asyncio_or_pathlib(
    kube: FakeKube, tmp_path: Path
) -> None:
    kube.add_pod(
        {"metadata": {"name": "plain", "namespace": "default"}, "spec": {"containers": [{"name": "a"}]}}
    )
    modules, stdout, stderr = await add(tmp_path, "K8S_POD_NAMESPACE=default;K8S_POD_NAME=plain")
    assert json.loads(stdout)["ips"], stdout  # the previous result, handed on
    assert "istio_agent.http.blocking" in modules  # the GET was made
    assert [m for m in OFF_THE_PATH if m in modules] == []
    assert our_dataclasses(modules - MARKERS) - NOT_OURS_YET == set()
    assert GC_ENABLED not in modules  # a process for one command: the collector would only cost time
    assert TEARDOWN not in modules  # nor the interpreter's teardown at exit, once the answer is out
    [line] = [json.loads(line) for line in stderr.splitlines()]  # Istio's JSON line, one per ADD
    assert (line["level"], line["scope"]) == ("info", "cni-plugin")
    assert line["msg"].startswith("pod default/plain: no redirect:"), line


async def test_a_mesh_pod_logs_in_the_same_format_through_its_rule_modules(
    kube: FakeKube, tmp_path: Path
) -> None:
    kube.add_pod(sidecar_pod())
    modules, _, stderr = await add(
        tmp_path, "K8S_POD_NAMESPACE=default;K8S_POD_NAME=app-1", plugin_log_level="debug"
    )
    assert "logging" not in modules and "asyncio" not in modules
    lines = [json.loads(line) for line in stderr.splitlines()]
    assert lines and all(set(line) == {"time", "level", "scope", "msg"} for line in lines)
    assert any("redirect set up" in line["msg"] for line in lines), lines
