"""KIVI quantization ops: packed format, quantizers, attention over packed codes.

``kivi_attention_partial`` dispatches to the Triton kernel for CUDA tensors when
Triton is installed and the kernel's capability check (:func:`.triton_kernel.supports`:
per-channel keys, a key group of 16..128, head dims up to 256, ...) accepts the call;
everything else goes to the PyTorch reference (same signature).  Set
``KVCOMPRESS_KERNELS=reference`` to force the reference everywhere.  ``KVCOMPRESS_KIVI_CUDA=1`` opts in to the
hand-written CUDA kernel (:mod:`.cuda_kernel`, checked first through its own ``supports()``).
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


def kivi_attention_partial(query, packed, scale):
    """Attention over a packed KIVI region; see :func:`.reference.kivi_attention_partial`."""
    if query.is_cuda and os.environ.get("KVCOMPRESS_KIVI_CUDA") == "1" and os.environ.get("KVCOMPRESS_KERNELS", "auto") != "reference":
        from . import cuda_kernel  # opt-in hand-written CUDA kernel (v3), built lazily on first use

        if cuda_kernel.supports(query, packed):
            return cuda_kernel.kivi_attention_partial(query, packed, scale)
    if query.is_cuda and os.environ.get("KVCOMPRESS_KERNELS", "auto") != "reference" and _triton_available():
        from . import triton_kernel  # compiled lazily, on first use

        if triton_kernel.supports(query, packed):
            return triton_kernel.kivi_attention_partial(query, packed, scale)
    return kivi_attention_partial_reference(query, packed, scale)


__all__ = ["BITS", "PackedKV", "bits_per_element", "dequantize_keys", "dequantize_values", "fake_quantize_keys",
           "fake_quantize_values", "kivi_attention_partial", "kivi_attention_partial_reference", "pack",
           "quantize_keys", "quantize_values", "unpack"]
