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

``KVCOMPRESS_KERNELS=reference`` forces the reference everywhere.  The order is
:func:`kvcompress.kernels.ops.kivi_order`, which :func:`kvcompress.kernels.ops.choose` applies once per cache (from
static facts) for compiled decode: a ``PackedKV`` whose ``impl`` is set (or a call with ``impl=``) runs the
registered op ``kvcompress::kivi_partial`` with that implementation and decides nothing per call.
"""

from __future__ import annotations

from .reference import (BITS, PackedKV, bits_per_element, dequantize_keys, dequantize_values,
                        fake_quantize_keys, fake_quantize_values, pack, quantize_keys, quantize_values, unpack)
from .reference import kivi_attention_partial as kivi_attention_partial_reference
from .lanes_reference import KiviLane, PackedLanes
from .lanes_reference import kivi_lanes_attention_partial as kivi_lanes_attention_partial_reference


def _triton_available() -> bool:
    from kvcompress.kernels.ops import triton_available

    return triton_available()


def implementation(query, packed) -> str:
    """Which implementation :func:`kivi_attention_partial` runs for this call: ``"cuda-v3"``, ``"triton-v2"`` or
    ``"reference"`` (the checks above, in order; nothing is compiled here)."""
    from kvcompress.kernels.ops import kivi_order

    def cuda_ok() -> bool:
        from . import cuda_kernel  # hand-written CUDA kernel (v3); nothing is compiled before its first launch

        return cuda_kernel.nvcc_path() is not None and cuda_kernel.supports(query, packed)

    def triton_ok() -> bool:
        from . import triton_kernel  # compiled lazily, on first use

        return triton_kernel.supports(query, packed)

    impl = kivi_order(bool(query.is_cuda), cuda_ok, triton_ok, _triton_available)
    return {"cuda": "cuda-v3", "triton": "triton-v2"}.get(impl, impl)


def kivi_attention_partial(query, packed, scale, *, impl: str | None = None, softcap: float | None = None):
    """Attention over a packed KIVI region; see :func:`.reference.kivi_attention_partial`.

    ``impl`` (or ``packed.impl``): run the registered op ``kvcompress::kivi_partial`` with that implementation
    (``"reference"``, ``"triton"``, ``"cuda"``; chosen once by :func:`kvcompress.kernels.ops.choose`) instead of
    deciding per call.  ``softcap``: logit soft-cap of the scores (every implementation applies it)."""
    impl = impl if impl is not None else getattr(packed, "impl", None)
    if impl is not None:
        from kvcompress.kernels import ops

        return ops.kivi_attention(query, packed, scale, impl=impl, softcap=softcap)
    chosen = implementation(query, packed)
    cap = {} if softcap is None else {"softcap": softcap}
    if chosen == "cuda-v3":
        from . import cuda_kernel  # reads packed.length on the device: skips the slots after it

        return cuda_kernel.kivi_attention_partial(query, packed, scale, **cap)
    if chosen == "triton-v2":
        from . import triton_kernel  # reads packed.length: skips the slots after it

        return triton_kernel.kivi_attention_partial(query, packed, scale, **cap)
    return kivi_attention_partial_reference(query, packed, scale, **cap)


def lanes_attention_partial(query, region, scale, *, impl: str | None = None, softcap: float | None = None):
    """Attention over every lane of a :class:`~.lanes_reference.PackedLanes` (a stacked LeanK + KIVI middle); see
    :func:`.lanes_reference.kivi_lanes_attention_partial`.

    ``impl`` (or ``region.impl``): run the registered op ``kvcompress::kivi_lanes_partial`` with that implementation
    (``"reference"`` / ``"triton"`` / ``"cuda"``, chosen once by :func:`kvcompress.kernels.ops.choose`).  ``None``:
    decided per call, in the order of :func:`kivi_attention_partial` - the CUDA lanes kernel (:mod:`.lanes_cuda`) for
    CUDA tensors when it is enabled, an nvcc is found and it takes the call, else the Triton kernel (:mod:`.lanes_triton`)
    when Triton is installed and it takes the call (``KVCOMPRESS_KERNELS=triton`` also on CPU tensors, under
    ``TRITON_INTERPRET=1``), else the reference."""
    impl = impl if impl is not None else getattr(region, "impl", None)
    if impl is not None:
        from kvcompress.kernels import ops

        return ops.kivi_lanes_attention(query, region, scale, impl=impl, softcap=softcap)
    from kvcompress.kernels.ops import kernels_mode, kivi_cuda_enabled

    mode = kernels_mode()
    if query.is_cuda and mode == "auto" and kivi_cuda_enabled():
        from . import lanes_cuda

        if lanes_cuda.supports(query, region):
            return lanes_cuda.kivi_lanes_attention_partial(query, region, scale, softcap=softcap)
    if (query.is_cuda or mode == "triton") and mode != "reference" and _triton_available():
        from . import lanes_triton  # compiled lazily, on first use

        if lanes_triton.supports(query, region):
            return lanes_triton.kivi_lanes_attention_partial(query, region, scale, softcap=softcap)
    return kivi_lanes_attention_partial_reference(query, region, scale, softcap=softcap)


__all__ = ["BITS", "KiviLane", "PackedKV", "PackedLanes", "lanes_attention_partial",
           "kivi_lanes_attention_partial_reference", "bits_per_element",
           "dequantize_keys", "dequantize_values", "fake_quantize_keys",
           "fake_quantize_values", "implementation", "kivi_attention_partial", "kivi_attention_partial_reference", "pack",
           "quantize_keys", "quantize_values", "unpack"]
