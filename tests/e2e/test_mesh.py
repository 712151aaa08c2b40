"""End to end: two workloads, each with ``pilot-agent proxy`` and a real Envoy, fed by the local control plane.

Workload ``a`` calls service ``b`` through its Envoy's loopback outbound listener; the request
crosses the mesh over mTLS with certificates the agents got from the local CA, and ``b``'s Envoy
tells the app who called (x-forwarded-client-cert). All configuration reaches Envoy through the
agent's xDS proxy (SotW or Delta ADS, per the bootstrap).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from istio_agent.ctl.local import free_port, wait_until
from istio_agent.ctl.localmesh import LocalMesh, Service, Workload, admin_json

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

B_CLUSTER = "outbound|8000||b.default.svc.cluster.local"
C_CLUSTER = "outbound|9000||c.default.svc.cluster.local"


def call(port: int, path: str = "/hello", timeout: float = 5) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as response:
        assert response.status == 200
        answer: dict[str, Any] = json.load(response)
        return answer


def build_mesh(base: Path, delta: bool) -> LocalMesh:
    services = [Service("b", 8000)]
    workloads = [
        Workload("a", base / "a", calls=["b"]),
        Workload("b", base / "b", backs=["b"]),
    ]
    return LocalMesh(base, services, workloads, delta=delta)


def start(mesh: LocalMesh) -> None:
    mesh.start_controlplane()
    for workload in mesh.workloads:
        mesh.start_workload(workload)
    a, b = mesh.workload("a"), mesh.workload("b")
    mesh.wait_for_config(
        a, lambda seen: f"127.0.0.1_{a.outbound_port('b')}" in seen["listeners"], "its outbound listener"
    )
    mesh.wait_for_config(b, lambda seen: any(n.startswith("inbound_") for n in seen["listeners"]), "inbound")


@pytest.fixture(params=[False, True], ids=["sotw", "delta"])
def mesh(request: pytest.FixtureRequest, short_tmp: Path) -> Iterator[LocalMesh]:
    local = build_mesh(short_tmp, delta=request.param)
    try:
        start(local)
        yield local
    finally:
        codes = local.stop()
        for name, code in codes.items():
            assert code == 0, f"{name} exited with {code}:\n{local.processes.log_tail(name)}"


def test_a_calls_b_over_mtls_and_b_sees_a(mesh: LocalMesh) -> None:
    a, b = mesh.workload("a"), mesh.workload("b")
    wait_until(lambda: _answers(a.outbound_port("b")), 30, "a request from a to b to succeed")
    answer = call(a.outbound_port("b"))
    assert answer["app"] == "b"
    headers = {name.lower(): value for name, value in answer["headers"].items()}
    xfcc = headers.get("x-forwarded-client-cert", "")
    assert f"URI={a.spiffe_id}" in xfcc, headers
    assert f"By={b.spiffe_id}" in xfcc, headers

    # The configuration came over ADS through the agent, in the flavour the bootstrap asked for.
    dump = admin_json(a.ports["admin"], "/config_dump?resource=dynamic_active_clusters")
    names = [entry["cluster"]["name"] for entry in dump["configs"]]
    assert B_CLUSTER in names
    configs = admin_json(a.ports["admin"], "/config_dump")["configs"]
    bootstrap = next(c["bootstrap"] for c in configs if c["@type"].endswith("BootstrapConfigDump"))
    api_type = bootstrap["dynamic_resources"]["ads_config"]["api_type"]
    assert api_type == ("DELTA_GRPC" if mesh.delta else "GRPC")
    assert "/XDS" in json.dumps(bootstrap["static_resources"]["clusters"])
    log = (a.workdir / "agent.log").read_text()
    assert "name table" in log.lower(), "the agent should have received the NDS name table"


def test_mesh_change_reaches_envoy(mesh: LocalMesh) -> None:
    a, b = mesh.workload("a"), mesh.workload("b")
    mesh.services.append(Service("c", 9000))
    b.backs.append("c")
    a.calls.append("c")
    a.ports["outbound:c"] = free_port()
    mesh.update_mesh()
    seen = mesh.wait_for_config(
        a,
        lambda names: (
            C_CLUSTER in names["clusters"] and f"127.0.0.1_{a.outbound_port('c')}" in names["listeners"]
        ),
        "service c",
    )
    assert B_CLUSTER in seen["clusters"]
    wait_until(lambda: _answers(a.outbound_port("c")), 30, "a request from a to c to succeed")


def test_controlplane_restart_loses_no_requests(mesh: LocalMesh) -> None:
    a = mesh.workload("a")
    port = a.outbound_port("b")
    wait_until(lambda: _answers(port), 30, "a request from a to b to succeed")
    results: list[bool] = []
    failures: list[str] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            try:
                call(port, timeout=2)
                results.append(True)
            except Exception as err:  # any failure counts
                failures.append(repr(err))
            time.sleep(0.05)

    worker = threading.Thread(target=client)
    worker.start()
    try:
        time.sleep(0.5)
        assert mesh.stop_controlplane(kill=True) != 0
        time.sleep(2)
        mesh.start_controlplane()
        # Config changes flow again after the restart (Envoy reconnects through the agent).
        mesh.services.append(Service("c", 9000))
        mesh.workload("b").backs.append("c")
        mesh.update_mesh()
        mesh.wait_for_config(
            a, lambda names: C_CLUSTER in names["clusters"], "service c after the restart", 60
        )
        time.sleep(0.5)
    finally:
        stop.set()
        worker.join()
    assert failures == []
    assert len(results) > 40


def _answers(port: int) -> bool:
    try:
        return call(port, timeout=2)["app"] in ("b",)
    except OSError:
        return False
