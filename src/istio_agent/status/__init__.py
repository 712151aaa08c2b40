"""The agent's status server (port 15020): readiness, merged metrics, app probes, quit/drain, debug.

No re-exports here: importing the package must not load aiohttp (``status.server``), which the
agent only loads once the workload is ready (see ``status/early.py``).
"""
