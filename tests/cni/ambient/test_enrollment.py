"""Enrollment by watching (Istio's ``cni/pkg/nodeagent/informers.go`` and ``informers_test.go``): running
pods enrolled when their namespace or pod label turns ambient, unenrolled when it turns off, deleted
from ztunnel when they go, the watch resumed after a drop, and a restarted agent that changes nothing.

The API is the FAKE API server (``tests/cni/fake_kube.py``: real list + watch over HTTPS); the pods
are real: a ``sleep`` in its own network namespace, in a cgroup naming the pod's UID as kubelet's do,
so the agent finds its namespace by scanning ``/proc`` as Istio's does. The rules, the probe set and
ztunnel are the FAKES of ``test_events.py`` (recording what they are asked).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from istio_agent.cni.ambient.hostprobe import HostProbeRules
from istio_agent.cni.ambient.nodeagent import AmbientSettings, NodeAgent, build, wait_ready
from istio_agent.cni.ambient.procnetns import find_pod_netns, pod_uid_of_cgroup, pod_uid_of_process
from istio_agent.cni.ambient.selectors import compile_selectors
from istio_agent.cni.ambient.settings import InpodSettings
from istio_agent.cni.kube import KubeClient, parse_kubeconfig
from istio_agent.cni.repair.informer import reflector_backoff
from istio_agent.metrics import Registry
from tests.cni.ambient.test_events import FakeHostProbes, FakeRules, FakeZtunnel, bounded
from tests.cni.ambient.test_plugin_ambient import HELM_SELECTORS
from tests.cni.fake_kube import FakeKube, start_fake_kube
from tests.cni.netns import Netns, needs_root, netns, sh

NODE = "node-1"
AMBIENT = {"istio.io/dataplane-mode": "ambient"}
REDIRECTION = "ambient.istio.io/redirection"
CGROUPS = Path("/sys/fs/cgroup")


def cgroup_root() -> Path | None:
    """A hierarchy a test may make a pod's cgroup in: cgroup v1's pids, else the v2 (unified) one."""
    for candidate in (CGROUPS / "pids", CGROUPS, CGROUPS / "unified"):
        if (candidate / "cgroup.procs").exists() and (
            candidate.name == "pids" or (candidate / "cgroup.controllers").exists()
        ):
            return candidate
    return None


# -- finding a pod's namespace from its UID ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "uid"),
    [  # the shapes of podcgroupns_linux_test.go: cgroupfs and systemd drivers, containerd and cri-o
        (
            "/kubepods/besteffort/pod5d2e1a7c-8b3f-4c2d-9e1f-0a1b2c3d4e5f/0123456789abcdef",
            "5d2e1a7c-8b3f-4c2d-9e1f-0a1b2c3d4e5f",
        ),
        (
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod5d2e1a7c_8b3f_4c2d_9e1f_0a1b2c3d4e5f.slice"
            "/cri-containerd-0123456789abcdef.scope",
            "5d2e1a7c-8b3f-4c2d-9e1f-0a1b2c3d4e5f",
        ),
        ("/kubepods/pod5d2e1a7c8b3f4c2d9e1f0a1b2c3d4e5f/abc", "5d2e1a7c8b3f4c2d9e1f0a1b2c3d4e5f"),
        ("/system.slice/containerd.service", None),
        ("/", None),
        ("/kubepods/podnot-a-uid/abc", None),
    ],
)
def test_the_pod_uid_a_cgroup_names(path: str, uid: str | None) -> None:
    assert pod_uid_of_cgroup(path) == uid


def test_a_process_naming_two_pods_is_nobodys() -> None:
    one, two = "5d2e1a7c-8b3f-4c2d-9e1f-0a1b2c3d4e5f", "6d2e1a7c-8b3f-4c2d-9e1f-0a1b2c3d4e5f"
    same = f"8:pids:/kubepods/pod{one}/abc\n4:memory:/kubepods/pod{one}/abc\n0::/\n"
    assert pod_uid_of_process(same) == one
    assert pod_uid_of_process(f"8:pids:/kubepods/pod{one}/abc\n4:memory:/kubepods/pod{two}/abc\n") is None


@dataclass
class RunningPod:
    """A pod's sandbox stand-in: ``sleep`` in its own network namespace and in a cgroup naming its UID."""

    uid: str
    space: Netns
    process: subprocess.Popen[bytes]

    @property
    def inode(self) -> int:
        return self.space.path.stat().st_ino


