"""A FAKE Kubernetes API server for the CNI tests (a real one cannot run here).

HTTPS on 127.0.0.1 with a serving certificate from a test CA and a bearer token check, serving pods
and Events from memory the way the real API server does for what the plugin and install-cni's repair
controller use:

- ``GET /api/v1/namespaces/{ns}/pods/{name}`` (the plugin's ADD). ``failures`` and ``requests``
  concern this request only: tests script failures per pod GET (status codes, a hang) to check that
  the plugin fails closed.
- list (``GET /api/v1/pods``, ``/api/v1/namespaces/{ns}/pods``) with ``labelSelector`` and
  ``fieldSelector`` (the pod fields the real server can select on; anything else is 400), and
  ``watch=1`` on the same paths: from ``resourceVersion`` "" or "0" the current pods as ADDED, from
  a version the changes after it (410 Gone as an ERROR event once :meth:`FakeKube.compact` dropped
  it), an object leaving the selectors as DELETED and entering as ADDED, BOOKMARK events when
  ``allowWatchBookmarks`` is set (:meth:`FakeKube.bookmark`), the end after ``timeoutSeconds``, and
  :meth:`FakeKube.drop_watches` to cut every watch connection as a network failure would.
- namespaces: ``GET /api/v1/namespaces/{name}`` and list and watch on ``/api/v1/namespaces`` (label
  selectors; the field selectors the server has for them, ``metadata.name`` and ``status.phase``),
  the same versions, history and 410 as pods: the ambient node agent watches both (``add_namespace``,
  ``update_namespace``, ``delete_namespace`` are the test's writes).
- ``GET`` of an apps/v1 DaemonSet from :attr:`FakeKube.daemonsets` (install-cni asks whether its own
  DaemonSet is still there when it stops: an upgrade).
- ``DELETE`` of a pod with ``DeleteOptions`` preconditions (UID, resourceVersion: 409 Conflict when
  they do not hold); a pod bound to a node is deleted gracefully (``deletionTimestamp`` set, gone
  when the "kubelet" calls :meth:`FakeKube.finish_deletion`), an unbound one at once.
- ``PATCH .../pods/{name}/status`` with a merge patch (labels and annotations may change, spec
  may not; labels are validated: 422), optimistic concurrency on ``metadata.resourceVersion``.
- ``POST`` and ``PATCH`` of core/v1 Events (name, namespace and involvedObject checked).
- ``forbidden``: (verb, resource) pairs answered 403 as RBAC would (``("delete", "pods")``).

Every write bumps the store's resourceVersion and is kept in a history the watches replay from. Built
on aiohttp, an HTTP stack independent of the agent's own client.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import secrets
import socket
import ssl
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from aiohttp import web

from istio_agent.controlplane.ca import LocalCA
from tests.cni.fake_kube_selectors import (
    POD_FIELDS,
    SelectorError,
    dns_subdomain_problem,
    fields_match,
    label_value_problem,
    labels_match,
    parse_field_selector,
    parse_label_selector,
    qualified_name_problem,
)

TOKEN = "fake-service-account-token-do-not-log"
USER = "system:serviceaccount:istio-system:istio-cni"
DEFAULT_WATCH_SECONDS = 1800
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"
_GO_TRUE = {"1", "t", "T", "TRUE", "true", "True"}
_GO_FALSE = {"0", "f", "F", "FALSE", "false", "False"}


def now_rfc3339(offset: float = 0.0) -> str:
    return (datetime.now(UTC) + timedelta(seconds=offset)).strftime("%Y-%m-%dT%H:%M:%SZ")


def status(code: int, reason: str, message: str, *, details: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``Status`` object, as the API server answers a failed request."""
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details:
        body["details"] = details
    return body


def _answer(code: int, reason: str, message: str) -> web.Response:
    return web.json_response(status(code, reason, message), status=code)


@dataclass(frozen=True)
class Change:
    """One write as the watch replays it: the object after (before, for a deletion) and before."""

    version: int
    type: str  # ADDED, MODIFIED, DELETED
    object: dict[str, Any]
    old: dict[str, Any] | None
    kind: str = "Pod"


