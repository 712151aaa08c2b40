"""End to end: ``agentctl proxy-status`` against the local control plane and through two real agents.

Two workloads run ``pilot-agent proxy`` with a real Envoy (each agent's debug tap on a port of its
own); the command asks the control plane directly over TLS with a token (the plaintext port is
refused, as istiod refuses it) and through both agents' taps, which put the question on their
workload's own authenticated stream. A dead agent address is reported on stderr in istioctl's words
and the others are still listed. A listener Envoy cannot take shows as a real NACK: LDS in ERROR with
Envoy's text, until the mesh file is fixed.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from istio_agent.controlplane.tokens import mint_token
from istio_agent.ctl.local import free_port, wait_until
from istio_agent.ctl.localmesh import LocalMesh, Service, Workload

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def agentctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "istio_agent.cli.agentctl", "proxy-status", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def mesh(short_tmp: Path) -> Iterator[LocalMesh]:
    workloads = [Workload("a", short_tmp / "a", calls=["b"]), Workload("b", short_tmp / "b", backs=["b"])]
    local = LocalMesh(short_tmp, [Service("b", 8000)], workloads)
    try:
        local.start_controlplane()
        for workload in workloads:
            local.start_workload(workload)
        a, b = local.workload("a"), local.workload("b")
        local.wait_for_config(
            a, lambda seen: f"127.0.0.1_{a.outbound_port('b')}" in seen["listeners"], "listeners"
        )
        local.wait_for_config(
            b, lambda seen: any(n.startswith("inbound_") for n in seen["listeners"]), "inbound"
        )
        yield local
    finally:
        local.stop()


def rows(stdout: str) -> dict[str, list[str]]:
    """The table's cells by column offsets (a cell may be empty, e.g. CLUSTER without a cluster ID)."""
    lines = stdout.splitlines()
    names = ["NAME", "CLUSTER", "ISTIOD", "VERSION", "SUBSCRIBED TYPES"]
    assert re.split(r"\s{2,}", lines[0]) == names, stdout
    starts = [lines[0].index(name) for name in names] + [None]
    table = {}
    for line in lines[1:]:
        cells = [line[starts[i] : starts[i + 1]].strip() for i in range(len(names))]
        table[cells[0]] = cells
    return table


def synced(mesh: LocalMesh, *args: str) -> subprocess.CompletedProcess[str]:
    """proxy-status once both proxies have ACKed everything (Envoy ACKs shortly after it applies)."""
    done: subprocess.CompletedProcess[str] | None = None

    def ready() -> bool:
        nonlocal done
        done = agentctl(*args, "-v")
        lines = done.stdout.splitlines()[1:3]
        return done.returncode == 0 and len(lines) == 2 and all("STALE" not in line for line in lines)

    wait_until(ready, 30, "both proxies to be in sync")
    assert done is not None
    return done


