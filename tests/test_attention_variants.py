"""Attention variants (issue 21): Gemma 2's logit soft-capping and gpt-oss' learned attention sinks.

Tiny random Gemma 2 (soft-cap 2.0) and gpt-oss (sink logits ~ N(0, 2)) models, each a sliding-window layer then a
full-attention layer.  Every built-in stack's decode logits are compared with independent oracles that never run
kvcompress: transformers' own eager attention under an explicit mask (``reference.masked_logits``), or one
teacher-forced forward whose attention function rebuilds what the cache holds and applies the variants from the
keywords the model passes it (``reference.view_oracle_logits`` / ``variant_probs``).  Kernels are checked against
their references with a soft-cap on (the Triton kernels under the interpreter, in one subprocess; the KIVI CUDA
kernel through its emulator and an nvcc build); the merge adds the sink logits once.
"""

from __future__ import annotations

import sys

import pytest
import torch

import kvcompress
from interpreter import collect
from interpreter import interpreted as run_interpreted
from models import TINY_SOFTCAP, VARIANT_ARCHS, tiny_model
from reference import (causal_visibility, decode_chunks, masked_logits, middle_oracle_logits, streamed_logits,
                       variant_probs, view_oracle_logits, window_visibility)

TOL = 1e-4
WINDOW = 8  # the tiny models' sliding window


@pytest.fixture(scope="module", params=VARIANT_ARCHS)
def model(request):
    return tiny_model(request.param)


def _ids(length, seed):
    return torch.randint(1, 256, (1, length), generator=torch.Generator().manual_seed(seed))


def _streamed(model, stack, ids, chunks, **kw):
    with kvcompress.compress(model, stack, **kw) as cache:
        return streamed_logits(model, ids, cache, chunks), cache


def _dense(model, ids):
    return masked_logits(model, ids, causal_visibility(ids.shape[1]), sliding_window=WINDOW)


# ----------------------------------------------------------------------------- the tiny models


def _without_variant(model):
    """The same weights with the variant switched off (soft-cap removed / sink logits at -inf)."""
    import copy

    plain = copy.deepcopy(model)
    for m in plain.modules():
        if getattr(m, "attn_logit_softcapping", None) is not None:
            m.attn_logit_softcapping = None
        if isinstance(getattr(m, "sinks", None), torch.nn.Parameter):
            m.sinks.data.fill_(-1e9)
    return plain


def test_the_variant_really_changes_the_tiny_model(model):
    """A read path that dropped the variant would be caught: the logits move by far more than the tolerance."""
    ids = _ids(48, 0)
    assert (_dense(model, ids) - _dense(_without_variant(model), ids)).abs().max().item() > 0.05
    from kvcompress.adapters import hf

    assert hf.model_variants(model) == (
        ["logit soft-capping"] if model.config.model_type == "gemma2" else ["learned attention sinks"])


def test_eager_oracle_applies_the_variant_as_written():
    """``variant_probs`` (the oracles' softmax) against a hand computation on one row."""
    s = torch.tensor([[[[0.5, 3.0, -1.0]]]])
    visible = torch.tensor([True, True, False])
    capped = TINY_SOFTCAP * torch.tanh(s[..., :2] / TINY_SOFTCAP)
    want = torch.softmax(capped, -1)
    assert torch.allclose(variant_probs(s, visible, {"softcap": TINY_SOFTCAP})[..., :2], want)
    sink = torch.tensor([0.7])
    e = torch.exp(s[..., :2])
    got = variant_probs(s, visible, {"s_aux": sink})
    assert torch.allclose(got[..., :2], e / (e.sum() + torch.exp(sink))) and got[..., 2] == 0


# ----------------------------------------------------------------------------- generate: token-identical


@pytest.mark.parametrize("static", [False, True])
def test_empty_stack_generates_like_plain_generate(model, static):
    """Left-padded batch of 2; the first prefill runs the model's eager attention (never transformers' SDPA,
    which refuses a soft-cap); the static cache's reads too."""
    ids = torch.randint(1, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    kw = {"max_cache_len": 48} if static else {}
    with kvcompress.compress(model, None, **kw) as cache:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, cache=cache)
    assert torch.equal(out, ref)
    types = [type(layer).__name__ for layer in cache.layers]
    assert types[1] in ("CompressedCacheLayer",) and types[0] != types[1]  # the sliding layer is transformers'


