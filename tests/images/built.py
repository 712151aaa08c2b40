"""The images ``make images`` builds (packaging/images/), as the tests get them: archive, config, root.

A test that runs what ships takes the image's root file system from here: unpacked from the archive
by :mod:`tests.images.oci` once per archive content (its manifest digest), under
``build/images/roots/``, shared by the test processes (a lock file serialises the unpacking).

    reason = unavailable("install-cni")      # None, or why the image cannot be had here
    root = image_root("install-cni")         # e.g. root / "opt/cni/bin/istio-cni"
    env = image("install-cni").env()         # its ENV
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

from tests.images.oci import OciImage, read, unpack

ROOT = Path(__file__).resolve().parents[2]
IMAGES_DIR = ROOT / "build" / "images"
ROOTS_DIR = IMAGES_DIR / "roots"
NAMES = ("proxyv2", "install-cni")


def archive(name: str) -> Path:
    """The image's OCI archive (``make images``)."""
    if name not in NAMES:
        raise ValueError(f"no image {name!r}: {', '.join(NAMES)}")
    return IMAGES_DIR / f"{name}.tar"


def unavailable(name: str) -> str | None:
    """Why the image's root cannot be had here (None: it can)."""
    if os.geteuid() != 0:
        return "an image's root file system needs root (its files' owners); CI runs as root"
    if not archive(name).is_file():
        return (
            f"{archive(name)} is missing: build it with `make images` (`make test` does as root; it needs "
            "Debian's mmdebstrap and buildah, which `make` installs)"
        )
    return None


def image(name: str) -> OciImage:
    """The image's manifest and config, read from its archive."""
    return read(archive(name))


def image_root(name: str) -> Path:
    """The image's root file system, unpacked from its archive (once per archive content).

    The directory is shared: use it read-only (bind-mount it read-only, or as an overlay's lower layer).
    """
    source = archive(name)
    digest = image(name).digest.removeprefix("sha256:")[:16]
    root = ROOTS_DIR / f"{name}-{digest}"
    ROOTS_DIR.mkdir(parents=True, exist_ok=True)
    with (ROOTS_DIR / f".{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if root.is_dir():  # renamed into place once whole
            return root
        for stale in ROOTS_DIR.glob(f"{name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=ROOTS_DIR))
        try:
            unpack(source, work / "root")
            (work / "root").rename(root)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return root
