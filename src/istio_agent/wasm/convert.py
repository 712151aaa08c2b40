"""ECDS remote-load conversion: a Wasm filter's remote code becomes a local file before Envoy sees it.

Istio's agent does this for every ECDS response (``pkg/wasm/convert.go``): Envoy cannot pull ``oci://``
modules at all, and the agent caches what it fetched on the ``istio-data`` volume. Per resource:

* a Wasm HTTP or network filter, direct or in a ``udpa.type.v1.TypedStruct``, with remote code: the
  module is fetched through the cache and the filter re-packed, direct, with ``local.filename``;
  the VM's ``ISTIO_META_*`` environment (pull secret, pull policy, resource version: meant for the
  agent) is taken out so it never reaches Envoy or the module;
* a module that cannot be had: the filter is replaced by Istio's RBAC stand-in, allow-all when the
  plugin fails open and deny-all otherwise (stat prefixes ``wasm-default-allow`` / ``-deny``), not a NACK;
* anything else passes unchanged; a resource that cannot be read at all, or a Wasm filter with no
  code, is a :class:`ConversionError`: the response is NACKed upstream and not forwarded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any, Protocol, TypeAlias

from envoy.config.core.v3 import extension_pb2
from envoy.extensions.filters.http.rbac.v3 import rbac_pb2 as http_rbac_pb2
from envoy.extensions.filters.http.wasm.v3 import wasm_pb2 as http_wasm_pb2
from envoy.extensions.filters.network.rbac.v3 import rbac_pb2 as network_rbac_pb2
from envoy.extensions.filters.network.wasm.v3 import wasm_pb2 as network_wasm_pb2
from envoy.extensions.wasm.v3 import wasm_pb2
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError, Message

from istio_agent.log import scope
from istio_agent.wasm import metrics
from istio_agent.wasm.errors import FetchError
from istio_agent.wasm.options import GetOptions, PullPolicy

log = scope("wasm")

TYPE_PREFIX = "type.googleapis.com/"
HTTP_WASM_TYPE = TYPE_PREFIX + http_wasm_pb2.Wasm.DESCRIPTOR.full_name
NETWORK_WASM_TYPE = TYPE_PREFIX + network_wasm_pb2.Wasm.DESCRIPTOR.full_name
TYPED_STRUCT_TYPE = TYPE_PREFIX + "udpa.type.v1.TypedStruct"
EXTENSION_CONFIG_TYPE = TYPE_PREFIX + extension_pb2.TypedExtensionConfig.DESCRIPTOR.full_name

ALLOW_STAT_PREFIX = "wasm-default-allow"
DENY_STAT_PREFIX = "wasm-default-deny"
PULL_SECRET_ENV = "ISTIO_META_WASM_IMAGE_PULL_SECRET"
PULL_POLICY_ENV = "ISTIO_META_WASM_IMAGE_PULL_POLICY"
RESOURCE_VERSION_ENV = "ISTIO_META_WASM_PLUGIN_RESOURCE_VERSION"
AGENT_ENV_PREFIX = "ISTIO_META_"
DEFAULT_FETCH_TIMEOUT = 5.0
"""Seconds, when the filter's ``http_uri`` has no timeout (istiod always sets 30s)."""

WasmFilter: TypeAlias = Any
"""``envoy.extensions.filters.{http,network}.wasm.v3.Wasm`` (the generated classes are untyped)."""


class ModuleSource(Protocol):
    """Where modules come from: :class:`istio_agent.wasm.cache.ModuleCache`."""

    async def get(self, url: str, options: GetOptions) -> object:
        """The local path of the module at ``url``; FetchError when it cannot be had."""


class ConversionError(ValueError):
    """The response cannot be converted: NACK it with this text."""


class _Failed(Exception):
    """Fetching this filter's module failed: the RBAC stand-in goes in its place."""

    def __init__(self, message: str, result: str) -> None:
        super().__init__(message)
        self.result = result


