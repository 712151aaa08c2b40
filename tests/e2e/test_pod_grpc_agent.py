"""End to end: ``pilot-agent`` as Istio's ``grpc-agent`` template runs it next to a proxyless gRPC app.

The agent runs in the proxy image ``make images`` builds (tests/e2e/test_pod_sidecar.py), uid 1337,
read-only root, only the template's volumes writable (tests/e2e/pod.py); no Envoy and no SDS server;
the certificates and the gRPC bootstrap on the volumes the app shares; the app's grpcio xDS client
reaches the local control plane through the agent's socket.
"""

from __future__ import annotations

import json
import stat
import sys
from dataclasses import replace

import pytest

from istio_agent.ctl.local import wait_until
from tests.e2e.injector import Istiod, grpc_agent, grpc_app, log_problems, mesh_for
from tests.e2e.pod import Pod, children, unsupported
from tests.e2e.test_pod_sidecar import (
    assert_runs_as_the_proxy_user,
    assert_runs_in_the_image,
    proxy_image,
    written_files,
)
from tests.images.built import unavailable

CANNOT_RUN = unsupported() or unavailable("proxyv2")
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(120),
    pytest.mark.skipif(CANNOT_RUN is not None, reason=CANNOT_RUN or ""),
]
CERT_FILES = ["cert-chain.pem", "key.pem", "root-cert.pem"]
CLIENT = """
import sys, grpc, grpc.experimental
credentials = grpc.xds_channel_credentials(grpc.experimental.insecure_channel_credentials())
channel = grpc.secure_channel(sys.argv[1], credentials)
try:
    grpc.channel_ready_future(channel).result(timeout=float(sys.argv[2]))
except grpc.FutureTimeoutError:
    pass
channel.close()
"""


@pytest.fixture
def istiod(pod: Pod) -> Istiod:
    control_plane = Istiod(pod, mesh_for(pod))
    control_plane.start()
    return control_plane


def test_the_grpc_agent_writes_certs_and_bootstrap_and_relays_the_apps_xds(pod: Pod, istiod: Istiod) -> None:
    # a short SECRET_TTL: the local CA's certificates are rotated while the test runs
    agent = grpc_agent(pod, istiod, proxy_metadata={"SECRET_TTL": "4s"}, grace_period=10)
    running = pod.start_container(replace(agent, image=proxy_image()))
    pod.wait_ready("istio-proxy")  # postStart: pilot-agent wait on 15020's /healthz/ready
    assert pod.http("GET", 15020, "/healthz/ready")[0] == 200

    assert_runs_in_the_image(running)
    assert_runs_as_the_proxy_user(running.pid)
    assert children(running.pid) == []  # no Envoy
    # every file the agent writes is on the template's volumes (the root refuses any other): no SDS socket
    assert written_files(pod.volume("istio-xds")) == ["XDS", "grpc-bootstrap.json"]
    assert written_files(pod.volume("istio-data")) == CERT_FILES
    assert written_files(pod.volume("workload-socket")) == []
    assert written_files(pod.volume("workload-certs")) == []
    for name in CERT_FILES:
        info = (pod.volume("istio-data") / name).stat()
        assert info.st_uid == 1337 and stat.S_IMODE(info.st_mode) == 0o644  # KUBERNETES_SERVICE_HOST is set

    bootstrap = json.loads((pod.volume("istio-xds") / "grpc-bootstrap.json").read_text())
    assert bootstrap["xds_servers"][0]["server_uri"] == "unix:///etc/istio/proxy/XDS"
    node_id = f"sidecar~{pod.ip}~{pod.name}.{pod.namespace}~{pod.namespace}.svc.cluster.local"
    assert bootstrap["node"]["id"] == node_id
    assert bootstrap["node"]["metadata"]["GENERATOR"] == "grpc"
    assert bootstrap["node"]["metadata"]["CLUSTER_ID"] == "Kubernetes"
    watcher = bootstrap["certificate_providers"]["default"]["config"]
    assert watcher["certificate_file"] == "/var/lib/istio/data/cert-chain.pem"
    assert watcher["ca_certificate_file"] == "/var/lib/istio/data/root-cert.pem"

    # the app (another user) loads the bootstrap; its ADS stream reaches the control plane via the agent
    target = f"xds:///{pod.name}.{pod.namespace}.svc.cluster.local:8000"
    pod.start_container(grpc_app("app", [sys.executable, "-c", CLIENT, target, "3"]))
    assert pod.wait_exit("app") == 0, pod.describe("app")
    app_log = pod.containers["app"].log.read_text(errors="replace")
    assert "Failed to create xds client" not in app_log, app_log
    connections = [line for line in istiod.log.read_text().splitlines() if "ADS: new" in line]
    assert any(line.endswith(f"node={node_id}") for line in connections), connections

    # rotation rewrites the files in place (gRPC's file watcher reads them again)
    data = pod.volume("istio-data")
    first_key, first_chain = (data / "key.pem").read_bytes(), (data / "cert-chain.pem").read_bytes()
    wait_until(lambda: (data / "key.pem").read_bytes() != first_key, 15, "the key to be rotated")
    wait_until(lambda: (data / "cert-chain.pem").read_bytes() != first_chain, 5, "the chain to be rotated")
    assert written_files(data) == CERT_FILES
    assert pod.http("GET", 15020, "/healthz/ready")[0] == 200

    assert pod.stop_container("istio-proxy") == 0
    not_allowed, _, unformatted = log_problems(running.log.read_text(errors="replace"))
    assert not not_allowed, "permission / read-only lines:\n" + "\n".join(not_allowed)
    assert not unformatted, "lines not in Istio's log format:\n" + "\n".join(unformatted)
