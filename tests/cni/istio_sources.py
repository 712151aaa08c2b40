"""Istio's own test files, kept verbatim, and the manifest that says where each one comes from.

A golden directory holds an ``ISTIO_SOURCES`` manifest: comment lines naming Istio's commit, then one
line per file, ``<our file> <Istio's path> <git blob id of that file at the commit>``. The blob id
lets anyone with Istio's repository check a copy (``git -C istio rev-parse <commit>:<path>``), and
lets a test check that the copy still has exactly those bytes: a golden that drifts from Istio's
file (edited by hand, or rewritten from our own output) fails.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "ISTIO_SOURCES"
ISTIO_COMMIT = "ff49c1889ebad8d444b8f82425a2fd326c039e54"
"""Istio's tag 1.28.10, the version this project behaves as."""


@dataclass(frozen=True)
class IstioFile:
    """One verbatim copy: our file name, Istio's path, and the git blob id Istio's repository has for it."""

    name: str
    istio_path: str
    blob: str


def blob_id(data: bytes) -> str:
    """The git blob id of ``data`` (what ``git hash-object`` prints)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def manifest(directory: Path) -> dict[str, IstioFile]:
    """The copies listed in ``directory/ISTIO_SOURCES``, by our file name."""
    files: dict[str, IstioFile] = {}
    for number, line in enumerate((directory / MANIFEST).read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) != 3:
            raise ValueError(f"{directory / MANIFEST}:{number}: expected '<file> <istio path> <blob id>'")
        files[fields[0]] = IstioFile(*fields)
    return files


def drifted(directory: Path) -> dict[str, str]:
    """The listed copies whose bytes are not Istio's any more (or that are missing), with why."""
    problems: dict[str, str] = {}
    for name, source in manifest(directory).items():
        path = directory / name
        if not path.is_file():
            problems[name] = "missing"
        elif (actual := blob_id(path.read_bytes())) != source.blob:
            problems[name] = f"blob {actual}, Istio's {source.istio_path} is {source.blob}"
    return problems
