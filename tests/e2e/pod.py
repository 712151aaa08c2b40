"""A Kubernetes pod on this machine, run the way the kubelet runs it: the harness for pod-shaped tests.

The agent must work where it really runs, not only in a test's temporary directory. What a pod gives
its containers, and how this harness gives it (Istio's side, the injected ``istio-proxy``, is in
``tests/e2e/injector.py``):

- **Network**: the pod's own network namespace, held by a pause process (as the kubelet's pause
  container holds it), loopback up. The pod listens on Istio's real fixed ports (15000, 15001, 15006,
  15020, 15021, 15053, 15090) without meeting any other test. What the test runs "in the cluster" (the
  local control plane as ``istiod.istio-system.svc``) lives in the same namespace on another loopback
  address, which the pod's ``/etc/hosts`` names. The test talks to the pod through sockets made in the
  namespace (:meth:`Pod.socket`). Or, as on a node with a CNI network (``tests/cni/node.py``), the
  namespace the runtime prepared with the CNI chain, the pod IP from its result; the cluster is then
  on the node's side of the bridge.
- **File system**: each container has a private mount namespace. With an image root
  (:meth:`Image.of_built`: ``make images``' image, unpacked from its archive by tests/images/built.py)
  the container's root is that image, as a runtime gives it: an overlay with the image as its lower
  layer (the mount points it lacks are made in the upper one, in the test's temporary directory),
  remounted read-only (``readOnlyRootFilesystem: true``), with its own ``/proc``, a ``/dev`` of the
  usual devices and a read-only ``/sys``; the container is ``chroot``-ed into it, and its last step,
  dropping to the image's user, runs the image's own ``setpriv`` and ``env``. Without one (a test's
  app, or the image laid out from this checkout), the root is the host's, remounted read-only: the
  venv and the Envoy binary stay readable and nothing else is writable; the image's files are
  bind-mounted where the image has them, and mount points the host lacks (``/etc/istio``,
  ``/var/lib/istio``, ``/var/run/secrets``) are made in overlays whose upper layers are in the test's
  temporary directory: nothing changes on the host.
- **Volumes** at their real paths, from per-test directories: emptyDirs writable (0777, as the kubelet
  makes them); config maps, projected tokens and downward-API files read-only.
- **Process**: a PID namespace per container (its entrypoint is PID 1, so a container that stops takes
  everything in it along, Envoy included), cwd ``/``, the image's uid/gid with no supplementary
  groups, every capability dropped and ``no_new_privs`` (``allowPrivilegeEscalation: false``), and an
  environment cleared to exactly the image's ENV, what the runtime adds and the pod spec's env
  (``$(VAR)`` in args expanded as the kubelet does).
- **Hooks** as the kubelet runs them: ``postStart`` starts right after the container, which is not
  ready until the hook exits 0; on stop, ``preStop`` runs first, then SIGTERM, then SIGKILL once the
  grace period is over. A hook, like ``kubectl exec``, runs in the container's namespaces with its
  user and environment.

Root only (namespaces, mounts, ``setpriv``): :func:`unsupported` says why a pod cannot run here.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import dns.message
import dns.query

from tests.cni.netns import socket_in
from tests.images import built

HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
POD_IP = "127.0.0.1"
CLUSTER_ADDRESS = "127.0.0.2"
"""Where the test's "cluster" services (istiod) listen, inside the pod's network."""
CLUSTER_DOMAIN = "cluster.local"
NAMESPACE_TIMEOUT = 20.0


def unsupported() -> str | None:
    """Why a pod cannot run on this machine (None: it can)."""
    if os.geteuid() != 0:
        return "pod-shaped tests need root (namespaces, mounts, setpriv); CI runs as root"
    tools = ("unshare", "nsenter", "setpriv", "mount", "ip", "bash")
    missing = [tool for tool in tools if shutil.which(tool, path=HOST_PATH) is None]
    if missing:
        return f"pod-shaped tests need {', '.join(missing)} (util-linux, iproute2)"
    if "overlay" not in Path("/proc/filesystems").read_text():
        return "pod-shaped tests need overlayfs (mount points of the read-only image)"
    return None


_GO_ESCAPES = {"\a": "\\a", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\v": "\\v"}
_GO_ESCAPES.update({'"': '\\"', "\\": "\\\\"})


def go_quote(value: str) -> str:
    """Go's ``%q`` of a string, as the kubelet writes downward-API values."""
    out = ['"']
    for char in value:
        if char in _GO_ESCAPES:
            out.append(_GO_ESCAPES[char])
        elif char.isprintable():
            out.append(char)
        elif ord(char) < 0x80:
            out.append(f"\\x{ord(char):02x}")
        else:
            out.append(f"\\u{ord(char):04x}" if ord(char) < 0x10000 else f"\\U{ord(char):08x}")
    return "".join([*out, '"'])


