"""KIVI packed format, quantizers and reference attention (pure PyTorch).

KIVI (Liu et al., ICML 2024, arXiv:2402.02750) quantizes keys **per channel**
(a group is ``G`` consecutive tokens of one channel) and values **per token**
(a group is ``Gv`` consecutive channels of one token), asymmetric min-max with
an fp16 scale and zero point::

    s = (max - min) / (2**bits - 1)      (s := 1 when the group is constant)
    code = clamp(round((x - z) / s), 0, 2**bits - 1),   z = min
    x_hat = code * s + z

Packed layout (``PER = 32 // bits`` codes per int32 word).  Inside a word the codes are
**interleaved by 16-bit half**: code ``j`` of a word sits at bits ``[bits*slot(j), bits*(slot(j)+1))``
with ``slot(j) = j // 2 + (j % 2) * PER // 2`` - even codes fill the low half, odd codes the high
half, so the two codes of one 16-bit pair ``(2i, 2i+1)`` sit at the same place in each half and one
AND/OR of a word yields them as one packed fp16 pair (see ``triton_kernel.py``).  :func:`pack` and
:func:`unpack` convert; codes are always unpacked in their logical order.

* keys ``k_codes``: int32 ``[B, H, NG, ceil(Dk / PER), G]`` - **packed along channels**: for token group
  ``g``, word ``w`` of token ``t`` (``t`` = position in the group) holds the codes of channels
  ``w*PER .. w*PER + PER - 1`` of that token, and the ``G`` tokens of one word index are contiguous
  (word-major inside a group).  Dim 2 counts G-token groups (the stores rely on it).  A tile of
  tokens unpacks straight into ``K`` ``[tokens, Dk]``, the operand of the score product whose
  reduction axis (channels) is the packed one.
  ``k_scale``, ``k_zero``: fp16 ``[B, H, NG, Dk]`` (per channel and group).
* values ``v_codes``: int32 ``[B, H, NG*G, Dv // PER]`` packed along channels (channel ``c`` is
  code ``c % PER`` of word ``c // PER``); dim 2 counts tokens.
  ``v_scale``, ``v_zero``: fp16 ``[B, H, NG*G, Dv // Gv]``.
* ``valid``: bool ``[B, NG*G]`` - slots attention may read (False for padding,
  evicted tokens and unused capacity).

Size: ``bits + 32/G`` bits per key element and ``bits + 32/Gv`` per value
element: 3.0 bits at 2 bits, G = Gv = 32.

The GPU kernel (``triton_kernel.py``) has the same signature as
:func:`kivi_attention_partial`.
"""

from __future__ import annotations

import dataclasses
import math

import torch

BITS = (2, 4)


def codes_per_word(bits: int) -> int:
    if bits not in BITS:
        raise ValueError(f"KIVI supports bits in {BITS}, got {bits}")
    return 32 // bits


# ----------------------------------------------------------------------------- packing


def slots(bits: int, device=None) -> torch.Tensor:
    """``slot[j]``: the bit field (in units of ``bits``) that holds code ``j`` of a word (see the module docstring)."""
    per = codes_per_word(bits)
    j = torch.arange(per, device=device, dtype=torch.int32)
    return j // 2 + (j % 2) * (per // 2)


_SHIFTS: dict[int, torch.Tensor] = {}  # bits -> shifts on the CPU (made once: a CPU decode step unpacks every layer)


