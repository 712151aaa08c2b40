"""The repair controller (Istio's ``cni/pkg/repair/repaircontroller*.go``): what a broken pod gets.

For each change to a pod of this node (:mod:`.informer`), the pod as last seen is checked
(:func:`.detect.is_broken`) and, when broken, handled in the one mode chosen, by Istio's precedence:

- **repair** (the chart's default): the redirect is programmed in the running pod, exactly as the
  plugin would have programmed it (``redirect.capture_config`` from the pod, then the plugin's
  :class:`~istio_agent.cni.plugin.NetnsApplier`), in the namespace found through the host's /proc
  (:mod:`.podnetns`). A pod repaired once (by UID) is not repaired again while it crash-loops back
  to health. No Event, no API write: it needs no RBAC, but the host's /proc and CAP_SYS_ADMIN.
- **delete**: the pod is deleted with its UID and resourceVersion as preconditions, so a pod that
  changed meanwhile is not deleted on stale information; an Event ``DeleteBrokenPod`` either way.
- **label**: ``<label key>=<label value>`` is merged into the pod's labels through ``pods/status``
  (less privileged than ``pods``), unless the key is already there; an Event ``LabelBrokenPod``.

A failed attempt is retried through the queue (5 attempts, Istio's budget). The metric
``istio_cni_repair_pods_repaired_total{type,result}`` counts each outcome, as ``monitoring.go``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path
from typing import Any

from istio_agent.backoff import ExponentialBackoff
from istio_agent.cni.install.settings import InstallSettings, RepairSettings
from istio_agent.cni.kube import KubeClient, KubeError
from istio_agent.cni.plugin import NetnsApplier, PluginError, Programmer
from istio_agent.cni.repair.detect import is_broken
from istio_agent.cni.repair.events import EventRecorder
from istio_agent.cni.repair.informer import Informer, Key
from istio_agent.cni.repair.podnetns import NetnsNotFound, find_pod_netns
from istio_agent.cni.repair.queue import BASE_DELAY, WorkQueue
from istio_agent.config.env import ConfigError
from istio_agent.metrics import Registry

log = logging.getLogger("istio.cni-agent")

COMPONENT = "cni-repair"
"""The Events' source, as Istio's ``kclient.NewEventRecorder(client, "cni-repair")``."""
REASON_DELETE = "DeleteBrokenPod"
REASON_LABEL = "LabelBrokenPod"
MAX_ATTEMPTS = 5
API_SECONDS = 30.0
REPAIR_SECONDS = 30.0
"""The time budget of one in-place repair's rule commands (Istio's has none)."""

FindNetns = Callable[[str, Path], Path]


class RepairFailed(Exception):
    """Handling a broken pod failed; the queue retries it."""


class RepairSetupError(Exception):
    """The controller cannot start (no API server to talk to); install-cni exits, as Istio's does."""


def selectors(settings: RepairSettings) -> tuple[str, str]:
    """The pod list's label and field selectors: the configured ones, and always this node's pods
    (``spec.nodeName=<node>``, as Istio appends it; an empty node name selects unscheduled pods)."""
    fields = [settings.field_selectors] if settings.field_selectors else []
    fields.append(f"spec.nodeName={settings.node_name}")
    return settings.label_selectors, ",".join(fields)


