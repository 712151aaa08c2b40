from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from istio_agent.security.model import ROOT_CERT, WORKLOAD_KEY_CERT, SecretItem
from istio_agent.security.output import check_writable, write_output_certs

FULL = SecretItem(WORKLOAD_KEY_CERT, certificate_chain=b"chain", private_key=b"key", root_cert=b"root")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """(inode, mtime_ns) of every file: a rewrite changes the inode (atomic rename)."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in directory.iterdir()}


def test_write_all_three(tmp_path: Path) -> None:
    out = tmp_path / "a" / "b"
    assert write_output_certs(out, FULL) == ["key.pem", "cert-chain.pem", "root-cert.pem"]
    assert out.is_dir()
    assert (out / "key.pem").read_bytes() == b"key"
    assert (out / "cert-chain.pem").read_bytes() == b"chain"
    assert (out / "root-cert.pem").read_bytes() == b"root"
    assert sorted(os.listdir(out)) == ["cert-chain.pem", "key.pem", "root-cert.pem"]
    assert {mode(p) for p in out.iterdir()} == {0o600}


def test_world_readable(tmp_path: Path) -> None:
    write_output_certs(tmp_path, FULL, world_readable=True)
    assert {mode(p) for p in tmp_path.iterdir()} == {0o644}


def test_unchanged_files_are_not_rewritten(tmp_path: Path) -> None:
    write_output_certs(tmp_path, FULL)
    before = snapshot(tmp_path)
    assert write_output_certs(tmp_path, FULL) == []
    assert snapshot(tmp_path) == before
    rotated = SecretItem(
        WORKLOAD_KEY_CERT, certificate_chain=b"chain2", private_key=b"key", root_cert=b"root"
    )
    assert write_output_certs(tmp_path, rotated) == ["cert-chain.pem"]
    after = snapshot(tmp_path)
    assert after["key.pem"] == before["key.pem"]
    assert after["root-cert.pem"] == before["root-cert.pem"]
    assert after["cert-chain.pem"][0] != before["cert-chain.pem"][0]
    assert (tmp_path / "cert-chain.pem").read_bytes() == b"chain2"


def test_only_present_fields_are_written(tmp_path: Path) -> None:
    write_output_certs(tmp_path, FULL)
    root_only = SecretItem(ROOT_CERT, root_cert=b"merged root")
    assert write_output_certs(tmp_path, root_only) == ["root-cert.pem"]
    assert (tmp_path / "key.pem").read_bytes() == b"key"  # absent fields leave files alone
    assert (tmp_path / "root-cert.pem").read_bytes() == b"merged root"
    cached = SecretItem(WORKLOAD_KEY_CERT, certificate_chain=b"c3", private_key=b"k3")
    assert write_output_certs(tmp_path, cached) == ["key.pem", "cert-chain.pem"]


def test_nothing_to_write(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="istio.cache"):
        assert write_output_certs(tmp_path / "out", SecretItem(WORKLOAD_KEY_CERT)) == []
    assert "no certificates to write" in caplog.text
    assert not (tmp_path / "out").exists()


def test_directory_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "out").write_bytes(b"")
    with pytest.raises(OSError):
        write_output_certs(tmp_path / "out", FULL)


def test_check_writable_creates_the_directory_and_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "x" / "y"
    check_writable(out)
    assert out.is_dir()
    assert list(out.iterdir()) == []


def test_check_writable_refuses_a_path_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "taken").write_bytes(b"")
    with pytest.raises(OSError):
        check_writable(tmp_path / "taken")
