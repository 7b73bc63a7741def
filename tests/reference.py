"""Independent references: full attention with an explicit (query, key) visibility mask.

These never touch kvcompress: the model runs transformers' *eager* attention on
the whole sequence in one teacher-forced forward, with a 4-D additive mask that
hides exactly the keys a policy evicted.
"""

from __future__ import annotations

import contextlib

import torch


def window_visibility(length: int, chunks: list[tuple[int, int]], sinks: int, recent: int) -> torch.Tensor:
    """allowed[t, j] for a sinks + recent window processed in ``chunks`` (start, end).

    A chunk starting at c sees the keys kept after processing [0, c) - the first
    ``sinks`` tokens and the ``recent`` newest of the others - plus itself, causally.
    """
    allowed = torch.zeros(length, length, dtype=torch.bool)
    for c0, c1 in chunks:
        kept = torch.zeros(length, dtype=torch.bool)
        kept[: min(sinks, c0)] = True
        kept[max(sinks, c0 - recent): c0] = True
        for t in range(c0, c1):
            allowed[t] = kept
            allowed[t, c0: t + 1] = True
    return allowed


def causal_visibility(length: int) -> torch.Tensor:
    return torch.ones(length, length, dtype=torch.bool).tril()


def _additive(allowed: torch.Tensor) -> torch.Tensor:
    mask = torch.zeros(allowed.shape, dtype=torch.float32)
    mask.masked_fill_(~allowed, torch.finfo(torch.float32).min)
    return mask[None, None]


@contextlib.contextmanager
def eager(model):
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


@torch.no_grad()
def masked_logits(model, ids: torch.Tensor, allowed: torch.Tensor, sliding_window: int | None = None):
    """Logits of one eager forward over ``ids`` [1, L] where token t sees keys ``allowed[t]``.

    For hybrid models (Gemma-3), sliding layers get their own causal sliding mask.
    """
    length = ids.shape[1]
    mask = _additive(allowed)
    if sliding_window is not None:
        t = torch.arange(length)
        sliding = causal_visibility(length) & ((t[:, None] - t[None, :]) < sliding_window)
        mask = {"full_attention": mask, "sliding_attention": _additive(sliding)}
    with eager(model):
        return model(ids, attention_mask=mask, position_ids=torch.arange(length)[None]).logits[0]


@torch.no_grad()
def streamed_logits(model, ids: torch.Tensor, cache, chunks: list[tuple[int, int]]) -> torch.Tensor:
    """Logits of feeding ``ids`` through ``cache`` chunk by chunk (direct forward calls).  The cache goes in under the
    keyword the installed transformers takes (``past_key_values`` before 5.24, whose forward ignores ``cache=``)."""
    from kvcompress.adapters.hf import cache_kwarg

    kw, out = cache_kwarg(model), []
    for c0, c1 in chunks:
        out.append(model(ids[:, c0:c1], **{kw: cache}, use_cache=True).logits[0])
    return torch.cat(out, 0)


def decode_chunks(prefill: int, length: int, extra: list[int] | None = None) -> list[tuple[int, int]]:
    """[(0, prefill)] then single tokens, with optional multi-token chunks at given starts."""
    chunks = [(0, prefill)]
    t = prefill
    extra = dict(extra or [])
    while t < length:
        step = extra.get(t, 1)
        chunks.append((t, min(length, t + step)))
        t += step
    return chunks


# ----------------------------------------------------------------------------- compressed-middle oracle


def fake_quant(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Min-max asymmetric fake quantization along ``dim`` with fp16 scale/zero (no packing involved)."""
    x = x.float()
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    s = ((hi - lo) / (2 ** bits - 1)).half().float()
    s[s == 0] = 1.0
    z = lo.half().float()
    return torch.clamp(torch.round((x - z) / s), 0, 2 ** bits - 1) * s + z


# ----------------------------------------------------------------------------- attention variants


def variant_probs(scores: torch.Tensor, visible: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """Softmax over the visible keys of scaled scores ``[b, hq, L, L]`` (float32), with the model's attention
    variants read from the keywords transformers passed the attention function, as its eager attention applies
    them: Gemma 2's ``softcap`` (``cap * tanh(s / cap)`` before masking) and gpt-oss' ``s_aux`` (one learned logit
    per query head in the denominator, no value).  Written here from the models' definitions, not from kvcompress."""
    cap = kwargs.get("softcap")
    if cap:
        scores = cap * torch.tanh(scores / cap)
    scores = scores.masked_fill(~visible, float("-inf"))
    sinks = kwargs.get("s_aux")
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    b, hq, length, _ = scores.shape
    column = sinks.float().view(1, hq, 1, 1).expand(b, hq, length, 1)
    return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]


