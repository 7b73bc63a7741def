"""LeanK channel masks: binarization rules, the RoPE-frequency heuristic, and the mask file format.

A mask is a boolean tensor ``keep[layer, kv_head, channel]`` over the post-RoPE key channels of
every decoder layer (LeanK, arXiv 2508.02215).  The compressor stores the *middle* of the cache
(everything except the attention sinks and each query's local window) only on the kept channels.

File format ``kvcompress.leank-mask/1`` (safetensors, never pickle):

* tensor ``keep``: uint8 ``[layers, kv_heads, head_dim]``, 1 = keep;
* tensor ``alpha`` (optional): float32, same shape, the learned scaling factors;
* string metadata: ``format``, ``model``, ``model_config_hash``, ``model_geometry`` (JSON),
  ``ratio``, ``align``, ``sinks``, ``local``, ``method``, ``settings`` (JSON), ``created``.

Nothing here imports transformers: model configs are read by attribute (duck typing).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import os
from typing import Any

import torch

from ..errors import ConfigError
from .files import FLOAT, CalibrationFileError, Tensor, read

FORMAT = "kvcompress.leank-mask/1"
METHODS = ("trained", "rope", "qk")
REQUIRED_META = ("model", "model_config_hash", "ratio", "align", "sinks", "local", "method", "settings")
_META_TYPES = {"ratio": "a finite number", "align": "an integer", "sinks": "an integer", "local": "an integer",
               "settings": "a JSON object", "model_geometry": "a JSON object", "history": "JSON",
               "count_histogram": "JSON", "kept_fraction": "a finite number", "seconds": "a finite number"}


class MaskFileError(CalibrationFileError):
    """A mask file is missing, malformed, or was made for another model.

    Same attributes as :class:`ConfigError` (``path`` is the file); the message does not quote
    ``got``, which is already a sentence.
    """

    kind = "mask file"


# ----------------------------------------------------------------------------- model geometry


def _text_config(model_config: Any) -> Any:
    config = getattr(model_config, "config", model_config)  # a model is accepted too
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if callable(getter) else config


def _get(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def geometry(model_config: Any) -> tuple[int, int, int]:
    """(layers, kv heads, head_dim) of a transformers config (or model, or plain dict)."""
    c = _text_config(model_config)
    heads = _get(c, "num_attention_heads")
    kv = _get(c, "num_key_value_heads") or heads
    head_dim = _get(c, "head_dim") or _get(c, "hidden_size") // heads
    return int(_get(c, "num_hidden_layers")), int(kv), int(head_dim)


def rope_parameters(model_config: Any) -> dict:
    """RoPE settings as one dict (transformers 5.x ``rope_parameters``, or the older separate fields)."""
    c = _text_config(model_config)
    params = _get(c, "rope_parameters")
    out = dict(params) if isinstance(params, dict) else {}
    if "rope_theta" not in out and _get(c, "rope_theta") is not None:
        out["rope_theta"] = _get(c, "rope_theta")
    scaling = _get(c, "rope_scaling")
    if isinstance(scaling, dict):
        out.update({k: v for k, v in scaling.items() if k not in out})
    if "partial_rotary_factor" not in out and _get(c, "partial_rotary_factor") is not None:
        out["partial_rotary_factor"] = _get(c, "partial_rotary_factor")
    return {k: v for k, v in out.items() if v is not None}


def _canonical(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return int(value) if float(value).is_integer() else float(value)
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return str(value)


def config_fields(model_config: Any) -> dict:
    """The config fields that define K geometry and weight identity, as hashed by :func:`config_hash`."""
    c = _text_config(model_config)
    layers, kv, head_dim = geometry(c)
    return _canonical({
        "model_type": _get(c, "model_type"),
        "num_hidden_layers": layers,
        "num_attention_heads": _get(c, "num_attention_heads"),
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "hidden_size": _get(c, "hidden_size"),
        "rope_parameters": rope_parameters(c),
        "vocab_size": _get(c, "vocab_size"),
    })


def config_hash(model_config: Any) -> str:
    """sha256 (hex) of the canonical JSON of :func:`config_fields`."""
    text = json.dumps(config_fields(model_config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def describe_model(name: str | None, fields: dict, digest: str | None) -> str:
    parts = [f"{fields.get('model_type')}", f"{fields.get('num_hidden_layers')} layers",
             f"{fields.get('num_key_value_heads')} KV heads", f"head_dim {fields.get('head_dim')}"]
    if digest:
        parts.append(f"config {digest[:12]}")
    return f"{name!r} ({', '.join(parts)})" if name else f"({', '.join(parts)})"


# ----------------------------------------------------------------------------- binarization


def check_ratio(ratio: float, path: str = "ratio") -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= float(ratio) <= 1.0 \
            or math.isnan(ratio):
        raise ConfigError(path, "the fraction of K channels to prune, a number in [0, 1]", ratio)
    return float(ratio)


def check_align(align: int, head_dim: int, path: str = "align") -> int:
    if isinstance(align, bool) or not isinstance(align, int) or not 1 <= align <= head_dim or head_dim % align:
        allowed = [a for a in range(1, head_dim + 1) if head_dim % a == 0]
        raise ConfigError(path, f"a divisor of head_dim {head_dim} (one of {allowed})", align,
                          hint="Every head keeps a multiple of align channels")
    return align


def round_half_up(count: torch.Tensor | int | float, align: int) -> Any:
    """``count`` rounded to the nearest multiple of ``align``, halves rounded up (0 is a multiple)."""
    if isinstance(count, torch.Tensor):
        return torch.div(2 * count + align, 2 * align, rounding_mode="floor") * align
    return int(math.floor(count / align + 0.5)) * align


def _descending_rank(scores: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Rank of every entry in descending score order; ties broken by lower index first."""
    order = torch.sort(-scores, dim=dim, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(dim, order, torch.arange(order.shape[dim]).expand_as(order).contiguous())
    return rank


def binarize(alpha: torch.Tensor, ratio: float, align: int, layers: torch.Tensor | None = None) -> torch.Tensor:
    """Binary keep mask from scaling factors (LeanK stage 2).

    1. One global threshold: the ``round(ratio * N)`` channels with the smallest alpha over all
       layers, heads and channels are pruned (ties: the channel with the higher flat index
       ``(layer, head, channel)`` is pruned first).
    2. Each head's kept count is rounded half-up to a multiple of ``align`` (0 and head_dim allowed).
    3. Each head keeps its top-``count`` channels by alpha (ties: lower channel index first).

    Args:
        alpha: float tensor ``[layers, kv_heads, head_dim]``.
        ratio: fraction of channels to prune, in [0, 1].
        align: kept counts are multiples of it; a divisor of head_dim.
        layers: optional bool ``[layers]``: only these layers are pruned (the threshold is over them); the others
            keep every channel (a hybrid model's sliding-window layers, which are never compressed).

    Returns:
        bool tensor of alpha's shape.
    """
    if layers is not None:
        keep = torch.ones(alpha.shape, dtype=torch.bool)
        keep[layers] = binarize(alpha[layers], ratio, align)
        return keep
    if alpha.dim() != 3 or not alpha.is_floating_point():
        raise ConfigError("alpha", "a float tensor [layers, kv_heads, head_dim]",
                          f"{alpha.dtype} tensor of shape {tuple(alpha.shape)}")
    if torch.isnan(alpha).any():
        raise ConfigError("alpha", "finite scaling factors", "a tensor containing NaN")
    ratio = check_ratio(ratio)
    head_dim = alpha.shape[-1]
    align = check_align(align, head_dim)
    alpha = alpha.detach().float().cpu()
    total = alpha.numel()
    n_keep = total - int(math.floor(ratio * total + 0.5))
    globally_kept = (_descending_rank(alpha.flatten(), 0) < n_keep).view(alpha.shape)
    counts = round_half_up(globally_kept.sum(-1), align).clamp(0, head_dim)
    return _descending_rank(alpha, -1) < counts[..., None]


def counts(keep: torch.Tensor) -> torch.Tensor:
    """Kept channels per (layer, kv head)."""
    return keep.sum(-1)


def rope_channel_order(head_dim: int, rotary_dim: int | None = None) -> list[int]:
    """Channels from the lowest to the highest RoPE frequency (transformers' rotate_half layout).

    Channel ``i`` pairs with ``i + r/2`` (r = rotary dim) at frequency ``base^(-2i/r)``, so a larger
    ``i`` is a lower frequency.  Channels beyond the rotary dim (partial RoPE) are not rotated
    (frequency 0) and come first.
    """
    r = head_dim if rotary_dim is None else rotary_dim
    half = r // 2
    order = list(range(r, head_dim))
    for i in reversed(range(half)):
        order += [i, i + half]
    return order


def rope_mask(model_config: Any, ratio: float, align: int) -> torch.Tensor:
    """Training-free mask: every head keeps its lowest-frequency RoPE channel pairs.

    The kept count is ``round((1 - ratio) * head_dim)`` rounded half-up to a multiple of
    ``align`` - the same for every layer and head.
    """
    layers, kv_heads, head_dim = geometry(model_config)
    ratio = check_ratio(ratio)
    align = check_align(align, head_dim)
    factor = float(rope_parameters(model_config).get("partial_rotary_factor", 1.0))
    rotary = int(head_dim * factor) // 2 * 2
    count = min(head_dim, round_half_up(int(math.floor((1.0 - ratio) * head_dim + 0.5)), align))
    row = torch.zeros(head_dim, dtype=torch.bool)
    row[rope_channel_order(head_dim, rotary)[:count]] = True
    return row.expand(layers, kv_heads, head_dim).clone()


# ----------------------------------------------------------------------------- files


@dataclasses.dataclass
class MaskFile:
    """A loaded mask: ``keep`` (bool ``[layers, kv_heads, head_dim]``), ``alpha`` or None, metadata.

    ``meta`` holds the file's metadata with ``ratio``/``kept_fraction``/``seconds`` as float,
    ``align``/``sinks``/``local`` as int and ``settings``/``model_geometry``/``history``/
    ``count_histogram`` decoded from JSON; everything else stays a string.
    """

    keep: torch.Tensor
    alpha: torch.Tensor | None
    meta: dict

    @property
    def counts(self) -> torch.Tensor:
        return counts(self.keep)

    @property
    def kept_fraction(self) -> float:
        return float(self.keep.float().mean())

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.keep.shape)  # type: ignore[return-value]


