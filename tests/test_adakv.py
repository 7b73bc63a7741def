"""AdaKV adaptive per-head budgets (``schedule: adaptive`` of :class:`kvcompress.ScoreEvictor`).

Checked against references outside the evictor: the allocation against a plain-loop re-implementation of AdaKV's
rule (arXiv 2407.11550; kvpress' ``AdaKVPress``: each head's top ``floor(alpha x`` the uniform budget``)``
reserved, the rest of the layer's budget to the top scores of all heads together) on small tensors; the per-head
read (every store and read path masks each head with its own kept tokens) against a per-head softmax computed in
the test; left padding, static = dynamic, compiled = eager (one graph), beam search, and the memory report against
the bytes of the tensors the cache holds.  The Triton lanes kernel with a per-head validity is checked under the
interpreter in tests/test_leank_kernel.py (cases ``per-head-valid-*``, ``read-path-per-head``).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import kvcompress
from kvcompress.errors import ConfigError
from models import tiny_model
import test_compiled_decode as compiled_decode
import test_scoring as scoring
from test_conformance import _tensors

pytestmark = pytest.mark.usefixtures("one_thread")

SINKS, RECENT, WINDOW = 2, 8, 6


def _snapkv_scores(q, k, valid, window, kernel=7):
    """SnapKV's per-kv-head scores of every prompt column (max pooling), as tests/test_scoring.py computes them."""
    b, hq, t, d = q.shape
    group = hq // k.shape[1]
    s = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(group, 1)) * d ** -0.5
    visible = torch.ones(t, t, dtype=torch.bool).tril()[None, None] & valid[:, None, None, :]
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    w = p[:, :, t - window:, : t - window].mean(dim=2).view(b, k.shape[1], group, t - window).sum(dim=2)
    return F.max_pool1d(w, kernel, stride=1, padding=kernel // 2)


def adakv_reference(scores, valid, ratio, alpha, sinks, recent):
    """AdaKV's allocation, one row and head at a time: ``[row][head] -> set of kept prompt columns``."""
    b, h = scores.shape[:2]
    out = []
    for row in range(b):
        cand, held, real = scoring._candidates(valid[row], sinks, recent)
        per_head = max(0, min(len(cand), math.floor(ratio * real) - held))  # the uniform budget
        total, floor = h * per_head, math.floor(alpha * per_head)
        kept = [set(scoring._top(scores[row, head], cand, floor)) for head in range(h)]
        rest = sorted(((-float(scores[row, head, c]), head, c) for head in range(h) for c in cand
                       if c not in kept[head]))
        for _, head, c in rest[: total - h * floor]:
            kept[head].add(c)
        out.append(kept)
    return out


def _stack(ratio=0.5, alpha=0.2, **extra):
    return {"compressors": [{"snapkv": {"ratio": ratio, "sinks": SINKS, "recent": RECENT, "window": WINDOW,
                                        "schedule": "adaptive", "alpha": alpha, **extra}}]}


@pytest.mark.parametrize("ratio,alpha", [(0.5, 0.2), (0.3, 0.5), (0.5, 0.0)])
def test_allocation_matches_a_loop_reference(ratio, alpha):
    q, k, v, valid = scoring._tensors(seed=7)
    keep, positions, layer = scoring._prefill_selection(_stack(ratio, alpha), q, k, v, valid)
    expected = adakv_reference(_snapkv_scores(q, k, valid, WINDOW), valid, ratio, alpha, SINKS, RECENT)
    b, h, _ = keep.shape
    for row in range(b):
        for head in range(h):
            got = set(positions[keep[row, head]].tolist())
            assert got == expected[row][head], (row, head, sorted(got ^ expected[row][head]))
    counts = keep.sum(-1)
    assert bool((counts[:, 0] != counts[:, 1]).any())  # the heads really keep different numbers
    for row in range(b):  # the row's total is the uniform one
        cand, held, real = scoring._candidates(valid[row], SINKS, RECENT)
        assert int(counts[row].sum()) == h * max(0, min(len(cand), math.floor(ratio * real) - held))
    # the store holds each head's own count, packed from column 0
    hv = layer.middle.head_valid_mask()
    assert torch.equal(hv.sum(-1), counts)
    cols = torch.arange(hv.shape[-1])
    assert torch.equal(hv, cols.view(1, 1, -1) < counts.unsqueeze(-1))


def test_alpha_one_is_the_uniform_selection():
    q, k, v, valid = scoring._tensors(seed=8)
    uniform = {"compressors": [{"snapkv": {"ratio": 0.4, "sinks": SINKS, "recent": RECENT, "window": WINDOW}}]}
    a, _, _ = scoring._prefill_selection(uniform, q, k, v, valid)
    b, _, _ = scoring._prefill_selection(_stack(0.4, 1.0), q, k, v, valid)
    assert torch.equal(a, b)


def test_decode_read_masks_each_head_with_its_own_tokens():
    """A decode step after an adaptive prefill (dynamic layer, reference read) equals a per-head softmax over the
    tokens each head kept (sinks, its own middle tokens, the window, the new token), computed here."""
    q, k, v, valid = scoring._tensors(seed=9)
    keep, positions, layer = scoring._prefill_selection(_stack(0.5), q, k, v, valid)
    gen = torch.Generator().manual_seed(10)
    b, hq, t, d = q.shape
    h = k.shape[1]
    q1, k1, v1 = (torch.randn(b, hq, 1, d, generator=gen), torch.randn(b, h, 1, d, generator=gen),
                  torch.randn(b, h, 1, d, generator=gen))
    layer.update(k1, v1, compressed=True)
    got = layer.attend(q1, None, d ** -0.5, scoring._dense)  # [b, 1, hq, d]
    allk, allv = torch.cat([k, k1], 2), torch.cat([v, v1], 2)
    for row in range(b):
        cand, _, _ = scoring._candidates(valid[row], SINKS, RECENT)
        for head in range(h):
            kept = set(positions[keep[row, head]].tolist())
            cols = [c for c in range(t) if valid[row, c] and (c not in cand or c in kept)] + [t]
            for g in range(hq // h):
                qh = q1[row, head * (hq // h) + g, 0]
                p = torch.softmax(allk[row, head, cols] @ qh * d ** -0.5, -1)
                ref = p @ allv[row, head, cols]
                assert (got[row, 0, head * (hq // h) + g] - ref).abs().max().item() <= 1e-5


PROMPT = compiled_decode.PROMPT


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_padded_batch_rows_equal_rows_alone(static):
    model = tiny_model("qwen3")
    gen = torch.Generator().manual_seed(4)
    a = torch.randint(1, 256, (1, 44), generator=gen)
    b = torch.randint(1, 256, (1, 33), generator=gen)
    ids = torch.cat([a, torch.cat([torch.zeros(1, 11, dtype=torch.long), b], 1)], 0)
    mask = torch.ones_like(ids)
    mask[1, :11] = 0
    kw = {"max_cache_len": 80} if static else {}

    def run(x, m):
        with kvcompress.compress(model, _stack(), **kw) as cache:
            return model.generate(x, attention_mask=m, max_new_tokens=12, do_sample=False, cache=cache,
                                  output_scores=True, return_dict_in_generate=True), cache

    both, cache = run(ids, mask)
    hv = cache.compressed_layers[0].middle.head_valid_mask()
    assert hv is not None and bool((hv.sum(-1)[:, 0] != hv.sum(-1)[:, 1]).any())
    for row, x in enumerate((a, b)):
        one, _ = run(x, torch.ones_like(x))
        assert torch.equal(both.sequences[row, ids.shape[1]:], one.sequences[0, -12:])
        got = torch.stack([s[row] for s in both.scores])
        ref = torch.stack([s[0] for s in one.scores])
        assert (got - ref).abs().max().item() <= 1e-4


def test_static_equals_dynamic():
    model = tiny_model("llama", layers=1)
    ids, mask = compiled_decode._ids(pad=3, length=PROMPT + 8)
    dynamic, dcache = compiled_decode._run(model, _stack(), ids, mask, static=False)
    static, _ = compiled_decode._run(model, _stack(), ids, mask, static=True)
    assert (static - dynamic).abs().max().item() <= 1e-5
    hv = dcache.compressed_layers[0].middle.head_valid_mask()
    assert bool((hv.sum(-1)[:, 0] != hv.sum(-1)[:, 1]).any())


def test_compiled_decode_equals_eager_in_one_graph():
    """torch.compile(fullgraph=True, aot_eager) of a static decode step after an adaptive prefill."""
    try:
        model = tiny_model("llama", layers=1)
        ids, _ = compiled_decode._ids(length=PROMPT + 6, seed=5)
        runs = []
        for compiled in (False, True):
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            out = []
            with kvcompress.compress(model, _stack(), max_cache_len=ids.shape[1] + 2) as cache, torch.no_grad():
                step = torch.compile(model.forward, backend="aot_eager", fullgraph=True) if compiled else model.forward
                model(ids[:, :PROMPT], cache=cache)
                hv = cache.compressed_layers[0].middle.head_valid_mask()
                assert bool((hv.sum(-1)[:, 0] != hv.sum(-1)[:, 1]).any())
                for t in range(PROMPT, ids.shape[1]):
                    out.append(step(input_ids=ids[:, t:t + 1], position_ids=torch.full((2, 1), t),
                                    cache=cache).logits[:, -1])
            runs.append(torch.stack(out))
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
        assert (runs[1] - runs[0]).abs().max().item() <= 1e-5
    finally:
        torch._dynamo.reset()


def test_beam_search_reorders_each_heads_validity():
    """Beam search: the best beam's summed log-probability equals the same tokens fed to a fresh cache."""
    import test_conformance as conformance

    model = tiny_model("llama", layers=1)
    ids = torch.randint(1, 256, (1, 40), generator=torch.Generator().manual_seed(4))
    with kvcompress.compress(model, _stack()) as cache, torch.no_grad():
        res = model.generate(ids, max_new_tokens=8, num_beams=3, do_sample=False, length_penalty=0.0,
                             early_stopping=True, output_scores=True, return_dict_in_generate=True, pad_token_id=0,
                             cache=cache)
    seq = res.sequences[0]
    logits, _ = conformance._teacher_forced(model, kvcompress.parse_stack(_stack()), seq[None, :-1],
                                            torch.ones_like(seq[None, :-1]), 7)
    logp = torch.log_softmax(logits[:, 0].float(), -1).gather(-1, seq[40:, None]).sum()
    assert abs(logp.item() - res.sequences_scores[0].item()) <= 1e-4


def test_memory_report_is_the_bytes_held():
    """Dynamic cache: the report equals the bytes of every tensor the layers hold, and the middle is as long as the
    longest head of each row (what the docs say the bytes follow).  Static cache: what the per-head validity adds to
    the report is exactly its tensors (the static buffers are allocated at capacity either way)."""
    model = tiny_model("llama")
    ids = torch.randint(1, 256, (2, 300), generator=torch.Generator().manual_seed(3))

    def stack(schedule):
        return {"compressors": [{"snapkv": {"ratio": 0.25, "sinks": 4, "recent": 32, "window": 32,
                                            "schedule": schedule}}]}

    with kvcompress.compress(model, stack("adaptive")) as cache, torch.no_grad():
        model(ids, cache=cache)
    seen, sizes = set(), []
    for layer in cache.compressed_layers:
        _tensors(layer, seen, sizes)
    assert cache.memory_report().cache_bytes == sum(sizes)
    for layer in cache.compressed_layers:
        counts = layer.middle.head_valid_mask().sum(-1)  # [b, h]
        assert int(counts.sum()) == 2 * 2 * (math.floor(0.25 * 300) - 36)  # rows x kv heads x uniform budget
        assert layer.middle.buf.size == int(counts.max())  # the longest head sizes the middle
    reports = {}
    for schedule in ("uniform", "adaptive"):
        with kvcompress.compress(model, stack(schedule), max_cache_len=310) as cache, torch.no_grad():
            model(ids, cache=cache)
        reports[schedule] = cache.memory_report().cache_bytes
    hvalid = sum(bufs["hvalid"].numel() for layer in cache.compressed_layers for _, bufs in layer.middle.lanes)
    assert reports["adaptive"] - reports["uniform"] == hvalid > 0


@pytest.mark.parametrize("entry,match", [
    ({"snapkv": {"budget": 200, "schedule": "adaptive", "phase": "both"}},
     r"compressors\[0\]\.snapkv\.schedule: expected 'uniform' or 'pyramid' with phase 'decode' or 'both'.*"
     r"got 'adaptive'"),
    ({"snapkv": {"ratio": 0.5, "schedule": "adaptive", "alpha": 1.5}}, r"snapkv\.alpha"),
])
def test_config_errors_name_key_allowed_and_given(entry, match):
    with pytest.raises(ConfigError, match=match):
        kvcompress.parse_stack({"compressors": [entry]})


def test_a_quantized_middle_is_refused_at_validation():
    with pytest.raises(ConfigError, match=r"compressors\[0\]\.snapkv\.schedule: expected 'uniform' or 'pyramid' in a "
                                          r"stack with a quantizer.*got \"'adaptive' with kivi at compressors\[1\]"):
        kvcompress.parse_stack({"compressors": [{"snapkv": {"ratio": 0.5, "schedule": "adaptive"}},
                                                {"kivi": {"bits": 4}}]})
