"""No module of the package imports grpcio (``grpc``) or grpcio-health-checking (``grpc_health``).

The agent's gRPC is :mod:`istio_agent.rpc` (grpclib) and its health messages are its own
(``protos/health.proto``); grpcio stays a test dependency, the independent client and server that
applications use. ``grpc_tools`` (grpcio-tools' protoc, ``make protos``) is a build tool, allowed
only in ``protos/generate.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import istio_agent

PACKAGE = Path(istio_agent.__file__).parent
FORBIDDEN = ("grpc", "grpc_health")
BUILD_TOOLS = {"grpc_tools": {"protos/generate.py"}}


def imported_modules(tree: ast.AST) -> list[str]:
    """Every absolute module an ``import`` or ``from ... import`` names, anywhere in the module."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def offenders(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root).as_posix()
        for name in imported_modules(ast.parse(path.read_bytes(), str(path))):
            top = name.split(".")[0]
            if top in FORBIDDEN or (top in BUILD_TOOLS and where not in BUILD_TOOLS[top]):
                found.append(f"{where}: {name}")
    return found


def test_no_module_under_the_package_imports_grpcio() -> None:
    assert offenders(PACKAGE) == []


def test_the_scan_sees_imports_in_functions_and_from_imports(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("def f():\n    import grpc.aio\n")
    (tmp_path / "b.py").write_text("from grpc_health.v1 import health_pb2\nfrom .grpc import x\n")
    (tmp_path / "c.py").write_text("import grpclib.client\nfrom grpc_tools import protoc\n")
    assert offenders(tmp_path) == ["a.py: grpc.aio", "b.py: grpc_health.v1", "c.py: grpc_tools"]
