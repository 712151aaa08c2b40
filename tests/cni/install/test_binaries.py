"""Copying the plugin binaries to the host (Istio's cni/pkg/install/binaries_test.go cases)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from istio_agent.cni.install.binaries import CopyError, copy_binaries, remove_binary


def make_source(tmp_path: Path) -> Path:
    source = tmp_path / "src"
    source.mkdir()
    (source / "istio-cni").write_bytes(b"plugin v1")
    (source / "istio-cni").chmod(0o755)
    (source / "helper").write_bytes(b"helper")
    (source / "helper").chmod(0o700)
    (source / "subdir").mkdir()  # not a regular file: not copied
    return source


def test_copies_every_file_with_its_mode_and_returns_the_names(tmp_path: Path) -> None:
    source = make_source(tmp_path)
    targets = (tmp_path / "bin1", tmp_path / "bin2")
    for target in targets:
        target.mkdir()
    assert copy_binaries(source, targets) == {"istio-cni", "helper"}
    for target in targets:
        assert sorted(p.name for p in target.iterdir()) == ["helper", "istio-cni"]
        assert (target / "istio-cni").stat().st_mode & 0o777 == 0o755
        assert (target / "helper").stat().st_mode & 0o777 == 0o700


def test_overwrites_a_changed_target_and_removes_stale_temporaries(tmp_path: Path) -> None:
    source = make_source(tmp_path)
    target = tmp_path / "bin"
    target.mkdir()
    (target / "istio-cni").write_bytes(b"old")
    (target / "istio-cni.tmp.12345").write_bytes(b"left by Istio")
    (target / ".istio-cni.abcdef.tmp").write_bytes(b"left by us")
    (target / "other.tmp.1").write_bytes(b"not ours")
    copy_binaries(source, (target,))
    assert (target / "istio-cni").read_bytes() == b"plugin v1"
    assert sorted(p.name for p in target.iterdir()) == ["helper", "istio-cni", "other.tmp.1"]


@pytest.mark.skipif(
    os.geteuid() == 0, reason="root writes anywhere: a non-writable directory needs a non-root user"
)
def test_a_read_only_target_is_skipped(tmp_path: Path) -> None:
    source = make_source(tmp_path)
    target = tmp_path / "ro"
    target.mkdir(mode=0o555)
    assert copy_binaries(source, (target,)) == set()


def test_a_missing_source_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CopyError, match=r"cannot list the plugin binaries in .*nope"):
        copy_binaries(tmp_path / "nope", (tmp_path,))


def test_remove_only_the_named_binary(tmp_path: Path) -> None:
    source = make_source(tmp_path)
    target = tmp_path / "bin"
    target.mkdir()
    copy_binaries(source, (target,))
    remove_binary((target,), "istio-cni")
    remove_binary((target,), "istio-cni")  # already gone: fine
    assert sorted(p.name for p in target.iterdir()) == ["helper"]
