"""A Kubernetes node as the containerd tests run it: containerd's CRI, Debian's CNI plugins, install-cni.

- **The node**: a network namespace of its own (``tests/cni/node.py``) standing for the host's.
  containerd runs there (``containerd.py``), so the bridge ``cni0`` and its gateway live there; its
  CNI config directory holds the node's pod network, Debian's ``bridge`` + ``host-local`` +
  ``portmap``, and its CNI bin directory Debian's plugins (and ``loopback``, which containerd runs
  for every sandbox's ``lo``).
- **install-cni**, as it ships: the install-cni image's program, run chrooted into the image's root
  file system (unpacked from the archive ``make images`` builds, ``tests/images/built.py``), in the
  node's namespace as Istio's DaemonSet runs it in the host's (``hostNetwork``), with the variables of
  Istio 1.28's chart (:data:`CHART_ENV`). Its host paths, which the DaemonSet mounts at
  ``/host/etc/cni/net.d``, ``/host/opt/cni/bin`` and ``/var/run/istio-cni``, are the test's
  directories, bind-mounted into its root; the plugin it installs is the image's ``/opt/cni/bin``: the
  self-contained plugin as it ships. It copies the plugin into
  the node's bin directory and chains it into the node's conflist; containerd picks that up by
  itself, as it does on a node.
- **The API server** is the FAKE one of the plugin tests (``tests/cni/fake_kube.py``: no real one
  runs here), on the node's loopback, where the plugin reaches it through the kubeconfig install-cni
  writes.
- **Ambient** (``cri_node(ambient=True)``): install-cni gets the chart's ambient values
  (:data:`AMBIENT_CHART_ENV`) and the DaemonSet's ambient mounts (:class:`AmbientMounts`): the node's
  ztunnel socket directory at ``/var/run/ztunnel`` and containerd's directory of pod network
  namespaces under ``/host``, receiving the runtime's later mounts (``HostToContainer``). The
  DaemonSet ``istio-cni-node`` is in the API server, so a restart of install-cni is an upgrade (Istio's
  ``ShouldStopCleanup``); it is deleted before the node's own stop, an uninstall. A process named
  ``kubelet`` stands for the kubelet in ``/proc`` (:func:`kubelet_process`). install-cni runs in
  the node's network namespace, as the chart renders it with ``ambient.shareHostNetworkNamespace``
  (``hostNetwork``, and no ``ALLOW_SWITCH_TO_HOST_NS``); the chart's default, a pod network namespace
  whose node agent enters ``/host/proc/1/ns/net``, is not run here: the machine's PID 1 is not the
  test node's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from istio_agent.ctl.local import wait_until
from tests.cni.fake_kube import TOKEN as FAKE_TOKEN
from tests.cni.fake_kube import FakeKube
from tests.cni.install.layout import Node as InstallLayout
from tests.cni.install.layout import install_cni_args
from tests.cni.libcni import DEBIAN_PLUGINS
from tests.cni.netns import in_netns, netns, sh
from tests.cni.node import Node, bridge_network, running_node
from tests.cri.containerd import Containerd, running_containerd
from tests.e2e.pod import image_root_script
from tests.e2e.test_cni_pod import ApiServerOnNode
from tests.images.built import image, image_root, unavailable

TESTDATA = Path(__file__).with_name("testdata")
NODE_PLUGINS = ("bridge", "host-local", "portmap", "loopback")
CONFLIST = "10-k8s-pod-network.conflist"
IMAGE_INSTALL_CNI = Path("/usr/local/bin/install-cni")
"""The install-cni image's program (its CMD)."""
NODE_NAME = "node-1"
CHART_ENV = {
    # the istio-cni chart's ConfigMap with its default values (manifests/charts/istio-cni,
    # templates/configmap-cni.yaml and values.yaml of 1.28)
    "AMBIENT_ENABLED": "false",
    "CHAINED_CNI_PLUGIN": "true",
    "EXCLUDE_NAMESPACES": "kube-system",
    "REPAIR_ENABLED": "true",
    "REPAIR_LABEL_PODS": "false",
    "REPAIR_DELETE_PODS": "false",
    "REPAIR_REPAIR_PODS": "true",
    "REPAIR_INIT_CONTAINER_NAME": "istio-validation",
    "REPAIR_BROKEN_POD_LABEL_KEY": "cni.istio.io/uninitialized",
    "REPAIR_BROKEN_POD_LABEL_VALUE": "true",
    "NATIVE_NFTABLES": "false",
    # the DaemonSet's own env (templates/daemonset.yaml)
    "REPAIR_NODE_NAME": NODE_NAME,
    "REPAIR_RUN_AS_DAEMON": "true",
    "REPAIR_SIDECAR_ANNOTATION": "sidecar.istio.io/status",
    "ALLOW_SWITCH_TO_HOST_NS": "true",
    "NODE_NAME": NODE_NAME,
    "POD_NAME": "istio-cni-node-x7k2p",
    "POD_NAMESPACE": "istio-system",
}
AMBIENT_CHART_ENV = {
    # the same ConfigMap with ambient.enabled=true and the chart's other ambient defaults (values.yaml:
    # enablementSelectors, dnsCapture, ipv6, reconcileIptablesOnStartup, enableAmbientDetectionRetry);
    # the selectors as the chart renders them (toYaml)
    "AMBIENT_ENABLED": "true",
    "AMBIENT_ENABLEMENT_SELECTOR": (
        "- podSelector:\n"
        "    matchLabels:\n"
        "      istio.io/dataplane-mode: ambient\n"
        "- namespaceSelector:\n"
        "    matchLabels:\n"
        "      istio.io/dataplane-mode: ambient\n"
        "  podSelector:\n"
        "    matchExpressions:\n"
        "    - key: istio.io/dataplane-mode\n"
        "      operator: NotIn\n"
        "      values:\n"
        "      - none\n"
    ),
    "AMBIENT_DNS_CAPTURE": "true",
    "AMBIENT_IPV6": "true",
    "AMBIENT_RECONCILE_POD_RULES_ON_STARTUP": "false",
    "ENABLE_AMBIENT_DETECTION_RETRY": "false",
}
ZTUNNEL_DIR = "/var/run/ztunnel"
"""Where the DaemonSet mounts the host's ``/var/run/ztunnel`` (``cni-ztunnel-sock-dir``), same path;
the node agent's default ``ZTUNNEL_UDS_ADDRESS`` is ``ztunnel.sock`` there."""
HOST_MOUNTS = "/host"
"""Istio's ``HostMountsPath``: the DaemonSet mounts the host's ``cniNetnsDir`` at ``/host/var/run/netns``,
and the node agent opens a plugin event's netns path under it (``openNetnsInRoot``)."""
DAEMONSET = {"metadata": {"name": "istio-cni-node", "namespace": "istio-system"}}


