"""Operator commands (demo now; proxy-status and secret comparison later)."""
