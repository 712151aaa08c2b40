"""The node agent's event server: the plugin's ``POST /cmdadd`` on ``pluginevent.sock`` turned into an
enrolled pod (Istio's ``cni/pkg/nodeagent/cni-watcher.go`` and ``meshdataplane_linux.go``, and the
cases of ``cni-watcher_test.go``).

The server, its HTTP stack and the annotation it writes (on the FAKE API server, ``tests/cni/fake_kube.py``)
are real; the in-pod rules, the host probe set and ztunnel are FAKES that record what they are asked
(``FakeRules``, ``FakeHostProbes``, ``FakeZtunnel``): their own tests are the rules' and ZDS's. The
last tests run the real ``istio-cni`` executable against the real server.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest

from istio_agent.cni.ambient.dataplane import Dataplane, KubeAnnotator, NonRetryableAdd
from istio_agent.cni.ambient.events import EventServer, parse_event, reconcile_add_event
from istio_agent.cni.ambient.settings import PodRedirect
from istio_agent.cni.ambient.zds import EnrolledPod, NoZtunnel
from istio_agent.cni.kube import KubeClient, parse_kubeconfig
from istio_agent.metrics import Registry
from tests.cni.fake_kube import FakeKube, start_fake_kube
from tests.cni.test_plugin_exec import PREV_RESULT, run_plugin

REDIRECTION = "ambient.istio.io/redirection"
T = TypeVar("T")


@dataclass
class FakeRules:
    """A FAKE of the in-pod rules: records (action, netns inode, overrides); ``fail`` raises."""

    calls: list[tuple[str, int, PodRedirect | None]] = field(default_factory=list)
    fail: Exception | None = None
    gate: threading.Event | None = None
    """When set, ``apply`` waits for it (after setting ``entered``)."""
    entered: threading.Event = field(default_factory=threading.Event)

    def apply(self, netns: Path, pod: PodRedirect) -> None:
        if self.fail is not None:
            raise self.fail
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        self.calls.append(("apply", os.stat(netns).st_ino, pod))

    def remove(self, netns: Path) -> None:
        self.calls.append(("remove", os.stat(netns).st_ino, None))


@dataclass
class FakeHostProbes:
    """A FAKE of the host probe set: the IPs it holds."""

    entries: dict[str, str] = field(default_factory=dict)
    installed: bool = False

    @property
    def ips(self) -> set[str]:
        return set(self.entries)

    def install(self) -> None:
        self.installed = True

    def add_pod_ips(self, ips: Sequence[str], *, uid: str = "") -> None:
        self.entries.update(dict.fromkeys(ips, uid))

    def remove_pod_ips(self, ips: Sequence[str], *, uid: str | None = None) -> None:
        for ip in ips:
            if uid in (None, self.entries.get(ip)):
                self.entries.pop(ip, None)

    def pod_ips(self) -> dict[str, str]:
        return dict(self.entries)

    def uninstall(self) -> None:
        self.installed = False
        self.entries.clear()


@dataclass
class FakeZtunnel:
    """A FAKE ZDS server: records adds (with the netns inode it would send) and deletes."""

    connected: bool = True
    added: list[tuple[EnrolledPod, int]] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def add(self, pod: EnrolledPod) -> None:
        if not self.connected:
            raise NoZtunnel("no ztunnel connection")
        assert pod.netns is not None
        self.added.append((pod, os.stat(pod.netns).st_ino))

    async def delete(self, uid: str) -> None:
        self.deleted.append(uid)


async def bounded(step: Awaitable[T], what: str, timeout: float = 20.0) -> T:
    """``step``, or a failure naming it, with every task's stack, when it takes longer than ``timeout``."""
    try:
        async with asyncio.timeout(timeout):
            return await step
    except TimeoutError:
        stacks = []
        for task in asyncio.all_tasks():
            frames = "".join(
                f"    {frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}\n"
                for frame in task.get_stack()
            )
            stacks.append(f"  {task.get_name()}:\n{frames}")
        raise AssertionError(f"not within {timeout}s: {what}\n" + "".join(stacks)) from None


def ambient_pod(name: str = "app-1", namespace: str = "default", **meta: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"istio.io/dataplane-mode": "ambient"},
            **meta,
        },
        "spec": {"containers": [{"name": "app"}], "serviceAccountName": "reviews", "nodeName": "node-1"},
    }