def _shifts(bits: int, device) -> torch.Tensor:
    """``slots(bits) * bits``: the shift of each code of a word; the CPU tensor is made once (not while tracing)."""
    if torch.device(device).type != "cpu" or torch.compiler.is_compiling():
        return slots(bits, device) * bits
    out = _SHIFTS.get(bits)
    if out is None:
        out = _SHIFTS[bits] = slots(bits) * bits
    return out


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes along the last axis into int32 words (``n`` divisible by ``32 // bits``).

    Code ``j`` of each run of ``PER`` codes goes to bit field ``slots(bits)[j]`` of its word.
    """
    per = codes_per_word(bits)
    n = codes.shape[-1]
    if n % per:
        raise ValueError(f"cannot pack {n} codes into words of {per}")
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], n // per, per)
    shifts = _shifts(bits, codes.device)
    # Disjoint bit fields: the sum is the bitwise OR (int32 wraps into the sign bit as intended).
    return (c << shifts).sum(dim=-1, dtype=torch.int32)


def unpack(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: int32 words ``[..., W]`` -> codes ``[..., W * 32 // bits]`` (int32)."""
    per = codes_per_word(bits)
    shifts = _shifts(bits, words.device)
    codes = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*words.shape[:-1], words.shape[-1] * per)


# ----------------------------------------------------------------------------- quantizers


