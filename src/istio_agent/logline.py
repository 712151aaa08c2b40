"""Istio's log line, and scope loggers that do not need the ``logging`` package.

The one encoding of a log entry (Istio's console ``<RFC3339 µs>Z<TAB>level<TAB>scope<TAB>message``
and its ``--log_as_json`` object): :mod:`istio_agent.log`'s formatters use it, and so does the CNI
plugin, which writes its lines itself. The plugin is exec'd once per pod sandbox and logs about one
line per ADD; importing ``logging`` for that (with ``traceback``, ``threading``, ``string``...)
cost ~6 ms of an ADD whose goal is 50 ms (docs/performance.md, "CNI plugin ADD").

Code that runs both in the plugin and in the agent's processes logs through a :class:`Scope`. By
default a scope hands its entries to ``logging`` (the logger ``istio.<scope>``, imported on the
first entry), so the agent's handlers and per-scope levels apply as before; a short-lived process
calls :func:`write_lines` first, and its entries are written here, one line each.
"""

from __future__ import annotations

import json
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Protocol, TextIO

    class Sink(Protocol):
        def __call__(self, scope: str, level: int, message: str, args: tuple[object, ...]) -> None: ...


ROOT = "istio"
DEFAULT_SCOPE = "default"
DEBUG, INFO, WARNING, ERROR, CRITICAL = 10, 20, 30, 40, 50
"""The numbers ``logging`` gives its levels, so a scope's entry can be handed to it unchanged."""
NONE = CRITICAL + 10
"""Istio's "none": above every level, so nothing is written."""
LEVELS = {
    "debug": DEBUG,
    "info": INFO,
    "warn": WARNING,
    "warning": WARNING,
    "error": ERROR,
    "fatal": CRITICAL,
    "none": NONE,
}
"""Istio's level names (``--log_output_level``, ``plugin_log_level``) and their numbers."""
_NAMES = {DEBUG: "debug", INFO: "info", WARNING: "warn", ERROR: "error"}


def level_name(level: int) -> str:
    """The level as Istio's line names it."""
    return _NAMES.get(level, "fatal" if level >= CRITICAL else "info")


def parse_level(name: str) -> int:
    """An Istio level name (any case); ValueError naming the choices."""
    try:
        return LEVELS[name.lower()]
    except KeyError:
        raise ValueError(f"invalid log level {name!r}; use one of {', '.join(LEVELS)}") from None


def scope_name(logger: str) -> str:
    """The scope of a logger name: ``istio.sds`` is ``sds``, ``istio`` itself ``default``."""
    if logger == ROOT:
        return DEFAULT_SCOPE
    if logger.startswith(ROOT + "."):
        return logger[len(ROOT) + 1 :]
    return logger


def timestamp(created: float) -> str:
    """``created`` (seconds since the epoch) as Istio writes it: RFC 3339 in UTC with microseconds."""
    micros = round(created * 1_000_000)
    seconds, fraction = divmod(micros, 1_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{fraction:06d}Z"


def console_line(created: float, level: int, scope: str, message: str) -> str:
    """Istio's console encoding: tab-separated time, level, scope and message."""
    return f"{timestamp(created)}\t{level_name(level)}\t{scope}\t{message}"


def json_line(created: float, level: int, scope: str, message: str, error: str | None = None) -> str:
    """Istio's ``--log_as_json`` encoding: one JSON object (``error`` holds a traceback, when given)."""
    entry = {"time": timestamp(created), "level": level_name(level), "scope": scope, "msg": message}
    if error is not None:
        entry["error"] = error
    return json.dumps(entry)


class Scope:
    """The logger of an Istio log scope, for code that also runs in the CNI plugin's process.

    Messages take ``%`` arguments, as ``logging``'s do (formatted only when written).
    """

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def debug(self, message: str, *args: object) -> None:
        _sink(self.name, DEBUG, message, args)

    def info(self, message: str, *args: object) -> None:
        _sink(self.name, INFO, message, args)

    def warning(self, message: str, *args: object) -> None:
        _sink(self.name, WARNING, message, args)

    def error(self, message: str, *args: object) -> None:
        _sink(self.name, ERROR, message, args)


def _to_logging(scope: str, level: int, message: str, args: tuple[object, ...]) -> None:
    """The default sink: the entry goes to ``logging``'s ``istio.<scope>`` (the agent's processes)."""
    import logging

    logging.getLogger(f"{ROOT}.{scope}").log(level, message, *args)


class LineWriter:
    """A sink that writes each entry at or above ``level`` as one line on ``stream`` (stderr when None)."""

    __slots__ = ("as_json", "level", "stream")

    def __init__(self, level: int, *, as_json: bool, stream: TextIO | None = None) -> None:
        self.level = level
        self.as_json = as_json
        self.stream = stream

    def __call__(self, scope: str, level: int, message: str, args: tuple[object, ...]) -> None:
        if level < self.level:
            return
        text = message % args if args else message
        encode = json_line if self.as_json else console_line
        stream = self.stream if self.stream is not None else sys.stderr
        stream.write(encode(time.time(), level, scope, text) + "\n")
        stream.flush()


_sink: Sink = _to_logging


def write_lines(level: str, *, as_json: bool, stream: TextIO | None = None) -> None:
    """Every scope's entries at or above ``level`` (an Istio level name) written by this module from
    now on, instead of handed to ``logging``; ValueError for an unknown level (nothing changes)."""
    global _sink
    _sink = LineWriter(parse_level(level), as_json=as_json, stream=stream)


def hand_to_logging() -> None:
    """Back to the default: entries go to ``logging`` (tests that called :func:`write_lines`)."""
    global _sink
    _sink = _to_logging
