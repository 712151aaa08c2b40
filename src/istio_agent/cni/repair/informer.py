"""Objects of one kind (a node's pods, the namespaces), kept current by list + watch (client-go's
reflector and informer, reduced).

Istio's controllers read pods and namespaces from informers (``kclient.NewFiltered``: the repair
controller's pods by its selectors, the ambient node agent's pods of its node and all namespaces).
This one does the same job for any core resource:

- **List** with the selectors, remember every object and the list's ``resourceVersion``; each object
  new, changed (another ``resourceVersion``) or gone since the previous list is reported.
- **Watch** from that version with bookmarks allowed; each ADDED, MODIFIED and DELETED updates the
  cache and is reported; a BOOKMARK only moves the version on.
- A watch that ends (its ``timeoutSeconds``, a dropped connection) is opened again **from the last
  version seen**, so no change between the two watches is missed. Only 410 Gone (the version is
  older than the API server keeps) makes it list again; any other failure waits with client-go's
  back-off (0.8 s doubling to 30 s, back to the start once a watch delivers) and tries again.

A report is a key (namespace, name), the namespace "" for a cluster-scoped object (a namespace);
the handler reads the object from :attr:`Informer.objects`.
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


def object_key(obj: dict[str, Any]) -> Key | None:
    """(namespace, name); the namespace is "" for a cluster-scoped object. None without a name."""
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        return None
    namespace, name = meta.get("namespace", ""), meta.get("name")
    if not isinstance(namespace, str) or not isinstance(name, str) or not name:
        return None
    return namespace, name


def _version(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata")
    value = meta.get("resourceVersion") if isinstance(meta, dict) else None
    return value if isinstance(value, str) else ""


def reflector_backoff(initial: float = 0.8, cap: float = 30.0) -> ExponentialBackoff:
    """client-go's reflector back-off on the project's one back-off: each delay between ``d`` and
    ``2d``, ``d`` doubling from ``initial``, the delays' centre capped at ``cap``."""
    return ExponentialBackoff(initial=1.5 * initial, multiplier=2.0, randomization=1 / 3, max_interval=cap)


class Informer:
    """The selected objects of ``resource``, listed once and then watched; ``on_change(key)`` for each change."""

    def __init__(
        self,
        client: KubeClient,
        on_change: Callable[[Key], None],
        *,
        resource: str = "pods",
        label_selector: str = "",
        field_selector: str = "",
        backoff: ExponentialBackoff | None = None,
        watch_seconds: Callable[[], int] | None = None,
    ) -> None:
        self._client = client
        self._on_change = on_change
        self.resource = resource
        self.label_selector = label_selector
        self.field_selector = field_selector
        self._backoff = backoff or reflector_backoff()
        self._watch_seconds = watch_seconds or (lambda: int(MIN_WATCH_SECONDS * (1 + random.random())))
        self.objects: dict[Key, dict[str, Any]] = {}
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
                    log.info(
                        "%s watch: resource version %s is too old, listing again", self.resource, self.version
                    )
                    self.version = ""
                    continue
                # A denial or a bad selector will not pass by itself: said once as an error, then quiet.
                persistent = err.status is not None and 400 <= err.status < 500 and not err.retryable
                if persistent and str(err) not in reported:
                    reported.add(str(err))
                    log.error("%s list/watch: %s (trying again)", self.resource, err)
                else:
                    log.warning("%s list/watch: %s", self.resource, err)
                await asyncio.sleep(self._backoff.next_delay())

    async def _list(self) -> None:
        answer = await self._client.list_objects(
            self.resource,
            label_selector=self.label_selector,
            field_selector=self.field_selector,
            deadline=time.monotonic() + LIST_SECONDS,
        )
        listed: dict[Key, dict[str, Any]] = {}
        for obj in answer.items:
            key = object_key(obj)
            if key is not None:
                listed[key] = obj
        old, self.objects = self.objects, listed
        self.version = answer.resource_version
        self.lists += 1
        for key in old.keys() - listed.keys():
            self._on_change(key)
        for key, obj in listed.items():
            if key not in old or _version(old[key]) != _version(obj):
                self._on_change(key)
        self.synced.set()
        log.debug("%s list: %d at resource version %s", self.resource, len(listed), self.version)

    async def _watch(self) -> int:
        """Follow one watch to its end; how many events it delivered."""
        self.watches += 1
        delivered = 0
        events = self._client.watch_objects(
            self.resource,
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
        key = object_key(event.object)
        if key is None:
            return
        if event.type == "DELETED":
            self.objects.pop(key, None)
        else:
            self.objects[key] = event.object
        self._on_change(key)
