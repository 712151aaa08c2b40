"""Settings for a process that runs grpcio and forks: the tests' and the benchmarks' (not the agent's).

The agent loads no grpcio; the tests and benchmarks do (the independent clients and servers real
applications use), and they start processes while grpcio is busy: Envoy with its parent-death hook
run between fork and exec, the agent, the proxyless apps. When a process forks while gRPC's threads
are busy, grpcio's fork handlers skip their work ("Other threads are currently calling into gRPC,
skipping fork() handlers") and the child can die of SIGSEGV before it execs: measured, 32 of 2,000
spawns of /bin/true from a busy grpcio process. These processes fork only to exec, so the handlers
are turned off. grpcio's C-core also writes its own log lines to stderr unless told otherwise; they
are kept quiet unless GRPC_VERBOSITY or GRPC_TRACE asks for them. grpc reads both when it loads.
"""

from __future__ import annotations

import os


def prepare_grpcio_process() -> None:
    """Call before grpc is imported."""
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    if "GRPC_VERBOSITY" not in os.environ and "GRPC_TRACE" not in os.environ:
        os.environ["GRPC_VERBOSITY"] = "NONE"
