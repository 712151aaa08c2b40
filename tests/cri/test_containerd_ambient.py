"""Ambient mode under a real container runtime: containerd's CRI runs the sandboxes, install-cni runs
as it ships with the chart's ambient values and mounts (``cluster.py``), and a ztunnel stand-in
(``tests/cni/ambient/ztunnel_standin.py``, written from ztunnel's source) serves on the node, on the
ztunnel socket directory install-cni's DaemonSet mounts. One node per backend: the chart's iptables
(its default) and native nftables (``global.nativeNftables``).

- a pod whose namespace is labelled ``istio.io/dataplane-mode=ambient`` created with RunPodSandbox is
  enrolled: its sandbox holds exactly what Istio's golden ``default_ipv6`` (the chart's DNS capture
  and IPv6) installs, and the fwmark rule of both families; the stand-in got an add with the
  sandbox's netns (a connection from inside it to any address reaches the stand-in's 15001); its IP
  is in the node's probe set; the pod is annotated ``ambient.istio.io/redirection: enabled``;
- across the node's bridge, a connection from a pod outside the mesh to its app port lands on the
  stand-in's 15006 (15008 on its HBONE listener), and a probe from the node as kubelet's uid is SNATed
  to 169.254.7.127 and reaches the app;
- a running pod whose namespace is relabelled ambient is enrolled by the node agent's watch, and
  unenrolled when relabelled ``none`` or unlabelled (rules, probe set entry, annotation gone; the
  stand-in's delete);
- ztunnel restarted: the new one gets the enrolled pods in its snapshot;
- install-cni restarted (an upgrade: its DaemonSet stays): the running pods' rules stay byte for byte,
  the reconnecting stand-in's snapshot has them, new pods are enrolled by the new agent;
- a pod deleted (the API server's graceful deletion, StopPodSandbox, RemovePodSandbox): the
  stand-in's delete, its IP out of the probe set, nothing left on the node;
- at the end install-cni stops with its DaemonSet gone (an uninstall): the node's rules, sets and
  the plugin go.

The nodes mount the runtime's netns directory only where the DaemonSet does (``/host`` + its path);
the node agent opens a plugin event's netns under ``/host``, as Istio's ``openNetnsInRoot``.
"""

from __future__ import annotations

import asyncio
import functools
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.cni.ambient.test_inpod_apply import golden_restores
from tests.cni.ambient.test_inpod_rules import TEST_SNAT_V6, golden
from tests.cni.ambient.ztunnel_standin import ZtunnelStandin
from tests.cni.fake_kube import now_rfc3339
from tests.cni.netns import in_netns, netns, sh, socket_in
from tests.cri.cluster import (
    CONFLIST,
    HOST_MOUNTS,
    NOTHING_LEFT,
    CriNode,
    cri_node,
    leftovers,
    plain_pod,
    saved_rules,
)
from tests.cri.conditions import cannot_run
from tests.cri.containerd import Sandbox, pb

REASON = cannot_run()
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(REASON is not None, reason=REASON or "")]
T = TypeVar("T")
AMBIENT = {"istio.io/dataplane-mode": "ambient"}
REDIRECTION = "ambient.istio.io/redirection"
HOST_PROBE_SNAT_V6 = "fd16:9254:7127:1337:ffff:ffff:ffff:ffff"
"""Istio's ``HostProbeV6SNATAddress`` (what the chart's node agent uses); Istio's golden has its test's."""
ANYWHERE = ("10.96.0.10", 8000)
"""A service address nothing routes: only a redirected connection is answered."""
NATIVE = "nftables"
BACKENDS = ("iptables", NATIVE)
"""The chart's ``global.nativeNftables`` off (its default: iptables, the probe set an ipset) and on."""


