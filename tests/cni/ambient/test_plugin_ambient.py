"""The real ``istio-cni`` executable in ambient mode: which pods it hands to the node agent, and that it
fails closed when the node agent cannot take them.

The decision table is the ambient cases of Istio's ``cni/pkg/plugin/plugin_test.go`` (TestIsAmbientPod,
TestCmdAddAmbientEnabledOnNS*, TestCmdAddPodWithProxySidecarAmbientEnabledNS, ...WithGenericSidecar,
...PodDisabledLabel, ...PodEnabledNamespaceDisabled, ...PodInExcludedNamespace) and the event client's
(``cnieventclient_test.go``): the pods and namespaces come from the FAKE API server
(``tests/cni/fake_kube.py``), the event goes to a FAKE node agent: an HTTP server on
``<cni_agent_run_dir>/pluginevent.sock`` that records what it is sent and answers as scripted.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.cni.ambient.test_events import bounded
from tests.cni.fake_kube import FakeKube, sidecar_pod, start_fake_kube
from tests.cni.test_plugin_exec import PREV_RESULT, Run, run_plugin

AMBIENT = {"istio.io/dataplane-mode": "ambient"}
HELM_SELECTORS: list[dict[str, Any]] = [
    {"podSelector": {"matchLabels": {"istio.io/dataplane-mode": "ambient"}}},
    {
        "podSelector": {
            "matchExpressions": [{"key": "istio.io/dataplane-mode", "operator": "NotIn", "values": ["none"]}]
        },
        "namespaceSelector": {"matchLabels": {"istio.io/dataplane-mode": "ambient"}},
    },
]
"""Istio's chart default (``manifests/charts/istio-cni/values.yaml``, ``ambient.enablementSelectors``)."""
CONTACT_FAILED = "istio-cni cmdAdd failed to contact node Istio CNI agent: "


@dataclass
class FakeNodeAgent:
    """A FAKE node agent's event socket: records each request, answers ``status`` (or hangs)."""

    status: int = 200
    body: bytes = b"server happy"
    hang: bool = False
    requests: list[tuple[str, str, str, bytes]] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(
            (request.method, request.path, request.headers.get("Content-Type", ""), await request.read())
        )
        if self.hang:
            await asyncio.sleep(3600)
        return web.Response(status=self.status, body=self.body)

    @property
    def events(self) -> list[Any]:
        return [json.loads(body) for _, _, _, body in self.requests]


@dataclass
class AmbientNode:
    kube: FakeKube
    agent: FakeNodeAgent
    run_dir: Path
    netns: Path
    dry_run: Path

    def config(self, **extra: Any) -> dict[str, Any]:
        return {
            "cniVersion": "1.0.0",
            "name": "k8s-pod-network",
            "type": "istio-cni",
            "cni_agent_run_dir": str(self.run_dir),
            "pod_namespace": "istio-system",
            "exclude_namespaces": ["istio-system"],
            "ambient_enabled": True,
            "enablement_selectors": HELM_SELECTORS,
            "prevResult": PREV_RESULT,
            **extra,
        }

    async def add(
        self, pod: str = "app-1", namespace: str = "default", *, program: Path | None = None, **extra: Any
    ) -> Run:
        """One ADD by the venv's ``istio-cni`` (or ``program``: the self-contained bundle)."""
        env = {
            "CNI_COMMAND": "ADD",
            "CNI_CONTAINERID": "abc123",
            "CNI_NETNS": str(self.netns),
            "CNI_IFNAME": "eth0",
            "CNI_PATH": "/opt/cni/bin",
            "CNI_ARGS": f"IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={pod}",
            "DRY_RUN_FILE_PATH": str(self.dry_run),
        }
        if program is None:
            return await run_plugin(env, self.config(**extra))
        process = await asyncio.create_subprocess_exec(
            str(program),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={"PATH": "/usr/bin:/bin", **env},
        )
        out, err = await process.communicate(json.dumps(self.config(**extra)).encode())
        assert process.returncode is not None
        return Run(process.returncode, out.decode(), err.decode(), 0.0)


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[AmbientNode]:
    state = tmp_path / "ca"
    state.mkdir()
    kube, kube_runner = await start_fake_kube(state)
    # A short directory: a Unix socket path is at most 107 bytes, and pytest's tmp_path can be longer.
    run_dir = Path(tempfile.mkdtemp(prefix="amb-"))
    (run_dir / "istio-cni-kubeconfig").write_text(kube.kubeconfig())
    agent = FakeNodeAgent()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", agent.handle)
    agent_runner = web.AppRunner(app, shutdown_timeout=0.1)
    await agent_runner.setup()
    await web.UnixSite(agent_runner, str(run_dir / "pluginevent.sock")).start()
    netns = tmp_path / "netns"
    netns.touch()
    try:
        yield AmbientNode(kube, agent, run_dir, netns, tmp_path / "rules.txt")
    finally:
        await bounded(agent_runner.cleanup(), "the FAKE node agent stops")
        await bounded(kube_runner.cleanup(), "the FAKE API server stops")
        shutil.rmtree(run_dir, ignore_errors=True)


