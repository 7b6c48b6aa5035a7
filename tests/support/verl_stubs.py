"""What the tests that drive verl's own code on one process stand in for (tests only):
``ray``, which ``verl.protocol`` imports at module level where it is not installed, and
process groups of other sizes and ranks."""

from __future__ import annotations

import importlib.util
import sys
import types


def stub_ray() -> None:
    """Put a stand-in ``ray`` module in ``sys.modules`` unless ray is importable.

    verl (installed ``--no-deps``) imports ``ray`` for ``DataProtoFuture`` only; nothing the
    tests drive calls it, and the stand-in raises if anything does.
    """
    if "ray" in sys.modules or importlib.util.find_spec("ray") is not None:
        return
    ray = types.ModuleType("ray")

    def _absent(*args: object, **kwargs: object) -> None:
        raise RuntimeError("ray is a stub in tests/support/verl_stubs.py")

    ray.ObjectRef = type("ObjectRef", (), {})  # type: ignore[attr-defined]
    ray.get = _absent  # type: ignore[attr-defined]
    sys.modules["ray"] = ray


class FakeGroup:
    """A process group of ``size`` ranks seen from rank ``rank`` (only size/rank are asked)."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank
