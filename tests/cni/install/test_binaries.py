"""Copying the plugin to the host's CNI bin directories (Istio's cni/pkg/install/binaries_test.go cases,
and the self-contained plugin's runtime directory beside its launcher).

Real files and real processes: a runtime exec'ing the plugin while it is replaced is a shell script
run in a loop, and a copy killed half-way is a child process killed with SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from istio_agent.cni.install.binaries import (
    CopyError,
    copy_binaries,
    plugin_problem,
    remove_binary,
    remove_plugin,
)

ROOT = Path(__file__).resolve().parents[3]
BUILT = ROOT / "build" / "cni" / "bin"
"""``make cni-plugin``'s output: the launcher and istio-cni-runtime/, what install-cni's image holds."""
RUNTIME = "istio-cni-runtime"
LAUNCHER = """#!/bin/sh
# reads its runtime as the real launcher does: found beside its own path
rt=${0%/*}/istio-cni-runtime
exec cat "$rt/bin/python" "$rt/lib/libc.so.6" "$rt/lib/python3/mod.pyc"
"""


def make_source(tmp_path: Path, version: bytes = b"1") -> Path:
    """A source laid out like build/cni/bin: the launcher, another file, and the runtime directory."""
    source = tmp_path / "src"
    source.mkdir()
    (source / "istio-cni").write_text(LAUNCHER)
    (source / "istio-cni").chmod(0o755)
    (source / "helper").write_bytes(b"helper")
    (source / "helper").chmod(0o700)
    write_runtime(source / RUNTIME, version)
    return source


def write_runtime(runtime: Path, version: bytes) -> None:
    """A small runtime: an executable, libraries (one a symlink), modules, an empty dir, a 0750 dir."""
    (runtime / "bin").mkdir(parents=True)
    (runtime / "lib" / "python3" / "empty").mkdir(parents=True)
    (runtime / "bin" / "python").write_bytes(b"python " + version * 4096 + b"\n")
    (runtime / "bin" / "python").chmod(0o755)
    (runtime / "lib" / "libc.so.6").write_bytes(b"libc " + version * 65536 + b"\n")
    (runtime / "lib" / "libc.so").symlink_to("libc.so.6")
    (runtime / "lib" / "python3" / "mod.pyc").write_bytes(b"mod " + version * 16 + b"\n")
    (runtime / "lib" / "python3" / "mod.pyc").chmod(0o600)
    (runtime / "lib" / "python3").chmod(0o750)


def tree(root: Path) -> dict[str, tuple[str, int, bytes | str]]:
    """Every entry under ``root`` (root included, as "."): kind, mode, and content or link target."""
    entries: dict[str, tuple[str, int, bytes | str]] = {}
    for path in [root, *sorted(root.rglob("*"))]:
        info = path.lstat()
        name = str(path.relative_to(root))
        if stat.S_ISLNK(info.st_mode):
            entries[name] = ("link", 0, os.readlink(path))
        elif stat.S_ISDIR(info.st_mode):
            entries[name] = ("dir", stat.S_IMODE(info.st_mode), b"")
        else:
            entries[name] = ("file", stat.S_IMODE(info.st_mode), path.read_bytes())
    return entries


def identities(root: Path) -> dict[str, tuple[int, int, int]]:
    """(inode, mtime, ctime) of every entry under ``root``: any rewrite changes one of them."""
    return {
        str(p.relative_to(root)): (p.lstat().st_ino, p.lstat().st_mtime_ns, p.lstat().st_ctime_ns)
        for p in [root, *root.rglob("*")]
    }


def test_copies_files_and_the_runtime_tree_with_modes_and_symlinks(tmp_path: Path) -> None:
    source = make_source(tmp_path)
    targets = (tmp_path / "bin1", tmp_path / "bin2")
    for target in targets:
        target.mkdir()
    written: set[Path] = set()
    assert copy_binaries(source, targets, written) == {"istio-cni", "helper", RUNTIME}
    assert written == {t / n for t in targets for n in ("istio-cni", "helper", RUNTIME)}
    for target in targets:
        assert sorted(p.name for p in target.iterdir()) == ["helper", "istio-cni", RUNTIME]
        assert (target / "istio-cni").stat().st_mode & 0o777 == 0o755
        assert (target / "helper").stat().st_mode & 0o777 == 0o700
        assert tree(target / RUNTIME) == tree(source / RUNTIME)
        assert (target / RUNTIME / "lib" / "libc.so").is_symlink()
        run = subprocess.run([target / "istio-cni"], capture_output=True, check=True)
        assert run.stdout.startswith(b"python 1111")


def test_an_unchanged_copy_writes_nothing_and_is_still_ours(tmp_path: Path) -> None:
    """A restart of install-cni on a node finds its plugin in place: no file is rewritten."""
    source = make_source(tmp_path)
    target = tmp_path / "bin"
    target.mkdir()
    copy_binaries(source, (target,))
    before = identities(target)
    written: set[Path] = set()
    assert copy_binaries(source, (target,), written) == {"istio-cni", "helper", RUNTIME}
    assert identities(target) == before
    assert written == {target / "istio-cni", target / "helper", target / RUNTIME}


def test_same_size_and_times_but_other_content_is_copied(tmp_path: Path) -> None:
    """Reproducible images give every file the same mtime: only the content tells versions apart."""
    source = make_source(tmp_path)
    target = tmp_path / "bin"
    target.mkdir()
    copy_binaries(source, (target,))
    module = target / RUNTIME / "lib" / "python3" / "mod.pyc"
    times = module.stat()
    module.write_bytes(module.read_bytes().replace(b"1", b"2"))
    os.utime(module, ns=(times.st_atime_ns, times.st_mtime_ns))
    copy_binaries(source, (target,))
    assert tree(target / RUNTIME) == tree(source / RUNTIME)


def test_a_changed_runtime_is_swapped_in_whole_and_an_unchanged_launcher_kept(tmp_path: Path) -> None:
    source = make_source(tmp_path)
    target = tmp_path / "bin"
    target.mkdir()
    copy_binaries(source, (target,))
    old_runtime = (target / RUNTIME).stat().st_ino
    old_launcher = identities(target)["istio-cni"]
    module = source / RUNTIME / "lib" / "python3" / "mod.pyc"
    module.write_bytes(b"mod " + b"2" * 16 + b"\n")
    (source / RUNTIME / "lib" / "new.so").write_bytes(b"new")
    copy_binaries(source, (target,))
    assert tree(target / RUNTIME) == tree(source / RUNTIME)
    assert (target / RUNTIME).stat().st_ino != old_runtime, "changed in place, not swapped in"
    assert identities(target)["istio-cni"] == old_launcher
    assert sorted(p.name for p in target.iterdir()) == ["helper", "istio-cni", RUNTIME]


def test_a_runtime_execing_the_plugin_during_updates_never_sees_a_partial_runtime(tmp_path: Path) -> None:
    """Versions swapped back and forth while a shell launcher reads its runtime in a loop."""
    versions = []
    for version in (b"1", b"2"):
        (tmp_path / version.decode()).mkdir()
        versions.append(make_source(tmp_path / version.decode(), version))
    target = tmp_path / "bin"
    target.mkdir()
    copy_binaries(versions[0], (target,))
    failures: list[str] = []
    runs = 0
    done = threading.Event()

    def runtime() -> None:
        nonlocal runs
        while not done.is_set():
            run = subprocess.run([target / "istio-cni"], capture_output=True, check=False)
            runs += 1
            parts = [line.partition(b" ")[2] for line in run.stdout.split(b"\n")[:3]]
            whole = len(parts) == 3 and all(len(set(part)) == 1 for part in parts)
            if run.returncode != 0 or not whole:
                failures.append(f"exit {run.returncode}: {run.stderr.decode()[:200]}")

    thread = threading.Thread(target=runtime)
    thread.start()
    swaps = 0
    deadline = time.monotonic() + 10
    try:
        while swaps < 30 or (runs < 100 and time.monotonic() < deadline):
            swaps += 1
            copy_binaries(versions[swaps % 2], (target,))
    finally:
        done.set()
        thread.join()
    if swaps % 2 == 0:
        copy_binaries(versions[1], (target,))
    assert not failures, failures[:3]
    assert tree(target / RUNTIME) == tree(versions[1] / RUNTIME)


KILLED_COPY = """
import os, sys, time
from pathlib import Path
from istio_agent.cni.install import binaries

real = binaries._copy_file

def copy_then_hang(*args):
    real(*args)
    os.write(1, b"copying")
    time.sleep(60)

binaries._copy_file = copy_then_hang
binaries.copy_binaries(Path(sys.argv[1]), (Path(sys.argv[2]),))
"""


def test_a_copy_killed_half_way_leaves_a_temporary_the_next_copy_removes(tmp_path: Path) -> None:
    source = make_source(tmp_path)
    target = tmp_path / "bin"
    target.mkdir()
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_COPY, source, target], stdout=subprocess.PIPE, cwd=ROOT
    )
    try:
        assert child.stdout is not None
        assert child.stdout.read(7) == b"copying"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    leftovers = [p.name for p in target.iterdir()]
    assert len(leftovers) == 1 and leftovers[0].startswith(f".{RUNTIME}."), leftovers
    assert not (target / "istio-cni").exists(), "the launcher went in before its runtime"
    copy_binaries(source, (target,))
    assert sorted(p.name for p in target.iterdir()) == ["helper", "istio-cni", RUNTIME]
    assert tree(target / RUNTIME) == tree(source / RUNTIME)


def test_overwrites_a_changed_target_and_removes_stale_temporaries(tmp_path: Path) -> None:
    source = make_source(tmp_path)
    target = tmp_path / "bin"
    target.mkdir()
    (target / "istio-cni").write_bytes(b"old")
    (target / "istio-cni.tmp.12345").write_bytes(b"left by Istio")
    (target / ".istio-cni.abcdef.tmp").write_bytes(b"left by us")
    (target / "other.tmp.1").write_bytes(b"not ours")
    stale = target / f".{RUNTIME}.0123456789ab.tmp"
    write_runtime(stale, b"0")
    (target / f".{RUNTIME}-other.0123.tmp").mkdir()  # another name's: kept
    copy_binaries(source, (target,))
    assert (target / "istio-cni").read_text() == LAUNCHER
    assert sorted(p.name for p in target.iterdir()) == [
        f".{RUNTIME}-other.0123.tmp",
        "helper",
        "istio-cni",
        RUNTIME,
        "other.tmp.1",
    ]


def test_a_target_runtime_that_is_a_symlink_or_a_file_is_replaced(tmp_path: Path) -> None:
    source = make_source(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    write_runtime(elsewhere, b"9")
    before = tree(elsewhere)
    for kind in ("link", "file"):
        target = tmp_path / f"bin-{kind}"
        target.mkdir()
        if kind == "link":
            (target / RUNTIME).symlink_to(elsewhere)
        else:
            (target / RUNTIME).write_bytes(b"not a directory")
        copy_binaries(source, (target,))
        assert not (target / RUNTIME).is_symlink()
        assert tree(target / RUNTIME) == tree(source / RUNTIME)
        assert sorted(p.name for p in target.iterdir()) == ["helper", "istio-cni", RUNTIME]
    assert tree(elsewhere) == before, "the symlink's target was changed"


def test_a_special_file_in_the_runtime_is_a_clear_error_and_changes_nothing(tmp_path: Path) -> None:
    source = make_source(tmp_path)
    target = tmp_path / "bin"
    target.mkdir()
    copy_binaries(source, (target,))
    before = identities(target)
    (source / "istio-cni").write_text(LAUNCHER + "# v2\n")
    os.mkfifo(source / RUNTIME / "lib" / "pipe")
    with pytest.raises(CopyError, match=rf"{RUNTIME}/lib/pipe.*not a regular file, directory or symlink"):
        copy_binaries(source, (target,))
    assert identities(target) == before, "a failed runtime copy changed the target or let the launcher in"


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
    assert sorted(p.name for p in target.iterdir()) == ["helper", RUNTIME]


def test_remove_plugin_takes_the_launcher_and_its_runtime_only_where_this_process_put_them(
    tmp_path: Path,
) -> None:
    source = make_source(tmp_path)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    for target in (ours, theirs):
        target.mkdir()
    written: set[Path] = set()
    copy_binaries(source, (ours,), written)
    copy_binaries(source, (theirs,))
    remove_plugin(written, "istio-cni")
    assert sorted(p.name for p in ours.iterdir()) == ["helper"]  # helper: not the plugin's
    assert sorted(p.name for p in theirs.iterdir()) == ["helper", "istio-cni", RUNTIME]
    remove_plugin(written, "istio-cni")  # already gone: fine


def test_plugin_problem_needs_the_launcher_and_its_whole_runtime(tmp_path: Path) -> None:
    source = make_source(tmp_path)
    target = tmp_path / "bin"
    target.mkdir()
    assert "istio-cni is missing" in plugin_problem(source, target, "istio-cni")
    copy_binaries(source, (target,))
    assert plugin_problem(source, target, "istio-cni") == ""
    (target / RUNTIME / "lib" / "libc.so.6").unlink()
    assert f"{target / RUNTIME} is incomplete: lib/libc.so.6 is missing" in plugin_problem(
        source, target, "istio-cni"
    )
    (target / RUNTIME / "bin" / "python").chmod(0o644)
    (target / RUNTIME / "lib" / "libc.so.6").write_bytes(b"short")
    assert "is incomplete: bin/python differs" in plugin_problem(source, target, "istio-cni")
    subprocess.run(["rm", "-rf", target / RUNTIME], check=True)
    assert f"its runtime {target / RUNTIME} is missing" in plugin_problem(source, target, "istio-cni")


@pytest.mark.skipif(
    not (BUILT / "istio-cni").is_file(), reason=f"no {BUILT}: build it with `make cni-plugin`"
)
def test_the_built_plugin_runs_from_where_it_was_copied(tmp_path: Path) -> None:
    """make cni-plugin's directory, as install-cni's image holds it, copied to a host bin dir and run."""
    target = tmp_path / "host" / "opt" / "cni" / "bin"
    target.mkdir(parents=True)
    assert copy_binaries(BUILT, (target,)) == {"istio-cni", RUNTIME}
    assert tree(target / RUNTIME) == tree(BUILT / RUNTIME)
    run = subprocess.run(
        [target / "istio-cni"], env={"CNI_COMMAND": "VERSION"}, capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr
    assert "1.1.0" in json.loads(run.stdout)["supportedVersions"]
    before = identities(target)
    copy_binaries(BUILT, (target,))
    assert identities(target) == before