class StandinOnNode:
    """The ztunnel stand-in on the node: its loop in a thread of its own, as ztunnel is a process of its
    own, so it answers the node agent while the test blocks in a CRI call."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.ztunnel: ZtunnelStandin | None = None

    def run(self, make: Callable[[], Coroutine[Any, Any, T]], timeout: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(make(), self._loop).result(timeout)

    @property
    def zt(self) -> ZtunnelStandin:
        assert self.ztunnel is not None, "the stand-in is not running"
        return self.ztunnel

    def start(self) -> None:
        """A new ztunnel: connects (again whenever the node agent ends the connection), waits for the snapshot."""

        async def start() -> None:
            self.ztunnel = ZtunnelStandin(self.socket_path, reconnect=True)
            await self.ztunnel.connect(timeout=30)
            await self.ztunnel.wait_snapshot(30)

        self.run(start, 40)

    def stop(self) -> None:
        """ztunnel exits: its connection and proxies go."""
        if self.ztunnel is not None:
            self.run(self.zt.stop)
            self.ztunnel = None

    def wait_for(self, condition: Callable[[ZtunnelStandin], bool], timeout: float = 20) -> None:
        self.run(lambda: self.zt.wait_for(condition, timeout), timeout + 5)

    def received(self) -> list[tuple[str, str]]:
        return self.run(self._copy_received)

    async def _copy_received(self) -> list[tuple[str, str]]:
        return list(self.zt.received)

    def close(self) -> None:
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def cri(backend: str) -> Iterator[CriNode]:
    """One ambient node per backend (containerd, install-cni with its node agent, the FAKE API server)."""
    env = {"NATIVE_NFTABLES": "true"} if backend == NATIVE else {}
    base = Path(tempfile.mkdtemp(prefix="ia-amb-", dir="/tmp"))  # short: Unix socket paths
    try:
        with cri_node(base, ambient=True, env=env) as node:
            yield node
            uninstall(node)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def uninstall(cri: CriNode) -> None:
    """install-cni stopped with its DaemonSet gone (an uninstall): it exits cleanly and takes the node
    agent's host rules and probe sets, and the plugin, off the node."""
    cri.kube.daemonsets.clear()
    assert cri.stop_install_cni() == 0, cri.install_cni_log.read_text()
    node = cri.node.netns.path
    assert "istio" not in sh(*in_netns(node, ["nft", "list", "tables"]))
    for command in (
        "iptables-nft-save",
        "iptables-legacy-save",
        "ip6tables-nft-save",
        "ip6tables-legacy-save",
    ):
        assert "ISTIO" not in sh(*in_netns(node, [command])), command
    if shutil.which("ipset"):
        assert "istio" not in sh(*in_netns(node, ["ipset", "list", "-n"]))
    assert "istio-cni" not in (cri.layout.conf / CONFLIST).read_text()
    assert "Traceback" not in cri.install_cni_log.read_text()


@pytest.fixture(scope="module")
def ztunnel(cri: CriNode) -> Iterator[StandinOnNode]:
    """ztunnel on the node, on the socket path the DaemonSet mounts (the node's side of it)."""
    assert cri.ambient is not None
    standin = StandinOnNode(cri.ambient.ztunnel_socket)
    try:
        standin.start()
        yield standin
    finally:
        standin.close()


# -- pods --------------------------------------------------------------------------------------------


def namespace(cri: CriNode, name: str, labels: dict[str, str] | None = None) -> None:
    if name not in cri.kube.namespaces:
        cri.kube_call(lambda: cri.kube.add_namespace(name, labels))


def run_pod(cri: CriNode, name: str, ns: str) -> tuple[Sandbox, str]:
    """The pod as the scheduler binds it (the FAKE API server), then its sandbox as the kubelet asks
    containerd for it (the pod's UID in its cgroup, as the kubelet names it), then its IP in the pod's
    status as the kubelet reports it; the sandbox and the pod's UID."""
    pod = cri.kube_call(lambda: cri.kube.add_pod(plain_pod(name, ns)))
    uid = pod["metadata"]["uid"]
    request = pb.RunPodSandboxRequest(config=cri.containerd.sandbox_config(name, ns, uid))
    answer = cri.containerd.runtime.RunPodSandbox(request, timeout=60)
    sandbox = cri.containerd.sandbox(answer.pod_sandbox_id)
    status = {"status": {"phase": "Running", "podIP": sandbox.ip, "podIPs": [{"ip": sandbox.ip}]}}
    cri.kube_call(lambda: cri.kube.update_pod(ns, name, status))
    return sandbox, uid


