"""WasmPlugins in the local control plane: the mesh file's entries, what istiod would generate, ADS.

The expected messages are written from istiod's code at Istio 1.28.10 (ff49c188), not from our output:
``pilot/pkg/networking/core/extension/wasmplugin.go`` (the ``config_discovery`` filter: ADS source with
``initial_fetch_timeout`` 0s, type URLs Wasm then RBAC, no default config; the pull secret put into the
VM env), ``pilot/pkg/model/extensions.go`` (``buildPluginConfig``, ``buildDataSource``, ``buildVMConfig``:
name ``<ns>.<name>``, root id, configuration, v8, remote ``http_uri`` {uri, cluster "_", 30s} and
sha256, or ``local.filename``; the ISTIO_META_WASM_* variables; failure policy by proxy version),
``pilot/pkg/model/push_context.go`` (``WasmPluginsByListenerInfo``: namespace then root namespace,
selector, traffic selectors, phase, priority highest first; ``WasmPluginsByName``),
``pilot/pkg/networking/core/listener_builder.go`` (AUTHN, AUTHZ, STATS, unspecified, then the router),
``pilot/pkg/networking/core/networkfilter.go`` (network plugins before the terminal filter),
``pilot/pkg/xds/ecds.go`` (pull secrets only to a verified proxy) and
``pkg/config/validation/validation.go`` (``ValidateWasmPlugin``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2, config_source_pb2, extension_pb2, http_uri_pb2
from envoy.config.listener.v3 import listener_components_pb2
from envoy.extensions.filters.http.wasm.v3 import wasm_pb2 as http_wasm_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2
from envoy.extensions.filters.network.wasm.v3 import wasm_pb2 as network_wasm_pb2
from envoy.extensions.wasm.v3 import wasm_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc
from google.protobuf import any_pb2, duration_pb2, wrappers_pb2

from istio_agent.controlplane.ads import AdsServer
from istio_agent.controlplane.debug import DebugAccess
from istio_agent.controlplane.mesh import MeshConfig, MeshError, parse_mesh
from istio_agent.controlplane.wasmgen import struct_json
from istio_agent.controlplane.wasmplugins import WasmPlugin
from istio_agent.controlplane.xdsgen import (
    EXTENSION_CONFIG_TYPE,
    LISTENER_TYPE,
    ProxyNode,
    build_snapshot,
)
from istio_agent.metrics import Registry
from istio_agent.rpc.server import RpcServer
from tests.controlplane.test_ads import Client

WASM_HTTP = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
RBAC_HTTP = "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC"
WASM_NETWORK = "type.googleapis.com/envoy.extensions.filters.network.wasm.v3.Wasm"
RBAC_NETWORK = "type.googleapis.com/envoy.extensions.filters.network.rbac.v3.RBAC"
PREFIX = "extensions.istio.io/wasmplugin/"
DIGEST = "a" * 64
DOCKER_CONFIG = b'{"auths":{"registry.example:5000":{"auth":"dXNlcjpwYXNz"}}}'

SERVICES = """
services:
  - {name: b, port: 8000}
workloads:
  - name: b-1
    labels: {app: b}
    services: [b]
    inboundPort: 15106
    appPort: 18080
  - name: a-1
    outbound: [{service: b, port: 15201}]
"""


def load(text: str, directory: Path) -> MeshConfig:
    path = directory / "mesh.yaml"
    path.write_text(text)
    return parse_mesh(text, path)


def proxy(
    name: str, namespace: str = "default", *, verified: bool = False, version: str = "1.28.0"
) -> ProxyNode:
    return ProxyNode(
        id=f"sidecar~127.0.0.1~{name}.{namespace}~{namespace}.svc.cluster.local",
        name=name,
        namespace=namespace,
        metadata={"ISTIO_VERSION": version} if version else {},
        verified=verified,
    )


# -- parsing ------------------------------------------------------------------------------------------


def test_a_full_entry_is_read_with_the_api_names(tmp_path: Path) -> None:
    (tmp_path / "reg.json").write_bytes(DOCKER_CONFIG)
    mesh = load(
        f"""
