"""Where a dotted name is in one SGLang wheel, read statically (AST only, nothing imported).

A :class:`Wheel` opens a ``.whl`` (a zip) or an unpacked copy of one and answers
:meth:`Wheel.find` for ``pkg.module``, ``pkg.module.name`` (a module-level name) or
``pkg.module.Class.attr`` (a class attribute or field).  Lookups follow
``from x import y`` (relative too), ``import x.y``, ``from x import *`` and class bases
in the same wheel (mixins, dataclasses, pydantic models, msgspec structs: annotated
names count).  A class that its module rebuilds as ``msgspec.defstruct`` from the
classes listed in ``_INPUT_NAMESPACES`` (``ServerArgs``, SGLang 0.5.20 on) has those
classes' annotated names as fields.  With ``instance=True`` an attribute may also be one
that ``__init__`` assigns (``self.x = ...``, ``self.x: T = ...``).

A name that is not there raises :class:`NotInWheelError`, whose message names it, the
release and the file where the lookup stopped.
"""

from __future__ import annotations

import ast
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

_BLOCKS = (ast.If, ast.Try, ast.TryStar, ast.With)
_DEPTH = 24  # import hops, more than any chain in a release


class NotInWheelError(LookupError):
    """A dotted name the wheel does not have (the message says where the lookup stopped)."""


@dataclass(frozen=True, eq=False)
class _Hit:
    """A binding: ``node`` in ``module``'s file (None: the module itself), or a name the
    wheel imports from outside itself (``external``)."""

    module: str
    node: ast.AST | None = None
    external: str = ""


def _statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """``body`` with the bodies of ``if``/``try``/``with`` blocks spliced in."""
    out: list[ast.stmt] = []
    for stmt in body:
        out.append(stmt)
        if isinstance(stmt, _BLOCKS):
            for part in ("body", "orelse", "finalbody"):
                out += _statements(getattr(stmt, part, []))
            for handler in getattr(stmt, "handlers", []):
                out += _statements(handler.body)
    return out


def _targets(stmt: ast.stmt) -> list[ast.expr]:
    """What an assignment statement assigns to, tuples unpacked (nothing for others)."""
    if isinstance(stmt, ast.Assign):
        targets = stmt.targets
    elif isinstance(stmt, ast.AnnAssign | ast.AugAssign):
        targets = [stmt.target]
    else:
        return []
    return [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]


def _names(stmt: ast.stmt) -> list[str]:
    """The plain names ``stmt`` binds (defs, classes, assignments, imports)."""
    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [stmt.name]
    if isinstance(stmt, ast.Import | ast.ImportFrom):
        return [a.asname or a.name.split(".")[0] for a in stmt.names if a.name != "*"]
    return [e.id for e in _targets(stmt) if isinstance(e, ast.Name)]


def _annotated(cls: ast.ClassDef) -> dict[str, ast.stmt]:
    """The field declarations of a class body (``name: T`` or ``name: T = v``)."""
    return {
        s.target.id: s
        for s in _statements(cls.body)
        if isinstance(s, ast.AnnAssign)
        and isinstance(s.target, ast.Name)
        and "ClassVar" not in ast.unparse(s.annotation)
    }


def _self_assigned(cls: ast.ClassDef) -> dict[str, ast.stmt]:
    """``self.<name>`` assigned anywhere in the class's ``__init__``."""
    out: dict[str, ast.stmt] = {}
    for fn in cls.body:
        if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
            for s in [n for n in ast.walk(fn) if isinstance(n, ast.stmt)]:
                for e in _targets(s):
                    if isinstance(e, ast.Attribute) and ast.unparse(e.value) == "self":
                        out.setdefault(e.attr, s)
    return out


