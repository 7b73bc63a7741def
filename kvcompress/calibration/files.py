"""Reading calibration files (LeanK masks, low-rank bases, DoubleSparse channels) as untrusted input.

Every format is safetensors (nothing is unpickled).  :func:`read` checks, in this order and before any
tensor is used: the file exists, is a regular file of at most :data:`MAX_BYTES`; safetensors' own header
checks (header size, JSON, offsets against the file size) pass; the format tag matches; the tensor names
are exactly the expected ones; every tensor has an allowed dtype and rank (read from the header, before
loading); float tensors hold only finite values; and metadata values parse as their declared types
(integers, finite numbers, JSON objects).  Each problem is one :class:`CalibrationFileError` naming the
file, the tensor or metadata key, what was expected and (bounded) what was found.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Callable

import torch

from ..errors import ConfigError, shorten
from ..files import check_regular_file

#: Largest calibration file read (a low-rank basis with a value basis for an 80-layer, 64-KV-head model
#: of head_dim 128 is about 340 MB).
MAX_BYTES = 1 << 30
#: Longest metadata value parsed (JSON settings of a real file are a few hundred characters).
MAX_META_CHARS = 1 << 16

FLOAT = ("F16", "BF16", "F32", "F64")
INT = ("I32", "I64")


class CalibrationFileError(ConfigError):
    """A calibration file is missing, malformed, or was made for another model.

    ``path`` is the file, or the stack key that names it (:meth:`at`); ``file`` is always the file.  The
    message does not quote ``got``, which is already a (bounded) sentence.
    """

    kind = "calibration file"
    default_hint: str | None = None

    def __init__(self, path: str, allowed: str, got: Any = None, hint: str | None = None, key: str | None = None):
        hint = hint or self.default_hint
        self.file, self.path, self.allowed, self.got, self.hint = path, key or path, allowed, got, hint
        msg = (f"{key}: " if key else "") + f"{self.kind} {shorten(path, 200)}: expected {shorten(allowed)}, " \
            f"got {shorten(got, 300)}"
        Exception.__init__(self, msg + (f". {hint[0].upper()}{hint[1:]}" if hint else ""))

    def at(self, key: str) -> "CalibrationFileError":
        """The same error, prefixed with the stack key path that named the file."""
        return type(self)(self.file, self.allowed, self.got, self.hint, key=key)


@dataclasses.dataclass(frozen=True)
class Tensor:
    """What one tensor of a format must be: allowed safetensors dtypes, rank, and whether it may be absent."""

    dtypes: tuple[str, ...]
    ndim: int
    required: bool = True

    def describe(self) -> str:
        kind = "a float" if self.dtypes == FLOAT else "an integer" if self.dtypes == INT else "/".join(self.dtypes)
        return f"{kind} tensor of rank {self.ndim}"


def _json_object(text: str) -> dict:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


def _json(text: str) -> Any:
    return json.loads(text)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("not finite")
    return value


#: metadata value parsers, by declared type (the name is what an error says was expected)
META_TYPES: dict[str, Callable[[str], Any]] = {"an integer": int, "a finite number": _finite,
                                                "a JSON object": _json_object, "JSON": _json}


def validate_file(key: str, loader: Callable[[str], Any], path: str) -> Any:
    """``loader(path)`` at stack-validation time; a file error names the stack key too."""
    try:
        return loader(path)
    except CalibrationFileError as exc:
        raise exc.at(key) from None


def read(path: str | os.PathLike, error: type[CalibrationFileError], what: str, fmt: str,
         tensors: dict[str, Tensor], meta: dict[str, str], required_meta: tuple[str, ...] = (),
         hint: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, metadata)`` of a calibration file after every check of the module docstring.

    Args:
        error: the error class to raise (its ``kind`` names the file in messages).
        what: the file's description ("LeanK mask file"); fmt: its ``format`` metadata tag.
        tensors: name -> :class:`Tensor` rule (no other name is accepted).
        meta: metadata key -> a key of :data:`META_TYPES` (parsed when present; other keys stay strings).
        required_meta: metadata keys that must be present.
    """
    from safetensors import safe_open

    path = os.fspath(path)

    def fail(allowed: str, got: Any, extra: str | None = None) -> CalibrationFileError:
        return error(path, allowed, got, hint=extra or hint)

    if not os.path.lexists(path):
        raise fail(f"an existing {what}", "no such file")
    check_regular_file(path, what, MAX_BYTES, lambda allowed, got, extra: fail(allowed, got, extra))
    try:
        with safe_open(path, framework="pt") as fh:
            raw = dict(fh.metadata() or {})
            if raw.get("format") != fmt:
                raise fail(f"a {error.kind} of format {fmt!r}", shorten(raw.get("format", "no format tag"), 100))
            names = set(fh.keys())
            missing = sorted(n for n, rule in tensors.items() if rule.required and n not in names)
            unknown = sorted(names - set(tensors))
            if missing or unknown:
                raise fail(f"the tensors {', '.join(tensors)}", f"{', '.join(sorted(names)) or 'none'}"
                           + (f" (missing: {', '.join(missing)})" if missing else "")
                           + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
            for name in sorted(names):
                part = fh.get_slice(name)
                dtype, shape = part.get_dtype(), part.get_shape()
                if dtype not in tensors[name].dtypes or len(shape) != tensors[name].ndim:
                    raise fail(f"tensor '{name}' as {tensors[name].describe()}", f"{dtype} of shape {tuple(shape)}")
            loaded = {name: fh.get_tensor(name) for name in sorted(names)}
    except CalibrationFileError:
        raise
    except Exception as exc:  # safetensors' own header checks raise its own error types
        raise fail(f"a safetensors file of format {fmt!r}", f"unreadable ({type(exc).__name__}: {exc})") from None
    for name, t in loaded.items():
        if t.is_floating_point():
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                raise fail(f"finite values in tensor '{name}'", f"{bad:,} NaN or infinite values of {t.numel():,}")
    absent = [key for key in required_meta if key not in raw]
    if absent:
        raise fail(f"a {fmt} file with the metadata {', '.join(required_meta)}", f"none for {', '.join(absent)}")
    parsed: dict[str, Any] = dict(raw)
    for key, kind in meta.items():
        if key in raw:
            try:
                if len(raw[key]) > MAX_META_CHARS:
                    raise ValueError("too long")
                parsed[key] = META_TYPES[kind](raw[key])
            except (ValueError, TypeError, OverflowError, RecursionError):
                raise fail(f"metadata '{key}' as {kind} (at most {MAX_META_CHARS:,} characters)",
                           repr(shorten(raw[key], 80))) from None
    return loaded, parsed


__all__ = ["CalibrationFileError", "FLOAT", "INT", "MAX_BYTES", "Tensor", "read", "validate_file"]
