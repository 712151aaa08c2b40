"""What every command does to its process: a warning filter, the event loop, a bounded exit.

Kept free of the agent's packages, so that a command's ``main`` can call :func:`prepare_process`
before it imports what does the work. No command loads grpcio (the agent's gRPC is
:mod:`istio_agent.rpc`, grpclib), so there are no grpc settings to make before it loads.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import select
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from istio_agent.log import scope

T = TypeVar("T")


def prepare_process() -> None:
    """Process-wide settings every command makes first, before it imports what does the work."""
    sys.stdout = _finishing_writes(sys.stdout)
    sys.stderr = _finishing_writes(sys.stderr)
    # Some roots in the OS trust store (SYSTEM roots, file-root:system) have serial number 0, which
    # RFC 5280 forbids; cryptography warns once per process. They are the OS's roots, not ours to fix.
    warnings.filterwarnings("ignore", message="Parsed a serial number which wasn't positive")


class _WholeWrites(io.RawIOBase):
    """A raw file whose ``write`` returns only once all of it is written, as a buffered one does.

    Under ``PYTHONUNBUFFERED`` (``-u``) stdout and stderr have no buffered layer, and a raw write may
    come back short: a write to a full pipe is cut short when the task has pending work, which
    uvloop's io_uring leaves behind. The text layer never writes the rest, so output a reader takes
    late (agentctl's config dumps, the agent's log lines in a busy container runtime) lost all but
    its first 64 KiB. Writes stay unbuffered: each returns when its bytes are with the kernel.
    """

    def __init__(self, raw: io.RawIOBase) -> None:
        super().__init__()
        self._raw = raw

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._raw.fileno()

    def isatty(self) -> bool:
        return self._raw.isatty()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        total = len(view)
        while view:
            written = self._raw.write(view)
            if written is None:  # a non-blocking file that is full: wait until it takes more
                select.select([], [self._raw], [])
                continue
            view = view[written:]
        return total


def _finishing_writes(stream: Any) -> Any:
    """``stream``, or an unbuffered equivalent whose writes are finished, when it has no buffer."""
    raw = getattr(stream, "buffer", None)
    if not isinstance(raw, io.FileIO):
        return stream  # buffered (its flush finishes short writes), already replaced, or not a file
    return io.TextIOWrapper(
        _WholeWrites(raw), encoding=stream.encoding, errors=stream.errors, write_through=True
    )


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on uvloop when installed (the house rule), else on asyncio's loop; return its result."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


class ExitDeadline:
    """Ends the process at a deadline whatever is still running, as a Go program ends when main returns.

    Stopping runs on the event loop, and Python waits for worker threads when it exits: a stop step
    that never returns (Envoy that will not die, a CA call that hangs) or a thread busy with work
    nobody waits for any more (a key being generated) would keep the process alive after SIGTERM,
    where kubelet then has to SIGKILL it. Once armed, a daemon thread logs why and ends the process
    with ``os._exit`` at the deadline; a process that finishes earlier never notices it.
    """

    def __init__(self, log: logging.Logger | logging.LoggerAdapter[logging.Logger]) -> None:
        self._log = log
        self._changed = threading.Condition()
        self._at: float | None = None
        self._code = 0
        self._level = logging.ERROR
        self._message = ""

    def arm(self, seconds: float, code: int, message: str, level: int = logging.ERROR) -> None:
        """End the process with ``code`` within ``seconds``, logging ``message`` first.

        An earlier deadline armed before stays, with its code and message.
        """
        with self._changed:
            at = time.monotonic() + seconds
            first = self._at is None
            if self._at is None or at < self._at:
                self._at = at
                self._code, self._level, self._message = code, level, message
                self._changed.notify()
        if first:
            threading.Thread(target=self._wait_and_exit, name="exit-deadline", daemon=True).start()

    def _wait_and_exit(self) -> None:
        with self._changed:
            while self._at is not None and (left := self._at - time.monotonic()) > 0:
                self._changed.wait(left)
            code, level, message = self._code, self._level, self._message
        self._log.log(level, "%s (exit status %d)", message, code)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # closed or broken: nothing more to say
                stream.flush()
        os._exit(code)


def install_signal_handlers(on_signal: Callable[[], None] = lambda: None) -> asyncio.Event:
    """An event the first SIGINT/SIGTERM sets; later signals are swallowed, as in Istio.

    Installed before anything starts: a signal that arrives while the agent is still starting (Envoy
    may already serve traffic then) must stop it cleanly, not kill the process outright.
    ``on_signal`` runs at the first signal, even while the agent is still starting.
    """
    stop = asyncio.Event()

    def received() -> None:
        if not stop.is_set():
            scope("default").info("received termination signal, shutting down")
            on_signal()
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, received)
    return stop
