"""Which layer of a Wasm image holds the module, and taking it out of a tar.gz layer.

The "Wasm Image Specification" Istio reads (solo-io/wasm ``spec/``; Istio's
``pkg/wasm/imagefetcher.go``) has three formats:

- Docker schema2 manifest: the last layer, a tar.gz holding ``plugin.wasm``;
- OCI manifest, "compat": the last layer ``application/vnd.oci.image.layer.v1.tar+gzip`` holding it;
- OCI manifest, "oci" (artifact): exactly two layers, the module raw in the one of type
  ``application/vnd.module.wasm.content.layer.v1+wasm``.

Where we differ from Istio, on purpose: a module over the size limit is refused with an error saying
so (Istio's ``io.LimitReader`` silently truncates it), also when only its decompressed layer is that
large, and a layer is never inflated past the limit (a gzip bomb stops there); a manifest of no Wasm
format fails before any blob is downloaded.
"""

from __future__ import annotations

import gzip
import io
import re
import tarfile
import zlib
from dataclasses import dataclass
from typing import Any

from istio_agent.http.exchange import describe
from istio_agent.wasm.errors import FetchError

DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_MANIFEST_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_LAYER = "application/vnd.docker.image.rootfs.diff.tar.gzip"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
WASM_LAYER = "application/vnd.module.wasm.content.layer.v1+wasm"
PLUGIN_FILE = "plugin.wasm"
TAR_SLACK = 64 << 10
"""Tar headers and small files the decompressed layer may hold besides a module at the size limit."""
DIGEST = re.compile(r"sha256:[a-f0-9]{64}")
_READ_CHUNK = 1 << 20


@dataclass(frozen=True)
class Layer:
    """The layer holding the module: raw (``artifact``) or ``plugin.wasm`` in a tar.gz."""

    media_type: str
    digest: str
    size: int
    archive: bool


def wasm_layer(manifest: dict[str, Any]) -> Layer:
    """The layer holding the module, by Istio's rules (see the module docstring)."""
    if manifest.get("schemaVersion") != 2 or not isinstance(manifest.get("layers"), list):
        raise FetchError("the manifest is not a schema 2 image manifest")
    layers = [_layer(entry) for entry in manifest["layers"]]
    if not layers:
        raise FetchError("the image has no layers")
    last = layers[-1]
    if manifest.get("mediaType") == DOCKER_MANIFEST:
        if last.media_type != DOCKER_LAYER:
            raise FetchError(f"Docker image: its last layer is {last.media_type} (expect {DOCKER_LAYER})")
        return last
    if last.media_type == OCI_LAYER:
        return last
    wasm = next((layer for layer in layers if layer.media_type == WASM_LAYER), None)
    if len(layers) == 2 and wasm is not None:
        return Layer(wasm.media_type, wasm.digest, wasm.size, archive=False)
    artifact = (
        f"it has {len(layers)} layers (expect 2)"
        if len(layers) != 2
        else f"it has no layer of type {WASM_LAYER}"
    )
    raise FetchError(
        "the image is in no Wasm image format: as a compat image, its last layer is "
        f"{last.media_type} (expect {OCI_LAYER}); as an oci image, {artifact}"
    )


def descriptor_digest(entry: object) -> str:
    """A descriptor's ``sha256:hex`` digest; ``FetchError`` when it has none of that form."""
    digest = entry.get("digest") if isinstance(entry, dict) else None
    if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
        raise FetchError(f"the manifest has a descriptor whose digest is not sha256: {digest!r}")
    return digest


def extract_plugin(blob: bytes, limit: int) -> bytes:
    """``plugin.wasm`` (in any directory) from a tar.gz layer, never inflating more than the limit
    allows: the module at most ``limit`` bytes, the tar at most ``TAR_SLACK`` more."""
    reader = _Bounded(gzip.GzipFile(fileobj=io.BytesIO(blob)), limit + TAR_SLACK)
    try:
        with tarfile.open(fileobj=reader, mode="r|") as archive:
            for member in archive:
                if member.name.rsplit("/", 1)[-1] != PLUGIN_FILE or not member.isfile():
                    continue
                if member.size > limit:
                    raise FetchError(f"{PLUGIN_FILE} is {member.size} bytes, {over_limit(limit)}")
                content = archive.extractfile(member)
                return content.read() if content is not None else b""
    except (tarfile.TarError, OSError, EOFError, zlib.error) as err:
        raise FetchError(f"the layer is not a gzip-compressed tar: {describe(err)}") from None
    raise FetchError(f"{PLUGIN_FILE} not found in the layer")


def over_limit(limit: int) -> str:
    return f"over the limit of {limit} bytes (ISTIO_WASM_MAX_BINARY_SIZE_BYTES); refused, not truncated"


def _layer(entry: object) -> Layer:
    if not isinstance(entry, dict):
        raise FetchError("the manifest has a layer that is not an object")
    size = entry.get("size")
    if not isinstance(size, int) or size < 0:
        raise FetchError("the manifest has a layer without a size")
    return Layer(str(entry.get("mediaType", "")), descriptor_digest(entry), size, archive=True)


class _Bounded(io.RawIOBase):
    """A reader that refuses to give more than ``limit`` bytes (a gzip bomb stops there)."""

    def __init__(self, inner: gzip.GzipFile, limit: int) -> None:
        self._inner = inner
        self._left = limit
        self._limit = limit

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        chunk = self._inner.read(_READ_CHUNK if size < 0 else min(size, _READ_CHUNK))
        self._left -= len(chunk)
        if self._left < 0:
            raise FetchError(f"the layer decompresses to something {over_limit(self._limit - TAR_SLACK)}")
        return chunk
