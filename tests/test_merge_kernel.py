"""The region merge as one op (``kvcompress::merge_partials``; Triton: kernels/attention/merge_triton.py).

The op's semantics is the reference merge (:func:`kvcompress.kernels.attention.reference.merge_partials`) and the cast
to the query's dtype; its cases (``opcases.merge_case``) run through the generic op tests of tests/test_kernel_ops.py
(opcheck, compiled graphs, the Triton kernel under the interpreter against the reference, the GPU tests).  Here: the
read path uses it exactly when the layer chose it, with the same result as the per-op merge, and a float64 oracle
of the merge itself.
"""

from __future__ import annotations

import pytest
import torch


def _segments(batch=2, kv_heads=2, group=3, tokens=(40, 17), d=32, seed=0):
    from kvcompress.state import Segment

    g = torch.Generator().manual_seed(seed)
    segs = []
    for t in tokens:
        valid = torch.rand(batch, t, generator=g) < 0.8
        valid[-1] = False  # a row no segment sees
        segs.append(Segment(torch.randn(batch, kv_heads, t, d, generator=g),
                            torch.randn(batch, kv_heads, t, d, generator=g), valid, torch.arange(t)))
    q = torch.randn(batch, kv_heads * group, 1, d, generator=g)
    return q, segs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_read_merges_through_the_op_when_chosen(dtype):
    """``impls["merge_partials"]`` set: one ``kvcompress::merge_partials`` call replaces the per-op merge and the cast
    (on the CPU the op runs the reference: the same numbers); without it, or with sinks, the op is not called."""
    from kvcompress.kernels import ops
    from kvcompress.kernels.attention import attend_segments

    q, segs = _segments()
    q = q.to(dtype)
    segs = [type(s)(s.k.to(dtype), s.v.to(dtype), s.valid, s.positions) for s in segs]
    calls = []
    real = ops._OPS["merge_partials"]

    def spy(*args):
        calls.append(args)
        return real(*args)

    ops._OPS["merge_partials"] = spy
    try:
        plain = attend_segments(q, segs, torch.tensor([100]), 0.3)
        assert not calls
        fused = attend_segments(q, segs, torch.tensor([100]), 0.3, impls={"merge_partials": "triton"})
        assert len(calls) == 1 and len(calls[0][0]) == 2 and calls[0][2] == str(dtype).split(".")[-1]
        sinks = attend_segments(q, segs, torch.tensor([100]), 0.3, impls={"merge_partials": "triton"},
                                sink_logits=torch.zeros(q.shape[1]))
        assert len(calls) == 1  # learned sinks: the reference merge (their term joins the denominator there)
    finally:
        ops._OPS["merge_partials"] = real
    assert fused.dtype == plain.dtype == dtype and fused.shape == plain.shape
    assert torch.equal(fused, plain)
    assert not torch.equal(sinks, plain)
    assert (plain[-1] == 0).all()  # the row no segment sees


def test_merge_matches_float64_oracle():
    """The reference merge (the op's CPU implementation) against a float64 softmax-weighted sum of the partials."""
    from kvcompress.kernels import opcases, ops

    case = opcases.merge_case(parts=4, rows=3, v_dim=16, dtype=torch.float32, seed=3)
    outs, lses = case.args[:4], case.args[4:]
    got = ops.merge_attention(list(zip(outs, lses)), torch.float32, impl="reference")
    lse = torch.stack(lses).double()
    top = lse.amax(0).nan_to_num(neginf=0.0)
    w = torch.exp(lse - top)
    exact = (w.unsqueeze(-1) * torch.stack(outs).double()).sum(0) / w.sum(0).clamp_min(1.0).unsqueeze(-1)
    assert torch.allclose(got.double(), exact, atol=1e-6, rtol=1e-6)
    dead = torch.isinf(lse).all(0)
    assert dead.any() and (got[dead] == 0).all()


def test_merge_op_validates_its_inputs():
    from kvcompress.kernels import ops

    out, lse = torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3)
    with pytest.raises(ValueError, match="dtype one of"):
        ops.merge_attention([(out, lse)], torch.int32, impl="reference")
    with pytest.raises(ValueError, match="one lse per output"):
        torch.ops.kvcompress.merge_partials.default([out, out], [lse], "float32", "reference")
    with pytest.raises(ValueError, match="impl must be one of"):
        torch.ops.kvcompress.merge_partials.default([out], [lse], "float32", "cuda")
    single = ops.merge_attention([(out, lse)], torch.float32, impl="reference")
    assert torch.equal(single, out) and single.data_ptr() != out.data_ptr()  # an op's output never aliases an input


def test_static_layer_chooses_the_merge_once():
    from kvcompress.static import choose_kernels

    assert choose_kernels(torch.device("cpu"), 64, 64, torch.float32)["merge_partials"] == "reference"
