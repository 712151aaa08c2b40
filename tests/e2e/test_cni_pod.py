"""End to end: a pod on a CNI network whose traffic is captured, calling a mesh service by name with plain curl.

What runs, as on a Kubernetes node (tests/cni/node.py, tests/e2e/pod.py, tests/e2e/injector.py):

- the node: a network namespace of its own where the runtime runs the CNI chain (Debian's ``bridge``
  + ``host-local``) and where the local control plane listens on the bridge's gateway address as
  ``istiod.istio-system.svc``, as a cluster Service outside the pod;
- ``httpbin``: a pod on that network with the injected ``istio-proxy`` (the real ``pilot-agent proxy``
  and Envoy) and the echo app on 8080; the mesh service ``httpbin`` has the VIP 10.96.0.10, which
  nothing in the network routes: only a captured connection reaches it;
- ``sleep``: a pod on that network whose namespace gets Istio's sidecar rules (outbound to 15001,
  inbound to 15006, DNS to 15053, the proxy's uid 1337 exempt, port 9090 excluded), the injected
  ``istio-proxy`` with ``ISTIO_META_DNS_CAPTURE=true``, and an app container (uid 1000) where the test
  runs Debian's ``curl``.

INTERIM: the rules are the output of ``pilot-agent istio-iptables --dry-run`` (the istio-cni plugin's
configuration: capture all DNS) fed to ``iptables-restore --noflush`` in the pod's namespace, until the
istio-cni plugin runs in the chain itself.
"""

from __future__ import annotations

import http.server
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from istio_agent.ctl.local import wait_until
from tests.cni.libcni import DEBIAN_PLUGINS
from tests.cni.node import AttachedPod, Node, running_node
from tests.e2e.injector import Istiod, istio_proxy, proxy_image
from tests.e2e.pod import CLUSTER_DOMAIN, Container, Image, Pod, unsupported

EXCLUDED_PORT = 9090
"""An outbound port the sleep pod's rules exclude (``traffic.sidecar.istio.io/excludeOutboundPorts``)."""
PLAIN_PORT = 9091
"""A port of a plain (non-mesh) server on the node: captured, so it goes through PassthroughCluster."""
VIP = "10.96.0.10"
SERVICE = "httpbin"
SERVICE_PORT = 8000
CLUSTER = f"outbound|{SERVICE_PORT}||{SERVICE}.default.svc.{CLUSTER_DOMAIN}"
APP_UID = 1000


def cannot_run() -> str | None:
    reason = unsupported()
    if reason is not None:
        return reason
    if not (DEBIAN_PLUGINS / "bridge").exists() or shutil.which("iptables-restore") is None:
        return "needs Debian's containernetworking-plugins and iptables (`make` installs them)"
    if shutil.which("curl") is None:
        return "needs Debian's curl (the app's HTTP client)"
    return None


CANNOT_RUN = cannot_run()
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(90),
    pytest.mark.skipif(CANNOT_RUN is not None, reason=CANNOT_RUN or ""),
]


def spiffe(account: str) -> str:
    return f"spiffe://{CLUSTER_DOMAIN}/ns/default/sa/{account}"


def mesh(server: Pod, client: Pod) -> dict[str, Any]:
    workload = {"namespace": "default", "inboundPort": 15006, "appPort": 8080}
    return {
        "trustDomain": CLUSTER_DOMAIN,
        "services": [{"name": SERVICE, "port": SERVICE_PORT, "addresses": [VIP]}],
        "workloads": [
            {
                "name": server.name,
                "serviceAccount": server.name,
                "address": server.ip,
                **workload,
                "services": [SERVICE],
            },
            {"name": client.name, "serviceAccount": client.name, "address": client.ip, "capture": True},
        ],
    }


def app_container(args: list[str]) -> Container:
    """An app container of uid 1000 (not the proxy's), this project's interpreter as its image's."""
    image = proxy_image()
    return Container(
        name="app",
        image=Image(files={}, env=image.env, uid=APP_UID, gid=APP_UID, needs=image.needs),
        args=args,
    )


def apply_sidecar_rules(netns: Path) -> None:
    """INTERIM until the istio-cni plugin is in the chain: the plugin's rule set, from istio-iptables."""
    pilot_agent = str(Path(sys.executable).parent / "pilot-agent")
    flags = ["-p", "15001", "-z", "15006", "-u", "1337", "-m", "REDIRECT", "-i", "*", "-x", "", "-b", "*"]
    flags += ["-d", "15090,15021,15020", "-o", str(EXCLUDED_PORT), "--redirect-dns", "--capture-all-dns"]
    rules = subprocess.run(
        [pilot_agent, "istio-iptables", *flags, "--dry-run"], capture_output=True, text=True, check=True
    ).stdout
    subprocess.run(
        ["nsenter", f"--net={netns}", "--", "iptables-restore", "--noflush"],
        input=rules,
        text=True,
        check=True,
    )


