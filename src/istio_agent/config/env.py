"""Typed access to environment variables, with errors that name the variable.

Istio's agent silently falls back to the default when a variable does not parse; we refuse to
start instead, naming the variable and the value, because a mistyped TTL or ratio otherwise shows
up hours later as a confusing rotation bug.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """An invalid setting; the message names the variable or field."""


_TRUE = {"1", "t", "T", "TRUE", "true", "True"}
_FALSE = {"0", "f", "F", "FALSE", "false", "False"}
_DURATION_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "μs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


def parse_go_duration(text: str) -> timedelta:
    """Parse a Go duration string (``24h``, ``1h30m``, ``100ms``, ``-1.5s``, ``0``)."""
    value = text.strip()
    sign = 1.0
    if value[:1] in "+-" and value:
        sign = -1.0 if value[0] == "-" else 1.0
        value = value[1:]
    if value == "0":
        return timedelta(0)
    if not value:
        raise ValueError(f"invalid duration {text!r}")
    seconds = 0.0
    pos = 0
    while pos < len(value):
        match = _DURATION_PART.match(value, pos)
        if not match:
            raise ValueError(f"invalid duration {text!r} (expected e.g. 24h, 90m, 1.5s, 100ms)")
        seconds += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        pos = match.end()
    return timedelta(seconds=sign * seconds)


def parse_go_bool(text: str) -> bool:
    """Parse a boolean the way Go's strconv.ParseBool does."""
    value = text.strip()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"invalid boolean {text!r} (expected true or false)")


class Env:
    """Typed reads from an environment mapping (``os.environ`` by default)."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._environ = os.environ if environ is None else environ

    def __contains__(self, name: str) -> bool:
        return name in self._environ

    def text(self, name: str, default: str = "") -> str:
        return self._environ.get(name, default)

    def _parse(self, name: str, default: T, parse: Callable[[str], T]) -> T:
        raw = self._environ.get(name)
        if raw is None or raw == "":
            return default
        try:
            return parse(raw)
        except ValueError as err:
            raise ConfigError(f"invalid value for {name}={raw!r}: {err}") from None

    def flag(self, name: str, default: bool = False) -> bool:
        return self._parse(name, default, parse_go_bool)

    def integer(self, name: str, default: int) -> int:
        return self._parse(name, default, int)

    def number(self, name: str, default: float) -> float:
        return self._parse(name, default, float)

    def duration(self, name: str, default: timedelta) -> timedelta:
        return self._parse(name, default, parse_go_duration)

    def with_prefix(self, prefix: str) -> dict[str, str]:
        """Variables named ``<prefix><NAME>``, keyed by ``NAME`` (used for CA_HEADER_*, XDS_HEADER_*)."""
        return {key[len(prefix) :]: value for key, value in self._environ.items() if key.startswith(prefix)}