@contextmanager
def running_pod(uid: str) -> Iterator[RunningPod]:
    root = cgroup_root()
    if root is None:
        pytest.skip(f"needs root and a cgroup hierarchy mounted under {CGROUPS} to put a pod's process in")
    with ExitStack() as stack:
        space = stack.enter_context(netns("amb"))
        group = root / f"ia-{os.getpid()}" / f"pod{uid}" / "0123456789abcdef"
        group.mkdir(parents=True)
        process = subprocess.Popen(["nsenter", f"--net={space.path}", "sleep", "600"])
        try:
            (group / "cgroup.procs").write_text(str(process.pid))
            yield RunningPod(uid, space, process)
        finally:
            process.kill()
            process.wait()
            for directory in (group, group.parent, group.parent.parent):
                try:
                    directory.rmdir()
                except OSError:
                    break


@needs_root
def test_the_netns_of_a_running_pod_is_found_by_its_uid() -> None:
    uid = str(uuid.uuid4())
    with running_pod(uid) as pod:
        found = find_pod_netns([uid, str(uuid.uuid4())], proc=Path("/proc"))
        assert list(found) == [uid]
        assert found[uid].stat().st_ino == pod.inode
    assert find_pod_netns([uid], proc=Path("/proc")) == {}  # the process is gone


# -- the agent against the fake API server -------------------------------------------------------------


@dataclass
class Node:
    kube: FakeKube
    client: KubeClient
    socket_dir: Path
    rules: FakeRules
    probes: FakeHostProbes
    ztunnel: FakeZtunnel
    agent: NodeAgent | None = None

    @property
    def ztunnel_socket(self) -> Path:
        return self.socket_dir / "ztunnel.sock"

    def settings(self, inpod: InpodSettings) -> AmbientSettings:
        """The chart's ambient settings on this node, ztunnel's socket beside the agent's."""
        return AmbientSettings(
            selectors=compile_selectors(HELM_SELECTORS),
            ztunnel_socket=self.ztunnel_socket,
            node_name=NODE,
            system_namespace="istio-system",
            inpod=inpod,
            host_proc_dir=Path("/proc"),
        )

    async def start_agent(self, *, reconcile: bool = False) -> NodeAgent:
        """A node agent on this node's FAKES (fresh ones when it is started again)."""
        self.agent = build(
            self.settings(InpodSettings(reconcile=reconcile)),
            self.client,
            socket_dir=self.socket_dir,
            registry=Registry(prefix="istio_"),
            rules=self.rules,
            probes=self.probes,
            ztunnel=self.ztunnel,
            informer_options={"backoff": reflector_backoff(initial=0.05, cap=0.2)},
        )
        await bounded(self.agent.start(), "the node agent starts")
        await wait_ready(self.agent, 10)
        return self.agent

    async def start_real_agent(self, probes: HostProbeRules) -> NodeAgent:
        """A node agent on the real in-pod rules, ``probes`` and a ZDS socket for the ztunnel stand-in."""
        self.agent = build(
            self.settings(probes.settings),
            self.client,
            socket_dir=self.socket_dir,
            registry=Registry(prefix="istio_"),
            probes=probes,
        )
        await self.agent.start()
        return self.agent

    async def stop_agent(self) -> None:
        if self.agent is not None:
            await bounded(self.agent.stop(cleanup=False), "the node agent stops")
            self.agent = None

    def annotation(self, name: str, namespace: str = "default") -> str | None:
        pod = self.kube.pods.get((namespace, name))
        return None if pod is None else (pod["metadata"].get("annotations") or {}).get(REDIRECTION)


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    state = tmp_path / "ca"
    state.mkdir()
    kube, runner = await start_fake_kube(state)
    client = KubeClient(parse_kubeconfig(kube.kubeconfig(), "test"))
    socket_dir = Path(tempfile.mkdtemp(prefix="amb-"))
    found = Node(kube, client, socket_dir, FakeRules(), FakeHostProbes(), FakeZtunnel())
    try:
        yield found
    finally:
        await bounded(found.stop_agent(), "the node agent stops")
        await bounded(runner.cleanup(), "the FAKE API server stops")
        shutil.rmtree(socket_dir, ignore_errors=True)


def pod_object(name: str, uid: str, ip: str, namespace: str = "default", **meta: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": namespace, "uid": uid, **meta},
        "spec": {"nodeName": NODE, "serviceAccountName": "sa-" + name, "containers": [{"name": "app"}]},
        "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]},
    }


async def eventually(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    try:
        async with asyncio.timeout(timeout):
            while not condition():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"not within {timeout}s: {what}") from None


