"""Canonical JSON and a strict dataclass codec (pure: no I/O).

Every durable record is a frozen dataclass. :func:`encode` turns it into plain JSON
values; :func:`decode` rebuilds it and refuses anything it does not expect: unknown
fields, missing fields, wrong types. Errors name the dotted path of the bad field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import types
import typing
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")

JsonValue = Any  # a JSON value passed through as is (validated as JSON-serialisable)


class DecodeError(ValueError):
    """A record does not match its schema; ``path`` names the offending field."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


def canonical_bytes(value: Any) -> bytes:
    """Canonical JSON: sorted keys, no spaces, UTF-8, no NaN/Infinity."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def digest(value: Any) -> str:
    """``sha256:<hex>`` of the canonical JSON of ``value``."""
    return "sha256:" + hashlib.sha256(canonical_bytes(value)).hexdigest()


OMIT_IF_DEFAULT = "omit_if_default"
"""Field metadata key: a field added later is left out of the JSON while it holds its
default, so records written before it existed keep their exact bytes (and digests)."""


def optional_field(default: Any = None) -> Any:
    """A dataclass field added without a schema bump (see :data:`OMIT_IF_DEFAULT`)."""
    return dataclasses.field(default=default, metadata={OMIT_IF_DEFAULT: True})


_SCALARS = frozenset({str, int, float, bool, type(None)})
_Plan = tuple[tuple[str, bool, Any], ...]
_plans: dict[type, _Plan] = {}


def _plan(cls: type) -> _Plan:
    """(name, omitted while default, default) of each field of a dataclass, in order;
    read once per class (a class's fields never change)."""
    plan = _plans.get(cls)
    if plan is None:
        plan = tuple(
            (f.name, bool(f.metadata.get(OMIT_IF_DEFAULT)), f.default)
            for f in dataclasses.fields(cls)
        )
        _plans[cls] = plan
    return plan


def encode(obj: Any) -> Any:
    """A dataclass tree as plain JSON values (tuples become lists)."""
    cls = type(obj)
    if cls in _SCALARS:  # exact types only: a subclass takes the general path below
        return obj
    if hasattr(cls, "__dataclass_fields__") and not isinstance(obj, type):
        out = {}
        for name, omit, default in _plan(cls):
            value = getattr(obj, name)
            if not (omit and value == default):
                out[name] = encode(value)
        return out
    if isinstance(obj, tuple | list):
        return [encode(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): encode(v) for k, v in obj.items()}
    return obj


def decode(cls: type[T], data: Any, path: str = "$") -> T:
    """Rebuild ``cls`` from JSON values, strictly."""
    return typing.cast(T, _decode(cls, data, path))


_hints_cache: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _hints_cache:
        _hints_cache[cls] = get_type_hints(cls)
    return _hints_cache[cls]


def _decode_dataclass(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise DecodeError(path, f"expected an object for {cls.__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise DecodeError(path, f"unknown field(s) {', '.join(unknown)}")
    missing = sorted(
        name
        for name, f in fields.items()
        if name not in data and not f.metadata.get(OMIT_IF_DEFAULT)
    )
    if missing:
        raise DecodeError(path, f"missing field(s) {', '.join(missing)}")
    hints = _hints(cls)
    kwargs = {name: _decode(hints[name], data[name], f"{path}.{name}") for name in data}
    return cls(**kwargs)


def _decode(tp: Any, data: Any, path: str) -> Any:
    if tp is Any:
        try:
            canonical_bytes(data)  # must at least be JSON (no NaN/Infinity, no foreign types)
        except (TypeError, ValueError) as exc:
            raise DecodeError(path, f"not a JSON value: {exc}") from exc
        return data
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _decode_dataclass(tp, data, path)
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return _decode_union(tp, data, path)
    if origin is tuple:
        args = get_args(tp)
        if not isinstance(data, list):
            raise DecodeError(path, "expected a list")
        return tuple(_decode(args[0], v, f"{path}[{i}]") for i, v in enumerate(data))
    if origin is dict:
        _, val_tp = get_args(tp)
        if not isinstance(data, dict):
            raise DecodeError(path, "expected an object")
        return {k: _decode(val_tp, v, f"{path}.{k}") for k, v in data.items()}
    return _decode_scalar(tp, data, path)


def _decode_union(tp: Any, data: Any, path: str) -> Any:
    """An optional or a union: None where allowed, else the first alternative that
    decodes (every alternative's complaint is reported when none does)."""
    args = get_args(tp)
    if data is None and type(None) in args:
        return None
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _decode(arg, data, path)
        except DecodeError as exc:
            errors.append(str(exc))
    raise DecodeError(path, "; ".join(errors) or "no alternative matched")


def _decode_scalar(tp: Any, data: Any, path: str) -> Any:
    """A bool, int, float or str, strictly: a bool is no number, a float must be finite."""
    if tp is bool:
        if not isinstance(data, bool):
            raise DecodeError(path, "expected true or false")
        return data
    if tp is int:
        if isinstance(data, bool) or not isinstance(data, int):
            raise DecodeError(path, "expected an integer")
        return data
    if tp is float:
        if isinstance(data, bool) or not isinstance(data, int | float):
            raise DecodeError(path, "expected a number")
        try:
            number = float(data)
        except OverflowError as exc:
            raise DecodeError(path, "number out of range") from exc
        if not math.isfinite(number):
            raise DecodeError(path, "expected a finite number")
        return number
    if tp is str:
        if not isinstance(data, str):
            raise DecodeError(path, "expected a string")
        return data
    raise DecodeError(path, f"unsupported type {tp!r}")
