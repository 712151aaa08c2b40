"""``pilot-agent istio-iptables``'s flags of Istio 1.28 beyond the rule set, for real: where the rules
go (``--network-namespace``), which backend (``--force-iptables-binary``, ``--native-nftables``),
``--force-apply``, ``--cni-mode``, and the injection template's command lines.

The command runs as a process of this interpreter, mostly from the test's own namespace with
``--network-namespace`` naming a pod namespace of the test's (so no uid switch is needed: the
validation tests apply the rules with ``-u 0``, making root the proxy whose dials are redirected).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from istio_agent.cni.iptables import NODE_LOCK
from tests.cni.netns import Netns, needs_root, netns
from tests.cni.test_old_iptables import node_lock_held

pytestmark = [needs_root, pytest.mark.e2e]
ISTIO_INIT = ["-p", "15001", "-z", "15006", "-u", "1337", "-m", "REDIRECT", "-i", "*", "-x", "", "-b", "*"]
ISTIO_INIT += ["-d", "15090,15021,15020", "--log_output_level=default:info"]
# what the 1.28 injection template renders with forceApplyIptables and nativeNftables on (istio-init),
# and with the CNI and nativeNftables on (istio-validation); see tests/cli/test_istio_iptables.py
TEMPLATE_INIT = [*ISTIO_INIT, "--force-apply", "--native-nftables"]
TEMPLATE_VALIDATION = [*ISTIO_INIT, "--run-validation", "--skip-rule-apply", "--native-nftables"]


def istio_iptables(*args: str, inside: Netns | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    """The command, from this namespace (or ``inside`` one, through ``ip netns exec``)."""
    argv = [sys.executable, "-m", "istio_agent.cli.pilot_agent", "istio-iptables", *args]
    if inside is not None:
        argv = ["ip", "netns", "exec", inside.name, *argv]
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"], **env},
        cwd="/",
        timeout=60,
        check=False,
    )


def as_proxy(args: list[str]) -> list[str]:
    """The same command line with root as the proxy's uid (``-u 0``): root's dials get captured."""
    index = args.index("-u")
    return [*args[: index + 1], "0", *args[index + 2 :]]


@pytest.fixture
def pod() -> Iterator[Netns]:
    with netns() as space:
        yield space


def saved(pod: Netns, flavor: str, *flags: str) -> str:
    return pod.exec(f"iptables-{flavor}-save", *flags)


def test_network_namespace_applies_there_and_cleans_up_there(pod: Netns) -> None:
    here = subprocess.run(["iptables-save"], capture_output=True, text=True, check=True).stdout.count("ISTIO")
    where = ["--network-namespace", str(pod.path), "--force-iptables-binary", "nft"]
    applied = istio_iptables(*ISTIO_INIT, *where)
    assert applied.returncode == 0, applied.stderr
    assert "iptables rules applied" in applied.stdout
    assert "-A ISTIO_OUTPUT -j ISTIO_REDIRECT" in saved(pod, "nft")
    assert subprocess.run(["iptables-save"], capture_output=True, text=True).stdout.count("ISTIO") == here

    cleaned = istio_iptables(*ISTIO_INIT, *where, "--cleanup-only")
    assert cleaned.returncode == 0, cleaned.stderr
    assert "ISTIO" not in saved(pod, "nft")


def test_a_missing_network_namespace_is_one_line(tmp_path: Path) -> None:
    failed = istio_iptables(*ISTIO_INIT, "--network-namespace", str(tmp_path / "gone"))
    assert failed.returncode == 255
    assert failed.stderr.startswith("Error: cannot read the addresses of network namespace")
    assert "does not exist" in failed.stderr and "Traceback" not in failed.stderr


@pytest.mark.parametrize(("forced", "other"), [("legacy", "nft"), ("nft", "legacy")])
def test_force_iptables_binary_writes_with_that_iptables(pod: Netns, forced: str, other: str) -> None:
    applied = istio_iptables(*ISTIO_INIT, "--network-namespace", str(pod.path), FORCE_IPTABLES_BINARY=forced)
    assert applied.returncode == 0, applied.stderr
    assert f"iptables-{forced}" in applied.stdout
    assert ":ISTIO_OUTPUT" in saved(pod, forced)
    assert "ISTIO" not in saved(pod, other)


def nat_output_jump_packets(pod: Netns) -> int:
    """The packet counter of nat OUTPUT's jump to ISTIO_OUTPUT."""
    match = re.search(r"^\[(\d+):\d+\] -A OUTPUT -j ISTIO_OUTPUT$", saved(pod, "nft", "-c"), re.M)
    assert match, saved(pod, "nft", "-c")
    return int(match.group(1))


