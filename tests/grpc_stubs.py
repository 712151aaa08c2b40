"""grpcio stubs of the project's services, for the tests, generated at build time into ``build/grpc-stubs/``.

The agent speaks gRPC through :mod:`istio_agent.rpc` and ships only the message modules
(``src/istio_agent/protos``); the tests keep grpcio as the independent client and server real
applications use, so the stubs they need are made here, from the same ``.proto``, and not committed.
``make grpc-stubs`` runs this module; importing it regenerates what is missing or older than its
``.proto``, so ``pytest tests/<one file>`` works alone.

    from tests.grpc_stubs import istio_ca_pb2_grpc
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType

from istio_agent.protos import generate

OUT_DIR = Path(__file__).resolve().parents[1] / "build" / "grpc-stubs"
PROTOS = ("istio_ca.proto",)
"""The project's protos with a service the tests serve or call with grpcio."""


def _module_name(proto: str) -> str:
    return proto.removesuffix(".proto") + "_pb2_grpc"


def stale(out_dir: Path = OUT_DIR) -> bool:
    """Whether a stub module is missing or older than its proto."""
    for proto in PROTOS:
        stub = out_dir / f"{_module_name(proto)}.py"
        if not stub.exists() or stub.stat().st_mtime < (generate.PROTO_DIR / proto).stat().st_mtime:
            return True
    return False


def build(out_dir: Path = OUT_DIR) -> None:
    """grpcio-tools' protoc, stubs only (the messages are the package's); each module appears at once
    (built beside it, then renamed), so concurrent test workers never read half a file."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as scratch:
        for proto in PROTOS:
            args = [
                "protoc",
                f"-I{generate.SRC_DIR}",
                f"-I{include}",
                f"--grpc_python_out={scratch}",
                f"istio_agent/protos/{proto}",
            ]
            if protoc.main(args) != 0:
                raise RuntimeError(f"protoc failed for {proto}")
            name = _module_name(proto)
            os.replace(Path(scratch) / "istio_agent" / "protos" / f"{name}.py", out_dir / f"{name}.py")


def _load(name: str) -> ModuleType:
    qualified = f"{__name__}.{name}"
    module = sys.modules.get(qualified)
    if module is None:
        spec = importlib.util.spec_from_file_location(qualified, OUT_DIR / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[qualified] = module
        spec.loader.exec_module(module)
    return module


if stale():
    build()
istio_ca_pb2_grpc = _load(_module_name("istio_ca.proto"))


def main() -> int:
    build()
    print(f"generated {', '.join(_module_name(p) for p in PROTOS)} into {OUT_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
