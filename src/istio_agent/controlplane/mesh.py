"""The local control plane's mesh file: a small YAML document describing the mesh.

Only ``trustDomain`` is interpreted here. The rest (``services``, ``workloads``, ``nameTable``, ...)
is kept verbatim in ``raw`` for the ADS side, so one file drives the whole control plane.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

DEFAULT_TRUST_DOMAIN = "cluster.local"
# SPIFFE trust domain names: lower-case letters, digits, '.', '-' and '_'.
_TRUST_DOMAIN = re.compile(r"^[a-z0-9._-]{1,255}$")


class MeshError(Exception):
    """The mesh file cannot be used; the message names the file and the problem."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"mesh file {path}: {reason}")
        self.path = path
        self.reason = reason


@dataclass(frozen=True)
class MeshConfig:
    """The parsed mesh file; ``raw`` is the whole document as loaded (do not mutate it)."""

    trust_domain: str = DEFAULT_TRUST_DOMAIN
    raw: dict[str, Any] = field(default_factory=dict)


def load_mesh(path: Path) -> MeshConfig:
    """Read and validate the mesh file at ``path``; MeshError when it is missing or invalid."""
    return parse_mesh(read_mesh_bytes(path), path)


def read_mesh_bytes(path: Path) -> bytes:
    """The raw mesh file; MeshError when it cannot be read."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise MeshError(path, "file does not exist") from None
    except OSError as err:
        raise MeshError(path, f"cannot read: {err.strerror or err}") from None


def parse_mesh(data: bytes | str, path: Path) -> MeshConfig:
    """Parse mesh-file content; ``path`` only names the source in errors.

    An empty file is an error rather than "all defaults": an editor truncating the file before
    writing it must not flip a running control plane to the default trust domain. Write ``{}``.
    """
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as err:
        raise MeshError(path, f"not UTF-8 text (byte {err.start})") from None
    if not text.strip():
        raise MeshError(path, "file is empty (write {} for an all-defaults mesh)")
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or "invalid YAML"
        raise MeshError(path, f"invalid YAML{where}: {problem}") from None
    if document is None:
        document = {}
    if not isinstance(document, dict):
        raise MeshError(path, f"the document must be a mapping, not {type(document).__name__}")
    trust_domain = document.get("trustDomain", DEFAULT_TRUST_DOMAIN)
    if not isinstance(trust_domain, str) or not _TRUST_DOMAIN.match(trust_domain):
        raise MeshError(
            path,
            f"trustDomain {trust_domain!r} is not a valid trust domain "
            "(use lower-case letters, digits, '.', '-' and '_')",
        )
    return MeshConfig(trust_domain=trust_domain, raw=document)
