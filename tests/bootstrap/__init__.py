"""Tests of the Envoy bootstrap; ``make_settings`` is shared with the Envoy process tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from istio_agent.config import Env, ProxyConfig, SecuritySettings
from istio_agent.config.bootstrap import BootstrapSettings, HostFacts
from istio_agent.host import LocalHost


class FakeHost:
    """A machine with the given interface addresses; names resolve to themselves (as IP literals do)."""

    def __init__(self, interfaces: list[tuple[str, str]]) -> None:
        self._interfaces = interfaces

    def interface_addresses(self) -> list[tuple[str, str]]:
        return list(self._interfaces)

    def resolve(self, host: str, port: int) -> str:
        return LocalHost().resolve(host, port)


def make_settings(
    workdir: Path,
    env: dict[str, str] | None = None,
    proxy_config: dict[str, Any] | None = None,
    host: HostFacts | None = None,
    **options: Any,
) -> BootstrapSettings:
    """BootstrapSettings from an explicit environment (nothing inherited) and ProxyConfig overlay."""
    environ = {"POD_NAME": "v0", "POD_NAMESPACE": "default", "INSTANCE_IP": "10.1.1.0", **(env or {})}
    config = ProxyConfig().overlay(proxy_config or {}, "test")
    security = SecuritySettings.from_env(Env(environ), workdir, config)
    return BootstrapSettings.from_env(
        Env(environ),
        workdir=workdir,
        proxy_config=config,
        security=security,
        host=host or LocalHost(),
        **options,
    )