def test_proxy_status_direct_and_through_two_agents(mesh: LocalMesh, short_tmp: Path) -> None:
    a, b = mesh.workload("a"), mesh.workload("b")
    token = short_tmp / "istioctl-token"
    token.write_text(mint_token(mesh.state_dir, "istio-system", "default"))
    tls = (
        "--xds-address",
        mesh.discovery_address,
        "--root-cert",
        str(mesh.state_dir / "root-cert.pem"),
        "--token",
        str(token),
    )

    verbose = synced(mesh, *tls)
    head = verbose.stdout.splitlines()[0].split()
    assert head[:6] == ["NAME", "CLUSTER", "CDS", "ECDS", "EDS", "LDS"]
    for line in verbose.stdout.splitlines()[1:3]:
        assert "SYNCED (" in line and "IGNORED" in line  # ECDS is not used here

    direct = agentctl(*tls)
    assert direct.returncode == 0, direct.stderr
    table = rows(direct.stdout)
    assert sorted(table) == ["a.default", "b.default"]
    assert table["a.default"][2] == "agentctl-controlplane"
    assert table["a.default"][4] == "5 (CDS,LDS,EDS,RDS,NDS)"

    as_json = agentctl(*tls, "-o", "json")
    assert as_json.returncode == 0, as_json.stderr
    answer = json.loads(as_json.stdout)  # the control plane's DiscoveryResponse, as istioctl prints it
    assert json.loads(answer["controlPlane"]["identifier"])["ID"] == "agentctl-controlplane"
    assert sorted(r["node"]["id"] for r in answer["resources"]) == ["a.default", "b.default"]

    # As istiod (ENABLE_DEBUG_ENDPOINT_AUTH): no debug answers on the plaintext port, which proves no identity
    plain = agentctl("--xds-address", f"127.0.0.1:{mesh.port}", "--plaintext")
    assert plain.returncode == 1 and plain.stdout == ""
    assert f"control plane 127.0.0.1:{mesh.port}: UNAUTHENTICATED: authentication required (" in plain.stderr

    dead = f"127.0.0.1:{free_port()}"
    via = agentctl(
        "--xds-via-agents",
        "--agent-address",
        f"a.default=127.0.0.1:{a.ports['tap']}",
        "--agent-address",
        f"b.default=127.0.0.1:{b.ports['tap']}",
        "--agent-address",
        f"gone.default={dead}",
        "--timeout",
        "3s",
    )
    assert via.returncode == 0, via.stderr
    assert rows(via.stdout) == table
    assert via.stderr.startswith("Skip the agent in Pod gone.default due to the error: "), via.stderr

    one_namespace = agentctl(
        "--xds-via-agents", f"--agent-address=b.default=127.0.0.1:{b.ports['tap']}", "-n", "x"
    )
    assert one_namespace.returncode == 0 and rows(one_namespace.stdout) == {}

    # The tap's HTTP side answers the same question as JSON.
    with urllib.request.urlopen(f"http://127.0.0.1:{a.ports['tap']}/debug/syncz", timeout=10) as response:
        assert response.headers["Content-Type"] == "application/json"
        body = json.load(response)
    assert sorted(r["node"]["id"] for r in body["resources"]) == ["a.default", "b.default"]


def test_a_listener_envoy_rejects_is_error_with_envoys_text_until_the_mesh_is_fixed(
    mesh: LocalMesh, short_tmp: Path
) -> None:
    """A real NACK: the mesh file moves a's outbound listener to a port another socket holds (without
    SO_REUSEPORT), so a's Envoy cannot bind it and rejects the LDS update; proxy-status shows LDS in
    ERROR with Envoy's text, directly and through the agents, until the mesh file is fixed."""
    a, b = mesh.workload("a"), mesh.workload("b")
    token = short_tmp / "istioctl-token"
    token.write_text(mint_token(mesh.state_dir, "istio-system", "default"))
    tls = ("--xds-address", mesh.discovery_address, "--root-cert", str(mesh.state_dir / "root-cert.pem"))
    tls += ("--token", str(token))
    agents = tuple(f"--agent-address={w.name}.default=127.0.0.1:{w.ports['tap']}" for w in (a, b))
    synced(mesh, *tls)

    def lds_cell(done: subprocess.CompletedProcess[str]) -> str:
        lines = done.stdout.splitlines()
        start = lines[0].index(" LDS ") + 1  # cells start where their header does (CLUSTER may be empty)
        row = next(line for line in lines[1:] if line.startswith("a.default "))
        return row[start:].split("  ")[0]

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        a.ports["outbound:b"] = taken
        mesh.update_mesh()
        seen: dict[str, subprocess.CompletedProcess[str]] = {}

        def rejected() -> bool:
            seen["direct"] = agentctl(*tls, "-v", "1")
            return seen["direct"].returncode == 0 and lds_cell(seen["direct"]).startswith("ERROR (")

        wait_until(rejected, 30, "LDS in ERROR after Envoy's NACK")
        direct = seen["direct"]
        assert re.search(rf"^a\.default rejected LDS \S+ ago: .*127\.0\.0\.1:{taken}", direct.stderr, re.M), (
            direct.stderr
        )
        via = agentctl("--xds-via-agents", *agents, "-v")
        assert via.returncode == 0, via.stderr
        assert lds_cell(via).startswith("ERROR (")
        assert f"127.0.0.1:{taken}" in via.stderr
        as_json = json.loads(agentctl(*tls, "-o", "json").stdout)
        errors = [
            config["errorState"]["details"]
            for proxy in as_json["resources"]
            if proxy["node"]["id"] == "a.default"
            for config in proxy["genericXdsConfigs"]
            if config["configStatus"] == "ERROR"
        ]
        assert len(errors) == 1 and f"127.0.0.1:{taken}" in errors[0]

    a.ports["outbound:b"] = free_port()
    mesh.update_mesh()
    wait_until(lambda: lds_cell(agentctl(*tls, "-v")).startswith("SYNCED ("), 30, "LDS synced again")
