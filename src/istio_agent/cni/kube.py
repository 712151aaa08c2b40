"""The CNI side's Kubernetes API access: the kubeconfig install-cni writes, and the few calls made on it.

No client library: the kubeconfig written by install-cni (``<cni_agent_run_dir>/istio-cni-kubeconfig``:
one cluster with ``server`` and either ``certificate-authority-data`` or ``insecure-skip-tls-verify``,
one user with a ``token``) and plain requests on the agent's HTTP stack.

- The plugin reads one pod per ADD: ``GET /api/v1/namespaces/{ns}/pods/{name}``, blocking (a
  short-lived process that must not import asyncio for one GET); the agent's tools use the asyncio GET.
- install-cni's repair controller (``cni/repair``) does what client-go does for Istio's: it lists and
  watches the pods of its node (``list_objects``, ``watch_objects`` on ``pods``, through its
  informer), deletes (with preconditions) or labels (``pods/status``) broken ones and records Events.
- The ambient node agent (``cni/ambient``) lists and watches its node's pods and every namespace
  the same way, and annotates pods through ``pods/status``; the plugin reads the pod's namespace
  (``get_namespace_blocking``) to decide whether the pod is ambient.

Lists, watches and writes are asyncio; asyncio is imported only when they run, so the plugin's import
of this module stays cheap.

Every request but a watch runs under the caller's deadline; what went wrong is a :class:`KubeError`
that says whether trying again can help (an outage can pass, an RBAC denial will not) and carries the
HTTP status.
"""

from __future__ import annotations

import base64
import binascii
import json
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from istio_agent.config.document import DocumentSyntaxError, Keys, Node, config_errors, load_document
from istio_agent.config.env import ConfigError
from istio_agent.http.url import URL, HTTPError

if TYPE_CHECKING:  # the stack itself (h11, ssl) is imported only for a request
    from os import PathLike

    from istio_agent.http.exchange import Fetched

    FilePath = str | PathLike[str]
    """Files are read with ``open``, not ``pathlib`` (~1 ms of the plugin's ADD to import)."""

KUBECONFIG_NAME = "istio-cni-kubeconfig"
MAX_POD_BYTES = 8 * 2**20
MAX_LIST_BYTES = 256 * 2**20
"""A node's pod list: ~110 pods of at most a few hundred KiB each, with room to spare."""
MAX_WATCH_LINE = 16 * 2**20
"""One watch event (a pod object; the API server stores at most ~1.5 MiB per object)."""
WATCH_GRACE = 30.0
"""A watch gets this long past its ``timeoutSeconds`` before the client drops it (a silent peer)."""
_RETRYABLE_STATUS = frozenset({408, 429})
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
WATCH_TYPES = frozenset({"ADDED", "MODIFIED", "DELETED", "BOOKMARK"})
_PLAIN_SEGMENT = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~")
"""What a path segment carries unescaped (RFC 3986's unreserved characters)."""


class KubeError(Exception):
    """A Kubernetes API call failed; ``retryable`` when the same call may succeed later.

    ``status`` is the HTTP status (or a watch ERROR event's ``code``), None when there was no answer;
    ``reason`` the Status object's ``reason`` (``NotFound``, ``Conflict``, ``Expired``...); ``detail``
    the API server's own message (what client-go's error says), else the whole message.
    """

    def __init__(
        self,
        message: str,
        *,
        retryable: bool,
        status: int | None = None,
        reason: str = "",
        detail: str | None = None,
    ) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.status = status
        self.reason = reason
        self.detail = message if detail is None else detail

    @property
    def gone(self) -> bool:
        """410: the resource version asked for is older than the server keeps (list again)."""
        return self.status == 410


class ObjectList(NamedTuple):
    """A list answer: the objects (pods, namespaces), and the resource version to watch from."""

    items: list[dict[str, Any]]
    resource_version: str


class WatchEvent(NamedTuple):
    """One watch event: ``ADDED``, ``MODIFIED``, ``DELETED`` or ``BOOKMARK`` (ERROR events are raised)."""

    type: str
    object: dict[str, Any]

    @property
    def resource_version(self) -> str:
        meta = self.object.get("metadata")
        value = meta.get("resourceVersion") if isinstance(meta, dict) else None
        return value if isinstance(value, str) else ""