# ----------------------------------------------------------------------------- decode logits vs oracles


@pytest.mark.parametrize("static", [False, True])
def test_window_matches_masked_eager_oracle(model, static):
    length, sinks, recent = 90, 2, 16
    ids = _ids(length, 2)
    chunks = decode_chunks(30, length, [(50, 4)] if not static else None)
    stack = {"compressors": [{"window": {"sinks": sinks, "recent": recent}}]}
    got, _ = _streamed(model, stack, ids, chunks, **({"max_cache_len": length + 4} if static else {}))
    ref = masked_logits(model, ids, window_visibility(length, chunks, sinks, recent), sliding_window=WINDOW)
    assert (got - ref).abs().max().item() < TOL
    assert (got - _dense(model, ids)).abs().max().item() > 1e-3  # tokens really were evicted


@pytest.mark.parametrize("static", [False, True])
def test_kivi_matches_fake_quant_oracle(model, static):
    length, group, residual = 120, 16, 16
    ids = _ids(length, 3)
    chunks = decode_chunks(50, length)
    stack = {"compressors": [{"kivi": {"bits": 2, "group": group, "residual": residual}}]}
    got, _ = _streamed(model, stack, ids, chunks, **({"max_cache_len": length + 4} if static else {}))
    ref = middle_oracle_logits(model, ids, chunks, recent=residual, flush=group, bits=2, group=group)
    assert (got - ref).abs().max().item() < TOL
    assert (got - _dense(model, ids)).abs().max().item() > 1e-3


def _leank_mask(tmp_path, model):
    from kvcompress.calibration.masks import config_hash, save_mask

    keep = torch.ones(2, 2, 16, dtype=torch.bool)  # layer 0 is a sliding layer: never compressed
    keep[1, 0] = False
    keep[1, 0, 1::2] = True  # layer 1: head 0 keeps 8 channels, head 1 keeps nothing (no middle K or V)
    keep[1, 1] = False
    path = tmp_path / f"{model.config.model_type}.safetensors"
    save_mask(path, keep, {"model": "tiny", "model_config_hash": config_hash(model.config), "ratio": 0.5,
                           "align": 4, "sinks": 2, "local": 16, "method": "trained", "settings": {}})
    return str(path), keep


def test_leank_matches_masked_channel_oracle(model, tmp_path):
    path, keep = _leank_mask(tmp_path, model)
    length = 110
    ids = _ids(length, 4)
    chunks = decode_chunks(40, length, [(70, 5)])
    stack = {"compressors": [{"leank": {"mask": path, "sinks": 3, "local": 16, "flush": 8}}]}
    got, _ = _streamed(model, stack, ids, chunks)
    ref = middle_oracle_logits(model, ids, chunks, sinks=3, recent=16, flush=8, keep=keep)
    assert (got - ref).abs().max().item() < TOL
    assert (got - _dense(model, ids)).abs().max().item() > 1e-3


def test_lowrank_matches_projected_key_oracle(model, tmp_path):
    """The basis comes from kvcompress' own PCA calibration (which runs on these hybrids)."""
    from kvcompress.calibration.lowrank import kv_spectra, load_basis, save_basis
    from kvcompress.calibration.masks import config_hash

    (eigenvalues, vectors), (v_eig, v_vec) = kv_spectra(model, _ids(96, 7).expand(3, 96), skip=2)
    rank = torch.full((2, 2), 8, dtype=torch.int32)
    path = tmp_path / "basis.safetensors"
    save_basis(path, vectors, rank, eigenvalues, {"model": "tiny", "model_config_hash": config_hash(model.config),
                                                  "target": "test", "align": 1, "settings": {}}, (v_vec, rank, v_eig))
    length = 100
    ids = _ids(length, 5)
    chunks = decode_chunks(40, length)
    stack = {"compressors": [{"lowrank": {"basis": str(path), "value_rank": 8, "sinks": 3, "recent": 16,
                                          "flush": 8}}]}
    got, _ = _streamed(model, stack, ids, chunks)
    f = load_basis(path)
    ref = middle_oracle_logits(model, ids, chunks, sinks=3, recent=16, flush=8, basis=f.basis[..., :8],
                               value_basis=f.value_basis[..., :8])
    assert (got - ref).abs().max().item() < TOL
    assert (got - _dense(model, ids)).abs().max().item() > 1e-3


