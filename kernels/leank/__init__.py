"""LeanK grouped decode attention: lanes of pruned, regrouped heads read with gathered queries.

``grouped_partial_attention(query, lanes, scale) -> (out, lse)`` dispatches to the
Triton kernel for CUDA tensors when Triton is installed and :func:`.triton_kernel.supports`
accepts the call (an explicit capability check), otherwise to the PyTorch reference
(same signature).  ``KVCOMPRESS_KERNELS=reference`` forces the reference, ``=triton`` the Triton
kernel also for CPU tensors (under ``TRITON_INTERPRET=1``; tests).  The
TileLang kernel (``tilelang_kernel.py``, the LeanK authors' approach) is imported only
when called directly; nothing here imports Triton or TileLang at package import.
"""

from __future__ import annotations

import os

from .reference import Lane, gather_query, merge_with_lse
from .reference import grouped_partial_attention as grouped_partial_attention_reference


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def grouped_partial_attention(query, lanes, scale):
    """Attention of grouped queries over LeanK lanes; see :func:`.reference.grouped_partial_attention`."""
    mode = os.environ.get("KVCOMPRESS_KERNELS", "auto")  # "triton" forces it (CPU: under TRITON_INTERPRET=1)
    if (query.is_cuda or mode == "triton") and mode != "reference" and triton_available():
        from . import triton_kernel  # compiled lazily, on first use

        if triton_kernel.supports(query, lanes):
            return triton_kernel.grouped_partial_attention(query, lanes, scale)
    return grouped_partial_attention_reference(query, lanes, scale)


__all__ = ["Lane", "gather_query", "grouped_partial_attention", "grouped_partial_attention_reference",
           "merge_with_lse", "triton_available"]