@dataclass(eq=False)
class Watcher:
    """An open watch: its selectors and the events waiting to be written."""

    namespace: str
    labels: tuple[Any, ...]
    fields: tuple[tuple[str, str, str], ...]
    bookmarks: bool
    kind: str = "Pod"
    """What is watched: ``Pod`` or ``Namespace``."""
    queue: asyncio.Queue[dict[str, Any] | str] = field(default_factory=asyncio.Queue)

    def matches(self, obj: dict[str, Any] | None) -> bool:
        if obj is None:
            return False
        if self.kind == "Namespace":
            return labels_match(self.labels, obj) and namespace_fields_match(self.fields, obj)
        if self.namespace and obj["metadata"].get("namespace") != self.namespace:
            return False
        return labels_match(self.labels, obj) and fields_match(self.fields, obj)

    def event_for(self, change: Change) -> dict[str, Any] | None:
        """What this watch sees of ``change``: objects entering or leaving its selectors are ADDED or
        DELETED, as the API server's watch filter does."""
        now, before = self.matches(change.object), self.matches(change.old)
        if change.type == "DELETED":
            kind = "DELETED" if now else None
        elif change.type == "ADDED":
            kind = "ADDED" if now else None
        elif now and before:
            kind = "MODIFIED"
        elif now:
            kind = "ADDED"
        elif before:
            kind = "DELETED"
        else:
            kind = None
        return None if kind is None else {"type": kind, "object": _with_kind(change.object, change.kind)}


def _with_kind(obj: dict[str, Any], kind: str = "Pod") -> dict[str, Any]:
    return {"kind": kind, "apiVersion": "v1", **copy.deepcopy(obj)}


NAMESPACE_FIELDS: dict[str, Any] = {
    "metadata.name": lambda ns: (ns.get("metadata") or {}).get("name", ""),
    "status.phase": lambda ns: (ns.get("status") or {}).get("phase", ""),
}
"""The field selectors the API server accepts for namespaces."""


def namespace_fields_match(terms: tuple[tuple[str, str, str], ...], ns: dict[str, Any]) -> bool:
    return all((NAMESPACE_FIELDS[name](ns) == value) == (op == "=") for name, op, value in terms)


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge_patch(result.get(key), value)
    return result


