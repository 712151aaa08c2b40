"""CNI benchmark: the istio-cni plugin's ADD latency (exec to result), next to the bridge plugin's.

    python -m bench.cni [--pods 50] [--plugin-dir build/cni/bin [--plugin-dir OTHER ...]]

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
* **(c) istio-cni, a pod without injection**: the pod GET, and the previous result handed on.

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
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from istio_agent.cni.kube import KUBECONFIG_NAME
from tests.cni.fake_kube import FakeKube, sidecar_pod, start_fake_kube
from tests.cni.libcni import DEBIAN_PLUGINS, Attachment, NetworkList, Runtime
from tests.cni.netns import enter, netns
from tests.cni.node import bridge_network

VENV_BIN = Path(sys.executable).parent
"""The venv's ``istio-cni`` console script."""
BUNDLE_DIR = Path(__file__).resolve().parents[1] / "build" / "cni" / "bin"
"""The self-contained plugin (``make cni-plugin``)."""
GOAL_P50_MS = 150.0
GOAL_SKIPPED_P50_MS = 50.0
"""Issue 21: a pod the plugin leaves alone (no injection) must cost little: every pod on the node pays."""
ISTIO_CHAIN = "ISTIO_OUTPUT"


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


@contextmanager
def fake_api(state: Path) -> Iterator[FakeKube]:
    """The fake API server on an event loop thread of its own (the bench itself runs synchronously)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fake-kube", daemon=True)
    thread.start()
    kube, runner = asyncio.run_coroutine_threadsafe(start_fake_kube(state), loop).result()
    try:
        yield kube
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def rules_applied(pod_netns: str) -> bool:
    """Whether the sandbox holds Istio's chains (in either iptables backend: the plugin picks the node's)."""
    for save in ("iptables-nft-save", "iptables-legacy-save"):
        done = subprocess.run(
            ["ip", "netns", "exec", pod_netns, save, "-t", "nat"], capture_output=True, text=True, check=False
        )
        if ISTIO_CHAIN in done.stdout:
            return True
    return False


@dataclass
class Build:
    """One istio-cni build under test and its rows."""

    label: str
    runtime: Runtime
    mesh: Row
    skipped: Row
    version: Row

    @classmethod
    def of(cls, plugin_dir: Path, label: str) -> Build:
        tag = f" [{label}]" if label else ""
        return cls(
            label,
            Runtime((plugin_dir, DEBIAN_PLUGINS)),
            Row(f"(b) istio-cni ADD (sidecar pod, rules applied){tag}"),
            Row(f"(c) istio-cni ADD, pod without injection (pod GET, no rules){tag}"),
            Row(f"istio-cni VERSION (floor){tag}"),
        )


def run(base: Path, pods: int, plugin_dirs: list[Path]) -> tuple[Row, Row, list[Build]]:
    """Measure; the caller has moved the process into the node's namespace. The builds take turns
    within each pod index, so they meet the same load."""
    (base / "ca").mkdir()
    run_dir = base / "run"
    run_dir.mkdir()
    bridge, bridge_version = Row("(a) bridge + host-local ADD"), Row("bridge VERSION (floor)")
    labels = [str(d) if len(plugin_dirs) > 1 else "" for d in plugin_dirs]
    builds = [Build.of(d, label) for d, label in zip(plugin_dirs, labels, strict=True)]
    with fake_api(base / "ca") as kube:
        (run_dir / KUBECONFIG_NAME).write_text(kube.kubeconfig())
        entry = {"type": "istio-cni", "pod_namespace": "istio-system", "exclude_namespaces": ["istio-system"]}
        network = bridge_network(base / "host-local", [{**entry, "cni_agent_run_dir": str(run_dir)}])
        for index in range(pods):
            bridge_version.time(builds[0].runtime.version, "bridge")
            for number, build in enumerate(builds):
                build.version.time(build.runtime.version, "istio-cni")
                name = f"bench-{index}-{number}m"
                kube.add_pod(sidecar_pod(name, "bench"))
                attach(build.runtime, network, name, bridge, build.mesh)
                name = f"bench-{index}-{number}s"
                kube.add_pod(plain_pod(name, "bench"))
                attach(build.runtime, network, name, bridge, build.skipped, expect_rules=False)
    return bridge, bridge_version, builds


def plain_pod(name: str, namespace: str) -> dict[str, Any]:
    """A pod without Istio's injection: the plugin GETs it and leaves it alone."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"},
        "spec": {"containers": [{"name": "app", "image": "app"}]},
    }


def attach(
    runtime: Runtime, network: NetworkList, name: str, bridge: Row, istio: Row, *, expect_rules: bool = True
) -> None:
    """One sandbox: bridge's ADD, then istio-cni's, each timed; the rules checked; DEL; namespace gone."""
    bridge_entry, istio_entry = network.plugins
    with netns(name.removeprefix("bench-")) as sandbox:
        attachment = Attachment.for_pod(f"{sandbox.name}-sandbox", sandbox.path, "bench", name)
        previous = bridge.time(runtime.run_plugin, "ADD", network, bridge_entry, attachment)
        answer = istio.time(runtime.run_plugin, "ADD", network, istio_entry, attachment, previous)
        if answer != previous:
            raise SystemExit(f"istio-cni changed the chained result: {previous} -> {answer}")
        if rules_applied(sandbox.name) != expect_rules:
            raise SystemExit(f"istio-cni ADD: {sandbox.name} holds {ISTIO_CHAIN}: {not expect_rules}")
        runtime.delete(network, attachment, answer)


def report(bridge: Row, bridge_version: Row, builds: list[Build]) -> None:
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    bytecode = os.environ.get("PYTHONDONTWRITEBYTECODE", "")
    print(f"\nCNI plugin ADD latency, exec to result ({when}, load average {os.getloadavg()[0]:.2f},")
    print(
        f"PYTHONDONTWRITEBYTECODE={bytecode!r}, PYTHONPYCACHEPREFIX={os.environ.get('PYTHONPYCACHEPREFIX', '')!r})\n"
    )
    print("| exec | runs | p50 | p99 | min | max |")
    print("|---|---|---|---|---|---|")
    for row in (bridge, *(r for b in builds for r in (b.mesh, b.skipped)), bridge_version):
        print(row.line())
    for build in builds:
        print(build.version.line())
    print()
    for row, goal in (
        (r, g) for b in builds for r, g in ((b.mesh, GOAL_P50_MS), (b.skipped, GOAL_SKIPPED_P50_MS))
    ):
        verdict = "MET" if row.p50_ms() <= goal else "NOT MET"
        ratio = row.p50_ms() / bridge.p50_ms()
        print(
            f"{row.name}: p50 {row.p50_ms():.0f} ms = {ratio:.1f}x bridge's; goal <= {goal:.0f} ms: {verdict}"
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
    for plugin_dir in plugin_dirs:
        if not (plugin_dir / "istio-cni").exists():
            sys.exit(f"no istio-cni in {plugin_dir}: `make cni-plugin`, or install the package")
    with tempfile.TemporaryDirectory(prefix="bench-cni-") as tmp, netns("node") as node:
        enter(node.path)  # the whole process (one thread so far): plugins and the fake API live here
        bridge, bridge_version, builds = run(Path(tmp), args.pods, plugin_dirs)
    print("\nistio-cni: " + ", ".join(str(d / "istio-cni") for d in plugin_dirs))
    report(bridge, bridge_version, builds)


if __name__ == "__main__":
    main()
