"""How Go prints the values that appear in Istio's log lines and error messages.

Operators grep for Istio's wording (``exit status 1``, ``signal: killed``, ``code = Unavailable``,
``1.5s``), so the agent renders these values the way the Go agent's standard library does.
"""

from __future__ import annotations

import enum
import signal
from datetime import timedelta


def exit_text(returncode: int) -> str:
    """Go's ``*exec.ExitError`` text: ``exit status 1``, or ``signal: killed`` for a negative code."""
    if returncode >= 0:
        return f"exit status {returncode}"
    number = -returncode
    try:
        name = signal.strsignal(number) or f"signal {number}"
    except ValueError:
        name = f"signal {number}"
    return f"signal: {name.lower()}"  # glibc's descriptions, lower-cased, are Go's signal names


def status_code_name(code: enum.Enum) -> str:
    """grpc-go's name of a status code: ``Unavailable``, ``NotFound``, ``Canceled`` (Go's spelling)."""
    if code.name == "CANCELLED":
        return "Canceled"
    if code.name == "OK":
        return "OK"
    return "".join(part.capitalize() for part in code.name.split("_"))


def duration(value: float | timedelta) -> str:
    """Go's ``time.Duration`` text: ``0s``, ``100ms``, ``2.5ms``, ``1.5s``, ``1m30s``, ``596h31m23.647s``.

    Seconds (a float) or a timedelta; shown to the microsecond (below a second, to 3 decimals of ms).
    """
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if seconds == 0:
        return "0s"
    sign = "-" if seconds < 0 else ""
    seconds = abs(seconds)
    if seconds < 1:
        return sign + f"{seconds * 1000:.3f}".rstrip("0").rstrip(".") + "ms"
    micros = round(seconds * 1_000_000) if not isinstance(value, timedelta) else abs(value) // _MICROSECOND
    hours, micros = divmod(micros, 3_600_000_000)
    minutes, micros = divmod(micros, 60_000_000)
    whole, fraction = divmod(micros, 1_000_000)
    text = f"{whole}.{fraction:06d}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{sign}{hours}h{minutes}m{text}"
    if minutes:
        return f"{sign}{minutes}m{text}"
    return sign + text


_MICROSECOND = timedelta(microseconds=1)
