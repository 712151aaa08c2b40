"""CNI benchmark: the istio-cni plugin's ADD latency (exec to result), next to the bridge plugin's.

    python -m bench.cni [--pods 50] [--plugin-dir build/cni/bin [--plugin-dir OTHER ...]] [--no-ambient]

Root only (network namespaces). The bench process moves into a "node" namespace it creates, so the
plugins run there as a container runtime runs them on a host, and the pod network's bridge never
touches the machine. A FAKE Kubernetes API server (``tests/cni/fake_kube.py``, HTTPS on the node's
loopback; no real one runs here) serves a sidecar pod per sandbox, and the plugin reads it through
a kubeconfig written as install-cni writes it. For each of ``--pods`` pod sandboxes (a fresh
named namespace each), as the test runtime (``tests/cni/libcni.py``) runs the network list:

* **(a) bridge**: Debian's ``bridge`` + ``host-local`` ADD, exec to result (veth, address, routes);
* **(b) istio-cni, a mesh pod**: istio-cni's ADD chained after it with (a)'s result as
  ``prevResult``, exec to result: the pod GET and Istio's sidecar rules really applied in the
  sandbox (checked after each ADD, outside the timing);
* **(c) istio-cni, a pod without injection**: the pod GET, and the previous result handed on;
* **(d) istio-cni, an ambient pod** (``--ambient``, the default as root): a pod in a namespace labelled
  ``istio.io/dataplane-mode=ambient``, the plugin's entry as install-cni writes it from the chart's
  ambient settings; exec to result is the pod and namespace GETs, the ``POST /cmdadd`` on the node
  agent's event socket and the node agent's whole enrolment (in-pod rules, ztunnel's add and its
  ack, the probe set, the annotation). The node agent runs in the node's namespace, built as
  install-cni builds it (``istio_agent.cni.ambient.nodeagent.build``: the real in-pod rules, the
  real host probe rules and set, the real ZDS server) with the ztunnel stand-in
  (``tests/cni/ambient/ztunnel_standin.py``) connected. Checked after each ADD, outside the timing:
  the sandbox holds the in-pod rules and the stand-in runs the workload. Then the pod is deleted in
  the API (Istio's plugin DEL does nothing in ambient mode: the node agent unenrolls on the pod's
  deletion) and the stand-in's delete is waited for, outside the timing. The node agent's own
  enrolment time (its dataplane's add, from the event's pod found in its cache to enrolled) is a
  row of its own.

The istio-cni exec'd is the one in ``--plugin-dir``: by default the self-contained bundle ``make
cni-plugin`` builds (``build/cni/bin``: what ships to nodes), else the venv's console script. Given
more than once (e.g. a previous commit's build, ``packaging/cni-plugin/build.py --out``), the builds
take turns pod by pod in the same run, each with rows of its own, so a comparison holds on a loaded
machine (separate runs moved by 10-20 ms with other jobs on this 2-core one).

Each sandbox then gets the list's DEL and its namespace deleted.

The floor is each plugin's VERSION (exec, interpreter start, nothing else), measured in the same
run, as is everything else, so the ratios hold on a loaded machine. The plugins get the bench's own
environment (``PYTHONDONTWRITEBYTECODE`` included: it is printed, as it decides whether the
venv script's modules are compiled on every exec; the bundle carries them compiled). Goals (issue
21): istio-cni ADD p50 <= 150 ms for a mesh pod, <= 50 ms for a pod it leaves alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from istio_agent.cni.ambient.dataplane import Dataplane
from istio_agent.cni.ambient.nodeagent import build
from istio_agent.cni.install.settings import InstallSettings, load_settings
from istio_agent.cni.kube import KUBECONFIG_NAME, KubeClient, parse_kubeconfig
from istio_agent.metrics import Registry
from tests.cni.ambient.test_plugin_ambient import HELM_SELECTORS
from tests.cni.ambient.ztunnel_standin import ZtunnelStandin
from tests.cni.fake_kube import FakeKube, sidecar_pod, start_fake_kube
from tests.cni.libcni import DEBIAN_PLUGINS, Attachment, NetworkList, Runtime
from tests.cni.netns import Netns, enter, netns
from tests.cni.node import bridge_network

VENV_BIN = Path(sys.executable).parent
"""The venv's ``istio-cni`` console script."""
BUNDLE_DIR = Path(__file__).resolve().parents[1] / "build" / "cni" / "bin"
"""The self-contained plugin (``make cni-plugin``)."""
GOAL_P50_MS = 150.0
GOAL_SKIPPED_P50_MS = 50.0
"""Issue 21: a pod the plugin leaves alone (no injection) must cost little: every pod on the node pays."""
ISTIO_CHAIN = "ISTIO_OUTPUT"
INPOD_CHAIN = "ISTIO_PRERT"
"""Ambient's in-pod chain in mangle (the sidecar's rules have none there)."""
NODE_NAME = "bench-node"
AMBIENT_NAMESPACE = "bench-ambient"
"""Labelled ``istio.io/dataplane-mode=ambient`` in the fake API: its pods are ambient by the chart's selectors."""
STEP_SECONDS = 30.0
"""The bound of one step on the fake API's loop (the node agent's start, a ztunnel delete awaited)."""
T = TypeVar("T")


