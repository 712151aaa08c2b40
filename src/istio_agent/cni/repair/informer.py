"""The pods of a node, kept current by list + watch (client-go's reflector and informer, reduced).

Istio's controller reads pods from an informer (``kclient.NewFiltered`` with the repair selectors).
This one does the same job:

- **List** with the selectors, remember every pod and the list's ``resourceVersion``; each pod new,
  changed (another ``resourceVersion``) or gone since the previous list is reported.
- **Watch** from that version with bookmarks allowed; each ADDED, MODIFIED and DELETED updates the
  cache and is reported; a BOOKMARK only moves the version on.
- A watch that ends (its ``timeoutSeconds``, a dropped connection) is opened again **from the last
  version seen**, so no change between the two watches is missed. Only 410 Gone (the version is
  older than the API server keeps) makes it list again; any other failure waits with client-go's
  back-off (0.8 s doubling to 30 s, back to the start once a watch delivers) and tries again.

A report is a key (namespace, name); the handler reads the pod from :attr:`PodInformer.pods`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from typing import Any

from istio_agent.backoff import ExponentialBackoff
from istio_agent.cni.kube import KubeClient, KubeError, WatchEvent

log = logging.getLogger("istio.cni-agent")

Key = tuple[str, str]
LIST_SECONDS = 60.0
MIN_WATCH_SECONDS = 300
"""client-go's watch length: between 5 and 10 minutes, chosen at random for each watch."""


def pod_key(pod: dict[str, Any]) -> Key | None:
    meta = pod.get("metadata")
    if not isinstance(meta, dict):
        return None
    namespace, name = meta.get("namespace"), meta.get("name")
    if not isinstance(namespace, str) or not isinstance(name, str) or not name:
        return None
    return namespace, name


def _version(pod: dict[str, Any]) -> str:
    meta = pod.get("metadata")
    value = meta.get("resourceVersion") if isinstance(meta, dict) else None
    return value if isinstance(value, str) else ""


def reflector_backoff(initial: float = 0.8, cap: float = 30.0) -> ExponentialBackoff:
    """client-go's reflector back-off on the project's one back-off: each delay between ``d`` and
    ``2d``, ``d`` doubling from ``initial``, the delays' centre capped at ``cap``."""
    return ExponentialBackoff(initial=1.5 * initial, multiplier=2.0, randomization=1 / 3, max_interval=cap)


class PodInformer:
    """The selected pods, listed once and then watched; ``on_change(key)`` for each change."""

    def __init__(
        self,
        client: KubeClient,
        on_change: Callable[[Key], None],
        *,
        label_selector: str = "",
        field_selector: str = "",
        backoff: ExponentialBackoff | None = None,
        watch_seconds: Callable[[], int] | None = None,
    ) -> None:
        self._client = client
        self._on_change = on_change
        self.label_selector = label_selector
        self.field_selector = field_selector
        self._backoff = backoff or reflector_backoff()
        self._watch_seconds = watch_seconds or (lambda: int(MIN_WATCH_SECONDS * (1 + random.random())))
        self.pods: dict[Key, dict[str, Any]] = {}
        self.version = ""
        """The resource version the next watch starts from ("" until the first list)."""
        self.synced = asyncio.Event()
        """Set once the first list is in."""
        self.lists = 0
        self.watches = 0

    async def run(self) -> None:
        """List and watch until cancelled."""
        reported: set[str] = set()
        while True:
            try:
                if not self.version:
                    await self._list()
                began = time.monotonic()
                delivered = await self._watch()
                reported.clear()
                if not delivered and time.monotonic() - began < 1.0:
                    await asyncio.sleep(self._backoff.next_delay())  # ended at once: do not spin
            except KubeError as err:
                if err.gone:
                    log.info("pod watch: resource version %s is too old, listing again", self.version)
                    self.version = ""
                    continue
                # A denial or a bad selector will not pass by itself: said once as an error, then quiet.
                persistent = err.status is not None and 400 <= err.status < 500 and not err.retryable
                if persistent and str(err) not in reported:
                    reported.add(str(err))
                    log.error("pod list/watch: %s (trying again)", err)
                else:
                    log.warning("pod list/watch: %s", err)
                await asyncio.sleep(self._backoff.next_delay())

    async def _list(self) -> None:
        answer = await self._client.list_pods(
            label_selector=self.label_selector,
            field_selector=self.field_selector,
            deadline=time.monotonic() + LIST_SECONDS,
        )
        listed: dict[Key, dict[str, Any]] = {}
        for pod in answer.items:
            key = pod_key(pod)
            if key is not None:
                listed[key] = pod
        old, self.pods = self.pods, listed
        self.version = answer.resource_version
        self.lists += 1
        for key in old.keys() - listed.keys():
            self._on_change(key)
        for key, pod in listed.items():
            if key not in old or _version(old[key]) != _version(pod):
                self._on_change(key)
        self.synced.set()
        log.debug("pod list: %d pods at resource version %s", len(listed), self.version)

    async def _watch(self) -> int:
        """Follow one watch to its end; how many events it delivered."""
        self.watches += 1
        delivered = 0
        events = self._client.watch_pods(
            resource_version=self.version,
            label_selector=self.label_selector,
            field_selector=self.field_selector,
            timeout_seconds=self._watch_seconds(),
        )
        async for event in events:
            delivered += 1
            self._backoff.reset()
            self._apply(event)
        return delivered

    def _apply(self, event: WatchEvent) -> None:
        if event.resource_version:
            self.version = event.resource_version
        if event.type == "BOOKMARK":
            return
        key = pod_key(event.object)
        if key is None:
            return
        if event.type == "DELETED":
            self.pods.pop(key, None)
        else:
            self.pods[key] = event.object
        self._on_change(key)
