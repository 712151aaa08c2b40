"""What istiod generates for WasmPlugins: the filters that fetch them over ECDS, and the ECDS resources.

istiod's code is the reference (Istio 1.28): ``pilot/pkg/model/push_context.go``
(``WasmPluginsByListenerInfo``: which plugins a listener gets and in which order;
``WasmPluginsByName``: which ones a proxy may ask for), ``pilot/pkg/networking/core/extension/wasmplugin.go``
(the ``config_discovery`` filters and the ECDS resources with the pull secret put in),
``pilot/pkg/model/extensions.go`` (the Wasm ``PluginConfig``), ``pilot/pkg/networking/core/listener_builder.go``
and ``networkfilter.go`` (where the filters go: by phase, AUTHN, AUTHZ, STATS, then unspecified, before
the router or the terminal network filter) and ``pilot/pkg/xds/ecds.go`` (pull secrets only for a
proxy whose identity was verified).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from envoy.config.core.v3 import extension_pb2
from envoy.extensions.filters.http.wasm.v3 import wasm_pb2 as http_wasm_pb2
from envoy.extensions.filters.network.wasm.v3 import wasm_pb2 as network_wasm_pb2
from envoy.extensions.wasm.v3 import wasm_pb2
from google.protobuf import any_pb2, duration_pb2, wrappers_pb2

from istio_agent import goformat
from istio_agent.controlplane.wasmplugins import ROOT_NAMESPACE, WasmPlugin

EXTENSION_CONFIG_TYPE = "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig"
WASM_HTTP_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
RBAC_HTTP_TYPE = "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC"
WASM_NETWORK_TYPE = "type.googleapis.com/envoy.extensions.filters.network.wasm.v3.Wasm"
RBAC_NETWORK_TYPE = "type.googleapis.com/envoy.extensions.filters.network.rbac.v3.RBAC"
RUNTIME = "envoy.wasm.runtime.v8"
REMOTE_TIMEOUT_SECONDS = 30
REMOTE_CLUSTER = "_"
"""istiod's placeholder cluster: the agent fetches the module, Envoy never does."""

SECRET_ENV = "ISTIO_META_WASM_IMAGE_PULL_SECRET"
POLICY_ENV = "ISTIO_META_WASM_IMAGE_PULL_POLICY"
RESOURCE_VERSION_ENV = "ISTIO_META_WASM_PLUGIN_RESOURCE_VERSION"

SERVER = "SERVER"
"""A sidecar's inbound listeners (istiod's ListenerClassSidecarInbound)."""
CLIENT = "CLIENT"
"""A sidecar's outbound listeners."""
PHASE_ORDER = ("AUTHN", "AUTHZ", "STATS", "UNSPECIFIED_PHASE")
_MIN_INT32 = -(2**31)
_ISTIO_VERSION = re.compile(r"^([1-9]+)\.([0-9]+)(\.([0-9]+))?")


def _selects(plugin: WasmPlugin, namespace: str, labels: dict[str, str]) -> bool:
    """The plugin's namespace is the workload's (or the root namespace) and its selector matches."""
    if plugin.namespace not in (namespace, ROOT_NAMESPACE):
        return False
    return plugin.selector is None or all(labels.get(k) == v for k, v in plugin.selector.items())


def _matches_listener(plugin: WasmPlugin, port: int, mode: str) -> bool:
    if not plugin.match:
        return True
    return any(
        selector.mode in ("UNDEFINED", "CLIENT_AND_SERVER", mode)
        and (not selector.ports or port in selector.ports)
        for selector in plugin.match
    )


def _by_namespace(plugins: Iterable[WasmPlugin], namespace: str) -> list[WasmPlugin]:
    """The proxy's namespace's plugins, then the root namespace's, each in file order (as istiod looks them up)."""
    plugins = list(plugins)
    namespaces = [namespace] if namespace == ROOT_NAMESPACE else [namespace, ROOT_NAMESPACE]
    return [plugin for ns in namespaces for plugin in plugins if plugin.namespace == ns]


def listener_plugins(
    plugins: Iterable[WasmPlugin],
    namespace: str,
    labels: dict[str, str],
    *,
    port: int,
    mode: str,
    network: bool,
) -> list[WasmPlugin]:
    """The plugins of one listener's filter chain, in istiod's order: by phase, then priority (highest
    first; none is lowest), then namespace and file order."""
    chosen = [
        plugin
        for plugin in _by_namespace(plugins, namespace)
        if plugin.is_network == network
        and _selects(plugin, namespace, labels)
        and _matches_listener(plugin, port, mode)
    ]
    ordered: list[WasmPlugin] = []
    for phase in PHASE_ORDER:
        in_phase = [plugin for plugin in chosen if plugin.phase == phase]
        in_phase.sort(key=lambda p: -(p.priority if p.priority is not None else _MIN_INT32))
        ordered.extend(in_phase)
    return ordered


def config_source() -> dict[str, Any]:
    """ADS, and Envoy waits for the plugin without a deadline (it may be security-critical, istiod says)."""
    return {"ads": {}, "initial_fetch_timeout": "0s", "resource_api_version": "V3"}


