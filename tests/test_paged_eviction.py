"""PagedEviction over the paged pool: decode logits against an independent oracle, and the invariants.

The oracle never touches kvcompress: one teacher-forced forward whose attention function, at
every layer, recomputes the token scores (mean over kv heads of ||V||/||K||) from that layer's
own keys and values, replays the policy on plain Python lists (:func:`simulate`) and masks
exactly the evicted (query, key) pairs; stacked with KIVI it fake-quantizes each page's keys
per channel over G kept tokens and values per token; with LeanK it masks the pruned key
channels of the middle.  Equal to streaming because the state at step t depends only on
positions < t (algorithms.md §9).
"""

from __future__ import annotations

import math

import pytest
import torch

import kvcompress
from kvcompress.errors import ConfigError
from kvcompress.paged import PagedStore
from kvcompress.state import KVBlock
from models import tiny_model
from reference import causal_visibility, decode_chunks, fake_quant, masked_logits, streamed_logits


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models on a shared 2-core machine: intra-op threads only add contention (20x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _stack(after=(), **cfg):
    return {"compressors": [{"paged_eviction": cfg}, *after]}


# ----------------------------------------------------------------------------- independent policy replay


def simulate(scores, chunks, *, budget, block, sinks, recent=0, flush=None):
    """Replay the policy for one row of one layer on lists of positions.

    Returns ``(allowed [L, L], middle [L, L], pages_log)``: key j is visible to query t, key j is
    read from the pool by query t, and every page as written (token lists, write order).
    """
    flush = flush or block
    length = len(scores)
    allowed = torch.zeros(length, length, dtype=torch.bool)
    middle = torch.zeros(length, length, dtype=torch.bool)
    sink, ring, pages, log = [], [], [], []
    evictions = []  # (boundary count, pages evicted) per flush after prefill
    prefilled = False
    for c0, c1 in chunks:
        in_pages = [t for p in pages for t in p]
        kept = sink + in_pages + ring
        allowed[c0:c1, kept] = True
        middle[c0:c1, in_pages] = True
        for t in range(c0, c1):
            allowed[t, c0:t + 1] = True
            (sink if len(sink) < sinks else ring).append(t)
        if len(ring) < recent + flush:
            continue
        m = (len(ring) - recent) // flush * flush
        blk, ring = ring[:m], ring[m:]
        held = len(sink) + len(ring) + sum(len(p) for p in pages)
        if not prefilled:
            prefilled = True
            room = max(0, budget - held)
            if len(blk) > room:
                protect = min(max(0, block - len(ring)), room)
                newest = blk[len(blk) - protect:]
                ranked = sorted(blk[:len(blk) - protect], key=lambda t: (-scores[t], t))[:room - protect]
                blk = sorted(newest + ranked)
            new = [blk[i:i + block] for i in range(0, len(blk), block)]
            pages += new
            log += new
            continue
        gone = 0
        for i in range(0, len(blk), block):
            page = blk[i:i + block]
            pages.append(page)
            held += len(page)
            if held > budget and len(pages) > 1:
                means = [sum(scores[t] for t in p) / len(p) for p in pages[:-1]]
                j = min(range(len(means)), key=lambda x: (means[x], x))
                held -= len(pages.pop(j))
                gone += 1
            if page in pages:
                log.append(page)
        evictions.append((len(blk) // block, gone))
    return allowed, middle, log, evictions


def oracle_logits(model, ids, chunks, *, budget, block, sinks, recent=0, flush=None, bits=None, group=None,
                  keep=None, record=None):
    """Teacher-forced logits with the replayed policy applied per layer (see the module docstring)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def attn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        b, hq, length, d = query.shape
        hkv = key.shape[1]
        rep = hq // hkv
        k, v = key.float(), value.float()
        scores = (v.norm(dim=-1) / k.norm(dim=-1).clamp(min=1e-6)).mean(dim=1)[0].tolist()
        allowed, middle, log, evictions = simulate(scores, chunks, budget=budget, block=block, sinks=sinks,
                                                   recent=recent, flush=flush)
        if record is not None:
            record[module.layer_idx] = (allowed, middle, log, evictions)
        km, vm = k.clone(), v.clone()
        see_middle = torch.ones(hq, dtype=torch.bool)
        if keep is not None:
            km = km * keep[module.layer_idx].to(km.dtype)[None, :, None, :]
            see_middle = keep[module.layer_idx].any(-1).repeat_interleave(rep)
        if bits is not None:
            gv = math.gcd(group, d)
            for page in log:  # each page is encoded once, from its own kept tokens
                idx = torch.tensor(page)
                slots = km[:, :, idx]
                if len(page) % group:  # a partial group: empty slots hold the mean of its valid tokens
                    last = slots[:, :, len(page) // group * group:]
                    fill = last.mean(dim=2, keepdim=True).expand(b, hkv, group - len(page) % group, d)
                    slots = torch.cat([slots, fill], dim=2)
                for g0 in range(0, slots.shape[2], group):
                    slots[:, :, g0:g0 + group] = fake_quant(slots[:, :, g0:g0 + group], bits, dim=2)
                km[:, :, idx] = slots[:, :, :len(page)]
                idx = torch.tensor(page)
                vm[:, :, idx] = fake_quant(vm[:, :, idx].reshape(b, hkv, len(page), d // gv, gv), bits,
                                           -1).reshape(b, hkv, len(page), d)
        k, v, km, vm = (t.repeat_interleave(rep, 1) for t in (k, v, km, vm))
        q = query.float()
        use_mid = middle[None, None]
        s = torch.where(use_mid, q @ km.transpose(-1, -2), q @ k.transpose(-1, -2)) * scaling
        vis = allowed[None, None] & ~(use_mid & ~see_middle.view(1, hq, 1, 1))
        p = torch.softmax(s.masked_fill(~vis, float("-inf")), dim=-1)
        out = (p * use_mid) @ vm + (p * ~use_mid) @ v
        return out.transpose(1, 2).to(query.dtype), None

    ALL_ATTENTION_FUNCTIONS.register("kvcompress_test_paged_oracle", attn)
    ALL_MASK_ATTENTION_FUNCTIONS.register("kvcompress_test_paged_oracle", sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation("kvcompress_test_paged_oracle")
    try:
        with torch.no_grad():
            return model(ids, position_ids=torch.arange(ids.shape[1])[None]).logits[0]
    finally:
        model.set_attn_implementation(previous)


def _ids(length, seed):
    return torch.randint(1, 256, (1, length), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- decode vs oracle


@pytest.mark.parametrize("arch,budget,block,sinks,prefill", [
    ("llama", 96, 16, None, 150),   # prefill evicts 150 -> 96 at token granularity, then pages
    ("qwen3", 80, 16, 4, 40),       # prompt under budget: eviction starts during decoding
])
def test_decode_logits_match_replayed_policy(arch, budget, block, sinks, prefill):
    model = tiny_model(arch)
    length = 330
    ids = _ids(length, budget)
    chunks = decode_chunks(prefill, length)
    cfg = dict(budget=budget, block=block) | ({} if sinks is None else {"sinks": sinks})
    with kvcompress.compress(model, _stack(**cfg)) as cache:
        got = streamed_logits(model, ids, cache, chunks)
    record = {}
    ref = oracle_logits(model, ids, chunks, budget=budget, block=block, sinks=block if sinks is None else sinks,
                        record=record)
    assert (got - ref).abs().max().item() < 1e-4
    assert (got - masked_logits(model, ids, causal_visibility(length))).abs().max().item() > 1e-2
    # the replay evicted pages at block boundaries, and the layers decided differently
    assert sum(g for _, g in record[0][3]) > 5
    assert not torch.equal(record[0][0], record[1][0])


@pytest.mark.parametrize("static", [False, True])
def test_kivi_pages_match_fake_quant_oracle(static):
    """KIVI-coded pages against the fake-quantizing oracle; on a static cache with the prompt in two chunks (the
    second over the budget: its pages' codes and scales placed by the pool's one-write host path)."""
    model = tiny_model("llama")
    length, group, residual, block, budget = 260, 16, 16, 32, 128
    ids = _ids(length, 7)
    chunks = decode_chunks(120, length)
    if static:
        chunks = [(0, 50), (50, 120)] + chunks[1:]
    stack = _stack(after=[{"kivi": {"bits": 2, "group": group, "residual": residual}}], budget=budget, block=block,
                   sinks=8)
    with kvcompress.compress(model, stack, **({"max_cache_len": length + 8} if static else {})) as cache:
        got = streamed_logits(model, ids, cache, chunks)
    ref = oracle_logits(model, ids, chunks, budget=budget, block=block, sinks=8, recent=residual, bits=2, group=group)
    assert (got - ref).abs().max().item() < 1e-4
    seg = cache.memory_report().segments
    assert "middle: pages, kivi codes" in seg and "middle: pages" not in seg
    plain = oracle_logits(model, ids, chunks, budget=budget, block=block, sinks=8, recent=residual)
    assert (got - plain).abs().max().item() > 1e-3  # the pages really are quantized


def test_leank_lanes_match_masked_channel_oracle(tmp_path):
    from kvcompress.calibration.masks import config_hash, save_mask

    model = tiny_model("llama")
    keep = torch.zeros(2, 2, 16, dtype=torch.bool)
    keep[0, 0, 1::2] = True
    keep[0, 1, :8] = True
    keep[1, 0] = True  # layer 1: head 1 keeps nothing (no K and no V pages)
    path = tmp_path / "mask.safetensors"
    save_mask(path, keep, {"model": "tiny-llama", "model_config_hash": config_hash(model.config), "ratio": 0.5,
                           "align": 4, "sinks": 2, "local": 16, "method": "trained", "settings": {}})
    length, block, budget = 240, 16, 112
    ids = _ids(length, 8)
    chunks = decode_chunks(100, length, [(170, 5)])
    leank = {"leank": {"mask": str(path), "sinks": 4, "local": 16, "flush": 32}}
    with kvcompress.compress(model, _stack(after=[leank], budget=budget, block=block)) as cache:
        got = streamed_logits(model, ids, cache, chunks)
    ref = oracle_logits(model, ids, chunks, budget=budget, block=block, sinks=block, recent=16, flush=32, keep=keep)
    assert (got - ref).abs().max().item() < 1e-4
    lanes = [[(g.heads.tolist(), bufs["k"].shape[-1], bufs["v"].shape[1]) for g, bufs in layer.middle.lanes]
             for layer in cache.compressed_layers]
    assert lanes == [[([0, 1], 8, 2)], [([0], 16, 1)]]


# ----------------------------------------------------------------------------- invariants


def _layer_sizes(layer):
    """Tokens each row holds in the layer: sinks + window + pages."""
    ring = layer.recent
    window = ring.valid[:, ring.ordered()].sum(1).tolist() if ring.size else [0] * len(layer.sinks.count)
    return [s + w + p for s, w, p in zip(layer.sinks.count, window, layer.middle.row_tokens())]


def test_invariants_over_a_long_generation():
    """Size C after prefill; one page per boundary when over budget; newest and sink blocks kept; pages
    reused from the free list; memory flat while generating far past the budget."""
    model = tiny_model("llama", layers=1)
    budget, block = 64, 16
    ids = _ids(700, 9)
    with kvcompress.compress(model, _stack(budget=budget, block=block)) as cache:
        layer = cache.compressed_layers[0]
        with torch.no_grad():
            model(ids[:, :200], cache=cache)
        assert _layer_sizes(layer) == [budget]  # exactly C after prefill
        store, state = layer.middle, layer.state["paged_eviction"]
        # the newest block of the prompt (positions 192..199 in the window, 184..191 paged) was kept
        kept = set(store.positions[store.valid].tolist())
        assert set(range(184, 192)) <= kept and layer.sinks.positions[0].tolist() == list(range(16))
        report0 = cache.memory_report().cache_bytes
        sizes, peaks = [], []
        for t in range(200, 700):
            boundaries, evicted = state.boundaries, state.evicted
            held_pages = store.row_tokens()[0]
            with torch.no_grad():
                model(ids[:, t:t + 1], cache=cache)
            sizes.append(_layer_sizes(layer)[0])
            peaks.append(cache.memory_report().cache_bytes)
            if (t + 1 - 16) % block == 0:  # a block boundary: the newest block became a page
                assert state.boundaries == boundaries + 1
                over = 16 + held_pages + block > budget
                assert state.evicted - evicted == int(over)
                newest = store.rows[0][-1]  # never the newest block
                assert sorted(store.positions[newest].tolist()) == list(range(t + 1 - block, t + 1))
            else:
                assert state.boundaries == boundaries and state.evicted == evicted
        assert max(sizes) <= budget + block - 1 and min(sizes[100:]) >= budget - block
        assert store.stats["reused"] > 25 and store.stats["overflow"] == 0
        assert store.capacity <= store.bound()
        assert max(peaks[50:]) - min(peaks[50:]) <= 8  # flat (the block table's width may change by one entry)
        assert max(peaks) <= report0 + block * 2 * 2 * 16 * 4 + 64  # at most one more page than after prefill
        assert sorted(layer.sinks.positions[0].tolist()) == list(range(16))  # sinks never evicted


def test_batch_rows_decide_independently():
    model = tiny_model("llama")
    ids = torch.randint(1, 256, (2, 180), generator=torch.Generator().manual_seed(10))
    chunks = decode_chunks(120, 180)
    stack = _stack(budget=64, block=16)

    def pages(cache, b):
        store = cache.compressed_layers[1].middle
        return [store.positions[p][store.valid[p]].tolist() for p in store.rows[b]]

    with kvcompress.compress(model, stack) as cache:
        with torch.no_grad():
            both = torch.cat([model(ids[:, c0:c1], cache=cache).logits for c0, c1 in chunks], 1)
    for b in range(2):
        with kvcompress.compress(model, stack) as single:
            alone = streamed_logits(model, ids[b:b + 1], single, chunks)
        assert (both[b] - alone).abs().max().item() < 1e-4
        assert pages(cache, b) == pages(single, 0)
    assert pages(cache, 0) != pages(cache, 1)  # the rows kept different tokens, each in its own pages


def test_padded_batch_never_pages_padding():
    model = tiny_model("qwen3")
    ids = torch.randint(1, 256, (2, 150), generator=torch.Generator().manual_seed(11))
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    with kvcompress.compress(model, _stack(budget=64, block=16)) as cache:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, cache=cache)
    assert out.shape == (2, 190)
    for layer in cache.compressed_layers:
        store = layer.middle
        assert min(store.positions[store.rows[1]][store.valid[store.rows[1]]].tolist()) >= 37 + 16
        assert max(_layer_sizes(layer)) <= 64 + 15


def test_beam_search_and_repeat_copy_pages_per_row():
    model = tiny_model("llama")
    ids = torch.randint(1, 256, (1, 90), generator=torch.Generator().manual_seed(12))
    with kvcompress.compress(model, _stack(budget=48, block=16)) as cache:
        out = model.generate(ids, max_new_tokens=40, num_beams=3, do_sample=False, cache=cache)
    assert out.shape[1] == 130
    store = cache.compressed_layers[0].middle
    pages = [p for r in store.rows for p in r]
    assert len(pages) == len(set(pages))  # no page shared by two rows
    assert len(store.free) + len(pages) == store.fresh


@pytest.mark.parametrize("static,prompt", [(False, "decode"), (True, "decode"), (True, "chunked")])
def test_multi_block_chunk_is_a_sequence_of_boundaries(static, prompt):
    """A 50-token chunk after prefill: 3 boundaries, at most one page evicted each, pages of the chunk included.
    On a static cache too, and there with a prompt sent in chunks over the budget (the host replay of the
    boundaries and the pool's one-write page placement, not the decode path's tensor ops)."""
    model = tiny_model("llama", layers=1)
    ids = _ids(200, 13)
    if prompt == "decode":
        chunks, seen = [(0, 100), (100, 101), (101, 151)] + [(t, t + 1) for t in range(151, 200)], (3, 3)
    else:
        chunks, seen = [(0, 40), (40, 90), (90, 150), (150, 170)] + [(t, t + 1) for t in range(170, 200)], (4, 4)
    with kvcompress.compress(model, _stack(budget=64, block=16), **({"max_cache_len": 208} if static else {})) as cache:
        got = streamed_logits(model, ids, cache, chunks)
    record = {}
    ref = oracle_logits(model, ids, chunks, budget=64, block=16, sinks=16, record=record)
    assert (got - ref).abs().max().item() < 1e-4
    assert seen in record[0][3]


def test_host_replay_of_boundaries_equals_the_tensor_loop():
    """A prompt chunk's page boundaries (host heap per row) decide exactly as the decode path's branch-free tensor
    loop, on random pools: partial and empty incoming pages, tied scores (the older page goes), rows under budget."""
    from kvcompress.plugins.paged_eviction import _boundaries_device, _replay_boundaries

    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        b, budget = 3, 48
        m, n = int(torch.randint(2, 9, (1,), generator=g)), int(torch.randint(1, 7, (1,), generator=g))
        live = torch.cat([torch.rand(b, m, generator=g) < 0.7, torch.zeros(b, n, dtype=torch.bool)], 1)
        score = torch.randint(0, 4, (b, m + n), generator=g).float() / 4  # few values: many ties
        tokens = torch.cat([torch.randint(1, 9, (b, m), generator=g), torch.randint(0, 9, (b, n), generator=g)], 1)
        age = torch.randperm(m + n, generator=g).expand(b, -1).clone()
        held = (live[:, :m] * tokens[:, :m]).sum(1) + torch.randint(0, 20, (b,), generator=g)
        inc = tokens[:, m:]
        want = _boundaries_device(live, score, tokens, age, held, inc, m, torch.ones((), dtype=torch.bool), budget)
        got = _replay_boundaries(live.tolist(), score.tolist(), tokens.tolist(), age.tolist(), held.tolist(),
                                 inc.tolist(), budget)
        assert torch.equal(torch.tensor(got), want), trial


@pytest.mark.parametrize("score", ["key_norm", "inverse_key_norm", "random"])
def test_other_scores_run_and_respect_the_budget(score):
    model = tiny_model("llama", layers=1)
    ids = _ids(200, 14)
    with kvcompress.compress(model, _stack(budget=64, block=16, score=score, seed=3)) as cache:
        streamed_logits(model, ids, cache, decode_chunks(120, 200))
    layer = cache.compressed_layers[0]
    assert max(_layer_sizes(layer)) <= 64 + 15 and layer.state["paged_eviction"].evicted > 0


def test_scores_pick_the_documented_direction():
    from kvcompress.plugins.paged_eviction import PagedEvictionConfig, token_scores

    k = torch.ones(1, 2, 3, 4)
    k[:, :, 1] *= 3  # token 1 has the largest key norm
    v = torch.ones(1, 2, 3, 4)
    lowest = {s: int(token_scores(PagedEvictionConfig(score=s), k, v, 0, 0).argmin())
              for s in ("v_over_k", "key_norm", "inverse_key_norm")}
    assert lowest == {"v_over_k": 1, "inverse_key_norm": 1, "key_norm": 0}


# ----------------------------------------------------------------------------- the pool alone


def test_pool_store_interface_pack_retain_drop():
    store = PagedStore(4)
    valid = torch.tensor([[1, 1, 0, 1, 1, 1, 0, 0, 1, 1], [0, 0, 0, 1, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    k = torch.arange(2 * 10, dtype=torch.float32).view(2, 1, 10, 1).expand(2, 1, 10, 2).contiguous()
    store.append(KVBlock(k, k.clone(), valid, torch.arange(10)))
    assert [len(r) for r in store.rows] == [2, 2] and store.row_tokens() == [7, 5]
    mask = store.valid_mask()
    assert mask.tolist() == [[True] * 7 + [False], [True] * 5 + [False] * 3]
    (seg,) = store.segments()
    keys, _ = seg.packed.dequantize()
    assert keys[0, 0, :7, 0].tolist() == [0, 1, 3, 4, 5, 8, 9] and keys[1, 0, :5, 0].tolist() == [13, 14, 15, 16, 17]
    keep = mask.clone()
    keep[1, :4] = False  # row 1 drops its whole first page
    store.retain(keep)
    assert [len(r) for r in store.rows] == [2, 1] and store.row_tokens() == [7, 1] and len(store.free) == 1
    store.append(KVBlock(k, k.clone(), valid, torch.arange(10, 20)))
    assert store.stats["reused"] == 1 and store.fresh == 7
    store.drop_oldest(4)
    assert [len(r) for r in store.rows] == [3, 2]
    with pytest.raises(ValueError, match="whole pages"):
        store.drop_oldest(3)
    sizes = store.nbytes()
    assert set(sizes) == {"middle: pages", "middle: page valid + positions (rows)", "middle: page scores (rows)",
                          "middle: block table (rows)"}
    assert sizes["middle: block table (rows)"] == 2 * 3 * 4


# ----------------------------------------------------------------------------- configuration


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError) as err:
        kvcompress.parse_stack(_stack(after=[{"kivi": {"group": 32, "residual": 32}}], budget=1024, block=16))
    assert "compressors[0].paged_eviction.block" in str(err.value) and "multiple of kivi's group (32)" in str(err.value)
    with pytest.raises(ConfigError) as err:
        kvcompress.parse_stack(_stack(budget=40, block=16))
    assert "compressors[0].paged_eviction.budget" in str(err.value)
    with pytest.raises(ConfigError) as err:
        kvcompress.parse_stack(_stack(after=[{"kivi": {"group": 32, "residual": 128}}], budget=200, block=32))
    assert "budget" in str(err.value) and "for this stack" in str(err.value)
    with pytest.raises(ConfigError):
        kvcompress.parse_stack(_stack(score="attention"))


def test_example_stacks_load():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "examples" / "stacks"
    for name in ("paged_eviction.yaml", "paged_eviction_kivi2.yaml"):
        stack = kvcompress.load_stack(root / name)
        assert stack.entries[0].name == "paged_eviction"


def test_quantizer_without_a_codec_cannot_hand_its_store_to_the_pool():
    import dataclasses

    from kvcompress import CompressorSpec, hookimpl
    from kvcompress.errors import PluginError
    from kvcompress.manager import get_registry
    from kvcompress.registry import Registry
    from kvcompress.state import DenseStore

    @dataclasses.dataclass(frozen=True)
    class NoParams:
        pass

    class StoreOnly(kvcompress.Compressor):
        @hookimpl
        def kvcompress_quantize_store(self, layer):
            return DenseStore()

    registry = Registry()
    registry.add(get_registry().get("paged_eviction"), "built-in")
    registry.add(CompressorSpec(name="storeonly", axis="quantize", config=NoParams, factory=StoreOnly), "test")
    stack = kvcompress.parse_stack({"compressors": [{"paged_eviction": {"budget": 64}}, {"storeonly": {}}]},
                                   registry=registry)
    with pytest.raises(PluginError, match="no codec") as err:
        kvcompress.Cache(stack, tiny_model("llama", layers=1))
    assert "StoreOnly.kvcompress_quantize_store" in str(err.value)
