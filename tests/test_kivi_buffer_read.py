"""A static KIVI layer's full-precision buffer (sinks + recent window) read in the same launch as its quantized middle.

The registered op ``kvcompress::kivi_buffer_partial`` (``PackedKV.attention_partial_with_buffer``; the CUDA kernel's
buffer CTAs, merged with the region's splits by the kernel's own split combine): its reference against an independent
masked-attention oracle (dequantized middle and buffer concatenated); the CUDA glue and the buffer CTAs' dataflow
through the kernel's CPU emulator; ``attend_segments`` reading ``[buffer, KIVI region]`` through the op, once, and
not otherwise.  On a GPU (marker ``gpu``) the kernel against the reference at decode shapes, and a static KIVI
model's logits with the one-launch read against the two-launch read.
"""

from __future__ import annotations

import re

import pytest
import torch

from kvcompress.kernels import opcases, ops
from kvcompress.kernels.kivi import cuda_kernel as ck
from kvcompress.kernels.kivi.reference import PackedKV, quantize_keys, quantize_values
from kvcompress.state import Segment


def _cases(device="cpu", softcap=None):
    return [c for c in opcases.small_cases(device, softcap=softcap) if c.op == "kivi_buffer_partial"]


def _oracle(case):
    """Masked softmax attention over the dequantized middle and the buffer, concatenated (float64)."""
    q, kc, ks, kz, vc, vs, vz, valid, length, bk, bv, bvalid, blen = case.args
    bits = int(re.match(r"kivi(\d)", case.name).group(1))
    packed = PackedKV(bits, 32, kc, ks, kz, vc, vs, vz, valid, length=length)
    k, v = packed.dequantize()
    keep = bvalid.clone()
    if blen is not None:
        keep[:, int(blen):] = False
    keys = torch.cat([k.double(), bk.double()], 2)
    values = torch.cat([v.double(), bv.double()], 2)
    mask = torch.cat([packed.live_valid(), keep], 1)[:, None, None, :]
    s = torch.einsum("bhmd,bhtd->bhmt", q.double(), keys) * q.shape[-1] ** -0.5
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bhmt,bhtd->bhmd", p, values), lse


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c.name)
def test_reference_equals_a_masked_attention_oracle(case):
    out, lse = case.reference()
    ref_out, ref_lse = _oracle(case)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite) and finite.any()
    assert (out[~finite] == 0).all()
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], atol=1e-5, rtol=1e-5)


def _buffer(gen, b, h, slots, d, dtype, live):
    k = (torch.randn(b, h, slots, d, generator=gen) * 1.5).to(dtype)
    v = torch.randn(b, h, slots, d, generator=gen).to(dtype)
    valid = torch.rand(b, slots, generator=gen) < 0.8
    valid[0, :5] = False
    return k, v, valid, (None if live is None else torch.tensor(live))


