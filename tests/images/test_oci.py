"""The tests' OCI archive reader (tests/images/oci.py) on archives made here, layer by layer.

What a runtime does with layers (the image-spec's ``layer.md``): later layers replace files of earlier
ones, ``.wh.<name>`` removes ``<name>`` of lower layers, ``.wh..wh..opq`` hides a directory's lower
content but keeps the layer's own; digests and ``diff_id``s are checked; nothing is written outside
the root, by path or through a link.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import stat
import tarfile
from pathlib import Path
from typing import Any

import pytest

from tests.images.oci import ArchiveError, read, unpack

Entry = tuple[str, str, Any]
"""(kind, path, content): ("file", path, bytes), ("dir", path, None), ("link", path, target)."""


def layer_tar(entries: list[Entry]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for kind, path, content in entries:
            info = tarfile.TarInfo(path)
            info.uid = info.gid = 0
            if kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            elif kind == "link":
                info.type, info.linkname, info.mode = tarfile.SYMTYPE, content, 0o777
                tar.addfile(info)
            else:
                data, mode = (content, 0o644) if isinstance(content, bytes) else content
                info.size, info.mode = len(data), mode
                tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def blob(blobs: dict[str, bytes], media_type: str, data: bytes) -> dict[str, Any]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blobs[digest] = data
    return {"mediaType": media_type, "digest": digest, "size": len(data)}


def make_archive(path: Path, layers: list[list[Entry]], *, compress: bool = True, tamper: str = "") -> Path:
    """An OCI archive with these layers (gzip by default); ``tamper`` breaks one thing on purpose."""
    blobs: dict[str, bytes] = {}
    descriptors, diff_ids = [], []
    for entries in layers:
        plain = layer_tar(entries)
        diff_ids.append("sha256:" + hashlib.sha256(plain).hexdigest())
        data = gzip.compress(plain, mtime=0) if compress else plain
        media = "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if compress else "")
        descriptors.append(blob(blobs, media, data))
    if tamper == "diff_id":
        diff_ids[0] = "sha256:" + "0" * 64
    if tamper == "media type":
        descriptors[0]["mediaType"] = "application/vnd.oci.image.layer.v1.tar+zstd"
    config = {"architecture": "amd64", "os": "linux", "config": {"Env": ["PATH=/bin", "A=b=c"]}}
    config["rootfs"] = {"type": "layers", "diff_ids": diff_ids}
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": blob(blobs, "application/vnd.oci.image.config.v1+json", json.dumps(config).encode()),
        "layers": descriptors,
    }
    entry = blob(blobs, "application/vnd.oci.image.manifest.v1+json", json.dumps(manifest).encode())
    entry["annotations"] = {"org.opencontainers.image.ref.name": "localhost/test/image:1"}
    if tamper.endswith("layer"):  # a gzip trailer or, in a plain tar, the file's content
        digest, flip = descriptors[0]["digest"], -1 if compress else 512
        flipped = bytearray(blobs[digest])
        flipped[flip] ^= 1
        blobs[digest] = bytes(flipped)
    files = {f"blobs/sha256/{d.removeprefix('sha256:')}": data for d, data in blobs.items()}
    files["oci-layout"] = b'{"imageLayoutVersion": "1.0.0"}'
    files["index.json"] = json.dumps({"schemaVersion": 2, "manifests": [entry]}).encode()
    with tarfile.open(path, "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def tree(root: Path) -> dict[str, str]:
    """Every path under ``root``: file contents, ``-> target`` for links, ``/`` for directories."""
    found = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            found[key] = "-> " + os.readlink(path)
        elif path.is_dir():
            found[key] = "/"
        else:
            found[key] = path.read_text()
    return found


def test_read_gives_the_name_digest_and_env(tmp_path: Path) -> None:
    image = read(make_archive(tmp_path / "a.tar", [[("file", "x", b"1")]]))
    assert image.name == "localhost/test/image:1"
    assert image.digest.startswith("sha256:") and len(image.layers) == 1
    assert image.env() == {"PATH": "/bin", "A": "b=c"}


@pytest.mark.parametrize("compress", [True, False], ids=["gzip", "plain"])
def test_layers_apply_in_order_with_their_whiteouts(tmp_path: Path, compress: bool) -> None:
    lower = [
        ("dir", "etc", None),
        ("file", "etc/keep", b"lower"),
        ("file", "etc/replaced", b"lower"),
        ("file", "etc/removed", b"lower"),
        ("dir", "opaque", None),
        ("file", "opaque/from-lower", b"lower"),
        ("dir", "gone", None),
        ("file", "gone/inside", b"lower"),
        ("link", "bin", "usr/bin"),
        ("dir", "usr", None),
        ("dir", "usr/bin", None),
        ("file", "usr/bin/tool", (b"#!/bin/sh\n", 0o4755)),
    ]
    upper = [
        ("file", "etc/replaced", b"upper"),
        ("file", "etc/.wh.removed", b""),
        ("file", ".wh.gone", b""),
        ("dir", "opaque", None),
        ("file", "opaque/.wh..wh..opq", b""),
        ("file", "opaque/from-upper", b"upper"),
    ]
    archive = make_archive(tmp_path / "a.tar", [lower, upper], compress=compress)
    unpack(archive, tmp_path / "root")
    assert tree(tmp_path / "root") == {
        "bin": "-> usr/bin",
        "etc": "/",
        "etc/keep": "lower",
        "etc/replaced": "upper",
        "opaque": "/",
        "opaque/from-upper": "upper",
        "usr": "/",
        "usr/bin": "/",
        "usr/bin/tool": "#!/bin/sh\n",
    }
    assert stat.S_IMODE((tmp_path / "root" / "usr/bin/tool").stat().st_mode) == 0o4755


def test_a_file_replaces_a_lower_link_instead_of_writing_through_it(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_text("host")
    layers: list[list[Entry]] = [[("link", "f", str(outside))], [("file", "f", b"image")]]
    unpack(make_archive(tmp_path / "a.tar", layers), tmp_path / "root")
    assert (tmp_path / "root" / "f").read_text() == "image" and not (tmp_path / "root" / "f").is_symlink()
    assert outside.read_text() == "host"


@pytest.mark.parametrize("name", ["../escape", "/absolute"])
def test_a_member_path_outside_the_root_is_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ArchiveError, match="points outside the root"):
        unpack(make_archive(tmp_path / "a.tar", [[("file", name, b"x")]]), tmp_path / "root")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.tar", "root"]


def test_nothing_is_written_through_a_link_out_of_the_root(tmp_path: Path) -> None:
    host_etc = tmp_path / "host-etc"
    host_etc.mkdir()
    layers: list[list[Entry]] = [[("link", "etc", str(host_etc))], [("file", "etc/passwd", b"x")]]
    with pytest.raises(ArchiveError, match="through a link outside the root"):
        unpack(make_archive(tmp_path / "a.tar", layers), tmp_path / "root")
    assert list(host_etc.iterdir()) == []


@pytest.mark.parametrize(
    ("tamper", "error"),
    [
        ("gzip layer", "is corrupt: "),
        ("plain layer", "does not match its digest"),
        ("diff_id", "does not match its diff_id"),
        ("media type", "is not supported"),
    ],
)
def test_a_tampered_archive_is_refused(tmp_path: Path, tamper: str, error: str) -> None:
    layers: list[list[Entry]] = [[("file", "x", b"content" * 100)]]
    archive = make_archive(tmp_path / "a.tar", layers, compress=tamper != "plain layer", tamper=tamper)
    with pytest.raises(ArchiveError, match=error):
        unpack(archive, tmp_path / "root")


def test_not_an_oci_archive(tmp_path: Path) -> None:
    path = tmp_path / "a.tar"
    with tarfile.open(path, "w") as tar:
        info = tarfile.TarInfo("index.json")
        tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(ArchiveError, match="no oci-layout"):
        read(path)


def test_unpack_wants_an_empty_target(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "something").touch()
    with pytest.raises(ArchiveError, match="is not empty"):
        unpack(make_archive(tmp_path / "a.tar", [[("file", "x", b"1")]]), tmp_path / "root")
