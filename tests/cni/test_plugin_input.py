"""What the plugin reads besides the pod: prevResult in each cniVersion, CNI_ARGS, its stdin config,
and install-cni's kubeconfig."""

from __future__ import annotations

import base64
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import yaml

from istio_agent.cni import kube, result
from istio_agent.cni.args import ArgsError, K8sArgs, is_agent_pod, parse_k8s_args
from istio_agent.cni.install import kubeconfig
from istio_agent.cni.kube import read_kubeconfig
from istio_agent.cni.plugin_config import PluginConfig, parse_network_config
from istio_agent.config.env import ConfigError

V100 = {
    "cniVersion": "1.0.0",
    "interfaces": [
        {"name": "eth0", "mac": "aa:bb:cc:dd:ee:ff", "mtu": 1450, "sandbox": "/var/run/netns/p"},
        {"name": "veth1", "mac": "11:22:33:44:55:66"},
    ],
    "ips": [
        {"interface": 0, "address": "10.1.0.5/24", "gateway": "10.1.0.1"},
        {"interface": 0, "address": "fd00::5/64"},
    ],
    "routes": [{"dst": "0.0.0.0/0", "gw": "10.1.0.1", "mtu": 1400}, {"dst": "::/0"}],
    "dns": {"nameservers": ["10.96.0.10"], "search": ["svc.cluster.local"]},
    "extra": "dropped",
}


def test_1_0_0_round_trips_and_drops_unknown_fields() -> None:
    out = result.render(result.parse(V100, "1.0.0"), "1.0.0")
    assert out == {k: v for k, v in V100.items() if k != "extra"}
    assert list(out) == ["cniVersion", "interfaces", "ips", "routes", "dns"]


def test_0_4_0_adds_the_ip_version_and_drops_mtu() -> None:
    given = {
        **V100,
        "cniVersion": "0.4.0",
        "ips": [{"version": "4", **V100["ips"][0]}, {"version": "6", **V100["ips"][1]}],
    }
    out = result.render(result.parse(given, "0.4.0"), "0.4.0")
    assert out["ips"] == given["ips"]
    assert out["interfaces"][0] == {"name": "eth0", "mac": "aa:bb:cc:dd:ee:ff", "sandbox": "/var/run/netns/p"}
    assert list(out["ips"][0]) == ["version", "interface", "address", "gateway"]


@pytest.mark.parametrize("version", ["0.3.0", "0.3.1"])
def test_0_3_x_results(version: str) -> None:
    given = {"cniVersion": version, "ips": [{"version": "4", "address": "10.1.0.5/24"}], "dns": {}}
    assert result.render(result.parse(given, version), version) == given


@pytest.mark.parametrize("version", ["0.1.0", "0.2.0"])
def test_legacy_results_keep_ip4_ip6_and_their_routes(version: str) -> None:
    given = {
        "cniVersion": version,
        "ip4": {"ip": "10.1.0.5/24", "gateway": "10.1.0.1", "routes": [{"dst": "0.0.0.0/0"}]},
        "ip6": {"ip": "fd00::5/64"},
        "dns": {"nameservers": ["10.96.0.10"]},
    }
    assert result.render(result.parse(given, version), version) == given


def test_1_1_0_keeps_its_route_fields() -> None:
    given = {
        "cniVersion": "1.1.0",
        "routes": [{"dst": "10.0.0.0/8", "table": 0, "scope": 253, "priority": 5}],
        "dns": {},
    }
    assert result.render(result.parse(given, "1.1.0"), "1.1.0") == given


def test_no_prev_result_is_an_empty_result() -> None:
    assert result.empty("0.3.1") == {"cniVersion": "0.3.1", "dns": {}}


