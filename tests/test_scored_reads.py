"""Scored reads: the attention kernels return the scores they computed, and the attention mass observers receive at
decode comes from them (no second pass over the keys).

* The ``*_scored`` references (``kvcompress::lanes_partial_scored``, ``kivi_partial_scored``,
  ``kivi_lanes_partial_scored``) against independent float64 score oracles (the query gathered to each lane's kept
  channels, times the keys - dequantized for KIVI -, scaled, soft-capped, masked by validity and ``length``), and their
  ``(out, lse)`` against the unscored ops'; the registered ops under ``torch.library.opcheck``.
* The Triton kernels with their ``logits`` output (dense lanes in fp16 and fp32, KIVI-2/4, KIVI lanes), on CPU tensors
  under the Triton interpreter (``tests/interpreter.py``), against those references - odd live lengths, masked slots,
  a dead row, left padding, several token splits, soft-capping, slots after ``length`` left untouched - and through
  the ops' CUDA glue (``ops.CUDA_IMPLS``) with ``impl="triton"``.
* End to end: in decode steps of dynamic and static caches, an observer's mass comes from the read
  (:func:`kvcompress.observe.attention_mass`, the reference pass, runs for prefills only), and equals the eager
  oracles of tests/test_observe.py (which run the same stacks).
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

from interpreter import collect
from interpreter import interpreted as run_interpreted

NEG = float("-inf")


# ----------------------------------------------------------------------------- inputs and oracles


def lanes_inputs(dtype=torch.float16, live=52, softcap=None, seed=2, capacity=77, kv_heads=4, rows=3, rank=None):
    """``(query, lanes, scale, length)`` of :func:`kvcompress.kernels.opcases.lanes_case` (one lane per kept count,
    a dense lane of 23 slots, masked slots, a dead row; ``rank``: a low-rank lane too)."""
    from kvcompress.kernels.opcases import lanes_case, lanes_of

    case = lanes_case(dtype=dtype, live=live, softcap=softcap, seed=seed, capacity=capacity, kv_heads=kv_heads,
                      rows=rows, rank=rank)
    q, rest = case.args[0], case.args[1:]
    parts, length = rest[:-1], rest[-1]
    lanes = lanes_of(parts)
    return q, lanes, q.shape[-1] ** -0.5, length


def lanes_oracle(q, lanes, scale, length, softcap=None):
    """float64 scores per lane ``[B, h, M, T]``: the lane's heads and kept channels of the query times its keys (a
    low-rank lane: the query times its coordinates mapped back to the head dimension, ``c U^T``)."""
    out = []
    for heads, channels, k, v, valid, basis in lanes:
        qs = q.double() if heads is None else q.double().index_select(1, heads)
        if channels is not None:
            qs = torch.stack([qs[:, i][..., channels[i]] for i in range(channels.shape[0])], 1)
        if basis is not None:
            k = torch.einsum("bhtr,hdr->bhtd", k.double(), basis.double())
        s = torch.einsum("bhmc,bhtc->bhmt", qs, k.double()) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        t = k.shape[2]
        ok = torch.ones(k.shape[0], t, dtype=torch.bool) if valid is None else valid.clone()
        if length is not None:
            ok[:, int(length):] = False
        out.append(s.masked_fill(~ok[:, None, None, :], NEG))
    return out


def kivi_inputs(bits=2, group=32, live=71, softcap=None, seed=0, capacity=96, kv_heads=2, rows=3, head_dim=64):
    from kvcompress.kernels.kivi.reference import PackedKV
    from kvcompress.kernels.opcases import kivi_case

    case = kivi_case(bits=bits, group=group, live=live, softcap=softcap, seed=seed, capacity=capacity,
                     kv_heads=kv_heads, rows=rows, head_dim=head_dim)
    q, kc, ks, kz, vc, vs, vz, valid, length = case.args
    return q, PackedKV(bits, group, kc, ks, kz, vc, vs, vz, valid, length=length), head_dim ** -0.5


def kivi_oracle(q, packed, scale, softcap=None):
    from kvcompress.kernels.kivi.reference import dequantize_keys

    k = dequantize_keys(packed.k_codes, packed.k_scale, packed.k_zero, packed.bits).double()
    s = torch.einsum("bhmd,bhtd->bhmt", q.double(), k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    ok = packed.valid.clone()
    if packed.length is not None:
        ok[:, int(packed.length):] = False
    return s.masked_fill(~ok[:, None, None, :], NEG)


def kivi_lanes_oracle(q, region, scale, softcap=None):
    from kvcompress.kernels.kivi.reference import dequantize_keys

    ok = region.valid.clone()
    if region.length is not None:
        ok[:, int(region.length):] = False
    out = []
    for lane in region.lanes:
        k = dequantize_keys(lane.k_codes, lane.k_scale, lane.k_zero, region.bits).double()
        qs = q.double() if lane.heads is None else q.double().index_select(1, lane.heads)
        if lane.channels is not None:
            qs = torch.stack([qs[:, i][..., lane.channels[i]] for i in range(lane.channels.shape[0])], 1)
        s = torch.einsum("bhmc,bhtc->bhmt", qs, k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        out.append(s.masked_fill(~ok[:, None, None, :], NEG))
    return out


def same_scores(got, ref, atol=1e-5, rtol=1e-5) -> str:
    """'' when the scores match (``-inf`` exactly where the reference has it), else what differs."""
    got, ref = got.double(), ref.double()
    if got.shape != ref.shape:
        return f"shape {tuple(got.shape)} != {tuple(ref.shape)}"
    if torch.isnan(got).any():
        return "NaN"
    inf = torch.isinf(ref)
    if not torch.equal(torch.isinf(got), inf):
        return f"-inf at {int((torch.isinf(got) != inf).sum())} other slots"
    if inf.all():
        return ""
    err = (got[~inf] - ref[~inf]).abs()
    if not bool((err <= atol + rtol * ref[~inf].abs()).all()):
        return f"max |score - ref| {err.max().item():.2e}"
    return ""


def same_partial(got, ref, atol=1e-5) -> str:
    for name, a, b in (("out", got[0], ref[0]), ("lse", got[1], ref[1])):
        fin = torch.isfinite(b)
        if not torch.equal(torch.isfinite(a), fin):
            return f"{name}: -inf rows differ"
        if fin.any() and (a[fin] - b[fin]).abs().max().item() > atol:
            return f"{name}: max diff {(a[fin] - b[fin]).abs().max().item():.2e}"
    return ""


# ----------------------------------------------------------------------------- references (CPU)


@pytest.mark.parametrize("rank", [None, 16], ids=["channels", "lowrank"])
@pytest.mark.parametrize("softcap", [None, 0.7], ids=["plain", "softcap"])
@pytest.mark.parametrize("live", [52, None], ids=["live52", "full"])
def test_lanes_scored_reference(live, softcap, rank):
    from kvcompress.kernels.leank import reference as ref

    q, lanes, scale, length = lanes_inputs(dtype=torch.float32, live=live, softcap=softcap, rank=rank)
    out, lse, logits = ref.grouped_partial_scored(q, lanes, scale, length=length, softcap=softcap)
    assert same_partial((out, lse), ref.grouped_partial_attention(q, lanes, scale, length=length,
                                                                  softcap=softcap)) == ""
    oracle = lanes_oracle(q, lanes, scale, length, softcap)
    assert len(logits) == len(oracle)
    for got, want in zip(logits, oracle):
        assert same_scores(got, want) == ""
    # the lanes' scores are what the partial normalised: logsumexp over a head's lanes is its lse
    b, hkv, m, _ = q.shape
    joint = torch.full((b, hkv, m), NEG, dtype=torch.float64)
    for (heads, *_), s in zip(lanes, logits):
        part = torch.logsumexp(s.double(), -1)
        if heads is None:
            joint = torch.logaddexp(joint, part)
        else:
            joint[:, heads] = torch.logaddexp(joint[:, heads], part)
    fin = torch.isfinite(lse)
    assert torch.equal(torch.isfinite(joint), fin)
    assert (joint[fin] - lse[fin].double()).abs().max() < 1e-5


@pytest.mark.parametrize("bits,group", [(2, 32), (4, 16)])
def test_kivi_scored_reference(bits, group):
    from kvcompress.kernels.kivi import reference as ref

    q, packed, scale = kivi_inputs(bits=bits, group=group)
    q = q.float()
    out, lse, logits = ref.kivi_attention_scored(q, packed, scale)
    assert same_partial((out, lse), ref.kivi_attention_partial(q, packed, scale)) == ""
    assert same_scores(logits, kivi_oracle(q, packed, scale)) == ""
    assert int(packed.length) < packed.valid.shape[-1] and torch.isinf(logits[..., int(packed.length):]).all()


def test_kivi_lanes_scored_reference():
    from kvcompress.kernels.kivi import lanes_reference as ref
    from test_kivi_lanes import make_region

    q, region = make_region(tokens=64, live=61)
    q = q.float()
    scale = q.shape[-1] ** -0.5
    out, lse, logits = ref.kivi_lanes_attention_scored(q, region, scale, softcap=0.9)
    assert same_partial((out, lse), ref.kivi_lanes_attention_partial(q, region, scale, softcap=0.9)) == ""
    for got, want in zip(logits, kivi_lanes_oracle(q, region, scale, softcap=0.9), strict=True):
        assert same_scores(got, want) == ""
    # the region's [B, H, M, T] form: each head from its lane, -inf on heads no lane covers
    _, _, full = region.attention_scored(q, scale, softcap=0.9)
    covered = torch.zeros(region.num_heads, dtype=torch.bool)
    for lane, s in zip(region.lanes, logits):
        assert same_scores(full.index_select(1, lane.heads), s) == ""
        covered[lane.heads] = True
    assert not covered.all() and torch.isinf(full[:, ~covered]).all()


def test_scored_ops_opcheck():
    """The registered scored ops: schema, fake implementations, no hidden mutation (torch.library.opcheck)."""
    from kvcompress.kernels import ops
    from test_kivi_lanes import make_region

    q, lanes, scale, length = lanes_inputs()
    ln = [tuple(x) for x in lanes]
    torch.library.opcheck(ops._OPS["lanes_partial_scored"],
                          (q, [x[0] for x in ln], [x[1] for x in ln], [x[2] for x in ln], [x[3] for x in ln],
                           [x[4] for x in ln], [x[5] for x in ln], length, scale, 0.0, "reference"))
    qk, p, sk = kivi_inputs()
    torch.library.opcheck(ops._OPS["kivi_partial_scored"],
                          (qk, p.k_codes, p.k_scale, p.k_zero, p.v_codes, p.v_scale, p.v_zero, p.valid, p.length,
                           p.bits, p.group, sk, False, 0.0, "reference"))
    qr, region = make_region(tokens=32, live=29)
    L = region.lanes
    torch.library.opcheck(ops._OPS["kivi_lanes_partial_scored"],
                          (qr, [x.heads for x in L], [x.channels for x in L], [x.k_codes for x in L],
                           [x.k_scale for x in L], [x.k_zero for x in L], [x.v_codes for x in L],
                           [x.v_scale for x in L], [x.v_zero for x in L], region.valid, region.length, region.bits,
                           region.group, qr.shape[-1] ** -0.5, 0.0, "reference"))
    # the flat output splits into the per-lane scores of the reference
    out, lse, logits = ops.lanes_attention_scored(q, lanes, scale, impl="reference", length=length)
    for got, want in zip(logits, lanes_oracle(q, lanes, scale, length), strict=True):
        assert same_scores(got, want, atol=2e-2, rtol=2e-2) == ""  # fp16 inputs, float32 products


# ----------------------------------------------------------------------------- Triton kernels (interpreter)


def _fill(shapes):
    return [torch.full(s, NEG, dtype=torch.float32) for s in shapes]


def _interpreter_cases() -> dict:
    from kvcompress.kernels import ops
    from kvcompress.kernels.kivi import lanes_reference, lanes_triton
    from kvcompress.kernels.kivi import reference as kivi_ref
    from kvcompress.kernels.kivi import triton_kernel as kivi_triton
    from kvcompress.kernels.leank import reference as leank_ref
    from kvcompress.kernels.leank import triton_kernel as leank_triton
    from test_kivi_lanes import make_region

    def lanes(dtype, live, softcap, splits, rank=None):
        def go():
            q, ln, scale, length = lanes_inputs(dtype=dtype, live=live, softcap=softcap, rank=rank)
            out, lse, ref = leank_ref.grouped_partial_scored(q, ln, scale, length=length, softcap=softcap)
            logits = _fill([(q.shape[0], lane[2].shape[1], q.shape[2], lane[2].shape[2]) for lane in ln])
            got = leank_triton.grouped_partial_attention(q, ln, scale, length=length, softcap=softcap,
                                                         splits=splits, logits=logits)
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            res = {"partial": same_partial(got, (out, lse), atol=tol if dtype == torch.float32 else 3e-3)}
            for i, (g, r) in enumerate(zip(logits, ref)):
                res[f"lane{i}"] = same_scores(g, r, atol=tol, rtol=tol)
            plain = leank_triton.grouped_partial_attention(q, ln, scale, length=length, softcap=softcap,
                                                           splits=splits)
            res["same_partial_as_unscored"] = same_partial(got, plain, atol=0)
            return res
        return go

    def kivi(bits, group, config, softcap):
        def go():
            q, packed, scale = kivi_inputs(bits=bits, group=group, softcap=softcap, head_dim=64 if bits == 2 else 128)
            out, lse, ref = kivi_ref.kivi_attention_scored(q, packed, scale, softcap=softcap)
            b, h, m, _ = q.shape
            logits = torch.full((b, h, m, packed.valid.shape[-1]), NEG)
            got = kivi_triton._forward(q, packed, scale, splits=3, config=config, softcap=softcap, logits=logits)
            return {"partial": same_partial(got, (out, lse), atol=5e-3), "scores": same_scores(logits, ref, 1e-2, 1e-2),
                    "after_length": "" if torch.isinf(logits[..., int(packed.length):]).all() else "written"}
        return go

    def kivi_lanes(config):
        def go():
            q, region = make_region(tokens=64, live=61)
            scale = q.shape[-1] ** -0.5
            out, lse, ref = lanes_reference.kivi_lanes_attention_scored(q, region, scale)
            b, h, m, _ = q.shape
            logits = _fill([(b, lane.heads.shape[0], m, 64) for lane in region.lanes])
            got = lanes_triton.kivi_lanes_attention_partial(q, region, scale, splits=2, config=config,
                                                            logits=logits)
            res = {"partial": same_partial(got, (out, lse), atol=5e-3)}
            for i, (g, r) in enumerate(zip(logits, ref)):
                res[f"lane{i}"] = same_scores(g, r, 1e-2, 1e-2)
            return res
        return go

    def glue():
        """The scored ops' CUDA implementations (what a CUDA layer runs) on CPU tensors with ``impl="triton"``."""
        res = {}
        q, ln, scale, length = lanes_inputs(live=40)
        heads, channels, k, v, valid, bases = (list(x) for x in zip(*ln))
        o, l, flat = ops.CUDA_IMPLS["lanes_partial_scored"](q, heads, channels, k, v, valid, bases, length, scale,
                                                              0.0, "triton")
        ro, rl, rflat = ops.lanes_partial_scored(q, heads, channels, k, v, valid, bases, length, scale, 0.0,
                                                 "reference")
        res["lanes"] = same_partial((o, l), (ro, rl), atol=3e-3) or same_scores(flat, rflat, 1e-2, 1e-2)
        qk, p, sk = kivi_inputs()
        args = (qk, p.k_codes, p.k_scale, p.k_zero, p.v_codes, p.v_scale, p.v_zero, p.valid, p.length, p.bits,
                p.group, sk, False, 0.0)
        o, l, s = ops.CUDA_IMPLS["kivi_partial_scored"](*args, "triton")
        ro, rl, rs = ops.kivi_partial_scored(*args, "reference")
        res["kivi"] = same_partial((o, l), (ro, rl), atol=5e-3) or same_scores(s, rs, 1e-2, 1e-2)
        qr, region = make_region(tokens=32, live=29)
        L = region.lanes
        args = (qr, [x.heads for x in L], [x.channels for x in L], [x.k_codes for x in L], [x.k_scale for x in L],
                [x.k_zero for x in L], [x.v_codes for x in L], [x.v_scale for x in L], [x.v_zero for x in L],
                region.valid, region.length, region.bits, region.group, qr.shape[-1] ** -0.5, 0.0)
        o, l, s = ops.CUDA_IMPLS["kivi_lanes_partial_scored"](*args, "triton")
        ro, rl, rs = ops.kivi_lanes_partial_scored(*args, "reference")
        res["kivi_lanes"] = same_partial((o, l), (ro, rl), atol=5e-3) or same_scores(s, rs, 1e-2, 1e-2)
        return res

    def fused_read(softcap):
        """attend_segments(fused=True, scored=True): the dense and LeanK-lane segments in one Triton lanes launch
        with scores, the packed ones by their readers; masses against the reference pass."""
        from kvcompress.kernels.attention import attend_segments
        from kvcompress.observe import attention_mass

        def go():
            q, segs, pos = rich_segments()
            scale = q.shape[-1] ** -0.5
            out, masses = attend_segments(q, segs, pos, scale, fused=True, softcap=softcap, scored=True)
            plain = attend_segments(q, segs, pos, scale, fused=False, softcap=softcap)
            res = {"out": "" if (out - plain).abs().max() < 1e-5 else f"out {(out - plain).abs().max():.2e}"}
            for i, (got, want) in enumerate(zip(masses, attention_mass(q, segs, pos, scale, 4, softcap))):
                err = (got - want).abs().max().item()
                res[f"segment{i}"] = "" if err < 1e-5 else f"max |mass - ref| {err:.2e}"
            return res
        return go

    return {
        "attend-fused": fused_read(None),
        "attend-fused-softcap": fused_read(0.9),
        "lanes-fp32-live52-splits3": lanes(torch.float32, 52, None, 3),
        "lanes-fp16-full-softcap-splits2": lanes(torch.float16, None, 0.8, 2),
        "lanes-fp16-live40-splits1": lanes(torch.float16, 40, None, 1),
        "lanes-fp16-lowrank-live52-splits2": lanes(torch.float16, 52, None, 2, rank=16),
        "lanes-fp32-lowrank-softcap-splits3": lanes(torch.float32, None, 0.8, 3, rank=16),
        "kivi2-g32": kivi(2, 32, None, None),
        "kivi4-g16-notrans-softcap": kivi(4, 16, {"TRANS": False}, 1.1),
        "kivi-lanes-trans": kivi_lanes(None),
        "kivi-lanes-notrans": kivi_lanes({"TRANS": False}),
        "glue": glue,
    }


