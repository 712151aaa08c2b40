"""The agent's status server (port 15020): readiness, merged metrics, app probes, quit/drain, debug.

No re-exports here: the agent imports ``status.server`` at start-up, and the merged metrics and app
probes only when first used (see ``status/lazy.py``).
"""
