"""DoubleSparse (plugins/double_sparse.py): reductions, layer budgets, label cache, decode logits.

The oracle (:func:`ds_oracle_logits`) never uses kvcompress: one teacher-forced forward whose
registered attention recomputes, per layer, query head and decode position, the label scores
``q[C] . K[C]`` from the model's own post-RoPE keys (fake-quantized per token for 4/2-bit labels),
the top-k middle tokens, and attention over sinks + window + the selected tokens + the token itself.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import kvcompress  # noqa: E402
from kvcompress import ConfigError, parse_stack  # noqa: E402
from models import tiny_model  # noqa: E402
from reference import decode_chunks, fake_quant, streamed_logits  # noqa: E402

TOL = 1e-4


def ds_oracle_logits(model, ids, chunks, *, channels, k, k_min=1, gamma=1.0, dense_layers=2, sinks=0, window=0,
                     bits=16, exact_scores=False, group_shared=False):
    """Logits of one forward where decode query t of layer l reads sinks, window, itself and its top-k_l middle."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    length = ids.shape[1]
    decode = torch.zeros(length, dtype=torch.bool)
    for c0, c1 in chunks[1:]:
        if c1 - c0 == 1:
            decode[c0] = True

    def attn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        layer = module.layer_idx
        b, hq, L, d = query.shape
        hkv = key.shape[1]
        rep = hq // hkv
        q, kf, vf = query.float(), key.float().repeat_interleave(rep, 1), value.float().repeat_interleave(rep, 1)
        s = q @ kf.transpose(-1, -2) * scaling  # [b, hq, L, L]
        ch = channels[layer].repeat_interleave(rep, 0)  # [hq, r]
        qc = q.gather(-1, ch[None, :, None, :].expand(b, hq, L, ch.shape[-1]))
        kc = kf.gather(-1, ch[None, :, None, :].expand(b, hq, L, ch.shape[-1]))
        if bits != 16:
            kc = fake_quant(kc, bits, dim=-1)
        ls = s if exact_scores else qc @ kc.transpose(-1, -2)
        allowed = torch.ones(b, hq, L, L, dtype=torch.bool).tril()
        budget = None if layer < dense_layers else max(k_min, round(k * gamma ** (layer - dense_layers)))
        for t in range(L):
            if not decode[t] or budget is None:
                continue
            lo, hi = sinks, t - window  # middle: [sinks, t - window)
            if hi - lo <= budget:
                continue
            cand = ls[:, :, t, lo:hi]
            if group_shared:  # one selection per kv head: the summed scores of its query heads, for all of them
                cand = cand.view(b, hkv, rep, -1).sum(2).repeat_interleave(rep, 1)
            top = cand.topk(budget, dim=-1).indices + lo
            row = torch.zeros(b, hq, L, dtype=torch.bool)
            row[..., :t + 1] = True
            row[..., lo:hi] = False
            row.scatter_(-1, top, True)
            allowed[:, :, t] = row
        p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
        return (p @ vf).transpose(1, 2).to(query.dtype), None

    ALL_ATTENTION_FUNCTIONS.register("kvcompress_test_ds_oracle", attn)
    ALL_MASK_ATTENTION_FUNCTIONS.register("kvcompress_test_ds_oracle", sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation("kvcompress_test_ds_oracle")
    try:
        with torch.no_grad():
            return model(ids, position_ids=torch.arange(length)[None]).logits[0]
    finally:
        model.set_attn_implementation(previous)


def _stack(**cfg):
    return parse_stack({"compressors": [{"double_sparse": cfg}]})


def _run(model, ids, chunks, **cfg):
    with kvcompress.compress(model, _stack(**cfg)) as cache:
        with torch.no_grad():
            return streamed_logits(model, ids, cache, chunks), cache


def _table(cache):
    comp = cache.pipeline.compressors[0][1]
    return comp.table


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=3)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(1, 256, (1, 96), generator=torch.Generator().manual_seed(5))


def test_plain_double_sparse_reduction(model, ids):
    """gamma = 1, no sinks, no window: top-k over every previous token (random label channels, r = 4)."""
    chunks = decode_chunks(40, 96)
    cfg = dict(channels="random", r=4, k=12, gamma=1.0, sinks=0, window=0, dense_layers=1)
    got, cache = _run(model, ids, chunks, **cfg)
    ref = ds_oracle_logits(model, ids, chunks, channels=_table(cache), k=12, dense_layers=1)
    assert (got - ref).abs().max().item() < TOL
    dense = model(ids).logits[0].detach()
    assert (got - dense).abs().max().item() > 1e-2  # the selection really changes the result


