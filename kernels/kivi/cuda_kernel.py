"""Fused KIVI decode attention as a hand-written CUDA C++ kernel ("v3"; ``cuda_kernel.cu``).

KIVI (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML 2024,
arXiv:2402.02750) keeps keys quantized per channel and values per token.  This module computes
:func:`.reference.kivi_attention_partial` (same signature and semantics: ``(out fp32 [B, Hkv, M, Dv],
lse fp32 [B, Hkv, M])``) straight from the existing packed format (``reference.py``): nothing is
converted or copied except to fix alignment.  Nothing is compiled at import: the first call builds a
shared library with ``nvcc`` (one per ``(bits, Dk, Dv)``, cached under ``$KVCOMPRESS_CACHE`` or
``~/.cache/kvcompress``) and binds its ``extern "C"`` launcher with :mod:`ctypes` (the device code needs no
torch headers, so the same file compiles on a machine without a CUDA build of torch).

Work split (flash decoding): grid ``(splits, B*Hkv, row blocks)``; a CTA of ``nw`` warps takes a range of
tokens; every warp walks its own 32-token tiles of it (tiles ``w, w+nw, ...``) through a ``stages``-deep
``cp.async`` pipeline into its own shared-memory buffers, keeps an online softmax (base 2, lazy rescale)
in registers, and the warps are merged through shared memory at the end; a small CUDA kernel merges the
splits by log-sum-exp.

Both products run on tensor cores (``mma.sync.m16n8k16``, fp16 in, fp32 accumulate), and all operands come
from registers (lane ``(g, t) = (lane // 4, lane % 4)``; PTX fragment layout: A ``a0 = (row g, k 2t..2t+1)``,
``a1`` row ``g+8``, ``a2/a3`` k ``+8``; B ``b0 = (k 2t..2t+1, column g)``, ``b1`` k ``+8``; C ``(row g, columns
2t, 2t+1)``, rows ``g+8`` in ``c2/c3``):

* ``S = Q K^T``: A = the GQA query rows (padded to 8 - ``ROWS16`` off: the second half of A is a zero register
  and the second half of C is discarded - or 16), loaded once, pre-multiplied by ``scale * log2(e)``.  The
  channel order of the reduction is free, so lane quad ``t`` owns channels ``[t*Dk/4, (t+1)*Dk/4)`` = key words
  ``[t*KWT, (t+1)*KWT)`` of a token (:func:`key_pair`): its local pair ``l = 2s + r`` is k-pair
  ``(2t, 2t+1)`` (``r = 0``) or ``(2t+8, 2t+9)`` (``r = 1``) of k16 slice ``s``.  B column ``g`` of score tile
  ``j`` (4 tiles per 32-token tile) is token ``4g + j`` (:func:`score_token`): the lane reads tokens ``4g..4g+3``
  of one key word as one 16-byte vector (keys are word-major inside a group, tokens contiguous).  A word's
  two halves hold the even / odd channel of each pair at the same bit place, so one LOP3 with the exponent of
  ``2**(10-p)`` gives ``(2**(10-p) + code)`` for both channels, one HSUB2 the exact codes and one HFMA2 applies the
  per-channel scale / zero *pair* (adjacent fp16 in ``k_scale``); fields above bit 9 are shifted down once per
  word.  1.56 (2-bit) / 1.63 (4-bit) instructions per key code.
* ``O += P V``: A = P straight from the score accumulators (FlashAttention-2 register reuse: k16 step ``kk``
  is score tiles ``2kk, 2kk+1``, so lane ``(g, t)`` holds tokens ``8t+2kk (+1)`` and ``8t+4+2kk (+1)``,
  :func:`pv_tokens`).  B column ``g`` is one value channel (:func:`value_channel`): lane column ``g`` owns value
  words ``[g*NVW, (g+1)*NVW)`` (both halves) when a token has >= 8 words, else half ``g % 2`` of word ``g // 2``.
  One PRMT puts the same 16-bit half of two tokens' words into one register, so every field of it is a
  ``(token a, token b)`` pair of one channel: LOP3 + HSUB2 + HFMA2 with the per-token value scale / zero pair
  (one value group per lane column: ``Gv`` must be a multiple of the channels it spans).
* Masking: the valid flags of tokens ``8t..8t+7`` are one 8-byte shared-memory load; invalid slots get
  ``-inf``; a row with no valid slot gets LSE ``-inf`` and a zero output, as in the reference.

:func:`emulate` is a pure-PyTorch model of exactly this dataflow (fragments, permutations, bit tricks) that
the CPU tests compare with the reference; the GPU tests compare the kernel itself.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

from .reference import PackedKV, codes_per_word

LOG2E = 1.4426950408889634
TILE = 32
DIMS = (64, 128)
SOURCE = Path(__file__).with_name("cuda_kernel.cu")
NVCC_FLAGS = ("-O3", "--use_fast_math", "-lineinfo", "-std=c++17", "-shared", "-Xcompiler", "-fPIC",
              "-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_80,code=sm_80")
DEFAULT_CONFIG = dict(nw=4, stages=3, waves=2.0, warps_per_sm=8, min_tiles=2, min_blocks=1)

_LIBS: dict[tuple[int, int, int, int], ctypes.CDLL] = {}
_LOCK = threading.Lock()
BUILD_SECONDS: dict[tuple[int, int, int, int], float] = {}


# ----------------------------------------------------------------------------- fragment mapping (also used by emulate)


def key_pair(dk: int, t: int, s: int, r: int) -> int:
    """Channel pair (channels ``2p, 2p+1``) that quad lane ``t`` feeds as register ``r`` of k16 slice ``s``."""
    return t * (dk // 8) + 2 * s + r


def key_word_field(bits: int, dk: int, t: int, local: int) -> tuple[int, int, int]:
    """``(word, shift, bit)`` of local pair ``local`` of quad lane ``t``: the pair sits at ``bit`` of
    ``word >> shift`` in both 16-bit halves (shift 0 for the fields inside the 10-bit mantissa)."""
    per = codes_per_word(bits)
    hp = per // 2
    kwt = dk // per // 4
    word, i = t * kwt + local // hp, local % hp
    direct = 10 // bits
    return (word, 0, bits * i) if i < direct else (word, bits * direct, bits * (i - direct))


def score_token(j: int, col: int) -> int:
    """Token (inside a 32-token tile) of column ``col`` of score tile ``j``."""
    return 4 * col + j


def pv_tokens(t: int, kk: int, r: int) -> tuple[int, int]:
    """Tokens (low, high half) of B register ``r`` of P.V step ``kk`` for quad lane ``t``."""
    return 8 * t + 2 * kk + r, 8 * t + 2 * kk + r + 4


def value_units(bits: int, dv: int, g: int) -> list[tuple[int, int]]:
    """``(word, half)`` of each value unit of lane column ``g``, in n8-tile order."""
    per = codes_per_word(bits)
    vw = dv // per
    if vw >= 8:
        nvw = vw // 8
        return [(g * nvw + u // 2, u % 2) for u in range(2 * nvw)]
    return [(g // 2, g % 2)]


def value_channel(bits: int, dv: int, nt: int, col: int) -> int:
    """Value channel of column ``col`` of output n8 tile ``nt``."""
    hp = codes_per_word(bits) // 2
    word, half = value_units(bits, dv, col)[nt // hp]
    return word * codes_per_word(bits) + 2 * (nt % hp) + half


def value_span(bits: int, dv: int) -> int:
    """Channels one lane column's value units cover (they must fall into one value group)."""
    per = codes_per_word(bits)
    vw = dv // per
    return (vw // 8) * per if vw >= 8 else per


# ----------------------------------------------------------------------------- capability check


def _problem(query: torch.Tensor, packed: PackedKV) -> str | None:
    """Why the kernel cannot take this call (``None`` when it can)."""
    if getattr(packed, "k_per_token", False):
        return "per-token keys (ablation) are not supported"
    if packed.bits not in (2, 4):
        return f"bits {packed.bits}"
    if query.dim() != 4 or query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"query {tuple(query.shape)} {query.dtype}"
    b, h, m, dk = query.shape
    per = 32 // packed.bits
    g = packed.group
    kc = packed.k_codes
    if dk not in DIMS:
        return f"key dim {dk} not in {DIMS}"
    if g % TILE or g & (g - 1) or kc.dim() != 5 or tuple(kc.shape[:2]) != (b, h) or kc.shape[3] != dk // per or kc.shape[4] != g:
        return f"k_codes {tuple(kc.shape)} / group {g} (needs a power of two >= {TILE})"
    if tuple(packed.k_scale.shape) != (b, h, kc.shape[2], dk) or packed.k_zero.shape != packed.k_scale.shape:
        return "key scales"
    nt = kc.shape[2] * g
    dv = packed.v_codes.shape[-1] * per
    if dv not in DIMS or packed.v_codes.dim() != 4 or tuple(packed.v_codes.shape[:3]) != (b, h, nt):
        return f"value codes {tuple(packed.v_codes.shape)}"
    ngv = packed.v_scale.shape[-1]
    if ngv < 1 or dv % ngv or tuple(packed.v_scale.shape) != (b, h, nt, ngv) or packed.v_zero.shape != packed.v_scale.shape:
        return "value scales"
    gv = dv // ngv
    if gv < 16 or gv % value_span(packed.bits, dv):
        return f"value group {gv} (needs >= 16 and a multiple of {value_span(packed.bits, dv)})"
    if tuple(packed.valid.shape) != (b, nt):
        return f"valid {tuple(packed.valid.shape)}"
    if packed.k_scale.dtype != torch.float16 or packed.v_scale.dtype != torch.float16:
        return "scales must be fp16"
    if kc.dtype != torch.int32 or packed.v_codes.dtype != torch.int32:
        return "codes must be int32"
    return None


def _device_ok(device: torch.device) -> bool:
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 8 and nvcc_path() is not None


def supports(query: torch.Tensor, packed: PackedKV) -> bool:
    """The dispatcher's explicit capability check (no compilation happens here)."""
    return _device_ok(query.device) and _problem(query, packed) is None


# ----------------------------------------------------------------------------- build + bind


def nvcc_path() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.path.exists(os.path.join(root, "bin", "nvcc")):
            return os.path.join(root, "bin", "nvcc")
    return None


def cache_dir() -> Path:
    root = os.environ.get("KVCOMPRESS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kvcompress")
    return Path(root) / "kivi_cuda"


def nvcc_command(bits: int, dk: int, dv: int, out: str, extra: tuple[str, ...] = ()) -> list[str]:
    return [nvcc_path() or "nvcc", *NVCC_FLAGS, f"-DKIVI_BITS={bits}", f"-DKIVI_DK={dk}", f"-DKIVI_DV={dv}", *extra,
            "-o", out, str(SOURCE)]


def build(bits: int, dk: int, dv: int, min_blocks: int = 1) -> ctypes.CDLL:
    """Compile (or load from the cache) the library for ``(bits, dk, dv)`` and bind its launchers.

    ``min_blocks`` > 1 caps the registers (``__launch_bounds__(128, min_blocks)``) - a tuning knob."""
    key = (bits, dk, dv, min_blocks)
    with _LOCK:
        if key in _LIBS:
            return _LIBS[key]
    src = SOURCE.read_bytes()
    tag = hashlib.sha256(src + repr((NVCC_FLAGS, key)).encode()).hexdigest()[:16]
    path = cache_dir() / f"libkivi_v3_b{bits}_k{dk}_v{dv}_r{min_blocks}_{tag}.so"
    t0 = time.time()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        cmd = nvcc_command(bits, dk, dv, tmp, (f"-DKIVI_MIN_BLOCKS={min_blocks}",))
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            os.unlink(tmp)
            raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{res.stderr[-4000:]}")
        os.replace(tmp, path)
    lib = ctypes.CDLL(str(path))
    lib.kivi_v3_launch.restype = ctypes.c_int
    lib.kivi_v3_launch.argtypes = [ctypes.POINTER(ctypes.c_longlong), ctypes.c_double, ctypes.c_int, ctypes.c_int,
                                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.kivi_v3_combine_launch.restype = ctypes.c_int
    lib.kivi_v3_combine_launch.argtypes = [ctypes.c_longlong] * 4 + [ctypes.c_int, ctypes.c_longlong, ctypes.c_int,
                                                                       ctypes.c_int, ctypes.c_void_p]
    lib.kivi_v3_error_string.restype = ctypes.c_char_p
    lib.kivi_v3_error_string.argtypes = [ctypes.c_int]
    lib.kivi_v3_stage_bytes.restype = ctypes.c_int
    if (lib.kivi_v3_bits(), lib.kivi_v3_dk(), lib.kivi_v3_dv()) != key[:3]:
        raise RuntimeError(f"{path} was built for another configuration")
    with _LOCK:
        _LIBS[key] = lib
        BUILD_SECONDS.setdefault(key, time.time() - t0)
    return lib


# ----------------------------------------------------------------------------- launch


def _aligned(t: torch.Tensor, dense: int, align: int) -> torch.Tensor:
    """``t`` if its last ``dense`` dims are row-major dense, its other strides and its address are multiples of
    ``align`` bytes; else a contiguous copy (which satisfies all of that for the shapes ``supports`` accepts)."""
    es = t.element_size()
    expected = 1
    ok = t.data_ptr() % align == 0
    for size, stride in zip(reversed(t.shape[-dense:]), reversed(t.stride()[-dense:])):
        ok &= size == 1 or stride == expected
        expected *= size
    ok &= all((st * es) % align == 0 for st in t.stride()[:-dense])
    return t if ok else t.contiguous()


def config(bits: int) -> dict:
    """Launch configuration; ``KVCOMPRESS_KIVI_CUDA_CONFIG`` (JSON, flat or per bit width) overrides entries."""
    cfg = dict(DEFAULT_CONFIG)
    env = os.environ.get("KVCOMPRESS_KIVI_CUDA_CONFIG")
    if env:
        over = json.loads(env)
        cfg.update(over.get(str(bits), {}) if any(k in over for k in ("2", "4")) else over)
    return cfg


def num_splits(ntiles: int, rows: int, sms: int, cfg: dict) -> int:
    """Splits for ``waves`` waves of ``warps_per_sm`` resident warps, each warp taking >= ``min_tiles`` tiles."""
    nw = int(cfg["nw"])
    want = -(-int(cfg["waves"] * sms * cfg["warps_per_sm"]) // (nw * rows))
    most = max(1, ntiles // (nw * int(cfg["min_tiles"])))
    return max(1, min(want, most))


def _forward(query: torch.Tensor, packed: PackedKV, scale: float, *, cfg: dict | None = None,
             splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    why = _problem(query, packed)
    if why is not None:
        raise ValueError(f"KIVI CUDA kernel: {why}")
    bits, g = packed.bits, packed.group
    b, h, m, dk = query.shape
    per = 32 // bits
    nt = packed.k_codes.shape[2] * g
    dv = packed.v_codes.shape[-1] * per
    ngv = packed.v_scale.shape[-1]
    dev = query.device
    out = torch.empty(b, h, m, dv, device=dev, dtype=torch.float32)
    lse = torch.empty(b, h, m, device=dev, dtype=torch.float32)
    if b * h * m == 0:
        return out, lse
    if nt == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    c = dict(config(bits))
    if cfg:
        c.update(cfg)
    lib = build(bits, dk, dv, int(c.get("min_blocks", 1)))

    q = _aligned(query.to(torch.float16), 1, 4)
    kc = _aligned(packed.k_codes, 2, 16)
    ks = _aligned(packed.k_scale, 1, 16)
    kz = _aligned(packed.k_zero, 1, 16)
    vc = _aligned(packed.v_codes, 1, 16)
    vs = _aligned(packed.v_scale, 2, 16)
    vz = _aligned(packed.v_zero, 2, 16)
    valid = packed.valid.view(torch.uint8) if packed.valid.dtype == torch.bool else packed.valid.to(torch.uint8)
    valid = _aligned(valid, 1, 16)

    rows16 = m > 8
    row_blocks = -(-m // (16 if rows16 else 8))
    ntiles = nt // TILE
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    s = splits or num_splits(ntiles, b * h * row_blocks, sms, c)
    tiles_per_split = -(-ntiles // max(1, min(s, ntiles)))
    s = -(-ntiles // tiles_per_split)
    if s == 1:
        po, pl = out, lse
    else:
        po = torch.empty(s, b * h * m, dv, device=dev, dtype=torch.float32)
        pl = torch.empty(s, b * h * m, device=dev, dtype=torch.float32)
    gv = dv // ngv
    args = [q.data_ptr(), kc.data_ptr(), ks.data_ptr(), kz.data_ptr(), vc.data_ptr(), vs.data_ptr(), vz.data_ptr(),
            valid.data_ptr(), po.data_ptr(), pl.data_ptr(),
            *q.stride()[:3], *kc.stride()[:3], *ks.stride()[:3], *kz.stride()[:3], *vc.stride()[:3],
            *vs.stride()[:2], *vz.stride()[:2], valid.stride(0),
            m, h, nt, g.bit_length() - 1, tiles_per_split * TILE, s, ngv, gv, b * h]
    arr = (ctypes.c_longlong * len(args))(*args)
    stream = torch.cuda.current_stream(dev).cuda_stream
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    rc = lib.kivi_v3_launch(arr, float(scale) * LOG2E, int(rows16), int(c["nw"]), int(c["stages"]), row_blocks,
                            index, ctypes.c_void_p(stream))
    if rc:
        raise RuntimeError(f"KIVI CUDA kernel launch failed: {lib.kivi_v3_error_string(rc).decode()}")
    if s > 1:
        rc = lib.kivi_v3_combine_launch(po.data_ptr(), pl.data_ptr(), out.data_ptr(), lse.data_ptr(), s, b * h * m, dv,
                                        index, ctypes.c_void_p(stream))
        if rc:
            raise RuntimeError(f"KIVI CUDA combine launch failed: {lib.kivi_v3_error_string(rc).decode()}")
    return out, lse


def kivi_attention_partial(query: torch.Tensor, packed: PackedKV, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention over a packed KIVI region; see :func:`.reference.kivi_attention_partial`."""
    return _forward(query, packed, scale)


# ----------------------------------------------------------------------------- pure-PyTorch model of the kernel


def _deq_field(words: torch.Tensor, shift: int, bit: int, bits: int, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """LOP3 (mask | exponent) + HSUB2 + HFMA2 on int32 words holding fp16 pairs, evaluated bit-exactly up to the
    fused multiply-add (done in fp32, then rounded once, like ``fma.rn.f16x2``).  Returns fp16 ``[..., 2]``."""
    mask = (((1 << bits) - 1) << bit) * 0x10001
    expb = ((25 - bit) << 10) * 0x10001
    x = ((words.to(torch.int64) & 0xFFFFFFFF) >> shift) & mask | expb
    halves = torch.stack([x & 0xFFFF, x >> 16], dim=-1)
    halves = torch.where(halves >= 0x8000, halves - 0x10000, halves).to(torch.int16).view(torch.float16)
    e = torch.tensor(float(1 << (10 - bit)), dtype=torch.float16)
    codes = halves - e  # exact
    return (codes.float() * s.float() + z.float()).to(torch.float16)


def _pairs(x: torch.Tensor) -> torch.Tensor:
    """fp16 ``[..., 2n]`` -> ``[..., n, 2]``."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)


def emulate(query: torch.Tensor, packed: PackedKV, scale: float, *, nw: int = 2, splits: int = 2,
            rows16: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's dataflow in PyTorch (CPU): the same lane/fragment mapping, token and channel permutations,
    bit-field extraction, fp16 rounding points, online softmax per warp, warp merge and split combine.

    Fragments are built lane by lane from :func:`key_pair` / :func:`key_word_field` / :func:`score_token` /
    :func:`pv_tokens` / :func:`value_channel` and multiplied as the PTX m16n8k16 layout defines them, so a wrong
    mapping shows up as a wrong result against the reference.  Slow; for tests on small shapes.
    """
    why = _problem(query, packed)
    if why is not None:
        raise ValueError(why)
    bits, gk = packed.bits, packed.group
    b, h, m, dk = query.shape
    per = 32 // bits
    nt = packed.k_codes.shape[2] * gk
    dv = packed.v_codes.shape[-1] * per
    ngv = packed.v_scale.shape[-1]
    gv = dv // ngv
    rows16 = m > 8 if rows16 is None else rows16
    mt = 16 if rows16 else 8
    nks, ntv = dk // 16, dv // 8
    out = torch.zeros(b, h, m, dv)
    lse = torch.full((b, h, m), float("-inf"))
    ntiles = nt // TILE
    tps = -(-ntiles // splits)
    qk = float(scale) * LOG2E
    lanes = [(ln // 4, ln % 4) for ln in range(32)]
    for bi in range(b):
        for hi in range(h):
            for rb in range(-(-m // mt)):
                parts = []
                for sp in range(-(-ntiles // tps)):
                    tiles = list(range(sp * tps, min((sp + 1) * tps, ntiles)))
                    warps = []
                    for w in range(nw):
                        warps.append(_emulate_warp(query, packed, bi, hi, rb, mt, tiles[w::nw], qk, bits, dk, dv,
                                                   gv, nks, ntv, lanes))
                    # warp merge (shared memory)
                    mm = torch.stack([x[0] for x in warps])  # [nw, mt]
                    lm = torch.stack([x[1] for x in warps])
                    om = torch.stack([x[2] for x in warps])  # [nw, mt, dv]
                    top = mm.max(0).values
                    f = torch.exp2(mm - torch.where(top == float("-inf"), 0.0, top))
                    f = torch.where(mm == float("-inf"), 0.0, f)
                    den = (f * lm).sum(0)
                    o = (f[..., None] * om).sum(0) / torch.where(den > 0, den, 1.0)[:, None]
                    pl = torch.where(top == float("-inf"), float("-inf"), (top + torch.log2(den)) * 0.6931471805599453)
                    parts.append((torch.where((top == float("-inf"))[:, None], 0.0, o), pl))
                po = torch.stack([x[0] for x in parts])
                pls = torch.stack([x[1] for x in parts])
                top = pls.max(0).values
                f = torch.exp(pls - torch.where(top == float("-inf"), 0.0, top))
                den = f.sum(0)
                o = (f[..., None] * po).sum(0) / torch.where(den > 0, den, 1.0)[:, None]
                rows = min(mt, m - rb * mt)
                r0 = rb * mt
                out[bi, hi, r0:r0 + rows] = torch.where((top == float("-inf"))[:, None], 0.0, o)[:rows]
                lse[bi, hi, r0:r0 + rows] = torch.where(top == float("-inf"), float("-inf"), top + torch.log(den))[:rows]
    return out, lse


def _emulate_warp(query, packed, bi, hi, rb, mt, tiles, qk, bits, dk, dv, gv, nks, ntv, lanes):
    """One warp's loop: returns (row max [mt] (log2 units), row sum [mt], unnormalised output [mt, dv])."""
    m = query.shape[2]
    hp = 32 // bits // 2
    # A fragments of Q: A[s][row, k] built lane by lane from the pair mapping
    qrow = torch.zeros(16, dk)
    rows = min(mt, m - rb * mt)
    qrow[:rows] = query[bi, hi, rb * mt: rb * mt + rows].float()
    qrow = (qrow * qk).to(torch.float16).float()
    A = torch.zeros(nks, 16, 16)
    for g, t in lanes:
        for s in range(nks):
            for r in range(2):
                p = key_pair(dk, t, s, r)
                for row in (g, g + 8):
                    A[s, row, 2 * t + 8 * r: 2 * t + 8 * r + 2] = qrow[row, 2 * p: 2 * p + 2]
    kc = packed.k_codes[bi, hi]
    ks = _pairs(packed.k_scale[bi, hi])
    kz = _pairs(packed.k_zero[bi, hi])
    vc = packed.v_codes[bi, hi]
    vs = packed.v_scale[bi, hi]
    vz = packed.v_zero[bi, hi]
    valid = packed.valid[bi]
    m_run = torch.full((16,), float("-inf"))
    l_run = torch.zeros(16)
    acc = torch.zeros(16, dv)  # indexed by output channel
    gk = packed.group
    for tile in tiles:
        tok0 = tile * TILE
        grp, toff = divmod(tok0, gk)
        S = torch.zeros(16, TILE)  # [row, token]
        for j in range(4):
            Bm = torch.zeros(nks, 16, 8)
            for g, t in lanes:
                tok = score_token(j, g)
                for s in range(nks):
                    for r in range(2):
                        local = 2 * s + r
                        word, shift, bit = key_word_field(bits, dk, t, local)
                        p = t * (dk // 8) + local
                        assert p == key_pair(dk, t, s, r)
                        w = kc[grp, word, toff + tok]
                        pair = _deq_field(w, shift, bit, bits, ks[grp, p], kz[grp, p])
                        Bm[s, 2 * t + 8 * r: 2 * t + 8 * r + 2, g] = pair.float()
            C = sum(A[s] @ Bm[s] for s in range(nks))  # [16, 8]: column g' = token score_token(j, g')
            for col in range(8):
                S[:, score_token(j, col)] = C[:, col]
        if mt == 8:
            S[8:] = 0.0
        ok = valid[tok0: tok0 + TILE]
        S = torch.where(ok[None, :], S, float("-inf"))
        mx = S.max(1).values
        grow = mx > m_run
        if bool(grow.any()):
            mn = torch.maximum(m_run, mx)
            alpha = torch.where(mn == float("-inf"), 1.0, torch.exp2(m_run - mn))
            l_run = l_run * alpha
            acc = acc * alpha[:, None]
            m_run = mn
        ms = torch.where(m_run == float("-inf"), 0.0, m_run)
        P = torch.exp2(S - ms[:, None])
        l_run = l_run + P.sum(1)
        P16 = P.to(torch.float16).float()
        for kk in range(2):
            # A of P.V: k index -> token through the score-tile columns; B rows are the tokens the kernel loads
            Ap = torch.zeros(16, 16)
            for g, t in lanes:  # register reuse: score C fragment of tiles 2kk, 2kk+1 (columns 2t, 2t+1)
                for r in range(2):
                    Ap[:, 2 * t + 8 * r] = P16[:, score_token(2 * kk + r, 2 * t)]
                    Ap[:, 2 * t + 8 * r + 1] = P16[:, score_token(2 * kk + r, 2 * t + 1)]
            for ntile in range(ntv):
                Bv = torch.zeros(16, 8)
                for g, t in lanes:
                    ch = value_channel(bits, dv, ntile, g)
                    word, half = value_units(bits, dv, g)[ntile // hp]
                    i = ntile % hp
                    direct = 10 // bits
                    shift, bit = (0, bits * i) if i < direct else (bits * direct, bits * (i - direct))
                    grp_v = (value_units(bits, dv, g)[0][0] * (32 // bits)) // gv
                    assert ch // gv == grp_v
                    for r in range(2):
                        ta, tb = pv_tokens(t, kk, r)
                        wa = int(vc[tok0 + ta, word]) & 0xFFFFFFFF
                        wb = int(vc[tok0 + tb, word]) & 0xFFFFFFFF
                        sh = 16 * half
                        merged = ((wa >> sh) & 0xFFFF) | (((wb >> sh) & 0xFFFF) << 16)  # PRMT
                        spair = torch.stack([vs[tok0 + ta, grp_v], vs[tok0 + tb, grp_v]])
                        zpair = torch.stack([vz[tok0 + ta, grp_v], vz[tok0 + tb, grp_v]])
                        pair = _deq_field(torch.tensor(merged, dtype=torch.int64), shift, bit, bits, spair, zpair)
                        Bv[2 * t + 8 * r: 2 * t + 8 * r + 2, g] = pair.float()
                C = Ap @ Bv  # [16, 8]
                for col in range(8):
                    acc[:, value_channel(bits, dv, ntile, col)] += C[:, col]
    return m_run[:mt], l_run[:mt], acc[:mt]
