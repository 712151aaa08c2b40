"""install-cni with ambient enabled: Istio's ``AMBIENT_*`` settings (``cni/pkg/cmd/root.go``, read through
viper: variables, no flags), and the node agent started before the first install pass, its readiness
part of install-cni's (Istio's ``healthServer.go``: ``/readyz`` needs the install and the agent).

The installer runs in-process on a temp-dir node (``tests/cni/install/layout.py``); the node agent talks
to the FAKE API server (``tests/cni/fake_kube.py``) with FAKE rules, probe set and ztunnel
(``test_events.py``): the host's own rules are never touched here.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from istio_agent.cni.ambient.nodeagent import build
from istio_agent.cni.install.ambient import AmbientAgent
from istio_agent.cni.install.installer import Installer
from istio_agent.cni.install.settings import load_settings
from istio_agent.cni.kube import KubeClient, parse_kubeconfig
from istio_agent.cni.repair.informer import reflector_backoff
from istio_agent.config.env import ConfigError
from istio_agent.metrics import Registry
from tests.cni.ambient.test_events import FakeHostProbes, FakeRules, FakeZtunnel, bounded
from tests.cni.ambient.test_plugin_ambient import HELM_SELECTORS
from tests.cni.fake_kube import FakeKube, start_fake_kube
from tests.cni.install.layout import Node
from tests.cni.netns import needs_root

SELECTOR_ENV = json.dumps(HELM_SELECTORS)


# -- settings ---------------------------------------------------------------------------------------------


def test_ambient_settings_are_istios_variables() -> None:
    settings = load_settings(
        {"ambient-enabled": "true"},
        {
            "AMBIENT_ENABLEMENT_SELECTOR": SELECTOR_ENV,
            "AMBIENT_DNS_CAPTURE": "true",
            "AMBIENT_IPV6": "true",
            "AMBIENT_RECONCILE_POD_RULES_ON_STARTUP": "true",
            "AMBIENT_DISABLE_SAFE_UPGRADE": "true",
            "ZTUNNEL_UDS_ADDRESS": "/run/zt/ztunnel.sock",
            "NATIVE_NFTABLES": "true",
            "NODE_NAME": "node-7",
            "POD_NAMESPACE": "kube-system",
        },
    )
    assert settings.plugin.ambient_enabled
    assert settings.plugin.enablement_selectors == tuple(HELM_SELECTORS)
    ambient = settings.ambient
    assert ambient is not None
    assert len(ambient.selectors) == 2
    assert ambient.ztunnel_socket == Path("/run/zt/ztunnel.sock")
    assert (ambient.node_name, ambient.system_namespace) == ("node-7", "istio-system")
    inpod = ambient.inpod
    assert (inpod.dns_capture, inpod.ipv6, inpod.reconcile, inpod.native_nftables) == (True, True, True, True)
    assert settings.ambient_disable_safe_upgrade


def test_ambient_defaults_are_istios() -> None:
    settings = load_settings({}, {"AMBIENT_ENABLED": "true", "SYSTEM_NAMESPACE": "mesh"})
    ambient = settings.ambient
    assert ambient is not None
    assert ambient.selectors == ()  # Istio's chart always sets them; without, no pod is ambient
    assert ambient.ztunnel_socket == Path("/var/run/ztunnel/ztunnel.sock")
    assert ambient.system_namespace == "mesh"
    inpod = ambient.inpod
    assert (inpod.dns_capture, inpod.ipv6, inpod.reconcile, inpod.native_nftables) == (
        False,
        False,
        False,
        False,
    )
    assert not settings.ambient_disable_safe_upgrade


def test_the_node_side_runs_in_the_nodes_namespace_when_the_chart_allows_the_switch(tmp_path: Path) -> None:
    """The chart sets ALLOW_SWITCH_TO_HOST_NS unless the DaemonSet shares the node's network: the probe
    rules and sets then go to ``/host/proc/1/ns/net`` (Istio's RunAsHost), not install-cni's own."""
    from istio_agent.cni.ambient.nodeagent import build
    from istio_agent.metrics import Registry

    switched = load_settings({"ambient-enabled": "true"}, {"ALLOW_SWITCH_TO_HOST_NS": "true"}).ambient
    own = load_settings({"ambient-enabled": "true"}, {}).ambient
    assert switched is not None and own is not None
    assert switched.host_netns == Path("/host/proc/1/ns/net")
    assert own.host_netns is None  # hostNetwork: install-cni's namespace is the node's
    agent = build(switched, client=None, socket_dir=tmp_path, registry=Registry())  # type: ignore[arg-type]
    assert agent.dataplane.probes.netns == Path("/host/proc/1/ns/net")  # type: ignore[attr-defined]


def test_without_ambient_there_is_no_node_agent() -> None:
    settings = load_settings({}, {"AMBIENT_ENABLEMENT_SELECTOR": SELECTOR_ENV})
    assert settings.ambient is None and not settings.plugin.ambient_enabled


@pytest.mark.parametrize(
    "selector",
    [
        '[{"podSelector": {"matchExpressions": [{"key": "a", "operator": "Near", "values": ["b"]}]}}]',
        '[{"podSelector": {"matchExpressions": [{"key": "a", "operator": "In"}]}}]',
        '[{"namespaceSelector": {"matchLabels": "x"}}]',
    ],
)
def test_a_selector_istio_would_refuse_stops_install_cni(selector: str) -> None:
    with pytest.raises(ConfigError, match="failed to instantiate ambient enablement selector"):
        load_settings({"ambient-enabled": "true"}, {"AMBIENT_ENABLEMENT_SELECTOR": selector})


# -- install-cni's run ------------------------------------------------------------------------------------


@pytest.fixture
async def kube(tmp_path: Path) -> AsyncIterator[FakeKube]:
    state = tmp_path / "ca"
    state.mkdir()
    fake, runner = await start_fake_kube(state)
    try:
        yield fake
    finally:
        await bounded(runner.cleanup(), "the FAKE API server stops")


@pytest.fixture
def short_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="amb-"))  # the event socket's path must stay under 108 bytes
    yield root
    shutil.rmtree(root, ignore_errors=True)


async def run_installer(
    node: Node, kube: FakeKube, environ: dict[str, str] | None = None
) -> tuple[Installer, asyncio.Task[None], FakeHostProbes]:
    """install-cni's installer with ambient on, the node agent on FAKES; POD_NAMESPACE istio-system."""
    settings = load_settings(
        {
            "ambient-enabled": "true",
            "mounted-cni-net-dir": str(node.conf),
            "cni-agent-run-dir": str(node.run),
            "cni-bin-source-dir": str(node.source),
            "cni-bin-target-dirs": str(node.bin),
            "service-account-dir": str(node.sa),
            "cni-conf-name": "10-calico.conflist",
        },
        {
            "AMBIENT_ENABLEMENT_SELECTOR": SELECTOR_ENV,
            "NODE_NAME": "node-1",
            "POD_NAMESPACE": "istio-system",
            "KUBERNETES_SERVICE_HOST": "10.96.0.1",
            "KUBERNETES_SERVICE_PORT": "443",
            **(environ or {}),
        },
    )
    assert settings.ambient is not None
    client = KubeClient(parse_kubeconfig(kube.kubeconfig(), "test"))
    probes = FakeHostProbes()
    agent = build(
        settings.ambient,
        client,
        socket_dir=node.run,
        registry=Registry(prefix="istio_"),
        rules=FakeRules(),
        probes=probes,
        ztunnel=FakeZtunnel(),
        informer_options={"backoff": reflector_backoff(initial=0.05, cap=0.2)},
    )
    ambient = AmbientAgent(agent, client, settings, retry_interval=0.01)
    installer = Installer(settings, Registry(prefix="istio_"), ambient=ambient)
    return installer, asyncio.create_task(installer.run()), probes


async def eventually(condition: object, what: str, timeout: float = 10.0) -> None:
    assert callable(condition)
    try:
        async with asyncio.timeout(timeout):
            while not condition():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"not within {timeout}s: {what}") from None


