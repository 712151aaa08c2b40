"""The proxyless gRPC bootstrap, field by field as Istio writes it (pkg/istio-agent/grpcxds/grpc_bootstrap.go)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

from istio_agent.bootstrap.grpc import build_grpc_bootstrap, write_grpc_bootstrap
from istio_agent.config import Env, ProxyConfig, SecuritySettings, XdsSettings
from istio_agent.config.grpc import GrpcBootstrapSettings, grpc_bootstrap_path
from tests.bootstrap import FakeHost, make_settings


def settings_for(workdir: Path, **env: str) -> GrpcBootstrapSettings:
    """As the CLI builds them: Envoy's node, the XDS socket, OUTPUT_CERTS."""
    environ = {
        "POD_NAME": "v0",
        "POD_NAMESPACE": "default",
        "INSTANCE_IP": "10.1.1.0",
        "XDS_ROOT_CA": "SYSTEM",
        **env,
    }
    node = make_settings(workdir, env=environ, host=FakeHost([("eth0", "10.1.1.0")]))
    security = SecuritySettings.from_env(Env(environ), workdir, ProxyConfig())
    xds = XdsSettings.from_env(Env(environ), security, ProxyConfig())
    path = grpc_bootstrap_path(Env(environ), workdir)
    assert path is not None
    return GrpcBootstrapSettings.from_settings(path, node, xds, security)


def test_every_field_istio_writes(tmp_path: Path) -> None:
    settings = settings_for(tmp_path, OUTPUT_CERTS="/var/lib/istio/data", ISTIO_META_GENERATOR="grpc")
    bootstrap = build_grpc_bootstrap(settings)
    assert list(bootstrap) == [
        "xds_servers",
        "node",
        "certificate_providers",
        "server_listener_resource_name_template",
    ]
    assert bootstrap["xds_servers"] == [
        {
            "server_uri": f"unix://{tmp_path}/etc/istio/proxy/XDS",
            "channel_creds": [{"type": "insecure"}],
            "server_features": ["xds_v3"],
        }
    ]
    node = bootstrap["node"]
    assert list(node) == ["id", "metadata", "locality", "UserAgentVersionType"]
    assert node["id"] == "sidecar~10.1.1.0~v0.default~default.svc.cluster.local"
    assert node["locality"] == {} and node["UserAgentVersionType"] is None
    assert bootstrap["certificate_providers"] == {
        "default": {
            "plugin_name": "file_watcher",
            "config": {
                "certificate_file": "/var/lib/istio/data/cert-chain.pem",
                "private_key_file": "/var/lib/istio/data/key.pem",
                "ca_certificate_file": "/var/lib/istio/data/root-cert.pem",
                "refresh_interval": "900s",
            },
        }
    }
    assert bootstrap["server_listener_resource_name_template"] == "xds.istio.io/grpc/lds/inbound/%s"


def test_node_metadata_is_envoys_with_generator_grpc(tmp_path: Path) -> None:
    """The metadata Envoy's bootstrap carries, sorted, with GENERATOR forced to grpc whatever the env says."""
    settings = settings_for(
        tmp_path, ISTIO_META_GENERATOR="api", ISTIO_META_CLUSTER_ID="Kubernetes", SERVICE_ACCOUNT="sa"
    )
    metadata = build_grpc_bootstrap(settings)["node"]["metadata"]
    envoy_metadata = make_settings(
        tmp_path,
        env={"ISTIO_META_GENERATOR": "api", "ISTIO_META_CLUSTER_ID": "Kubernetes", "SERVICE_ACCOUNT": "sa"},
        host=FakeHost([("eth0", "10.1.1.0")]),
    ).metadata
    assert metadata == {**envoy_metadata, "GENERATOR": "grpc"}
    assert list(metadata) == sorted(metadata)
    assert metadata["INSTANCE_IPS"] == "10.1.1.0"
    assert metadata["PILOT_SAN"] == ["istiod.istio-system.svc"]
    assert metadata["NAMESPACE"] == "default" and metadata["SERVICE_ACCOUNT"] == "sa"
    assert metadata["CLUSTER_ID"] == "Kubernetes"
    assert "PROXY_CONFIG" in metadata


def test_locality_from_the_pod_label(tmp_path: Path) -> None:
    settings = GrpcBootstrapSettings(
        path=tmp_path / "b.json", node_id="n", locality={"region": "r", "zone": "z", "sub_zone": "s"}
    )
    assert build_grpc_bootstrap(settings)["node"]["locality"] == {"region": "r", "zone": "z", "sub_zone": "s"}


def test_no_output_certs_means_no_certificate_provider(tmp_path: Path) -> None:
    bootstrap = build_grpc_bootstrap(settings_for(tmp_path))
    assert "certificate_providers" not in bootstrap
    assert list(bootstrap)[-1] == "server_listener_resource_name_template"


def test_without_the_xds_socket_grpc_talks_to_the_discovery_address(tmp_path: Path) -> None:
    settings = GrpcBootstrapSettings(path=tmp_path / "b.json", node_id="n", discovery_address="istiod:15012")
    assert build_grpc_bootstrap(settings)["xds_servers"][0]["server_uri"] == "istiod:15012"


def test_path_default_override_and_disabled(tmp_path: Path) -> None:
    assert grpc_bootstrap_path(Env({}), tmp_path) == tmp_path / "etc/istio/proxy/grpc-bootstrap.json"
    assert grpc_bootstrap_path(Env({"GRPC_XDS_BOOTSTRAP": "/x/b.json"}), tmp_path) == Path("/x/b.json")
    assert grpc_bootstrap_path(Env({"GRPC_XDS_BOOTSTRAP": "rel/b.json"}), tmp_path) == tmp_path / "rel/b.json"
    assert grpc_bootstrap_path(Env({"GRPC_XDS_BOOTSTRAP": ""}), tmp_path) is None


def test_written_as_istio_writes_it(tmp_path: Path) -> None:
    settings = settings_for(tmp_path, OUTPUT_CERTS="/certs", GRPC_XDS_BOOTSTRAP="deep/dir/grpc.json")
    path = write_grpc_bootstrap(settings)
    assert path == tmp_path / "deep/dir/grpc.json"
    text = path.read_text()
    assert json.loads(text) == build_grpc_bootstrap(settings)
    assert text.startswith('{\n  "xds_servers": [\n    {\n      "server_uri"')  # 2-space indented
    assert '"UserAgentVersionType": null' in text
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert [p.name for p in path.parent.iterdir()] == ["grpc.json"]  # no temporary file left
