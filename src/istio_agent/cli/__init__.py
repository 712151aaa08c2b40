"""Command-line entry points (``pilot-agent``, ``agentctl``).

Flags and environment in, config objects out; the packages do the work.

This package is imported first whenever a command starts, so it is where the process is prepared
before grpc loads (see :func:`istio_agent.cli.runtime.prepare_process`).
"""

from istio_agent.cli.runtime import prepare_process

prepare_process()
