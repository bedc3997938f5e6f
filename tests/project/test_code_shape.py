"""The code's shape, checked on the source with ``ast``: no function over 80 lines and no
private name imported across packages. (The import layers and circles are ``lint-imports``'s,
run by ``make test``.)"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "radixserve"
MAX_FUNCTION_LINES = 80


def modules() -> list[tuple[str, ast.Module]]:
    """Every module of radixserve: its dotted name and its syntax tree."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out.append((name, ast.parse(path.read_text(), str(path))))
    return out


def top_package(module: str) -> str:
    """``radixserve.server.app`` -> ``radixserve.server``; a top-level module is its own."""
    return ".".join(module.split(".")[:2])


def test_no_private_name_is_imported_across_packages():
    found = []
    for name, tree in modules():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            if not node.module.startswith("radixserve"):
                continue
            if top_package(node.module) == top_package(name):
                continue
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"{name}:{node.lineno} imports {node.module}.{alias.name}")
    assert not found, "\n".join(found)


def test_no_function_is_over_80_lines():
    long = []
    for name, tree in modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1  # from its def, decorators aside
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name} (line {node.lineno}): {lines} lines")
    assert not long, "split these:\n" + "\n".join(long)
