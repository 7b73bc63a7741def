"""The alpha-scaled attention used by LeanK calibration, registered through the adapter.

For a query at position ``t`` the keys split into three regions:

* sinks ``j < sinks`` and the local window ``t - local <= j <= t``: exact scores;
* the middle ``sinks <= j < t - local``: scores against keys scaled channel-wise by
  ``alpha[layer, kv_head]`` (a binary ``alpha`` is exactly LeanK's channel pruning).  A head whose
  alpha is zero on every channel does not read the middle at all (LeanK stores no middle K and V
  for it), rather than scoring every middle key 0 (``drop_empty_heads=False`` scores them 0).

Both score matrices are computed and selected per (query, key) by the region mask; since
``q . (alpha * k) = (alpha * q) . k`` the scaled scores scale the query.  With ``alpha = 1`` the
result is bit-identical to transformers' eager attention.  ``alpha=None`` means exact attention
through torch's fused SDPA (prefill of contexts, targets).

The same function also serves calibration passes:

* ``capture``: record every layer's post-RoPE K and V (a context prefilled once, reused by many
  training steps as ``prefix``);
* ``prefix``: per-layer (K, V) of tokens processed earlier, prepended to this forward's keys
  (position ids of the new tokens must then be passed explicitly);
* ``observer``: ``fn(layer, query, key)`` sees post-RoPE queries and keys (|q.k| channel statistics).

Sequences are unpadded: key ``j`` has logical position ``j``.

Hybrid models (Gemma 2 / 3, gpt-oss): a sliding-window layer (``sliding_window`` passed) is never compressed
by kvcompress, so it attends exactly within its window and ``alpha`` never applies there.  Attention variants
apply as the model's eager attention applies them: a logit soft-cap (``softcap``, Gemma 2) on the scores before
masking, learned sink logits (``s_aux``, gpt-oss) in every softmax denominator.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

import torch

from ..adapters import hf
from ..errors import UnsupportedModelError

ATTN_NAME = "kvcompress_leank_calibration"


@dataclasses.dataclass(eq=False)
class ScaledKeys:
    """What the registered attention reads during one forward.

    Attributes:
        alpha: ``layer -> [kv_heads, head_dim]`` scaling of middle keys, or None for exact attention
            (a tensor ``[layers, kv_heads, head_dim]`` is accepted too).
        sinks: leading keys never scaled.
        local: a query at ``t`` sees keys ``t - local .. t`` unscaled.
        prefix: per-layer ``(K, V)`` ``[batch, kv_heads, n, head_dim]`` prepended to the keys.
        capture: if a dict, receives ``layer -> (K, V)`` of this forward (detached, after ``prefix``
            is prepended).
        observer: ``fn(layer, query, key)``, called with the full keys.
        drop_empty_heads: a head whose alpha is 0 on every channel skips the middle (LeanK's
            deployment: no middle K/V for it).  False: its middle keys all score 0 (the plain
            continuous relaxation, whose gradient never vanishes; used by training stage 1).
    """

    alpha: Any = None
    sinks: int = 0
    local: int = 0
    prefix: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    capture: dict | None = None
    observer: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None
    drop_empty_heads: bool = True

    def alpha_for(self, layer: int) -> torch.Tensor | None:
        if self.alpha is None:
            return None
        if isinstance(self.alpha, torch.Tensor):
            return self.alpha[layer]
        return self.alpha(layer)


_ACTIVE: list[ScaledKeys] = []


def middle_region(q_pos: torch.Tensor, k_pos: torch.Tensor, sinks: int, local: int) -> torch.Tensor:
    """bool ``[q, k]``: key ``j`` is in query ``t``'s middle (``sinks <= j < t - local``)."""
    return (k_pos[None, :] >= sinks) & (k_pos[None, :] < q_pos[:, None] - local)


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    # same layout and ops as transformers' repeat_kv (bit-identical matmuls to eager attention)
    if groups == 1:
        return x
    b, h, n, d = x.shape
    return x[:, :, None, :, :].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)


