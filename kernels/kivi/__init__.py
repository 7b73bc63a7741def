"""KIVI quantization ops: packed format, quantizers, attention over packed codes.

``kivi_attention_partial`` picks one implementation per call, by explicit checks only (no exception is caught to
choose a path):

1. the hand-written CUDA kernel ("v3", :mod:`.cuda_kernel`) for CUDA tensors when its capability check
   (:func:`.cuda_kernel.supports`: bits 2/4, head dims 64/128, fp16 scales, a CUDA GPU of compute capability >= 8)
   accepts the call and an ``nvcc`` is available (:func:`.cuda_kernel.nvcc_path`).  It is built with nvcc at its
   first use; a failing build raises (the message says to set ``KVCOMPRESS_KIVI_CUDA=0``) instead of silently
   falling back.  ``KVCOMPRESS_KIVI_CUDA=0`` disables it;
2. else the Triton kernel ("v2", :mod:`.triton_kernel`) when Triton is installed and its own ``supports()``
   accepts the call;
3. else the PyTorch reference (same signature).

``KVCOMPRESS_KERNELS=reference`` forces the reference everywhere.
"""

from __future__ import annotations

import os

from .reference import (BITS, PackedKV, bits_per_element, dequantize_keys, dequantize_values,
                        fake_quantize_keys, fake_quantize_values, pack, quantize_keys, quantize_values, unpack)
from .reference import kivi_attention_partial as kivi_attention_partial_reference


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _cuda_kernel_enabled() -> bool:
    return os.environ.get("KVCOMPRESS_KIVI_CUDA", "1") != "0"


def implementation(query, packed) -> str:
    """Which implementation :func:`kivi_attention_partial` runs for this call: ``"cuda-v3"``, ``"triton-v2"`` or
    ``"reference"`` (the checks above, in order; nothing is compiled here)."""
    if not query.is_cuda or os.environ.get("KVCOMPRESS_KERNELS", "auto") == "reference":
        return "reference"
    if _cuda_kernel_enabled():
        from . import cuda_kernel  # hand-written CUDA kernel (v3); nothing is compiled before its first launch

        if cuda_kernel.nvcc_path() is not None and cuda_kernel.supports(query, packed):
            return "cuda-v3"
    if _triton_available():
        from . import triton_kernel  # compiled lazily, on first use

        if triton_kernel.supports(query, packed):
            return "triton-v2"
    return "reference"


def kivi_attention_partial(query, packed, scale):
    """Attention over a packed KIVI region; see :func:`.reference.kivi_attention_partial`."""
    impl = implementation(query, packed)
    if impl == "cuda-v3":
        from . import cuda_kernel

        return cuda_kernel.kivi_attention_partial(query, packed, scale)
    if impl == "triton-v2":
        from . import triton_kernel

        return triton_kernel.kivi_attention_partial(query, packed, scale)
    return kivi_attention_partial_reference(query, packed, scale)


__all__ = ["BITS", "PackedKV", "bits_per_element", "dequantize_keys", "dequantize_values", "fake_quantize_keys",
           "fake_quantize_values", "implementation", "kivi_attention_partial", "kivi_attention_partial_reference", "pack",
           "quantize_keys", "quantize_values", "unpack"]
