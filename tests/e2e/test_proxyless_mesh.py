"""End to end: two proxyless gRPC workloads, each with its own ``pilot-agent`` as the grpc-agent template runs it.

The local control plane serves a grpc service ``echo`` backed by a proxyless server and a proxyless
caller. Each workload has its own directory and agent (``DISABLE_ENVOY``, ``ISTIO_META_GENERATOR=grpc``,
``OUTPUT_CERTS``, a short certificate lifetime) writing its own ``grpc-bootstrap.json``; grpcio's xDS
server and client (separate processes) load those bootstraps, reach the control plane only through
their agent's XDS socket, and take their mTLS certificates from the files their agent keeps fresh.
A caller keeps calling on one channel while the certificates rotate and the control plane is killed
and started again; a fresh caller after both gets through with the rotated certificate. And
``agentctl proxy-status --xds-via-agents`` through both agents' debug taps lists both grpc nodes.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509

from istio_agent.ctl.local import answers_200, free_port, wait_until
from istio_agent.ctl.localmesh import LocalMesh, Workload
from tests.e2e.grpc_apps import CLIENT_ID, TARGET, call_once, calls, mesh_yaml, start_caller, start_server
from tests.e2e.test_proxy_status import agentctl as proxy_status

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

CERT_LIFETIME = "30s"
ROTATE_AFTER_RATIO = "0.85"
"""Rotate when 85% of the lifetime is left: a new certificate every ~4.5 s, each valid 30 s. grpc's
file_watcher re-reads the files only every refresh_interval (900 s, as Istio writes it), so a
process keeps presenting the certificate it loaded at start; a lifetime this long keeps that one
valid for the whole test, as Istio's 24 h certificates rotated at half-life are for 12 h."""


def certs_dir(workload: Workload) -> Path:
    return workload.workdir / "var/lib/istio/data"


def bootstrap(workload: Workload) -> Path:
    return workload.workdir / "etc/istio/proxy/grpc-bootstrap.json"


def serial(workload: Workload) -> str:
    """The serial number (hex) of the leaf certificate the agent last wrote."""
    chain = (certs_dir(workload) / "cert-chain.pem").read_bytes()
    return format(x509.load_pem_x509_certificate(chain).serial_number, "x")


def start_agent(mesh: LocalMesh, workload: Workload) -> None:
    """``pilot-agent proxy sidecar`` with the grpc-agent template's environment, in the workload's directory."""
    mesh.start_agent(
        workload,
        ISTIO_META_GENERATOR="grpc",
        DISABLE_ENVOY="true",
        OUTPUT_CERTS=str(certs_dir(workload)),
        ISTIO_META_DNS_CAPTURE="false",
        SECRET_TTL=CERT_LIFETIME,
        SECRET_GRACE_PERIOD_RATIO=ROTATE_AFTER_RATIO,
    )


def connections(mesh: LocalMesh, workload: Workload) -> int:
    """How many ADS streams with this workload's node the control plane has logged (its log is appended)."""
    node = f"node=sidecar~127.0.0.1~{workload.name}.default~default.svc.cluster.local"
    log = (mesh.base / "controlplane.log").read_text(errors="replace")
    return sum(1 for line in log.splitlines() if "ADS: new" in line and line.endswith(node))


def diagnostics(mesh: LocalMesh) -> str:
    """The ends of the caller's answers, the server's log and each agent's log, for a failed wait."""
    parts = []
    for name in ("caller.out", "server.log", "echo/agent.log", "client/agent.log", "controlplane.log"):
        text = (mesh.base / name).read_text(errors="replace") if (mesh.base / name).exists() else ""
        parts.append(f"--- {name}:\n" + "\n".join(text.splitlines()[-8:]))
    return "\n".join(parts)


@pytest.fixture
def stop_later() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes the test started, terminated at its end whatever happened."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        process.terminate()
        process.wait(10)


@pytest.fixture
def mesh(short_tmp: Path) -> Iterator[LocalMesh]:
    server = Workload("echo-1", short_tmp / "echo", service_account="echo")
    client = Workload("client-1", short_tmp / "client", service_account="client")
    local = LocalMesh(short_tmp, [], [server, client])
    server.ports["app"] = free_port()
    local.mesh_file.write_text(mesh_yaml(server.ports["app"]))
    try:
        local.start_controlplane()
        for workload in (server, client):
            start_agent(local, workload)
        for workload in (server, client):
            url = f"http://127.0.0.1:{workload.ports['status']}/healthz/ready"
            wait_until(
                lambda url=url: local.processes.alive() and answers_200(url),  # type: ignore[misc]
                30,
                f"{workload.name}'s agent to be ready",
            )
        yield local
    finally:
        codes = local.stop()
        for name, code in codes.items():
            assert code == 0, f"{name} exited with {code}:\n{local.processes.log_tail(name)}"


