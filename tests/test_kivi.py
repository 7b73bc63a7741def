"""KIVI: packed format, append-only store, and decode logits against an independent fake-quant oracle."""

import math

import pytest
import torch

import kvcompress
from kvcompress.errors import ConfigError
from kvcompress.kernels.attention import attend_segments, segment_attention
from kvcompress.kernels.kivi import (PackedKV, dequantize_keys, dequantize_values, pack, quantize_keys,
                                     quantize_values, unpack)
from kvcompress.state import KVBlock, Segment
from models import tiny_model
from reference import causal_visibility, decode_chunks, fake_quant, masked_logits, streamed_logits
from reference import middle_oracle_logits

def _oracle(model, ids, chunks, *, bits, group, residual, sinks=0, key_axis="channel", budget=None):
    return middle_oracle_logits(model, ids, chunks, sinks=sinks, recent=residual, flush=group, bits=bits,
                                group=group, key_axis=key_axis, budget=budget)


def _kivi(**kw):
    return {"compressors": [{"kivi": kw}]}


# ----------------------------------------------------------------------------- packing and quantizers


@pytest.mark.parametrize("bits", [2, 4])
def test_pack_unpack_round_trip_over_shapes(bits):
    gen = torch.Generator().manual_seed(bits)
    per = 32 // bits
    for _ in range(20):
        shape = [int(x) for x in torch.randint(1, 5, (3,), generator=gen)] + [per * int(torch.randint(1, 9, (1,), generator=gen))]
        codes = torch.randint(0, 2 ** bits, shape, generator=gen)
        words = pack(codes, bits)
        assert words.dtype == torch.int32 and words.shape[-1] == shape[-1] // per
        assert torch.equal(unpack(words, bits), codes.int())
    # every code value in the top (sign-bit) field survives
    top = torch.full((1, per), 2 ** bits - 1)
    assert torch.equal(unpack(pack(top, bits), bits), top.int())


@pytest.mark.parametrize("bits,group", [(2, 32), (4, 32), (2, 16), (4, 64)])
def test_quantizers_match_oracle_and_error_bound(bits, group):
    gen = torch.Generator().manual_seed(7)
    k = torch.randn(2, 3, 2 * group, 64, generator=gen) * 3
    v = torch.randn(2, 3, 2 * group, 64, generator=gen)
    kh = dequantize_keys(*quantize_keys(k, bits, group), bits)
    vh = dequantize_values(*quantize_values(v, bits, 32), bits)
    ref_k = fake_quant(k.view(2, 3, 2, group, 64), bits, dim=3).view_as(k)
    ref_v = fake_quant(v.view(2, 3, 2 * group, 2, 32), bits, dim=-1).view_as(v)
    assert torch.allclose(kh, ref_k, atol=1e-5) and torch.allclose(vh, ref_v, atol=1e-5)
    # rounding error at most half a step (plus fp16 rounding of scale and zero)
    step = (k.view(2, 3, 2, group, 64).amax(3) - k.view(2, 3, 2, group, 64).amin(3)) / (2 ** bits - 1)
    err = (kh - k).view(2, 3, 2, group, 64).abs().amax(3)
    assert bool((err <= step * 0.5 + 1e-2).all())


def test_constant_groups_never_produce_nan():
    k = torch.full((1, 2, 32, 16), 0.7)
    k[:, 1] = 0.0
    v = torch.full((1, 2, 32, 16), -3.25)
    kh = dequantize_keys(*quantize_keys(k, 2, 32), 2)
    vh = dequantize_values(*quantize_values(v, 2, 16), 2)
    assert torch.isfinite(kh).all() and torch.isfinite(vh).all()
    assert torch.allclose(kh, k.half().float()) and torch.allclose(vh, v)


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError) as err:
        kvcompress.parse_stack(_kivi(bits=2, group=32, residual=100))
    assert "compressors[0].kivi.residual" in str(err.value) and "multiple of group" in str(err.value)
    with pytest.raises(ConfigError) as err:
        kvcompress.parse_stack(_kivi(bits=3))
    assert "compressors[0].kivi.bits" in str(err.value)


# ----------------------------------------------------------------------------- decode vs oracle


@pytest.mark.parametrize("bits,sinks", [(2, 0), (4, 3), (2, 5)])
def test_decode_logits_match_fake_quant_oracle(bits, sinks):
    model = tiny_model("llama")
    length, prefill = 170, 70
    ids = torch.randint(1, 256, (1, length), generator=torch.Generator().manual_seed(bits + sinks))
    chunks = decode_chunks(prefill, length)
    cfg = dict(bits=bits, group=16, residual=32, sinks=sinks)
    with kvcompress.compress(model, _kivi(**cfg)) as cache:
        got = streamed_logits(model, ids, cache, chunks)
    ref = _oracle(model, ids, chunks, **cfg)
    assert (got - ref).abs().max().item() < 1e-4
    full = masked_logits(model, ids, causal_visibility(length))
    assert (got - full).abs().max().item() > 1e-3  # quantization is really applied


