"""How Go prints the values that appear in Istio's log lines and error messages.

Operators grep for Istio's wording (``exit status 1``, ``signal: killed``, ``code = Unavailable``,
``1.5s``), so the agent renders these values the way the Go agent's standard library does.
"""

from __future__ import annotations

import enum
import json
import math
import signal
from datetime import timedelta
from typing import Any


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


_QUOTE_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\a": "\\a",
    "\b": "\\b",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
    "\v": "\\v",
}


def go_quote(text: str) -> str:
    """Go's ``%q`` of a string (``strconv.Quote``): printable characters as they are, the rest escaped."""
    out = ['"']
    for char in text:
        code = ord(char)
        if char in _QUOTE_ESCAPES:
            out.append(_QUOTE_ESCAPES[char])
        elif char.isprintable():
            out.append(char)
        elif code < 0x80:
            out.append(f"\\x{code:02x}")
        elif code < 0x10000:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)


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
    that column, each cell padded to the block's widest cell plus ``padding``, empty ones included:
    a line whose last cell is empty ends in the padding of the cell before it, as istioctl's tables
    do (its golden outputs keep those trailing spaces).
    """
    widths: list[int] = []
    out: list[str] = []

    def write_lines(start: int, end: int) -> None:
        for line in lines[start:end]:
            text = "".join(
                cell.ljust(widths[j]) if j < len(widths) and j < len(line) - 1 else cell
                for j, cell in enumerate(line)
            )
            out.append(text + "\n")

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


_JSON_ESCAPES = (
    ("<", "\\u003c"),
    (">", "\\u003e"),
    ("&", "\\u0026"),
    ("\u2028", "\\u2028"),
    ("\u2029", "\\u2029"),
)
"""What Go's ``encoding/json`` escapes beyond JSON's rules (HTML-safe output); other non-ASCII is written raw."""


def json_marshal(value: Any, indent: str = "  ", *, sort_keys: bool = False) -> str:
    """Go's ``json.MarshalIndent(value, "", indent)``, without a final newline.

    Strings are written as Go writes them (UTF-8 as is, ``<``, ``>``, ``&``, U+2028 and U+2029
    escaped). ``sort_keys`` gives a Go map's order (a struct keeps its field order, as a dict here
    does). A float is written as Go writes a float64 (``1500``, not ``1500.0``; ``1e+21``; ``1e-7``),
    so a document read into floats and written again is what a Go program would write.
    """
    text = _json(value, indent, "\n", sort_keys)
    for char, escape in _JSON_ESCAPES:
        text = text.replace(char, escape)
    return text


def _json(value: Any, indent: str, newline: str, sort_keys: bool) -> str:
    inner = newline + indent
    if isinstance(value, dict):
        if not value:
            return "{}"
        keys = sorted(value) if sort_keys else list(value)
        items = [
            f"{json.dumps(str(k), ensure_ascii=False)}: {_json(value[k], indent, inner, sort_keys)}"
            for k in keys
        ]
        return "{" + inner + ("," + inner).join(items) + newline + "}"
    if isinstance(value, (list, tuple)):
        if not value:
            return "[]"
        items = [_json(item, indent, inner, sort_keys) for item in value]
        return "[" + inner + ("," + inner).join(items) + newline + "]"
    if isinstance(value, float):
        return go_float(value)
    return json.dumps(value, ensure_ascii=False)


def go_float(value: float) -> str:
    """A float64 as Go's ``encoding/json`` writes it: shortest round-trip digits, exponent only outside 1e-6..1e21."""
    if not math.isfinite(value):
        raise ValueError(f"json: unsupported value: {value!r}")
    magnitude = abs(value)
    if magnitude != 0 and (magnitude < 1e-6 or magnitude >= 1e21):
        text = repr(value)  # shortest digits, exponent with a sign and at least two digits (as Go's)
        mantissa, _, exponent = text.partition("e")
        if exponent[:2] == "-0":  # Go writes e-07 as e-7 (but keeps e+21)
            exponent = "-" + exponent[2:]
        return f"{mantissa.removesuffix('.0')}e{exponent}"
    from decimal import Decimal  # here, not at the top: only this rare case needs it (~0.3 MB)

    text = format(Decimal(repr(value)), "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text
