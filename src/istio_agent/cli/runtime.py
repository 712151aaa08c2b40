"""What every command does to its process before the work starts: grpc's fork handlers, the event loop.

Kept free of grpc and of the agent's packages: :func:`prepare_process` must run before grpc loads.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def prepare_process() -> None:
    """Turn grpcio's fork handlers off unless the operator chose otherwise; call before grpc is imported.

    When a process forks while gRPC's threads are busy, the handlers skip their work ("Other threads
    are currently calling into gRPC, skipping fork() handlers") and the child can die of SIGSEGV before
    it execs: measured, 32 of 2,000 spawns of /bin/true from a busy gRPC process, and now and then
    Envoy itself at agent start-up. The agent forks only to exec (Envoy, exec probes), never to run
    gRPC in a child, so it needs none of what the handlers do. grpc reads the variable when it loads.
    """
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on uvloop when installed (the house rule), else on asyncio's loop; return its result."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
