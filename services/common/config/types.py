"""How a YAML mapping becomes a frozen config record: pydantic validates it, each constraint beside its field.

A section is a frozen dataclass marked with `config_section`. Its fields keep plain Python types
(`int`, `bool`, `float`, `tuple[str, ...]`, `Literal[...]`, a nested section) or one of the
constrained aliases below (`PositiveInt`, `Share`, `Port`, ...); `config_section` makes pydantic
read them as a YAML author means them: an integer is an integer (not `2.5`, `"2"` or `true`), a
boolean is `true` or `false`, a number may be written as an integer or as YAML 1.1's `1e-6` (which
it reads as a string), a list may be a single item, and an unknown key is an error. `parse_section`
returns every error at once as "full.key.path: message", with "did you mean" for a misspelt key.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Annotated, Any, Literal

import pydantic
from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, Strict, TypeAdapter
from pydantic_core import PydanticCustomError


def _number(value: Any) -> Any:
    if isinstance(value, bool):  # pydantic would read true as 1.0
        raise PydanticCustomError("float_type", "")
    if isinstance(value, str):  # YAML 1.1 reads `1e-6` (no dot) as a string: the number it spells
        try:
            return float(value)
        except ValueError:
            pass
    return value


def _one_or_list(value: Any) -> Any:
    return [value] if isinstance(value, (str, int, float)) else value


def _port(value: int) -> int:
    if not 0 <= value < 65536:
        raise PydanticCustomError("tcp_port", "{value} is not a TCP port (1-65535, or 0)", {"value": value})
    return value


PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]
Probability = Annotated[float, Field(gt=0, le=1)]  # in (0, 1]
Share = Annotated[float, Field(ge=0, le=1)]
Port = Annotated[int, AfterValidator(_port)]


def _strict(tp: Any) -> Any:
    """`tp` as the config reads YAML into it (see the module docstring)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is int or tp is bool:
        return Annotated[tp, Strict()]
    if tp is float:
        return Annotated[float, BeforeValidator(_number)]
    if origin is Annotated:
        return Annotated[(_strict(args[0]), *tp.__metadata__)]
    if origin is tuple:
        return Annotated[tuple[_strict(args[0]), ...], BeforeValidator(_one_or_list)]
    if origin in (typing.Union, types.UnionType):
        return typing.Union[tuple(_strict(a) for a in args)]
    return tp  # str, Literal, a nested section


_SECTION_CONFIG = ConfigDict(extra="forbid")


def config_section(cls: type) -> type:
    """Makes `cls` a frozen dataclass whose fields pydantic reads strictly (the module docstring), unknown keys refused."""
    hints = typing.get_type_hints(cls, include_extras=True)
    cls.__annotations__ = {name: _strict(hints[name]) for name in cls.__annotations__}
    cls = dataclasses.dataclass(frozen=True)(cls)
    cls.__pydantic_config__ = _SECTION_CONFIG
    return cls


