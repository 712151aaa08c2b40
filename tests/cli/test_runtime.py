"""cli.runtime: what every command does to its process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

WRITER = textwrap.dedent(
    """
    import sys
    from istio_agent.cli import runtime

    if sys.argv[1] == "prepared":
        runtime.prepare_process()

    async def nothing() -> None:
        pass

    runtime.run(nothing())  # uvloop's io_uring leaves work that cuts blocking pipe writes short
    sys.stdout.write("x" * 1_000_000)
    sys.stdout.flush()
    sys.stderr.write("y" * 1_000_000)
    sys.stderr.flush()
    """
)


def written_through_slow_pipes(mode: str) -> tuple[int, int, int]:
    """(exit status, stdout bytes, stderr bytes) of WRITER, unbuffered, its pipes read late."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-c", WRITER, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    time.sleep(1.0)  # both pipes fill up while nobody reads
    out, err = process.communicate(timeout=30)
    return process.returncode, len(out), len(err)


def test_an_unbuffered_command_writes_everything_to_a_pipe_read_late() -> None:
    """PYTHONUNBUFFERED (common in images) leaves stdout without a buffered layer, whose write loop
    finishes a short write; a raw write that comes back short is lost (agentctl's config dumps
    were cut at 64 KiB in a pipe). prepare_process puts a writer that finishes every write there."""
    assert written_through_slow_pipes("prepared") == (0, 1_000_000, 1_000_000)