def test_paged_eviction_matches_replayed_policy(model):
    """PagedEviction (full-precision pages, then KIVI pages): the policy replayed on the layer's own keys
    (tests/test_paged_eviction.simulate), read with the variant."""
    from test_paged_eviction import simulate

    length, budget, block = 150, 48, 16
    ids = _ids(length, 6)
    chunks = decode_chunks(60, length)
    stack = {"compressors": [{"paged_eviction": {"budget": budget, "block": block}}]}
    got, _ = _streamed(model, stack, ids, chunks)

    def view(layer, q, k, v):
        scores = (v.norm(dim=-1) / k.norm(dim=-1).clamp(min=1e-6)).mean(dim=1)[0].tolist()
        allowed, middle, _, evictions = simulate(scores, chunks, budget=budget, block=block, sinks=block)
        assert sum(g for _, g in evictions) > 2  # pages really were evicted
        return None, None, middle, allowed

    ref = view_oracle_logits(model, ids, view)
    assert (got - ref).abs().max().item() < TOL


def _ds_view(channels, *, k, sinks, window, decode, group_shared):
    """DoubleSparse oracle: a decode query of a selecting layer reads sinks, its window, itself and the top-``k``
    middle tokens by label score ``q[C] . k[C]`` (16-bit labels).  Soft-capping (strictly increasing) and sink
    logits (one constant per head) leave a head's ranking unchanged, so a head ranks by its raw label scores; a
    group-shared selection ranks by the sum of the group's raw label scores (the project's heuristic: the cap is not
    applied inside that sum).  The reads of the selected tokens apply both variants."""
    def view(layer, q, key, value):
        b, hq, length, d = q.shape
        rep = hq // key.shape[1]
        ch = channels[layer].repeat_interleave(rep, 0)  # [hq, r]
        qc = q.gather(-1, ch[None, :, None, :].expand(b, hq, length, ch.shape[-1]))
        kc = key.repeat_interleave(rep, 1).gather(-1, ch[None, :, None, :].expand(b, hq, length, ch.shape[-1]))
        ls = qc @ kc.transpose(-1, -2)
        allowed = causal_visibility(length).expand(b, hq, length, length).clone()
        for t in range(length):
            lo, hi = sinks, t - window
            if not decode[t] or hi - lo <= k:
                continue
            cand = ls[:, :, t, lo:hi]
            if group_shared:
                cand = cand.reshape(b, -1, rep, hi - lo).sum(2).repeat_interleave(rep, 1)
            row = torch.zeros(b, hq, length, dtype=torch.bool)
            row[..., :t + 1] = True
            row[..., lo:hi] = False
            row.scatter_(-1, cand.topk(k, dim=-1).indices + lo, True)
            allowed[:, :, t] = row
        return None, None, torch.zeros(length, length, dtype=torch.bool), allowed

    return view


@pytest.mark.parametrize("group_shared", [False, True])
def test_double_sparse_matches_top_k_oracle(model, group_shared):
    length, k, sinks, window = 110, 12, 2, 6
    ids = _ids(length, 7)
    chunks = decode_chunks(40, length, [(60, 3)])
    cfg = dict(channels="random", r=8, k=k, sinks=sinks, window=window, dense_layers=0, group_shared=group_shared)
    got, cache = _streamed(model, {"compressors": [{"double_sparse": cfg}]}, ids, chunks)
    decode = torch.zeros(length, dtype=torch.bool)
    for c0, c1 in chunks[1:]:
        decode[c0] = c1 - c0 == 1
    table = cache.pipeline.compressors[0][1].table
    ref = view_oracle_logits(model, ids, _ds_view(table, k=k, sinks=sinks, window=window, decode=decode,
                                                  group_shared=group_shared))
    assert (got - ref).abs().max().item() < TOL
    assert (got - _dense(model, ids)).abs().max().item() > 1e-3


# ----------------------------------------------------------------------------- calibration on these models


