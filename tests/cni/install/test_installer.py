"""install-cni's full run on temp directories: install, repair, the guardian, cleanup, and its HTTP endpoints.

The installer runs on the test's event loop; another component is played by the test writing files.
Waits are for a condition (the file, readiness), polled every few milliseconds, never a fixed sleep.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest

from istio_agent.cni.install import conffiles
from istio_agent.cni.install.guard import ConflictGuard, GuardSettings, Throttle
from istio_agent.cni.install.installer import RECHECK_SECONDS, Installer, InstallError
from istio_agent.cni.install.servers import health_endpoint, metrics_endpoint
from istio_agent.metrics import Registry
from tests.cni.install.layout import DATA, TOKEN, Node, golden

TIMEOUT = 5.0
RUNTIME = "istio-cni-runtime"


async def eventually(condition: Callable[[], bool], what: str, timeout: float = TIMEOUT) -> float:
    """Wait until ``condition()`` holds; returns how long it took."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)
    return time.monotonic() - start


class Running:
    """An installer running as a task; ``stop()`` cancels it and cleans up, as SIGTERM does."""

    def __init__(
        self,
        node: Node,
        guard: GuardSettings | None = None,
        recheck: float = RECHECK_SECONDS,
        **changes: object,
    ) -> None:
        self.node = node
        self.registry = Registry(prefix="istio_")
        self.guard = ConflictGuard(guard or GuardSettings())
        self.installer = Installer(
            node.settings(**changes),
            self.registry,
            throttle=Throttle(interval=0.0),
            guard=self.guard,
            recheck_seconds=recheck,
        )
        self.task = asyncio.create_task(self.installer.run())

    def metric(self, name: str, **labels: str) -> float | None:
        return self.registry.sample(f"istio_{name}", labels)

    async def ready(self) -> None:
        await eventually(lambda: self._alive() and self.installer.ready, "install-cni to be ready")

    async def not_ready(self, reason: str) -> None:
        await eventually(
            lambda: self._alive() and not self.installer.ready and reason in self.installer.reason,
            f"not ready because {reason!r} (now: {self.installer.reason!r})",
        )

    def _alive(self) -> bool:
        if self.task.done():
            self.task.result()  # raises what the run failed with
            raise AssertionError("the installer stopped")
        return True

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.installer.cleanup()


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


@pytest.fixture
async def stoppers() -> AsyncIterator[list[Running]]:
    started: list[Running] = []
    yield started
    for running in started:
        if not running.task.done():
            await running.stop()


def start(
    stoppers: list[Running],
    node: Node,
    guard: GuardSettings | None = None,
    recheck: float = RECHECK_SECONDS,
    **changes: object,
) -> Running:
    running = Running(node, guard, recheck, **changes)
    stoppers.append(running)
    return running


def add_runtime(node: Node) -> Path:
    """The plugin's runtime directory in the source, beside the launcher, as make cni-plugin lays it out."""
    runtime = node.source / RUNTIME
    (runtime / "lib").mkdir(parents=True)
    (runtime / "lib" / "libc.so.6").write_bytes(b"libc")
    (runtime / "lib" / "libc.so").symlink_to("libc.so.6")
    (runtime / "bin").mkdir()
    (runtime / "bin" / "python3").write_bytes(b"python")
    (runtime / "bin" / "python3").chmod(0o755)
    return runtime


def without_istio(path: Path) -> None:
    """What another CNI agent does: write its own list back, without our entry."""
    document = conffiles.read_document(path)
    path.write_bytes(conffiles.marshal(conffiles.remove_entry(document)))


def has_istio(path: Path) -> bool:
    try:
        return bool(conffiles.istio_entries(conffiles.read_document(path)))
    except conffiles.CniConfigError:
        return False


async def test_chains_into_calico_and_cleanup_restores_it(node: Node, stoppers: list[Running]) -> None:
    original = node.put("calico.conflist", "10-calico.conflist")
    before = conffiles.marshal(conffiles.read_document(original))
    original.write_bytes(before)  # as Go would have written it: cleanup must give back these bytes
    running = start(stoppers, node)
    await running.ready()
    golden("calico.conflist", original.read_bytes())
    assert (node.bin / "istio-cni").read_bytes() == (node.source / "istio-cni").read_bytes()
    assert TOKEN in (node.run / "istio-cni-kubeconfig").read_text()
    assert running.metric("cni_install_ready") == 1
    assert running.metric("cni_installs_total", result="SUCCESS") == 1
    await running.stop()
    assert original.read_bytes() == before
    assert not (node.bin / "istio-cni").exists()
    assert not (node.run / "istio-cni-kubeconfig").exists()
    assert [p.name for p in node.conf.iterdir()] == ["10-calico.conflist"]  # no temporary files left
    assert [p.name for p in node.bin.iterdir()] == []


