"""How long containerd's RunPodSandbox takes with istio-cni in the chain (root; docs/performance.md).

    .venv/bin/python -m tests.cri.measure [--count 20]

One sandbox at a time, as the kubelet of a quiet node asks: the node's chain without istio-cni
(Debian's bridge, host-local and portmap only), then with install-cni's istio-cni chained in (the
self-contained plugin of ``build/cni/bin``) for an injected pod (Istio's rules written) and for a pod
it skips (excluded namespace: no API call). Each sandbox is stopped and removed before the next.
Prints p50 and p90 of RunPodSandbox and of StopPodSandbox + RemovePodSandbox, in ms.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tests.cni.libcni import DEBIAN_PLUGINS
from tests.cni.node import running_node
from tests.cri.cluster import CONFLIST, NODE_PLUGINS, cri_node, injected_pod, node_conflist
from tests.cri.conditions import cannot_run
from tests.cri.containerd import Containerd, running_containerd


def timed(runtime: Containerd, names: list[str], namespace: str) -> tuple[list[float], list[float]]:
    """RunPodSandbox and Stop + Remove times (ms) for each pod, one after another."""
    runs, removals = [], []
    for name in names:
        start = time.perf_counter()
        sandbox = runtime.run_pod_sandbox(name, namespace)
        runs.append((time.perf_counter() - start) * 1000)
        start = time.perf_counter()
        runtime.stop_pod_sandbox(sandbox.id)
        runtime.remove_pod_sandbox(sandbox.id)
        removals.append((time.perf_counter() - start) * 1000)
    return runs, removals


def report(label: str, runs: list[float], removals: list[float]) -> None:
    def p(values: list[float], q: int) -> float:
        return statistics.quantiles(values, n=10, method="inclusive")[q // 10 - 1]

    print(
        f"{label:<44} run p50 {statistics.median(runs):6.1f} p90 {p(runs, 90):6.1f}"
        f"   stop+remove p50 {statistics.median(removals):6.1f} p90 {p(removals, 90):6.1f}"
    )


def without_istio_cni(base: Path, count: int) -> None:
    conf_dir, bin_dir = base / "net.d", base / "bin"
    conf_dir.mkdir(parents=True)
    bin_dir.mkdir()
    for plugin in NODE_PLUGINS:
        shutil.copy2(DEBIAN_PLUGINS / plugin, bin_dir / plugin)
    with running_node(base / "node") as node:
        (conf_dir / CONFLIST).write_text(json.dumps(node_conflist(node.ipam_dir)))
        with running_containerd(base / "containerd", node.netns.path, conf_dir, bin_dir) as runtime:
            timed(runtime, ["warm-up"], "default")
            report("bridge + portmap (no istio-cni)", *timed(runtime, pods("plain", count), "default"))


def with_istio_cni(base: Path, count: int) -> None:
    with cri_node(base) as cri:
        cases: list[tuple[str, str, str, Callable[[str, str], dict[str, object]]]] = [
            ("+ istio-cni, injected pod (rules written)", "mesh", "default", injected_pod),
            ("+ istio-cni, excluded namespace (skipped)", "skip", "kube-system", injected_pod),
        ]
        for label, prefix, namespace, make in cases:
            names = pods(prefix, count)
            for name in ["warm-up", *names]:
                cri.kube.add_pod(make(f"{prefix}-{name}" if name == "warm-up" else name, namespace))
            timed(cri.containerd, [f"{prefix}-warm-up"], namespace)
            report(label, *timed(cri.containerd, names, namespace))


def pods(prefix: str, count: int) -> list[str]:
    return [f"{prefix}-{index}" for index in range(count)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=20)
    args = parser.parse_args(argv)
    reason = cannot_run()
    if reason is not None:
        print(f"cannot measure: {reason}", file=sys.stderr)
        return 1
    base = Path(tempfile.mkdtemp(prefix="ia-cri-", dir="/tmp"))
    try:
        without_istio_cni(base / "plain", args.count)
        with_istio_cni(base / "istio", args.count)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
