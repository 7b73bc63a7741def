"""Ring-buffer window with sinks (StreamingLLM) against an independent masked-attention oracle."""

import pytest
import torch

import kvcompress
from models import tiny_model
from reference import causal_visibility, decode_chunks, masked_logits, streamed_logits, window_visibility


def _stack(sinks, recent):
    return {"compressors": [{"window": {"sinks": sinks, "recent": recent}}]}


@pytest.mark.parametrize("arch,sinks,recent", [("llama", 4, 32), ("qwen3", 0, 24), ("mistral", 1, 17)])
def test_window_logits_match_masked_reference_over_long_decode(arch, sinks, recent):
    model = tiny_model(arch)
    length = 380
    ids = torch.randint(1, 256, (1, length), generator=torch.Generator().manual_seed(0))
    chunks = decode_chunks(60, length)  # prefill 60, then 320 single-token decode steps
    with kvcompress.compress(model, _stack(sinks, recent)) as cache:
        got = streamed_logits(model, ids, cache, chunks)
    ref = masked_logits(model, ids, window_visibility(length, chunks, sinks, recent))
    assert (got - ref).abs().max().item() < 1e-4
    # the policy really evicts: full attention differs
    full = masked_logits(model, ids, causal_visibility(length))
    assert (got - full).abs().max().item() > 1e-2


def test_window_chunked_continuation_matches_reference():
    """Multi-token chunks after a filled cache (q_len > 1 over evicted storage)."""
    model = tiny_model("llama")
    length = 200
    ids = torch.randint(1, 256, (1, length), generator=torch.Generator().manual_seed(1))
    chunks = decode_chunks(40, length, [(90, 7), (140, 33)])
    with kvcompress.compress(model, _stack(3, 16)) as cache:
        got = streamed_logits(model, ids, cache, chunks)
    ref = masked_logits(model, ids, window_visibility(length, chunks, 3, 16))
    assert (got - ref).abs().max().item() < 1e-4


def test_window_on_hybrid_sliding_model_keeps_native_sliding_layers():
    model = tiny_model("gemma3")
    length = 160
    ids = torch.randint(1, 256, (1, length), generator=torch.Generator().manual_seed(2))
    chunks = decode_chunks(30, length, [(100, 5)])
    with kvcompress.compress(model, _stack(2, 20)) as cache:
        got = streamed_logits(model, ids, cache, chunks)
    assert [type(layer).__name__ for layer in cache.layers] == [
        "DynamicSlidingWindowLayer", "DynamicSlidingWindowLayer", "CompressedCacheLayer"]
    ref = masked_logits(model, ids, window_visibility(length, chunks, 2, 20), sliding_window=8)
    assert (got - ref).abs().max().item() < 1e-4


def test_window_generate_equals_streamed_reference_tokens():
    """generate() through the window equals greedy decoding under the masked oracle."""
    model = tiny_model("llama")
    prompt = torch.randint(1, 256, (1, 40), generator=torch.Generator().manual_seed(3))
    with kvcompress.compress(model, _stack(2, 12)) as cache:
        out = model.generate(prompt, max_new_tokens=30, do_sample=False, cache=cache)
    length = out.shape[1]
    chunks = decode_chunks(40, length)
    ref_logits = masked_logits(model, out, window_visibility(length, chunks, 2, 12))
    ref_next = ref_logits[39:-1].argmax(-1)
    assert torch.equal(out[0, 40:], ref_next)


def test_padded_batch_matches_each_row_alone():
    model = tiny_model("qwen3")
    gen = torch.Generator().manual_seed(4)
    a = torch.randint(1, 256, (1, 30), generator=gen)
    b = torch.randint(1, 256, (1, 21), generator=gen)
    ids = torch.cat([a, torch.cat([torch.zeros(1, 9, dtype=torch.long), b], 1)], 0)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    stack = _stack(3, 12)

    def run(x, m):
        with kvcompress.compress(model, stack) as cache:
            o = model.generate(x, attention_mask=m, max_new_tokens=30, do_sample=False, cache=cache,
                               output_logits=True, return_dict_in_generate=True)
        return o.sequences, torch.stack(o.logits, 1)

    seq, logits = run(ids, mask)
    seq_a, logits_a = run(a, torch.ones_like(a))
    seq_b, logits_b = run(b, torch.ones_like(b))
    assert torch.equal(seq[0, 30:], seq_a[0, 30:])
    assert torch.equal(seq[1, 30:], seq_b[0, 21:])
    assert (logits[0] - logits_a[0]).abs().max().item() < 1e-4
    assert (logits[1] - logits_b[0]).abs().max().item() < 1e-4


def test_padded_row_never_keeps_pad_tokens_as_sinks():
    model = tiny_model("llama")
    ids = torch.randint(1, 256, (2, 20), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    with kvcompress.compress(model, _stack(4, 8)) as cache:
        model(ids, attention_mask=mask, cache=cache)
    layer = cache.compressed_layers[0]
    assert layer.sinks.positions[0].tolist() == [0, 1, 2, 3]
    assert layer.sinks.positions[1].tolist() == [6, 7, 8, 9]


def test_memory_report_shrinks_with_the_window():
    model = tiny_model("llama")
    ids = torch.randint(1, 256, (1, 300), generator=torch.Generator().manual_seed(6))
    reports = {}
    for name, stack in {"none": None, "window": _stack(4, 60)}.items():
        with kvcompress.compress(model, stack) as cache:
            model(ids, cache=cache)
        reports[name] = cache.memory_report()
    full, win = reports["none"], reports["window"]
    assert full.dense_fp16_bytes == win.dense_fp16_bytes == 2 * 2 * 300 * 2 * 16 * 2  # layers*(K,V)*T*H*D*2B
    # fp32 buffers: the window holds 64 of 300 tokens (plus per-slot bookkeeping)
    per_token_fp32 = 2 * 2 * 2 * 16 * 4
    assert win.cache_bytes < 70 * per_token_fp32 + 4096
    assert full.cache_bytes >= 300 * per_token_fp32
    assert win.ratio > 2.0