@pytest.mark.parametrize("bits,m,d,slots,live,dtype,cap,tokens,ctas", [
    (2, 4, 128, 160, None, torch.bfloat16, None, 32, 16),   # a Llama KIVI-2 layer's ring: 5 buffer CTAs
    (2, 4, 128, 160, 150, torch.bfloat16, None, 256, 16),   # the same ring in ONE buffer CTA (buffer_tokens 256)
    (4, 12, 64, 45, 41, torch.float16, None, 32, 16),       # two row blocks, a live length inside the last CTA
    (2, 3, 64, 600, 333, torch.bfloat16, 0.9, 64, 16),      # a longer buffer (longer runs per CTA), soft-capped
    (2, 3, 64, 1024, 1001, torch.float16, None, 16, 64),    # LeanK + KIVI's buffer in 64 CTAs of 16 (buffer_ctas)
])
def test_emulated_buffer_ctas_equal_the_reference(bits, m, d, slots, live, dtype, cap, tokens, ctas):
    """The kernel's dataflow (CPU emulator: the region's warps and splits, the buffer CTAs' per-warp online softmax and
    warp merge, the split combine over both) against the reference."""
    gen = torch.Generator().manual_seed(bits * 100 + slots)
    b, h, t = 2, 2, 96
    kc, ks, kz = quantize_keys(torch.randn(b, h, t, d, generator=gen), bits, 32)
    vc, vs, vz = quantize_values(torch.randn(b, h, t, d, generator=gen), bits, 32)
    valid = torch.rand(b, t, generator=gen) < 0.9
    packed = PackedKV(bits, 32, kc, ks, kz, vc, vs, vz, valid, length=torch.tensor(70))
    buffer = _buffer(gen, b, h, slots, d, dtype, live)
    q = torch.randn(b, h, m, d, generator=gen).half()
    out, lse = ck.emulate(q, packed, d ** -0.5, buffer=buffer, softcap=cap, buffer_tokens=tokens, buffer_ctas=ctas)
    ref = ops.kivi_buffer_partial(q, kc, ks, kz, vc, vs, vz, valid, torch.tensor(70), bits, 32, d ** -0.5,
                                  *buffer, softcap=float(cap or 0.0))
    ok, err, msg = opcases.check_partial((out, lse), ref)
    assert ok, msg


def test_cuda_glue_hands_both_regions_to_one_launch(monkeypatch):
    """impl "cuda": one kernel call that gets the buffer with its length and the region with its own length (the
    kernel replaced by its emulator), equal to the reference."""
    case = _cases()[0]
    seen = []

    def fake_forward(query, packed, scale, *, base=None, softcap=None, buffer=None, **kw):
        seen.append((packed.length, buffer))
        return ck.emulate(query, packed, scale, buffer=buffer, softcap=softcap)

    monkeypatch.setattr(ck, "_forward", fake_forward)
    args = opcases.op_args(case)
    got = ops.CUDA_IMPLS["kivi_buffer_partial"](*args[:-1], "cuda")
    assert len(seen) == 1
    length, buffer = seen[0]
    assert length is args[8] and buffer[0] is args[12] and buffer[2] is args[14] and buffer[3] is args[15]
    ok, err, msg = opcases.check_partial(got, case.reference())
    assert ok, msg


