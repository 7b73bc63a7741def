"""LeanK grouped decode attention: lanes of pruned, regrouped heads read with gathered queries.

``grouped_partial_attention(query, lanes, scale) -> (out, lse)`` dispatches to the
Triton kernel for CUDA tensors when Triton is installed and :func:`.triton_kernel.supports`
accepts the call (an explicit capability check), otherwise to the PyTorch reference
(same signature).  ``KVCOMPRESS_KERNELS=reference`` forces the reference, ``=triton`` the Triton
kernel also for CPU tensors (under ``TRITON_INTERPRET=1``; tests).  The
TileLang kernel (``tilelang_kernel.py``, the LeanK authors' approach) is imported only
when called directly; nothing here imports Triton or TileLang at package import.  With ``impl=`` (chosen once
by :func:`kvcompress.kernels.ops.choose`) it runs the registered op ``kvcompress::lanes_partial`` with that
implementation instead (graph-capturable; nothing is decided per call).
"""

from __future__ import annotations

from .reference import Lane, gather_query, merge_with_lse
from .reference import grouped_partial_attention as grouped_partial_attention_reference


def triton_available() -> bool:
    from kvcompress.kernels.ops import triton_available as available

    return available()


def grouped_partial_attention(query, lanes, scale, *, impl: str | None = None, length=None, softcap=None,
                              out_dtype=None):
    """Attention of grouped queries over LeanK lanes; see :func:`.reference.grouped_partial_attention`.

    ``impl``: ``"reference"`` / ``"triton"`` through the registered op (``None``: decided per call).  ``length``:
    optional 0-dim int device tensor, every lane's slots at or after it are treated as invalid and not read by
    the kernel.  ``softcap``: logit soft-cap of the scores (every implementation applies it).  ``out_dtype``: the
    output's dtype (``None``: float32; a read whose only part this is: no cast after it)."""
    if impl is not None:
        from kvcompress.kernels import ops

        return ops.lanes_attention(query, lanes, scale, impl=impl, length=length, softcap=softcap,
                                   out_dtype=out_dtype)
    from kvcompress.kernels.ops import kernels_mode

    mode = kernels_mode()  # "triton" forces it (CPU: under TRITON_INTERPRET=1)
    if (query.is_cuda or mode == "triton") and mode != "reference" and triton_available():
        from . import triton_kernel  # compiled lazily, on first use

        if triton_kernel.supports(query, lanes):
            return triton_kernel.grouped_partial_attention(query, lanes, scale, length=length, softcap=softcap,
                                                           out_dtype=out_dtype)
    return grouped_partial_attention_reference(query, lanes, scale, length=length, softcap=softcap,
                                               out_dtype=out_dtype)


__all__ = ["Lane", "gather_query", "grouped_partial_attention", "grouped_partial_attention_reference",
           "merge_with_lse", "triton_available"]
