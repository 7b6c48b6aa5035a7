"""Modules a newcomer can hold (issue 55): no product module over 600 lines and no function
over 90, unless its docstring says why at the top (a line starting ``Long because:``).

Generated code (the gRPC stubs, ``*_pb2*.py``) is left out: nobody reads it to change it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = [ROOT / "clients" / "r3_client", ROOT / "cache_service", ROOT / "sglang_r3"]
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 90
REASON = "Long because:"


def product_files() -> list[Path]:
    return sorted(
        file for root in PRODUCT for file in root.rglob("*.py") if "_pb2" not in file.name
    )


def has_reason(node: ast.AST) -> bool:
    """Whether ``node``'s docstring (a module or a function) gives a reason for its length."""
    assert isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef))
    doc = ast.get_docstring(node) or ""
    return any(line.strip().startswith(REASON) for line in doc.splitlines())


def too_long(source: str, name: str) -> list[str]:
    """Every module or function in ``source`` over its bound with no reason written."""
    tree = ast.parse(source)
    found = []
    lines = len(source.splitlines())
    if lines > MAX_MODULE_LINES and not has_reason(tree):
        found.append(f"{name}: {lines} lines")
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            span = (node.end_lineno or node.lineno) - node.lineno + 1
            if span > MAX_FUNCTION_LINES and not has_reason(node):
                found.append(f"{name}:{node.lineno} {node.name}: {span} lines")
    return found


def test_no_product_module_or_function_is_over_its_bound_without_a_reason() -> None:
    files = product_files()
    assert len(files) > 100  # the walk found the product
    found = [
        hit for file in files for hit in too_long(file.read_text(), str(file.relative_to(ROOT)))
    ]
    assert found == []


def body(lines: int) -> str:
    return "".join(f"    x{i} = {i}\n" for i in range(lines))


@pytest.mark.parametrize(
    ("source", "hits"),
    [
        ("def f():\n" + body(MAX_FUNCTION_LINES), ["m.py:1 f: 91 lines"]),
        ("def f():\n" + body(MAX_FUNCTION_LINES - 1), []),
        ('def f():\n    """Long because: a table."""\n' + body(MAX_FUNCTION_LINES), []),
        (
            "class C:\n    async def g(self):\n"
            + body(MAX_FUNCTION_LINES).replace("    ", "        "),
            ["m.py:2 g: 91 lines"],
        ),
        ("x = 1\n" * (MAX_MODULE_LINES + 1), [f"m.py: {MAX_MODULE_LINES + 1} lines"]),
        (
            '"""A table.\n\nLong because: generated from the spec.\n"""\n'
            + "x = 1\n" * MAX_MODULE_LINES,
            [],
        ),
    ],
)
def test_the_length_walk_sees_what_is_over(source: str, hits: list[str]) -> None:
    assert too_long(source, "m.py") == hits