@dataclass
class Agent:
    kube: FakeKube
    rules: FakeRules
    probes: FakeHostProbes
    ztunnel: FakeZtunnel
    dataplane: Dataplane
    server: EventServer
    registry: Registry
    cache: dict[tuple[str, str], dict[str, Any] | None]
    socket: Path

    def lookup(self, name: str, namespace: str) -> dict[str, Any] | None:
        """The FAKE pod cache: KeyError when unknown, None when known and not ambient."""
        return self.cache[(namespace, name)]

    def requests(self, code: str) -> float:
        """``istio_cni_plugin_requests_total{response_code=code}`` as /metrics shows it."""
        wanted = f'istio_cni_plugin_requests_total{{response_code="{code}"}} '
        for line in self.registry.expose().decode().splitlines():
            if line.startswith(wanted):
                return float(line[len(wanted) :])
        return 0.0

    async def post(self, body: bytes) -> tuple[int, str]:
        """POST /cmdadd on the socket with aiohttp (a client independent of the server's stack)."""
        async with (
            aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(self.socket))) as session,
            session.post(
                "http://unix/cmdadd", data=body, headers={"Content-Type": "application/json"}
            ) as answer,
        ):
            return answer.status, await answer.text()


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[Agent]:
    state = tmp_path / "ca"
    state.mkdir()
    kube, runner = await start_fake_kube(state)
    client = KubeClient(parse_kubeconfig(kube.kubeconfig(), "test"))
    rules, probes, ztunnel = FakeRules(), FakeHostProbes(), FakeZtunnel()
    dataplane = Dataplane(rules=rules, probes=probes, ztunnel=ztunnel, annotate=KubeAnnotator(client))
    registry = Registry(prefix="istio_")
    base = Path(tempfile.mkdtemp(prefix="amb-"))  # a Unix socket path is at most 107 bytes
    socket_path = base / "run" / "pluginevent.sock"
    cache: dict[tuple[str, str], dict[str, Any] | None] = {}
    holder: list[Agent] = []
    server = EventServer(
        socket_path,
        lambda event: reconcile_add_event(event, holder[0].lookup, dataplane, interval=0.001),
        registry,
    )
    found = Agent(kube, rules, probes, ztunnel, dataplane, server, registry, cache, socket_path)
    holder.append(found)
    await server.start()
    try:
        yield found
    finally:
        await bounded(server.stop(), "the event server stops")
        await bounded(dataplane.stop(cleanup=True), "the dataplane stops")
        await bounded(runner.cleanup(), "the FAKE API server stops")
        shutil.rmtree(base, ignore_errors=True)


def event(netns: Path, name: str = "app-1", namespace: str = "default", ip: str = "10.1.0.5") -> bytes:
    return json.dumps(
        {
            "Netns": str(netns),
            "PodName": name,
            "PodNamespace": namespace,
            "IPs": [{"Interface": 0, "Address": {"IP": ip, "Mask": "////AA=="}, "Gateway": "10.1.0.1"}],
        }
    ).encode()


def pod_annotations(kube: FakeKube, name: str = "app-1", namespace: str = "default") -> dict[str, str]:
    return dict(kube.pods[(namespace, name)]["metadata"].get("annotations") or {})


# -- the socket -----------------------------------------------------------------------------------------


async def test_the_socket_is_open_to_the_plugin_and_its_directory_is_not(agent: Agent) -> None:
    assert stat.S_ISSOCK(agent.socket.stat().st_mode)
    assert stat.S_IMODE(agent.socket.stat().st_mode) == 0o666
    assert stat.S_IMODE(agent.socket.parent.stat().st_mode) == 0o750


async def test_a_socket_left_by_an_earlier_run_is_replaced(agent: Agent) -> None:
    await agent.server.stop()
    agent.socket.write_text("stale")
    await agent.server.start()
    assert stat.S_ISSOCK(agent.socket.stat().st_mode)
    status, _ = await agent.post(b"not json")
    assert status == 400


# -- the answers ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body", [b"not json", b"[]", b'{"Netns": 5}', b'{"IPs": [{"Address": {"IP": "x"}}]}']
)
async def test_a_body_that_is_not_an_event_is_400(agent: Agent, body: bytes) -> None:
    status, _ = await agent.post(body)
    assert status == 400
    assert agent.requests("400") == 1
    assert agent.rules.calls == [] and agent.ztunnel.added == []


def test_parse_event_reads_istios_json() -> None:
    parsed = parse_event(event(Path("/var/run/netns/x")))
    assert parsed.netns == "/var/run/netns/x"
    assert (parsed.pod_name, parsed.pod_namespace, parsed.ips) == ("app-1", "default", ("10.1.0.5",))
    assert parse_event(b'{"Netns":"n","PodName":"p","PodNamespace":"d","IPs":null}').ips == ()