@dataclass
class AmbientMounts:
    """The DaemonSet's ambient mounts, with the node's paths: ztunnel's socket directory, and the
    directory where the runtime pins pod network namespaces (``cniNetnsDir``: containerd's own here).

    ``netns_at_same_path`` also mounts that directory at its host path (besides ``/host`` + it),
    which Istio's chart does not: for a node agent that opens the event's path as it is."""

    ztunnel_dir: Path
    netns_dir: Path
    netns_at_same_path: bool = False

    @property
    def ztunnel_socket(self) -> Path:
        return self.ztunnel_dir / "ztunnel.sock"

    def binds(self) -> list[tuple[Path, str, bool]]:
        binds = [
            (self.ztunnel_dir, ZTUNNEL_DIR, False),
            (self.netns_dir, f"{HOST_MOUNTS}{self.netns_dir}", False),
            (Path("/proc"), f"{HOST_MOUNTS}/proc", True),  # the chart's cni-host-procfs volume
        ]
        if self.netns_at_same_path:
            binds.append((self.netns_dir, str(self.netns_dir), False))
        return binds


@contextlib.contextmanager
def kubelet_process(directory: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A process the node agent takes for the kubelet (comm and command line ``kubelet``, root as
    kubelet runs): with native nftables it finds kubelet's uid in ``/proc`` at start (Istio's
    ``kubeletuid_linux.go``) to SNAT only kubelet's probes. The test is the kubelet here (its CRI
    client); this process only stands for it in ``/proc``. Ended on exit."""
    program = directory / "kubelet"
    shutil.copy2(shutil.which("sleep") or "/bin/sleep", program)
    process = subprocess.Popen([str(program), "infinity"])
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def share_mounts_below(directory: Path) -> None:
    """Make ``directory`` a shared mount point, so the binds of it in install-cni's mount namespace
    (slaves there) receive the runtime's later mounts below it (``mountPropagation: HostToContainer``).
    The node's ``Containerd.stop`` unmounts it with everything under its directory."""
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "--bind", str(directory), str(directory)], check=True)
    subprocess.run(["mount", "--make-shared", str(directory)], check=True)


