"""Looking at other processes from a test, through /proc (no psutil)."""

from __future__ import annotations

from pathlib import Path


def running(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (dead, not yet reaped by its new parent) does not count."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")