@dataclass
class Row:
    """One measured exec kind: its latencies in seconds."""

    name: str
    seconds: list[float] = field(default_factory=list)

    def time(self, call: Callable[..., Any], *args: Any) -> Any:
        start = time.monotonic()
        answer = call(*args)
        self.seconds.append(time.monotonic() - start)
        return answer

    def p50_ms(self) -> float:
        return statistics.median(self.seconds) * 1000

    def p99_ms(self) -> float:
        """The 99th percentile (statistics' exclusive method: with 50 samples, about the slowest)."""
        if len(self.seconds) < 2:
            return self.seconds[0] * 1000
        return statistics.quantiles(self.seconds, n=100)[98] * 1000

    def line(self) -> str:
        return (
            f"| {self.name} | {len(self.seconds)} | {self.p50_ms():.0f} ms | {self.p99_ms():.0f} ms | "
            f"{min(self.seconds) * 1000:.0f} ms | {max(self.seconds) * 1000:.0f} ms |"
        )


@dataclass
class Api:
    """The fake API server and the event loop thread it runs on (the bench itself runs synchronously).

    Its writes go through :meth:`call`: a watch (the node agent's) is fed from the loop's queues."""

    kube: FakeKube
    loop: asyncio.AbstractEventLoop

    def run(self, step: Coroutine[Any, Any, T], what: str, timeout: float = STEP_SECONDS) -> T:
        """``step`` on the loop; its result, or SystemExit naming ``what`` did not finish."""
        future = asyncio.run_coroutine_threadsafe(step, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise SystemExit(f"not within {timeout:.0f} s: {what}") from None

    def call(self, function: Callable[..., T], *args: Any) -> T:
        """``function(*args)`` on the loop."""

        async def on_loop() -> T:
            return function(*args)

        return self.run(on_loop(), getattr(function, "__qualname__", "a call on the loop"))


async def _stop_fake_api(runner: Any) -> None:
    """Stop the server, then end what it left running (watches still streaming), so that closing the
    loop destroys no pending task."""
    await runner.cleanup()
    left = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in left:
        task.cancel()
    await asyncio.gather(*left, return_exceptions=True)


@contextmanager
def fake_api(state: Path) -> Iterator[Api]:
    """The fake API server on an event loop thread of its own."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fake-kube", daemon=True)
    thread.start()
    kube, runner = asyncio.run_coroutine_threadsafe(start_fake_kube(state), loop).result()
    try:
        yield Api(kube, loop)
    finally:
        asyncio.run_coroutine_threadsafe(_stop_fake_api(runner), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def holds_chain(pod_netns: str, table: str, chain: str) -> bool:
    """Whether the sandbox's ``table`` holds ``chain`` (in either iptables backend: the plugin and the
    node agent pick the node's)."""
    for save in ("iptables-nft-save", "iptables-legacy-save"):
        done = subprocess.run(
            ["ip", "netns", "exec", pod_netns, save, "-t", table], capture_output=True, text=True, check=False
        )
        if f":{chain} " in done.stdout:
            return True
    return False


def rules_applied(pod_netns: str) -> bool:
    """Whether the sandbox holds Istio's sidecar chains."""
    return holds_chain(pod_netns, "nat", ISTIO_CHAIN)


def inpod_rules_applied(pod_netns: str) -> bool:
    """Whether the sandbox holds ambient's in-pod chains (mangle's, which the sidecar's rules lack, and nat's)."""
    return holds_chain(pod_netns, "mangle", INPOD_CHAIN) and holds_chain(pod_netns, "nat", ISTIO_CHAIN)


@dataclass
class Build:
    """One istio-cni build under test and its rows."""

    label: str
    runtime: Runtime
    mesh: Row
    skipped: Row
    version: Row
    ambient: Row

    @classmethod
    def of(cls, plugin_dir: Path, label: str) -> Build:
        tag = f" [{label}]" if label else ""
        return cls(
            label,
            Runtime((plugin_dir, DEBIAN_PLUGINS)),
            Row(f"(b) istio-cni ADD (sidecar pod, rules applied){tag}"),
            Row(f"(c) istio-cni ADD, pod without injection (pod GET, no rules){tag}"),
            Row(f"istio-cni VERSION (floor){tag}"),
            Row(f"(d) istio-cni ADD, ambient pod (node agent enrolment included){tag}"),
        )


# -- (d): the ambient node ----------------------------------------------------------------------------


def ambient_settings(run_dir: Path, ztunnel_socket: Path) -> InstallSettings:
    """install-cni's settings with the chart's ambient values (``manifests/charts/istio-cni/values.yaml``:
    the enablement selectors, DNS capture, IPv6) on this node: the node agent's and the plugin's entry.

    install-cni runs in the node's namespace here (the chart's ``shareHostNetworkNamespace``), so the
    node agent's probe rules go in the bench's node namespace, and ``/proc`` is the node's."""
    return load_settings(
        {
            "ambient-enabled": "true",
            "cni-agent-run-dir": str(run_dir),
            "host-proc-dir": "/proc",
        },
        {
            "AMBIENT_ENABLEMENT_SELECTOR": json.dumps(HELM_SELECTORS),
            "AMBIENT_DNS_CAPTURE": "true",
            "AMBIENT_IPV6": "true",
            "ZTUNNEL_UDS_ADDRESS": str(ztunnel_socket),
            "NODE_NAME": NODE_NAME,
            "POD_NAMESPACE": "istio-system",
        },
    )


def ambient_pod(name: str) -> dict[str, Any]:
    """A pod of the ambient namespace, scheduled on the bench's node (the node agent watches only those)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": AMBIENT_NAMESPACE, "uid": f"uid-{name}"},
        "spec": {"nodeName": NODE_NAME, "serviceAccountName": "bench", "containers": [{"name": "app"}]},
    }


def time_enrolments(dataplane: Dataplane, row: Row) -> None:
    """Time each enrolment of a plugin event (its netns given; the watch's own adds pass "") in ``row``.

    No log line or metric of the node agent gives it: its dataplane's ``add_pod`` is wrapped on this
    instance (the event server calls it once the pod is found in the cache)."""
    add_pod = dataplane.add_pod

    async def timed(pod: Any, ips: Sequence[str], netns: str) -> None:
        start = time.monotonic()
        await add_pod(pod, ips, netns)
        if netns:
            row.seconds.append(time.monotonic() - start)

    dataplane.add_pod = timed  # type: ignore[method-assign]


@dataclass
class AmbientNode:
    """The node agent and the ztunnel stand-in, on the fake API's loop; the plugin's entry for them."""

    api: Api
    ztunnel: ZtunnelStandin
    entry: dict[str, Any]
    enrolment: Row

    def has_workload(self, uid: str) -> bool:
        return self.api.call(lambda: uid in self.ztunnel.workloads)

    def delete_pod(self, name: str, uid: str) -> None:
        """The pod goes from the API (kubelet done with it); until ztunnel was told to delete it."""
        self.api.call(self.api.kube.finish_deletion, AMBIENT_NAMESPACE, name)
        self.api.run(
            self.ztunnel.wait_for(lambda zt: ("del", uid) in zt.received and uid not in zt.workloads),
            f"the ztunnel stand-in told to delete {uid}",
        )


@contextmanager
def ambient_node(api: Api, run_dir: Path, base: Path) -> Iterator[AmbientNode]:
    """The node agent started (caches synced, probe rules in, ZDS and event servers listening) with the
    stand-in connected and its snapshot received; everything stopped and the node's rules taken out after."""
    settings = ambient_settings(run_dir, base / "ztunnel.sock")
    assert settings.ambient is not None
    api.call(api.kube.add_namespace, AMBIENT_NAMESPACE, {"istio.io/dataplane-mode": "ambient"})
    client = KubeClient(parse_kubeconfig(api.kube.kubeconfig(), "of the bench"), user_agent="install-cni")
    agent = build(settings.ambient, client, socket_dir=run_dir, registry=Registry(prefix="istio_"))
    enrolment = Row(
        "node agent: enrolment of the plugin's event (in-pod rules, ZDS add + ack, probe set, annotation)"
    )
    time_enrolments(agent.dataplane, enrolment)
    api.run(agent.start(), "the node agent starts")
    try:
        ztunnel = api.call(ZtunnelStandin, settings.ambient.ztunnel_socket)
        api.run(ztunnel.connect(), "the ztunnel stand-in connects")
        try:
            api.run(ztunnel.wait_snapshot(), "the ztunnel stand-in's snapshot")
            yield AmbientNode(api, ztunnel, settings.plugin.plugin_object(with_version=False), enrolment)
        finally:
            api.run(ztunnel.stop(), "the ztunnel stand-in stops")
    finally:
        api.run(agent.stop(cleanup=True), "the node agent stops")


# -- the run ------------------------------------------------------------------------------------------


def run(
    base: Path, pods: int, plugin_dirs: list[Path], *, ambient: bool = False
) -> tuple[Row, Row, list[Build], Row | None]:
    """Measure; the caller has moved the process into the node's namespace. The builds take turns
    within each pod index, so they meet the same load. The last: the node agent's enrolments (ambient)."""
    (base / "ca").mkdir()
    run_dir = base / "run"
    run_dir.mkdir()
    bridge, bridge_version = Row("(a) bridge + host-local ADD"), Row("bridge VERSION (floor)")
    labels = [str(d) if len(plugin_dirs) > 1 else "" for d in plugin_dirs]
    builds = [Build.of(d, label) for d, label in zip(plugin_dirs, labels, strict=True)]
    with fake_api(base / "ca") as api, ambient_node_if(ambient, api, run_dir, base) as node:
        (run_dir / KUBECONFIG_NAME).write_text(api.kube.kubeconfig())
        entry = {"type": "istio-cni", "pod_namespace": "istio-system", "exclude_namespaces": ["istio-system"]}
        network = bridge_network(base / "host-local", [{**entry, "cni_agent_run_dir": str(run_dir)}])
        ambient_network = None if node is None else bridge_network(base / "host-local", [node.entry])
        for index in range(pods):
            bridge_version.time(builds[0].runtime.version, "bridge")
            for number, build_ in enumerate(builds):
                build_.version.time(build_.runtime.version, "istio-cni")
                name = f"bench-{index}-{number}m"
                api.call(api.kube.add_pod, sidecar_pod(name, "bench"))
                attach(build_.runtime, network, name, bridge, build_.mesh)
                name = f"bench-{index}-{number}s"
                api.call(api.kube.add_pod, plain_pod(name, "bench"))
                attach(build_.runtime, network, name, bridge, build_.skipped, expect_rules=False)
                if node is not None and ambient_network is not None:
                    attach_ambient(
                        build_.runtime,
                        ambient_network,
                        f"bench-{index}-{number}a",
                        bridge,
                        build_.ambient,
                        node,
                    )
    return bridge, bridge_version, builds, None if node is None else node.enrolment


@contextmanager
def ambient_node_if(wanted: bool, api: Api, run_dir: Path, base: Path) -> Iterator[AmbientNode | None]:
    if not wanted:
        yield None
        return
    with ambient_node(api, run_dir, base) as node:
        yield node


def plain_pod(name: str, namespace: str) -> dict[str, Any]:
    """A pod without Istio's injection: the plugin GETs it and leaves it alone."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"},
        "spec": {"containers": [{"name": "app", "image": "app"}]},
    }


@contextmanager
def added(
    runtime: Runtime, network: NetworkList, name: str, bridge: Row, istio: Row, *, namespace: str = "bench"
) -> Iterator[Netns]:
    """One sandbox of pod ``namespace/name``: bridge's ADD, then istio-cni's, each timed; after the
    caller's checks, DEL and the namespace gone."""
    bridge_entry, istio_entry = network.plugins
    with netns(name.removeprefix("bench-")) as sandbox:
        attachment = Attachment.for_pod(f"{sandbox.name}-sandbox", sandbox.path, namespace, name)
        previous = bridge.time(runtime.run_plugin, "ADD", network, bridge_entry, attachment)
        answer = istio.time(runtime.run_plugin, "ADD", network, istio_entry, attachment, previous)
        if answer != previous:
            raise SystemExit(f"istio-cni changed the chained result: {previous} -> {answer}")
        yield sandbox
        runtime.delete(network, attachment, answer)


def attach(
    runtime: Runtime, network: NetworkList, name: str, bridge: Row, istio: Row, *, expect_rules: bool = True
) -> None:
    """A sidecar pod's sandbox (or one without injection): the rules checked."""
    with added(runtime, network, name, bridge, istio) as sandbox:
        if rules_applied(sandbox.name) != expect_rules:
            raise SystemExit(f"istio-cni ADD: {sandbox.name} holds {ISTIO_CHAIN}: {not expect_rules}")


def attach_ambient(
    runtime: Runtime, network: NetworkList, name: str, bridge: Row, istio: Row, node: AmbientNode
) -> None:
    """An ambient pod's sandbox: enrolled by the node agent within the ADD; deleted from ztunnel once
    the pod is gone from the API, before the DEL."""
    node.api.call(node.api.kube.add_pod, ambient_pod(name))  # as the scheduler binds it, before the sandbox
    with added(runtime, network, name, bridge, istio, namespace=AMBIENT_NAMESPACE) as sandbox:
        if not inpod_rules_applied(sandbox.name):
            raise SystemExit(f"istio-cni ADD (ambient): {sandbox.name} holds no {INPOD_CHAIN}")
        uid = f"uid-{name}"
        if not node.has_workload(uid):
            raise SystemExit(f"istio-cni ADD (ambient): the ztunnel stand-in runs no workload {uid}")
        node.delete_pod(name, uid)


def report(bridge: Row, bridge_version: Row, builds: list[Build], enrolment: Row | None = None) -> None:
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    bytecode = os.environ.get("PYTHONDONTWRITEBYTECODE", "")
    print(f"\nCNI plugin ADD latency, exec to result ({when}, load average {os.getloadavg()[0]:.2f},")
    print(
        f"PYTHONDONTWRITEBYTECODE={bytecode!r}, PYTHONPYCACHEPREFIX={os.environ.get('PYTHONPYCACHEPREFIX', '')!r})\n"
    )
    print("| exec | runs | p50 | p99 | min | max |")
    print("|---|---|---|---|---|---|")
    measured = (r for b in builds for r in (b.mesh, b.skipped, b.ambient) if r.seconds)
    for row in (bridge, *measured, *([enrolment] if enrolment and enrolment.seconds else []), bridge_version):
        print(row.line())
    for build_ in builds:
        print(build_.version.line())
    print()
    for row, goal in (
        (r, g) for b in builds for r, g in ((b.mesh, GOAL_P50_MS), (b.skipped, GOAL_SKIPPED_P50_MS))
    ):
        verdict = "MET" if row.p50_ms() <= goal else "NOT MET"
        ratio = row.p50_ms() / bridge.p50_ms()
        print(
            f"{row.name}: p50 {row.p50_ms():.0f} ms = {ratio:.1f}x bridge's; goal <= {goal:.0f} ms: {verdict}"
        )
    for build_ in builds:
        row, peer = build_.ambient, build_.mesh
        if row.seconds:
            print(
                f"{row.name}: p50 {row.p50_ms():.0f} ms, p99 {row.p99_ms():.0f} ms = "
                f"{row.p50_ms() / peer.p50_ms():.2f}x (b)'s p50, {row.p99_ms() / peer.p99_ms():.2f}x its p99 (no goal)"
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pods", type=int, default=50, help="pod sandboxes to attach (one ADD each)")
    default_dir = BUNDLE_DIR if (BUNDLE_DIR / "istio-cni").exists() else VENV_BIN
    parser.add_argument(
        "--plugin-dir",
        type=Path,
        action="append",
        dest="plugin_dirs",
        help=f"where istio-cni is (default {default_dir}); more than once: builds compared, taking turns",
    )
    parser.add_argument(
        "--ambient",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the (d) row: an ambient pod enrolled by a node agent in the node's namespace (default on)",
    )
    args = parser.parse_args()
    plugin_dirs: list[Path] = args.plugin_dirs or [default_dir]
    if args.pods < 1:
        parser.error("--pods must be positive")
    if os.geteuid() != 0:
        sys.exit("bench.cni needs root: it creates network namespaces and applies iptables rules in them")
    if not (DEBIAN_PLUGINS / "bridge").exists():
        sys.exit(
            f"bench.cni needs Debian's containernetworking-plugins in {DEBIAN_PLUGINS} (`make` installs them)"
        )
    if args.ambient and shutil.which("ipset") is None:
        sys.exit("bench.cni --ambient needs Debian's ipset (the node agent's probe set); or --no-ambient")
    for plugin_dir in plugin_dirs:
        if not (plugin_dir / "istio-cni").exists():
            sys.exit(f"no istio-cni in {plugin_dir}: `make cni-plugin`, or install the package")
    with tempfile.TemporaryDirectory(prefix="bench-cni-") as tmp, netns("node") as node:
        enter(node.path)  # the whole process (one thread so far): plugins and the fake API live here
        bridge, bridge_version, builds, enrolment = run(
            Path(tmp), args.pods, plugin_dirs, ambient=args.ambient
        )
    print("\nistio-cni: " + ", ".join(str(d / "istio-cni") for d in plugin_dirs))
    report(bridge, bridge_version, builds, enrolment)


if __name__ == "__main__":
    main()