async def settled(node: Node) -> None:
    """The agent's queue has nothing left to do."""
    assert node.agent is not None
    queue = node.agent.enrollment.queue
    await asyncio.sleep(0.1)
    await eventually(lambda: queue.idle, "the queue is idle")


@needs_root
async def test_relabelling_a_namespace_enrolls_its_running_pods_and_unlabelling_removes_them(
    node: Node,
) -> None:
    node.kube.add_namespace("default")
    node.kube.add_namespace("other")
    one, two, elsewhere = (str(uuid.uuid4()) for _ in range(3))
    with running_pod(one) as pod1, running_pod(two) as pod2, running_pod(elsewhere):
        node.kube.add_pod(pod_object("app-1", one, "10.1.0.5"))
        node.kube.add_pod(pod_object("app-2", two, "10.1.0.6"))
        node.kube.add_pod(pod_object("db", elsewhere, "10.1.0.7", namespace="other"))
        node.kube.add_pod(
            {**pod_object("far", str(uuid.uuid4()), "10.1.0.8"), "spec": {"nodeName": "node-2"}}
        )
        await node.start_agent()
        await settled(node)
        assert node.rules.calls == [] and node.ztunnel.added == []

        node.kube.update_namespace("default", {"metadata": {"labels": AMBIENT}})
        await eventually(
            lambda: node.annotation("app-1") == node.annotation("app-2") == "enabled", "enrolled"
        )
        applied = sorted(inode for action, inode, _ in node.rules.calls if action == "apply")
        assert applied == sorted([pod1.inode, pod2.inode])
        sent = {pod.uid: (pod.name, pod.service_account, inode) for pod, inode in node.ztunnel.added}
        assert sent == {one: ("app-1", "sa-app-1", pod1.inode), two: ("app-2", "sa-app-2", pod2.inode)}
        assert node.probes.entries == {"10.1.0.5": one, "10.1.0.6": two}
        assert node.annotation("db", "other") is None and node.annotation("far") is None

        node.kube.update_namespace("default", {"metadata": {"labels": {"istio.io/dataplane-mode": None}}})
        await eventually(
            lambda: node.annotation("app-1") is None and node.annotation("app-2") is None, "removed"
        )
        removed = sorted(inode for action, inode, _ in node.rules.calls if action == "remove")
        assert removed == sorted([pod1.inode, pod2.inode])
        assert sorted(node.ztunnel.deleted) == sorted([one, two])
        assert node.probes.entries == {}
        assert node.agent is not None and node.agent.dataplane.snapshot() == []
        events = node.agent.enrollment.events
        # Istio's count: the 3 pods of this node and the 2 namespaces listed (add), the 2 relabellings
        # and the 2 annotation changes of each pod of "default" (update).
        assert events.labels(type="add").value == 5 and events.labels(type="update").value >= 6
        assert events.labels(type="delete").value == 0


@needs_root
async def test_a_pod_label_turns_one_pod_on_and_the_opt_out_label_keeps_it_out(node: Node) -> None:
    node.kube.add_namespace("default")
    uid = str(uuid.uuid4())
    with running_pod(uid) as pod:
        node.kube.add_pod(pod_object("app-1", uid, "10.1.0.5"))
        await node.start_agent()
        node.kube.add_pod(
            {
                **pod_object("app-1", uid, "10.1.0.5"),
                "metadata": {**pod_object("app-1", uid, "")["metadata"], "labels": AMBIENT},
            }
        )
        await eventually(lambda: node.annotation("app-1") == "enabled", "enrolled by its label")
        assert [inode for _, inode in node.ztunnel.added] == [pod.inode]

        meta = node.kube.pods[("default", "app-1")]["metadata"]
        node.kube.add_pod(
            {
                **pod_object("app-1", uid, "10.1.0.5"),
                "metadata": {**meta, "labels": {"istio.io/dataplane-mode": "none"}},
            }
        )
        await eventually(lambda: node.annotation("app-1") is None, "opted out")
        assert node.ztunnel.deleted == [uid]


@needs_root
async def test_a_deleted_pod_is_deleted_from_ztunnel(node: Node) -> None:
    node.kube.add_namespace("default", AMBIENT)
    uid = str(uuid.uuid4())
    with running_pod(uid):
        node.kube.add_pod(pod_object("app-1", uid, "10.1.0.5"))
        await node.start_agent()
        await eventually(lambda: node.annotation("app-1") == "enabled", "enrolled")
        node.kube.finish_deletion("default", "app-1")
        await eventually(lambda: node.ztunnel.deleted == [uid], "deleted from ztunnel")
        assert [action for action, _, _ in node.rules.calls] == ["apply"]  # its rules go with its netns
        assert node.probes.entries == {}