def injected_pod(name: str, namespace: str = "default") -> dict[str, Any]:
    """Istio's injector output for a CNI node (``testdata/hello.yaml.cni.injected``) as a pod."""
    deployment = next(yaml.safe_load_all((TESTDATA / "hello.yaml.cni.injected").read_text()))
    template = deployment["spec"]["template"]
    metadata = {**template["metadata"], "name": name, "namespace": namespace}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {**template["spec"], "nodeName": NODE_NAME},
    }


def plain_pod(name: str, namespace: str = "default") -> dict[str, Any]:
    """The same workload without injection (no sidecar, no status annotation)."""
    metadata = {"name": name, "namespace": namespace, "labels": {"app": "hello"}}
    container = {"name": "hello", "image": "fake.docker.io/google-samples/hello-go-gke:1.0"}
    spec = {"containers": [container], "nodeName": NODE_NAME}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


@dataclass
class CriNode:
    """The node's parts the tests use."""

    base: Path
    node: Node
    api: ApiServerOnNode
    layout: InstallLayout
    containerd: Containerd

    api_stopped: bool = False
    ambient: AmbientMounts | None = None
    env: Mapping[str, str] | None = None
    """Chart values other than the defaults, for every start of install-cni."""
    install_cni: subprocess.Popen[bytes] | None = None
    starts: int = 0
    """How many times install-cni was started (each start has a container directory of its own)."""

    @property
    def kube(self) -> FakeKube:
        assert self.api.kube is not None
        return self.api.kube

    @property
    def install_cni_log(self) -> Path:
        return self.base / "install-cni.log"

    def kube_call(self, write: Callable[[], Any]) -> Any:
        """Run ``write`` (a change of the FAKE API server's state) on the server's loop, so that the
        watches it wakes are woken there (``FakeKube`` is not thread-safe); its result."""
        loop = self.api._loop  # ApiServerOnNode has no public handle on its loop
        assert loop is not None

        async def call() -> Any:
            return write()

        return asyncio.run_coroutine_threadsafe(call(), loop).result(10)

    def start_install_cni(self) -> subprocess.Popen[bytes]:
        """install-cni's container started again (a new container directory, as a new pod of the
        DaemonSet has); returns once its program runs."""
        self.starts += 1
        workdir = self.base / f"install-cni-container-{self.starts}"
        self.install_cni = start_install_cni(
            self.layout,
            self.node,
            self.kube.port,
            self.kube.ca_pem,
            self.install_cni_log,
            ambient=self.ambient,
            workdir=workdir,
            env=self.env,
        )
        return self.install_cni

    def assert_in_image_root(self) -> None:
        """install-cni's program runs chrooted in its container's root (once it has started: the
        container's script says it is ready just before its ``exec chroot``)."""
        assert self.install_cni is not None
        running_in = os.readlink(f"/proc/{self.install_cni.pid}/root")
        assert running_in == str(self.base / f"install-cni-container-{self.starts}" / "root"), running_in

    def stop_install_cni(self) -> int:
        """SIGTERM, as the kubelet stops the container; its exit code."""
        assert self.install_cni is not None
        self.install_cni.terminate()
        try:
            return self.install_cni.wait(15)
        except subprocess.TimeoutExpired:
            self.install_cni.kill()
            self.install_cni.wait()
            raise

    @property
    def ipam_dir(self) -> Path:
        return self.node.ipam_dir

    def stop_api_server(self) -> None:
        """The API server goes down (for good: the node's fixture does not start it again)."""
        self.api.stop()
        self.api_stopped = True

    def veths(self) -> list[str]:
        """The host ends of the pods' veths in the node's namespace."""
        links = json.loads(self.node.netns.ip("-j", "link", "show", "type", "veth") or "[]")
        return [link["ifname"] for link in links]

    def allocations(self) -> list[str]:
        """The pod IPs host-local holds (one file per address in its network's directory)."""
        network = self.ipam_dir / "k8s-pod-network"
        if not network.is_dir():
            return []
        return sorted(
            p.name for p in network.iterdir() if p.name[0].isdigit() and not p.name.startswith("last_")
        )


def node_conflist(ipam_dir: Path) -> dict[str, Any]:
    """The node's pod network before install-cni: bridge + host-local, then portmap (as kubeadm nodes)."""
    portmap = {"type": "portmap", "capabilities": {"portMappings": True}}
    return bridge_network(ipam_dir, [portmap]).document()


def start_install_cni(
    layout: InstallLayout,
    node: Node,
    api_port: int,
    ca_pem: bytes,
    log: Path,
    *,
    ambient: AmbientMounts | None = None,
    workdir: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """install-cni as the DaemonSet runs it: the install-cni image's own program, chrooted into the
    image's root (an overlay on the unpacked archive, in a mount namespace of its own), in the node's
    network namespace, with the image's ENV plus the chart's. Its host paths (the node's CNI conf and bin
    directories, the run directory and the service account) are bind-mounted into that root at the paths
    the test uses outside, as the chart mounts ``/var/run/istio-cni`` at the same path on both sides:
    the plugin it configures runs on the node and must find those paths there too.

    ``ambient``: the chart's ambient values and the DaemonSet's ambient mounts; install-cni's mount
    namespace is then a slave of the test's, so mounts the runtime makes later under a shared host path
    reach it. ``workdir``: the container's directory (its overlay), new for each start. ``env``: chart
    values other than the defaults (``NATIVE_NFTABLES``: the chart's ``global.nativeNftables``)."""
    (layout.sa / "ca.crt").write_bytes(ca_pem)
    (layout.sa / "token").write_text(FAKE_TOKEN)
    env = {
        **image("install-cni").env(),
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",
        "KUBERNETES_SERVICE_PORT": str(api_port),
        **CHART_ENV,
        **(AMBIENT_CHART_ENV if ambient is not None else {}),
        **(env or {}),
    }
    if ambient is not None:  # shareHostNetworkNamespace: the chart leaves the switch out
        env.pop("ALLOW_SWITCH_TO_HOST_NS", None)
    layout.run.mkdir(exist_ok=True)
    binds = [(path, str(path), False) for path in (layout.conf, layout.bin, layout.run)]
    binds.append((layout.sa, str(layout.sa), True))
    if ambient is not None:
        binds += ambient.binds()
    workdir = workdir or log.parent / "install-cni-container"
    workdir.mkdir()
    ready_read, ready_write = os.pipe()
    script = image_root_script(image_root("install-cni"), binds, workdir, ready_write)
    args = install_cni_args(layout, program=IMAGE_INSTALL_CNI)
    propagation = "slave" if ambient is not None else "private"
    command = [
        "nsenter",
        f"--net={node.netns.path}",
        "--",
        "unshare",
        "--mount",
        f"--propagation={propagation}",
    ]
    # Ambient: the node's /proc where the DaemonSet mounts it, and the node's root under /host for
    # the netns paths of plugin events (the node agent derives it from --host-proc-dir).
    host_proc = f"{HOST_MOUNTS}/proc" if ambient is not None else "/proc"
    command += ["bash", "-c", script, "bash", *args, f"--host-proc-dir={host_proc}"]
    try:
        with log.open("ab") as output:
            process = subprocess.Popen(
                command,
                env=env,  # its PATH (the image's) finds the host's nsenter, unshare and bash too
                stdout=output,
                stderr=subprocess.STDOUT,
                pass_fds=(ready_write,),
            )
    finally:
        os.close(ready_write)
    with os.fdopen(ready_read, "rb") as ready:
        if ready.read().strip() != b"ready":
            process.wait(15)
            raise AssertionError(f"install-cni's container did not start: {log.read_text()}")
    return process


@contextlib.contextmanager
def cri_node(
    base: Path,
    *,
    path_prefix: Sequence[Path] = (),
    ambient: bool = False,
    netns_at_same_path: bool = False,
    env: Mapping[str, str] | None = None,
) -> Iterator[CriNode]:
    """The started node; on exit every sandbox is removed and every process, mount and namespace ended.

    ``path_prefix``: directories put first on containerd's PATH (the plugins it execs inherit it).
    ``ambient``: install-cni in ambient mode (the module's "Ambient"); ``netns_at_same_path``: see
    :class:`AmbientMounts`; ``env``: chart values other than the defaults."""
    reason = unavailable("install-cni")
    if reason is not None:
        pytest.skip(reason)
    conf_dir, bin_dir, install_root = base / "etc-cni-net.d", base / "opt-cni-bin", base / "install"
    for directory in (conf_dir, bin_dir, install_root):
        directory.mkdir(parents=True)
    for plugin in NODE_PLUGINS:
        shutil.copy2(DEBIAN_PLUGINS / plugin, bin_dir / plugin)
    layout = InstallLayout(install_root)  # its run dir and service account; the node's conf and bin dirs
    layout.conf, layout.bin = conf_dir, bin_dir
    layout.source = Path("/opt/cni/bin")  # in the image's root, where install-cni runs
    prefix = os.pathsep.join(str(p) for p in path_prefix)
    with contextlib.ExitStack() as stack, running_node(base / "node") as node:
        conflist = conf_dir / CONFLIST
        conflist.write_text(json.dumps(node_conflist(node.ipam_dir), indent=2))
        with running_containerd(
            base / "containerd", node.netns.path, conf_dir, bin_dir, path_prefix=prefix
        ) as runtime:
            cri = CriNode(base, node, ApiServerOnNode(node, base / "kube"), layout, runtime, env=env)
            if ambient:
                share_mounts_below(runtime.netns_dir)
                cri.ambient = AmbientMounts(base / "ztunnel", runtime.netns_dir, netns_at_same_path)
                cri.ambient.ztunnel_dir.mkdir()
                cri.kube.daemonsets[("istio-system", "istio-cni-node")] = DAEMONSET
            try:
                if ambient:
                    stack.enter_context(kubelet_process(base))
                process = cri.start_install_cni()
                try:
                    wait_for_chaining(runtime, conflist, process, cri.install_cni_log)
                    cri.assert_in_image_root()
                    yield cri
                finally:
                    # an uninstall, not an upgrade: the node agent takes its host rules out
                    cri.kube.daemonsets.clear()
                    if cri.install_cni is not None and cri.install_cni.poll() is None:
                        cri.stop_install_cni()
            finally:
                if not cri.api_stopped:
                    cri.api.stop()


def wait_for_chaining(
    runtime: Containerd, conflist: Path, process: subprocess.Popen[bytes], log: Path
) -> None:
    """Until install-cni has chained istio-cni into the conflist and containerd has loaded it."""

    def chained() -> bool:
        assert process.poll() is None, f"install-cni exited: {log.read_text()}"
        plugins = json.loads(conflist.read_text())["plugins"]
        return plugins[-1]["type"] == "istio-cni" and (runtime.cni_bin_dir / "istio-cni").exists()

    wait_until(chained, 30, "install-cni chaining istio-cni into the node's conflist")

    def loaded() -> bool:
        ready, config = runtime.network_status()
        networks = [n["Config"] for n in config.get("Networks", [])]
        types = [
            p["Network"]["type"] for n in networks if n["Name"] == "k8s-pod-network" for p in n["Plugins"]
        ]
        return ready and types[-1:] == ["istio-cni"]

    wait_until(loaded, 30, "containerd loading the conflist with istio-cni")


# -- what the tests check in a sandbox and on the node ---------------------------------------------

ISTIO_GOLDEN = TESTDATA / "basic.txt.golden"
"""Istio's rules for the injected pod (Istio's plugin dry run for its basic case)."""
BACKENDS = ("nft", "legacy")


def saved_rules(netns: Path) -> dict[str, str]:
    """``iptables-save`` and ``ip6tables-save`` of each backend in a namespace, comments dropped and
    counters zeroed, for those that hold any of Istio's chains."""
    saved = {}
    for family in ("iptables", "ip6tables"):
        for backend in BACKENDS:
            command = f"{family}-{backend}-save"
            text = sh(*in_netns(netns, [command]))
            lines = [
                re.sub(r"\[\d+:\d+\]", "[0:0]", line)
                for line in text.splitlines()
                if not line.startswith("#")
            ]
            if any("ISTIO" in line for line in lines):
                saved[command] = "\n".join(lines)
    return saved


@functools.cache
def istio_reference(save_command: str) -> str:
    """Istio's golden rules as ``save_command``'s backend holds them: restored in a fresh namespace, saved."""
    with netns("reference") as reference:
        sh(
            *in_netns(reference.path, [save_command.replace("-save", "-restore")]),
            input=ISTIO_GOLDEN.read_text() + "\n",
        )
        return saved_rules(reference.path)[save_command]


def processes_from(directory: Path) -> list[str]:
    """Processes running a program from ``directory`` (a plugin the runtime exec'd from the bin dir: its
    path is an argument of the shell or the loader that runs it)."""
    prefix = f"{directory}/".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                if any(arg.startswith(prefix) for arg in argv):
                    found.append(f"{entry.name}: {b' '.join(argv).decode(errors='replace')}")
    return found


def leftovers(cri: CriNode) -> dict[str, list[str]]:
    """What sandboxes may leave on the node, by kind: every list is empty once they are all removed."""
    runtime = cri.containerd
    netns_dir = runtime.netns_dir
    return {
        "sandboxes": runtime.sandbox_ids(),
        "network namespaces": sorted(os.listdir(netns_dir)) if netns_dir.is_dir() else [],
        "shims": [str(pid) for pid in runtime.shims()],
        "plugin processes": processes_from(runtime.cni_bin_dir),
        "pod IPs": cri.allocations(),
        "veths": cri.veths(),
    }


NOTHING_LEFT: dict[str, list[str]] = {
    kind: [] for kind in ("sandboxes", "network namespaces", "shims", "plugin processes", "pod IPs", "veths")
}
