"""Low-rank lanes in the grouped lanes kernel: the decode read of a projecting segment (``qmap`` = ``q U``, no
``channels``) through the fused kernel - a :class:`kvcompress.LinearQueryMap` (the built-in plugin's map) projected by
the kernel itself, any other map's projected query appended to the query as extra columns.

The Triton cases (the fused branch of ``attend_segments``, ``fused=True``) run in ONE worker subprocess under
``TRITON_INTERPRET=1`` (``tests/interpreter.py``) and are compared with today's PyTorch partial path
(``fused=False``) and the joint-softmax oracle (``segment_attention``).  Which implementation read the low-rank
lanes is checked through public seams: the op calls a ``TorchDispatchMode`` sees (the PyTorch partial computes a
``logsumexp``, the fused kernel none) and the graph ``torch.compile(fullgraph=True, backend="aot_eager")`` captures
with the build-time implementation ``impls={"lanes_partial": "triton"}`` (on the CPU the registered op runs its
reference, so this part needs no interpreter).  Inputs are small and fp16 or fp32 (the interpreter computes bf16
``tl.dot`` wrongly and is slow).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from interpreter import collect
from interpreter import interpreted as run_interpreted
from kvcompress.kernels import ops

LANES_OP = ops._OPS["lanes_partial"]  # torch.ops.kvcompress.lanes_partial.default (as tests/test_kernel_ops.py)

ROOT = Path(__file__).resolve().parents[1]

# name -> (batch, kv heads, GQA group, head_dim, low-rank lanes [(heads, rank, tokens)], extras)
CASES = {
    "d64-r16-all-heads": (2, 2, 4, 64, [([0, 1], 16, 37)], {}),
    "d128-r32-two-lanes": (2, 2, 4, 128, [([1], 32, 29), ([0], 16, 45)], {}),
    "d128-r32-fp32-ieee": (2, 2, 4, 128, [([0, 1], 32, 33)], {"dtype": "float32"}),
    "d64-r32-softcap-sinks": (2, 2, 4, 64, [([1, 0], 32, 41)], {"softcap": 0.9, "sink_logits": True}),
    "d64-r16-masked-row": (2, 2, 4, 64, [([0, 1], 16, 23)], {"dead_row": True}),
    # 128 + 96 + 32 fits 256 columns, the third lane (16 more) does not: it stays with the PyTorch partial
    "d128-width-overflow": (1, 2, 4, 128, [([0], 96, 19), ([1], 32, 27), ([0, 1], 16, 21)], {"overflow": 1}),
}
# the same reads with the built-in plugin's query map, a LinearQueryMap: the kernel projects the query in its programs
# (the query keeps its d columns, so no lane overflows the width)
CASES.update({f"{name}-linear": (*case[:-1], {**{k: v for k, v in case[-1].items() if k != "overflow"}, "linear": True})
              for name, case in list(CASES.items())})
ATOL, RTOL = 3e-3, 1e-2  # fp16: the kernel rounds the scaled query to fp16 (like every lane it reads)
ATOL32 = 2e-5  # fp32: IEEE products in the interpreter


def _project(basis: torch.Tensor):
    """The low-rank plugin's query map: ``[b, h, group, q, d] -> [..., r]`` (fp32 product, query dtype)."""
    def project(q: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bhgqd,hdr->bhgqr", q.float(), basis).to(q.dtype)

    return project


def make_case(name: str, device: str = "cpu"):
    """``(query [b, hq, 1, d], segments, q_positions, scale, softcap, sink_logits)``: sinks with a left-padded row,
    the low-rank lanes (odd token counts, random validity), a window and the new token."""
    from kvcompress.state import HeadGroup, LinearQueryMap, Segment

    b, hkv, group, d, spec, extra = CASES[name]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    dtype = getattr(torch, extra.get("dtype", "float16"))

    def t(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    n_sinks, n_window = 5, 7
    sink_valid = torch.ones(b, n_sinks, dtype=torch.bool)
    sink_valid[-1, :2] = False  # left padding: the last row's first columns are pads
    segs = [Segment(t(b, hkv, n_sinks, d), t(b, hkv, n_sinks, d), sink_valid.to(device),
                    torch.arange(n_sinks, device=device))]
    first = n_sinks
    for i, (heads, rank, tokens) in enumerate(spec):
        h = len(heads)
        basis = torch.linalg.qr(torch.randn(h, d, rank, generator=gen)).Q.to(device)  # [h, d, r], orthonormal
        keys = torch.randn(b, h, tokens, d, generator=gen).to(device) * 1.3
        coords = torch.einsum("bhtd,hdr->bhtr", keys, basis).to(dtype)
        valid = torch.rand(b, tokens, generator=gen) > 0.2
        valid[-1, :3] = False
        if i == 0:
            valid[0] = False  # a row with no valid token in this lane
        seg = Segment(coords, t(b, h, tokens, d), valid.to(device), torch.arange(first, first + tokens,
                                                                                  device=device))
        qmap = LinearQueryMap.of(basis, dtype) if extra.get("linear") else _project(basis)
        segs.append(HeadGroup(torch.tensor(heads, device=device), None, None, qmap=qmap).attach(seg))
        first += tokens
    window_valid = torch.rand(b, n_window, generator=gen) > 0.1
    segs.append(Segment(t(b, hkv, n_window, d), t(b, hkv, n_window, d), window_valid.to(device),
                        torch.arange(first, first + n_window, device=device)))
    first += n_window
    q_pos = torch.tensor([first], device=device)
    new_valid = torch.ones(b, 1, dtype=torch.bool)
    if extra.get("dead_row"):  # row 0 sees no key at all: zeros, never NaN
        new_valid[0] = False
        for seg in segs:
            seg.valid[0] = False
    segs.append(Segment(t(b, hkv, 1, d), t(b, hkv, 1, d), new_valid.to(device), q_pos))
    query = t(b, hkv * group, 1, d)
    sink_logits = (torch.randn(hkv * group, generator=gen) * 2).to(device) if extra.get("sink_logits") else None
    return query, segs, q_pos, d ** -0.5, extra.get("softcap"), sink_logits


class _Count(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ``aten.logsumexp`` calls (one per segment the PyTorch partial reads; the fused kernel makes
    none) and ``kvcompress::lanes_partial`` calls."""

    def __init__(self):
        super().__init__()
        self.logsumexp = 0
        self.lanes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.logsumexp:
            self.logsumexp += 1
        if func is LANES_OP:
            self.lanes += 1
        return func(*args, **(kwargs or {}))


def _read(name: str, device: str, **kw):
    from kvcompress.kernels.attention import attend_segments

    query, segs, q_pos, scale, softcap, sink_logits = make_case(name, device)
    with _Count() as count:
        out = attend_segments(query, segs, q_pos, scale, softcap=softcap, sink_logits=sink_logits, **kw)
    return out, count


def run_case(name: str, device: str = "cpu") -> dict:
    """Fused branch (the Triton lanes kernel) against today's PyTorch partials and the joint-softmax oracle."""
    from kvcompress.kernels.attention import segment_attention

    fused, fused_count = _read(name, device, fused=True)
    partial, partial_count = _read(name, device, fused=False)
    query, segs, q_pos, scale, softcap, sink_logits = make_case(name, device)
    oracle = segment_attention(query, segs, q_pos, scale, softcap, sink_logits)
    f, p, o = fused.double().cpu(), partial.double().cpu(), oracle.double().cpu()
    return {
        "shape": list(fused.shape), "dtype": str(fused.dtype),
        "any_nan": bool(torch.isnan(f).any()),
        "err_partial": float((f - p).abs().max()), "err_oracle": float((f - o).abs().max()),
        "close_partial": bool(torch.allclose(f, p, atol=ATOL, rtol=RTOL)),
        "close_oracle": bool(torch.allclose(f, o, atol=ATOL, rtol=RTOL)),
        "dead_row_zero": bool((f[0] == 0).all()),
        "fused_logsumexp": fused_count.logsumexp, "partial_logsumexp": partial_count.logsumexp,
    }


def _worker(path: str) -> None:
    collect({name: (lambda n=name: run_case(n)) for name in CASES}, path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return run_interpreted(__file__, tmp_path_factory.mktemp("lowrank_lanes"))


# ----------------------------------------------------------------------------- Triton (interpreter)


@pytest.mark.parametrize("name", list(CASES))
def test_fused_lowrank_lanes_interpreted(interpreted, name):
    res = interpreted[name]
    assert "error" not in res, res.get("error")
    b, hkv, group, d, spec, extra = CASES[name]
    assert res["shape"] == [b, hkv * group, 1, d]
    assert res["dtype"] == f"torch.{extra.get('dtype', 'float16')}"
    assert not res["any_nan"]
    # today's path reads every segment (sinks, low-rank lanes, window, new token) with a PyTorch partial (one
    # logsumexp each); the fused branch reads all of them in the lanes kernel, except the low-rank lanes that do
    # not fit the kernel's query width
    assert res["partial_logsumexp"] == len(spec) + 3
    assert res["fused_logsumexp"] == extra.get("overflow", 0)
    if extra.get("dtype") == "float32":
        assert res["err_partial"] <= ATOL32 and res["err_oracle"] <= ATOL32, res
    else:
        assert res["close_partial"], f"max |fused - partial| = {res['err_partial']:.2e}"
        assert res["close_oracle"], f"max |fused - oracle| = {res['err_oracle']:.2e}"
    if extra.get("dead_row"):
        assert res["dead_row_zero"]


# ----------------------------------------------------------------------------- dispatch (CPU, no interpreter)


def _recording_backend(graphs: list):
    from torch._dynamo.backends.registry import lookup_backend

    def backend(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)

    return backend


def _f32(name: str):
    from kvcompress.state import LinearQueryMap

    query, segs, q_pos, scale, softcap, sink_logits = make_case(name)
    for seg in segs:
        seg.k, seg.v = seg.k.float(), seg.v.float()
        if isinstance(seg.qmap, LinearQueryMap):  # the map of coordinates stored in fp32
            seg.qmap = LinearQueryMap.of(seg.qmap.basis, torch.float32)
    return query.float(), segs, q_pos, scale, softcap, sink_logits


@pytest.mark.parametrize("name", ["d128-r32-two-lanes", "d64-r32-softcap-sinks", "d128-width-overflow",
                                  "d128-r32-two-lanes-linear", "d128-width-overflow-linear"])
def test_compiled_decode_read_puts_lowrank_lanes_in_the_lanes_op(name):
    """With the build-time implementation ``triton`` (what a static cache on CUDA chooses), the decode read is one
    graph (fullgraph, aot_eager) holding ONE ``kvcompress::lanes_partial`` call over the sinks, every low-rank
    lane that fits and the dense regions, with no PyTorch partial left for them; equal to today's path."""
    from kvcompress.kernels.attention import attend_segments

    query, segs, q_pos, scale, softcap, sink_logits = _f32(name)
    *_, spec, extra = CASES[name]
    overflow = extra.get("overflow", 0)

    def read(q):
        return attend_segments(q, segs, q_pos, scale, impls={"lanes_partial": "triton"}, softcap=softcap,
                               sink_logits=sink_logits)

    torch._dynamo.reset()
    graphs: list = []
    got = torch.compile(read, fullgraph=True, backend=_recording_backend(graphs))(query)
    assert len(graphs) == 1
    calls = [n for n in graphs[0].graph.nodes if n.op == "call_function"]
    lanes = [n for n in calls if n.target is LANES_OP]
    assert len(lanes) == 1
    n_lanes = len(lanes[0].args[3])  # the op's list of K tensors: one per lane
    assert n_lanes == 3 + len(spec) - overflow  # sinks, window, new token + the low-rank lanes that fit
    bases = lanes[0].args[6]
    assert sum(x is not None for x in bases) == (len(spec) if extra.get("linear") else 0)
    assert sum("logsumexp" in str(n.target) for n in calls) == overflow
    with _Count() as count:
        eager = read(query)
    assert count.lanes == 1 and count.logsumexp == overflow
    today = attend_segments(query, segs, q_pos, scale, fused=False, softcap=softcap, sink_logits=sink_logits)
    assert torch.allclose(got, eager, atol=1e-6, rtol=1e-6)
    assert torch.allclose(eager, today, atol=1e-5, rtol=1e-5), float((eager - today).abs().max())


def test_projected_query_fills_appended_columns_of_the_lanes_heads_only():
    """The lanes op receives the model's query plus, per low-rank lane, ``r`` columns holding ``q U`` on the lane's
    kv heads (zeros elsewhere), and channel indices pointing at exactly those columns (dense lanes: the first
    ``d``)."""
    from kvcompress.kernels.attention import attend_segments

    query, segs, q_pos, scale, softcap, sink_logits = _f32("d128-r32-two-lanes")
    seen = {}

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is LANES_OP:
                seen["query"], seen["heads"], seen["channels"] = args[0], args[1], args[2]
            return func(*args, **(kwargs or {}))

    with Spy():
        attend_segments(query, segs, q_pos, scale, impls={"lanes_partial": "triton"})
    b, hkv, group, d, spec, _ = CASES["d128-r32-two-lanes"]
    q5 = query.view(b, hkv, group, 1, d)
    ext = seen["query"]
    assert ext.shape == (b, hkv, group, d + sum(r for _, r, _ in spec))
    assert torch.equal(ext[..., :d], q5.reshape(b, hkv, group, d))
    channels = seen["channels"]
    assert len(channels) == len(segs)  # every segment is a lane, in order
    for i in (0, len(segs) - 2, len(segs) - 1):  # sinks, window, new token: the model's query columns
        assert torch.equal(channels[i], torch.arange(d).expand(hkv, d))
    col = d
    for i, seg, (heads, rank, _) in zip(range(1, 1 + len(spec)), segs[1:], spec):
        channels = seen["channels"][i]
        assert channels.shape == (len(heads), rank)
        assert torch.equal(channels, torch.arange(col, col + rank).expand(len(heads), rank))
        assert torch.equal(seen["heads"][i], torch.tensor(heads))
        projected = seg.qmap(q5.index_select(1, seg.heads)).reshape(b, len(heads), group, rank)
        assert torch.equal(ext[:, heads, :, col:col + rank], projected)
        others = [h for h in range(hkv) if h not in heads]
        assert (ext[:, others, :, col:col + rank] == 0).all()
        col += rank


def test_linear_query_map_passes_its_basis_and_the_models_query():
    """With a :class:`kvcompress.LinearQueryMap` the lanes op receives the model's query unchanged (``d`` columns),
    and each low-rank lane its map's ``weight`` as its basis and no channel list: no projection, cast or
    concatenation runs outside the op.  The compiled read's graph holds no matrix product, einsum or cat."""
    from kvcompress.kernels.attention import attend_segments

    query, segs, q_pos, scale, softcap, sink_logits = make_case("d128-r32-two-lanes-linear")
    seen = {}

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is LANES_OP:
                seen.update(query=args[0], heads=args[1], channels=args[2], k=args[3], bases=args[6])
            return func(*args, **(kwargs or {}))

    with Spy():
        attend_segments(query, segs, q_pos, scale, impls={"lanes_partial": "triton"})
    b, hkv, group, d, spec, _ = CASES["d128-r32-two-lanes-linear"]
    assert seen["query"].shape == (b, hkv, group, d)
    assert torch.equal(seen["query"], query.view(b, hkv, group, d))
    assert len(seen["bases"]) == len(segs)
    for i, seg in enumerate(segs):
        if 1 <= i <= len(spec):
            assert seen["bases"][i] is seg.qmap.weight and seen["channels"][i] is None
            assert seen["k"][i] is seg.k
        else:
            assert seen["bases"][i] is None

    def read(q):
        return attend_segments(q, segs, q_pos, scale, impls={"lanes_partial": "triton"})

    torch._dynamo.reset()
    graphs: list = []
    torch.compile(read, fullgraph=True, backend=_recording_backend(graphs))(query)
    names = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert not [n for n in names if any(w in n for w in ("einsum", "matmul", "bmm", "cat"))], names


@pytest.mark.parametrize("name, only_part", [("d128-r32-two-lanes-linear", True), ("d128-r32-two-lanes", True),
                                             ("d128-width-overflow", False), ("d64-r32-softcap-sinks-linear", False)])
def test_a_read_the_lanes_launch_covers_alone_takes_its_dtype_from_it(name, only_part):
    """When the lanes launch reads every segment (no PyTorch partial left, no learned sinks), it writes the read's
    dtype itself (``out_dtype``): no merge and no cast run after it, in eager calls and in the compiled graph.  Else
    (a lane that does not fit the query width; learned sinks, merged in fp32) its output stays float32.  Both equal
    today's PyTorch path."""
    from kvcompress.kernels.attention import attend_segments

    query, segs, q_pos, scale, softcap, sink_logits = make_case(name)
    seen = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is LANES_OP:
                seen.append(((kwargs or {}).get("out_dtype", args[9]), out[0].dtype))
            return out

    def read(q):
        return attend_segments(q, segs, q_pos, scale, impls={"lanes_partial": "triton"}, softcap=softcap,
                               sink_logits=sink_logits)

    with Spy():
        got = read(query)
    want = query.dtype if only_part else torch.float32
    assert seen == [(str(want)[6:], want)]
    assert got.dtype == query.dtype
    today = attend_segments(query, segs, q_pos, scale, fused=False, softcap=softcap, sink_logits=sink_logits)
    err = float((got.float() - today.float()).abs().max())
    assert torch.allclose(got.float(), today.float(), atol=ATOL, rtol=RTOL), err
    torch._dynamo.reset()
    graphs: list = []
    compiled = torch.compile(read, fullgraph=True, backend=_recording_backend(graphs))(query)
    assert torch.equal(compiled, got)
    nodes = list(graphs[0].graph.nodes)
    first = next(i for i, n in enumerate(nodes) if n.op == "call_function" and n.target is LANES_OP)
    after = [str(n.target) for n in nodes[first + 1:] if n.op in ("call_function", "call_method")]
    casts = [t for t in after if t in ("to", "float", "half", "bfloat16", "type")]
    assert (not casts) if only_part else casts, after


def test_lanes_with_value_basis_or_reference_impl_keep_the_pytorch_partial():
    """A low-rank lane with a value basis (``vmap``: outputs over value coordinates) is not a lane; with the
    reference implementation (the CPU's choice) nothing changes: no lanes op, one partial per segment."""
    from kvcompress.kernels.attention import attend_segments

    query, segs, q_pos, scale, softcap, sink_logits = _f32("d64-r16-all-heads")
    with _Count() as count:
        attend_segments(query, segs, q_pos, scale, impls={"lanes_partial": "reference"})
    assert count.lanes == 0 and count.logsumexp == len(segs)
    d = query.shape[-1]
    lowrank = segs[1]
    v_basis = torch.linalg.qr(torch.randn(2, d, 16, generator=torch.Generator().manual_seed(3))).Q
    segs[1] = dataclasses.replace(lowrank, v=torch.einsum("bhtd,hdr->bhtr", lowrank.v, v_basis),
                                  vmap=lambda o: torch.einsum("bhnr,hdr->bhnd", o.float(), v_basis).to(o.dtype))
    with _Count() as count:
        got = attend_segments(query, segs, q_pos, scale, impls={"lanes_partial": "triton"})
    assert count.lanes == 1 and count.logsumexp == 1
    today = attend_segments(query, segs, q_pos, scale, fused=False)
    assert torch.allclose(got, today, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(CASES))
def test_fused_lowrank_lanes_on_gpu(name):
    res = run_case(name, "cuda")
    *_, spec, extra = CASES[name]
    assert not res["any_nan"] and res["fused_logsumexp"] == extra.get("overflow", 0)
    assert res["close_partial"] and res["close_oracle"], res  # fp32 inputs: TF32 products on the GPU


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.path.insert(0, str(ROOT))
        _worker(sys.argv[2])
