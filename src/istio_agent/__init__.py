"""istio-agent: a Python implementation of Istio's workload agent and node agent."""

import os

__version__ = "0.1.0"

ISTIO_VERSION = "1.28.0"
"""The Istio release whose agent behaviour we follow; reported to istiod as node metadata
``ISTIO_VERSION``, which istiod uses to decide which proxy features it may configure."""

# grpcio's fork handlers are on by default. When a process forks while gRPC's threads are busy they
# skip their work ("Other threads are currently calling into gRPC, skipping fork() handlers") and the
# child can then die of SIGSEGV before it execs: measured, 32 of 2,000 spawns of /bin/true from a busy
# gRPC process, and now and then Envoy itself at agent start-up. The agent forks only to exec (Envoy,
# exec probes), never to run gRPC in a child, so the handlers are turned off before grpc is imported.
# Set here, in the package's first module, because the variable is read when grpc loads.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
