"""An OCI image archive read and unpacked as a container runtime would: the tests' own reader, not buildah's.

The archive is the image-spec's layout in a tar (``oci-layout``, ``index.json``, ``blobs/sha256/…``), as
``buildah push … oci-archive:`` writes it. :func:`read` checks the layout and every digest it reads;
:func:`unpack` applies the layers in order onto a directory, with their whiteouts, owners, modes and
links, checking each layer against its digest and its uncompressed ``diff_id``.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any

MANIFEST = "application/vnd.oci.image.manifest.v1+json"
LAYER_TYPES = {
    "application/vnd.oci.image.layer.v1.tar": False,
    "application/vnd.oci.image.layer.v1.tar+gzip": True,
}
"""Layer media type -> gzip-compressed."""
WHITEOUT = ".wh."
_TRUSTED: dict[str, Any] = {"filter": "fully_trusted"} if hasattr(tarfile, "data_filter") else {}
"""Python >= 3.11.4 filters members; ours are checked here (paths, links), and modes and owners kept."""
OPAQUE = ".wh..wh..opq"


class ArchiveError(Exception):
    """The archive is not a valid OCI image archive, or a layer would write outside the root."""


@dataclass(frozen=True)
class OciImage:
    """An image of the archive: its name, manifest digest, config and layer descriptors."""

    name: str
    """``org.opencontainers.image.ref.name`` of its index entry."""
    digest: str
    """The manifest's digest: the image's identity."""
    config: dict[str, Any]
    layers: list[dict[str, Any]]

    @property
    def settings(self) -> dict[str, Any]:
        """The run settings (``Env``, ``Entrypoint``, ``Cmd``, ``WorkingDir``, ``User``, ``Labels``)."""
        return dict(self.config.get("config") or {})

    def env(self) -> dict[str, str]:
        """The image's ENV as a mapping."""
        return dict(item.partition("=")[::2] for item in self.settings.get("Env") or [])


def read(archive: Path) -> OciImage:
    """The one image of ``archive``."""
    with tarfile.open(archive) as tar:
        return _image(tar, archive)


def unpack(archive: Path, target: Path) -> OciImage:
    """Apply the image's layers onto ``target`` (an empty or missing directory); returns the image.

    As root, files get the owners the layers record; otherwise the caller's.
    """
    if target.exists() and any(target.iterdir()):
        raise ArchiveError(f"{target} is not empty")
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        image = _image(tar, archive)
        for descriptor, diff_id in zip(image.layers, image.config["rootfs"]["diff_ids"], strict=True):
            blob = _blob_file(tar, descriptor["digest"], archive)
            _apply_layer(blob, descriptor, diff_id, target)
    return image


def _image(tar: tarfile.TarFile, archive: Path) -> OciImage:
    try:
        layout = json.loads(_member_bytes(tar, "oci-layout", archive))
        if layout.get("imageLayoutVersion") != "1.0.0":
            raise ArchiveError(f"{archive}: unknown oci-layout {layout}")
        index = json.loads(_member_bytes(tar, "index.json", archive))
        entries = [m for m in index.get("manifests", []) if m.get("mediaType") == MANIFEST]
        if len(entries) != 1:
            raise ArchiveError(f"{archive}: expected one image manifest in index.json, found {len(entries)}")
        entry = entries[0]
        manifest = json.loads(_blob_bytes(tar, entry, archive))
        config = json.loads(_blob_bytes(tar, manifest["config"], archive))
        layers = list(manifest["layers"])
        diff_ids = config["rootfs"]["diff_ids"]
    except (KeyError, TypeError, ValueError) as err:
        raise ArchiveError(f"{archive}: not an OCI image archive ({type(err).__name__}: {err})") from None
    if len(diff_ids) != len(layers):
        raise ArchiveError(f"{archive}: {len(layers)} layers but {len(diff_ids)} diff_ids")
    for layer in layers:
        if layer.get("mediaType") not in LAYER_TYPES:
            raise ArchiveError(f"{archive}: layer media type {layer.get('mediaType')!r} is not supported")
    name = (entry.get("annotations") or {}).get("org.opencontainers.image.ref.name", "")
    return OciImage(name=name, digest=entry["digest"], config=config, layers=layers)


def _member_bytes(tar: tarfile.TarFile, name: str, archive: Path) -> bytes:
    try:
        member = tar.extractfile(name)
    except KeyError:
        member = None
    if member is None:
        raise ArchiveError(f"{archive}: no {name}")
    return member.read()


