"""Proxyless and operator-tool benchmarks.

    python -m bench.proxyless [--agents 50] [--runs 10] [--first-call-runs 10] [--settle 2]

``first_call``: the grpc-agent template's timeline. The local control plane (``agentctl
controlplane``, its own process) serves a grpc service backed by a proxyless grpcio xDS server that
already runs next to its own agent. Each run spawns a fresh ``pilot-agent proxy sidecar`` with the
template's env (``DISABLE_ENVOY``, ``ISTIO_META_GENERATOR=grpc``, ``OUTPUT_CERTS``) in a fresh
workload directory, waits for its ``/healthz/ready`` (the template's postStart hook holds the app
back until then), then spawns the app: a grpcio client on the agent's bootstrap dialing
``xds:///<service>:<port>`` with ``xds_channel_credentials``. Measured: spawn of the agent to the
app's first successful mTLS call (p50 over the runs), split into agent ready and app first call.
Then, ``--settle`` seconds later, the idle agent's VmRSS (no Envoy, no SDS server) and where it
goes by mapping (``bench.memory``). Goal: idle RSS <= 45 MB.

``proxy_status_via_agents``: ``agentctl proxy-status --xds-via-agents`` across N agents, each asked
concurrently through its debug tap. Every agent here is the real xDS proxy and debug tap
(``XdsProxy`` + ``DebugTap``) with a gRPC client standing in for Envoy on its socket, all relaying
to one local control plane (plaintext) in this process; so the figure includes every hop the
question takes (tap, the workload's upstream stream, the control plane's syncz over N proxies, and
back), with all N agents sharing one event loop and core, which real agents (a process each) do not.
Measured: wall time of one proxy-status (p50 and max over ``--runs``), and that all N proxies are
listed, two ways: ``via_agents`` called in this process (the asking alone), and ``agentctl
proxy-status`` run as the operator runs it, a process of its own (interpreter start, imports, the
asking, rendering), with its peak RSS. With ``--baseline-src DIR`` (another checkout's ``src``, e.g.
``git worktree add /tmp/base HEAD~3``) the previous build's agentctl runs alternately with this
build's against the same agents. Goal: <= 2 s through 50 agents.

``agentctl_help``: ``agentctl proxy-status --help``, spawn to exit and peak RSS, for both builds
alternately: the cost of starting the tool at all. ``--skip-first-call`` leaves out the first section.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

from istio_agent.cli.runtime import prepare_process
from tests.grpcio_process import prepare_grpcio_process

prepare_process()
prepare_grpcio_process()  # this process runs grpcio (Envoy's stand-ins) and spawns: before grpc loads

import grpc  # noqa: E402
from envoy.config.core.v3.base_pb2 import Node  # noqa: E402
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2  # noqa: E402

from bench.memory import Breakdown, breakdown  # noqa: E402
from bench.startup import pct, proc_status_kb, report_idle_memory  # noqa: E402
from istio_agent.config import XdsSettings  # noqa: E402
from istio_agent.controlplane.debug import DebugAccess  # noqa: E402
from istio_agent.controlplane.server import ControlPlane  # noqa: E402
from istio_agent.controlplane.xdsgen import CLUSTER_TYPE  # noqa: E402
from istio_agent.ctl import proxystatus as ps  # noqa: E402
from istio_agent.ctl.local import answers_200, free_port, wait_until  # noqa: E402
from istio_agent.ctl.localmesh import LocalMesh, Workload  # noqa: E402
from istio_agent.metrics import Registry  # noqa: E402
from istio_agent.xds.proxy import XdsProxy  # noqa: E402
from istio_agent.xds.tap import DebugTap  # noqa: E402
from tests.e2e.grpc_apps import TARGET, calls, mesh_yaml, start_caller, start_server  # noqa: E402

GOAL_RSS_MB = 45.0
FIRST_CALL_TIMEOUT = 60.0


async def _agent(
    stack: AsyncExitStack, base: Path, index: int, discovery: str
) -> tuple[ps.Agent, asyncio.Task[None]]:
    """One agent's xDS proxy and tap, and an Envoy-like client that subscribed to CDS and ACKs."""
    settings = XdsSettings(
        socket_path=base / f"a{index}" / "XDS", discovery_address=discovery, plaintext=True
    )
    proxy = XdsProxy(settings, registry=Registry())
    await proxy.start()
    stack.push_async_callback(proxy.stop)
    tap = DebugTap(proxy, 0, host="127.0.0.1")
    await tap.start()
    stack.push_async_callback(tap.stop)
    channel = grpc.aio.insecure_channel(f"unix:{settings.socket_path}")
    stack.push_async_callback(channel.close)
    call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
    node = Node(id=f"sidecar~127.0.0.1~w{index}.default~default.svc.cluster.local")
    node.metadata["NAMESPACE"] = "default"
    node.metadata.get_or_create_struct("PROXY_CONFIG")  # an agent's node: syncz lists it
    await call.write(discovery_pb2.DiscoveryRequest(type_url=CLUSTER_TYPE, node=node))

    async def envoy() -> None:
        async for response in call:
            await call.write(
                discovery_pb2.DiscoveryRequest(
                    type_url=response.type_url,
                    response_nonce=response.nonce,
                    version_info=response.version_info,
                )
            )

    task = asyncio.create_task(envoy())
    return ps.Agent(f"127.0.0.1:{tap.port}", f"w{index}.default"), task