def quantize_groups(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min-max quantization of ``x`` with one group along ``dim``.

    Returns ``(codes int32 like x, scale fp16, zero fp16)`` with ``dim`` reduced (kept as size 1).
    A constant group (zero range, or a range that underflows fp16) gets scale 1, so it
    dequantizes to its (fp16-rounded) value and never produces NaN or inf.
    """
    x = x.float()
    lo = x.amin(dim=dim, keepdim=True)
    hi = x.amax(dim=dim, keepdim=True)
    qmax = (1 << bits) - 1
    scale = ((hi - lo) / qmax).to(torch.float16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = lo.to(torch.float16)
    codes = torch.round((x - zero.float()) / scale.float()).clamp_(0, qmax).to(torch.int32)
    return codes, scale, zero


def quantize_keys(k: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel key quantization: ``k [B, H, T, Dk]`` (T divisible by ``group``).

    Returns ``k_codes [B, H, T/G, ceil(Dk/PER), G]`` int32 (packed along channels, word-major inside a
    group; a last partial word is padded with zero codes),
    ``k_scale``, ``k_zero`` ``[B, H, T/G, Dk]`` fp16.
    """
    b, h, t, d = k.shape
    if t % group:
        raise ValueError(f"{t} key tokens are not a multiple of the group size {group}")
    per = codes_per_word(bits)
    x = k.reshape(b, h, t // group, group, d)  # [B, H, NG, G, Dk]
    codes, scale, zero = quantize_groups(x, bits, dim=3)  # one scale per (group, channel)
    if d % per:  # the last word of a token is padded with zero codes
        codes = torch.nn.functional.pad(codes, (0, per - d % per))
    words = pack(codes, bits)  # [B, H, NG, G, ceil(Dk/PER)]
    return words.transpose(-1, -2).contiguous(), scale.squeeze(3), zero.squeeze(3)


def fill_masked(x: torch.Tensor, valid: torch.Tensor, group: int) -> torch.Tensor:
    """Give masked token slots of ``x [B, H, T, d]`` (``valid [B, T]``, T a multiple of ``group``) the mean of the
    valid tokens of their own ``group``-token group (0 if none), so a group's min/max - hence its scale - is
    exactly that of its valid tokens."""
    b, h, t, d = x.shape
    w = valid.view(b, 1, t // group, group, 1)
    xg = x.view(b, h, t // group, group, d)
    n = w.sum(dim=3, keepdim=True)
    mean = (xg * w).sum(dim=3, keepdim=True) / n.clamp(min=1)
    # a group with no valid token: exactly +0 (the sum of x * 0 would be -0 where every x is negative, NaN where one
    # is infinite), so such a group always encodes as codes 0, scale 1, zero +0 - what the kernels write for it
    mean = mean.masked_fill(n == 0, 0)
    return torch.where(w, xg, mean.to(x.dtype)).view(b, h, t, d)


def dequantize_keys(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """``k_codes [B, H, NG, ceil(Dk/PER), G]`` -> keys ``[B, H, NG*G, Dk]`` (``Dk`` from the scales; float32)."""
    c = unpack(codes.transpose(-1, -2), bits)[..., :scale.shape[-1]].float()  # [B, H, NG, G, Dk]
    x = c * scale.float().unsqueeze(3) + zero.float().unsqueeze(3)
    b, h, ng, g, d = x.shape
    return x.reshape(b, h, ng * g, d)


def quantize_values(v: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token value quantization: ``v [B, H, T, Dv]`` (Dv divisible by ``group``).

    Returns ``v_codes [B, H, T, Dv/PER]`` int32, ``v_scale``, ``v_zero`` ``[B, H, T, Dv/Gv]`` fp16.
    """
    b, h, t, d = v.shape
    if d % group:
        raise ValueError(f"value dim {d} is not a multiple of the value group size {group}")
    x = v.reshape(b, h, t, d // group, group)
    codes, scale, zero = quantize_groups(x, bits, dim=-1)
    return pack(codes.reshape(b, h, t, d), bits), scale.squeeze(-1), zero.squeeze(-1)


def dequantize_values(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """``v_codes [B, H, T, W]`` -> values ``[B, H, T, Dv]`` (float32)."""
    c = unpack(codes, bits).float()
    b, h, t, d = c.shape
    groups = scale.shape[-1]
    x = c.view(b, h, t, groups, d // groups) * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)
    return x.view(b, h, t, d)


def fake_quantize_keys(k: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Quantize then dequantize keys (an oracle for tests and emulation)."""
    return dequantize_keys(*quantize_keys(k, bits, group), bits).to(k.dtype)


def fake_quantize_values(v: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    return dequantize_values(*quantize_values(v, bits, group), bits).to(v.dtype)


# ----------------------------------------------------------------------------- packed view


@dataclasses.dataclass
class PackedKV:
    """A view of quantized keys/values (see the module docstring for the layout).

    ``group`` is the key token-group size ``G``; ``v_group`` the value channel-group size.
    Tensors may be longer than the live data: ``valid`` masks every slot that must not be read.

    ``impl`` (optional): the implementation :meth:`attention_partial` runs, chosen once when the store is built
    (:func:`kvcompress.kernels.ops.choose`): ``"reference"``, ``"triton"`` or ``"cuda"``, through the registered op
    ``kvcompress::kivi_partial`` (graph-capturable).  ``None`` (default): decided per call
    (:func:`kvcompress.kernels.kivi.kivi_attention_partial`).
    ``length`` (optional): 0-dim int device tensor, the number of leading token slots that may be live; slots at or
    after it are treated as invalid by every implementation (the Triton and CUDA kernels do not read them; a length
    past the slots bounds nothing).
    """

    bits: int
    group: int
    k_codes: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_codes: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor
    valid: torch.Tensor
    k_per_token: bool = False  # ablation only: keys in the *values'* per-token layout (KIVI's wrong axis)
    impl: str | None = None
    length: torch.Tensor | None = None

    #: :meth:`attention_partial` takes ``softcap=`` (every implementation applies it)
    supports_softcap = True
    #: :meth:`attention_scored` returns the scores the read computed (attention-mass observers use them)
    supports_scores = True
    #: :meth:`attention_partial_with_buffer` takes ``out_dtype=`` (the joint output in the read's dtype)
    buffer_out_dtype = True

    @property
    def num_tokens(self) -> int:
        return self.valid.shape[-1]

    @property
    def v_group(self) -> int:
        return self.v_codes.shape[-1] * (32 // self.bits) // self.v_scale.shape[-1]

    def live_valid(self) -> torch.Tensor:
        """``valid`` restricted to the slots before ``length`` (``valid`` itself without a length)."""
        if self.length is None:
            return self.valid
        t = self.valid.shape[-1]
        return self.valid & (torch.arange(t, device=self.valid.device) < self.length.to(self.valid.device))

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Full keys ``[B, H, T, Dk]`` and values ``[B, H, T, Dv]`` in float32 (read-time, transient)."""
        if self.k_per_token:
            k = dequantize_values(self.k_codes, self.k_scale, self.k_zero, self.bits)
        else:
            k = dequantize_keys(self.k_codes, self.k_scale, self.k_zero, self.bits)
        v = dequantize_values(self.v_codes, self.v_scale, self.v_zero, self.bits)
        return k, v

    def attention_partial(self, query: torch.Tensor, scale: float,
                          softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` of ``query [B, H, M, Dk]`` over this region (fused kernel on CUDA): through the registered
        op with the chosen ``impl`` when it is set, else decided per call.  ``softcap``: logit soft-cap."""
        if self.impl is not None:
            return _ops().kivi_attention(query, self, scale, impl=self.impl, softcap=softcap)
        if self.k_per_token:
            return kivi_attention_partial(query, self, scale, softcap=softcap)
        from . import kivi_attention_partial as dispatch

        return dispatch(query, self, scale, softcap=softcap)

    def attention_partial_with_buffer(self, query: torch.Tensor, scale: float, k: torch.Tensor, v: torch.Tensor,
                                      valid: torch.Tensor, length: torch.Tensor | None = None,
                                      softcap: float | None = None, out_dtype: torch.dtype | None = None
                                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(out, lse)`` over this region and a full-precision buffer ``k`` / ``v`` ``[B, H, T, Dk / Dv]`` (validity
        ``valid [B, T]``, ``length`` bounding its slots) in ONE launch - the hand-written CUDA kernel's buffer CTAs
        (registered op ``kvcompress::kivi_buffer_partial``), or, with the launch setting ``buffer_lanes`` (the
        default), the Triton lanes kernel beside it into the same split combine - or ``None`` when the region's
        implementation cannot (not ``"cuda"``, or shapes / dtypes it does not take) or should not (a read large
        enough that the two regions apart are faster: :func:`.cuda_kernel.buffer_read`): the caller then reads the
        two regions apart.
        ``out_dtype``: ``out``'s dtype (``None``: float32; the split combine stores it: a read whose only part this
        is needs no cast after it)."""
        if self.impl != "cuda" or self.k_per_token:
            return None
        from . import cuda_kernel

        if cuda_kernel.buffer_problem(query, self, k, v, valid) is not None:  # shapes only: decided at trace time
            return None
        slots = self.k_codes.shape[2] * self.group
        how = cuda_kernel.buffer_read(self.bits, *query.shape[:3], slots, k.shape[2])
        if how is None or (how == "lanes" and not cuda_kernel.buffer_lanes_ok(query, k, v, valid)):
            return None  # large: apart is faster (unless the buffer is read beside the region: buffer_lanes)
        return _ops().kivi_buffer_attention(query, self, scale, k, v, valid, length, impl=self.impl, softcap=softcap,
                                            out_dtype=out_dtype)

    def attention_scored(self, query: torch.Tensor, scale: float, softcap: float | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`attention_partial` that also returns its scores ``[B, H, M, T]`` (natural-log units, ``-inf`` on
        slots not attended): the registered op ``kvcompress::kivi_partial_scored`` with the region's ``impl`` (the
        CUDA v3 choice is scored by the Triton kernel); without one, the reference."""
        if self.impl is not None:
            return _ops().kivi_attention_scored(query, self, scale, impl=self.impl, softcap=softcap)
        return kivi_attention_scored(query, self, scale, softcap=softcap)


def _ops():
    from kvcompress.kernels import ops  # registers the ops on first use (it imports this module)

    return ops


# ----------------------------------------------------------------------------- attention


def kivi_attention_partial(query: torch.Tensor, packed: PackedKV, scale: float, *,
                           softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of grouped queries over a quantized region, unnormalised across regions.

    Every stored token precedes every query (the quantized middle is older than the
    recent window), so only ``packed.valid`` (restricted to slots before ``packed.length`` when set) masks keys.

    Args:
        query: ``[B, Hkv, M, Dk]`` - the ``M = group * q_len`` query rows that share each kv head
            (already mapped to the stored key channels).
        packed: the quantized keys and values.
        scale: softmax scale.
        softcap: logit soft-cap ``softcap * tanh(s / softcap)`` of the scaled scores (``None`` or 0: none).

    Returns:
        ``(out [B, Hkv, M, Dv] float32, lse [B, Hkv, M] float32)``: the softmax-normalised output over
        this region and the natural-log sum of ``exp(scale * q.k)`` over its valid keys (``-inf`` and a
        zero output where no key is valid).  Merge regions with
        :func:`kvcompress.kernels.attention.reference.merge_partials`.
    """
    from kvcompress.kernels.attention.reference import partial_attention

    k, v = packed.dequantize()  # once; many query rows (a prefill chunk) are then read in bounded chunks
    valid = packed.live_valid()
    return partial_attention(query, k, v, valid.view(valid.shape[0], 1, 1, valid.shape[-1]), scale, softcap)


def kivi_buffer_attention_partial(query: torch.Tensor, packed: PackedKV, scale: float, k: torch.Tensor,
                                  v: torch.Tensor, valid: torch.Tensor, length: torch.Tensor | None = None, *,
                                  softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over a packed region and a full-precision buffer together (what the CUDA kernel reads in one launch,
    :meth:`PackedKV.attention_partial_with_buffer`): the two regions' partials merged by log-sum-exp.  ``k`` / ``v``
    ``[B, H, T, Dk / Dv]``, ``valid [B, T]``; ``length`` (0-dim int tensor or ``None``): only the buffer's slots before
    it may be live.  Returns ``(out [B, H, M, Dv] float32, lse [B, H, M] float32)`` as
    :func:`kivi_attention_partial`."""
    from kvcompress.kernels.attention.reference import merge_partials, merged_lse

    region = kivi_attention_partial(query, packed, scale, softcap=softcap)
    buffer = buffer_attention_partial(query, k, v, valid, length, scale, softcap=softcap)
    return merge_partials([region, buffer]), merged_lse([region[1], buffer[1]])


def buffer_attention_partial(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                             length: torch.Tensor | None, scale: float, *,
                             softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The full-precision buffer's partial of :func:`kivi_buffer_attention_partial`: ``valid [B, T]`` restricted to the
    slots before ``length``."""
    from kvcompress.kernels.attention.reference import partial_attention

    if length is not None:
        valid = valid & (torch.arange(valid.shape[-1], device=valid.device) < length.to(valid.device))
    return partial_attention(query, k, v, valid.view(valid.shape[0], 1, 1, valid.shape[-1]), scale, softcap or None)


def kivi_attention_scored(query: torch.Tensor, packed: PackedKV, scale: float, *,
                          softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`kivi_attention_partial` that also returns its scores: ``(out, lse, logits [B, Hkv, M, T] float32)``,
    the scaled (soft-capped) scores of the dequantized keys in natural-log units, ``-inf`` on slots not attended."""
    from kvcompress.kernels.attention.reference import partial_scored

    k, v = packed.dequantize()
    valid = packed.live_valid()
    return partial_scored(query, k, v, valid.view(valid.shape[0], 1, 1, valid.shape[-1]), scale, softcap)


def bits_per_element(bits: int, group: int) -> float:
    """Storage cost of one quantized element including its share of the fp16 scale and zero."""
    return bits + 32 / group


def packed_bytes(tokens: int, heads: int, dk: int, dv: int, bits: int, group: int, v_group: int) -> int:
    """Bytes of codes + scales + zeros for ``tokens`` (one row), without the valid mask."""
    ng = math.ceil(tokens / group)
    k = heads * ng * dk * (group * bits // 8 + 4)
    v = heads * ng * group * (dv * bits // 8 + 4 * (dv // v_group))
    return k + v
