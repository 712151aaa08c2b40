"""The Wasm metrics, with Istio's names and labels (``pkg/wasm/monitoring.go``)."""

from __future__ import annotations

from istio_agent.metrics import Registry

# wasm_remote_fetch_count results
FETCH_SUCCESS = "success"
DOWNLOAD_FAILURE = "download_failure"
MANIFEST_FAILURE = "manifest_failure"
CHECKSUM_MISMATCH = "checksum_mismatched"

# wasm_config_conversion_count results
CONVERSION_SUCCESS = "success"
NO_REMOTE_LOAD = "no_remote_load"
MARSHAL_FAILURE = "marshal_failure"
UNMARSHAL_FAILURE = "unmarshal_failure"
FETCH_FAILURE = "fetch_failure"
MISS_REMOTE_FETCH_HINT = "miss_remote_fetch_hint"

CONVERSION_BUCKETS_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class WasmMetrics:
    """One set per agent: the cache and the conversion count into it."""

    def __init__(self, registry: Registry) -> None:
        self.cache_entries = registry.gauge(
            "wasm_cache_entries", "number of Wasm remote fetch cache entries."
        )
        self.cache_lookups = registry.counter(
            "wasm_cache_lookup_count", "number of Wasm remote fetch cache lookups.", ["hit"]
        )
        self.remote_fetches = registry.counter(
            "wasm_remote_fetch_count",
            "number of Wasm remote fetches and results, including success, download failure, and checksum mismatch.",
            ["result"],
        )
        self.conversions = registry.counter(
            "wasm_config_conversion_count",
            "number of Wasm config conversions and results, including success, no remote load, marshal "
            "failure, remote fetch failure, miss remote fetch hint.",
            ["result"],
        )
        self.conversion_duration = registry.histogram(
            "wasm_config_conversion_duration",
            "Total time in milliseconds istio-agent spends on converting remote load in Wasm config.",
            buckets=CONVERSION_BUCKETS_MS,
        )
