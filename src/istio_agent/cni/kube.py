"""The plugin's Kubernetes API access: the kubeconfig install-cni writes, and one GET of the pod.

The plugin reads a single pod per ADD, so it needs no client library: the kubeconfig written by
install-cni (``<cni_agent_run_dir>/istio-cni-kubeconfig``: one cluster with ``server`` and either
``certificate-authority-data`` or ``insecure-skip-tls-verify``, one user with a ``token``) and
``GET /api/v1/namespaces/{ns}/pods/{name}`` on the agent's HTTP stack: blocking in the plugin (a
short-lived process that must not import asyncio for one GET), asyncio in the agent's tools. Every
request runs under the caller's deadline; what went wrong is a :class:`KubeError` that says whether
trying again can help (an outage can pass, an RBAC denial will not).
"""

from __future__ import annotations

import base64
import binascii
import json
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from istio_agent.config.document import DocumentSyntaxError, Keys, Node, config_errors, load_document
from istio_agent.config.env import ConfigError
from istio_agent.http.exchange import URL, Fetched, HTTPError

KUBECONFIG_NAME = "istio-cni-kubeconfig"
MAX_POD_BYTES = 8 * 2**20
_RETRYABLE_STATUS = frozenset({408, 429})


class KubeError(Exception):
    """A Kubernetes API call failed; ``retryable`` when the same call may succeed later."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True)
class Kubeconfig:
    """The parts of a kubeconfig the plugin uses; ``token`` is a secret and never shown."""

    server: URL
    ca_pem: str | None
    insecure: bool
    token: str = field(repr=False)

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


def read_kubeconfig(path: Path) -> Kubeconfig:
    """The current context's server, trust and token; raises ConfigError naming the file and field."""
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"cannot read the kubeconfig {path}: {err.strerror or err}") from None
    try:
        document = load_document(text)
    except DocumentSyntaxError as err:
        # err.brief: the YAML parser's message quotes the bad line, which may be the token's
        raise ConfigError(f"kubeconfig {path} is neither JSON nor YAML: {err.brief}") from None
    root = Node(document, "", config_errors(f"kubeconfig {path}: "))
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
            ca_pem = Path(ca_file.text()).read_text()
        except OSError as err:
            ca_file.fail(f"cannot read {ca_file.value}: {err.strerror or err}")
    insecure = cluster["insecure-skip-tls-verify"]
    token = user["token"].string()
    if not token and not user["tokenFile"].is_null:
        token_file = user["tokenFile"]
        try:
            token = Path(token_file.text()).read_text().strip()
        except OSError as err:
            token_file.fail(f"cannot read {token_file.value}: {err.strerror or err}")
    return Kubeconfig(url, ca_pem, False if insecure.is_null else insecure.boolean(), token)


class KubeClient:
    """GETs on the API server named by a kubeconfig (one connection per request)."""

    def __init__(self, config: Kubeconfig) -> None:
        self._config = config
        self._tls = config.tls() if config.server.scheme == "https" else None

    def get_pod_blocking(self, namespace: str, name: str, *, deadline: float) -> dict[str, Any]:
        """The pod object, or KubeError; gives up at ``deadline`` (``time.monotonic()``)."""
        from istio_agent.http import blocking

        url, headers, what = self._pod_request(namespace, name)
        try:
            response = blocking.fetch(
                "GET", url, headers=headers, deadline=deadline, max_body=MAX_POD_BYTES, tls=self._tls
            )
        except TimeoutError:
            raise self._no_answer(what) from None
        except HTTPError as err:
            raise KubeError(f"get {what}: {err}", retryable=True) from None
        return _pod_from(response, what)

    async def get_pod(self, namespace: str, name: str, *, deadline: float) -> dict[str, Any]:
        """:meth:`get_pod_blocking` on the agent's asyncio client."""
        import asyncio

        from istio_agent.http.client import Client

        url, headers, what = self._pod_request(namespace, name)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(loop.time() + (deadline - time.monotonic())):
                response = await Client(tls=self._tls).fetch(
                    "GET", url, headers=headers, max_body=MAX_POD_BYTES
                )
        except TimeoutError:
            raise self._no_answer(what) from None
        except HTTPError as err:
            raise KubeError(f"get {what}: {err}", retryable=True) from None
        return _pod_from(response, what)

    def _pod_request(self, namespace: str, name: str) -> tuple[URL, dict[str, str], str]:
        server = self._config.server
        path = f"/api/v1/namespaces/{quote(namespace, safe='')}/pods/{quote(name, safe='')}"
        url = URL(server.scheme, server.host, server.port, server.target.rstrip("/") + path)
        headers = {"Accept": "application/json", "User-Agent": "istio-cni"}
        if self._config.token:
            headers["Authorization"] = f"Bearer {self._config.token}"
        return url, headers, f"pod {namespace}/{name}"

    def _no_answer(self, what: str) -> KubeError:
        return KubeError(f"get {what}: no answer from {self._config.server.address} in time", retryable=True)


def _pod_from(response: Fetched, what: str) -> dict[str, Any]:
    """The pod in an answer, or KubeError (retryable for 5xx, 408, 429)."""
    if response.status != 200:
        retryable = response.status >= 500 or response.status in _RETRYABLE_STATUS
        raise KubeError(
            f"get {what}: {response.status} {response.reason}: {_status_message(response.body)}",
            retryable=retryable,
        )
    try:
        pod = json.loads(response.body)
    except ValueError as err:
        raise KubeError(f"get {what}: the answer is not JSON: {err}", retryable=False) from None
    if not isinstance(pod, dict):
        raise KubeError(f"get {what}: the answer is not a JSON object", retryable=False)
    return pod


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