def scaled_attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                             **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention-interface entry (see the module docstring)."""
    if not _ACTIVE:
        raise RuntimeError(f"{ATTN_NAME} attention used outside kvcompress.calibration.attention.scaled_keys()")
    state = _ACTIVE[-1]
    softcap, sinks = hf.attention_variant(kwargs)
    window = kwargs.get("sliding_window")
    layer = module.layer_idx
    if state.prefix is not None:
        pk, pv = state.prefix[layer]
        key = torch.cat([pk.to(key.dtype), key], dim=2)
        value = torch.cat([pv.to(value.dtype), value], dim=2)
    if state.capture is not None:
        state.capture[layer] = (key.detach(), value.detach())
    if state.observer is not None:
        state.observer(layer, query, key)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    q_len, kv_len = query.shape[2], key.shape[2]
    groups = query.shape[1] // key.shape[1]
    q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)
    k_pos = torch.arange(kv_len, device=query.device)
    alpha = None if window else state.alpha_for(layer)  # sliding layers are never compressed: exact
    visible = k_pos[None, :] <= q_pos[:, None]
    if window:
        visible = visible & (q_pos[:, None] - k_pos[None, :] < window)
    if alpha is None and softcap is None and sinks is None and not window:
        # exact attention (context prefill, targets): torch's fused SDPA
        out = torch.nn.functional.scaled_dot_product_attention(
            query, _repeat_kv(key, groups), _repeat_kv(value, groups), attn_mask=visible, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    keys_t = _repeat_kv(key, groups).transpose(2, 3)
    values = _repeat_kv(value, groups)
    scores = torch.matmul(query, keys_t) * scaling
    region = middle_region(q_pos, k_pos, state.sinks, state.local)
    dropped = None  # (query, key) pairs of heads that keep no channel: no middle at all
    if alpha is not None and bool(region.any()):
        a = alpha.to(query.dtype).repeat_interleave(groups, dim=0)[None, :, None, :]
        scaled = torch.matmul(query * a, keys_t) * scaling
        scores = torch.where(region, scaled, scores)
        empty = (alpha == 0).all(-1).repeat_interleave(groups)
        if state.drop_empty_heads and bool(empty.any()):
            dropped = region & empty[None, :, None, None]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if dropped is not None:
        scores = scores.masked_fill(dropped, torch.finfo(scores.dtype).min)
    causal = torch.zeros(q_len, kv_len, dtype=scores.dtype, device=scores.device)
    causal.masked_fill_(~visible, torch.finfo(scores.dtype).min)
    scores = scores + causal
    if sinks is not None:  # one learned logit per query head in the denominator, no value
        column = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(scores.shape[0], -1, q_len, 1)
        probs = torch.nn.functional.softmax(torch.cat([scores, column], -1), dim=-1, dtype=torch.float32)[..., :-1]
    else:
        probs = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32)
    out = torch.matmul(probs.to(query.dtype), values).transpose(1, 2).contiguous()
    return out, None


@contextlib.contextmanager
def scaled_keys(model: Any, state: ScaledKeys) -> Iterator[ScaledKeys]:
    """Run ``model`` with :func:`scaled_attention_forward` reading ``state``; restore on exit."""
    _ACTIVE.append(state)
    try:
        with hf.use_attention(model, ATTN_NAME, scaled_attention_forward):
            yield state
    finally:
        _ACTIVE.remove(state)


CALIBRATED_TYPES = ("full_attention", "sliding_attention")


def check_calibratable(model: Any) -> None:
    """Calibration runs models whose decoder layers are full attention, or full and sliding-window attention
    (hybrids: only the full-attention layers are compressed, so only they are calibrated)."""
    types = hf.layer_types(model)
    if any(t not in CALIBRATED_TYPES for t in types):
        raise UnsupportedModelError(
            f"calibration supports models whose layers are full or sliding-window attention; this one has "
            f"{sorted(set(types))}")


def compressed_layers(model: Any) -> torch.Tensor | None:
    """bool ``[layers]``: the layers kvcompress compresses (full attention), or ``None`` when that is every layer.
    A hybrid's calibration file keeps everything in its other layers (they are never compressed)."""
    full = torch.tensor([t in hf.COMPRESSED_LAYER_TYPES for t in hf.layer_types(model)])
    return None if bool(full.all()) else full