INTERPRETER_CASES = ["attend-fused", "attend-fused-softcap", "lanes-fp32-live52-splits3", "lanes-fp16-full-softcap-splits2",
                     "lanes-fp16-live40-splits1", "lanes-fp16-lowrank-live52-splits2",
                     "lanes-fp32-lowrank-softcap-splits3", "kivi2-g32", "kivi4-g16-notrans-softcap", "kivi-lanes-trans", "kivi-lanes-notrans", "glue"]


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    pytest.importorskip("triton")
    return run_interpreted(__file__, tmp_path_factory.mktemp("scored"), OMP_NUM_THREADS="1")


@pytest.mark.parametrize("name", INTERPRETER_CASES)
def test_triton_scores_under_interpreter(interpreted, name):
    res = interpreted[name]
    assert "error" not in res, res.get("error")
    for key, msg in res.items():
        assert msg == "", f"{name} {key}: {msg}"


# ----------------------------------------------------------------------------- end to end: decode mass from the read


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("quantized", [False, True], ids=["dense", "kivi"])
def test_decode_mass_comes_from_the_read(monkeypatch, static, quantized):
    """The reference mass pass runs once per layer for the prefill and never in a decode step, and the observers'
    mass sums to 1 per query head over every region (the read's scores normalised by the joint LSE)."""
    import kvcompress.observe as observe
    from test_observe import Observer, _registry  # the recording observer (attention=True) of tests/test_observe.py

    from kvcompress.stack import parse_stack
    from models import tiny_model

    calls = []
    real = observe.attention_mass

    def counting(*args, **kwargs):
        calls.append(args[0].shape[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(observe, "attention_mass", counting)
    model = tiny_model("llama")
    ids = torch.randint(1, 256, (2, 50), generator=torch.Generator().manual_seed(3))
    entries = [{"observer": {"sinks": 2, "recent": 16, "flush": 16}}]
    if quantized:
        entries.append({"kivi": {"bits": 2, "group": 16, "residual": 16}})
    stack = parse_stack({"compressors": entries}, registry=_registry())
    import kvcompress

    kw = {"max_cache_len": 56} if static else {}
    with kvcompress.compress(model, stack, **kw) as cache, torch.no_grad():
        model(ids[:, :30], cache=cache)
        for t in range(30, 50):
            model(ids[:, t:t + 1], cache=cache)
    records = cache.pipeline.compressors[0][1].seen
    layers = sorted({i for i, _ in records})
    assert len(calls) == len(layers)  # the prefills only
    hq = model.config.num_attention_heads
    group = hq // model.config.num_key_value_heads
    decode = [r for _, r in records if r["obs"].query.shape[2] == 1 and r["obs"].keys.shape[2] == 1]
    assert len(decode) == 20 * len(layers)
    for rec in decode:
        total = sum(m.sum(-1) for m in rec["mass"].values())  # [b, kv]: the group's query heads, 1 each
        assert torch.allclose(total, torch.full_like(total, float(group)), atol=1e-5)
    assert any(r["mass"]["middle"].sum() > 0 for r in decode)
    assert math.isfinite(float(sum(r["mass"]["middle"].sum() for r in decode)))


def rich_segments(dtype=torch.float32, seed=7):
    """``(query [B, Hq, 1, D], segments, q_positions)``: every kind of segment a decode read meets - a dense buffer
    with a live length and masked slots, LeanK lanes (a head subset with kept channels, per lane), a per-head
    validity (AdaKV), a KIVI-2 region, KIVI lanes over a head subset, the step's own token."""
    from kvcompress.kernels.kivi.lanes_reference import KiviLane, PackedLanes
    from kvcompress.kernels.kivi.reference import PackedKV, quantize_keys, quantize_values
    from kvcompress.state import HeadGroup, Segment

    g = torch.Generator().manual_seed(seed)
    b, hkv, group, d = 2, 4, 2, 32
    t0 = torch.zeros((), dtype=torch.long)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    def valid(*shape, p=0.85):
        return torch.rand(*shape, generator=g) < p

    segs = []
    va = valid(b, 19)
    va[:, 15:] = False  # nothing valid at or after a segment's length (the contract of Segment.length)
    segs.append(Segment(rnd(b, hkv, 19, d), rnd(b, hkv, 19, d), va, t0.expand(19), length=torch.tensor(15)))
    for heads, kept in (([1, 3], 12), ([0], 20)):  # LeanK lanes: head subsets, kept channels
        ch = torch.stack([torch.randperm(d, generator=g)[:kept].sort().values for _ in heads])
        grp = HeadGroup(torch.tensor(heads), None, None, channels=ch)
        segs.append(grp.attach(Segment(rnd(b, len(heads), 23, kept), rnd(b, len(heads), 23, d), valid(b, 23),
                                       t0.expand(23))))
    segs.append(Segment(rnd(b, hkv, 11, d), rnd(b, hkv, 11, d), valid(b, hkv, 11), t0.expand(11)))  # per head
    kq = quantize_keys(torch.randn(b, hkv, 32, d, generator=g), 2, 16)
    vq = quantize_values(torch.randn(b, hkv, 32, d, generator=g), 2, 16)
    kv_valid = valid(b, 32)
    kv_valid[:, 29:] = False
    segs.append(Segment(None, None, kv_valid, t0.expand(32),
                        packed=PackedKV(2, 16, *kq, *vq, kv_valid, length=torch.tensor(29))))
    lanes = []
    for heads, kept in (([0, 2], 8), ([1, 3], 16)):  # every head in one lane (a store masks heads it lacks)
        ch = torch.stack([torch.randperm(d, generator=g)[:kept].sort().values for _ in heads])
        lanes.append(KiviLane(torch.tensor(heads), ch,
                              *quantize_keys(torch.randn(b, len(heads), 32, kept, generator=g), 2, 16),
                              *quantize_values(torch.randn(b, len(heads), 32, d, generator=g), 2, 16)))
    lv = valid(b, 32)
    segs.append(Segment(None, None, lv, t0.expand(32), packed=PackedLanes(2, 16, tuple(lanes), lv, hkv, d)))
    segs.append(Segment(rnd(b, hkv, 1, d), rnd(b, hkv, 1, d), None, torch.tensor([200])))  # the step's token
    return rnd(b, hkv * group, 1, d), segs, torch.tensor([200])


@pytest.mark.parametrize("variant", ["plain", "softcap", "sinks"])
def test_scored_read_mass_equals_reference_pass(variant):
    """attend_segments(scored=True) over every kind of segment (reference readers, CPU): the same output as the
    unscored read, and per segment the mass of the reference pass (kvcompress.observe.attention_mass, which
    tests/test_observe.py checks against eager oracles)."""
    from kvcompress.kernels.attention import attend_segments
    from kvcompress.observe import attention_mass

    q, segs, pos = rich_segments()
    softcap = 0.9 if variant == "softcap" else None
    sinks = torch.randn(q.shape[1], generator=torch.Generator().manual_seed(1)) if variant == "sinks" else None
    scale = q.shape[-1] ** -0.5
    out, masses = attend_segments(q, segs, pos, scale, softcap=softcap, sink_logits=sinks, scored=True)
    plain = attend_segments(q, segs, pos, scale, softcap=softcap, sink_logits=sinks)
    assert (out - plain).abs().max() < 1e-6
    ref = attention_mass(q, segs, pos, scale, 4, softcap, sinks)
    assert len(masses) == len(ref) == len(segs)
    for i, (got, want) in enumerate(zip(masses, ref)):
        assert got.shape == want.shape, i
        assert (got - want).abs().max() < 1e-5, i
    total = sum(m.sum(-1) for m in masses)  # the group's 2 query heads, less the sinks' share
    assert (total <= 2 + 1e-5).all() and (variant == "sinks" or torch.allclose(total, torch.full_like(total, 2.0)))


def test_layout_attention_phases():
    from kvcompress import Layout

    both = Layout.combine([Layout(attention="prefill"), Layout(attention="decode")])
    assert both.attention is True and both.attention_at("prefill") and both.attention_at("decode")
    pre = Layout.combine([Layout(attention="prefill"), Layout(sinks=4)])
    assert pre.attention == "prefill" and pre.attention_at("prefill") and not pre.attention_at("decode")
    assert Layout.combine([Layout(attention=True), Layout(attention="decode")]).attention is True
    assert Layout.combine([Layout(), None]).attention is None
    with pytest.raises(ValueError, match="Layout.attention"):
        Layout.combine([Layout(attention="always")])


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_scored_reads_only_where_the_mass_is_read(monkeypatch, static):
    """TOVA reads the mass in decode steps: its decode reads are scored.  SnapKV with ``phase: prefill`` reads it only
    in the prefill: its decode steps read as any stack does (no score output, no mass computed)."""
    import kvcompress
    import kvcompress.kernels.attention as attention
    from models import tiny_model

    calls = []
    real = attention.attend_segments

    def spy(*args, **kwargs):
        calls.append(bool(kwargs.get("scored")))
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "attend_segments", spy)
    model = tiny_model("llama")
    ids = torch.randint(1, 256, (1, 48), generator=torch.Generator().manual_seed(4))
    kw = {"max_cache_len": 52} if static else {}
    for entry, scored in (({"tova": {"budget": 24, "sinks": 2, "recent": 4}}, True),
                          ({"snapkv": {"ratio": 0.5, "window": 4, "sinks": 2, "recent": 4}}, False)):
        calls.clear()
        with kvcompress.compress(model, {"compressors": [entry]}, **kw) as cache, torch.no_grad():
            model(ids[:, :32], cache=cache)
            for t in range(32, 48):
                model(ids[:, t:t + 1], cache=cache)
        if scored:  # every decode step of both layers (the prefill reads unscored)
            assert calls.count(True) == 16 * 2 and all(calls[-32:]), (entry, calls)
        else:  # dense decode reads may go to the backend's attention: none is scored
            assert not any(calls), (entry, calls)


# ----------------------------------------------------------------------------- GPU (never in CI)


def _cuda(x):
    return None if x is None else x.cuda()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["lanes-fp16", "lanes-fp32", "kivi2", "kivi4", "kivi-lanes"])
