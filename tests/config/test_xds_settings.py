from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest

from istio_agent.config import ConfigError, Env, ProxyConfig, SecuritySettings, XdsSettings

DEFAULT_ROOT = "var/run/secrets/istio/root-cert.pem"


def xds(
    tmp_path: Path,
    proxy_config: ProxyConfig | None = None,
    proxy_type: str = "sidecar",
    *,
    with_default_root: bool = True,
    **env: str,
) -> XdsSettings:
    if with_default_root:
        (tmp_path / DEFAULT_ROOT).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / DEFAULT_ROOT).write_text("root")
    proxy_config = proxy_config or ProxyConfig()
    security = SecuritySettings.from_env(Env(env), tmp_path, proxy_config)
    return XdsSettings.from_env(Env(env), security, proxy_config, proxy_type)


def test_defaults_follow_istio(tmp_path: Path) -> None:
    s = xds(tmp_path)
    assert s.socket_path == tmp_path / "etc/istio/proxy/XDS"
    assert s.discovery_address == "istiod.istio-system.svc:15012"
    assert not s.plaintext
    assert s.root_ca == tmp_path / DEFAULT_ROOT
    assert s.server_name == "istiod.istio-system.svc"
    assert (s.client_cert, s.client_key) == (None, None)
    assert s.token_path == tmp_path / "var/run/secrets/tokens/istio-token"
    assert s.cluster_id == "" and s.headers == {}
    assert s.keepalive_interval == timedelta(seconds=30)
    assert s.keepalive_timeout == timedelta(seconds=10)
    assert s.max_streams == 100000
    assert s.max_recv_bytes == 4194304
    assert not s.nds_enabled and not s.pcds_enabled


def test_socket_follows_config_path(tmp_path: Path) -> None:
    relative = xds(tmp_path, ProxyConfig(config_path="./run/proxy"))
    assert relative.socket_path == tmp_path / "run/proxy/XDS"
    absolute = xds(tmp_path, ProxyConfig(config_path="/etc/envoy"))
    assert absolute.socket_path == Path("/etc/envoy/XDS")


def test_plaintext_when_auth_policy_none_or_port_15010(tmp_path: Path) -> None:
    none = xds(tmp_path, ProxyConfig(control_plane_auth_policy="NONE"), with_default_root=False)
    assert none.plaintext and none.root_ca is None
    port = xds(
        tmp_path, ProxyConfig(discovery_address="istiod.istio-system.svc:15010"), with_default_root=False
    )
    assert port.plaintext and port.root_ca is None


def test_server_name(tmp_path: Path) -> None:
    assert xds(tmp_path, ProxyConfig(discovery_address="10.1.2.3:15012")).server_name == "10.1.2.3"
    assert (
        xds(tmp_path, ProxyConfig(discovery_address="localhost:15012")).server_name
        == "istiod.istio-system.svc"
    )
    assert xds(tmp_path, ProxyConfig(discovery_address="[::1]:15012")).server_name == "::1"
    san = xds(tmp_path, ProxyConfig(discovery_address="10.1.2.3:15012"), ISTIOD_SAN="istiod.custom.svc")
    assert san.server_name == "istiod.custom.svc"


def test_cluster_id_and_headers(tmp_path: Path) -> None:
    s = xds(tmp_path, ISTIO_META_CLUSTER_ID="Kubernetes", XDS_HEADER_X_Team="blue", XDS_HEADER_TRACE="1")
    assert s.cluster_id == "Kubernetes"
    assert s.headers == {"x_team": "blue", "trace": "1"}


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("XDS_HEADER_BAD NAME", "v"),
        ("XDS_HEADER_GRPC-TIMEOUT", "1"),
        ("XDS_HEADER_X-BIN", "v"),
        ("XDS_HEADER_OK", "\n"),
    ],
)
def test_bad_headers_are_refused(tmp_path: Path, name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name.replace(" ", ".")):
        xds(tmp_path, **{name: value})


def test_grpc_tuning(tmp_path: Path) -> None:
    s = xds(
        tmp_path,
        GRPC_KEEPALIVE_INTERVAL="1m",
        GRPC_KEEPALIVE_TIMEOUT="2s",
        ISTIO_GPRC_MAXSTREAMS="10",
        ISTIO_GPRC_MAXRECVMSGSIZE="1024",
    )
    assert s.keepalive_interval == timedelta(minutes=1)
    assert s.keepalive_timeout == timedelta(seconds=2)
    assert (s.max_streams, s.max_recv_bytes) == (10, 1024)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("GRPC_KEEPALIVE_INTERVAL", "soon"),
        ("GRPC_KEEPALIVE_INTERVAL", "0s"),
        ("GRPC_KEEPALIVE_TIMEOUT", "-1s"),
        ("ISTIO_GPRC_MAXSTREAMS", "many"),
        ("ISTIO_GPRC_MAXSTREAMS", "0"),
        ("ISTIO_GPRC_MAXRECVMSGSIZE", "-5"),
        ("PROXY_CONFIG_XDS_AGENT", "maybe"),
        ("ISTIO_META_DNS_CAPTURE", "yes please"),
    ],
)
def test_bad_values_name_the_variable(tmp_path: Path, name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name):
        xds(tmp_path, **{name: value})


# -- agent-handled types --------------------------------------------------------------------------
def test_nds_from_dns_capture_for_sidecars_only(tmp_path: Path) -> None:
    assert xds(tmp_path, ISTIO_META_DNS_CAPTURE="true").nds_enabled
    assert not xds(tmp_path, proxy_type="router", ISTIO_META_DNS_CAPTURE="true").nds_enabled
    assert xds(tmp_path, proxy_type="router", ISTIO_META_ENABLE_DNS_SERVER="true").nds_enabled


