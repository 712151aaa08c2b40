"""The mesh file's ``wasmPlugins`` (Istio's WasmPlugin spec) and ``pullSecrets`` entries, validated.

Field names and enum values are the WasmPlugin API's (``extensions.istio.io/v1alpha1``), so an entry
reads like the ``spec`` of a WasmPlugin resource; the checks are istiod's validation webhook's
(``pkg/config/validation/validation.go`` ``ValidateWasmPlugin``) plus what a file can check that a
cluster cannot: an ``imagePullSecret`` must name a ``pullSecrets`` entry. A pull secret is the docker
config JSON a ``kubernetes.io/dockerconfigjson`` Secret holds, read from a file named relative to the
mesh file.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from istio_agent.config.document import Keys, Node, kind

ROOT_NAMESPACE = "istio-system"
"""istiod's default mesh root namespace: a WasmPlugin there applies to every namespace."""
RESOURCE_NAME_PREFIX = "extensions.istio.io/wasmplugin/"
"""istiod's ECDS resource name prefix (``pilot/pkg/model/extensions.go`` WasmPluginResourceNamePrefix)."""
SECRET_PREFIX = "kubernetes://"

PHASES = ("UNSPECIFIED_PHASE", "AUTHN", "AUTHZ", "STATS")
FAIL_STRATEGIES = ("FAIL_CLOSE", "FAIL_OPEN", "FAIL_RELOAD")
PULL_POLICIES = ("UNSPECIFIED_POLICY", "IfNotPresent", "Always")
PLUGIN_TYPES = ("UNSPECIFIED_PLUGIN_TYPE", "HTTP", "NETWORK")
ENV_SOURCES = ("INLINE", "HOST")
WORKLOAD_MODES = ("UNDEFINED", "CLIENT", "SERVER", "CLIENT_AND_SERVER")
URL_SCHEMES = ("", "file", "http", "https", "oci")

