"""Small helpers for running mesh pieces as local processes (demo, benchmarks, end-to-end tests)."""

from __future__ import annotations

import random
import socket
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PORT = 10000
_HANDED_OUT: set[int] = set()
"""Ports this process already handed out: random picks must not repeat (a demo or test asks for a
dozen, and two listeners given the same port would fail). The one piece of module state in this
dev-tools module; the agent itself has none."""


def _ephemeral_start() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, from below the kernel's ephemeral range.

    Ports from ``bind(0)`` are ephemeral ports, the same pool every outgoing connection draws its
    source port from: between picking one and the process that needs it binding it, a connection
    (Envoy's, the agent's) could take it and the listener would fail. Below the range, only other
    listeners compete.
    """
    high = _ephemeral_start() - 1
    for _ in range(50):
        port = random.randint(_LOWEST_PORT, high) if high > _LOWEST_PORT else 0
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = int(sock.getsockname()[1])
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0


def answers_200(url: str) -> bool:
    """Whether a GET of ``url`` answers 200 within a second (a readiness probe, as the kubelet's)."""
    try:
        with urllib.request.urlopen(url, timeout=1) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def wait_until(check: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll ``check`` (for things a process does that cannot be awaited) until true or ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def controlplane_command(mesh: Path, state_dir: Path, port: int, secure_port: int, *extra: str) -> list[str]:
    """The command line of ``agentctl controlplane`` on 127.0.0.1 with this interpreter."""
    return [
        sys.executable, "-m", "istio_agent.cli.agentctl", "controlplane",
        "--mesh", str(mesh), "--state-dir", str(state_dir),
        "--address", f"127.0.0.1:{port}", "--secure-address", f"127.0.0.1:{secure_port}",
        *extra,
    ]  # fmt: skip
