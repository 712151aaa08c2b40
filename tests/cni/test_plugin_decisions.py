"""The plugin's decisions in-process: Istio's skip rules and Redirect (the "Plugin" acceptance lines of
``cni/pkg/plugin/plugin_test.go``), the ADD flow's order, the pod GET's retries and its one deadline.

The pods are served by an in-memory FAKE of the API server's pod GET (a function), so the many cases
stay fast; the executable with an HTTPS fake is ``test_plugin_exec.py``.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from istio_agent.cni import plugin
from istio_agent.cni.capture_config import CaptureConfig
from istio_agent.cni.kube import KubeError
from istio_agent.cni.plugin import PluginError, add, fetch_pod
from istio_agent.cni.pod import skip_reason
from istio_agent.cni.redirect import capture_config
from istio_agent.cni.skel import CmdArgs
from istio_agent.config.env import ConfigError
from tests.cni.fake_kube import sidecar_pod


class FakePods:
    """A FAKE pod GET: answers from a dict, or raises the scripted KubeErrors first."""

    def __init__(self, *pods: dict[str, Any], errors: list[KubeError] | None = None) -> None:
        self.pods = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in pods}
        self.errors = list(errors or [])
        self.calls = 0

    def __call__(self, namespace: str, name: str, deadline: float) -> dict[str, Any]:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        try:
            return self.pods[(namespace, name)]
        except KeyError:
            raise KubeError(f'pods "{name}" not found', retryable=False) from None


class Recorder:
    """The Programmer seam, recording what it is asked to set up."""

    def __init__(self) -> None:
        self.calls: list[tuple[CaptureConfig, Path]] = []

    def __call__(self, config: CaptureConfig, netns: Path, deadline: float) -> None:
        self.calls.append((config, netns))


def cmd(tmp_path: Path, *, pod: str = "app-1", namespace: str = "default", **config: Any) -> CmdArgs:
    netns = tmp_path / "netns"
    netns.touch()
    network = {
        "cniVersion": "1.0.0",
        "name": "net",
        "type": "istio-cni",
        "cni_agent_run_dir": str(tmp_path / "no-such-run-dir"),
        "pod_namespace": "istio-system",
        "exclude_namespaces": ["istio-system"],
        **config,
    }
    return CmdArgs(
        command="ADD",
        container_id="abc",
        netns=str(netns),
        ifname="eth0",
        args=f"IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={pod}",
        path="/opt/cni/bin",
        stdin=json.dumps(network).encode(),
        config=network,
        cni_version=str(network["cniVersion"]),
    )


def programmed(tmp_path: Path, pod: dict[str, Any], **config: Any) -> list[tuple[CaptureConfig, Path]]:
    recorder = Recorder()
    add(cmd(tmp_path, **config), programmer=recorder, get_pod=FakePods(pod))
    return recorder.calls


# -- the ADD flow -----------------------------------------------------------------------------------


def test_sidecar_pod_is_programmed_with_all_inbound_ports(tmp_path: Path) -> None:
    calls = programmed(tmp_path, sidecar_pod())
    assert len(calls) == 1
    config, netns = calls[0]
    assert config.inbound_ports == ("*",) and netns == tmp_path / "netns"


@pytest.mark.parametrize(
    "pod",
    [
        {**sidecar_pod(), "metadata": {"name": "app-1", "namespace": "default", "annotations": {}}},
        sidecar_pod(init_containers=[{"name": "istio-init"}]),
        sidecar_pod(proxy=False),
    ],
    ids=["no-status-annotation", "istio-init", "no-istio-proxy"],
)
def test_pods_that_get_no_rules(tmp_path: Path, pod: dict[str, Any]) -> None:
    assert programmed(tmp_path, pod) == []


def test_excluded_namespace_is_not_fetched(tmp_path: Path) -> None:
    pods = FakePods()
    recorder = Recorder()
    out = add(cmd(tmp_path, namespace="istio-system"), programmer=recorder, get_pod=pods)
    assert (out, pods.calls, recorder.calls) == ({"cniVersion": "1.0.0", "dns": {}}, 0, [])


def test_not_a_kubernetes_pod(tmp_path: Path) -> None:
    pods = FakePods()
    assert add(cmd(tmp_path, pod=""), programmer=Recorder(), get_pod=pods)["dns"] == {}
    assert pods.calls == 0


def test_agent_pod_is_left_alone_before_the_kubeconfig_is_read(tmp_path: Path) -> None:
    # no get_pod and no kubeconfig: reading it would fail the ADD
    args = cmd(tmp_path, pod="istio-cni-node-abcde", namespace="istio-system")
    assert add(args, programmer=Recorder())["cniVersion"] == "1.0.0"


def test_missing_kubeconfig_fails_for_other_pods(tmp_path: Path) -> None:
    with pytest.raises(PluginError, match="cannot read the kubeconfig"):
        add(cmd(tmp_path), programmer=Recorder())


def test_bad_annotation_fails_the_add(tmp_path: Path) -> None:
    pod = sidecar_pod(annotations={"sidecar.istio.io/interceptionMode": "MAGIC"})
    with pytest.raises(PluginError, match="interceptionMode"):
        programmed(tmp_path, pod)


def test_bad_cni_args_fail_the_add(tmp_path: Path) -> None:
    args = cmd(tmp_path)
    args.args = "K8S_POD_NAME=x;Unknown=1"
    with pytest.raises(PluginError, match="unknown args"):
        add(args, programmer=Recorder(), get_pod=FakePods())


def test_dual_stack_enables_ipv6(tmp_path: Path) -> None:
    ((config, _),) = programmed(tmp_path, sidecar_pod(proxy_env={"ISTIO_DUAL_STACK": "true"}))
    assert config.enable_ipv6


def test_dry_run_writer_or_the_applier_is_chosen_by_env(tmp_path: Path) -> None:
    assert isinstance(plugin.select_programmer({}), plugin.NetnsApplier)
    writer = plugin.select_programmer({"DRY_RUN_FILE_PATH": str(tmp_path / "out")})
    assert isinstance(writer, plugin.DryRunWriter)
    writer(CaptureConfig(), tmp_path, time.monotonic() + 1)
    assert (tmp_path / "out").read_text().startswith("* nat\n")


# -- the pod GET: retries within the deadline -------------------------------------------------------


def test_retries_pass_after_transient_failures() -> None:
    pods = FakePods(sidecar_pod(), errors=[KubeError("503", retryable=True)] * 3)
    pod = fetch_pod(pods, "default", "app-1", time.monotonic() + 5, retry_interval=0.01)
    assert pod["metadata"]["name"] == "app-1" and pods.calls == 4


def test_retries_stop_at_the_deadline() -> None:
    pods = FakePods(errors=[KubeError("503 Service Unavailable", retryable=True)] * 1000)
    start = time.monotonic()
    with pytest.raises(PluginError, match=r"503 Service Unavailable.*deadline"):
        fetch_pod(pods, "default", "app-1", start + 0.3, retry_interval=0.05)
    assert time.monotonic() - start < 1.0
    assert 2 <= pods.calls <= 10


def test_a_denial_is_not_retried() -> None:
    pods = FakePods(errors=[KubeError("403 Forbidden: RBAC", retryable=False)])
    with pytest.raises(PluginError, match="403 Forbidden"):
        fetch_pod(pods, "default", "app-1", time.monotonic() + 30, retry_interval=0.01)
    assert pods.calls == 1


# -- skip rules (Istio's order) ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pod", "reason"),
    [
        (sidecar_pod(), None),
        (sidecar_pod(init_containers=[{"name": "istio-init"}]), "istio-init"),
        (sidecar_pod(extra_containers=[{"name": "istio-init"}]), "istio-init"),
        (sidecar_pod(proxy_env={"DISABLE_ENVOY": "true"}), "DISABLE_ENVOY"),
        (sidecar_pod(proxy_env={"DISABLE_ENVOY": "maybe"}), None),
        (sidecar_pod(proxy=False), "no istio-proxy"),
        (sidecar_pod(proxy_args=["proxy", "router"]), "'router', not as a sidecar"),
        (sidecar_pod(annotations={"sidecar.istio.io/inject": "false"}), "inject is 'false'"),
        (sidecar_pod(labels={"sidecar.istio.io/inject": "false"}), "inject is 'false'"),
        (
            sidecar_pod(
                labels={"sidecar.istio.io/inject": "true"}, annotations={"sidecar.istio.io/inject": "false"}
            ),
            None,
        ),
        (sidecar_pod(annotations={"sidecar.istio.io/inject": "nope"}), None),
    ],
)
def test_skip_reason(pod: dict[str, Any], reason: str | None) -> None:
    found = skip_reason(pod)
    if reason is None:
        assert found is None
    else:
        assert found is not None and reason in found


def test_no_status_annotation_is_skipped() -> None:
    pod = sidecar_pod()
    del pod["metadata"]["annotations"]["sidecar.istio.io/status"]
    assert "not injected" in (skip_reason(pod) or "")


def test_native_sidecar_proxy_counts() -> None:
    pod = sidecar_pod(
        proxy=False,
        init_containers=[{"name": "istio-validation"}, {"name": "istio-proxy", "args": ["proxy", "sidecar"]}],
    )
    assert skip_reason(pod) is None


# -- Redirect from annotations ----------------------------------------------------------------------


def redirect(**options: Any) -> CaptureConfig:
    return capture_config(sidecar_pod(**options), {})


@pytest.mark.parametrize(("given", "want"), [("*", ("*",)), ("", ()), ("80, 8080", ("80", "8080"))])
def test_include_inbound_ports(given: str, want: tuple[str, ...]) -> None:
    config = redirect(annotations={"traffic.sidecar.istio.io/includeInboundPorts": given})
    assert config.inbound_ports == want


@pytest.mark.parametrize(
    ("given", "want"),
    [
        (None, (15020, 15021, 15090)),
        ("", (15020, 15021, 15090)),
        ("3306", (3306, 15020, 15021, 15090)),
        ("15021,3306", (15021, 3306, 15020, 15090)),
    ],
)
def test_exclude_inbound_ports_always_has_the_agents(given: str | None, want: tuple[int, ...]) -> None:
    annotations = {} if given is None else {"traffic.sidecar.istio.io/excludeInboundPorts": given}
    assert redirect(annotations=annotations).inbound_ports_exclude == want


def test_defaults() -> None:
    config = redirect()
    assert (config.mode, config.proxy_uid, config.proxy_gid) == ("REDIRECT", ("1337",), ("1337",))
    assert config.ip_ranges_include == ("*",) and config.ip_ranges_exclude == ()
    assert config.outbound_ports_exclude == (15020,) and config.outbound_ports == ()
    assert (config.proxy_port, config.inbound_capture_port, config.inbound_tunnel_port) == (
        15001,
        15006,
        15008,
    )
    assert not (config.redirect_dns or config.capture_all_dns or config.drop_invalid or config.enable_ipv6)


def test_dns_capture_is_capture_all() -> None:
    config = redirect(proxy_env={"ISTIO_META_DNS_CAPTURE": "true"})
    assert config.redirect_dns and config.capture_all_dns


def test_bad_env_flag_only_warns() -> None:
    assert not redirect(proxy_env={"INVALID_DROP": "sometimes"}).drop_invalid


def test_ids_from_the_security_context() -> None:
    config = redirect(security_context={"runAsUser": 1000670000})
    assert (config.proxy_uid, config.proxy_gid) == (("1000670000",), ("1337",))


def test_reroute_interfaces_prefer_the_new_annotation() -> None:
    both = {
        "istio.io/reroute-virtual-interfaces": "eth1",
        "traffic.sidecar.istio.io/kubevirtInterfaces": "eth2",
    }
    assert redirect(annotations=both).reroute_interfaces == ("eth1",)
    old = {"traffic.sidecar.istio.io/kubevirtInterfaces": "eth2,eth3"}
    assert redirect(annotations=old).reroute_interfaces == ("eth2", "eth3")


def test_owner_groups_and_loopback_come_from_the_plugins_env() -> None:
    env = {"ISTIO_OUTBOUND_OWNER_GROUPS": "java,202", "ISTIO_META_DNS_CAPTURE": "true"}
    config = capture_config(sidecar_pod(), env)
    assert config.owner_groups_include == ("java", "202")
    assert not config.redirect_dns  # the plugin's own env does not decide the pod's DNS capture


@pytest.mark.parametrize(
    ("annotation", "value"),
    [
        ("traffic.sidecar.istio.io/includeOutboundIPRanges", "10.0.0.0/8, 11.0.0.0/8"),
        ("traffic.sidecar.istio.io/excludeOutboundIPRanges", "10.0.0.1"),
        ("traffic.sidecar.istio.io/includeInboundPorts", "http"),
        ("traffic.sidecar.istio.io/excludeOutboundPorts", "70000"),
        ("traffic.sidecar.istio.io/excludeInterfaces", "a-very-long-interface-name"),
        ("istio.io/reroute-virtual-interfaces", "0eth"),
        ("sidecar.istio.io/interceptionMode", "NONE"),
    ],
)
def test_bad_annotation_names_itself(annotation: str, value: str) -> None:
    with pytest.raises(ConfigError, match=annotation):
        redirect(annotations={annotation: value})


@pytest.mark.parametrize(
    "annotation, value",
    [
        # an IPv6 zone may hold any text: it must never reach the iptables-restore input
        (
            "traffic.sidecar.istio.io/excludeOutboundIPRanges",
            "fe80::1%lo\nCOMMIT\n*filter\n-I OUTPUT 1 -j ACCEPT/128",
        ),
        ("traffic.sidecar.istio.io/includeOutboundIPRanges", "fe80::1%eth0/64"),
        ("traffic.sidecar.istio.io/excludeOutboundPorts", "\u00b2"),  # a digit to str.isdigit, not a port
        ("traffic.sidecar.istio.io/includeInboundPorts", "\u0663\u0663"),
    ],
)
def test_annotations_that_could_smuggle_text_into_rules_are_refused(
    tmp_path: Path, annotation: str, value: str
) -> None:
    with pytest.raises(PluginError, match=re.escape(annotation)):
        programmed(tmp_path, sidecar_pod(annotations={annotation: value}))
