"""End to end: ``pilot-agent proxy`` answering DNS from the control plane's NDS, forwarding to a real dnsmasq.

Clients are ``dig`` (Debian's bind9-dnsutils) and dnspython; the upstream is dnsmasq on port 53 of a
spare 127.0.0.N (the resolv.conf the agent reads can name no port).
"""

from __future__ import annotations

import shutil
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import dns.flags
import dns.message
import dns.query
import dns.rcode
import pytest

from istio_agent.ctl.local import wait_until
from istio_agent.ctl.localmesh import LocalMesh, Service, Workload
from tests.dns.conftest import (  # noqa: F401  (fixtures)
    dnsmasq_upstream,
    start_dnsmasq_factory,
    upstream_resolv_conf,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

NAME_TABLE = {
    "productpage.default.svc.cluster.local": {
        "ips": ["10.10.0.1"],
        "registry": "Kubernetes",
        "shortname": "productpage",
        "namespace": "default",
    },
    "*.wild.example": {"ips": ["10.10.0.9", "fd00::9"], "registry": "External"},
}


def dig(port: int, *args: str) -> str:
    if shutil.which("dig") is None:
        pytest.skip("dig is not installed (Debian package bind9-dnsutils; `make` installs it)")
    done = subprocess.run(
        ["dig", "@127.0.0.1", "-p", str(port), "+time=3", "+tries=1", *args],
        capture_output=True,
        text=True,
        timeout=15,
        check=False,
    )
    return done.stdout


def ask(port: int, name: str, rdtype: str = "A", *, tcp: bool = False) -> dns.message.Message:
    query = dns.message.make_query(name, rdtype)
    if tcp:
        return dns.query.tcp(query, "127.0.0.1", port=port, timeout=5)
    return dns.query.udp(query, "127.0.0.1", port=port, timeout=5)


def http(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=3) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
    except OSError:
        return 0, ""


@pytest.fixture
def mesh(short_tmp: Path, upstream_resolv_conf: Path) -> Iterator[LocalMesh]:  # noqa: F811
    local = LocalMesh(
        short_tmp,
        [Service("b", 8000)],
        [Workload("b", short_tmp / "b", backs=["b"])],
        agent_env={"ISTIO_AGENT_RESOLV_CONF": str(upstream_resolv_conf)},
    )
    local.update_mesh(nameTable=NAME_TABLE)
    try:
        yield local
    finally:
        local.stop()


def start_and_wait_ready(mesh: LocalMesh, workload: Workload) -> None:
    mesh.start_workload(workload)
    try:
        wait_until(lambda: http(workload.ports["status"], "/healthz/ready")[0] == 200, 60, "readiness")
    except TimeoutError as err:
        log = mesh.processes.log_tail(f"pilot-agent {workload.name}", 40)
        raise TimeoutError(f"{err}; agent log:\n{log}") from None


@pytest.mark.parametrize("parallel", [False, True], ids=["sequential", "parallel"])
def test_mesh_names_from_nds_and_the_rest_from_the_upstream(mesh: LocalMesh, parallel: bool) -> None:
    b = mesh.workload("b")
    if parallel:
        mesh.agent_env["DNS_FORWARD_PARALLEL"] = "true"
    mesh.start_controlplane()
    start_and_wait_ready(mesh, b)  # readiness includes "DNS lookup table is ready"
    port = b.ports["dns"]

    short = dig(port, "productpage", "A")
    assert "status: NOERROR" in short and " aa " in short.split("flags:")[1].split(";")[0] + " "
    assert "productpage.\t\t30\tIN\tA\t10.10.0.1" in short
    assert dig(port, "+short", "b.default").split() == ["127.0.0.1"]  # a service of the mesh file
    assert dig(port, "+short", "+tcp", "x.y.wild.example", "AAAA").split() == ["fd00::9"]
    assert dig(port, "+short", "www.upstream.test").split() == ["192.0.2.10"]  # forwarded to dnsmasq
    assert "status: NXDOMAIN" in dig(port, "nowhere.upstream.test")

    nodata = ask(port, "productpage.default.svc.cluster.local.", "AAAA")
    assert (nodata.rcode(), nodata.answer, bool(nodata.flags & dns.flags.AA)) == (dns.rcode.NOERROR, [], True)
    expanded = ask(port, "b.default.svc.cluster.local.default.svc.cluster.local.", tcp=True)
    # the resolv.conf here has no search domains, so no search-expansion CNAME: forwarded, NXDOMAIN
    assert expanded.rcode() == dns.rcode.NXDOMAIN

    code, body = http(b.ports["status"], "/debug/ndsz")
    assert code == 200 and '"productpage.default.svc.cluster.local"' in body and '"productpage."' in body
    code, metrics = http(b.ports["status"], "/stats/prometheus")
    assert code == 200 and "istio_agent_dns_requests_total" in metrics
    assert 'istio_agent_dns_queries_total{qtype="A",rcode="NXDOMAIN",source="upstream"}' in metrics


def test_a_new_name_arrives_with_a_push_and_the_table_outlives_a_restart(mesh: LocalMesh) -> None:
    b = mesh.workload("b")
    mesh.start_controlplane()
    start_and_wait_ready(mesh, b)
    port = b.ports["dns"]
    mesh.update_mesh(nameTable={**NAME_TABLE, "ratings.default.svc.cluster.local": {"ips": ["10.10.0.2"]}})
    wait_until(
        lambda: dig(port, "+short", "ratings.default.svc.cluster.local").split() == ["10.10.0.2"],
        30,
        "the pushed name to resolve",
    )

    mesh.processes.stop(f"pilot-agent {b.name}")
    mesh.processes.stop(f"app {b.name}")
    mesh.stop_controlplane()
    mesh.start_workload(b)  # no control plane: the saved table answers
    wait_until(
        lambda: dig(port, "+short", "productpage").split() == ["10.10.0.1"], 30, "the saved table to answer"
    )
    code, _ = http(b.ports["status"], "/healthz/ready")
    assert code == 503  # readiness still waits for the control plane (Envoy's config, this run's table)