class Wheel:
    """One SGLang wheel (a ``.whl`` file or the directory it was unpacked into)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._zip = None if path.is_dir() else zipfile.ZipFile(path)
        files = (
            self._zip.namelist()
            if self._zip
            else [p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()]
        )
        self._files = {f for f in files if f.endswith(".py")}
        self._dirs = {f[: i + 1] for f in self._files for i, c in enumerate(f) if c == "/"}
        self.version = self._version(files)
        self._index: dict[str, dict[str, list[ast.stmt]]] = {}

    def _version(self, files: list[str]) -> str:
        meta = [f for f in files if re.fullmatch(r"sglang-[^/]+\.dist-info/METADATA", f)]
        if meta:
            found = re.search(r"^Version: (\S+)$", self._read(meta[0]), re.M)
            if found:
                return found[1]
        return self.path.name.split("-")[1] if "-" in self.path.name else self.path.name

    def _read(self, name: str) -> str:
        raw = self._zip.read(name) if self._zip else (self.path / name).read_bytes()
        return raw.decode("utf-8")

    # ------------------------------------------------------------------ modules

    def file(self, module: str) -> str | None:
        """The wheel's file for ``module`` (``a/b.py``, ``a/b/__init__.py``, or ``a/b/``
        for a package without ``__init__.py``), or None."""
        base = module.replace(".", "/")
        files = (f"{base}.py", f"{base}/__init__.py")
        found = next((f for f in files if f in self._files), None)
        return found or (f"{base}/" if f"{base}/" in self._dirs else None)

    def _bindings(self, module: str) -> dict[str, list[ast.stmt]]:
        """``module``'s top-level statements by the name each binds, in order (``"*"``:
        its ``from x import *``)."""
        if module not in self._index:
            index: dict[str, list[ast.stmt]] = {}
            path = self.file(module) or "/"
            source = "" if path.endswith("/") else self._read(path)
            for s in _statements(ast.parse(source).body):
                star = isinstance(s, ast.ImportFrom) and any(a.name == "*" for a in s.names)
                for name in ["*"] if star else _names(s):
                    index.setdefault(name, []).append(s)
            self._index[module] = index
        return self._index[module]

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        """The module ``from ... import`` reads from, relative imports made absolute."""
        if not node.level:
            return node.module or ""
        package = module.split(".")
        if not (self.file(module) or "").endswith(("__init__.py", "/")):
            package = package[:-1]
        package = package[: len(package) - (node.level - 1)]
        return ".".join(package + ([node.module] if node.module else []))

    def _lookup(self, module: str, name: str, depth: int = 0) -> _Hit | None:
        """What ``name`` is in ``module``'s namespace, imports followed."""
        if depth > _DEPTH or self.file(module) is None:
            return None
        index = self._bindings(module)
        stmt = index[name][0] if name in index else None
        if stmt is None:
            for star in index.get("*", []):
                assert isinstance(star, ast.ImportFrom)
                hit = self._lookup(self._absolute(module, star), name, depth + 1)
                if hit:
                    return hit
            sub = f"{module}.{name}"
            return _Hit(sub) if self.file(sub) else None
        if isinstance(stmt, ast.ImportFrom):
            source = self._absolute(module, stmt)
            orig = next(a.name for a in stmt.names if (a.asname or a.name) == name)
            if self.file(f"{source}.{orig}"):
                return _Hit(f"{source}.{orig}")
            if self.file(source):
                return self._lookup(source, orig, depth + 1)
            return _Hit(module, stmt, external=f"{source}.{orig}")
        if isinstance(stmt, ast.Import):
            alias = next(a for a in stmt.names if (a.asname or a.name.split(".")[0]) == name)
            target = alias.name if alias.asname else name
            return _Hit(target) if self.file(target) else _Hit(module, stmt, external=target)
        return _Hit(module, stmt)

    # ------------------------------------------------------------------ classes

    def _expr(self, module: str, expr: ast.expr) -> _Hit | None:
        """What a base-class expression (``A``, ``m.A``, ``A[T]``) names."""
        if isinstance(expr, ast.Name):
            return self._lookup(module, expr.id)
        if isinstance(expr, ast.Subscript):
            return self._expr(module, expr.value)
        if isinstance(expr, ast.Attribute):
            owner = self._expr(module, expr.value)
            return self._member(owner, expr.attr, instance=False) if owner else None
        return None

    def _mro(self, cls: _Hit) -> list[_Hit]:
        """``cls`` and its bases in the wheel, depth first (bases outside it are skipped)."""
        out: list[_Hit] = []
        todo = [cls]
        while todo and len(out) < _DEPTH:
            c = todo.pop(0)
            if isinstance(c.node, ast.ClassDef) and all(c.node is not o.node for o in out):
                out.append(c)
                bases = [self._expr(c.module, b) for b in c.node.bases]
                todo = [b for b in bases if b is not None] + todo
        return out

    def _namespaces(self, cls: _Hit) -> list[_Hit]:
        """The ``_INPUT_NAMESPACES`` classes when ``cls``'s module rebinds it as a
        ``msgspec.defstruct``, else nothing."""
        assert isinstance(cls.node, ast.ClassDef)
        index = self._bindings(cls.module)
        rebuilt = any(
            isinstance(s, ast.Assign)
            and isinstance(s.value, ast.Call)
            and ast.unparse(s.value.func).endswith("defstruct")
            for s in index.get(cls.node.name, [])
        )
        listed = index.get("_INPUT_NAMESPACES", [None])[0]
        if not rebuilt or not isinstance(listed, ast.Assign | ast.AnnAssign):
            return []
        elts = listed.value.elts if isinstance(listed.value, ast.List | ast.Tuple) else []
        hits = [self._expr(cls.module, e) for e in elts]
        return [h for h in hits if h is not None and isinstance(h.node, ast.ClassDef)]

    def _member(self, owner: _Hit, name: str, *, instance: bool) -> _Hit | None:
        """``name`` in a module's namespace, or on a class (its body, its bases', its
        ``_INPUT_NAMESPACES`` fields, then with ``instance`` its ``__init__``'s)."""
        if owner.node is None:
            return self._lookup(owner.module, name)
        if not isinstance(owner.node, ast.ClassDef):
            return None
        mro = self._mro(owner)
        for c in mro:
            assert isinstance(c.node, ast.ClassDef)
            stmt = next((s for s in _statements(c.node.body) if name in _names(s)), None)
            if stmt is not None:
                return _Hit(c.module, stmt)
        for ns in self._namespaces(owner):
            for c in self._mro(ns):
                assert isinstance(c.node, ast.ClassDef)
                if name in _annotated(c.node):
                    return _Hit(c.module, _annotated(c.node)[name])
        for c in mro if instance else []:
            assert isinstance(c.node, ast.ClassDef)
            if name in _self_assigned(c.node):
                return _Hit(c.module, _self_assigned(c.node)[name])
        return None

    # ------------------------------------------------------------------ public

    def where(self, hit: _Hit) -> str:
        """``path:line`` of a binding (``path`` alone for a module)."""
        path = self.file(hit.module) or hit.module
        line = getattr(hit.node, "lineno", None)
        return f"{path}:{line}" if line else path

    def _fail(self, dotted: str, why: str) -> NotInWheelError:
        return NotInWheelError(
            f"{dotted} is not in SGLang {self.version} ({self.path.name}): {why}"
        )

    def find(self, dotted: str, *, instance: bool = False) -> str:
        """Where ``dotted`` is (``path:line``), or :class:`NotInWheelError`; ``instance``:
        the last part may be a ``self.<name>`` that the class's ``__init__`` assigns."""
        parts = dotted.split(".")
        cut = next((i for i in range(len(parts), 0, -1) if self.file(".".join(parts[:i]))), 0)
        if not cut:
            raise self._fail(dotted, f"no module {parts[0]} in the wheel")
        hit = _Hit(".".join(parts[:cut]))
        for i, name in enumerate(parts[cut:], cut):
            if hit.external:
                raise self._fail(
                    dotted, f"{'.'.join(parts[:i])} comes from {hit.external}, outside the wheel"
                )
            found = self._member(hit, name, instance=instance and i == len(parts) - 1)
            if found is None:
                kinds = {ast.ClassDef: "class", ast.FunctionDef: "function"}
                what = "module" if hit.node is None else kinds.get(type(hit.node), "name")
                raise self._fail(
                    dotted, f"{what} {'.'.join(parts[:i])} ({self.where(hit)}) has no {name}"
                )
            hit = found
        return self.where(hit)

    def problem(self, dotted: str, *, instance: bool = False) -> str | None:
        """:meth:`find`'s error message, or None when ``dotted`` is there."""
        try:
            self.find(dotted, instance=instance)
        except NotInWheelError as e:
            return str(e)
        return None