def test_scored_kernels_on_gpu(kind):
    """The compiled Triton kernels with their score output, through the registered scored ops (``impl="triton"``;
    KIVI regions chosen for the CUDA v3 kernel are scored by Triton), at Llama head shapes with odd live lengths,
    masked slots, a dead row and left padding, against the references on the same GPU tensors."""
    from kvcompress.kernels import ops
    from kvcompress.kernels.kivi import lanes_reference
    from kvcompress.kernels.kivi import reference as kivi_ref
    from kvcompress.kernels.kivi.reference import PackedKV
    from kvcompress.kernels.leank import reference as leank_ref
    from test_kivi_lanes import make_region

    if kind.startswith("lanes"):
        dtype = torch.float32 if kind == "lanes-fp32" else torch.float16
        q, lanes, scale, length = lanes_inputs(dtype=dtype, live=3001, capacity=4096, kv_heads=8, rows=4)
        q, length = q.cuda(), length.cuda()
        lanes = [tuple(_cuda(x) for x in lane) for lane in lanes]
        out, lse, logits = ops.lanes_attention_scored(q, lanes, scale, impl="triton", length=length)
        ro, rl, rlog = leank_ref.grouped_partial_scored(q, lanes, scale, length=length)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
    elif kind.startswith("kivi2") or kind == "kivi4":
        bits = int(kind[-1])
        q, packed, scale = kivi_inputs(bits=bits, group=32, live=4001, capacity=4096, kv_heads=8, rows=4,
                                       head_dim=128)
        packed = PackedKV(bits, 32, *(x.cuda() for x in (packed.k_codes, packed.k_scale, packed.k_zero,
                                                          packed.v_codes, packed.v_scale, packed.v_zero,
                                                          packed.valid)), length=packed.length.cuda(), impl="cuda")
        q = q.cuda()
        out, lse, s = packed.attention_scored(q, scale)  # impl "cuda": scored by the Triton kernel
        ro, rl, rs = kivi_ref.kivi_attention_scored(q, packed, scale)
        logits, rlog, tol = [s], [rs], 2e-2
    else:
        q, region = make_region(batch=2, counts=(0, 32, 32, 32, 32, 32, 64, 96), tokens=4096, live=4001, seed=11)
        q = q.cuda()
        region = lanes_reference.PackedLanes(
            region.bits, region.group, tuple(lanes_reference.KiviLane(*(_cuda(x) for x in lane))
                                             for lane in region.lanes),
            region.valid.cuda(), region.num_heads, region.head_dim, length=region.length.cuda(), impl="triton")
        scale = q.shape[-1] ** -0.5
        out, lse, logits = ops.kivi_lanes_attention_scored(q, region, scale, impl="triton")
        ro, rl, rlog = lanes_reference.kivi_lanes_attention_scored(q, region, scale)
        tol = 2e-2
    assert same_partial((out.cpu(), lse.cpu()), (ro.cpu(), rl.cpu()), atol=max(tol, 5e-3)) == ""
    for got, want in zip(logits, rlog, strict=True):
        assert same_scores(got.cpu(), want.cpu(), atol=tol, rtol=tol) == ""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("quantized", [False, True], ids=["dense", "kivi"])
