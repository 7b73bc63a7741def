"""Buffers and the reference segment attention against brute-force computations."""

import math

import pytest
import torch

from kvcompress.kernels.attention import segment_attention
from kvcompress.state import (GROWTH_FRACTION, GROWTH_MIN_TOKENS, DenseStore, KVBlock, Layout, RingBuffer, Segment,
                              grown_capacity)


def _kv(b=2, h=2, t=5, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, t, d, generator=g), torch.randn(b, h, t, d, generator=g)


def test_ring_buffer_keeps_order_across_wraparound():
    k, v = _kv(t=1)
    ring = RingBuffer(5, k, v)
    for step in range(13):
        if ring.size == 5:
            ring.discard_oldest(1)
        kk = torch.full((2, 2, 1, 4), float(step))
        ring.push(kk, kk, torch.ones(2, 1, dtype=torch.bool), torch.tensor([step]))
    order = ring.ordered()
    assert ring.positions[order].tolist() == [8, 9, 10, 11, 12]
    assert ring.k[0, 0, order, 0].tolist() == [8.0, 9.0, 10.0, 11.0, 12.0]
    seg = ring.segment()
    assert sorted(seg.positions.tolist()) == [8, 9, 10, 11, 12]


def test_ring_buffer_pop_returns_a_copy():
    k, v = _kv(t=4)
    ring = RingBuffer(4, k, v)
    ring.push(k, v, torch.ones(2, 4, dtype=torch.bool), torch.arange(4))
    block = ring.pop_oldest(2)
    ring.push(k[:, :, :2] * 0, v[:, :, :2] * 0, torch.ones(2, 2, dtype=torch.bool), torch.arange(4, 6))
    assert torch.equal(block.k, k[:, :, :2])


def _geometric_steps(n: int) -> int:
    """Most reallocations of a growable buffer from 16 slots to ``n`` tokens under :func:`grown_capacity`'s rule."""
    knee = GROWTH_MIN_TOKENS * GROWTH_FRACTION  # below it the floor is the larger step
    return GROWTH_FRACTION + math.ceil(math.log(n / knee, 1 + 1 / GROWTH_FRACTION))


def test_growable_buffer_amortises_growth():
    k, v = _kv(t=1)
    ring = RingBuffer(None, k, v)
    caps = set()
    for step in range(2000):
        ring.push(k, v, torch.ones(2, 1, dtype=torch.bool), torch.tensor([step]))
        caps.add(ring.capacity)
    # geometric: the first capacity, steps of the floor up to floor x fraction tokens, then steps of 1/fraction
    # (27 capacities: 16, 48, ..., 240, 272, 306, ..., 2247), where a fixed step of 32 tokens would take 63
    assert ring.size == 2000 and len(caps) <= _geometric_steps(2000) + 1
    assert ring.capacity <= 2000 * (1 + 1 / GROWTH_FRACTION) + 1


def test_dense_store_retain_frees_leading_columns():
    store = DenseStore()
    k, v = _kv(t=6)
    store.append(KVBlock(k, v, torch.ones(2, 6, dtype=torch.bool), torch.arange(6)))
    keep = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 0, 1, 1, 1]], dtype=torch.bool)
    store.retain(keep)
    assert store.num_tokens == 5
    assert store.valid_mask().tolist() == keep[:, 1:].tolist()


def test_layout_combination():
    lay = Layout.combine([Layout(sinks=4, recent=0, flush=1), Layout(recent=128, flush=32), None,
                          Layout(flush=3)])
    assert lay == Layout(sinks=4, recent=128, flush=96)
    assert Layout.combine([]) == Layout(sinks=0, recent=None, flush=1)


