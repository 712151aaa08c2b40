"""Copying the plugin to the host's CNI bin directories, so the container runtime can exec it.

Istio: ``cni/pkg/install/binaries.go`` copies every regular file of the source directory to each
target directory atomically. Our plugin is a launcher plus the directory it runs
(``istio-cni-runtime/``: CPython, its glibc, our modules; see docs/cni.md, "Packaging the plugin"),
so directories are copied too, and a runtime exec'ing the plugin at any moment must find a whole
runtime beside the launcher:

* a directory is built under a temporary name in the target directory and swapped in by one
  ``renameat2(RENAME_EXCHANGE)`` (the old tree is removed after), so the name always holds a whole
  tree; on a file system without that flag, two renames leave the name missing for microseconds;
* directories go in before files, so a launcher is replaced only once its runtime is in place;
* an entry already identical in the target (kind, mode, size, link target and bytes; not times,
  which reproducible images make equal across versions) is not rewritten, so a restart of
  install-cni does not churn 33 MiB on the host (Istio rewrites its one binary on every pass);
* temporaries a killed copy left behind are removed first: Istio's ``<name>.tmp.*`` and ours
  (``.<name>.<random>.tmp``, files from ``files.write_atomic`` and trees from here).
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import shutil
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from istio_agent.files import write_atomic
from istio_agent.log import scope

log = scope("cni-agent")

RENAME_EXCHANGE = 2
"""``renameat2`` flag (linux/fs.h): swap two existing paths in one step."""
AT_FDCWD = -100
CHUNK = 1 << 20


class CopyError(Exception):
    """A binary could not be copied; the message names it and, when the host is read-only, says so."""


def copy_binaries(source: Path, targets: tuple[Path, ...], written: set[Path] | None = None) -> set[str]:
    """Copy every regular file and directory of ``source`` into each writable target; returns their names.

    Each destination is added to ``written`` as soon as it is in place (copied, or found identical:
    then it is what this process would have written), even when a later copy fails: cleanup removes
    only what this process installed, never another install-cni's files.
    """
    try:
        entries = sorted(
            (p for p in source.iterdir() if p.is_dir() or p.is_file()), key=lambda p: (not p.is_dir(), p.name)
        )
    except OSError as err:
        raise CopyError(f"cannot list the plugin binaries in {source}: {err.strerror}") from None
    if not entries:
        log.warning("no plugin binaries to copy in %s", source)
    copied: set[str] = set()
    for target in targets:
        if not os.access(target, os.W_OK):
            log.info("directory %s is not writable, skipping", target)
            continue
        for entry in entries:
            destination = target / entry.name
            remove_stale_temporaries(target, entry.name)
            changed = (
                _install_tree(entry, destination) if entry.is_dir() else _install_file(entry, destination)
            )
            if written is not None:
                written.add(destination)
            copied.add(entry.name)
            if changed:
                log.info("Copied %s to %s", entry.name, target)
            else:
                log.info("%s in %s is up to date", entry.name, target)
    return copied


def _install_file(source: Path, destination: Path) -> bool:
    """Copy one file unless ``destination`` already is that file; whether it was copied."""
    try:
        if _same_file(source, destination):
            return False
        write_atomic(destination, source.read_bytes(), stat.S_IMODE(source.stat().st_mode))
    except OSError as err:
        raise _copy_error(source, destination, err) from None
    return True


def _same_file(source: Path, destination: Path) -> bool:
    """Whether ``destination`` is a regular file (not a link) with ``source``'s mode and bytes."""
    try:
        have = destination.lstat()
    except FileNotFoundError:
        return False
    want = source.stat()
    if not stat.S_ISREG(have.st_mode) or (have.st_mode, have.st_size) != (want.st_mode, want.st_size):
        return False
    return _same_bytes(source, destination)


def _same_bytes(a: Path, b: Path) -> bool:
    with a.open("rb") as fa, b.open("rb") as fb:
        while True:
            chunk = fa.read(CHUNK)
            if chunk != fb.read(CHUNK):
                return False
            if not chunk:
                return True


