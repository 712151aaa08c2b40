"""Soak: the demo mesh under faults for minutes, with short-lived certificates and steady traffic.

    python -m bench.soak [--minutes 10] [--secret-ttl 30] [--kill-every 120] [--outage 18]

What runs: ``agentctl demo``'s mesh (the local control plane, workloads ``a`` and ``b``, each with
its echo app, ``pilot-agent proxy`` and Envoy), the agents asking for certificates of
``SECRET_TTL`` seconds, so each rotates every half of that. Meanwhile:

* **traffic**: ``a``'s application calls service ``b`` through ``a``'s Envoy every 50 ms; every
  answer other than HTTP 200 counts as failed;
* **control plane kills**: the control plane is SIGKILLed and started again at once, every
  ``--kill-every`` seconds;
* **one CA outage** half-way through, longer than the interval between two rotations: the control
  plane (the CA, and xDS with it) is stopped for ``--outage`` seconds, right after both workloads
  rotated, so each agent's rotation falls inside the outage and has to be retried after it.

The report: failed requests (goal 0), rotations seen by the server Envoy (``b``) and the client
Envoy (``a``), each agent's resident memory and open file descriptors at the start and the end
(goal: growth <= 5 MB and <= 5 FDs), and warning or error lines other than the reconnects the
faults explain (goal 0). ``tests/e2e/test_soak.py`` runs a short variant in the test suite.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from istio_agent.ctl.demo import build_mesh
from istio_agent.ctl.local import wait_until
from istio_agent.ctl.localmesh import LocalMesh, Workload, admin_json

GOAL_RSS_GROWTH_MB = 5.0
GOAL_FD_GROWTH = 5

EXPECTED_WARNINGS = (
    # The xDS proxy's upstream ended or refused while the control plane is down or restarting.
    re.compile(r"\txdsproxy\t.*(upstream|connect)"),
    # The CA unreachable: Istio's CA client retries, then the rotation is retried with backoff.
    re.compile(r"\tcitadelclient\t(ca request failed|failed to sign CSR)"),
    re.compile(r"\tcache\tcertificate rotation failed"),
    # Envoy's own line for its ADS stream to the agent closing (the agent ends it with the upstream).
    re.compile(r"gRPC config stream to xds-grpc closed"),
)
"""Warnings a fault explains, when they fall inside a fault's window; any other counts against the soak."""

FAULT_SETTLE = timedelta(seconds=15)
"""How long after a fault ends its warnings still count as explained (reconnect backoff)."""

_LEVEL = re.compile(r"\t(warn|error)\t|\]\[(warning|error|critical)\]")
_AGENT_TIME = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)Z")
_ENVOY_TIME = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\]")


@dataclass
class Plan:
    duration: float = 600.0
    secret_ttl: int = 30
    request_interval: float = 0.05
    kill_every: float = 120.0
    outage: float = 18.0


@dataclass
class Usage:
    rss_mb: float
    fds: list[str]


@dataclass
class Report:
    requests: int = 0
    failed: list[str] = field(default_factory=list)
    rotations: dict[str, int] = field(default_factory=dict)
    usage_start: dict[str, Usage] = field(default_factory=dict)
    usage_end: dict[str, Usage] = field(default_factory=dict)
    kills: int = 0
    outages: list[str] = field(default_factory=list)
    faults: list[tuple[datetime, datetime]] = field(default_factory=list)
    rss_by_minute: dict[str, list[float]] = field(default_factory=dict)
    fds_gained: dict[str, list[str]] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    expected_warnings: int = 0

    def growth(self, name: str) -> tuple[float, int]:
        start, end = self.usage_start[name], self.usage_end[name]
        return end.rss_mb - start.rss_mb, len(end.fds) - len(start.fds)

    @property
    def passed(self) -> bool:
        growth_ok = all(
            rss <= GOAL_RSS_GROWTH_MB and fds <= GOAL_FD_GROWTH
            for rss, fds in (self.growth(name) for name in self.usage_start)
        )
        return not self.failed and not self.unexpected and growth_ok


def usage(pid: int) -> Usage:
    """VmRSS and what the open file descriptors of a process point at, from /proc."""
    rss_kb = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kb = int(line.split()[1])
    targets = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            targets.append(re.sub(r"\[\d+\]", "[...]", os.readlink(fd)))
        except OSError:
            continue  # closed meanwhile
    return Usage(rss_kb / 1024, sorted(targets))


def gained(start: list[str], end: list[str]) -> list[str]:
    """The kinds of file descriptor the process holds more of at the end (``socket:[...] +3``)."""
    before, after = Counter(start), Counter(end)
    return [
        f"{kind} {after[kind] - before[kind]:+d}" for kind in sorted(after) if after[kind] != before[kind]
    ]


def in_fault(line: str, faults: list[tuple[datetime, datetime]]) -> bool:
    """True when the log line's timestamp (the agent's or Envoy's format, UTC) falls in a fault window."""
    match = _AGENT_TIME.match(line)
    text = match.group(1) if match else (envoy.group(1) if (envoy := _ENVOY_TIME.match(line)) else "")
    try:
        when = datetime.fromisoformat(text).replace(tzinfo=UTC)
    except ValueError:
        return False
    return any(start <= when <= end + FAULT_SETTLE for start, end in faults)


def serials(workload: Workload) -> set[str]:
    """Serial numbers of the workload certificates the workload's Envoy holds now."""
    try:
        certificates = admin_json(workload.ports["admin"], "/certs")["certificates"]
    except (OSError, KeyError, ValueError):
        return set()
    return {
        cert["serial_number"]
        for entry in certificates
        for cert in entry.get("cert_chain", [])
        if any("uri" in san for san in cert.get("subject_alt_names", []))
    }


class Traffic(threading.Thread):
    """``a``'s application: one request to ``b`` every interval, failures kept with their time."""

    def __init__(self, port: int, interval: float, started: float) -> None:
        super().__init__(name="soak-traffic", daemon=True)
        self.url = f"http://127.0.0.1:{port}/soak"
        self.interval = interval
        self.started = started
        self.requests = 0
        self.failed: list[str] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        next_at = time.monotonic()
        while not self.stopping.is_set():
            self.requests += 1
            try:
                with urllib.request.urlopen(self.url, timeout=5) as answer:
                    answer.read()
                    outcome = "" if answer.status == 200 else f"HTTP {answer.status}"
            except urllib.error.HTTPError as err:
                outcome = f"HTTP {err.code}"
            except OSError as err:
                outcome = f"{type(err).__name__}: {err}"
            if outcome:
                self.failed.append(f"{time.monotonic() - self.started:7.1f}s {outcome}")
            next_at += self.interval
            self.stopping.wait(max(0.0, next_at - time.monotonic()))


class RotationWatch(threading.Thread):
    """Polls each Envoy's certificates once a second and records every new serial number."""

    def __init__(self, workloads: list[Workload]) -> None:
        super().__init__(name="soak-rotations", daemon=True)
        self.workloads = workloads
        self.seen: dict[str, list[str]] = {w.name: [] for w in workloads}
        self.stopping = threading.Event()
        self.lock = threading.Lock()

    def run(self) -> None:
        while not self.stopping.wait(1.0):
            for workload in self.workloads:
                for serial in serials(workload):
                    with self.lock:
                        if serial not in self.seen[workload.name]:
                            self.seen[workload.name].append(serial)

    def count(self, name: str) -> int:
        with self.lock:
            return len(self.seen[name])


def classify_logs(mesh: LocalMesh, since: dict[str, int], report: Report) -> None:
    """Sort the agents' warning and error lines (their Envoy's included) into expected and not."""
    for workload in mesh.workloads:
        log = workload.workdir / "agent.log"
        text = log.read_bytes()[since.get(workload.name, 0) :].decode(errors="replace")
        for line in text.splitlines():
            if not _LEVEL.search(line):
                continue
            if in_fault(line, report.faults) and any(pattern.search(line) for pattern in EXPECTED_WARNINGS):
                report.expected_warnings += 1
            else:
                report.unexpected.append(f"{workload.name}: {line.strip()}")


def run_soak(plan: Plan, base: Path, say: Callable[[str], None] = print) -> Report:
    """Run the soak in ``base`` and return what it saw; every process is stopped on the way out."""
    mesh = build_mesh(base)
    mesh.agent_env = {"SECRET_TTL": f"{plan.secret_ttl}s"}
    a, b = mesh.workload("a"), mesh.workload("b")
    report = Report()
    began = time.monotonic()

    def step(text: str) -> None:
        say(f"[{time.monotonic() - began:6.1f}s] {text}")

    try:
        mesh.start_controlplane()
        for workload in (b, a):
            mesh.start_workload(workload)
        port = a.outbound_port("b")
        mesh.wait_for_config(a, lambda names: f"127.0.0.1_{port}" in names["listeners"], "its listener for b")
        wait_until(lambda: mesh.processes.alive() and _answers(port), 60, "a's first request to b")
        agents = {w.name: mesh.processes.children[f"pilot-agent {w.name}"].pid for w in (a, b)}
        log_start = {w.name: (w.workdir / "agent.log").stat().st_size for w in (a, b)}
        report.usage_start = {name: usage(pid) for name, pid in agents.items()}
        step(f"mesh up; traffic a -> b every {plan.request_interval * 1000:.0f} ms for {plan.duration:.0f}s")

        started = time.monotonic()
        traffic = Traffic(port, plan.request_interval, started)
        watch = RotationWatch([a, b])
        traffic.start()
        watch.start()
        outage_at = plan.duration / 2
        next_kill = plan.kill_every
        outage_done = False
        report.rss_by_minute = {name: [report.usage_start[name].rss_mb] for name in agents}
        while (elapsed := time.monotonic() - started) < plan.duration:
            mesh.processes.alive(*(f"pilot-agent {name}" for name in agents))
            if elapsed >= 60 * len(report.rss_by_minute["a"]):
                for name, pid in agents.items():
                    report.rss_by_minute[name].append(usage(pid).rss_mb)
            if not outage_done and elapsed >= outage_at:
                ca_outage(mesh, watch, plan, step, report)
                outage_done = True
            elif elapsed >= next_kill:
                step("SIGKILL the control plane and start it again")
                began_at = datetime.now(UTC)
                mesh.stop_controlplane(kill=True)
                mesh.start_controlplane()
                report.faults.append((began_at, datetime.now(UTC)))
                report.kills += 1
                next_kill += plan.kill_every
            time.sleep(0.2)
        traffic.stopping.set()
        watch.stopping.set()
        traffic.join()
        watch.join()
        report.requests, report.failed = traffic.requests, traffic.failed
        report.rotations = {name: max(0, watch.count(name) - 1) for name in watch.seen}
        report.usage_end = {name: usage(pid) for name, pid in agents.items()}
        report.fds_gained = {
            name: gained(report.usage_start[name].fds, report.usage_end[name].fds) for name in agents
        }
        classify_logs(mesh, log_start, report)
        return report
    finally:
        mesh.stop()