def test_k_at_least_the_tokens_is_dense(model, ids):
    chunks = decode_chunks(30, 96, extra=[(50, 5)])
    got, _ = _run(model, ids, chunks, channels="random", r=4, k=96, sinks=0, window=0, dense_layers=0)
    with torch.no_grad():
        dense = model(ids).logits[0]
    assert (got - dense).abs().max().item() < TOL


def test_all_channels_fp_labels_is_oracle_top_k(model, ids):
    """r = head_dim with full-precision labels selects by the exact attention scores."""
    chunks = decode_chunks(40, 96)
    got, cache = _run(model, ids, chunks, channels="all", k=10, sinks=0, window=0, dense_layers=0)
    ref = ds_oracle_logits(model, ids, chunks, channels=_table(cache), k=10, dense_layers=0, exact_scores=True)
    assert (got - ref).abs().max().item() < TOL


@pytest.mark.parametrize("bits", [16, 4, 2])
def test_double_sparse_pp_decode_matches_oracle(model, ids, bits):
    """Sinks + window + decaying per-layer budgets + dense first layer, chunked prefill, quantized labels."""
    chunks = decode_chunks(24, 96, extra=[(30, 7), (60, 3)])
    cfg = dict(channels="random", r=8, k=16, k_min=6, gamma=0.5, sinks=3, window=5, dense_layers=1,
               label_bits=bits, seed=3)
    got, cache = _run(model, ids, chunks, **cfg)
    ref = ds_oracle_logits(model, ids, chunks, channels=_table(cache), k=16, k_min=6, gamma=0.5,
                           dense_layers=1, sinks=3, window=5, bits=bits)
    assert (got - ref).abs().max().item() < TOL



@pytest.mark.parametrize("bits", [16, 4])
def test_group_shared_selection_matches_oracle(bits):
    """GQA group-shared selection: every query head of a kv head reads the top-k of the group's summed scores."""
    gqa = tiny_model("llama", layers=3)  # 4 query heads on 2 kv heads
    assert gqa.config.num_attention_heads // gqa.config.num_key_value_heads == 2
    ids = torch.randint(1, 256, (1, 90), generator=torch.Generator().manual_seed(8))
    chunks = decode_chunks(30, 90, extra=[(40, 4)])
    cfg = dict(channels="random", r=8, k=12, sinks=2, window=4, dense_layers=1, label_bits=bits, seed=1,
               group_shared=True)
    got, cache = _run(gqa, ids, chunks, **cfg)
    ref = ds_oracle_logits(gqa, ids, chunks, channels=_table(cache), k=12, dense_layers=1, sinks=2, window=4,
                           bits=bits, group_shared=True)
    assert (got - ref).abs().max().item() < TOL
    per_head = ds_oracle_logits(gqa, ids, chunks, channels=_table(cache), k=12, dense_layers=1, sinks=2, window=4,
                                bits=bits)
    assert (got - per_head).abs().max().item() > 1e-3  # a different selection from the per-query-head one


def test_budget_values():
    from kvcompress.plugins.double_sparse import DoubleSparseConfig

    c = DoubleSparseConfig(k=128, k_min=16, gamma=0.5, dense_layers=2)
    assert [c.budget(i) for i in range(7)] == [None, None, 128, 64, 32, 16, 16]
    c = DoubleSparseConfig(k=100, k_min=1, gamma=0.9, dense_layers=0)
    assert [c.budget(i) for i in range(4)] == [100, 90, 81, 73]  # round(72.9) = 73
    assert DoubleSparseConfig(k=7, gamma=1.0).budget(29) == 7


def test_budget_is_applied_per_layer(model, ids):
    """The selection each layer returns has exactly k_l indices per query head."""
    seen = {}
    from kvcompress import layer as layer_module

    orig = layer_module.apply_selection

    def spy(middle, selection):
        seen.setdefault(middle[0].num_tokens, []).append(selection.resolve().index.shape[-1])
        return orig(middle, selection)

    layer_module.apply_selection = spy
    try:
        _run(model, ids[:, :60], decode_chunks(50, 60), channels="random", r=4, k=20, k_min=3, gamma=0.25,
             sinks=0, window=0, dense_layers=0)
    finally:
        layer_module.apply_selection = orig
    for counts in seen.values():
        assert counts == [20, 5, 3]  # layers 0, 1, 2: max(3, round(20 * 0.25^l))


