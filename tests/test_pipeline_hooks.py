"""Every CacheCompressor hook is called at its stage, in pipeline order, and its result is honoured."""

import dataclasses

import torch

import kvcompress
from kvcompress import CompressorSpec, Layout, hookimpl, param
from kvcompress.registry import Registry
from kvcompress.stack import parse_stack
from kvcompress.state import DenseStore, KVBlock
from models import tiny_model
from reference import decode_chunks, masked_logits, streamed_logits


@dataclasses.dataclass(frozen=True)
class Cfg:
    recent: int = param(8, "full-precision recent tokens", min=0)


LOG: list[str] = []


class Scorer(kvcompress.Compressor):
    """Evict axis: scores |K| and evicts nothing; checks the score reached the evict stage."""

    @hookimpl
    def kvcompress_layer_layout(self, layer):
        return Layout(recent=self.config.recent, flush=4)

    @hookimpl
    def kvcompress_score_tokens(self, layer, block):
        LOG.append("score")
        block.meta["knorm"] = block.k.float().norm(dim=-1).mean(dim=1)  # [batch, tokens]

    @hookimpl
    def kvcompress_evict_tokens(self, layer, block):
        assert block.meta["knorm"].shape == block.valid.shape
        LOG.append("evict")
        return None


class Pruner(kvcompress.Compressor):
    @hookimpl
    def kvcompress_prune_channels(self, layer, block):
        LOG.append("prune")
        return None


class Projector(kvcompress.Compressor):
    @hookimpl
    def kvcompress_lowrank_transform(self, layer, block):
        LOG.append("lowrank")
        return None


class Regrouper(kvcompress.Compressor):
    @hookimpl
    def kvcompress_regroup_heads(self, layer, block):
        LOG.append("regroup")
        return KVBlock(block.k, block.v, block.valid, block.positions, block.meta)


class HalfStore(DenseStore):
    def append(self, block):
        LOG.append(f"store:{block.num_tokens}")
        super().append(dataclasses.replace(block, k=block.k.half(), v=block.v.half()))

    def segments(self):
        return [dataclasses.replace(s, k=s.k.float(), v=s.v.float()) for s in super().segments()]


class Halver(kvcompress.Compressor):
    @hookimpl
    def kvcompress_quantize_store(self, layer):
        return HalfStore()


class EvenSelector(kvcompress.Compressor):
    """Read-time selection: the middle is read only at even logical positions."""

    @hookimpl
    def kvcompress_layer_layout(self, layer):
        return Layout(recent=self.config.recent)

    @hookimpl
    def kvcompress_select_tokens(self, layer, query):
        (seg,) = layer.middle.segments()
        even = (seg.positions % 2 == 0)  # [tokens]
        b, hkv, q_len = query.shape[0], layer.info.num_kv_heads, query.shape[2]
        return even.view(1, 1, 1, -1).expand(b, hkv, q_len, -1)


def _registry():
    reg = Registry()
    for name, axis, factory in [("scorer", "evict", Scorer), ("pruner", "prune", Pruner), ("projector", "lowrank", Projector),
                                ("regrouper", "regroup", Regrouper), ("halver", "quantize", Halver),
                                ("even", "select", EvenSelector)]:
        reg.add(CompressorSpec(name=name, axis=axis, config=Cfg, factory=factory), "test")
    return reg


def test_flush_runs_score_evict_prune_regroup_store_in_order():
    model = tiny_model("llama", layers=1)
    stack = parse_stack({"compressors": [{"scorer": {}}, {"pruner": {}}, {"regrouper": {}}, {"halver": {}}]},
                        registry=_registry())
    LOG.clear()
    ids = torch.randint(1, 256, (1, 30), generator=torch.Generator().manual_seed(0))
    with kvcompress.compress(model, stack) as cache:
        streamed_logits(model, ids, cache, decode_chunks(18, 30))
    # prefill 18 with recent 8, flush 4: 8 tokens leave at once, then 4 every 4 steps
    assert LOG == ["score", "evict", "prune", "regroup", "store:8"] + ["score", "evict", "prune", "regroup", "store:4"] * 3
    layer = cache.compressed_layers[0]
    assert layer.middle.num_tokens == 20 and layer.recent.size == 10
    assert layer.middle.buf.k.dtype == torch.float16  # the store really holds half precision