@needs_root
async def test_a_pod_with_a_sidecar_or_without_an_ip_is_not_enrolled(node: Node) -> None:
    node.kube.add_namespace("default", AMBIENT)
    with_sidecar, without_ip = str(uuid.uuid4()), str(uuid.uuid4())
    with running_pod(with_sidecar), running_pod(without_ip):
        node.kube.add_pod(
            pod_object("sidecar", with_sidecar, "10.1.0.5", annotations={"sidecar.istio.io/status": "{}"})
        )
        pending = pod_object("starting", without_ip, "10.1.0.6")
        pending["status"] = {"phase": "Pending"}
        node.kube.add_pod(pending)
        await node.start_agent()
        await settled(node)
        assert node.ztunnel.added == [] and node.rules.calls == []
        node.kube.update_pod(
            "default",
            "starting",
            {"status": {"phase": "Running", "podIP": "10.1.0.6", "podIPs": [{"ip": "10.1.0.6"}]}},
        )
        await eventually(lambda: node.annotation("starting") == "enabled", "enrolled once it has an IP")


@needs_root
async def test_a_dropped_watch_is_resumed_and_a_compacted_one_listed_again(node: Node) -> None:
    node.kube.add_namespace("default")
    one, two = str(uuid.uuid4()), str(uuid.uuid4())
    with running_pod(one), running_pod(two):
        node.kube.add_pod(pod_object("app-1", one, "10.1.0.5"))
        node.kube.add_pod(pod_object("app-2", two, "10.1.0.6"))
        agent = await node.start_agent()
        pods, namespaces = agent.enrollment.pods, agent.enrollment.namespaces
        assert (pods.lists, namespaces.lists) == (1, 1)
        await eventually(lambda: len(node.kube.watchers) == 2, "both watches open")

        assert node.kube.drop_watches() == 2
        node.kube.update_namespace("default", {"metadata": {"labels": AMBIENT}})  # while no watch is open
        await eventually(
            lambda: node.annotation("app-1") == node.annotation("app-2") == "enabled", "enrolled"
        )
        assert (pods.lists, namespaces.lists) == (1, 1)  # resumed from the last version, not listed again

        node.kube.compact()
        node.kube.drop_watches()
        node.kube.update_namespace("default", {"metadata": {"labels": {"istio.io/dataplane-mode": None}}})
        await eventually(
            lambda: node.annotation("app-1") is None and node.annotation("app-2") is None, "removed"
        )
        assert namespaces.lists == 2  # 410 Gone: listed again


@needs_root
async def test_a_restarted_agent_changes_nothing_for_pods_already_right(node: Node) -> None:
    node.kube.add_namespace("default", AMBIENT)
    node.kube.add_namespace("other")
    one, two = str(uuid.uuid4()), str(uuid.uuid4())
    with running_pod(one) as pod1, running_pod(two) as pod2:
        node.kube.add_pod(pod_object("app-1", one, "10.1.0.5"))
        node.kube.add_pod(pod_object("app-2", two, "10.1.0.6", namespace="other"))
        await node.start_agent()
        await eventually(lambda: node.annotation("app-1") == "enabled", "enrolled")
        await node.stop_agent()
        versions = {key: pod["metadata"]["resourceVersion"] for key, pod in node.kube.pods.items()}
        calls_before = len(node.kube.calls)

        node.rules, node.ztunnel = FakeRules(), FakeZtunnel()
        agent = await node.start_agent()
        await settled(node)
        assert node.rules.calls == [] and node.ztunnel.added == [] and node.ztunnel.deleted == []
        assert {key: pod["metadata"]["resourceVersion"] for key, pod in node.kube.pods.items()} == versions
        assert not [call for call in node.kube.calls[calls_before:] if call[0] != "GET"]  # no writes
        [enrolled] = agent.dataplane.snapshot()  # what ztunnel gets when it connects
        assert enrolled.uid == one and enrolled.netns is not None
        assert enrolled.netns.stat().st_ino == pod1.inode
        assert node.probes.entries == {"10.1.0.5": one}

        # ...and a change made while it was down is still acted on.
        await node.stop_agent()
        node.kube.update_namespace("other", {"metadata": {"labels": AMBIENT}})
        await node.start_agent()
        await eventually(lambda: node.annotation("app-2", "other") == "enabled", "enrolled after the restart")
        assert [inode for _, inode in node.ztunnel.added] == [pod2.inode]


