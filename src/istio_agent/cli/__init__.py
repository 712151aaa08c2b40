"""Command-line entry points (``pilot-agent``, ``agentctl``).

Flags and environment in, config objects out; the packages do the work.
"""