@pytest.mark.parametrize(
    ("given", "where"),
    [
        ({"ips": [{"address": "10.1.0.5"}]}, "prevResult.ips[0].address"),
        ({"ips": [{"address": "10.1.0.5/24", "gateway": "nope"}]}, "prevResult.ips[0].gateway"),
        ({"ips": "10.1.0.5/24"}, "prevResult.ips"),
        ({"routes": [{"gw": "10.0.0.1"}]}, "prevResult.routes[0].dst"),
        ([], "prevResult"),
        # Passed on as given, so typed as the library's structs type them (Go refuses the rest);
        # this also bounds how much larger the printed result can be than the config.
        ({"dns": {"nameservers": [0]}}, "prevResult.dns.nameservers[0]"),
        ({"dns": {"nameservers": [[[]]]}}, "prevResult.dns.nameservers[0]"),
        ({"dns": {"search": "a"}}, "prevResult.dns.search"),
        ({"dns": {"domain": ["a"]}}, "prevResult.dns.domain"),
        ({"dns": {"options": {"a": 1}}}, "prevResult.dns.options"),
        ({"interfaces": [{"name": "eth0", "mac": [[]]}]}, "prevResult.interfaces[0].mac"),
        ({"interfaces": [{"name": "eth0", "mtu": "1500"}]}, "prevResult.interfaces[0].mtu"),
        ({"interfaces": [{"name": "eth0", "sandbox": {}}]}, "prevResult.interfaces[0].sandbox"),
    ],
)
def test_bad_prev_result_names_the_field(given: Any, where: str) -> None:
    with pytest.raises(result.ResultError, match="^" + re.escape(where)):
        result.parse(given, "1.0.0")


# -- CNI_ARGS ---------------------------------------------------------------------------------------


def test_k8s_args() -> None:
    raw = "IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p;K8S_POD_INFRA_CONTAINER_ID=c;K8S_POD_UID=u;X=y"
    assert parse_k8s_args(raw) == K8sArgs("p", "ns", "c", "u")
    assert parse_k8s_args("") == K8sArgs()


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("K8S_POD_NAME=p;X=y", "unknown args 'X'"),
        ("K8S_POD_NAME=p;IgnoreUnknown=0;X=y", "unknown args 'X'"),
        ("K8S_POD_NAME", "invalid pair 'K8S_POD_NAME'"),
        ("K8S_POD_NAME=a=b", "invalid pair"),
        ("K8S_POD_NAME=p;", "invalid pair ''"),
        ("IgnoreUnknown=yes", "boolean unmarshal error"),
    ],
)
def test_bad_k8s_args(raw: str, message: str) -> None:
    with pytest.raises(ArgsError, match=message):
        parse_k8s_args(raw)


@pytest.mark.parametrize("flag", ["true", "TRUE", "1"])
def test_ignore_unknown_spellings(flag: str) -> None:
    assert parse_k8s_args(f"X=1;IgnoreUnknown={flag};K8S_POD_NAME=p").pod_name == "p"


@pytest.mark.parametrize(
    ("name", "namespace", "expected"),
    [
        ("istio-cni-node-abcde", "istio-system", True),
        ("istio-cni-node-abcde", "default", False),
        ("istio-cni-abcde", "istio-system", False),
        ("app-istio-cni-node-x", "istio-system", False),
    ],
)
def test_agent_pod(name: str, namespace: str, expected: bool) -> None:
    assert is_agent_pod(K8sArgs(name, namespace), "istio-system") is expected


# -- the stdin config -------------------------------------------------------------------------------


def test_network_config_reads_istios_keys_and_ignores_others() -> None:
    config = parse_network_config(
        {
            "cniVersion": "0.3.1",
            "name": "k8s-pod-network",
            "type": "istio-cni",
            "plugin_log_level": "debug",
            "cni_agent_run_dir": "/run/x",
            "exclude_namespaces": ["istio-system", "kube-system"],
            "pod_namespace": "istio-system",
            "kubernetes": {"kubeconfig": "/etc/cni/net.d/ZZZ-istio-cni-kubeconfig"},
            "add_timeout": "2s",
        }
    )
    assert (config.cni_version, config.name, config.prev_result) == ("0.3.1", "k8s-pod-network", None)
    assert config.plugin.exclude_namespaces == ("istio-system", "kube-system")
    assert config.plugin.add_timeout == timedelta(seconds=2)
    assert config.plugin.cni_agent_run_dir == "/run/x"


