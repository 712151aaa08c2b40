"""Build the self-contained istio-cni plugin: ``<out>/istio-cni`` and ``<out>/istio-cni-runtime/``.

    python packaging/cni-plugin/build.py [--out build/cni/bin]

Run with the project's venv interpreter (``make cni-plugin`` does). A node's root may offer only the
kernel, ``/bin/sh`` and its iptables binaries: no Python, and a C library of its own version (or
musl) that our interpreter must not use. So the plugin carries this CPython (the interpreter the
venv was made from), the glibc it was built against with that glibc's own loader, and every shared
library they need; the launcher (``launcher.sh``, a POSIX sh script) runs the bundled loader
explicitly on the bundled interpreter, so nothing of the host's is loaded. Why this and not
PyInstaller or Nuitka: docs/cni.md, "Packaging the plugin" (measured: the same start-up as the
venv, where PyInstaller's one-dir re-executes itself and costs +40 ms per exec).

What goes in ``istio-cni-runtime/``:

* ``bin/python3.X``: the interpreter; ``lib/``: its loader, glibc and the other libraries it and the
  extension modules link (``ldd``), debug sections stripped when ``strip`` is installed;
* ``lib/python3.X/``: the standard library compiled to sourceless ``.pyc`` (without its tests, GUI,
  IDE, database and build-tool parts) and its extension modules; the ``istio_agent`` modules the
  plugin can import (``modulefinder`` from ``plugin_main``: every static import, function-level
  ones included) and, whole, each third-party package among them (today h11 and PyYAML);
* ``openssl.cnf``: empty, so the bundled OpenSSL never reads the host's (another version's) config.

The output replaces ``<out>`` in one rename, and only after the built plugin answered VERSION.
``.pyc`` files are unchecked-hash ones, so the same inputs give the same bytes.
"""

from __future__ import annotations

import argparse
import json
import modulefinder
import os
import py_compile
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SRC = ROOT / "src"
ENTRY = SRC / "istio_agent" / "cni" / "plugin_main.py"
OWN_PACKAGE = "istio_agent"
PLUGIN = "istio-cni"
RUNTIME = "istio-cni-runtime"
PY = f"python{sys.version_info.major}.{sys.version_info.minor}"

STDLIB_LEFT_OUT = {
    # tests, GUI, IDE, build and install tools, databases, demos: nothing a CNI plugin imports
    "test", "idlelib", "tkinter", "turtledemo", "turtle.py", "lib2to3", "ensurepip", "venv",
    "distutils", "pydoc_data", "sqlite3", "dbm", "curses", "site-packages", "__pycache__",
}  # fmt: skip
EXTENSIONS_LEFT_OUT = re.compile(
    r"^(_test\w*|_xxtestfuzz|_xxsubinterpreters|xxlimited\w*|_ctypes_test|_tkinter|_curses\w*|_sqlite3|"
    r"_dbm|_gdbm|readline|nis|spwd|ossaudiodev|_crypt|audioop)\."
)
"""Extension modules for those parts, and those linking libraries a plugin has no use for."""


