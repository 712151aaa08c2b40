"""The CRI subset's Python modules (``cri_runtime.proto``), generated at build time into ``build/cri/``.

``make cri-protos`` runs this module; :func:`load` regenerates the modules first when they are
missing or older than the ``.proto`` (so ``pytest tests/cri`` works alone), then imports them. They
are not committed: the proto is the source, as for Kubernetes' own generated client.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

from tests import protoc_build

PROTO = Path(__file__).with_name("cri_runtime.proto")
OUT_DIR = Path(__file__).resolve().parents[2] / "build" / "cri"
MODULES = ("cri_runtime_pb2", "cri_runtime_pb2_grpc")


def stale(out_dir: Path = OUT_DIR) -> bool:
    """Whether a generated module is missing or older than the proto."""
    return protoc_build.stale(PROTO, [out_dir / f"{name}.py" for name in MODULES])


def generate(out_dir: Path = OUT_DIR) -> None:
    """Run grpcio-tools' protoc on the proto into ``out_dir``."""
    protoc_build.run_protoc(
        [f"-I{PROTO.parent}", "--python_out={out}", "--grpc_python_out={out}"],
        PROTO.name,
        out_dir,
        [f"{name}.py" for name in MODULES],
    )


def load() -> tuple[ModuleType, ModuleType]:
    """The messages module and the gRPC stubs module (generated first when stale)."""
    if stale():
        generate()
    # the stubs import the messages by their top-level name
    messages, stubs = (protoc_build.load(name, OUT_DIR / f"{name}.py") for name in MODULES)
    return messages, stubs


def main() -> int:
    generate()
    print(f"generated {', '.join(MODULES)} into {OUT_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