class PlainServer:
    """A plain HTTP server on the node's side of the bridge (not in the mesh), counting what it answers."""

    def __init__(self, node: Node, port: int) -> None:
        self.served = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.served += 1
                body = b"plain\n"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.HTTPServer((node.gateway, port), Handler, bind_and_activate=False)
        self.server.socket.close()
        self.server.socket = node.socket()
        self.server.server_bind()
        self.server.server_activate()
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Cluster:
    node: Node
    istiod: Istiod
    server: Pod
    client: Pod


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """One cluster for the module's tests (starting it is most of their time); each test compares the
    counters it reads with their values before it acted."""
    base = Path(tempfile.mkdtemp(prefix="ia-", dir="/tmp"))  # short: Unix socket paths
    try:
        yield from _cluster(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def pod_on(base: Path, network: AttachedPod, hosts: dict[str, str], stats: str) -> Pod:
    """A pod in the sandbox the CNI chain attached; ``stats``: the Envoy stats the assertions read."""
    annotations = {"sidecar.istio.io/statsInclusionPrefixes": stats}
    name = network.attachment.args["K8S_POD_NAME"]
    return Pod(
        base / name, name, hosts=hosts, annotations=annotations, network=(network.netns.path, network.ip)
    )


def _cluster(base: Path) -> Iterator[Cluster]:
    with running_node(base / "node") as node:
        server_net, client_net = node.attach("httpbin"), node.attach("sleep")
        apply_sidecar_rules(client_net.netns.path)
        hosts = {"istiod.istio-system.svc": node.gateway}
        server = pod_on(base, server_net, hosts, stats="listener")
        client = pod_on(base, client_net, hosts, stats="cluster.outbound,cluster.PassthroughCluster,listener")
        istiod = Istiod(node, mesh(server, client), address=node.gateway)
        try:
            istiod.start()
            for pod in (server, client):
                pod.start()
            server.start_container(istio_proxy(server, istiod, grace_period=5))
            server.start_container(
                app_container(
                    [sys.executable, "-m", "istio_agent.ctl.echo", "--name", SERVICE, "--port", "8080"]
                )
            )
            client.start_container(
                istio_proxy(client, istiod, proxy_metadata={"ISTIO_META_DNS_CAPTURE": "true"}, grace_period=5)
            )
            client.start_container(app_container(["sleep", "infinity"]))
            server.wait_ready("istio-proxy")
            client.wait_ready("istio-proxy")
            yield Cluster(node, istiod, server, client)
        finally:
            client.stop()
            server.stop()
            istiod.stop()


def curl(pod: Pod, container: str, url: str) -> str:
    done = pod.exec(container, ["curl", "-sS", "--max-time", "5", url], timeout=15)
    assert done.returncode == 0, (
        f"curl {url} from {container}: {done.returncode} {done.stderr}\n{pod.describe('istio-proxy')}"
    )
    return done.stdout


def envoy_stat(pod: Pod, name: str) -> int:
    """A counter from the pod's Envoy admin API (0 when Envoy has not made it yet)."""
    status, body = pod.http("GET", 15000, f"/stats?filter=^{re.escape(name)}$")
    assert status == 200, body
    match = re.search(rf"^{re.escape(name)}: (\d+)$", body, re.M)
    return int(match.group(1)) if match else 0


def agent_metric(pod: Pod, sample: str) -> float:
    """One sample of the merged metrics on 15020 (the agent's and Envoy's), 0 when absent."""
    status, body = pod.http("GET", 15020, "/stats/prometheus")
    assert status == 200, body
    match = re.search(rf"^{re.escape(sample)} (\S+)$", body, re.M)
    return float(match.group(1)) if match else 0.0


DNS_FROM_TABLE = 'istio_agent_dns_queries_total{qtype="A",rcode="NOERROR",source="table"}'
PASSTHROUGH = "cluster.PassthroughCluster.upstream_cx_total"


def test_curl_by_service_name_is_captured_resolved_by_the_agent_and_sent_over_mtls(cluster: Cluster) -> None:
    client, server = cluster.client, cluster.server
    wait_until(
        lambda: envoy_stat(client, f"cluster.{CLUSTER}.membership_healthy") == 1, 10, "httpbin's endpoint"
    )
    handed_off = "listener.0.0.0.0_8000.downstream_cx_total"
    counters = [(client, f"cluster.{CLUSTER}.upstream_rq_200"), (client, handed_off)]
    counters.append((server, f"listener.{server.ip}_15006.ssl.handshake"))
    before = [envoy_stat(pod, name) for pod, name in counters]
    dns_before = agent_metric(client, DNS_FROM_TABLE)

    answer = json.loads(curl(client, "app", f"http://{SERVICE}:{SERVICE_PORT}/hello"))

    assert answer["app"] == SERVICE and answer["path"] == "/hello"
    # the server's Envoy verified the client's certificate: the caller's SPIFFE id, and its own
    xfcc = {k.lower(): v for k, v in answer["headers"].items()}.get("x-forwarded-client-cert", "")
    assert f"URI={spiffe('sleep')}" in xfcc and f"By={spiffe('httpbin')}" in xfcc, answer["headers"]
    # the name was answered by the agent's DNS proxy from its NDS table (curl asked resolv.conf's
    # 127.0.0.53:53, where nothing listens)
    assert agent_metric(client, DNS_FROM_TABLE) > dns_before
    # one request to the service's outbound cluster, on a connection 15001 handed to the port's
    # listener (bound to no port: nothing else reaches it), and one more mTLS handshake on the server
    assert [envoy_stat(pod, name) for pod, name in counters] == [count + 1 for count in before]


def test_the_proxy_uid_and_excluded_ports_bypass_capture(cluster: Cluster) -> None:
    client, node = cluster.client, cluster.node
    plain, excluded = PlainServer(node, PLAIN_PORT), PlainServer(node, EXCLUDED_PORT)
    try:
        before = envoy_stat(client, PASSTHROUGH)
        assert curl(client, "app", f"http://{node.gateway}:{PLAIN_PORT}/") == "plain\n"
        assert envoy_stat(client, PASSTHROUGH) == before + 1  # the app is captured: through Envoy

        assert curl(client, "istio-proxy", f"http://{node.gateway}:{PLAIN_PORT}/") == "plain\n"
        assert curl(client, "app", f"http://{node.gateway}:{EXCLUDED_PORT}/") == "plain\n"
        assert envoy_stat(client, PASSTHROUGH) == before + 1  # uid 1337 and the excluded port went direct
        assert (plain.served, excluded.served) == (2, 1)
    finally:
        plain.stop()
        excluded.stop()
