"""A prefill chunk after the first reads the stored compressed regions (KIVI codes, KIVI lanes, LeanK's
full-precision channel lanes, low-rank keys) decoded once to dense keys / values, through the backend's attention
(``kvcompress.layer.decoded_for_prompt``, sessions 59-60): the same outputs as the reference partial attention it
replaced, read by read, on dynamic and static caches, with left padding - and regions with no dense form (a query
map of no known form, lanes that leave a head out or disagree on their tokens) still read through the partial
attention."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kvcompress
from kvcompress import layer, static
from models import lowrank_basis_file, tiny_model

KIVI2 = {"kivi": {"bits": 2, "group": 16, "residual": 16}}
KIVI4 = {"kivi": {"bits": 4, "group": 16, "residual": 32, "sinks": 4}}
LEANK = {"leank": {"mask": "rope", "ratio": 0.5, "align": 4, "sinks": 4, "local": 24, "flush": 16}}
STACKS = {"kivi2": [KIVI2], "kivi4+sinks": [KIVI4], "leank+kivi2": [LEANK, KIVI2], "leank": [LEANK],
          "window+kivi2": [{"window": {"sinks": 0, "recent": 64}}, KIVI2],
          # AdaKV: each kv head keeps its own tokens (per-head validity), read per kv head
          "adakv": [{"snapkv": {"ratio": 0.5, "window": 8, "sinks": 2, "recent": 8, "schedule": "adaptive",
                                "alpha": 0.2}}]}
LOWRANK = "lowrank"  # replaced by the entry with the test's basis file
STACKS.update({"lowrank": [LOWRANK], "lowrank+kivi2": [LOWRANK, KIVI2]})
CHUNKS = (70, 50, 45, 33)  # four prompt chunks: the later three read what the earlier ones stored


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def lowrank(tmp_path_factory, model):
    """A low-rank entry with a calibrated basis for the tiny model: keys in rank 8 of 16, values in a rank-16 basis."""
    path = lowrank_basis_file(model, tmp_path_factory.mktemp("lowrank") / "basis.safetensors", value_rank=16,
                              tokens=96)
    return {"lowrank": {"basis": path, "value_rank": 16, "sinks": 4, "recent": 24, "flush": 16}}


def _prefill(model, stack, static_cache, monkeypatch):
    """Prefill in chunks; at every multi-token read that took the decoded route, the largest difference between its
    output and the partial read's (``attend_segments``, the reference it replaced) over the same stored regions.
    The two are compared read by read: end to end, a 1e-7 difference in one chunk's output can move a later token's
    key across a quantization step, which then differs by a whole step (a 4-bit KIVI static cache: 8e-5 in the
    logits)."""
    from kvcompress.kernels.attention import attend_segments

    diffs, pending = [], []
    real_decode, real_dense = layer.decoded_for_prompt, layer.dense_read

    def decode_spy(query, segs):
        out = real_decode(query, segs)
        if out is not None and any(not s.is_dense for s in segs):
            pending.append((list(segs), len(out)))
        return out

    def dense_spy(query, segs, q_pos, scaling, dense_attention):
        out = real_dense(query, segs, q_pos, scaling, dense_attention)
        if pending:
            stored, n_out = pending.pop()
            read = stored + ([segs[-1]] if len(segs) == n_out + 1 else [])  # the chunk's own tokens (dynamic)
            ref = attend_segments(query, read, q_pos, scaling, fused=False).transpose(1, 2)
            diffs.append((out - ref).abs().max().item())
        return out

    for module in (layer, static):
        monkeypatch.setattr(module, "decoded_for_prompt", decode_spy)
        monkeypatch.setattr(module, "dense_read", dense_spy)
    total = sum(CHUNKS)
    ids = torch.randint(1, 256, (2, total), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # left padding
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    kw = {"max_cache_len": total + 4} if static_cache else {}
    a = 0
    with kvcompress.compress(model, {"compressors": stack}, **kw) as cache, torch.no_grad():
        for n in CHUNKS:
            model(ids[:, a:a + n], attention_mask=mask[:, :a + n], position_ids=pos[:, a:a + n], cache=cache)
            a += n
    assert not pending
    return diffs


@pytest.mark.parametrize("static_cache", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("name", list(STACKS))
def test_decoded_prompt_read_equals_the_partial_read(model, lowrank, name, static_cache, monkeypatch):
    stack = [lowrank if entry is LOWRANK else entry for entry in STACKS[name]]
    diffs = _prefill(model, stack, static_cache, monkeypatch)
    assert len(diffs) >= 2 * (len(CHUNKS) - 2), diffs  # both layers, at least the last two chunks
    assert max(diffs) <= 1e-5, diffs


def test_regions_without_a_dense_form_are_left_to_the_partial_read():
    from kvcompress.state import Segment

    q = torch.randn(1, 4, 3, 16)
    k, v = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    pos = torch.arange(5)
    dense = Segment(k, v, None, pos)
    assert layer.decoded_for_prompt(q, [dense]) == [dense]
    subset = Segment(k[:, :1], v[:, :1], None, pos, heads=torch.tensor([1]))
    assert layer.decoded_for_prompt(q, [dense, subset]) is None
    mapped = Segment(k, v, None, pos, qmap=lambda x: x)
    assert layer.decoded_for_prompt(q, [mapped]) is None


def _lanes(q, heads_channels, n=7, positions=None, valid=None, seed=0):
    """Channel-lane segments (as a LeanK store gives them): per group its heads and kept channels."""
    from kvcompress.state import Segment

    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(n) if positions is None else positions
    segs = []
    for heads, channels in heads_channels:
        hs, ch = torch.tensor(heads), torch.tensor(channels)
        k = torch.randn(q.shape[0], len(heads), n, ch.shape[-1], generator=g)
        v = torch.randn(q.shape[0], len(heads), n, q.shape[-1], generator=g)
        index = ch.view(1, len(heads), 1, 1, -1)
        segs.append(Segment(k, v, valid, pos, heads=hs, channels=ch,
                            qmap=lambda x, index=index: x.gather(-1, index.expand(*x.shape[:-1], index.shape[-1]))))
    return segs


def test_channel_lanes_that_cover_every_head_read_as_one_dense_segment():
    from kvcompress.kernels.attention import attend_segments
    from kvcompress.state import Segment

    q = torch.randn(2, 4, 3, 8)  # 2 kv heads, group 2, 3 query rows
    valid = torch.tensor([[True] * 7, [False, False, True, True, True, True, True]])
    lanes = _lanes(q, [([1], [[0, 2, 5, 7]]), ([0], [[1, 2, 3, 4, 6, 7]])], valid=valid)
    new = Segment(torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8), None, torch.arange(7, 10))
    dense = layer.decoded_for_prompt(q, [new] + lanes)
    assert dense is not None and len(dense) == 2 and all(s.is_dense for s in dense)
    q_pos = torch.arange(7, 10)

    def sdpa(query, keys, values, mask, scaling):  # the adapter's dense attention: output [batch, q, heads, d]
        out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling,
                                                               enable_gqa=True)
        return out.transpose(1, 2)

    got = layer.dense_read(q, dense, q_pos, 0.3, sdpa)
    ref = attend_segments(q, [new] + lanes, q_pos, 0.3, fused=False).transpose(1, 2)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_channel_lanes_without_a_dense_form_are_left_to_the_partial_read():
    from kvcompress.state import Segment

    q = torch.randn(1, 6, 3, 8)  # 3 kv heads
    new = Segment(torch.randn(1, 3, 3, 8), torch.randn(1, 3, 3, 8), None, torch.arange(7, 10))
    two = [([0], [[0, 1]]), ([2], [[3, 4]])]
    assert layer.decoded_for_prompt(q, [new] + _lanes(q, two)) is None  # head 1 left out
    twice = two + [([0], [[5, 6]])]
    assert layer.decoded_for_prompt(q, [new] + _lanes(q, twice)) is None  # head 0 twice
    every = two + [([1], [[5, 6]])]
    assert layer.decoded_for_prompt(q, [new] + _lanes(q, every)) is not None


def test_lanes_over_different_tokens_read_padded_with_per_head_validity():
    """Lanes that cover every head once but hold different tokens (AdaKV on a dynamic cache: each kv head its own
    survivors, lanes of their own lengths) read as one padded segment, each head behind its own validity: equal to
    the partial read over the lanes."""
    from kvcompress.kernels.attention import attend_segments
    from kvcompress.state import Segment

    q = torch.randn(2, 6, 3, 8)  # 3 kv heads, group 2
    valid = torch.tensor([[True] * 7, [False, True, True, True, True, True, True]])
    lanes = _lanes(q, [([0], [[0, 1, 4]]), ([2], [[3, 4, 5, 6]]), ([1], [[5, 6]])], valid=valid)
    lanes[1] = dataclasses.replace(lanes[1], k=lanes[1].k[:, :, :5], v=lanes[1].v[:, :, :5],
                                   valid=lanes[1].valid[:, :5], positions=lanes[1].positions[:5])  # a shorter lane
    new = Segment(torch.randn(2, 3, 3, 8), torch.randn(2, 3, 3, 8), None, torch.arange(7, 10))
    dense = layer.decoded_for_prompt(q, [new] + lanes)
    assert dense is not None and len(dense) == 2 and dense[1].valid.dim() == 3

    def sdpa(query, keys, values, mask, scaling, heads=None):  # the adapter's dense attention: [batch, q, heads, d]
        out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling,
                                                               enable_gqa=True)
        return out.transpose(1, 2)

    q_pos = torch.arange(7, 10)
    got = layer.dense_read(q, dense, q_pos, 0.3, sdpa)
    ref = attend_segments(q, [new] + lanes, q_pos, 0.3, fused=False).transpose(1, 2)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_per_head_validity_reads_each_kv_head_with_its_query_heads_and_their_sink_logits():
    """A stored region whose kv heads keep different tokens (AdaKV on a static cache) is read one kv head at a time,
    each call given its query heads (``heads=``) so a model's learned sink logits follow them: equal to the partial
    read with the sink logits, and each head masked by its own validity."""
    from kvcompress.kernels.attention import attend_segments
    from kvcompress.state import Segment

    g = torch.Generator().manual_seed(0)
    b, h, group, q, t, d = 2, 3, 2, 5, 12, 8
    query = torch.randn(b, h * group, q, d, generator=g)
    valid = torch.rand(b, h, t, generator=g) > 0.4
    valid[..., 0] = True
    stored = Segment(torch.randn(b, h, t, d, generator=g), torch.randn(b, h, t, d, generator=g), valid,
                     torch.arange(t))
    new = Segment(torch.randn(b, h, q, d, generator=g), torch.randn(b, h, q, d, generator=g), None,
                  torch.arange(t, t + q))
    sinks = torch.randn(h * group, generator=g)

    def dense(qry, key, value, mask, scaling, heads=None):  # eager attention with learned sinks, [b, q, heads, d]
        s = sinks if heads is None else sinks[heads]
        rep = qry.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
        scores = (qry @ key.transpose(-1, -2) * scaling).masked_fill(~mask, float("-inf"))
        scores = torch.cat([scores, s.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], -1)
        return (scores.softmax(-1)[..., :-1] @ value).transpose(1, 2)

    got = layer.dense_read(query, [stored, new], new.positions, d ** -0.5, dense)
    want = attend_segments(query, [stored, new], new.positions, d ** -0.5, fused=False, sink_logits=sinks)
    assert (got - want.transpose(1, 2)).abs().max().item() <= 1e-5
    same_mask = dataclasses.replace(stored, valid=valid[:, :1].expand(-1, h, -1))
    other = attend_segments(query, [same_mask, new], new.positions, d ** -0.5, fused=False, sink_logits=sinks)
    assert (got - other.transpose(1, 2)).abs().max().item() > 1e-3  # the heads' own masks matter here
