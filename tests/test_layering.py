"""The import graph: the three packages import only downward (client <- service <- engine);
inside each, no circle, no chain longer than it is today, no private name taken from another
module; outside ``r3_client``, product code uses its public modules and ``r3_client.wire`` only.
And the stored layout has one owner: only ``r3_client.stored`` spells a hash field's name (the
Lua scripts, which cannot import it, spell the owner's).

``r3_client`` imports neither ``cache_service`` nor ``sglang_r3``; ``cache_service``
does not import ``sglang_r3``.  Every import counts, also one inside a function:
a lazy upward import is still an upward edge.  Tools that combine the packages
register themselves from above (the ``r3.commands`` entry point).
"""

from __future__ import annotations

import ast
import re
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


# -- the stored layout: one owner -------------------------------------------------------------
#
# What a rollout's, a view's and a shared blob's hash fields are called is said once, in
# ``r3_client.stored`` (the service's reads and writes and ``DirectReader`` take the names from
# there).  Product code elsewhere that spells a field prefix, a whole field name in a Redis hash
# command, a view's or a blob's key infix, or the shared-segment pointer restates the layout.

LAYOUT_OWNER = PACKAGES["r3_client"] / "stored"
PRODUCT = [ROOT / "clients", ROOT / "cache_service", ROOT / "sglang_r3"]
LUA = ROOT / "cache_service" / "lua"
#: redis-py's hash commands: a literal field name passed to one names the layout.
HASH_COMMANDS = {"hdel", "hexists", "hget", "hincrby", "hmget", "hscan", "hset", "hsetnx"}


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes of ``tree`` (prose, not names the code uses)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def layout_names(source: str) -> set[str]:
    """The stored layout's names that ``source`` spells: field prefixes (``"s:"``,
    ``f"c:{d}"``, ``b"k:"`` ...) and key infixes as string literals, whole field names given
    to a hash command, and the shared-segment pointer ``b"@"``."""
    from r3_client.stored import FIELD_PREFIXES, NAMED_FIELDS
    from r3_client.stored.fields import BLOB_KEY, POINTER, VIEW_KEY

    tree = ast.parse(source)
    prose = _docstrings(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and id(node) not in prose:
            value = node.value
            text = value.decode("latin-1") if isinstance(value, bytes) else value
            if not isinstance(text, str):
                continue
            found.update(p for p in FIELD_PREFIXES if text.startswith(p))
            found.update(k for k in (VIEW_KEY, BLOB_KEY) if k in text)
            if value == POINTER:
                found.add(POINTER.decode())
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in HASH_COMMANDS
        ):
            whole = {*NAMED_FIELDS, *(n.encode() for n in NAMED_FIELDS)}
            for arg in ast.walk(ast.Tuple(elts=node.args[1:], ctx=ast.Load())):
                if isinstance(arg, ast.Constant) and arg.value in whole:
                    found.add(arg.value.decode() if isinstance(arg.value, bytes) else arg.value)
    return found


def test_only_the_layout_owner_names_stored_fields() -> None:
    """Product code spells a stored field's name only in ``r3_client.stored``; the owner
    spells every one of them (so this cannot pass by finding nothing)."""
    from r3_client.stored import FIELD_PREFIXES

    outside = {
        f"{file.relative_to(ROOT)}: {sorted(names)}"
        for folder in PRODUCT
        for file in sorted(folder.rglob("*.py"))
        if LAYOUT_OWNER not in file.parents
        and (names := layout_names(file.read_text(encoding="utf-8")))
    }
    assert outside == set()
    owner = set().union(*(layout_names(f.read_text()) for f in LAYOUT_OWNER.rglob("*.py")))
    assert owner >= {*FIELD_PREFIXES, ":v:", "blob:", "@"}, sorted(owner)


@pytest.mark.parametrize(
    "source",
    [
        'f"c:{digest}"',
        'field = b"s:0:10"',
        'key + ":v:" + str(serves)',
        'r.hget(blob, "f")',
        "v[:1] == b'@'",
        "pipe.hmget(key, [b'm', name])",
    ],
)
def test_the_layout_walk_sees_a_field_name(source: str) -> None:
    assert layout_names(source)