def test_buffer_settings_choose_the_one_launch_read(monkeypatch):
    """The launch setting ``buffer_tokens``: slots per buffer CTA (at most 16 CTAs); 0 turns the one-launch read
    off, as does a read with more batch x head x row-block rows than ``buffer_rows`` and more rows x region slots than
    ``buffer_work``: the buffer is then read beside the region (``buffer_lanes``, the default) or, without it,
    ``attention_partial_with_buffer`` answers None and the caller reads the two regions apart."""
    assert ck.buffer_plan(160, 64) == (3, 64) and ck.buffer_plan(160, 256) == (1, 256)
    assert ck.buffer_plan(160) == (5, 32) and ck.buffer_plan(1000, 32) == (16, 63)
    # buffer_ctas: LeanK + KIVI's 1024-slot buffer in 32 CTAs of 32 (16 of 64 by default); never fewer slots than
    # buffer_tokens a CTA
    assert ck.buffer_plan(1024) == (16, 64) and ck.buffer_plan(1024, 32, 32) == (32, 32)
    assert ck.buffer_plan(1024, 32, 64) == (32, 32) and ck.buffer_plan(1000, 32, 1) == (1, 1000)
    with pytest.raises(ValueError, match="buffer_tokens"):
        ck.buffer_plan(160, 0)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=r"KVCOMPRESS_KIVI_CUDA_CONFIG: buffer_ctas must be \"auto\" or an "
                                             r"integer >= 1, "
                                             r"got " + re.escape(repr(bad))):
            ck.buffer_plan(160, 32, bad)
    for name in ("_BUFFER_SETTINGS", "_CAPPED", "_BUFFER_LANES"):  # (read_buffer_settings below writes them)
        monkeypatch.setattr(ck, name, {})

    def settings(cfg):  # the configuration, read as ops.choose reads it when a cache picks the CUDA kernel
        monkeypatch.setenv("KVCOMPRESS_KIVI_CUDA_CONFIG", cfg)
        ck.read_buffer_settings(2)

    gen = torch.Generator().manual_seed(8)
    segs = _segments("cuda", gen)
    packed, (k, v, valid) = segs[1].packed, (segs[0].k, segs[0].v, segs[0].valid)
    q = torch.randn(2, 2, 1, 64, generator=gen).half()
    calls = []
    real = ops.kivi_buffer_attention
    monkeypatch.setattr(ops, "kivi_buffer_attention", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    assert packed.attention_partial_with_buffer(q, 0.125, k, v, valid) is not None and len(calls) == 1
    k128 = 128 * 1024
    assert ck.fuses_buffer(2, 1, 8, 4, 4 * k128) and ck.fuses_buffer(2, 2, 8, 4, 4 * k128)  # 8 / 16 rows: always
    assert ck.fuses_buffer(2, 4, 8, 4, 8192) and not ck.fuses_buffer(2, 4, 8, 4, 32768)  # 32 rows x 8k / x 32k
    assert not ck.fuses_buffer(2, 16, 8, 4, 4096) and not ck.fuses_buffer(2, 4, 4, 17, 32768)  # 128 rows; 48
    settings('{"buffer_tokens": 0, "buffer_lanes": false}')
    assert packed.attention_partial_with_buffer(q, 0.125, k, v, valid) is None and len(calls) == 1
    # buffer_lanes (the default): a read the buffer CTAs do not take goes through the same op (the buffer read
    # beside the region)
    settings('{"buffer_tokens": 0}')
    assert ck.buffer_read(2, 2, 2, 1, 96, k.shape[2]) == "lanes"
    assert packed.attention_partial_with_buffer(q, 0.125, k, v, valid) is not None and len(calls) == 2
    calls.pop()
    # this read: 2 x 2 x 1 = 4 rows over 96 slots (buffer_weight 0: the buffer not counted)
    settings('{"buffer_rows": 3, "buffer_work": 383, "buffer_weight": 0, "buffer_lanes": false}')
    assert packed.attention_partial_with_buffer(q, 0.125, k, v, valid) is None and len(calls) == 1
    settings('{"buffer_rows": 3, "buffer_work": 384, "buffer_weight": 0}')
    assert packed.attention_partial_with_buffer(q, 0.125, k, v, valid) is not None and len(calls) == 2
    settings('{"buffer_rows": 4, "buffer_work": 0}')
    assert packed.attention_partial_with_buffer(q, 0.125, k, v, valid) is not None and len(calls) == 3
    # buffer_weight: each of the buffer's k.shape[2] slots counts as that many region slots in buffer_work
    t = k.shape[2]
    settings(f'{{"buffer_rows": 3, "buffer_work": {4 * (96 + 2 * t) - 1}, "buffer_weight": 2, "buffer_lanes": false}}')
    assert packed.attention_partial_with_buffer(q, 0.125, k, v, valid) is None and len(calls) == 3
    settings(f'{{"buffer_rows": 3, "buffer_work": {4 * (96 + 2 * t)}, "buffer_weight": 2}}')
    assert packed.attention_partial_with_buffer(q, 0.125, k, v, valid) is not None and len(calls) == 4
    monkeypatch.setenv("KVCOMPRESS_KIVI_CUDA_CONFIG", '{"buffer_rows": 0}')  # the environment alone changes nothing
    assert packed.attention_partial_with_buffer(q, 0.125, k, v, valid) is not None and len(calls) == 5
    for bad in ('{"buffer_rows": -1}', '{"buffer_work": 1.5}', '{"buffer_tokens": "all"}', '{"buffer_weight": -2}'):
        with pytest.raises(ValueError, match="must be an integer >= 0"):
            settings(bad)
    for bad in ('{"buffer_ctas": 0}', '{"buffer_ctas": "many"}'):  # checked when read, too
        with pytest.raises(ValueError, match="buffer_ctas must be \"auto\" or an integer >= 1, got"):
            settings(bad)
    settings('{"buffer_ctas": "auto"}')


def test_buffer_weight_sends_large_buffers_of_many_rows_apart(monkeypatch):
    """``buffer_weight`` (default 6, session 41): a read of more than ``buffer_rows`` rows counts each buffer slot as
    that many region slots against ``buffer_work``.  The benchmark layers of session 41's H100 rounds: LeanK-70 +
    KIVI-2 (3584-slot region, 1024-slot buffer) at Llama B4/4k (32 rows) and SmolLM2 B16/4k (48 rows) were faster
    apart and now are; static KIVI-2 (4128 + 160 slots) at the same rows stays in one launch, as does any read of at
    most 16 rows however long its buffer; ``{"buffer_weight": 0}`` is the rule before (buffer not counted)."""
    monkeypatch.setattr(ck, "_BUFFER_SETTINGS", {})
    monkeypatch.delenv("KVCOMPRESS_KIVI_CUDA_CONFIG", raising=False)
    assert ck.DEFAULT_CONFIG["buffer_weight"] == 6 and ck.read_buffer_settings(2)[3] == 6
    assert not ck.fuses_buffer(2, 4, 8, 1, 3584, 1024) and not ck.fuses_buffer(2, 16, 3, 1, 3584, 1024)
    assert ck.fuses_buffer(2, 4, 8, 1, 4128, 160) and ck.fuses_buffer(2, 16, 3, 1, 4128, 160)
    assert ck.fuses_buffer(2, 4, 8, 1, 3584) and ck.fuses_buffer(2, 16, 3, 1, 3584)  # no buffer slots given
    assert ck.fuses_buffer(2, 1, 8, 1, 3584, 1 << 20) and ck.fuses_buffer(2, 4, 3, 1, 32768, 1 << 20)  # <= 16 rows
    assert ck.fuses_buffer(2, 4, 8, 1, 8192 - 6 * 100, 100) and not ck.fuses_buffer(2, 4, 8, 1, 8192 - 6 * 100, 101)
    monkeypatch.setenv("KVCOMPRESS_KIVI_CUDA_CONFIG", '{"buffer_weight": 0}')
    ck.read_buffer_settings(2)
    assert ck.fuses_buffer(2, 4, 8, 1, 3584, 1024) and ck.fuses_buffer(2, 16, 3, 1, 3584, 1024)
    assert not ck.fuses_buffer(2, 4, 8, 1, 8193, 0)


def test_auto_buffer_ctas_spread_the_buffer_of_few_rows_over_more_ctas():
    """``buffer_ctas`` "auto" (the default): a launch of at most 16 rows over at most 128k rows x region slots gives
    each row 384 / rows CTAs (a power of two, 16 to 64) of at least 16 slots; any other launch, and any explicit
    count, keeps 16 CTAs (or the count given) of ``buffer_tokens`` slots."""
    assert ck.DEFAULT_CONFIG["buffer_ctas"] == "auto"
    assert ck.buffer_launch(3, 4096) == (16, 64)  # SmolLM2 heads, B1
    assert ck.buffer_launch(3, 32 * 1024) == (16, 64)  # 96k rows x slots
    assert ck.buffer_launch(8, 4096) == (16, 32) and ck.buffer_launch(12, 4096) == (16, 32)
    assert ck.buffer_launch(16, 8192) == (16, 16)  # 384 / 16 = 24 -> 16
    assert ck.buffer_launch(8, 32 * 1024) == (32, 16)  # Llama heads B1 / 32k: 256k rows x slots, the region is long
    assert ck.buffer_launch(17, 64) == (32, 16) and ck.buffer_launch(32, 4096) == (32, 16)  # many rows
    assert ck.buffer_launch(1, 64) == (16, 64)  # never more than 64
    assert ck.buffer_launch(3, 4096, 8) == (8, 64)  # fewer slots per CTA than 16 stay as asked
    assert ck.buffer_launch(3, 4096, 32, 16) == (32, 16) and ck.buffer_launch(64, 4096, 64, 8) == (64, 8)
    # what the plan then makes of a 1024-slot buffer (LeanK + KIVI) and a 128-slot one (static KIVI)
    assert ck.buffer_plan(1024, *ck.buffer_launch(3, 4096)) == (64, 16)
    assert ck.buffer_plan(1024, *ck.buffer_launch(8, 4096)) == (32, 32)
    assert ck.buffer_plan(128, *ck.buffer_launch(8, 4096)) == (8, 16)
    assert ck.buffer_plan(128, *ck.buffer_launch(32, 4096)) == (4, 32)
    for bad in (0, "many", 2.5):
        with pytest.raises(ValueError, match="buffer_ctas must be"):
            ck.buffer_launch(3, 4096, 32, bad)


def test_fused_or_apart_traces_under_torch_compile(monkeypatch):
    """``fuses_buffer`` runs inside the compiled step: with settings read from the environment it must trace with
    fullgraph and without a dynamo warning (reading the configuration there traced an lru_cache wrapper and
    ``json.loads``), and decide as it does eagerly at every shape, dynamic shapes included."""
    import warnings

    monkeypatch.setattr(ck, "_BUFFER_SETTINGS", {})
    monkeypatch.setenv("KVCOMPRESS_KIVI_CUDA_CONFIG", '{"buffer_rows": 16, "buffer_work": 262144}')
    ck.read_buffer_settings(2)

    def step(q, slots):
        return q + 1 if ck.fuses_buffer(2, *q.shape[:3], slots, q.shape[-1] * 128) else q - 1

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for shape, slots in (((1, 8, 4, 8), 4096), ((16, 8, 4, 8), 32768), ((2, 8, 4, 8), 4096),
                             ((16, 8, 4, 8), 4096), ((4, 8, 4, 8), 8192), ((4, 8, 4, 2), 4096),
                             ((4, 8, 4, 8), 4096)):
            q = torch.zeros(shape)
            want = q + 1 if ck.fuses_buffer(2, *shape[:3], slots, shape[-1] * 128) else q - 1
            assert torch.equal(compiled(q, slots), want), (shape, slots)


def _segments(impl, gen, b=2, h=2, d=64, slots=45, length=None):
    t = 96
    kc, ks, kz = quantize_keys(torch.randn(b, h, t, d, generator=gen), 2, 32)
    vc, vs, vz = quantize_values(torch.randn(b, h, t, d, generator=gen), 2, 32)
    valid = torch.rand(b, t, generator=gen) < 0.9
    valid[:, 64:] = False  # (PackedKV.length: no valid slot at or after it)
    packed = PackedKV(2, 32, kc, ks, kz, vc, vs, vz, valid, impl=impl, length=torch.tensor(64))
    zero = torch.zeros((), dtype=torch.long)
    k, v, bvalid, _ = _buffer(gen, b, h, slots, d, torch.float16, None)
    if length is not None:  # (Segment.length: no valid slot at or after it)
        bvalid[:, int(length):] = False
    return [Segment(k, v, bvalid, zero.expand(slots), length=length),
            Segment(None, None, valid, zero.expand(t), packed=packed)]


@pytest.mark.parametrize("impl,scored,fused", [("cuda", False, True), ("triton", False, False),
                                               ("cuda", True, False)])
def test_attend_segments_reads_buffer_and_region_in_one_op(monkeypatch, impl, scored, fused):
    """A decode read of [buffer, KIVI region whose implementation is the CUDA kernel] is one call of the op (no
    lanes read, no merge); a region of another implementation, or a scored read (observers need the scores), is
    read apart.  Every way equals the segment-attention oracle."""
    from kvcompress.kernels.attention.partials import attend_segments
    from kvcompress.kernels.attention.reference import segment_attention

    gen = torch.Generator().manual_seed(4)
    segs = _segments(impl, gen, length=torch.tensor(40))
    q = torch.randn(2, 8, 1, 64, generator=gen).half()
    calls = []
    real = ops._OPS["kivi_buffer_partial"]
    monkeypatch.setitem(ops._OPS, "kivi_buffer_partial", lambda *a: (calls.append(a), real(*a))[1])
    if impl != "cuda":  # the region's own read (the Triton kernel is not what this CPU test checks)
        monkeypatch.setattr(segs[1].packed, "impl", "reference")
    got = attend_segments(q, segs, None, 0.125, impls={"lanes_partial": "reference"}, scored=scored)
    got = got[0] if scored else got
    assert len(calls) == (1 if fused else 0)
    plain = [Segment(segs[0].k, segs[0].v, segs[0].valid, segs[0].positions), segs[1]]
    want = segment_attention(q, plain, torch.tensor([10**6]), 0.125)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=1e-2)


