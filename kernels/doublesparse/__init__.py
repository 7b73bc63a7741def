"""DoubleSparse read-time ops: label scores + top-k selection, gather attention over selected tokens.

Each op dispatches to its Triton kernel for CUDA tensors when Triton is installed and the kernel's
capability check (``triton_kernel.supports_*``) accepts the call; everything else goes to the
PyTorch reference (same signature, :mod:`.reference`).  ``KVCOMPRESS_KERNELS=reference`` forces
the reference everywhere; ``KVCOMPRESS_KERNELS=triton`` also runs the kernels on CPU tensors
(under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os

from . import reference
from .reference import LABEL_BITS, Labels, dequantize_labels, quantize_labels, selection_mask


def _use_triton(t) -> bool:
    mode = os.environ.get("KVCOMPRESS_KERNELS", "auto")
    if mode == "reference" or not (t.is_cuda or mode == "triton"):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def select_topk(query, labels: Labels, channels, valid, k: int):
    """Top-``k`` token indices per query head from label scores; see :func:`.reference.select_topk`."""
    if _use_triton(query):
        from . import triton_kernel

        if triton_kernel.supports_scores(query, labels, channels):
            return triton_kernel.select_topk(query, labels, channels, valid, k)
    return reference.select_topk(query, labels, channels, valid, k)


def gather_partial_attention(query, k, v, valid, index, scale):
    """Attention over each row's selected tokens; see :func:`.reference.gather_partial_attention`."""
    if _use_triton(query):
        from . import triton_kernel

        if triton_kernel.supports_gather(query, k, v, index):
            return triton_kernel.gather_partial_attention(query, k, v, valid, index, scale)
    return reference.gather_partial_attention(query, k, v, valid, index, scale)


__all__ = ["LABEL_BITS", "Labels", "dequantize_labels", "gather_partial_attention", "quantize_labels",
           "select_topk", "selection_mask"]
