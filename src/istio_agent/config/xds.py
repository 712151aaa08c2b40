"""Settings of the agent's xDS proxy (Envoy <-> agent <-> istiod), from Istio's env names.

Paths relative to the agent's working directory (``./etc/certs``, ``./var/run/secrets/...``) are made
absolute against ``SecuritySettings.workdir``, as everywhere else in the agent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from istio_agent.config.env import INT32_MAX, ConfigError, Env
from istio_agent.config.headers import headers_from_env
from istio_agent.config.proxy_config import ProxyConfig
from istio_agent.config.security import (
    CERT_CHAIN_FILE,
    ISTIO_CA_ROOT,
    KEY_FILE,
    LEGACY_CERTS_DIR,
    ROOT_CERT_FILE,
    SecuritySettings,
    is_plaintext_address,
)
from istio_agent.config.wasm import WasmSettings, wasm_settings

XDS_SOCKET_FILE = "XDS"
DEFAULT_MAX_STREAMS = 100000
DEFAULT_MAX_RECV_BYTES = 4 * 1024 * 1024
DEFAULT_KEEPALIVE_INTERVAL = timedelta(seconds=30)
DEFAULT_KEEPALIVE_TIMEOUT = timedelta(seconds=10)
DEFAULT_DEBUG_TAP_PORT = 15004
MAX_GRPC_MILLISECONDS = timedelta(milliseconds=INT32_MAX)
"""gRPC's channel arguments are C ints: a longer keepalive cannot be passed to it."""
ISTIOD_HOST = "istiod.istio-system.svc"
FILE_JWT_POLICIES = ("third-party-jwt", "first-party-jwt")
TLS_CLIENT_ROOT_CERT = "ISTIO_META_TLS_CLIENT_ROOT_CERT"
TLS_CLIENT_CERT_CHAIN = "ISTIO_META_TLS_CLIENT_CERT_CHAIN"
TLS_CLIENT_KEY = "ISTIO_META_TLS_CLIENT_KEY"


@dataclass(frozen=True)
class XdsSettings:
    socket_path: Path
    discovery_address: str
    plaintext: bool = False
    root_ca: Path | None = None
    """None: the OS trust store (or no TLS at all when ``plaintext``)."""
    server_name: str = ""
    client_cert: Path | None = None
    client_key: Path | None = None
    token_path: Path | None = None
    cluster_id: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    keepalive_interval: timedelta = DEFAULT_KEEPALIVE_INTERVAL
    keepalive_timeout: timedelta = DEFAULT_KEEPALIVE_TIMEOUT
    max_streams: int = DEFAULT_MAX_STREAMS
    max_recv_bytes: int = DEFAULT_MAX_RECV_BYTES
    nds_enabled: bool = False
    pcds_enabled: bool = False
    debug_tap_port: int | None = None
    """The debug tap's port on localhost (PROXY_XDS_DEBUG_VIA_AGENT[_PORT]); None: no tap."""
    wasm: WasmSettings | None = None
    """Remote Wasm modules in ECDS fetched by the agent; None: ECDS goes to Envoy unchanged
    (ISTIO_AGENT_ENABLE_WASM_REMOTE_LOAD_CONVERSION=false)."""

    @classmethod
    def from_env(
        cls,
        env: Env,
        security: SecuritySettings,
        proxy_config: ProxyConfig,
        proxy_type: str = "sidecar",
    ) -> XdsSettings:
        """Read the xDS proxy's env vars; raise ConfigError naming the variable on any invalid value."""
        workdir = security.workdir
        address = proxy_config.discovery_address
        plaintext = proxy_config.control_plane_auth_policy == "NONE" or is_plaintext_address(address)

        def resolve(path: str) -> Path:
            return Path(path) if Path(path).is_absolute() else workdir / path

        def metadata(name: str) -> str:
            # proxyMetadata values reach the agent as env vars in Istio; a real env var wins.
            return env.text(name) or proxy_config.proxy_metadata.get(name, "")

        def flag(name: str) -> bool:
            raw = metadata(name)
            return Env({name: raw}).flag(name) if raw else False

        client_cert = client_key = None
        if security.prov_cert is not None:
            client_cert, client_key = security.prov_cert / CERT_CHAIN_FILE, security.prov_cert / KEY_FILE
        elif security.file_mounted_certs:
            chain, key = metadata(TLS_CLIENT_CERT_CHAIN), metadata(TLS_CLIENT_KEY)
            client_cert = resolve(chain) if chain else None
            client_key = resolve(key) if key else None

        token_path = None
        if security.credential_fetcher_type in ("JWT", "") and security.jwt_policy in FILE_JWT_POLICIES:
            token_path = security.token_path

        wasm = wasm_settings(env, workdir)
        return cls(
            socket_path=resolve(proxy_config.config_path) / XDS_SOCKET_FILE,
            discovery_address=address,
            plaintext=plaintext,
            root_ca=None if plaintext else _find_root_ca(env, security, resolve, metadata),
            server_name=_server_name(address, security.istiod_san),
            client_cert=client_cert,
            client_key=client_key,
            token_path=token_path,
            cluster_id=security.cluster_id,  # checked as a header value by SecuritySettings.from_env
            headers=headers_from_env(env, "XDS_HEADER_"),
            keepalive_interval=_grpc_milliseconds(env, "GRPC_KEEPALIVE_INTERVAL", DEFAULT_KEEPALIVE_INTERVAL),
            keepalive_timeout=_grpc_milliseconds(env, "GRPC_KEEPALIVE_TIMEOUT", DEFAULT_KEEPALIVE_TIMEOUT),
            max_streams=env.integer(
                "ISTIO_GPRC_MAXSTREAMS", DEFAULT_MAX_STREAMS, minimum=1, maximum=INT32_MAX
            ),
            max_recv_bytes=env.integer(
                "ISTIO_GPRC_MAXRECVMSGSIZE", DEFAULT_MAX_RECV_BYTES, minimum=1, maximum=INT32_MAX
            ),
            nds_enabled=(proxy_type == "sidecar" and flag("ISTIO_META_DNS_CAPTURE"))
            or flag("ISTIO_META_ENABLE_DNS_SERVER"),
            pcds_enabled=env.flag("PROXY_CONFIG_XDS_AGENT"),
            debug_tap_port=(
                env.integer(
                    "PROXY_XDS_DEBUG_VIA_AGENT_PORT", DEFAULT_DEBUG_TAP_PORT, minimum=0, maximum=65535
                )
                if env.flag("PROXY_XDS_DEBUG_VIA_AGENT", True)
                else None
            ),
            wasm=wasm if wasm.conversion_enabled else None,
        )