def test_buffer_problem_names_what_it_cannot_read():
    gen = torch.Generator().manual_seed(5)
    segs = _segments("cuda", gen)
    packed, (k, v, valid) = segs[1].packed, (segs[0].k, segs[0].v, segs[0].valid)
    q = torch.randn(2, 2, 4, 64, generator=gen).half()
    assert ck.buffer_problem(q, packed, k, v, valid) is None
    assert "dtypes" in ck.buffer_problem(q, packed, k.float(), v.float(), valid)
    assert "head dims" in ck.buffer_problem(q, packed, k[..., :32], v, valid)
    assert "validity" in ck.buffer_problem(q, packed, k, v, valid.int())
    assert "dense" in ck.buffer_problem(q, packed, k.transpose(2, 3).contiguous().transpose(2, 3), v, valid)
    assert not ck.supports_buffer(q, packed, k, v, valid)  # a CPU tensor: never the kernel
    assert packed.attention_partial_with_buffer(q, 0.125, k.float(), v.float(), valid) is None


def test_launch_arguments_carry_the_buffer():
    """The argument array: the region's entries, then the buffer's (pointers, strides, slots, CTAs, slots per CTA,
    bf16 flag) - what ``parse_params`` reads, in order (KIVI_PARAMS_INTS entries in all)."""
    gen = torch.Generator().manual_seed(6)
    segs = _segments("cuda", gen, slots=160)
    packed = segs[1].packed
    kv = ck._kv_tensors(packed)
    k, v, valid = segs[0].k, segs[0].v, segs[0].valid.view(torch.uint8)
    arr = list(ck._args(packed, kv, 1, (0, 0, 0), 2, 3, 4, 32, 3, buffer=(k, v, valid, None)))
    assert len(arr) == ck.PARAMS_INTS == 56
    assert arr[41:45] == [k.data_ptr(), v.data_ptr(), valid.data_ptr(), 0]
    assert arr[45:52] == [*k.stride()[:3], *v.stride()[:3], valid.stride(0)]
    assert arr[52:] == [160, 5, 32, 0] and ck.buffer_plan(160) == (5, 32) and ck.buffer_plan(1000) == (16, 63)
    assert list(ck._args(packed, kv, 1, (0, 0, 0), 2, 3, 4, 32, 3))[41:] == [0] * 15


