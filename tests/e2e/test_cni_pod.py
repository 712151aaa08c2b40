"""End to end: a pod on a CNI network whose traffic is captured, calling a mesh service by name with plain curl.

What runs, as on a Kubernetes node (tests/cni/node.py, tests/e2e/pod.py, tests/e2e/injector.py):

- the node: a network namespace of its own where the real ``install-cni`` chains the ``istio-cni``
  executable into the node's bridge conflist, where the runtime runs
  that conflist (Debian's ``bridge`` + ``host-local``, then ``istio-cni``) and where the local control
  plane listens on the bridge's gateway address as ``istiod.istio-system.svc``, as a cluster Service
  outside the pod. The plugin reads the pods from a FAKE Kubernetes API server
  (tests/cni/fake_kube.py: no real one runs here) on the node's loopback, through the kubeconfig
  install-cni writes;
- ``httpbin``: a pod injected with ``istio-init`` (which istio-cni skips): ``pilot-agent
  istio-iptables`` with the injector's args programs its rules; the injected ``istio-proxy`` (the real
  ``pilot-agent proxy`` and Envoy) and the echo app on 8080. The mesh service ``httpbin`` has the VIP
  10.96.0.10, which nothing in the network routes: only a captured connection reaches it;
- ``sleep``: a pod injected for CNI, with ``ISTIO_META_DNS_CAPTURE=true`` and port 9090 excluded
  (``traffic.sidecar.istio.io/excludeOutboundPorts``): istio-cni programs its rules during ADD; the
  injected ``istio-proxy`` and an app container (uid 1000) where the test runs Debian's ``curl``.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from tests.cni.fake_kube import TOKEN as FAKE_TOKEN
from tests.cni.fake_kube import FakeKube, sidecar_pod, start_fake_kube
from tests.cni.install.layout import Node as InstallLayout
from tests.cni.install.layout import start_install_cni
from tests.cni.libcni import DEBIAN_PLUGINS
from tests.cni.netns import enter, in_netns
from tests.cni.node import AttachedPod, Node, running_node
from tests.e2e.injector import Istiod, istio_proxy, proxy_image
from tests.e2e.pod import CLUSTER_DOMAIN, Container, Image, Pod, unsupported

PLUGIN_BUILD = Path(__file__).resolve().parents[2] / "build" / "cni" / "bin"
"""``make cni-plugin``'s output: what install-cni's image holds in /opt/cni/bin and copies to nodes."""
EXCLUDED_PORT = 9090
"""An outbound port the sleep pod's rules exclude (``traffic.sidecar.istio.io/excludeOutboundPorts``)."""
PLAIN_PORT = 9091
"""A port of a plain (non-mesh) server on the node: captured, so it goes through PassthroughCluster."""
VIP = "10.96.0.10"
SERVICE = "httpbin"
SERVICE_PORT = 8000
CLUSTER = f"outbound|{SERVICE_PORT}||{SERVICE}.default.svc.{CLUSTER_DOMAIN}"
APP_UID = 1000
DNS_CAPTURE = {"ISTIO_META_DNS_CAPTURE": "true"}
SLEEP_POD = sidecar_pod(
    "sleep",
    annotations={"traffic.sidecar.istio.io/excludeOutboundPorts": str(EXCLUDED_PORT)},
    proxy_env=DNS_CAPTURE,
)
"""The sleep pod as the API server has it: injected for a CNI node (istio-validation, no istio-init)."""
HTTPBIN_POD = sidecar_pod("httpbin", init_containers=[{"name": "istio-init"}])
"""httpbin: injected with istio-init, which programs its rules; istio-cni leaves it alone."""


