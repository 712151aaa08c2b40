"""Copying the plugin's binaries to the host's CNI bin directories, so the container runtime can exec them.

Istio: ``cni/pkg/install/binaries.go``. Every regular file of the source directory is copied to
each target directory atomically (a runtime exec'ing the plugin mid-copy sees the old file or the
new one). Temporary files a killed copy left behind are removed first: Istio's ``<name>.tmp.*`` and
ours (``files.write_atomic``: ``.<name>.<random>.tmp``).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from istio_agent.files import write_atomic
from istio_agent.log import scope

log = scope("cni-agent")


class CopyError(Exception):
    """A binary could not be copied; the message names it and, when the host is read-only, says so."""


def copy_binaries(source: Path, targets: tuple[Path, ...], written: set[Path] | None = None) -> set[str]:
    """Copy every regular file of ``source`` into each writable target; returns the names copied.

    Each destination is added to ``written`` as soon as it is in place, even when a later copy
    fails: cleanup removes only what this process installed, never another install-cni's files.
    """
    try:
        files = sorted(p for p in source.iterdir() if p.is_file())
    except OSError as err:
        raise CopyError(f"cannot list the plugin binaries in {source}: {err.strerror}") from None
    if not files:
        log.warning("no plugin binaries to copy in %s", source)
    copied: set[str] = set()
    for target in targets:
        if not os.access(target, os.W_OK):
            log.info("directory %s is not writable, skipping", target)
            continue
        for file in files:
            remove_stale_temporaries(target, file.name)
            _copy(file, target / file.name)
            if written is not None:
                written.add(target / file.name)
            copied.add(file.name)
            log.info("Copied %s to %s", file.name, target)
    return copied


def _copy(source: Path, destination: Path) -> None:
    try:
        data = source.read_bytes()
        mode = stat.S_IMODE(source.stat().st_mode)
        write_atomic(destination, data, mode)
    except OSError as err:
        hint = ""
        if "read-only file system" in str(err).lower():
            hint = " (the host's CNI bin directory is read-only: set the CNI bin directory to a writable one)"
        raise CopyError(f"cannot copy {source} to {destination}: {err.strerror}{hint}") from None


def remove_stale_temporaries(directory: Path, name: str) -> None:
    """Remove temporary copies of ``name`` left in ``directory`` by an interrupted copy."""
    for pattern in (f"{name}.tmp.*", f".{name}.*.tmp"):
        for leftover in directory.glob(pattern):
            try:
                leftover.unlink()
            except FileNotFoundError:
                continue
            except OSError as err:
                log.warning("cannot remove the stale temporary file %s: %s", leftover, err.strerror)


def remove_binary(targets: tuple[Path, ...], name: str) -> None:
    """Remove ``name`` from every target directory (cleanup on exit); a missing file is fine."""
    for target in targets:
        try:
            (target / name).unlink()
            log.info("removed %s", target / name)
        except FileNotFoundError:
            continue
        except OSError as err:
            log.warning("cannot remove %s: %s", target / name, err.strerror)