pullSecrets:
  - {{name: reg, namespace: apps, dockerConfig: reg.json}}
wasmPlugins:
  - name: auth
    namespace: apps
    selector: {{matchLabels: {{app: b}}}}
    url: oci://registry.example:5000/filters/auth:v1
    sha256: {DIGEST}
    phase: AUTHN
    priority: 10
    failStrategy: FAIL_OPEN
    imagePullPolicy: Always
    imagePullSecret: reg
    pluginConfig: {{header: x-auth, limit: 3}}
    pluginName: auth_root
    type: HTTP
    vmConfig:
      env:
        - {{name: MODE, value: strict}}
        - {{name: HOSTNAME, valueFrom: HOST}}
    match:
      - mode: SERVER
        ports: [{{number: 8080}}]
""",
        tmp_path,
    )
    [plugin] = mesh.wasm_plugins
    assert (plugin.name, plugin.namespace, plugin.selector) == ("auth", "apps", {"app": "b"})
    assert (plugin.url, plugin.sha256, plugin.phase, plugin.priority) == (
        "oci://registry.example:5000/filters/auth:v1",
        DIGEST,
        "AUTHN",
        10,
    )
    assert (plugin.fail_strategy, plugin.image_pull_policy, plugin.image_pull_secret) == (
        "FAIL_OPEN",
        "Always",
        "kubernetes://apps/reg",
    )
    assert plugin.plugin_config == {"header": "x-auth", "limit": 3}
    assert (plugin.plugin_name, plugin.type) == ("auth_root", "HTTP")
    assert [(e.name, e.value, e.value_from) for e in plugin.vm_env] == [
        ("MODE", "strict", "INLINE"),
        ("HOSTNAME", "", "HOST"),
    ]
    assert [(m.mode, m.ports) for m in plugin.match] == [("SERVER", (8080,))]
    assert plugin.resource_name == "extensions.istio.io/wasmplugin/apps.auth"
    assert mesh.pull_secrets == {"kubernetes://apps/reg": DOCKER_CONFIG}


def test_defaults_are_the_apis(tmp_path: Path) -> None:
    [plugin] = load("wasmPlugins: [{name: p, url: 'file:///m.wasm'}]", tmp_path).wasm_plugins
    assert plugin == WasmPlugin(
        name="p", namespace="default", url="file:///m.wasm", resource_version=plugin.resource_version
    )
    assert (plugin.phase, plugin.fail_strategy, plugin.image_pull_policy, plugin.type) == (
        "UNSPECIFIED_PHASE",
        "FAIL_CLOSE",
        "UNSPECIFIED_POLICY",
        "UNSPECIFIED_PLUGIN_TYPE",
    )


def test_the_resource_version_follows_the_entry(tmp_path: Path) -> None:
    first = load("wasmPlugins: [{name: p, url: 'oci://r/x'}]", tmp_path).wasm_plugins[0]
    same = load("wasmPlugins: [{url: 'oci://r/x', name: p}]", tmp_path).wasm_plugins[0]
    changed = load("wasmPlugins: [{name: p, url: 'oci://r/x', priority: 1}]", tmp_path).wasm_plugins[0]
    assert first.resource_version == same.resource_version != changed.resource_version


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("{name: p}", r"wasmPlugins\[0\] \(default/p\)\.url: required"),
        ("{url: 'oci://r/x'}", r"wasmPlugins\[0\]\.name: required"),
        ("{name: P, url: 'oci://r/x'}", r"wasmPlugins\[0\]\.name: 'P' is not a valid name"),
        ("{name: p, url: 'ftp://r/x'}", r"url: url contains unsupported scheme: ftp"),
        ("{name: p, url: 'localhost:5000/x'}", r"url: url contains unsupported scheme: localhost"),
        ("{name: p, url: 'file://rel.wasm'}", r"url: a file:// URL needs an absolute path"),
        ("{name: p, url: 'oci://r/x', sha256: ABC}", r"sha256: must be 64 lower-case hex digits"),
        ("{name: p, url: 'oci://r/x', phase: authn}", r"phase: must be one of UNSPECIFIED_PHASE, AUTHN"),
        ("{name: p, url: 'oci://r/x', failStrategy: OPEN}", r"failStrategy: must be one of FAIL_CLOSE"),
        ("{name: p, url: 'oci://r/x', imagePullPolicy: always}", r"imagePullPolicy: must be one of"),
        ("{name: p, url: 'oci://r/x', type: TCP}", r"type: must be one of UNSPECIFIED_PLUGIN_TYPE, HTTP"),
        ("{name: p, url: 'oci://r/x', priority: high}", r"priority: expected an integer"),
        (
            "{name: p, url: 'oci://r/x', imagePullSecret: reg}",
            r"imagePullSecret: no pullSecrets entry default/reg",
        ),
        ("{name: p, url: 'oci://r/x', selector: {app: b}}", r"selector: unknown key \"app\""),
        (
            "{name: p, url: 'oci://r/x', selector: {matchLabels: {v: 1}}}",
            r"matchLabels\.v: expected a string",
        ),
        ("{name: p, url: 'oci://r/x', pluginConfig: [1]}", r"pluginConfig: expected a map"),
        ("{name: p, url: 'oci://r/x', pluginConfig: {n: .inf}}", r"pluginConfig\.n: must be a finite number"),
        (
            "{name: p, url: 'oci://r/x', vmConfig: {env: [{name: A, valueFrom: HOST, value: x}]}}",
            r"value: value may only be set when valueFrom is INLINE",
        ),
        (
            "{name: p, url: 'oci://r/x', vmConfig: {env: [{name: A}, {name: A}]}}",
            r"name: duplicate env 'A'",
        ),
        ("{name: p, url: 'oci://r/x', match: [{ports: [{number: 0}]}]}", r"number: .*1"),
        ("{name: p, url: 'oci://r/x', bogus: 1}", r"wasmPlugins\[0\]: unknown key \"bogus\""),
    ],
)
def test_bad_entries_are_refused_naming_the_entry(tmp_path: Path, entry: str, message: str) -> None:
    with pytest.raises(MeshError, match=message):
        load(f"wasmPlugins: [{entry}]", tmp_path)


def test_a_duplicate_plugin_is_refused(tmp_path: Path) -> None:
    with pytest.raises(
        MeshError, match=r"wasmPlugins\[1\] \(default/p\): duplicate WasmPlugin \(also wasmPlugins\[0\]\)"
    ):
        load("wasmPlugins: [{name: p, url: 'oci://r/x'}, {name: p, url: 'oci://r/y'}]", tmp_path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, r"pullSecrets\[0\] \(default/reg\)\.dockerConfig: cannot read .*reg\.json"),
        (b"not json", r"dockerConfig: .*reg\.json is not JSON"),
        (b"[1]", r"dockerConfig: .*reg\.json is not a docker config"),
    ],
)
def test_bad_pull_secrets_are_refused(tmp_path: Path, content: bytes | None, message: str) -> None:
    if content is not None:
        (tmp_path / "reg.json").write_bytes(content)
    with pytest.raises(MeshError, match=message):
        load("pullSecrets: [{name: reg, dockerConfig: reg.json}]", tmp_path)


def test_a_pull_secret_is_looked_up_in_the_plugins_namespace(tmp_path: Path) -> None:
    """istiod's toSecretResourceName: whatever namespace the name gives, the plugin's is used."""
    (tmp_path / "reg.json").write_bytes(DOCKER_CONFIG)
    mesh = load(
        "pullSecrets: [{name: reg, dockerConfig: reg.json}]\n"
        "wasmPlugins: [{name: p, url: 'oci://r/x', imagePullSecret: 'other/reg'}]",
        tmp_path,
    )
    assert mesh.wasm_plugins[0].image_pull_secret == "kubernetes://default/reg"


# -- listeners ----------------------------------------------------------------------------------------


def ads_config_source() -> config_source_pb2.ConfigSource:
    return config_source_pb2.ConfigSource(
        ads=config_source_pb2.AggregatedConfigSource(),
        initial_fetch_timeout=duration_pb2.Duration(seconds=0),
        resource_api_version=config_source_pb2.V3,
    )


def expected_http_filter(name: str) -> http_connection_manager_pb2.HttpFilter:
    """wasmplugin.go toEnvoyHTTPFilter."""
    return http_connection_manager_pb2.HttpFilter(
        name=name,
        config_discovery=config_source_pb2.ExtensionConfigSource(
            config_source=ads_config_source(), type_urls=[WASM_HTTP, RBAC_HTTP]
        ),
    )


def expected_network_filter(name: str) -> listener_components_pb2.Filter:
    """wasmplugin.go toEnvoyNetworkFilter."""
    return listener_components_pb2.Filter(
        name=name,
        config_discovery=config_source_pb2.ExtensionConfigSource(
            config_source=ads_config_source(), type_urls=[WASM_NETWORK, RBAC_NETWORK]
        ),
    )


def hcm_of(chain_filter: listener_components_pb2.Filter) -> http_connection_manager_pb2.HttpConnectionManager:
    hcm = http_connection_manager_pb2.HttpConnectionManager()
    assert chain_filter.typed_config.Unpack(hcm)
    return hcm


PLUGINS = """
wasmPlugins:
  - {name: stats, url: 'oci://r/stats', phase: STATS}
  - {name: authn-low, url: 'oci://r/low', phase: AUTHN, priority: 1}
  - {name: none, url: 'oci://r/none'}
  - {name: authn-high, url: 'oci://r/high', phase: AUTHN, priority: 10}
  - {name: authz, url: 'oci://r/authz', phase: AUTHZ, selector: {matchLabels: {app: b}}}
  - {name: mesh-wide, namespace: istio-system, url: 'oci://r/mesh', phase: AUTHN}
  - {name: elsewhere, namespace: other, url: 'oci://r/else'}
  - {name: not-b, url: 'oci://r/notb', selector: {matchLabels: {app: z}}}
  - {name: clients, url: 'oci://r/clients', match: [{mode: CLIENT}]}
  - {name: port-9, url: 'oci://r/p9', match: [{ports: [{number: 9}]}]}
  - {name: port-app, url: 'oci://r/papp', phase: STATS, match: [{mode: SERVER, ports: [{number: 18080}]}]}
  - {name: tcp-level, url: 'oci://r/tcp', type: NETWORK, phase: AUTHZ}
