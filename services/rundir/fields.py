"""Values of typed dataclass fields: text from the command line parsed by a field's declared type, a value checked
against that type, and a recipe written back as TOML (`albert config show`).

The types are the annotations of the config dataclasses (RunConfig's sections, albert_core's AlbertConfig): str,
int, float, bool, list[T], dict[str, T], Any, and `T | None`.
"""

from __future__ import annotations

import json
import re
import tomllib
import types
import typing
from typing import Any

_NOT_TOML = object()


def type_hints(cls: type) -> dict[str, Any]:
    """The declared type of each field of a dataclass (its annotations resolved)."""
    return typing.get_type_hints(cls)


def describe(hint: Any) -> str:
    """The kind of value a type takes, as an error message says it."""
    inner = _optional_of(hint)
    if inner is not None:
        return f"{describe(inner)} or none"
    origin = typing.get_origin(hint)
    if origin is list:
        return "a list (TOML: [a, b])"
    if origin is dict:
        return "a table (TOML: {key = value})"
    return {str: "text", bool: "true or false", int: "an integer", float: "a number"}.get(hint, "a value")


def parse_text(hint: Any, text: str) -> Any:
    """The value of `text` (as `--set` gives it) for a field of type `hint`: a str field takes the text as it is
    (a TOML quoted string is unquoted), other types read it as TOML (3, 0.1, true, [1, 2], {a = 1}); ValueError
    says what the field expected."""
    inner = _optional_of(hint)
    if inner is not None:
        return None if text.strip().lower() in ("none", "null") else parse_text(inner, text)
    if hint is str:
        quoted = _toml(text) if text.strip()[:1] in ('"', "'") else _NOT_TOML
        return quoted if isinstance(quoted, str) else text
    value = _toml(text)
    if hint is Any:
        return text if value is _NOT_TOML else value
    if value is _NOT_TOML and hint is float:
        try:
            value = float(text)
        except ValueError:
            pass
    if value is _NOT_TOML:
        raise ValueError(f"expected {describe(hint)}, got {text!r}")
    check_value(hint, value)
    return value


def check_value(hint: Any, value: Any) -> None:
    """ValueError unless `value` is of type `hint` (an int does for a float; a bool is never a number)."""
    if not fits(hint, value):
        raise ValueError(f"expected {describe(hint)}, got {value!r}")


def fits(hint: Any, value: Any) -> bool:
    if hint is Any:
        return True
    inner = _optional_of(hint)
    if inner is not None:
        return value is None or fits(inner, value)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list:
        return isinstance(value, list) and all(fits(args[0] if args else Any, v) for v in value)
    if origin is dict:
        item = args[1] if args else Any
        return isinstance(value, dict) and all(isinstance(k, str) and fits(item, v) for k, v in value.items())
    if hint is bool or isinstance(value, bool):
        return hint is bool and isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float)
    return isinstance(value, hint) if isinstance(hint, type) else True


def _optional_of(hint: Any) -> Any:
    """T of `T | None` (None for any other type)."""
    if typing.get_origin(hint) not in (typing.Union, types.UnionType):
        return None
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if len(args) == 1 and len(typing.get_args(hint)) == 2 else None


def _toml(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return _NOT_TOML


# --- TOML out ----------------------------------------------------------------------------------------------------

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def to_toml(sections: dict[str, dict[str, Any]]) -> str:
    """A recipe's sections as TOML that tomllib reads back to the same dict: each section's values, then each of its
    non-empty tables as `[section.name]`. A value of None (TOML has no null) is written as a comment."""
    lines: list[str] = []
    for name, values in sections.items():
        tables = {k: v for k, v in values.items() if isinstance(v, dict) and v}
        lines += [f"[{_key(name)}]", *_entries({k: v for k, v in values.items() if k not in tables}), ""]
        for key, table in tables.items():
            lines += [f"[{_key(name)}.{_key(key)}]", *_entries(table), ""]
    return "\n".join(lines)


def _entries(values: dict[str, Any]) -> list[str]:
    return [f"# {_key(k)}: none" if v is None else f"{_key(k)} = {toml_value(v)}" for k, v in values.items()]


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if value != value else repr(value)  # inf, -inf and 1e-05 are TOML too
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = ", ".join(f"{_key(k)} = {toml_value(v)}" for k, v in value.items() if v is not None)
        return "{ " + items + " }" if items else "{}"
    raise TypeError(f"no TOML form for {value!r}")


def _key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else json.dumps(key, ensure_ascii=False)
