"""KIVI quantizer in Triton: keys and values of a block in ONE launch (``kvcompress::kivi_quantize``, impl "triton").

Same signature, outputs (shapes, dtypes, contiguous layouts) and bits as the reference path of
:func:`kvcompress.kernels.ops.kivi_quantize`: :func:`.reference.fill_masked` on ``k`` and ``v`` when ``valid`` is
given, then :func:`.reference.quantize_keys` (or :func:`.reference.quantize_values` for per-token keys) and
:func:`.reference.quantize_values`.  The reference is ~45 small launches per call; a compiled decode step calls it
once per layer.

One program per (batch * head, G-token group) holds the group's key tile ``[G, Dk]`` and value tile ``[G, Dv]``:

* **fill** (with ``valid``): a masked slot takes the mean of its group's valid tokens per channel, as the reference
  computes it in ``x``'s dtype: the fp32 sum of ``x * valid`` rounded to that dtype, divided (IEEE, fp32) by the
  count (at least 1), rounded again.  A group with no valid slot is not read at all: it encodes as codes 0,
  scales 1, zeros +0 (the reference fills it with exactly +0) - a static cache's decode step offers a block every step
  and only one in G leaves the window, so most calls take this branch.  bf16 rounding is done on the fp32 bits (round to
  nearest even): the Triton interpreter's fp32 -> bf16 cast truncates;
* **quantize**: min / max in fp32; ``scale = fp16((max - min) / qmax)`` divided as the reference divides on the same
  device: on CUDA PyTorch divides a tensor by a Python scalar as a multiplication by its fp32 reciprocal
  (``aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu``), so the kernel computes ``(max - min) * fp32(1 / qmax)``
  there, and an IEEE division (``tl.math.div_rn``) elsewhere (CPU tensors: the interpreter, as PyTorch's CPU
  kernels); ``scale <= 0 -> 1``, ``zero = fp16(min)``, ``code = round_half_even(clamp((x - zero) / scale, 0,
  qmax))`` with a correctly rounded division on every device (``tl.math.div_rn``: Triton's plain ``/`` is
  approximate on CUDA; PyTorch divides two tensors exactly).  Clamping then rounding equals the reference's
  round-then-clamp; the rounding is floor plus an exact fraction test, the same on CUDA and in the interpreter;
* **pack**: ``32 // bits`` codes per int32 word in the reference's interleaved slots (:func:`.reference.slots`);
  keys word-major inside a group (``[Dk/PER, G]``, a last partial word padded with zero codes), values and per-token
  keys along channels.  Per-token groups of ``Gv`` channels are a 4-D view ``[G, A, B, C]`` of the tile: ``A`` value
  groups of ``B`` words of ``PER`` codes (``Gv >= PER``), or ``A`` words of ``B`` groups of ``Gv`` codes.

**Caveat (the one difference from the reference):** the fp32 sum of a masked mean is reduced in Triton's order, not
PyTorch's, so the mean can differ in its last fp32 bit.  For bf16 / fp16 inputs the sum is rounded to the input
dtype before use, so such a bit almost never survives (and sums of up to 128 nearby bf16 / fp16 values are exact
anyway).  For fp32 inputs it can change the code of a masked slot whose mean lands at a rounding boundary and, in a
group whose valid values are all (nearly) equal, the group's range itself - the range is then a few ulps, the scale a
subnormal fp16 or 1 - and with it that group's scale, zero and codes.  Everything else (no ``valid``, groups without
a masked slot, every other rounding) is bit-identical.

Limits (:func:`problem`, also :func:`kvcompress.kernels.ops.choose`'s check): bits 2 / 4; a power-of-two key group
up to 128; a power-of-two value group dividing ``Dv`` (and ``Dk`` for per-token keys); ``Dv`` (and per-token ``Dk``)
a multiple of ``32 // bits``; head dims up to 256; fp16 / bf16 / fp32 inputs (any strides).
Nothing is compiled at import; Triton compiles each configuration at its first launch.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .reference import codes_per_word

MAX_DIM = 256
MAX_GROUP = 128
_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def problem(bits: int, group: int, v_group: int, k_dim: int, v_dim: int, k_per_token: bool,
            dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """Why the kernel cannot take these static facts (``None``: it can)."""
    if bits not in (2, 4):
        return f"bits {bits} (2 or 4)"
    per = 32 // bits
    if not (_pow2(group) and group <= MAX_GROUP):
        return f"key group {group} (a power of two up to {MAX_GROUP})"
    if not (0 < k_dim <= MAX_DIM and 0 < v_dim <= MAX_DIM):
        return f"head dims {k_dim} / {v_dim} (up to {MAX_DIM})"
    token_dims = (v_dim, k_dim) if k_per_token else (v_dim,)
    if not _pow2(v_group) or any(d % v_group or d % per for d in token_dims):
        return f"value group {v_group} (a power of two dividing {token_dims}, each a multiple of {per})"
    if dtype is not None and dtype not in _DTYPES:
        return f"dtype {dtype} (float16, bfloat16 or float32)"
    return None


# ----------------------------------------------------------------------------- device helpers


@triton.jit
def _round_to(x, XD: tl.constexpr):
    """fp32 ``x`` rounded to nearest even in the input dtype (0 fp32, 1 fp16, 2 bf16), returned as fp32."""
    if XD == 1:
        return x.to(tl.float16).to(tl.float32)
    elif XD == 2:  # on the bits: the interpreter's fp32 -> bf16 cast truncates
        u = x.to(tl.uint32, bitcast=True)
        u = (u + (0x7FFF + ((u >> 16) & 1))) & 0xFFFF0000
        return u.to(tl.float32, bitcast=True)
    else:
        return x


@triton.jit
def _fill(x, w, n, XD: tl.constexpr):
    """:func:`.reference.fill_masked` of a tile ``x [G, ...]`` (fp32 holding input-dtype values): masked tokens
    (``w`` False, broadcast like ``x``) take the mean of the group's valid ones, ``n`` their count (>= 1)."""
    s = tl.sum(x * w.to(tl.float32), axis=0, keep_dims=True)
    mean = _round_to(tl.math.div_rn(_round_to(s, XD), n), XD)
    return tl.where(w, x, mean)


