"""Exec-to-exit time of the istio-cni executable: the self-contained build beside the venv's script.

    python -m bench.cni_plugin_exec [--runs 40] [--plugin NAME=PATH ...] [--build]
    python -m bench.cni_plugin_exec --floor [--runs 40]

Two invocations, each as a container runtime makes them (a minimal environment, the config on stdin):
VERSION (exec and interpreter start, nothing else) and the ADD of a sandbox the plugin leaves alone
(no ``K8S_POD_NAME``: the previous result passes through; the kubeconfig install-cni writes is read,
the API server never asked). Rows: the package's console script (the venv), the self-contained
plugin (``make cni-plugin``) from this machine's root and, as root, from a node root holding only a
static busybox and the plugin (``tests/cni/test_plugin_bundle.py``'s, entered with ``chroot``), and
any ``--plugin`` given (other packagings, for comparison). The rows take turns, run by run, so a
loaded machine slows them alike; the first two runs of each are not counted. ``--build`` also times
a fresh ``packaging/cni-plugin/build.py`` into a temporary directory. Goal (issue 21): a skipped
pod's ADD p50 <= 50 ms.

``--floor`` instead times the bundle's interpreter importing, step by step, what the ADD of a pod it
GETs needs (``-I -S -c "import ..."``; the collector off and the exit without teardown, as in the
plugin), the steps taking turns: the floor under the 50 ms goal for a pod without injection, and
what each layer adds to it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.cni.test_plugin_bundle import (
    BIN,
    CAN_MAKE_NODE_ROOT,
    KUBECONFIG,
    NETNS,
    NODE_ROOT_NEEDS,
    PLUGIN,
    RUN_DIR,
    VENV_PLUGIN,
    add_config,
    add_env,
    node_root,
)

GOAL_SKIPPED_P50_MS = 50.0
WARMUP = 2
FLOOR_STEPS = (
    ("the interpreter alone", ""),
    (
        "+ re, enum, json, socket, ssl, typing, base64, ipaddress",
        "re, enum, json, socket, ssl, typing, base64, ipaddress",
    ),
    ("+ dataclasses (h11's events are dataclasses)", "dataclasses"),
    ("+ h11 (the HTTP engine)", "h11"),
    ("+ config.document (datetime, decimal, signal)", "istio_agent.config.document"),
    (
        "+ the plugin's own modules on that path",
        "istio_agent.cni.plugin_main, istio_agent.cni.plugin, istio_agent.cni.kube, istio_agent.cni.pod, "
        "istio_agent.http.blocking",
    ),
)
"""Cumulative: each step imports its modules after all the previous steps'."""


