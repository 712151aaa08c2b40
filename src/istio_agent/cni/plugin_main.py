"""The ``istio-cni`` executable: exec'd by the container runtime once per CNI command.

It lives here rather than in ``istio_agent.cli``, whose package start-up prepares a process for
grpc and loads asyncio: a CNI plugin pays its start-up on every pod sandbox, so only what a command
needs is imported, when it needs it (VERSION needs nothing beyond ``skel``; an ADD no event loop).
"""

from __future__ import annotations

import gc
import os
import sys
import time

from istio_agent import __version__
from istio_agent.cni import skel

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, NoReturn


def _add(args: skel.CmdArgs) -> dict[str, Any]:
    from istio_agent.cni.plugin import cmd_add

    return cmd_add(args, started=_STARTED)


def _nothing(args: skel.CmdArgs) -> None:
    """CHECK and DEL: nothing to verify or undo (the rules go with the pod's network namespace)."""


_STARTED = time.monotonic()
"""The ADD deadline counts from the start of the process (the runtime's clock has been running)."""
HANDLERS: dict[str, skel.Handler] = {"ADD": _add, "CHECK": _nothing, "DEL": _nothing}


def main() -> None:
    # The process lives for one command: the cyclic collector would only scan, again and again, the
    # objects the imports create (~3 ms of an ADD, docs/performance.md), and what it could free is
    # freed at exit anyway.
    gc.disable()
    _exit(skel.main(HANDLERS, about=f"CNI plugin istio-cni {__version__}"))


def _exit(code: int) -> NoReturn:
    """Exit with ``code`` once the answer is written, without the interpreter's teardown.

    Tearing down every module (and OpenSSL) took ~5 ms of an ADD, after the runtime already had its
    answer but before it could go on. Nothing on the plugin's paths registers an exit handler, every
    thread it starts is joined and every child waited for, so there is nothing to finish but the
    two streams, flushed here; if that fails, the normal exit reports it.
    """
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:
        sys.exit(code or 1)
    os._exit(code)


if __name__ == "__main__":
    main()
