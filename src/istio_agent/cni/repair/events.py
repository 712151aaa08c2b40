"""Kubernetes Events about pods, recorded as client-go's event recorder does for Istio's controllers.

Istio's repair controller writes through ``kclient.NewEventRecorder(client, "cni-repair")``: a core/v1
Event per call, named ``<pod>.<unix nanoseconds in hex>`` in the pod's namespace, with the pod as
``involvedObject``, ``source.component`` and ``reportingComponent`` ``cni-repair``, ``count`` 1.
client-go sends them in the background (a failure to record never holds up the controller), and an
event identical to one it sent before (same object, type, reason and message) is not created again:
the earlier one gets its ``count`` raised and ``lastTimestamp`` moved by a strategic merge patch
(created anew if it has expired meanwhile). Those two behaviours are kept here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from istio_agent.cni.kube import KubeClient, KubeError

log = logging.getLogger("istio.cni-agent")

SEND_SECONDS = 10.0
CACHE_SIZE = 4096
"""client-go's event cache: identical events beyond it are created again rather than counted."""


@dataclass(frozen=True)
class _Sent:
    name: str
    count: int


def _timestamp(now: float) -> str:
    return datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def pod_reference(pod: Mapping[str, Any]) -> dict[str, str]:
    """The pod as an Event's ``involvedObject`` (an ObjectReference)."""
    meta = pod.get("metadata") if isinstance(pod.get("metadata"), dict) else {}
    assert isinstance(meta, dict)
    return {
        "kind": "Pod",
        "namespace": str(meta.get("namespace", "")),
        "name": str(meta.get("name", "")),
        "uid": str(meta.get("uid", "")),
        "apiVersion": "v1",
        "resourceVersion": str(meta.get("resourceVersion", "")),
    }


class EventRecorder:
    """Queues Events and sends them one after another (:meth:`run`); ``sent`` counts the successes."""

    def __init__(self, client: KubeClient, component: str) -> None:
        self._client = client
        self.component = component
        self._pending: asyncio.Queue[tuple[dict[str, str], str, str, str, float]] = asyncio.Queue()
        self._sent: OrderedDict[tuple[str, ...], _Sent] = OrderedDict()
        self._outstanding = 0
        self.sent = 0
        self.failed = 0

    def write(self, pod: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        """Record an event about ``pod`` (sent in the background)."""
        log.debug("event on pod %s: %s %s: %s", pod_reference(pod)["name"], type_, reason, message)
        self._outstanding += 1
        self._pending.put_nowait((pod_reference(pod), type_, reason, message, time.time()))

    @property
    def idle(self) -> bool:
        """Every event written so far has been sent (or failed)."""
        return self._outstanding == 0

    async def run(self) -> None:
        """Send queued events until cancelled."""
        while True:
            item = await self._pending.get()
            try:
                await self._send(*item)
            except KubeError as err:
                self.failed += 1
                log.warning(
                    "could not record event %s on pod %s/%s: %s",
                    item[2],
                    item[0]["namespace"],
                    item[0]["name"],
                    err,
                )
            finally:
                self._outstanding -= 1

    async def _send(self, ref: dict[str, str], type_: str, reason: str, message: str, now: float) -> None:
        namespace = ref["namespace"]
        key = (ref["kind"], namespace, ref["name"], ref["uid"], type_, reason, message)
        deadline = time.monotonic() + SEND_SECONDS
        earlier = self._sent.get(key)
        if earlier is not None:
            patch = {"count": earlier.count + 1, "lastTimestamp": _timestamp(now), "message": message}
            try:
                await self._client.patch_event(namespace, earlier.name, patch, deadline=deadline)
            except KubeError as err:
                if err.status != 404:
                    raise
            else:
                self._remember(key, _Sent(earlier.name, earlier.count + 1))
                self.sent += 1
                return
        name = f"{ref['name']}.{int(now * 1e9):x}"
        event = {
            "kind": "Event",
            "apiVersion": "v1",
            "metadata": {"name": name, "namespace": namespace},
            "involvedObject": ref,
            "reason": reason,
            "message": message,
            "source": {"component": self.component},
            "firstTimestamp": _timestamp(now),
            "lastTimestamp": _timestamp(now),
            "count": 1,
            "type": type_,
            "reportingComponent": self.component,
            "reportingInstance": "",
        }
        await self._client.create_event(namespace, event, deadline=deadline)
        self._remember(key, _Sent(name, 1))
        self.sent += 1

    def _remember(self, key: tuple[str, ...], sent: _Sent) -> None:
        self._sent[key] = sent
        self._sent.move_to_end(key)
        while len(self._sent) > CACHE_SIZE:
            self._sent.popitem(last=False)