# -- directories -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One entry of a tree as compared: what a copy preserves."""

    kind: str
    """``dir``, ``file``, ``link``, or ``other`` (a FIFO, socket or device: never copied)."""
    mode: int = 0
    size: int = 0
    link: str = ""


def scan(root: Path, follow_root: bool = False) -> dict[str, Entry]:
    """Every entry of the tree at ``root`` by path relative to it ("." for ``root``), parents first.

    Links are entries, never followed (``follow_root``: except ``root`` itself, a source directory
    that may be a link); a root that is not a directory is the only entry. Raises OSError.
    """
    info = os.stat(root) if follow_root else os.lstat(root)
    entries = {".": _entry(info, root)}
    if entries["."].kind == "dir":
        _scan_into(root, "", entries)
    return entries


def _scan_into(directory: Path, prefix: str, entries: dict[str, Entry]) -> None:
    with os.scandir(directory) as listing:
        children = sorted(listing, key=lambda e: e.name)
    for child in children:
        name = prefix + child.name
        entry = _entry(child.stat(follow_symlinks=False), Path(child.path))
        entries[name] = entry
        if entry.kind == "dir":
            _scan_into(Path(child.path), name + "/", entries)


def _entry(info: os.stat_result, path: Path) -> Entry:
    mode = stat.S_IMODE(info.st_mode)
    if stat.S_ISDIR(info.st_mode):
        return Entry("dir", mode)  # a directory's size depends on the file system: not compared
    if stat.S_ISREG(info.st_mode):
        return Entry("file", mode, info.st_size)
    if stat.S_ISLNK(info.st_mode):
        return Entry("link", link=os.readlink(path))
    return Entry("other", mode)


def _install_tree(source: Path, destination: Path) -> bool:
    """Put a copy of the tree ``source`` at ``destination`` in one step unless it is there; whether copied."""
    try:
        shape = scan(source, follow_root=True)
        if _same_tree(source, shape, destination):
            return False
    except OSError as err:
        raise _copy_error(source, destination, err) from None
    special = next((name for name, entry in shape.items() if entry.kind == "other"), None)
    if special is not None:
        raise CopyError(f"cannot copy {source / special}: not a regular file, directory or symlink")
    temporary = _temporary(destination)
    try:
        _build(source, shape, temporary)
        _sync_filesystem(temporary)  # the whole tree on disk before any name points at it
        _swap_in(temporary, destination)
        _sync_filesystem(destination.parent)
    except OSError as err:
        _discard(temporary)
        raise _copy_error(source, destination, err) from None
    return True


def _same_tree(source: Path, shape: dict[str, Entry], destination: Path) -> bool:
    try:
        if scan(destination) != shape:
            return False
    except FileNotFoundError:
        return False
    return all(
        _same_bytes(source / name, destination / name)
        for name, entry in shape.items()
        if entry.kind == "file"
    )


def _build(source: Path, shape: dict[str, Entry], root: Path) -> None:
    """Lay the tree out at ``root`` (a new name nobody execs); directories get their modes last."""
    for name, entry in shape.items():
        path = root / name
        if entry.kind == "dir":
            path.mkdir(mode=0o700)
        elif entry.kind == "link":
            path.symlink_to(entry.link)
        else:
            _copy_file(source / name, path, entry.mode)
    for name, entry in reversed(shape.items()):
        if entry.kind == "dir":
            (root / name).chmod(entry.mode)


def _copy_file(source: Path, destination: Path, mode: int) -> None:
    shutil.copyfile(source, destination)
    destination.chmod(mode)


