"""ECDS remote-load conversion (istio_agent.wasm.convert), the cases of Istio's pkg/wasm/convert_test.go."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from envoy.config.core.v3 import extension_pb2
from envoy.extensions.filters.http.rbac.v3 import rbac_pb2 as http_rbac_pb2
from envoy.extensions.filters.http.wasm.v3 import wasm_pb2 as http_wasm_pb2
from envoy.extensions.filters.network.rbac.v3 import rbac_pb2 as network_rbac_pb2
from envoy.extensions.filters.network.wasm.v3 import wasm_pb2 as network_wasm_pb2
from envoy.extensions.wasm.v3 import wasm_pb2
from google.protobuf import any_pb2, empty_pb2, json_format, struct_pb2
from udpa.type.v1 import typed_struct_pb2

from istio_agent.metrics import Registry
from istio_agent.wasm.convert import (
    HTTP_WASM_TYPE,
    NETWORK_WASM_TYPE,
    ConversionError,
    EcdsConverter,
)
from istio_agent.wasm.errors import FetchError
from istio_agent.wasm.metrics import WasmMetrics
from istio_agent.wasm.options import GetOptions, PullPolicy

URL = "http://registry.test/filter.wasm"
LOCAL = Path("/var/lib/istio/data/abc/def.wasm")


class FakeModules:
    """A stand-in for the module cache: records what was asked; fails for URLs in ``failing``."""

    def __init__(self, failing: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.asked: list[tuple[str, GetOptions]] = []
        self.failing = failing

    async def get(self, url: str, options: GetOptions) -> Path:
        self.asked.append((url, options))
        if url in self.failing:
            raise FetchError("registry said 404")
        return LOCAL


def packed(message: object) -> any_pb2.Any:
    result = any_pb2.Any()
    result.Pack(message)
    return result


def http_wasm(
    *,
    url: str | None = URL,
    sha256: str = "abc",
    env: dict[str, str] | None = None,
    host_env: tuple[str, ...] = (),
    fail_open: bool = False,
    failure_policy: int = wasm_pb2.UNSPECIFIED,
    local: str | None = None,
    network: bool = False,
) -> http_wasm_pb2.Wasm | network_wasm_pb2.Wasm:
    config = wasm_pb2.PluginConfig(name="plugin", fail_open=fail_open, failure_policy=failure_policy)
    vm = config.vm_config
    vm.runtime = "envoy.wasm.runtime.v8"
    if local is not None:
        vm.code.local.filename = local
    elif url is not None:
        vm.code.remote.http_uri.uri = url
        vm.code.remote.http_uri.timeout.FromSeconds(30)
        vm.code.remote.sha256 = sha256
    else:
        vm.code.remote.sha256 = sha256
    if env is not None or host_env:
        vm.environment_variables.key_values.update(env or {})
        vm.environment_variables.host_env_keys.extend(host_env)
    wasm = network_wasm_pb2.Wasm(config=config) if network else http_wasm_pb2.Wasm(config=config)
    return wasm


def extension(typed: object, name: str = "default.plugin") -> any_pb2.Any:
    config = extension_pb2.TypedExtensionConfig(name=name)
    if typed is not None:
        config.typed_config.CopyFrom(typed if isinstance(typed, any_pb2.Any) else packed(typed))
    return packed(config)


def typed_struct(wasm: object, type_url: str = HTTP_WASM_TYPE) -> any_pb2.Any:
    struct = struct_pb2.Struct()
    struct.update(json_format.MessageToDict(wasm))
    return packed(typed_struct_pb2.TypedStruct(type_url=type_url, value=struct))


def unpack(resource: any_pb2.Any) -> extension_pb2.TypedExtensionConfig:
    config = extension_pb2.TypedExtensionConfig()
    assert resource.Unpack(config)
    return config


def convert(resources: list[any_pb2.Any], modules: FakeModules | None = None) -> list[any_pb2.Any]:
    converter = EcdsConverter(modules or FakeModules(), WasmMetrics(Registry()))
    return asyncio.run(converter.convert(resources))


def local_http_wasm(resource: any_pb2.Any) -> http_wasm_pb2.Wasm:
    config = unpack(resource)
    assert config.typed_config.type_url == HTTP_WASM_TYPE  # direct, not a TypedStruct
    wasm = http_wasm_pb2.Wasm()
    assert config.typed_config.Unpack(wasm)
    return wasm


def rbac(resource: any_pb2.Any, http: bool = True) -> http_rbac_pb2.RBAC | network_rbac_pb2.RBAC:
    config = unpack(resource)
    message = http_rbac_pb2.RBAC() if http else network_rbac_pb2.RBAC()
    assert config.typed_config.Unpack(message), config.typed_config.type_url
    return message


# -- remote code becomes a local file ------------------------------------------------------------------


@pytest.mark.parametrize("wrap", [lambda w: w, typed_struct], ids=["direct", "typed-struct"])
def test_remote_code_becomes_the_cached_local_file(wrap) -> None:
    modules = FakeModules()
    [out] = convert([extension(wrap(http_wasm()))], modules)
    wasm = local_http_wasm(out)
    assert unpack(out).name == "default.plugin"
    assert wasm.config.vm_config.code.local.filename == str(LOCAL)
    assert not wasm.config.vm_config.code.HasField("remote")
    assert wasm.config.vm_config.runtime == "envoy.wasm.runtime.v8"
    [(url, options)] = modules.asked
    assert url == URL
    assert options.checksum == "abc" and options.resource_name == "default.plugin"
    assert options.timeout == 30.0


def test_the_agents_environment_is_taken_out_and_read() -> None:
    modules = FakeModules()
    env = {
        "ISTIO_META_WASM_IMAGE_PULL_SECRET": '{"auths":{}}',
        "ISTIO_META_WASM_IMAGE_PULL_POLICY": "Always",
        "ISTIO_META_WASM_PLUGIN_RESOURCE_VERSION": "7",
        "KEEP": "me",
    }
    [out] = convert([extension(http_wasm(env=env))], modules)
    variables = local_http_wasm(out).config.vm_config.environment_variables
    assert dict(variables.key_values) == {"KEEP": "me"}
    [(_, options)] = modules.asked
    assert options.pull_secret == b'{"auths":{}}'
    assert options.pull_policy is PullPolicy.ALWAYS
    assert options.resource_version == "7"
    assert "auths" not in repr(options)


def test_an_environment_of_only_agent_keys_is_dropped_unless_host_keys_remain() -> None:
    only_agent = {"ISTIO_META_WASM_IMAGE_PULL_POLICY": "IfNotPresent"}
    [out] = convert([extension(http_wasm(env=only_agent))])
    assert not local_http_wasm(out).config.vm_config.HasField("environment_variables")
    [out] = convert([extension(http_wasm(env=only_agent, host_env=("HOME",)))])
    variables = local_http_wasm(out).config.vm_config.environment_variables
    assert list(variables.host_env_keys) == ["HOME"] and not variables.key_values


def test_nil_checksum_is_no_checksum_and_an_unset_timeout_is_five_seconds() -> None:
    modules = FakeModules()
    wasm = http_wasm(sha256="nil")
    wasm.config.vm_config.code.remote.http_uri.ClearField("timeout")
    convert([extension(wasm)], modules)
    [(_, options)] = modules.asked
    assert options.checksum == "" and options.timeout == 5.0


def test_network_filters_are_converted_as_well() -> None:
    [out] = convert([extension(http_wasm(network=True))])
    config = unpack(out)
    assert config.typed_config.type_url == NETWORK_WASM_TYPE
    wasm = network_wasm_pb2.Wasm()
    config.typed_config.Unpack(wasm)
    assert wasm.config.vm_config.code.local.filename == str(LOCAL)


# -- a module that cannot be had: Istio's RBAC stand-in, not a NACK ----------------------------------


def test_a_failed_fetch_fails_closed_by_default() -> None:
    modules = FakeModules(failing={URL})
    [out] = convert([extension(http_wasm())], modules)
    denied = rbac(out)
    assert unpack(out).name == "default.plugin"
    assert denied.rules_stat_prefix == "wasm-default-deny"
    assert denied.HasField("rules") and not denied.rules.policies  # empty rules: deny all


@pytest.mark.parametrize(
    ("fail_open", "policy", "opens"),
    [
        (True, wasm_pb2.UNSPECIFIED, True),
        (False, wasm_pb2.FAIL_OPEN, True),
        (True, wasm_pb2.FAIL_CLOSED, False),
        (True, wasm_pb2.FAIL_RELOAD, False),
    ],
)
def test_fail_open_follows_the_failure_policy_then_the_old_flag(
    fail_open: bool, policy: int, opens: bool
) -> None:
    [out] = convert([extension(http_wasm(fail_open=fail_open, failure_policy=policy))], FakeModules({URL}))
    filter_ = rbac(out)
    assert filter_.HasField("rules") is not opens
    assert filter_.rules_stat_prefix == ("wasm-default-allow" if opens else "wasm-default-deny")


def test_network_stand_in_is_the_network_rbac_filter() -> None:
    [out] = convert([extension(http_wasm(network=True, fail_open=True))], FakeModules({URL}))
    allowed = rbac(out, http=False)
    assert allowed.stat_prefix == "wasm-default-allow" and not allowed.HasField("rules")


def test_missing_http_uri_and_empty_pull_secret_fall_back_without_fetching() -> None:
    modules = FakeModules()
    no_uri = http_wasm(url=None)
    empty_secret = http_wasm(env={"ISTIO_META_WASM_IMAGE_PULL_SECRET": ""})
    out = convert([extension(no_uri, "a"), extension(empty_secret, "b")], modules)
    assert [rbac(resource).rules_stat_prefix for resource in out] == ["wasm-default-deny"] * 2
    assert modules.asked == []


def test_mixed_response_keeps_order_and_converts_each() -> None:
    modules = FakeModules(failing={"http://down.test/x.wasm"})
    out = convert(
        [extension(http_wasm(url="http://down.test/x.wasm"), "a"), extension(typed_struct(http_wasm()), "b")],
        modules,
    )
    assert [unpack(resource).name for resource in out] == ["a", "b"]
    assert rbac(out[0]).rules_stat_prefix == "wasm-default-deny"
    assert local_http_wasm(out[1]).config.vm_config.code.local.filename == str(LOCAL)


# -- passed through unchanged ------------------------------------------------------------------------


def test_other_filters_local_code_and_other_typed_structs_pass_unchanged() -> None:
    router = packed(empty_pb2.Empty())
    other_struct = packed(typed_struct_pb2.TypedStruct(type_url="type.googleapis.com/some.Other"))
    local = extension(http_wasm(local="/etc/filter.wasm"))
    resources = [
        extension(router, "a"),
        extension(other_struct, "b"),
        local,
        extension(typed_struct(http_wasm(local="/x.wasm"))),
    ]
    modules = FakeModules()
    assert convert(resources, modules) == resources
    assert modules.asked == []


# -- NACKed ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "resource",
    [
        packed(empty_pb2.Empty()),  # not a TypedExtensionConfig
        extension(None),  # no typed config
        any_pb2.Any(
            type_url="type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig", value=b"\x0a\xff"
        ),
        extension(any_pb2.Any(type_url=HTTP_WASM_TYPE, value=b"\x0a\x05\x0a")),  # broken Wasm message
    ],
    ids=["not-extension-config", "no-typed-config", "broken-config", "broken-wasm"],
)
def test_unreadable_resources_are_a_conversion_error(resource: any_pb2.Any) -> None:
    with pytest.raises(ConversionError):
        convert([resource])


def test_no_code_at_all_is_an_error_naming_the_filter() -> None:
    wasm = http_wasm(url=None)
    wasm.config.vm_config.ClearField("code")
    with pytest.raises(
        ConversionError, match=r"no remote and local load found in Wasm HTTP filter 'default\.plugin'"
    ):
        convert([extension(wasm)])


def test_a_typed_struct_that_is_not_a_wasm_filter_is_an_error() -> None:
    struct = struct_pb2.Struct()
    struct.update({"config": {"no_such_field": 1}})
    broken = packed(typed_struct_pb2.TypedStruct(type_url=HTTP_WASM_TYPE, value=struct))
    with pytest.raises(ConversionError, match="as a Wasm filter"):
        convert([extension(broken)])


# -- metrics -------------------------------------------------------------------------------------------


def test_each_outcome_is_counted_by_result() -> None:
    registry = Registry()
    converter = EcdsConverter(FakeModules(failing={"http://down.test/x.wasm"}), WasmMetrics(registry))
    resources = [
        extension(http_wasm()),
        extension(http_wasm(url="http://down.test/x.wasm")),
        extension(http_wasm(url=None)),
        extension(packed(empty_pb2.Empty())),
    ]
    asyncio.run(converter.convert(resources))
    text = registry.expose().decode()
    metrics = WasmMetrics(registry)  # the same series, looked up again
    counts = {
        result: metrics.conversions.labels(result=result).value
        for result in ("success", "fetch_failure", "miss_remote_fetch_hint", "no_remote_load")
    }
    assert counts == {"success": 1, "fetch_failure": 1, "miss_remote_fetch_hint": 1, "no_remote_load": 1}, (
        text
    )
    assert "istio_agent_wasm_config_conversion_duration_bucket" in text