_PLUGIN_KEYS = (
    "name",
    "namespace",
    "selector",
    "url",
    "sha256",
    "phase",
    "priority",
    "failStrategy",
    "imagePullPolicy",
    "imagePullSecret",
    "pluginConfig",
    "pluginName",
    "type",
    "vmConfig",
    "match",
)
_SECRET_KEYS = ("name", "namespace", "dockerConfig")
_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_SUBDOMAIN = re.compile(r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_SHA256 = re.compile(r"^[a-f0-9]{64}$")
_INT32 = 2**31 - 1


@dataclass(frozen=True)
class VmEnv:
    """One ``vmConfig.env`` entry: a value given inline, or a variable of Envoy's host (``HOST``)."""

    name: str
    value: str = ""
    value_from: str = "INLINE"


@dataclass(frozen=True)
class TrafficSelector:
    """One ``match`` entry: which listeners (by workload mode and port) the plugin goes on."""

    mode: str = "UNDEFINED"
    ports: tuple[int, ...] = ()


@dataclass(frozen=True)
class WasmPlugin:
    """A validated ``wasmPlugins`` entry; ``image_pull_secret`` is a ``kubernetes://<ns>/<name>`` key."""

    name: str
    namespace: str
    url: str
    selector: dict[str, str] | None = None
    """``selector.matchLabels``; None: every workload of the namespace (of the mesh, in the root namespace)."""
    sha256: str = ""
    phase: str = "UNSPECIFIED_PHASE"
    priority: int | None = None
    fail_strategy: str = "FAIL_CLOSE"
    image_pull_policy: str = "UNSPECIFIED_POLICY"
    image_pull_secret: str = ""
    plugin_config: dict[str, Any] = field(default_factory=dict)
    plugin_name: str = ""
    type: str = "UNSPECIFIED_PLUGIN_TYPE"
    vm_env: tuple[VmEnv, ...] = ()
    match: tuple[TrafficSelector, ...] = ()
    resource_version: str = ""
    """Stands for the Kubernetes resourceVersion: a hash of the entry, so it changes when the entry does."""

    @property
    def resource_name(self) -> str:
        """The ECDS resource and HTTP filter name istiod gives it."""
        return f"{RESOURCE_NAME_PREFIX}{self.namespace}.{self.name}"

    @property
    def is_network(self) -> bool:
        return self.type == "NETWORK"


def secret_key(namespace: str, name: str) -> str:
    return f"{SECRET_PREFIX}{namespace}/{name}"


def read_pull_secrets(node: Node, base: Path) -> dict[str, bytes]:
    """``pullSecrets``: ``kubernetes://<ns>/<name>`` → the docker config JSON file's bytes."""
    secrets: dict[str, bytes] = {}
    for item in node.items():
        fields = item.fields(_SECRET_KEYS, Keys.EXACT)
        name = _name(fields["name"], _SUBDOMAIN, "secret name (DNS-1123 subdomain)")
        namespace = _name(fields["namespace"], _LABEL, "namespace (DNS-1123 label)", "default")
        entry = Node(item.value, f"{item.where} ({namespace}/{name})", item.error)
        key = secret_key(namespace, name)
        if key in secrets:
            entry.fail("duplicate pull secret")
        path_node = entry.child("dockerConfig", fields["dockerConfig"].value)
        if path_node.is_null:
            path_node.fail("required (the docker config JSON file, relative to the mesh file)")
        path = base / path_node.text()
        try:
            data = path.read_bytes()
        except OSError as err:
            path_node.fail(f"cannot read {path}: {err.strerror or err}")
        try:
            document = json.loads(data)
        except ValueError as err:
            path_node.fail(f"{path} is not JSON: {err}")
        if not isinstance(document, dict):
            path_node.fail(f"{path} is not a docker config (a JSON object), got {kind(document)}")
        secrets[key] = data
    return secrets


def read_wasm_plugins(node: Node, pull_secrets: dict[str, bytes]) -> tuple[WasmPlugin, ...]:
    """``wasmPlugins``, in file order (istiod's order: creation time); ``<ns>/<name>`` unique."""
    plugins: list[WasmPlugin] = []
    seen: dict[tuple[str, str], int] = {}
    for index, item in enumerate(node.items()):
        plugin = _plugin(index, item, pull_secrets)
        key = (plugin.namespace, plugin.name)
        if key in seen:
            raise item.error(
                f"wasmPlugins[{index}] ({plugin.namespace}/{plugin.name})",
                f"duplicate WasmPlugin (also wasmPlugins[{seen[key]}])",
            )
        seen[key] = index
        plugins.append(plugin)
    return tuple(plugins)


def _name(node: Node, pattern: re.Pattern[str], what: str, default: str | None = None) -> str:
    if node.is_null and default is None:
        node.fail("required")
    value = node.string(default or "")
    if not pattern.match(value):
        node.fail(f"{value!r} is not a valid {what}")
    return value


def _plugin(index: int, item: Node, pull_secrets: dict[str, bytes]) -> WasmPlugin:
    fields = item.fields(_PLUGIN_KEYS, Keys.EXACT)
    name = _name(fields["name"], _SUBDOMAIN, "name (DNS-1123 subdomain)")
    namespace = _name(fields["namespace"], _LABEL, "namespace (DNS-1123 label)", "default")
    entry = Node(item.value, f"wasmPlugins[{index}] ({namespace}/{name})", item.error)
    fields = entry.fields(_PLUGIN_KEYS, Keys.EXACT)
    url = _url(fields["url"])
    sha256 = fields["sha256"].string()
    if sha256 and not _SHA256.match(sha256):
        fields["sha256"].fail("must be 64 lower-case hex digits ([a-f0-9]{64})")
    priority = (
        None
        if fields["priority"].is_null
        else fields["priority"].integer(minimum=-_INT32 - 1, maximum=_INT32)
    )
    secret = _pull_secret(fields["imagePullSecret"], namespace, pull_secrets)
    plugin_name = fields["pluginName"].string()
    if len(plugin_name) > 256:
        fields["pluginName"].fail("must be at most 256 characters long")
    return WasmPlugin(
        name=name,
        namespace=namespace,
        url=url,
        selector=_selector(fields["selector"]),
        sha256=sha256,
        phase=_enum(fields["phase"], PHASES),
        priority=priority,
        fail_strategy=_enum(fields["failStrategy"], FAIL_STRATEGIES),
        image_pull_policy=_enum(fields["imagePullPolicy"], PULL_POLICIES),
        image_pull_secret=secret,
        plugin_config=_plugin_config(fields["pluginConfig"]),
        plugin_name=plugin_name,
        type=_enum(fields["type"], PLUGIN_TYPES),
        vm_env=_vm_env(fields["vmConfig"]),
        match=_match(fields["match"]),
        resource_version=_resource_version(item.value),
    )


def _enum(node: Node, options: tuple[str, ...]) -> str:
    """An enum by its API name; null is the first (the proto default)."""
    return options[0] if node.is_null else node.choice(options)


def _url(node: Node) -> str:
    """The module's URL: ``file://``, ``http(s)://``, ``oci://`` or a registry reference without scheme
    (which istiod reads as ``oci://``); what ``urlsplit`` takes for a scheme is checked as istiod does."""
    if node.is_null or not node.string():
        node.fail("required (file://, http://, https:// or oci:// URL of the Wasm module)")
    url = node.text()
    try:
        scheme = urlsplit(url).scheme
    except ValueError as err:
        node.fail(f"failed to parse url: {err}")
    if scheme not in URL_SCHEMES:
        node.fail(f"url contains unsupported scheme: {scheme} (use file, http, https or oci)")
    if scheme == "file" and not url.removeprefix("file://").startswith("/"):
        node.fail("a file:// URL needs an absolute path (file:///path/to/module.wasm)")
    return url


def _selector(node: Node) -> dict[str, str] | None:
    if node.is_null:
        return None
    labels = node.fields(("matchLabels",), Keys.EXACT)["matchLabels"]
    if labels.is_null:
        return {}
    result = labels.map()
    for key, value in result.items():
        if not isinstance(key, str):
            labels.fail(f"key {key!r}: expected a string, got {kind(key)}")
        if not isinstance(value, str):
            labels.child(key, value).fail(f"expected a string, got {kind(value)} (quote it)")
    return dict(sorted(result.items()))


def _pull_secret(node: Node, namespace: str, pull_secrets: dict[str, bytes]) -> str:
    """istiod's rule (``toSecretResourceName``): the secret is in the plugin's namespace, whatever
    namespace the name gives; a name no ``pullSecrets`` entry has is an error here."""
    name = node.string()
    if not name:
        return ""
    if len(name) > 253:
        node.fail("must be at most 253 characters long")
    key = secret_key(namespace, name.removeprefix(SECRET_PREFIX).rpartition("/")[2])
    if key not in pull_secrets:
        node.fail(
            f"no pullSecrets entry {key.removeprefix(SECRET_PREFIX)} (secrets are the plugin's namespace's)"
        )
    return key


def _plugin_config(node: Node) -> dict[str, Any]:
    if node.is_null:
        return {}
    config = node.map()
    _check_struct(node)
    return config


def _check_struct(node: Node) -> None:
    """What a protobuf Struct holds: maps with string keys, lists, strings, finite numbers, booleans, null."""
    value = node.value
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                node.fail(f"key {key!r}: expected a string, got {kind(key)}")
            _check_struct(node.child(key, item))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_struct(node.element(index, item))
    elif isinstance(value, int | float) and not isinstance(value, bool):
        node.number()
    elif not (value is None or isinstance(value, str | bool)):
        node.fail(f"expected a JSON value, got {kind(value)}")


def _vm_env(node: Node) -> tuple[VmEnv, ...]:
    if node.is_null:
        return ()
    env: list[VmEnv] = []
    names: set[str] = set()
    for item in node.fields(("env",), Keys.EXACT)["env"].items():
        fields = item.fields(("name", "value", "valueFrom"), Keys.EXACT)
        name = fields["name"].string()
        if not name:
            fields["name"].fail("required")
        if len(name) > 256:
            fields["name"].fail("must be at most 256 characters long")
        if name in names:
            fields["name"].fail(f"duplicate env {name!r}")
        names.add(name)
        value_from = _enum(fields["valueFrom"], ENV_SOURCES)
        value = fields["value"].string()
        if value_from != "INLINE" and value:
            fields["value"].fail("value may only be set when valueFrom is INLINE")
        env.append(VmEnv(name, value, value_from))
    return tuple(env)


def _match(node: Node) -> tuple[TrafficSelector, ...]:
    selectors = []
    for item in node.items():
        fields = item.fields(("mode", "ports"), Keys.EXACT)
        ports = []
        for port in fields["ports"].items():
            ports.append(port.fields(("number",), Keys.EXACT)["number"].port())
        selectors.append(TrafficSelector(_enum(fields["mode"], WORKLOAD_MODES), tuple(ports)))
    return tuple(selectors)


def _resource_version(value: Any) -> str:
    digest = hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()
    return digest[:16]
