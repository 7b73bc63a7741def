"""The kernels as registered custom ops (namespace ``kvcompress``), and the build-time chooser.

Compiled decode (``torch.compile(..., fullgraph=True)``, CUDA graphs with ``mode="reduce-overhead"``) needs every
kernel to be an op the compiler sees as one opaque call: these are registered with
:func:`torch.library.custom_op`, take only tensors / ints / floats / bools / strs (lists of tensors for LeanK's
lanes), declare no mutation, and have a fake implementation giving output shapes and dtypes.

====================================  =========================================================================
op                                    semantics (the PyTorch reference, also the CPU implementation)
====================================  =========================================================================
``kvcompress::kivi_partial``          :func:`kvcompress.kernels.kivi.reference.kivi_attention_partial`
``kvcompress::kivi_lanes_partial``    :func:`kvcompress.kernels.kivi.lanes_reference.kivi_lanes_attention_partial`
                                      (every quantized lane of a stacked LeanK + KIVI middle, one op; CUDA:
                                      :mod:`kvcompress.kernels.kivi.lanes_cuda`, Triton:
                                      :mod:`kvcompress.kernels.kivi.lanes_triton`, one launch + one merge each)
``kvcompress::kivi_lanes_buffer_partial`` :func:`kvcompress.kernels.kivi.lanes_reference.kivi_lanes_buffer_attention_partial`
                                      (the lanes and a full-precision buffer together; CUDA: one launch, buffer CTAs)
``kvcompress::paged_partial``         :func:`kvcompress.kernels.paged.reference.paged_attention_partial`
``kvcompress::lanes_partial``         :func:`kvcompress.kernels.leank.reference.grouped_partial_attention`
``kvcompress::select_topk``           :func:`kvcompress.kernels.doublesparse.reference.select_topk`
``kvcompress::gather_partial``        :func:`kvcompress.kernels.doublesparse.reference.gather_partial_attention`
``kvcompress::select_gather``         :func:`kvcompress.kernels.doublesparse.reference.select_gather_partial`
                                      (the two above in one op; Triton: one kernel, a program per selection)
``kvcompress::kivi_quantize``         :func:`kvcompress.kernels.kivi.reference.fill_masked`, ``quantize_keys``,
                                      ``quantize_values`` (Triton: :mod:`kvcompress.kernels.kivi.quantize_triton`)
``kvcompress::merge_partials``        :func:`kvcompress.kernels.attention.reference.merge_partials` + the cast to
                                      the query's dtype (a read's region partials; Triton:
                                      :mod:`kvcompress.kernels.attention.merge_triton`, one launch)
====================================  =========================================================================

* **CPU**: always the reference (``impl`` is accepted and ignored: the references are the CPU path), except
  ``kivi_quantize``, which raises for ``impl="triton"`` on CPU tensors.
* **CUDA**: the implementation named by the explicit ``impl`` argument - ``"reference"``, ``"triton"`` (every op)
  or ``"cuda"`` (KIVI and KIVI lanes: the hand-written v3 kernel, built with nvcc at its first call, bound with
  ctypes).  The op
  never reads the environment, looks up nvcc or probes the device: :func:`choose` does that once, when a cache is
  built, and the caller passes its answer with every call.  A named kernel that cannot take the call raises
  (``ValueError`` naming the op and the implementation); nothing falls back silently.

``softcap`` (the attention ops ``kivi_partial``, ``paged_partial``, ``lanes_partial``, ``gather_partial``): the logit
soft-cap of a model's attention (Gemma 2: ``softcap * tanh(s / softcap)`` on the scaled scores, before masking);
``0.0`` means none.  Every implementation applies it (the references, the Triton kernels and the KIVI CUDA kernel), so
the choice of an implementation never depends on it.  Learned sink logits (gpt-oss) are not an argument of any op:
a partial never sees them; :func:`kvcompress.kernels.attention.reference.merge_partials` adds them once, when the
partials are merged.

``length`` (KIVI, KIVI lanes, paged, lanes; optional): a 0-dim int32 / int64 device tensor, the number of leading
token slots that may hold live data.  Slots at or after it are treated as invalid by every implementation (the reference masks
them), and the Triton kernels do not read them: a static cache sized for ``max_cache_len`` passes its fill level
and the kernels skip the empty capacity, with a grid that does not depend on the value (CUDA-graph safe); so does
the KIVI CUDA kernel (v3), which reads the length on the device once per CTA (since session 23).

``out_dtype`` (``lanes_partial``, ``kivi_buffer_partial``, ``kivi_lanes_buffer_partial``; a name, ``"float32"`` by
default, ``"float16"`` or ``"bfloat16"``): ``out``'s dtype.  A decode read whose only part one of these launches is
(a static layer's empty stack or low-rank read, a buffer read with its KIVI region) asks for its own dtype: the
split merge stores the float32 result rounded once, so no cast launch follows (the LSE stays float32).

The Python wrappers below (:func:`kivi_attention`, :func:`paged_attention`, :func:`lanes_attention`,
:func:`select`, :func:`gather_attention`) take the structured arguments the subpackages use (``PackedKV``, lanes,
``Labels``) and call the ops; the subpackages' dispatchers route through them when given ``impl=``.

This module registers the ops at import (as any ``torch.library`` op); it imports neither Triton nor the CUDA
kernel module, reads no environment and compiles nothing until an op runs on CUDA or :func:`choose` is called.
(No ``from __future__ import annotations`` here: ``custom_op`` infers the schema from the annotations.)
"""

import functools
import logging
import os
from typing import Optional, Sequence

import torch
from torch import Tensor

from .attention.partials import MERGE_MAX_PARTS  # the most region partials one merge_partials call merges
from .doublesparse import reference as ds_ref
from .kivi import lanes_reference as kivi_lanes_ref
from .kivi import reference as kivi_ref
from .leank import reference as leank_ref
from .paged import reference as paged_ref

logger = logging.getLogger(__name__)

IMPLS = ("reference", "triton", "cuda")
# op name -> implementations its CUDA kernel accepts
OPS = {
    "kivi_partial": ("reference", "triton", "cuda"),
    "kivi_buffer_partial": ("reference", "triton", "cuda"),
    "kivi_lanes_partial": ("reference", "triton", "cuda"),
    "kivi_lanes_buffer_partial": ("reference", "triton", "cuda"),
    "paged_partial": ("reference", "triton"),
    "lanes_partial": ("reference", "triton"),
    "select_topk": ("reference", "triton"),
    "gather_partial": ("reference", "triton"),
    "select_gather": ("reference", "triton"),
    "kivi_quantize": ("reference", "triton"),
    "kivi_partial_scored": ("reference", "triton"),
    "kivi_lanes_partial_scored": ("reference", "triton"),
    "lanes_partial_scored": ("reference", "triton"),
    "merge_partials": ("reference", "triton"),
}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _out_dtype(op: str, name: str) -> torch.dtype:
    """An op's output-dtype argument (a name: ops take plain argument types) as a torch dtype."""
    if name not in _DTYPES:
        raise ValueError(f"kvcompress::{op}: out_dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def _dtype_name(dtype: torch.dtype | None) -> str:
    """The name :func:`_out_dtype` reads for ``dtype`` (``None``: ``"float32"``)."""
    if dtype is None:
        return "float32"
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"out_dtype must be one of {sorted(_DTYPES.values(), key=str)} or None, got {dtype}")
#: the scored variant of an attention op -> the op it extends (same inputs; also returns what it scored)
SCORED = {"kivi_partial_scored": "kivi_partial", "kivi_lanes_partial_scored": "kivi_lanes_partial",
          "lanes_partial_scored": "lanes_partial"}


def _check_impl(op: str, impl: str) -> None:
    if impl not in OPS[op]:
        raise ValueError(f"kvcompress::{op}: impl must be one of {OPS[op]}, got {impl!r}")


def _check_length(op: str, length: Optional[Tensor]) -> None:
    if length is not None and (length.dim() != 0 or length.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"kvcompress::{op}: length must be a 0-dim int32/int64 tensor, got "
                         f"{tuple(length.shape)} {length.dtype}")


def live_slots(valid: Optional[Tensor], length: Optional[Tensor], tokens: int, batch: int,
               device: torch.device) -> Optional[Tensor]:
    """``valid [B, T]`` (or ``None`` = all valid) restricted to slots ``< length``: bool ``[B, T]``, or ``valid``
    itself when ``length`` is ``None``.  Shape-static and sync-free."""
    if length is None:
        return valid
    ok = torch.arange(tokens, device=device) < length.to(device)
    return ok.expand(batch, tokens) if valid is None else valid & ok


def _fresh(*ts: Tensor):
    """Outputs as fresh contiguous tensors (the fake implementations promise contiguous outputs)."""
    out = tuple(t.contiguous() for t in ts)
    return out if len(out) > 1 else out[0]


def _empty_partial(query: Tensor, dv) -> tuple[Tensor, Tensor]:
    b, h, m, _ = query.shape
    return (query.new_empty((b, h, m, dv), dtype=torch.float32), query.new_empty((b, h, m), dtype=torch.float32))


# ----------------------------------------------------------------------------- tuning snapshots (read once)


@functools.lru_cache(maxsize=None)
def _kivi_triton_base(bits: int, group: int, dk: int, dv: int, v_group: int) -> dict:
    from .kivi import triton_kernel

    return triton_kernel.resolved_config(bits, group, dk, dv, v_group, torch.device("cuda"))


@functools.lru_cache(maxsize=None)
def _kivi_cuda_base(bits: int) -> dict:
    from .kivi import cuda_kernel

    cuda_kernel.read_buffer_settings(bits)  # what fuses_buffer decides from (inside compiled steps too)
    return cuda_kernel.config(bits)


@functools.lru_cache(maxsize=None)
def _leank_base() -> dict:
    from .leank import triton_kernel

    return triton_kernel._config()


# ----------------------------------------------------------------------------- KIVI


