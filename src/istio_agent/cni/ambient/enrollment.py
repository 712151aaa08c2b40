"""Enrolling running pods by watching the API: a namespace or pod label turning ambient, or off.

Istio's ``cni/pkg/nodeagent/informers.go``: the pods of this node (``spec.nodeName``) and every
namespace are listed and watched (``cni/repair/informer.py``'s list + watch: resumed from the last
resource version after a dropped watch, listed again on 410 Gone), and each pod that changes, or
whose namespace changes, is reconciled on a work queue (retried with back-off, 5 ms to 5 s, without
limit, as Istio's queue):

- a pod that should be ambient (:mod:`.selectors`) and is not enrolled (annotation
  ``ambient.istio.io/redirection``) nor terminated, and has an IP, is enrolled: its namespace found
  in ``/proc`` (:mod:`.procnetns`); a new pod is the plugin's (its IP comes after its ADD);
- an enrolled (or ``pending``) pod that should not be is unenrolled: rules out, ztunnel told, the
  annotation removed; a terminated one is deleted from ztunnel;
- a pod that is deleted while it was, or should have been, in the mesh is deleted from ztunnel.

The enrollment state is the annotation, so after the node agent's restart a pod already right is
left as it is: nothing to change. What Istio decides from events (add, update, delete) is decided
here from the cache's state and the last version of the pod seen, which comes to the same and also
covers a change missed while the agent was down.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from typing import Any, cast

from istio_agent.cni.ambient.dataplane import (
    ENABLED,
    PENDING,
    Dataplane,
    NonRetryableAdd,
    annotation,
    pod_ips,
    pod_uid,
)
from istio_agent.cni.ambient.selectors import (
    EnablementSelector,
    labels_of,
    namespace_selected,
    pod_is_ambient,
)
from istio_agent.cni.kube import KubeClient
from istio_agent.cni.repair.informer import Informer, Key
from istio_agent.cni.repair.queue import WorkQueue
from istio_agent.log import scope
from istio_agent.metrics import Registry

log = scope("cni-agent")

QUEUE_MAX_DELAY = 5.0
"""Istio's ambient queue: per-item back-off from 5 ms, at most 5 s, retried for ever."""
QUEUE_ATTEMPTS = 2**62


def is_ztunnel_pod(system_namespace: str, pod: Mapping[str, Any]) -> bool:
    meta = pod.get("metadata") or {}
    return meta.get("namespace") == system_namespace and labels_of(pod).get("app") == "ztunnel"


def is_terminal(pod: Mapping[str, Any]) -> bool:
    """Istio's ``CheckPodTerminal``: the pod's phase is Succeeded or Failed."""
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


RESTART_SECONDS = 1.0


async def _supervised(informer: Informer, what: str) -> None:
    """``informer.run()`` for as long as the agent runs: the engine retries what the API answers, and
    anything else it did not expect (a connection failure its client let through) is logged and the
    list + watch started again, rather than the agent's caches silently going stale."""
    while True:
        try:
            await informer.run()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.error("the %s list/watch failed; starting it again", what, exc_info=True)
            await asyncio.sleep(RESTART_SECONDS)