async def test_the_node_agent_starts_before_the_plugin_is_installed(kube: FakeKube, short_root: Path) -> None:
    node = Node(short_root)
    node.put("calico.conflist", "10-calico.conflist")
    kube.add_namespace("default")
    installer, task, _ = await run_installer(node, kube)
    try:
        await eventually(lambda: installer.ready, "install-cni ready")
        socket = node.run / "pluginevent.sock"
        assert stat.S_ISSOCK(socket.stat().st_mode)
        entry = [
            p
            for p in json.loads((node.conf / "10-calico.conflist").read_text())["plugins"]
            if p["type"] == "istio-cni"
        ]
        assert entry[0]["ambient_enabled"] is True
        assert entry[0]["enablement_selectors"] == HELM_SELECTORS
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert not socket.exists()  # the agent stopped with the run
    assert installer.ambient is not None and not installer.ambient.ready


async def test_install_cni_is_not_ready_until_the_node_agent_is(kube: FakeKube, short_root: Path) -> None:
    """The namespaces cannot be listed (RBAC): the agent never syncs, so nothing is installed and
    ``/readyz`` says why; once allowed, both come up."""
    node = Node(short_root)
    node.put("calico.conflist", "10-calico.conflist")
    kube.forbidden.add(("list", "namespaces"))
    installer, task, _ = await run_installer(node, kube)
    try:
        await asyncio.sleep(0.5)
        assert not installer.ready
        assert installer.reason == "the ambient node agent is starting"
        assert "istio-cni" not in (node.conf / "10-calico.conflist").read_text()  # not installed yet
        kube.forbidden.clear()
        await eventually(lambda: installer.ready, "ready once the agent synced")
        assert installer.reason == ""
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def istio_entry(node: Node) -> bool:
    plugins = json.loads((node.conf / "10-calico.conflist").read_text())["plugins"]
    return any(plugin["type"] == "istio-cni" for plugin in plugins)


