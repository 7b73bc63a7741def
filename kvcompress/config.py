"""Typed, validated compressor configurations.

A compressor declares its parameters as a frozen dataclass whose fields are
created with :func:`param`.  :func:`parse_config` turns a user mapping (from
YAML or Python) into that dataclass and raises :class:`~kvcompress.errors.ConfigError`
with the full key path for every problem: unknown keys (listing the known ones),
wrong types, values out of range or not among the allowed choices.  Cross-field
rules live in the dataclass' ``check(path)`` method.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from .errors import ConfigError

_META = "kvcompress"


def param(
    default: Any,
    doc: str,
    *,
    type: type | tuple[type, ...] | None = None,  # noqa: A002 - mirrors dataclass vocabulary
    min: float | None = None,  # noqa: A002
    max: float | None = None,  # noqa: A002
    choices: tuple[Any, ...] | None = None,
    nullable: bool = False,
) -> Any:
    """Declare one configuration parameter of a compressor.

    Args:
        default: value used when the key is absent.
        doc: one-line description (shown by ``kvcompress plugins --all``).
        type: accepted Python type(s); inferred from ``default`` when omitted.
        min, max: inclusive numeric bounds.
        choices: closed set of allowed values.
        nullable: whether ``null`` (None) is accepted.
    """
    if type is None:
        type = builtins_type(default)
    meta = {"doc": doc, "type": type, "min": min, "max": max, "choices": choices, "nullable": nullable}
    return dataclasses.field(default=default, metadata={_META: meta})


def builtins_type(value: Any) -> type | tuple[type, ...]:
    if isinstance(value, bool):
        return bool
    if isinstance(value, int):
        return int
    if isinstance(value, float):
        return (int, float)
    if isinstance(value, str):
        return str
    raise TypeError(f"cannot infer a parameter type from default {value!r}; pass type=")


def _type_name(tp: type | tuple[type, ...]) -> str:
    if isinstance(tp, tuple):
        names = [t.__name__ for t in tp]
        return "a number" if set(names) == {"int", "float"} else " or ".join(names)
    return {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}.get(
        tp.__name__, tp.__name__
    )


def describe(field: dataclasses.Field) -> str:
    """Human description of the values a parameter accepts."""
    meta = field.metadata[_META]
    if meta["choices"] is not None:
        text = "one of " + ", ".join(repr(c) for c in meta["choices"])
    else:
        text = _type_name(meta["type"])
        lo, hi = meta["min"], meta["max"]
        if lo is not None and hi is not None:
            text += f" in [{lo}, {hi}]"
        elif lo is not None:
            text += f" >= {lo}"
        elif hi is not None:
            text += f" <= {hi}"
    if meta["nullable"]:
        text += " (or null)"
    return text


def _check_value(field: dataclasses.Field, value: Any, path: str) -> Any:
    meta = field.metadata[_META]
    if value is None:
        if meta["nullable"]:
            return None
        raise ConfigError(path, describe(field), value)
    tp = meta["type"]
    types = tp if isinstance(tp, tuple) else (tp,)
    as_float = float in types and int not in types  # a float parameter takes an integer too: `ratio: 1` is 1.0
    if as_float:
        types = types + (int,)
    # bool is a subclass of int: "recent: true" must not pass as 1.
    if isinstance(value, bool) and bool not in types:
        raise ConfigError(path, describe(field), value)
    if not isinstance(value, types):
        raise ConfigError(path, describe(field), value)
    if as_float:
        try:
            value = float(value)
        except OverflowError:  # an integer beyond any float
            raise ConfigError(path, describe(field), value) from None
    if meta["choices"] is not None and value not in meta["choices"]:
        raise ConfigError(path, describe(field), value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(path, describe(field), value)
        if meta["min"] is not None and value < meta["min"]:
            raise ConfigError(path, describe(field), value)
        if meta["max"] is not None and value > meta["max"]:
            raise ConfigError(path, describe(field), value)
    return value


def parse_config(cls: type, data: Any, path: str) -> Any:
    """Build the config dataclass ``cls`` from ``data``, validating every key.

    ``data`` may be ``None`` (all defaults) or a mapping.  Errors carry ``path``
    (e.g. ``compressors[0].window``) extended with the key name.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(path, "a mapping of parameters (or nothing for the defaults)", data)
    fields = {f.name: f for f in dataclasses.fields(cls) if _META in f.metadata}
    for key in data:
        if key not in fields:
            known = ", ".join(sorted(fields)) or "(none)"
            raise ConfigError(f"{path}.{key}", f"one of the known parameters: {known}", key,
                              hint="unknown parameter")
    values = {name: _check_value(fields[name], value, f"{path}.{name}") for name, value in data.items()}
    config = cls(**values)
    check = getattr(config, "check", None)
    if check is not None:
        check(path)
    return config


def config_to_dict(config: Any) -> dict[str, Any]:
    """Plain mapping of a config dataclass (what YAML would contain)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if _META in f.metadata}


def config_fields(cls: type) -> list[tuple[str, Any, str, str]]:
    """(name, default, allowed, doc) for every parameter of ``cls``."""
    out = []
    for f in dataclasses.fields(cls):
        if _META in f.metadata:
            out.append((f.name, f.default, describe(f), f.metadata[_META]["doc"]))
    return out
