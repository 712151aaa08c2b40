"""Command-line entry points (``pilot-agent``, ``agentctl``, ``install-cni``).

Flags and environment in, config objects out; the packages do the work. Importing this package
does nothing: each command's ``main`` prepares its process (:func:`istio_agent.cli.runtime.prepare_process`)
before it imports what does the work.
"""