def test_decode_mass_on_gpu_equals_cpu(quantized):
    """A static cache on the GPU (kernels chosen by the cache: the Triton lanes kernel, KIVI scored by Triton) gives
    the observer the same decode-step mass as the CPU path (the references, checked against eager oracles by
    tests/test_observe.py), fp32 tiny Llama; the mass sums to the group size per kv head."""
    from test_observe import _registry

    import kvcompress
    from kvcompress.stack import parse_stack
    from models import tiny_model

    entries = [{"observer": {"sinks": 2, "recent": 16, "flush": 16}}]
    if quantized:
        entries.append({"kivi": {"bits": 2, "group": 16, "residual": 16}})
    ids = torch.randint(1, 256, (2, 70), generator=torch.Generator().manual_seed(5))
    masses = {}
    for device in ("cpu", "cuda"):
        model = tiny_model("llama").to(device)
        stack = parse_stack({"compressors": entries}, registry=_registry())
        with kvcompress.compress(model, stack, max_cache_len=76) as cache, torch.no_grad():
            model(ids[:, :40].to(device), past_key_values=cache)
            for t in range(40, 70):
                model(ids[:, t:t + 1].to(device), past_key_values=cache)
        rec = [r for _, r in cache.pipeline.compressors[0][1].seen if r["obs"].keys.shape[2] == 1]
        masses[device] = [{k: m.cpu() for k, m in r["mass"].items()} for r in rec]
    assert len(masses["cpu"]) == len(masses["cuda"]) == 60
    tol = 2e-3 if quantized else 1e-5  # KIVI's Triton kernel multiplies fp16 operands
    for a, b in zip(masses["cpu"], masses["cuda"]):
        for region in a:
            assert torch.allclose(a[region], b[region], atol=tol), region


