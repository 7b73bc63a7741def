"""Stacks: an ordered, validated list of compressors, loaded from YAML or Python.

YAML shape::

    name: streaming            # optional, shared settings of the whole stack
    compressors:               # the pipeline, in order
      - window: {sinks: 4, recent: 1024}

Validation happens here, before any model is touched: unknown top-level keys,
unknown compressor names (the registered ones are listed), parameters (via each
compressor's config class), the pipeline order and exclusive axes.  Every error
is a :class:`~kvcompress.errors.ConfigError` naming the key path.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from .config import config_to_dict, parse_config
from .errors import ConfigError, bounded
from .manager import get_registry
from .pipeline import StackPipeline
from .registry import AXES, EXCLUSIVE_GROUPS, PIPELINE_ORDER, CompressorSpec, Registry
from .yamlsafe import load_file, read_yaml  # noqa: F401 - read_yaml is part of this module's API

#: Top-level keys a stack file may contain besides ``compressors``.
SETTINGS_KEYS = ("name", "description")


@dataclasses.dataclass(frozen=True)
class StackEntry:
    name: str
    spec: CompressorSpec
    config: Any
    path: str


@dataclasses.dataclass(frozen=True)
class Stack:
    """A validated compressor stack.  Build fresh compressor objects with :meth:`build`."""

    entries: tuple[StackEntry, ...]
    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    source: str = "<stack>"

    def build(self) -> StackPipeline:
        return StackPipeline([(e.name, e.spec.factory(e.config)) for e in self.entries],
                             sources=[e.spec.source for e in self.entries])

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.settings)
        out["compressors"] = [{e.name: config_to_dict(e.config)} for e in self.entries]
        return out

    @property
    def label(self) -> str:
        if "name" in self.settings:
            return str(self.settings["name"])
        return " + ".join(e.name for e in self.entries) or "none"

    def __len__(self) -> int:
        return len(self.entries)


def load_stack(path: str | os.PathLike) -> Stack:
    """Load and validate a stack file (never touches a model).  The file is read within the limits of
    :mod:`kvcompress.yamlsafe` (size, UTF-8 text, nesting depth, alias expansion)."""
    path = os.fspath(path)
    return parse_stack(load_file(path), source=path)


def parse_stack(data: Any, source: str = "<stack>", registry: Registry | None = None) -> Stack:
    """Validate a stack given as a mapping (the parsed YAML)."""
    registry = registry or get_registry()
    if not isinstance(data, Mapping):
        raise ConfigError("(top level)", "a mapping with a 'compressors' list", data,
                          hint=f"in {source}; see examples/stacks/window.yaml")
    for key in data:
        if key != "compressors" and key not in SETTINGS_KEYS:
            allowed = ", ".join(("compressors",) + SETTINGS_KEYS)
            raise ConfigError(_key(key), f"one of the top-level keys: {allowed}", key, hint="unknown key")
    if "compressors" not in data:
        raise ConfigError("compressors", "a list of compressors (use [] for no compression)", None,
                          hint="the key is missing")
    items = data["compressors"]
    if items is None:
        items = []
    if not isinstance(items, list):
        raise ConfigError("compressors", "a list of one-key mappings like '- window: {recent: 1024}'", items)
    for key in SETTINGS_KEYS:
        if key in data and not isinstance(data[key], str):
            raise ConfigError(key, "a string", data[key])
    entries: list[StackEntry] = []
    for i, item in enumerate(items):
        path = f"compressors[{i}]"
        if not isinstance(item, Mapping) or len(item) != 1:
            raise ConfigError(path, "a one-key mapping from a compressor name to its parameters", item)
        (name, params), = item.items()
        spec = registry.get(name) if isinstance(name, str) else None
        if spec is None:
            known = ", ".join(registry.names()) or "(none installed)"
            raise ConfigError(f"{path}.{_key(name)}", f"a registered compressor: {known}", name,
                              hint=registry.why_missing(name) or "unknown compressor; `kvcompress plugins` lists them")
        config = parse_config(spec.config, params, f"{path}.{name}")
        entries.append(StackEntry(name, spec, config, f"{path}.{name}"))
    _check_order(entries)
    stack = Stack(tuple(entries), {k: data[k] for k in SETTINGS_KEYS if k in data}, source)
    if entries:
        pipeline = stack.build()
        pipeline.validate_stack(entries=[(e.name, e.config) for e in entries], axes=[e.spec.axis for e in entries])
        _check_budgets(pipeline, [e.path for e in entries])
    return stack


def _check_budgets(pipeline: StackPipeline, paths: list[str]) -> None:
    """The budget check of :meth:`StackPipeline.check_budgets` before any model, on a stand-in layer (layouts
    that depend on the model's shapes are checked again, per layer, when a cache is built)."""
    from .state import LayerInfo

    try:
        pipeline.check_budgets(LayerInfo(0, 1, 1, 1, 64), paths)
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001 - a layout that needs the real model: checked when the cache is built
        return


def _key(key: Any) -> str:
    """A mapping key as it appears in a key path (a non-string key is quoted, bounded)."""
    return key if isinstance(key, str) else bounded(key, 60)


def _check_order(entries: list[StackEntry]) -> None:
    for j, later in enumerate(entries):
        for earlier in entries[:j]:
            a, b = earlier.spec.axis, later.spec.axis
            if EXCLUSIVE_GROUPS[a] == EXCLUSIVE_GROUPS[b]:
                raise ConfigError(
                    later.path, f"at most one compressor on the {EXCLUSIVE_GROUPS[b]} axis", later.name,
                    hint=f"{earlier.path} ({earlier.name}, axis {a}) already acts on it; remove one of them")
            if AXES[a] > AXES[b]:
                raise ConfigError(
                    later.path, f"stack order {PIPELINE_ORDER}", later.name,
                    hint=f"{later.name} (axis {b}) must come before {earlier.path} ({earlier.name}, axis {a}); "
                         "reorder the list")


def as_stack(stack: "Stack | str | os.PathLike | Mapping[str, Any] | None") -> Stack:
    """Accept a Stack, a path to a YAML file, a mapping, or None (no compression)."""
    if isinstance(stack, Stack):
        return stack
    if stack is None:
        return parse_stack({"compressors": []})
    if isinstance(stack, Mapping):
        return parse_stack(stack)
    if not isinstance(stack, (str, os.PathLike)):
        raise ConfigError("stack", "a kvcompress.Stack, a path to a YAML stack file, a mapping {'compressors': [...]} "
                          "or None", stack,
                          hint="a list of compressor entries goes under 'compressors': {'compressors': [...]}"
                          if isinstance(stack, (list, tuple)) else None)
    return load_stack(stack)