async def test_an_ambient_pod_is_enrolled(agent: Agent, tmp_path: Path) -> None:
    pod = agent.kube.add_pod(ambient_pod())
    agent.cache[("default", "app-1")] = pod
    netns = tmp_path / "netns"
    netns.touch()  # the fakes only stat it; a real namespace in test_enrollment.py
    status, text = await agent.post(event(netns))
    assert (status, text) == (200, "")
    inode = netns.stat().st_ino
    [(action, applied_inode, overrides)] = agent.rules.calls
    assert (action, applied_inode, overrides) == ("apply", inode, PodRedirect())
    assert agent.probes.ips == {"10.1.0.5"}
    [(sent, sent_inode)] = agent.ztunnel.added
    assert (sent.uid, sent.name, sent.namespace, sent.service_account) == (
        pod["metadata"]["uid"],
        "app-1",
        "default",
        "reviews",
    )
    assert sent_inode == inode
    assert pod_annotations(agent.kube)[REDIRECTION] == "enabled"
    assert [p.uid for p in agent.dataplane.snapshot()] == [pod["metadata"]["uid"]]
    assert agent.requests("200") == 1


async def test_the_pods_overrides_reach_the_rules(agent: Agent, tmp_path: Path) -> None:
    overrides = {
        "ambient.istio.io/bypass-inbound-capture": "true",
        "ambient.istio.io/dns-capture": "false",
    }
    agent.cache[("default", "app-1")] = agent.kube.add_pod(ambient_pod(annotations=overrides))
    (tmp_path / "netns").touch()
    status, _ = await agent.post(event(tmp_path / "netns"))
    assert status == 200
    assert agent.rules.calls[0][2] == PodRedirect(ingress_mode=True, dns_capture=False)


async def test_a_pod_the_cache_says_is_not_ambient_is_500(agent: Agent, tmp_path: Path) -> None:
    agent.cache[("default", "app-1")] = None
    (tmp_path / "netns").touch()
    status, text = await agent.post(event(tmp_path / "netns"))
    assert status == 500
    assert "pod default/app-1 is unexpectedly not eligible for ambient enrollment" in text
    assert agent.rules.calls == [] and agent.requests("500") == 1


async def test_a_pod_not_in_the_cache_is_looked_for_again_then_500(agent: Agent, tmp_path: Path) -> None:
    (tmp_path / "netns").touch()
    pod = agent.kube.add_pod(ambient_pod())

    async def arrives_late() -> None:
        await asyncio.sleep(0.003)
        agent.cache[("default", "app-1")] = pod

    late = asyncio.create_task(arrives_late())
    status, _ = await agent.post(event(tmp_path / "netns"))
    await late
    assert status == 200  # the cache caught up within Istio's 10 retries

    status, text = await agent.post(event(tmp_path / "netns", name="never"))
    assert status == 500 and "failed to get pod default/never" in text


async def test_rules_that_fail_leave_the_pod_out_and_unannotated(agent: Agent, tmp_path: Path) -> None:
    agent.cache[("default", "app-1")] = agent.kube.add_pod(ambient_pod())
    agent.rules.fail = OSError("iptables-restore: exit 1")
    (tmp_path / "netns").touch()
    status, text = await agent.post(event(tmp_path / "netns"))
    assert status == 500 and "iptables-restore: exit 1" in text
    assert agent.ztunnel.added == [] and agent.probes.ips == set()
    assert REDIRECTION not in pod_annotations(agent.kube)
    assert agent.dataplane.snapshot() == []


async def test_without_ztunnel_the_pod_is_pending_and_the_add_fails(agent: Agent, tmp_path: Path) -> None:
    """Istio: the rules are in, ztunnel did not take the pod: annotated ``pending`` and an error (the
    plugin fails the ADD; the kubelet tries the sandbox again)."""
    agent.cache[("default", "app-1")] = agent.kube.add_pod(ambient_pod())
    agent.ztunnel.connected = False
    (tmp_path / "netns").touch()
    status, text = await agent.post(event(tmp_path / "netns"))
    assert status == 500 and "no ztunnel connection" in text
    assert pod_annotations(agent.kube)[REDIRECTION] == "pending"
    assert len(agent.rules.calls) == 1
    assert len(agent.dataplane.snapshot()) == 1  # it goes in the next ztunnel's snapshot


async def test_a_netns_that_does_not_exist_is_not_retried(agent: Agent, tmp_path: Path) -> None:
    agent.cache[("default", "app-1")] = agent.kube.add_pod(ambient_pod())
    with pytest.raises(NonRetryableAdd):
        await agent.dataplane.add_pod(
            agent.cache[("default", "app-1")] or {}, ["10.1.0.5"], str(tmp_path / "gone")
        )
    status, _ = await agent.post(event(tmp_path / "gone"))
    assert status == 500
    assert agent.rules.calls == [] and REDIRECTION not in pod_annotations(agent.kube)