class Kubeconfig(NamedTuple):
    """The parts of a kubeconfig the plugin uses; ``token`` is a secret and never shown.

    This module's types are NamedTuples rather than dataclasses: the plugin imports it for every pod
    it GETs, and a dataclass costs ~0.5 ms of generated code at import (docs/performance.md)."""

    server: URL
    ca_pem: str | None
    insecure: bool
    token: str
    token_file: FilePath | None = None
    """Read before each request when set (a projected service-account token rotates), as client-go does."""

    def __repr__(self) -> str:
        return (
            f"Kubeconfig(server={self.server!r}, ca_pem={self.ca_pem!r}, insecure={self.insecure!r}, "
            f"token_file={self.token_file!r})"
        )

    def bearer(self) -> str:
        """The token to send now; ConfigError when its file cannot be read."""
        if self.token_file is None:
            return self.token
        try:
            return _read_text(self.token_file).strip()
        except OSError as err:
            raise ConfigError(f"cannot read the token {self.token_file}: {err.strerror or err}") from None

    def tls(self) -> ssl.SSLContext | None:
        """The TLS context for the server; None: the system's roots (the HTTP client's cached context)."""
        if self.insecure:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
            return context
        if self.ca_pem is None:
            return None
        try:
            return ssl.create_default_context(cadata=self.ca_pem)
        except ssl.SSLError as err:
            raise ConfigError(
                f"kubeconfig: certificate-authority-data holds no usable certificate: {err}"
            ) from None


def _named(node: Node, name: str, what: str) -> Node:
    """The entry ``name`` of a kubeconfig list (``clusters``, ``users``), its inner object."""
    for item in node.items():
        entry = item.fields(("name", what), Keys.GO_JSON)
        if entry["name"].string() == name:
            return entry[what]
    node.fail(f"no entry named {name!r}")


def _read_text(path: FilePath) -> str:
    with open(path, encoding="utf-8") as file:
        return file.read()


def read_kubeconfig(path: FilePath) -> Kubeconfig:
    """The current context's server, trust and token; raises ConfigError naming the file and field."""
    try:
        text = _read_text(path)
    except OSError as err:
        raise ConfigError(f"cannot read the kubeconfig {path}: {err.strerror or err}") from None
    return parse_kubeconfig(text, str(path))


def parse_kubeconfig(text: str, where: str) -> Kubeconfig:
    """:func:`read_kubeconfig` on a kubeconfig's text; ``where`` names it in errors."""
    try:
        document = load_document(text)
    except DocumentSyntaxError as err:
        # err.brief: the YAML parser's message quotes the bad line, which may be the token's
        raise ConfigError(f"kubeconfig {where} is neither JSON nor YAML: {err.brief}") from None
    root = Node(document, "", config_errors(f"kubeconfig {where}: "))
    fields = root.fields(("current-context", "contexts", "clusters", "users"), Keys.GO_JSON)
    current = fields["current-context"].string()
    contexts = fields["contexts"]
    if current:
        context = _named(contexts, current, "context").fields(("cluster", "user"), Keys.GO_JSON)
        cluster_name, user_name = context["cluster"].string(), context["user"].string()
    else:
        items = contexts.items()
        if len(items) != 1:
            root.fail("no current-context, and not exactly one context to take instead")
        context = (
            items[0].fields(("context",), Keys.GO_JSON)["context"].fields(("cluster", "user"), Keys.GO_JSON)
        )
        cluster_name, user_name = context["cluster"].string(), context["user"].string()
    cluster = _named(fields["clusters"], cluster_name, "cluster").fields(
        ("server", "certificate-authority-data", "certificate-authority", "insecure-skip-tls-verify"),
        Keys.GO_JSON,
    )
    user = _named(fields["users"], user_name, "user").fields(("token", "tokenFile"), Keys.GO_JSON)
    server = cluster["server"]
    try:
        url = URL.parse(server.text())
    except HTTPError as err:
        server.fail(str(err))
    ca_pem = None
    ca_data = cluster["certificate-authority-data"]
    if not ca_data.is_null:
        try:
            ca_pem = base64.b64decode(ca_data.text(), validate=True).decode("ascii")
        except (binascii.Error, UnicodeDecodeError):
            ca_data.fail("not base64 of a PEM certificate")
    elif not cluster["certificate-authority"].is_null:
        ca_file = cluster["certificate-authority"]
        try:
            ca_pem = _read_text(ca_file.text())
        except OSError as err:
            ca_file.fail(f"cannot read {ca_file.value}: {err.strerror or err}")
    insecure = cluster["insecure-skip-tls-verify"]
    token = user["token"].string()
    if not token and not user["tokenFile"].is_null:
        token_file = user["tokenFile"]
        try:
            token = _read_text(token_file.text()).strip()
        except OSError as err:
            token_file.fail(f"cannot read {token_file.value}: {err.strerror or err}")
    return Kubeconfig(url, ca_pem, False if insecure.is_null else insecure.boolean(), token)