def test_calibration_attention_with_alpha_one_is_eager_attention(model):
    """LeanK's calibration attention applies the variant and the sliding window exactly as the model's eager
    attention does (alpha = 1: bit-identical), and alpha really acts on the full-attention layer only."""
    from kvcompress.calibration import attention as attn
    from reference import eager

    ids = torch.randint(1, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), eager(model):
        ref = model(ids).logits
    with torch.no_grad(), attn.scaled_keys(model, attn.ScaledKeys(alpha=torch.ones(2, 2, 16), sinks=3, local=5)):
        assert torch.equal(model(ids).logits, ref)
    alpha = torch.ones(2, 2, 16)
    alpha[1] = 0  # the full-attention layer's middle: gone
    with torch.no_grad(), attn.scaled_keys(model, attn.ScaledKeys(alpha=alpha, sinks=3, local=5)):
        pruned = model(ids).logits
    assert not torch.allclose(pruned, ref, atol=1e-3)
    alpha = torch.ones(2, 2, 16)
    alpha[0] = 0  # the sliding layer is never compressed: its alpha is ignored
    with torch.no_grad(), attn.scaled_keys(model, attn.ScaledKeys(alpha=alpha, sinks=3, local=5)):
        assert torch.equal(model(ids).logits, ref)


def test_calibrate_cli_runs_and_its_files_compress(model, tmp_path, monkeypatch, capsys):
    """``kvcompress calibrate leank (qk, trained, rope) | doublesparse | lowrank`` on the tiny model (a byte
    tokenizer stands in for a real one); the LeanK masks keep the sliding layer whole and prune the full layer;
    every file drives its compressor."""
    import kvcompress.models
    from kvcompress.calibration.masks import load_mask
    from kvcompress.cli import main
    from test_eval_cli import ByteTokenizer

    monkeypatch.setattr(kvcompress.models, "load_model", lambda name=None, dtype=None, device=None:
                        (model, ByteTokenizer()))
    small = ["--samples", "2", "--context", "64"]
    leank = ["calibrate", "leank", "--ratio", "0.5", "--align", "4", "--sinks", "2", "--local", "6", *small]
    runs = {"qk": [*leank, "--method", "qk"], "rope": [*leank, "--method", "rope"],
            "trained": [*leank, "--method", "trained", "--data", "text", "--tail", "8", "--batch", "1", "--steps", "2",
                        "--ft-steps", "1", "--quiet"],
            "ds": ["calibrate", "doublesparse", "--channels", "4", *small],
            "lowrank": ["calibrate", "lowrank", "--rank", "8", "--align", "8", "--quiet", *small]}
    for name, argv in runs.items():
        assert main([*argv, "--out", str(tmp_path / f"{name}.safetensors")]) == 0, capsys.readouterr().err
        if name in ("qk", "rope", "trained"):
            keep = load_mask(tmp_path / f"{name}.safetensors", model.config).keep
            assert bool(keep[0].all()) and 0.3 < float(keep[1].float().mean()) < 0.7, name
    stacks = [{"leank": {"mask": str(tmp_path / "trained.safetensors"), "sinks": 2, "local": 8, "flush": 4}},
              {"double_sparse": {"channels": str(tmp_path / "ds.safetensors"), "k": 4, "sinks": 2, "window": 4,
                                 "dense_layers": 0}},
              {"lowrank": {"basis": str(tmp_path / "lowrank.safetensors"), "sinks": 2, "recent": 8, "flush": 4}}]
    ids = _ids(30, 9)
    for entry in stacks:
        with kvcompress.compress(model, {"compressors": [entry]}) as cache:
            out = model.generate(ids, max_new_tokens=8, do_sample=False, cache=cache)
        assert out.shape == (1, 38) and cache.compressed_layers[0].middle.num_tokens > 0, entry


# ----------------------------------------------------------------------------- compiled static decode


def test_compiled_static_decode_equals_eager():
    """KIVI + window under a static cache of gpt-oss (learned sinks: a parameter reaching the merge; its sliding
    layers through the model's eager attention): the decode step traced with fullgraph=True (no graph break)
    equals the eager static run, which matches the oracles above.  (Gemma 2's soft-cap is a Python float, the
    same code path; one architecture keeps the CI time down.)"""
    model = tiny_model("gpt_oss")
    stack = {"compressors": [{"window": {"sinks": 0, "recent": 48}}, {"kivi": {"bits": 2, "group": 16,
                                                                                "residual": 16}}]}
    ids = _ids(90, 8)
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        with kvcompress.compress(model, stack, max_cache_len=96) as cache, torch.no_grad():
            step = torch.compile(model.forward, backend="aot_eager", fullgraph=True) if compiled else model.forward
            out = [model(ids[:, :40], cache=cache).logits[:, -1]]
            for t in range(40, ids.shape[1]):
                out.append(step(input_ids=ids[:, t:t + 1], position_ids=torch.tensor([[t]]), cache=cache)
                           .logits[:, -1])
        runs.append(torch.cat(out))
    torch._dynamo.reset()
    assert (runs[0] - runs[1]).abs().max().item() <= 1e-5