async def test_converts_a_conf_and_cleanup_leaves_a_clean_list(node: Node, stoppers: list[Running]) -> None:
    node.put("minikube.conf", "10-minikube.conf")
    running = start(stoppers, node)
    await running.ready()
    converted = node.conf / "10-minikube.conflist"
    golden("minikube.conflist", converted.read_bytes())
    assert not (node.conf / "10-minikube.conf").exists()
    await running.stop()
    document = conffiles.read_document(converted)
    assert [p["type"] for p in document["plugins"]] == ["bridge"]  # stays a .conflist, as in Istio


async def test_skips_invalid_files_and_takes_the_first_valid(node: Node, stoppers: list[Running]) -> None:
    (node.conf / "00-not-json.conf").write_text("not json")
    (node.conf / "01-typeless.conf").write_text('{"name": "x"}')
    (node.conf / "02-nameless.conflist").write_text('{"plugins": [{"type": "bridge"}]}')
    node.put("calico.conflist", "10-calico.conflist")
    node.put("bridge.conf", "20-bridge.conf")
    running = start(stoppers, node)
    await running.ready()
    assert has_istio(node.conf / "10-calico.conflist")
    assert (node.conf / "20-bridge.conf").read_bytes() == (DATA / "bridge.conf").read_bytes()


@pytest.mark.parametrize("name", ["", "10-calico.conf"])
async def test_waits_for_a_delayed_primary_config(node: Node, stoppers: list[Running], name: str) -> None:
    running = start(stoppers, node, cni_conf_name=name)
    await running.not_ready("waiting for")
    node.put("calico.conflist", "10-calico.conflist")
    await running.ready()
    assert has_istio(node.conf / "10-calico.conflist")


async def test_repairs_a_removed_entry_within_seconds(node: Node, stoppers: list[Running]) -> None:
    path = node.put("calico.conflist", "10-calico.conflist")
    running = start(stoppers, node)
    await running.ready()
    without_istio(path)
    took = await eventually(lambda: has_istio(path) and running.installer.ready, "the entry to be put back")
    assert took < 3
    golden("calico.conflist", path.read_bytes())
    path.unlink()  # the whole file removed, then written again by its owner
    await running.not_ready("no networks found")
    node.put("calico.conflist", "10-calico.conflist")
    await eventually(lambda: has_istio(path) and running.installer.ready, "the entry in the new file")


async def test_standalone_file_removed_is_written_again(node: Node, stoppers: list[Running]) -> None:
    running = start(stoppers, node, chained_cni_plugin=False)
    await running.ready()
    path = node.conf / "YYY-istio-cni.conf"
    golden("YYY-istio-cni.conf", path.read_bytes())
    path.unlink()
    await eventually(lambda: path.exists() and running.installer.ready, "the standalone file to be back")
    await running.stop()
    assert not path.exists()


async def test_a_copied_binary_removed_is_copied_again(node: Node, stoppers: list[Running]) -> None:
    node.put("calico.conflist", "10-calico.conflist")
    running = start(stoppers, node)
    await running.ready()
    (node.bin / "istio-cni").unlink()
    await eventually(
        lambda: (node.bin / "istio-cni").exists() and running.installer.ready, "the binary to be back"
    )


async def test_a_corrupt_list_is_left_alone_reported_and_not_ready(
    node: Node, stoppers: list[Running], caplog: pytest.LogCaptureFixture
) -> None:
    path = node.put("calico.conflist", "10-calico.conflist")
    node.put("bridge.conf", "20-bridge.conf")
    running = start(stoppers, node)
    await running.ready()
    path.write_text('{"name": "k8s-pod-network", "plugins": [{"type": "calico"}')  # cut off mid-write
    await running.not_ready("corrupt and left alone")
    assert running.metric("cni_config_blocked", reason="corrupt") == 1
    assert path.read_text().endswith('"calico"}')  # untouched
    assert not has_istio(node.conf / "20-bridge.conf")  # and not moved to the next file
    assert any("is corrupt" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)
    node.put("calico.conflist", "10-calico.conflist")  # its owner fixes it
    await eventually(lambda: has_istio(path) and running.installer.ready, "the repaired file")
    assert running.metric("cni_config_blocked", reason="corrupt") == 0


