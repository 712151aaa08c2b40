"""Merged-metrics benchmark: the agent's ``/stats/prometheus`` with a 100,000-line application endpoint.

    python -m bench.metrics [--lines 100000] [--scrapes 10]

A local control plane (process) and one ``pilot-agent proxy sidecar`` + Envoy whose
``ISTIO_PROMETHEUS_ANNOTATIONS`` points at an application endpoint. The application is a separate
process (``python -m bench.metrics --serve-app PORT``, aiohttp) serving realistic Prometheus text:
counters, gauges and histograms with method/code labels, ``--lines`` lines (~6 MB), built
once and served from memory so that only the agent's work is measured.

Once the agent is ready, each path is scraped ``--scrapes`` times in a row (after one warm-up):

* the app directly, and Envoy's own ``/stats/prometheus`` (port 15090 style), for scale;
* the agent's merged endpoint, plain text and with ``Accept-Encoding: gzip`` (what Prometheus sends).

Time is request sent to last byte read (p50/p99). For the agent's rows also its CPU time per
scrape and its memory: VmRSS before, the peak (VmHWM, reset through ``/proc/<pid>/clear_refs``
just before the row) and VmRSS after. The goal (issue 4): peak RSS grows < 10 MB.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from istio_agent.ctl.local import port_open, wait_until
from istio_agent.ctl.localmesh import LocalMesh, Workload

GOAL_GROWTH_MB = 10.0
BUCKETS = ("0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1", "2.5", "5", "10", "+Inf")
METHODS = ("GET", "POST", "PUT", "DELETE")
CODES = ("200", "201", "204", "400", "404", "500", "503")


def app_body(lines: int, seed: int = 4) -> bytes:
    """Prometheus text with exactly ``lines`` lines: families of counters, gauges and histograms."""
    rng = random.Random(seed)
    out: list[str] = []
    family = 0
    while len(out) < lines:
        kind = ("counter", "gauge", "histogram")[family % 3]
        name = f"app_{('requests', 'queue_depth', 'latency_seconds')[family % 3]}_{family}"
        out.append(f"# HELP {name} {kind.capitalize()} of the app's handler group {family}.")
        out.append(f"# TYPE {name} {kind}")
        for series in range(8):
            labels = f'method="{METHODS[series % 4]}",code="{CODES[series % 7]}"'
            if kind == "counter":
                out.append(f"{name}_total{{{labels}}} {rng.randrange(10**7)}")
            elif kind == "gauge":
                out.append(f"{name}{{{labels}}} {rng.random() * 100:.3f}")
            else:
                count = 0
                for le in BUCKETS:
                    count += rng.randrange(1000)
                    out.append(f'{name}_bucket{{{labels},le="{le}"}} {count}')
                out.append(f"{name}_sum{{{labels}}} {count * 0.037:.3f}")
                out.append(f"{name}_count{{{labels}}} {count}")
        family += 1
    return ("\n".join(out[:lines]) + "\n").encode()


def serve_app(port: int, lines: int) -> None:
    """The application process: one metrics endpoint answering the prebuilt body."""
    from aiohttp import web

    body = app_body(lines)

    async def handle(_request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    app = web.Application()
    app.router.add_get("/metrics", handle)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def proc_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


def cpu_seconds(pid: int) -> float:
    """utime + stime of the process (all its threads), from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def reset_peak(pid: int) -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False when not permitted."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def scrape(url: str, accept_gzip: bool) -> tuple[float, bytes]:
    """Seconds from sending the request to reading the last byte, and the decoded body."""
    headers = {"Accept-Encoding": "gzip"} if accept_gzip else {"Accept-Encoding": "identity"}
    started = time.perf_counter()
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as answer:
        raw = answer.read()
        encoding = answer.headers.get("Content-Encoding", "")
    elapsed = time.perf_counter() - started
    return elapsed, gzip.decompress(raw) if encoding == "gzip" else raw


@dataclass
class Row:
    label: str
    seconds: list[float]
    body_bytes: int
    cpu_per_scrape: float | None = None
    rss_before_kb: int | None = None
    peak_kb: int | None = None
    rss_after_kb: int | None = None


def measure(label: str, url: str, n: int, accept_gzip: bool, check: bytes, agent_pid: int | None) -> Row:
    _, body = scrape(url, accept_gzip)  # warm-up (connections to upstreams, first-use allocations)
    if check not in body:
        raise RuntimeError(f"{label}: the response lacks the app's last line ({len(body)} bytes)")
    row = Row(label, [], len(body))
    if agent_pid is not None:
        row.rss_before_kb = proc_kb(agent_pid, "VmRSS")
        if not reset_peak(agent_pid):
            print("note: cannot reset VmHWM; the peak includes start-up", file=sys.stderr)
        cpu_before = cpu_seconds(agent_pid)
    for _ in range(n):
        elapsed, body = scrape(url, accept_gzip)
        if check not in body:
            raise RuntimeError(f"{label}: a response lacks the app's last line ({len(body)} bytes)")
        row.seconds.append(elapsed)
    if agent_pid is not None:
        row.cpu_per_scrape = (cpu_seconds(agent_pid) - cpu_before) / n
        row.peak_kb = proc_kb(agent_pid, "VmHWM")
        row.rss_after_kb = proc_kb(agent_pid, "VmRSS")
    return row