def test_chunked_continuation_over_quantized_middle_matches_oracle():
    model = tiny_model("qwen3")
    length = 150
    ids = torch.randint(1, 256, (1, length), generator=torch.Generator().manual_seed(11))
    chunks = decode_chunks(40, length, [(60, 9), (100, 20)])
    cfg = dict(bits=2, group=16, residual=16)
    with kvcompress.compress(model, _kivi(**cfg)) as cache:
        got = streamed_logits(model, ids, cache, chunks)
    assert (got - _oracle(model, ids, chunks, **cfg)).abs().max().item() < 1e-4


def test_wrong_axis_ablation_matches_its_oracle():
    model = tiny_model("llama")
    length = 120
    ids = torch.randint(1, 256, (1, length), generator=torch.Generator().manual_seed(12))
    chunks = decode_chunks(50, length)
    cfg = dict(bits=2, group=16, residual=16, key_axis="token")
    with kvcompress.compress(model, _kivi(**cfg)) as cache:
        got = streamed_logits(model, ids, cache, chunks)
    assert (got - _oracle(model, ids, chunks, **cfg)).abs().max().item() < 1e-4


def test_window_then_kivi_matches_oracle_and_memory_stays_bounded():
    model = tiny_model("llama")
    length, sinks, group, residual, recent = 260, 4, 16, 16, 64
    ids = torch.randint(1, 256, (1, length), generator=torch.Generator().manual_seed(13))
    chunks = decode_chunks(80, length)
    stack = {"compressors": [{"window": {"sinks": sinks, "recent": recent}},
                             {"kivi": {"bits": 2, "group": group, "residual": residual}}]}
    sizes = []
    with kvcompress.compress(model, stack) as cache:
        out = []
        for c0, c1 in chunks:
            out.append(model(ids[:, c0:c1], cache=cache).logits[0])
            sizes.append(cache.memory_report().cache_bytes)
        got = torch.cat(out)
    ref = _oracle(model, ids, chunks, bits=2, group=group, residual=residual, sinks=sinks,
                  budget=recent - residual)
    assert (got - ref).abs().max().item() < 1e-4
    assert max(sizes[len(sizes) // 2:]) == sizes[len(sizes) // 2]  # the group ring is reused, never grows


# ----------------------------------------------------------------------------- state and memory


def test_residual_flush_boundaries():
    model = tiny_model("llama", layers=1)
    g, r, s = 16, 32, 2
    ids = torch.randint(1, 256, (1, 140), generator=torch.Generator().manual_seed(3))
    with kvcompress.compress(model, _kivi(bits=2, group=g, residual=r, sinks=s)) as cache:
        layer = cache.compressed_layers[0]
        model(ids[:, :60], cache=cache)
        for n in range(60, 140):
            q = max(0, (n - s - r) // g) * g
            assert layer.middle.num_tokens == q, n
            assert layer.recent.size == n - s - q
            assert r <= layer.recent.size < r + g or n - s < r + g
            model(ids[:, n:n + 1], cache=cache)


def test_store_is_append_only():
    """Flushing new groups never rewrites stored codes."""
    from kvcompress.plugins.kivi import KiviConfig, KiviStore

    store = KiviStore(KiviConfig(bits=2, group=16, residual=0), head_dim=32)
    gen = torch.Generator().manual_seed(0)

    def block(n, start):
        return KVBlock(torch.randn(1, 2, n, 32, generator=gen), torch.randn(1, 2, n, 32, generator=gen),
                       torch.ones(1, n, dtype=torch.bool), torch.arange(start, start + n))

    store.append(block(32, 0))
    before = {k: v[:, :, :2].clone() for k, v in store.lanes[0][1].items()
              if k.startswith("k_")}
    for i in range(6):
        store.append(block(16, 32 + 16 * i))
    for name, t in before.items():
        assert torch.equal(store.lanes[0][1][name][:, :, :2], t)
    assert store.num_tokens == 128


def test_memory_report_three_bits_per_element():
    from kvcompress.plugins.kivi import KiviConfig, KiviStore

    store = KiviStore(KiviConfig(bits=2, group=32, residual=0), head_dim=64)
    t, h, d = 256, 3, 64
    store.append(KVBlock(torch.randn(1, h, t, d), torch.randn(1, h, t, d), torch.ones(1, t, dtype=torch.bool),
                         torch.arange(t)))
    sizes = store.nbytes()
    elements = 2 * h * t * d
    assert sizes["middle: kivi codes"] * 8 / elements == 2.0
    assert sizes["middle: kivi scales"] * 8 / elements == 1.0  # fp16 scale + zero per 32 elements
    assert sizes["middle: mask (rows)"] == t  # one byte per token per row (row bookkeeping)


def test_real_memory_saving_on_generation():
    model = tiny_model("llama")
    ids = torch.randint(1, 256, (1, 600), generator=torch.Generator().manual_seed(4))
    reports = {}
    for bits in (2, 4):
        with kvcompress.compress(model, _kivi(bits=bits, group=32, residual=32)) as cache:
            with torch.no_grad():
                model(ids, cache=cache)
        reports[bits] = cache.memory_report()
        middle = (600 - 32) // 32 * 32  # tokens quantized after a 600-token prefill with R = 32
        elements = 2 * 2 * middle * 16 * 2  # layers x kv heads x tokens x head_dim x (K and V)
        seg = reports[bits].segments
        assert seg["middle: kivi codes"] * 8 == elements * bits
        # keys: fp16 scale + zero per 32 tokens; values: per 16 channels (head_dim 16)
        assert seg["middle: kivi scales"] * 8 == elements // 2 * (32 / 32 + 32 / 16)
    assert reports[2].cache_bytes < reports[2].dense_fp16_bytes / 2 < reports[4].cache_bytes < reports[4].dense_fp16_bytes


def test_beam_search_reorders_the_packed_store():
    model = tiny_model("llama")
    prompt = torch.randint(1, 256, (1, 70), generator=torch.Generator().manual_seed(5))
    with kvcompress.compress(model, _kivi(bits=4, group=16, residual=16)) as cache:
        out = model.generate(prompt, max_new_tokens=12, num_beams=3, do_sample=False, cache=cache)
    assert out.shape == (1, 82)


# ----------------------------------------------------------------------------- read path


def test_merged_partials_equal_joint_reference_on_mixed_segments():
    gen = torch.Generator().manual_seed(9)
    b, hkv, group, q, d = 2, 3, 3, 2, 32
    query = torch.randn(b, hkv * group, q, d, generator=gen)
    k, v = torch.randn(b, hkv, 64, d, generator=gen), torch.randn(b, hkv, 64, d, generator=gen)
    kc, vc = quantize_keys(k, 2, 32), quantize_values(v, 2, 32)
    valid = torch.rand(b, 64, generator=gen) > 0.3
    valid[1] = False  # a row with nothing valid in the packed region
    packed = PackedKV(2, 32, *kc, *vc, valid)
    qpos = torch.tensor([100, 101])
    segs = [
        Segment(None, None, valid, torch.zeros((), dtype=torch.long).expand(64), packed=packed),
        Segment(torch.randn(b, hkv, 5, d, generator=gen), torch.randn(b, hkv, 5, d, generator=gen), None,
                torch.arange(5)),
        Segment(torch.randn(b, 2, 7, 16, generator=gen), torch.randn(b, 2, 7, d, generator=gen), None,
                torch.arange(10, 17), heads=torch.tensor([0, 2]), qmap=lambda x: x[..., :16]),
        Segment(torch.randn(b, hkv, 9, d, generator=gen), torch.randn(b, hkv, 9, d, generator=gen), None,
                torch.arange(20, 29), select=torch.rand(b, hkv, q, 9, generator=gen) > 0.5),
        Segment(torch.randn(b, hkv, q, d, generator=gen), torch.randn(b, hkv, q, d, generator=gen), None, qpos),
    ]
    got = attend_segments(query, segs, qpos, 0.2)
    ref = segment_attention(query, segs, qpos, 0.2)
    assert torch.allclose(got, ref, atol=1e-5)


def test_masked_slots_never_widen_a_key_group():
    """Evicted / padded slots are encoded with their group's valid mean: valid tokens quantize as if alone."""
    from kvcompress.plugins.kivi import KiviCodec, KiviConfig

    codec = KiviCodec(KiviConfig(bits=2, group=16, residual=0), head_dim=16)
    gen = torch.Generator().manual_seed(21)
    k, v = torch.randn(1, 2, 32, 16, generator=gen), torch.randn(1, 2, 32, 16, generator=gen)
    k[:, :, 20] = 100.0  # a huge masked key in the second group
    valid = torch.ones(1, 32, dtype=torch.bool)
    valid[0, 20] = False
    got = dequantize_keys(*(codec.encode(k, v, valid)[n] for n in ("k_codes", "k_scale", "k_zero")), 2)
    alone = fake_quant(k[:, :, 16:32][:, :, valid[0, 16:]], 2, dim=2)
    assert torch.allclose(got[:, :, 16:32][:, :, valid[0, 16:]], alone, atol=1e-5)
