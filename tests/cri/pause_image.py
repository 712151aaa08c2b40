"""The sandbox ("pause") image for the containerd tests, built here from Debian's busybox-static.

There is no registry to pull ``registry.k8s.io/pause`` from, so this writes an OCI image layout
archive (``oci-layout``, ``index.json``, ``blobs/sha256/…``: the image-spec's layout) that
``ctr images import`` takes. One uncompressed layer holds ``/bin/busybox`` (static: the image needs
no C library), ``/bin/sh`` and ``/bin/sleep`` as links to it, and ``/pause``, a shell script that
waits until it is stopped, as Kubernetes' pause does: SIGTERM or SIGINT ends it with status 0
(containerd stops a sandbox with SIGKILL anyway). Every tar header is fixed (owner 0, time 0), so two
builds give the same digests.
"""

from __future__ import annotations

import hashlib
import io
import json
import platform
import tarfile
from pathlib import Path
from typing import Any

BUSYBOX = Path("/bin/busybox")
"""busybox-static's binary (Debian's ``busybox`` package links it dynamically: unusable in a bare image)."""
IMAGE_NAME = "localhost/istio-agent-tests/pause:busybox"
PAUSE_SCRIPT = b"""#!/bin/sh
# The pod sandbox's process: holds the namespaces until the runtime stops it.
trap 'exit 0' TERM INT
while :; do sleep 3600 & wait $!; done
"""
OCI_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}


def _tar_entry(
    tar: tarfile.TarFile, name: str, *, data: bytes | None = None, link: str = "", mode: int
) -> None:
    info = tarfile.TarInfo(name)
    info.mode, info.uid, info.gid, info.mtime = mode, 0, 0, 0
    if link:
        info.type, info.linkname = tarfile.SYMTYPE, link
        tar.addfile(info)
    elif data is None:
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
    else:
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


def layer(busybox: Path = BUSYBOX) -> bytes:
    """The image's one layer, an uncompressed tar."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        _tar_entry(tar, "bin", mode=0o755)
        _tar_entry(tar, "bin/busybox", data=busybox.read_bytes(), mode=0o755)
        _tar_entry(tar, "bin/sh", link="busybox", mode=0o777)
        _tar_entry(tar, "bin/sleep", link="busybox", mode=0o777)
        _tar_entry(tar, "pause", data=PAUSE_SCRIPT, mode=0o755)
    return buffer.getvalue()


def _blob(blobs: dict[str, bytes], media_type: str, data: bytes) -> dict[str, Any]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blobs[digest] = data
    return {"mediaType": media_type, "digest": digest, "size": len(data)}


def _json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def build(out: Path, *, name: str = IMAGE_NAME, busybox: Path = BUSYBOX) -> str:
    """Write the image as an OCI layout archive at ``out``; returns the image name it carries
    (``io.containerd.image.name``, which ``ctr images import`` registers it under)."""
    if not busybox.is_file():
        raise FileNotFoundError(f"{busybox} is missing: install Debian's busybox-static (`make` installs it)")
    arch = OCI_ARCH.get(platform.machine(), platform.machine())
    blobs: dict[str, bytes] = {}
    layer_data = layer(busybox)
    layer_desc = _blob(blobs, "application/vnd.oci.image.layer.v1.tar", layer_data)
    config = {
        "architecture": arch,
        "os": "linux",
        "config": {"Entrypoint": ["/pause"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [layer_desc["digest"]]},  # uncompressed: same digest
    }
    config_desc = _blob(blobs, "application/vnd.oci.image.config.v1+json", _json(config))
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": config_desc,
        "layers": [layer_desc],
    }
    manifest_desc = _blob(blobs, "application/vnd.oci.image.manifest.v1+json", _json(manifest))
    manifest_desc["platform"] = {"architecture": arch, "os": "linux"}
    manifest_desc["annotations"] = {
        "io.containerd.image.name": name,
        "org.opencontainers.image.ref.name": name.rpartition(":")[2],
    }
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [manifest_desc],
    }
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        _tar_entry(tar, "blobs", mode=0o755)
        _tar_entry(tar, "blobs/sha256", mode=0o755)
        for digest, data in sorted(blobs.items()):
            _tar_entry(tar, f"blobs/sha256/{digest.removeprefix('sha256:')}", data=data, mode=0o644)
        _tar_entry(tar, "oci-layout", data=_json({"imageLayoutVersion": "1.0.0"}), mode=0o644)
        _tar_entry(tar, "index.json", data=_json(index), mode=0o644)
    return name
