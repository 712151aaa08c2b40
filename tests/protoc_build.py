"""Modules the tests generate with grpcio-tools' protoc at build time, shared by their generators.

What both :mod:`tests.grpc_stubs` and :mod:`tests.cri.protos` need: whether generated files are older
than their ``.proto``, a protoc run whose outputs appear each at once (built in a scratch directory
beside them, then renamed, so concurrent test workers never read half a file), and loading a
generated file as a module.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import ModuleType


def stale(proto: Path, outputs: Iterable[Path]) -> bool:
    """Whether an output is missing or older than ``proto``."""
    source = proto.stat().st_mtime
    return any(not out.exists() or out.stat().st_mtime < source for out in outputs)


def run_protoc(options: Sequence[str], proto: str, out_dir: Path, produced: Iterable[str]) -> None:
    """``protoc options --*_out=scratch proto`` (``{out}`` in an option is the scratch directory),
    then each file of ``produced`` (relative to the scratch directory) renamed into ``out_dir``."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as scratch:
        args = ["protoc", *(option.format(out=scratch) for option in options), proto]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed for {proto}")
        for relative in produced:
            os.replace(Path(scratch) / relative, out_dir / Path(relative).name)


def load(name: str, path: Path) -> ModuleType:
    """The module ``name`` from ``path``, executed once per process."""
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module