"""


def test_the_inbound_hcm_gets_the_selected_plugins_in_istiods_order(tmp_path: Path) -> None:
    mesh = load(SERVICES + PLUGINS, tmp_path)
    listener = build_snapshot(mesh, proxy("b-1"))[LISTENER_TYPE]["inbound_127.0.0.1_15106"]
    filters = listener.filter_chains[0].filters
    assert list(filters[:-1]) == [expected_network_filter(PREFIX + "default.tcp-level")]
    http_filters = list(hcm_of(filters[-1]).http_filters)
    names = [
        "default.authn-high",  # AUTHN by priority, highest first; none is lowest;
        "default.authn-low",  # the workload's namespace before the root namespace
        "istio-system.mesh-wide",
        "default.authz",
        "default.stats",  # STATS in file order
        "default.port-app",
        "default.none",  # UNSPECIFIED_PHASE last
    ]
    assert http_filters[:-1] == [expected_http_filter(PREFIX + name) for name in names]
    assert http_filters[-1].name == "envoy.filters.http.router"


def test_outbound_hcms_get_the_client_side_plugins(tmp_path: Path) -> None:
    mesh = load(SERVICES + PLUGINS, tmp_path)
    listener = build_snapshot(mesh, proxy("a-1"))[LISTENER_TYPE]["127.0.0.1_15201"]
    filters = listener.filter_chains[0].filters
    names = [f.name.removeprefix(PREFIX) for f in hcm_of(filters[-1]).http_filters]
    assert names == [
        "default.authn-high",
        "default.authn-low",
        "istio-system.mesh-wide",
        "default.stats",
        "default.none",  # UNSPECIFIED_PHASE in file order
        "default.clients",
        "envoy.filters.http.router",
    ]


def test_without_plugins_the_listeners_are_unchanged(tmp_path: Path) -> None:
    plain = build_snapshot(load(SERVICES, tmp_path), proxy("b-1"))
    other = build_snapshot(
        load(SERVICES + "wasmPlugins: [{name: x, namespace: other, url: 'oci://r/x'}]", tmp_path),
        proxy("b-1"),
    )
    assert plain[LISTENER_TYPE] == other[LISTENER_TYPE]
    assert EXTENSION_CONFIG_TYPE not in plain


# -- ECDS ---------------------------------------------------------------------------------------------


def wrapped(config: wasm_pb2.PluginConfig, *, network: bool = False) -> any_pb2.Any:
    typed = any_pb2.Any()
    typed.Pack(network_wasm_pb2.Wasm(config=config) if network else http_wasm_pb2.Wasm(config=config))
    return typed


def string_value(text: str) -> any_pb2.Any:
    typed = any_pb2.Any()
    typed.Pack(wrappers_pb2.StringValue(value=text))
    return typed


REMOTE = f"""
pullSecrets: [{{name: reg, namespace: apps, dockerConfig: reg.json}}]
wasmPlugins:
  - name: auth
    namespace: apps
    url: oci://registry.example:5000/filters/auth:v1
    sha256: {DIGEST}
    failStrategy: FAIL_OPEN
    imagePullPolicy: IfNotPresent
    imagePullSecret: reg
    pluginConfig: {{limit: 3, header: x-auth, nested: {{list: [1.5, "a<b"]}}}}
    pluginName: auth_root
    vmConfig:
      env:
        - {{name: MODE, value: strict}}
        - {{name: HOSTNAME, valueFrom: HOST}}