def _meta(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = pod.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _field(pod: Mapping[str, Any], name: str) -> str:
    value = _meta(pod).get(name)
    return value if isinstance(value, str) else ""


class RepairController:
    """Watches the node's pods and handles the broken ones (:meth:`run` until cancelled)."""

    def __init__(
        self,
        settings: RepairSettings,
        client: KubeClient,
        registry: Registry,
        *,
        programmer: Programmer | None = None,
        environ: Mapping[str, str] | None = None,
        find_netns: FindNetns = find_pod_netns,
        backoff: ExponentialBackoff | None = None,
        retry_delay: float = BASE_DELAY,
    ) -> None:
        import os

        self.settings = settings
        self._client = client
        self._environ = os.environ if environ is None else environ
        self._programmer = programmer or NetnsApplier(self._environ, settings.native_nftables)
        self._find_netns = find_netns
        self.repaired_total = registry.counter(
            "cni_repair_pods_repaired_total",
            "Total number of pods repaired by repair controller",
            ["type", "result"],
        )
        self.events = EventRecorder(client, COMPONENT)
        self.queue = WorkQueue(
            "repair pods",
            self._reconcile_key,
            max_attempts=MAX_ATTEMPTS,
            base_delay=retry_delay,
            describe=lambda key: "/".join(key) if isinstance(key, tuple) else str(key),
            expected=(RepairFailed,),
        )
        label_selector, field_selector = selectors(settings)
        self.informer = Informer(
            client,
            self.queue.add,
            label_selector=label_selector,
            field_selector=field_selector,
            backoff=backoff,
        )
        self.repaired: dict[Key, str] = {}
        """Pods repaired in place, by key: their UID (a repaired pod is left alone while it recovers)."""

    async def run(self) -> None:
        """Start the watch, wait for the first list, then handle pods until cancelled."""
        log.info(
            "starting CNI sidecar repair controller (mode %s, pods selected by %r %r)",
            self.settings.mode,
            self.informer.label_selector,
            self.informer.field_selector,
        )
        async with asyncio.TaskGroup() as group:
            group.create_task(self.informer.run(), name="repair-informer")
            group.create_task(self.events.run(), name="repair-events")
            await self.informer.synced.wait()
            group.create_task(self.queue.run(), name="repair-queue")

    @property
    def idle(self) -> bool:
        """Nothing to handle or send right now (for tests)."""
        return self.informer.synced.is_set() and self.queue.idle and self.events.idle

    async def _reconcile_key(self, key: Hashable) -> None:
        assert isinstance(key, tuple)
        pod = self.informer.objects.get(key)
        if pod is None:
            self.repaired.pop(key, None)  # deleted: forget it, so the map does not grow
            return
        await self.reconcile_pod(pod)

    async def reconcile_pod(self, pod: Mapping[str, Any]) -> None:
        """Handle ``pod`` if it is broken; RepairFailed when that fails."""
        if not is_broken(pod, self.settings):
            return
        log.debug("Reconciling pod %s", _field(pod, "name"))
        mode = self.settings.mode
        if mode == "repair":
            await self._repair(pod)
        elif mode == "delete":
            await self._delete(pod)
        elif mode == "label":
            await self._label(pod)

    def _count(self, kind: str, result: str) -> None:
        self.repaired_total.labels(type=kind, result=result).inc()

    async def _repair(self, pod: Mapping[str, Any]) -> None:
        namespace, name, uid = _field(pod, "namespace"), _field(pod, "name"), _field(pod, "uid")
        key = (namespace, name)
        done = self.repaired.get(key)
        if done is not None:
            if done == uid:
                log.debug("pod %s/%s: skipping pod, already repaired", namespace, name)
            else:
                log.error(
                    "pod %s/%s: skipping pod, already repaired with an unexpected UID %s vs %s",
                    namespace,
                    name,
                    done,
                    uid,
                )
            return
        log.info("pod %s/%s: repairing pod...", namespace, name)
        status = pod.get("status") if isinstance(pod.get("status"), dict) else {}
        assert isinstance(status, dict)
        pod_ip = status.get("podIP") if isinstance(status.get("podIP"), str) else ""
        try:
            netns = await asyncio.to_thread(self._find_netns, str(pod_ip), self.settings.host_proc_dir)
        except NetnsNotFound as err:
            self._count("repair", "fail")
            raise RepairFailed(f"pod {namespace}/{name}: get netns: {err}") from None
        try:
            await asyncio.to_thread(self._redirect, pod, netns)
        except RepairFailed as err:
            log.error("pod %s/%s (netns %s): failed to setup redirection: %s", namespace, name, netns, err)
            self._count("repair", "fail")
            raise
        self.repaired[key] = uid
        log.info("pod %s/%s (netns %s): pod repaired", namespace, name, netns)
        self._count("repair", "success")

    def _redirect(self, pod: Mapping[str, Any], netns: Path) -> None:
        """The plugin's redirect for ``pod``, programmed in ``netns`` (a thread: commands block)."""
        from istio_agent.cni.redirect import capture_config

        try:
            config = capture_config(pod, self._environ)
        except ConfigError as err:
            raise RepairFailed(f"setup redirect: {err}") from None
        try:
            self._programmer(config, netns, time.monotonic() + REPAIR_SECONDS)
        except PluginError as err:
            raise RepairFailed(f"program redirection: {err}") from None

    async def _delete(self, pod: Mapping[str, Any]) -> None:
        namespace, name = _field(pod, "namespace"), _field(pod, "name")
        log.info("Pod detected as broken, deleting: %s/%s", namespace, name)
        try:
            await self._client.delete_pod(
                namespace,
                name,
                uid=_field(pod, "uid"),
                resource_version=_field(pod, "resourceVersion"),
                deadline=time.monotonic() + API_SECONDS,
            )
        except KubeError as err:
            self.events.write(
                pod, "Warning", REASON_DELETE, f"pod detected as broken, but failed to delete: {err.detail}"
            )
            self._count("delete", "fail")
            raise RepairFailed(str(err)) from None
        self.events.write(pod, "Warning", REASON_DELETE, "pod detected as broken, deleted")
        self._count("delete", "success")

    async def _label(self, pod: Mapping[str, Any]) -> None:
        namespace, name = _field(pod, "namespace"), _field(pod, "name")
        key, value = self.settings.label_key, self.settings.label_value
        log.info("Pod detected as broken, adding label: %s/%s", namespace, name)
        labels = _meta(pod).get("labels")
        if isinstance(labels, dict) and key in labels:
            self._count("label", "skip")
            log.info("Pod %s/%s already has label with key %s, skipping", namespace, name, key)
            return
        log.info("Labeling pod %s/%s with label %s=%s", namespace, name, key, value)
        patch = {"metadata": {"labels": {key: value}}}
        try:
            await self._client.patch_pod_status(
                namespace, name, patch, deadline=time.monotonic() + API_SECONDS
            )
        except KubeError as err:
            log.error("Failed to update pod: %s", err)
            self.events.write(
                pod, "Warning", REASON_LABEL, f"pod detected as broken, but failed to label: {err.detail}"
            )
            self._count("label", "fail")
            raise RepairFailed(str(err)) from None
        self.events.write(pod, "Warning", REASON_LABEL, "pod detected as broken, labeled")
        self._count("label", "success")


def in_cluster_client(settings: InstallSettings) -> KubeClient:
    """A client for the API server install-cni writes into the plugin's kubeconfig (the same server,
    trust and service account), its token read again for each request; RepairSetupError."""
    from istio_agent.cni.install import kubeconfig
    from istio_agent.cni.kube import parse_kubeconfig

    try:
        config = parse_kubeconfig(kubeconfig.render(kubeconfig.build(settings)), "of the service account")
        return KubeClient(
            config._replace(token="", token_file=settings.service_account_dir / "token"),
            user_agent="install-cni",
        )
    except (kubeconfig.KubeconfigError, ConfigError) as err:
        raise RepairSetupError(f"CNI repair could not construct its API client: {err}") from None


def build(settings: InstallSettings, registry: Registry) -> RepairController | None:
    """The controller install-cni runs, or None (disabled, or no mode chosen: logged); RepairSetupError."""
    repair = settings.repair
    if not repair.enabled:
        log.info("CNI repair controller is disabled")
        return None
    if repair.mode is None:
        log.info(
            "CNI repair controller: none of REPAIR_REPAIR_PODS, REPAIR_DELETE_PODS, REPAIR_LABEL_PODS is "
            "set, so there is nothing to do for a broken pod: not started"
        )
        return None
    if [repair.repair_pods, repair.delete_pods, repair.label_pods].count(True) > 1:
        log.warning("CNI repair controller: more than one mode is set; only %r is used", repair.mode)
    if not repair.node_name:
        log.warning(
            "CNI repair controller: REPAIR_NODE_NAME is empty, so it selects spec.nodeName= (pods not "
            "bound to a node), as Istio's does: set it to this node's name (the DaemonSet's spec.nodeName)"
        )
    return RepairController(repair, in_cluster_client(settings), registry)
