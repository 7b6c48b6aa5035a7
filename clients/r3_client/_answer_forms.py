"""The service's answers as records: each defined once, as a dataclass; every form derived.

The dataclasses (:class:`~r3_client._routing.Segment`, and ``PutResult``,
``SegmentInfo``, ``RolloutInfo`` in :mod:`r3_client._answers`) are the one definition.
From them come:

- the HTTP JSON (:func:`to_plain` / :func:`from_plain`; FastAPI takes the
  dataclasses as response models, so the OpenAPI schema follows too);
- the gRPC messages (:func:`to_message` / :func:`from_message`);
- the messages' definitions in ``r3_cache.proto`` (:func:`proto_messages`, written
  between the ``BEGIN/END GENERATED`` markers by ``scripts/gen_proto.sh``;
  ``tests/service/test_proto.py`` fails when the file is stale).

Adding a field to one of these answers is one line in its dataclass, then
``scripts/gen_proto.sh``.  Field numbers follow declaration order, so append
fields, never reorder or remove them (that would renumber the wire format).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from r3_client._exceptions import ProtocolError

T = TypeVar("T")

__all__ = ["from_message", "from_plain", "proto_messages", "to_message", "to_plain"]


@functools.cache  # (type objects: a handful, read per field of every answer)
def _optional(tp: Any) -> tuple[bool, Any]:
    """``(True, X)`` for ``X | None``, else ``(False, tp)``."""
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return True, args[0]
    return False, tp


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """``cls``'s resolved field types, once per class: resolving them evaluates the
    annotations' strings (``compile``), which a stat of a thousand rollouts did per
    record, holding the GIL a training loop needs."""
    return get_type_hints(cls)


# ---------------------------------------------------------------- plain (JSON) form


def to_plain(record: Any) -> Any:
    """``record`` as JSON-ready dicts and lists (tuples become lists)."""
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        return {f.name: to_plain(getattr(record, f.name)) for f in dataclasses.fields(record)}
    if isinstance(record, list | tuple):
        return [to_plain(x) for x in record]
    return record


def from_plain(cls: type[T], data: Any) -> T:
    """A ``cls`` record from its plain form; :class:`ProtocolError` on anything else."""
    try:
        return typing.cast(T, _plain_value(cls, data))
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"unexpected {cls.__name__} answer: {exc!r}") from None


def _plain_value(tp: Any, value: Any) -> Any:
    optional, tp = _optional(tp)
    if value is None:
        if optional:
            return None
        raise ValueError("null where a value is required")
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise TypeError(f"{tp.__name__} must be an object, got {type(value).__name__}")
        hints = _hints(tp)
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(tp):
            if f.name in value:
                kwargs[f.name] = _plain_value(hints[f.name], value[f.name])
            elif _optional(hints[f.name])[0]:
                kwargs[f.name] = None  # an absent optional field reads as None
            elif f.default is dataclasses.MISSING:
                raise KeyError(f.name)
        return tp(**kwargs)
    return _scalar_or_tuple(tp, value, _plain_value)


def _scalar_or_tuple(tp: Any, value: Any, inner: Any) -> Any:
    origin = get_origin(tp)
    if origin is tuple:
        (item,) = (a for a in get_args(tp) if a is not Ellipsis)
        return tuple(inner(item, x) for x in value)
    if origin is Literal:
        if value not in get_args(tp):
            raise ValueError(f"{value!r} is not one of {get_args(tp)}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise TypeError(f"expected a boolean, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise TypeError(f"expected an integer, got {value!r}")
        return int(value)
    if tp is float:
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise TypeError(f"expected a string, got {value!r}")
        return value
    raise TypeError(f"no conversion for {tp!r}")


# ---------------------------------------------------------------- protobuf form


def to_message(record: Any, message_cls: Any) -> Any:
    """``record`` as a ``message_cls`` protobuf message (``None`` leaves a field unset)."""
    from google.protobuf.message_factory import GetMessageClass

    kwargs: dict[str, Any] = {}
    fields_by_name = message_cls.DESCRIPTOR.fields_by_name
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if value is None:
            continue
        fd = fields_by_name[f.name]
        if fd.message_type is not None:
            sub = GetMessageClass(fd.message_type)
            is_list = isinstance(value, list | tuple)
            kwargs[f.name] = (
                [to_message(x, sub) for x in value] if is_list else to_message(value, sub)
            )
        else:
            kwargs[f.name] = list(value) if isinstance(value, list | tuple) else value
    return message_cls(**kwargs)


def from_message(message: Any, cls: type[T]) -> T:
    """A ``cls`` record from its protobuf message (an unset optional field is None)."""
    try:
        return typing.cast(T, _message_value(cls, message))
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"unexpected {cls.__name__} message: {exc!r}") from None


def _message_value(tp: Any, message: Any) -> Any:
    hints = _hints(tp)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(tp):
        optional, inner = _optional(hints[f.name])
        if optional and not message.HasField(f.name):
            kwargs[f.name] = None
            continue
        value = getattr(message, f.name)
        kwargs[f.name] = _message_field(inner, value)
    return tp(**kwargs)


def _message_field(tp: Any, value: Any) -> Any:
    if dataclasses.is_dataclass(tp):
        return _message_value(tp, value)
    return _scalar_or_tuple(tp, value, _message_field)


# ---------------------------------------------------------------- .proto definitions

_SCALARS = {int: "int64", str: "string", bool: "bool", float: "double"}


def _proto_type(tp: Any, names: dict[type, str]) -> str:
    if dataclasses.is_dataclass(tp):
        return names[typing.cast(type, tp)]
    if get_origin(tp) is Literal:
        return _SCALARS[type(get_args(tp)[0])]
    return _SCALARS[tp]


def proto_messages(records: dict[type, str]) -> str:
    """The ``.proto`` message definitions of ``records`` (dataclass -> message name)."""
    out = []
    for cls, name in records.items():
        hints = _hints(cls)
        lines = [f"message {name} {{"]
        for number, f in enumerate(dataclasses.fields(cls), start=1):
            optional, tp = _optional(hints[f.name])
            if get_origin(tp) is tuple:
                (item,) = (a for a in get_args(tp) if a is not Ellipsis)
                label = f"repeated {_proto_type(item, records)}"
            else:
                label = ("optional " if optional else "") + _proto_type(tp, records)
            lines.append(f"  {label} {f.name} = {number};")
        lines.append("}")
        out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"