def discovery_filter(plugin: WasmPlugin) -> dict[str, Any]:
    """The HTTP or network filter (protobuf JSON) that takes the plugin from ECDS; no default config."""
    type_urls = (
        [WASM_NETWORK_TYPE, RBAC_NETWORK_TYPE] if plugin.is_network else [WASM_HTTP_TYPE, RBAC_HTTP_TYPE]
    )
    return {
        "name": plugin.resource_name,
        "config_discovery": {"config_source": config_source(), "type_urls": type_urls},
    }


# -- ECDS -------------------------------------------------------------------------------------------


def extension_configs(
    plugins: Iterable[WasmPlugin],
    namespace: str,
    *,
    pull_secrets: dict[str, bytes],
    verified: bool,
    istio_version: str = "",
) -> dict[str, extension_pb2.TypedExtensionConfig]:
    """Every ECDS resource a proxy of ``namespace`` may ask for, by name (istiod's WasmPluginsByName
    takes the plugins of its namespace and the root namespace by name, whatever their selector).

    ``verified``: the proxy's identity was authenticated (TLS port); others get an empty pull secret.
    """
    configs: dict[str, extension_pb2.TypedExtensionConfig] = {}
    for plugin in _by_namespace(plugins, namespace):
        secret = ""
        if plugin.image_pull_secret:
            found = pull_secrets.get(plugin.image_pull_secret) if verified else None
            secret = found.decode("utf-8", "replace") if found is not None else ""
        config = plugin_config(plugin, secret, istio_version)
        wrapper = (
            network_wasm_pb2.Wasm(config=config) if plugin.is_network else http_wasm_pb2.Wasm(config=config)
        )
        typed = any_pb2.Any()
        typed.Pack(wrapper)
        configs[plugin.resource_name] = extension_pb2.TypedExtensionConfig(
            name=plugin.resource_name, typed_config=typed
        )
    return configs


def plugin_config(plugin: WasmPlugin, pull_secret: str, istio_version: str = "") -> wasm_pb2.PluginConfig:
    """The Wasm ``PluginConfig`` as istiod's ``buildPluginConfig`` writes it."""
    config = wasm_pb2.PluginConfig(name=f"{plugin.namespace}.{plugin.name}", root_id=plugin.plugin_name)
    config.configuration.SetInParent()  # istiod sets an empty Any when there is no pluginConfig
    if plugin.plugin_config:
        config.configuration.Pack(wrappers_pb2.StringValue(value=struct_json(plugin.plugin_config)))
    vm = config.vm_config
    vm.runtime = RUNTIME
    _code(plugin, vm.code)
    env = vm.environment_variables
    env.SetInParent()
    if plugin.image_pull_secret:
        env.key_values[SECRET_ENV] = pull_secret
    if plugin.image_pull_policy != "UNSPECIFIED_POLICY":
        env.key_values[POLICY_ENV] = plugin.image_pull_policy
    env.key_values[RESOURCE_VERSION_ENV] = plugin.resource_version
    for variable in plugin.vm_env:
        if variable.value_from == "INLINE":
            env.key_values[variable.name] = variable.value
        else:
            env.host_env_keys.append(variable.name)
    if _at_least_1_25(istio_version):
        config.failure_policy = {
            "FAIL_OPEN": wasm_pb2.FAIL_OPEN,
            "FAIL_CLOSE": wasm_pb2.FAIL_CLOSED,
            "FAIL_RELOAD": wasm_pb2.FAIL_RELOAD,
        }[plugin.fail_strategy]
    else:  # the deprecated field, for proxies older than 1.25
        config.fail_open = plugin.fail_strategy == "FAIL_OPEN"
    return config


def _code(plugin: WasmPlugin, code: Any) -> None:
    """``local.filename`` for a file:// URL, else ``remote`` (a URL without scheme is oci://)."""
    if plugin.url.startswith("file://"):
        code.local.filename = plugin.url.removeprefix("file://")
        return
    url = plugin.url if "://" in plugin.url else f"oci://{plugin.url}"
    code.remote.http_uri.uri = url
    code.remote.http_uri.cluster = REMOTE_CLUSTER
    code.remote.http_uri.timeout.CopyFrom(duration_pb2.Duration(seconds=REMOTE_TIMEOUT_SECONDS))
    code.remote.sha256 = plugin.sha256


def _at_least_1_25(istio_version: str) -> bool:
    """istiod's ``VersionGreaterOrEqual(1.25.0)``: a proxy that states no version is taken as the newest."""
    found = _ISTIO_VERSION.match(istio_version.removeprefix("release-"))
    if found is None:
        return True
    return (int(found.group(1)), int(found.group(2))) >= (1, 25)


def struct_json(value: Any) -> str:
    """A Struct as istiod's ``protomarshal.ToJSON`` (golang/protobuf jsonpb) writes it: compact, map keys
    sorted, numbers as Go writes a float64, strings as Go's encoding/json does."""
    if isinstance(value, dict):
        items = (f"{goformat.json_marshal(str(key))}:{struct_json(value[key])}" for key in sorted(value))
        return "{" + ",".join(items) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(struct_json(item) for item in value) + "]"
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, int | float):
        return goformat.go_float(float(value))
    return goformat.json_marshal(str(value))
