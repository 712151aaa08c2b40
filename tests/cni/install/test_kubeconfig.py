"""The kubeconfig install-cni writes for the plugin (Istio's cni/pkg/install/kubeconfig_test.go cases)."""

from __future__ import annotations

import base64
import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from istio_agent.cni.install import kubeconfig
from istio_agent.cni.install.kubeconfig import KubeconfigError
from tests.cni.install.layout import TOKEN, Node, golden


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


@pytest.mark.parametrize(("host", "port", "missing"), [("", "443", "HOST"), ("10.96.0.1", "", "PORT")])
def test_the_api_server_address_must_be_known(node: Node, host: str, port: str, missing: str) -> None:
    settings = node.settings(kubernetes_service_host=host, kubernetes_service_port=port)
    with pytest.raises(
        KubeconfigError, match=f"KUBERNETES_SERVICE_{missing} not set. Is this not running within a pod"
    ):
        kubeconfig.build(settings)


def test_tls_with_the_service_account_ca(node: Node) -> None:
    document = kubeconfig.write(node.settings())
    text = node.settings().kubeconfig_path.read_bytes()
    golden("kubeconfig-tls", text)
    assert json.loads(text) == yaml.safe_load(text) == document  # JSON, and so YAML as kubectl reads it
    assert node.settings().kubeconfig_path.stat().st_mode & 0o777 == 0o600
    data = document["clusters"][0]["cluster"]["certificate-authority-data"]
    assert base64.b64decode(data) == (node.sa / "ca.crt").read_bytes()


def test_skip_tls_verify_has_no_ca_and_a_chosen_mode(node: Node) -> None:
    settings = node.settings(skip_tls_verify=True, kubeconfig_mode=0o640, kube_ca_file="/nonexistent")
    kubeconfig.write(settings)
    golden("kubeconfig-skip-tls", settings.kubeconfig_path.read_bytes())
    assert settings.kubeconfig_path.stat().st_mode & 0o777 == 0o640


def test_a_new_host_rewrites_the_server(node: Node) -> None:
    kubeconfig.write(node.settings())
    settings = node.settings(kubernetes_service_host="50.76.2.1")
    kubeconfig.write(settings)
    golden("kubeconfig-newhost", settings.kubeconfig_path.read_bytes())


def test_ipv6_hosts_are_bracketed_and_the_protocol_is_kept(node: Node) -> None:
    settings = node.settings(kubernetes_service_host="fd00::1", kubernetes_service_protocol="http")
    assert kubeconfig.build(settings)["clusters"][0]["cluster"]["server"] == "http://[fd00::1]:443"


def test_the_token_never_reaches_the_redacted_form(node: Node) -> None:
    document = kubeconfig.build(node.settings())
    assert document["users"][0]["user"]["token"] == TOKEN
    shown = kubeconfig.render(kubeconfig.redacted(document))
    assert TOKEN not in shown and '"token": "<redacted>"' in shown
    assert document["users"][0]["user"]["token"] == TOKEN  # the original is untouched


def test_a_missing_ca_file_is_a_clear_error(node: Node) -> None:
    settings = replace(node.settings(), kube_ca_file=str(node.root / "missing-ca.crt"))
    with pytest.raises(KubeconfigError, match=r"cannot read the CA .*missing-ca\.crt"):
        kubeconfig.build(settings)
