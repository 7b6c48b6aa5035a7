"""The three packages import only downward: client <- service <- engine.

``r3_client`` imports neither ``cache_service`` nor ``sglang_r3``; ``cache_service``
does not import ``sglang_r3``.  Every import counts, also one inside a function:
a lazy upward import is still an upward edge.  Tools that combine the packages
register themselves from above (the ``r3.commands`` entry point).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "r3_client": ROOT / "clients" / "r3_client",
    "cache_service": ROOT / "cache_service",
    "sglang_r3": ROOT / "sglang_r3",
}
LEVEL = {"r3_client": 0, "cache_service": 1, "sglang_r3": 2}


def imported_packages(source: str) -> set[str]:
    """Top-level names of every absolute import in ``source`` (module and function level)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def upward_edges() -> list[str]:
    edges = []
    for package, path in PACKAGES.items():
        for file in sorted(path.rglob("*.py")):
            for name in imported_packages(file.read_text()):
                if name in LEVEL and LEVEL[name] > LEVEL[package]:
                    edges.append(f"{file.relative_to(ROOT)} imports {name}")
    return edges


def test_no_package_imports_one_above_it() -> None:
    assert upward_edges() == []


@pytest.mark.parametrize(
    "source",
    [
        "import sglang_r3.hooks",
        "from cache_service.cli import add_serve_parser",
        "def f():\n    from sglang_r3 import demo\n",
    ],
)
def test_the_walk_sees_module_and_function_level_imports(source: str) -> None:
    assert imported_packages(source) & {"sglang_r3", "cache_service"}


def test_the_r3_command_still_offers_the_service_and_engine_commands() -> None:
    from r3_client.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", "--help"])
    assert exc.value.code == 0