@dataclass(frozen=True)
class ToolRun:
    """One agentctl process: spawn to exit, its peak RSS, and what it printed."""

    seconds: float
    max_rss_mb: float
    stdout: str


AGENTCTL = """
import atexit, runpy, sys

def peak():
    with open("/proc/self/status") as status:
        kb = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
    print(f"maxrss-kb {kb}", file=sys.stderr)

atexit.register(peak)
sys.argv = ["agentctl", *sys.argv[1:]]
runpy.run_module("istio_agent.cli.agentctl", run_name="__main__")
"""
"""agentctl as ``python -m`` runs it, reporting its own peak RSS at exit: VmHWM, which exec resets
(getrusage's ru_maxrss would keep the forking parent's, this benchmark's)."""


def agentctl_env(src: Path | None) -> dict[str, str]:
    """This process's environment without its grpcio settings; ``src``: that build's code instead."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPC_")}
    if src is not None:
        env["PYTHONPATH"] = str(src.resolve())
    return env


async def run_agentctl(args: list[str], src: Path | None) -> ToolRun:
    """``agentctl <args>`` from this build (``src`` None) or another; RuntimeError when it fails."""
    started = time.perf_counter()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        AGENTCTL,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=agentctl_env(src),
    )
    out, err = await process.communicate()
    seconds = time.perf_counter() - started
    lines = err.decode(errors="replace").splitlines()
    if process.returncode != 0 or not lines or not lines[-1].startswith("maxrss-kb "):
        raise RuntimeError(f"agentctl {' '.join(args)} exited {process.returncode}: {lines[-5:]}")
    return ToolRun(seconds, int(lines[-1].split()[1]) / 1024, out.decode())


async def proxy_status_via_agents(
    count: int = 50, runs: int = 10, baseline_src: Path | None = None
) -> dict[str, list[float]]:
    """Seconds of one proxy-status through ``count`` agents (all must be listed): in this process
    (``in_process``), as this build's agentctl process (``agentctl``, ``agentctl_rss_mb``) and, with
    ``baseline_src``, the previous build's (``baseline``, ``baseline_rss_mb``), alternately."""
    figures: dict[str, list[float]] = {
        key: [] for key in ("in_process", "agentctl", "agentctl_rss_mb", "baseline", "baseline_rss_mb")
    }
    with tempfile.TemporaryDirectory(prefix="ia-ps-") as tmp:
        base = Path(tmp)
        mesh = base / "mesh.yaml"
        mesh.write_text(
            "trustDomain: cluster.local\nservices:\n- {name: b, namespace: default, port: 8000}\n"
        )
        # The agents dial plaintext, with no identity: debug questions need istiod's debug auth off
        # (ENABLE_DEBUG_ENDPOINT_AUTH=false), as a plaintext port would.
        plane = ControlPlane(
            mesh,
            base / "state",
            "127.0.0.1:0",
            "127.0.0.1:0",
            debug_access=DebugAccess(enabled=False),
            registry=Registry(),
        )
        await plane.start()
        async with AsyncExitStack() as stack:
            stack.push_async_callback(plane.stop, 0)
            made = [await _agent(stack, base, i, f"127.0.0.1:{plane.port}") for i in range(count)]
            agents = [agent for agent, _ in made]
            for _, task in made:
                stack.callback(task.cancel)
            node = ps.debug_node("istio-system", "default")
            listed = 0
            deadline = time.monotonic() + 30
            while listed < count and time.monotonic() < deadline:  # every proxy connected and ACKed
                result = await ps.via_agents(agents[:1], node, limit=0)
                listed = len(ps.proxies(result.responses))
            addresses = base / "agents.txt"
            addresses.write_text("".join(f"{a.name}={a.address}\n" for a in agents))
            tool = ["proxy-status", "--xds-via-agents", "--agent-addresses-file", str(addresses)]
            tool += ["--xds-via-agents-limit", "0", "--timeout", "10s"]
            builds = [("agentctl", None)] + ([("baseline", baseline_src)] if baseline_src else [])
            for _ in range(runs):
                started = time.perf_counter()
                result = await ps.via_agents(agents, node, limit=0, timeout=10)
                figures["in_process"].append(time.perf_counter() - started)
                rows = ps.proxies(result.responses)
                if result.failures or len(rows) != count:
                    raise RuntimeError(f"listed {len(rows)} of {count}; failures: {result.failures[:3]}")
                for key, src in builds:
                    run = await run_agentctl(tool, src)
                    if len(run.stdout.splitlines()) != count + 1:
                        raise RuntimeError(f"{key}: listed {len(run.stdout.splitlines()) - 1} of {count}")
                    figures[key].append(run.seconds)
                    figures[f"{key}_rss_mb"].append(run.max_rss_mb)
    return figures