@needs_root
async def test_a_restarted_agent_with_reconcile_applies_the_rules_again(node: Node) -> None:
    """``AMBIENT_RECONCILE_POD_RULES_ON_STARTUP``: the rules of pods already enrolled are applied again
    (the real rules leave rules already right unchanged); ztunnel is not asked again."""
    node.kube.add_namespace("default", AMBIENT)
    uid = str(uuid.uuid4())
    with running_pod(uid) as pod:
        node.kube.add_pod(pod_object("app-1", uid, "10.1.0.5"))
        await node.start_agent()
        await eventually(lambda: node.annotation("app-1") == "enabled", "enrolled")
        await node.stop_agent()
        node.rules, node.ztunnel = FakeRules(), FakeZtunnel()
        await node.start_agent(reconcile=True)
        await settled(node)
        assert [(action, inode) for action, inode, _ in node.rules.calls] == [("apply", pod.inode)]
        assert node.ztunnel.added == []


# -- with the real parts: plugin, event server, in-pod rules, probe set, ZDS --------------------------------


@needs_root
async def test_real_parts_a_pod_is_enrolled_by_the_plugin_and_removed_by_unlabelling(node: Node) -> None:
    """The real ``istio-cni`` executable's event reaches the real event server; the real in-pod rules
    go in the pod's namespace, its IP in the probe set of a namespace standing for the host, and the
    ztunnel stand-in (``ztunnel_standin.py``, written from ztunnel's source) runs its proxy in the pod's
    namespace from the fd it received: an app connection to anywhere lands on its 15001. Turning the
    namespace's label off takes it all back."""
    from tests.cni.ambient.test_events import ambient_pod
    from tests.cni.ambient.ztunnel_standin import ZtunnelStandin
    from tests.cni.test_plugin_exec import PREV_RESULT, run_plugin

    if shutil.which("ipset") is None:
        pytest.skip("ipset is not installed (Debian's ipset)")
    node.kube.add_namespace("default", AMBIENT)
    uid = str(uuid.uuid4())
    with running_pod(uid) as pod, netns("host") as host:
        wire(pod.space, host, "10.1.0.5")
        created = ambient_pod(uid=uid)
        created["spec"]["nodeName"] = NODE
        created["metadata"]["labels"] = {}  # ambient by its namespace's label
        node.kube.add_pod(created)  # as the scheduler binds it, before the sandbox (no IP yet)
        probes = HostProbeRules(InpodSettings(reconcile=True), netns=host.path)
        await bounded(node.start_real_agent(probes), "the node agent starts")
        ztunnel = ZtunnelStandin(node.ztunnel_socket)
        await ztunnel.connect()
        try:
            await ztunnel.wait_snapshot()
            (node.socket_dir / "istio-cni-kubeconfig").write_text(node.kube.kubeconfig())
            config = {
                "cniVersion": "1.0.0",
                "name": "k8s-pod-network",
                "type": "istio-cni",
                "cni_agent_run_dir": str(node.socket_dir),
                "pod_namespace": "istio-system",
                "ambient_enabled": True,
                "enablement_selectors": HELM_SELECTORS,
                "prevResult": PREV_RESULT,
            }
            env = {
                "CNI_COMMAND": "ADD",
                "CNI_CONTAINERID": "abc123",
                "CNI_NETNS": str(pod.space.path),
                "CNI_IFNAME": "eth0",
                "CNI_PATH": "/opt/cni/bin",
                "CNI_ARGS": "K8S_POD_NAMESPACE=default;K8S_POD_NAME=app-1",
            }
            run = await bounded(run_plugin(env, config), "the plugin's ADD")
            assert run.code == 0, run.stdout + run.stderr
            assert node.annotation("app-1") == "enabled"
            assert "-A OUTPUT -j ISTIO_OUTPUT" in pod.space.exec("iptables-save")
            assert "10.1.0.5" in host.exec("ipset", "list", "istio-inpod-probes-v4")
            await ztunnel.wait_for(lambda zt: uid in zt.workloads)
            answer = await asyncio.to_thread(connect_from, pod.space, ("1.2.3.4", 80))
            assert answer == f"ztunnel-standin {uid} 15001"

            node.kube.update_namespace("default", {"metadata": {"labels": {"istio.io/dataplane-mode": None}}})
            await eventually(lambda: node.annotation("app-1") is None, "unenrolled")
            await ztunnel.wait_for(lambda zt: uid not in zt.workloads)
            assert "ISTIO_OUTPUT" not in pod.space.exec("iptables-save")
            assert "10.1.0.5" not in host.exec("ipset", "list", "istio-inpod-probes-v4")
        finally:
            await bounded(ztunnel.stop(), "the ztunnel stand-in stops")
            await bounded(node.stop_agent(), "the node agent stops")
            await bounded(asyncio.to_thread(probes.uninstall), "the probe rules go")


