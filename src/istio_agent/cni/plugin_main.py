"""The ``istio-cni`` executable: exec'd by the container runtime once per CNI command.

It lives here rather than in ``istio_agent.cli``, whose package start-up prepares a process for
grpc and loads asyncio: a CNI plugin pays its start-up on every pod sandbox, so only what a command
needs is imported, when it needs it (VERSION needs nothing beyond ``skel``). ADD goes to the node
agent first (:mod:`istio_agent.cni.handoff`), which has everything imported already; without one
the ADD runs here.
"""

from __future__ import annotations

import io
import os
import sys
import time

from istio_agent import __version__
from istio_agent.cni import skel

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from istio_agent.cni import handoff


def _add(args: skel.CmdArgs, not_handed_over: handoff.Fallback | None = None) -> dict[str, Any]:
    from istio_agent.cni.plugin import cmd_add

    return cmd_add(args, started=_STARTED, not_handed_over=not_handed_over)


def _nothing(args: skel.CmdArgs) -> None:
    """CHECK and DEL: the rules live in the pod's netns and go with it; nothing to verify or undo."""
    return None


_STARTED = time.monotonic()
HANDLERS: dict[str, skel.Handler] = {"ADD": _add, "CHECK": _nothing, "DEL": _nothing}


def main() -> None:
    stdin = None
    handlers = HANDLERS
    if os.environ.get("CNI_COMMAND") == "ADD":
        from istio_agent.cni import handoff

        data = sys.stdin.buffer.read()
        try:
            status, stdout = handoff.hand_over(os.environ, data, _STARTED)
        except handoff.Fallback as why:
            stdin = io.BytesIO(data)  # the ADD runs here, on the bytes already read
            reason = why  # ``why`` is unbound when the except block ends
            handlers = {**HANDLERS, "ADD": lambda args: _add(args, not_handed_over=reason)}
        else:
            sys.stdout.write(stdout)
            sys.stdout.flush()
            sys.exit(status)
    sys.exit(skel.main(handlers, about=f"CNI plugin istio-cni {__version__}", stdin=stdin))


if __name__ == "__main__":
    main()
