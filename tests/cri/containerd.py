"""containerd with its CRI plugin, started by a test as a node runs it, and a CRI client that drives it
as the kubelet does.

The node is a network namespace of its own (``tests/cni/netns.py``): containerd runs there, so the
CNI plugins it execs (Debian's ``bridge`` makes ``cni0``) change that namespace, never the machine's.
Everything containerd keeps (root, state, its socket, runc's state, the pod network namespaces:
``netns_mounts_under_state_dir``) lives in the test's directory; its CNI config and bin directories are
the test's; the sandbox image is ``pause_image.py``'s, imported with ``ctr``. Its environment is a
node's (``PATH`` and nothing of the test's), so the plugins run as they would there.

:meth:`Containerd.stop` removes every sandbox through CRI, stops containerd, ends the shims it
left (containerd leaves them by design) and unmounts whatever is still mounted in the test's directory,
so a test leaves no process, mount or cgroup behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from tests.cni.netns import in_netns
from tests.cri import pause_image
from tests.cri.protos import load

pb, pb_grpc = load()

NODE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""A node's PATH (systemd's default, which containerd's unit inherits)."""
TOOLS = ("containerd", "ctr", "containerd-shim-runc-v2", "runc")
CGROUP_ROOT = Path("/sys/fs/cgroup")
RPC_TIMEOUT = 60.0


def missing_tools() -> list[str]:
    """The Debian programs (packages containerd and runc) not installed."""
    return [tool for tool in TOOLS if shutil.which(tool, path=NODE_PATH) is None]


def overlay_works(directory: Path) -> bool:
    """Whether an overlay mount works on ``directory``'s file system (not on overlayfs itself, for one);
    containerd's ``overlayfs`` snapshotter refuses to start otherwise."""
    probe = directory / "overlay-probe"
    layers = [probe / name for name in ("lower", "upper", "work", "merged")]
    for layer in layers:
        layer.mkdir(parents=True)
    lower, upper, work, merged = layers
    options = f"lowerdir={lower},upperdir={upper},workdir={work}"
    done = subprocess.run(
        ["mount", "-t", "overlay", "overlay", "-o", options, str(merged)], capture_output=True
    )
    if done.returncode == 0:
        subprocess.run(["umount", str(merged)], check=True)
    shutil.rmtree(probe)
    return done.returncode == 0


@dataclass
class Sandbox:
    """A pod sandbox containerd runs: its id, and what its status says (verbose ``info``)."""

    id: str
    name: str
    namespace: str
    ip: str
    netns: Path
    pid: int