@triton.jit
def _quantize(x, lo, hi, QMAX: tl.constexpr, INV: tl.constexpr):
    """Codes (int32, like ``x``), scale and zero (fp16, like ``lo``) of :func:`.reference.quantize_groups`.
    ``INV``: 0 -> ``(hi - lo) / qmax`` (IEEE), else ``(hi - lo) * INV`` (``INV`` = fp32 ``1 / qmax``)."""
    if INV == 0:
        scale = tl.math.div_rn(hi - lo, tl.full(lo.shape, QMAX, tl.float32)).to(tl.float16)
    else:
        scale = ((hi - lo) * INV).to(tl.float16)
    scale = tl.where(scale > 0, scale, 1.0)
    zero = lo.to(tl.float16)
    y = tl.math.div_rn(x - zero.to(tl.float32), scale.to(tl.float32))
    y = tl.minimum(tl.maximum(y, 0.0), QMAX * 1.0)
    f = tl.floor(y)
    r = y - f  # exact
    fi = f.to(tl.int32)
    up = (r > 0.5) | ((r == 0.5) & ((fi & 1) == 1))  # round half to even
    return fi + up.to(tl.int32), scale, zero


@triton.jit
def _shift(j, BITS: tl.constexpr, PER: tl.constexpr):
    """Bit offset of code ``j`` of a word (:func:`.reference.slots`)."""
    return ((j // 2 + (j % 2) * (PER // 2)) * BITS).to(tl.uint32)


@triton.jit
def _pack(code, shift, axis: tl.constexpr):
    """Codes shifted into their bit fields, summed along ``axis``: disjoint fields, so the sum is their OR (unsigned:
    no overflow; the interpreter sums in 64 bits and narrows)."""
    return tl.sum(code.to(tl.uint32) << shift, axis=axis)


@triton.jit
def _per_channel(src, s_t, s_c, w, n, codes, scales, zeros, grp,
                 DK: tl.constexpr, KW: tl.constexpr, KW_PAD: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr,
                 XD: tl.constexpr, HAS_VALID: tl.constexpr, INV: tl.constexpr):
    """Keys of one G-token group, per channel: codes ``[KW, G]`` at group ``grp``, scales / zeros ``[Dk]``."""
    PER: tl.constexpr = 32 // BITS
    t = tl.arange(0, G)[:, None, None]
    wi = tl.arange(0, KW_PAD)[None, :, None]
    j = tl.arange(0, PER)[None, None, :]
    c = wi * PER + j  # channel
    c_ok = c < DK
    x = tl.load(src + t * s_t + c * s_c, mask=c_ok, other=0.0).to(tl.float32)
    if HAS_VALID:
        x = _fill(x, w[:, None, None], n, XD)
    lo = tl.min(x, axis=0, keep_dims=True)
    hi = tl.max(x, axis=0, keep_dims=True)
    code, scale, zero = _quantize(x, lo, hi, (1 << BITS) - 1, INV)
    code = tl.where(c_ok, code, 0)  # a last partial word is padded with zero codes (already 0: loaded as 0)
    words = _pack(code, _shift(j, BITS, PER), 2).to(tl.int32, bitcast=True)  # [G, KW_PAD]
    t2 = tl.arange(0, G)[:, None]
    w2 = tl.arange(0, KW_PAD)[None, :]
    tl.store(codes + (grp * KW + w2) * G + t2, words, mask=w2 < KW)
    c1 = c.reshape(KW_PAD, PER)
    tl.store(scales + grp * DK + c1, scale.reshape(KW_PAD, PER), mask=c1 < DK)
    tl.store(zeros + grp * DK + c1, zero.reshape(KW_PAD, PER), mask=c1 < DK)


@triton.jit
def _per_token(src, s_t, s_c, w, n, codes, scales, zeros, row,
               D: tl.constexpr, GV: tl.constexpr, A_PAD: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr,
               XD: tl.constexpr, HAS_VALID: tl.constexpr, INV: tl.constexpr):
    """Values (or per-token keys) of one G-token group starting at token row ``row``: codes ``[G, D/PER]``,
    scales / zeros ``[G, D/GV]``.  Channel ``c = a*(BN*CN) + b*CN + i`` of the 4-D view ``[G, A_PAD, BN, CN]``."""
    PER: tl.constexpr = 32 // BITS
    CN: tl.constexpr = PER if GV >= PER else GV
    BN: tl.constexpr = GV // PER if GV >= PER else PER // GV
    NW: tl.constexpr = D // PER  # words per token
    NS: tl.constexpr = D // GV  # groups per token
    t = tl.arange(0, G)[:, None, None, None]
    a = tl.arange(0, A_PAD)[None, :, None, None]
    b = tl.arange(0, BN)[None, None, :, None]
    i = tl.arange(0, CN)[None, None, None, :]
    c = a * (BN * CN) + b * CN + i
    c_ok = c < D  # whole groups and words are padded: padding never joins a real group
    x = tl.load(src + t * s_t + c * s_c, mask=c_ok, other=0.0).to(tl.float32)
    if HAS_VALID:
        x = _fill(x, w[:, None, None, None], n, XD)
    t2 = tl.arange(0, G)[:, None]
    a2 = tl.arange(0, A_PAD)[None, :]
    if GV >= PER:  # a group = BN whole words: reduce over (b, i); pack over i
        lo = tl.min(tl.min(x, axis=3), axis=2)
        hi = tl.max(tl.max(x, axis=3), axis=2)
        code, scale, zero = _quantize(x, lo[:, :, None, None], hi[:, :, None, None], (1 << BITS) - 1, INV)
        words = _pack(code, _shift(i, BITS, PER), 3).to(tl.int32, bitcast=True)  # [G, A_PAD, BN]
        t3 = tl.arange(0, G)[:, None, None]
        wd = a2[:, :, None] * BN + tl.arange(0, BN)[None, None, :]
        tl.store(codes + (row + t3) * NW + wd, words, mask=wd < NW)
        s_ok = a2 < NS
        tl.store(scales + (row + t2) * NS + a2, scale.reshape(G, A_PAD), mask=s_ok)
        tl.store(zeros + (row + t2) * NS + a2, zero.reshape(G, A_PAD), mask=s_ok)
    else:  # a word = BN whole groups: reduce over i; pack over (b, i)
        lo = tl.min(x, axis=3)
        hi = tl.max(x, axis=3)
        code, scale, zero = _quantize(x, lo[:, :, :, None], hi[:, :, :, None], (1 << BITS) - 1, INV)
        words = tl.sum(_pack(code, _shift(b * CN + i, BITS, PER), 3), axis=2).to(tl.int32, bitcast=True)
        tl.store(codes + (row + t2) * NW + a2, words, mask=a2 < NW)
        t3 = tl.arange(0, G)[:, None, None]
        gi = a2[:, :, None] * BN + tl.arange(0, BN)[None, None, :]
        tl.store(scales + (row + t3) * NS + gi, tl.reshape(scale, G, A_PAD, BN), mask=gi < NS)
        tl.store(zeros + (row + t3) * NS + gi, tl.reshape(zero, G, A_PAD, BN), mask=gi < NS)


@triton.jit
def _per_channel_empty(codes, scales, zeros, grp, DK: tl.constexpr, KW: tl.constexpr, KW_PAD: tl.constexpr,
                       G: tl.constexpr, PER: tl.constexpr):
    """What :func:`_per_channel` writes for a group with no valid token (every slot filled with +0): codes 0,
    scales 1, zeros +0 - without reading the keys."""
    t2 = tl.arange(0, G)[:, None]
    w2 = tl.arange(0, KW_PAD)[None, :]
    tl.store(codes + (grp * KW + w2) * G + t2, tl.zeros((G, KW_PAD), tl.int32), mask=w2 < KW)
    c1 = tl.arange(0, KW_PAD * PER)
    tl.store(scales + grp * DK + c1, tl.full((KW_PAD * PER,), 1.0, tl.float16), mask=c1 < DK)
    tl.store(zeros + grp * DK + c1, tl.zeros((KW_PAD * PER,), tl.float16), mask=c1 < DK)


@triton.jit
def _per_token_empty(codes, scales, zeros, row, D: tl.constexpr, GV: tl.constexpr, G: tl.constexpr,
                     BITS: tl.constexpr, NW_PAD: tl.constexpr, NS_PAD: tl.constexpr):
    """What :func:`_per_token` writes for a group with no valid token: codes 0, scales 1, zeros +0 per token."""
    PER: tl.constexpr = 32 // BITS
    NW: tl.constexpr = D // PER
    NS: tl.constexpr = D // GV
    t2 = tl.arange(0, G)[:, None]
    wd = tl.arange(0, NW_PAD)[None, :]
    tl.store(codes + (row + t2) * NW + wd, tl.zeros((G, NW_PAD), tl.int32), mask=wd < NW)
    gi = tl.arange(0, NS_PAD)[None, :]
    tl.store(scales + (row + t2) * NS + gi, tl.full((G, NS_PAD), 1.0, tl.float16), mask=gi < NS)
    tl.store(zeros + (row + t2) * NS + gi, tl.zeros((G, NS_PAD), tl.float16), mask=gi < NS)


@triton.jit
def _kivi_quantize_kernel(
    K, V, VALID, KC, KS, KZ, VC, VS, VZ,
    H, T, NG,
    sk_b, sk_h, sk_t, sk_c,
    sv_b, sv_h, sv_t, sv_c,
    sva_b, sva_t,
    DK: tl.constexpr, DV: tl.constexpr, G: tl.constexpr, GV: tl.constexpr, BITS: tl.constexpr,
    KW: tl.constexpr, KW_PAD: tl.constexpr, KA_PAD: tl.constexpr, VA_PAD: tl.constexpr,
    KXD: tl.constexpr, VXD: tl.constexpr, K_PER_TOKEN: tl.constexpr, HAS_VALID: tl.constexpr, INV: tl.constexpr,
    KNW_PAD: tl.constexpr, KNS_PAD: tl.constexpr, VNW_PAD: tl.constexpr, VNS_PAD: tl.constexpr,
):
    """One (G-token group, batch * head): its keys, then its values."""
    g = tl.program_id(0).to(tl.int64)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    t0 = g * G
    n = 1.0
    live = 1
    w = tl.full((G,), 1, tl.int1)
    if HAS_VALID:
        w = tl.load(VALID + b * sva_b + (t0 + tl.arange(0, G)) * sva_t) != 0
        live = tl.sum(w.to(tl.int32), axis=0)
        n = tl.maximum(live.to(tl.float32), 1.0)
    k_src = K + b * sk_b + h * sk_h + t0 * sk_t
    v_src = V + b * sv_b + h * sv_h + t0 * sv_t
    row = bh * T + t0  # first token row of the group in [B*H*T, ...] outputs
    if live > 0:
        if K_PER_TOKEN:
            _per_token(k_src, sk_t, sk_c, w, n, KC, KS, KZ, row, DK, GV, KA_PAD, G, BITS, KXD, HAS_VALID, INV)
        else:
            _per_channel(k_src, sk_t, sk_c, w, n, KC, KS, KZ, bh * NG + g, DK, KW, KW_PAD, G, BITS, KXD,
                         HAS_VALID, INV)
        _per_token(v_src, sv_t, sv_c, w, n, VC, VS, VZ, row, DV, GV, VA_PAD, G, BITS, VXD, HAS_VALID, INV)
    else:  # no valid token (a static cache's decode step offers a block every step; most are not due): constants
        if K_PER_TOKEN:
            _per_token_empty(KC, KS, KZ, row, DK, GV, G, BITS, KNW_PAD, KNS_PAD)
        else:
            _per_channel_empty(KC, KS, KZ, bh * NG + g, DK, KW, KW_PAD, G, 32 // BITS)
        _per_token_empty(VC, VS, VZ, row, DV, GV, G, BITS, VNW_PAD, VNS_PAD)


# ----------------------------------------------------------------------------- host wrapper


def _reciprocal(bits: int) -> float:
    """fp32 ``1 / qmax``, as PyTorch's CUDA division by a Python scalar computes it (``opmath(1) / b`` on the host,
    then ``a * inv`` on the device: ``aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu``)."""
    return float(torch.tensor(1.0, dtype=torch.float32) / ((1 << bits) - 1))


def _groups_pad(d: int, gv: int, per: int) -> int:
    """``A_PAD`` of :func:`_per_token`: value groups (``gv >= per``) or words per token, as a power of two."""
    return triton.next_power_of_2(d // max(gv, per))


def kivi_quantize_triton(k: torch.Tensor, v: torch.Tensor, valid: Optional[torch.Tensor], bits: int, group: int,
                         v_group: int, k_per_token: bool, *, scale_reciprocal: Optional[bool] = None):
    """``(k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)`` of ``k`` / ``v`` ``[B, H, T, d]``, exactly as the
    reference path of :func:`kvcompress.kernels.ops.kivi_quantize` on the same device (see the module docstring for
    the one caveat).

    ``valid``: optional bool ``[B, T]``; masked slots first take their group's valid mean.  One launch; inputs may
    be strided views; outputs are fresh contiguous tensors.  Raises ``ValueError`` for arguments the kernel (or the
    reference) does not take.  ``scale_reciprocal``: compute the scale as ``(max - min) * fp32(1 / qmax)`` (as
    PyTorch does on CUDA) rather than ``(max - min) / qmax`` (as on CPU); ``None``: as PyTorch on ``k``'s device."""
    if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
        raise ValueError(f"kivi_quantize_triton: k and v must be [B, H, T, d] with the same B, H, T, got "
                         f"{tuple(k.shape)} / {tuple(v.shape)}")
    bsz, heads, t, dk = k.shape
    dv = v.shape[-1]
    why = problem(bits, group, v_group, dk, dv, k_per_token, k.dtype) or problem(
        bits, group, v_group, dk, dv, k_per_token, v.dtype)
    if why is not None:
        raise ValueError(f"kivi_quantize_triton: the kernel does not take {why}")
    if t % group:
        raise ValueError(f"kivi_quantize_triton: {t} tokens are not a multiple of the group size {group}")
    if valid is not None and (valid.dtype != torch.bool or tuple(valid.shape) != (bsz, t)):
        raise ValueError(f"kivi_quantize_triton: valid must be bool [{bsz}, {t}], got {valid.dtype} "
                         f"{tuple(valid.shape)}")
    per = codes_per_word(bits)
    ng = t // group
    kw = -(-dk // per)
    f16 = dict(dtype=torch.float16, device=k.device)
    if k_per_token:
        kc = torch.empty(bsz, heads, t, dk // per, dtype=torch.int32, device=k.device)
        ks = torch.empty(bsz, heads, t, dk // v_group, **f16)
    else:
        kc = torch.empty(bsz, heads, ng, kw, group, dtype=torch.int32, device=k.device)
        ks = torch.empty(bsz, heads, ng, dk, **f16)
    vc = torch.empty(bsz, heads, t, dv // per, dtype=torch.int32, device=v.device)
    vs = torch.empty(bsz, heads, t, dv // v_group, **f16)
    kz, vz = torch.empty_like(ks), torch.empty_like(vs)
    if ng == 0 or bsz * heads == 0:
        return kc, ks, kz, vc, vs, vz
    va = valid.view(torch.uint8) if valid is not None else kc  # any pointer when there is no mask
    sva = valid.stride() if valid is not None else (0, 0)
    tile = group * max(dk, dv)
    _kivi_quantize_kernel[(ng, bsz * heads)](
        k, v, va, kc, ks, kz, vc, vs, vz,
        heads, t, ng,
        *k.stride(), *v.stride(), *sva,
        DK=dk, DV=dv, G=group, GV=v_group, BITS=bits,
        KW=kw, KW_PAD=triton.next_power_of_2(kw), KA_PAD=_groups_pad(dk, v_group, per) if k_per_token else 1,
        VA_PAD=_groups_pad(dv, v_group, per), KXD=_DTYPES[k.dtype], VXD=_DTYPES[v.dtype],
        K_PER_TOKEN=bool(k_per_token), HAS_VALID=valid is not None,
        INV=_reciprocal(bits) if (k.is_cuda if scale_reciprocal is None else scale_reciprocal) else 0,
        KNW_PAD=triton.next_power_of_2(dk // per) if k_per_token else 1,
        KNS_PAD=triton.next_power_of_2(dk // v_group) if k_per_token else 1,
        VNW_PAD=triton.next_power_of_2(dv // per), VNS_PAD=triton.next_power_of_2(dv // v_group),
        num_warps=8 if tile > 4096 else 4,
    )
    return kc, ks, kz, vc, vs, vz


__all__ = ["kivi_quantize_triton", "problem"]
