"""The repair controller against the FAKE API server (``fake_kube.py``): what a broken pod of this node
gets in each of Istio's modes (``cni/pkg/repair/repair_test.go``: label, delete; repair in place with
a stand-in for the node's namespaces here, for real in ``test_repair_netns.py``), that healthy pods
and other nodes' pods are left alone, Istio's Events, metric and retry budget, and that the pod
watch resumes after a drop without missing a change."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from istio_agent.cni.capture_config import CaptureConfig
from istio_agent.cni.install.settings import RepairSettings
from istio_agent.cni.kube import KubeClient, parse_kubeconfig
from istio_agent.cni.plugin import PluginError
from istio_agent.cni.repair.controller import RepairController, RepairFailed
from istio_agent.cni.repair.informer import reflector_backoff
from istio_agent.cni.repair.podnetns import NetnsNotFound
from istio_agent.metrics import Registry
from tests.cni.fake_kube import (
    FakeKube,
    sidecar_pod,
    start_fake_kube,
    validation_crashlooping,
    validation_passed,
)

NODE = "node-1"
LABEL = "cni.istio.io/uninitialized"


@pytest.fixture
async def fake(tmp_path: Path) -> AsyncIterator[FakeKube]:
    kube, runner = await start_fake_kube(tmp_path)
    try:
        yield kube
    finally:
        await runner.cleanup()


def broken(name: str, node: str = NODE, ip: str = "10.9.0.2", **options: Any) -> dict[str, Any]:
    """An injected pod whose istio-validation exited 126, as the kubelet reports it."""
    pod = sidecar_pod(name, node_name=node, **options)
    pod["status"] = validation_crashlooping(ip)
    return pod


def healthy(name: str, node: str = NODE) -> dict[str, Any]:
    pod = sidecar_pod(name, node_name=node)
    pod["status"] = validation_passed("10.9.0.3")
    return pod


async def until(condition: Callable[[], bool], what: str, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds}s: {what}")
        await asyncio.sleep(0.02)


@dataclass
class Running:
    controller: RepairController
    registry: Registry

    def repaired(self) -> dict[tuple[str, str], float]:
        """``istio_cni_repair_pods_repaired_total`` by (type, result), parsed from the exposition."""
        out = {}
        for family in text_string_to_metric_families(self.registry.expose().decode()):
            for sample in family.samples:
                if sample.name == "istio_cni_repair_pods_repaired_total":
                    out[(sample.labels["type"], sample.labels["result"])] = sample.value
        return out

    async def settled(self) -> None:
        """The controller has nothing left to do (no key queued or due, no event unsent)."""
        await until(lambda: self.controller.idle, "the controller is idle")
        await asyncio.sleep(0.1)
        await until(lambda: self.controller.idle, "the controller is idle")


@asynccontextmanager
async def controller(fake: FakeKube, settings: RepairSettings, **options: Any) -> AsyncIterator[Running]:
    registry = Registry(prefix="istio_")
    client = KubeClient(parse_kubeconfig(fake.kubeconfig(), "test"))
    repair = RepairController(
        replace(settings, node_name=NODE), client, registry, backoff=reflector_backoff(0.02, 0.1), **options
    )
    task = asyncio.create_task(repair.run())
    try:
        await until(lambda: repair.informer.synced.is_set() or task.done(), "the first list")
        yield Running(repair, registry)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    if task.done() and not task.cancelled() and task.exception() is not None:
        raise AssertionError(f"the controller failed: {task.exception()!r}")


def labels(fake: FakeKube, name: str) -> dict[str, str]:
    return dict(fake.pods[("default", name)]["metadata"].get("labels") or {})


def events(fake: FakeKube) -> list[tuple[str, str, str, str, int]]:
    return sorted(
        (e["involvedObject"]["name"], e["type"], e["reason"], e["message"], e["count"])
        for e in fake.events.values()
    )


# -- label ------------------------------------------------------------------------------------------


async def test_label_mode_labels_only_the_broken_pod_of_this_node(fake: FakeKube) -> None:
    stored = fake.add_pod(broken("broken"))
    fake.add_pod(healthy("healthy"))
    fake.add_pod(broken("elsewhere", node="node-2"))
    no_sidecar = broken("not-injected")
    no_sidecar["metadata"]["annotations"] = {}
    fake.add_pod(no_sidecar)
    async with controller(fake, RepairSettings(label_pods=True)) as running:
        await until(lambda: LABEL in labels(fake, "broken"), "the broken pod is labelled")
        await running.settled()
        assert labels(fake, "broken") == {LABEL: "true"}
        assert [labels(fake, name) for name in ("healthy", "elsewhere", "not-injected")] == [{}, {}, {}]
        assert events(fake) == [("broken", "Warning", "LabelBrokenPod", "pod detected as broken, labeled", 1)]
        event = next(iter(fake.events.values()))
        assert event["involvedObject"]["uid"] == stored["metadata"]["uid"]
        assert event["source"] == {"component": "cni-repair"} and event["reportingComponent"] == "cni-repair"
        assert event["metadata"]["name"].startswith("broken.")
        # the label's own update comes back through the watch: seen as labelled already (Istio: skip)
        assert running.repaired() == {("label", "success"): 1.0, ("label", "skip"): 1.0}
    patches = [path for method, path in fake.calls if method == "PATCH" and "/pods/" in path]
    assert patches == ["/api/v1/namespaces/default/pods/broken/status"]
    assert fake.calls[0] == ("GET", "/api/v1/pods?fieldSelector=spec.nodeName%3Dnode-1")


async def test_a_pod_labelled_already_is_skipped(fake: FakeKube) -> None:
    fake.add_pod(broken("broken", labels={LABEL: "false"}))
    async with controller(fake, RepairSettings(label_pods=True, label_key=LABEL)) as running:
        await until(lambda: running.repaired() != {}, "the pod was looked at")
        await running.settled()
        assert running.repaired() == {("label", "skip"): 1.0}
    assert labels(fake, "broken") == {LABEL: "false"}
    assert fake.events == {}


async def test_the_configured_selectors_narrow_the_watch(fake: FakeKube) -> None:
    fake.add_pod(broken("web", labels={"app": "web"}))
    fake.add_pod(broken("db", labels={"app": "db"}, namespace="prod"))
    settings = RepairSettings(
        label_pods=True, label_selectors="app=web", field_selectors="metadata.namespace=default"
    )
    async with controller(fake, settings) as running:
        await until(lambda: LABEL in labels(fake, "web"), "the selected pod is labelled")
        await running.settled()
    assert fake.pods[("prod", "db")]["metadata"]["labels"] == {"app": "db"}
    assert fake.calls[0] == (
        "GET",
        "/api/v1/pods?labelSelector=app%3Dweb&fieldSelector=metadata.namespace%3Ddefault%2Cspec.nodeName%3Dnode-1",
    )


# -- delete -----------------------------------------------------------------------------------------


async def test_delete_mode_deletes_the_broken_pod_with_preconditions(fake: FakeKube) -> None:
    stored = fake.add_pod(broken("broken"))
    fake.add_pod(healthy("healthy"))
    fake.add_pod(broken("elsewhere", node="node-2"))
    async with controller(fake, RepairSettings(delete_pods=True)) as running:
        await until(lambda: fake.delete_options != [], "a delete")
        meta = stored["metadata"]
        preconditions = {"uid": meta["uid"], "resourceVersion": meta["resourceVersion"]}
        assert fake.delete_options[0] == {
            "kind": "DeleteOptions",
            "apiVersion": "v1",
            "preconditions": preconditions,
        }
        await until(
            lambda: "deletionTimestamp" in fake.pods[("default", "broken")]["metadata"], "terminating"
        )
        fake.finish_deletion("default", "broken")  # the kubelet stops it
        await running.settled()
        assert ("default", "broken") not in running.controller.informer.objects
        # The terminating pod's update is still a broken pod: deleted again (a no-op), as Istio does.
        assert all(options["preconditions"]["uid"] == meta["uid"] for options in fake.delete_options)
        # A second delete carries the resourceVersion the controller saw: when the terminating pod's
        # update came first it succeeds, else the API server answers 409 (counted as a failure).
        repaired = running.repaired()
        successes = repaired[("delete", "success")]
        assert successes >= 1
        assert successes + repaired.get(("delete", "fail"), 0) == len(fake.delete_options), repaired
        (event,) = [e for e in fake.events.values() if e["message"] == "pod detected as broken, deleted"]
        assert event["reason"] == "DeleteBrokenPod"
        assert event["count"] == successes  # identical events are counted, not repeated
    assert set(fake.pods) == {("default", "healthy"), ("default", "elsewhere")}


async def test_a_pod_that_changed_meanwhile_is_not_deleted(fake: FakeKube) -> None:
    seen = fake.add_pod(broken("broken"))
    fake.update_pod("default", "broken", {"metadata": {"annotations": {"touched": "yes"}}})
    client = KubeClient(parse_kubeconfig(fake.kubeconfig(), "test"))
    repair = RepairController(
        RepairSettings(delete_pods=True, node_name=NODE), client, Registry(prefix="istio_")
    )
    sending = asyncio.create_task(repair.events.run())  # only the event sender: no watch, no queue
    try:
        with pytest.raises(RepairFailed, match="Precondition failed"):
            await repair.reconcile_pod(seen)  # the pod as it was before the change
        await until(lambda: repair.events.idle, "the event is sent")
    finally:
        sending.cancel()
    assert "deletionTimestamp" not in fake.pods[("default", "broken")]["metadata"]
    now = fake.pods[("default", "broken")]["metadata"]["resourceVersion"]
    message = (
        'pod detected as broken, but failed to delete: Operation cannot be fulfilled on pods "broken": '
        f"Precondition failed: ResourceVersion in precondition: {seen['metadata']['resourceVersion']}, "
        f"ResourceVersion in object meta: {now}"
    )
    assert events(fake) == [("broken", "Warning", "DeleteBrokenPod", message, 1)]


async def test_a_refused_delete_is_reported_and_tried_istios_five_times(fake: FakeKube) -> None:
    fake.add_pod(broken("broken"))
    fake.forbidden.add(("delete", "pods"))
    async with controller(fake, RepairSettings(delete_pods=True)) as running:
        deletes = lambda: [call for call in fake.calls if call[0] == "DELETE"]  # noqa: E731
        await until(lambda: len(deletes()) == 5, "five attempts")
        await running.settled()
        await asyncio.sleep(0.3)  # the back-off after the 5th would be 80 ms: nothing more comes
        assert len(deletes()) == 5
        assert running.repaired() == {("delete", "fail"): 5.0}
    message = (
        'pod detected as broken, but failed to delete: pods "broken" is forbidden: User '
        '"system:serviceaccount:istio-system:istio-cni" cannot delete resource "pods" in API group "" '
        'in the namespace "default"'
    )
    assert events(fake) == [("broken", "Warning", "DeleteBrokenPod", message, 5)]


# -- repair in place (a stand-in for the node's namespaces) -------------------------------------------


@dataclass
class Programmed:
    calls: list[tuple[CaptureConfig, Path]]
    fail: bool = False

    def __call__(self, config: CaptureConfig, netns: Path, deadline: float) -> None:
        self.calls.append((config, netns))
        if self.fail:
            raise PluginError("iptables-restore failed (exit status 1): boom")


async def test_repair_mode_programs_the_pod_once_per_uid(fake: FakeKube) -> None:
    fake.add_pod(
        broken("broken", ip="10.9.0.7", annotations={"traffic.sidecar.istio.io/excludeInboundPorts": "9000"})
    )
    fake.add_pod(healthy("healthy"))
    programmed = Programmed([])
    found: list[tuple[str, Path]] = []

    def find(ip: str, proc: Path) -> Path:
        found.append((ip, proc))
        return proc / "4242" / "ns" / "net"

    settings = RepairSettings(repair_pods=True, host_proc_dir=Path("/test/proc"))
    async with controller(fake, settings, programmer=programmed, find_netns=find) as running:
        await until(lambda: len(programmed.calls) == 1, "the pod is programmed")
        config, netns = programmed.calls[0]
        assert netns == Path("/test/proc/4242/ns/net") and found == [("10.9.0.7", Path("/test/proc"))]
        assert config.inbound_ports_exclude[0] == 9000 and config.mode == "REDIRECT"  # the plugin's redirect
        fake.update_pod("default", "broken", {"metadata": {"annotations": {"seen": "again"}}})  # still broken
        await running.settled()
        assert len(programmed.calls) == 1  # the same pod (UID) crash-looping on is not programmed again
        old_uid = fake.pods[("default", "broken")]["metadata"]["uid"]
        fake.finish_deletion("default", "broken")
        await running.settled()
        fake.add_pod(broken("broken", ip="10.9.0.8"))  # a new pod of the same name
        await until(lambda: len(programmed.calls) == 2, "the new pod is programmed")
        assert fake.pods[("default", "broken")]["metadata"]["uid"] != old_uid
        await running.settled()
        assert running.repaired() == {("repair", "success"): 2.0}
    writes = [call for call in fake.calls if call[0] != "GET"]
    assert writes == [] and fake.events == {}  # repair needs no RBAC and records no Event, as in Istio


@pytest.mark.parametrize("failure", ["no netns", "programming"])
async def test_a_failed_repair_is_counted_and_retried(fake: FakeKube, failure: str) -> None:
    fake.add_pod(broken("broken"))
    programmed = Programmed([], fail=failure == "programming")

    def find(ip: str, proc: Path) -> Path:
        if failure == "no netns":
            raise NetnsNotFound("failed to find network namespace")
        return proc / "1" / "ns" / "net"

    async with controller(
        fake, RepairSettings(repair_pods=True), programmer=programmed, find_netns=find
    ) as running:
        await until(lambda: running.repaired().get(("repair", "fail")) == 5.0, "five failures")
        await running.settled()
        assert running.repaired() == {("repair", "fail"): 5.0}
        assert running.controller.repaired == {}


# -- the watch --------------------------------------------------------------------------------------


@contextmanager
def no_relist(running: Running) -> Iterator[None]:
    lists = running.controller.informer.lists
    yield
    assert running.controller.informer.lists == lists, "the informer listed again instead of resuming"


async def test_a_dropped_watch_is_resumed_without_missing_a_change(fake: FakeKube) -> None:
    fake.add_pod(healthy("turns-broken"))
    fake.add_pod(healthy("goes-away"))
    async with controller(fake, RepairSettings(label_pods=True)) as running:
        await until(lambda: fake.watchers != set(), "the watch is open")
        informer = running.controller.informer
        with no_relist(running):
            resume_from = informer.version
            # While the watch is down (the drop and these changes happen before the loop runs again):
            fake.drop_watches()
            fake.update_pod("default", "turns-broken", {"status": validation_crashlooping("10.9.0.9")})
            fake.finish_deletion("default", "goes-away")
            await until(
                lambda: LABEL in labels(fake, "turns-broken"), "the change made while dropped is handled"
            )
            await until(lambda: ("default", "goes-away") not in informer.objects, "the deletion is seen")
        watches = [path for method, path in fake.calls if method == "GET" and "watch=1" in path]
        assert len(watches) == 2 and f"resourceVersion={resume_from}&" in watches[1]
        await running.settled()


async def test_a_watch_too_old_to_resume_lists_again(fake: FakeKube) -> None:
    fake.add_pod(healthy("turns-broken"))
    fake.add_pod(healthy("goes-away"))
    async with controller(fake, RepairSettings(label_pods=True)) as running:
        await until(lambda: fake.watchers != set(), "the watch is open")
        informer = running.controller.informer
        fake.drop_watches()
        fake.update_pod("default", "turns-broken", {"status": validation_crashlooping("10.9.0.9")})
        fake.finish_deletion("default", "goes-away")
        fake.compact()  # the versions the informer knows are gone: 410
        await until(lambda: LABEL in labels(fake, "turns-broken"), "the change is handled after a new list")
        await until(lambda: ("default", "goes-away") not in informer.objects, "the deletion is seen")
        assert informer.lists == 2
        await running.settled()


async def test_a_watch_that_ends_is_opened_again_from_the_last_bookmark(fake: FakeKube) -> None:
    fake.add_pod(healthy("a"))
    async with controller(fake, RepairSettings(label_pods=True)) as running:
        await until(lambda: fake.watchers != set(), "the watch is open")
        fake.add_pod(healthy("elsewhere", node="node-2"))  # moves the version on, unseen by this watch
        fake.bookmark()
        informer = running.controller.informer
        await until(lambda: informer.version == str(fake.version), "the bookmark's version is taken")
        bookmarked = informer.version
        with no_relist(running):
            fake.drop_watches()
            fake.update_pod("default", "a", {"status": validation_crashlooping("10.9.0.9")})
            await until(lambda: LABEL in labels(fake, "a"), "the change after the bookmark is handled")
        watches = [path for method, path in fake.calls if method == "GET" and "watch=1" in path]
        assert f"resourceVersion={bookmarked}&" in watches[1]
        await running.settled()


async def test_a_denied_list_is_tried_again_until_allowed(fake: FakeKube) -> None:
    fake.add_pod(broken("broken"))
    fake.forbidden.add(("list", "pods"))
    registry = Registry(prefix="istio_")
    client = KubeClient(parse_kubeconfig(fake.kubeconfig(), "test"))
    settings = RepairSettings(label_pods=True, node_name=NODE)
    repair = RepairController(settings, client, registry, backoff=reflector_backoff(0.02, 0.1))
    task = asyncio.create_task(repair.run())
    try:
        await until(lambda: len(fake.calls) >= 3, "a few refused lists")
        assert not repair.informer.synced.is_set()
        fake.forbidden.clear()  # RBAC fixed
        await until(lambda: LABEL in labels(fake, "broken"), "the pod is labelled once the list works")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
