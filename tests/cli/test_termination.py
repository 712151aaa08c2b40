"""SIGTERM ends ``pilot-agent proxy`` within its stop deadline, whatever work is in flight.

Each agent runs in a subprocess with one piece of its work made to hang (patched in before
``main()``): key generation stuck in a worker thread, or a stop step that never returns. No Envoy
(``DISABLE_ENVOY``), so the deadline is the stop grace alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from istio_agent.cli.pilot_agent import LINGER_SECONDS, STOP_GRACE_SECONDS

STARTED = "STUCK WORK STARTED"

KEYGEN_NEVER_ENDS = f"""
import sys, time
import istio_agent.security.manager as manager

def generate_csr(*_args):  # a key that takes forever, in a worker thread nothing can cancel
    print({STARTED!r}, flush=True)
    time.sleep(3600)

manager.generate_csr = generate_csr
"""

STOP_NEVER_ENDS = """
import asyncio
import istio_agent.security.manager as manager

async def stop(self):  # a stop step that never returns (a CA call or an Envoy that will not die)
    await asyncio.sleep(3600)

manager.SecretManager.stop = stop
"""

RUN_MAIN = "\nfrom istio_agent.cli.pilot_agent import main\nmain()\n"


def start_agent(cwd: Path, patch: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME")}
    env.update(
        DISABLE_ENVOY="true",
        PROXY_CONFIG=json.dumps({"discoveryAddress": "127.0.0.1:15010", "statusPort": 0}),  # plaintext
    )
    return subprocess.Popen(
        [sys.executable, "-c", patch + RUN_MAIN, "proxy"],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_line(agent: subprocess.Popen[str], text: str, timeout: float = 20) -> list[str]:
    assert agent.stdout is not None
    deadline = time.monotonic() + timeout
    lines: list[str] = []
    while time.monotonic() < deadline:
        line = agent.stdout.readline()
        if not line:
            break
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"{text!r} never logged:\n{''.join(lines)}")


def terminate(agent: subprocess.Popen[str], budget: float) -> tuple[float, str]:
    """SIGTERM, then how long the agent took to exit and what it logged meanwhile."""
    began = time.monotonic()
    agent.send_signal(signal.SIGTERM)
    try:
        output, _ = agent.communicate(timeout=budget)
    except subprocess.TimeoutExpired:
        agent.kill()
        agent.communicate()
        raise AssertionError(f"the agent was still running {budget}s after SIGTERM") from None
    return time.monotonic() - began, output


@pytest.mark.parametrize(
    ("patch", "ready", "bound", "said"),
    [
        (KEYGEN_NEVER_ENDS, STARTED, LINGER_SECONDS + 4, "exiting without waiting for work still running"),
        (
            STOP_NEVER_ENDS,
            "xDS proxy on",  # the last step of the start
            STOP_GRACE_SECONDS + 4,
            f"did not stop within {STOP_GRACE_SECONDS:g}s of SIGTERM",
        ),
    ],
    ids=["key-generation-in-a-thread", "stop-step-on-the-loop"],
)
def test_sigterm_exits_within_the_deadline_whatever_is_stuck(
    short_tmp: Path, patch: str, ready: str, bound: float, said: str
) -> None:
    """A 99999999-bit key kept the agent alive for over 10 minutes after SIGTERM."""
    agent = start_agent(short_tmp, patch)
    try:
        wait_for_line(agent, ready)
        elapsed, output = terminate(agent, budget=bound + 10)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.communicate()
    assert agent.returncode == 0, output  # a termination that was asked for, as Istio exits
    assert elapsed < bound, output
    assert said in output
    assert "Traceback" not in output
