"""``bench.cni``'s ambient row runs: the real plugin hands each pod to a real node agent (in-pod rules,
host probe set, ZDS server) with the ztunnel stand-in connected, and the bench's own checks (the
sandbox's in-pod rules, the stand-in's workload, its delete once the pod is gone) pass for every pod.

A short run of the bench itself as the operator runs it (``python -m bench.cni``), so the table it
prints is what is checked.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cni.netns import needs_root, netns

ROOT = Path(__file__).resolve().parents[3]
VENV_BIN = Path(sys.executable).parent


def bench(*args: str) -> str:
    """``python -m bench.cni ARGS`` with the venv's plugin; its output (the run must succeed)."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.cni", "--plugin-dir", str(VENV_BIN), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.e2e
@needs_root
@pytest.mark.timeout(300)
def test_the_ambient_row_is_measured_next_to_the_sidecar_row() -> None:
    if shutil.which("ipset") is None:
        pytest.skip("ipset is not installed (Debian's ipset): the node agent's probe set needs it")
    out = bench("--pods", "2")
    row = re.search(r"^\| \(d\) istio-cni ADD, ambient pod[^|]*\| (\d+) \| (\d+) ms \|", out, re.MULTILINE)
    assert row is not None, out
    assert row.group(1) == "2"
    assert re.search(r"^\| \(b\) istio-cni ADD \(sidecar pod, rules applied\) \| 2 \|", out, re.MULTILINE), (
        out
    )
    assert re.search(r"\(d\) istio-cni ADD, ambient pod.*: p50 \d+ ms, p99 \d+ ms = [\d.]+x \(b\)'s", out), (
        out
    )
    enrolment = re.search(r"^\| node agent: enrolment[^|]*\| (\d+) \|", out, re.MULTILINE)
    assert enrolment is not None and enrolment.group(1) == "2", out


@pytest.mark.e2e
@needs_root
@pytest.mark.timeout(300)
def test_without_ambient_the_table_is_as_before() -> None:
    out = bench("--pods", "1", "--no-ambient")
    assert "(d)" not in out and "node agent" not in out
    assert re.search(r"^\| \(b\) istio-cni ADD \(sidecar pod, rules applied\) \| 1 \|", out, re.MULTILINE), (
        out
    )


@needs_root
def test_the_checks_tell_ambients_chains_from_the_sidecars() -> None:
    """The bench's checks after each ADD: a sandbox with only the sidecar's nat chain does not pass for
    an enrolled ambient pod; one with ambient's mangle chain too does."""
    from bench.cni import inpod_rules_applied, rules_applied

    with netns("check") as sandbox:
        assert not rules_applied(sandbox.name) and not inpod_rules_applied(sandbox.name)
        sandbox.exec("iptables-restore", input="*nat\n:ISTIO_OUTPUT - [0:0]\nCOMMIT\n")
        assert rules_applied(sandbox.name) and not inpod_rules_applied(sandbox.name)
        sandbox.exec("iptables-restore", "--noflush", input="*mangle\n:ISTIO_PRERT - [0:0]\nCOMMIT\n")
        assert inpod_rules_applied(sandbox.name)