def remove(cri: CriNode, sandbox: Sandbox) -> None:
    """As a pod is deleted: the API server marks it (graceful deletion), the kubelet stops its sandbox
    (StopPodSandbox), the pod leaves the API server once stopped, and the kubelet removes the sandbox
    (RemovePodSandbox)."""
    key = (sandbox.namespace, sandbox.name)
    if key in cri.kube.pods:
        deleting = {"metadata": {"deletionTimestamp": now_rfc3339(), "deletionGracePeriodSeconds": 30}}
        cri.kube_call(lambda: cri.kube.update_pod(*key, deleting))
    cri.containerd.stop_pod_sandbox(sandbox.id)
    if key in cri.kube.pods:
        cri.kube_call(lambda: cri.kube.finish_deletion(*key))
    cri.containerd.remove_pod_sandbox(sandbox.id)


@contextmanager
def sandboxes(cri: CriNode) -> Iterator[list[Sandbox]]:
    made: list[Sandbox] = []
    try:
        yield made
    finally:
        for sandbox in made:
            remove(cri, sandbox)


def annotation(cri: CriNode, sandbox: Sandbox) -> str | None:
    pod = cri.kube.pods.get((sandbox.namespace, sandbox.name), {})
    return (pod.get("metadata", {}).get("annotations") or {}).get(REDIRECTION)


def eventually(condition: Callable[[], bool], what: str, timeout: float = 20) -> None:
    from istio_agent.ctl.local import wait_until

    wait_until(condition, timeout, what)


# -- what the tests read back ----------------------------------------------------------------------------


def golden_text(kind: str) -> str:
    """Istio's golden ``default_ipv6`` (DNS capture and IPv6: the chart's defaults) of ``kind``. Its
    v6 probe SNAT address is its test's (``constructTestConfig``); the chart's node agent uses Istio's
    default, which is put in its place."""
    return golden(kind, "default", True).replace(TEST_SNAT_V6, HOST_PROBE_SNAT_V6)


def nft_ruleset(netns_path: Path) -> str:
    return sh(*in_netns(netns_path, ["nft", "-s", "list", "ruleset"]))


@functools.cache
def istio_inpod(kind: str) -> dict[str, str]:
    """What Istio's golden installs in a fresh namespace, read back as :func:`inpod_state` reads a
    sandbox: ``kind`` is an iptables backend (its restore input per family restored and saved by that
    backend) or ``nftables`` (its transaction given to ``nft -f``, the ruleset listed)."""
    with netns("istio") as reference:
        if kind == NATIVE:
            sh(*in_netns(reference.path, ["nft", "-f", "-"]), input=golden_text(NATIVE))
            return {"nft": nft_ruleset(reference.path)}
        for family, text in golden_restores(golden_text("iptables")).items():
            restore = f"{'ip6tables' if family == 'v6' else 'iptables'}-{kind}-restore"
            sh(*in_netns(reference.path, [restore]), input=text)
        return saved_rules(reference.path)


def inpod_state(sandbox: Sandbox, backend: str) -> dict[str, str]:
    """The sandbox's rules in their tool's listing: ``nft list ruleset``, or the saves of each iptables
    backend holding Istio's chains."""
    if backend == NATIVE:
        return {"nft": nft_ruleset(sandbox.netns)}
    return saved_rules(sandbox.netns)


def policy_routing(netns_path: Path) -> list[str]:
    """The in-pod fwmark rule and table 100's routes, both families."""
    lines = []
    for family in ("-4", "-6"):
        rules = sh(*in_netns(netns_path, ["ip", family, "rule", "show"]))
        lines += [f"{family} {line}" for line in rules.splitlines() if "lookup 100" in line]
        routes = sh(*in_netns(netns_path, ["ip", family, "route", "show", "table", "100"]))
        lines += [f"{family} table 100: {re.sub(r' +', ' ', line.strip())}" for line in routes.splitlines()]
    return lines


def assert_inpod_rules(sandbox: Sandbox, backend: str) -> dict[str, str]:
    """The sandbox holds exactly what Istio's golden installs (one iptables backend, both families, or
    nft's tables) and the fwmark rule of both families; the rules are returned."""
    rules = inpod_state(sandbox, backend)
    if backend == NATIVE:
        assert rules == istio_inpod(NATIVE)
    else:
        kinds = {command.split("-")[1] for command in rules}
        assert len(kinds) == 1 and len(rules) == 2, sorted(rules)
        assert rules == istio_inpod(kinds.pop())
    routing = policy_routing(sandbox.netns)
    assert [line for line in routing if "fwmark" in line] == [
        "-4 32764:\tfrom all fwmark 0x111/0xfff lookup 100",
        "-6 32764:\tfrom all fwmark 0x111/0xfff lookup 100",
    ], routing
    return rules


