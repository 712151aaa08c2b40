"""The packages depend on each other one way: no import cycle between them, and config depends on no package.

Every import of the project's own modules counts, including those inside functions (they still tie the
packages together), except imports made only for type checking.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import istio_agent

SOURCE = Path(istio_agent.__file__).parent
LEAF_MODULES = {
    "log",
    "logline",
    "goformat",
    "files",
    "backoff",
    "metrics",
    "memory",
    "inotify",
    "host",
    "pem",
    "uds",
    "keepalive",
    "__init__",
}
"""Top-level modules of utilities that import no package of ours: anything may use them."""


def unit(module: str) -> str:
    """``istio_agent.config.env`` -> ``config``: the package (or top-level module) a module belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path) -> str:
    relative = path.relative_to(SOURCE.parent).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    return ".".join(parts)


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(path: Path) -> set[str]:
    """The project modules ``path`` imports (absolute and relative), outside ``if TYPE_CHECKING:``."""
    found: set[str] = set()
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("istio_agent"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing module's package
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], base]).strip(".")
            if base.startswith("istio_agent"):
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    known = {unit(module_name(path)) for path in SOURCE.rglob("*.py")}
    for path in SOURCE.rglob("*.py"):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        source = unit(module_name(path))
        for imported in imports_of(path):
            target = unit(imported)
            if target != source and target in known:
                graph[source].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_no_import_cycle_between_packages() -> None:
    graph = package_graph()
    assert cycles(graph) == [], {source: sorted(targets) for source, targets in sorted(graph.items())}


def test_config_depends_on_no_package_of_ours() -> None:
    assert package_graph()["config"] <= LEAF_MODULES


def test_leaf_modules_import_no_package() -> None:
    graph = package_graph()
    for leaf in LEAF_MODULES:
        assert graph.get(leaf, set()) <= LEAF_MODULES, leaf


def test_the_checker_sees_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