async def agentctl_help(runs: int = 10, baseline_src: Path | None = None) -> dict[str, list[float]]:
    """``agentctl proxy-status --help``: seconds and peak RSS (MB) per build, alternately."""
    figures: dict[str, list[float]] = {
        key: [] for key in ("agentctl", "agentctl_rss_mb", "baseline", "baseline_rss_mb")
    }
    builds = [("agentctl", None)] + ([("baseline", baseline_src)] if baseline_src else [])
    for _ in range(runs):
        for key, src in builds:
            run = await run_agentctl(["proxy-status", "--help"], src)
            figures[key].append(run.seconds)
            figures[f"{key}_rss_mb"].append(run.max_rss_mb)
    return figures


def report_tool(title: str, figures: dict[str, list[float]]) -> None:
    """p50 / max / min of each build's seconds (ms) and peak RSS (MB)."""
    print(f"{title}\n")
    print(f"| {'':<40} | {'p50':>7} | {'max':>7} | {'min':>7} |")
    print(f"|{'-' * 42}|{'-' * 9}|{'-' * 9}|{'-' * 9}|")
    rows = [
        ("in this process, ms", "in_process", 1000.0),
        ("this build's agentctl, ms", "agentctl", 1000.0),
        ("previous build's agentctl, ms", "baseline", 1000.0),
        ("this build's agentctl peak RSS, MB", "agentctl_rss_mb", 1.0),
        ("previous build's agentctl peak RSS, MB", "baseline_rss_mb", 1.0),
    ]
    for label, key, scale in rows:
        samples = [v * scale for v in figures.get(key, [])]
        if samples:
            print(f"| {label:<40} | {pct(samples, 0.5):7.1f} | {max(samples):7.1f} | {min(samples):7.1f} |")
    print()


def proxyless_env(workload: Workload) -> dict[str, str]:
    """The grpc-agent template's agent env (on top of the sidecar env ``LocalMesh`` sets)."""
    return {
        "ISTIO_META_GENERATOR": "grpc",
        "DISABLE_ENVOY": "true",
        "OUTPUT_CERTS": str(workload.workdir / "var/lib/istio/data"),
        "ISTIO_META_DNS_CAPTURE": "false",
    }


def bootstrap(workload: Workload) -> Path:
    return workload.workdir / "etc/istio/proxy/grpc-bootstrap.json"


def ready_url(workload: Workload) -> str:
    return f"http://127.0.0.1:{workload.ports['status']}/healthz/ready"


@dataclass
class FirstCall:
    ready: float  # seconds from spawning the agent to its /healthz/ready answering 200
    first_call: float  # seconds from spawning the agent to the app's first successful call
    rss_kb: int
    hwm_kb: int
    memory: Breakdown