def _blob_file(tar: tarfile.TarFile, digest: str, archive: Path) -> IO[bytes]:
    algorithm, _, hexdigest = digest.partition(":")
    if algorithm != "sha256" or len(hexdigest) != 64:
        raise ArchiveError(f"{archive}: unsupported digest {digest!r}")
    try:
        blob = tar.extractfile(f"blobs/sha256/{hexdigest}")
    except KeyError:
        blob = None
    if blob is None:
        raise ArchiveError(f"{archive}: blob {digest} is missing")
    return blob


def _blob_bytes(tar: tarfile.TarFile, descriptor: dict[str, Any], archive: Path) -> bytes:
    data = _blob_file(tar, descriptor["digest"], archive).read()
    if (
        "sha256:" + hashlib.sha256(data).hexdigest() != descriptor["digest"]
        or len(data) != descriptor["size"]
    ):
        raise ArchiveError(f"{archive}: blob {descriptor['digest']} does not match its digest or size")
    return data


class _Hashing:
    """A read-only stream that hashes what is read through it."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.stream = stream
        self.sha256 = hashlib.sha256()
        self.size = 0

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        self.sha256.update(data)
        self.size += len(data)
        return data

    def drain(self) -> None:
        while self.read(1 << 20):
            pass

    def digest(self) -> str:
        return "sha256:" + self.sha256.hexdigest()


def _apply_layer(blob: IO[bytes], descriptor: dict[str, Any], diff_id: str, target: Path) -> None:
    compressed = _Hashing(blob)
    raw: Any = compressed
    if LAYER_TYPES[descriptor["mediaType"]]:
        raw = gzip.GzipFile(fileobj=compressed, mode="rb")  # type: ignore[call-overload]
    plain = _Hashing(raw)
    try:
        _extract(plain, target)
        plain.drain()
        compressed.drain()
    except (OSError, EOFError, tarfile.TarError, zlib.error) as err:
        if isinstance(err, ArchiveError):
            raise
        raise ArchiveError(f"layer {descriptor['digest']} is corrupt: {err}") from None
    if compressed.digest() != descriptor["digest"] or compressed.size != descriptor["size"]:
        raise ArchiveError(f"layer {descriptor['digest']} does not match its digest or size")
    if plain.digest() != diff_id:
        raise ArchiveError(f"layer {descriptor['digest']} does not match its diff_id {diff_id}")


def _extract(plain: _Hashing, target: Path) -> None:
    """One layer's members onto ``target``, whiteouts applied."""
    written: set[PurePosixPath] = set()
    with tarfile.open(fileobj=plain, mode="r|") as layer:  # type: ignore[call-overload]
        for member in layer:
            path = _member_path(member.name)
            if path is None:
                continue  # the layer's root directory itself
            _check_inside(target, path)
            if path.name == OPAQUE:
                _clear_directory(target / path.parent, path.parent, written)
            elif path.name.startswith(WHITEOUT):
                _remove(target / path.parent / path.name.removeprefix(WHITEOUT))
            else:
                _replace_non_directory(target / path, member)
                layer.extract(member, path=target, numeric_owner=True, **_TRUSTED)
                written.add(path)


def _member_path(name: str) -> PurePosixPath | None:
    """The member's path relative to the root; refuses absolute paths and ``..``."""
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts:
        raise ArchiveError(f"layer member {name!r} points outside the root")
    parts = [part for part in path.parts if part != "."]
    return PurePosixPath(*parts) if parts else None


def _check_inside(target: Path, path: PurePosixPath) -> None:
    """The member's parent directory must resolve inside ``target`` (no write through a link out of it)."""
    parent = os.path.realpath(target / path.parent)
    root = os.path.realpath(target)
    if parent != root and not parent.startswith(root + os.sep):
        raise ArchiveError(f"layer member {str(path)!r} would be written through a link outside the root")


def _clear_directory(directory: Path, relative: PurePosixPath, written: set[PurePosixPath]) -> None:
    """An opaque whiteout: what lower layers put in the directory goes; this layer's entries stay."""
    if not directory.is_dir():
        return
    for child in directory.iterdir():
        if relative / child.name not in written:
            _remove(child)


def _replace_non_directory(path: Path, member: tarfile.TarInfo) -> None:
    """A member replaces what a lower layer had at its path, unless both are directories."""
    if path.is_symlink() or (path.exists() and not (path.is_dir() and member.isdir())):
        _remove(path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.is_symlink() or path.exists():
        path.unlink()