class Enrollment:
    """The node's pods and the namespaces, watched; pods enrolled and unenrolled as they change."""

    def __init__(
        self,
        client: KubeClient,
        dataplane: Dataplane,
        selectors: Sequence[EnablementSelector],
        *,
        node_name: str,
        system_namespace: str,
        informer_options: Mapping[str, Any] | None = None,
        registry: Registry | None = None,
    ) -> None:
        self.dataplane = dataplane
        self.selectors = tuple(selectors)
        self.system_namespace = system_namespace
        options = dict(informer_options or {})
        self.pods = Informer(
            client, self._pod_changed, field_selector=f"spec.nodeName={node_name}", **options
        )
        self.namespaces = Informer(client, self._namespace_changed, resource="namespaces", **options)
        self.queue = WorkQueue(
            "ambient",
            self._reconcile,  # type: ignore[arg-type]  # its keys are pod keys
            max_attempts=QUEUE_ATTEMPTS,
            max_delay=QUEUE_MAX_DELAY,
            describe=lambda key: "/".join(cast(Key, key)),
        )
        self._seen: dict[Key, Mapping[str, Any]] = {}
        self._seen_namespaces: set[str] = set()
        self._reconciled: set[Key] = set()
        self.events = (registry or Registry(prefix="istio_")).counter(
            "nodeagent_reconcile_events_total", "The total number of node agent reconcile events.", ["type"]
        )
        """Istio's count of pod and namespace changes handled, by type (add, update, delete)."""
        self._tasks: list[asyncio.Task[None]] = []
        self._queue_task: asyncio.Task[None] | None = None

    # -- what the event server and the snapshot read ---------------------------------------------------

    def namespace(self, name: str) -> Mapping[str, Any] | None:
        return self.namespaces.objects.get(("", name))

    def get_pod_if_ambient(self, name: str, namespace: str) -> Mapping[str, Any] | None:
        """Istio's ``GetPodIfAmbientEnabled``: KeyError when the cache lacks the pod or its namespace."""
        ns = self.namespace(namespace)
        if ns is None:
            raise KeyError(f"failed to find namespace {namespace}")
        pod = self.pods.objects.get((namespace, name))
        if pod is None:
            raise KeyError(f"failed to find pod {namespace}/{name}")
        return pod if self._should_be_ambient(pod, ns) else None

    def active_ambient_pods(self) -> list[Mapping[str, Any]]:
        """Istio's ``GetActiveAmbientPodSnapshot``: the pods annotated enrolled, running, not ztunnel."""
        return [
            pod
            for pod in self.pods.objects.values()
            if not is_ztunnel_pod(self.system_namespace, pod)
            and not is_terminal(pod)
            and annotation(pod) == ENABLED
        ]

    # -- running ---------------------------------------------------------------------------------------

    async def sync(self) -> None:
        """Start listing and watching; return once both caches hold their first list."""
        self._tasks = [
            asyncio.create_task(_supervised(self.pods, "pods"), name="ambient-pods"),
            asyncio.create_task(_supervised(self.namespaces, "namespaces"), name="ambient-namespaces"),
        ]
        await asyncio.gather(self.pods.synced.wait(), self.namespaces.synced.wait())
        self._seen.update(self.pods.objects)

    def start_queue(self) -> None:
        """Reconcile changes from now on (Istio starts its queue after the initial snapshot)."""
        self._queue_task = asyncio.create_task(self.queue.run(), name="ambient-queue")

    async def stop(self) -> None:
        tasks = [*self._tasks, *filter(None, [self._queue_task])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks, self._queue_task = [], None

    # -- reconciling -----------------------------------------------------------------------------------

    def _pod_changed(self, key: Key) -> None:
        self.queue.add(key)

    def _namespace_changed(self, key: Key) -> None:
        name = key[1]
        ns = self.namespace(name)
        if ns is None:
            self._seen_namespaces.discard(name)
            self.events.labels(type="delete").inc()
        else:
            self.events.labels(type="update" if name in self._seen_namespaces else "add").inc()
            self._seen_namespaces.add(name)
            state = "enabled in" if namespace_selected(self.selectors, labels_of(ns)) else "disabled from"
            log.info("namespace %s is %s ambient mesh", name, state)
        for pod_key, pod in list(self.pods.objects.items()):
            if pod_key[0] == name and not is_ztunnel_pod(self.system_namespace, pod):
                self.queue.add(pod_key)

    def _should_be_ambient(self, pod: Mapping[str, Any], namespace: Mapping[str, Any]) -> bool:
        return pod_is_ambient(
            self.selectors, labels_of(pod), labels_of(pod, "annotations"), labels_of(namespace)
        )

    async def _reconcile(self, key: Key) -> None:
        pod = self.pods.objects.get(key)
        seen = self._seen.get(key)
        kind = "delete" if pod is None else "update" if key in self._reconciled else "add"
        self.events.labels(type=kind).inc()
        if pod is None:
            self._reconciled.discard(key)
        else:
            self._reconciled.add(key)
        if seen is not None and (pod is None or pod_uid(pod) != pod_uid(seen)):
            await self._deleted(seen)
            self._seen.pop(key, None)
        if pod is None:
            return
        self._seen[key] = pod
        await self._updated(key, pod)

    async def _deleted(self, pod: Mapping[str, Any]) -> None:
        ns = self.namespace(str((pod.get("metadata") or {}).get("namespace", "")))
        was = annotation(pod) in (ENABLED, PENDING) or self.dataplane.enrolled(pod_uid(pod))
        if was or (ns is not None and self._should_be_ambient(pod, ns)):
            log.debug("pod %s is deleted and was or should be captured, removing from ztunnel", pod_uid(pod))
            await self.dataplane.remove_pod(pod, deleted=True)

    async def _updated(self, key: Key, pod: Mapping[str, Any]) -> None:
        ns = self.namespace(key[0])
        if ns is None:
            log.error("failed to find namespace %s, skipping the pod %s", key[0], "/".join(key))
            return
        if is_ztunnel_pod(self.system_namespace, pod):
            return
        enrolled, partially = annotation(pod) == ENABLED, annotation(pod) == PENDING
        should = self._should_be_ambient(pod, ns)
        terminated = is_terminal(pod)
        if (enrolled or partially) and terminated:
            log.debug("deleting pod %s from mesh: pod was enabled but is now terminated", "/".join(key))
            await self.dataplane.remove_pod(pod, deleted=True)
            return
        if terminated or (enrolled == should and not partially):
            return
        if not should:
            log.debug("removing pod %s from mesh: no longer should be enabled", "/".join(key))
            await self.dataplane.remove_pod(pod, deleted=False)
            return
        ips = pod_ips(pod)
        if not ips:
            log.debug("pod %s update event skipped: no IP assigned yet", "/".join(key))
            return
        try:
            await self.dataplane.add_pod(pod, ips, "")
        except NonRetryableAdd as err:
            log.error("failed capturing pod %s, will not retry: %s", "/".join(key), err)