def _first_call_run(mesh: LocalMesh, run: int, settle: float) -> FirstCall:
    client = Workload("client-1", mesh.base / f"client-{run}", service_account="client")
    name = f"pilot-agent {client.name}"
    spawned_wall, started = time.time(), time.perf_counter()
    mesh.start_agent(client, **proxyless_env(client))
    process = mesh.processes.children[name]
    output = client.workdir / "caller.out"
    try:
        wait_until(lambda: mesh.processes.alive(name) and answers_200(ready_url(client)), 30, "the agent")
        ready = time.perf_counter() - started
        with output.open("w") as out:
            caller = start_caller(bootstrap(client), TARGET, out, timeout=FIRST_CALL_TIMEOUT)
        try:
            wait_until(lambda: any("error" not in c for c in calls(output)), FIRST_CALL_TIMEOUT, "a call")
        finally:
            assert caller.stdin is not None
            caller.stdin.close()
            caller.wait(10)
        answers = calls(output)
        if "error" in answers[0]:
            raise RuntimeError(f"the first call failed: {answers[0]}")
        first_call = answers[0]["at"] - spawned_wall
        time.sleep(settle)  # idle means "nothing happening": there is nothing to await
        rss, hwm = proc_status_kb(process.pid, "VmRSS"), proc_status_kb(process.pid, "VmHWM")
        memory = breakdown(process.pid)
    finally:
        mesh.processes.stop(name)
    return FirstCall(ready, first_call, rss, hwm, memory)


def first_call(runs: int = 10, settle: float = 2.0) -> list[FirstCall]:
    """``runs`` fresh proxyless agents, each to its app's first successful xDS mTLS call (after a warm-up)."""
    base = Path(tempfile.mkdtemp(prefix="bench-pl-", dir="/tmp"))
    server = Workload("echo-1", base / "echo", service_account="echo")
    server.ports["app"] = free_port()
    mesh = LocalMesh(base, [], [server])
    mesh.mesh_file.write_text(mesh_yaml(server.ports["app"]))
    grpc_server: subprocess.Popen[str] | None = None
    try:
        mesh.start_controlplane()
        mesh.start_agent(server, **proxyless_env(server))
        wait_until(
            lambda: mesh.processes.alive() and answers_200(ready_url(server)), 30, "the server's agent"
        )
        with (base / "server.log").open("w") as log:
            grpc_server = start_server(bootstrap(server), server.ports["app"], log)
        _first_call_run(mesh, -1, 0)  # warm-up: the server gets its listener; page cache
        return [_first_call_run(mesh, run, settle) for run in range(runs)]
    finally:
        if grpc_server is not None:
            grpc_server.terminate()
            grpc_server.wait(10)
        mesh.stop()
        shutil.rmtree(base, ignore_errors=True)


def report_first_call(results: list[FirstCall]) -> None:
    print(f"Proxyless agent: start to the app's first xDS mTLS call ({len(results)} runs, ms)\n")
    print(f"| {'measurement':<66} | {'p50':>6} | {'max':>6} | {'min':>6} |")
    print(f"|{'-' * 68}|{'-' * 8}|{'-' * 8}|{'-' * 8}|")
    ready = [r.ready * 1000 for r in results]
    first = [r.first_call * 1000 for r in results]
    app = [(r.first_call - r.ready) * 1000 for r in results]
    for label, ms in (
        ("spawn agent -> app's first successful call", first),
        ("  of which: spawn agent -> /healthz/ready 200", ready),
        ("  of which: app spawned -> first call answered", app),
    ):
        print(f"| {label:<66} | {pct(ms, 0.5):6.0f} | {max(ms):6.0f} | {min(ms):6.0f} |")
    print()
    report_idle_memory("Idle agent without Envoy (MB)", results, GOAL_RSS_MB, "first call")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=50)
    parser.add_argument("--runs", type=int, default=10, help="proxy-status runs")
    parser.add_argument("--first-call-runs", type=int, default=10, help="fresh agents to a first call")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds after the first call before RSS")
    parser.add_argument("--skip-first-call", action="store_true", help="only the operator-tool sections")
    parser.add_argument(
        "--baseline-src", type=Path, help="the previous build's src directory: its agentctl runs alternately"
    )
    args = parser.parse_args()
    if not args.skip_first_call:
        report_first_call(first_call(args.first_call_runs, args.settle))
        print()
    figures = asyncio.run(proxy_status_via_agents(args.agents, args.runs, args.baseline_src))
    report_tool(f"proxy-status via {args.agents} agents (concurrent), over {args.runs} runs", figures)
    report_tool(
        f"agentctl proxy-status --help, over {args.runs} runs",
        asyncio.run(agentctl_help(args.runs, args.baseline_src)),
    )


if __name__ == "__main__":
    main()