# ----------------------------------------------------------------------------- GPU


def _gpu():
    return pytest.mark.skipif(not (torch.cuda.is_available() and ck.nvcc_path()), reason="needs a CUDA GPU and nvcc")


@pytest.mark.gpu
@_gpu()
@pytest.mark.parametrize("pdl", [True, False])
def test_buffer_read_beside_the_region_like_the_reference(monkeypatch, pdl):
    """``buffer_lanes``: a static KIVI read too large for the buffer CTAs (Llama heads B16 / 4k: 128 rows) takes its
    buffer through the Triton lanes kernel beside the KIVI launch (with PDL: concurrently), into the same split
    combine - against the reference, eagerly and replayed from a CUDA graph."""
    for name in ("_BUFFER_SETTINGS", "_CAPPED", "_BUFFER_LANES"):
        monkeypatch.setattr(ck, name, dict(getattr(ck, name)))
    monkeypatch.setenv("KVCOMPRESS_KIVI_CUDA_CONFIG", f'{{"buffer_lanes": true, "pdl": {str(pdl).lower()}}}')
    ck.read_buffer_settings(2)
    b, h, m, d, t, slots = 16, 8, 4, 128, 4096, 160
    assert ck.buffer_read(2, b, h, m, t, slots) == "lanes"
    gen = torch.Generator(device="cuda").manual_seed(3)
    kc, ks, kz = quantize_keys(torch.randn(b, h, t, d, generator=gen, device="cuda"), 2, 32)
    vc, vs, vz = quantize_values(torch.randn(b, h, t, d, generator=gen, device="cuda"), 2, 32)
    valid = torch.rand(b, t, generator=gen, device="cuda") < 0.9
    valid[-1] = False
    bk = (torch.randn(b, h, slots, d, generator=gen, device="cuda") * 1.5).half()
    bv = torch.randn(b, h, slots, d, generator=gen, device="cuda").half()
    bvalid = torch.rand(b, slots, generator=gen, device="cuda") < 0.85
    length, blen = torch.tensor(4001, device="cuda"), torch.tensor(150, device="cuda")
    q = torch.randn(b, h, m, d, generator=gen, device="cuda").half()
    packed = PackedKV(2, 32, kc, ks, kz, vc, vs, vz, valid, impl="cuda", length=length)
    got = packed.attention_partial_with_buffer(q, d ** -0.5, bk, bv, bvalid, blen)
    assert got is not None
    ref = ops.kivi_buffer_partial(q.cpu(), kc.cpu(), ks.cpu(), kz.cpu(), vc.cpu(), vs.cpu(), vz.cpu(), valid.cpu(),
                                  length.cpu(), 2, 32, d ** -0.5, bk.cpu(), bv.cpu(), bvalid.cpu(), blen.cpu())
    ok, err, msg = opcases.check_partial(tuple(x.cpu() for x in got), ref)
    assert ok, msg
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        packed.attention_partial_with_buffer(q, d ** -0.5, bk, bv, bvalid, blen)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        held = packed.attention_partial_with_buffer(q, d ** -0.5, bk, bv, bvalid, blen)
    for _ in range(3):
        held[0].zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(held[0], got[0]) and torch.equal(held[1], got[1])


