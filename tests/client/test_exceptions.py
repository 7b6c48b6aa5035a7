"""The exception tree: one module, one code per class, drawn in full in its docstring."""

from __future__ import annotations

import r3_client
from r3_client import _exceptions
from r3_client._exceptions import R3Error, ServiceError, _all_subclasses, error_for_code


def test_every_error_has_its_own_code_and_round_trips() -> None:
    classes = _all_subclasses(R3Error)
    codes = [cls.code for cls in classes]
    assert len(codes) == len(set(codes)), sorted(codes)
    assert R3Error.code not in codes
    for cls in classes:
        if cls is ServiceError:
            continue
        assert type(error_for_code(cls.code, "x")) is cls


def test_every_error_lives_in_the_tree_module_and_is_drawn_and_exported() -> None:
    doc = _exceptions.__doc__ or ""
    for cls in _all_subclasses(R3Error):
        assert cls.__module__ == "r3_client._exceptions", cls
        assert f" {cls.__name__}" in doc, f"{cls.__name__} missing from the drawn tree"
        assert getattr(r3_client, cls.__name__) is cls


def test_replay_errors_are_in_the_tree() -> None:
    from r3_client.replay import ReplayError
    from r3_client.replay.megatron import MegatronReplayError

    assert issubclass(MegatronReplayError, ReplayError)
    assert issubclass(ReplayError, R3Error) and issubclass(ReplayError, ValueError)
    assert type(error_for_code("replay_error", "x")) is ReplayError
    assert type(error_for_code("r3_error", "x")) is ServiceError  # the generic code is no class
