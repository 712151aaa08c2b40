"""xDS benchmark: Envoy fed through the agent's xDS proxy vs Envoy connected to the control plane directly.

    python -m bench.xds [--sizes 1000,5000] [--rounds 5] [--repeats 3] [--flavours delta,sotw]
                        [--baseline-src /tmp/base/src] [--src /tmp/this/src]

For each mesh size (clusters, each with two endpoints) and ADS flavour, two paths side by side,
each run ``--repeats`` times, interleaved (medians reported, push latencies pooled):

* **via agent**: ``pilot-agent proxy`` starts Envoy on its generated bootstrap; Envoy's ADS goes over
  the agent's Unix socket and the agent relays it to the control plane;
* **direct**: the same agent and Envoy, but the bootstrap's ``xds-grpc`` cluster points straight at
  the control plane (given to the agent as ProxyConfig ``customConfigFile``), so only the xDS path
  differs; the agent still serves SDS, so both Envoys warm their TLS clusters the same way;
* **via baseline** (with ``--baseline-src``): as *via agent*, the agent imported from another
  checkout's ``src`` (``PYTHONPATH``), so a previous build is measured alternated with this one;
  ``--src`` does the same for the other two paths (a snapshot of this build, when others edit the
  checkout meanwhile).

The local control plane runs in this process (plaintext port for both paths, so neither pays for
TLS) with a push observer that timestamps every response written and every ACK received.

Measured: *time to applied* = first response written to the last ACK of CDS, EDS, LDS and RDS for
the initial configuration; *push latency* = after a mesh change (one service added), from the
control plane writing the first resulting response (CDS or EDS) to Envoy's ACK of the last one,
over ``--rounds`` changes (p50/p99; the control plane's own generation time is excluded); the
agent's CPU seconds (user+sys, whole run including start-up) and its peak RSS (VmHWM), Envoy excluded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from google.protobuf import any_pb2

from istio_agent.bootstrap.envoy import XDS_CLUSTER, build_bootstrap
from istio_agent.config import Env, ProxyConfig, SecuritySettings
from istio_agent.config.bootstrap import BootstrapSettings
from istio_agent.controlplane.mesh import parse_mesh
from istio_agent.controlplane.server import ControlPlane
from istio_agent.controlplane.xdsgen import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    LISTENER_TYPE,
    ROUTE_TYPE,
    ProxyNode,
    build_snapshot,
)
from istio_agent.ctl.localmesh import Workload
from istio_agent.host import LocalHost
from istio_agent.metrics import Registry

ENVOY_TYPES = (CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE)
BACKENDS = 20  # backend workloads; service i is backed by the two whose index is i mod 10
OUTBOUND = 10  # loopback listeners (and routes) on the measured proxy


@dataclass
class TypeTimes:
    pushed_nonce: str = ""
    pushed_at: float = 0.0
    acked_nonce: str = ""
    acked_at: float = 0.0
    error: str | None = None
    writes: list[float] = field(default_factory=list)

    def first_push_after(self, after: float) -> float:
        return min(at for at in self.writes if at >= after)


@dataclass
class Timeline:
    """The control plane's push observer: what was written to and ACKed by each connection, and when."""

    types: dict[int, dict[str, TypeTimes]] = field(default_factory=dict)
    first_push: dict[int, float] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def pushed(self, conn_id: int, type_url: str, nonce: str, resources: int, at: float) -> None:
        entry = self.types.setdefault(conn_id, {}).setdefault(type_url, TypeTimes())
        entry.pushed_nonce, entry.pushed_at = nonce, at
        entry.writes.append(at)
        self.first_push.setdefault(conn_id, at)
        self.changed.set()

    def acked(self, conn_id: int, type_url: str, nonce: str, at: float, error: str | None) -> None:
        entry = self.types.setdefault(conn_id, {}).setdefault(type_url, TypeTimes())
        entry.acked_nonce, entry.acked_at, entry.error = nonce, at, error
        self.changed.set()

    def envoy_connection(self) -> int | None:
        """The connection that carries Envoy's clusters (the agent's relay, or Envoy itself)."""
        return next((conn for conn, types in self.types.items() if CLUSTER_TYPE in types), None)

    def synced(self, conn: int, types: tuple[str, ...], after: float = 0.0) -> tuple[float, float] | None:
        """(first write, last ACK) once every type's latest response sent after ``after`` is ACKed, else None."""
        entries = self.types.get(conn, {})
        writes, acks = [], []
        for type_url in types:
            entry = entries.get(type_url)
            if entry is None or entry.pushed_at < after or entry.acked_nonce != entry.pushed_nonce:
                return None
            if entry.error:
                raise RuntimeError(f"Envoy NACKed {type_url}: {entry.error}")
            writes.append(entry.first_push_after(after))
            acks.append(entry.acked_at)
        return min(writes), max(acks)

    async def wait(
        self, check: Callable[[], tuple[float, float] | None], timeout: float, what: str
    ) -> tuple[float, float]:
        deadline = time.monotonic() + timeout
        while (result := check()) is None:
            self.changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"timed out waiting for {what}")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, 0.5)):
                    await self.changed.wait()
        return result


