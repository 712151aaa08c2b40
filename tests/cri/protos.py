"""The CRI subset's Python modules (``cri_runtime.proto``), generated at build time into ``build/cri/``.

``make cri-protos`` runs this module; :func:`load` regenerates the modules first when they are
missing or older than the ``.proto`` (so ``pytest tests/cri`` works alone), then imports them. They
are not committed: the proto is the source, as for Kubernetes' own generated client.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType

PROTO = Path(__file__).with_name("cri_runtime.proto")
OUT_DIR = Path(__file__).resolve().parents[2] / "build" / "cri"
MODULES = ("cri_runtime_pb2", "cri_runtime_pb2_grpc")


def stale(out_dir: Path = OUT_DIR) -> bool:
    """Whether a generated module is missing or older than the proto."""
    source = PROTO.stat().st_mtime
    return any(
        not (out_dir / f"{name}.py").exists() or (out_dir / f"{name}.py").stat().st_mtime < source
        for name in MODULES
    )


def generate(out_dir: Path = OUT_DIR) -> None:
    """Run grpcio-tools' protoc on the proto; the modules appear in ``out_dir`` each at once (built
    in a temporary directory beside it, then renamed), so concurrent test workers never read half a file."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as scratch:
        args = [
            "protoc",
            f"-I{PROTO.parent}",
            f"--python_out={scratch}",
            f"--grpc_python_out={scratch}",
            PROTO.name,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed for {PROTO}")
        for name in MODULES:
            os.replace(Path(scratch) / f"{name}.py", out_dir / f"{name}.py")


def load() -> tuple[ModuleType, ModuleType]:
    """The messages module and the gRPC stubs module (generated first when stale)."""
    if stale():
        generate()
    loaded = []
    for name in MODULES:  # the stubs import the messages by their top-level name
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, OUT_DIR / f"{name}.py")
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        loaded.append(module)
    return loaded[0], loaded[1]


def main() -> int:
    generate()
    print(f"generated {', '.join(MODULES)} into {OUT_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
