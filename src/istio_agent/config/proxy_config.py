"""ProxyConfig: the subset of Istio's ``meshconfig.ProxyConfig`` the agent uses so far.

Sources, in increasing precedence (as Istio): defaults, the mesh config file's ``defaultConfig``,
``PROXY_CONFIG`` (YAML or JSON). Overlays replace fields, except ``proxyMetadata``, whose maps merge.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import yaml

from istio_agent.config.env import ConfigError, Env, parse_go_duration

DEFAULT_DISCOVERY_ADDRESS = "istiod.istio-system.svc:15012"


@dataclass(frozen=True)
class ProxyConfig:
    discovery_address: str = DEFAULT_DISCOVERY_ADDRESS
    config_path: str = "./etc/istio/proxy"
    binary_path: str = "/usr/local/bin/envoy"
    custom_config_file: str = ""
    service_cluster: str = "istio-proxy"
    proxy_admin_port: int = 15000
    status_port: int = 15020
    control_plane_auth_policy: str = "MUTUAL_TLS"
    proxy_metadata: dict[str, str] = field(default_factory=dict)
    drain_duration: timedelta = timedelta(seconds=45)
    termination_drain_duration: timedelta = timedelta(seconds=5)

    _FIELDS = {
        "discoveryAddress": "discovery_address",
        "configPath": "config_path",
        "binaryPath": "binary_path",
        "customConfigFile": "custom_config_file",
        "serviceCluster": "service_cluster",
        "proxyAdminPort": "proxy_admin_port",
        "statusPort": "status_port",
        "controlPlaneAuthPolicy": "control_plane_auth_policy",
        "proxyMetadata": "proxy_metadata",
        "drainDuration": "drain_duration",
        "terminationDrainDuration": "termination_drain_duration",
    }

    def overlay(self, doc: dict[str, Any], source: str) -> ProxyConfig:
        """Apply a ProxyConfig document (camelCase keys); unknown keys are ignored as in Istio's lenient parse."""
        changes: dict[str, Any] = {}
        for key, value in doc.items():
            name = self._FIELDS.get(key)
            if name is None:
                continue
            current = getattr(self, name)
            if name == "proxy_metadata":
                if not isinstance(value, dict):
                    raise ConfigError(f"{source}: proxyMetadata must be a map of strings")
                changes[name] = {**current, **{str(k): str(v) for k, v in value.items()}}
            elif isinstance(current, timedelta):
                changes[name] = _duration(value, key, source)
            elif isinstance(current, int):
                if isinstance(value, bool) or not isinstance(value, int | str) or not str(value).isdigit():
                    raise ConfigError(f"{source}: {key} must be an integer, got {value!r}")
                changes[name] = int(value)
            else:
                if not isinstance(value, str):
                    raise ConfigError(f"{source}: {key} must be a string, got {value!r}")
                changes[name] = value
        updated = dataclasses.replace(self, **changes)
        updated.validate(source)
        return updated

    def validate(self, source: str = "ProxyConfig") -> None:
        host, sep, port = self.discovery_address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"{source}: discoveryAddress {self.discovery_address!r} must be host:port")
        for name in ("proxy_admin_port", "status_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ConfigError(f"{source}: {name} out of range")
        if self.drain_duration.total_seconds() < 1 or self.drain_duration.total_seconds() % 1:
            raise ConfigError(f"{source}: drainDuration must be whole seconds, at least 1s")
        if self.termination_drain_duration < timedelta(0):
            raise ConfigError(f"{source}: terminationDrainDuration must not be negative")
        if self.control_plane_auth_policy not in ("NONE", "MUTUAL_TLS"):
            raise ConfigError(f"{source}: controlPlaneAuthPolicy must be NONE or MUTUAL_TLS")

    @classmethod
    def load(cls, env: Env, mesh_config_file: Path | None = None) -> ProxyConfig:
        config = cls()
        if mesh_config_file is not None and mesh_config_file.exists():
            mesh = _parse_document(mesh_config_file.read_text(), str(mesh_config_file))
            default_config = mesh.get("defaultConfig") or {}
            if not isinstance(default_config, dict):
                raise ConfigError(f"{mesh_config_file}: defaultConfig must be a map")
            config = config.overlay(default_config, str(mesh_config_file))
        raw = env.text("PROXY_CONFIG")
        if raw.strip():
            config = config.overlay(_parse_document(raw, "PROXY_CONFIG"), "PROXY_CONFIG")
        return config


def _duration(value: Any, key: str, source: str) -> timedelta:
    """A ProxyConfig duration: Go syntax (``5s``) as in YAML/JSON protobuf form; bare numbers are seconds."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"{source}: {key} must be a duration such as 5s, got {value!r}")
    try:
        return timedelta(seconds=value) if isinstance(value, int | float) else parse_go_duration(value)
    except ValueError as err:
        raise ConfigError(f"{source}: {key}: {err}") from None


def _parse_document(text: str, source: str) -> dict[str, Any]:
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: not valid YAML/JSON: {err}") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: expected a map, got {type(doc).__name__}")
    return doc
