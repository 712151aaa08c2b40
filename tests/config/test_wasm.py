"""WASM_* settings (istio_agent.config.wasm): Istio's names, defaults and zero values."""

from __future__ import annotations

import ipaddress
from datetime import timedelta
from pathlib import Path

import pytest

from istio_agent.config.env import ConfigError, Env
from istio_agent.config.wasm import WasmSettings, wasm_settings


def test_defaults_are_istios(tmp_path: Path) -> None:
    settings = wasm_settings(Env({}), tmp_path)
    assert settings == WasmSettings(cache_dir=tmp_path / "var/lib/istio/data")
    assert settings.conversion_enabled
    assert settings.module_expiry == timedelta(hours=24) and settings.purge_interval == timedelta(hours=1)
    assert settings.http_timeout == timedelta(seconds=15) and settings.http_max_retries == 5
    assert settings.max_binary_bytes == 256 * 1024 * 1024
    assert settings.blocked_networks == ()


def test_every_variable_is_read(tmp_path: Path) -> None:
    env = Env(
        {
            "ISTIO_AGENT_ENABLE_WASM_REMOTE_LOAD_CONVERSION": "false",
            "WASM_INSECURE_REGISTRIES": "registry.local:5000, 10.0.0.5",
            "WASM_MODULE_EXPIRY": "2h",
            "WASM_PURGE_INTERVAL": "10m",
            "WASM_HTTP_REQUEST_TIMEOUT": "3s",
            "WASM_HTTP_REQUEST_MAX_RETRIES": "2",
            "ISTIO_WASM_MAX_BINARY_SIZE_BYTES": "1048576",
            "BLOCKED_CIDRS_IN_WASM_FETCH": "10.0.0.0/8, fd00::/8",
        }
    )
    settings = wasm_settings(env, tmp_path)
    assert not settings.conversion_enabled
    assert settings.insecure_registries == {"registry.local:5000", "10.0.0.5"}
    assert settings.module_expiry == timedelta(hours=2) and settings.purge_interval == timedelta(minutes=10)
    assert settings.http_timeout == timedelta(seconds=3) and settings.http_max_retries == 2
    assert settings.max_binary_bytes == 1048576
    assert settings.blocked_networks == (ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("fd00::/8"))


def test_zero_durations_are_istios_defaults(tmp_path: Path) -> None:
    env = Env({"WASM_MODULE_EXPIRY": "0s", "WASM_PURGE_INTERVAL": "0", "WASM_HTTP_REQUEST_TIMEOUT": "0s"})
    settings = wasm_settings(env, tmp_path)
    assert settings.module_expiry == timedelta(hours=24) and settings.purge_interval == timedelta(hours=1)
    assert settings.http_timeout == timedelta(seconds=5)  # NewHTTPFetcher's zero


def test_insecure_hosts_match_as_written_or_star() -> None:
    listed = WasmSettings(insecure_registries=frozenset({"registry.local:5000", "plain.local"}))
    assert listed.insecure("registry.local:5000") and listed.insecure("plain.local")
    assert not listed.insecure("registry.local") and not listed.insecure("plain.local:443")
    assert WasmSettings(insecure_registries=frozenset({"*"})).insecure("anything:1")


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("BLOCKED_CIDRS_IN_WASM_FETCH", "10.0.0.0/8,not-a-cidr"),
        ("WASM_HTTP_REQUEST_MAX_RETRIES", "-1"),
        ("ISTIO_WASM_MAX_BINARY_SIZE_BYTES", "4"),
        ("WASM_MODULE_EXPIRY", "soon"),
        ("ISTIO_AGENT_ENABLE_WASM_REMOTE_LOAD_CONVERSION", "maybe"),
    ],
)
def test_bad_values_name_the_variable(tmp_path: Path, name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name):
        wasm_settings(Env({name: value}), tmp_path)