def probe_set(cri: CriNode, backend: str) -> str:
    """The node's probe set of IPv4 pod IPs (the ipset, or the set in nft's host table)."""
    if backend == NATIVE:
        argv = ["nft", "list", "set", "inet", "istio-ambient-nat", "istio-inpod-probes-v4"]
    else:
        argv = ["ipset", "list", "istio-inpod-probes-v4"]
    return sh(*in_netns(cri.node.netns.path, argv))


def connect(netns_path: Path, address: tuple[str, int]) -> str:
    """Connect from inside a network namespace and read the first line answered."""
    sock = socket_in(netns_path)
    with sock:
        sock.settimeout(5)
        sock.connect(address)
        return sock.makefile().readline().strip()


def connect_from(sandbox: Sandbox, address: tuple[str, int] = ANYWHERE) -> str:
    """Connect from inside the sandbox (as its app would) and read the first line answered."""
    return connect(sandbox.netns, address)


def runs_proxy_for(ztunnel: StandinOnNode, sandbox: Sandbox, uid: str) -> None:
    """The stand-in runs the pod's proxy in the sandbox's netns (the fd it got is that netns), and an
    app connection from the sandbox to anywhere lands on its 15001."""
    ztunnel.wait_for(lambda zt: uid in zt.workloads)
    workload = ztunnel.zt.workloads[uid]
    status = sandbox.netns.stat()
    assert workload.netns_id == (status.st_dev, status.st_ino)
    assert (workload.info.name, workload.info.namespace) == (sandbox.name, sandbox.namespace)
    assert connect_from(sandbox) == f"ztunnel-standin {uid} 15001"


def enrolled(
    cri: CriNode, ztunnel: StandinOnNode, sandbox: Sandbox, uid: str, backend: str
) -> dict[str, str]:
    """Everything of an enrolled pod, checked; its rules."""
    rules = assert_inpod_rules(sandbox, backend)
    runs_proxy_for(ztunnel, sandbox, uid)
    assert annotation(cri, sandbox) == "enabled"
    assert sandbox.ip in probe_set(cri, backend)
    return rules


# -- the tests ---------------------------------------------------------------------------------------


def test_a_pod_in_an_ambient_namespace_is_enrolled_when_its_sandbox_runs(
    cri: CriNode, ztunnel: StandinOnNode, backend: str
) -> None:
    namespace(cri, "amb", AMBIENT)
    with sandboxes(cri) as made:
        sandbox, uid = run_pod(cri, "app-1", "amb")
        made.append(sandbox)
        assert sandbox.ip.startswith("10.22.0.")
        enrolled(cri, ztunnel, sandbox, uid, backend)
    ztunnel.wait_for(lambda zt: uid not in zt.workloads)
    assert ("del", uid) in ztunnel.received()
    assert sandbox.ip not in probe_set(cri, backend)
    assert leftovers(cri) == NOTHING_LEFT


def test_through_the_nodes_bridge_inbound_lands_on_ztunnel_and_the_kubelets_probe_on_the_app(
    cri: CriNode, ztunnel: StandinOnNode, backend: str
) -> None:
    """Traffic as the node carries it (containerd's sandboxes on Debian's bridge): a connection from a
    pod outside the mesh to an enrolled pod's app port lands on ztunnel's inbound 15006, to 15008 on
    its HBONE listener; the kubelet's probe (a node socket of kubelet's uid, root here) is SNATed by the
    node agent's host rules to 169.254.7.127 and reaches the app itself."""
    namespace(cri, "amb", AMBIENT)
    namespace(cri, "plain")
    with sandboxes(cri) as made:
        web, uid = run_pod(cri, "web-1", "amb")
        made.append(web)
        client, _ = run_pod(cri, "client-1", "plain")
        made.append(client)
        runs_proxy_for(ztunnel, web, uid)
        assert connect(client.netns, (web.ip, 8080)) == f"ztunnel-standin {uid} 15006"
        assert connect(client.netns, (web.ip, 15008)) == f"ztunnel-standin {uid} 15008"

        app = socket_in(web.netns)
        with app:
            app.bind(("0.0.0.0", 8080))
            app.listen(4)
            app.settimeout(5)
            probe = socket_in(cri.node.netns.path)
            with probe:
                probe.settimeout(5)
                probe.connect((web.ip, 8080))
                conn, peer = app.accept()
                with conn:
                    conn.sendall(b"ok\n")
                assert probe.recv(3) == b"ok\n"  # the reply goes back through the SNAT
        assert peer[0] == "169.254.7.127"
    assert leftovers(cri) == NOTHING_LEFT