"""


def expected_remote(secret: str, resource_version: str, **failure: Any) -> extension_pb2.TypedExtensionConfig:
    """extensions.go buildPluginConfig / buildDataSource / buildVMConfig, and wasmplugin.go updatePluginConfig."""
    config = wasm_pb2.PluginConfig(
        name="apps.auth",
        root_id="auth_root",
        configuration=string_value('{"header":"x-auth","limit":3,"nested":{"list":[1.5,"a\\u003cb"]}}'),
        vm_config=wasm_pb2.VmConfig(
            runtime="envoy.wasm.runtime.v8",
            code=base_pb2.AsyncDataSource(
                remote=base_pb2.RemoteDataSource(
                    http_uri=http_uri_pb2.HttpUri(
                        uri="oci://registry.example:5000/filters/auth:v1",
                        cluster="_",
                        timeout=duration_pb2.Duration(seconds=30),
                    ),
                    sha256=DIGEST,
                )
            ),
            environment_variables=wasm_pb2.EnvironmentVariables(
                key_values={
                    "ISTIO_META_WASM_IMAGE_PULL_SECRET": secret,
                    "ISTIO_META_WASM_IMAGE_PULL_POLICY": "IfNotPresent",
                    "ISTIO_META_WASM_PLUGIN_RESOURCE_VERSION": resource_version,
                    "MODE": "strict",
                },
                host_env_keys=["HOSTNAME"],
            ),
        ),
        **failure,
    )
    return extension_pb2.TypedExtensionConfig(name=PREFIX + "apps.auth", typed_config=wrapped(config))


@pytest.fixture
def remote_mesh(tmp_path: Path) -> MeshConfig:
    (tmp_path / "reg.json").write_bytes(DOCKER_CONFIG)
    return load(REMOTE, tmp_path)


def test_a_remote_plugin_is_istiods_ecds_resource(remote_mesh: MeshConfig) -> None:
    version = remote_mesh.wasm_plugins[0].resource_version
    ecds = build_snapshot(remote_mesh, proxy("any", "apps", verified=True))[EXTENSION_CONFIG_TYPE]
    assert ecds == {
        PREFIX + "apps.auth": expected_remote(
            DOCKER_CONFIG.decode(), version, failure_policy=wasm_pb2.FAIL_OPEN
        )
    }


def test_an_unverified_proxy_gets_an_empty_pull_secret(remote_mesh: MeshConfig) -> None:
    """ecds.go GeneratePullSecrets: no verified identity, no secrets (the plaintext port)."""
    version = remote_mesh.wasm_plugins[0].resource_version
    ecds = build_snapshot(remote_mesh, proxy("any", "apps"))[EXTENSION_CONFIG_TYPE]
    assert ecds[PREFIX + "apps.auth"] == expected_remote("", version, failure_policy=wasm_pb2.FAIL_OPEN)


def test_a_proxy_older_than_1_25_gets_fail_open(remote_mesh: MeshConfig) -> None:
    version = remote_mesh.wasm_plugins[0].resource_version
    ecds = build_snapshot(remote_mesh, proxy("any", "apps", version="1.24.3"))[EXTENSION_CONFIG_TYPE]
    assert ecds[PREFIX + "apps.auth"] == expected_remote("", version, fail_open=True)


@pytest.mark.parametrize(
    ("strategy", "policy"),
    [
        ("FAIL_CLOSE", wasm_pb2.FAIL_CLOSED),
        ("FAIL_OPEN", wasm_pb2.FAIL_OPEN),
        ("FAIL_RELOAD", wasm_pb2.FAIL_RELOAD),
    ],
)
def test_fail_strategy_is_the_failure_policy(tmp_path: Path, strategy: str, policy: int) -> None:
    mesh = load(f"wasmPlugins: [{{name: p, url: 'oci://r/x', failStrategy: {strategy}}}]", tmp_path)
    [resource] = build_snapshot(mesh, proxy("any", version=""))[EXTENSION_CONFIG_TYPE].values()
    wasm = http_wasm_pb2.Wasm()
    assert resource.typed_config.Unpack(wasm)
    assert (wasm.config.failure_policy, wasm.config.fail_open) == (policy, False)


def test_a_local_plugin_and_one_without_scheme(tmp_path: Path) -> None:
    mesh = load(
        "wasmPlugins:\n"
        "  - {name: local, url: 'file:///opt/filters/f.wasm', type: NETWORK}\n"
        "  - {name: bare, url: 'registry.example/f:1'}\n",
        tmp_path,
    )
    ecds = build_snapshot(mesh, proxy("any"))[EXTENSION_CONFIG_TYPE]
    local, bare = (mesh.wasm_plugins[0], mesh.wasm_plugins[1])
    env = wasm_pb2.EnvironmentVariables(
        key_values={"ISTIO_META_WASM_PLUGIN_RESOURCE_VERSION": local.resource_version}
    )
    expected_local = wasm_pb2.PluginConfig(
        name="default.local",
        configuration=any_pb2.Any(),
        vm_config=wasm_pb2.VmConfig(
            runtime="envoy.wasm.runtime.v8",
            code=base_pb2.AsyncDataSource(local=base_pb2.DataSource(filename="/opt/filters/f.wasm")),
            environment_variables=env,
        ),
        failure_policy=wasm_pb2.FAIL_CLOSED,
    )
    assert ecds[PREFIX + "default.local"] == extension_pb2.TypedExtensionConfig(
        name=PREFIX + "default.local", typed_config=wrapped(expected_local, network=True)
    )
    wasm = http_wasm_pb2.Wasm()
    assert ecds[PREFIX + "default.bare"].typed_config.Unpack(wasm)
    assert wasm.config.vm_config.code.remote.http_uri.uri == "oci://registry.example/f:1"
    assert wasm.config.vm_config.environment_variables.key_values == {
        "ISTIO_META_WASM_PLUGIN_RESOURCE_VERSION": bare.resource_version
    }
    assert wasm.config.HasField("configuration") and wasm.config.configuration == any_pb2.Any()


def test_ecds_has_the_plugins_of_the_proxys_namespace_and_the_root(tmp_path: Path) -> None:
    """push_context.go WasmPluginsByName: by namespace and name, whatever the selector."""
    mesh = load(SERVICES + PLUGINS, tmp_path)
    names = sorted(build_snapshot(mesh, proxy("b-1"))[EXTENSION_CONFIG_TYPE])
    assert "extensions.istio.io/wasmplugin/default.not-b" in names
    assert "extensions.istio.io/wasmplugin/istio-system.mesh-wide" in names
    assert not [name for name in names if ".elsewhere" in name]
    assert sorted(build_snapshot(mesh, proxy("x", "other"))[EXTENSION_CONFIG_TYPE]) == [
        PREFIX + "istio-system.mesh-wide",
        PREFIX + "other.elsewhere",
    ]


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ({"b": 1, "a": True, "c": None}, '{"a":true,"b":1,"c":null}'),
        ({"n": 1e21, "m": 1e-7, "k": 1000000, "f": 0.5}, '{"f":0.5,"k":1000000,"m":1e-7,"n":1e+21}'),
        ({"s": "<&>é"}, '{"s":"\\u003c\\u0026\\u003eé"}'),
        ({"l": [], "o": {}}, '{"l":[],"o":{}}'),
    ],
)
def test_plugin_config_is_written_as_istiods_jsonpb(value: Any, text: str) -> None:
    assert struct_json(value) == text


# -- ADS ----------------------------------------------------------------------------------------------


@pytest.fixture
async def ads(tmp_path: Path) -> AsyncIterator[ads_pb2_grpc.AggregatedDiscoveryServiceStub]:
    (tmp_path / "reg.json").write_bytes(DOCKER_CONFIG)
    server = AdsServer(load(REMOTE, tmp_path), build_snapshot, registry=Registry())
    rpc = RpcServer()
    server.add_to(rpc, authorize=False)
    await rpc.start(host="127.0.0.1", port=0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{rpc.sockets()[0].getsockname()[1]}")
    try:
        yield ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
    finally:
        await channel.close()
        await server.close()
        await rpc.stop(0)


def apps_node() -> base_pb2.Node:
    node = base_pb2.Node(id="sidecar~10.0.0.1~web-1.apps~apps.svc.cluster.local")
    node.metadata["NAMESPACE"] = "apps"
    node.metadata["ISTIO_VERSION"] = "1.28.0"
    return node


def extension_names(resources: Any) -> list[str]:
    names = []
    for resource in resources:
        config = extension_pb2.TypedExtensionConfig()
        assert resource.Unpack(config)
        names.append(config.name)
    return names


async def test_ecds_over_sotw_serves_the_names_asked_for(
    ads: ads_pb2_grpc.AggregatedDiscoveryServiceStub,
) -> None:
    client = Client(ads.StreamAggregatedResources(), apps_node(), delta=False)
    try:
        await client.request(EXTENSION_CONFIG_TYPE, [PREFIX + "apps.auth", PREFIX + "apps.unknown"])
        response = await client.response(EXTENSION_CONFIG_TYPE)
        assert extension_names(response.resources) == [PREFIX + "apps.auth"]
        config = extension_pb2.TypedExtensionConfig()
        assert response.resources[0].Unpack(config)
        wasm = http_wasm_pb2.Wasm()
        assert config.typed_config.Unpack(wasm)
        # the plaintext port verifies no identity: no pull secret
        assert (
            wasm.config.vm_config.environment_variables.key_values["ISTIO_META_WASM_IMAGE_PULL_SECRET"] == ""
        )
    finally:
        await client.close()


async def test_ecds_over_delta(ads: ads_pb2_grpc.AggregatedDiscoveryServiceStub) -> None:
    client = Client(ads.DeltaAggregatedResources(), apps_node(), delta=True)
    try:
        await client.delta_request(EXTENSION_CONFIG_TYPE, [PREFIX + "apps.auth"])
        response = await client.response(EXTENSION_CONFIG_TYPE)
        assert [r.name for r in response.resources] == [PREFIX + "apps.auth"]
        assert extension_names(r.resource for r in response.resources) == [PREFIX + "apps.auth"]
    finally:
        await client.close()


async def test_an_authenticated_proxy_gets_the_pull_secret(tmp_path: Path) -> None:
    """ads.py marks a proxy whose identity the authorizer proved (istiod's VerifiedIdentity)."""
    (tmp_path / "reg.json").write_bytes(DOCKER_CONFIG)

    async def authorize(call: Any, node: ProxyNode) -> str:
        return "spiffe://cluster.local/ns/apps/sa/web"

    server = AdsServer(load(REMOTE, tmp_path), build_snapshot, registry=Registry(), authorize=authorize)
    rpc = RpcServer()
    server.add_to(rpc)
    await rpc.start(host="127.0.0.1", port=0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{rpc.sockets()[0].getsockname()[1]}")
    client = Client(
        ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources(),
        apps_node(),
        delta=False,
    )
    try:
        await client.request(EXTENSION_CONFIG_TYPE, [PREFIX + "apps.auth"])
        response = await asyncio.wait_for(client.response(EXTENSION_CONFIG_TYPE), 10)
        config = extension_pb2.TypedExtensionConfig()
        assert response.resources[0].Unpack(config)
        wasm = http_wasm_pb2.Wasm()
        assert config.typed_config.Unpack(wasm)
        secret = wasm.config.vm_config.environment_variables.key_values["ISTIO_META_WASM_IMAGE_PULL_SECRET"]
        assert secret == DOCKER_CONFIG.decode()
    finally:
        await client.close()
        await channel.close()
        await server.close()
        await rpc.stop(0)


async def test_delta_never_removes_an_extension_config(tmp_path: Path) -> None:
    """istiod's neverRemoveDelta (``pilot/pkg/xds/delta.go``, envoyproxy/envoy#32823): a plugin gone from
    the mesh is not removed over Delta; Envoy unsubscribes once no listener refers to it."""
    (tmp_path / "reg.json").write_bytes(DOCKER_CONFIG)
    server = AdsServer(
        load(REMOTE, tmp_path), build_snapshot, registry=Registry(), debug_access=DebugAccess(enabled=False)
    )
    rpc = RpcServer()
    server.add_to(rpc, authorize=False)
    await rpc.start(host="127.0.0.1", port=0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{rpc.sockets()[0].getsockname()[1]}")
    stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
    delta = Client(stub.DeltaAggregatedResources(), apps_node(), delta=True)
    sotw = Client(stub.StreamAggregatedResources(), apps_node(), delta=False)
    try:
        await delta.subscribe(EXTENSION_CONFIG_TYPE, [PREFIX + "apps.auth"])
        await sotw.subscribe(EXTENSION_CONFIG_TYPE, [PREFIX + "apps.auth"])
        await server.update_mesh(load("wasmPlugins: []", tmp_path))
        await delta.barrier()  # nothing was sent before the barrier's answer: no removal
        response = await sotw.response(EXTENSION_CONFIG_TYPE)  # SotW answers with what exists now
        assert list(response.resources) == []
    finally:
        await delta.close()
        await sotw.close()
        await channel.close()
        await server.close()
        await rpc.stop(0)
