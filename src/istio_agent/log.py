"""Logging in Istio's format: ``<RFC3339 µs>Z<TAB>level<TAB>scope<TAB>message``.

Every subsystem logs through a *scope* (``sds``, ``cache``, ``ca``, ...), as Istio does, so
``--log_output_level sds:debug,default:info`` works the same way. Scope loggers are ordinary
``logging`` loggers named ``istio.<scope>``.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:  # only for an annotation: short-lived processes (the CNI plugin) log without asyncio
    import asyncio

ROOT = "istio"
DEFAULT_SCOPE = "default"
DEFAULT_OUTPUT_LEVELS = "default:info,grpc:none"

# Istio level names -> logging levels. "none" silences a scope entirely.
_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "fatal": logging.CRITICAL,
    "none": logging.CRITICAL + 10,
}
_NAMES = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warn", logging.ERROR: "error"}


def scope(name: str) -> logging.Logger:
    """The logger of an Istio log scope."""
    return logging.getLogger(f"{ROOT}.{name}")


def _scope_of(record: logging.LogRecord) -> str:
    if record.name == ROOT:
        return DEFAULT_SCOPE
    if record.name.startswith(ROOT + "."):
        return record.name[len(ROOT) + 1 :]
    return record.name


def _timestamp(record: logging.LogRecord) -> str:
    return datetime.fromtimestamp(record.created, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _level(record: logging.LogRecord) -> str:
    return _NAMES.get(record.levelno, "fatal" if record.levelno >= logging.CRITICAL else "info")


class IstioFormatter(logging.Formatter):
    """Istio's console encoding: tab-separated time, level, scope and message."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        return f"{_timestamp(record)}\t{_level(record)}\t{_scope_of(record)}\t{message}"


class JsonFormatter(logging.Formatter):
    """Istio's ``--log_as_json`` encoding: one JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": _timestamp(record),
            "level": _level(record),
            "scope": _scope_of(record),
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def parse_output_levels(spec: str) -> dict[str, int]:
    """Parse ``scope:level,...`` (a bare level applies to ``default``); raise ValueError when invalid."""
    levels: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, level = item.rpartition(":")
        name = name or DEFAULT_SCOPE
        if level.lower() not in _LEVELS:
            raise ValueError(
                f"invalid log level {level!r} for scope {name!r}; use one of {', '.join(_LEVELS)}"
            )
        levels[name] = _LEVELS[level.lower()]
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