def downward_api(values: Mapping[str, str]) -> str:
    """A downward-API labels/annotations file: ``key="value"`` lines, sorted, Go-quoted."""
    return "\n".join(f"{key}={go_quote(value)}" for key, value in sorted(values.items()))


def expand_kubelet_vars(text: str, env: Mapping[str, str]) -> str:
    """``$(VAR)`` in a container's command and args, as the kubelet expands it (``$$`` escapes it)."""

    def replace(match: re.Match[str]) -> str:
        return "$" if match.group(0) == "$$" else env.get(match.group(1), match.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", replace, text)


@dataclass(frozen=True)
class Image:
    """What an image contributes: its root (or files at their paths on the host's), its ENV, its USER."""

    files: Mapping[str, Path]
    env: Mapping[str, str]
    uid: int
    gid: int
    needs: tuple[Path, ...] = ()
    """Host paths the files use at run time (an interpreter, a venv): an image would have them where
    any user can read them, so the container is given a way through to them."""
    root: Path | None = None
    """The image's root file system: the container runs in it instead of the host's root."""

    @classmethod
    def of_built(cls, name: str, *, uid: int, gid: int) -> Image:
        """``make images``' image ``name`` (tests/images/built.py): its unpacked root and its config's ENV;
        ``uid``/``gid`` are the pod's ``runAsUser``/``runAsGroup``."""
        return cls(files={}, env=built.image(name).env(), uid=uid, gid=gid, root=built.image_root(name))


@dataclass(frozen=True)
class Mount:
    """A volume mounted into a container (``volumeMounts``)."""

    volume: str
    path: str
    read_only: bool = False


@dataclass
class Container:
    """One container of the pod spec."""

    name: str
    image: Image
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    mounts: list[Mount] = field(default_factory=list)
    post_start: list[str] | None = None
    pre_stop: list[str] | None = None
    grace_period: float = 30.0

    def environment(self, hostname: str) -> dict[str, str]:
        """The process environment: the image's ENV, what the runtime adds, then the pod spec's env."""
        return {**self.image.env, "HOSTNAME": hostname, "HOME": "/", **self.env}

    def command(self) -> list[str]:
        return [expand_kubelet_vars(arg, self.env) for arg in self.args]


@dataclass
class Running:
    """A started container: the runtime process (whose exit status is the container's) and its PID 1."""

    spec: Container
    restart: int
    runtime: subprocess.Popen[bytes]
    pid: int
    """The entrypoint's PID as the host sees it."""
    log: Path
    """stdout and stderr, as ``kubectl logs`` shows them."""
    post_start: subprocess.Popen[bytes] | None = None
    pre_stop_code: int | None = None
    exit_code: int | None = None

    def alive(self) -> bool:
        return self.runtime.poll() is None

    def output(self, name: str) -> Path:
        """A file beside the log: ``post-start.log``, ``pre-stop.log``, ``runtime.log``, ``setup.sh``."""
        return self.log.parent / name


class Pod:
    """A pod: its network namespace, volumes and containers. :meth:`stop` kills all it started."""

    def __init__(
        self,
        base: Path,
        name: str = "web",
        namespace: str = "default",
        *,
        service_account: str | None = None,
        labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
        hosts: Mapping[str, str] | None = None,
        network: tuple[Path, str] | None = None,
    ) -> None:
        """``network``: (the sandbox's network namespace, the pod IP) when the CNI chain prepared it (as
        tests/cni/node.py does); without it the pod gets a namespace of its own with loopback only."""
        self.base = base
        self.name, self.namespace = name, namespace
        self.service_account = service_account or name
        self.labels = dict(labels or {"app": name})
        self.annotations = dict(annotations or {})
        self.ip = network[1] if network else POD_IP
        self._network_namespace = network[0] if network else None
        self.hosts = dict(hosts or {})
        """Extra ``/etc/hosts`` entries: name -> address."""
        self.volumes: dict[str, tuple[Path, bool]] = {}
        """Volume name -> (its directory on the host, read-only)."""
        self.containers: dict[str, Running] = {}
        self._pause: subprocess.Popen[bytes] | None = None
        self._others: list[subprocess.Popen[bytes]] = []
        self._starts: dict[str, int] = {}

    # -- the pod's network ----------------------------------------------------------------------------
    @property
    def netns(self) -> Path:
        assert self._pause is not None, "the pod is not started"
        return Path(f"/proc/{self._pause.pid}/ns/net")

    def start(self) -> None:
        """The pause process holding the pod's network namespace (loopback up), and its hosts and resolv.conf."""
        self.base.mkdir(parents=True, exist_ok=True)
        if self._network_namespace is None:
            enter = ["unshare", "--net", "--"]
        else:  # the sandbox the runtime made and attached to the pod network before starting the pod
            enter = ["nsenter", f"--net={self._network_namespace}", "--"]
        self._pause = subprocess.Popen([*enter, "sleep", "infinity"], env={"PATH": HOST_PATH})
        deadline = time.monotonic() + NAMESPACE_TIMEOUT
        while not self._own_netns():
            if self._pause.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the pod's network namespace did not come up")
            time.sleep(0.01)
        loopback_up = ["nsenter", f"--net={self.netns}", "--", "ip", "link", "set", "lo", "up"]
        subprocess.run(loopback_up, check=True, env={"PATH": HOST_PATH})
        etc = self.base / "etc"
        etc.mkdir(exist_ok=True)
        hosts = [
            "127.0.0.1\tlocalhost",
            "::1\tlocalhost ip6-localhost ip6-loopback",
            f"{self.ip}\t{self.name}",
        ]
        hosts += [f"{address}\t{host}" for host, address in self.hosts.items()]
        (etc / "hosts").write_text("# Kubernetes-managed hosts file.\n" + "\n".join(hosts) + "\n")
        search = f"{self.namespace}.svc.{CLUSTER_DOMAIN} svc.{CLUSTER_DOMAIN} {CLUSTER_DOMAIN}"
        # No cluster DNS runs: a forwarded query is refused at once. The names the pod needs are in hosts.
        (etc / "resolv.conf").write_text(f"search {search}\nnameserver 127.0.0.53\noptions ndots:5\n")

    def _own_netns(self) -> bool:
        assert self._pause is not None
        try:
            return os.readlink(f"/proc/{self._pause.pid}/ns/net") != os.readlink("/proc/self/ns/net")
        except OSError:
            return False

    def stop(self) -> None:
        """Kill every container, hook and process of the pod, then the pause process."""
        for running in self.containers.values():
            self._kill(running)
        for process in self._others:
            stop_process(process)
        if self._pause is not None:
            stop_process(self._pause, signal.SIGKILL)

    def run_in_network(self, args: Sequence[str], log: Path) -> subprocess.Popen[bytes]:
        """A root process of the test's "cluster" (the control plane) that lives in the pod's network."""
        with log.open("ab") as output:
            process = subprocess.Popen(
                ["nsenter", f"--net={self.netns}", "--", *args], stdout=output, stderr=subprocess.STDOUT
            )
        self._others.append(process)
        return process

    def socket(
        self, family: socket.AddressFamily = socket.AF_INET, kind: socket.SocketKind = socket.SOCK_STREAM
    ) -> socket.socket:
        """A socket in the pod's network namespace, for the test to reach the pod's ports."""
        return socket_in(self.netns, family, kind)

    def port_open(self, port: int, host: str = "127.0.0.1") -> bool:
        with self.socket() as sock:
            sock.settimeout(0.5)
            return sock.connect_ex((host, port)) == 0

    def http(self, method: str, port: int, path: str, *, timeout: float = 3.0) -> tuple[int, str]:
        """One HTTP request to a port of the pod: (status, body); (0, the error) when it cannot connect."""
        connection = _PodHTTPConnection(self, "127.0.0.1", port, timeout)
        try:
            connection.request(method, path)
            response = connection.getresponse()
            return response.status, response.read().decode(errors="replace")
        except OSError as err:
            return 0, str(err)
        finally:
            connection.close()

    def ask_dns(
        self, name: str, rdtype: str = "A", *, port: int = 15053, tcp: bool = False
    ) -> dns.message.Message:
        """A DNS query to a port of the pod (the agent's DNS proxy by default), over UDP or TCP."""
        query = dns.message.make_query(name, rdtype)
        if not tcp:
            with self.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                udp.setblocking(False)
                return dns.query.udp(query, "127.0.0.1", port=port, timeout=3, sock=udp)
        with self.socket() as stream:
            stream.settimeout(3)
            stream.connect(("127.0.0.1", port))
            stream.setblocking(False)
            return dns.query.tcp(query, "127.0.0.1", port=port, timeout=3, sock=stream)

    # -- volumes --------------------------------------------------------------------------------------
    def empty_dir(self, name: str) -> Path:
        """An emptyDir volume: writable by every container's user (the kubelet makes it 0777)."""
        path = self._volume_dir(name, read_only=False)
        path.chmod(0o777)
        return path

    def files(self, name: str, files: Mapping[str, str | bytes]) -> Path:
        """A config map, secret, projected or downward-API volume: files 0644, mounted read-only."""
        path = self._volume_dir(name, read_only=True)
        for relative, content in files.items():
            target = path / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content.encode() if isinstance(content, str) else content)
            target.chmod(0o644)
        return path

    def volume(self, name: str) -> Path:
        return self.volumes[name][0]

    def _volume_dir(self, name: str, *, read_only: bool) -> Path:
        path = self.base / "volumes" / name
        path.mkdir(parents=True, exist_ok=True)
        self.volumes[name] = (path, read_only)
        return path

    # -- containers -----------------------------------------------------------------------------------
    def start_container(self, spec: Container) -> Running:
        """Start a container (then its postStart hook); returns once its file system is laid out and its
        entrypoint is being started. Starting it again is a restart: same volumes, a new log."""
        start = self._starts.get(spec.name, -1) + 1
        self._starts[spec.name] = start
        workdir = self.base / "containers" / spec.name / str(start)
        workdir.mkdir(parents=True)
        log = workdir / "output.log"
        ready_read, ready_write = os.pipe()
        script = self._setup_script(spec, workdir, ready_write)
        namespaces = ["nsenter", f"--net={self.netns}", "--", "unshare", "--mount", "--pid", "--fork"]
        namespaces += ["--kill-child=SIGKILL", "--propagation", "private", "--"]
        command = [*namespaces, "bash", "-c", script, "bash", *self._as_user(spec), *spec.command()]
        try:
            with log.open("ab") as output, (workdir / "runtime.log").open("ab") as runtime_log:
                runtime = subprocess.Popen(
                    command,
                    stdout=output,
                    stderr=runtime_log,
                    pass_fds=(ready_write,),
                    env={"PATH": HOST_PATH},
                )
        finally:
            os.close(ready_write)
        with os.fdopen(ready_read, "rb") as ready_pipe:
            ready = ready_pipe.readline()
        if ready.strip() != b"ready":
            runtime.wait(10)
            raise RuntimeError(f"container {spec.name} was not set up:\n{tail(workdir / 'runtime.log')}")
        pid = children(runtime.pid)[0]
        running = Running(spec, start, runtime, pid, log)
        self.containers[spec.name] = running
        if spec.post_start:
            with running.output("post-start.log").open("ab") as hook_log:
                running.post_start = self._exec(
                    running, spec.post_start, stdout=hook_log, stderr=subprocess.STDOUT
                )
        return running

    def restart_container(self, name: str) -> Running:
        """Start an exited container again with the same volumes (``restartPolicy: Always``)."""
        running = self.containers[name]
        if running.alive():
            raise RuntimeError(f"container {name} is still running")
        return self.start_container(running.spec)

    def wait_ready(self, name: str, timeout: float = 60.0) -> None:
        """Wait for the postStart hook to exit 0 (till then the container is not running); raises with the logs."""
        hook = self.containers[name].post_start
        if hook is None:
            return
        try:
            code = hook.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(
                f"{name}: postStart still running after {timeout:.0f}s\n{self.describe(name)}"
            ) from None
        if code != 0:
            raise RuntimeError(f"{name}: postStart exited {code}\n{self.describe(name)}")

    def wait_exit(self, name: str, timeout: float = 30.0) -> int:
        """Wait for a container to exit on its own; its exit code."""
        running = self.containers[name]
        try:
            running.runtime.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{name} still running after {timeout:.0f}s\n{self.describe(name)}") from None
        return self._finished(running)

    def exec(self, name: str, args: Sequence[str], timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """Run a command in a running container (``kubectl exec``)."""
        process = self._exec(self.containers[name], args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
        return subprocess.CompletedProcess(list(args), process.returncode, out.decode(), err.decode())

    def stop_container(self, name: str) -> int:
        """Stop a container as the kubelet does: preStop hook, SIGTERM, SIGKILL at the end of the grace period."""
        running = self.containers[name]
        deadline = time.monotonic() + running.spec.grace_period
        if running.spec.pre_stop and running.alive():
            with running.output("pre-stop.log").open("ab") as hook_log:
                hook = self._exec(running, running.spec.pre_stop, stdout=hook_log, stderr=subprocess.STDOUT)
            try:
                running.pre_stop_code = hook.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                stop_process(hook, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(running.pid, signal.SIGTERM)
        try:
            running.runtime.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._kill(running)
        return self._finished(running)

    def kill_container(self, name: str) -> int:
        """SIGKILL a container's PID 1 (a crash, an OOM kill): everything in the container dies with it."""
        return self._finished(self._kill(self.containers[name]))

    def describe(self, name: str, lines: int = 40) -> str:
        """The container's last output lines and its hooks', for failure messages."""
        running = self.containers[name]
        parts = [f"--- {name} (start {running.restart}) output:", tail(running.log, lines)]
        for other in ("post-start.log", "pre-stop.log", "runtime.log"):
            if running.output(other).exists() and running.output(other).stat().st_size:
                parts += [f"--- {other}:", tail(running.output(other), lines)]
        return "\n".join(parts)

    def _as_user(self, spec: Container) -> list[str]:
        """The image's user without privileges, in the container's environment and cwd ``/``."""
        environment = [f"{key}={value}" for key, value in spec.environment(self.name).items()]
        user = [f"--reuid={spec.image.uid}", f"--regid={spec.image.gid}", "--clear-groups"]
        privileges = ["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
        return ["setpriv", *user, *privileges, "--", "env", "-i", "-C", "/", *environment]

    def _exec(self, running: Running, args: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        enter = ["nsenter", f"--target={running.pid}", "--mount", "--net", "--pid", "--"]
        if running.spec.image.root is not None:  # the container's root, mounted before it started
            enter += ["chroot", str(running.output("root"))]
        return subprocess.Popen(
            [*enter, *self._as_user(running.spec), *args], env={"PATH": HOST_PATH}, **kwargs
        )

    def _kill(self, running: Running) -> Running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(running.pid, signal.SIGKILL)
        stop_process(running.runtime, signal.SIGKILL)
        return running

    def _finished(self, running: Running) -> int:
        running.exit_code = running.runtime.wait(10)
        if running.post_start is not None:  # the kubelet gives up on a hook once its container is gone
            stop_process(running.post_start, signal.SIGKILL)
        return running.exit_code

    # -- the container's file system ------------------------------------------------------------------
    def _setup_script(self, spec: Container, workdir: Path, ready_fd: int) -> str:
        """The bash script that lays out a container's file system in its new mount namespace, as root.

        Its arguments are the entrypoint; it writes "ready" to ``ready_fd`` once done. Its stderr is the
        runtime's log; stdout is the container's log, opened before the mount namespace exists (a file
        open for writing there would keep "/" from going read-only).
        """
        binds = [
            (self.base / "etc" / "hosts", "/etc/hosts", True),
            (self.base / "etc" / "resolv.conf", "/etc/resolv.conf", True),
        ]
        binds += [(source, path, True) for path, source in spec.image.files.items()]
        for mount in spec.mounts:
            source, read_only = self.volumes[mount.volume]
            binds.append((source, mount.path, read_only or mount.read_only))
        if spec.image.root is not None:
            script = image_root_script(spec.image.root, binds, workdir, ready_fd)
            (workdir / "setup.sh").write_text(script)
            return script
        targets = [os.path.realpath(target) for _, target, _ in binds]
        closed = _closed_directories(spec.image.needs, spec.image.uid)
        overlays = _outermost([*_missing_mount_roots(targets), *closed])
        q = shlex.quote
        lines = ["set -eu", "mount -t proc proc /proc"]  # the container's own PID namespace
        for index, directory in enumerate(overlays):
            upper, work = (
                workdir / "overlay" / str(index) / "upper",
                workdir / "overlay" / str(index) / "work",
            )
            upper.mkdir(parents=True)
            work.mkdir()
            layers = f"lowerdir={directory},upperdir={upper},workdir={work}"
            lines.append(f"mount -t overlay overlay -o {q(layers)} {q(directory)}")
        # e.g. an interpreter under /root (0700): an image would have it under /usr/local, open to all
        lines += [f"chmod o+x {q(directory)}" for directory in closed]
        for (source, _, read_only), target in zip(binds, targets, strict=True):
            if source.is_dir():
                lines.append(f"[ -e {q(target)} ] || mkdir -p {q(target)}")
            else:
                lines.append(
                    f"[ -e {q(target)} ] || {{ mkdir -p {q(os.path.dirname(target))}; touch {q(target)}; }}"
                )
            lines.append(f"mount --bind {q(str(source))} {q(target)}")
            if read_only:
                lines.append(f"mount -o remount,bind,ro {q(target)}")
        # a host mount under an overlaid directory (/run/netns under /run) is hidden by the overlay
        shown = [p for p in _writable_system_mounts() if not any(p.startswith(d + "/") for d in overlays)]
        lines += [f"mount -o remount,bind,ro {q(point)}" for point in [*shown, *overlays]]
        lines += [f"echo ready >&{ready_fd}", f'exec "$@" 2>&1 {ready_fd}>&-']
        script = "\n".join(lines) + "\n"
        (workdir / "setup.sh").write_text(script)
        return script


DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
"""The device nodes a runtime gives every container (runc's defaults)."""


def image_root_script(
    image_root: Path, binds: Sequence[tuple[Path, str, bool]], workdir: Path, ready_fd: int
) -> str:
    """The setup script for a container that runs in its image's root (see :meth:`Pod._setup_script`).

    The image is the lower layer of an overlay whose upper layer is in ``workdir`` (where the mount
    points the image lacks are made), mounted at ``workdir/root``; the kernel file systems and the
    volumes go on it, the overlay is remounted read-only, and the entrypoint runs ``chroot``-ed there.
    """
    q = shlex.quote
    root, upper, work = workdir / "root", workdir / "rootfs" / "upper", workdir / "rootfs" / "work"
    for directory in (root, upper, work):
        directory.mkdir(parents=True)
    r = q(str(root))
    layers = f"lowerdir={image_root},upperdir={upper},workdir={work}"
    lines = ["set -eu", f"mount -t overlay overlay -o {q(layers)} {r}"]
    lines += [f"mkdir -p {r}/proc {r}/dev {r}/sys", f"mount -t proc proc {r}/proc"]
    lines += [f"mount -t tmpfs -o nosuid,mode=755 tmpfs {r}/dev"]
    for device in DEVICES:
        lines += [f"touch {r}/dev/{device}", f"mount --bind /dev/{device} {r}/dev/{device}"]
    lines += [f"mkdir {r}/dev/shm", f"mount -t tmpfs -o nosuid,nodev,mode=1777 shm {r}/dev/shm"]
    lines += [f"ln -s /proc/self/fd {r}/dev/fd"]
    lines += [
        f"ln -s /proc/self/fd/{fd} {r}/dev/{name}" for fd, name in enumerate(("stdin", "stdout", "stderr"))
    ]
    lines += [f"mount -t sysfs -o ro,nosuid,nodev,noexec sysfs {r}/sys"]
    for source, path, read_only in binds:
        target = q(str(root / in_root(image_root, path)))
        if source.is_dir():
            lines.append(f"[ -d {target} ] || mkdir -p {target}")
        else:
            lines.append(f"[ -e {target} ] || {{ mkdir -p $(dirname {target}); touch {target}; }}")
        lines.append(f"mount --bind {q(str(source))} {target}")
        if read_only:
            lines.append(f"mount -o remount,bind,ro {target}")
    lines += [f"mount -o remount,bind,ro {r}"]
    lines += [f"echo ready >&{ready_fd}", f'exec chroot {r} "$@" 2>&1 {ready_fd}>&-']
    return "\n".join(lines) + "\n"


def in_root(root: Path, path: str) -> PurePosixPath:
    """Where ``path`` of a container is in its image ``root``, relative to it: its links followed as the
    container would see them, an absolute link target taken from ``root`` (``/var/run`` -> ``/run``),
    never leaving it (as runtimes resolve mount points). The part that does not exist is kept as is."""
    pending = list(PurePosixPath(path).parts[1:])
    resolved = PurePosixPath()
    links = 0
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            resolved = resolved.parent
            continue
        candidate = root / resolved / part
        if not candidate.is_symlink():
            resolved /= part
            continue
        links += 1
        if links > 40:
            raise ValueError(f"{path}: too many links in {root}")
        target = PurePosixPath(os.readlink(candidate))
        if target.is_absolute():
            resolved = PurePosixPath()
        pending[:0] = [p for p in target.parts if p != "/"]
    return resolved


class _PodHTTPConnection(http.client.HTTPConnection):
    """An HTTP connection whose socket is made in the pod's network namespace."""

    def __init__(self, pod: Pod, host: str, port: int, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._pod = pod

    def connect(self) -> None:
        sock = self._pod.socket()
        sock.settimeout(self.timeout)
        try:
            sock.connect((self.host, self.port))
        except OSError:
            sock.close()
            raise
        self.sock = sock


def _missing_mount_roots(targets: Sequence[str]) -> list[str]:
    """For each mount point the host lacks, its deepest existing ancestor (overlaid to make it there)."""
    roots = []
    for target in targets:
        if os.path.lexists(target):
            continue
        ancestor = os.path.dirname(target)
        while not os.path.isdir(ancestor):
            ancestor = os.path.dirname(ancestor)
        if ancestor == "/":
            raise ValueError(f"mount point {target} needs a new top-level directory")
        roots.append(ancestor)
    return roots


def _closed_directories(paths: Sequence[Path], uid: int) -> list[str]:
    """Directories on the way to ``paths`` that ``uid`` may not pass through (no search permission)."""
    closed = []
    for path in paths:
        resolved = Path(os.path.realpath(path))
        for directory in [*reversed(resolved.parents), resolved]:
            if str(directory) == "/" or not directory.is_dir():
                continue
            status = directory.stat()
            if not status.st_mode & (0o100 if status.st_uid == uid else 0o001):
                closed.append(str(directory))
    return list(dict.fromkeys(closed))


def _outermost(directories: Sequence[str]) -> list[str]:
    """The directories to overlay: one inside another needs no overlay of its own."""
    unique = set(directories)
    return sorted(d for d in unique if not any(d.startswith(other + "/") for other in unique))


def _writable_system_mounts() -> list[str]:
    """The host's writable mount points a container must see read-only: "/" and every file system under
    it but the kernel's (/proc, /dev); /sys read-only as the runtime mounts it. Namespace handles
    (``nsfs``, e.g. ``/run/netns/<name>`` of ``ip netns add``) are no file systems, and may vanish
    before the container starts."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])  # \040 is a space
        fstype = fields[fields.index("-") + 1]
        if (
            "ro" not in fields[5].split(",")
            and not point.startswith(("/proc", "/dev", "/sys"))
            and fstype != "nsfs"
        ):
            points.append(point)
    return [*dict.fromkeys(points), "/sys"]


def stop_process(process: subprocess.Popen[bytes], sig: signal.Signals = signal.SIGTERM) -> int:
    """Signal a child process and reap it (SIGKILL if it is still there after 10 s)."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(sig)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"


def process_status(pid: int) -> dict[str, str]:
    """``/proc/<pid>/status`` as a mapping (Uid, Gid, Groups, CapEff, CapBnd, NoNewPrivs, ...)."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {key: value.strip() for key, _, value in (line.partition(":") for line in lines)}


def children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@contextlib.contextmanager
def running_pod(base: Path, **kwargs: Any) -> Iterator[Pod]:
    """A started pod, stopped (every process it started killed) however the test ends."""
    pod = Pod(base, **kwargs)
    try:
        pod.start()
        yield pod
    finally:
        pod.stop()
