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
    """Dynamic cache: the report equals the bytes of every tensor the layers hold; each kv head has its own lane, as
    long as that head's longest row, and the row-level union (what :meth:`valid_mask` reports) is as long as the
    longest head.  Static cache: the report equals the bytes held too, the store sized at the first prefill for what
    one head may keep (a quarter of the prompt, or the budget of the row's heads under AdaKV)."""
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
        assert layer.middle.buf.size == int(counts.max())  # the row-level union: the longest head
        lanes = {int(group.heads): buf for group, buf in layer.middle.lanes}  # one lane per kv head
        assert sorted(lanes) == [0, 1]
        for head, buf in lanes.items():
            assert buf.size == int(counts[:, head].max()) and buf.k.shape[1] == 1
    slots = {}
    for schedule in ("uniform", "adaptive"):
        with kvcompress.compress(model, stack(schedule), max_cache_len=310) as cache, torch.no_grad():
            model(ids, cache=cache)
        seen, sizes = set(), []
        for layer in cache.compressed_layers:
            _tensors(layer, seen, sizes)
        assert cache.memory_report().cache_bytes == sum(sizes)
        layer = cache.compressed_layers[0]
        slots[schedule] = layer.middle.ring.capacity
        # every head's columns can hold what one head may keep: a quarter of the prompt (uniform), or under AdaKV
        # the budget of all the row's kv heads (2 here), plus the 10 tokens the capacity leaves after the prompt
        counts = (layer.middle.head_valid_mask() if schedule == "adaptive" else layer.middle.valid_mask()
                  .unsqueeze(1)).sum(-1)
        assert int(counts.max()) <= slots[schedule] < 300 - 36
    assert slots["uniform"] < slots["adaptive"]


def _ratio_stack(schedule, ratio=0.25, *extra):
    return {"compressors": [{"snapkv": {"ratio": ratio, "sinks": 4, "recent": 32, "window": 32,
                                        "schedule": schedule}}, *extra]}


def test_adaptive_bytes_follow_the_kept_tokens():
    """One row at 25% kept: the adaptive middle's payload (each kv head its own lane, as long as its own count) is the
    uniform middle's, the same total of head-columns; what it adds is exactly the per-lane bookkeeping (a bool
    validity and int64 positions per lane column, the head index tensor, the row-level union: no payload), at most
    9 bytes per kept head-column plus 9 per union column and 8 per kv head.  Here (head_dim 16, fp32: 128 payload bytes
    per head-column) that is under 8% of the cache; on the default model (head_dim 64) under 2% (benchmarks/
    adakv_head_counts.py).  Before, the middle followed the longest head (1.45x head-columns on the default model)."""
    model = tiny_model("llama")
    ids = torch.randint(1, 256, (1, 600), generator=torch.Generator().manual_seed(11))
    reports, caches = {}, {}
    for schedule in ("uniform", "adaptive"):
        with kvcompress.compress(model, _ratio_stack(schedule)) as cache, torch.no_grad():
            model(ids, cache=cache)
        reports[schedule], caches[schedule] = cache.memory_report(), cache
    def payload(buf):
        return buf.k.numel() * buf.k.element_size() + buf.v.numel() * buf.v.element_size()

    def bookkeeping(buf):
        return buf.valid.numel() + buf.positions.numel() * 8

    kept = extra = 0
    for layer in caches["adaptive"].compressed_layers:
        middle = layer.middle
        counts = middle.head_valid_mask().sum(-1)[0]
        assert int(counts.max()) > int(counts.min())  # the heads really keep different numbers
        per_col = 2 * middle.lanes[0][1].k.shape[-1] * middle.lanes[0][1].k.element_size()
        for group, buf in middle.lanes:  # each lane exactly its head's count (at least 16 columns)
            assert payload(buf) == per_col * max(16, int(counts[int(group.heads)]))
        assert middle.rows.k.numel() == 0
        extra += sum(bookkeeping(buf) for _, buf in middle.lanes) + bookkeeping(middle.rows) + 8 * middle.kv_heads
        kept += int(counts.sum())
    uniform = [buf for layer in caches["uniform"].compressed_layers for _, buf in layer.middle.lanes]
    assert sum(payload(buf) for buf in uniform) == per_col * kept  # the same head-columns
    extra -= sum(bookkeeping(buf) for buf in uniform)
    a, u = reports["adaptive"].cache_bytes, reports["uniform"].cache_bytes
    assert a - u == extra  # nothing but the bookkeeping
    assert extra <= 9 * kept + 9 * kept // 2 + 8 * 2 * len(uniform), (extra, kept)
    assert a <= 1.08 * u, (a, u)


