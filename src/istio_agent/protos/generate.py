"""Generate the Python modules for the project's .proto files (``make protos``).

The generated files are committed; ``tests/test_protos.py`` regenerates them into a temporary
directory and fails when the committed copies are stale. Only messages are generated: the agent's
gRPC is :mod:`istio_agent.rpc`, so no grpcio stubs (``*_pb2_grpc.py``) belong here; the tests make
the ones they use (``tests/grpc_stubs.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
SRC_DIR = PROTO_DIR.parent.parent
PROTO_FILES = ("istio_ca.proto", "nds.proto", "proxy_config.proto", "health.proto", "zds.proto")


def generate(out_dir: Path) -> None:
    """Run grpcio-tools' protoc for every proto file, writing the message modules under ``out_dir``."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in PROTO_FILES:
        args = [
            "protoc",
            f"-I{SRC_DIR}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            str(Path("istio_agent/protos") / name),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed for {name}")


def main() -> int:
    generate(SRC_DIR)
    print(f"generated {', '.join(PROTO_FILES)} into {PROTO_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