class KubeClient:
    """Requests on the API server named by a kubeconfig (one connection per request)."""

    def __init__(self, config: Kubeconfig, *, user_agent: str = "istio-cni") -> None:
        self._config = config
        self._user_agent = user_agent
        self._tls = config.tls() if config.server.scheme == "https" else None

    def get_pod_blocking(self, namespace: str, name: str, *, deadline: float) -> dict[str, Any]:
        """The pod object, or KubeError; gives up at ``deadline`` (``time.monotonic()``)."""
        return self._get_blocking(_pod_path(namespace, name), f"get pod {namespace}/{name}", deadline)

    def get_namespace_blocking(self, name: str, *, deadline: float) -> dict[str, Any]:
        """The namespace object (the plugin's ambient check reads its labels), or KubeError."""
        return self._get_blocking(f"/api/v1/namespaces/{_segment(name)}", f"get namespace {name}", deadline)

    def _get_blocking(self, path: str, action: str, deadline: float) -> dict[str, Any]:
        from istio_agent.http import blocking

        url = self._url(path)
        headers = self._headers()
        try:
            response = blocking.fetch(
                "GET", url, headers=headers, deadline=deadline, max_body=MAX_POD_BYTES, tls=self._tls
            )
        except TimeoutError:
            raise self._no_answer(action) from None
        except HTTPError as err:
            raise KubeError(f"{action}: {err}", retryable=True) from None
        return _decoded(response, action)

    async def get_pod(self, namespace: str, name: str, *, deadline: float) -> dict[str, Any]:
        """:meth:`get_pod_blocking` on the agent's asyncio client."""
        return await self._object("GET", _pod_path(namespace, name), f"get pod {namespace}/{name}", deadline)

    async def get_daemonset(self, namespace: str, name: str, *, deadline: float) -> dict[str, Any]:
        """An apps/v1 DaemonSet (install-cni's own, to tell an upgrade from an uninstall), or KubeError."""
        path = f"/apis/apps/v1/namespaces/{_segment(namespace)}/daemonsets/{_segment(name)}"
        return await self._object("GET", path, f"get daemonset {namespace}/{name}", deadline)

    async def list_pods(
        self, *, label_selector: str = "", field_selector: str = "", deadline: float
    ) -> ObjectList:
        """All pods matching the selectors (every namespace), with the list's resource version."""
        return await self.list_objects(
            "pods", label_selector=label_selector, field_selector=field_selector, deadline=deadline
        )

    async def list_objects(
        self, resource: str, *, label_selector: str = "", field_selector: str = "", deadline: float
    ) -> ObjectList:
        """All objects of a core ``resource`` (``pods``, ``namespaces``) matching the selectors, with
        the list's resource version."""
        query = _query(labelSelector=label_selector, fieldSelector=field_selector)
        action = f"list {resource}"
        answer = await self._object("GET", f"/api/v1/{resource}" + query, action, deadline, MAX_LIST_BYTES)
        items, meta = answer.get("items"), answer.get("metadata")
        version = meta.get("resourceVersion") if isinstance(meta, dict) else None
        if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
            raise KubeError(f"{action}: the answer has no list of items", retryable=False)
        if not isinstance(version, str) or not version:
            raise KubeError(f"{action}: the answer has no metadata.resourceVersion", retryable=False)
        return ObjectList(items, version)

    async def watch_pods(
        self,
        *,
        resource_version: str,
        label_selector: str = "",
        field_selector: str = "",
        timeout_seconds: int = 300,
    ) -> AsyncIterator[WatchEvent]:
        """:meth:`watch_objects` for pods."""
        events = self.watch_objects(
            "pods",
            resource_version=resource_version,
            label_selector=label_selector,
            field_selector=field_selector,
            timeout_seconds=timeout_seconds,
        )
        async for event in events:
            yield event

    async def watch_objects(
        self,
        resource: str,
        *,
        resource_version: str,
        label_selector: str = "",
        field_selector: str = "",
        timeout_seconds: int = 300,
    ) -> AsyncIterator[WatchEvent]:
        """The changes of a core ``resource`` after ``resource_version``, until the server ends the
        watch (after ``timeoutSeconds``) or the connection drops; bookmarks are asked for and passed on.

        An ERROR event is raised as the KubeError it carries: 410 (``gone``) means the version is
        too old, so the caller lists again.
        """
        import asyncio

        from istio_agent.http.client import Client

        query = _query(
            watch="1",
            resourceVersion=resource_version,
            allowWatchBookmarks="true",
            timeoutSeconds=str(timeout_seconds),
            labelSelector=label_selector,
            fieldSelector=field_selector,
        )
        action, url = f"watch {resource}", self._url(f"/api/v1/{resource}" + query)
        headers = self._headers()
        try:
            async with (
                asyncio.timeout(timeout_seconds + WATCH_GRACE),
                Client(tls=self._tls).stream("GET", url, headers=headers) as response,
            ):
                if response.status != 200:
                    body = await response.read(MAX_POD_BYTES, truncate=True)
                    raise _status_error(action, response.status, response.reason, body)
                async for line in _lines(response, action):
                    yield _watch_event(line, action)
        except TimeoutError:
            raise KubeError(f"{action}: the watch did not end in time", retryable=True) from None
        except HTTPError as err:
            raise KubeError(f"{action}: {err}", retryable=True) from None

    async def delete_pod(
        self, namespace: str, name: str, *, uid: str, resource_version: str, deadline: float
    ) -> dict[str, Any]:
        """Delete the pod only if it is still the one seen (preconditions: its UID and resource
        version, as Istio's repair sends them); 409 (it changed) or 404 (gone) is a KubeError."""
        options = {
            "kind": "DeleteOptions",
            "apiVersion": "v1",
            "preconditions": {"uid": uid, "resourceVersion": resource_version},
        }
        action = f"delete pod {namespace}/{name}"
        return await self._object("DELETE", _pod_path(namespace, name), action, deadline, body=options)

    async def patch_pod_status(
        self, namespace: str, name: str, patch: Mapping[str, Any], *, deadline: float
    ) -> dict[str, Any]:
        """A JSON merge patch on ``pods/status``, which may also change labels and annotations with
        less privilege than ``pods`` (Istio labels broken pods this way); the patched pod."""
        path, action = _pod_path(namespace, name) + "/status", f"patch pod {namespace}/{name} status"
        return await self._object("PATCH", path, action, deadline, body=patch, content_type=MERGE_PATCH)

    async def create_event(
        self, namespace: str, event: Mapping[str, Any], *, deadline: float
    ) -> dict[str, Any]:
        """POST a core/v1 Event into ``namespace``."""
        path = f"/api/v1/namespaces/{_segment(namespace)}/events"
        return await self._object("POST", path, f"create event in {namespace}", deadline, body=event)

    async def patch_event(
        self, namespace: str, name: str, patch: Mapping[str, Any], *, deadline: float
    ) -> dict[str, Any]:
        """A strategic merge patch on an Event (its count and last time, as client-go's recorder sends it)."""
        path = f"/api/v1/namespaces/{_segment(namespace)}/events/{_segment(name)}"
        action = f"patch event {namespace}/{name}"
        return await self._object(
            "PATCH", path, action, deadline, body=patch, content_type=STRATEGIC_MERGE_PATCH
        )

    def _url(self, path: str) -> URL:
        server = self._config.server
        return URL(server.scheme, server.host, server.port, server.target.rstrip("/") + path)

    def _headers(self, content_type: str | None = None) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": self._user_agent}
        try:
            token = self._config.bearer()
        except ConfigError as err:
            raise KubeError(str(err), retryable=True) from None
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if content_type is not None:
            headers["Content-Type"] = content_type
        return headers

    def _no_answer(self, action: str) -> KubeError:
        return KubeError(f"{action}: no answer from {self._config.server.address} in time", retryable=True)

    async def _object(
        self,
        method: str,
        path: str,
        action: str,
        deadline: float,
        max_body: int = MAX_POD_BYTES,
        *,
        body: Mapping[str, Any] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        """One request on the asyncio client whose answer is a JSON object, else KubeError naming ``action``."""
        import asyncio

        from istio_agent.http.client import Client

        url = self._url(path)
        data = b"" if body is None else json.dumps(body).encode()
        headers = self._headers(None if body is None else content_type)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(loop.time() + (deadline - time.monotonic())):
                response = await Client(tls=self._tls).fetch(
                    method, url, headers=headers, body=data, max_body=max_body
                )
        except TimeoutError:
            raise self._no_answer(action) from None
        except HTTPError as err:
            raise KubeError(f"{action}: {err}", retryable=True) from None
        return _decoded(response, action)


def _pod_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{_segment(namespace)}/pods/{_segment(name)}"


def _segment(name: str) -> str:
    """``name`` as one path segment. Kubernetes names are DNS labels and subdomains, which need no
    escaping, so ``urllib.parse`` (~1 ms of the plugin's ADD to import) is loaded only for others."""
    if name and _PLAIN_SEGMENT.issuperset(name):
        return name
    from urllib.parse import quote

    return quote(name, safe="")


def _query(**params: str) -> str:
    from urllib.parse import urlencode  # list and watch: install-cni's repair, never the plugin

    given = {key: value for key, value in params.items() if value}
    return "?" + urlencode(given) if given else ""


def _decoded(response: Fetched, action: str) -> dict[str, Any]:
    """The JSON object of a 2xx answer, or KubeError (retryable for 5xx, 408, 429)."""
    if not 200 <= response.status < 300:
        raise _status_error(action, response.status, response.reason, response.body)
    try:
        answer = json.loads(response.body)
    except ValueError as err:
        raise KubeError(f"{action}: the answer is not JSON: {err}", retryable=False) from None
    if not isinstance(answer, dict):
        raise KubeError(f"{action}: the answer is not a JSON object", retryable=False)
    return answer


def _status_error(action: str, status: int, reason: str, body: bytes) -> KubeError:
    retryable = status >= 500 or status in _RETRYABLE_STATUS
    detail = _status_message(body)
    return KubeError(
        f"{action}: {status} {reason}: {detail}",
        retryable=retryable,
        status=status,
        reason=_status_reason(body),
        detail=detail,
    )


async def _lines(response: Any, action: str) -> AsyncIterator[bytes]:
    """The newline-framed JSON documents of a watch body, each as soon as it is complete."""
    pending = bytearray()
    while chunk := await response.read_chunk():
        pending += chunk
        while (end := pending.find(b"\n")) >= 0:
            line = bytes(pending[:end])
            del pending[: end + 1]
            if line.strip():
                yield line
        if len(pending) > MAX_WATCH_LINE:
            raise KubeError(f"{action}: an event longer than {MAX_WATCH_LINE} bytes", retryable=True)
    if pending.strip():
        yield bytes(pending)


def _watch_event(line: bytes, action: str) -> WatchEvent:
    """One watch event; an ERROR event (a Status) becomes the KubeError it carries."""
    try:
        event = json.loads(line)
    except ValueError as err:
        raise KubeError(f"{action}: an event that is not JSON: {err}", retryable=True) from None
    kind = event.get("type") if isinstance(event, dict) else None
    body = event.get("object") if isinstance(event, dict) else None
    if not isinstance(kind, str) or not isinstance(body, dict):
        raise KubeError(f"{action}: an event without a type and an object", retryable=True)
    if kind == "ERROR":
        code = body.get("code")
        status = code if isinstance(code, int) and not isinstance(code, bool) else None
        message = body.get("message")
        reason = body.get("reason")
        detail = message if isinstance(message, str) else json.dumps(body)[:200]
        raise KubeError(
            f"{action}: error event {status}: {detail}",
            retryable=True,
            status=status,
            reason=reason if isinstance(reason, str) else "",
            detail=detail,
        )
    if kind not in WATCH_TYPES:
        raise KubeError(f"{action}: an event of unknown type {kind!r}", retryable=True)
    return WatchEvent(kind, body)


def _status_message(body: bytes) -> str:
    """The ``message`` of a Kubernetes Status answer (``pods "x" is forbidden: ...``), else the body's start."""
    try:
        status = json.loads(body)
    except ValueError:
        status = None
    if isinstance(status, dict) and isinstance(status.get("message"), str):
        return str(status["message"])
    text = body[:200].decode("utf-8", errors="replace").strip()
    return text or "(no body)"


def _status_reason(body: bytes) -> str:
    """The ``reason`` of a Kubernetes Status answer (``NotFound``, ``Conflict``...), else ""."""
    try:
        status = json.loads(body)
    except ValueError:
        return ""
    reason = status.get("reason") if isinstance(status, dict) else None
    return reason if isinstance(reason, str) else ""
