"""``agentctl proxy-config`` subcommands (registered on the group by :func:`register`)."""

from __future__ import annotations

import click


def register(group: click.Group) -> None:
    """Add this module's commands to the ``proxy-config`` group."""