@pytest.mark.parametrize("bits", [16, 4])
def test_label_cache_matches_middle_keys_across_steps(model, ids, bits):
    """After chunked prefill and decode steps, labels are the middle keys on the label channels."""
    from kvcompress.kernels.doublesparse import dequantize_labels

    chunks = decode_chunks(20, 80, extra=[(25, 6), (40, 9)])
    _, cache = _run(model, ids[:, :80], chunks, channels="random", r=8, k=4, sinks=2, window=6, dense_layers=1,
                     label_bits=bits)
    layers = cache.compressed_layers
    assert "double_sparse" not in layers[0].state  # dense layers keep no labels
    for layer in layers[1:]:
        lab = layer.state["double_sparse"]
        (seg,) = layer.middle.segments()
        assert lab.size == seg.num_tokens == 80 - 2 - 6
        assert torch.equal(lab.positions[:lab.size], seg.positions)
        ch = lab.channels
        expect = seg.k.gather(-1, ch.view(1, -1, 1, ch.shape[1]).expand(*seg.k.shape[:3], ch.shape[1]))
        got = dequantize_labels(lab.labels())
        if bits == 16:
            assert torch.equal(got, expect)
        else:
            assert torch.allclose(got, fake_quant(expect, bits, dim=-1), atol=1e-5)
            assert lab.labels().data.shape[-1] == ch.shape[1] * bits // 8  # packed codes


def test_reads_only_selected_tokens_with_padding_batch(model):
    """A left-padded batch of two equals each row alone (per-row validity in scores and gather)."""
    gen = torch.Generator().manual_seed(9)
    a = torch.randint(1, 256, (1, 70), generator=gen)
    b = torch.randint(1, 256, (1, 62), generator=gen)
    cfg = _stack(channels="random", r=4, k=9, sinks=2, window=4, dense_layers=1, label_bits=4)
    outs = []
    for row in (a, b):
        with kvcompress.compress(model, cfg) as cache, torch.no_grad():
            outs.append(model.generate(row, attention_mask=torch.ones_like(row), cache=cache, max_new_tokens=12,
                                       do_sample=False)[0, row.shape[1]:])
    pad = torch.cat([torch.zeros(1, 8, dtype=torch.long), b], 1)
    batch = torch.cat([a, pad], 0)
    mask = torch.cat([torch.ones(1, 70, dtype=torch.long), torch.cat([torch.zeros(1, 8), torch.ones(1, 62)], 1).long()])
    with kvcompress.compress(model, cfg) as cache, torch.no_grad():
        got = model.generate(batch, attention_mask=mask, cache=cache, max_new_tokens=12, do_sample=False)[:, 70:]
    assert torch.equal(got[0], outs[0]) and torch.equal(got[1], outs[1])


@pytest.mark.parametrize("cfg,path,allowed", [
    ({"gamma": 0.0}, "compressors[0].double_sparse.gamma", "(0, 1]"),
    ({"gamma": 1.5}, "compressors[0].double_sparse.gamma", "1"),
    ({"k": 8, "k_min": 9}, "compressors[0].double_sparse.k_min", "<= k (8)"),
    ({"channels": "random"}, "compressors[0].double_sparse.r", "number of random label channels"),
    ({"channels": "nope.safetensors"}, "compressors[0].double_sparse.channels", "existing channel file"),
    ({"label_bits": 8}, "compressors[0].double_sparse.label_bits", "16"),
    ({"channels": "random", "r": 3, "label_bits": 2}, "compressors[0].double_sparse.r", "multiple of 4"),
    ({"window": -1}, "compressors[0].double_sparse.window", "0"),
    ({"topk": 3}, "compressors[0].double_sparse", "topk"),
])
def test_config_errors_name_the_key(cfg, path, allowed):
    with pytest.raises(ConfigError) as exc:
        _stack(**cfg)
    assert str(exc.value).startswith(path) and allowed in str(exc.value)


@pytest.mark.parametrize("evictor", [{"window": {"sinks": 4, "recent": 64}}, {"paged_eviction": {"budget": 64}}])
def test_an_evictor_in_the_stack_is_refused_at_load_time(evictor):
    ds = {"double_sparse": {"channels": "all", "k": 16}}
    with pytest.raises(ConfigError) as exc:  # before any model: parse_stack alone
        parse_stack({"compressors": [evictor, ds]})
    name = next(iter(evictor))
    assert str(exc.value).startswith(f"compressors[0].{name}") and "double_sparse" in str(exc.value)
    parse_stack({"compressors": [ds, {"kivi": {"bits": 4, "group": 16, "residual": 32}}]})  # quantizers are fine


