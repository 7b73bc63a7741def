"""LeanK compressor: pruned, regrouped middle against an independent masked-channel oracle."""

import pytest
import torch

import kvcompress
from kvcompress.calibration.masks import config_hash, rope_mask, save_mask
from kvcompress.errors import ConfigError, KVCompressError
from models import tiny_model
from reference import causal_visibility, decode_chunks, masked_logits, middle_oracle_logits, streamed_logits


def _mixed_keep() -> torch.Tensor:
    """Tiny llama (2 layers, 2 kv heads, head_dim 16): counts 8/8 in layer 0; 16/0 in layer 1."""
    keep = torch.zeros(2, 2, 16, dtype=torch.bool)
    keep[0, 0, 1::2] = True
    keep[0, 1, :4] = True
    keep[0, 1, 12:] = True
    keep[1, 0] = True  # keeps everything; head 1 of layer 1 keeps nothing
    return keep


def _mask_file(tmp_path, model, keep, name="mask.safetensors"):
    path = tmp_path / name
    save_mask(path, keep, {"model": "tiny-llama", "model_config_hash": config_hash(model.config), "ratio": 0.5,
                           "align": 4, "sinks": 2, "local": 16, "method": "trained", "settings": {}})
    return str(path)


def _stack(mask, sinks=3, local=24, flush=8, **extra):
    entry = {"leank": {"mask": mask, "sinks": sinks, "local": local, "flush": flush}}
    return {"compressors": [entry] + extra.get("after", [])}


def test_decode_logits_match_masked_channel_oracle(tmp_path):
    model = tiny_model("llama")
    keep = _mixed_keep()
    length = 200
    ids = torch.randint(1, 256, (1, length), generator=torch.Generator().manual_seed(0))
    chunks = decode_chunks(60, length, [(120, 5)])
    with kvcompress.compress(model, _stack(_mask_file(tmp_path, model, keep))) as cache:
        got = streamed_logits(model, ids, cache, chunks)
    ref = middle_oracle_logits(model, ids, chunks, sinks=3, recent=24, flush=8, keep=keep)
    assert (got - ref).abs().max().item() < 1e-4
    assert (got - masked_logits(model, ids, causal_visibility(length))).abs().max().item() > 1e-3


def test_regrouped_storage_and_zero_count_heads_hold_no_values(tmp_path):
    model = tiny_model("llama")
    keep = _mixed_keep()
    ids = torch.randint(1, 256, (1, 100), generator=torch.Generator().manual_seed(1))
    with kvcompress.compress(model, _stack(_mask_file(tmp_path, model, keep))) as cache:
        with torch.no_grad():
            model(ids, cache=cache)
    layer0, layer1 = cache.compressed_layers
    lanes0 = [(g.heads.tolist(), buf.k.shape[-1], buf.v.shape[1]) for g, buf in layer0.middle.lanes]
    assert lanes0 == [([0, 1], 8, 2)]  # both heads keep 8: one dense group
    assert layer0.middle.lanes[0][0].channels.tolist() == [list(range(1, 16, 2)), [0, 1, 2, 3, 12, 13, 14, 15]]
    lanes1 = [(g.heads.tolist(), buf.k.shape[-1], buf.v.shape[1]) for g, buf in layer1.middle.lanes]
    assert lanes1 == [([0], 16, 1)]  # head 1 keeps nothing: no K and no V lane at all
    middle = 100 - 3 - 24 - (100 - 3 - 24) % 8  # flushed tokens
    assert layer1.middle.num_tokens == middle
    # real bytes (fp32): layer 0 holds K 2 heads x 8 channels + V 2 x 16; layer 1 K 1 x 16 + V 1 x 16;
    # each lane also keeps a validity byte and a position (int64) per token, and its head and channel indices
    # (int64): layer 0 heads [2] + channels [2, 8], layer 1 heads [1] + channels [1, 16].  Layer 0's lane holds
    # every head: its validity and positions are the row's bookkeeping ("middle (rows)"); layer 1's lane of one
    # head keeps its own copy, counted with its head
    segments = cache.memory_report().segments
    assert segments["middle"] == middle * (4 * (2 * 8 + 2 * 16 + 16 + 16) + (1 + 8)) + 8 * (2 + 16 + 1 + 16)
    assert segments["middle (rows)"] == middle * (1 + 8)


def test_rope_mask_source_matches_oracle_with_the_same_mask():
    model = tiny_model("qwen3")
    keep = rope_mask(model.config, 0.5, 4)
    assert keep.sum(-1).unique().tolist() == [8]
    length = 150
    ids = torch.randint(1, 256, (1, length), generator=torch.Generator().manual_seed(2))
    chunks = decode_chunks(50, length)
    stack = {"compressors": [{"leank": {"mask": "rope", "ratio": 0.5, "align": 4, "sinks": 2, "local": 16,
                                        "flush": 8}}]}
    with kvcompress.compress(model, stack) as cache:
        got = streamed_logits(model, ids, cache, chunks)
    ref = middle_oracle_logits(model, ids, chunks, sinks=2, recent=16, flush=8, keep=keep)
    assert (got - ref).abs().max().item() < 1e-4


def test_leank_then_kivi_matches_oracle(tmp_path):
    model = tiny_model("llama")
    keep = _mixed_keep()
    length = 220
    ids = torch.randint(1, 256, (1, length), generator=torch.Generator().manual_seed(3))
    chunks = decode_chunks(70, length)
    stack = _stack(_mask_file(tmp_path, model, keep), sinks=3, local=24, flush=16,
                   after=[{"kivi": {"bits": 2, "group": 16, "residual": 16}}])
    with kvcompress.compress(model, stack) as cache:
        got = streamed_logits(model, ids, cache, chunks)
    ref = middle_oracle_logits(model, ids, chunks, sinks=3, recent=24, flush=16, keep=keep, bits=2, group=16)
    assert (got - ref).abs().max().item() < 1e-4
    seg = cache.memory_report().segments
    assert "middle: kivi codes" in seg and "middle" not in seg
    # layer 0: 2 heads x 8 channels of K; layer 1: 1 head x 16 channels (head 1 dropped) -> same K codes
    layer1 = cache.compressed_layers[1]
    assert [b["v_codes"].shape[1] for _, b in layer1.middle.lanes] == [1]


def test_mask_for_another_model_is_refused(tmp_path):
    model = tiny_model("llama")
    other = tiny_model("llama", layers=3)
    keep = torch.ones(3, 2, 16, dtype=torch.bool)
    path = _mask_file(tmp_path, other, keep)
    with pytest.raises(KVCompressError) as err:
        with kvcompress.compress(model, _stack(path)):
            pass
    assert "mask" in str(err.value).lower() and path in str(err.value)


def test_missing_mask_file_is_a_config_error_before_any_model():
    with pytest.raises(ConfigError) as err:
        kvcompress.parse_stack(_stack("no/such/mask.safetensors"))
    assert "compressors[0].leank.mask" in str(err.value) and "kvcompress calibrate leank" in str(err.value)


def test_stack_order_leank_after_kivi_is_rejected():
    with pytest.raises(ConfigError):
        kvcompress.parse_stack({"compressors": [{"kivi": {}}, {"leank": {}}]})