async def test_a_corrupt_named_file_at_start_waits_to_be_fixed(node: Node, stoppers: list[Running]) -> None:
    path = node.conf / "10-calico.conflist"
    path.write_text("{")
    running = start(stoppers, node, cni_conf_name="10-calico.conflist")
    await running.not_ready("corrupt and left alone")
    assert path.read_text() == "{"
    node.put("calico.conflist", "10-calico.conflist")
    await eventually(lambda: has_istio(path) and running.installer.ready, "the entry once fixed")


async def test_backs_off_from_a_component_that_keeps_removing_our_entry(
    node: Node, stoppers: list[Running], caplog: pytest.LogCaptureFixture
) -> None:
    path = node.put("calico.conflist", "05-cilium.conflist")
    guard = GuardSettings(repairs=3, window=30, backoff=0.5)
    running = start(stoppers, node, guard)
    await running.ready()
    fights = 0
    fighting = True

    async def other_cni() -> None:
        """Removes our entry whenever it sees it, as Cilium with cni.exclusive=true does."""
        nonlocal fights
        while fighting:
            if has_istio(path):
                without_istio(path)
                fights += 1
            await asyncio.sleep(0.002)

    fighter = asyncio.create_task(other_cni())
    try:
        await running.not_ready("another component keeps rewriting")
        assert running.metric("cni_config_conflicts_total") == 1
        assert running.metric("cni_config_blocked", reason="conflict") == 1
        line = next(r.getMessage() for r in caplog.records if "keeps rewriting" in r.getMessage())
        assert "not fighting it" in line and "cni.exclusive=false" in line
        at_backoff = fights
        assert at_backoff <= guard.repairs + 1
        await asyncio.sleep(0.1)
        if running.guard.remaining() > 0:  # still within the back-off (a very slow machine may be past it)
            assert fights == at_backoff, "the file was rewritten during the back-off"
        # After the back-off one retry; removed again, so a longer back-off and a second count.
        await eventually(lambda: running.metric("cni_config_conflicts_total") == 2, "the second back-off")
        assert "no rewrite for 1s" in running.installer.reason
    finally:
        fighting = False
        await fighter
    await eventually(
        lambda: has_istio(path) and running.installer.ready, "install-cni back once the fight stopped"
    )
    assert running.metric("cni_config_blocked", reason="conflict") == 0


async def test_a_failed_pass_ends_the_run(node: Node, stoppers: list[Running]) -> None:
    running = start(stoppers, node, kubernetes_service_host="")
    with pytest.raises(InstallError, match="KUBERNETES_SERVICE_HOST not set"):
        await asyncio.wait_for(running.task, TIMEOUT)
    assert running.metric("cni_installs_total", result="CREATE_KUBECONFIG_FAILURE") == 1


async def test_health_readiness_and_metrics_over_http(node: Node, stoppers: list[Running]) -> None:
    running = start(stoppers, node)
    installer = running.installer
    health = health_endpoint("127.0.0.1", 0, lambda: (installer.ready, installer.reason))
    metrics = metrics_endpoint("127.0.0.1", 0, running.registry)
    await health.start()
    await metrics.start()
    try:
        async with aiohttp.ClientSession() as session:
            base = f"http://127.0.0.1:{health.port}"
            async with session.get(f"{base}/healthz") as response:
                assert response.status == 200
            await running.not_ready("waiting for a primary CNI config")  # the first pass runs off the loop
            async with session.get(f"{base}/readyz") as response:
                assert response.status == 503
                assert "waiting for a primary CNI config" in await response.text()
            node.put("calico.conflist", "10-calico.conflist")
            await running.ready()
            async with session.get(f"{base}/readyz") as response:
                assert response.status == 200
            async with session.get(f"{base}/nope") as response:
                assert response.status == 404
            async with session.get(f"http://127.0.0.1:{metrics.port}/metrics") as response:
                assert response.status == 200
                text = await response.text()
    finally:
        await health.stop()
        await metrics.stop()
    from prometheus_client.parser import text_string_to_metric_families

    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("istio_cni_install_ready", ())] == 1
    assert samples[("istio_cni_installs_total", (("result", "SUCCESS"),))] == 1
    assert samples[("istio_cni_config_blocked", (("reason", "corrupt"),))] == 0


async def test_a_rotated_token_rewrites_the_kubeconfig(node: Node, stoppers: list[Running]) -> None:
    node.put("calico.conflist", "10-calico.conflist")
    running = start(stoppers, node)
    await running.ready()
    kubeconfig = node.run / "istio-cni-kubeconfig"
    (node.sa / "token").write_text("rotated-token\n")
    await eventually(
        lambda: '"token": "rotated-token"' in kubeconfig.read_text(), "the new token in the kubeconfig"
    )
    await running.ready()