class EcdsConverter:
    """Converts the resources of one ECDS response at a time (all of them concurrently)."""

    def __init__(self, modules: ModuleSource, wasm_metrics: metrics.WasmMetrics) -> None:
        self._modules = modules
        self._metrics = wasm_metrics

    async def convert(self, resources: Sequence[any_pb2.Any]) -> list[any_pb2.Any]:
        """The resources as Envoy should get them, in order; ConversionError (all failures, one text)
        when any cannot be converted."""
        started = time.perf_counter()
        try:
            outcomes = await asyncio.gather(
                *(self._convert(resource) for resource in resources), return_exceptions=True
            )
        finally:
            self._metrics.conversion_duration.observe(int((time.perf_counter() - started) * 1000))
        converted: list[any_pb2.Any] = []
        errors: list[str] = []
        for outcome in outcomes:
            if isinstance(outcome, ConversionError):
                errors.append(str(outcome))
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                converted.append(outcome)
        if errors:
            raise ConversionError("; ".join(errors))
        return converted

    async def _convert(self, resource: any_pb2.Any) -> any_pb2.Any:
        try:
            found = _remote_wasm(resource)
        except ConversionError:
            self._metrics.conversions.labels(result=metrics.UNMARSHAL_FAILURE).inc()
            raise
        if found is None:
            self._metrics.conversions.labels(result=metrics.NO_REMOTE_LOAD).inc()
            return resource
        config, wasm = found
        try:
            await self._localise(config.name, wasm)
        except _Failed as failure:
            self._metrics.conversions.labels(result=failure.result).inc()
            fail_open = _fails_open(wasm.config)
            log.error(
                "cannot use Wasm module of %s: %s; applying the %s RBAC filter",
                config.name,
                failure,
                "allow" if fail_open else "deny",
            )
            return _packed(_stand_in(config.name, isinstance(wasm, http_wasm_pb2.Wasm), fail_open))
        self._metrics.conversions.labels(result=metrics.CONVERSION_SUCCESS).inc()
        config.typed_config.CopyFrom(_packed(wasm))
        return _packed(config)

    async def _localise(self, resource_name: str, wasm: WasmFilter) -> None:
        """Fetch the module and point the VM at the local file (Istio's rewriteVMConfig)."""
        vm = wasm.config.vm_config
        plugin = wasm.config.name
        pull_secret: bytes | None = None
        pull_policy = PullPolicy.UNSPECIFIED
        resource_version = ""
        if vm.HasField("environment_variables"):
            env = vm.environment_variables
            if PULL_SECRET_ENV in env.key_values:
                if not env.key_values[PULL_SECRET_ENV]:
                    raise _Failed(
                        f"cannot fetch Wasm module {plugin}: missing image pulling secret",
                        metrics.FETCH_FAILURE,
                    )
                pull_secret = env.key_values[PULL_SECRET_ENV].encode()
            pull_policy = PullPolicy.from_env_value(env.key_values.get(PULL_POLICY_ENV, ""))
            resource_version = env.key_values.get(RESOURCE_VERSION_ENV, "")
            for key in [key for key in env.key_values if key.startswith(AGENT_ENV_PREFIX)]:
                del env.key_values[key]
            if not env.key_values and not env.host_env_keys:
                vm.ClearField("environment_variables")
        remote = vm.code.remote
        if not remote.HasField("http_uri"):
            raise _Failed(
                f"Wasm remote fetch of {plugin} does not have an http_uri", metrics.MISS_REMOTE_FETCH_HINT
            )
        uri = remote.http_uri
        checksum = "" if remote.sha256 == "nil" else remote.sha256  # istiod's "not set"
        timeout = (
            uri.timeout.ToTimedelta().total_seconds() if uri.HasField("timeout") else DEFAULT_FETCH_TIMEOUT
        )
        options = GetOptions(
            checksum=checksum,
            resource_name=resource_name,
            resource_version=resource_version,
            timeout=timeout,
            pull_secret=pull_secret,
            pull_policy=pull_policy,
        )
        try:
            path = await self._modules.get(uri.uri, options)
        except FetchError as err:
            raise _Failed(f"cannot fetch Wasm module {uri.uri}: {err}", metrics.FETCH_FAILURE) from None
        vm.code.Clear()
        vm.code.local.filename = str(path)


