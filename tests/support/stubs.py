"""Stand-ins for packages a framework imports at module level that the path a test drives
never uses (tests only: ray, hydra, experiment loggers where they are not installed)."""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any


class Absent(type):
    """Any name of a stubbed package: its attributes are more of them (so annotations and
    ``except`` clauses that name them evaluate), and calling one raises."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = Absent(name, (Exception,), {"__module__": cls.__module__})
        setattr(cls, name, value)
        return value

    def __call__(cls, *args: object, **kwargs: object) -> Any:
        raise RuntimeError(f"{cls.__module__}.{cls.__name__} is a stub (tests/support/stubs.py)")


class StubModule(types.ModuleType):
    """A stubbed module: every attribute is an :class:`Absent`."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = Absent(name, (Exception,), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


def installed(name: str) -> bool:
    """Whether ``name`` is a real package (not a stub another test module left in place)."""
    if name in sys.modules:
        return getattr(sys.modules[name], "__spec__", None) is not None
    return importlib.util.find_spec(name) is not None


def stub_modules(names: list[str]) -> dict[str, types.ModuleType]:
    """Stub modules for dotted ``names`` (and their parents) whose top package is not
    installed, linked as attributes of their parents; existing stubs are extended."""
    out: dict[str, types.ModuleType] = {}
    for full in names:
        parts = full.split(".")
        if installed(parts[0]):
            continue
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            module = out.get(name) or sys.modules.get(name)
            if module is None:
                module = StubModule(name)
                module.__path__ = []
            out[name] = module
            if i > 1:
                setattr(out[".".join(parts[: i - 1])], parts[i - 1], module)
    return out
