"""grpcio stubs of the project's services, for the tests, generated at build time into ``build/grpc-stubs/``.

The agent speaks gRPC through :mod:`istio_agent.rpc` and ships only the message modules
(``src/istio_agent/protos``); the tests keep grpcio as the independent client and server real
applications use, so the stubs they need are made here, from the same ``.proto``, and not committed.
``make grpc-stubs`` runs this module; importing it regenerates what is missing or older than its
``.proto``, so ``pytest tests/<one file>`` works alone.

    from tests.grpc_stubs import istio_ca_pb2_grpc
"""

from __future__ import annotations

import sys
from pathlib import Path

from istio_agent.protos import generate
from tests import protoc_build

OUT_DIR = Path(__file__).resolve().parents[1] / "build" / "grpc-stubs"
PROTOS = ("istio_ca.proto",)
"""The project's protos with a service the tests serve or call with grpcio."""


def _module_name(proto: str) -> str:
    return proto.removesuffix(".proto") + "_pb2_grpc"


def stale(out_dir: Path = OUT_DIR) -> bool:
    """Whether a stub module is missing or older than its proto."""
    return any(
        protoc_build.stale(generate.PROTO_DIR / proto, [out_dir / f"{_module_name(proto)}.py"])
        for proto in PROTOS
    )


def build(out_dir: Path = OUT_DIR) -> None:
    """grpcio-tools' protoc, stubs only (the messages are the package's)."""
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    for proto in PROTOS:
        protoc_build.run_protoc(
            [f"-I{generate.SRC_DIR}", f"-I{include}", "--grpc_python_out={out}"],
            f"istio_agent/protos/{proto}",
            out_dir,
            [f"istio_agent/protos/{_module_name(proto)}.py"],
        )


if stale():
    build()
istio_ca_pb2_grpc = protoc_build.load(
    f"{__name__}.{_module_name('istio_ca.proto')}", OUT_DIR / f"{_module_name('istio_ca.proto')}.py"
)


def main() -> int:
    build()
    print(f"generated {', '.join(_module_name(p) for p in PROTOS)} into {OUT_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
