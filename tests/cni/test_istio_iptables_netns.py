"""``pilot-agent istio-iptables`` for real, inside a pod namespace, as the istio-init and
istio-validation containers run it (the latter as uid 1337)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cni.as_user import as_user
from tests.cni.netns import Netns, needs_root, netns, pod_and_peer

pytestmark = [needs_root, pytest.mark.e2e]
ISTIO_INIT = ["-p", "15001", "-z", "15006", "-u", "1337", "-m", "REDIRECT", "-i", "*", "-x", "", "-b", "*"]
ISTIO_INIT += ["-d", "15090,15021,15020", "--log_output_level=default:info"]
SRC = Path(__file__).resolve().parents[2] / "src"


def istio_iptables(pod: Netns, *args: str, uid: int = 0) -> subprocess.CompletedProcess[str]:
    """The command in ``pod`` with this interpreter: as root, or as ``uid`` as its container runs it
    (``as_user``: the interpreter, venv and sources within its reach, wherever the checkout is)."""
    command = [sys.executable, "-m", "istio_agent.cli.pilot_agent", "istio-iptables", *args]
    env = {"PATH": os.environ["PATH"]}
    if uid:
        needs = (Path(sys.executable), Path(sys.prefix), Path(sys.base_prefix), SRC)
        command = [*as_user(uid, needs), *command]
    return subprocess.run(
        ["ip", "netns", "exec", pod.name, *command],
        capture_output=True,
        text=True,
        env=env,
        cwd="/",
        timeout=30,
        check=False,
    )


@pytest.fixture
def pod() -> Iterator[Netns]:
    with netns() as space:
        yield space


def test_apply_rerun_and_cleanup_only(pod: Netns) -> None:
    first = istio_iptables(pod, *ISTIO_INIT)
    assert first.returncode == 0, first.stderr
    assert "iptables rules applied" in first.stdout
    assert "-A ISTIO_OUTPUT -j ISTIO_REDIRECT" in first.stdout  # the resulting rules are logged
    assert "ISTIO_REDIRECT" in pod.exec("iptables-save")

    again = istio_iptables(pod, *ISTIO_INIT)
    assert again.returncode == 0, again.stderr
    assert "iptables rules unchanged" in again.stdout

    cleaned = istio_iptables(pod, *ISTIO_INIT, "--cleanup-only")
    assert cleaned.returncode == 0, cleaned.stderr
    assert "iptables rules cleaned" in cleaned.stdout
    assert "ISTIO" not in pod.exec("iptables-save")


def test_validation_passes_once_the_rules_capture_and_exits_126_without_them(pod: Netns) -> None:
    uncaptured = istio_iptables(
        pod, "--run-validation", "--skip-rule-apply", "--probe-timeout=300ms", uid=1337
    )
    assert uncaptured.returncode == 126, uncaptured.stderr
    assert "validation failed" in uncaptured.stdout

    assert istio_iptables(pod, *ISTIO_INIT).returncode == 0
    validated = istio_iptables(pod, "--run-validation", "--skip-rule-apply", uid=1337)
    assert validated.returncode == 0, validated.stdout + validated.stderr
    assert "validation passed" in validated.stdout


def test_ipv6_rules_follow_the_pods_addresses_with_dual_stack() -> None:
    with pod_and_peer(ipv6=True) as (pod, _):
        applied = istio_iptables(pod, *ISTIO_INIT, "--dual-stack")
        assert applied.returncode == 0, applied.stderr
        assert "IPv6 on" in applied.stdout
        assert "-A ISTIO_OUTPUT -s ::6/128 -o lo -j RETURN" in applied.stdout
        # istio-validation of an IPv6 pod: dials [::6]:15002, REDIRECT lands it on [::1]:15006
        validated = istio_iptables(pod, "--run-validation", "--skip-rule-apply", "--dual-stack", uid=1337)
        assert validated.returncode == 0, validated.stdout + validated.stderr
        assert "validation passed" in validated.stdout


def test_a_failed_apply_is_exit_255_with_the_command_named(pod: Netns) -> None:
    failed = istio_iptables(pod, *ISTIO_INIT, "-c", "an-interface-name-too-long")
    assert failed.returncode == 255
    assert failed.stderr.startswith("Error: ")
    assert "iptables" in failed.stderr and "an-interface-name-too-long" in failed.stderr
    assert "ISTIO" not in pod.exec("iptables-save")
