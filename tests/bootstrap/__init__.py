"""Tests of the Envoy bootstrap; ``make_settings`` is shared with the Envoy process tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from istio_agent.config import Env, ProxyConfig, SecuritySettings
from istio_agent.config.bootstrap import BootstrapSettings


def make_settings(
    workdir: Path,
    env: dict[str, str] | None = None,
    proxy_config: dict[str, Any] | None = None,
    **options: Any,
) -> BootstrapSettings:
    """BootstrapSettings from an explicit environment (nothing inherited) and ProxyConfig overlay."""
    environ = {"POD_NAME": "v0", "POD_NAMESPACE": "default", "INSTANCE_IP": "10.1.1.0", **(env or {})}
    config = ProxyConfig().overlay(proxy_config or {}, "test")
    security = SecuritySettings.from_env(Env(environ), workdir, config)
    return BootstrapSettings.from_env(
        Env(environ), workdir=workdir, proxy_config=config, security=security, **options
    )