def test_proxyless_calls_through_two_agents_survive_rotation_and_a_control_plane_restart(
    mesh: LocalMesh, stop_later: list[subprocess.Popen[str]]
) -> None:
    server, client = mesh.workload("echo-1"), mesh.workload("client-1")
    with (mesh.base / "server.log").open("w") as server_log, (mesh.base / "caller.out").open("w") as out:
        stop_later.append(start_server(bootstrap(server), server.ports["app"], server_log))
        caller = start_caller(bootstrap(client), TARGET, out)
        try:
            try:
                wait_until(
                    lambda: any("error" not in c for c in calls(mesh.base / "caller.out")), 30, "a call"
                )
            except TimeoutError:
                raise AssertionError(diagnostics(mesh)) from None
            first = calls(mesh.base / "caller.out")[-1]
            assert first["transport_security_type"] == ["tls"]
            assert first["peer_spiffe_id"] == [CLIENT_ID]
            loaded = first["peer_serial"][0]  # what the caller's grpc loaded from its agent's files

            # the agents rotate: new serials in both OUTPUT_CERTS directories
            server_serial = serial(server)
            wait_until(lambda: serial(client) != loaded, 15, "the client's certificate to be rotated")
            wait_until(lambda: serial(server) != server_serial, 15, "the server's certificate to be rotated")

            # the control plane dies without a word and comes back; both agents reconnect
            before = {w.name: connections(mesh, w) for w in (server, client)}
            assert mesh.stop_controlplane(kill=True) != 0
            time.sleep(1)
            mesh.start_controlplane()
            wait_until(
                lambda: all(connections(mesh, w) > before[w.name] for w in (server, client)),
                30,
                "both apps' ADS streams to reach the restarted control plane through their agents",
            )
            time.sleep(1)  # calls keep going on the new streams
        finally:
            assert caller.stdin is not None
            caller.stdin.close()
            caller.wait(10)

        answers = calls(mesh.base / "caller.out")
        failures = [a for a in answers if "error" in a]
        assert failures == [], failures[:5]
        assert len(answers) > 50
        assert {a["peer_spiffe_id"][0] for a in answers} == {CLIENT_ID}

        # a new caller loads the rotated files: the server sees the client's current certificate
        holding = {serial(client)}
        fresh = call_once(bootstrap(client), TARGET, timeout=20)[TARGET]
        assert "error" not in fresh, (fresh, (mesh.base / "server.log").read_text()[-2000:])
        assert fresh["peer_spiffe_id"] == [CLIENT_ID]
        holding.add(serial(client))  # a rotation may have come while the caller started
        assert fresh["peer_serial"][0] != loaded
        assert fresh["peer_serial"][0] in holding, (fresh["peer_serial"], holding)


def test_proxy_status_through_the_proxyless_agents_taps(
    mesh: LocalMesh, stop_later: list[subprocess.Popen[str]]
) -> None:
    """Each agent's debug tap asks over its workload's own connection: both grpc nodes are listed with
    the types grpc subscribed to, synced."""
    server, client = mesh.workload("echo-1"), mesh.workload("client-1")
    with (mesh.base / "server.log").open("w") as server_log, (mesh.base / "caller.out").open("w") as out:
        stop_later.append(start_server(bootstrap(server), server.ports["app"], server_log))
        caller = start_caller(bootstrap(client), TARGET, out)
        stop_later.append(caller)
        try:
            wait_until(lambda: any("error" not in c for c in calls(mesh.base / "caller.out")), 30, "a call")
        except TimeoutError:
            raise AssertionError(diagnostics(mesh)) from None
        agents = [f"--agent-address={w.name}.default=127.0.0.1:{w.ports['tap']}" for w in (server, client)]
        done = proxy_status("--xds-via-agents", *agents, "-o", "json")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # no agent skipped
    answer = json.loads(done.stdout)  # the one control plane's DiscoveryResponse, as istioctl prints it
    synced = {
        proxy["node"]["id"]: {
            config["typeUrl"].rsplit(".", 1)[-1]: config["configStatus"]
            for config in proxy["genericXdsConfigs"]
        }
        for proxy in answer["resources"]
    }
    assert synced == {
        "client-1.default": dict.fromkeys(
            ["Cluster", "ClusterLoadAssignment", "Listener", "RouteConfiguration"], "SYNCED"
        ),
        "echo-1.default": {"Listener": "SYNCED"},  # the server's inbound listener (its route is inline)
    }