def type_name(tp: Any) -> str:
    """A field's type in words (docs/config.md and error messages)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        if any(getattr(m, "func", None) is _port for m in tp.__metadata__):
            return "TCP port"
        bounds = _bounds(tp)
        return f"{type_name(args[0])} {bounds}".rstrip()
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in args)
    if origin is tuple:
        return f"list of {type_name(args[0])}"
    if origin is Literal:
        return " \\| ".join("''" if a == "" else str(a) for a in args)  # '' (off) shown, not a blank
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


# ---------------------------------------------------------------- errors worded as the config's own


def _field_at(cls: type, loc: tuple) -> tuple[str, Any, type | None, Any]:
    """Walks an error's location from section `cls`: (the key path, the field's type there, the section holding it,
    the union the location passed through, if any).

    pydantic names the union member it tried after a union field's key; the walk follows the list member (the only
    member with items) and stops at anything else that is not a key or a list index (a validator's name).
    """
    path, tp, section, union = "", cls, None, None
    for part in loc:
        bare = _bare(tp)
        members = typing.get_args(bare) if typing.get_origin(bare) in (typing.Union, types.UnionType) else (bare,)
        base = next((a for a in members if dataclasses.is_dataclass(a)), None)
        items = next((_bare(a) for a in members if typing.get_origin(_bare(a)) is tuple), None)
        if isinstance(part, str) and base is not None:
            hints = typing.get_type_hints(base, include_extras=True)
            section, path = base, f"{path}.{part}" if path else part
            if part not in hints:
                return path, None, section, union
            tp = hints[part]
        elif isinstance(part, int) and items is not None:
            path, tp = f"{path}[{part}]", typing.get_args(items)[0]
        elif isinstance(part, str) and len(members) > 1:
            union = tp  # the member pydantic names: only a list member has more to walk into
        else:
            break
    return path, tp, section, union


def _bare(tp: Any) -> Any:
    while typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _bounds(tp: Any) -> str:
    """A constrained number's range in words: "> 0", ">= 0", "in (0, 1]"; "" when it has none."""
    lower = upper = None
    for meta in getattr(tp, "__metadata__", ()):
        for m in getattr(meta, "metadata", [meta]):
            for attr, sign in (("gt", "("), ("ge", "[")):
                if getattr(m, attr, None) is not None:
                    lower = (sign, getattr(m, attr))
            for attr, sign in (("lt", ")"), ("le", "]")):
                if getattr(m, attr, None) is not None:
                    upper = (sign, getattr(m, attr))
    if lower and upper:
        return f"in {lower[0]}{lower[1]}, {upper[1]}{upper[0]}"
    if lower:
        return f"{'>' if lower[0] == '(' else '>='} {lower[1]}"
    return f"{'<' if upper[0] == ')' else '<='} {upper[1]}" if upper else ""


_EXPECTED = {"int": "an integer", "bool": "true or false", "float": "a number", "string": "a string", "tuple": "a list",
             "list": "a list", "dataclass": "a mapping (section)", "dict": "a mapping (section)"}


def _message(error: dict, path: str, tp: Any, section: type | None) -> str:
    kind, value = error["type"], error["input"]
    got = f"{type(value).__name__} {value!r}"
    if kind == "unexpected_keyword_argument":
        names = [f.name for f in dataclasses.fields(section)] if section else []
        close = difflib.get_close_matches(path.rsplit(".", 1)[-1], names, n=1)
        return f"unknown key ({f'did you mean {close[0]!r}?' if close else 'known keys: ' + ', '.join(sorted(names))})"
    if kind == "literal_error":
        return f"{value!r} is not one of {', '.join(map(str, typing.get_args(_bare(tp))))}"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return f"must be {_bounds(tp)}, got {value!r}"
    for prefix, words in _EXPECTED.items():
        if kind.startswith(prefix):
            return f"expected {words}, got {value!r}" if prefix == "bool" else f"expected {words}, got {got}"
    return error["msg"]


_ADAPTERS: dict[type, TypeAdapter] = {}


def parse_section(cls: type, data: dict, path: str = "") -> tuple[Any, list[str]]:
    """`data` read into section `cls`: (the record, []) or (None, every error as "key.path: message")."""
    adapter = _ADAPTERS.get(cls) or _ADAPTERS.setdefault(cls, TypeAdapter(cls))
    try:
        return adapter.validate_python(data), []
    except pydantic.ValidationError as exc:
        errors: dict[str, str] = {}
        for error in exc.errors(include_url=False):
            where, tp, section, union = _field_at(cls, error["loc"])
            full = ".".join(p for p in (path, where) if p) or cls.__name__
            if union is not None and tp is union:  # the value fits no member: one error for the field
                value = error["input"]
                message = f"expected {type_name(union)}, got {type(value).__name__} {value!r}"
            else:
                message = _message(error, where, tp, section)
            errors.setdefault(full, f"{full}: {message}")
        # an item's own error says more than its list's "fits no member"
        return None, [e for key, e in errors.items() if not any(k.startswith(key + "[") for k in errors)]