def plain_pod(name: str = "app-1", namespace: str = "default", **meta: Any) -> dict[str, Any]:
    """A pod as Istio's test builds it: two containers, no sidecar."""
    return {
        "metadata": {"name": name, "namespace": namespace, **meta},
        "spec": {"containers": [{"name": "foo-init"}, {"name": "mockContainer"}]},
    }


def passed_on(run: Run) -> None:
    """The ADD succeeded and printed the previous result, unchanged."""
    assert run.code == 0, run.stdout + run.stderr
    assert run.json["ips"] == PREV_RESULT["ips"]


# -- the decision table ---------------------------------------------------------------------------------


async def test_a_pod_in_an_ambient_namespace_is_sent_to_the_node_agent(node: AmbientNode) -> None:
    node.kube.add_namespace("default", AMBIENT)
    node.kube.add_pod(plain_pod())
    run = await node.add()
    passed_on(run)
    [(method, path, media, _)] = node.agent.requests
    assert (method, path, media) == ("POST", "/cmdadd", "application/json")
    mask = base64.b64encode(bytes([255, 255, 255, 0])).decode()
    assert node.agent.events == [
        {
            "Netns": str(node.netns),
            "PodName": "app-1",
            "PodNamespace": "default",
            "IPs": [{"Interface": 0, "Address": {"IP": "10.1.0.5", "Mask": mask}, "Gateway": "10.1.0.1"}],
        }
    ]
    assert not node.dry_run.exists()  # the plugin programs nothing itself for an ambient pod


async def test_an_ambient_label_on_the_pod_is_enough(node: AmbientNode) -> None:
    node.kube.add_namespace("default")
    node.kube.add_pod(plain_pod(labels=AMBIENT))
    passed_on(await node.add())
    assert len(node.agent.requests) == 1


async def test_a_pod_with_a_proxy_container_but_no_sidecar_status_is_ambient(node: AmbientNode) -> None:
    node.kube.add_namespace("default", AMBIENT)
    pod = plain_pod()
    pod["spec"]["containers"] = [{"name": "app"}, {"name": "istio-proxy"}]
    node.kube.add_pod(pod)
    passed_on(await node.add())
    assert len(node.agent.requests) == 1


async def test_a_sidecar_pod_in_an_ambient_namespace_gets_its_sidecar_rules(node: AmbientNode) -> None:
    node.kube.add_namespace("default", AMBIENT)
    node.kube.add_pod(sidecar_pod())
    passed_on(await node.add())
    assert node.agent.requests == []
    assert "ISTIO_REDIRECT" in node.dry_run.read_text()  # the sidecar path ran


@pytest.mark.parametrize(
    ("ns_labels", "pod_labels"),
    [
        (AMBIENT, {"istio.io/dataplane-mode": "none"}),  # the pod opts out
        ({}, {}),  # nothing asks for ambient
        ({"istio.io/dataplane-mode": "none"}, {}),
    ],
)
async def test_pods_not_enabled_are_not_sent(
    node: AmbientNode, ns_labels: dict[str, str], pod_labels: dict[str, str]
) -> None:
    node.kube.add_namespace("default", ns_labels)
    node.kube.add_pod(plain_pod(labels=pod_labels))
    passed_on(await node.add())
    assert node.agent.requests == []


async def test_an_excluded_namespace_is_never_sent_nor_asked_about(node: AmbientNode) -> None:
    node.kube.add_namespace("istio-system", AMBIENT)
    node.kube.add_pod(plain_pod(namespace="istio-system"))
    passed_on(await node.add(namespace="istio-system"))
    assert node.agent.requests == []
    assert node.kube.requests == [] and node.kube.calls == []