def test_channels_all_with_wrong_r_is_refused(model):
    with pytest.raises(ConfigError, match="r: expected null or head_dim"):
        with kvcompress.compress(model, _stack(channels="all", r=4)):
            pass


def test_channel_file_roundtrip_subset_and_model_refusal(model, tmp_path):
    from kvcompress.calibration.doublesparse import load_channels, rank_channels, save_channels
    from kvcompress.calibration.masks import MaskFileError

    scores = torch.rand(3, 2, 16, generator=torch.Generator().manual_seed(0))
    ranked = rank_channels(scores, 8)
    assert torch.equal(ranked, scores.argsort(-1, descending=True)[..., :8])
    path = tmp_path / "ch.safetensors"
    save_channels(path, ranked, scores, model.config, "tiny", {"windows": 1})
    f = load_channels(path, model.config)
    assert torch.equal(f.channels, ranked) and f.meta["settings"] == {"windows": 1}
    with kvcompress.compress(model, _stack(channels=str(path), r=4)) as cache:
        table = _table(cache)
    assert torch.equal(table, ranked[..., :4].sort(-1).values)  # the 4 best, as a set
    other = tiny_model("llama", layers=2)
    with pytest.raises(MaskFileError, match="channel file made for the model given"):
        load_channels(path, other.config)
    with pytest.raises(ConfigError, match="at most the file's 8"):
        with kvcompress.compress(model, _stack(channels=str(path), r=12)):
            pass


def test_calibrate_cli_validates_before_loading_a_model(capsys):
    from kvcompress.cli import main

    assert main(["calibrate", "doublesparse", "--channels", "0", "--out", "x.safetensors"]) == 2
    assert "--channels: expected an integer >= 1, got 0" in capsys.readouterr().err
    assert main(["calibrate", "doublesparse", "--channels", "16", "--out", "x.bin"]) == 2


