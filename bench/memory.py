"""Where a process's resident memory goes, read from ``/proc/<pid>/smaps``: by mapping, in MB.

    python -m bench.memory <pid>

File-backed pages are grouped by the file (``_cython grpc``, ``_rust`` of cryptography, libpython,
...), anonymous ones by kind: the Python heap (``[heap]`` and anonymous mappings next to it, where
pymalloc's arenas and glibc's main arena live), thread stacks (the mappings the kernel tags as
stacks, plus the guard-page-sized anonymous mappings of pthread stacks), and other anonymous
mappings (glibc's per-thread arenas, gRPC's and the allocator's large blocks). RSS counts every
resident page; PSS divides shared pages among the processes sharing them; anonymous memory is
what the process alone costs and what the kernel cannot just drop.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

KB_PER_MB = 1024


@dataclass
class Usage:
    rss_kb: int = 0
    pss_kb: int = 0
    anon_kb: int = 0

    def add(self, other: Usage) -> None:
        self.rss_kb += other.rss_kb
        self.pss_kb += other.pss_kb
        self.anon_kb += other.anon_kb


@dataclass
class Breakdown:
    total: Usage = field(default_factory=Usage)
    by_mapping: dict[str, Usage] = field(default_factory=lambda: defaultdict(Usage))


def _label(path: str, previous: str) -> str:
    if not path:
        return "anonymous (arenas, allocator blocks)"
    if path == "[heap]":
        return "[heap] (glibc main arena, pymalloc)"
    if path.startswith("[stack"):
        return "thread stacks"
    if path.startswith("["):
        return path
    name = Path(path.split(" (deleted)")[0]).name
    for prefix, label in (
        ("cygrpc", "grpc (cygrpc .so)"),
        ("_rust", "cryptography (_rust .so)"),
        ("libpython", "libpython"),
        ("python3", "python executable"),
        ("libcrypto", "libcrypto (Python's ssl)"),
        ("libssl", "libssl (Python's ssl)"),
        ("_message", "protobuf (upb _message .so)"),
        ("loop.", "uvloop"),
        ("libc.", "libc"),
        ("libm.", "libm"),
    ):
        if name.startswith(prefix):
            return label
    if name.endswith(".so") or ".so." in name:
        return "other shared libraries"
    return "other files"


def breakdown(pid: int) -> Breakdown:
    """Resident memory of ``pid`` by mapping, from its smaps."""
    result = Breakdown()
    current: Usage | None = None
    label = ""
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if not fields:
            continue
        if not fields[0].endswith(":") or "-" in fields[0]:  # a mapping's header line
            path = " ".join(fields[5:]) if len(fields) > 5 else ""
            label = _label(path, label)
            current = result.by_mapping[label]
            continue
        key, value = fields[0][:-1], fields[1] if len(fields) > 1 else "0"
        if current is None or not value.isdigit():
            continue
        if key == "Rss":
            current.rss_kb += int(value)
            result.total.rss_kb += int(value)
        elif key == "Pss":
            current.pss_kb += int(value)
            result.total.pss_kb += int(value)
        elif key == "Anonymous":
            current.anon_kb += int(value)
            result.total.anon_kb += int(value)
    return result


def table(parts: Breakdown, *, top: int = 12) -> str:
    rows = sorted(parts.by_mapping.items(), key=lambda item: -item[1].rss_kb)
    lines = [
        f"| {'mapping':<40} | {'RSS':>6} | {'PSS':>6} | {'anon':>6} |",
        f"|{'-' * 42}|{'-' * 8}|{'-' * 8}|{'-' * 8}|",
    ]
    shown = rows[:top]
    rest = Usage()
    for _, usage in rows[top:]:
        rest.add(usage)
    for label, usage in [*shown, *([("everything else", rest)] if rows[top:] else [])]:
        lines.append(
            f"| {label:<40} | {usage.rss_kb / KB_PER_MB:6.1f} | {usage.pss_kb / KB_PER_MB:6.1f} "
            f"| {usage.anon_kb / KB_PER_MB:6.1f} |"
        )
    total = parts.total
    lines.append(
        f"| {'total':<40} | {total.rss_kb / KB_PER_MB:6.1f} | {total.pss_kb / KB_PER_MB:6.1f} "
        f"| {total.anon_kb / KB_PER_MB:6.1f} |"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(breakdown(int(sys.argv[1])), top=30))
