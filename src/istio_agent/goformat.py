"""How Go prints the values that appear in Istio's log lines and error messages.

Operators grep for Istio's wording (``exit status 1``, ``signal: killed``, ``code = Unavailable``,
``1.5s``), so the agent renders these values the way the Go agent's standard library does.
"""

from __future__ import annotations

import enum
import signal


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


def duration(seconds: float) -> str:
    """A short Go-style duration: ``0s``, ``1s``, ``1.5s``, ``100ms``, ``2.5ms``."""
    if seconds == 0:
        return "0s"
    if abs(seconds) < 1:
        return f"{seconds * 1000:.3f}".rstrip("0").rstrip(".") + "ms"
    return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"