@pytest.mark.gpu
@_gpu()
@pytest.mark.parametrize("b,h,m,d,bits,t,live,slots,blive,dtype", [
    (1, 8, 4, 128, 2, 4096, 4001, 160, None, torch.bfloat16),   # Llama KIVI-2 B1/4k: the ring of 128 + 32
    (4, 8, 4, 128, 4, 1024, 777, 288, 250, torch.float16),     # sinks + ring, a live length
    (2, 3, 3, 64, 2, 2048, 2048, 160, 97, torch.bfloat16),     # SmolLM2 heads
    (2, 2, 12, 128, 2, 512, 300, 45, None, torch.float16),     # two row blocks, one partial buffer CTA
])
def test_kernel_reads_buffer_and_region_like_the_reference(b, h, m, d, bits, t, live, slots, blive, dtype):
    gen = torch.Generator(device="cuda").manual_seed(slots + t)
    k = torch.randn(b, h, t, d, generator=gen, device="cuda")
    v = torch.randn(b, h, t, d, generator=gen, device="cuda")
    kc, ks, kz = quantize_keys(k, bits, 32)
    vc, vs, vz = quantize_values(v, bits, 32)
    valid = torch.rand(b, t, generator=gen, device="cuda") < 0.9
    if b > 1:
        valid[-1] = False
    bk = (torch.randn(b, h, slots, d, generator=gen, device="cuda") * 1.5).to(dtype)
    bv = torch.randn(b, h, slots, d, generator=gen, device="cuda").to(dtype)
    bvalid = torch.rand(b, slots, generator=gen, device="cuda") < 0.85
    bvalid[0, :3] = False
    length = torch.tensor(live, device="cuda")
    blen = None if blive is None else torch.tensor(blive, device="cuda")
    q = torch.randn(b, h, m, d, generator=gen, device="cuda").to(dtype)
    packed = PackedKV(bits, 32, kc, ks, kz, vc, vs, vz, valid, impl="cuda", length=length)
    got = packed.attention_partial_with_buffer(q, d ** -0.5, bk, bv, bvalid, blen)
    assert got is not None
    ref = ops.kivi_buffer_partial(q.cpu(), kc.cpu(), ks.cpu(), kz.cpu(), vc.cpu(), vs.cpu(), vz.cpu(), valid.cpu(),
                                  length.cpu(), bits, 32, d ** -0.5, bk.cpu(), bv.cpu(), bvalid.cpu(),
                                  None if blen is None else blen.cpu())
    ok, err, msg = opcases.check_partial(tuple(x.cpu() for x in got), ref)
    assert ok, msg
    # the read's own dtype stored by the split combine: the float32 result rounded once, the same LSE
    low = packed.attention_partial_with_buffer(q, d ** -0.5, bk, bv, bvalid, blen, out_dtype=dtype)
    assert low[0].dtype == dtype and torch.equal(low[0], got[0].to(dtype)) and torch.equal(low[1], got[1])


