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

import pytest

from istio_agent.cni.ambient.nodeagent import build
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


async def run_installer(node: Node, kube: FakeKube) -> tuple[Installer, asyncio.Task[None], FakeZtunnel]:
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
            "KUBERNETES_SERVICE_HOST": "10.96.0.1",
            "KUBERNETES_SERVICE_PORT": "443",
        },
    )
    assert settings.ambient is not None
    ztunnel = FakeZtunnel()
    agent = build(
        settings.ambient,
        KubeClient(parse_kubeconfig(kube.kubeconfig(), "test")),
        socket_dir=node.run,
        registry=Registry(prefix="istio_"),
        rules=FakeRules(),
        probes=FakeHostProbes(),
        ztunnel=ztunnel,
        informer_options={"backoff": reflector_backoff(initial=0.05, cap=0.2)},
    )
    installer = Installer(settings, Registry(prefix="istio_"), node_agent=agent)
    return installer, asyncio.create_task(installer.run()), ztunnel


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
    assert installer.node_agent is not None and not installer.node_agent.ready


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