@pytest.mark.parametrize("broken", ["{", '{"name": "k8s-pod-network"}'], ids=["not-json", "no-plugins"])
async def test_cleanup_keeps_the_plugin_when_its_entry_cannot_be_removed(
    node: Node, stoppers: list[Running], caplog: pytest.LogCaptureFixture, broken: str
) -> None:
    """A list that may still chain istio-cni must not be left chaining a missing binary (Istio's
    Cleanup returns before removing anything when it cannot take its entry out)."""
    path = node.put("calico.conflist", "10-calico.conflist")
    add_runtime(node)
    running = start(stoppers, node)
    await running.ready()
    path.write_text(broken)
    await running.not_ready("corrupt")
    await running.stop()
    assert path.read_text() == broken
    assert (node.bin / "istio-cni").read_bytes() == (node.source / "istio-cni").read_bytes()
    assert (node.bin / RUNTIME / "bin" / "python3").read_bytes() == b"python"
    assert TOKEN in (node.run / "istio-cni-kubeconfig").read_text()
    kept = [r for r in caplog.records if "keeping the kubeconfig" in r.getMessage()]
    assert kept and kept[0].levelno >= logging.WARNING, [r.getMessage() for r in caplog.records]


async def test_not_ready_while_the_plugin_binary_is_missing(node: Node, stoppers: list[Running]) -> None:
    """An empty source and no binary on the host: the list would chain a plugin the runtime cannot exec."""
    node.put("calico.conflist", "10-calico.conflist")
    (node.source / "istio-cni").unlink()
    running = start(stoppers, node)
    installer = running.installer
    health = health_endpoint("127.0.0.1", 0, lambda: (installer.ready, installer.reason))
    await health.start()
    try:
        await running.not_ready("plugin binary istio-cni")
        assert has_istio(node.conf / "10-calico.conflist")  # written as Istio does; readiness tells
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{health.port}/readyz") as response,
        ):
            assert response.status == 503
            body = await response.text()
        assert "not ready: the plugin binary istio-cni is missing from" in body, body
        assert str(node.bin) in body and str(node.source) in body
        plugin = node.bin / "istio-cni"  # someone puts it on the host: ready without waiting for a recheck
        plugin.write_text("#!/bin/sh\n")
        plugin.chmod(0o755)
        await running.ready()
    finally:
        await health.stop()


async def test_the_runtime_is_copied_repaired_and_removed_with_the_launcher(
    node: Node, stoppers: list[Running]
) -> None:
    node.put("calico.conflist", "10-calico.conflist")
    add_runtime(node)
    running = start(stoppers, node, recheck=0.2)
    await running.ready()
    assert (node.bin / RUNTIME / "lib" / "libc.so").readlink() == Path("libc.so.6")
    assert (node.bin / RUNTIME / "bin" / "python3").read_bytes() == b"python"
    shutil.rmtree(node.bin / RUNTIME)  # the directory removed from the host: seen at once
    took = await eventually(
        lambda: (node.bin / RUNTIME / "bin" / "python3").exists() and running.installer.ready,
        "the runtime to be copied again",
    )
    assert took < 3
    (node.bin / RUNTIME / "lib" / "libc.so.6").unlink()  # inside it: not watched, found by the recheck
    await eventually(
        lambda: (node.bin / RUNTIME / "lib" / "libc.so.6").exists() and running.installer.ready,
        "the runtime to be repaired",
    )
    await running.stop()
    assert [p.name for p in node.bin.iterdir()] == []


def test_the_plugin_is_missing_while_its_runtime_is(node: Node) -> None:
    """A launcher without its runtime cannot run: every pod sandbox on the node would fail."""
    add_runtime(node)
    installer = Installer(node.settings(), Registry(prefix="istio_"))
    (node.bin / "istio-cni").write_text("#!/bin/sh\n")
    reason = installer.missing_plugin()
    assert reason.startswith(f"the plugin istio-cni in {node.bin} cannot run: its runtime"), reason
    assert f"{node.bin / RUNTIME} is missing" in reason
    shutil.copytree(node.source / RUNTIME, node.bin / RUNTIME, symlinks=True)
    assert installer.missing_plugin() == ""
    (node.bin / RUNTIME / "bin" / "python3").unlink()
    assert "is incomplete: bin/python3 is missing" in installer.missing_plugin()
    (node.bin / "istio-cni").unlink()
    assert "the plugin binary istio-cni is missing from" in installer.missing_plugin()