def test_lowrank_stage_runs_between_evict_and_regroup():
    model = tiny_model("llama", layers=1)
    stack = parse_stack({"compressors": [{"scorer": {}}, {"projector": {}}, {"regrouper": {}}]}, registry=_registry())
    LOG.clear()
    ids = torch.randint(1, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    with kvcompress.compress(model, stack) as cache:
        model(ids, cache=cache)
    assert LOG == ["score", "evict", "lowrank", "regroup"]


def test_quantize_store_is_what_attention_reads():
    model = tiny_model("llama")
    ids = torch.randint(1, 256, (1, 80), generator=torch.Generator().manual_seed(1))
    chunks = decode_chunks(40, 80)
    half = parse_stack({"compressors": [{"scorer": {}}, {"halver": {}}]}, registry=_registry())
    full = parse_stack({"compressors": [{"scorer": {}}]}, registry=_registry())
    with kvcompress.compress(model, half) as cache:
        got_half = streamed_logits(model, ids, cache, chunks)
    mem_half = cache.memory_report().segments["middle"]
    with kvcompress.compress(model, full) as cache:
        got_full = streamed_logits(model, ids, cache, chunks)
    mem_full = cache.memory_report().segments["middle"]
    diff = (got_half - got_full).abs().max().item()
    assert 0 < diff < 2e-2  # fp16 rounding of the middle is visible but small
    assert mem_half < 0.6 * mem_full


def test_select_tokens_hides_unselected_middle_tokens_exactly():
    model = tiny_model("llama")
    length, recent = 120, 8
    ids = torch.randint(1, 256, (1, length), generator=torch.Generator().manual_seed(2))
    chunks = decode_chunks(30, length)
    stack = parse_stack({"compressors": [{"even": {"recent": recent}}]}, registry=_registry())
    with kvcompress.compress(model, stack) as cache:
        got = streamed_logits(model, ids, cache, chunks)
    allowed = torch.zeros(length, length, dtype=torch.bool)
    for c0, c1 in chunks:
        in_ring = max(0, c0 - recent)  # tokens before this leave the ring into the middle
        kept = torch.zeros(length, dtype=torch.bool)
        if c0 == 0:
            pass
        else:
            kept[in_ring:c0] = True
            kept[:in_ring] = torch.arange(in_ring) % 2 == 0
        for t in range(c0, c1):
            allowed[t] = kept
            allowed[t, c0:t + 1] = True
    ref = masked_logits(model, ids, allowed)
    assert (got - ref).abs().max().item() < 1e-4


class LateBudget(kvcompress.Compressor):
    """Evict axis: a budget of 20 tokens on layers after the first only (a layout that needs the model)."""

    @hookimpl
    def kvcompress_layer_layout(self, layer):
        if layer.index == 0:
            return Layout(recent=self.config.recent, flush=4)
        return Layout(recent=self.config.recent, flush=4, budget=20)


def test_a_budget_swallowed_on_one_layer_is_refused_when_the_cache_is_built():
    import pytest

    from kvcompress.errors import ConfigError

    reg = _registry()
    reg.add(CompressorSpec(name="late", axis="evict", config=Cfg, factory=LateBudget), "test")
    fits = parse_stack({"compressors": [{"late": {"recent": 8}}]}, registry=reg)  # validates: layer 0 has no budget
    kvcompress.Cache(fits, tiny_model("llama", layers=2))
    swallowed = parse_stack({"compressors": [{"late": {"recent": 24}}]}, registry=reg)
    with pytest.raises(ConfigError, match=r"compressors\[0\]\.late.*recent window of 24.*a budget of 20 tokens"):
        kvcompress.Cache(swallowed, tiny_model("llama", layers=2))
