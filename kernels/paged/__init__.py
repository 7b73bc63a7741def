"""Paged attention: one query block over KV pages read through per-sequence block tables.

``paged_attention_partial`` dispatches to the Triton paged decode kernel for CUDA tensors
when Triton is installed and the page size is a power of two (16..128), otherwise to the
PyTorch reference (same signature).  Set ``KVCOMPRESS_KERNELS=reference`` to force the
reference everywhere.
"""

from __future__ import annotations

import os

from .reference import paged_attention_partial as paged_attention_partial_reference


def triton_supported(query, k_pages) -> bool:
    p = k_pages.shape[2]
    return (query.is_cuda and os.environ.get("KVCOMPRESS_KERNELS", "auto") != "reference"
            and 16 <= p <= 128 and p & (p - 1) == 0)


def paged_attention_partial(query, k_pages, v_pages, page_valid, block_table, scale):
    """Attention over KV pages through a block table; see :func:`.reference.paged_attention_partial`."""
    if triton_supported(query, k_pages):
        try:
            from .triton_kernel import paged_attention_partial as fused  # compiled lazily, on first use
        except ImportError:  # Triton missing: the reference is the documented fallback
            return paged_attention_partial_reference(query, k_pages, v_pages, page_valid, block_table, scale)
        return fused(query, k_pages, v_pages, page_valid, block_table, scale)
    return paged_attention_partial_reference(query, k_pages, v_pages, page_valid, block_table, scale)


__all__ = ["paged_attention_partial", "paged_attention_partial_reference", "triton_supported"]