# ----------------------------------------------------------------------------- the read path's merge


def _dense_joint(query, k, v, mask, scale, softcap, sinks):
    """One softmax over every key and the sink logit, written out for dense keys (no kvcompress code)."""
    b, hq, q_len, d = query.shape
    rep = hq // k.shape[1]
    s = (query.float() @ k.float().repeat_interleave(rep, 1).transpose(-1, -2)) * scale
    s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask, float("-inf"))
    s = torch.cat([s, sinks.float().view(1, hq, 1, 1).expand(b, hq, q_len, 1)], -1)
    return (torch.softmax(s, -1)[..., :-1] @ v.float().repeat_interleave(rep, 1))


def test_merged_partials_add_the_sinks_once():
    """Three dense regions read as three partials and merged: equal to one softmax with the sink in the
    denominator once (a per-partial sink would count it three times)."""
    from kvcompress.kernels.attention import attend_segments, segment_attention
    from kvcompress.state import Segment

    g = torch.Generator().manual_seed(0)
    b, hq, hkv, d, q_len = 2, 4, 2, 16, 3
    q = torch.randn(b, hq, q_len, d, generator=g)
    parts = [(torch.randn(b, hkv, n, d, generator=g) * 2, torch.randn(b, hkv, n, d, generator=g)) for n in (5, 7, 4)]
    valid = [torch.rand(b, n, generator=g) > 0.3 for n in (5, 7, 4)]
    valid[1][1] = False  # row 1: a region with no valid key
    pos = [torch.arange(0, 5), torch.arange(5, 12), torch.arange(12, 16)]
    segs = [Segment(k, v, ok, p) for (k, v), ok, p in zip(parts, valid, pos)]
    qpos = torch.arange(13, 16)
    sinks = torch.randn(hq, generator=g) * 2
    got = attend_segments(q, segs, qpos, 0.3, softcap=1.5, sink_logits=sinks)
    k = torch.cat([p[0] for p in parts], 2)
    v = torch.cat([p[1] for p in parts], 2)
    allpos = torch.cat(pos)
    mask = (torch.cat(valid, 1)[:, None, None, :] & (allpos[None, :] <= qpos[:, None])[None, None])
    ref = _dense_joint(q, k, v, mask, 0.3, 1.5, sinks)
    assert (got - ref).abs().max().item() < 1e-5
    assert (segment_attention(q, segs, qpos, 0.3, softcap=1.5, sink_logits=sinks) - ref).abs().max().item() < 1e-5
    once_per_part = attend_segments(q, segs, qpos, 0.3, softcap=1.5)  # no sink: must differ
    assert (once_per_part - ref).abs().max().item() > 1e-2


def test_mixed_segments_with_variants_equal_the_joint_reference():
    """Packed KIVI, LeanK-style lanes (head subsets, gathered channels), a token selection and dense regions:
    the partial read path equals the joint-softmax reference with soft-cap and sinks."""
    from kvcompress.kernels.attention import attend_segments, segment_attention
    from kvcompress.kernels.kivi.reference import PackedKV, quantize_keys, quantize_values
    from kvcompress.state import HeadGroup, Segment, TokenSelection

    g = torch.Generator().manual_seed(1)
    b, hq, hkv, d = 2, 4, 2, 16
    q = torch.randn(b, hq, 1, d, generator=g)
    kp, vp = torch.randn(b, hkv, 32, d, generator=g) * 2, torch.randn(b, hkv, 32, d, generator=g)
    packed = PackedKV(2, 16, *quantize_keys(kp, 2, 16), *quantize_values(vp, 2, 16),
                      torch.rand(b, 32, generator=g) > 0.2)
    lane = HeadGroup(torch.tensor([1]), None, None, channels=torch.tensor([[0, 3, 5, 8, 9, 12, 14, 15]]))
    kl, vl = torch.randn(b, 1, 10, 8, generator=g) * 2, torch.randn(b, 1, 10, d, generator=g)
    kd, vd = torch.randn(b, hkv, 20, d, generator=g) * 2, torch.randn(b, hkv, 20, d, generator=g)
    index = torch.stack([torch.randperm(20, generator=g)[:6] for _ in range(b * hq)]).view(b, hq, 1, 6)
    zero = torch.zeros((), dtype=torch.long)
    segs = [Segment(None, None, packed.valid, zero.expand(32), packed=packed),
            lane.attach(Segment(kl, vl, None, zero.expand(10))),
            Segment(kd, vd, None, zero.expand(20), select=TokenSelection(index)),
            Segment(torch.randn(b, hkv, 3, d, generator=g), torch.randn(b, hkv, 3, d, generator=g), None,
                    torch.arange(40, 43))]
    qpos = torch.tensor([42])
    sinks = torch.randn(hq, generator=g) * 2
    got = attend_segments(q, segs, qpos, 0.25, softcap=1.0, sink_logits=sinks)
    ref = segment_attention(q, segs, qpos, 0.25, softcap=1.0, sink_logits=sinks)
    assert (got - ref).abs().max().item() < 1e-5
    plain = segment_attention(q, segs, qpos, 0.25)
    assert (got - plain).abs().max().item() > 1e-2


