"""KIVI lanes (a stacked LeanK + KIVI middle read as one region): ``kvcompress::kivi_lanes_partial``.

* The Triton kernel (``kernels/kivi/lanes_triton.py``: one launch over every lane + one merge), run on CPU tensors under
  the Triton interpreter in one worker subprocess (``tests/interpreter.py``), against the PyTorch reference beside it
  and against an independent float64 dense-attention oracle (dequantized keys of each head's kept channels, values,
  masked softmax): odd token counts and live lengths (not multiples of the tile), masked slots, left padding, a dead
  row, lanes of different kept-channel counts, a head no lane covers, kivi bits 2 and 4, GQA group 4, d 128 and 64,
  several token splits, the op's CUDA glue (``ops.CUDA_IMPLS``).
* The reference against the same oracle; the registered op (opcheck, fake implementation, one node of a fullgraph
  compiled graph, no recompilation when ``length`` changes).
* End to end (CPU path): a tiny Llama with 4 kv heads and a LeanK mask of mixed kept counts stacked with KIVI-2, in a
  dynamic and a static cache: the layer reads one merged segment, and its logits equal those of the per-lane read
  and of the independent compressed-middle oracle (``tests/reference.py``).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from interpreter import collect
from interpreter import interpreted as run_interpreted


def make_region(batch=2, heads=8, rows=4, head_dim=128, tokens=96, bits=2, group=32, counts=(0, 32, 96, 64, 32, 0, 128,
                64), live=None, dead_row=True, seed=0, keep=0.85, pad=7):
    """Query ``[B, H, M, D]`` fp16 and a :class:`PackedLanes` of one lane per kept count (0: no lane), quantized from
    random keys / values; plus the float keys / values the oracle decodes."""
    from kvcompress.kernels.kivi.lanes_reference import KiviLane, PackedLanes
    from kvcompress.kernels.kivi.reference import quantize_keys, quantize_values

    g = torch.Generator().manual_seed(seed)
    v_group = min(32, head_dim)
    lanes = []
    for c in sorted(set(counts) - {0}, reverse=True):
        hs = [h for h, n in enumerate(counts) if n == c]
        channels = torch.stack([torch.randperm(head_dim, generator=g)[:c].sort().values for _ in hs])
        k = torch.randn(batch, len(hs), tokens, c, generator=g) * 1.5 + 0.3
        v = torch.randn(batch, len(hs), tokens, head_dim, generator=g)
        lanes.append(KiviLane(torch.tensor(hs), None if c == head_dim and len(hs) == heads else channels,
                              *quantize_keys(k, bits, group), *quantize_values(v, bits, v_group)))
    valid = torch.rand(batch, tokens, generator=g) < keep
    valid[0, :pad] = False  # left padding of row 0
    if dead_row and batch > 1:
        valid[batch - 1] = False
    q = torch.randn(batch, heads, rows, head_dim, generator=g).half()
    length = None if live is None else torch.tensor(live)
    return q, PackedLanes(bits, group, tuple(lanes), valid, heads, head_dim, length=length)


def oracle(q, region, scale):
    """float64 masked softmax attention over each head's dequantized kept channels (independent of the kernels and
    of the reference's per-lane merge): ``(out [B, H, M, Dv], lse [B, H, M])``."""
    from kvcompress.kernels.kivi.reference import dequantize_keys, dequantize_values

    b, h, m, d = q.shape
    t = region.valid.shape[1]
    ok = region.valid.clone()
    if region.length is not None:
        ok[:, int(region.length):] = False
    scores = torch.full((b, h, m, t), float("-inf"), dtype=torch.float64)
    values = torch.zeros(b, h, t, region.v_dim, dtype=torch.float64)
    for lane in region.lanes:
        k = dequantize_keys(lane.k_codes, lane.k_scale, lane.k_zero, region.bits).double()
        v = dequantize_values(lane.v_codes, lane.v_scale, lane.v_zero, region.bits).double()
        heads = range(h) if lane.heads is None else lane.heads.tolist()
        for i, head in enumerate(heads):
            ch = torch.arange(d) if lane.channels is None else lane.channels[i]
            s = torch.einsum("bmc,btc->bmt", q[:, head][..., ch].double(), k[:, i]) * scale
            scores[:, head] = s.masked_fill(~ok[:, None, :], float("-inf"))
            values[:, head] = v[:, i]
    lse = torch.logsumexp(scores, -1)
    p = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1))
    return torch.einsum("bhmt,bhtd->bhmd", p, values), lse


def close(got, ref, atol=3e-3, rtol=1e-2, lse_atol=2e-3) -> str:
    """'' when ``got`` matches ``ref`` (fp16 operands, fp32 accumulation), else what differs."""
    out, lse = got
    ref_out, ref_lse = (x.float() for x in ref)
    if out.dtype != torch.float32 or out.shape != ref_out.shape or lse.shape != ref_lse.shape:
        return f"shapes / dtype {tuple(out.shape)} {out.dtype}"
    if torch.isnan(out).any() or torch.isnan(lse).any():
        return "NaN"
    fin = torch.isfinite(ref_lse)
    if not torch.equal(torch.isfinite(lse), fin):
        return "-inf LSE rows differ"
    if (out[~fin] != 0).any():
        return "rows without a valid key must be zero"
    err = (out - ref_out).abs()
    if not bool((err <= atol + rtol * ref_out.abs()).all()):
        return f"max |out - ref| {err.max().item():.2e}"
    if fin.any() and (lse[fin] - ref_lse[fin]).abs().max().item() > lse_atol:
        return f"max |lse - ref| {(lse[fin] - ref_lse[fin]).abs().max().item():.2e}"
    return ""


# name -> (make_region kwargs, kernel kwargs, poison the slots after length): every case also runs the reference
# and the oracle
CASES = {
    # Llama heads (8 kv, group 4, d 128), KIVI-2, lanes of 32 / 64 / 96 / 128 channels, two heads without a lane,
    # 61 live of 64 slots (not a multiple of the 16-token tile), 2 splits
    "llama-kivi2-live61-splits2": (dict(tokens=64, live=61), dict(splits=2), False),
    # KIVI-4 (G 16), odd live length 45 (a tile cut by it), one split; slots after it poisoned (never read)
    "llama-kivi4-live45": (dict(bits=4, group=16, live=45, seed=1), dict(splits=1), True),
    # SmolLM-like d 64, 3 kv heads, 3 rows, lanes of 16 / 48 channels, odd live length, 5 splits (some past it)
    "d64-kivi2-h3-live83": (dict(heads=3, rows=3, head_dim=64, counts=(16, 48, 16), tokens=96, live=83, seed=2),
                            dict(splits=5), True),
    # d 64, KIVI-4, G 32, two lanes covering every head (64 and 32 channels), left padding of 11, default splits
    "d64-kivi4-live77": (dict(bits=4, heads=4, head_dim=64, counts=(64, 32, 32, 64), tokens=128, live=77, seed=3,
                              pad=11), dict(), False),
    # one row per head (GQA group 1), one lane of every head with all channels (no channel list), no dead row
    "dense-lane-m1": (dict(heads=2, rows=1, head_dim=64, counts=(64, 64), tokens=64, seed=4, dead_row=False),
                      dict(splits=2), False),
    # the split merge that folds several splits per step (config combine: "splits"): 5 splits (one block of SB 8),
    # some past the live length, a head without a lane
    "d64-kivi2-combine-splits": (dict(heads=3, rows=3, head_dim=64, counts=(16, 48, 0), tokens=96, live=83, seed=6),
                                 dict(splits=5, config={"combine": "splits"}), True),
}