def _brute(query, keys, values, allowed, scale):
    b, hq, q, d = query.shape
    hk = keys.shape[1]
    kr = keys.repeat_interleave(hq // hk, 1)
    vr = values.repeat_interleave(hq // hk, 1)
    s = (query @ kr.transpose(-1, -2)) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ vr


@pytest.mark.parametrize("q_len", [1, 3])
def test_segment_attention_equals_brute_force(q_len):
    g = torch.Generator().manual_seed(1)
    b, hq, hk, d = 2, 6, 2, 8
    query = torch.randn(b, hq, q_len, d, generator=g)
    lens = [3, 7, q_len]
    ks = [torch.randn(b, hk, n, d, generator=g) for n in lens]
    vs = [torch.randn(b, hk, n, d, generator=g) for n in lens]
    pos = [torch.tensor([0, 1, 2]), torch.arange(10, 17), torch.arange(20, 20 + q_len)]
    valid1 = torch.rand(b, 7, generator=g) > 0.3
    segs = [Segment(ks[0], vs[0], None, pos[0]), Segment(ks[1], vs[1], valid1, pos[1]),
            Segment(ks[2], vs[2], None, pos[2])]
    qpos = pos[2]
    out = segment_attention(query, segs, qpos, 0.3)
    keys, values = torch.cat(ks, 2), torch.cat(vs, 2)
    allpos = torch.cat(pos)
    valid = torch.cat([torch.ones(b, 3, dtype=torch.bool), valid1, torch.ones(b, q_len, dtype=torch.bool)], 1)
    allowed = (allpos[None, :] <= qpos[:, None])[None, None] & valid[:, None, None, :]
    ref = _brute(query, keys, values, allowed, 0.3)
    assert torch.allclose(out, ref, atol=1e-5)


def test_segment_attention_head_subsets_and_query_maps():
    """A segment covering some kv heads with pruned channels equals masked, zero-padded attention."""
    g = torch.Generator().manual_seed(2)
    b, hq, hk, d, t = 1, 4, 2, 8, 5
    query = torch.randn(b, hq, 1, d, generator=g)
    k_full, v_full = torch.randn(b, hk, t, d, generator=g), torch.randn(b, hk, t, d, generator=g)
    keep = torch.tensor([0, 2, 5])
    pruned = Segment(k_full[:, 1:2][..., keep], v_full[:, 1:2], None, torch.arange(t),
                     heads=torch.tensor([1]), qmap=lambda q: q[..., keep])
    recent = Segment(k_full, v_full, None, torch.arange(t, 2 * t))  # second region, all heads
    out = segment_attention(query, [pruned, recent], torch.tensor([2 * t]), 0.25)
    k_zero = torch.zeros_like(k_full)
    k_zero[:, 1, :, keep] = k_full[:, 1][..., keep]
    keys = torch.cat([k_zero, k_full], 2)
    values = torch.cat([v_full, v_full], 2)
    allowed = torch.ones(b, hq, 1, 2 * t, dtype=torch.bool)
    allowed[:, :2, :, :t] = False  # kv head 0 (query heads 0,1) has no middle
    ref = _brute(query, keys, values, allowed, 0.25)
    assert torch.allclose(out, ref, atol=1e-5)


def test_fully_masked_rows_give_zeros_not_nan():
    q = torch.randn(1, 2, 1, 4)
    seg = Segment(torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4), torch.zeros(1, 3, dtype=torch.bool),
                  torch.arange(3))
    out = segment_attention(q, [seg], torch.tensor([5]), 0.5)
    assert torch.equal(out, torch.zeros_like(out))


def test_growth_respects_a_token_limit():
    k, v = _kv(t=1)
    store = DenseStore()
    store.limit(40)
    for step in range(60):
        if store.num_tokens == 40:
            store.drop_oldest(1)
        store.append(KVBlock(k, v, torch.ones(2, 1, dtype=torch.bool), torch.tensor([step])))
    assert store.buf.capacity == 40 and store.num_tokens == 40
    assert sorted(store.segments()[0].positions.tolist()) == list(range(20, 60))


def test_growable_ring_holds_at_most_an_eighth_more_than_it_uses():
    like = torch.zeros(1, 2, 1, 8)
    ring = RingBuffer(None, like, like)
    grows = 0
    for n in range(1, 5001):
        cap = ring.capacity
        ring.push(torch.full((1, 2, 1, 8), float(n)), torch.full((1, 2, 1, 8), float(n)),
                  torch.ones(1, 1, dtype=torch.bool), torch.tensor([n]))
        grows += ring.capacity != cap
        assert ring.capacity <= max(n * (1 + 1 / GROWTH_FRACTION) + 1, n + GROWTH_MIN_TOKENS)  # not doubling's 2x
    assert grows <= _geometric_steps(5000)  # O(log n) (33); a fixed step of GROWTH_MIN_TOKENS would take 156
    assert torch.equal(ring.k[0, 0, ring.ordered(), 0], torch.arange(1, 5001, dtype=torch.float32))
    assert grown_capacity(100, 101, unit=32, limit=105) == 105 and grown_capacity(100, 130, limit=120) == 130


def test_ring_push_all_valid_hint_skips_the_check_and_a_false_column_is_still_seen(monkeypatch):
    k, v = _kv(t=2)
    ring = RingBuffer(8, k, v)
    calls = []
    real_all = torch.Tensor.all

    def counting_all(self, *a, **kw):
        calls.append(1)
        return real_all(self, *a, **kw)

    ones = torch.ones(2, 2, dtype=torch.bool)
    pad = ones.clone()
    pad[1, 0] = False
    monkeypatch.setattr(torch.Tensor, "all", counting_all)
    ring.push(k, v, ones, torch.arange(2), all_valid=True)  # caller-known: no device-to-host check
    assert calls == [] and ring.all_valid
    ring.push(k, v, pad, torch.arange(2, 4))  # not known: checked, and the padding is recorded
    assert calls and not ring.all_valid
    monkeypatch.undo()
    assert ring.segment().valid[1].tolist() == [True, True, False, True]


def test_merge_partials_equals_joint_softmax():
    from kvcompress.kernels.attention import merge_partials, partial_attention

    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 3, 4, generator=g)
    k, v = torch.randn(2, 2, 9, 4, generator=g), torch.randn(2, 2, 9, 5, generator=g)
    mask = torch.rand(2, 2, 3, 9, generator=g) > 0.4
    mask[0, 0, 1] = False  # a row with no visible key at all: zero output
    joint, _ = partial_attention(q, k, v, mask, 0.5)
    parts = [partial_attention(q, k[:, :, a:b], v[:, :, a:b], mask[..., a:b], 0.5) for a, b in ((0, 2), (2, 7), (7, 9))]
    torch.testing.assert_close(merge_partials(parts), joint, rtol=1e-5, atol=1e-6)
    assert torch.equal(merge_partials(parts)[0, 0, 1], torch.zeros(5))
    assert merge_partials(parts[:1]) is parts[0][0]