def ca_outage(
    mesh: LocalMesh, watch: RotationWatch, plan: Plan, step: Callable[[str], None], report: Report
) -> None:
    """Stop the control plane right after both workloads rotated, for longer than a rotation interval."""
    counts = {name: watch.count(name) for name in watch.seen}
    wait_until(
        lambda: all(watch.count(name) > count for name, count in counts.items()),
        plan.secret_ttl,
        "both workloads to rotate before the CA outage",
        interval=0.2,
    )
    step(
        f"CA outage: control plane stopped for {plan.outage:.0f}s (rotation interval {plan.secret_ttl / 2:.0f}s)"
    )
    began, began_at = time.monotonic(), datetime.now(UTC)
    mesh.stop_controlplane()
    time.sleep(plan.outage)
    mesh.start_controlplane()
    report.faults.append((began_at, datetime.now(UTC)))
    report.outages.append(f"{time.monotonic() - began:.1f}s")
    step("control plane back")


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/soak", timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def print_report(plan: Plan, report: Report, say: Callable[[str], None] = print) -> None:
    say("")
    say(f"soak: {plan.duration / 60:.1f} min, SECRET_TTL {plan.secret_ttl}s, control plane SIGKILLed every "
        f"{plan.kill_every:.0f}s ({report.kills}x), CA outage {', '.join(report.outages) or 'none'}")  # fmt: skip
    rows = [("measurement", "value", "goal")]
    rows.append(("requests a -> b (every 50 ms)", str(report.requests), ""))
    rows.append(("failed requests", str(len(report.failed)), "0"))
    for name, count in report.rotations.items():
        role = "server" if name == "b" else "client"
        rows.append((f"rotations seen by {name}'s Envoy ({role})", str(count), ""))
    for name in report.usage_start:
        start, end = report.usage_start[name], report.usage_end[name]
        rss, fds = report.growth(name)
        rows.append(
            (
                f"agent {name} RSS start -> end",
                f"{start.rss_mb:.1f} -> {end.rss_mb:.1f} MB ({rss:+.1f})",
                "<= +5",
            )
        )
        fd_counts = f"{len(start.fds)} -> {len(end.fds)} ({fds:+d})"
        rows.append((f"agent {name} open FDs start -> end", fd_counts, "<= +5"))
    rows.append(("expected reconnect warnings", str(report.expected_warnings), ""))
    rows.append(("other warning/error lines", str(len(report.unexpected)), "0"))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        say("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    for name, samples in report.rss_by_minute.items():
        if len(samples) > 1:
            say(f"  agent {name} RSS each minute (MB): {' '.join(f'{mb:.1f}' for mb in samples)}")
    for name, kinds in report.fds_gained.items():
        if kinds:
            say(f"  agent {name} file descriptors changed: {', '.join(kinds)}")
    for line in report.failed[:10]:
        say(f"  failed: {line}")
    for line in report.unexpected[:20]:
        say(f"  unexpected: {line}")
    say(f"  {'PASS' if report.passed else 'FAIL'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--secret-ttl", type=int, default=30, help="SECRET_TTL in seconds")
    parser.add_argument("--kill-every", type=float, default=120.0, help="seconds between control plane kills")
    parser.add_argument("--outage", type=float, default=18.0, help="CA outage in seconds")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    args = parser.parse_args(argv)
    plan = Plan(args.minutes * 60, args.secret_ttl, 0.05, args.kill_every, args.outage)
    base = Path(tempfile.mkdtemp(prefix="ia-soak-", dir="/tmp"))
    try:
        report = run_soak(plan, base)
        print_report(plan, report)
        return 0 if report.passed else 1
    finally:
        if args.keep:
            print(f"logs kept in {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