# ----------------------------------------------------------------------------- registered ops with a soft-cap


SOFTCAP = 0.8


def _capped_cases(device="cpu"):
    """The attention ops' small cases (kernels/opcases.py) read with a soft-cap, by name."""
    from kvcompress.kernels import opcases

    return {c.name: c for c in opcases.small_cases(device, softcap=SOFTCAP) if c.op in opcases.OUTPUT_OPS}


def _plain_twin(case):
    from kvcompress.kernels import opcases

    return {c.name: c for c in opcases.small_cases()}[case.name.rsplit("-cap", 1)[0]]


@pytest.mark.parametrize("name", list(_capped_cases()))
def test_ops_take_the_soft_cap(name):
    """Every attention op: the soft-cap reaches the op (its ``softcap`` argument, just before ``impl``), the capped
    reference differs from the plain one, opcheck passes with a cap, and a fullgraph trace holds the op."""
    from kvcompress.kernels import opcases

    case = _capped_cases()[name]
    got, plain = case.reference(), _plain_twin(case).reference()
    assert (got[0] - plain[0]).abs().max().item() > 1e-3
    args = opcases.op_args(case)
    assert args[-2] == pytest.approx(SOFTCAP)
    torch.library.opcheck(getattr(torch.ops.kvcompress, case.op).default, args)
    torch._dynamo.reset()
    out = torch.compile(case.fn("reference"), fullgraph=True, backend="aot_eager")(*case.args)
    assert all(torch.equal(a, r) for a, r in zip(out, got))


def _interpreter_cases() -> dict:
    """The ops' CUDA implementations (Triton kernels) with a soft-cap, on CPU tensors, against the capped reference;
    and the grouped lanes kernel inside attend_segments with soft-cap and sinks."""
    from kvcompress.kernels import opcases, ops

    def run(case):
        def go():
            args = opcases.op_args(case)
            got = ops.CUDA_IMPLS[case.op](*args[:-1], "triton")
            ok, err, msg = case.check(got, case.reference())
            return {"ok": ok, "err": err, "msg": msg}
        return go

    def fused_read():
        from kvcompress.kernels.attention import attend_segments, segment_attention
        from kvcompress.state import HeadGroup, Segment

        g = torch.Generator().manual_seed(3)
        b, hq, hkv, d = 2, 4, 2, 16
        q = torch.randn(b, hq, 1, d, generator=g)
        lane = HeadGroup(torch.tensor([0]), None, None, channels=torch.arange(0, 16, 2).view(1, 8))
        zero = torch.zeros((), dtype=torch.long)
        segs = [lane.attach(Segment(torch.randn(b, 1, 40, 8, generator=g) * 2, torch.randn(b, 1, 40, d, generator=g),
                                    torch.rand(b, 40, generator=g) > 0.2, zero.expand(40))),
                Segment(torch.randn(b, hkv, 9, d, generator=g) * 2, torch.randn(b, hkv, 9, d, generator=g), None,
                        torch.arange(9))]
        sinks = torch.randn(hq, generator=g) * 2
        qpos = torch.tensor([9])
        got = attend_segments(q, segs, qpos, 0.25, fused=True, softcap=1.0, sink_logits=sinks)
        ref = segment_attention(q, segs, qpos, 0.25, softcap=1.0, sink_logits=sinks)
        err = (got - ref).abs().max().item()
        return {"ok": err < 3e-3, "err": err, "msg": f"max |fused - ref| {err:.2e}"}

    return {**{name: run(case) for name, case in _capped_cases().items()}, "fused-lanes-read": fused_read}


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return run_interpreted(__file__, tmp_path_factory.mktemp("variants"), OMP_NUM_THREADS="1")