async def test_without_selectors_nothing_is_ambient(node: AmbientNode) -> None:
    node.kube.add_namespace("default", AMBIENT)
    node.kube.add_pod(plain_pod())
    passed_on(await node.add(enablement_selectors=[]))
    assert node.agent.requests == []


async def test_the_agent_pod_needs_neither_the_api_nor_the_node_agent(node: AmbientNode) -> None:
    (node.run_dir / "istio-cni-kubeconfig").unlink()
    node.agent.status = 500
    passed_on(await node.add(pod="istio-cni-node-x7f2q", namespace="istio-system"))
    assert node.agent.requests == []


# -- failing closed -------------------------------------------------------------------------------------


async def test_a_node_agent_answering_500_fails_the_add(node: AmbientNode) -> None:
    node.kube.add_namespace("default", AMBIENT)
    node.kube.add_pod(plain_pod())
    node.agent.status, node.agent.body = 500, b"server not happy"
    run = await node.add()
    assert run.code == 1
    assert run.json == {
        "code": 999,
        "msg": CONTACT_FAILED + "unable to push CNI event (status code 500): server not happy",
    }


async def test_no_node_agent_fails_the_add(node: AmbientNode) -> None:
    node.kube.add_namespace("default", AMBIENT)
    node.kube.add_pod(plain_pod())
    (node.run_dir / "pluginevent.sock").unlink()
    run = await node.add()
    assert run.code == 1
    assert run.json["code"] == 999
    assert run.json["msg"].startswith(CONTACT_FAILED + "failed to send event request: "), run.json
    assert "pluginevent.sock" in run.json["msg"]


async def test_a_node_agent_that_never_answers_fails_the_add_within_the_deadline(node: AmbientNode) -> None:
    node.kube.add_namespace("default", AMBIENT)
    node.kube.add_pod(plain_pod())
    node.agent.hang = True
    started = time.monotonic()
    run = await node.add(add_timeout="1500ms")
    assert time.monotonic() - started < 4
    assert run.code == 1 and run.json["msg"].startswith(CONTACT_FAILED), run.json
    assert len(node.agent.requests) == 1


# -- the ambient check's retries --------------------------------------------------------------------------


async def test_with_the_retry_flag_the_check_outlasts_api_failures(node: AmbientNode) -> None:
    node.kube.add_namespace("default", AMBIENT)
    node.kube.add_pod(plain_pod())
    node.kube.failures = [500, 500, 500]
    passed_on(await node.add(enable_ambient_detection_retry=True))
    assert len(node.agent.requests) == 1
    assert len(node.kube.requests) == 4


async def test_with_the_retry_flag_failures_past_the_deadline_fail_the_add(node: AmbientNode) -> None:
    node.kube.add_namespace("default", AMBIENT)
    node.kube.add_pod(plain_pod())
    node.kube.failures = [500] * 10
    run = await node.add(enable_ambient_detection_retry=True, add_timeout="2500ms")
    assert run.code == 1
    assert run.json["msg"].startswith("failed to get pod or namespace info: podErr="), run.json
    assert node.agent.requests == []


async def test_without_the_retry_flag_a_failed_check_means_not_ambient(node: AmbientNode) -> None:
    """Istio logs the error and goes on as for a pod that is not ambient (the sidecar path), after
    its one retry."""
    node.kube.add_namespace("default", AMBIENT)
    node.kube.add_pod(plain_pod())
    node.kube.failures = [500, 500]
    passed_on(await node.add())
    assert node.agent.requests == []
    assert len(node.kube.requests) == 3  # two checks, then the sidecar path's own GET


BUNDLE = Path(__file__).resolve().parents[3] / "build" / "cni" / "bin" / "istio-cni"
"""The self-contained plugin ``make cni-plugin`` builds (``make test`` depends on it)."""


async def test_the_self_contained_plugin_takes_the_same_path(node: AmbientNode) -> None:
    """What the bundle carries for the ambient path (the selectors, the event POST) is enough."""
    assert BUNDLE.exists(), f"{BUNDLE} missing: run make cni-plugin"
    node.kube.add_namespace("default", AMBIENT)
    node.kube.add_pod(plain_pod())
    passed_on(await node.add(program=BUNDLE))
    assert len(node.agent.requests) == 1
    node.agent.status = 500
    run = await node.add(program=BUNDLE)
    assert run.code == 1 and run.json["msg"].startswith(CONTACT_FAILED), run.json
