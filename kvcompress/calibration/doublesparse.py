"""DoubleSparse label channels (arXiv 2408.07092): offline ranking and the channel file format.

Per layer and KV head, post-RoPE key channels are ranked by the mean ``|q_c k_c|`` over causal
(query, key) pairs of calibration text, summed over the query heads that share the KV head
(:func:`kvcompress.calibration.qk.qk_scores`, the ranking LeanK's ``qk`` baseline uses).  The label
cache is stored once per KV head, so one channel set per KV head serves its whole GQA group.
Channels are indexed in transformers' rotate_half RoPE layout (channel ``i`` pairs with
``i + d/2``): the official repository's ``permute_channel_config`` (for gpt-fast's interleaved
layout) does not apply.

File format ``kvcompress.doublesparse-channels/1`` (safetensors, never pickle):

* tensor ``channels``: int32 ``[layers, kv_heads, r]``, each head's channels, best first;
* tensor ``scores``: float32 ``[layers, kv_heads, head_dim]``, the calibration scores;
* string metadata: ``format``, ``model``, ``model_config_hash``, ``model_geometry`` (JSON),
  ``channels`` (r), ``settings`` (JSON), ``created``.

A file made for another model (config hash or geometry) is refused.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from typing import Any

import torch

from .files import FLOAT, INT, Tensor, read
from .masks import MaskFileError, _text_config, config_fields, config_hash, describe_model, geometry

FORMAT = "kvcompress.doublesparse-channels/1"
_HINT = "make one with: kvcompress calibrate doublesparse --channels R --out FILE"


@dataclasses.dataclass
class ChannelFile:
    """A loaded channel file: ``channels`` int64 ``[layers, kv_heads, r]`` (best first), ``scores``, ``meta``."""

    channels: torch.Tensor
    scores: torch.Tensor
    meta: dict


def rank_channels(scores: torch.Tensor, r: int) -> torch.Tensor:
    """The ``r`` best channels per (layer, head) of ``scores [layers, heads, d]``, best first (ties: lower index)."""
    order = torch.sort(-scores.float(), dim=-1, stable=True).indices
    return order[..., :r]


def save_channels(path: str | os.PathLike, channels: torch.Tensor, scores: torch.Tensor, model_config: Any,
                  model_name: str, settings: dict) -> None:
    """Write a channel file for ``model_config`` (parent folders are created)."""
    from safetensors.torch import save_file

    layers, kv, head_dim = geometry(model_config)
    if tuple(channels.shape[:2]) != (layers, kv) or tuple(scores.shape) != (layers, kv, head_dim):
        raise ValueError(f"channels {tuple(channels.shape)} / scores {tuple(scores.shape)} do not match the model "
                         f"geometry {(layers, kv, head_dim)}")
    geo = {"model_type": config_fields(model_config).get("model_type"), "layers": layers, "kv_heads": kv,
           "head_dim": head_dim}
    meta = {"format": FORMAT, "model": model_name, "model_config_hash": config_hash(model_config),
            "model_geometry": json.dumps(geo, sort_keys=True), "channels": str(channels.shape[-1]),
            "settings": json.dumps(settings, sort_keys=True), "created": datetime.date.today().isoformat()}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file({"channels": channels.to(torch.int32).contiguous().cpu(),
               "scores": scores.to(torch.float32).contiguous().cpu()}, os.fspath(path), metadata=meta)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)  # safetensors writes through a private (0600) temporary file


class ChannelFileError(MaskFileError):
    """A DoubleSparse channel file is missing, malformed, or was made for another model."""

    kind = "channel file"
    default_hint = _HINT


def load_channels(path: str | os.PathLike, model_config: Any = None) -> ChannelFile:
    """Read a channel file (with the checks of :func:`kvcompress.calibration.files.read`); with
    ``model_config``, refuse a file made for another model.

    Raises:
        ChannelFileError (a MaskFileError, a ConfigError): missing, malformed, or made for another model.
    """
    path = os.fspath(path)
    tensors, meta = read(path, ChannelFileError, "DoubleSparse channel file", FORMAT,
                         {"channels": Tensor(INT, 3), "scores": Tensor(FLOAT, 3)},
                         {"settings": "a JSON object", "model_geometry": "a JSON object", "channels": "an integer"})
    channels, scores = tensors["channels"].long(), tensors["scores"]
    d = scores.shape[-1]
    if channels.shape[:2] != scores.shape[:2] or channels.shape[-1] < 1 or d < 1 or channels.shape[-1] > d \
            or bool((channels < 0).any() or (channels >= d).any()):
        raise ChannelFileError(path, "'channels' [layers, kv_heads, r] (1 <= r <= head_dim) indexing 'scores' "
                               "[layers, kv_heads, head_dim]", f"shapes {tuple(channels.shape)} and "
                               f"{tuple(scores.shape)}" + ("" if channels.numel() == 0 or bool(
                                   (channels >= 0).all() and (channels < d).all()) else ", indices out of range"))
    meta.setdefault("settings", {})
    if model_config is not None:
        same_shape = (*channels.shape[:2], d) == geometry(model_config)
        digest = config_hash(model_config)
        if not (same_shape and meta.get("model_config_hash") == digest):
            c = _text_config(model_config)
            given = getattr(c, "_name_or_path", None) or None
            geo = meta.get("model_geometry", {})
            made = describe_model(meta.get("model"), {"model_type": geo.get("model_type", "?"),
                                                      "num_hidden_layers": channels.shape[0],
                                                      "num_key_value_heads": channels.shape[1], "head_dim": d},
                                  meta.get("model_config_hash"))
            why = "its shape differs" if not same_shape else "the model config hash differs"
            raise ChannelFileError(path, "a channel file made for the model given, "
                                   f"{describe_model(given, config_fields(model_config), digest)}",
                                   f"a file made for {made}; {why}")
    return ChannelFile(channels=channels, scores=scores, meta=meta)


def calibrate_channels(model: Any, tokenizer: Any, r: int, *, samples: int = 16, context: int = 512,
                       seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(channels [layers, kv_heads, r], scores [layers, kv_heads, head_dim])`` from mean ``|q_c k_c|``
    over ``samples`` windows of ``context`` tokens of the training split of the offline text."""
    from . import data
    from .qk import qk_scores

    windows = data.windows(data.split_tokens(tokenizer, "train"), context, samples, seed=seed)
    scores = qk_scores(model, torch.tensor(windows))
    return rank_channels(scores, r), scores