@pytest.mark.parametrize("name", list(_capped_cases()) + ["fused-lanes-read"])
def test_triton_kernels_apply_the_soft_cap_under_interpreter(interpreted, name):
    res = interpreted[name]
    assert "error" not in res, res.get("error")
    assert res["ok"], f"{name}: {res['msg']}"


# ----------------------------------------------------------------------------- the KIVI CUDA kernel


def test_kivi_cuda_emulator_applies_the_soft_cap():
    """The CUDA kernel's dataflow model (same fragment mapping; the soft-cap on each score fragment before masking)
    against the capped reference; the cap really moves the result."""
    from kvcompress.kernels.kivi import cuda_kernel as ck
    from kvcompress.kernels.kivi.reference import kivi_attention_partial
    from test_kivi_cuda import check, make_case

    q, packed = make_case("b2-d64-gqa3", emulated=True)
    scale = q.shape[-1] ** -0.5
    out, lse = ck.emulate(q, packed, scale, softcap=0.7)
    ref_out, ref_lse = kivi_attention_partial(q, packed, scale, softcap=0.7)
    check(out, lse, ref_out, ref_lse, q.shape[2], ref_out.shape[-1])
    assert (ref_out - kivi_attention_partial(q, packed, scale)[0]).abs().max().item() > 0.1


@pytest.mark.parametrize("bits,dk,dv", [(2, 128, 128), (4, 64, 64)])
def test_kivi_cuda_softcap_build_compiles_without_spills(bits, dk, dv, tmp_path):
    import re
    import subprocess

    from kvcompress.kernels.kivi import cuda_kernel as ck

    if not ck.nvcc_path():
        pytest.skip("nvcc not on the PATH")
    out = tmp_path / "k.cubin"
    cmd = [ck.nvcc_path(), "-O3", "--use_fast_math", "-std=c++17", "-cubin", "-gencode=arch=compute_90a,code=sm_90a",
           "-Xptxas", "-v", f"-DKIVI_BITS={bits}", f"-DKIVI_DK={dk}", f"-DKIVI_DV={dv}", "-DKIVI_SOFTCAP=1",
           f"-DKIVI_MIN_BLOCKS={ck.DEFAULT_CONFIG['min_blocks']}", "-o", str(out), str(ck.SOURCE)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", res.stderr)
    assert spills and all(s == ("0", "0") for s in spills), res.stderr


# ----------------------------------------------------------------------------- GPU (never in CI)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(_capped_cases()))
def test_every_implementation_applies_the_soft_cap_on_gpu(name):
    from kvcompress.kernels import ops

    case = _capped_cases("cuda")[name]
    ref = case.reference()
    for impl in ops.OPS[case.op]:
        if impl == "cuda" and ops.choose(case.op, "cuda", **case.facts) != "cuda":
            continue
        ok, err, msg = case.check(case.fn(impl)(*case.args), ref)
        assert ok, f"{name} [{impl}]: {msg}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", VARIANT_ARCHS)
def test_kivi_static_decode_on_gpu_matches_the_cpu_oracle(arch):
    """The fused kernels chosen on CUDA (the Triton KIVI kernel at head_dim 16, the lanes kernel) with the model's
    variant, fp32 model (the kernels' fp16 operands bound the error, far below the variant's own effect)."""
    model = tiny_model(arch).cuda()
    length = 120
    ids = _ids(length, 3)
    chunks = decode_chunks(50, length)
    stack = {"compressors": [{"kivi": {"bits": 2, "group": 16, "residual": 16}}]}
    got, _ = _streamed(model, stack, ids.cuda(), chunks, max_cache_len=length + 4)
    ref = middle_oracle_logits(model.cpu(), ids, chunks, recent=16, flush=16, bits=2, group=16)
    assert (got.cpu() - ref).abs().max().item() < 2e-2


if __name__ == "__main__" and "--worker" in sys.argv:
    collect(_interpreter_cases(), sys.argv[sys.argv.index("--worker") + 1])