def view_oracle_logits(model, ids, view, name: str = "kvcompress_test_view_oracle"):
    """Logits of one teacher-forced forward whose attention, in every full-attention layer, reads the keys and
    values as ``view`` says the cache holds them; sliding-window layers (``sliding_window`` passed) attend exactly
    within their window.  Attention variants apply as in :func:`variant_probs`.

    ``view(layer, q, k, v)`` gets float32 ``q [b, hq, L, d]``, ``k``/``v`` ``[b, hkv, L, d]`` and returns
    ``(k_mid, v_mid, middle, visible)``: the keys/values middle reads use (``[b, hkv, L, *]``, or ``None`` for
    ``k``/``v``) and boolean ``[.., L, L]`` masks (broadcast to ``[b, hq, L, L]``) of the (query, key) pairs read
    from the middle and of those visible at all.
    """
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def attn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        hq, length = query.shape[1], query.shape[2]
        rep = hq // key.shape[1]
        q, k, v = query.float(), key.float(), value.float()
        window = kwargs.get("sliding_window")
        if window:  # transformers' own sliding layer: exact attention inside the window
            t = torch.arange(length)
            visible = causal_visibility(length) & ((t[:, None] - t[None, :]) < window)
            k_mid = v_mid = None
            middle = torch.zeros(length, length, dtype=torch.bool)
        else:
            k_mid, v_mid, middle, visible = view(module.layer_idx, q, k, v)
        k_mid = k if k_mid is None else k_mid
        v_mid = v if v_mid is None else v_mid
        k, v, k_mid, v_mid = (x.repeat_interleave(rep, 1) for x in (k, v, k_mid, v_mid))
        s = torch.where(middle, q @ k_mid.transpose(-1, -2), q @ k.transpose(-1, -2)) * scaling
        p = variant_probs(s, visible.expand(s.shape), kwargs)
        out = (p * middle) @ v_mid + (p * ~middle) @ v
        return out.transpose(1, 2).to(query.dtype), None

    ALL_ATTENTION_FUNCTIONS.register(name, attn)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        with torch.no_grad():
            return model(ids, position_ids=torch.arange(ids.shape[1])[None]).logits[0]
    finally:
        model.set_attn_implementation(previous)


def middle_oracle_logits(model, ids, chunks, *, sinks=0, recent, flush, bits=None, group=None,
                         key_axis="channel", keep=None, budget=None, basis=None,
                         value_basis=None):
    """One teacher-forced forward in which every (query, key) pair reads the key as the cache holds it.

    A query of the chunk starting at c reads a cache of c tokens whose middle is
    ``[sinks, sinks + M(c))`` with ``M(n) = flush * floor((n - sinks - recent) / flush)`` (0 during
    the first prefill). Middle keys are, independently of kvcompress:

    * channel-masked by ``keep`` (bool ``[layers, kv_heads, head_dim]``; a head keeping nothing
      does not see the middle at all, neither K nor V),
    * fake-quantized (``bits``): keys per channel over token groups ``[sinks + iG, sinks + (i+1)G)``
      (or per token for ``key_axis="token"``), values per token over channel groups of gcd(G, d),
    * hidden beyond the newest ``budget`` middle tokens (a window stacked before),
    * replaced by their projection ``k U U^T`` onto ``basis`` (float ``[layers, kv_heads, head_dim, r]``,
      zero columns allowed); with ``bits``, the coordinates ``k U`` are what gets fake-quantized per channel;
    * middle values likewise replaced by ``v U_v U_v^T`` (``value_basis``; with ``bits``, the coordinates are
      fake-quantized per token over channel groups).

    Sliding-window layers (hybrids) are exact within their window; attention variants apply (:func:`view_oracle_logits`).
    """
    import math

    length = ids.shape[1]
    cache_len = torch.zeros(length, dtype=torch.long)
    for c0, c1 in chunks:
        cache_len[c0:c1] = c0
    m_count = torch.div(cache_len - sinks - recent, flush, rounding_mode="floor").clamp(min=0) * flush
    m_count[: chunks[0][1]] = 0
    j = torch.arange(length)
    middle = (j[None, :] >= sinks) & (j[None, :] < sinks + m_count[:, None])  # [query, key]
    visible = causal_visibility(length)
    if budget is not None:
        visible = visible & ~(middle & (j[None, :] < sinks + m_count[:, None] - budget))

    def view(layer, query, key, value):
        b, hq, L, d = query.shape
        hkv = key.shape[1]
        rep = hq // hkv
        km, vm = key.clone(), value.clone()
        see_middle = torch.ones(hq, dtype=torch.bool)
        if keep is not None:
            mask = keep[layer].to(key.dtype)  # [hkv, d]
            km = km * mask[None, :, None, :]
            see_middle = keep[layer].any(-1).repeat_interleave(rep)
        if basis is not None:
            u = basis[layer].to(key.dtype)[None]  # [1, hkv, d, r]
            km = km @ u
        if value_basis is not None:
            uv = value_basis[layer].to(value.dtype)[None]
            vm = vm @ uv
        if bits is not None:
            if key_axis == "channel":
                for i in range((L - sinks) // group):
                    sl = slice(sinks + i * group, sinks + (i + 1) * group)
                    km[:, :, sl] = fake_quant(km[:, :, sl], bits, dim=2)
            gv = math.gcd(group, d)
            if key_axis == "token":
                km = fake_quant(km.view(b, hkv, L, d // gv, gv), bits, -1).view(b, hkv, L, d)
            dv = vm.shape[-1]
            vm = fake_quant(vm.view(b, hkv, L, dv // gv, gv), bits, -1).view(b, hkv, L, dv)
        if basis is not None:
            km = km @ u.transpose(-1, -2)
        if value_basis is not None:
            vm = vm @ uv.transpose(-1, -2)
        vis = visible[None, None] & ~(middle[None, None] & ~see_middle.view(1, hq, 1, 1))
        return km, vm, middle[None, None], vis

    return view_oracle_logits(model, ids, view, "kvcompress_test_middle_oracle")
