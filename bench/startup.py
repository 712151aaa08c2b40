"""Startup benchmark: ``pilot-agent proxy`` + Envoy to ready, against Envoy alone, and the agent's idle RSS.

    python -m bench.startup [--runs 10] [--settle 2] [--env NAME=VALUE ...]

The local control plane (``agentctl controlplane``) runs as its own process, started once. Each
run, interleaved:

* **Envoy alone** (the floor): Envoy on a static bootstrap (admin + one HTTP listener answering
  directly), timed from spawning it to its admin ``/ready`` answering 200;
* **agent + Envoy**: ``pilot-agent proxy sidecar`` in a fresh workload directory (root cert and
  token mounted, sidecar env as the injector sets it), timed from spawning the agent to its status
  port's ``/healthz/ready`` answering 200: interpreter start and imports, certificate from the
  control plane, bootstrap, Envoy start, xDS through the agent's proxy, Envoy ready;
* **idle RSS**: ``--settle`` seconds after ready, VmRSS of the pilot-agent process (Envoy, its
  child, excluded), and its VmHWM (peak so far, start-up included).

* **the previous build** (``--baseline-src DIR``): the same agent run from another checkout's ``src``
  (``git archive <commit> src | tar -x -C DIR``), interleaved with this build's, so both see the
  same machine; its rows are added to the tables.

* **where the memory goes**: the idle agent's resident memory by mapping (``bench.memory``): RSS,
  PSS and anonymous memory of each library, the heap and the other anonymous mappings.

The goals: agent + Envoy ready within Envoy alone + 0.2 s; agent idle RSS <= 50 MB.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

from bench.memory import Breakdown, breakdown, table
from istio_agent.ctl.local import answers_200, free_port
from istio_agent.ctl.localmesh import LocalMesh, Workload
from istio_agent.ctl.static_mtls import direct_response_bootstrap
from istio_agent.envoy.binary import find_envoy

READY_TIMEOUT = 60.0
POLL = 0.005
GOAL_EXTRA_SECONDS = 0.2  # issue 23
GOAL_RSS_MB = 50.0


def wait_ready(
    process: subprocess.Popen[bytes], url: str, started: float, what: str, poll: float = POLL
) -> float:
    """Seconds from ``started`` until ``url`` answers 200 (polled: it is another process's state)."""
    deadline = started + READY_TIMEOUT
    while time.perf_counter() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with status {process.returncode}")
        if answers_200(url):
            return time.perf_counter() - started
        time.sleep(poll)
    raise TimeoutError(f"{what} not ready after {READY_TIMEOUT:.0f}s")


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def proc_status_kb(pid: int, field: str) -> int:
    """A ``VmRSS``/``VmHWM`` style line of /proc/<pid>/status, in kB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


def envoy_alone(base: Path, run: int, poll: float = POLL) -> float:
    workdir = base / f"envoy-{run}"
    workdir.mkdir()
    admin_port = free_port()
    (workdir / "envoy.json").write_text(
        json.dumps(direct_response_bootstrap(admin_port, free_port(), "bench"))
    )
    started = time.perf_counter()
    process = subprocess.Popen(
        [str(find_envoy()), "-c", "envoy.json", "--use-dynamic-base-id", "--log-level", "error"],
        cwd=workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        return wait_ready(process, f"http://127.0.0.1:{admin_port}/ready", started, "Envoy", poll)
    finally:
        stop(process)


@dataclass
class AgentRun:
    ready: float  # seconds from spawn to /healthz/ready 200
    first_log: float  # seconds from spawn to the agent's first log line (interpreter + imports)
    envoy_spawned: float  # seconds from spawn to the agent logging Envoy's command line
    rss_kb: int
    hwm_kb: int
    memory: Breakdown


def log_offsets(log: Path, spawned_at: float) -> tuple[float, float]:
    """Seconds from spawn (wall clock) to the first log line and to the "Envoy command" line."""
    first = envoy = float("nan")
    for line in log.read_text(errors="replace").splitlines():
        stamp, _, rest = line.partition("\t")
        try:
            at = datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()
        except ValueError:
            continue
        if first != first:  # nan: not set yet
            first = at - spawned_at
        if "Envoy command:" in rest:
            envoy = at - spawned_at
            break
    return first, envoy


def agent_with_envoy(
    mesh: LocalMesh,
    workload: Workload,
    run: int | str,
    settle: float,
    extra_env: dict[str, str],
    poll: float = POLL,
) -> AgentRun:
    """One fresh pilot-agent + Envoy: time to ready, start-up phases, idle memory."""
    workload.workdir = mesh.base / f"agent-{run}"
    for role in ("admin", "status", "envoy_status", "prometheus"):  # not in the mesh file: fresh each run
        workload.ports[role] = free_port()
    workload.workdir.mkdir()
    workload.prepare(mesh.state_dir)
    env = {**workload.env(mesh.discovery_address), **extra_env}
    url = f"http://127.0.0.1:{workload.ports['status']}/healthz/ready"
    with (workload.workdir / "agent.log").open("ab") as log:
        spawned_at, started = time.time(), time.perf_counter()
        process = subprocess.Popen(
            workload.agent_command(), cwd=workload.workdir, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        what = f"pilot-agent (log: {workload.workdir / 'agent.log'})"
        elapsed = wait_ready(process, url, started, what, poll)
        time.sleep(settle)  # idle means "nothing happening": there is nothing to await
        rss, hwm = proc_status_kb(process.pid, "VmRSS"), proc_status_kb(process.pid, "VmHWM")
        memory = breakdown(process.pid)
    finally:
        stop(process)
    first, envoy = log_offsets(workload.workdir / "agent.log", spawned_at)
    return AgentRun(elapsed, first, envoy, rss, hwm, memory)


@contextmanager
def local_mesh(base: Path, workload: Workload) -> Iterator[LocalMesh]:
    mesh = LocalMesh(base, [], [workload])
    try:
        mesh.start_controlplane()
        yield mesh
    finally:
        mesh.stop()


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def report(
    runs: int,
    envoy: list[float],
    agent: list[AgentRun],
    imports: list[float],
    baseline: list[AgentRun] | None = None,
    poll: float = POLL,
) -> None:
    ready = [run.ready for run in agent]
    print(f"Start to ready, {runs} runs each, interleaved, polled every {poll * 1000:g} ms (ms)\n")
    print(f"| {'measurement':<66} | {'p50':>6} | {'p99':>6} | {'min':>6} |")
    print(f"|{'-' * 68}|{'-' * 8}|{'-' * 8}|{'-' * 8}|")
    rows = [
        ("Envoy alone, static bootstrap: spawn -> admin /ready 200", envoy),
        ("pilot-agent proxy + Envoy: spawn -> /healthz/ready 200", ready),
        ("  of which: spawn -> agent's first log line (interpreter, imports)", [r.first_log for r in agent]),
        ("  of which: spawn -> agent starts Envoy", [r.envoy_spawned for r in agent]),
    ]
    if baseline:
        rows += [
            ("previous build + Envoy: spawn -> /healthz/ready 200", [r.ready for r in baseline]),
            ("  of which: spawn -> agent's first log line", [r.first_log for r in baseline]),
            ("  of which: spawn -> agent starts Envoy", [r.envoy_spawned for r in baseline]),
        ]
    rows.append(("for scale: `python -c 'import ...pilot_agent'` incl. exit", imports))
    for label, samples in rows:
        ms = [s * 1000 for s in samples]
        print(f"| {label:<66} | {pct(ms, 0.5):6.0f} | {pct(ms, 0.99):6.0f} | {min(ms):6.0f} |")
    diffs = [("difference (agent + Envoy) - (Envoy alone)", ready)]
    if baseline:
        diffs.append(("difference, previous build", [r.ready for r in baseline]))
    for label, series in diffs:
        diff50 = (pct(series, 0.5) - pct(envoy, 0.5)) * 1000
        diff99 = (pct(series, 0.99) - pct(envoy, 0.99)) * 1000
        print(f"| {label:<66} | {diff50:6.0f} | {diff99:6.0f} | {'':>6} |")
    diff50 = (pct(ready, 0.5) - pct(envoy, 0.5)) * 1000
    verdict = "met" if diff50 <= GOAL_EXTRA_SECONDS * 1000 else "NOT met"
    print(f"\nGoal: difference <= {GOAL_EXTRA_SECONDS * 1000:.0f} ms at p50: {verdict}.\n")

    report_idle_memory("pilot-agent process memory, Envoy excluded (MB)", agent, GOAL_RSS_MB, "ready")
    if baseline:
        report_idle_memory(
            "previous build's pilot-agent, the same moments (MB)", baseline, GOAL_RSS_MB, "ready"
        )


class IdleMemory(Protocol):
    rss_kb: int
    hwm_kb: int
    memory: Breakdown


def report_idle_memory(title: str, runs: Sequence[IdleMemory], goal_mb: float, after: str) -> None:
    """The idle agent's memory over the runs, the goal's verdict and the median run's breakdown."""
    print(f"{title}\n")
    print(f"| {'measurement':<66} | {'p50':>6} | {'max':>6} | {'min':>6} |")
    print(f"|{'-' * 68}|{'-' * 8}|{'-' * 8}|{'-' * 8}|")
    rss = [r.rss_kb / 1024 for r in runs]
    hwm = [r.hwm_kb / 1024 for r in runs]
    pss = [r.memory.total.pss_kb / 1024 for r in runs]
    anon = [r.memory.total.anon_kb / 1024 for r in runs]
    for label, mb in (
        (f"idle VmRSS ({after} + settle)", rss),
        ("idle PSS (shared pages divided among their processes)", pss),
        ("idle anonymous memory (the process's own)", anon),
        ("VmHWM (peak since start), same moment", hwm),
    ):
        print(f"| {label:<66} | {pct(mb, 0.5):6.1f} | {max(mb):6.1f} | {min(mb):6.1f} |")
    verdict = "met" if pct(rss, 0.5) <= goal_mb else "NOT met"
    print(f"\nGoal: idle RSS <= {goal_mb:.0f} MB: {verdict}.\n")
    median = sorted(runs, key=lambda run: run.rss_kb)[len(runs) // 2]
    print(
        f"Where the idle agent's memory goes (the run with the median RSS, {median.rss_kb / 1024:.1f} MB)\n"
    )
    print(table(median.memory))


def import_seconds() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import istio_agent.cli.pilot_agent"], check=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--settle", type=float, default=2.0, help="seconds after ready before reading RSS")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra agent env (e.g. MALLOC_ARENA_MAX=2)",
    )
    parser.add_argument("--poll", type=float, default=POLL, help="seconds between readiness polls")
    parser.add_argument(
        "--baseline-src",
        type=Path,
        default=None,
        metavar="DIR",
        help="also run the agent from this src directory (a previous build), interleaved",
    )
    args = parser.parse_args()
    extra_env = dict(item.split("=", 1) for item in args.env)
    baseline_env = None
    if args.baseline_src is not None:
        baseline_env = {**extra_env, "PYTHONPATH": str(args.baseline_src.resolve())}
    baseline: list[AgentRun] = []
    base = Path(tempfile.mkdtemp(prefix="bench-startup-", dir="/tmp"))
    envoy: list[float] = []
    agent: list[AgentRun] = []
    imports: list[float] = []
    try:
        workload = Workload("bench", base / "agent-0")
        with local_mesh(base, workload) as mesh:
            envoy_alone(base, -1)  # warm-up: page cache for Envoy, Python and the agent's modules
            agent_with_envoy(mesh, workload, -1, 0, extra_env)
            if baseline_env is not None:
                agent_with_envoy(mesh, workload, "base-1", 0, baseline_env)
            for run in range(args.runs):
                envoy.append(envoy_alone(base, run, args.poll))
                agent.append(agent_with_envoy(mesh, workload, run, args.settle, extra_env, args.poll))
                if baseline_env is not None:
                    baseline.append(
                        agent_with_envoy(mesh, workload, f"base{run}", args.settle, baseline_env, args.poll)
                    )
                imports.append(import_seconds())
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report(args.runs, envoy, agent, imports, baseline, args.poll)


if __name__ == "__main__":
    main()