def test_what_install_cni_writes_reads_back() -> None:
    written = PluginConfig(exclude_namespaces=("a",), pod_namespace="istio-system").plugin_object()
    assert parse_network_config(written).plugin == PluginConfig(
        exclude_namespaces=("a",), pod_namespace="istio-system"
    )
    assert "add_timeout" not in written


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"exclude_namespaces": "istio-system"}, "exclude_namespaces: expected a list"),
        ({"ambient_enabled": "yes"}, "ambient_enabled: expected true or false"),
        ({"add_timeout": "soon"}, "add_timeout"),
        ({"add_timeout": "0s"}, "add_timeout"),
    ],
)
def test_bad_network_config_names_the_key(given: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_network_config({"name": "n", **given})


# -- the kubeconfig ---------------------------------------------------------------------------------

KUBECONFIG = """apiVersion: v1
clusters:
- cluster:
    {trust}
    server: https://[fd00::1]:6443
  name: local
contexts:
- context:
    cluster: local
    user: istio-cni
  name: istio-cni-context
current-context: istio-cni-context
kind: Config
users:
- name: istio-cni
  user:
    token: s3cret
"""


def test_kubeconfig_with_ca_data(tmp_path: Path) -> None:
    path = tmp_path / "kc"
    pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    path.write_text(
        KUBECONFIG.format(trust=f"certificate-authority-data: {base64.b64encode(pem.encode()).decode()}")
    )
    config = read_kubeconfig(path)
    assert (config.server.host, config.server.port, config.ca_pem, config.insecure) == (
        "fd00::1",
        6443,
        pem,
        False,
    )
    assert config.token == "s3cret" and "s3cret" not in repr(config)


def test_kubeconfig_skip_tls_verify(tmp_path: Path) -> None:
    path = tmp_path / "kc"
    path.write_text(KUBECONFIG.format(trust="insecure-skip-tls-verify: true"))
    config = read_kubeconfig(path)
    assert config.insecure and config.ca_pem is None
    assert config.tls().verify_mode.name == "CERT_NONE"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            KUBECONFIG.format(trust="certificate-authority-data: '%%%'"),
            "certificate-authority-data: not base64",
        ),
        (
            KUBECONFIG.format(trust="insecure-skip-tls-verify: true").replace(
                "https://[fd00::1]:6443", "ftp://x"
            ),
            "server",
        ),
        (
            KUBECONFIG.format(trust="").replace(
                "current-context: istio-cni-context", "current-context: other"
            ),
            "no entry named 'other'",
        ),
        ("clusters: [", "neither JSON nor YAML"),
    ],
)
def test_bad_kubeconfig_names_the_field(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "kc"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as caught:
        read_kubeconfig(path)
    assert "s3cret" not in str(caught.value)


def test_the_kubeconfig_install_cni_writes_is_read_without_a_yaml_parser(tmp_path: Path) -> None:
    """install-cni writes JSON (valid YAML), so the plugin, exec'd per pod, never imports PyYAML."""
    path = tmp_path / "kc"
    document = yaml.safe_load(KUBECONFIG.format(trust="insecure-skip-tls-verify: true"))
    path.write_text(kubeconfig.render(document))
    probe = (
        "import sys; from pathlib import Path; from istio_agent.cni.kube import read_kubeconfig; "
        f"config = read_kubeconfig(Path({str(path)!r})); "
        "assert config.insecure and config.token == 's3cret', config; "
        "assert 'yaml' not in sys.modules, 'the kubeconfig was parsed as YAML'"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_a_broken_kubeconfig_is_reported_without_its_token(tmp_path: Path) -> None:
    """The YAML parser quotes the offending line; that line may hold the token, and the error
    becomes the CNI error (pod events) and a log line."""
    from istio_agent.cni.kube import read_kubeconfig

    path = tmp_path / "istio-cni-kubeconfig"
    path.write_text('{"users": [{"name": "istio-cni", "user": {"token": "SECRET-TOKEN-abcdef" x')
    with pytest.raises(ConfigError) as caught:
        read_kubeconfig(path)
    message = str(caught.value)
    assert "SECRET-TOKEN" not in message
    assert "neither JSON nor YAML: line 1, column" in message


@pytest.mark.parametrize("name", ["app-1", "istio-system", "a.b_c~d", "", "a/b", "..", "ü", "a b", "50%"])
def test_api_paths_escape_names_as_quote_does(name: str) -> None:
    assert kube._segment(name) == quote(name, safe="")
