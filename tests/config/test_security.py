from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from istio_agent.config import ConfigError, Env, ProxyConfig, SecuritySettings


def settings(tmp_path: Path, **env: str) -> SecuritySettings:
    return SecuritySettings.from_env(Env(env), tmp_path)


def test_defaults_follow_istio(tmp_path: Path) -> None:
    s = settings(tmp_path)
    assert s.trust_domain == "cluster.local"
    assert s.secret_ttl == timedelta(hours=24)
    assert (s.grace_period_ratio, s.grace_period_ratio_jitter) == (0.5, 0.01)
    assert s.rsa_key_size == 2048 and s.ecc_signature_algorithm == "" and s.ecc_curve == "P256"
    assert s.ca_addr == "istiod.istio-system.svc:15012" and s.ca_addr_defaulted
    assert s.sds_socket_path == tmp_path / "var/run/secrets/workload-spiffe-uds/socket"
    assert s.token_path == tmp_path / "var/run/secrets/tokens/istio-token"
    assert s.cert_chain_file == tmp_path / "etc/certs/cert-chain.pem"
    assert not s.ca_plaintext


def test_identity_and_headers(tmp_path: Path) -> None:
    s = settings(
        tmp_path,
        TRUST_DOMAIN="example.org",
        POD_NAMESPACE="ns1",
        SERVICE_ACCOUNT="sa1",
        CA_HEADER_FOO="foo",
        CA_HEADER_BAZ="=baz",
        ISTIO_META_CLUSTER_ID="Kubernetes",
    )
    assert s.spiffe_id == "spiffe://example.org/ns/ns1/sa/sa1"
    assert s.ca_headers == {"foo": "foo", "baz": "=baz"}
    assert s.cluster_id == "Kubernetes"


def test_ca_address_and_server_name(tmp_path: Path) -> None:
    assert settings(tmp_path, CA_ADDR="localhost:15012").ca_server_name == "istiod.istio-system.svc"
    assert settings(tmp_path, CA_ADDR="127.0.0.1:15010").ca_plaintext
    defaulted = settings(tmp_path, ISTIOD_SAN="istiod.custom.svc")
    assert defaulted.ca_server_name == "istiod.custom.svc"
    explicit = settings(tmp_path, CA_ADDR="ca.example:443", ISTIOD_SAN="istiod.custom.svc")
    assert explicit.ca_server_name == "ca.example"
    from_proxy_config = SecuritySettings.from_env(
        Env({}), tmp_path, ProxyConfig(discovery_address="10.0.0.1:15012")
    )
    assert from_proxy_config.ca_addr == "10.0.0.1:15012"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SECRET_TTL": "soon"}, "SECRET_TTL"),
        ({"SECRET_GRACE_PERIOD_RATIO": "1.5"}, "SECRET_GRACE_PERIOD_RATIO"),
        ({"SECRET_GRACE_PERIOD_RATIO": "half"}, "SECRET_GRACE_PERIOD_RATIO"),
        ({"WORKLOAD_RSA_KEY_SIZE": "1024"}, "WORKLOAD_RSA_KEY_SIZE=.1024.: must be between 2048 and 8192"),
        (
            {"WORKLOAD_RSA_KEY_SIZE": "99999999"},
            "WORKLOAD_RSA_KEY_SIZE=.99999999.: must be between 2048 and 8192",
        ),
        ({"ECC_SIGNATURE_ALGORITHM": "ED25519"}, "ECC_SIGNATURE_ALGORITHM"),
        ({"ECC_CURVE": "P521"}, "ECC_CURVE"),
        ({"CA_PROVIDER": "GoogleCA"}, 'CA provider "GoogleCA" not registered'),
        ({"CREDENTIAL_FETCHER_TYPE": "foo"}, "invalid credential fetcher type foo"),
        ({"WORKLOAD_IDENTITY_SOCKET_FILE": "a/b"}, "must be a filename, not a path"),
        ({"PROV_CERT": "/x", "FILE_MOUNTED_CERTS": "true"}, "mutually exclusive"),
        ({"FILE_MOUNTED_CERTS": "perhaps"}, "FILE_MOUNTED_CERTS"),
    ],
)
def test_invalid_settings_are_clear_startup_errors(tmp_path: Path, env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        settings(tmp_path, **env)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("CA_HEADER_BAD NAME", "x"),
        ("CA_HEADER_GRPC-X", "x"),
        ("CA_HEADER_X-BIN", "x"),
        ("CA_HEADER_OK", "a\nb"),
        ("ISTIO_META_CLUSTER_ID", "c\u00e9"),
    ],
)
def test_unusable_headers_are_config_errors(tmp_path: Path, name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name.replace(" ", ".")):
        settings(tmp_path, **{name: value})