def connect_from(space: Netns, address: tuple[str, int]) -> str:
    """Connect from inside ``space`` (as the pod's app) and read the first line answered."""
    sock = space.socket()
    with sock:
        sock.settimeout(5)
        sock.connect(address)
        return sock.makefile().readline().strip()


def wire(pod: Netns, host: Netns, ip: str) -> None:
    """A veth from the pod (``ip``/24, default route) to the host stand-in (.1)."""
    gateway = ip.rsplit(".", 1)[0] + ".1"
    device = "v" + pod.name[-8:].replace("-", "")
    sh("ip", "link", "add", "eth0", "netns", pod.name, "type", "veth", "peer", device, "netns", host.name)
    pod.ip("address", "add", f"{ip}/24", "dev", "eth0")
    if gateway not in host.ip("-4", "address", "show"):
        host.ip("address", "add", f"{gateway}/24", "dev", device)
    pod.ip("link", "set", "eth0", "up")
    host.ip("link", "set", device, "up")
    pod.ip("route", "add", "default", "via", gateway)


def saved_rules(space: Netns) -> str:
    """``iptables-save`` without its comment lines (they carry a timestamp)."""
    return "".join(
        line + "\n" for line in space.exec("iptables-save").splitlines() if not line.startswith("#")
    )


@needs_root
async def test_real_parts_a_restarted_agent_leaves_enrolled_pods_as_they_are(node: Node) -> None:
    """``AMBIENT_RECONCILE_POD_RULES_ON_STARTUP`` on, real in-pod rules: the rules of a pod enrolled by
    the previous agent are applied again and stay byte for byte what they were, the pod is not written
    to, and the reconnecting ztunnel's snapshot names it with its namespace, so its proxy stays."""
    from tests.cni.ambient.ztunnel_standin import ZtunnelStandin

    if shutil.which("ipset") is None:
        pytest.skip("ipset is not installed (Debian's ipset)")
    node.kube.add_namespace("default", AMBIENT)
    uid = str(uuid.uuid4())
    with running_pod(uid) as pod, netns("host") as host:
        wire(pod.space, host, "10.1.0.5")
        node.kube.add_pod(pod_object("app-1", uid, "10.1.0.5"))
        probes = HostProbeRules(InpodSettings(reconcile=True), netns=host.path)
        await node.start_real_agent(probes)
        ztunnel = ZtunnelStandin(node.ztunnel_socket, reconnect=True)
        await ztunnel.connect()
        try:
            await eventually(lambda: node.annotation("app-1") == "enabled", "enrolled by the watch")
            await ztunnel.wait_for(lambda zt: uid in zt.workloads)
            rules_before = saved_rules(pod.space)
            assert "ISTIO_OUTPUT" in rules_before
            version = node.kube.pods[("default", "app-1")]["metadata"]["resourceVersion"]
            proxy = ztunnel.workloads[uid]

            await bounded(node.stop_agent(), "the node agent stops")
            await ztunnel.wait_for(lambda zt: not zt.snapshot_received or not zt.connected)
            received = len(ztunnel.received)
            await bounded(node.start_real_agent(probes), "the node agent starts again")
            await ztunnel.wait_snapshot()
            await settled(node)
            assert ztunnel.received[received:] == [("add", uid), ("snapshot", "")]
            assert ztunnel.workloads[uid] is proxy  # same netns: ztunnel keeps its proxy
            assert saved_rules(pod.space) == rules_before
            assert node.kube.pods[("default", "app-1")]["metadata"]["resourceVersion"] == version
            assert "10.1.0.5" in host.exec("ipset", "list", "istio-inpod-probes-v4")
            answer = await asyncio.to_thread(connect_from, pod.space, ("1.2.3.4", 80))
            assert answer == f"ztunnel-standin {uid} 15001"
        finally:
            await bounded(ztunnel.stop(), "the ztunnel stand-in stops")
            await bounded(node.stop_agent(), "the node agent stops")
            await bounded(asyncio.to_thread(probes.uninstall), "the probe rules go")
