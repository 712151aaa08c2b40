"""``/debug/secrets``: what the agent holds, for ``agentctl proxy-config secret --diff``.

Istio's agent lost this view in 1.7 (with the node agent's debug endpoint), so operators compare
Envoy's config dump with md5 sums of the cert files by hand after a rotation. This view gives the
other side of that comparison: for each secret the agent holds, and for each certificate file it
reads or writes (OUTPUT_CERTS, mounted certificates), the certificates' public facts and
fingerprints. Never key material: key files are not even opened.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from istio_agent.config.security import CERT_CHAIN_FILE, ROOT_CERT_FILE
from istio_agent.pem import CertificateSummary, PemError, parse_certificates, rfc3339
from istio_agent.security.manager import SecretManager
from istio_agent.security.model import ROOT_CERT, WORKLOAD_KEY_CERT

MAX_FILE = 1024 * 1024
"""A certificate file bigger than this is reported, not read (a bundle of every public CA is ~250 KiB)."""


def _certificates(data: bytes) -> dict[str, Any]:
    """The fingerprints of ``data`` (exact bytes) and a summary of each certificate in it."""
    facts: dict[str, Any] = {
        "sha256": hashlib.sha256(data).hexdigest(),
        "md5": hashlib.md5(data, usedforsecurity=False).hexdigest(),
    }
    try:
        facts["certificates"] = [CertificateSummary.of(c).as_json() for c in parse_certificates(data)]
    except PemError as err:
        facts["error"] = str(err)
    return facts


def _file(resource_name: str, path: Path) -> dict[str, Any]:
    entry: dict[str, Any] = {"resource_name": resource_name, "path": str(path)}
    try:
        if path.stat().st_size > MAX_FILE:
            return {**entry, "error": f"larger than {MAX_FILE} bytes, not read"}
        data = path.read_bytes()
    except OSError as err:
        return {**entry, "error": (err.strerror or str(err)).lower()}
    return {**entry, **_certificates(data)}


def certificate_files(manager: SecretManager) -> list[tuple[str, Path]]:
    """(resource name, path) of every certificate file behind what the agent holds or writes."""
    files: list[tuple[str, Path]] = []
    output = manager.output_dir
    if output is not None:
        files += [(WORKLOAD_KEY_CERT, output / CERT_CHAIN_FILE), (ROOT_CERT, output / ROOT_CERT_FILE)]
    for held in manager.held():
        if held.source is not None and (held.resource_name, held.source) not in files:
            files.append((held.resource_name, held.source))
    return files


def secrets_view(manager: SecretManager) -> dict[str, Any]:
    """The JSON document ``GET /debug/secrets`` answers."""
    secrets = [
        {
            "resource_name": held.resource_name,
            "kind": "root" if held.is_root else "cert_chain",
            "source": str(held.source) if held.source is not None else "ca",
            "since": rfc3339(held.since),
            **_certificates(held.certificates),
        }
        for held in manager.held()
    ]
    return {"secrets": secrets, "files": [_file(name, path) for name, path in certificate_files(manager)]}
