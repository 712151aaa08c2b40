"""Small helpers for running mesh pieces as local processes (demo, benchmarks, end-to-end tests)."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0


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
