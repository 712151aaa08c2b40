"""``agentctl cni check``: the rules a pod should have against those in its network namespace.

Real iptables in network namespaces the tests create (root only); the pods are plain objects in
files, as ``kubectl get pod -o json`` prints them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from istio_agent.cli.agentctl import main
from istio_agent.cni import redirect
from istio_agent.cni.apply import apply_capture
from istio_agent.cni.check import compare
from tests.cni.fake_kube import sidecar_pod
from tests.cni.netns import Netns, needs_root, netns

DEFAULT_POD_RULES = "-A ISTIO_OUTPUT -d 127.0.0.1/32 -j RETURN"


def check(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["cni", "check", *args])
    return result.exit_code, result.stdout, result.stderr


def pod_file(tmp_path: Path, pod: dict[str, Any]) -> Path:
    path = tmp_path / "pod.json"
    path.write_text(json.dumps(pod))
    return path


@pytest.fixture
def pod_ns() -> Iterator[Netns]:
    with netns() as space:
        space.ip("address", "add", "10.78.0.2/24", "dev", "lo")
        yield space


def test_compare_names_missing_leftover_and_misplaced_rules() -> None:
    expected = {"nat": {"ISTIO_OUTPUT": ["a", "b", "c"], "ISTIO_INBOUND": ["x"]}}
    installed = {"nat": {"ISTIO_OUTPUT": ["c", "b", "d"], "ISTIO_DIVERT": ["y"]}}
    found = [(d.kind, d.chain, d.rule) for d in compare("v4", expected, installed)]
    misplaced = [rule for kind, _, rule in found if kind == "misplaced"]
    assert len(misplaced) == 1 and misplaced[0] in ("b", "c")  # moving one of them restores the order
    assert {entry for entry in found if entry[0] != "misplaced"} == {
        ("missing-chain", "ISTIO_INBOUND", ""),
        ("missing", "ISTIO_INBOUND", "x"),
        ("unexpected-chain", "ISTIO_DIVERT", ""),
        ("unexpected", "ISTIO_DIVERT", "y"),
        ("missing", "ISTIO_OUTPUT", "a"),
        ("unexpected", "ISTIO_OUTPUT", "d"),
    }
    assert compare("v4", expected, expected) == []


def test_a_rule_installed_twice_is_one_leftover_copy() -> None:
    expected = {"nat": {"ISTIO_INBOUND": ["a", "b"]}}
    installed = {"nat": {"ISTIO_INBOUND": ["a", "b", "a"]}}
    assert [(d.kind, d.rule) for d in compare("v4", expected, installed)] == [("unexpected", "a")]
    assert [(d.kind, d.rule) for d in compare("v4", installed, expected)] == [("missing", "a")]


@needs_root
def test_a_pod_with_its_rules_matches(pod_ns: Netns, tmp_path: Path) -> None:
    pod = sidecar_pod(annotations={"traffic.sidecar.istio.io/excludeInboundPorts": "3306"})
    apply_capture(redirect.capture_config(pod, {}), netns=pod_ns.path)
    code, out, err = check(str(pod_ns.path), "--pod", str(pod_file(tmp_path, pod)))
    assert code == 0, out + err
    assert "OK: the installed rules are exactly the expected ones" in out
    assert "the pod is injected" in out


@needs_root
def test_missing_and_leftover_rules_are_listed(pod_ns: Netns) -> None:
    apply_capture(redirect.capture_config(sidecar_pod(), {}), netns=pod_ns.path)
    pod_ns.exec("iptables", "-t", "nat", "-D", "ISTIO_OUTPUT", "-d", "127.0.0.1/32", "-j", "RETURN")
    pod_ns.exec(
        "iptables", "-t", "nat", "-I", "ISTIO_INBOUND", "1", "-p", "tcp", "--dport", "3306", "-j", "RETURN"
    )
    code, out, _ = check(str(pod_ns.path))  # no pod: the default injected pod's rules
    assert code == 1
    lines = out.splitlines()
    assert any(
        line.startswith("MISSING") and "v4 nat ISTIO_OUTPUT  -d 127.0.0.1/32 -j RETURN" in line
        for line in lines
    )
    assert any(line.startswith("LEFTOVER") and "ISTIO_INBOUND" in line and "3306" in line for line in lines)
    assert lines[-1] == "2 difference(s)"


@needs_root
def test_rules_of_an_old_config_show_in_json(pod_ns: Netns, tmp_path: Path) -> None:
    """The namespace holds the default rules; the pod now asks for TPROXY."""
    apply_capture(redirect.capture_config(sidecar_pod(), {}), netns=pod_ns.path)
    pod = sidecar_pod(annotations={"sidecar.istio.io/interceptionMode": "TPROXY"})
    code, out, _ = check(str(pod_ns.path), "--pod", str(pod_file(tmp_path, pod)), "-o", "json")
    assert code == 1
    report = json.loads(out)
    assert report["matches"] is False
    kinds = {(d["kind"], d["table"], d["chain"]) for d in report["differences"]}
    assert ("missing-chain", "mangle", "ISTIO_TPROXY") in kinds
    assert ("unexpected", "nat", "ISTIO_INBOUND") in kinds


@needs_root
def test_a_pod_that_is_not_injected_should_have_no_rules(pod_ns: Netns, tmp_path: Path) -> None:
    plain = sidecar_pod(proxy=False)
    path = pod_file(tmp_path, plain)
    code, out, _ = check(str(pod_ns.path), "--pod", str(path))
    assert code == 0, out
    assert "no capture expected" in out
    apply_capture(redirect.capture_config(sidecar_pod(), {}), netns=pod_ns.path)
    code, out, _ = check(str(pod_ns.path), "--pod", str(path))
    assert code == 1
    assert "LEFTOVER CHAIN" in out


@needs_root
def test_a_pid_names_its_network_namespace(pod_ns: Netns) -> None:
    apply_capture(redirect.capture_config(sidecar_pod(), {}), netns=pod_ns.path)
    sleeper = subprocess.Popen(["ip", "netns", "exec", pod_ns.name, "sleep", "30"])
    try:
        for _ in range(200):  # until ip has entered the namespace and exec'd sleep
            if Path(f"/proc/{sleeper.pid}/comm").read_text().strip() == "sleep":
                break
        code, out, _ = check(str(sleeper.pid))
        assert code == 0, out
        assert f"/proc/{sleeper.pid}/ns/net" in out
    finally:
        sleeper.kill()
        sleeper.wait()


def test_bad_targets_and_pods_are_errors(tmp_path: Path) -> None:
    code, _, err = check("/nonexistent/netns")
    assert code == 2 and "no such network namespace" in err
    code, _, err = check("999999999")
    assert code == 2 and "no such process" in err
    bad = tmp_path / "pod.yaml"
    bad.write_text("kind: Service\n")
    code, _, err = check("/proc/self/ns/net", "--pod", str(bad))
    assert code == 2 and "not a Pod object" in err
    annotated = pod_file(tmp_path, sidecar_pod(annotations={"sidecar.istio.io/interceptionMode": "MAGIC"}))
    code, _, err = check("/proc/self/ns/net", "--pod", str(annotated))
    assert code == 2 and "interceptionMode" in err
    code, _, err = check("/proc/self/ns/net", "--pod", str(annotated), "--pod-name", "a/b")
    assert code == 2 and "not both" in err


def test_the_command_is_installed() -> None:
    agentctl = Path(sys.executable).parent / "agentctl"
    done = subprocess.run(
        [str(agentctl), "cni", "check", "--help"], capture_output=True, text=True, check=True
    )
    assert "TARGET" in done.stdout


def test_an_istio_init_pod_is_expected_in_the_injectors_port_order() -> None:
    """istio-init gets ``-d 15090,15021,<excludeInboundPorts>,15020`` and ``-o`` only from the
    annotation; the plugin's own order and default outbound exclusion do not apply to it."""
    from istio_agent.ctl.cnicheck import expected_config

    pod = sidecar_pod(
        init_containers=[{"name": "istio-init"}],
        annotations={"traffic.sidecar.istio.io/excludeInboundPorts": "3306"},
    )
    config, why = expected_config(pod, {})
    assert config is not None and "istio-init" in why
    assert config.inbound_ports_exclude == (15090, 15021, 3306, 15020)
    assert config.outbound_ports_exclude == ()
    injected, _ = expected_config(
        sidecar_pod(annotations={"traffic.sidecar.istio.io/excludeInboundPorts": "3306"}), {}
    )
    assert injected is not None
    assert injected.inbound_ports_exclude == (3306, 15020, 15021, 15090)
    assert injected.outbound_ports_exclude == (15020,)