@torch.library.custom_op("kvcompress::kivi_partial", mutates_args=(), device_types="cpu")
def kivi_partial(query: Tensor, k_codes: Tensor, k_scale: Tensor, k_zero: Tensor, v_codes: Tensor,
                 v_scale: Tensor, v_zero: Tensor, valid: Tensor, length: Optional[Tensor], bits: int, group: int,
                 scale: float, k_per_token: bool = False, softcap: float = 0.0,
                 impl: str = "reference") -> tuple[Tensor, Tensor]:
    """Attention of ``query [B, Hkv, M, Dk]`` over a packed KIVI region (the fields of ``PackedKV``):
    ``(out [B, Hkv, M, Dv] fp32, lse [B, Hkv, M] fp32)``.  CPU: the reference."""
    _check_impl("kivi_partial", impl)
    _check_length("kivi_partial", length)
    packed = kivi_ref.PackedKV(bits, group, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                               live_slots(valid, length, valid.shape[-1], valid.shape[0], valid.device), k_per_token)
    return _fresh(*kivi_ref.kivi_attention_partial(query, packed, scale, softcap=softcap))


@kivi_partial.register_kernel("cuda")
def _kivi_partial_cuda(query, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, valid, length, bits, group, scale,
                       k_per_token=False, softcap=0.0, impl="reference"):
    _check_impl("kivi_partial", impl)
    _check_length("kivi_partial", length)
    packed = kivi_ref.PackedKV(bits, group, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, valid, k_per_token)
    if impl == "triton":
        from .kivi import triton_kernel

        dk, dv = query.shape[-1], v_codes.shape[-1] * (32 // bits)
        return _fresh(*triton_kernel._forward(query, packed, scale, length=length,
                                              base=_kivi_triton_base(bits, group, dk, dv, packed.v_group),
                                              softcap=softcap))
    if impl == "cuda":  # the kernel reads the length on the device: tiles after it are not read, no mask op here
        from .kivi import cuda_kernel

        packed.length = length
        return _fresh(*cuda_kernel._forward(query, packed, scale, base=_kivi_cuda_base(bits), softcap=softcap))
    packed.valid = live_slots(valid, length, valid.shape[-1], valid.shape[0], valid.device)
    return _fresh(*kivi_ref.kivi_attention_partial(query, packed, scale, softcap=softcap))


@kivi_partial.register_fake
def _kivi_partial_fake(query, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, valid, length, bits, group, scale,
                       k_per_token=False, softcap=0.0, impl="reference"):
    return _empty_partial(query, v_codes.shape[-1] * (32 // bits))


def kivi_attention(query: Tensor, packed, scale: float, *, impl: str, length: Optional[Tensor] = None,
                   softcap: Optional[float] = None) -> tuple[Tensor, Tensor]:
    """``kvcompress::kivi_partial`` over a :class:`~kvcompress.kernels.kivi.PackedKV` (``length`` defaults to
    ``packed.length``)."""
    if length is None:
        length = packed.length
    return _OPS["kivi_partial"](
        _cuda_query(query, impl), packed.k_codes, packed.k_scale, packed.k_zero, packed.v_codes, packed.v_scale,
        packed.v_zero, packed.valid, length, packed.bits, packed.group, float(scale), bool(packed.k_per_token),
        float(softcap or 0.0), impl)


@torch.library.custom_op("kvcompress::kivi_buffer_partial", mutates_args=(), device_types="cpu")
def kivi_buffer_partial(query: Tensor, k_codes: Tensor, k_scale: Tensor, k_zero: Tensor, v_codes: Tensor,
                        v_scale: Tensor, v_zero: Tensor, valid: Tensor, length: Optional[Tensor], bits: int, group: int,
                        scale: float, buffer_k: Tensor, buffer_v: Tensor, buffer_valid: Tensor,
                        buffer_length: Optional[Tensor], out_dtype: str = "float32", k_per_token: bool = False,
                        softcap: float = 0.0, impl: str = "reference") -> tuple[Tensor, Tensor]:
    """Attention of ``query [B, Hkv, M, Dk]`` over a packed KIVI region (as ``kivi_partial``) and a full-precision
    buffer ``buffer_k`` / ``buffer_v`` ``[B, Hkv, T, Dk / Dv]`` (validity ``buffer_valid [B, T]``, slots before
    ``buffer_length``) together: ``(out, lse)`` of the joint softmax.  ``impl`` ``"cuda"``: one launch of the
    hand-written kernel (its buffer CTAs) and its split combine; ``"triton"``: the two regions read apart (the KIVI
    Triton kernel, the grouped lanes kernel) and merged; CPU: the reference.  ``out_dtype``: ``out``'s dtype
    (``"float32"`` / ``"float16"`` / ``"bfloat16"``, rounded once: a read whose only part this is needs no cast after
    it; the CUDA split combine stores it)."""
    _check_impl("kivi_buffer_partial", impl)
    _check_length("kivi_buffer_partial", length)
    _check_length("kivi_buffer_partial", buffer_length)
    dtype = _out_dtype("kivi_buffer_partial", out_dtype)
    return _as_out(dtype, *_kivi_buffer_reference(query, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, valid,
                                                  length, bits, group, scale, buffer_k, buffer_v, buffer_valid,
                                                  buffer_length, k_per_token, softcap))


def _as_out(dtype: torch.dtype, out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """A float32 partial's ``out`` in ``dtype`` (one rounding; the same tensor when already so)."""
    return (out if out.dtype == dtype else out.to(dtype)), lse


def _kivi_buffer_reference(query, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, valid, length, bits, group,
                           scale, buffer_k, buffer_v, buffer_valid, buffer_length, k_per_token, softcap):
    packed = kivi_ref.PackedKV(bits, group, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                               live_slots(valid, length, valid.shape[-1], valid.shape[0], valid.device), k_per_token)
    return _fresh(*kivi_ref.kivi_buffer_attention_partial(query, packed, scale, buffer_k, buffer_v, buffer_valid,
                                                          buffer_length, softcap=softcap))


def _with_buffer_apart(query, region, buffer_k, buffer_v, buffer_valid, buffer_length, scale, softcap):
    """A buffer op's ``triton`` implementation after its packed region's partial ``region``: the full-precision
    buffer through the grouped lanes kernel (the reference where the query's dtype is not the keys'), the two merged."""
    from .attention.reference import merge_partials, merged_lse

    if query.dtype == buffer_k.dtype:  # (the lanes kernel reads the query in the keys' dtype)
        buffer = _lanes_partial_cuda(query, [None], [None], [buffer_k], [buffer_v], [buffer_valid], [None],
                                     buffer_length, scale, "float32", softcap, "triton")
    else:
        buffer = kivi_ref.buffer_attention_partial(query, buffer_k, buffer_v, buffer_valid, buffer_length, scale,
                                                   softcap=softcap)
    return _fresh(merge_partials([region, buffer]), merged_lse([region[1], buffer[1]]))


@kivi_buffer_partial.register_kernel("cuda")
def _kivi_buffer_partial_cuda(query, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, valid, length, bits, group,
                              scale, buffer_k, buffer_v, buffer_valid, buffer_length, out_dtype="float32",
                              k_per_token=False, softcap=0.0, impl="reference"):
    _check_impl("kivi_buffer_partial", impl)
    _check_length("kivi_buffer_partial", length)
    _check_length("kivi_buffer_partial", buffer_length)
    dtype = _out_dtype("kivi_buffer_partial", out_dtype)
    if impl == "cuda":  # one launch: the packed region's splits and the buffer's CTAs, then the split combine
        from .kivi import cuda_kernel

        packed = kivi_ref.PackedKV(bits, group, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, valid, k_per_token)
        packed.length = length
        return _fresh(*cuda_kernel._forward(query, packed, scale, base=_kivi_cuda_base(bits), softcap=softcap,
                                            buffer=(buffer_k, buffer_v, buffer_valid, buffer_length),
                                            out_dtype=dtype))
    if impl == "triton":  # the two regions apart, merged
        region = _kivi_partial_cuda(query, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, valid, length, bits,
                                    group, scale, k_per_token, softcap, "triton")
        return _as_out(dtype, *_with_buffer_apart(query, region, buffer_k, buffer_v, buffer_valid, buffer_length,
                                                  scale, softcap))
    return _as_out(dtype, *_kivi_buffer_reference(query, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, valid,
                                                  length, bits, group, scale, buffer_k, buffer_v, buffer_valid,
                                                  buffer_length, k_per_token, softcap))


@kivi_buffer_partial.register_fake
def _kivi_buffer_partial_fake(query, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, valid, length, bits, group,
                              scale, buffer_k, buffer_v, buffer_valid, buffer_length, out_dtype="float32",
                              k_per_token=False, softcap=0.0, impl="reference"):
    out, lse = _empty_partial(query, v_codes.shape[-1] * (32 // bits))
    return query.new_empty(out.shape, dtype=_out_dtype("kivi_buffer_partial", out_dtype)), lse


def kivi_buffer_attention(query: Tensor, packed, scale: float, k: Tensor, v: Tensor, valid: Tensor,
                          length: Optional[Tensor] = None, *, impl: str, softcap: Optional[float] = None,
                          out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    """``kvcompress::kivi_buffer_partial`` over a :class:`~kvcompress.kernels.kivi.PackedKV` (its ``length`` bounds
    the packed slots) and a full-precision buffer ``k`` / ``v`` / ``valid`` bounded by ``length``; ``out_dtype``: the
    output's dtype (``None``: float32)."""
    return _OPS["kivi_buffer_partial"](
        _cuda_query(query, impl), packed.k_codes, packed.k_scale, packed.k_zero, packed.v_codes, packed.v_scale,
        packed.v_zero, packed.valid, packed.length, packed.bits, packed.group, float(scale), k, v, valid, length,
        _dtype_name(out_dtype), bool(packed.k_per_token), float(softcap or 0.0), impl)


def scored_impl(impl: str) -> str:
    """The implementation of a scored op for a region whose read op was chosen as ``impl``: the hand-written KIVI
    CUDA kernel (v3) returns no scores, so its regions are scored by the Triton kernel (a static mapping of the
    choice made when the cache was built: nothing is probed here)."""
    return "triton" if impl == "cuda" else impl


@torch.library.custom_op("kvcompress::kivi_partial_scored", mutates_args=(), device_types="cpu")
def kivi_partial_scored(query: Tensor, k_codes: Tensor, k_scale: Tensor, k_zero: Tensor, v_codes: Tensor,
                        v_scale: Tensor, v_zero: Tensor, valid: Tensor, length: Optional[Tensor], bits: int,
                        group: int, scale: float, k_per_token: bool = False, softcap: float = 0.0,
                        impl: str = "reference") -> tuple[Tensor, Tensor, Tensor]:
    """``kvcompress::kivi_partial`` that also returns what it scored: ``(out, lse, logits [B, Hkv, M, T] fp32)``,
    the scaled (soft-capped) scores in natural-log units, ``-inf`` on slots not attended
    (:func:`kvcompress.kernels.kivi.reference.kivi_attention_scored`).  CPU: the reference."""
    _check_impl("kivi_partial_scored", impl)
    _check_length("kivi_partial_scored", length)
    packed = kivi_ref.PackedKV(bits, group, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                               live_slots(valid, length, valid.shape[-1], valid.shape[0], valid.device), k_per_token)
    return _fresh(*kivi_ref.kivi_attention_scored(query, packed, scale, softcap=softcap))


@kivi_partial_scored.register_kernel("cuda")
def _kivi_partial_scored_cuda(query, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, valid, length, bits, group,
                              scale, k_per_token=False, softcap=0.0, impl="reference"):
    _check_impl("kivi_partial_scored", impl)
    _check_length("kivi_partial_scored", length)
    packed = kivi_ref.PackedKV(bits, group, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, valid, k_per_token)
    if impl == "triton":
        from .kivi import triton_kernel

        dk, dv = query.shape[-1], v_codes.shape[-1] * (32 // bits)
        b, h, m, _ = query.shape
        logits = query.new_full((b, h, m, valid.shape[-1]), float("-inf"), dtype=torch.float32)
        out, lse = triton_kernel._forward(query, packed, scale, length=length,
                                          base=_kivi_triton_base(bits, group, dk, dv, packed.v_group),
                                          softcap=softcap, logits=logits)
        return _fresh(out, lse, logits)
    packed.valid = live_slots(valid, length, valid.shape[-1], valid.shape[0], valid.device)
    return _fresh(*kivi_ref.kivi_attention_scored(query, packed, scale, softcap=softcap))


@kivi_partial_scored.register_fake
def _kivi_partial_scored_fake(query, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, valid, length, bits, group,
                              scale, k_per_token=False, softcap=0.0, impl="reference"):
    b, h, m, _ = query.shape
    return (*_empty_partial(query, v_codes.shape[-1] * (32 // bits)),
            query.new_empty((b, h, m, valid.shape[-1]), dtype=torch.float32))


def kivi_attention_scored(query: Tensor, packed, scale: float, *, impl: str, length: Optional[Tensor] = None,
                          softcap: Optional[float] = None) -> tuple[Tensor, Tensor, Tensor]:
    """``kvcompress::kivi_partial_scored`` over a :class:`~kvcompress.kernels.kivi.PackedKV`: ``(out, lse, logits)``.
    ``impl``: the region's read implementation (``"cuda"`` is scored by ``"triton"``, :func:`scored_impl`)."""
    if length is None:
        length = packed.length
    return _OPS["kivi_partial_scored"](
        query, packed.k_codes, packed.k_scale, packed.k_zero, packed.v_codes, packed.v_scale, packed.v_zero,
        packed.valid, length, packed.bits, packed.group, float(scale), bool(packed.k_per_token),
        float(softcap or 0.0), scored_impl(impl))


def split_lane_logits(flat: Tensor, shapes: Sequence[tuple[int, int, int, int]]) -> list[Tensor]:
    """The per-lane views ``[B, h_i, M, T_i]`` of a scored lanes op's flat logits (no copy)."""
    sizes = [b * h * m * t for b, h, m, t in shapes]
    return [part.view(shape) for part, shape in zip(flat.split(sizes), shapes)]


def _flat_logits(query: Tensor, shapes: Sequence[tuple[int, int, int, int]]) -> Tensor:
    """A scored lanes op's flat float32 logits for lanes of ``shapes``, filled with ``-inf`` (slots a kernel does not
    read keep it)."""
    return query.new_full((sum(b * h * m * t for b, h, m, t in shapes),), float("-inf"), dtype=torch.float32)


def _flatten(per_lane: Sequence[Tensor]) -> Tensor:
    """Per-lane logits as a scored lanes op's one flat output."""
    return torch.cat([x.reshape(-1) for x in per_lane])


# ----------------------------------------------------------------------------- KIVI lanes (stacked LeanK + KIVI)


def _kivi_region(heads, channels, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, valid, length, bits, group,
                 num_heads, head_dim):
    n = len(k_codes)
    if n == 0 or any(len(x) != n for x in (heads, channels, k_scale, k_zero, v_codes, v_scale, v_zero)):
        raise ValueError("kvcompress::kivi_lanes_partial: one entry per lane in heads / channels / k_codes / "
                         "k_scale / k_zero / v_codes / v_scale / v_zero, got "
                         f"{[len(x) for x in (heads, channels, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)]}")
    lanes = tuple(kivi_lanes_ref.KiviLane(*lane) for lane in zip(heads, channels, k_codes, k_scale, k_zero, v_codes,
                                                                 v_scale, v_zero))
    return kivi_lanes_ref.PackedLanes(bits, group, lanes, valid, num_heads, head_dim, length=length)


@torch.library.custom_op("kvcompress::kivi_lanes_partial", mutates_args=(), device_types="cpu")
def kivi_lanes_partial(query: Tensor, heads: list[Optional[Tensor]], channels: list[Optional[Tensor]],
                       k_codes: list[Tensor], k_scale: list[Tensor], k_zero: list[Tensor], v_codes: list[Tensor],
                       v_scale: list[Tensor], v_zero: list[Tensor], valid: Tensor, length: Optional[Tensor], bits: int,
                       group: int, scale: float, softcap: float = 0.0,
                       impl: str = "reference") -> tuple[Tensor, Tensor]:
    """Attention of ``query [B, H, M, D]`` over KIVI lanes sharing their token slots (lane ``i`` = ``heads[i]``
    (positions among the ``H`` heads, ``None`` = all), ``channels[i]`` (kept query channels, ``None`` = all) and its
    packed payload; one ``valid [B, T]`` for all; see :mod:`kvcompress.kernels.kivi.lanes_reference`):
    ``(out [B, H, M, Dv] fp32, lse [B, H, M] fp32)``.  CPU: the reference."""
    _check_impl("kivi_lanes_partial", impl)
    _check_length("kivi_lanes_partial", length)
    region = _kivi_region(heads, channels, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, valid, length, bits,
                          group, query.shape[1], query.shape[-1])
    return _fresh(*kivi_lanes_ref.kivi_lanes_attention_partial(query, region, scale, softcap=softcap))


@kivi_lanes_partial.register_kernel("cuda")
def _kivi_lanes_partial_cuda(query, heads, channels, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, valid, length,
                             bits, group, scale, softcap=0.0, impl="reference"):
    _check_impl("kivi_lanes_partial", impl)
    _check_length("kivi_lanes_partial", length)
    region = _kivi_region(heads, channels, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, valid, length, bits,
                          group, query.shape[1], query.shape[-1])
    if impl == "cuda":
        from .kivi import lanes_cuda

        return _fresh(*lanes_cuda.kivi_lanes_attention_partial(query, region, scale, base=_kivi_cuda_base(bits),
                                                                softcap=softcap))
    if impl == "triton":
        from .kivi import lanes_triton

        dv = v_codes[0].shape[-1] * (32 // bits)
        base = _kivi_triton_base(bits, group, query.shape[-1], dv, dv // v_scale[0].shape[-1])
        return _fresh(*lanes_triton.kivi_lanes_attention_partial(query, region, scale, base=base, softcap=softcap))
    return _fresh(*kivi_lanes_ref.kivi_lanes_attention_partial(query, region, scale, softcap=softcap))


@kivi_lanes_partial.register_fake
def _kivi_lanes_partial_fake(query, heads, channels, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, valid, length,
                             bits, group, scale, softcap=0.0, impl="reference"):
    return _empty_partial(query, v_codes[0].shape[-1] * (32 // bits))


def kivi_lanes_attention(query: Tensor, region, scale: float, *, impl: str, length: Optional[Tensor] = None,
                         softcap: Optional[float] = None) -> tuple[Tensor, Tensor]:
    """``kvcompress::kivi_lanes_partial`` over a :class:`~kvcompress.kernels.kivi.PackedLanes` (``length`` defaults
    to ``region.length``)."""
    return _OPS["kivi_lanes_partial"](*_kivi_lanes_args(_cuda_query(query, impl), region, scale, length, softcap),
                                      impl)


def _cuda_query(query: Tensor, impl: str) -> Tensor:
    """The query as the KIVI CUDA kernels read it (fp16 operands) when ``impl`` is ``"cuda"``: cast here, in the
    caller's graph, where a compiled step fuses the cast into the kernel that makes the query; inside the op it
    would be a launch of its own per layer and step.  The op casts the same way, so nothing else changes."""
    return query.to(torch.float16) if impl == "cuda" and query.dtype != torch.float16 else query


def _kivi_lanes_args(query: Tensor, region, scale: float, length: Optional[Tensor], softcap: Optional[float]) -> tuple:
    """The KIVI lanes ops' arguments (all but ``impl``) for a :class:`~kvcompress.kernels.kivi.PackedLanes`."""
    lanes = region.lanes
    return (query, [ln.heads for ln in lanes], [ln.channels for ln in lanes], [ln.k_codes for ln in lanes],
            [ln.k_scale for ln in lanes], [ln.k_zero for ln in lanes], [ln.v_codes for ln in lanes],
            [ln.v_scale for ln in lanes], [ln.v_zero for ln in lanes], region.valid,
            region.length if length is None else length, region.bits, region.group, float(scale),
            float(softcap or 0.0))


@torch.library.custom_op("kvcompress::kivi_lanes_buffer_partial", mutates_args=(), device_types="cpu")
def kivi_lanes_buffer_partial(query: Tensor, heads: list[Optional[Tensor]], channels: list[Optional[Tensor]],
                              k_codes: list[Tensor], k_scale: list[Tensor], k_zero: list[Tensor],
                              v_codes: list[Tensor], v_scale: list[Tensor], v_zero: list[Tensor], valid: Tensor,
                              length: Optional[Tensor], bits: int, group: int, scale: float, buffer_k: Tensor,
                              buffer_v: Tensor, buffer_valid: Tensor, buffer_length: Optional[Tensor],
                              out_dtype: str = "float32", softcap: float = 0.0,
                              impl: str = "reference") -> tuple[Tensor, Tensor]:
    """Attention of ``query [B, H, M, D]`` over KIVI lanes (as ``kivi_lanes_partial``) and a full-precision buffer
    ``buffer_k`` / ``buffer_v`` ``[B, H, T, D / Dv]`` over every head and all query channels (validity ``buffer_valid
    [B, T]``, slots before ``buffer_length``) together: ``(out, lse)`` of the joint softmax.  ``impl`` ``"cuda"``: one
    launch of the CUDA lanes kernel (its buffer CTAs) and its split combine; ``"triton"``: the two regions read apart
    (the KIVI lanes Triton kernel, the grouped lanes kernel) and merged; CPU: the reference.  ``out_dtype``: ``out``'s
    dtype (as ``kivi_buffer_partial``'s)."""
    _check_impl("kivi_lanes_buffer_partial", impl)
    _check_length("kivi_lanes_buffer_partial", length)
    _check_length("kivi_lanes_buffer_partial", buffer_length)
    dtype = _out_dtype("kivi_lanes_buffer_partial", out_dtype)
    region = _kivi_region(heads, channels, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, valid, length, bits,
                          group, query.shape[1], query.shape[-1])
    return _fresh(*_as_out(dtype, *kivi_lanes_ref.kivi_lanes_buffer_attention_partial(
        query, region, scale, buffer_k, buffer_v, buffer_valid, buffer_length, softcap=softcap)))


@kivi_lanes_buffer_partial.register_kernel("cuda")
def _kivi_lanes_buffer_partial_cuda(query, heads, channels, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, valid,
                                    length, bits, group, scale, buffer_k, buffer_v, buffer_valid, buffer_length,
                                    out_dtype="float32", softcap=0.0, impl="reference"):
    _check_impl("kivi_lanes_buffer_partial", impl)
    _check_length("kivi_lanes_buffer_partial", length)
    _check_length("kivi_lanes_buffer_partial", buffer_length)
    dtype = _out_dtype("kivi_lanes_buffer_partial", out_dtype)
    region = _kivi_region(heads, channels, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, valid, length, bits,
                          group, query.shape[1], query.shape[-1])
    if impl == "cuda":  # one launch: the lanes' splits and the buffer's CTAs, then the split combine
        from .kivi import lanes_cuda

        return _fresh(*lanes_cuda.kivi_lanes_attention_partial(
            query, region, scale, base=_kivi_cuda_base(bits), softcap=softcap,
            buffer=(buffer_k, buffer_v, buffer_valid, buffer_length), out_dtype=dtype))
    if impl == "triton":  # the two regions apart, merged
        lanes = _kivi_lanes_partial_cuda(query, heads, channels, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                                         valid, length, bits, group, scale, softcap, "triton")
        return _as_out(dtype, *_with_buffer_apart(query, lanes, buffer_k, buffer_v, buffer_valid, buffer_length,
                                                  scale, softcap))
    return _fresh(*_as_out(dtype, *kivi_lanes_ref.kivi_lanes_buffer_attention_partial(
        query, region, scale, buffer_k, buffer_v, buffer_valid, buffer_length, softcap=softcap)))


@kivi_lanes_buffer_partial.register_fake
def _kivi_lanes_buffer_partial_fake(query, heads, channels, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, valid,
                                    length, bits, group, scale, buffer_k, buffer_v, buffer_valid, buffer_length,
                                    out_dtype="float32", softcap=0.0, impl="reference"):
    out, lse = _empty_partial(query, v_codes[0].shape[-1] * (32 // bits))
    return query.new_empty(out.shape, dtype=_out_dtype("kivi_lanes_buffer_partial", out_dtype)), lse


def kivi_lanes_buffer_attention(query: Tensor, region, scale: float, k: Tensor, v: Tensor, valid: Tensor,
                                length: Optional[Tensor] = None, *, impl: str, softcap: Optional[float] = None,
                                out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    """``kvcompress::kivi_lanes_buffer_partial`` over a :class:`~kvcompress.kernels.kivi.PackedLanes` (its ``length``
    bounds the lanes' slots) and a full-precision buffer ``k`` / ``v`` / ``valid`` bounded by ``length``;
    ``out_dtype``: the output's dtype (``None``: float32)."""
    args = _kivi_lanes_args(_cuda_query(query, impl), region, scale, None, softcap)
    return _OPS["kivi_lanes_buffer_partial"](*args[:-1], k, v, valid, length, _dtype_name(out_dtype), args[-1], impl)


def _kivi_lane_shapes(query: Tensor, heads, valid: Tensor) -> list:
    """Each KIVI lane's logits shape ``[B, h_i, M, T]`` (its head list ``heads[i]``, ``None``: every head)."""
    b, hq, m, _ = query.shape
    return [(b, hq if h is None else h.shape[0], m, valid.shape[-1]) for h in heads]


@torch.library.custom_op("kvcompress::kivi_lanes_partial_scored", mutates_args=(), device_types="cpu")
def kivi_lanes_partial_scored(query: Tensor, heads: list[Optional[Tensor]], channels: list[Optional[Tensor]],
                              k_codes: list[Tensor], k_scale: list[Tensor], k_zero: list[Tensor],
                              v_codes: list[Tensor], v_scale: list[Tensor], v_zero: list[Tensor], valid: Tensor,
                              length: Optional[Tensor], bits: int, group: int, scale: float, softcap: float = 0.0,
                              impl: str = "reference") -> tuple[Tensor, Tensor, Tensor]:
    """``kvcompress::kivi_lanes_partial`` that also returns what it scored: ``(out, lse, logits)``, ``logits`` flat
    float32, lane ``i``'s ``[B, h_i, M, T]`` scores one after the other (:func:`split_lane_logits`; natural-log
    units, ``-inf`` on slots not attended).  CPU: the reference."""
    _check_impl("kivi_lanes_partial_scored", impl)
    _check_length("kivi_lanes_partial_scored", length)
    region = _kivi_region(heads, channels, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, valid, length, bits,
                          group, query.shape[1], query.shape[-1])
    out, lse, logits = kivi_lanes_ref.kivi_lanes_attention_scored(query, region, scale, softcap=softcap)
    return _fresh(out, lse, _flatten(logits))


@kivi_lanes_partial_scored.register_kernel("cuda")
def _kivi_lanes_partial_scored_cuda(query, heads, channels, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, valid,
                                    length, bits, group, scale, softcap=0.0, impl="reference"):
    _check_impl("kivi_lanes_partial_scored", impl)
    _check_length("kivi_lanes_partial_scored", length)
    region = _kivi_region(heads, channels, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, valid, length, bits,
                          group, query.shape[1], query.shape[-1])
    if impl == "triton":
        from .kivi import lanes_triton

        dv = v_codes[0].shape[-1] * (32 // bits)
        base = _kivi_triton_base(bits, group, query.shape[-1], dv, dv // v_scale[0].shape[-1])
        shapes = _kivi_lane_shapes(query, heads, valid)
        flat = _flat_logits(query, shapes)
        out, lse = lanes_triton.kivi_lanes_attention_partial(query, region, scale, base=base, softcap=softcap,
                                                             logits=split_lane_logits(flat, shapes))
        return _fresh(out, lse, flat)
    out, lse, logits = kivi_lanes_ref.kivi_lanes_attention_scored(query, region, scale, softcap=softcap)
    return _fresh(out, lse, _flatten(logits))


@kivi_lanes_partial_scored.register_fake
def _kivi_lanes_partial_scored_fake(query, heads, channels, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, valid,
                                    length, bits, group, scale, softcap=0.0, impl="reference"):
    n = sum(b * h * m * t for b, h, m, t in _kivi_lane_shapes(query, heads, valid))
    return (*_empty_partial(query, v_codes[0].shape[-1] * (32 // bits)),
            query.new_empty((n,), dtype=torch.float32))


def kivi_lanes_attention_scored(query: Tensor, region, scale: float, *, impl: str, length: Optional[Tensor] = None,
                                softcap: Optional[float] = None) -> tuple[Tensor, Tensor, list[Tensor]]:
    """``kvcompress::kivi_lanes_partial_scored`` over a :class:`~kvcompress.kernels.kivi.PackedLanes`:
    ``(out, lse, per-lane logits [B, h_i, M, T])``."""
    out, lse, flat = _OPS["kivi_lanes_partial_scored"](*_kivi_lanes_args(query, region, scale, length, softcap),
                                                        scored_impl(impl))
    return out, lse, split_lane_logits(flat, _kivi_lane_shapes(query, [ln.heads for ln in region.lanes],
                                                                region.valid))


# ----------------------------------------------------------------------------- KIVI quantizer


def _kivi_quantize_reference(k, v, valid, bits, group, v_group, k_per_token):
    if valid is not None:
        k, v = kivi_ref.fill_masked(k, valid, group), kivi_ref.fill_masked(v, valid, group)
    if k_per_token:
        kq = kivi_ref.quantize_values(k, bits, v_group)
    else:
        kq = kivi_ref.quantize_keys(k, bits, group)
    vq = kivi_ref.quantize_values(v, bits, v_group)
    return _fresh(*kq, *vq)


@torch.library.custom_op("kvcompress::kivi_quantize", mutates_args=(), device_types="cpu")
def kivi_quantize(k: Tensor, v: Tensor, valid: Optional[Tensor], bits: int, group: int, v_group: int,
                  k_per_token: bool, impl: str = "reference") -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """KIVI codes, scales and zeros of ``k`` / ``v`` ``[B, H, T, d]`` (the reference quantizers, one opaque op);
    with ``valid`` ``[B, T]``, masked slots first take their group's mean (:func:`~.kivi.reference.fill_masked`).

    Registered so that a compiled step runs exactly the eager quantizer: fused by Inductor, the division of
    ``(x - zero) / scale`` is an approximate one in Triton and codes at a rounding boundary flip, so compiled
    and eager caches would hold different codes.

    ``impl``: ``"reference"`` (the reference quantizers, ~45 small launches on CUDA) or ``"triton"`` (CUDA only:
    :func:`~.kivi.quantize_triton.kivi_quantize_triton`, keys and values in one launch, the same bits but for the
    fp32 summation order of a masked mean).  CPU runs the reference; ``"triton"`` on CPU tensors raises.
    """
    _check_impl("kivi_quantize", impl)
    if impl != "reference":
        raise ValueError(f"kvcompress::kivi_quantize: impl {impl!r} runs on CUDA tensors only, got {k.device} "
                         f"tensors (ops.choose('kivi_quantize', device) picks 'reference' off CUDA)")
    return _kivi_quantize_reference(k, v, valid, bits, group, v_group, k_per_token)


@kivi_quantize.register_kernel("cuda")
def _kivi_quantize_cuda(k, v, valid, bits, group, v_group, k_per_token, impl="reference"):
    _check_impl("kivi_quantize", impl)
    if impl == "triton":
        from .kivi.quantize_triton import kivi_quantize_triton  # raises ValueError naming what it cannot take

        return kivi_quantize_triton(k, v, valid, bits, group, v_group, k_per_token)
    return _kivi_quantize_reference(k, v, valid, bits, group, v_group, k_per_token)


@kivi_quantize.register_fake
def _kivi_quantize_fake(k, v, valid, bits, group, v_group, k_per_token, impl="reference"):
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    per = 32 // bits
    if k_per_token:
        kc = k.new_empty(b, h, t, dk // per, dtype=torch.int32)
        ks = k.new_empty(b, h, t, dk // v_group, dtype=torch.float16)
    else:
        kc = k.new_empty(b, h, t // group, -(-dk // per), group, dtype=torch.int32)
        ks = k.new_empty(b, h, t // group, dk, dtype=torch.float16)
    vc = v.new_empty(b, h, t, dv // per, dtype=torch.int32)
    vs = v.new_empty(b, h, t, dv // v_group, dtype=torch.float16)
    return kc, ks, torch.empty_like(ks), vc, vs, torch.empty_like(vs)


@torch.library.custom_op("kvcompress::quantize_labels", mutates_args=(), device_types=("cpu", "cuda"))
def quantize_labels(x: Tensor, bits: int) -> tuple[Tensor, Tensor, Tensor]:
    """DoubleSparse label codes, scales and zeros (:func:`~.doublesparse.reference.quantize_labels`) as one opaque
    op, for the same reason as :func:`kivi_quantize` (compiled and eager label caches hold the same codes)."""
    q = ds_ref.quantize_labels(x, bits)
    return q.data.contiguous(), q.scale.contiguous(), q.zero.contiguous()


@quantize_labels.register_fake
def _quantize_labels_fake(x, bits):
    b, h, t, r = x.shape
    return (x.new_empty(b, h, t, r * bits // 8, dtype=torch.uint8), x.new_empty(b, h, t, dtype=torch.float16),
            x.new_empty(b, h, t, dtype=torch.float16))


# ----------------------------------------------------------------------------- paged


@functools.lru_cache(maxsize=None)
def _paged_base() -> dict:
    from .paged import triton_kernel

    return triton_kernel._config()


@torch.library.custom_op("kvcompress::paged_partial", mutates_args=(), device_types="cpu")
def paged_partial(query: Tensor, k_pages: Tensor, v_pages: Tensor, page_valid: Tensor, block_table: Tensor,
                  length: Optional[Tensor], scale: float, softcap: float = 0.0,
                  impl: str = "reference") -> tuple[Tensor, Tensor]:
    """Attention through a block table (``[num_pages, H, P, D]`` pools, ``block_table [B, W]`` with ``-1`` for no
    page): ``(out [B, H, M, Dv] fp32, lse [B, H, M] fp32)``.  ``length`` counts token slots in block-table order
    (position ``w`` holds slots ``w*P .. w*P+P-1``).  CPU: the reference."""
    _check_impl("paged_partial", impl)
    _check_length("paged_partial", length)
    return _fresh(*paged_ref.paged_attention_partial(query, k_pages, v_pages, page_valid, block_table, scale,
                                                     length=length, softcap=softcap))


@paged_partial.register_kernel("cuda")
def _paged_partial_cuda(query, k_pages, v_pages, page_valid, block_table, length, scale, softcap=0.0,
                        impl="reference"):
    _check_impl("paged_partial", impl)
    _check_length("paged_partial", length)
    if impl == "triton":
        from .paged import triton_kernel

        return _fresh(*triton_kernel._forward(query, k_pages, v_pages, page_valid, block_table, scale,
                                              length=length, softcap=softcap, base=_paged_base()))
    return _fresh(*paged_ref.paged_attention_partial(query, k_pages, v_pages, page_valid, block_table, scale,
                                                     length=length, softcap=softcap))


@paged_partial.register_fake
def _paged_partial_fake(query, k_pages, v_pages, page_valid, block_table, length, scale, softcap=0.0,
                        impl="reference"):
    return _empty_partial(query, v_pages.shape[-1])


def paged_attention(query: Tensor, k_pages: Tensor, v_pages: Tensor, page_valid: Tensor, block_table: Tensor,
                    scale: float, *, impl: str, length: Optional[Tensor] = None,
                    softcap: Optional[float] = None) -> tuple[Tensor, Tensor]:
    """``kvcompress::paged_partial``."""
    return _OPS["paged_partial"](query, k_pages, v_pages, page_valid, block_table, length, float(scale),
                                 float(softcap or 0.0), impl)


# ----------------------------------------------------------------------------- LeanK lanes


def _lanes(heads, channels, k, v, valid, bases) -> list:
    n = len(k)
    if not (len(heads) == len(channels) == len(v) == len(valid) == len(bases) == n) or n == 0:
        raise ValueError(f"kvcompress::lanes_partial: one entry per lane in heads / channels / k / v / valid / bases, "
                         f"got {[len(heads), len(channels), len(k), len(v), len(valid), len(bases)]}")
    return [leank_ref.Lane(*lane) for lane in zip(heads, channels, k, v, valid, bases)]


@torch.library.custom_op("kvcompress::lanes_partial", mutates_args=(), device_types="cpu")
def lanes_partial(query: Tensor, heads: list[Optional[Tensor]], channels: list[Optional[Tensor]], k: list[Tensor],
                  v: list[Tensor], valid: list[Optional[Tensor]], bases: list[Optional[Tensor]],
                  length: Optional[Tensor], scale: float, out_dtype: str = "float32", softcap: float = 0.0,
                  impl: str = "reference") -> tuple[Tensor, Tensor]:
    """Attention of ``query [B, Hkv, M, D]`` over LeanK lanes, given as parallel lists (lane ``i`` =
    ``(heads[i], channels[i], k[i], v[i], valid[i], bases[i])``, see :mod:`kvcompress.kernels.leank.reference`;
    a lane with a basis holds low-rank coordinates and projects the query itself):
    ``(out [B, Hkv, M, Dv] fp32, lse [B, Hkv, M] fp32)``.  ``length`` bounds every lane's token axis.
    ``out_dtype``: ``out``'s dtype (``"float32"`` / ``"float16"`` / ``"bfloat16"``: rounded once from fp32, for a read
    whose only part this is: no cast after it).  CPU: the reference."""
    _check_impl("lanes_partial", impl)
    _check_length("lanes_partial", length)
    lanes = _lanes(heads, channels, k, v, valid, bases)
    return _fresh(*leank_ref.grouped_partial_attention(query, lanes, scale, length=length, softcap=softcap,
                                                       out_dtype=_out_dtype("lanes_partial", out_dtype)))


@lanes_partial.register_kernel("cuda")
def _lanes_partial_cuda(query, heads, channels, k, v, valid, bases, length, scale, out_dtype="float32", softcap=0.0,
                        impl="reference"):
    _check_impl("lanes_partial", impl)
    _check_length("lanes_partial", length)
    out_dtype = _out_dtype("lanes_partial", out_dtype)
    lanes = _lanes(heads, channels, k, v, valid, bases)
    if impl == "triton":
        from .leank import triton_kernel

        return _fresh(*triton_kernel.grouped_partial_attention(query, lanes, scale, length=length,
                                                               base=_leank_base(), softcap=softcap,
                                                               out_dtype=out_dtype))
    return _fresh(*leank_ref.grouped_partial_attention(query, lanes, scale, length=length, softcap=softcap,
                                                       out_dtype=out_dtype))


@lanes_partial.register_fake
def _lanes_partial_fake(query, heads, channels, k, v, valid, bases, length, scale, out_dtype="float32", softcap=0.0,
                        impl="reference"):
    out, lse = _empty_partial(query, v[0].shape[-1])
    return query.new_empty(out.shape, dtype=_out_dtype("lanes_partial", out_dtype)), lse


def lanes_attention(query: Tensor, lanes: Sequence, scale: float, *, impl: str, length: Optional[Tensor] = None,
                    softcap: Optional[float] = None, out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    """``kvcompress::lanes_partial`` over ``lanes`` (tuples ``(heads, channels, k, v[, valid[, basis]]])``);
    ``out_dtype``: the output's dtype (``None``: float32)."""
    args = _lanes_args(query, lanes, scale, length, softcap)
    return _OPS["lanes_partial"](*args[:-1], _dtype_name(out_dtype), args[-1], impl)


def _lanes_args(query: Tensor, lanes: Sequence, scale: float, length: Optional[Tensor],
                softcap: Optional[float]) -> tuple:
    """The lanes ops' arguments (all but ``impl``) for lanes ``(heads, channels, k, v[, valid[, basis]])``."""
    lanes = [leank_ref.Lane(*lane) for lane in lanes]
    return (query, [ln.heads for ln in lanes], [ln.channels for ln in lanes], [ln.k for ln in lanes],
            [ln.v for ln in lanes], [ln.valid for ln in lanes], [ln.basis for ln in lanes], length, float(scale),
            float(softcap or 0.0))


def _lane_shapes(query: Tensor, k) -> list:
    """Each lane's logits shape ``[B, h_i, M, T_i]`` (its keys ``k[i]``: ``[B, h_i, T_i, c_i]``)."""
    b, _, m, _ = query.shape
    return [(b, kk.shape[1], m, kk.shape[2]) for kk in k]


@torch.library.custom_op("kvcompress::lanes_partial_scored", mutates_args=(), device_types="cpu")
def lanes_partial_scored(query: Tensor, heads: list[Optional[Tensor]], channels: list[Optional[Tensor]],
                         k: list[Tensor], v: list[Tensor], valid: list[Optional[Tensor]],
                         bases: list[Optional[Tensor]], length: Optional[Tensor], scale: float, softcap: float = 0.0,
                         impl: str = "reference") -> tuple[Tensor, Tensor, Tensor]:
    """``kvcompress::lanes_partial`` that also returns what it scored: ``(out, lse, logits)``, ``logits`` flat float32,
    lane ``i``'s ``[B, h_i, M, T_i]`` scores one after the other (:func:`split_lane_logits`; natural-log units,
    ``-inf`` on slots not attended; :func:`kvcompress.kernels.leank.reference.grouped_partial_scored`).  CPU: the
    reference."""
    _check_impl("lanes_partial_scored", impl)
    _check_length("lanes_partial_scored", length)
    lanes = _lanes(heads, channels, k, v, valid, bases)
    out, lse, logits = leank_ref.grouped_partial_scored(query, lanes, scale, length=length, softcap=softcap)
    return _fresh(out, lse, _flatten(logits))


@lanes_partial_scored.register_kernel("cuda")
def _lanes_partial_scored_cuda(query, heads, channels, k, v, valid, bases, length, scale, softcap=0.0,
                               impl="reference"):
    _check_impl("lanes_partial_scored", impl)
    _check_length("lanes_partial_scored", length)
    lanes = _lanes(heads, channels, k, v, valid, bases)
    if impl == "triton":
        from .leank import triton_kernel

        shapes = _lane_shapes(query, k)
        flat = _flat_logits(query, shapes)
        out, lse = triton_kernel.grouped_partial_attention(query, lanes, scale, length=length, base=_leank_base(),
                                                           softcap=softcap, logits=split_lane_logits(flat, shapes))
        return _fresh(out, lse, flat)
    out, lse, logits = leank_ref.grouped_partial_scored(query, lanes, scale, length=length, softcap=softcap)
    return _fresh(out, lse, _flatten(logits))


@lanes_partial_scored.register_fake
def _lanes_partial_scored_fake(query, heads, channels, k, v, valid, bases, length, scale, softcap=0.0,
                               impl="reference"):
    n = sum(b * h * m * t for b, h, m, t in _lane_shapes(query, k))
    return (*_empty_partial(query, v[0].shape[-1]), query.new_empty((n,), dtype=torch.float32))


def lanes_attention_scored(query: Tensor, lanes: Sequence, scale: float, *, impl: str,
                           length: Optional[Tensor] = None,
                           softcap: Optional[float] = None) -> tuple[Tensor, Tensor, list[Tensor]]:
    """``kvcompress::lanes_partial_scored`` over ``lanes``: ``(out, lse, per-lane logits [B, h_i, M, T_i])``."""
    args = _lanes_args(query, lanes, scale, length, softcap)
    out, lse, flat = _OPS["lanes_partial_scored"](*args, impl)
    return out, lse, split_lane_logits(flat, _lane_shapes(query, args[3]))


# ----------------------------------------------------------------------------- DoubleSparse


@torch.library.custom_op("kvcompress::select_topk", mutates_args=(), device_types="cpu")
def select_topk(query: Tensor, label_data: Tensor, label_scale: Optional[Tensor], label_zero: Optional[Tensor],
                label_bits: int, channels: Tensor, valid: Optional[Tensor], k: int, group: int = 1,
                impl: str = "reference") -> Tensor:
    """Indices ``[B, Hq / group, k]`` (int64, in no particular order) of the ``k`` best label scores per query head,
    or per ``group`` consecutive query heads scored together (``query [B, Hq, D]``, labels ``Labels(label_data,
    label_bits, label_scale, label_zero)``).  CPU: the reference."""
    _check_impl("select_topk", impl)
    labels = ds_ref.Labels(label_data, label_bits, label_scale, label_zero)
    return _fresh(ds_ref.select_topk(query, labels, channels, valid, k, group))


@select_topk.register_kernel("cuda")
def _select_topk_cuda(query, label_data, label_scale, label_zero, label_bits, channels, valid, k, group=1,
                      impl="reference"):
    _check_impl("select_topk", impl)
    labels = ds_ref.Labels(label_data, label_bits, label_scale, label_zero)
    if impl == "triton":
        from .doublesparse import triton_kernel

        if not triton_kernel.supports_scores(query, labels, channels, group):
            raise ValueError("kvcompress::select_topk: the Triton kernel does not take these arguments "
                             "(doublesparse.triton_kernel.supports_scores)")
        return _fresh(triton_kernel.select_topk(query, labels, channels, valid, k, group=group))
    return _fresh(ds_ref.select_topk(query, labels, channels, valid, k, group))


@select_topk.register_fake
def _select_topk_fake(query, label_data, label_scale, label_zero, label_bits, channels, valid, k, group=1,
                      impl="reference"):
    return query.new_empty((query.shape[0], query.shape[1] // group, k), dtype=torch.int64)


def select(query: Tensor, labels, channels: Tensor, valid: Optional[Tensor], k: int, *, impl: str,
           group: int = 1) -> Tensor:
    """``kvcompress::select_topk`` over a :class:`~kvcompress.kernels.doublesparse.Labels`."""
    return _OPS["select_topk"](query, labels.data, labels.scale, labels.zero, labels.bits,
                                                    channels, valid, int(k), int(group), impl)


def _rows(index: Tensor, m: int) -> Tensor:
    """``index [B, H, 1, K]`` (one selection shared by a kv head's rows) as the stride-0 view ``[B, H, M, K]``."""
    return index.expand(index.shape[0], index.shape[1], m, index.shape[3]) if index.shape[2] == 1 else index


@torch.library.custom_op("kvcompress::gather_partial", mutates_args=(), device_types="cpu")
def gather_partial(query: Tensor, k: Tensor, v: Tensor, valid: Optional[Tensor], index: Tensor, scale: float,
                   softcap: float = 0.0, impl: str = "reference") -> tuple[Tensor, Tensor]:
    """Attention of every row of ``query [B, Hkv, M, D]`` over its selected tokens ``index [B, Hkv, M, K]``
    (``[B, Hkv, 1, K]``: one selection shared by the kv head's rows - the group-shared kernel on CUDA):
    ``(out [B, Hkv, M, Dv] fp32, lse [B, Hkv, M] fp32)``.  CPU: the reference."""
    _check_impl("gather_partial", impl)
    return _fresh(*ds_ref.gather_partial_attention(query, k, v, valid, _rows(index, query.shape[2]), scale,
                                                   softcap=softcap))


@gather_partial.register_kernel("cuda")
def _gather_partial_cuda(query, k, v, valid, index, scale, softcap=0.0, impl="reference"):
    _check_impl("gather_partial", impl)
    index = _rows(index, query.shape[2])
    if impl == "triton":
        from .doublesparse import triton_kernel

        last = [t if t.stride(-1) == 1 else t.contiguous() for t in (query, k, v)]
        if index.stride(-1) != 1:
            index = index.contiguous()
        if not triton_kernel.supports_gather(*last, index):
            raise ValueError("kvcompress::gather_partial: the Triton kernel does not take these arguments "
                             "(doublesparse.triton_kernel.supports_gather)")
        return _fresh(*triton_kernel.gather_partial_attention(last[0], last[1], last[2], valid, index, scale,
                                                              softcap=softcap))
    return _fresh(*ds_ref.gather_partial_attention(query, k, v, valid, index, scale, softcap=softcap))


@gather_partial.register_fake
def _gather_partial_fake(query, k, v, valid, index, scale, softcap=0.0, impl="reference"):
    return _empty_partial(query, v.shape[-1])


def gather_attention(query: Tensor, k: Tensor, v: Tensor, valid: Optional[Tensor], index: Tensor, scale: float, *,
                     impl: str, softcap: Optional[float] = None) -> tuple[Tensor, Tensor]:
    """``kvcompress::gather_partial``."""
    return _OPS["gather_partial"](query, k, v, valid, index, float(scale), float(softcap or 0.0), impl)


def _select_gather_reference(query, label_data, label_scale, label_zero, label_bits, channels, valid, k, v, kk, scale,
                             group, softcap):
    labels = ds_ref.Labels(label_data, label_bits, label_scale, label_zero)
    out, lse, index = ds_ref.select_gather_partial(query, labels, channels, valid, k, v, kk, scale, group,
                                                   softcap or None)
    return _fresh(out, lse, index.to(torch.int32))


@torch.library.custom_op("kvcompress::select_gather", mutates_args=(), device_types="cpu")
def select_gather(query: Tensor, label_data: Tensor, label_scale: Optional[Tensor], label_zero: Optional[Tensor],
                  label_bits: int, channels: Tensor, valid: Optional[Tensor], k: Tensor, v: Tensor, kk: int,
                  scale: float, group: int = 1, softcap: float = 0.0,
                  impl: str = "reference") -> tuple[Tensor, Tensor, Tensor]:
    """``select_topk`` and ``gather_partial`` over what it selected, as one op: the top-``kk`` label scores of
    ``query [B, Hq, D]`` per query head (``group`` 1) or per kv head (``group = Hq / Hkv``: its heads' summed
    query), and each query head's attention over its selection of ``k`` / ``v`` ``[B, Hkv, T, D / Dv]``:
    ``(out [B, Hkv, G, Dv] fp32, lse [B, Hkv, G] fp32, index [B, Hq / group, kk] int32)``.  CPU: the reference
    (:func:`kvcompress.kernels.doublesparse.reference.select_gather_partial`); CUDA with ``"triton"``: one kernel
    (:func:`kvcompress.kernels.doublesparse.triton_kernel.select_gather_partial`)."""
    _check_impl("select_gather", impl)
    return _select_gather_reference(query, label_data, label_scale, label_zero, label_bits, channels, valid, k, v, kk,
                                    scale, group, softcap)


@select_gather.register_kernel("cuda")
def _select_gather_cuda(query, label_data, label_scale, label_zero, label_bits, channels, valid, k, v, kk, scale,
                        group=1, softcap=0.0, impl="reference"):
    _check_impl("select_gather", impl)
    if impl == "triton":
        from .doublesparse import triton_kernel

        labels = ds_ref.Labels(label_data, label_bits, label_scale, label_zero)
        if not triton_kernel.supports_select_gather(query, labels, channels, k, v, kk, group):
            raise ValueError("kvcompress::select_gather: the Triton kernel does not take these arguments "
                             "(doublesparse.triton_kernel.supports_select_gather)")
        return _fresh(*triton_kernel.select_gather_partial(query, labels, channels, valid, k, v, kk, scale, group=group,
                                                           softcap=softcap or None))
    return _select_gather_reference(query, label_data, label_scale, label_zero, label_bits, channels, valid, k, v, kk,
                                    scale, group, softcap)


@select_gather.register_fake
def _select_gather_fake(query, label_data, label_scale, label_zero, label_bits, channels, valid, k, v, kk, scale,
                        group=1, softcap=0.0, impl="reference"):
    b, hq, _ = query.shape
    hkv = k.shape[1]
    out = query.new_empty((b, hkv, hq // hkv, v.shape[-1]), dtype=torch.float32)
    lse = query.new_empty((b, hkv, hq // hkv), dtype=torch.float32)
    return out, lse, query.new_empty((b, hq // group, kk), dtype=torch.int32)


def select_gather_attention(query: Tensor, labels, channels: Tensor, valid: Optional[Tensor], k: Tensor, v: Tensor,
                            kk: int, scale: float, *, impl: str, group: int = 1,
                            softcap: Optional[float] = None) -> tuple[Tensor, Tensor, Tensor]:
    """``kvcompress::select_gather`` over a :class:`~kvcompress.kernels.doublesparse.Labels`."""
    return _OPS["select_gather"](query, labels.data, labels.scale, labels.zero, labels.bits, channels, valid, k, v,
                                 int(kk), float(scale), int(group), float(softcap or 0.0), impl)


# ----------------------------------------------------------------------------- region merge


def _check_merge(outs, lses, dtype: str) -> None:
    if len(outs) == 0 or len(outs) != len(lses) or dtype not in _DTYPES:
        raise ValueError(f"kvcompress::merge_partials: one lse per output (at least one), dtype one of "
                         f"{sorted(_DTYPES)}; got {len(outs)} outputs, {len(lses)} lses, dtype {dtype!r}")


def _merge_reference(outs, lses, dtype: str) -> Tensor:
    from .attention.reference import merge_partials as reference_merge

    _check_merge(outs, lses, dtype)
    if len(outs) == 1:
        return outs[0].to(_DTYPES[dtype], copy=True)  # a fresh tensor (an op's output never aliases an input)
    return reference_merge(list(zip(outs, lses))).to(_DTYPES[dtype]).contiguous()


@torch.library.custom_op("kvcompress::merge_partials", mutates_args=(), device_types="cpu")
def merge_partials(outs: list[Tensor], lses: list[Tensor], dtype: str, impl: str = "reference") -> Tensor:
    """The joint softmax output of partials ``(outs[i] [..., Dv] float32, lses[i] [...] float32)`` over disjoint key
    regions, as ``dtype`` (``"float32"`` / ``"float16"`` / ``"bfloat16"``):
    :func:`kvcompress.kernels.attention.reference.merge_partials` (no learned sinks) and the cast, in one op (on CUDA
    with ``impl="triton"`` one launch, :mod:`kvcompress.kernels.attention.merge_triton`, for at most
    :data:`MERGE_MAX_PARTS` partials of one shape).  CPU: the reference."""
    _check_impl("merge_partials", impl)
    return _merge_reference(outs, lses, dtype)


@merge_partials.register_kernel("cuda")
def _merge_partials_cuda(outs, lses, dtype, impl="reference"):
    _check_impl("merge_partials", impl)
    if impl == "triton":
        from .attention import merge_triton

        _check_merge(outs, lses, dtype)
        return merge_triton.merge_partials(list(zip(outs, lses)), _DTYPES[dtype])
    return _merge_reference(outs, lses, dtype)


@merge_partials.register_fake
def _merge_partials_fake(outs, lses, dtype, impl="reference"):
    return outs[0].new_empty(outs[0].shape, dtype=_DTYPES.get(dtype, torch.float32))


def merge_attention(parts: Sequence[tuple[Tensor, Tensor]], dtype: torch.dtype, *, impl: str) -> Tensor:
    """``kvcompress::merge_partials`` over ``(out, lse)`` partials, output in ``dtype``."""
    name = {v: k for k, v in _DTYPES.items()}.get(dtype)
    if name is None:
        raise ValueError(f"kvcompress::merge_partials: dtype one of {sorted(_DTYPES)}, got {dtype}")
    return _OPS["merge_partials"]([o for o, _ in parts], [lse for _, lse in parts], name, impl)


# the registered ops by name (the wrappers call these), and their CUDA implementations as Python functions (what
# tests/test_kernel_ops.py runs on CPU tensors under the Triton interpreter to check the CUDA glue without a GPU)
_OPS = {name: getattr(torch.ops.kvcompress, name).default for name in OPS}
CUDA_IMPLS = {"kivi_partial": _kivi_partial_cuda, "kivi_buffer_partial": _kivi_buffer_partial_cuda,
              "kivi_lanes_partial": _kivi_lanes_partial_cuda,
              "kivi_lanes_buffer_partial": _kivi_lanes_buffer_partial_cuda,
              "paged_partial": _paged_partial_cuda,
              "lanes_partial": _lanes_partial_cuda, "select_topk": _select_topk_cuda,
              "gather_partial": _gather_partial_cuda, "select_gather": _select_gather_cuda,
              "kivi_quantize": _kivi_quantize_cuda,
              "kivi_partial_scored": _kivi_partial_scored_cuda,
              "kivi_lanes_partial_scored": _kivi_lanes_partial_scored_cuda,
              "lanes_partial_scored": _lanes_partial_scored_cuda, "merge_partials": _merge_partials_cuda}


# ----------------------------------------------------------------------------- the chooser (environment read here)


def kernels_mode() -> str:
    """``KVCOMPRESS_KERNELS``: ``"auto"`` (default), ``"reference"`` (the references everywhere) or ``"triton"``
    (the per-call dispatchers also run the Triton kernels on CPU tensors, under ``TRITON_INTERPRET=1``)."""
    return os.environ.get("KVCOMPRESS_KERNELS", "auto")


def kivi_cuda_enabled() -> bool:
    """``KVCOMPRESS_KIVI_CUDA=0`` disables the KIVI CUDA kernel (v3)."""
    return os.environ.get("KVCOMPRESS_KIVI_CUDA", "1") != "0"


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def kivi_order(is_cuda: bool, cuda_ok, triton_ok, triton_installed=None) -> str:
    """The KIVI decision, shared by :func:`choose` (static facts, once per cache) and the per-call dispatcher
    :func:`kvcompress.kernels.kivi.implementation` (tensors): ``"cuda"`` when on CUDA, not disabled, and
    ``cuda_ok()`` (nvcc, device and shape checks); else ``"triton"`` when Triton is installed and ``triton_ok()``;
    else ``"reference"``.  ``KVCOMPRESS_KERNELS=reference`` forces the reference."""
    if not is_cuda or kernels_mode() == "reference":
        return "reference"
    if kivi_cuda_enabled() and cuda_ok():
        return "cuda"
    if (triton_installed or triton_available)() and triton_ok():
        return "triton"
    return "reference"


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


_FACTS = {
    "kivi_partial": {"bits", "group", "head_dim", "v_dim", "v_group", "k_per_token", "tokens"},
    "kivi_buffer_partial": {"bits", "group", "head_dim", "v_dim", "v_group", "k_per_token", "tokens"},
    "kivi_lanes_partial": {"bits", "group", "head_dim", "v_dim", "v_group", "kept", "k_per_token"},
    "kivi_lanes_buffer_partial": {"bits", "group", "head_dim", "v_dim", "v_group", "kept", "k_per_token"},
    "paged_partial": {"page_size", "head_dim", "v_dim", "dtype"},
    "lanes_partial": {"head_dim", "v_dim", "kept", "dtype"},
    "select_topk": {"label_bits", "label_channels", "query_dtype", "label_dtype"},
    "gather_partial": {"head_dim", "v_dim", "dtype", "query_dtype"},
    "select_gather": {"label_bits", "label_channels", "label_dtype", "head_dim", "v_dim", "dtype", "query_dtype",
                      "tokens", "k", "rows"},
    "kivi_quantize": {"bits", "group", "v_group", "head_dim", "v_dim", "k_per_token", "dtype"},
    "merge_partials": {"v_dim"},
}
_FACTS.update({scored: _FACTS[base] for scored, base in SCORED.items()})
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _kivi_cuda_problem(device: torch.device, f: dict) -> Optional[str]:
    from .kivi import cuda_kernel

    if cuda_kernel.nvcc_path() is None:
        return "no nvcc (PATH, $CUDA_HOME, $CUDA_PATH, /usr/local/cuda)"
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(device)[0] < 8:
        return "needs a CUDA GPU of compute capability >= 8"
    bits, g, dk = f.get("bits", 2), f.get("group", 32), f.get("head_dim", 128)
    dv, gv = f.get("v_dim", dk), f.get("v_group", 32)
    if f.get("k_per_token"):
        return "per-token keys (ablation)"
    if bits not in (2, 4):
        return f"bits {bits}"
    if dk not in cuda_kernel.DIMS or dv not in cuda_kernel.DIMS:
        return f"head dims {dk} / {dv} not in {cuda_kernel.DIMS}"
    if g % cuda_kernel.TILE or not _pow2(g):
        return f"key group {g} (a power of two >= {cuda_kernel.TILE})"
    if gv < 16 or dv % gv or gv % cuda_kernel.value_span(bits, dv):
        return f"value group {gv}"
    if "tokens" in f and f["tokens"] * max(dk, dv) >= 2**31:
        return f"{f['tokens']} tokens (32-bit offsets)"
    return None


def _kivi_lanes_cuda_problem(device: torch.device, f: dict) -> Optional[str]:
    """The CUDA lanes kernel (:mod:`.kivi.lanes_cuda`): the plain CUDA kernel's conditions on bits, groups and the
    value width, lanes of at most 8 distinct kept counts, each a multiple of 16 up to 128."""
    from .kivi import cuda_kernel, lanes_cuda

    why = _kivi_cuda_problem(device, {k: v for k, v in f.items() if k not in ("kept", "head_dim")})
    if why is not None:
        return why
    kept = tuple(f.get("kept") or ())
    if any(c not in cuda_kernel.LANE_DIMS for c in kept):
        return f"kept channel counts {kept} (multiples of 16 up to 128)"
    if len(set(kept)) > lanes_cuda.MAX_LANES:
        return f"{len(set(kept))} distinct kept counts (at most {lanes_cuda.MAX_LANES})"
    return None


def _triton_problem(op: str, f: dict, device: Optional[torch.device] = None) -> Optional[str]:
    op = SCORED.get(op, op)
    if op in ("kivi_buffer_partial", "kivi_lanes_buffer_partial"):  # the KIVI region / lanes through their Triton
        # kernel, the buffer through the grouped lanes kernel
        dims = dict(head_dim=f.get("head_dim", 128), v_dim=f.get("v_dim", f.get("head_dim", 128)))
        region_op = "kivi_partial" if op == "kivi_buffer_partial" else "kivi_lanes_partial"
        return _triton_problem(region_op, f) or _triton_problem("lanes_partial", dims)
    dk = f.get("head_dim", 128)
    dv = f.get("v_dim", dk)
    if op in ("kivi_partial", "kivi_lanes_partial"):
        bits, g, gv = f.get("bits", 2), f.get("group", 32), f.get("v_group", 32)
        if f.get("k_per_token"):
            return "per-token keys (ablation)"
        if bits not in (2, 4):
            return f"bits {bits}"
        if not (_pow2(g) and 16 <= g <= 128):
            return f"key group {g} (a power of two in 16..128)"
    if op == "kivi_partial":
        if dk > 256 or dk % 2 or dv > 256 or dv % (32 // bits) or not _pow2(gv) or gv < 2 or dv % gv:
            return f"dims {dk} / {dv}, value group {gv}"
        return None
    if op == "kivi_lanes_partial":
        kept = f.get("kept") or ()
        if any(c % 2 or c > 256 or c <= 0 for c in kept):
            return f"kept channel counts {tuple(kept)} (even, up to 256)"
        if dk > 256 or dv > 256 or dv % (32 // bits) or not _pow2(gv) or gv < 2 or dv % gv:
            return f"dims {dk} / {dv}, value group {gv}"
        return None
    if op == "paged_partial":
        p = f.get("page_size", 16)
        if not (_pow2(p) and 16 <= p <= 128):
            return f"page size {p} (a power of two in 16..128)"
        if f.get("dtype", torch.float16) not in _FLOATS:
            return f"dtype {f['dtype']}"
        return None
    if op == "lanes_partial":
        kept = f.get("kept") or ()
        if dk > 256 or dv > 256 or any(c > 256 for c in kept):
            return f"dims {dk} / {dv} (up to 256)"
        if f.get("dtype", torch.float16) not in _FLOATS:
            return f"dtype {f['dtype']}"
        return None
    if op == "select_topk":
        if f.get("label_bits", 16) not in ds_ref.LABEL_BITS or f.get("label_channels", 16) > 256:
            return f"label bits {f.get('label_bits')}, channels {f.get('label_channels')}"
        if f.get("query_dtype", torch.float16) not in _FLOATS:
            return f"query dtype {f['query_dtype']}"
        if f.get("label_bits", 16) == 16 and f.get("label_dtype", torch.float16) not in _FLOATS:
            return f"label dtype {f['label_dtype']}"
        return None
    if op == "select_gather":
        from .doublesparse import triton_kernel as ds_triton  # Triton is installed (choose checked)

        select = {n: f[n] for n in _FACTS["select_topk"] if n in f}
        problem = _triton_problem("select_topk", select) or _triton_problem("gather_partial", {
            n: f[n] for n in _FACTS["gather_partial"] if n in f})
        tokens, k = f.get("tokens", 1), f.get("k", 1)
        most = ds_triton.one_chunk_tokens()
        if problem is None and not 0 < k <= tokens <= most:
            problem = f"{tokens} tokens, k {k} (one select chunk: k <= tokens <= {most})"
        rows, dim = f.get("rows", 1), f.get("head_dim", 128)
        if problem is None and not ds_triton.fuse_gather_for(k, rows, device, tokens, dim):
            setting = ds_triton.fuse_gather_setting()
            problem = ("fuse_gather is off (KVCOMPRESS_DS_CONFIG)" if setting is False else
                       f"k {k} of {tokens} tokens over {rows} selection rows, head dim {dim}: two kernels are "
                       f"faster (fuse_rule)")
        return problem
    if op == "kivi_quantize":
        from .kivi.quantize_triton import problem  # Triton is installed (choose checked)

        return problem(f.get("bits", 2), f.get("group", 32), f.get("v_group", 32), dk, dv,
                       bool(f.get("k_per_token", False)), f.get("dtype"))
    if dk > 256 or dv > 256:
        return f"dims {dk} / {dv} (up to 256)"
    if f.get("dtype", torch.float16) not in _FLOATS or f.get("query_dtype", torch.float16) not in _FLOATS:
        return "dtypes"
    return None


def choose(op: str, device, **static_facts) -> str:
    """The implementation a cache built on ``device`` passes as ``impl`` to op ``op`` - decided once, at build time.

    ``"reference"`` on CPU (and with ``KVCOMPRESS_KERNELS=reference``); on CUDA the fused kernel when it is
    available and its capability check accepts the static facts: for ``"kivi_partial"`` the CUDA kernel (v3) unless
    ``KVCOMPRESS_KIVI_CUDA=0`` or no nvcc is found, else the Triton kernel; for the others the Triton kernel when
    Triton is installed.  This is the one place that reads those variables, looks up nvcc and imports Triton.

    Static facts (all optional; a missing fact is assumed to be the common case and not checked):

    * ``kivi_partial``: ``bits``, ``group`` (key token group), ``head_dim`` (Dk), ``v_dim``, ``v_group``,
      ``k_per_token``, ``tokens`` (capacity);
    * ``kivi_lanes_partial``: ``bits``, ``group``, ``head_dim`` (the query width D), ``v_dim``, ``v_group``, ``kept``
      (the lanes' kept key-channel counts), ``k_per_token``;
    * ``paged_partial``: ``page_size``, ``head_dim``, ``v_dim``, ``dtype`` (of the pages);
    * ``lanes_partial``: ``head_dim``, ``v_dim``, ``kept`` (kept channel counts), ``dtype`` (of K/V);
    * ``select_topk``: ``label_bits``, ``label_channels``, ``query_dtype``, ``label_dtype``;
    * ``gather_partial``: ``head_dim``, ``v_dim``, ``dtype`` (of K/V), ``query_dtype``;
    * ``select_gather``: those of ``select_topk`` and ``gather_partial`` (``query_dtype`` once), ``tokens`` (the
      label slots), ``k``, ``rows`` (selection rows: batch x query heads, or x kv heads group-shared); ``"triton"``
      where ``fuse_gather`` in ``KVCOMPRESS_DS_CONFIG`` is on, or unset and the measured rule
      (:func:`kvcompress.kernels.doublesparse.triton_kernel.fuse_rule`) takes ``k`` of ``tokens`` over ``rows`` at
      ``head_dim``;
    * ``kivi_quantize``: ``bits``, ``group``, ``v_group``, ``head_dim`` (Dk), ``v_dim``, ``k_per_token``, ``dtype``
      (of K/V);
    * ``merge_partials``: ``v_dim``.

    Example: ``impl = choose("kivi_partial", torch.device("cuda"), bits=2, group=32, head_dim=128, v_group=32)``.
    When the fused kernel is not taken on CUDA, the reason is logged (``logging``, level INFO).
    """
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; one of {sorted(OPS)}")
    unknown = set(static_facts) - _FACTS[op]
    if unknown:
        raise TypeError(f"choose({op!r}): unknown static facts {sorted(unknown)}; known: {sorted(_FACTS[op])}")
    device = torch.device(device)
    why: dict[str, Optional[str]] = {}
    if op in ("kivi_partial", "kivi_buffer_partial", "kivi_lanes_partial", "kivi_lanes_buffer_partial"):
        def cuda_ok():
            problem = _kivi_lanes_cuda_problem if op.startswith("kivi_lanes") else _kivi_cuda_problem
            why["cuda"] = problem(device, static_facts)
            return why["cuda"] is None

        def triton_ok():
            why["triton"] = _triton_problem(op, static_facts)
            return why["triton"] is None

        impl = kivi_order(device.type == "cuda", cuda_ok, triton_ok)
        if impl == "triton":
            _kivi_triton_base(static_facts.get("bits", 2), static_facts.get("group", 32),
                              static_facts.get("head_dim", 128),
                              static_facts.get("v_dim", static_facts.get("head_dim", 128)),
                              static_facts.get("v_group", 32))  # tuning knobs read now, not per call
        elif impl == "cuda":
            _kivi_cuda_base(static_facts.get("bits", 2))
    elif device.type != "cuda" or kernels_mode() == "reference":
        impl = "reference"
    elif not triton_available():
        impl, why["triton"] = "reference", "Triton is not installed"
    else:
        why["triton"] = _triton_problem(op, static_facts, device)
        impl = "triton" if why["triton"] is None else "reference"
        if impl == "triton" and op in ("lanes_partial", "lanes_partial_scored"):
            _leank_base()
        elif impl == "triton" and op in ("kivi_lanes_partial", "kivi_lanes_partial_scored", "kivi_partial_scored"):
            _kivi_triton_base(static_facts.get("bits", 2), static_facts.get("group", 32),
                              static_facts.get("head_dim", 128),
                              static_facts.get("v_dim", static_facts.get("head_dim", 128)),
                              static_facts.get("v_group", 32))
    if device.type == "cuda" and impl != OPS[op][-1] and why:
        logger.info("kvcompress: %s on %s runs %r (%s)", op, device, impl,
                    "; ".join(f"{k}: {v}" for k, v in why.items() if v))
    return impl


def kivi_facts(query: Tensor, packed) -> dict:
    """The static facts of a KIVI call (for :func:`choose`), read from its tensors' shapes."""
    per = 32 // packed.bits if packed.bits in kivi_ref.BITS else 1
    return dict(bits=packed.bits, group=packed.group, head_dim=query.shape[-1],
                v_dim=packed.v_codes.shape[-1] * per, v_group=packed.v_group, k_per_token=bool(packed.k_per_token),
                tokens=packed.valid.shape[-1])


__all__ = ["IMPLS", "OPS", "SCORED", "choose", "kivi_attention_scored", "kivi_buffer_attention", "kivi_buffer_partial", "kivi_lanes_attention_scored",
           "kivi_lanes_partial_scored", "kivi_partial_scored", "lanes_attention_scored", "lanes_partial_scored",
           "scored_impl", "split_lane_logits", "gather_attention", "gather_partial", "kivi_attention", "kivi_facts",
           "kivi_lanes_attention", "kivi_lanes_buffer_attention", "kivi_lanes_buffer_partial", "kivi_lanes_partial",
           "kivi_order", "kivi_partial", "kernels_mode", "kivi_cuda_enabled", "lanes_attention", "lanes_partial",
           "live_slots", "paged_attention", "paged_partial", "select", "select_gather", "select_gather_attention",
           "select_topk", "triton_available"]
