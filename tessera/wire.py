"""One encode/decode pair for every typed message crossing a role boundary.

Messages are frozen dataclasses. ``to_wire`` turns one into JSON-ready builtins and
``from_wire`` rebuilds it, checking types on the way in so that a malformed body becomes a
:class:`~tessera.errors.DecodeError` that names the field, never a traceback deep inside a
handler. Supported field types: str, int, float, bool, enums, nested dataclasses, tuples
(``tuple[T, ...]``), lists, dicts with str keys, and ``X | None``.

Keys a message does not have are ignored between roles (a newer peer may add fields), and
refused on bodies a client writes by hand (``closed``): a misspelt optional field would
otherwise be dropped without a word and the request served as if it had been left out.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import types
import typing
from collections.abc import Collection, Mapping
from functools import cache
from typing import Any, TypeVar, Union, cast

import orjson

from tessera.errors import DecodeError

T = TypeVar("T")
WIRE_VERSION = 1


@cache
def _hints(cls: Any) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@cache
def _fields(cls: Any) -> tuple[dataclasses.Field[Any], ...]:
    return dataclasses.fields(cls)


def to_wire(obj: Any) -> Any:
    """Dataclass (or builtin) -> JSON-ready builtins."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_wire(getattr(obj, f.name)) for f in _fields(type(obj))}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [to_wire(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_wire(v) for k, v in obj.items()}
    return obj


MAX_NAMED_UNKNOWN = 5  # unknown keys named in one message (each one costs a fuzzy match)
MAX_LISTED_KNOWN = 12  # a message lists the known fields when there are no more than this


def unknown_keys(value: Mapping[str, Any], known: Collection[str], path: str = "") -> str | None:
    """A message naming the keys of ``value`` not in ``known``, each with the nearest known one, or None."""
    unknown = [key for key in value if key not in known]
    if not unknown:
        return None
    where = f"{path}: " if path else ""
    out = []
    unmatched = False
    for key in unknown[:MAX_NAMED_UNKNOWN]:
        name = str(key) if len(str(key)) <= 64 else str(key)[:61] + "..."
        near = difflib.get_close_matches(name, list(known), n=1)
        unmatched |= not near
        out.append(f"{where}unknown field {name!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    if len(unknown) > MAX_NAMED_UNKNOWN:
        out.append(f"and {len(unknown) - MAX_NAMED_UNKNOWN} more unknown fields")
    if unmatched and len(known) <= MAX_LISTED_KNOWN:
        out.append(f"{where}known fields: {', '.join(sorted(known))}")
    return "; ".join(out)


def _fail(path: str, expected: str, value: Any) -> DecodeError:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return DecodeError(f"field {path or '<body>'}: expected {expected}, got {shown}")


def _convert(tp: Any, value: Any, path: str, closed: bool) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise _fail(path, "a value", value)
        non_none = [a for a in args if a is not type(None)]
        errors: list[DecodeError] = []
        for arg in non_none:
            try:
                return _convert(arg, value, path, closed)
            except DecodeError as exc:
                errors.append(exc)
        raise errors[0]
    if tp is Any:
        return value
    if origin in (tuple, list):
        if not isinstance(value, list):
            raise _fail(path, "an array", value)
        args = typing.get_args(tp)
        item_tp = args[0] if args else Any
        items = [_convert(item_tp, v, f"{path}[{i}]", closed) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise _fail(path, "an object", value)
        _, val_tp = typing.get_args(tp) or (str, Any)
        return {str(k): _convert(val_tp, v, f"{path}.{k}", closed) for k, v in value.items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _from_dict(tp, value, path, closed)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise _fail(path, "one of " + ", ".join(repr(m.value) for m in tp), value) from None
    if tp is bool:
        if not isinstance(value, bool):
            raise _fail(path, "true or false", value)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(path, "an integer", value)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(path, "a number", value)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _fail(path, "a string", value)
        return value
    raise TypeError(f"unsupported wire type {tp!r} at {path}")


def _from_dict(cls: type[T], value: Any, path: str, closed: bool) -> T:
    if not isinstance(value, dict):
        raise _fail(path, f"an object ({cls.__name__})", value)
    hints = _hints(cast(Any, cls))
    if closed:
        unknown = unknown_keys(value, [f.name for f in _fields(cast(Any, cls))], path)
        if unknown is not None:
            raise DecodeError(unknown)
    kwargs: dict[str, Any] = {}
    for f in _fields(cast(Any, cls)):
        sub = f"{path}.{f.name}" if path else f.name
        if f.name in value:
            kwargs[f.name] = _convert(hints[f.name], value[f.name], sub, closed)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise DecodeError(f"field {sub} is required")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise DecodeError(f"{path or cls.__name__}: {exc}") from None


def from_wire(cls: type[T], value: Any, *, closed: bool = False) -> T:
    """JSON builtins -> dataclass, with field-level type checks (raises DecodeError).

    ``closed``: a key that no (nested) dataclass has is refused, naming the nearest known one.
    """
    return _from_dict(cls, value, "", closed)


def encode(obj: Any) -> bytes:
    return orjson.dumps(to_wire(obj))


def loads(body: bytes | str) -> Any:
    """JSON builtins of a body (DecodeError if it is not JSON), before :func:`from_wire`."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise DecodeError(f"body is not valid JSON: {exc}") from None


def decode(cls: type[T], body: bytes | str) -> T:
    return from_wire(cls, loads(body))


def decode_tagged(classes: Mapping[str, type[T]], body: bytes | str, tag: str = "kind") -> T:
    """Decode one member of a tagged union: ``body[tag]`` names its class in ``classes``."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise DecodeError(f"body is not valid JSON: {exc}") from None
    kind = value.get(tag) if isinstance(value, dict) else None
    if not isinstance(kind, str) or kind not in classes:
        raise _fail(tag, "one of " + ", ".join(repr(k) for k in classes), kind)
    return from_wire(classes[kind], value)
