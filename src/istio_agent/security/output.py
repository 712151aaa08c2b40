"""OUTPUT_CERTS: write the workload key, chain and root to a directory for non-Envoy consumers."""

from __future__ import annotations

import os
from pathlib import Path

from istio_agent.config.security import CERT_CHAIN_FILE, KEY_FILE, ROOT_CERT_FILE
from istio_agent.files import write_atomic
from istio_agent.log import scope
from istio_agent.security.model import SecretItem

PRIVATE_MODE = 0o600
WORLD_READABLE_MODE = 0o644
DIRECTORY_MODE = 0o755


def _current(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def check_writable(directory: Path) -> None:
    """Create ``directory`` if needed and prove a file can be written in it; raises OSError when not.

    Checked at start-up so a read-only or missing volume is a clear error naming the path, not a
    proxyless app that waits forever for certificates (Istio only logs each failed write).
    """
    directory.mkdir(mode=DIRECTORY_MODE, parents=True, exist_ok=True)
    probe = directory / f".write-check-{os.urandom(6).hex()}"
    os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, PRIVATE_MODE))
    probe.unlink()


def write_output_certs(directory: Path, item: SecretItem, world_readable: bool = False) -> list[str]:
    """Write the item's key, chain and root under ``directory``; return the names of the files written.

    Files whose content is unchanged are left alone, so watchers of the directory only see real
    changes. Raises OSError when the directory or a file cannot be written.
    """
    files = (
        (KEY_FILE, item.private_key),
        (CERT_CHAIN_FILE, item.certificate_chain),
        (ROOT_CERT_FILE, item.root_cert),
    )
    if not any(data for _, data in files):
        scope("cache").error("no certificates to write to %s for resource %s", directory, item.resource_name)
        return []
    directory.mkdir(mode=DIRECTORY_MODE, parents=True, exist_ok=True)
    mode = WORLD_READABLE_MODE if world_readable else PRIVATE_MODE
    written = []
    for name, data in files:
        if not data or _current(directory / name) == data:
            continue
        write_atomic(directory / name, data, mode)
        written.append(name)
    return written