def _remote_wasm(resource: any_pb2.Any) -> tuple[extension_pb2.TypedExtensionConfig, WasmFilter] | None:
    """The extension config and its Wasm filter when the filter loads remote code; None to pass the
    resource on unchanged; ConversionError when it cannot be read (Istio's tryUnmarshal)."""
    config = extension_pb2.TypedExtensionConfig()
    if resource.type_url != EXTENSION_CONFIG_TYPE:
        raise ConversionError(f"resource of type {resource.type_url!r} is not a TypedExtensionConfig")
    try:
        config.ParseFromString(resource.value)
    except DecodeError as err:
        raise ConversionError(f"cannot decode extension config resource: {err}") from None
    if not config.HasField("typed_config"):
        raise ConversionError(f"typed extension config {config.name!r} does not contain any typed config")
    typed = config.typed_config
    wasm: WasmFilter
    if typed.type_url == HTTP_WASM_TYPE:
        wasm = _decode(typed.value, http_wasm_pb2.Wasm(), config.name)
    elif typed.type_url == NETWORK_WASM_TYPE:
        wasm = _decode(typed.value, network_wasm_pb2.Wasm(), config.name)
    elif typed.type_url == TYPED_STRUCT_TYPE:
        struct_wasm = _from_typed_struct(typed.value, config.name)
        if struct_wasm is None:
            return None
        wasm = struct_wasm
    else:
        return None
    code = wasm.config.vm_config.code
    if code.HasField("remote"):
        return config, wasm
    if code.HasField("local"):
        return None
    kind = "HTTP" if isinstance(wasm, http_wasm_pb2.Wasm) else "Network"
    raise ConversionError(f"no remote and local load found in Wasm {kind} filter {config.name!r}")


def _decode(value: bytes, message: Message, name: str) -> WasmFilter:
    try:
        message.ParseFromString(value)
    except DecodeError as err:
        raise ConversionError(f"cannot decode Wasm filter of {name!r}: {err}") from None
    return message


def _from_typed_struct(value: bytes, name: str) -> WasmFilter | None:
    """The Wasm filter a TypedStruct holds (its struct read as the filter's JSON), None for another type."""
    from google.protobuf import json_format  # only TypedStruct configs need the JSON mapping
    from udpa.type.v1 import typed_struct_pb2

    typed_struct = typed_struct_pb2.TypedStruct()
    try:
        typed_struct.ParseFromString(value)
    except DecodeError as err:
        raise ConversionError(f"cannot decode typed struct of {name!r}: {err}") from None
    wasm: WasmFilter
    if typed_struct.type_url == HTTP_WASM_TYPE:
        wasm = http_wasm_pb2.Wasm()
    elif typed_struct.type_url == NETWORK_WASM_TYPE:
        wasm = network_wasm_pb2.Wasm()
    else:
        return None
    try:
        json_format.ParseDict(json_format.MessageToDict(typed_struct.value), wasm)
    except json_format.ParseError as err:
        raise ConversionError(f"cannot read the typed struct of {name!r} as a Wasm filter: {err}") from None
    return wasm


def _fails_open(plugin: wasm_pb2.PluginConfig) -> bool:
    """The failure policy when set, else the deprecated ``fail_open``."""
    if plugin.failure_policy != wasm_pb2.UNSPECIFIED:
        return plugin.failure_policy == wasm_pb2.FAIL_OPEN
    return plugin.fail_open


def _stand_in(name: str, http: bool, fail_open: bool) -> extension_pb2.TypedExtensionConfig:
    """Istio's RBAC filter in place of a module it could not have: no rules allow all, empty rules deny all."""
    rbac: Message
    if http:
        rbac = http_rbac_pb2.RBAC(rules_stat_prefix=ALLOW_STAT_PREFIX if fail_open else DENY_STAT_PREFIX)
    else:
        rbac = network_rbac_pb2.RBAC(stat_prefix=ALLOW_STAT_PREFIX if fail_open else DENY_STAT_PREFIX)
    if not fail_open:
        rbac.rules.SetInParent()
    config = extension_pb2.TypedExtensionConfig(name=name)
    config.typed_config.CopyFrom(_packed(rbac))
    return config


def _packed(message: Message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed
