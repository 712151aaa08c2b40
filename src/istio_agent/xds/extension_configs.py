"""ECDS responses on their way to Envoy: remote Wasm modules fetched and made local first.

Istio's agent converts every ECDS response (``pkg/istio-agent/xds_proxy.go``, ``pkg/wasm``); see
:mod:`istio_agent.wasm.convert`. The module cache and the conversion are built at the first ECDS
response, not at start: most sidecars never get one, and an idle agent should not carry them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

from google.protobuf import any_pb2

from istio_agent.config.wasm import WasmSettings
from istio_agent.log import scope
from istio_agent.metrics import Registry

if TYPE_CHECKING:
    from istio_agent.wasm.cache import ModuleCache
    from istio_agent.wasm.convert import EcdsConverter

log = scope("wasm")


class ConversionRefused(ValueError):
    """The response cannot be converted: the text of the NACK sent upstream."""


class ExtensionConfigs:
    """One per proxy: the Wasm module cache every stream converts through, and its purge task."""

    def __init__(self, settings: WasmSettings, registry: Registry) -> None:
        self._settings = settings
        self._registry = registry
        self._cache: ModuleCache | None = None
        self._converter: EcdsConverter | None = None
        self._building = asyncio.Lock()
        """Two streams' first ECDS responses at once build one cache."""

    async def convert(self, resources: Sequence[any_pb2.Any]) -> list[any_pb2.Any]:
        """The resources as Envoy gets them; ConversionRefused when the response must be NACKed."""
        from istio_agent.wasm.convert import ConversionError

        converter = await self._ready()
        try:
            return await converter.convert(resources)
        except ConversionError as err:
            raise ConversionRefused(str(err)) from None

    async def _ready(self) -> EcdsConverter:
        async with self._building:
            return self._converter or await self._build()

    async def _build(self) -> EcdsConverter:
        from istio_agent.wasm.cache import ModuleCache
        from istio_agent.wasm.convert import EcdsConverter
        from istio_agent.wasm.metrics import WasmMetrics

        metrics = WasmMetrics(self._registry)
        cache = ModuleCache(self._settings, metrics)
        await cache.start()
        self._cache = cache
        self._converter = EcdsConverter(cache, metrics)
        log.info("Wasm module cache in %s", self._settings.cache_dir)
        return self._converter

    async def stop(self) -> None:
        """Stop the cache's purge task (the modules stay on disk for the next start)."""
        cache, self._cache, self._converter = self._cache, None, None
        if cache is not None:
            await cache.stop()
