"""The import graph: the three packages import only downward (client <- service <- engine);
inside each, no circle, no chain longer than it is today, no private name taken from another
module; outside ``r3_client``, product code uses its public modules and ``r3_client.wire`` only.

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


# -- inside each package: the import graph ---------------------------------------------------
#
# Edges are every import of a module of the same package, module or function level, relative
# or absolute; ``from pkg import name`` counts as an edge to ``pkg.name`` when that is a
# module, and to ``pkg`` (its ``__init__``) otherwise.

# The longest chain of imports inside a package, counted in modules, may not grow.  Before
# issue 28 it was 12 in r3_client (through the circle _frame -> _codec_v2 -> _codec_v1 ->
# _frame), 9 in sglang_r3 (through the circle hicache -> startup -> hooks -> worker_hooks) and
# 9 in cache_service.
LONGEST_CHAIN = {"r3_client": 11, "cache_service": 9, "sglang_r3": 7}


def module_files(package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``package``."""
    root = PACKAGES[package].parent
    modules = {}
    for file in sorted(PACKAGES[package].rglob("*.py")):
        parts = list(file.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = file
    return modules


def imports_of(module: str, file: Path) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import statement in ``file``."""
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                if file.name != "__init__.py":
                    base.pop()
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            found.append((target, [alias.name for alias in node.names]))
    return found


def import_graph(package: str) -> dict[str, set[str]]:
    modules = module_files(package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, file in modules.items():
        for target, names in imports_of(name, file):
            hits = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
            if len(hits) < len(names) or not names:
                hits.append(target)
            graph[name].update(h for h in hits if h in modules and h != name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def longest_chain(graph: dict[str, set[str]]) -> list[str]:
    """The longest import chain of a graph without circles, as module names."""
    memo: dict[str, list[str]] = {}

    def chain(node: str) -> list[str]:
        if node not in memo:
            tails = [chain(nxt) for nxt in sorted(graph[node])]
            memo[node] = [node, *max(tails, key=len, default=[])]
        return memo[node]

    return max((chain(node) for node in sorted(graph)), key=len)


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_circle_inside_a_package(package: str) -> None:
    assert circles(import_graph(package)) == []


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_the_longest_import_chain_does_not_grow(package: str) -> None:
    chain = longest_chain(import_graph(package))
    assert len(chain) <= LONGEST_CHAIN[package], " -> ".join(chain)


def test_the_circle_finder_finds_a_lazy_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert longest_chain({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a"}}) == ["d", "a", "b", "c"]


# -- across packages: only public names -------------------------------------------------------

# Product code and benchmarks.  Tests may import private modules: they test the internals.
OUTSIDE_CLIENT = [ROOT / "cache_service", ROOT / "sglang_r3", ROOT / "bench", ROOT / "scripts"]


def private_client_imports(file: Path) -> list[str]:
    """``r3_client._*`` modules (at any depth) imported by ``file``."""
    bad = []
    for target, names in imports_of("", file):
        parts = target.split(".")
        if parts[0] != "r3_client":
            continue
        if any(p.startswith("_") for p in parts[1:]) or any(
            n.startswith("_") for n in names if target == "r3_client"
        ):
            bad.append(target)
    return bad


def test_nothing_outside_the_client_imports_its_private_modules() -> None:
    """The service and the engine use ``r3_client`` and its seam ``r3_client.wire`` only."""
    bad = [
        f"{file.relative_to(ROOT)} imports {target}"
        for folder in OUTSIDE_CLIENT
        for file in sorted(folder.rglob("*.py"))
        for target in private_client_imports(file)
    ]
    assert bad == []


def private_names_across_modules(package: str) -> list[str]:
    """``from other_module import _name`` inside ``package``: a module's privates stay its own."""
    modules = module_files(package)
    bad = []
    for name, file in modules.items():
        for target, names in imports_of(name, file):
            if target.split(".")[0] != package or target == name:
                continue
            bad += [
                f"{name} imports {target}.{n}"
                for n in names
                if n.startswith("_")
                and not n.endswith("__")  # dunders are everyone's
                and f"{target}.{n}" not in modules  # a module is no name
            ]
    return bad


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_private_name_is_imported_from_another_module(package: str) -> None:
    assert private_names_across_modules(package) == []


@pytest.mark.parametrize(
    "source",
    [
        "from r3_client._codec import x",
        "import r3_client._proto.r3_cache_pb2",
        "from r3_client import _x",
    ],
)
def test_the_walk_sees_private_client_imports(tmp_path: Path, source: str) -> None:
    file = tmp_path / "m.py"
    file.write_text(source)
    assert private_client_imports(file)
