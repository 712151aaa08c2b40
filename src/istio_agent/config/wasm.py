"""Settings of the agent's Wasm module fetching (ECDS remote-load conversion), from Istio's env names.

Istio reads them in ``pilot/cmd/pilot-agent/options`` and ``pilot/pkg/features``; defaults as
``pkg/wasm/options.go``.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from istio_agent.config.env import ConfigError, Env

DEFAULT_PURGE_INTERVAL = timedelta(hours=1)
DEFAULT_MODULE_EXPIRY = timedelta(hours=24)
DEFAULT_HTTP_TIMEOUT = timedelta(seconds=15)
DEFAULT_HTTP_MAX_RETRIES = 5
ZERO_HTTP_TIMEOUT = timedelta(seconds=5)
DEFAULT_MAX_BINARY_BYTES = 256 * 1024 * 1024
DATA_DIR = "./var/lib/istio/data"
"""The ``istio-data`` volume: the cache lives there so a container restart does not refetch."""

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class WasmSettings:
    conversion_enabled: bool = True
    """``ISTIO_AGENT_ENABLE_WASM_REMOTE_LOAD_CONVERSION``: off, ECDS goes to Envoy unchanged."""
    cache_dir: Path = Path(DATA_DIR)
    insecure_registries: frozenset[str] = frozenset()
    """Hosts fetched without TLS verification, or over plain HTTP for OCI, as written in the URL
    (``host:port`` when it has a port); ``*`` is every host."""
    module_expiry: timedelta = DEFAULT_MODULE_EXPIRY
    purge_interval: timedelta = DEFAULT_PURGE_INTERVAL
    http_timeout: timedelta = DEFAULT_HTTP_TIMEOUT
    http_max_retries: int = DEFAULT_HTTP_MAX_RETRIES
    max_binary_bytes: int = DEFAULT_MAX_BINARY_BYTES
    blocked_networks: tuple[IPNetwork, ...] = field(default_factory=tuple)
    """``BLOCKED_CIDRS_IN_WASM_FETCH``: refused in addition to the link-local ranges, always refused."""

    def insecure(self, host: str) -> bool:
        """Whether ``host`` (as written in the URL, with its port when it has one) may skip TLS
        checks: listed exactly, as Istio's cache options compare it, or ``*``."""
        return "*" in self.insecure_registries or host in self.insecure_registries


def wasm_settings(env: Env, workdir: Path) -> WasmSettings:
    """The settings from the environment; paths relative to the agent's working directory."""
    insecure = frozenset(h.strip() for h in env.text("WASM_INSECURE_REGISTRIES").split(",") if h.strip())
    return WasmSettings(
        conversion_enabled=env.flag("ISTIO_AGENT_ENABLE_WASM_REMOTE_LOAD_CONVERSION", True),
        cache_dir=workdir / DATA_DIR,
        insecure_registries=insecure,
        # Zero is the default, as Istio's cache options take it (pkg/wasm/cache.go).
        module_expiry=env.duration("WASM_MODULE_EXPIRY", DEFAULT_MODULE_EXPIRY, minimum=timedelta(0))
        or DEFAULT_MODULE_EXPIRY,
        purge_interval=env.duration("WASM_PURGE_INTERVAL", DEFAULT_PURGE_INTERVAL, minimum=timedelta(0))
        or DEFAULT_PURGE_INTERVAL,
        # Zero is 5s, as Istio's NewHTTPFetcher takes it.
        http_timeout=env.duration("WASM_HTTP_REQUEST_TIMEOUT", DEFAULT_HTTP_TIMEOUT, minimum=timedelta(0))
        or ZERO_HTTP_TIMEOUT,
        http_max_retries=env.integer("WASM_HTTP_REQUEST_MAX_RETRIES", DEFAULT_HTTP_MAX_RETRIES, minimum=0),
        max_binary_bytes=env.integer("ISTIO_WASM_MAX_BINARY_SIZE_BYTES", DEFAULT_MAX_BINARY_BYTES, minimum=8),
        blocked_networks=_networks("BLOCKED_CIDRS_IN_WASM_FETCH", env.text("BLOCKED_CIDRS_IN_WASM_FETCH")),
    )


def _networks(name: str, text: str) -> tuple[IPNetwork, ...]:
    networks = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError as err:
            raise ConfigError(f"invalid value for {name}={text!r}: {err}") from None
    return tuple(networks)