def _make_hint(meta: dict | None = None, model: str | None = None) -> str:
    ratio = meta.get("ratio", "R") if meta else "R"
    align = meta.get("align", "A") if meta else "A"
    model_opt = f" --model {model}" if model else ""
    return (f"make one with: kvcompress calibrate leank{model_opt} --ratio {ratio} --align {align} --out FILE "
            "(or --method rope for the training-free RoPE mask)")


def save_mask(path: str | os.PathLike, keep: torch.Tensor, meta: dict, alpha: torch.Tensor | None = None) -> None:
    """Write a mask file (format ``kvcompress.leank-mask/1``).

    Args:
        path: destination ``.safetensors`` file (parent folders are created).
        keep: bool tensor ``[layers, kv_heads, head_dim]``.
        meta: must contain ``model``, ``model_config_hash``, ``ratio``, ``align``, ``sinks``,
            ``local``, ``method`` and ``settings`` (a dict or a JSON string); may contain
            ``model_geometry`` (dict).  ``format`` and ``created`` are filled in.
        alpha: optional learned scaling factors, same shape as ``keep``.
    """
    from safetensors.torch import save_file

    if keep.dim() != 3 or keep.dtype != torch.bool:
        raise ConfigError("keep", "a bool tensor [layers, kv_heads, head_dim]",
                          f"{keep.dtype} tensor of shape {tuple(keep.shape)}")
    missing = [k for k in REQUIRED_META if k not in meta]
    if missing:
        raise ConfigError("meta", f"the keys {list(REQUIRED_META)}", sorted(meta), hint=f"missing: {missing}")
    if meta["method"] not in METHODS:
        raise ConfigError("meta.method", f"one of {list(METHODS)}", meta["method"])
    strings = {}
    for key, value in meta.items():
        if isinstance(value, (dict, list)):
            strings[key] = json.dumps(value, sort_keys=True)
        else:
            strings[key] = str(value)
    strings.setdefault("model_geometry", json.dumps(
        {"layers": keep.shape[0], "kv_heads": keep.shape[1], "head_dim": keep.shape[2]}, sort_keys=True))
    strings["format"] = FORMAT
    strings.setdefault("created", datetime.date.today().isoformat())
    tensors = {"keep": keep.to(torch.uint8).contiguous().cpu()}
    if alpha is not None:
        if tuple(alpha.shape) != tuple(keep.shape):
            raise ConfigError("alpha", f"a tensor of shape {tuple(keep.shape)}", tuple(alpha.shape))
        tensors["alpha"] = alpha.detach().to(torch.float32).contiguous().cpu()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    save_file(tensors, tmp, metadata=strings)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # safetensors writes through a private (0600) temporary file
    os.replace(tmp, path)