def test_nds_from_proxy_metadata_and_env_wins(tmp_path: Path) -> None:
    metadata = ProxyConfig(proxy_metadata={"ISTIO_META_DNS_CAPTURE": "true"})
    assert xds(tmp_path, metadata).nds_enabled
    assert not xds(tmp_path, metadata, ISTIO_META_DNS_CAPTURE="false").nds_enabled
    server = ProxyConfig(proxy_metadata={"ISTIO_META_ENABLE_DNS_SERVER": "1"})
    assert xds(tmp_path, server, proxy_type="router").nds_enabled


def test_pcds(tmp_path: Path) -> None:
    assert xds(tmp_path, PROXY_CONFIG_XDS_AGENT="true").pcds_enabled


# -- token and client certificate -----------------------------------------------------------------
def test_token_path_follows_jwt_policy(tmp_path: Path) -> None:
    token = tmp_path / "var/run/secrets/tokens/istio-token"
    assert xds(tmp_path, JWT_POLICY="first-party-jwt").token_path == token
    assert xds(tmp_path, JWT_POLICY="none").token_path is None
    assert xds(tmp_path, CREDENTIAL_FETCHER_TYPE="Mock").token_path is None


def test_client_cert_from_prov_cert(tmp_path: Path) -> None:
    s = xds(tmp_path, PROV_CERT="etc/prov")
    assert s.client_cert == tmp_path / "etc/prov/cert-chain.pem"
    assert s.client_key == tmp_path / "etc/prov/key.pem"


def test_client_cert_from_file_mounted_metadata(tmp_path: Path) -> None:
    root = tmp_path / "mounted/root.pem"
    root.parent.mkdir()
    root.write_text("root")
    metadata = ProxyConfig(
        proxy_metadata={
            "ISTIO_META_TLS_CLIENT_CERT_CHAIN": "mounted/chain.pem",
            "ISTIO_META_TLS_CLIENT_KEY": "/abs/key.pem",
            "ISTIO_META_TLS_CLIENT_ROOT_CERT": "mounted/root.pem",
        }
    )
    s = xds(tmp_path, metadata, FILE_MOUNTED_CERTS="true")
    assert s.client_cert == tmp_path / "mounted/chain.pem"
    assert s.client_key == Path("/abs/key.pem")
    assert s.root_ca == root


# -- root CA order (FindRootCAForXDS) -------------------------------------------------------------
def test_root_system(tmp_path: Path) -> None:
    assert xds(tmp_path, XDS_ROOT_CA="SYSTEM", with_default_root=False).root_ca is None


def test_root_explicit_beats_everything(tmp_path: Path) -> None:
    (tmp_path / "etc/certs").mkdir(parents=True)
    (tmp_path / "etc/certs/root-cert.pem").write_text("legacy")
    (tmp_path / "my-root.pem").write_text("mine")
    assert xds(tmp_path, XDS_ROOT_CA="my-root.pem", PROV_CERT="prov").root_ca == tmp_path / "my-root.pem"


def test_root_explicit_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        xds(tmp_path, XDS_ROOT_CA="/nowhere/root.pem")


def test_root_legacy_certs_dir_before_prov_cert(tmp_path: Path) -> None:
    (tmp_path / "etc/certs").mkdir(parents=True)
    (tmp_path / "etc/certs/root-cert.pem").write_text("legacy")
    assert xds(tmp_path, PROV_CERT="prov").root_ca == tmp_path / "etc/certs/root-cert.pem"


def test_root_prov_cert_is_not_checked(tmp_path: Path) -> None:
    s = xds(tmp_path, PROV_CERT="prov", with_default_root=False)
    assert s.root_ca == tmp_path / "prov/root-cert.pem"


def test_root_file_mounted_needs_metadata(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="ISTIO_META_TLS_CLIENT_ROOT_CERT"):
        xds(tmp_path, FILE_MOUNTED_CERTS="true")
    (tmp_path / "r.pem").write_text("root")
    s = xds(tmp_path, FILE_MOUNTED_CERTS="true", ISTIO_META_TLS_CLIENT_ROOT_CERT="r.pem")
    assert s.root_ca == tmp_path / "r.pem"


def test_root_provider_none_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="none"):
        xds(tmp_path, PILOT_CERT_PROVIDER="none")


def test_root_default_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"root-cert\.pem"):
        xds(tmp_path, with_default_root=False)
    assert xds(tmp_path).root_ca == tmp_path / DEFAULT_ROOT


def test_settings_are_frozen(tmp_path: Path) -> None:
    s = xds(tmp_path)
    assert replace(s, max_streams=5).max_streams == 5
    with pytest.raises(AttributeError):
        s.max_streams = 5  # type: ignore[misc]


def test_debug_tap_on_15004_unless_turned_off(tmp_path: Path) -> None:
    assert xds(tmp_path).debug_tap_port == 15004
    assert xds(tmp_path, PROXY_XDS_DEBUG_VIA_AGENT_PORT="16004").debug_tap_port == 16004
    assert xds(tmp_path, PROXY_XDS_DEBUG_VIA_AGENT="false").debug_tap_port is None
    with pytest.raises(ConfigError, match="PROXY_XDS_DEBUG_VIA_AGENT_PORT"):
        xds(tmp_path, PROXY_XDS_DEBUG_VIA_AGENT_PORT="70000")
    with pytest.raises(ConfigError, match="PROXY_XDS_DEBUG_VIA_AGENT"):
        xds(tmp_path, PROXY_XDS_DEBUG_VIA_AGENT="maybe")