def test_the_layout_walk_leaves_prose_alone() -> None:
    assert not layout_names('"""Fields ``s:<a>:<b>`` and ``<key>:v:<serves>``."""\nx = "m"\n')


def _lua_code(script: Path) -> str:
    """A Lua script without its comments (they quote prose with apostrophes)."""
    return re.sub(r"--[^\n]*", "", script.read_text())


def test_the_lua_scripts_spell_the_owners_field_names() -> None:
    """The store's Lua scripts hard-code field names (a script cannot import them): each
    prefix they match or build, each field a hash command names, and the view key's infix
    is the layout owner's."""
    from r3_client.stored import FIELD_PREFIXES, NAMED_FIELDS, VIEW_KEY

    prefixes, named, infixes = set(), set(), set()
    for script in sorted(LUA.glob("*.lua")):
        code = _lua_code(script)
        for lit in re.findall(r"'([^']*)'", code):
            if m := re.match(r"\^?([a-z]{1,2}:)", lit):
                prefixes.add(m.group(1))
            if ":v:" in lit or "blob" in lit:
                infixes.add(lit)
        for call in re.finditer(r"redis\.p?call\('H[A-Z]+',([^)]*)\)", code):
            # each argument that starts with a literal names a field (or its prefix)
            named.update(m[1] for a in call[1].split(",") if (m := re.match(r"\s*'([^']*)'", a)))
    assert prefixes, "no field prefix found: the walk is broken"
    assert prefixes <= set(FIELD_PREFIXES), sorted(prefixes - set(FIELD_PREFIXES))
    assert named, "no hash field found: the walk is broken"
    assert named <= {*FIELD_PREFIXES, *NAMED_FIELDS}, sorted(named)
    assert infixes == {VIEW_KEY}, infixes


# -- framework glue: a module per process -----------------------------------------------------
#
# Each framework's glue is a package with a module per process it runs in (issue 55):
# ``rollout`` on the rollout side (where SGLang is called), ``driver`` on the trainer's driver,
# ``worker`` / ``rank`` on each training rank.  The rollout side and the ranks are different
# machines' processes: neither imports the other's module, directly or through another module
# (what both need lives in a module of its own, e.g. ``_keys``).

INTEGRATIONS = "r3_client.integrations"
FRAMEWORK_PACKAGES = ("areal", "miles", "samples", "slime", "verl")
RANK_MODULES = ("rank", "worker")


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others (``start`` left out)."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    seen.discard(start)
    return seen


def process_modules(graph: dict[str, set[str]]) -> tuple[set[str], set[str]]:
    """(rollout modules, rank modules) of every framework package."""
    rollout = {f"{INTEGRATIONS}.{p}.rollout" for p in FRAMEWORK_PACKAGES}
    ranks = {f"{INTEGRATIONS}.{p}.{m}" for p in FRAMEWORK_PACKAGES for m in RANK_MODULES}
    return rollout & set(graph), ranks & set(graph)


def test_every_framework_is_a_package_with_a_module_per_process() -> None:
    graph = import_graph("r3_client")
    for package in FRAMEWORK_PACKAGES:
        base = f"{INTEGRATIONS}.{package}"
        assert f"{base}.rollout" in graph, f"{base} has no rollout module"
        assert any(f"{base}.{m}" in graph for m in RANK_MODULES), f"{base} has no rank module"
        # not a single module beside (or instead of) the package
        assert not (PACKAGES["r3_client"] / "integrations" / f"{package}.py").exists()


@pytest.mark.parametrize("side", ["rollout", "rank"])
def test_the_rollout_side_and_the_ranks_import_nothing_of_each_other(side: str) -> None:
    graph = import_graph("r3_client")
    rollout, ranks = process_modules(graph)
    mine, theirs = (rollout, ranks) if side == "rollout" else (ranks, rollout)
    assert mine and theirs
    crossing = {f"{m} -> {sorted(reachable(graph, m) & theirs)}" for m in mine}
    assert {c for c in crossing if not c.endswith("[]")} == set()


def test_the_process_walk_sees_an_indirect_import() -> None:
    graph = {"a.rollout": {"a.util"}, "a.util": {"a.rank"}, "a.rank": set()}
    assert reachable(graph, "a.rollout") == {"a.util", "a.rank"}