def load_mask(path: str | os.PathLike, model_config: Any = None) -> MaskFile:
    """Read a mask file written by :func:`save_mask` (safetensors only; nothing is unpickled), with the checks
    of :func:`kvcompress.calibration.files.read` (size, header, tensor names / dtypes / ranks, finite values,
    typed metadata).

    Args:
        path: the ``.safetensors`` mask file.
        model_config: optional transformers config (or model).  When given, the mask must have
            been made for the same config hash and geometry (layers, KV heads, head_dim).

    Returns:
        :class:`MaskFile`.

    Raises:
        MaskFileError (a ConfigError): missing file, wrong format, or a mask for another model.
    """
    path = os.fspath(path)
    tensors, meta = read(path, MaskFileError, "LeanK mask file", FORMAT,
                         {"keep": Tensor(("U8",), 3), "alpha": Tensor(FLOAT, 3, required=False)}, _META_TYPES,
                         REQUIRED_META, hint=_make_hint())
    keep_raw, alpha = tensors["keep"], tensors.get("alpha")
    if keep_raw.numel() == 0 or bool((keep_raw > 1).any()):
        raise MaskFileError(path, "'keep' as a uint8 0/1 tensor [layers, kv_heads, head_dim]",
                            f"{keep_raw.dtype} tensor of shape {tuple(keep_raw.shape)}"
                            + (" with values other than 0 and 1" if keep_raw.numel() else ""), hint=_make_hint(meta))
    keep = keep_raw.bool()
    if alpha is not None and tuple(alpha.shape) != tuple(keep.shape):
        raise MaskFileError(path, f"'alpha' of shape {tuple(keep.shape)}", tuple(alpha.shape), hint=_make_hint(meta))
    if model_config is not None:
        check_mask_for_model(path, keep, meta, model_config)
    return MaskFile(keep=keep, alpha=alpha, meta=meta)


def _mask_fields(keep: torch.Tensor, meta: dict) -> dict:
    geo = meta.get("model_geometry") or {}
    return {"model_type": geo.get("model_type", "?"), "num_hidden_layers": keep.shape[0],
            "num_key_value_heads": keep.shape[1], "head_dim": keep.shape[2]}


def check_mask_for_model(path: str, keep: torch.Tensor, meta: dict, model_config: Any) -> None:
    """Refuse a mask whose config hash or geometry differs from ``model_config``'s."""
    fields = config_fields(model_config)
    digest = config_hash(model_config)
    same_shape = tuple(keep.shape) == geometry(model_config)
    if same_shape and meta.get("model_config_hash") == digest:
        return
    c = _text_config(model_config)
    given = _get(c, "_name_or_path") or _get(c, "name_or_path") or None
    made_for = describe_model(meta.get("model"), _mask_fields(keep, meta), meta.get("model_config_hash"))
    why = "its shape differs" if not same_shape else "the model config hash differs"
    raise MaskFileError(
        path, f"a LeanK mask made for the model given, {describe_model(given, fields, digest)}",
        f"a mask made for {made_for}; {why}",
        hint=_make_hint(meta, model=given))