class BuildError(Exception):
    """The build cannot go on; the message says why."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "cni" / "bin", help="the bin directory")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        build(args.out.resolve())
    except BuildError as err:
        print(f"cni-plugin: {err}", file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file() and not f.is_symlink())
    print(f"cni-plugin: {args.out} ({size / 2**20:.1f} MiB) in {time.monotonic() - started:.1f} s")
    return 0


def build(out: Path) -> None:
    """Lay out the plugin in a sibling temporary directory, check it runs, then put it in place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    work.chmod(0o755)  # mkdtemp makes it 0700; install-cni copies the modes to the node
    try:
        runtime = work / RUNTIME
        pylib = runtime / "lib" / PY
        interpreter = runtime / "bin" / PY
        interpreter.parent.mkdir(parents=True)
        shutil.copy2(_interpreter(), interpreter)
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        _compile_tree(stdlib, pylib, _stdlib_files(stdlib))
        dynload = pylib / "lib-dynload"
        dynload.mkdir()
        for ext in sorted(Path(sysconfig.get_config_var("DESTSHARED")).iterdir()):
            if ext.is_file() and not EXTENSIONS_LEFT_OUT.match(ext.name):
                shutil.copy2(ext, dynload / ext.name)
        for package in _imported_packages():
            _copy_package(package, pylib)
        loader = _bundle_libraries(runtime / "lib", [interpreter, *runtime.rglob("*.so")])
        _strip(runtime)
        (runtime / "openssl.cnf").write_text(
            "# Empty: the bundled OpenSSL must not read the host's config.\n"
        )
        launcher = work / PLUGIN
        launcher.write_text(
            (HERE / "launcher.sh").read_text().replace("@LOADER@", loader).replace("@PYTHON@", PY)
        )
        launcher.chmod(0o755)
        _check(launcher)
        if out.exists():
            shutil.rmtree(out)
        work.rename(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _interpreter() -> Path:
    """The CPython binary itself (a venv's ``python`` is a link to it)."""
    base = getattr(sys, "_base_executable", None) or sys.executable
    return Path(os.path.realpath(base))


def _stdlib_files(stdlib: Path) -> Iterator[Path]:
    for path in sorted(stdlib.iterdir()):
        if path.name in STDLIB_LEFT_OUT or path.name.startswith("config-") or path.name == "lib-dynload":
            continue
        if path.is_dir():
            yield from sorted(p for p in path.rglob("*.py") if "__pycache__" not in p.parts)
        elif path.suffix == ".py":
            yield path


def _compile_tree(source: Path, target: Path, files: Iterable[Path]) -> None:
    """Each of ``files`` (under ``source``) as a sourceless ``.pyc`` at the same place under ``target``."""
    for path in files:
        relative = path.relative_to(source)
        pyc = target / relative.with_suffix(".pyc")
        pyc.parent.mkdir(parents=True, exist_ok=True)
        try:
            py_compile.compile(
                str(path),
                cfile=str(pyc),
                dfile=str(relative),
                doraise=True,
                invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
            )
        except py_compile.PyCompileError as err:
            if "site-packages" in path.parts or OWN_PACKAGE in path.parts:
                raise BuildError(f"cannot compile {path}: {err.msg}") from None
            # a stdlib file that does not compile (lib2to3-style test data) is not importable anyway


def _imported_packages() -> list[Path]:
    """The top-level packages (or modules) outside the stdlib that the plugin can import.

    ``istio_agent`` contributes only the modules reached from the entry point (the rest may import
    grpc, which is not bundled); a third-party package comes whole (its data and lazy imports).
    """
    finder = modulefinder.ModuleFinder(path=[str(SRC), *sys.path[1:]])
    finder.run_script(str(ENTRY))
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    own: set[Path] = set()
    third_party: set[Path] = set()
    for name, module in finder.modules.items():
        file = getattr(module, "__file__", None)
        if not file or name == "__main__":
            continue
        path = Path(file).resolve()
        if path.is_relative_to(stdlib) and "site-packages" not in path.parts:
            continue
        if name.split(".")[0] == OWN_PACKAGE:
            own.add(path)
        else:
            third_party.add(_top_level(name, path))
    own.add(ENTRY.resolve())
    if not own:
        raise BuildError(f"modulefinder found no {OWN_PACKAGE} module from {ENTRY}")
    return sorted(own) + sorted(third_party)


def _top_level(name: str, path: Path) -> Path:
    """The directory of ``name``'s top-level package, or the module file for a top-level module."""
    depth = name.count(".") + (1 if path.stem == "__init__" else 0)
    top = path
    for _ in range(depth):
        top = top.parent
    return top


def _copy_package(path: Path, pylib: Path) -> None:
    """One of ``istio_agent``'s modules, or a third-party package or module, into ``pylib``."""
    if path.is_relative_to(SRC):
        relative = path.relative_to(SRC)
        _compile_tree(SRC, pylib, [path])
        for parent in relative.parents:  # the package __init__s up to the top
            init = SRC / parent / "__init__.py"
            if parent != Path(".") and init.exists():
                _compile_tree(SRC, pylib, [init])
        return
    if path.is_file():
        if path.suffix == ".py":
            _compile_tree(path.parent, pylib, [path])
        else:
            shutil.copy2(path, pylib / path.name)
        return
    _compile_tree(path.parent, pylib, sorted(p for p in path.rglob("*.py") if "__pycache__" not in p.parts))
    for other in sorted(path.rglob("*")):
        if (
            other.is_file()
            and other.suffix not in (".py", ".pyc", ".pyi")
            and "__pycache__" not in other.parts
        ):
            target = pylib / other.relative_to(path.parent)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(other, target)


_LDD_LINE = re.compile(r"^\s*(\S+)\s+=>\s+(\S+)\s+\(0x[0-9a-f]+\)$|^\s*(/\S+)\s+\(0x[0-9a-f]+\)$")


def _bundle_libraries(libdir: Path, elves: list[Path]) -> str:
    """Copy every library the ELF files link, and the loader; returns the loader's file name."""
    found: dict[str, Path] = {}
    loader: Path | None = None
    for elf in elves:
        result = subprocess.run(["ldd", str(elf)], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise BuildError(f"ldd {elf} failed: {result.stderr.strip() or result.stdout.strip()}")
        for line in result.stdout.splitlines():
            if "not found" in line:
                raise BuildError(f"{elf}: a library it links is missing on this machine: {line.strip()}")
            match = _LDD_LINE.match(line)
            if match is None:
                continue  # linux-vdso.so.1 (no file) and statically linked notes
            if match.group(3):
                loader = Path(match.group(3))
            else:
                found.setdefault(match.group(1), Path(match.group(2)))
    if loader is None:
        raise BuildError(f"ldd names no loader for {elves[0]}: is it a dynamically linked ELF?")
    # glibc loads libgcc_s at run time (thread cancellation, unwinding); it links nowhere
    gcc_s = Path(found["libc.so.6"]).parent / "libgcc_s.so.1" if "libc.so.6" in found else None
    if gcc_s is not None and gcc_s.exists():
        found.setdefault("libgcc_s.so.1", gcc_s)
    libdir.mkdir(parents=True, exist_ok=True)
    for soname, path in sorted(found.items()):
        shutil.copy(os.path.realpath(path), libdir / soname)
    shutil.copy(os.path.realpath(loader), libdir / loader.name)
    (libdir / loader.name).chmod(0o755)
    return loader.name


def _strip(runtime: Path) -> None:
    """Drop debug sections (a pyenv libpython is 23 MiB with them, 5 MiB without); optional."""
    strip = shutil.which("strip")
    if strip is None:
        return
    elves = [p for p in runtime.rglob("*") if p.is_file() and p.read_bytes()[:4] == b"\x7fELF"]
    subprocess.run([strip, "--strip-debug", *map(str, elves)], check=True)


def _check(launcher: Path) -> None:
    """The built plugin must answer VERSION, with an empty environment (as a node would run it)."""
    result = subprocess.run(
        [str(launcher)], env={"CNI_COMMAND": "VERSION"}, capture_output=True, text=True, check=False
    )
    try:
        versions = json.loads(result.stdout)["supportedVersions"]
    except (ValueError, KeyError, TypeError):
        versions = None
    if result.returncode != 0 or not versions:
        raise BuildError(
            f"the built plugin does not answer VERSION (exit {result.returncode}): "
            f"{(result.stderr or result.stdout).strip()[-2000:]}"
        )


if __name__ == "__main__":
    sys.exit(main())