def _interpreter_cases() -> dict:
    from kvcompress.kernels import ops
    from kvcompress.kernels.kivi import lanes_reference, lanes_triton

    def run(make_kw, kernel_kw, poison):
        def go():
            q, region = make_region(**make_kw)
            scale = q.shape[-1] ** -0.5
            ref = lanes_reference.kivi_lanes_attention_partial(q, region, scale)
            got = lanes_triton.kivi_lanes_attention_partial(q, region, scale, **kernel_kw)
            res = {"vs_reference": close(got, ref), "vs_oracle": close(got, oracle(q, region, scale)),
                   "ref_vs_oracle": close(ref, oracle(q, region, scale), atol=1e-4, rtol=1e-4, lse_atol=1e-4)}
            if poison:  # slots after length: poisoned scales (NaN) and valid flags must not be read
                poisoned = region.valid.clone()
                poisoned[:, int(region.length):] = True
                lanes = []
                for lane in region.lanes:
                    ks, vs = lane.k_scale.clone(), lane.v_scale.clone()
                    g0 = -(-int(region.length) // region.group)
                    ks[:, :, g0:] = float("nan")
                    vs[:, :, int(region.length):] = float("nan")
                    lanes.append(lane._replace(k_scale=ks, v_scale=vs))
                bad = lanes_reference.PackedLanes(region.bits, region.group, tuple(lanes), poisoned, region.num_heads,
                                                  region.head_dim, length=region.length)
                again = lanes_triton.kivi_lanes_attention_partial(q, bad, scale, **kernel_kw)
                res["never_reads_after_length"] = close(again, got, atol=0, rtol=0, lse_atol=0)
            return res
        return go

    def softcap():
        q, region = make_region(heads=4, head_dim=64, counts=(0, 16, 32, 16), tokens=64, live=70 - 9, seed=5)
        scale = q.shape[-1] ** -0.5
        ref = lanes_reference.kivi_lanes_attention_partial(q, region, scale, softcap=0.5)
        got = lanes_triton.kivi_lanes_attention_partial(q, region, scale, softcap=0.5, splits=2)
        return {"vs_reference": close(got, ref)}

    def op_glue():
        """The registered op's CUDA implementation (what a CUDA layer runs) on CPU tensors, with ``impl="triton"``: its
        launch plan is made once and cached on the region's mask; later calls reuse it and read the lanes' current
        values (a store writes its buffers in place); a lane that needs a contiguous copy is planned at every call."""
        q, region = make_region(batch=1, heads=8, rows=4, tokens=32, live=29, seed=6)
        scale = q.shape[-1] ** -0.5

        def via_op(region):
            seen = {}
            real = ops._OPS["kivi_lanes_partial"]

            def spy(*args):
                seen["args"] = args
                return real(*args)

            ops._OPS["kivi_lanes_partial"] = spy
            try:
                ref = ops.kivi_lanes_attention(q, region, scale, impl="reference")
            finally:
                ops._OPS["kivi_lanes_partial"] = real
            return ops.CUDA_IMPLS["kivi_lanes_partial"](*seen["args"][:-1], "triton"), ref

        got, ref = via_op(region)
        res = {"vs_reference": close(got, ref)}
        plan = getattr(region.valid, lanes_triton.PLAN_ATTR, None)
        res["plan_cached"] = "" if plan is not None else "no plan cached on the region's mask"
        region.lanes[0].v_scale.mul_(2.0)  # the store writes in place: the cached plan must read the new values
        region.lanes[1].k_zero.add_(0.5)
        again, ref2 = via_op(region)
        res["after_write"] = close(again, ref2)
        res["same_plan"] = "" if getattr(region.valid, lanes_triton.PLAN_ATTR, None) is plan else "plan rebuilt"
        res["values_moved"] = "" if not torch.equal(again[0], got[0]) else "the write changed nothing"
        lane = region.lanes[0]  # a strided value-scale view (last dim not contiguous): copied, so never cached
        strided = lane._replace(v_scale=lane.v_scale.transpose(-1, -2).contiguous().transpose(-1, -2))
        other = lanes_reference.PackedLanes(region.bits, region.group, (strided, *region.lanes[1:]),
                                            region.valid.clone(), region.num_heads, region.head_dim,
                                            length=region.length)
        got3, ref3 = via_op(other)
        res["strided_lane"] = close(got3, ref3)
        res["strided_not_cached"] = "" if getattr(other.valid, lanes_triton.PLAN_ATTR, None) is None else "cached"
        # the cached plan keeps no lane tensor alive (under reduce-overhead the tensors of a recorded call live in
        # the CUDA graphs' pool, and one kept past the call fails the recording)
        import gc
        import weakref

        fresh = lanes_reference.PackedLanes(
            region.bits, region.group, tuple(lanes_reference.KiviLane(*(None if x is None else x.clone() for x in ln))
                                             for ln in region.lanes),
            region.valid.clone(), region.num_heads, region.head_dim, length=region.length)
        via_op(fresh)
        keep = fresh.valid
        refs = [weakref.ref(x) for ln in fresh.lanes for x in ln if x is not None]
        del fresh
        gc.collect()
        alive = sum(r() is not None for r in refs)
        res["plan_holds_no_lane"] = ("" if getattr(keep, lanes_triton.PLAN_ATTR, None) is not None and alive == 0
                                     else f"plan cached: {getattr(keep, lanes_triton.PLAN_ATTR, None) is not None}, "
                                          f"{alive} of {len(refs)} lane tensors kept alive")
        return res

    def many_lanes():
        """More lanes than one launch takes (MAX_LANES): two launches into the same partials, one merge."""
        counts = tuple(2 * (i + 1) for i in range(lanes_triton.MAX_LANES + 2))
        q, region = make_region(batch=1, heads=len(counts), rows=1, head_dim=32, tokens=32, counts=counts, seed=7,
                                dead_row=False)
        scale = q.shape[-1] ** -0.5
        got = lanes_triton.kivi_lanes_attention_partial(q, region, scale, splits=1)
        return {"vs_oracle": close(got, oracle(q, region, scale))}

    def overlap():
        """A head in two lanes: the merge folds both lanes' rows of that head (joint softmax)."""
        q, region = overlapping_region()
        got = lanes_triton.kivi_lanes_attention_partial(q, region, 0.2, splits=2)
        return {"vs_reference": close(got, lanes_reference.kivi_lanes_attention_partial(q, region, 0.2))}

    def read_beside():
        """``cuda_kernel.read_beside`` (``buffer_lanes``) on CPU tensors: the Triton lanes kernel (interpreted) reads
        the buffer into the partials after the KIVI launch's (replaced by the lanes reference's partial and two empty
        splits), and the combine (a log-sum-exp merge here) gets every partial - against the reference of the lanes
        and the buffer together, with a head no lane holds and live lengths in both.  The KIVI launch comes first,
        then the combine, launched plainly, over all ``3 + buffer splits`` partials."""
        from kvcompress.kernels.kivi import cuda_kernel as ck

        q, region = make_region(batch=2, heads=4, rows=4, head_dim=64, counts=(16, 0, 32, 64), tokens=64, live=50,
                                seed=9)
        gen = torch.Generator().manual_seed(10)
        bk = (torch.randn(2, 4, 40, 64, generator=gen) * 1.2).half()
        bv = torch.randn(2, 4, 40, 64, generator=gen).half()
        bvalid = torch.rand(2, 40, generator=gen) < 0.8
        bvalid[0, :4] = False
        blen = torch.tensor(33)
        scale = q.shape[-1] ** -0.5
        lanes_out, lanes_lse = lanes_reference.kivi_lanes_attention_partial(q, region, scale)
        order = []

        def launch(po, pl):  # the KIVI launch's 3 split partials: the region's whole partial, then two empty splits
            order.append(("kivi", po.shape[0]))
            po[0] = lanes_out.reshape(-1, 64)
            pl[0] = lanes_lse.reshape(-1)
            po[1:3] = 0.0
            pl[1:3] = float("-inf")
            return []

        def combine(lib, po, pl, out, lse, total, index, stream, pdl=False):
            order.append(("combine", total, pdl))
            top = pl[:total].max(0).values
            w = torch.exp(pl[:total] - torch.where(torch.isinf(top), 0.0, top)).nan_to_num(0.0)
            den = w.sum(0)
            out.copy_(torch.where(den[:, None] > 0, (w[..., None] * po[:total]).sum(0) / den.clamp_min(1e-30)[:, None],
                                  0.0).view(out.shape))
            lse.copy_(torch.where(den > 0, top + torch.log(den.clamp_min(1e-30)), float("-inf")).view(lse.shape))

        real = ck.combine_into
        ck.combine_into = combine
        try:
            out, lse = torch.empty(2, 4, 4, 64), torch.empty(2, 4, 4)
            ck.read_beside(q, (bk, bv, bvalid.view(torch.uint8), blen), scale, None, 3, launch, None, out, lse, 0,
                           None, True)
        finally:
            ck.combine_into = real
        ref = lanes_reference.kivi_lanes_buffer_attention_partial(q.float(), region, scale, bk, bv, bvalid, blen)
        ok = (len(order) == 2 and order[0][0] == "kivi" and order[0][1] > 3 and order[1] == ("combine", order[0][1],
                                                                                              False))
        return {"vs_reference": close((out, lse), ref), "order": "" if ok else f"launches {order}"}

    cases = {name: run(*kw) for name, kw in CASES.items()}
    cases.update({"softcap": softcap, "op-glue": op_glue, "many-lanes": many_lanes, "overlap": overlap,
                  "read-beside": read_beside})
    return cases


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    pytest.importorskip("triton")
    return run_interpreted(__file__, tmp_path_factory.mktemp("kivi_lanes"), OMP_NUM_THREADS="1")


@pytest.mark.parametrize("name", list(CASES) + ["softcap", "op-glue", "many-lanes", "overlap", "read-beside"])
def test_triton_kernel_under_interpreter(interpreted, name):
    res = interpreted[name]
    assert "error" not in res, res.get("error")
    for key, msg in res.items():
        assert msg == "", f"{name} {key}: {msg}"


# ----------------------------------------------------------------------------- reference and registered op (CPU)


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_float64_oracle(name):
    from kvcompress.kernels.kivi.lanes_reference import kivi_lanes_attention_partial

    q, region = make_region(**CASES[name][0])
    scale = q.shape[-1] ** -0.5
    assert close(kivi_lanes_attention_partial(q, region, scale), oracle(q, region, scale), atol=1e-4, rtol=1e-4,
                 lse_atol=1e-4) == ""


def overlapping_region(seed=13):
    """Two lanes sharing head 1 (not what the stores build; the op's semantics: that head's joint softmax)."""
    from kvcompress.kernels.kivi.lanes_reference import KiviLane, PackedLanes
    from kvcompress.kernels.kivi.reference import quantize_keys, quantize_values

    g = torch.Generator().manual_seed(seed)
    b, t, d = 2, 64, 32
    lanes = []
    for hs, c in (([0, 1], 16), ([1, 2], 8)):
        k = torch.randn(b, 2, t, c, generator=g)
        v = torch.randn(b, 2, t, d, generator=g)
        ch = torch.stack([torch.randperm(d, generator=g)[:c].sort().values for _ in hs])
        lanes.append(KiviLane(torch.tensor(hs), ch, *quantize_keys(k, 2, 32), *quantize_values(v, 2, 32)))
    valid = torch.rand(b, t, generator=g) < 0.8
    q = torch.randn(b, 4, 3, d, generator=g).half()  # head 3: no lane
    return q, PackedLanes(2, 32, tuple(lanes), valid, 4, d)


def test_reference_joint_softmax_of_a_head_in_two_lanes():
    from kvcompress.kernels.kivi.lanes_reference import kivi_lanes_attention_partial
    from kvcompress.kernels.kivi.reference import dequantize_keys, dequantize_values

    q, region = overlapping_region()
    out, lse = kivi_lanes_attention_partial(q, region, 0.2)
    scores, values = [], []  # head 1: both lanes' tokens in one softmax (float64)
    for lane, i in zip(region.lanes, (1, 0)):
        k = dequantize_keys(lane.k_codes, lane.k_scale, lane.k_zero, 2)[:, i].double()
        s = torch.einsum("bmc,btc->bmt", q[:, 1][..., lane.channels[i]].double(), k) * 0.2
        scores.append(s.masked_fill(~region.valid[:, None], float("-inf")))
        values.append(dequantize_values(lane.v_codes, lane.v_scale, lane.v_zero, 2)[:, i].double())
    s, v = torch.cat(scores, -1), torch.cat(values, 1)
    torch.testing.assert_close(lse[:, 1].double(), torch.logsumexp(s, -1), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[:, 1].double(), torch.einsum("bmt,btd->bmd", torch.softmax(s, -1), v), atol=1e-4,
                               rtol=1e-4)
    assert torch.isinf(lse[:, 3]).all() and (out[:, 3] == 0).all()


def test_dequantize_spreads_kept_channels_into_the_head():
    """The fallback readers' view (selections, observers): D-wide keys, zeros on pruned channels - same scores."""
    from kvcompress.kernels.attention.reference import partial_attention

    q, region = make_region(heads=4, head_dim=64, counts=(16, 48, 16, 64), tokens=64, live=None, seed=8)
    k, v = region.dequantize()
    assert k.shape == (2, 4, 64, 64) and v.shape == (2, 4, 64, 64)
    got = partial_attention(q, k, v, region.valid.view(2, 1, 1, 64), 0.125)
    assert close(got, oracle(q, region, 0.125), atol=1e-4, rtol=1e-4, lse_atol=1e-4) == ""
    assert region.k_codes.shape[:2] == (2, 4)  # the head-count view attend_segments reads


def _op_args(q, region, scale):
    from kvcompress.kernels import ops

    seen = {}
    real = ops._OPS["kivi_lanes_partial"]

    def spy(*args):
        seen["args"] = args
        return real(*args)

    ops._OPS["kivi_lanes_partial"] = spy
    try:
        ops.kivi_lanes_attention(q, region, scale, impl="reference")
    finally:
        ops._OPS["kivi_lanes_partial"] = real
    return seen["args"]


def test_registered_op_opcheck_and_compiled_graph():
    from kvcompress.kernels import ops
    from kvcompress.kernels.kivi.lanes_reference import kivi_lanes_attention_partial

    q, region = make_region(batch=2, heads=4, rows=2, head_dim=64, counts=(0, 16, 32, 16), tokens=64, live=50, seed=9)
    scale = 0.125
    torch.library.opcheck(torch.ops.kvcompress.kivi_lanes_partial.default, _op_args(q, region, scale))
    assert ops.choose("kivi_lanes_partial", "cpu", bits=2, group=32, head_dim=64, kept=(16, 32)) == "reference"

    def step(q, length):
        return region.with_length(length).attention_partial(q, scale)

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("aot_eager")(gm, example_inputs)

    region.impl = "reference"
    torch._dynamo.reset()
    f = torch.compile(step, fullgraph=True, backend=backend)
    for live in (50, 41):
        with torch._dynamo.config.patch(error_on_recompile=live == 41):
            got = f(q, torch.tensor(live))
        ref = kivi_lanes_attention_partial(q, region, scale, length=torch.tensor(live))
        assert all(torch.equal(g, r) for g, r in zip(got, ref))
    assert len(graphs) == 1
    targets = {n.target for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert ops._OPS["kivi_lanes_partial"] in targets
    torch._dynamo.reset()


def test_choose_on_cuda_takes_triton_when_it_can(monkeypatch):
    from kvcompress.kernels import ops

    monkeypatch.setattr(ops, "triton_available", lambda: True)
    monkeypatch.setattr(ops, "_kivi_triton_base", lambda *a: {})
    monkeypatch.setenv("KVCOMPRESS_KIVI_CUDA", "0")  # the CUDA lanes kernel: test_choose_on_cuda_takes_the_cuda_...
    monkeypatch.delenv("KVCOMPRESS_KERNELS", raising=False)
    facts = dict(bits=2, group=32, head_dim=128, v_dim=128, v_group=32)
    assert ops.choose("kivi_lanes_partial", "cuda", kept=(32, 64, 96), **facts) == "triton"
    assert ops.choose("kivi_lanes_partial", "cuda", kept=(31, 64), **facts) == "reference"  # odd kept count
    assert ops.choose("kivi_lanes_partial", "cuda", k_per_token=True, **facts) == "reference"
    monkeypatch.setenv("KVCOMPRESS_KERNELS", "reference")
    assert ops.choose("kivi_lanes_partial", "cuda", kept=(32,), **facts) == "reference"


def test_choose_on_cuda_takes_the_cuda_lanes_kernel_when_it_can(monkeypatch):
    """With nvcc and a GPU (faked here: the capability facts are what is checked), the CUDA lanes kernel; kept counts
    it cannot read (not a multiple of 16, more than 8 distinct) and a disabled KIVI CUDA kernel fall back to Triton."""
    from kvcompress.kernels import ops
    from kvcompress.kernels.kivi import cuda_kernel

    monkeypatch.setattr(ops, "triton_available", lambda: True)
    monkeypatch.setattr(ops, "_kivi_triton_base", lambda *a: {})
    monkeypatch.setattr(ops, "_kivi_cuda_base", lambda *a: {})
    monkeypatch.setattr(cuda_kernel, "nvcc_path", lambda: "/usr/bin/nvcc")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.delenv("KVCOMPRESS_KERNELS", raising=False)
    monkeypatch.delenv("KVCOMPRESS_KIVI_CUDA", raising=False)
    facts = dict(bits=2, group=32, head_dim=128, v_dim=128, v_group=32)
    assert ops.choose("kivi_lanes_partial", "cuda", kept=(32, 64, 96), **facts) == "cuda"
    assert ops.choose("kivi_lanes_partial", "cuda", kept=(16, 48), bits=4, group=32, head_dim=64, v_dim=64,
                      v_group=16) == "cuda"
    assert ops.choose("kivi_lanes_partial", "cuda", kept=(24, 64), **facts) == "triton"  # not a multiple of 16
    assert ops.choose("kivi_lanes_partial", "cuda", kept=tuple(range(16, 160, 16)), **facts) == "triton"
    assert ops.choose("kivi_lanes_partial", "cuda", kept=(32, 64), **{**facts, "v_group": 8}) == "triton"
    monkeypatch.setenv("KVCOMPRESS_KIVI_CUDA", "0")
    assert ops.choose("kivi_lanes_partial", "cuda", kept=(32, 64, 96), **facts) == "triton"


# small regions for the CUDA lanes kernel's CPU emulator (Python loops over lanes and fragments: slow): name ->
# make_region kwargs.  Lanes of 32 / 96 / 64 channels at 2 bits (32 and 96: shared quarter words), a head without a
# lane, left padding; d 64 with 16 / 48 (one and three shared words); 4 bits with 16 / 48 and no channel list.
EMULATED = {
    "llama-kivi2-32-96-64": dict(batch=1, heads=4, rows=4, counts=(32, 96, 0, 64), tokens=64, live=61, seed=21),
    "d64-kivi2-16-48": dict(batch=1, heads=3, rows=3, head_dim=64, counts=(16, 48, 16), tokens=64, seed=22),
    "d64-kivi4-16-48-64": dict(batch=1, heads=3, rows=2, head_dim=64, bits=4, counts=(48, 64, 16), tokens=64,
                               seed=23, live=50),
}


@pytest.mark.parametrize("name", list(EMULATED))
def test_cuda_lanes_emulated_matches_oracle(name):
    """The CUDA lanes kernel's dataflow (kvcompress.kernels.kivi.lanes_cuda.emulate: the host head tables, the query
    gathered to each lane's channels, the plain kernel's fragments with shared quarter key words) against the float64
    oracle and the reference."""
    from kvcompress.kernels.kivi import lanes_cuda

    q, region = make_region(**EMULATED[name])
    scale = q.shape[-1] ** -0.5
    from kvcompress.kernels.kivi.lanes_reference import kivi_lanes_attention_partial

    got = lanes_cuda.emulate(q, region, scale, nw=2, splits=2)
    assert close(got, oracle(q, region, scale)) == ""
    assert close(got, kivi_lanes_attention_partial(q, region, scale)) == ""


@pytest.mark.parametrize("name,lane_splits,interleave", [("llama-kivi2-32-96-64", (1, 2, 2), 1),
                                                         ("d64-kivi4-16-48-64", (2, 1, 2), 0)])
def test_cuda_lanes_emulated_with_a_split_count_per_lane_matches_oracle(name, lane_splits, interleave):
    """Each lane with its own split count (configuration lane_balance: ``LaneParams::nsplit`` / ``tps``; the CTAs of
    a lane's heads past its count write empty partials): the same result as the float64 oracle, for both tile
    assignments."""
    from kvcompress.kernels.kivi import lanes_cuda

    q, region = make_region(**EMULATED[name])
    scale = q.shape[-1] ** -0.5
    got = lanes_cuda.emulate(q, region, scale, nw=2, splits=2, interleave=interleave, lane_splits=lane_splits)
    assert close(got, oracle(q, region, scale)) == ""


def test_balanced_splits_give_wider_lanes_more_within_the_budget():
    """lanes_cuda.balanced_splits (lane_balance): the benchmark's Llama LeanK-70 lanes (32 x 5 heads, 64, 96) at B16
    (16 CTAs per head split) within one H100 wave of 528 CTAs: the lane splits stay within the wave, wider lanes get
    at least the splits of narrower ones, and the largest per-CTA cost (channels x tiles) is lower than with the
    uniform split count the same wave allows (4 per head of 7 heads at 16 rows: 448 CTAs)."""
    from kvcompress.kernels.kivi import lanes_cuda

    lanes = [(96, 1), (64, 1), (32, 5)]
    ntiles, rows, budget, dv = 1024, 16, 528, 128
    s = lanes_cuda.balanced_splits(ntiles, lanes, rows, budget, most=ntiles, dv=dv)
    assert sum(n * heads * rows for n, (_, heads) in zip(s, lanes)) <= budget
    assert s[0] >= s[1] >= s[2] >= 1
    load = max((dk + dv) * -(-ntiles // n) for n, (dk, _) in zip(s, lanes))
    uniform = max((dk + dv) * -(-ntiles // 4) for dk, _ in lanes)
    assert load < 0.85 * uniform, (s, load, uniform)
    # the per-warp minimum caps every lane; a budget below one split each still gives each lane one
    assert lanes_cuda.balanced_splits(ntiles, lanes, rows, budget, most=2, dv=dv) == [2, 2, 2]
    assert lanes_cuda.balanced_splits(ntiles, lanes, rows, 10, most=ntiles, dv=dv) == [1, 1, 1]
    # equal lanes: the uniform split count
    assert lanes_cuda.balanced_splits(64, [(32, 2), (32, 2)], 4, 32, most=64, dv=64) == [2, 2]
    # the cap binds before the budget (batch 1, a short context): every lane reaches it, as the uniform plan does,
    # rather than the narrow lanes stopping where the widest one is capped
    assert lanes_cuda.balanced_splits(ntiles, lanes, 1, budget, most=31, dv=dv) == [31, 31, 31]
    # a capped wide lane leaves the budget to the others, costliest first
    s = lanes_cuda.balanced_splits(ntiles, lanes, rows, budget, most=5, dv=dv)
    assert s[0] == s[1] == 5 and 1 < s[2] <= 5
    assert sum(n * heads * rows for n, (_, heads) in zip(s, lanes)) <= budget < sum(
        (n + (i == 2)) * heads * rows for i, (n, (_, heads)) in enumerate(zip(s, lanes)))


def test_launch_args_end_each_lane_with_its_splits():
    """The launcher reads LANE_INTS per lane, the last two the lane's splits and tokens per split: those given, or the
    launch's own for every lane."""
    from kvcompress.kernels.kivi import cuda_kernel as ck, lanes_cuda

    q, region = make_region(**EMULATED["llama-kivi2-32-96-64"])
    valid8 = region.valid.view(torch.uint8)
    base = ck.PARAMS_INTS + 1
    args, _ = lanes_cuda.launch_args(q.half(), region, valid8, 0, 0, 3, 1)
    lanes = len(region.lanes)
    assert len(args) == base + lanes * lanes_cuda.LANE_INTS
    ends = [tuple(args[base + (i + 1) * lanes_cuda.LANE_INTS - 2: base + (i + 1) * lanes_cuda.LANE_INTS])
            for i in range(lanes)]
    assert ends == [(3, ck.TILE)] * lanes
    mine = tuple((i + 1, (i + 2) * ck.TILE) for i in range(lanes))
    args, _ = lanes_cuda.launch_args(q.half(), region, valid8, 0, 0, 3, 1, lane_splits=mine)
    assert [tuple(args[base + (i + 1) * lanes_cuda.LANE_INTS - 2: base + (i + 1) * lanes_cuda.LANE_INTS])
            for i in range(lanes)] == list(mine)


def test_reads_during_a_capture_need_no_host_read_of_the_heads(monkeypatch):
    """A region whose head tensors are new objects read during a CUDA-graph capture (torch.compile's CUDA graphs copy
    their inputs): the reference takes the joint-softmax path without reading the heads on the host (a capture
    forbids it) - the same result -, and the CUDA lanes kernel's check asks for a warm-up call instead of guessing."""
    from kvcompress.kernels.kivi import lanes_cuda, lanes_reference

    q, region = make_region(batch=2, heads=5, counts=(32, 0, 96, 32, 64), tokens=64, seed=5)
    scale = q.shape[-1] ** -0.5
    plain = lanes_reference.kivi_lanes_attention_partial(q, region, scale)
    copied = lanes_reference.PackedLanes(region.bits, region.group,
                                         tuple(lane._replace(heads=lane.heads.clone()) for lane in region.lanes),
                                         region.valid.clone(), region.num_heads, region.head_dim)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("a host read during the capture"))
    assert lanes_reference.disjoint_or_none(copied) is None
    got = lanes_reference.kivi_lanes_attention_partial(q, copied, scale)
    assert close(got, plain, atol=1e-6, rtol=1e-6, lse_atol=1e-6) == ""
    assert "warm" in lanes_cuda.problem(q, copied) or "before capturing" in lanes_cuda.problem(q, copied)


def test_cuda_lanes_launch_arguments_parse_as_the_launcher_reads_them():
    """The argument array lanes_cuda builds, parsed by the library's own parse code on the host
    (kivi_v3_lanes_parse_probe; needs nvcc to build, no GPU): sizes, lane count, each lane's kept count, channel
    stride, head count, last stride, first pointer, splits and tokens per split, the live length's pointer and the
    tile assignment land where the launcher reads them."""
    from kvcompress.kernels.kivi import cuda_kernel as ck
    from kvcompress.kernels.kivi import lanes_cuda

    if not ck.nvcc_path():
        pytest.skip("nvcc not on the PATH")
    import ctypes

    q, region = make_region(batch=2, heads=5, counts=(32, 0, 96, 32, 64), tokens=64)
    dks = tuple(sorted({lane.k_scale.shape[-1] for lane in region.lanes}))
    lib = ck.build(2, dks[-1], 128, 4, lane_dks=dks)
    valid8 = region.valid.view(torch.uint8)
    length = torch.tensor(40)
    args, keep = lanes_cuda.launch_args(q, region, valid8, 1111, 2222, 3, 1, length, interleave=0)
    out = (ctypes.c_longlong * 64)()
    used = lib.kivi_v3_lanes_parse_probe((ctypes.c_longlong * len(args))(*args), out)
    assert used == len(args)
    want = [q.shape[2], 5, 64, 2 * 5, 3, length.data_ptr(), 0, len(region.lanes)]
    for lane, kept in zip(region.lanes, keep[3::6]):
        want += [lane.k_scale.shape[-1], lane.channels.stride(0), lane.heads.numel(), lane.v_zero.stride(1),
                 kept.data_ptr(), 3, ck.TILE]  # every lane: the launch's 3 splits of 1 tile
    assert list(out[:len(want)]) == want


def test_cuda_lanes_covered_heads_and_problem():
    """The heads some lane holds (split sizing) and the capability check's refusals: a head in two lanes, an fp64
    query (fp16 / bf16 / fp32 are read as fp16), a lane of 24 channels, int32 head lists."""
    from kvcompress.kernels.kivi import lanes_cuda
    from kvcompress.kernels.kivi.lanes_reference import KiviLane, PackedLanes

    q, region = make_region(batch=1, heads=5, counts=(32, 0, 96, 32, 64), tokens=64)
    assert lanes_cuda.covered_heads(region) == 4
    assert lanes_cuda.problem(q, region) is None
    assert lanes_cuda.problem(q.float(), region) is None and lanes_cuda.problem(q.bfloat16(), region) is None
    assert "fp16" in lanes_cuda.problem(q.double(), region)
    narrow = region.lanes[0]._replace(heads=region.lanes[0].heads.int())
    assert "int64" in lanes_cuda.problem(q, PackedLanes(region.bits, region.group, (narrow, *region.lanes[1:]),
                                                        region.valid, 5, 128))
    lanes = region.lanes
    two = PackedLanes(region.bits, region.group, (lanes[0], lanes[1]._replace(heads=lanes[0].heads)), region.valid,
                      5, 128)
    assert "two lanes" in lanes_cuda.problem(q, two)
    coarse = lanes[1]._replace(v_scale=lanes[1].v_scale[..., :2].contiguous(),
                               v_zero=lanes[1].v_zero[..., :2].contiguous())  # value groups of 64, not 32
    assert "value groups" in lanes_cuda.problem(q, PackedLanes(region.bits, region.group, (lanes[0], coarse, lanes[2]),
                                                               region.valid, 5, 128))
    odd = lanes[0]._replace(channels=lanes[0].channels[:, :24], k_scale=lanes[0].k_scale[..., :24],
                            k_zero=lanes[0].k_zero[..., :24])
    assert "24" in lanes_cuda.problem(q, PackedLanes(region.bits, region.group, (odd,), region.valid, 5, 128))


def test_merged_segment_fallback_readers_mask_heads_without_a_lane():
    """The merged segment covers every head; a head without a lane (count 0) is invalid in its per-head validity.
    The read (the op), a read-time selection (decoded through ``dequantize``), the attention-mass observer and the
    joint-softmax oracle all equal the per-lane segments' results."""
    import dataclasses

    from kvcompress.kernels.attention import attend_segments, segment_attention
    from kvcompress.observe import attention_mass
    from kvcompress.plugins.kivi import KiviConfig, KiviStore
    from kvcompress.state import HeadGroup, KVBlock, Segment, TokenSelection

    g = torch.Generator().manual_seed(12)
    b, hkv, d, t, group = 2, 4, 16, 48, 4
    heads = {8: [0, 3], 4: [1]}  # head 2 keeps nothing
    groups = [HeadGroup(torch.tensor(hs), torch.randn(b, len(hs), t, c, generator=g),
                        torch.randn(b, len(hs), t, d, generator=g),
                        torch.stack([torch.randperm(d, generator=g)[:c].sort().values for _ in hs]))
              for c, hs in heads.items()]
    valid = torch.rand(b, t, generator=g) < 0.8
    store = KiviStore(KiviConfig(bits=2, group=16, residual=0), head_dim=d, num_kv_heads=hkv)
    store.append(KVBlock(None, None, valid, torch.arange(t), groups=groups))
    merged = store.segments()
    assert len(merged) == 1 and merged[0].heads is None and merged[0].valid.shape == (b, hkv, t)
    store.merged, store._segments = None, None
    per_lane = store.segments()
    assert len(per_lane) == 2
    window = Segment(torch.randn(b, hkv, 8, d, generator=g), torch.randn(b, hkv, 8, d, generator=g), None,
                     torch.arange(t, t + 8))
    q = torch.randn(b, hkv * group, 1, d, generator=g)
    q_pos = torch.tensor([t + 8])
    scale = d ** -0.5

    def read(middle, fn=attend_segments):
        return fn(q, middle + [window], q_pos, scale)

    torch.testing.assert_close(read(merged), read(per_lane), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(read(merged, segment_attention), read(per_lane), atol=1e-5, rtol=1e-5)
    sel = TokenSelection(torch.rand(b, hkv * group, 1, t, generator=g).argsort(-1)[..., :20])
    torch.testing.assert_close(read([dataclasses.replace(s, select=sel) for s in merged]),
                               read([dataclasses.replace(s, select=sel) for s in per_lane]), atol=1e-5, rtol=1e-5)
    mass = attention_mass(q, merged + [window], q_pos, scale, hkv)
    lanes_mass = attention_mass(q, per_lane + [window], q_pos, scale, hkv)
    torch.testing.assert_close(mass[0], lanes_mass[0] + lanes_mass[1], atol=1e-6, rtol=1e-5)
    assert (mass[0][:, 2] == 0).all() and (mass[0][:, [0, 1, 3]] > 0).any()


# ----------------------------------------------------------------------------- end to end (CPU path)


KV_HEADS, HEAD_DIM = 4, 16


def _model():
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4 * KV_HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=1024)
    return tf.LlamaForCausalLM(cfg).eval()


def _keep() -> torch.Tensor:
    """Layer 0: kept counts 8 / 4 / 0 / 8 (lanes of 8 and 4 channels, head 2 without a lane: a segment over heads
    0, 1, 3); layer 1: 16 / 8 / 8 / 4 (three lanes covering every head)."""
    g = torch.Generator().manual_seed(1)
    keep = torch.zeros(2, KV_HEADS, HEAD_DIM, dtype=torch.bool)
    for layer, counts in enumerate(((8, 4, 0, 8), (16, 8, 8, 4))):
        for h, c in enumerate(counts):
            keep[layer, h, torch.randperm(HEAD_DIM, generator=g)[:c]] = True
    return keep


@pytest.fixture(scope="module")
def stacked(tmp_path_factory):
    from kvcompress.calibration.masks import config_hash, save_mask

    model = _model()
    path = tmp_path_factory.mktemp("mask") / "mask.safetensors"
    save_mask(path, _keep(), {"model": "tiny-llama-4kv", "model_config_hash": config_hash(model.config), "ratio": 0.5,
                              "align": 4, "sinks": 3, "local": 24, "method": "trained", "settings": {}})
    stack = {"compressors": [{"leank": {"mask": str(path), "sinks": 3, "local": 24, "flush": 16}},
                             {"kivi": {"bits": 2, "group": 16, "residual": 16}}]}
    return model, stack


def _logits(model, stack, ids, static: bool):
    import kvcompress
    from reference import decode_chunks, streamed_logits

    kw = {"max_cache_len": ids.shape[1] + 8} if static else {}
    with kvcompress.compress(model, stack, **kw) as cache, torch.no_grad():
        got = streamed_logits(model, ids, cache, decode_chunks(70, ids.shape[1]))
    return got, cache


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_stacked_leank_kivi_logits_unchanged(stacked, static, monkeypatch):
    """The merged read (one op for every KIVI lane) gives the per-lane read's logits, and the independent oracle's."""
    from kvcompress.kernels.kivi import PackedLanes
    from kvcompress.plugins import kivi

    model, stack = stacked
    ids = torch.randint(1, 256, (1, 130), generator=torch.Generator().manual_seed(3))
    merged, cache = _logits(model, stack, ids, static)
    for i in range(2):  # one segment over every head; layer 0's head 2 (no lane) is never valid in it
        segs = cache.compressed_layers[i].middle.segments()
        assert len(segs) == 1 and isinstance(segs[0].packed, PackedLanes) and segs[0].heads is None
        assert len(segs[0].packed.lanes) == (2 if i == 0 else 3)
        assert (segs[0].valid.dim() == 3 and not segs[0].valid[:, 2].any()) if i == 0 else segs[0].valid.dim() == 2
    with monkeypatch.context() as m:
        m.setattr(kivi.MergedLanes, "plan", classmethod(lambda cls, *a, **k: None))
        per_lane, _ = _logits(model, stack, ids, static)
    assert (merged - per_lane).abs().max().item() < 1e-5
    if not static:
        from reference import decode_chunks, middle_oracle_logits

        ref = middle_oracle_logits(model, ids, decode_chunks(70, ids.shape[1]), sinks=3, recent=24, flush=16,
                                   keep=_keep(), bits=2, group=16)
        assert (merged - ref).abs().max().item() < 1e-4


def test_static_store_keeps_the_per_head_validity_as_it_writes():
    """A static LeanK + KIVI middle with a head without a lane: its segment's per-head validity is a buffer the store
    rewrites when its validity changes (a flush, ``retain``, ``reset``, ``map_batch``) - the same tensor read after
    read, always ``valid & covered`` - so a decode read runs no op for it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from kvcompress.kernels import benchutil

    shape = benchutil.Shape("tiny", 16, 8, 32)  # LeanK 70 %: head 0 keeps no channel
    layer = benchutil.build_static_layer("leank70-kivi2", shape, 2, 150, "cpu", torch.Generator().manual_seed(5),
                                         regions={"sinks": 4, "window": 16, "flush": 32})
    store = layer.middle

    def check():
        seg = store.segments()[0]
        want = store.ring.valid.unsqueeze(1) & store.merged.covered.view(1, -1, 1)
        assert seg.valid is store._head_valid and torch.equal(seg.valid, want)
        return seg.valid

    first = check()
    assert first[:, 1:].any() and not first[:, 0].any()

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    seen: list[str] = []
    with Ops():
        store.segments()
    assert not [n for n in seen if "and" in n], seen  # no validity op per read
    keep = torch.rand(store.ring.valid.shape, generator=torch.Generator().manual_seed(7)) > 0.5
    store.retain(keep)
    assert check() is first  # rewritten in place: a captured graph reads the same address
    store.map_batch(lambda t: t.flip(0))
    check()
    store.reset()
    assert not check().any()


def test_compiled_static_read_is_one_graph_with_one_op():
    """A static layer's decode read (``StaticLayer._read``: the sinks + window buffer and the middle's segments, what a
    compiled decode step runs), LeanK 70 % + KIVI-2 as the GPU benchmark builds it, compiled in one graph
    (``fullgraph``): every KIVI lane is read by one ``kvcompress::kivi_lanes_partial`` node, equal to eager, and the
    live length moving (more tokens) recompiles nothing."""
    from kvcompress.kernels import benchutil, ops

    shape = benchutil.Shape("tiny", 16, 8, 32)  # LeanK 70 %: kept 0/8/8/8/8/8/16/24 -> 3 lanes, head 0 none
    layer = benchutil.build_static_layer("leank70-kivi2", shape, 2, 150, "cpu", torch.Generator().manual_seed(5),
                                         regions={"sinks": 4, "window": 16, "flush": 32})
    seg = benchutil.static_segments(layer)[1:]
    assert len(seg) == 1 and len(seg[0].packed.lanes) == 3 and seg[0].heads is None
    assert not seg[0].valid[:, 0].any()  # head 0 keeps no channel: no lane, never valid
    graphs = []

    def backend(gm, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend

        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)

    q = torch.randn(2, 16, 1, 32, generator=torch.Generator().manual_seed(6)).half()
    torch._dynamo.reset()
    try:
        f = torch.compile(lambda q: benchutil.static_read(layer, q, 32 ** -0.5), fullgraph=True, backend=backend)
        got = f(q)
        eager = benchutil.static_read(layer, q, 32 ** -0.5)
        benchutil.fill_static_layer(layer, 32, torch.Generator().manual_seed(7))  # one more flushed block
        with torch._dynamo.config.patch(error_on_recompile=True):
            again = f(q)
        eager_again = benchutil.static_read(layer, q, 32 ** -0.5)
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets.count(ops._OPS["kivi_lanes_partial"]) == 1 and ops._OPS["kivi_partial"] not in targets
    assert torch.equal(got, eager) and torch.equal(again, eager_again) and not torch.equal(got, again)


# ----------------------------------------------------------------------------- GPU (never in CI)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(CASES) + ["llama-b4-4k"])
def test_triton_kernel_on_gpu_matches_reference(name):
    """The compiled kernel (inline-PTX dequantisation, tensor-core dots, the op's resolved configuration and its
    cached launch plan) against the reference and the float64 oracle, on a real GPU."""
    from kvcompress.kernels import ops
    from kvcompress.kernels.kivi import lanes_reference, lanes_triton

    if name == "llama-b4-4k":  # the benchmark's Llama layout: kept 0/32/32/32/32/32/64/96, 4001 of 4096 slots live
        make_kw = dict(batch=4, counts=(0, 32, 32, 32, 32, 32, 64, 96), tokens=4096, live=4001, seed=11)
    else:
        make_kw = CASES[name][0]
    q, region = make_region(**make_kw)
    q = q.cuda()
    lanes = tuple(lanes_reference.KiviLane(*(None if x is None else x.cuda() for x in lane)) for lane in region.lanes)
    region = lanes_reference.PackedLanes(region.bits, region.group, lanes, region.valid.cuda(), region.num_heads,
                                         region.head_dim, length=None if region.length is None else
                                         region.length.cuda())
    scale = q.shape[-1] ** -0.5
    ref = lanes_reference.kivi_lanes_attention_partial(q, region, scale)
    base = ops._kivi_triton_base(region.bits, region.group, q.shape[-1], region.v_dim, region.v_group)
    for _ in range(2):  # plans, then reuses the cached plan
        got = lanes_triton.kivi_lanes_attention_partial(q, region, scale, base=base)
        assert close(got, ref) == ""
    assert getattr(region.valid, lanes_triton.PLAN_ATTR, None) is not None
    exact = oracle(q.cpu(), lanes_reference.PackedLanes(
        region.bits, region.group, tuple(lanes_reference.KiviLane(*(None if x is None else x.cpu() for x in lane))
                                         for lane in region.lanes), region.valid.cpu(), region.num_heads,
        region.head_dim, length=None if region.length is None else region.length.cpu()), scale)
    assert close(tuple(x.cpu() for x in got), exact) == ""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(CASES) + list(EMULATED) + ["llama-b4-4k", "smollm2-b3-4k", "llama-b2-kivi4",
                                  "llama-b2-bf16"])
def test_cuda_lanes_kernel_on_gpu_matches_reference(name):
    """The CUDA lanes kernel (one launch over every lane, the plain CUDA kernel's inner loop) against the reference and
    the float64 oracle, on a real GPU: every CASES / EMULATED region (odd live lengths, left padding, dead rows, heads
    without a lane, shared quarter key words) and the benchmark's layouts at 4k slots."""
    from kvcompress.kernels import ops
    from kvcompress.kernels.kivi import cuda_kernel, lanes_cuda, lanes_reference

    if not cuda_kernel.nvcc_path():
        pytest.skip("no nvcc")
    if name == "llama-b4-4k":  # the benchmark's Llama layout: kept 0/32/32/32/32/32/64/96, 4001 of 4096 slots live
        make_kw = dict(batch=4, counts=(0, 32, 32, 32, 32, 32, 64, 96), tokens=4096, live=4001, seed=11)
    elif name == "smollm2-b3-4k":  # SmolLM2 heads at LeanK 70 %: kept 0 / 16 / 16 ... (3 kv heads, d 64)
        make_kw = dict(batch=3, heads=3, rows=3, head_dim=64, counts=(0, 16, 48), tokens=4096, live=4093, seed=12)
    elif name == "llama-b2-kivi4":
        make_kw = dict(batch=2, bits=4, counts=(0, 32, 32, 48, 32, 32, 64, 96), tokens=2048, live=1999, seed=13)
    elif name == "llama-b2-bf16":  # a bf16 model's query (read as fp16, one cast)
        make_kw = dict(batch=2, counts=(0, 32, 32, 48, 32, 32, 64, 96), tokens=1024, live=1001, seed=14)
    else:
        make_kw = CASES[name][0] if name in CASES else EMULATED[name]
    q, region = make_region(**make_kw)
    q = q.cuda() if name != "llama-b2-bf16" else q.cuda().bfloat16()
    lanes = tuple(lanes_reference.KiviLane(*(None if x is None else x.cuda() for x in lane)) for lane in region.lanes)
    region = lanes_reference.PackedLanes(region.bits, region.group, lanes, region.valid.cuda(), region.num_heads,
                                         region.head_dim, length=None if region.length is None else
                                         region.length.cuda())
    scale = q.shape[-1] ** -0.5
    if region.group < cuda_kernel.TILE:  # the CUDA kernels read whole 32-token tiles of one key group
        assert not lanes_cuda.supports(q, region) and "group" in lanes_cuda.problem(q, region)
        return
    assert lanes_cuda.supports(q, region)
    ref = lanes_reference.kivi_lanes_attention_partial(q, region, scale)
    for _ in range(2):  # plans, then reuses the cached plan
        got = lanes_cuda.kivi_lanes_attention_partial(q, region, scale, base=ops._kivi_cuda_base(region.bits))
        assert close(got, ref) == ""
    via_op = ops.kivi_lanes_attention(q, region, scale, impl="cuda")
    assert close(via_op, ref) == ""
    # a split count per lane (lane_balance, the default since session 54: wider lanes more, narrower fewer, the CTAs
    # past a lane's count empty) and one count for every lane (lane_balance off)
    for balance in (True, False):
        other = lanes_cuda.kivi_lanes_attention_partial(
            q, region, scale, base=dict(ops._kivi_cuda_base(region.bits), lane_balance=balance))
        assert close(other, ref) == "", balance
    exact = oracle(q.cpu(), lanes_reference.PackedLanes(
        region.bits, region.group, tuple(lanes_reference.KiviLane(*(None if x is None else x.cpu() for x in lane))
                                         for lane in region.lanes), region.valid.cpu(), region.num_heads,
        region.head_dim, length=None if region.length is None else region.length.cpu()), scale)
    assert close(tuple(x.cpu() for x in got), exact) == ""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_static_read_on_gpu_reduce_overhead():
    """The benchmark's static layer (LeanK 70 % + KIVI-2, Llama heads) read by one kivi_lanes_partial launch, compiled
    with CUDA graphs (``mode="reduce-overhead"``), equals the per-lane read."""
    from kvcompress.kernels import benchutil

    shape = benchutil.SHAPES[0]
    gen = torch.Generator(device="cuda").manual_seed(0)
    layer = benchutil.build_static_layer("leank70-kivi2", shape, 2, 4096, "cuda", gen)
    assert layer.middle.merged is not None and layer.middle.lanes_kernel in ("cuda", "triton")
    q = torch.randn(2, shape.q_heads, 1, shape.head_dim, device="cuda", dtype=torch.float16, generator=gen)
    scale = shape.head_dim ** -0.5
    eager = benchutil.static_read(layer, q, scale)
    torch._dynamo.reset()
    f = torch.compile(lambda q: benchutil.static_read(layer, q, scale), fullgraph=True, mode="reduce-overhead")
    for _ in range(3):
        torch.compiler.cudagraph_mark_step_begin()
        got = f(q).clone()
    torch._dynamo.reset()
    merged, region = layer.middle.merged, layer.middle._region
    layer.middle.merged = None  # the per-lane read (one KIVI launch per lane)
    per_lane = benchutil.static_read(layer, q, scale)
    layer.middle.merged, layer.middle._region = merged, region
    torch.testing.assert_close(got.float(), eager.float(), atol=2e-3, rtol=1e-2)
    torch.testing.assert_close(eager.float(), per_lane.float(), atol=2e-3, rtol=1e-2)


if __name__ == "__main__" and "--worker" in sys.argv:
    collect(_interpreter_cases(), sys.argv[sys.argv.index("--worker") + 1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_large_batch_reads_lanes_one_by_one():
    """From MERGE_MAX_ROW_HEADS rows x kv heads and PER_LANE_MIN_TOKENS slots a static CUDA store keeps its lanes as
    separate segments (the per-lane reads were faster there on the H200); the read still equals the reference read
    of the same layer.  A shorter store of as many rows stays merged."""
    from kvcompress.kernels import benchutil
    from kvcompress.plugins.kivi import MERGE_MAX_ROW_HEADS, PER_LANE_MIN_TOKENS

    os.environ["KVCOMPRESS_KIVI_CUDA"] = "0"  # the rule is the Triton lanes kernel's (the CUDA one stays merged)
    try:
        _large_batch_reads_lanes_one_by_one(benchutil, MERGE_MAX_ROW_HEADS, PER_LANE_MIN_TOKENS)
    finally:
        del os.environ["KVCOMPRESS_KIVI_CUDA"]


def _large_batch_reads_lanes_one_by_one(benchutil, MERGE_MAX_ROW_HEADS, PER_LANE_MIN_TOKENS):
    shape = benchutil.SHAPES[0]
    batch = -(-MERGE_MAX_ROW_HEADS // shape.kv_heads)
    gen = torch.Generator(device="cuda").manual_seed(0)
    short = benchutil.build_static_layer("leank70-kivi2", shape, batch, 1024, "cuda", gen)
    assert short.middle.merged is not None
    del short
    layer = benchutil.build_static_layer("leank70-kivi2", shape, batch, 2 * PER_LANE_MIN_TOKENS, "cuda", gen)
    assert layer.middle.ring.columns >= PER_LANE_MIN_TOKENS
    assert layer.middle.merged is None and len(layer.middle.segments()) == len(layer.middle.lanes) > 1
    q = torch.randn(batch, shape.q_heads, 1, shape.head_dim, device="cuda", dtype=torch.float16, generator=gen)
    scale = shape.head_dim ** -0.5
    got = benchutil.static_read(layer, q, scale)  # [B, 1, Hq, Dv]
    from kvcompress.kernels.attention.reference import segment_attention

    ref = segment_attention(q.float(), benchutil.static_segments(layer), layer.seen.view(1) - 1, scale)
    assert (got.float().transpose(1, 2) - ref.float()).abs().max().item() <= 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_lanes_length_read_on_device_in_a_graph():
    """The CUDA lanes kernel reads the region's live length on the device (``Params::len``): one captured CUDA graph,
    replayed after the length tensor changes in place (0, inside a tile, a tile boundary, past the capacity), matches
    the reference at each length."""
    from kvcompress.kernels.kivi import cuda_kernel, lanes_cuda, lanes_reference

    if not cuda_kernel.nvcc_path():
        pytest.skip("no nvcc")
    q, region = make_region(batch=3, counts=(0, 32, 32, 48, 32, 32, 64, 96), tokens=256, live=256, seed=21)
    q = q.cuda()
    lanes = tuple(lanes_reference.KiviLane(*(None if x is None else x.cuda() for x in lane)) for lane in region.lanes)
    length = torch.tensor(256, device="cuda")
    region = lanes_reference.PackedLanes(region.bits, region.group, lanes, region.valid.cuda(), region.num_heads,
                                         region.head_dim, length=length)
    scale = q.shape[-1] ** -0.5
    lanes_cuda.kivi_lanes_attention_partial(q, region, scale)  # plans (one host check of the lanes) before capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = lanes_cuda.kivi_lanes_attention_partial(q, region, scale)
    for n in (256, 0, 77, 128, 300):
        length.fill_(n)
        g.replay()
        torch.cuda.synchronize()
        assert close(got, lanes_reference.kivi_lanes_attention_partial(q, region, scale)) == "", n