def test_ca_root_resolution(tmp_path: Path) -> None:
    s = settings(tmp_path)
    with pytest.raises(ConfigError, match="root CA file for CA does not exist"):
        s.ca_root_path()
    root = tmp_path / "var/run/secrets/istio/root-cert.pem"
    root.parent.mkdir(parents=True)
    root.write_text("x")
    assert s.ca_root_path() == root
    assert settings(tmp_path, CA_ROOT_CA="SYSTEM").ca_root_path() is None
    assert settings(tmp_path, PROV_CERT="prov").ca_root_path() == tmp_path / "prov/root-cert.pem"
    with pytest.raises(ConfigError, match="provider as none"):
        settings(tmp_path, PILOT_CERT_PROVIDER="none").ca_root_path()


def test_output_and_prov_cert_paths_are_resolved(tmp_path: Path) -> None:
    s = settings(tmp_path, OUTPUT_CERTS="out", PROV_CERT="/abs/prov", KUBERNETES_SERVICE_HOST="10.0.0.1")
    assert s.output_certs == tmp_path / "out"
    assert s.prov_cert == Path("/abs/prov")
    assert s.output_world_readable


def test_proxy_config_overlays(tmp_path: Path) -> None:
    mesh = tmp_path / "mesh"
    mesh.write_text("defaultConfig:\n  discoveryAddress: a:15012\n  proxyMetadata: {A: '1', B: '1'}\n")
    env = Env({"PROXY_CONFIG": '{"discoveryAddress": "b:15012", "proxyMetadata": {"B": "2"}}'})
    config = ProxyConfig.load(env, mesh)
    assert config.discovery_address == "b:15012"
    assert config.proxy_metadata == {"A": "1", "B": "2"}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("discoveryAddress: nohost", "discoveryAddress"),
        ("[1, 2]", "expected a map"),
        ("statusPort: lots", "statusPort: expected an integer"),
        ("{unclosed", "not valid YAML"),
    ],
)
def test_bad_proxy_config_names_the_field(raw: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ProxyConfig.load(Env({"PROXY_CONFIG": raw}))


def test_proxy_config_durations() -> None:
    config = ProxyConfig().overlay(
        {"drainDuration": "10s", "terminationDrainDuration": "1.5s"}, "PROXY_CONFIG"
    )
    assert config.drain_duration.total_seconds() == 10
    assert config.termination_drain_duration.total_seconds() == 1.5
    assert ProxyConfig().termination_drain_duration.total_seconds() == 5
    with pytest.raises(ConfigError, match="terminationDrainDuration"):
        ProxyConfig().overlay({"terminationDrainDuration": "soon"}, "PROXY_CONFIG")
    with pytest.raises(ConfigError, match=r"drainDuration: must be whole seconds, got 1\.5s"):
        ProxyConfig().overlay({"drainDuration": "1.5s"}, "PROXY_CONFIG")


def test_ports_in_addresses_are_ascii_digits() -> None:
    """str.isdigit() takes Arabic-Indic digits, and int() reads them: "istiod:١٥٠١٢" was port 15012."""
    from istio_agent.config import dns, proxy_config

    for split in (proxy_config.split_host_port, dns.split_host_port):
        with pytest.raises(ValueError):
            split("istiod:\u0661\u0665\u0660\u0661\u0662")
        assert split("istiod:15012") == ("istiod", 15012)
