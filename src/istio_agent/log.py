"""Logging in Istio's format: ``<RFC3339 µs>Z<TAB>level<TAB>scope<TAB>message``.

Every subsystem logs through a *scope* (``sds``, ``cache``, ``ca``, ...), as Istio does, so
``--log_output_level sds:debug,default:info`` works the same way. Scope loggers are ordinary
``logging`` loggers named ``istio.<scope>``. The line itself is :mod:`istio_agent.logline`'s (the
one encoding, shared with the CNI plugin, which writes its lines without ``logging``).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from istio_agent import logline
from istio_agent.logline import DEFAULT_SCOPE, ROOT

if TYPE_CHECKING:  # only for an annotation: short-lived processes (the CNI plugin) log without asyncio
    import asyncio

DEFAULT_OUTPUT_LEVELS = "default:info,grpc:none"


def scope(name: str) -> logging.Logger:
    """The logger of an Istio log scope."""
    return logging.getLogger(f"{ROOT}.{name}")


class IstioFormatter(logging.Formatter):
    """Istio's console encoding: tab-separated time, level, scope and message."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        return logline.console_line(record.created, record.levelno, logline.scope_name(record.name), message)


class JsonFormatter(logging.Formatter):
    """Istio's ``--log_as_json`` encoding: one JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        error = self.formatException(record.exc_info) if record.exc_info else None
        return logline.json_line(
            record.created, record.levelno, logline.scope_name(record.name), record.getMessage(), error
        )


def parse_output_levels(spec: str) -> dict[str, int]:
    """Parse ``scope:level,...`` (a bare level applies to ``default``); raise ValueError when invalid."""
    levels: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, level = item.rpartition(":")
        name = name or DEFAULT_SCOPE
        if level.lower() not in logline.LEVELS:
            raise ValueError(
                f"invalid log level {level!r} for scope {name!r}; use one of {', '.join(logline.LEVELS)}"
            )
        levels[name] = logline.LEVELS[level.lower()]
    return levels


def configure(
    output_levels: str = DEFAULT_OUTPUT_LEVELS, as_json: bool = False, stream: TextIO | None = None
) -> None:
    """Install the Istio formatter on the root logger and apply per-scope levels."""
    levels = parse_output_levels(DEFAULT_OUTPUT_LEVELS)
    levels.update(parse_output_levels(output_levels))
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if as_json else IstioFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    default = levels.pop(DEFAULT_SCOPE, logging.INFO)
    root.setLevel(default)
    logging.getLogger(ROOT).setLevel(default)
    for name, level in levels.items():
        # Third-party loggers (grpc, asyncio) are addressed by their own names.
        logging.getLogger(name if name in ("grpc", "asyncio") else f"{ROOT}.{name}").setLevel(level)


def report_failure(logger: logging.Logger, what: str) -> Callable[[asyncio.Task[Any]], None]:
    """A done-callback that logs, with its traceback, the exception a background task died of.

    A task that fails is only noticed when someone awaits it; a background task (rotation, health
    checks, reloads) may never be awaited, so its bug would otherwise be silent until its effect shows.
    """

    def done(task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("%s failed", what, exc_info=task.exception())

    return done