@pytest.mark.gpu
@_gpu()
def test_static_kivi_model_decodes_the_same_with_the_one_launch_read(monkeypatch):
    """A static KIVI-2 cache on a head-dim-128 model: the logits of 40 decode steps with the one-launch read equal
    those with the buffer and the region read apart (the same kernels otherwise)."""
    import transformers

    import kvcompress
    from kvcompress.kernels.attention import partials

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=1, head_dim=128,
                                   max_position_embeddings=1024)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).cuda().to(torch.bfloat16).eval()
    stack = kvcompress.parse_stack({"compressors": [{"kivi": {"bits": 2, "group": 32, "residual": 64}}]})
    ids = torch.randint(1, 256, (2, 340), generator=torch.Generator().manual_seed(1)).cuda()
    pos = torch.arange(340, device="cuda").expand(2, -1)

    def run():
        logits = []
        with kvcompress.compress(model, stack, max_cache_len=340) as cache, torch.no_grad():
            model(ids[:, :300], position_ids=pos[:, :300], past_key_values=cache)
            for i in range(300, 340):
                out = model(input_ids=ids[:, i:i + 1], position_ids=pos[:, i:i + 1], past_key_values=cache)
                logits.append(out.logits[:, -1].float())
        return torch.stack(logits)

    calls = []
    real = ops._OPS["kivi_buffer_partial"]
    monkeypatch.setitem(ops._OPS, "kivi_buffer_partial", lambda *a: (calls.append(1), real(*a))[1])
    together = run()
    assert len(calls) == 2 * 40  # every decode step of both layers read its two regions in one launch
    monkeypatch.setattr(partials, "_buffer_with_region", lambda *a: None)
    apart = run()
    torch.testing.assert_close(together, apart, atol=2e-2, rtol=0)