def test_a_running_pod_is_enrolled_when_its_namespace_turns_ambient_and_unenrolled_when_it_turns_off(
    cri: CriNode, ztunnel: StandinOnNode, backend: str
) -> None:
    namespace(cri, "later")
    with sandboxes(cri) as made:
        sandbox, uid = run_pod(cri, "app-2", "later")
        made.append(sandbox)
        assert inpod_state(sandbox, backend) in ({}, {"nft": ""})  # not ambient yet: no rules
        assert uid not in ztunnel.zt.workloads

        cri.kube_call(lambda: cri.kube.update_namespace("later", {"metadata": {"labels": AMBIENT}}))
        eventually(lambda: annotation(cri, sandbox) == "enabled", "enrolled by the node agent's watch")
        enrolled(cri, ztunnel, sandbox, uid, backend)

        off = {"metadata": {"labels": {"istio.io/dataplane-mode": "none"}}}
        cri.kube_call(lambda: cri.kube.update_namespace("later", off))
        eventually(lambda: annotation(cri, sandbox) is None, "unenrolled")
        ztunnel.wait_for(lambda zt: uid not in zt.workloads)
        assert ztunnel.received()[-1] == ("del", uid)
        assert inpod_state(sandbox, backend) in ({}, {"nft": ""})
        assert [line for line in policy_routing(sandbox.netns) if "fwmark" in line] == []
        assert sandbox.ip not in probe_set(cri, backend)

        cri.kube_call(lambda: cri.kube.update_namespace("later", {"metadata": {"labels": AMBIENT}}))
        eventually(lambda: annotation(cri, sandbox) == "enabled", "enrolled again")
        enrolled(cri, ztunnel, sandbox, uid, backend)
        unlabelled = {"metadata": {"labels": {"istio.io/dataplane-mode": None}}}
        cri.kube_call(lambda: cri.kube.update_namespace("later", unlabelled))
        eventually(lambda: annotation(cri, sandbox) is None, "unenrolled once the label is removed")
        ztunnel.wait_for(lambda zt: uid not in zt.workloads)
        assert inpod_state(sandbox, backend) in ({}, {"nft": ""})
    assert leftovers(cri) == NOTHING_LEFT


def test_a_restarted_ztunnel_gets_the_enrolled_pods_in_its_snapshot(
    cri: CriNode, ztunnel: StandinOnNode, backend: str
) -> None:
    namespace(cri, "amb", AMBIENT)
    with sandboxes(cri) as made:
        first, first_uid = run_pod(cri, "zt-1", "amb")
        made.append(first)
        second, second_uid = run_pod(cri, "zt-2", "amb")
        made.append(second)
        ztunnel.wait_for(lambda zt: {first_uid, second_uid} <= set(zt.workloads))

        ztunnel.stop()
        ztunnel.start()  # returns once the snapshot is acked
        received = ztunnel.received()
        assert received[-1] == ("snapshot", "")
        assert sorted(received[:-1]) == sorted([("add", first_uid), ("add", second_uid)])
        runs_proxy_for(ztunnel, first, first_uid)
        runs_proxy_for(ztunnel, second, second_uid)
    ztunnel.wait_for(lambda zt: not ({first_uid, second_uid} & set(zt.workloads)))
    assert leftovers(cri) == NOTHING_LEFT