@dataclass
class Row:
    """One executable, run from one root: how to start it and its timings per command."""

    name: str
    argv: list[str]
    run_dir: str
    netns: str
    chroot: Path | None = None
    times: dict[str, list[float]] = field(default_factory=lambda: {"VERSION": [], "ADD (skipped pod)": []})

    def once(self, command: str) -> None:
        if command == "VERSION":
            env, stdin = {"CNI_COMMAND": "VERSION"}, b""
        else:
            env = add_env(CNI_NETNS=self.netns)
            stdin = json.dumps({**add_config(), "cni_agent_run_dir": self.run_dir}).encode()
        preexec: Callable[[], None] | None = None
        if self.chroot is not None:
            root = self.chroot

            def preexec() -> None:
                os.chroot(root)
                os.chdir("/")

        started = time.perf_counter()
        done = subprocess.run(
            self.argv, env=env, input=stdin, capture_output=True, preexec_fn=preexec, check=False
        )
        elapsed = time.perf_counter() - started
        if done.returncode != 0:
            raise SystemExit(
                f"{self.name}: {command} failed (exit {done.returncode}): {done.stderr.decode()[-1000:]}"
            )
        self.times[command].append(elapsed * 1000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40, help="counted runs per row and command")
    parser.add_argument(
        "--plugin", action="append", default=[], metavar="NAME=PATH", help="another executable"
    )
    parser.add_argument("--build", action="store_true", help="also time a fresh build")
    parser.add_argument("--floor", action="store_true", help="time the import ladder instead (see above)")
    args = parser.parse_args()
    if not PLUGIN.is_file():
        raise SystemExit(f"{PLUGIN} is missing: make cni-plugin")
    if args.floor:
        floor(args.runs)
        return
    with tempfile.TemporaryDirectory(prefix="bench-cni-exec-") as tmp:
        work = Path(tmp)
        run_dir = work / "run"
        run_dir.mkdir()
        (run_dir / "istio-cni-kubeconfig").write_text(json.dumps(KUBECONFIG))
        netns = work / "netns"
        netns.touch()
        rows = [
            Row("venv console script", [str(VENV_PLUGIN)], str(run_dir), str(netns)),
            Row("self-contained, host root", [str(PLUGIN)], str(run_dir), str(netns)),
        ]
        if CAN_MAKE_NODE_ROOT:
            root = node_root(work / "root")
            rows.append(
                Row("self-contained, node root", ["/opt/cni/bin/istio-cni"], RUN_DIR, NETNS, chroot=root)
            )
        else:
            print(f"(no node-root row: it needs {NODE_ROOT_NEEDS})")
        for spec in args.plugin:
            name, _, path = spec.partition("=")
            rows.append(Row(name, [path], str(run_dir), str(netns)))
        for run in range(args.runs + WARMUP):
            for row in rows:
                for command in row.times:
                    row.once(command)
                    if run < WARMUP:
                        row.times[command].pop()
        report(rows)
        print(
            f"\nbuild/cni/bin: {_size_mib(BIN):.1f} MiB ({sum(1 for p in BIN.rglob('*') if p.is_file())} files)"
        )
        if args.build:
            started = time.monotonic()
            subprocess.run(
                [
                    sys.executable,
                    str(BIN.parents[2] / "packaging" / "cni-plugin" / "build.py"),
                    "--out",
                    str(work / "b"),
                ],
                check=True,
                capture_output=True,
            )
            print(f"a fresh build: {time.monotonic() - started:.1f} s")


def floor(runs: int) -> None:
    """The import ladder in the bundle's interpreter, run as the launcher runs it."""
    runtime = BIN / "istio-cni-runtime"
    loader = next((runtime / "lib").glob("ld-linux*"))
    python = next((runtime / "bin").glob("python3*"))
    argv = [
        str(loader),
        "--inhibit-cache",
        "--library-path",
        str(runtime / "lib"),
        str(python),
        "-I",
        "-S",
        "-c",
    ]
    env = {"OPENSSL_CONF": str(runtime / "openssl.cnf")}
    codes, modules = [], ["sys"]
    for _, imports in FLOOR_STEPS:
        modules += [m.strip() for m in imports.split(",") if m.strip()]
        codes.append(f"import gc, os; gc.disable(); import {', '.join(modules)}; os._exit(0)")
    samples: list[list[float]] = [[] for _ in FLOOR_STEPS]
    for run in range(runs + WARMUP):
        for index, code in enumerate(codes):
            started = time.perf_counter()
            subprocess.run([*argv, code], env=env, check=True)
            if run >= WARMUP:
                samples[index].append((time.perf_counter() - started) * 1000)
    print(f"{'step (cumulative)':60} {'p50 ms':>8} {'min ms':>8} {'+p50 ms':>8}  (n={runs})")
    previous = 0.0
    for (name, _), times in zip(FLOOR_STEPS, samples, strict=True):
        p50 = statistics.median(times)
        print(f"{name:60} {p50:8.1f} {min(times):8.1f} {p50 - previous:8.1f}")
        previous = p50


def report(rows: list[Row]) -> None:
    print(
        f"{'executable':32} {'command':18} {'p50 ms':>8} {'p90 ms':>8} {'min ms':>8}  (n={len(rows[0].times['VERSION'])})"
    )
    for row in rows:
        for command, samples in row.times.items():
            ordered = sorted(samples)
            p50 = statistics.median(ordered)
            goal = ""
            if command.startswith("ADD"):
                goal = (
                    "  goal met"
                    if p50 <= GOAL_SKIPPED_P50_MS
                    else f"  over the {GOAL_SKIPPED_P50_MS:g} ms goal"
                )
            p90 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))]
            print(f"{row.name:32} {command:18} {p50:8.1f} {p90:8.1f} {ordered[0]:8.1f}{goal}")


def _size_mib(directory: Path) -> float:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file() and not p.is_symlink()) / 2**20


if __name__ == "__main__":
    main()
