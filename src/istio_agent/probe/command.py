"""The ``exec`` check: a command exits 0 within the timeout.

Beyond Istio: the command gets its own process group and the whole group is killed on timeout, so
a shell's children do not outlive the probe.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Sequence


class CommandTimeout(Exception):
    """The command ran past the timeout and was killed; ``returncode`` is how it ended."""

    def __init__(self, returncode: int) -> None:
        super().__init__(f"killed after the timeout (return code {returncode})")
        self.returncode = returncode


async def run(command: Sequence[str], timeout: float) -> int:
    """Run ``command`` without input or output and return its exit code (negative: killed by a signal).

    Raises ``FileNotFoundError`` or another ``OSError`` when it cannot be started, and
    ``CommandTimeout`` when it did not end within ``timeout`` seconds.
    """
    process = await asyncio.create_subprocess_exec(
        *command,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        async with asyncio.timeout(timeout):
            return await process.wait()
    except TimeoutError:
        _kill_group(process.pid)
        raise CommandTimeout(await process.wait()) from None
    except asyncio.CancelledError:
        _kill_group(process.pid)
        raise


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
