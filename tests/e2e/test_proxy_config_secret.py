"""End to end: ``agentctl proxy-config secret`` against a real Envoy and its agent, across a rotation.

One workload of the local mesh (pilot-agent + Envoy, certificates from the local control plane's CA,
a short SECRET_TTL, OUTPUT_CERTS on). The table read from Envoy's admin shows the agent's
certificate as valid with a verified chain, ``--diff`` agrees with the agent and the files on disk;
a config dump saved before the agent rotated is then the case operators hunt: Envoy holding the old
certificate while the agent and the files have the new one.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from istio_agent.ctl.local import free_port, wait_until
from istio_agent.ctl.localmesh import LocalMesh, Service, Workload
from istio_agent.ctl.secretsview import SUMMARY_COLUMNS

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

TTL_SECONDS = (
    24  # rotation at half of it: late enough to look at the first certificate, soon enough to wait for
)


def agentctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "istio_agent.cli.agentctl", "proxy-config", "secret", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def envoy_serial(admin_port: int) -> str | None:
    """The serial of Envoy's active ``default``, read through the command itself (-o items)."""
    done = agentctl(f"127.0.0.1:{admin_port}", "-o", "items")
    if done.returncode != 0:
        return None
    items = {item["resource_name"]: item for item in json.loads(done.stdout) if item["state"] == "ACTIVE"}
    return items["default"]["serial_number"] if "default" in items and "ROOTCA" in items else None


@pytest.fixture
def mesh(short_tmp: Path) -> Iterator[LocalMesh]:
    env = {
        "SECRET_TTL": f"{TTL_SECONDS}s",
        "SECRET_GRACE_PERIOD_RATIO_JITTER": "0",
        "OUTPUT_CERTS": str(short_tmp / "b" / "out"),
    }
    local = LocalMesh(
        short_tmp, [Service("b", 8000)], [Workload("b", short_tmp / "b", backs=["b"])], agent_env=env
    )
    try:
        yield local
    finally:
        local.stop()


def test_table_and_diff_agree_then_a_stale_envoy_is_a_mismatch(mesh: LocalMesh, short_tmp: Path) -> None:
    b = mesh.workload("b")
    admin, agent = f"127.0.0.1:{b.ports['admin']}", f"127.0.0.1:{b.ports['status']}"
    out_dir = short_tmp / "b" / "out"
    mesh.start_controlplane()
    mesh.start_workload(b)
    serial: str | None = None

    def envoy_has_its_secrets() -> bool:
        nonlocal serial
        mesh.processes.alive()
        serial = envoy_serial(b.ports["admin"])
        return serial is not None

    wait_until(envoy_has_its_secrets, 60, "Envoy to hold default and ROOTCA", interval=0.5)

    # The table, as istioctl prints it, from Envoy's admin.
    done = agentctl(admin, "-v")
    assert done.returncode == 0, done.stderr
    header, *rows = done.stdout.splitlines()
    assert re.split(r"\s{2,}", header) == [*SUMMARY_COLUMNS, "EXPIRES", "CHAIN"]
    by_name = {row.split()[0]: row.split() for row in rows}
    assert by_name["default"][1:5] == ["Cert", "Chain", "ACTIVE", "true"]
    assert by_name["default"][-1] == "verified" and by_name["default"][-3] == "in"
    assert by_name["ROOTCA"][1:4] == ["CA", "ACTIVE", "true"]
    assert done.stderr == ""

    # --diff: Envoy, the agent and the files agree (retried: a rotation may land in between).
    agreed: list[subprocess.CompletedProcess[str]] = []

    def diff_agrees() -> bool:
        result = agentctl(admin, "--diff", "--agent", agent)
        assert result.returncode == 0, result.stderr
        agreed[:] = [result]
        return "MISMATCH" not in result.stderr

    wait_until(diff_agrees, 30, "--diff to agree", interval=0.5)
    table, files = agreed[0].stdout.split("\n\n")
    rows = [line.split() for line in table.splitlines()[1:]]
    assert {(row[0], row[-5]) for row in rows} == {("default", agent), ("ROOTCA", agent)}  # NODE AGENT
    assert {line.split()[0]: line.split()[-1] for line in files.splitlines()[1:]} == {
        str(out_dir / "cert-chain.pem"): "SAME",
        str(out_dir / "root-cert.pem"): "SAME",
    }

    # Save what Envoy holds now, then let the agent rotate (and push).
    with urllib.request.urlopen(f"http://{admin}/config_dump", timeout=5) as response:
        saved = short_tmp / "before-rotation.json"
        saved.write_bytes(response.read())
    before = envoy_serial(b.ports["admin"])
    wait_until(
        lambda: envoy_serial(b.ports["admin"]) not in (None, before),
        TTL_SECONDS + 15,
        "a rotation",
        interval=0.5,
    )

    # Envoy "still holding the old certificate": the saved dump against the agent and the files now.
    stale = agentctl("-f", str(saved), "--diff", "--agent", agent, "-o", "json")
    assert stale.returncode == 0, stale.stderr
    document = json.loads(stale.stdout)
    defaults = [
        (row["agent"], row["proxy"], row["serial_number"])
        for row in document["secrets"]
        if row["resource_name"] == "default"
    ]
    assert ("", "ACTIVE", before) in defaults
    assert any(agent_side == "PRESENT" and proxy == "" and sn != before for agent_side, proxy, sn in defaults)
    assert f"MISMATCH default: Envoy holds serial {before}, the agent holds serial" in stale.stderr
    files_verdict = {f["path"]: f["envoy"] for f in document["files"]}
    assert files_verdict[str(out_dir / "cert-chain.pem")] == "DIFFERENT"
    assert files_verdict[str(out_dir / "root-cert.pem")] == "SAME"
    as_yaml = agentctl("-f", str(saved), "--diff", "--agent", agent, "-o", "yaml")
    assert as_yaml.returncode == 0, as_yaml.stderr
    assert yaml.safe_load(as_yaml.stdout)["files"] == document["files"]

    # And the live Envoy, which did get the push, agrees again.
    wait_until(diff_agrees, 30, "--diff to agree after the rotation", interval=0.5)


def test_bad_addresses_and_files(short_tmp: Path) -> None:
    port = free_port()
    done = agentctl(f"127.0.0.1:{port}", "--timeout", "2")
    assert done.returncode == 1 and "cannot connect" in done.stderr and done.stdout == ""
    not_a_dump = short_tmp / "stats.json"
    not_a_dump.write_text('{"stats": []}')
    done = agentctl("-f", str(not_a_dump))
    assert (
        done.returncode == 1 and str(not_a_dump) in done.stderr and "not an Envoy config dump" in done.stderr
    )