@contextmanager
def started_mesh(base: Path, workload: Workload, lines: int) -> Iterator[tuple[LocalMesh, int]]:
    """Control plane, the app endpoint and pilot-agent + Envoy, ready; yields the mesh and the agent's pid."""
    mesh = LocalMesh(base, [], [workload])
    try:
        mesh.start_controlplane()
        app_port = workload.ports["app"]
        mesh.processes.start(
            "app",
            [sys.executable, "-m", "bench.metrics", "--serve-app", str(app_port), "--lines", str(lines)],
            base / "app.log",
        )
        wait_until(lambda: mesh.processes.alive("app") and port_open(app_port), 60, "the app endpoint")
        workload.workdir.mkdir(parents=True)
        workload.prepare(mesh.state_dir)
        annotations = {"scrape": "true", "port": str(app_port), "path": "/metrics"}
        env = workload.env(mesh.discovery_address, ISTIO_PROMETHEUS_ANNOTATIONS=json.dumps(annotations))
        agent = mesh.processes.start(
            "pilot-agent",
            workload.agent_command(),
            workload.workdir / "agent.log",
            cwd=workload.workdir,
            env=env,
        )
        ready = f"http://127.0.0.1:{workload.ports['status']}/healthz/ready"

        def is_ready() -> bool:
            mesh.processes.alive("pilot-agent")
            try:
                with urllib.request.urlopen(ready, timeout=1) as answer:
                    return bool(answer.status == 200)
            except OSError:
                return False

        wait_until(is_ready, 60, "pilot-agent to be ready")
        yield mesh, agent.pid
    finally:
        mesh.stop()


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def mb(kb: int | None) -> str:
    return "" if kb is None else f"{kb / 1024:.1f}"


def report(lines: int, scrapes: int, app_bytes: int, rows: list[Row]) -> None:
    print(f"Scrape of {lines:,} app lines ({app_bytes / 1e6:.1f} MB), {scrapes} scrapes per row\n")
    print(f"| {'path':<44} | {'body MB':>7} | {'p50 ms':>7} | {'p99 ms':>7} | {'agent CPU ms':>12} |")
    print(f"|{'-' * 46}|{'-' * 9}|{'-' * 9}|{'-' * 9}|{'-' * 14}|")
    for row in rows:
        cpu = "" if row.cpu_per_scrape is None else f"{row.cpu_per_scrape * 1000:.0f}"
        print(
            f"| {row.label:<44} | {row.body_bytes / 1e6:7.2f} | {pct(row.seconds, 0.5) * 1000:7.1f} | "
            f"{pct(row.seconds, 0.99) * 1000:7.1f} | {cpu:>12} |"
        )
    print("\npilot-agent memory during the merged scrapes, Envoy excluded (MB)\n")
    print(f"| {'path':<44} | {'RSS before':>10} | {'peak':>7} | {'growth':>7} | {'RSS after':>9} |")
    print(f"|{'-' * 46}|{'-' * 12}|{'-' * 9}|{'-' * 9}|{'-' * 11}|")
    worst = 0.0
    for row in rows:
        if row.peak_kb is None or row.rss_before_kb is None:
            continue
        growth = (row.peak_kb - row.rss_before_kb) / 1024
        worst = max(worst, growth)
        print(
            f"| {row.label:<44} | {mb(row.rss_before_kb):>10} | {mb(row.peak_kb):>7} | "
            f"{growth:7.1f} | {mb(row.rss_after_kb):>9} |"
        )
    verdict = "met" if worst < GOAL_GROWTH_MB else "NOT met"
    print(f"\nGoal: peak RSS grows < {GOAL_GROWTH_MB:.0f} MB: {verdict} (worst {worst:.1f} MB).")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--scrapes", type=int, default=10)
    parser.add_argument("--serve-app", type=int, default=0, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_app:
        serve_app(args.serve_app, args.lines)
        return
    body = app_body(args.lines)
    last_line = body.rstrip(b"\n").rsplit(b"\n", 1)[1]
    base = Path(tempfile.mkdtemp(prefix="bench-metrics-", dir="/tmp"))
    try:
        workload = Workload("bench", base / "agent")
        with started_mesh(base, workload, args.lines) as (_mesh, pid):
            app = f"http://127.0.0.1:{workload.ports['app']}/metrics"
            envoy = f"http://127.0.0.1:{workload.ports['prometheus']}/stats/prometheus"
            merged = f"http://127.0.0.1:{workload.ports['status']}/stats/prometheus"
            n = args.scrapes
            rows = [
                measure("app directly", app, n, False, last_line, None),
                measure("Envoy's own /stats/prometheus", envoy, n, False, b"envoy_", None),
                measure("agent merged (agent + Envoy + app), plain", merged, n, False, last_line, pid),
                measure("agent merged, Accept-Encoding: gzip", merged, n, True, last_line, pid),
            ]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report(args.lines, args.scrapes, len(body), rows)


if __name__ == "__main__":
    main()
