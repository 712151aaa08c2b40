"""ECDS through the xDS proxy: remote Wasm fetched and made local before Envoy sees it (Istio's
xds_proxy_test.go ECDS cases), between a real gRPC client (Envoy), a fake istiod and a real HTTP
server holding the module."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from envoy.config.core.v3 import extension_pb2
from envoy.extensions.filters.http.rbac.v3 import rbac_pb2
from envoy.extensions.filters.http.wasm.v3 import wasm_pb2 as http_wasm_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import any_pb2

from istio_agent.config.wasm import WasmSettings
from istio_agent.xds.proxy import XdsProxy
from istio_agent.xds.types import EXTENSION_CONFIG
from tests.xds import CDS, EnvoyStream, FakeIstiod, FakeUpstreamStream, running
from tests.xds.test_proxy import FLAVOURS, istiod, packed, sample, settings_for

__all__ = ["istiod"]  # the fixture, imported for this module's tests

MODULE = b"\0asm\x01\x00\x00\x00"  # the smallest valid Wasm module: magic and version
MODULE_SHA = hashlib.sha256(MODULE).hexdigest()


class ModuleServer:
    """A plain HTTP/1.1 server on loopback: ``/filter.wasm`` is the module, ``/slow.wasm`` the module
    after ``release`` is set, anything else 404."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.requests: list[str] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> ModuleServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    def url(self, path: str) -> str:
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}{path}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        path = head.split(b" ")[1].decode()
        self.requests.append(path)
        if path == "/slow.wasm":
            await self.release.wait()
        if path in ("/filter.wasm", "/slow.wasm"):
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(MODULE) + MODULE
            )
        else:
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


@pytest.fixture
async def modules() -> AsyncIterator[ModuleServer]:
    server = await ModuleServer().start()
    yield server
    await server.stop()


def cache(workdir: Path) -> WasmSettings:
    return WasmSettings(cache_dir=workdir / "var" / "lib" / "istio" / "data", http_max_retries=1)


def remote_filter(url: str, name: str = "default.plugin", sha256: str = MODULE_SHA) -> any_pb2.Any:
    wasm = http_wasm_pb2.Wasm()
    vm = wasm.config.vm_config
    vm.runtime = "envoy.wasm.runtime.v8"
    vm.code.remote.http_uri.uri = url
    vm.code.remote.http_uri.timeout.FromSeconds(5)
    vm.code.remote.sha256 = sha256
    vm.environment_variables.key_values["ISTIO_META_WASM_PLUGIN_RESOURCE_VERSION"] = "1"
    return packed(extension_pb2.TypedExtensionConfig(name=name, typed_config=packed(wasm)))


def ecds(resources: list[any_pb2.Any], *, delta: bool, nonce: str, version: str = "v1") -> Any:
    if delta:
        return discovery_pb2.DeltaDiscoveryResponse(
            type_url=EXTENSION_CONFIG,
            nonce=nonce,
            system_version_info=version,
            resources=[
                discovery_pb2.Resource(name=f"default.p{i}", version=f"rv{i}", resource=r)
                for i, r in enumerate(resources)
            ],
            removed_resources=["default.gone"],
        )
    return discovery_pb2.DiscoveryResponse(
        type_url=EXTENSION_CONFIG, nonce=nonce, version_info=version, resources=resources
    )


def configs(response: Any, delta: bool) -> list[extension_pb2.TypedExtensionConfig]:
    found = []
    for entry in response.resources:
        config = extension_pb2.TypedExtensionConfig()
        assert (entry.resource if delta else entry).Unpack(config)
        found.append(config)
    return found


@contextlib.asynccontextmanager
async def ecds_stream(
    short_tmp: Path, istiod: FakeIstiod, delta: bool, *, wasm: WasmSettings | None, **request: Any
) -> AsyncIterator[tuple[XdsProxy, EnvoyStream, FakeUpstreamStream]]:
    """A proxy (``wasm``: its conversion settings), Envoy's stream subscribed to ECDS (``request``: more
    fields of that request), and istiod's side of it with the subscription read."""
    async with running(settings_for(short_tmp, istiod.address, wasm=wasm)) as (proxy, channel):
        envoy = EnvoyStream(channel, delta=delta)
        await envoy.send(EXTENSION_CONFIG, **request)
        upstream = await istiod.next_stream()
        await upstream.recv()
        yield proxy, envoy, upstream
        await envoy.close()


