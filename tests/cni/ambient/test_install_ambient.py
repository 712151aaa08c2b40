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
import shutil
import stat
import tempfile
from collections.abc import AsyncIterator
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
from tests.cni.ambient.test_events import FakeHostProbes, FakeRules, FakeZtunnel
from tests.cni.ambient.test_plugin_ambient import HELM_SELECTORS
from tests.cni.fake_kube import FakeKube, start_fake_kube
from tests.cni.install.layout import Node

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
        await runner.cleanup()


@pytest.fixture
def short_root() -> AsyncIterator[Path]:
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