def _find_root_ca(
    env: Env,
    security: SecuritySettings,
    resolve: Callable[[str], Path],
    metadata: Callable[[str], str],
) -> Path | None:
    """Istio's FindRootCAForXDS: which root verifies istiod; None is the OS trust store."""
    configured = env.text("XDS_ROOT_CA")
    if configured == "SYSTEM":
        return None
    if configured:
        path = resolve(configured)
        source = "XDS_ROOT_CA"
    elif (security.workdir / LEGACY_CERTS_DIR / ROOT_CERT_FILE).is_file():
        return security.workdir / LEGACY_CERTS_DIR / ROOT_CERT_FILE
    elif security.prov_cert is not None:
        return security.prov_cert / ROOT_CERT_FILE  # unchecked: the agent may provision it later
    elif security.file_mounted_certs:
        mounted = metadata(TLS_CLIENT_ROOT_CERT)
        if not mounted:
            raise ConfigError(
                f"invalid value for {TLS_CLIENT_ROOT_CERT}: FILE_MOUNTED_CERTS is set, "
                "so the root certificate for XDS must be configured"
            )
        path = resolve(mounted)
        source = TLS_CLIENT_ROOT_CERT
    elif security.pilot_cert_provider == "none":
        raise ConfigError(
            "root CA file for XDS required but configured provider as none (PILOT_CERT_PROVIDER)"
        )
    else:
        path = security.workdir / ISTIO_CA_ROOT
        source = "XDS_ROOT_CA (default)"
    if not path.exists():
        raise ConfigError(f"root CA file for XDS does not exist {path} (from {source})")
    return path


def _server_name(address: str, istiod_san: str) -> str:
    if istiod_san:
        return istiod_san
    host = address.rpartition(":")[0].strip("[]")
    return ISTIOD_HOST if "localhost" in host else host


def _grpc_milliseconds(env: Env, name: str, default: timedelta) -> timedelta:
    """A duration gRPC takes as a whole number of milliseconds in a C int: 1ms to about 24 days."""
    return env.duration(name, default, minimum=timedelta(milliseconds=1), maximum=MAX_GRPC_MILLISECONDS)
