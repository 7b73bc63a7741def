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
    """Logits of feeding ``ids`` through ``cache`` chunk by chunk (direct forward calls)."""
    out = []
    for c0, c1 in chunks:
        out.append(model(ids[:, c0:c1], cache=cache, use_cache=True).logits[0])
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