def _swap_in(temporary: Path, destination: Path) -> None:
    """Give ``temporary`` the name ``destination``, which is never missing if it existed; the old one goes."""
    if not os.path.lexists(destination):
        os.rename(temporary, destination)
    elif _exchange(temporary, destination):
        _discard(temporary)  # what was there before
    else:
        old = _temporary(destination)
        os.rename(destination, old)
        os.rename(temporary, destination)
        _discard(old)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically; False when the kernel or file system cannot (then nothing changed)."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:  # a C library older than glibc 2.28
        return False
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        log.debug("cannot exchange %s and %s in one step: %s", a, b, os.strerror(code))
        return False
    raise OSError(code, os.strerror(code), str(b))


def _sync_filesystem(path: Path) -> None:
    """Flush the file system holding ``path`` (one ``syncfs``, not one fsync per file); best effort."""
    syncfs = getattr(ctypes.CDLL(None, use_errno=True), "syncfs", None)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if syncfs is None or syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)


def _temporary(destination: Path) -> Path:
    return destination.with_name(f".{destination.name}.{secrets.token_hex(6)}.tmp")


def _discard(path: Path) -> None:
    """Remove a file, link or whole directory (never through a link); a failure is logged, not raised."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        return
    except OSError as err:
        log.warning("cannot remove %s: %s", path, err.strerror)


def _copy_error(source: Path, destination: Path, err: OSError) -> CopyError:
    hint = ""
    if err.errno == errno.EROFS:
        hint = " (the host's CNI bin directory is read-only: set the CNI bin directory to a writable one)"
    return CopyError(f"cannot copy {source} to {destination}: {err.strerror}{hint}")


def remove_stale_temporaries(directory: Path, name: str) -> None:
    """Remove temporary copies of ``name`` (files or trees) left in ``directory`` by an interrupted copy."""
    for pattern in (f"{name}.tmp.*", f".{name}.*.tmp"):
        for leftover in directory.glob(pattern):
            _discard(leftover)


# -- readiness and cleanup ---------------------------------------------------------------------------


def plugin_problem(source: Path, target: Path, launcher: str) -> str:
    """Why a runtime could not exec ``target/launcher`` ("" when it could).

    The launcher must be there, and beside it every directory of ``source`` (the runtime it runs)
    with all its entries as copied (kind, mode, size, link target; bytes are compared by a copy).
    """
    if not (target / launcher).is_file():
        return f"{target / launcher} is missing"
    try:
        for directory in sorted(p for p in source.iterdir() if p.is_dir()):
            problem = _tree_problem(scan(directory, follow_root=True), target / directory.name)
            if problem:
                return f"its runtime {target / directory.name} {problem}"
    except OSError as err:
        return f"cannot check its runtime: {err.filename}: {err.strerror}"
    return ""


def _tree_problem(expected: dict[str, Entry], root: Path) -> str:
    try:
        actual = scan(root)
    except FileNotFoundError:
        return "is missing"
    if actual["."].kind != "dir":
        return "is not a directory"
    for name, entry in expected.items():
        if name == ".":
            continue
        found = actual.get(name)
        if found is None:
            return f"is incomplete: {name} is missing"
        if found != entry:
            return f"is incomplete: {name} differs"
    return ""


def remove_plugin(installed: Iterable[Path], launcher: str) -> None:
    """Remove ``launcher``, then the directories installed beside it, where this process installed it.

    ``installed``: what :func:`copy_binaries` recorded. The launcher goes first (it must never point
    at a missing runtime); a runtime beside a launcher this process did not install stays.
    """
    paths = set(installed)
    for target in sorted({p.parent for p in paths if p.name == launcher}):
        remove_binary((target,), launcher)
        if (target / launcher).exists():
            continue
        for path in sorted(p for p in paths if p.parent == target and p.is_dir() and not p.is_symlink()):
            _discard(path)
            if not path.exists():
                log.info("removed %s", path)


def remove_binary(targets: tuple[Path, ...], name: str) -> None:
    """Remove ``name`` from every target directory (cleanup on exit); a missing file is fine."""
    for target in targets:
        try:
            (target / name).unlink()
            log.info("removed %s", target / name)
        except FileNotFoundError:
            continue
        except OSError as err:
            log.warning("cannot remove %s: %s", target / name, err.strerror)