@pytest.mark.parametrize("leank", [False, True], ids=["dense", "leank"])
def test_per_head_lanes_decode_equals_the_masked_layout(leank, monkeypatch):
    """Left-padded batch, fp32: decode logits with one lane per kv head (each as long as its own head; the decode
    steps flush tokens into every lane) equal those of the masked layout (``DenseStore.head_lanes = False``: one lane
    per head group as long as its longest head, a per-(row, head) validity masking the columns a head does not
    hold), with and without LeanK channel lanes, and those of the static cache (its masked layout at capacity)."""
    from kvcompress.state import DenseStore

    model = tiny_model("llama", layers=2)
    extra = [compiled_decode.LEANK] if leank else []
    stack = _ratio_stack("adaptive", 0.4, *extra)
    ids, mask = compiled_decode._ids(pad=5, length=224, seed=12)
    lanes, cache = compiled_decode._run(model, stack, ids, mask, static=False, prompt=200)
    middle = cache.compressed_layers[0].middle
    assert len({buf.size for _, buf in middle.lanes}) > 1 and all(buf.k.shape[1] == 1 for _, buf in middle.lanes)
    if leank:
        assert any(group.channels is not None for group, _ in middle.lanes)
    with monkeypatch.context() as m:
        m.setattr(DenseStore, "head_lanes", False)
        masked, mcache = compiled_decode._run(model, stack, ids, mask, static=False, prompt=200)
    assert len(mcache.compressed_layers[0].middle.lanes) < len(middle.lanes)  # (the masked layout really ran)
    assert (lanes - masked).abs().max().item() <= 1e-5
    for a, b in zip(cache.compressed_layers, mcache.compressed_layers):  # the same tokens per head
        assert torch.equal(a.middle.head_valid_mask().sum(-1), b.middle.head_valid_mask().sum(-1))
    static, _ = compiled_decode._run(model, stack, ids, mask, static=True, prompt=200)
    assert (static - lanes).abs().max().item() <= 1e-5


def test_per_head_lanes_chunked_prefill_equals_the_masked_layout(monkeypatch):
    """A prompt prefilled in two chunks (the second chunk's allocation reads what each head holds, and its
    observation reads the lanes of different lengths) gives the masked layout's logits."""
    from kvcompress.state import DenseStore

    model = tiny_model("llama", layers=2)
    ids = torch.randint(1, 256, (1, 230), generator=torch.Generator().manual_seed(15))

    def run():
        out = []
        with kvcompress.compress(model, _ratio_stack("adaptive", 0.4)) as cache, torch.no_grad():
            for lo, hi in ((0, 120), (120, 220)):
                out.append(model(ids[:, lo:hi], cache=cache).logits[:, -1])
            for t in range(220, 230):
                out.append(model(ids[:, t:t + 1], cache=cache).logits[:, -1])
        return torch.stack(out), cache

    lanes, cache = run()
    assert len({buf.size for _, buf in cache.compressed_layers[0].middle.lanes}) > 1
    with monkeypatch.context() as m:
        m.setattr(DenseStore, "head_lanes", False)
        masked, _ = run()
    assert (lanes - masked).abs().max().item() <= 1e-5


def test_per_head_lanes_read_equals_a_masked_segment():
    """The read of the per-head lanes (one segment per kv head, different lengths) equals the joint-softmax oracle
    over one longest-head segment that masks each head's columns, rebuilt here from the lanes."""
    from kvcompress.kernels.attention import attend_segments
    from kvcompress.kernels.attention.reference import segment_attention
    from kvcompress.state import Segment

    q, k, v, valid = scoring._tensors(seed=13)
    _, _, layer = scoring._prefill_selection(_stack(0.5), q, k, v, valid)
    middle = layer.middle
    lanes = middle.lanes
    b, h, d = k.shape[0], k.shape[1], k.shape[-1]
    width = max(buf.size for _, buf in lanes)
    assert len({buf.size for _, buf in lanes}) > 1
    kk, vv = k.new_zeros(b, h, width, d), v.new_zeros(b, h, width, d)
    hv = torch.zeros(b, h, width, dtype=torch.bool)
    for group, buf in lanes:
        head, n, order = int(group.heads), buf.size, buf.ordered()
        kk[:, head, :n], vv[:, head, :n] = buf.k[:, 0, order], buf.v[:, 0, order]
        hv[:, head, :n] = buf.valid[:, order]
    assert torch.equal(hv, middle.head_valid_mask())
    masked = Segment(kk, vv, hv, torch.zeros(width, dtype=torch.long))
    query = torch.randn(b, q.shape[1], 1, d, generator=torch.Generator().manual_seed(14))
    pos = torch.tensor([10_000])
    got = attend_segments(query, middle.segments(), pos, d ** -0.5)
    ref = segment_attention(query, [masked], pos, d ** -0.5)
    assert (got - ref).abs().max().item() <= 1e-5


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
