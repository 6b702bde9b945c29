"""JSON round-trip for the planner's frozen dataclasses, driven by their type hints."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def to_jsonable(obj: Any) -> Any:
    """Dataclasses become dicts and tuples become lists, recursively."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    return obj


def from_jsonable(cls: type[T], data: Any) -> T:
    """Rebuild an instance of ``cls`` (a dataclass or a typed container) from JSON data."""
    return _build(cls, data)


def dumps(obj: Any) -> str:
    return json.dumps(to_jsonable(obj), sort_keys=True)


def loads(cls: type[T], text: str) -> T:
    return from_jsonable(cls, json.loads(text))


def _has_default(f: dataclasses.Field) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def _build(tp: Any, data: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if data is None:
            return None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _build(inner, data)
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_build(args[0], v) for v in data)
        return tuple(_build(a, v) for a, v in zip(args, data, strict=True))
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        return {_build(key_tp, k): _build(val_tp, v) for k, v in data.items()}
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        # A field missing from the data keeps its default: JSON written before the field existed.
        kwargs = {f.name: _build(hints[f.name], data[f.name]) for f in dataclasses.fields(tp)
                  if f.init and (f.name in data or not _has_default(f))}
        return tp(**kwargs)
    if tp is float and isinstance(data, int):
        return float(data)
    if tp is int and isinstance(data, str):
        return int(data)
    return data
