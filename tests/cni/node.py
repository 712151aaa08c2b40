"""A Kubernetes node in a network namespace of its own, attaching pod namespaces as its runtime does.

The node's namespace plays the host's: the container runtime runs the CNI plugins there, so Debian's
``bridge`` plugin makes its bridge (with the gateway address, the "cluster" side of the pod network)
inside it, never on the machine. ``host-local`` keeps its IP allocations in the test's directory.
Each pod gets a named namespace (tests/cni/netns.py; ``ip netns add``, as CRI runtimes pin a
sandbox's namespace), then the network list's ADD; :meth:`Node.stop` runs DEL for every pod still
attached and deletes all the namespaces, so a test leaves no interface, address, rule or file behind.

What else "the cluster" runs (the control plane) lives in the node's namespace and listens on the
gateway address, which pods reach over the bridge, as they reach a Service in a cluster.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import socket
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.cni.libcni import Attachment, NetworkList, Runtime
from tests.cni.netns import Netns, in_netns, netns

SUBNET = ipaddress.ip_network("10.22.0.0/24")
GATEWAY = "10.22.0.1"
BRIDGE = "cni0"
NETWORK_NAME = "k8s-pod-network"


def bridge_network(data_dir: Path, extra_plugins: Sequence[Mapping[str, Any]] = ()) -> NetworkList:
    """The node's pod network: ``bridge`` with ``host-local`` IPAM (default route via the gateway), then
    any chained plugins (istio-cni)."""
    bridge = {
        "type": "bridge",
        "bridge": BRIDGE,
        "isGateway": True,
        "ipMasq": False,
        "ipam": {
            "type": "host-local",
            "ranges": [[{"subnet": str(SUBNET), "gateway": GATEWAY}]],
            "routes": [{"dst": "0.0.0.0/0"}],
            "dataDir": str(data_dir),
        },
    }
    return NetworkList(NETWORK_NAME, "1.0.0", (bridge, *extra_plugins))


@dataclass
class AttachedPod:
    """A pod sandbox's network: its namespace, its attachment and the runtime's cached ADD result."""

    netns: Netns
    attachment: Attachment
    result: dict[str, Any]
    holder: contextlib.ExitStack
    """Deletes the namespace."""

    @property
    def ip(self) -> str:
        """The pod IP: the first address of the result on an interface in the sandbox."""
        interfaces = self.result["interfaces"]
        for entry in self.result["ips"]:
            index = entry.get("interface")
            if index is not None and interfaces[index].get("sandbox"):
                return str(ipaddress.ip_interface(entry["address"]).ip)
        raise ValueError(f"no address in the sandbox in {self.result}")


class Node:
    """The node's namespace, its CNI runtime and the pods attached so far."""

    def __init__(
        self, base: Path, *, plugin_paths: Sequence[Path] = (), plugin_env: Mapping[str, str] | None = None
    ):
        self.base = base
        self._namespaces = contextlib.ExitStack()
        self._netns: Netns | None = None
        self.ipam_dir = base / "host-local"
        runtime_paths = (*plugin_paths, Runtime().paths[0])
        self.runtime = Runtime(runtime_paths, env=plugin_env)
        self.extra_plugins: list[Mapping[str, Any]] = []
        """Plugins chained after bridge (istio-cni) for the pods attached from now on."""
        self.conf_file: Path | None = None
        """The node's CNI config file, once something (install-cni) manages it: read at every ADD and
        DEL, as a runtime reads its conf dir, instead of ``bridge`` + ``extra_plugins``."""
        self.pods: dict[str, AttachedPod] = {}
        self._processes: list[subprocess.Popen[bytes]] = []

    @property
    def netns(self) -> Netns:
        """The node's namespace (the host's, for the runtime and the plugins)."""
        assert self._netns is not None, "the node is not started"
        return self._netns

    @property
    def gateway(self) -> str:
        return GATEWAY

    def start(self) -> Node:
        self.base.mkdir(parents=True, exist_ok=True)
        self._netns = self._namespaces.enter_context(netns("node"))
        self.runtime.runtime_netns = self._netns.path
        return self

    def network(self) -> NetworkList:
        if self.conf_file is not None:
            return NetworkList.from_document(json.loads(self.conf_file.read_text()))
        return bridge_network(self.ipam_dir, self.extra_plugins)

    def attach(self, name: str, namespace: str = "default") -> AttachedPod:
        """Create the pod's sandbox namespace and ADD it to the network, as the runtime does for a new pod."""
        holder = contextlib.ExitStack()
        sandbox = holder.enter_context(netns(name))
        attachment = Attachment.for_pod(f"{sandbox.name}-sandbox", sandbox.path, namespace, name)
        pod = AttachedPod(sandbox, attachment, {}, holder)
        self.pods[name] = pod
        pod.result = self.runtime.add(self.network(), attachment)
        return pod

    def detach(self, name: str) -> None:
        """DEL the pod from the network and delete its namespace (as the runtime tears down a sandbox)."""
        pod = self.pods.pop(name)
        try:
            if pod.result:
                self.runtime.delete(self.network(), pod.attachment, pod.result)
        finally:
            pod.holder.close()

    def stop(self) -> None:
        for process in self._processes:
            if process.poll() is None:
                process.kill()
            process.wait()
        try:
            for name in list(self.pods):
                self.detach(name)
        finally:
            self._namespaces.close()

    # -- what the cluster runs on the node's side of the bridge (Istiod uses these) --------------------
    def run_in_network(self, args: Sequence[str], log: Path) -> subprocess.Popen[bytes]:
        """A root process in the node's namespace (the control plane), stopped by :meth:`stop`."""
        with log.open("ab") as output:
            process = subprocess.Popen(
                in_netns(self.netns.path, args), stdout=output, stderr=subprocess.STDOUT
            )
        self._processes.append(process)
        return process

    def port_open(self, port: int, host: str = GATEWAY) -> bool:
        with self.socket() as sock:
            sock.settimeout(0.5)
            return sock.connect_ex((host, port)) == 0

    def socket(
        self, family: socket.AddressFamily = socket.AF_INET, kind: socket.SocketKind = socket.SOCK_STREAM
    ) -> socket.socket:
        return self.netns.socket(family, kind)


@contextlib.contextmanager
def running_node(base: Path, **kwargs: Any) -> Iterator[Node]:
    """A started node, every pod detached and every namespace deleted however the test ends."""
    node = Node(base, **kwargs)
    try:
        yield node.start()
    finally:
        node.stop()