def mesh_document(size: int, proxy: Workload, extra: int = 0) -> dict[str, Any]:
    services = [{"name": f"svc-{i}", "port": 8000} for i in range(size + extra)]
    backends = []
    for k in range(BACKENDS):
        backed = [f"svc-{i}" for i in range(size + extra) if i % (BACKENDS // 2) == k % (BACKENDS // 2)]
        backends.append(
            {
                "name": f"backend-{k}",
                "serviceAccount": "backend",
                "address": f"10.1.0.{k + 1}",
                "services": backed,
                "inboundPort": 15006,
                "appPort": 8080,
            }
        )
    return {
        "trustDomain": "cluster.local",
        "services": services,
        "workloads": [proxy.mesh_entry(), *backends],
    }


def largest_push_bytes(document: dict[str, Any], proxy: Workload) -> int:
    """Bytes of the largest SotW response (all resources of one type) the measured proxy receives."""
    mesh = parse_mesh(yaml.safe_dump(document), Path("bench-mesh.yaml"))
    node = ProxyNode(
        id=f"sidecar~127.0.0.1~{proxy.name}.default~default.svc.cluster.local",
        name=proxy.name,
        namespace="default",
    )
    snapshot = build_snapshot(mesh, node)
    sizes = []
    for resources in snapshot.values():
        total = 0
        for message in resources.values():
            packed = any_pb2.Any()
            packed.Pack(message)
            total += packed.ByteSize()
        sizes.append(total)
    return max(sizes)


def direct_bootstrap(workload: Workload, env: dict[str, str], plane_port: int) -> Path:
    """The agent's own bootstrap with ``xds-grpc`` pointed at the control plane's TCP port."""
    environ = Env(env)
    proxy_config = ProxyConfig.load(environ)
    security = SecuritySettings.from_env(environ, workload.workdir, proxy_config)
    settings = BootstrapSettings.from_env(
        environ, workdir=workload.workdir, proxy_config=proxy_config, security=security, host=LocalHost()
    )
    bootstrap = build_bootstrap(settings)
    for cluster in bootstrap["static_resources"]["clusters"]:
        if cluster["name"] == XDS_CLUSTER:
            endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
            endpoint["address"] = {"socket_address": {"address": "127.0.0.1", "port_value": plane_port}}
    path = workload.workdir / "direct-bootstrap.json"
    path.write_text(json.dumps(bootstrap))
    return path


def process_usage(pid: int) -> tuple[float, int]:
    """CPU seconds (user+sys) and peak RSS in bytes of one process (not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    peak = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            peak = int(line.split()[1]) * 1024
    return cpu, peak


@dataclass
class Result:
    mode: str
    applied: float
    push_latencies: list[float]
    cpu: float
    initial_rss: int
    """Peak RSS once the initial configuration was applied."""
    peak_rss: int


async def run_once(
    base: Path,
    size: int,
    flavour: str,
    mode: str,
    rounds: int,
    baseline_src: str | None = None,
    src: str | None = None,
) -> Result:
    base.mkdir(parents=True)
    proxy = Workload("bench", base / "bench", calls=[f"svc-{i}" for i in range(OUTBOUND)])
    proxy.workdir.mkdir()
    document = mesh_document(size, proxy)
    mesh_file = base / "mesh.yaml"
    mesh_file.write_text(yaml.safe_dump(document))
    timeline = Timeline()
    plane = ControlPlane(
        mesh_file, base / "state", "127.0.0.1:0", "127.0.0.1:0", push_observer=timeline, registry=Registry()
    )
    await plane.start()
    agent: asyncio.subprocess.Process | None = None
    try:
        proxy.prepare(base / "state")
        proxy_config = {
            "discoveryAddress": f"127.0.0.1:{plane.port}",
            "controlPlaneAuthPolicy": "NONE",
            "proxyAdminPort": proxy.ports["admin"],
            "statusPort": proxy.ports["status"],
            "terminationDrainDuration": "0s",
        }
        env = proxy.env(
            f"127.0.0.1:{plane.port}", delta=flavour == "delta", CA_ADDR=f"127.0.0.1:{plane.secure_port}"
        )
        env["PROXY_CONFIG"] = json.dumps(proxy_config)
        env.pop("ISTIO_META_DNS_CAPTURE")  # Envoy types only: the direct Envoy never asks for NDS
        agent_src = baseline_src if mode == "via baseline" else src
        if agent_src:
            env["PYTHONPATH"] = agent_src
        if mode == "direct":
            proxy_config["customConfigFile"] = direct_bootstrap(proxy, env, plane.port).name
            env["PROXY_CONFIG"] = json.dumps(proxy_config)
        log = (proxy.workdir / "agent.log").open("wb")
        agent = await asyncio.create_subprocess_exec(
            *proxy.agent_command(), cwd=proxy.workdir, env=env, stdout=log, stderr=log
        )

        def initial() -> tuple[float, float] | None:
            conn = timeline.envoy_connection()
            return None if conn is None else timeline.synced(conn, ENVOY_TYPES)

        _, applied_at = await timeline.wait(
            initial, float(os.environ.get("BENCH_TIMEOUT", "120")), f"Envoy to apply {size} clusters ({mode})"
        )
        conn = timeline.envoy_connection()
        assert conn is not None
        applied = applied_at - timeline.first_push[conn]
        _, initial_rss = process_usage(agent.pid)
        latencies = []
        for extra in range(1, rounds + 1):
            changed = parse_mesh(yaml.safe_dump(mesh_document(size, proxy, extra)), mesh_file)
            started = time.monotonic()
            await plane.ads.update_mesh(changed)
            written, done = await timeline.wait(
                lambda started=started: timeline.synced(conn, (CLUSTER_TYPE, ENDPOINT_TYPE), after=started),  # type: ignore[misc]
                120,
                "a push to be applied",
            )
            latencies.append(done - written)
        cpu, peak = process_usage(agent.pid)
        return Result(mode, applied, latencies, cpu, initial_rss, peak)
    finally:
        if agent is not None and agent.returncode is None:
            agent.terminate()
            await agent.wait()
        await plane.stop(0)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.1f} ms"


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def _combine(mode: str, runs: list[Result]) -> Result:
    """Medians over repeated runs; push latencies pooled."""
    return Result(
        mode,
        statistics.median(run.applied for run in runs),
        [latency for run in runs for latency in run.push_latencies],
        statistics.median(run.cpu for run in runs),
        int(statistics.median(run.initial_rss for run in runs)),
        int(statistics.median(run.peak_rss for run in runs)),
    )


async def main_async(
    sizes: list[int],
    rounds: int,
    flavours: list[str],
    repeats: int,
    baseline_src: str | None = None,
    src: str | None = None,
) -> None:
    base = Path(tempfile.mkdtemp(prefix="ia-bx-", dir="/tmp"))
    print(f"xDS benchmark: Envoy via the agent vs Envoy direct to the control plane ({os.cpu_count()} CPUs)")
    print(
        f"{BACKENDS} backend workloads, two endpoints per cluster, {OUTBOUND} listeners+routes; "
        f"{repeats} interleaved runs per path, {rounds} pushes per run; medians"
    )
    print()
    header = (
        "| clusters | ADS | path | time to applied | push p50 | push p99 "
        "| agent CPU s | agent peak RSS | largest push |"
    )
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    ratios: list[tuple[int, str, str, float, float, float, float]] = []
    modes = ["direct", "via agent"] + (["via baseline"] if baseline_src else [])
    try:
        for size in sizes:
            probe = Workload("bench", base / "probe", calls=[f"svc-{i}" for i in range(OUTBOUND)])
            push_bytes = largest_push_bytes(mesh_document(size, probe), probe)
            for flavour in flavours:
                runs: dict[str, list[Result]] = {mode: [] for mode in modes}
                for repeat in range(repeats):  # interleaved, so machine noise hits both paths alike
                    for mode in runs:
                        run_dir = base / f"{size}-{flavour}-{mode.replace(' ', '-')}-{repeat}"
                        runs[mode].append(
                            await run_once(run_dir, size, flavour, mode, rounds, baseline_src, src)
                        )
                results = {mode: _combine(mode, done) for mode, done in runs.items()}
                for mode, result in results.items():
                    print(
                        f"| {size:,} | {flavour} | {mode} | {_ms(result.applied)} | "
                        f"{_ms(statistics.median(result.push_latencies))} | "
                        f"{_ms(_percentile(result.push_latencies, 0.99))} | {result.cpu:.2f} | "
                        f"{result.peak_rss / 2**20:.1f} MiB | {push_bytes / 2**20:.2f} MiB |",
                        flush=True,
                    )
                direct = results["direct"]
                for mode in modes[1:]:
                    via = results[mode]
                    ratios.append(
                        (
                            size,
                            flavour,
                            mode,
                            via.applied / direct.applied,
                            (via.initial_rss - direct.initial_rss) / push_bytes,
                            (via.peak_rss - direct.peak_rss) / push_bytes,
                            statistics.median(via.push_latencies) - statistics.median(direct.push_latencies),
                        )
                    )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print()
    print(
        "| clusters | ADS | path | time to applied, via/direct | agent RSS growth / largest push: "
        "initial sync | same, after the pushes | added push latency p50 |"
    )
    print("|---|---|---|---|---|---|---|")
    for size, flavour, mode, ratio, initial, final, added in ratios:
        print(f"| {size:,} | {flavour} | {mode} | {ratio:.2f} | {initial:.2f} | {final:.2f} | {_ms(added)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes", default="1000,5000", help="comma-separated cluster counts")
    parser.add_argument("--rounds", type=int, default=5, help="mesh changes to time per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per path (medians are reported)")
    parser.add_argument("--flavours", default="delta,sotw", help="ADS flavours: delta, sotw")
    parser.add_argument(
        "--baseline-src",
        help="also run the agent from this src directory (a previous build), alternated with this one",
    )
    parser.add_argument("--src", help="run this build's agent from this src directory (default: installed)")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    flavours = [flavour.strip() for flavour in args.flavours.split(",")]
    asyncio.run(main_async(sizes, args.rounds, flavours, args.repeats, args.baseline_src, args.src))


if __name__ == "__main__":
    main()