@dataclass
class Containerd:
    """One containerd, its CRI client, and the sandboxes made through it."""

    base: Path
    node_netns: Path
    cni_conf_dir: Path
    cni_bin_dir: Path
    path_prefix: str = ""
    """Directories put before the node's PATH in containerd's environment (the plugins inherit it)."""
    process: subprocess.Popen[bytes] | None = None
    channel: grpc.Channel | None = None
    snapshotter: str = "overlayfs"
    cgroup_parent: str = field(default_factory=lambda: f"/ia-cri-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    image: str = pause_image.IMAGE_NAME

    @property
    def socket(self) -> Path:
        return self.base / "containerd.sock"

    @property
    def log(self) -> Path:
        return self.base / "containerd.log"

    @property
    def netns_dir(self) -> Path:
        """Where containerd pins the pods' network namespaces (``netns_mounts_under_state_dir``)."""
        return self.base / "state" / "io.containerd.grpc.v1.cri" / "netns"

    @property
    def runtime(self) -> Any:
        assert self.channel is not None, "containerd is not started"
        return pb_grpc.RuntimeServiceStub(self.channel)

    def config(self) -> str:
        """containerd 1.6's configuration (version 2) for this test."""
        cri = '[plugins."io.containerd.grpc.v1.cri"'
        disabled = [
            "io.containerd.internal.v1.opt",  # would install into /opt/containerd
            "io.containerd.snapshotter.v1.btrfs",
            "io.containerd.snapshotter.v1.zfs",
            "io.containerd.snapshotter.v1.devmapper",
            "io.containerd.snapshotter.v1.aufs",
            "io.containerd.tracing.processor.v1.otlp",
        ]
        return "\n".join(
            [
                "version = 2",
                f'root = "{self.base / "root"}"',
                f'state = "{self.base / "state"}"',
                f"disabled_plugins = {json.dumps(disabled)}",
                "[grpc]",
                f'  address = "{self.socket}"',
                "[debug]",
                '  level = "info"',
                f"{cri}]",
                f'  sandbox_image = "{self.image}"',
                "  netns_mounts_under_state_dir = true",
                "  disable_tcp_service = true",
                '  stream_server_address = "127.0.0.1"',
                '  stream_server_port = "0"',
                "  disable_apparmor = true",
                # no lower oom_score_adj than containerd's own (-998 for a sandbox): without
                # CAP_SYS_RESOURCE (a machine that is itself a sandbox, as kind's nodes) runc is refused it
                "  restrict_oom_score_adj = true",
                f"{cri}.cni]",
                f'  bin_dir = "{self.cni_bin_dir}"',
                f'  conf_dir = "{self.cni_conf_dir}"',
                "  max_conf_num = 1",
                f"{cri}.containerd]",
                f'  snapshotter = "{self.snapshotter}"',
                '  default_runtime_name = "runc"',
                f"{cri}.containerd.runtimes.runc]",
                '  runtime_type = "io.containerd.runc.v2"',
                f"{cri}.containerd.runtimes.runc.options]",
                "  SystemdCgroup = false",
                f'  Root = "{self.base / "runc"}"',
                "",
            ]
        )

    def start(self, timeout: float = 30.0) -> Containerd:
        """Start containerd in the node's namespace, wait for its CRI service, import the sandbox image."""
        self.base.mkdir(parents=True, exist_ok=True)
        if not overlay_works(self.base):
            self.snapshotter = "native"
        config = self.base / "config.toml"
        config.write_text(self.config())
        env = {"PATH": f"{self.path_prefix}:{NODE_PATH}" if self.path_prefix else NODE_PATH}
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                in_netns(self.node_netns, ["containerd", "--config", str(config)]),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.channel = grpc.insecure_channel(f"unix://{self.socket}")
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"containerd exited ({self.process.returncode}): {self.log_tail()}")
            try:
                self.runtime.Version(pb.VersionRequest(version="v1"), timeout=1)
                break
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"containerd's CRI did not answer in {timeout:.0f}s: {self.log_tail()}"
                    ) from None
                time.sleep(0.1)
        archive = self.base / "pause.oci.tar"
        pause_image.build(archive, name=self.image)
        self.ctr("images", "import", "--snapshotter", self.snapshotter, str(archive))
        return self

    def ctr(self, *args: str) -> str:
        """Run ``ctr`` on this containerd, in the CRI plugin's namespace (``k8s.io``)."""
        argv = ["ctr", "--address", str(self.socket), "--namespace", "k8s.io", *args]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    # -- CRI, as the kubelet calls it ------------------------------------------------------------------

    def network_status(self) -> tuple[bool, dict[str, Any]]:
        """The runtime's NetworkReady condition and its loaded CNI configuration (verbose Status)."""
        answer = self.runtime.Status(pb.StatusRequest(verbose=True), timeout=RPC_TIMEOUT)
        ready = any(c.type == "NetworkReady" and c.status for c in answer.status.conditions)
        return ready, json.loads(answer.info.get("cniconfig", "{}"))

    def sandbox_config(self, name: str, namespace: str = "default", uid: str | None = None) -> Any:
        """A PodSandboxConfig as the kubelet sends it for a pod with its own network namespace."""
        uid = uid or str(uuid.uuid4())
        return pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(name=name, uid=uid, namespace=namespace, attempt=0),
            hostname=name,
            log_directory=str(self.base / "pods" / f"{namespace}_{name}_{uid}"),
            dns_config=pb.DNSConfig(servers=["10.96.0.53"], searches=[f"{namespace}.svc.cluster.local"]),
            labels={
                "io.kubernetes.pod.name": name,
                "io.kubernetes.pod.namespace": namespace,
                "io.kubernetes.pod.uid": uid,
            },
            annotations={"kubernetes.io/config.source": "api"},
            linux=pb.LinuxPodSandboxConfig(
                cgroup_parent=f"{self.cgroup_parent}/pod{uid}",
                security_context=pb.LinuxSandboxSecurityContext(
                    namespace_options=pb.NamespaceOption(network=pb.POD, pid=pb.CONTAINER, ipc=pb.POD)
                ),
            ),
        )

    def run_pod_sandbox(self, name: str, namespace: str = "default", timeout: float = RPC_TIMEOUT) -> Sandbox:
        """RunPodSandbox; the sandbox as its verbose status describes it. A refusal raises grpc.RpcError."""
        request = pb.RunPodSandboxRequest(config=self.sandbox_config(name, namespace))
        answer = self.runtime.RunPodSandbox(request, timeout=timeout)
        return self.sandbox(answer.pod_sandbox_id)

    def sandbox(self, sandbox_id: str) -> Sandbox:
        status = self.runtime.PodSandboxStatus(
            pb.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id, verbose=True), timeout=RPC_TIMEOUT
        )
        info = json.loads(status.info["info"])
        namespaces = info["runtimeSpec"]["linux"]["namespaces"]
        netns = next(space["path"] for space in namespaces if space["type"] == "network")
        meta = status.status.metadata
        return Sandbox(
            sandbox_id, meta.name, meta.namespace, status.status.network.ip, Path(netns), info["pid"]
        )

    def stop_pod_sandbox(self, sandbox_id: str) -> None:
        self.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=RPC_TIMEOUT)

    def remove_pod_sandbox(self, sandbox_id: str) -> None:
        self.runtime.RemovePodSandbox(
            pb.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=RPC_TIMEOUT
        )

    def sandbox_ids(self) -> list[str]:
        answer = self.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=RPC_TIMEOUT)
        return [item.id for item in answer.items]

    # -- what is left on the node ----------------------------------------------------------------------

    def shims(self) -> list[int]:
        """The pids of the runc shims serving this containerd (one per sandbox)."""
        marker = str(self.socket).encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv and argv[0].endswith(b"containerd-shim-runc-v2") and marker in argv:
                found.append(int(entry.name))
        return found

    def stop(self) -> None:
        """Remove every sandbox, stop containerd, end its leftover shims, unmount what it left mounted."""
        try:
            if self.channel is not None and self.process is not None and self.process.poll() is None:
                for sandbox_id in self.sandbox_ids():
                    with contextlib.suppress(grpc.RpcError):
                        self.stop_pod_sandbox(sandbox_id)
                        self.remove_pod_sandbox(sandbox_id)
        finally:
            if self.channel is not None:
                self.channel.close()
            if self.process is not None and self.process.poll() is None:
                self.process.send_signal(signal.SIGTERM)
                try:
                    self.process.wait(15)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
            for pid in self.shims():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for mount in reversed(mounts_under(self.base)):
                subprocess.run(["umount", "-l", mount], capture_output=True, check=False)
            remove_cgroups(self.cgroup_parent)


def mounts_under(directory: Path) -> list[str]:
    """The mount points at or below ``directory``, in mount order (from this process's mountinfo)."""
    prefix = str(directory.resolve())
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == prefix or point.startswith(prefix + "/"):
            points.append(point)
    return points


def remove_cgroups(parent: str) -> None:
    """Remove ``parent`` (and the empty pod cgroups below it) from every cgroup hierarchy."""
    for hierarchy in [CGROUP_ROOT, *CGROUP_ROOT.iterdir()] if CGROUP_ROOT.is_dir() else []:
        top = hierarchy / parent.lstrip("/")
        if not top.is_dir():
            continue
        for directory in sorted(top.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            if directory.is_dir():
                with contextlib.suppress(OSError):
                    directory.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()


@contextlib.contextmanager
def running_containerd(
    base: Path, node_netns: Path, conf_dir: Path, bin_dir: Path, *, path_prefix: str = ""
) -> Iterator[Containerd]:
    """A started containerd, stopped (and everything of it removed) however the test ends."""
    runtime = Containerd(base, node_netns, conf_dir, bin_dir, path_prefix=path_prefix)
    try:
        yield runtime.start()
    finally:
        runtime.stop()