def test_force_apply_writes_rules_that_look_in_place_anew(pod: Netns) -> None:
    """Istio's break-glass (#52899): without it an identical re-run writes nothing (counters keep
    counting); with it the rules are written again (the counters start over)."""
    where = ["--network-namespace", str(pod.path), "--force-iptables-binary", "nft"]
    assert istio_iptables(*ISTIO_INIT, *where).returncode == 0
    with pod.socket() as client:
        client.settimeout(1)
        client.connect_ex(("127.0.0.1", 9))
    assert nat_output_jump_packets(pod) == 1

    again = istio_iptables(*ISTIO_INIT, *where)
    assert "iptables rules unchanged" in again.stdout, again.stdout + again.stderr
    assert nat_output_jump_packets(pod) == 1

    forced = istio_iptables(*ISTIO_INIT, *where, "--force-apply")
    assert forced.returncode == 0, forced.stderr
    assert "iptables rules applied" in forced.stdout
    assert nat_output_jump_packets(pod) == 0
    assert saved(pod, "nft").count("-A OUTPUT -j ISTIO_OUTPUT") == 1


def test_the_templates_istio_init_then_istio_validation_with_native_nftables(pod: Netns) -> None:
    """istio-init with --force-apply --native-nftables writes Istio's nftables tables; the
    istio-validation container's args (with --native-nftables) then find the traffic captured."""
    where = ["--network-namespace", str(pod.path)]
    init = istio_iptables(*as_proxy(TEMPLATE_INIT), *where)
    assert init.returncode == 0, init.stdout + init.stderr
    assert "nftables rules applied" in init.stdout
    assert "table inet istio-proxy-nat" in pod.exec("nft", "list", "ruleset")
    assert "ISTIO" not in saved(pod, "nft") + saved(pod, "legacy")

    validated = istio_iptables(*TEMPLATE_VALIDATION, *where, "--probe-timeout=3s")
    assert validated.returncode == 0, validated.stdout + validated.stderr
    assert "validation passed" in validated.stdout


def test_validation_with_network_namespace_checks_that_namespace(pod: Netns) -> None:
    where = ["--network-namespace", str(pod.path)]
    uncaptured = istio_iptables(*TEMPLATE_VALIDATION, *where, "--probe-timeout=300ms")
    assert uncaptured.returncode == 126, uncaptured.stdout + uncaptured.stderr
    assert istio_iptables(*as_proxy(ISTIO_INIT), *where).returncode == 0
    validated = istio_iptables(*TEMPLATE_VALIDATION[:-1], *where, "--probe-timeout=3s")
    assert validated.returncode == 0, validated.stdout + validated.stderr


def test_cni_mode_never_waits_for_the_nodes_xtables_lock(pod: Netns) -> None:
    """Run inside the pod's namespace but on the node's filesystem, as Istio's CNI mode: the writes
    lock the namespace, so kube-proxy holding the node's lock does not hold them up."""
    started = time.monotonic()
    with node_lock_held():
        applied = istio_iptables(*ISTIO_INIT, "--cni-mode", "--force-iptables-binary=legacy", inside=pod)
    assert applied.returncode == 0, applied.stderr
    assert time.monotonic() - started < 10  # a wait for the lock would be --wait=30
    assert ":ISTIO_OUTPUT" in saved(pod, "legacy")
    assert NODE_LOCK.exists()
