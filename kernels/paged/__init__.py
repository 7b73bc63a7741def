"""Paged attention: one query block over KV pages read through per-sequence block tables.

``paged_attention_partial`` dispatches to the Triton paged decode kernel for CUDA tensors
when Triton is installed and the page size is a power of two (16..128), otherwise to the
PyTorch reference (same signature).  Set ``KVCOMPRESS_KERNELS=reference`` to force the
reference everywhere.  With ``impl=`` (chosen once by :func:`kvcompress.kernels.ops.choose`) it runs the
registered op ``kvcompress::paged_partial`` with that implementation instead (graph-capturable; nothing is
decided per call).
"""

from __future__ import annotations

from .reference import paged_attention_partial as paged_attention_partial_reference


def triton_supported(query, k_pages) -> bool:
    from kvcompress.kernels.ops import kernels_mode

    p = k_pages.shape[2]
    return query.is_cuda and kernels_mode() != "reference" and 16 <= p <= 128 and p & (p - 1) == 0


def paged_attention_partial(query, k_pages, v_pages, page_valid, block_table, scale, *, impl: str | None = None,
                            length=None, softcap=None):
    """Attention over KV pages through a block table; see :func:`.reference.paged_attention_partial`.

    ``impl``: ``"reference"`` / ``"triton"`` through the registered op (``None``: decided per call).  ``length``:
    optional 0-dim int device tensor, token slots at or after it (block-table order) are treated as invalid and
    not read by the kernel.  ``softcap``: logit soft-cap of the scores (every implementation applies it)."""
    if impl is not None:
        from kvcompress.kernels import ops

        return ops.paged_attention(query, k_pages, v_pages, page_valid, block_table, scale, impl=impl, length=length,
                                   softcap=softcap)
    if triton_supported(query, k_pages):
        from kvcompress.kernels.ops import triton_available

        if triton_available():  # compiled lazily, on first use
            from .triton_kernel import paged_attention_partial as fused

            return fused(query, k_pages, v_pages, page_valid, block_table, scale, length=length, softcap=softcap)
    return paged_attention_partial_reference(query, k_pages, v_pages, page_valid, block_table, scale, length=length,
                                             softcap=softcap)


__all__ = ["paged_attention_partial", "paged_attention_partial_reference", "triton_supported"]