@dataclass
class FakeKube:
    """The fake's state: the pods and events it serves, and scripted failures of the pod GET."""

    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    namespaces: dict[str, dict[str, Any]] = field(default_factory=dict)
    daemonsets: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    """apps/v1 DaemonSets by (namespace, name), for GET only (install-cni's upgrade check)."""
    failures: list[int | str] = field(default_factory=list)
    """Per pod GET, in order: an HTTP status to answer instead, or "hang" (never answer)."""
    requests: list[str] = field(default_factory=list)
    """The paths of the pod GETs."""
    calls: list[tuple[str, str]] = field(default_factory=list)
    """Every request but the pod GET: (method, path and query)."""
    delete_options: list[dict[str, Any]] = field(default_factory=list)
    """The DeleteOptions of every pod DELETE, as sent."""
    events: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    forbidden: set[tuple[str, str]] = field(default_factory=set)
    """(verb, resource) pairs RBAC denies: verbs get/list/watch/create/patch/delete, resources
    ``pods``, ``pods/status``, ``events``, ``namespaces``."""
    port: int = 0
    ca_pem: bytes = b""
    version: int = 1000
    history: list[Change] = field(default_factory=list)
    compacted: int = 0
    """Watches from a version below this get 410 Gone (etcd compaction)."""
    watchers: set[Watcher] = field(default_factory=set)

    # -- test-side writes (what the scheduler and the kubelet would do) --------------------------------

    def add_pod(self, pod: dict[str, Any]) -> dict[str, Any]:
        """Create the pod (uid, resourceVersion and creationTimestamp filled in as the server does);
        a pod of that name already there is updated instead."""
        pod = copy.deepcopy(pod)
        pod.pop("kind", None)  # stored (and listed) without them; GET and watch events add them
        pod.pop("apiVersion", None)
        meta = pod.setdefault("metadata", {})
        key = (meta["namespace"], meta["name"])
        old = self.pods.get(key)
        if old is not None:
            meta["uid"] = old["metadata"]["uid"]
            meta["creationTimestamp"] = old["metadata"]["creationTimestamp"]
            return self._store(key, pod, old)
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", now_rfc3339())
        return self._store(key, pod, None)

    def update_pod(self, namespace: str, name: str, change: dict[str, Any]) -> dict[str, Any]:
        """Merge-patch the stored pod as the kubelet's status updates do (``{"status": {...}}``)."""
        key = (namespace, name)
        return self._store(key, _merge_patch(self.pods[key], change), self.pods[key])

    def add_namespace(self, name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
        """Create the namespace (as ``kubectl create namespace``, with ``labels``)."""
        if name in self.namespaces:
            raise ValueError(f'namespaces "{name}" already exists')
        namespace = {
            "metadata": {
                "name": name,
                "uid": str(uuid.uuid4()),
                "creationTimestamp": now_rfc3339(),
                "labels": {"kubernetes.io/metadata.name": name, **(labels or {})},
            },
            "spec": {"finalizers": ["kubernetes"]},
            "status": {"phase": "Active"},
        }
        return self._store_namespace(name, namespace, None)

    def update_namespace(self, name: str, change: dict[str, Any]) -> dict[str, Any]:
        """Merge-patch the namespace (``{"metadata": {"labels": {...}}}``, as ``kubectl label`` does)."""
        old = self.namespaces[name]
        return self._store_namespace(name, _merge_patch(old, change), old)

    def delete_namespace(self, name: str) -> None:
        namespace = self.namespaces.pop(name)
        self.version += 1
        namespace["metadata"]["resourceVersion"] = str(self.version)
        self._publish(Change(self.version, "DELETED", copy.deepcopy(namespace), None, "Namespace"))

    def finish_deletion(self, namespace: str, name: str) -> None:
        """The kubelet has stopped a gracefully deleted pod: it goes from the store."""
        self._remove((namespace, name))

    def compact(self) -> None:
        """Forget the history so far, as etcd compaction does: older versions are 410 Gone."""
        self.compacted = self.version
        self.history.clear()

    def bookmark(self) -> None:
        """Send a BOOKMARK with the current version to every watch that allows them."""
        for watcher in self.watchers:
            if watcher.bookmarks:
                meta = {"resourceVersion": str(self.version), "creationTimestamp": None}
                watcher.queue.put_nowait(
                    {
                        "type": "BOOKMARK",
                        "object": {"kind": watcher.kind, "apiVersion": "v1", "metadata": meta},
                    }
                )

    def drop_watches(self) -> int:
        """Cut every open watch connection mid-stream (no end of the body); how many there were."""
        for watcher in self.watchers:
            watcher.queue.put_nowait("drop")
        return len(self.watchers)

    # -- the store ---------------------------------------------------------------------------------

    def _store(self, key: tuple[str, str], pod: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
        self.version += 1
        pod["metadata"]["resourceVersion"] = str(self.version)
        self.pods[key] = pod
        self._publish(Change(self.version, "MODIFIED" if old else "ADDED", copy.deepcopy(pod), old))
        return copy.deepcopy(pod)

    def _store_namespace(self, name: str, ns: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
        self.version += 1
        ns["metadata"]["resourceVersion"] = str(self.version)
        self.namespaces[name] = ns
        change = Change(self.version, "MODIFIED" if old else "ADDED", copy.deepcopy(ns), old, "Namespace")
        self._publish(change)
        return copy.deepcopy(ns)

    def _remove(self, key: tuple[str, str]) -> dict[str, Any]:
        pod = self.pods.pop(key)
        self.version += 1
        pod["metadata"]["resourceVersion"] = str(self.version)
        self._publish(Change(self.version, "DELETED", copy.deepcopy(pod), None))
        return pod

    def _publish(self, change: Change) -> None:
        self.history.append(change)
        for watcher in self.watchers:
            if watcher.kind != change.kind:
                continue
            event = watcher.event_for(change)
            if event is not None:
                watcher.queue.put_nowait(event)

    # -- requests ----------------------------------------------------------------------------------

    def kubeconfig(self, *, insecure: bool = False, server: str | None = None) -> str:
        """The kubeconfig as install-cni writes it (its own renderer: JSON), pointing at this fake."""
        from istio_agent.cni.install import kubeconfig

        trust: dict[str, Any] = (
            {"insecure-skip-tls-verify": True}
            if insecure
            else {"certificate-authority-data": base64.b64encode(self.ca_pem).decode()}
        )
        cluster = {**trust, "server": server or f"https://127.0.0.1:{self.port}"}
        return kubeconfig.render(
            {
                "apiVersion": "v1",
                "clusters": [{"cluster": cluster, "name": kubeconfig.CLUSTER}],
                "contexts": [
                    {
                        "context": {"cluster": kubeconfig.CLUSTER, "user": kubeconfig.USER},
                        "name": kubeconfig.CONTEXT,
                    }
                ],
                "current-context": kubeconfig.CONTEXT,
                "kind": "Config",
                "preferences": {},
                "users": [{"name": kubeconfig.USER, "user": {"token": TOKEN}}],
            }
        )

    def _denied(self, request: web.Request, verb: str, resource: str, name: str = "") -> web.Response | None:
        """401 without the token, 403 for a denied (verb, resource); None when allowed."""
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return _answer(401, "Unauthorized", "Unauthorized")
        if (verb, resource) not in self.forbidden:
            return None
        namespace = request.match_info.get("ns", "")
        base, _, sub = resource.partition("/")
        what = f'{base} "{name}"' if name else base
        where = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
        target = f'resource "{base}"' + (f' subresource "{sub}"' if sub else "")
        message = f'{what} is forbidden: User "{USER}" cannot {verb} {target} in API group "" {where}'
        return _answer(403, "Forbidden", message)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """GET of one pod (the plugin's ADD)."""
        self.requests.append(request.path)
        if self.failures:
            failure = self.failures.pop(0)
            if failure == "hang":
                await asyncio.sleep(3600)
            return web.json_response(
                {"kind": "Status", "message": f"fake failure {failure}", "code": failure}, status=int(failure)
            )
        name = request.match_info["name"]
        denied = self._denied(request, "get", "pods", name)
        if denied is not None:
            return denied
        key = (request.match_info["ns"], name)
        pod = self.pods.get(key)
        if pod is None:
            return _answer(404, "NotFound", f'pods "{key[1]}" not found')
        return web.json_response(_with_kind(pod))

    async def pods_collection(self, request: web.Request) -> web.StreamResponse:
        """List or watch pods (every namespace, or one)."""
        return await self._collection(request, "Pod", request.match_info.get("ns", ""), POD_FIELDS)

    async def _collection(
        self, request: web.Request, kind: str, namespace: str, field_table: Mapping[str, Any]
    ) -> web.StreamResponse:
        """List or watch ``kind`` (``Pod`` or ``Namespace``), as the API server checks the query."""
        self.calls.append((request.method, request.path_qs))
        query = request.query
        watch_text = query.get("watch", "false")
        if watch_text not in _GO_TRUE | _GO_FALSE:
            return _answer(400, "BadRequest", f'invalid value for watch: "{watch_text}"')
        watching = watch_text in _GO_TRUE
        denied = self._denied(request, "watch" if watching else "list", kind.lower() + "s")
        if denied is not None:
            return denied
        try:
            labels = parse_label_selector(query.get("labelSelector", ""))
            fields = parse_field_selector(query.get("fieldSelector", ""), field_table)
        except SelectorError as err:
            return _answer(400, "BadRequest", str(err))
        if "limit" in query or "continue" in query:
            return _answer(500, "InternalError", "the FAKE API server does not paginate lists")
        bookmarks_text = query.get("allowWatchBookmarks", "false")
        if bookmarks_text not in _GO_TRUE | _GO_FALSE:
            return _answer(400, "BadRequest", f'invalid value for allowWatchBookmarks: "{bookmarks_text}"')
        watcher = Watcher(namespace, labels, fields, bookmarks_text in _GO_TRUE, kind)
        if not watching:
            stored = self.pods.values() if kind == "Pod" else self.namespaces.values()
            return web.json_response(
                {
                    "kind": f"{kind}List",
                    "apiVersion": "v1",
                    "metadata": {"resourceVersion": str(self.version)},
                    "items": [copy.deepcopy(obj) for obj in stored if watcher.matches(obj)],
                }
            )
        return await self._watch(request, watcher)

    async def _watch(self, request: web.Request, watcher: Watcher) -> web.StreamResponse:
        version_text = request.query.get("resourceVersion", "")
        timeout_text = request.query.get("timeoutSeconds", str(DEFAULT_WATCH_SECONDS))
        if not version_text.isdigit() and version_text != "":
            return _answer(400, "BadRequest", f'invalid resource version: "{version_text}"')
        if not timeout_text.isdigit():
            return _answer(400, "BadRequest", f'invalid value for timeoutSeconds: "{timeout_text}"')
        # Replay and registration happen without yielding to the loop: no write falls between them.
        if version_text in ("", "0"):
            stored = self.pods.values() if watcher.kind == "Pod" else self.namespaces.values()
            for obj in stored:
                if watcher.matches(obj):
                    watcher.queue.put_nowait({"type": "ADDED", "object": _with_kind(obj, watcher.kind)})
        elif int(version_text) < self.compacted:
            message = f"too old resource version: {version_text} ({self.compacted})"
            watcher.queue.put_nowait({"type": "ERROR", "object": status(410, "Expired", message)})
            watcher.queue.put_nowait("end")
        elif int(version_text) > self.version:
            message = f"Too large resource version: {version_text}, current: {self.version}"
            watcher.queue.put_nowait({"type": "ERROR", "object": status(504, "Timeout", message)})
            watcher.queue.put_nowait("end")
        else:
            for change in self.history:
                if change.version > int(version_text) and change.kind == watcher.kind:
                    event = watcher.event_for(change)
                    if event is not None:
                        watcher.queue.put_nowait(event)
        self.watchers.add(watcher)
        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        try:
            await response.prepare(request)
            ends = asyncio.get_running_loop().time() + int(timeout_text)
            while True:
                left = ends - asyncio.get_running_loop().time()
                if left <= 0:
                    break
                try:
                    async with asyncio.timeout(left):
                        item = await watcher.queue.get()
                except TimeoutError:
                    break
                if item == "end":
                    break
                if item == "drop":
                    assert request.transport is not None
                    request.transport.abort()
                    return response
                assert isinstance(item, dict)
                await response.write(json.dumps(item).encode() + b"\n")
            await response.write_eof()
            return response
        finally:
            self.watchers.discard(watcher)

    async def daemonset_get(self, request: web.Request) -> web.StreamResponse:
        self.calls.append((request.method, request.path_qs))
        namespace, name = request.match_info["ns"], request.match_info["name"]
        denied = self._denied(request, "get", "daemonsets", name)
        if denied is not None:
            return denied
        daemonset = self.daemonsets.get((namespace, name))
        if daemonset is None:
            return _answer(404, "NotFound", f'daemonsets.apps "{name}" not found')
        return web.json_response({"kind": "DaemonSet", "apiVersion": "apps/v1", **copy.deepcopy(daemonset)})

    async def namespace_get(self, request: web.Request) -> web.StreamResponse:
        self.calls.append((request.method, request.path_qs))
        name = request.match_info["name"]
        denied = self._denied(request, "get", "namespaces", name)
        if denied is not None:
            return denied
        namespace = self.namespaces.get(name)
        if namespace is None:
            return _answer(404, "NotFound", f'namespaces "{name}" not found')
        return web.json_response(_with_kind(namespace, "Namespace"))

    async def namespaces_collection(self, request: web.Request) -> web.StreamResponse:
        """List or watch namespaces."""
        return await self._collection(request, "Namespace", "", NAMESPACE_FIELDS)

    async def pod_delete(self, request: web.Request) -> web.StreamResponse:
        self.calls.append((request.method, request.path_qs))
        namespace, name = request.match_info["ns"], request.match_info["name"]
        denied = self._denied(request, "delete", "pods", name)
        if denied is not None:
            return denied
        raw = await request.read()
        try:
            options = json.loads(raw) if raw.strip() else {}
        except ValueError as err:
            return _answer(400, "BadRequest", f"invalid DeleteOptions: {err}")
        if not isinstance(options, dict) or options.get("kind", "DeleteOptions") != "DeleteOptions":
            return _answer(400, "BadRequest", "the body is not a DeleteOptions object")
        self.delete_options.append(options)
        pod = self.pods.get((namespace, name))
        if pod is None:
            return _answer(404, "NotFound", f'pods "{name}" not found')
        meta = pod["metadata"]
        preconditions = options.get("preconditions") or {}
        for field_name, label in (("uid", "UID"), ("resourceVersion", "ResourceVersion")):
            wanted = preconditions.get(field_name)
            if wanted is not None and wanted != meta[field_name]:
                message = (
                    f'Operation cannot be fulfilled on pods "{name}": Precondition failed: '
                    f"{label} in precondition: {wanted}, {label} in object meta: {meta[field_name]}"
                )
                return _answer(409, "Conflict", message)
        spec, phase = pod.get("spec") or {}, (pod.get("status") or {}).get("phase")
        grace = options.get("gracePeriodSeconds", spec.get("terminationGracePeriodSeconds", 30))
        if not spec.get("nodeName") or phase in ("Failed", "Succeeded"):
            grace = 0
        if grace == 0:
            return web.json_response(_with_kind(self._remove((namespace, name))))
        if "deletionTimestamp" in meta and meta.get("deletionGracePeriodSeconds", 0) <= grace:
            return web.json_response(_with_kind(pod))  # already terminating: nothing changes
        changed = copy.deepcopy(pod)
        changed["metadata"]["deletionTimestamp"] = now_rfc3339(grace)
        changed["metadata"]["deletionGracePeriodSeconds"] = grace
        return web.json_response(_with_kind(self._store((namespace, name), changed, pod)))

    async def pod_status_patch(self, request: web.Request) -> web.StreamResponse:
        self.calls.append((request.method, request.path_qs))
        namespace, name = request.match_info["ns"], request.match_info["name"]
        denied = self._denied(request, "patch", "pods/status", name)
        if denied is not None:
            return denied
        patch, problem = await _patch_body(request)
        if problem is not None:
            return problem
        pod = self.pods.get((namespace, name))
        if pod is None:
            return _answer(404, "NotFound", f'pods "{name}" not found')
        patched = _merge_patch(pod, patch)
        meta, old_meta = patched.get("metadata") or {}, pod["metadata"]
        if meta.get("name") != name or meta.get("namespace") != namespace:
            return _answer(
                400,
                "BadRequest",
                f"the name of the object ({meta.get('name')}) does not match the name on the URL ({name})",
            )
        if meta.get("uid") != old_meta["uid"]:
            message = (
                f'Operation cannot be fulfilled on pods "{name}": Precondition failed: UID in precondition: '
                f"{meta.get('uid')}, UID in object meta: {old_meta['uid']}"
            )
            return _answer(409, "Conflict", message)
        if meta.get("resourceVersion") != old_meta["resourceVersion"]:
            message = (
                f'Operation cannot be fulfilled on pods "{name}": the object has been modified; '
                "please apply your changes to the latest version and try again"
            )
            return _answer(409, "Conflict", message)
        invalid = _metadata_problems(meta)
        if invalid:
            return _answer(422, "Invalid", f'Pod "{name}" is invalid: {invalid}')
        # The status subresource keeps the spec (and who owns the pod) as they were.
        patched["spec"] = copy.deepcopy(pod.get("spec"))
        for kept in ("deletionTimestamp", "ownerReferences"):
            if kept in old_meta:
                meta[kept] = copy.deepcopy(old_meta[kept])
            else:
                meta.pop(kept, None)
        if patched == pod:
            return web.json_response(_with_kind(pod))
        return web.json_response(_with_kind(self._store((namespace, name), patched, pod)))

    async def event_create(self, request: web.Request) -> web.StreamResponse:
        self.calls.append((request.method, request.path_qs))
        namespace = request.match_info["ns"]
        denied = self._denied(request, "create", "events")
        if denied is not None:
            return denied
        try:
            event = json.loads(await request.read())
        except ValueError as err:
            return _answer(400, "BadRequest", f"the body is not JSON: {err}")
        if not isinstance(event, dict):
            return _answer(400, "BadRequest", "the body is not an object")
        if event.get("kind", "Event") != "Event" or event.get("apiVersion", "v1") != "v1":
            return _answer(
                400, "BadRequest", f"not a core/v1 Event: {event.get('apiVersion')}/{event.get('kind')}"
            )
        meta = event.setdefault("metadata", {})
        if meta.get("namespace", namespace) != namespace:
            return _answer(
                400,
                "BadRequest",
                "the namespace of the provided object does not match the namespace sent on the request",
            )
        meta["namespace"] = namespace
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        name = meta.get("name") or ""
        problems = []
        if not name:
            problems.append("metadata.name: Required value: name or generateName is required")
        elif dns_subdomain_problem(name):
            problems.append(f'metadata.name: Invalid value: "{name}": {dns_subdomain_problem(name)}')
        involved = event.get("involvedObject") or {}
        if involved.get("namespace", "") not in ("", namespace):
            problems.append(
                f'involvedObject.namespace: Invalid value: "{involved.get("namespace")}": does not match event.namespace'
            )
        if event.get("type") not in (None, "", "Normal", "Warning"):
            problems.append(
                f'type: Unsupported value: "{event.get("type")}": supported values: "Normal", "Warning"'
            )
        if problems:
            return _answer(422, "Invalid", f'Event "{name}" is invalid: {", ".join(problems)}')
        if (namespace, name) in self.events:
            return _answer(409, "AlreadyExists", f'events "{name}" already exists')
        self.version += 1
        meta.update(uid=str(uuid.uuid4()), resourceVersion=str(self.version), creationTimestamp=now_rfc3339())
        self.events[(namespace, name)] = event
        return web.json_response(event, status=201)

    async def event_patch(self, request: web.Request) -> web.StreamResponse:
        self.calls.append((request.method, request.path_qs))
        namespace, name = request.match_info["ns"], request.match_info["name"]
        denied = self._denied(request, "patch", "events", name)
        if denied is not None:
            return denied
        patch, problem = await _patch_body(request)
        if problem is not None:
            return problem
        event = self.events.get((namespace, name))
        if event is None:
            return _answer(404, "NotFound", f'events "{name}" not found')
        patched = _merge_patch(event, patch)
        self.version += 1
        patched["metadata"]["resourceVersion"] = str(self.version)
        self.events[(namespace, name)] = patched
        return web.json_response(patched)


async def _patch_body(request: web.Request) -> tuple[dict[str, Any], web.Response | None]:
    """The patch document, or the answer refusing it (media type, not JSON, not an object)."""
    media = request.content_type
    if media in (JSON_PATCH, APPLY_PATCH):
        return {}, _answer(500, "InternalError", f"the FAKE API server does not implement {media}")
    if media not in (MERGE_PATCH, STRATEGIC_MERGE_PATCH):
        message = (
            "the body of the request was in an unknown format - accepted media types include: "
            f"{JSON_PATCH}, {MERGE_PATCH}, {APPLY_PATCH}, {STRATEGIC_MERGE_PATCH}"
        )
        return {}, _answer(415, "UnsupportedMediaType", message)
    try:
        patch = json.loads(await request.read())
    except ValueError as err:
        return {}, _answer(400, "BadRequest", f"error decoding patch: {err}")
    if not isinstance(patch, dict):
        return {}, _answer(400, "BadRequest", "error decoding patch: not a JSON object")
    return patch, None


def _metadata_problems(meta: dict[str, Any]) -> str:
    """The validation errors of labels and annotations, as the API server lists them ("" when valid)."""
    problems = []
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    if not isinstance(labels, dict) or not isinstance(annotations, dict):
        return "metadata: Invalid value: labels and annotations must be maps of strings"
    for key, value in labels.items():
        if qualified_name_problem(key):
            problems.append(f'metadata.labels: Invalid value: "{key}": {qualified_name_problem(key)}')
        if not isinstance(value, str):
            problems.append(f'metadata.labels: Invalid value: "{value}": must be a string')
        elif label_value_problem(value):
            problems.append(f'metadata.labels: Invalid value: "{value}": {label_value_problem(value)}')
    for key, value in annotations.items():
        if qualified_name_problem(key):
            problems.append(f'metadata.annotations: Invalid value: "{key}": {qualified_name_problem(key)}')
        if not isinstance(value, str):
            problems.append(f'metadata.annotations: Invalid value: "{value}": must be a string')
    return ", ".join(problems)


async def start_fake_kube(
    state_dir: Path, *, sock: socket.socket | None = None
) -> tuple[FakeKube, web.AppRunner]:
    """Serve a FakeKube on 127.0.0.1 (HTTPS, certificate for 127.0.0.1); the caller cleans the runner up.

    ``sock``: a listening socket on 127.0.0.1 to serve on instead (one made in a test's node namespace)."""
    ca = LocalCA.load_or_create(state_dir, "cluster.local")
    key_pem, chain_pem = ca.issue_serving_cert(["127.0.0.1"])
    (state_dir / "tls.key").write_bytes(key_pem)
    (state_dir / "tls.crt").write_bytes(chain_pem)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(state_dir / "tls.crt", state_dir / "tls.key")
    fake = FakeKube(ca_pem=ca.root_pem)
    app = web.Application()
    app.router.add_get("/api/v1/namespaces/{ns}/pods/{name}", fake.handle)
    app.router.add_delete("/api/v1/namespaces/{ns}/pods/{name}", fake.pod_delete)
    app.router.add_patch("/api/v1/namespaces/{ns}/pods/{name}/status", fake.pod_status_patch)
    app.router.add_get("/api/v1/pods", fake.pods_collection)
    app.router.add_get("/api/v1/namespaces/{ns}/pods", fake.pods_collection)
    app.router.add_get("/api/v1/namespaces", fake.namespaces_collection)
    app.router.add_get("/apis/apps/v1/namespaces/{ns}/daemonsets/{name}", fake.daemonset_get)
    app.router.add_get("/api/v1/namespaces/{name}", fake.namespace_get)
    app.router.add_post("/api/v1/namespaces/{ns}/events", fake.event_create)
    app.router.add_patch("/api/v1/namespaces/{ns}/events/{name}", fake.event_patch)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site: web.BaseSite = (
        web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
        if sock is None
        else web.SockSite(runner, sock, ssl_context=context)
    )
    await site.start()
    fake.port = int(runner.addresses[0][1])
    return fake, runner


def sidecar_pod(
    name: str = "app-1",
    namespace: str = "default",
    *,
    annotations: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
    proxy_env: dict[str, str] | None = None,
    security_context: dict[str, Any] | None = None,
    extra_containers: list[dict[str, Any]] | None = None,
    init_containers: list[dict[str, Any]] | None = None,
    proxy_args: list[str] | None = None,
    proxy: bool = True,
    node_name: str | None = None,
) -> dict[str, Any]:
    """A pod as the injector leaves it for a CNI-enabled mesh (istio-validation, no istio-init)."""
    proxy_container: dict[str, Any] = {
        "name": "istio-proxy",
        "args": proxy_args if proxy_args is not None else ["proxy", "sidecar"],
        "env": [{"name": key, "value": value} for key, value in (proxy_env or {}).items()],
    }
    if security_context is not None:
        proxy_container["securityContext"] = security_context
    containers = [{"name": "app"}, *(extra_containers or [])]
    if proxy:
        containers.append(proxy_container)
    spec: dict[str, Any] = {
        "initContainers": init_containers if init_containers is not None else [{"name": "istio-validation"}],
        "containers": containers,
    }
    if node_name is not None:
        spec["nodeName"] = node_name
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": labels or {},
            "annotations": {
                "sidecar.istio.io/status": '{"containers":["istio-proxy"]}',
                **(annotations or {}),
            },
        },
        "spec": spec,
    }


def validation_crashlooping(pod_ip: str, *, exit_code: int = 126, message: str = "") -> dict[str, Any]:
    """The status the kubelet reports for a pod whose ``istio-validation`` init container exited
    ``exit_code`` and is waiting to be restarted (CrashLoopBackOff); the app waits to initialize."""
    terminated = {
        "exitCode": exit_code,
        "reason": "Error",
        "startedAt": now_rfc3339(-6),
        "finishedAt": now_rfc3339(-1),
        "containerID": "containerd://" + "a" * 64,
    }
    if message:
        terminated["message"] = message
    return {
        "phase": "Pending",
        "podIP": pod_ip,
        "podIPs": [{"ip": pod_ip}],
        "initContainerStatuses": [
            {
                "name": "istio-validation",
                "state": {
                    "waiting": {
                        "reason": "CrashLoopBackOff",
                        "message": "back-off 10s restarting failed container=istio-validation",
                    }
                },
                "lastState": {"terminated": terminated},
                "ready": False,
                "restartCount": 1,
                "image": "docker.io/istio/proxyv2:1.28.0",
                "imageID": "",
                "started": False,
            }
        ],
        "containerStatuses": [
            {
                "name": name,
                "state": {"waiting": {"reason": "PodInitializing"}},
                "lastState": {},
                "ready": False,
                "restartCount": 0,
                "image": "",
                "imageID": "",
                "started": False,
            }
            for name in ("app", "istio-proxy")
        ],
    }


def validation_passed(pod_ip: str) -> dict[str, Any]:
    """The status of a healthy pod: istio-validation completed, the containers running."""
    return {
        "phase": "Running",
        "podIP": pod_ip,
        "podIPs": [{"ip": pod_ip}],
        "initContainerStatuses": [
            {
                "name": "istio-validation",
                "state": {"terminated": {"exitCode": 0, "reason": "Completed"}},
                "lastState": {},
                "ready": True,
                "restartCount": 0,
                "image": "docker.io/istio/proxyv2:1.28.0",
                "imageID": "",
                "started": False,
            }
        ],
        "containerStatuses": [
            {
                "name": name,
                "state": {"running": {"startedAt": now_rfc3339(-5)}},
                "lastState": {},
                "ready": True,
                "restartCount": 0,
                "image": "",
                "imageID": "",
                "started": True,
            }
            for name in ("app", "istio-proxy")
        ],
    }
