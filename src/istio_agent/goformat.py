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


def tabwrite(lines: list[list[str]], *, minwidth: int = 0, padding: int = 1) -> str:
    """Go's ``text/tabwriter`` with a space pad character and no flags, as istioctl prints tables.

    Each line is a list of cells; every cell but the last is tab-terminated, so the last one is
    not part of a column (Go's rule). Columns are aligned per block of consecutive lines that have
    that column, each cell padded to the block's widest cell plus ``padding``. Trailing spaces
    (from empty trailing cells) are dropped, as in istioctl's golden outputs.
    """
    widths: list[int] = []
    out: list[str] = []

    def write_lines(start: int, end: int) -> None:
        for line in lines[start:end]:
            text = "".join(
                cell.ljust(widths[j]) if j < len(widths) and j < len(line) - 1 else cell
                for j, cell in enumerate(line)
            )
            out.append(text.rstrip(" ") + "\n")

    def format_block(start: int, end: int) -> None:
        column = len(widths)
        this = start
        while this < end:
            if column >= len(lines[this]) - 1:
                this += 1
                continue
            write_lines(start, this)
            start = this
            width = minwidth
            while this < end and column < len(lines[this]) - 1:
                width = max(width, len(lines[this][column]) + padding)
                this += 1
            widths.append(width)
            format_block(start, this)
            widths.pop()
            start = this
        write_lines(start, end)

    format_block(0, len(lines))
    return "".join(out)
