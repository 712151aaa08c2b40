"""The repair controller's settings: Istio's flags and variables (``cni/pkg/cmd/root.go``, the chart's
``configmap-cni.yaml`` and DaemonSet env), defaults, precedence of the modes, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from istio_agent.cni.install.settings import load_settings
from istio_agent.cni.repair.controller import selectors
from istio_agent.config.env import ConfigError


def test_defaults_are_istios_flags() -> None:
    repair = load_settings({}, {}).repair
    assert repair.enabled is True
    assert (repair.repair_pods, repair.delete_pods, repair.label_pods) == (False, False, False)
    assert repair.mode is None
    assert (repair.label_key, repair.label_value) == ("cni.istio.io/uninitialized", "true")
    assert repair.sidecar_annotation == "sidecar.istio.io/status"
    assert repair.init_container_name == "istio-validation"
    assert (repair.init_exit_code, repair.init_termination_message) == (126, "")
    assert repair.host_proc_dir == Path("/host/proc")


def test_the_charts_environment() -> None:
    environ = {  # configmap-cni.yaml with the chart's defaults, and the DaemonSet's env
        "REPAIR_ENABLED": "true",
        "REPAIR_LABEL_PODS": "false",
        "REPAIR_DELETE_PODS": "false",
        "REPAIR_REPAIR_PODS": "true",
        "REPAIR_INIT_CONTAINER_NAME": "istio-validation",
        "REPAIR_BROKEN_POD_LABEL_KEY": "cni.istio.io/uninitialized",
        "REPAIR_BROKEN_POD_LABEL_VALUE": "true",
        "NATIVE_NFTABLES": "false",
        "REPAIR_NODE_NAME": "node-1",
        "REPAIR_RUN_AS_DAEMON": "true",
        "REPAIR_SIDECAR_ANNOTATION": "sidecar.istio.io/status",
    }
    repair = load_settings({}, environ).repair
    assert repair.mode == "repair"
    assert repair.node_name == "node-1"
    assert selectors(repair) == ("", "spec.nodeName=node-1")


def test_flags_win_and_modes_have_istios_precedence() -> None:
    flags = {
        "repair-delete-pods": "true",
        "repair-label-pods": "true",
        "repair-init-container-exit-code": "3",
        "repair-field-selectors": "metadata.namespace=prod",
        "repair-label-selectors": "app=web",
        "repair-node-name": "n2",
    }
    repair = load_settings(flags, {"REPAIR_INIT_CONTAINER_EXIT_CODE": "7"}).repair
    assert repair.mode == "delete"  # repair > delete > label, as ReconcilePod picks
    assert repair.init_exit_code == 3
    assert selectors(repair) == ("app=web", "metadata.namespace=prod,spec.nodeName=n2")
    assert load_settings({}, {"REPAIR_REPAIR_PODS": "1", "REPAIR_LABEL_PODS": "1"}).repair.mode == "repair"


@pytest.mark.parametrize(
    ("flags", "environ", "message"),
    [
        ({"repair-init-container-exit-code": "x"}, {}, "--repair-init-container-exit-code='x'"),
        ({}, {"REPAIR_REPAIR_PODS": "yes"}, "REPAIR_REPAIR_PODS='yes'"),
        (
            {"repair-label-pods": "true", "repair-broken-pod-label-key": "a b"},
            {},
            "repair-broken-pod-label-key",
        ),
        ({"repair-label-pods": "true", "repair-broken-pod-label-key": "Bad.Prefix/x"}, {}, "prefix"),
        ({"repair-label-pods": "true", "repair-broken-pod-label-value": "-x"}, {}, "label-value='-x'"),
        ({"repair-label-pods": "true", "repair-broken-pod-label-value": "v" * 64}, {}, "at most 63"),
    ],
)
def test_bad_values_name_the_flag_or_variable(
    flags: dict[str, str], environ: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_settings(flags, environ)


def test_repair_repair_pods_is_no_flag_in_istio() -> None:
    from istio_agent.cni.install.settings import FLAGS

    assert "repair-repair-pods" not in {option.flag for option in FLAGS}


def test_a_label_not_used_is_not_checked() -> None:
    assert load_settings({"repair-broken-pod-label-key": "a b"}, {}).repair.label_key == "a b"