@pytest.mark.parametrize(
    ("daemonset", "environ", "kept"),
    [
        pytest.param(
            {"metadata": {"name": "istio-cni-node"}}, {}, True, id="an upgrade: the DaemonSet stays"
        ),
        pytest.param(None, {}, False, id="an uninstall: the DaemonSet is gone"),
        pytest.param(
            {"metadata": {"name": "istio-cni-node", "deletionTimestamp": "2026-12-04T15:00:00Z"}},
            {},
            False,
            id="an uninstall: the DaemonSet is being deleted",
        ),
        pytest.param(
            {"metadata": {"name": "istio-cni-node"}},
            {"AMBIENT_DISABLE_SAFE_UPGRADE": "true"},
            False,
            id="safe upgrade disabled",
        ),
    ],
)
async def test_on_an_upgrade_the_plugin_and_host_rules_stay(
    kube: FakeKube, short_root: Path, daemonset: dict[str, Any] | None, environ: dict[str, str], kept: bool
) -> None:
    """Istio's ``ShouldStopCleanup``: while install-cni's DaemonSet is still there (an upgrade), the
    plugin stays installed, so new ambient pods wait (their ADD fails) for the next node agent, and the
    host's probe rules stay for the pods already running; otherwise both go."""
    if daemonset is not None:
        kube.daemonsets[("istio-system", "istio-cni-node")] = daemonset
    node = Node(short_root)
    node.put("calico.conflist", "10-calico.conflist")
    installer, task, probes = await run_installer(node, kube, environ)
    try:
        await eventually(lambda: installer.ready, "install-cni ready")
        assert probes.installed and istio_entry(node)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        installer.cleanup()
    assert probes.installed is kept
    assert istio_entry(node) is kept
    asked = ("GET", "/apis/apps/v1/namespaces/istio-system/daemonsets/istio-cni-node") in kube.calls
    assert asked is not bool(environ)  # with safe upgrade disabled Istio does not ask


async def test_when_the_daemonset_cannot_be_read_it_is_not_an_upgrade(
    kube: FakeKube, short_root: Path
) -> None:
    """Istio: an error other than NotFound or Unauthorized is tried again, then it shuts down normally."""
    kube.daemonsets[("istio-system", "istio-cni-node")] = {"metadata": {"name": "istio-cni-node"}}
    kube.forbidden.add(("get", "daemonsets"))
    node = Node(short_root)
    node.put("calico.conflist", "10-calico.conflist")
    installer, task, probes = await run_installer(node, kube)
    try:
        await eventually(lambda: installer.ready, "install-cni ready")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        installer.cleanup()
    assert not probes.installed and not istio_entry(node)


# -- the real install-cni process ---------------------------------------------------------------------------


def readyz(node_netns: Path, port: int) -> int:
    """GET /readyz on install-cni's health port, from inside the node's namespace: the status."""
    from tests.cni.netns import socket_in

    sock = socket_in(node_netns)
    with sock:
        sock.settimeout(2)
        try:
            sock.connect(("127.0.0.1", port))
            sock.sendall(b"GET /readyz HTTP/1.0\r\nHost: x\r\n\r\n")
            return int(sock.recv(64).split()[1])
        except OSError:
            return 0


@pytest.mark.e2e
@needs_root
async def test_install_cni_runs_the_node_agent_that_enrolls_the_plugins_pods(short_root: Path) -> None:
    """The real ``install-cni`` with ``AMBIENT_ENABLED=true``, in a namespace standing for the node, with
    the FAKE API server on that node's loopback: ready once the agent is; the real plugin (the entry
    install-cni wrote) hands an ambient pod over; the pod gets its in-pod rules, its IP goes in the
    node's probe set and the ztunnel stand-in runs its proxy; on SIGTERM (its DaemonSet gone: an
    uninstall) the node's probe rules and the plugin go."""
    from tests.cli.test_install_cni import free_port
    from tests.cni.ambient.test_enrollment import NODE, running_pod
    from tests.cni.ambient.test_events import ambient_pod
    from tests.cni.ambient.ztunnel_standin import ZtunnelStandin
    from tests.cni.fake_kube import TOKEN
    from tests.cni.install.layout import install_cni_args
    from tests.cni.netns import netns, socket_in
    from tests.cni.test_plugin_exec import PREV_RESULT

    if shutil.which("ipset") is None:
        pytest.skip("ipset is not installed (Debian's ipset)")
    with netns("node") as node_space:
        listener = socket_in(node_space.path)
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        state = short_root / "ca"
        state.mkdir()
        kube, runner = await start_fake_kube(state, sock=listener)
        root = short_root / "n"
        root.mkdir()
        layout = Node(root)
        layout.put("calico.conflist", "10-calico.conflist")
        (layout.sa / "ca.crt").write_bytes(kube.ca_pem)
        (layout.sa / "token").write_text(TOKEN)
        kube.add_namespace("default", {"istio.io/dataplane-mode": "ambient"})
        health = free_port()
        ztunnel_socket = short_root / "zt.sock"
        env = {
            **os.environ,
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(kube.port),
            "AMBIENT_ENABLED": "true",
            "AMBIENT_ENABLEMENT_SELECTOR": SELECTOR_ENV,
            "ZTUNNEL_UDS_ADDRESS": str(ztunnel_socket),
            "NODE_NAME": NODE,
            "POD_NAMESPACE": "istio-system",
            "REPAIR_ENABLED": "false",
        }
        args = [
            "nsenter",
            f"--net={node_space.path}",
            "--",
            *install_cni_args(layout, health_port=health),
            "--host-proc-dir=/proc",
            "--cni-conf-name=10-calico.conflist",
        ]
        log = short_root / "install-cni.log"
        with open(log, "wb") as output:
            process = subprocess.Popen(args, env=env, stdout=output, stderr=subprocess.STDOUT)
        ztunnel = ZtunnelStandin(ztunnel_socket)
        try:
            await eventually(lambda: readyz(node_space.path, health) == 200, "install-cni ready", 30)
            await ztunnel.connect()
            await ztunnel.wait_snapshot()
            uid = str(uuid.uuid4())
            with running_pod(uid) as pod:
                created = ambient_pod(uid=uid)
                created["spec"]["nodeName"] = NODE
                kube.add_pod(created)
                plugins = json.loads((layout.conf / "10-calico.conflist").read_text())["plugins"]
                [entry] = [plugin for plugin in plugins if plugin["type"] == "istio-cni"]
                config = {
                    **entry,
                    "cniVersion": "1.0.0",
                    "name": "k8s-pod-network",
                    "prevResult": PREV_RESULT,
                }
                cni_env = {
                    "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                    "CNI_COMMAND": "ADD",
                    "CNI_CONTAINERID": "abc123",
                    "CNI_NETNS": str(pod.space.path),
                    "CNI_IFNAME": "eth0",
                    "CNI_PATH": "/opt/cni/bin",
                    "CNI_ARGS": "K8S_POD_NAMESPACE=default;K8S_POD_NAME=app-1",
                }
                plugin = Path(sys.executable).parent / "istio-cni"
                done = await asyncio.to_thread(
                    subprocess.run,
                    ["nsenter", f"--net={node_space.path}", "--", str(plugin)],
                    input=json.dumps(config).encode(),
                    env=cni_env,
                    capture_output=True,
                    check=False,
                )
                assert done.returncode == 0, done.stdout.decode() + done.stderr.decode() + log.read_text()
                annotations = kube.pods[("default", "app-1")]["metadata"].get("annotations") or {}
                assert annotations.get("ambient.istio.io/redirection") == "enabled"
                assert "-A OUTPUT -j ISTIO_OUTPUT" in pod.space.exec("iptables-save")
                assert "10.1.0.5" in node_space.exec("ipset", "list", "istio-inpod-probes-v4")
                await ztunnel.wait_for(lambda zt: uid in zt.workloads)
            process.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(process.wait, 15)
            assert code == 0, log.read_text()
            assert "istio-inpod-probes-v4" not in node_space.exec("ipset", "list", "-n")
            assert "ISTIO_POSTRT" not in node_space.exec("iptables-save")
            assert "istio-cni" not in (layout.conf / "10-calico.conflist").read_text()
            assert "Traceback" not in log.read_text()
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            await ztunnel.stop()
            await runner.cleanup()
