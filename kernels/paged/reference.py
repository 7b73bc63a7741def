"""Paged attention reference (pure PyTorch): gather pages through the block table, then attend.

Layout (the pool of :class:`kvcompress.paged.PagedStore`):

* ``k_pages`` ``[num_pages, H, P, Dk]`` and ``v_pages`` ``[num_pages, H, P, Dv]``: page ``p`` holds
  ``P`` token slots of one sequence for every kv head;
* ``page_valid`` ``[num_pages, P]`` bool: slots attention may read;
* ``block_table`` ``[B, W]`` int32: the pages of sequence ``b``, in order, ``-1`` for none.

Every stored token precedes every query (the middle of the cache is older than the recent
window), so only validity masks keys.  The Triton kernel (``triton_kernel.py``) has the same
signature and reads the table inside the kernel instead of gathering.
"""

from __future__ import annotations

import torch

from kvcompress.kernels.attention.reference import partial_attention


def gather_pages(pages: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """``pages [num_pages, H, P, d]`` through ``block_table [B, W]`` -> ``[B, H, W * P, d]`` (a copy)."""
    g = pages[block_table.clamp(min=0).long()]  # [B, W, H, P, d]
    b, w, h, p, d = g.shape
    return g.transpose(1, 2).reshape(b, h, w * p, d)


def gather_valid(page_valid: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """``[B, W * P]`` validity of the gathered slots (False for ``-1`` table entries)."""
    v = page_valid[block_table.clamp(min=0).long()] & (block_table >= 0).unsqueeze(-1)
    return v.reshape(block_table.shape[0], -1)


def paged_attention_partial(query: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                            page_valid: torch.Tensor, block_table: torch.Tensor,
                            scale: float, *, length: torch.Tensor | None = None,
                            softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of grouped queries over paged keys/values, as a mergeable partial.

    Args:
        query: ``[B, H, M, Dk]`` - the ``M = group * q_len`` query rows sharing each kv head.
        k_pages, v_pages: ``[num_pages, H, P, Dk]`` / ``[num_pages, H, P, Dv]``.
        page_valid: ``[num_pages, P]`` bool.
        block_table: ``[B, W]`` int32 page indices, ``-1`` where a sequence has no page.
        scale: softmax scale.
        length: optional 0-dim int tensor: token slots at or after it, counted in block-table order (table
            position ``w`` holds slots ``w*P .. w*P+P-1``), are treated as invalid (the kernel does not read them).
        softcap: logit soft-cap of the scaled scores (``None`` or 0: none).

    Returns:
        ``(out [B, H, M, Dv] float32, lse [B, H, M] float32)``; ``lse = -inf`` and a zero output for
        rows without a valid key.
    """
    k = gather_pages(k_pages, block_table)
    v = gather_pages(v_pages, block_table)
    valid = gather_valid(page_valid, block_table)
    if length is not None:
        valid = valid & (torch.arange(valid.shape[-1], device=valid.device) < length.to(valid.device))
    return partial_attention(query, k, v, valid[:, None, None, :], scale, softcap or None)