def test_calibration_ranks_by_mean_abs_qk(model):
    """calibrate_channels ranks with qk_scores (the shared |q_c k_c| statistic)."""
    from kvcompress.calibration.doublesparse import rank_channels
    from kvcompress.calibration.qk import qk_scores

    toks = torch.randint(1, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    scores = qk_scores(model, toks)
    ch = rank_channels(scores, 4)
    assert ch.shape == (3, 2, 4)
    top = scores.gather(-1, ch)
    rest_max = scores.scatter(-1, ch, float("-inf")).amax(-1)
    assert bool((top.amin(-1) >= rest_max).all())


# ----------------------------------------------------------------------------- the one-kernel select + gather read
# The plugin returns its selection as a LabelTopK (kvcompress.state): the core runs the top-k, in one kernel with the
# gather where `fuse_gather` is on, or unset and fuse_rule takes the read (kernels/doublesparse/triton_kernel.py).

FUSED_CASES = {  # name: (stack config, model layers)
    "per-head": dict(channels="random", r=8, k=12, sinks=3, window=5, dense_layers=1, seed=3),
    "shared-4bit": dict(channels="random", r=8, k=12, sinks=2, window=4, dense_layers=1, label_bits=4, seed=1,
                        group_shared=True),
}


def _fused_in_model(name: str) -> dict:
    """Worker side (Triton interpreter, ``fuse_gather`` on): the dynamic cache's decode steps through the one-kernel
    read, against the oracle; how many reads took it."""
    from kvcompress.kernels.doublesparse import triton_kernel

    cfg = FUSED_CASES[name]
    model = tiny_model("llama", layers=3)
    ids = torch.randint(1, 256, (1, 58), generator=torch.Generator().manual_seed(5))
    chunks = decode_chunks(44, 58, extra=[(50, 3)])
    calls = []
    real = triton_kernel.select_gather_partial

    def counted(*a, **kw):
        calls.append(triton_kernel.supports_select_gather(a[0], a[1], a[2], a[4], a[5], a[6], kw.get("group", 1)))
        return real(*a, **kw)

    triton_kernel.select_gather_partial = counted
    try:
        got, cache = _run(model, ids, chunks, **cfg)
    finally:
        triton_kernel.select_gather_partial = real
    ref = ds_oracle_logits(model, ids, chunks, channels=_table(cache), k=cfg["k"], dense_layers=1,
                           sinks=cfg["sinks"], window=cfg["window"], bits=cfg.get("label_bits", 16),
                           group_shared=cfg.get("group_shared", False))
    return {"err": (got - ref).abs().max().item(), "calls": len(calls), "one_kernel": sum(calls)}


@pytest.fixture(scope="module")
def fused_interpreted(tmp_path_factory):
    from interpreter import interpreted

    return interpreted(__file__, tmp_path_factory.mktemp("ds_fused"), KVCOMPRESS_KERNELS="triton",
                       KVCOMPRESS_DS_CONFIG='{"fuse_gather": true}')


@pytest.mark.parametrize("name", list(FUSED_CASES))
def test_one_kernel_read_in_the_model_matches_the_oracle(fused_interpreted, name):
    """With ``fuse_gather`` on, every sparse decode read of the dynamic cache runs the one-kernel select + gather
    (Triton, interpreted) and the logits equal the oracle's."""
    res = fused_interpreted[name]
    assert "error" not in res, res.get("error")
    # 2 sparse layers x the decode steps whose middle holds more than k tokens (single-token steps only)
    assert res["calls"] >= 2 * 8 and res["one_kernel"] == res["calls"], res
    assert res["err"] < TOL, res


def test_static_one_kernel_read_is_the_two_op_read_eager_and_compiled(monkeypatch):
    """A static cache built to select on Triton and to read in one kernel (``ops.choose`` of ``select_topk`` and
    ``select_gather`` faked to say ``"triton"``) reads every sparse decode step through the registered
    ``kvcompress::select_gather`` op (here its CPU implementation, the reference: the test is the wiring - which read
    runs, what it returns, the graph it compiles into), with no select op left in the compiled graph; its logits equal
    the two-op read's, eager and compiled.  Built without it the same cache never calls the op.  ``choose`` is asked
    with the selection rows of the launch (batch x kv heads, group-shared), which its rule needs."""
    from kvcompress.kernels import ops

    model = tiny_model("llama", layers=3)
    ids = torch.randint(1, 256, (2, 70), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    stack = _stack(channels="random", r=8, k=12, sinks=2, window=4, dense_layers=1, group_shared=True)
    real_choose, real_op = ops.choose, ops._OPS["select_gather"]

    asked = []

    def run(one_kernel: bool, graphs: list | None = None):
        fake = ("select_topk", "select_gather") if one_kernel else ("select_topk",)

        def choose(op, device, **f):
            if op == "select_gather":
                asked.append(f)
            return "triton" if op in fake else real_choose(op, device, **f)

        monkeypatch.setattr(ops, "choose", choose)
        calls = []
        if graphs is None:  # eager: count the op's calls
            monkeypatch.setitem(ops._OPS, "select_gather", lambda *a: calls.append(a[-1]) or real_op(*a))
        out = []
        with kvcompress.compress(model, stack, max_cache_len=80) as cache, torch.no_grad():
            step = model.forward
            if graphs is not None:
                def backend(gm, example_inputs):
                    graphs.append(gm)
                    return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)
                step = torch.compile(model.forward, backend=backend, fullgraph=True)
            model(ids[:, :40], attention_mask=mask[:, :40], position_ids=pos[:, :40], cache=cache)
            for t in range(40, ids.shape[1]):
                o = step(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1].contiguous(),
                         position_ids=pos[:, t:t + 1], cache=cache)
                out.append(o.logits[:, -1])
        monkeypatch.setitem(ops._OPS, "select_gather", real_op)
        return torch.stack(out), calls

    two_ops, calls = run(False)
    assert not calls
    assert asked and {(f["rows"], f["k"]) for f in asked} == {(2 * 2, 12)}  # 2 rows x 2 kv heads (tests/models.py)
    one_op, calls = run(True)
    assert len(calls) == 2 * 30 and set(calls) == {"triton"}  # 2 sparse layers x 30 steps
    assert (one_op - two_ops).abs().max().item() <= 1e-6
    torch._dynamo.reset()
    graphs: list = []
    compiled, _ = run(True, graphs)
    torch._dynamo.reset()
    assert 1 <= len(graphs) <= 2
    targets = {n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert ops._OPS["select_gather"] in targets and ops._OPS["select_topk"] not in targets
    assert (compiled - one_op).abs().max().item() <= 1e-5


if __name__ == "__main__" and "--worker" in sys.argv:
    from interpreter import collect

    collect({name: (lambda n=name: _fused_in_model(n)) for name in FUSED_CASES}, sys.argv[sys.argv.index("--worker") + 1])