async def test_removal_undoes_the_enrollment(agent: Agent, tmp_path: Path) -> None:
    pod = agent.kube.add_pod({**ambient_pod(), "status": {"podIPs": [{"ip": "10.1.0.5"}]}})
    agent.cache[("default", "app-1")] = pod
    (tmp_path / "netns").touch()
    assert (await agent.post(event(tmp_path / "netns")))[0] == 200
    enrolled = agent.kube.pods[("default", "app-1")]
    await agent.dataplane.remove_pod(enrolled, deleted=False)
    assert [call[0] for call in agent.rules.calls] == ["apply", "remove"]
    assert agent.ztunnel.deleted == [pod["metadata"]["uid"]]
    assert agent.probes.ips == set()
    assert REDIRECTION not in pod_annotations(agent.kube)
    assert agent.dataplane.snapshot() == []


async def test_removal_takes_out_the_ips_of_the_event_when_the_status_has_none(
    agent: Agent, tmp_path: Path
) -> None:
    """The plugin's event carries the pod's IPs before the kubelet reports them in the pod's status."""
    agent.cache[("default", "app-1")] = agent.kube.add_pod(ambient_pod())
    (tmp_path / "netns").touch()
    assert (await agent.post(event(tmp_path / "netns")))[0] == 200
    assert agent.probes.ips == {"10.1.0.5"}
    await agent.dataplane.remove_pod(agent.kube.pods[("default", "app-1")], deleted=True)
    assert agent.probes.ips == set()


async def test_an_add_and_a_removal_of_one_pod_take_turns(agent: Agent, tmp_path: Path) -> None:
    """The plugin's event and the watch may act on one pod at once: the removal waits for the add."""
    pod = agent.kube.add_pod(ambient_pod())
    (tmp_path / "netns").touch()
    agent.rules.gate = threading.Event()
    adding = asyncio.create_task(agent.dataplane.add_pod(pod, ["10.1.0.5"], str(tmp_path / "netns")))
    assert await asyncio.to_thread(agent.rules.entered.wait, 10)
    removing = asyncio.create_task(agent.dataplane.remove_pod(pod, deleted=True))
    await asyncio.sleep(0.1)
    assert agent.ztunnel.deleted == [] and not removing.done()
    agent.rules.gate.set()
    await asyncio.gather(adding, removing)
    assert [p.uid for p, _ in agent.ztunnel.added] == agent.ztunnel.deleted == [pod["metadata"]["uid"]]
    assert agent.probes.ips == set() and agent.dataplane.snapshot() == []


# -- the real plugin against the real server ------------------------------------------------------------


async def test_the_plugin_enrolls_through_the_server(agent: Agent, tmp_path: Path) -> None:
    agent.kube.add_namespace("default", {"istio.io/dataplane-mode": "ambient"})
    agent.cache[("default", "app-1")] = agent.kube.add_pod(ambient_pod())
    run_dir = agent.socket.parent
    (run_dir / "istio-cni-kubeconfig").write_text(agent.kube.kubeconfig())
    netns = tmp_path / "netns"
    netns.touch()
    config = {
        "cniVersion": "1.0.0",
        "name": "k8s-pod-network",
        "type": "istio-cni",
        "cni_agent_run_dir": str(run_dir),
        "pod_namespace": "istio-system",
        "ambient_enabled": True,
        "enablement_selectors": [{"podSelector": {"matchLabels": {"istio.io/dataplane-mode": "ambient"}}}],
        "prevResult": PREV_RESULT,
    }
    env = {
        "CNI_COMMAND": "ADD",
        "CNI_CONTAINERID": "abc123",
        "CNI_NETNS": str(netns),
        "CNI_IFNAME": "eth0",
        "CNI_PATH": "/opt/cni/bin",
        "CNI_ARGS": "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=app-1",
    }
    run = await run_plugin(env, config)
    assert run.code == 0, run.stdout + run.stderr
    assert agent.probes.ips == {"10.1.0.5"} and len(agent.ztunnel.added) == 1
    assert pod_annotations(agent.kube)[REDIRECTION] == "enabled"

    agent.ztunnel.connected = False  # the next pod cannot be handed over: its ADD fails
    agent.cache[("default", "app-2")] = agent.kube.add_pod(ambient_pod("app-2"))
    run = await run_plugin({**env, "CNI_ARGS": "K8S_POD_NAMESPACE=default;K8S_POD_NAME=app-2"}, config)
    assert run.code == 1
    assert run.json["msg"].startswith(
        "istio-cni cmdAdd failed to contact node Istio CNI agent: unable to push CNI event (status code 500): "
    ), run.json