if __name__ == "__main__" and "--worker" in sys.argv:
    collect(_interpreter_cases(), sys.argv[sys.argv.index("--worker") + 1])


@pytest.mark.parametrize("variant", ["plain", "softcap", "sinks"])
@pytest.mark.parametrize("case", ["decode", "prefill-window"])
def test_chunked_mass_equals_one_pass(case, variant):
    """attention_mass past its element limit (two passes over token chunks, the LSE first) gives the one-pass mass:
    every kind of segment of a decode read, and a prefill's observation window (8 queries: a stored dense region with
    masked slots, a LeanK-style head subset with kept channels, the step's own 18 tokens read causally), with
    chunks that split segments unevenly."""
    from kvcompress.observe import attention_mass
    from kvcompress.state import HeadGroup, Segment

    if case == "decode":
        q, segs, pos = rich_segments()
        kv = 4
    else:
        g = torch.Generator().manual_seed(3)
        b, kv, group, d = 2, 2, 3, 16
        q = torch.randn(b, kv * group, 8, d, generator=g)
        valid = torch.rand(b, 30, generator=g) > 0.3
        stored = Segment(torch.randn(b, kv, 30, d, generator=g), torch.randn(b, kv, 30, d, generator=g), valid,
                         torch.arange(30))
        ch = torch.tensor([[1, 4, 5, 9, 11]])
        lane = HeadGroup(torch.tensor([1]), None, None, channels=ch).attach(Segment(torch.randn(b, 1, 12, 5, generator=g),
                                                               torch.randn(b, 1, 12, d, generator=g),
                                                               torch.rand(b, 12, generator=g) > 0.2, torch.arange(12)))
        new = Segment(torch.randn(b, kv, 18, d, generator=g), torch.randn(b, kv, 18, d, generator=g), None,
                      torch.arange(30, 48))
        segs, pos = [stored, lane, new], torch.arange(40, 48)
    softcap = 0.9 if variant == "softcap" else None
    sinks = torch.randn(q.shape[1], generator=torch.Generator().manual_seed(1)) if variant == "sinks" else None
    scale = q.shape[-1] ** -0.5
    one = attention_mass(q, segs, pos, scale, kv, softcap, sinks)
    for limit in (1, q.shape[0] * q.shape[1] * q.shape[2] * 7):  # one token per chunk; 7 tokens per chunk
        chunked = attention_mass(q, segs, pos, scale, kv, softcap, sinks, max_elements=limit)
        assert len(chunked) == len(one)
        for i, (got, want) in enumerate(zip(chunked, one)):
            assert got.shape == want.shape, i
            assert (got - want).abs().max() < 1e-6, (i, limit)
