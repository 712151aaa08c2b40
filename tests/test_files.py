"""The one atomic file writer: old or new content, never partial; final mode from the start."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from istio_agent.files import write_atomic


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_write_atomic_creates_and_replaces(tmp_path: Path) -> None:
    target = tmp_path / "f.pem"
    write_atomic(target, b"one", 0o600)
    assert target.read_bytes() == b"one" and mode(target) == 0o600
    inode = target.stat().st_ino
    write_atomic(target, b"two", 0o644)
    assert target.read_bytes() == b"two" and mode(target) == 0o644
    assert target.stat().st_ino != inode  # replaced by rename, not rewritten in place
    assert os.listdir(tmp_path) == ["f.pem"]  # no temporary file left


def test_write_atomic_mode_ignores_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        write_atomic(tmp_path / "f", b"x", 0o644)
    finally:
        os.umask(old)
    assert mode(tmp_path / "f") == 0o644


def test_write_atomic_failure_removes_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "busy"
    target.mkdir()
    (target / "inside").write_bytes(b"")
    with pytest.raises(OSError):
        write_atomic(target, b"data", 0o600)  # rename onto a non-empty directory fails
    assert sorted(os.listdir(tmp_path)) == ["busy"]


def test_write_atomic_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        write_atomic(tmp_path / "missing" / "f", b"x", 0o600)


def test_write_atomic_takes_text(tmp_path: Path) -> None:
    write_atomic(tmp_path / "f.json", '{"a": "é"}')
    assert (tmp_path / "f.json").read_text(encoding="utf-8") == '{"a": "é"}'
    assert mode(tmp_path / "f.json") == 0o644


def test_concurrent_writers_never_share_a_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "table.pb"
    payloads = [bytes([n]) * 100_000 for n in range(8)]
    threads = [threading.Thread(target=write_atomic, args=(target, data)) for data in payloads]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert target.read_bytes() in payloads  # one whole payload, not a mix
    assert os.listdir(tmp_path) == ["table.pb"]
