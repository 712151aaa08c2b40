"""Typed access to environment variables, with errors that name the variable.

Istio's agent silently falls back to the default when a variable does not parse; we refuse to
start instead, naming the variable and the value, because a mistyped TTL or ratio otherwise shows
up hours later as a confusing rotation bug.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import TypeVar

from istio_agent import goformat

T = TypeVar("T")


class ConfigError(ValueError):
    """An invalid setting; the message names the variable or field."""


_TRUE = {"1", "t", "T", "TRUE", "true", "True"}
_FALSE = {"0", "f", "F", "FALSE", "false", "False"}
_NANOSECONDS = {
    "ns": 1,
    "us": 1_000,
    "µs": 1_000,  # U+00B5 micro sign
    "μs": 1_000,  # U+03BC Greek mu
    "ms": 1_000_000,
    "s": 1_000_000_000,
    "m": 60_000_000_000,
    "h": 3_600_000_000_000,
}
_NUMBER = re.compile(r"([0-9]*)(?:\.([0-9]*))?")
_UNIT = re.compile(r"[^0-9.]*")
_GO_INT = re.compile(r"[+-]?[0-9]+")
_MAX_NANOSECONDS = 2**63 - 1
MAX_DURATION = timedelta(microseconds=_MAX_NANOSECONDS // 1000)
"""Go's largest ``time.Duration`` (about 292 years), to the microsecond: no Go setting can be longer."""
INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1


def parse_go_duration(text: str) -> timedelta:
    """Parse a Go duration (``24h``, ``1h30m``, ``100ms``, ``-1.5s``, ``0``) as Go's time.ParseDuration does.

    Values beyond Go's range (about ±292 years) are refused with Go's own message, never an
    OverflowError: the agent refuses what Istio's agent could not have read either.
    """
    value = text.strip()
    quoted = f'"{value}"'
    sign, rest = 1, value
    if rest[:1] in ("+", "-"):
        sign, rest = (-1 if rest[0] == "-" else 1), rest[1:]
    if rest == "0":
        return timedelta(0)
    if not rest:
        raise ValueError(f"time: invalid duration {quoted}")
    total = 0
    pos = 0
    while pos < len(rest):
        number = _NUMBER.match(rest, pos)
        assert number is not None  # both groups may match nothing
        whole, fraction = number.group(1), number.group(2) or ""
        if not whole and not fraction:
            raise ValueError(f"time: invalid duration {quoted}")
        unit = _UNIT.match(rest, number.end())
        assert unit is not None
        name = unit.group()
        if not name:
            raise ValueError(f"time: missing unit in duration {quoted}")
        if name not in _NANOSECONDS:
            raise ValueError(f'time: unknown unit "{name}" in duration {quoted}')
        scale = _NANOSECONDS[name]
        if len(whole.lstrip("0")) > 19:  # more digits than any int64 has: overflow, as Go reports it
            raise ValueError(f"time: invalid duration {quoted}")
        digits = fraction[:20]  # digits past the 20th cannot change a nanosecond count
        total += int(whole or "0") * scale + (int(digits) * scale // 10 ** len(digits) if digits else 0)
        if total > _MAX_NANOSECONDS + (sign < 0):  # Go's range: -2**63 .. 2**63-1 nanoseconds
            raise ValueError(f"time: invalid duration {quoted}")
        pos = unit.end()
    return timedelta(microseconds=sign * (total // 1000))


def parse_go_int(text: str) -> int:
    """A decimal integer as Go's strconv.Atoi reads it (no ``_``, no spaces inside, within int64)."""
    value = text.strip()
    if not _GO_INT.fullmatch(value):
        raise ValueError(f'strconv.Atoi: parsing "{value}": invalid syntax')
    number = int(value)
    if not -INT64_MAX - 1 <= number <= INT64_MAX:
        raise ValueError(f'strconv.Atoi: parsing "{value}": value out of range')
    return number


def parse_number(text: str) -> float:
    """A finite decimal number (``0.5``, ``1e-3``); NaN and infinities are refused."""
    number = float(text.strip())
    if not math.isfinite(number):
        raise ValueError(f"{text.strip()!r} is not a finite number")
    return number


Bound = TypeVar("Bound", int, float, timedelta)


def out_of_range(
    value: Bound, minimum: Bound | None, maximum: Bound | None, show: Callable[[Bound], str] = str
) -> str | None:
    """Why ``value`` is outside ``minimum..maximum`` (inclusive; None is unbounded), or None when inside.

    The one bounds check of every numeric setting, env var or document field alike, so each says
    the same thing: ``must be between 2048 and 8192``, ``must be at least 1s``, ``must be at most 10``.
    """
    if (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
        return None
    if minimum is not None and maximum is not None:
        return f"must be between {show(minimum)} and {show(maximum)}"
    if minimum is not None:
        return f"must be at least {show(minimum)}"
    assert maximum is not None
    return f"must be at most {show(maximum)}"


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

    def _parse(
        self,
        name: str,
        default: T,
        parse: Callable[[str], T],
        check: Callable[[T], str | None] = lambda _value: None,
    ) -> T:
        """The variable parsed and checked; unset or empty is ``default`` (not checked: it is ours)."""
        raw = self._environ.get(name)
        if raw is None or raw == "":
            return default
        try:
            value = parse(raw)
        except ValueError as err:
            raise ConfigError(f"invalid value for {name}={raw!r}: {err}") from None
        problem = check(value)
        if problem is not None:
            raise ConfigError(f"invalid value for {name}={raw!r}: {problem}")
        return value

    def flag(self, name: str, default: bool = False) -> bool:
        return self._parse(name, default, parse_go_bool)

    def integer(
        self, name: str, default: int, *, minimum: int | None = None, maximum: int | None = None
    ) -> int:
        """A decimal integer within ``minimum..maximum`` (inclusive)."""
        return self._parse(name, default, parse_go_int, lambda value: out_of_range(value, minimum, maximum))

    def number(
        self, name: str, default: float, *, minimum: float | None = None, maximum: float | None = None
    ) -> float:
        """A finite number within ``minimum..maximum`` (inclusive)."""
        return self._parse(
            name, default, parse_number, lambda value: out_of_range(value, minimum, maximum, _show_number)
        )

    def duration(
        self,
        name: str,
        default: timedelta,
        *,
        minimum: timedelta | None = None,
        maximum: timedelta | None = None,
    ) -> timedelta:
        """A Go duration within ``minimum..maximum`` (inclusive); Go's range bounds every duration."""
        return self._parse(
            name,
            default,
            parse_go_duration,
            lambda value: out_of_range(value, minimum, maximum, goformat.duration),
        )

    def with_prefix(self, prefix: str) -> dict[str, str]:
        """Variables named ``<prefix><NAME>``, keyed by ``NAME`` (used for CA_HEADER_*, XDS_HEADER_*)."""
        return {key[len(prefix) :]: value for key, value in self._environ.items() if key.startswith(prefix)}


def _show_number(value: float) -> str:
    return f"{value:g}"