def test_a_restarted_node_agent_leaves_running_pods_as_they_are(
    cri: CriNode, ztunnel: StandinOnNode, backend: str
) -> None:
    """install-cni stopped and started again while its DaemonSet stays (an upgrade): the plugin stays
    chained, the pods' rules stay byte for byte, the reconnecting ztunnel's snapshot has them."""
    namespace(cri, "amb", AMBIENT)
    with sandboxes(cri) as made:
        sandbox, uid = run_pod(cri, "kept-1", "amb")
        made.append(sandbox)
        rules = enrolled(cri, ztunnel, sandbox, uid, backend)
        routing = policy_routing(sandbox.netns)
        version = cri.kube.pods[("amb", "kept-1")]["metadata"]["resourceVersion"]
        proxy = ztunnel.zt.workloads[uid]

        assert cri.stop_install_cni() == 0, cri.install_cni_log.read_text()
        ztunnel.wait_for(lambda zt: not zt.snapshot_received)
        assert inpod_state(sandbox, backend) == rules  # an upgrade: nothing is taken out meanwhile
        received = len(ztunnel.received())
        cri.start_install_cni()
        ztunnel.wait_for(lambda zt: zt.snapshot_received, 40)
        cri.assert_in_image_root()
        assert ztunnel.received()[received:] == [("add", uid), ("snapshot", "")]
        assert ztunnel.zt.workloads[uid] is proxy  # the same netns: ztunnel keeps its proxy
        assert inpod_state(sandbox, backend) == rules
        assert policy_routing(sandbox.netns) == routing
        assert cri.kube.pods[("amb", "kept-1")]["metadata"]["resourceVersion"] == version
        assert sandbox.ip in probe_set(cri, backend)
        assert connect_from(sandbox) == f"ztunnel-standin {uid} 15001"

        other, other_uid = run_pod(cri, "after-restart", "amb")  # the new agent takes new pods
        made.append(other)
        enrolled(cri, ztunnel, other, other_uid, backend)
    assert leftovers(cri) == NOTHING_LEFT


def test_a_removed_pod_is_deleted_from_ztunnel_and_leaves_nothing(
    cri: CriNode, ztunnel: StandinOnNode, backend: str
) -> None:
    namespace(cri, "amb", AMBIENT)
    sandbox, uid = run_pod(cri, "gone-1", "amb")
    try:
        enrolled(cri, ztunnel, sandbox, uid, backend)
    finally:
        remove(cri, sandbox)
    ztunnel.wait_for(lambda zt: uid not in zt.workloads)
    assert ("del", uid) in ztunnel.received()
    eventually(lambda: sandbox.ip not in probe_set(cri, backend), "the pod's IP out of the probe set")
    assert leftovers(cri) == NOTHING_LEFT


def test_with_only_the_daemonsets_netns_mount_an_ambient_pods_sandbox_runs() -> None:
    """The DaemonSet mounts the runtime's netns directory only at ``/host`` + its host path. The mount
    is right (a sandbox's netns is there, the same namespace, inside install-cni's root), so an ambient
    pod's RunPodSandbox must succeed as on the module's node."""
    base = Path(tempfile.mkdtemp(prefix="ia-amb-", dir="/tmp"))
    try:
        with cri_node(base, ambient=True, env={"NATIVE_NFTABLES": "true"}) as cri:
            assert cri.ambient is not None and cri.install_cni is not None
            standin = StandinOnNode(cri.ambient.ztunnel_socket)
            try:
                standin.start()
                namespace(cri, "plain")
                namespace(cri, "amb", AMBIENT)
                with sandboxes(cri) as made:
                    sandbox, _ = run_pod(cri, "plain-1", "plain")
                    made.append(sandbox)
                    root = Path(f"/proc/{cri.install_cni.pid}/root")
                    assert not (root / str(sandbox.netns).lstrip("/")).exists()
                    seen = (root / HOST_MOUNTS.lstrip("/") / str(sandbox.netns).lstrip("/")).stat()
                    assert (seen.st_dev, seen.st_ino) == (
                        sandbox.netns.stat().st_dev,
                        sandbox.netns.stat().st_ino,
                    )
                    ambient_sandbox, uid = run_pod(cri, "app-1", "amb")
                    made.append(ambient_sandbox)
                    runs_proxy_for(standin, ambient_sandbox, uid)
            finally:
                standin.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