def cannot_run() -> str | None:
    reason = unsupported()
    if reason is not None:
        return reason
    if not (DEBIAN_PLUGINS / "bridge").exists() or shutil.which("iptables-restore") is None:
        return "needs Debian's containernetworking-plugins and iptables (`make` installs them)"
    if shutil.which("curl") is None:
        return "needs Debian's curl (the app's HTTP client)"
    if not (Path(sys.executable).parent / "istio-cni").exists():
        return "needs the istio-cni executable: reinstall the package (pip install -e .)"
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


def istio_init(netns: Path) -> None:
    """The ``istio-init`` container of a pod injected without CNI: ``pilot-agent istio-iptables`` with the
    injector's args, as root with NET_ADMIN in the pod's network namespace."""
    pilot_agent = str(Path(sys.executable).parent / "pilot-agent")
    args = ["-p", "15001", "-z", "15006", "-u", "1337", "-m", "REDIRECT", "-i", "*", "-x", "", "-b", "*"]
    args += ["-d", "15090,15021,15020", "--log_output_level=default:info"]
    done = subprocess.run(
        in_netns(netns, [pilot_agent, "istio-iptables", *args]), capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


class ApiServerOnNode:
    """The FAKE Kubernetes API server of the plugin tests (tests/cni/fake_kube.py; no real one runs
    here), on the node's loopback, where the plugin reaches it from: its loop runs in a thread that
    entered the node's namespace."""

    def __init__(self, node: Node, state_dir: Path) -> None:
        state_dir.mkdir(parents=True)
        self._started = threading.Event()
        self._failure: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self.kube: FakeKube | None = None
        self._thread = threading.Thread(target=self._run, args=(node.netns.path, state_dir), daemon=True)
        self._thread.start()
        self._started.wait(20)
        if self._failure is not None or self.kube is None:
            raise RuntimeError(f"the fake API server did not start: {self._failure!r}")

    def _run(self, netns: Path, state_dir: Path) -> None:
        try:
            enter(netns)
            asyncio.run(self._serve(state_dir))
        except BaseException as err:  # reported to the test by __init__
            self._failure = err
            self._started.set()

    async def _serve(self, state_dir: Path) -> None:
        self._loop, self._stopping = asyncio.get_running_loop(), asyncio.Event()
        self.kube, runner = await start_fake_kube(state_dir)
        self._started.set()
        try:
            await self._stopping.wait()
        finally:
            await runner.cleanup()

    def stop(self) -> None:
        if self._loop is not None and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(10)


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
    (base / "install").mkdir()
    layout = InstallLayout(base / "install")  # the node's /etc/cni/net.d, /opt/cni/bin, ...
    with running_node(base / "node", plugin_paths=[layout.bin]) as node:
        api = ApiServerOnNode(node, base / "kube")
        try:
            assert api.kube is not None
            with install_cni_on(node, layout, api.kube, base / "install-cni.log"):
                yield from _pods(base, node, api, layout)
        finally:
            api.stop()


@contextlib.contextmanager
def install_cni_on(node: Node, layout: InstallLayout, kube: FakeKube, log: Path) -> Iterator[None]:
    """The real install-cni in the node's namespace, as the istio-cni-node DaemonSet runs it: it copies
    the istio-cni executable into the node's CNI bin dir, writes the plugin's kubeconfig, chains the
    plugin into the node's bridge conflist. The runtime reads that
    conflist from then on. SIGTERM at the end (it restores the conflist and removes the plugin)."""
    if not (PLUGIN_BUILD / "istio-cni").exists():
        pytest.fail(f"{PLUGIN_BUILD} is not built: `make cni-plugin` (`make test` does)")
    for item in PLUGIN_BUILD.iterdir():  # the self-contained plugin, as the install-cni image holds it
        if item.is_dir():
            shutil.copytree(item, layout.source / item.name, symlinks=True)
        else:
            shutil.copy2(item, layout.source / item.name)
    conflist = layout.conf / "10-k8s-pod-network.conflist"
    conflist.write_text(json.dumps(node.network().document(), indent=2))
    with log.open("ab") as output:
        process = start_install_cni(layout, kube.port, kube.ca_pem, FAKE_TOKEN, output, netns=node.netns.path)
    try:

        def chained() -> bool:
            assert process.poll() is None, f"install-cni exited: {log.read_text()}"
            plugins = json.loads(conflist.read_text())["plugins"]
            return plugins[-1]["type"] == "istio-cni" and (layout.run / "istio-cni-kubeconfig").exists()

        wait_until(chained, 20, "install-cni chaining istio-cni into the node's conflist")
        node.conf_file = conflist
        yield
    finally:
        process.terminate()
        process.wait(10)


def _pods(base: Path, node: Node, api: ApiServerOnNode, layout: InstallLayout) -> Iterator[Cluster]:
    assert api.kube is not None
    # sleep: injected for a CNI node (istio-validation, no istio-init): istio-cni programs its rules
    api.kube.add_pod(SLEEP_POD)
    # httpbin: injected with istio-init, which programs its rules; istio-cni leaves it alone
    api.kube.add_pod(HTTPBIN_POD)
    server_net, client_net = node.attach("httpbin"), node.attach("sleep")
    assert "ISTIO_OUTPUT" not in server_net.netns.exec("iptables-save")
    istio_init(server_net.netns.path)
    hosts = {"istiod.istio-system.svc": node.gateway}
    server = pod_on(base, server_net, hosts, stats="listener")
    client = pod_on(base, client_net, hosts, stats="cluster.outbound,cluster.PassthroughCluster,listener")
    assert "ISTIO_OUTPUT" in client_net.netns.exec("iptables-save")  # the plugin's ADD programmed it
    istiod = Istiod(node, mesh(server, client), address=node.gateway)
    try:
        istiod.start()
        for pod in (server, client):
            pod.start()
        server.start_container(istio_proxy(server, istiod, grace_period=5))
        echo = [sys.executable, "-m", "istio_agent.ctl.echo", "--name", SERVICE, "--port", "8080"]
        server.start_container(app_container(echo))
        client.start_container(istio_proxy(client, istiod, proxy_metadata=DNS_CAPTURE, grace_period=5))
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


def inbound_redirects(pod: Pod) -> int:
    """Packets the pod's ``ISTIO_IN_REDIRECT`` rule sent to 15006 (iptables' own counter, either backend)."""
    netns = str(pod.netns)
    saved = "".join(
        subprocess.run(
            in_netns(Path(netns), [save, "-c", "-t", "nat"]), capture_output=True, text=True
        ).stdout
        for save in ("iptables-nft-save", "iptables-legacy-save")
    )
    counts = re.findall(
        r"^\[(\d+):\d+\] -A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006$", saved, re.M
    )
    return sum(map(int, counts))


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
    dns_before, inbound_before = agent_metric(client, DNS_FROM_TABLE), inbound_redirects(server)

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
    # and it reached httpbin's Envoy through httpbin's own capture (istio-init's inbound rule)
    assert inbound_redirects(server) > inbound_before


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


@pytest.mark.parametrize("name", ["sleep", "httpbin"])
def test_agentctl_cni_check_finds_each_pods_rules_as_expected(
    cluster: Cluster, tmp_path: Path, name: str
) -> None:
    """What an operator runs on the node: the rules istio-cni (sleep) and istio-init with the
    injector's args (httpbin) programmed are exactly those expected from each pod object."""
    pod, spec = (cluster.client, SLEEP_POD) if name == "sleep" else (cluster.server, HTTPBIN_POD)
    pod_file = tmp_path / f"{name}.json"
    pod_file.write_text(json.dumps(spec))
    agentctl = str(Path(sys.executable).parent / "agentctl")
    check = [agentctl, "cni", "check", str(pod.netns), "--pod", str(pod_file)]
    done = subprocess.run(
        in_netns(cluster.node.netns.path, check), capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK: the installed rules are exactly the expected ones" in done.stdout