@FLAVOURS
async def test_remote_wasm_reaches_envoy_as_the_cached_local_file(
    short_tmp: Path, istiod: FakeIstiod, modules: ModuleServer, delta: bool
) -> None:
    async with ecds_stream(short_tmp, istiod, delta, wasm=cache(short_tmp)) as (proxy, envoy, upstream):
        await upstream.send(ecds([remote_filter(modules.url("/filter.wasm"))], delta=delta, nonce="e1"))
        got = await envoy.recv()
        assert got.nonce == "e1" and got.type_url == EXTENSION_CONFIG
        [config] = configs(got, delta)
        assert config.name == "default.plugin"
        wasm = http_wasm_pb2.Wasm()
        assert config.typed_config.Unpack(wasm)
        local = Path(wasm.config.vm_config.code.local.filename)
        assert local.read_bytes() == MODULE
        assert local.is_relative_to(short_tmp / "var" / "lib" / "istio" / "data")
        assert not wasm.config.vm_config.HasField("environment_variables")  # ISTIO_META_* taken out
        if delta:
            assert [(r.name, r.version) for r in got.resources] == [("default.p0", "rv0")]
            assert list(got.removed_resources) == ["default.gone"]
            assert got.system_version_info == "v1"
        else:
            assert got.version_info == "v1"
    assert sample(proxy, "wasm_config_conversion_count", result="success") == 1
    assert sample(proxy, "xds_proxy_pushes", type_url=EXTENSION_CONFIG) == 1


@FLAVOURS
async def test_a_module_that_cannot_be_fetched_becomes_deny_all_not_a_nack(
    short_tmp: Path, istiod: FakeIstiod, modules: ModuleServer, delta: bool
) -> None:
    async with ecds_stream(short_tmp, istiod, delta, wasm=cache(short_tmp)) as (proxy, envoy, upstream):
        await upstream.send(ecds([remote_filter(modules.url("/missing.wasm"))], delta=delta, nonce="e1"))
        [config] = configs(await envoy.recv(), delta)
        deny = rbac_pb2.RBAC()
        assert config.name == "default.plugin" and config.typed_config.Unpack(deny)
        assert deny.rules_stat_prefix == "wasm-default-deny" and deny.HasField("rules")
        await upstream.expect_silence()  # no NACK: Envoy's own ACK is what istiod gets
    assert sample(proxy, "wasm_config_conversion_count", result="fetch_failure") == 1


@FLAVOURS
async def test_an_unreadable_ecds_response_is_nacked_upstream_with_the_last_accepted_version(
    short_tmp: Path, istiod: FakeIstiod, delta: bool
) -> None:
    broken = packed(extension_pb2.TypedExtensionConfig(name="default.broken"))  # no typed config
    accepted = {} if delta else {"version_info": "accepted-3"}  # Delta requests carry no version
    async with ecds_stream(short_tmp, istiod, delta, wasm=cache(short_tmp), **accepted) as (
        _,
        envoy,
        upstream,
    ):
        await upstream.send(ecds([broken], delta=delta, nonce="bad-1", version="v4"))
        nack = await upstream.recv()
        assert nack.type_url == EXTENSION_CONFIG and nack.response_nonce == "bad-1"
        assert nack.error_detail.code == 13 and "default.broken" in nack.error_detail.message
        if not delta:
            assert nack.version_info == "accepted-3"
        # Not forwarded, and the stream carries on.
        await upstream.send(_cds(delta, "cds-1"))
        assert (await envoy.recv()).nonce == "cds-1"


def _cds(delta: bool, nonce: str) -> Any:
    if delta:
        return discovery_pb2.DeltaDiscoveryResponse(type_url=CDS, nonce=nonce)
    return discovery_pb2.DiscoveryResponse(type_url=CDS, nonce=nonce, version_info="c1")


@FLAVOURS
async def test_a_slow_module_holds_back_later_ecds_but_no_other_type(
    short_tmp: Path, istiod: FakeIstiod, modules: ModuleServer, delta: bool
) -> None:
    async with ecds_stream(short_tmp, istiod, delta, wasm=cache(short_tmp)) as (_, envoy, upstream):
        await upstream.send(ecds([remote_filter(modules.url("/slow.wasm"))], delta=delta, nonce="e1"))
        await upstream.send(ecds([remote_filter(modules.url("/filter.wasm"))], delta=delta, nonce="e2"))
        await upstream.send(_cds(delta, "cds-1"))
        assert (await envoy.recv()).nonce == "cds-1"  # CDS went past the fetching ECDS
        modules.release.set()
        assert [(await envoy.recv()).nonce for _ in range(2)] == ["e1", "e2"]  # ECDS kept its order


@FLAVOURS
async def test_without_conversion_ecds_is_relayed_byte_for_byte(
    short_tmp: Path, istiod: FakeIstiod, modules: ModuleServer, delta: bool
) -> None:
    async with ecds_stream(short_tmp, istiod, delta, wasm=None) as (_, envoy, upstream):
        sent = ecds([remote_filter(modules.url("/filter.wasm"))], delta=delta, nonce="e1")
        await upstream.send(sent)
        assert await envoy.recv() == sent
    assert modules.requests == []


async def test_conversion_is_on_by_default_from_the_environment(short_tmp: Path) -> None:
    """ISTIO_AGENT_ENABLE_WASM_REMOTE_LOAD_CONVERSION defaults to true; false turns it off."""
    from istio_agent.config.env import Env
    from istio_agent.config.wasm import wasm_settings as from_env

    assert from_env(Env({}), short_tmp).conversion_enabled
    assert from_env(Env({}), short_tmp).cache_dir == short_tmp / "var/lib/istio/data"
    assert not from_env(
        Env({"ISTIO_AGENT_ENABLE_WASM_REMOTE_LOAD_CONVERSION": "false"}), short_tmp
    ).conversion_enabled
