"""install-cni's flags and environment variables: Istio's names, flag over env over default, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from istio_agent.cni.install.settings import OPTIONS, load_settings
from istio_agent.config.env import ConfigError


def test_defaults_are_istios() -> None:
    settings = load_settings({}, {})
    assert settings.mounted_cni_net_dir == Path("/host/etc/cni/net.d")
    assert settings.cni_agent_run_dir == Path("/var/run/istio-cni")
    assert settings.chained_cni_plugin is True
    assert settings.kubeconfig_mode == 0o600
    assert settings.conf_file_mode == 0o600
    assert settings.monitoring_port == 15014
    assert settings.health_port == 8000
    assert settings.cni_bin_source_dir == Path("/opt/cni/bin")
    assert settings.cni_bin_target_dirs == (Path("/host/opt/cni/bin"),)
    assert settings.ca_file == Path("/var/run/secrets/kubernetes.io/serviceaccount/ca.crt")
    assert settings.kubernetes_service_protocol == "https"
    assert settings.plugin.exclude_namespaces == ()


def test_env_names_are_the_flags_upper_cased() -> None:
    assert {o.flag: o.env for o in OPTIONS}[
        "istio-owned-cni-config-filename"
    ] == "ISTIO_OWNED_CNI_CONFIG_FILENAME"
    environ = {
        "CNI_CONF_NAME": "10-calico.conflist",
        "CHAINED_CNI_PLUGIN": "false",
        "CNI_CONF_GROUP_READ": "true",
        "KUBECONFIG_MODE": "0640",
        "EXCLUDE_NAMESPACES": " kube-system, ,istio-system ",
        "POD_NAMESPACE": "istio-system",
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
        "KUBERNETES_SERVICE_PORT": "443",
        "ISTIO_OWNED_CNI_CONFIG": "true",
    }
    settings = load_settings({}, environ, plugin_log_level="debug")
    assert settings.cni_conf_name == "10-calico.conflist"
    assert settings.chained_cni_plugin is False
    assert settings.conf_file_mode == 0o640
    assert settings.kubeconfig_mode == 0o640
    assert settings.plugin.exclude_namespaces == ("kube-system", "istio-system")
    assert settings.plugin.pod_namespace == "istio-system"
    assert settings.plugin.plugin_log_level == "debug"
    assert settings.istio_owned_cni_config_filename == "02-istio-cni.conflist"
    assert settings.kubernetes_service_host == "10.96.0.1"


def test_a_flag_wins_over_its_variable() -> None:
    settings = load_settings(
        {"cni-conf-name": "a.conf", "kubeconfig-mode": "384"}, {"CNI_CONF_NAME": "b.conf"}
    )
    assert settings.cni_conf_name == "a.conf"
    assert settings.kubeconfig_mode == 0o600


@pytest.mark.parametrize(
    ("flags", "environ", "message"),
    [
        ({"chained-cni-plugin": "maybe"}, {}, "--chained-cni-plugin='maybe'"),
        ({}, {"MONITORING_PORT": "x"}, "MONITORING_PORT='x'"),
        ({"monitoring-port": "70000"}, {}, "must be at most 65535"),
        ({"kubeconfig-mode": "0999"}, {}, "--kubeconfig-mode='0999'"),
        ({"kubeconfig-mode": "01000"}, {}, "must be between"),
        ({}, {"AMBIENT_ENABLEMENT_SELECTOR": "{a: 1}"}, "expected a list of selectors"),
        ({"cni-bin-target-dirs": " , "}, {}, "at least one directory"),
    ],
)
def test_bad_values_name_the_flag_or_variable(
    flags: dict[str, str], environ: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_settings(flags, environ)


def test_a_disabled_monitoring_port_is_allowed() -> None:
    assert load_settings({"monitoring-port": "-1"}, {}).monitoring_port == -1
