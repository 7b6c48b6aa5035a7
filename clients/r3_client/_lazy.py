"""Module attributes that load on first access (PEP 562), for modules whose names pull in
heavy dependencies (httpx, grpc, protobuf) that most importers never use."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(
    namespace: dict[str, Any], table: dict[str, tuple[str, str | None]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module's ``__getattr__`` and ``__dir__`` serving ``table``'s names lazily.

    ``table`` maps a name to ``(module, attribute)``, or ``(module, None)`` for the
    module itself; ``namespace`` is the module's ``globals()``, where a loaded name is
    kept so later lookups skip ``__getattr__``.
    """
    module_name = namespace["__name__"]

    def getattr_(name: str) -> Any:
        where = table.get(name)
        if where is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        module = importlib.import_module(where[0])
        value = module if where[1] is None else getattr(module, where[1])
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(table))

    return getattr_, dir_
