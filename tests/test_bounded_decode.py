"""Bounded decoding (issue 17): decode-time per-head eviction that reuses the freed slots.

TOVA (arXiv 2401.06104) on a layer fed directly with small tensors against an independent simulation of the
policy (its own per-head token sets and exact softmax: every step's attention output must match); on the tiny
models: memory flat over 2000 decode steps, the static cache (dense and KIVI middles) eager = compiled, dynamic =
static, and a store without per-head slots refused when the cache is built.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kvcompress
from kvcompress.errors import ConfigError
from models import tiny_model

SINKS, RECENT, MIDDLE = 2, 3, 8
BUDGET = SINKS + RECENT + MIDDLE

pytestmark = pytest.mark.usefixtures("one_thread")


def _dense(query, key, value, mask, scaling):
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=mask is None, scale=scaling)
    return out.transpose(1, 2)


class TovaReference:
    """TOVA with per-kv-head token sets, written from the paper's rule: every step each kv head's query heads attend
    to its sinks + its kept tokens + the window + the step; the attention summed over the group scores every token;
    the token leaving the window joins the head's set, and while the set exceeds the budget the lowest-scoring
    token of the set leaves.  The prompt is cut by its last query's attention (top budget per head)."""

    def __init__(self, valid):
        self.valid = valid  # [b, L] real tokens
        self.keys = self.values = None
        self.sets = None  # per row, per head: kept middle positions

    def attend(self, q, k, v, first):
        b, hq, t, d = q.shape
        h = k.shape[1]
        g = hq // h
        self.keys = k if self.keys is None else torch.cat([self.keys, k], 2)
        self.values = v if self.values is None else torch.cat([self.values, v], 2)
        end = first + t
        outs = torch.zeros(b, hq, t, d)
        mass = torch.zeros(b, h, end)
        for row in range(b):
            real = [p for p in range(end) if self.valid[row, p]]
            sinks = real[:SINKS]
            seen = [p for p in real if p < first]
            window = [p for p in seen if p not in sinks][-RECENT:] if first else []
            for head in range(h):
                base = set(sinks) | set(window) | (self.sets[row][head] if self.sets else set())
                for qi in range(t):
                    pos = first + qi
                    vis = sorted(p for p in base | set(range(first, pos + 1)) if self.valid[row, p] and p <= pos)
                    for gi in range(g):
                        qh = head * g + gi
                        s = (self.keys[row, head, vis] @ q[row, qh, qi]) * d ** -0.5
                        p = torch.softmax(s, 0)
                        outs[row, qh, qi] = p @ self.values[row, head, vis]
                        if qi == t - 1:
                            mass[row, head, vis] += p
        return outs, mass

    def commit(self, first, t, mass):
        """The tokens that left the window in this step join each head's set by :meth:`admit`."""
        b, h = mass.shape[:2]
        end = first + t
        if self.sets is None:
            self.sets = [[set() for _ in range(h)] for _ in range(b)]
        for row in range(b):
            real = [p for p in range(end) if self.valid[row, p]]
            sinks = real[:SINKS]
            rest = [p for p in real if p not in sinks]
            leaving = rest[:-RECENT] if len(rest) > RECENT else []
            before = [p for p in range(first) if self.valid[row, p] and p not in sinks]
            old_left = before[:-RECENT] if len(before) > RECENT else []
            new_left = [p for p in leaving if p not in old_left]
            for head in range(h):
                self.admit(row, head, new_left, first, end, mass)

    def admit(self, row, head, new_left, first, end, mass):
        kept = self.sets[row][head]
        score = lambda p: float(mass[row, head, p])  # noqa: E731
        if first == 0:  # the prompt: its last query's attention, top MIDDLE per head
            ranked = sorted(new_left, key=lambda p: (-score(p), p))
            kept |= set(ranked[:MIDDLE])
            return
        for p in new_left:
            kept.add(p)
            while len(kept) > MIDDLE:
                kept.discard(min(kept, key=lambda x: (score(x), -x if x != p else -10**9)))


class KeyDiffReference(TovaReference):
    """KeyDiff (arXiv 2504.15364) with per-kv-head token sets, written from the paper's block-wise rule: the prompt's
    tokens leaving the window are ranked by minus the cosine of their key with the mean of their unit keys (top
    budget per head); then each token leaving the window joins its head's set and, while the set exceeds the budget,
    the token whose key is the most similar to the mean unit key of the set (the newcomer included) leaves."""

    def admit(self, row, head, new_left, first, end, mass):
        kept = self.sets[row][head]
        unit = {p: F.normalize(self.keys[row, head, p], dim=0) for p in range(end)}

        def scores(tokens):
            anchor = F.normalize(torch.stack([unit[p] for p in tokens]).sum(0), dim=0)
            return {p: -float(unit[p] @ anchor) for p in tokens}

        if first == 0:
            s = scores(new_left)
            kept |= set(sorted(new_left, key=lambda p: (-s[p], p))[:MIDDLE])
            return
        for p in new_left:
            kept.add(p)
            while len(kept) > MIDDLE:
                s = scores(sorted(kept))
                kept.discard(min(kept, key=lambda x: (s[x], -x if x != p else -10**9)))


def _layer_outputs(static, steps=30, prompt=20, name="tova"):
    model = tiny_model("llama", layers=1)
    stack = {"compressors": [{name: {"budget": BUDGET, "sinks": SINKS, "recent": RECENT,
                                     **({"phase": "both"} if name == "keydiff" else {})}}]}
    length = prompt + steps
    kw = {"max_cache_len": length + 2} if static else {}
    cache = kvcompress.Cache(stack, model, **kw)
    layer = cache.compressed_layers[0]
    gen = torch.Generator().manual_seed(5)
    b = 2
    q = torch.randn(b, 4, length, 16, generator=gen) * 2
    k = torch.randn(b, 2, length, 16, generator=gen) * 2
    v = torch.randn(b, 2, length, 16, generator=gen)
    valid = torch.ones(b, length, dtype=torch.bool)
    valid[1, :4] = False
    ref = (KeyDiffReference if name == "keydiff" else TovaReference)(valid)
    width = (length + 2) if static else None
    worst = 0.0
    chunks = [(0, prompt)] + [(t, t + 1) for t in range(prompt, length)]
    for c0, c1 in chunks:
        cols = width or c1
        vis = torch.zeros(b, 1, c1 - c0, cols, dtype=torch.bool)
        for i, pos in enumerate(range(c0, c1)):
            vis[:, 0, i, : pos + 1] = valid[:, : pos + 1]
        layer.update(k[:, :, c0:c1], v[:, :, c0:c1], compressed=True)
        got = layer.attend(q[:, :, c0:c1], vis, 16 ** -0.5, _dense)  # [b, t, hq, d]
        want, mass = ref.attend(q[:, :, c0:c1], k[:, :, c0:c1], v[:, :, c0:c1], c0)
        ref.commit(c0, c1 - c0, mass)
        real = valid[:, c0:c1]  # padding queries are not compared
        diff = (got.transpose(1, 2) - want).abs().amax(dim=(1, 3))[real]
        worst = max(worst, diff.max().item())
    return worst, layer


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_tova_matches_independent_simulation(static):
    worst, layer = _layer_outputs(static)
    assert worst <= 1e-5
    assert layer.middle.slot_valid().sum(1).tolist() == [MIDDLE, MIDDLE]


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_keydiff_matches_independent_simulation(static):
    """KeyDiff while decoding under a budget (``phase: both``): the stored tokens are rescored against the anchor of
    the held keys and the incoming one at every step, each head replacing its most redundant key."""
    worst, layer = _layer_outputs(static, name="keydiff")
    assert worst <= 1e-5
    assert layer.middle.slot_valid().sum(1).tolist() == [MIDDLE, MIDDLE]


def test_memory_is_flat_over_2000_decode_steps():
    """Dynamic cache, dense middle: the bytes held after the prefill's flush at the budget never change again."""
    model = tiny_model("llama", layers=1)
    ids = torch.randint(1, 256, (1, 2040), generator=torch.Generator().manual_seed(0))
    stack = {"compressors": [{"tova": {"budget": 24, "sinks": 2, "recent": 4}}]}
    with kvcompress.compress(model, stack) as cache, torch.no_grad():
        model(ids[:, :40], cache=cache)
        at_budget = cache.memory_report()
        for t in range(40, 2040):
            model(ids[:, t:t + 1], cache=cache)
        end = cache.memory_report()
    assert end.segments == at_budget.segments
    layer = cache.compressed_layers[0]
    assert int(layer.held_tokens()[0]) + int(layer.middle.slot_valid().sum()) == 24
    assert end.tokens == 2040 and end.cache_bytes < end.dense_native_bytes / 50


TOVA = {"tova": {"budget": 40, "sinks": 2, "recent": 16}}
KIVI4 = {"kivi": {"bits": 4, "group": 16, "residual": 16}}
PROMPT, STEPS = 48, 40


def _run(model, stack, ids, mask, *, static=False, compiled=False):
    kw = {"max_cache_len": ids.shape[1] + 4} if static else {}
    out = []
    with kvcompress.compress(model, stack, **kw) as cache, torch.no_grad():
        step = torch.compile(model.forward, backend="aot_eager", fullgraph=True) if compiled else model.forward
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        first = model(ids[:, :PROMPT], attention_mask=mask[:, :PROMPT], position_ids=pos[:, :PROMPT], cache=cache)
        out.append(first.logits[:, -1])
        mem = cache.memory_report().cache_bytes
        for t in range(PROMPT, ids.shape[1]):
            o = step(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1].contiguous(),
                     position_ids=pos[:, t:t + 1], cache=cache)
            out.append(o.logits[:, -1])
        assert cache.memory_report().cache_bytes == mem  # flat while decoding
    return torch.stack(out).float(), cache


def _stack_of(name):
    return {"tova": [TOVA], "tova+kivi4": [{"tova": dict(TOVA["tova"], sinks=0)}, KIVI4],
            "snapkv-both": [{"snapkv": {"budget": 40, "sinks": 2, "recent": 16, "window": 8, "phase": "both"}}],
            "expected_attention-both": [{"expected_attention": {"budget": 40, "sinks": 2, "recent": 16, "window": 16,
                                                                "n_future": 32, "phase": "both"}}],
            "keydiff-both": [{"keydiff": {"budget": 40, "sinks": 2, "recent": 16, "phase": "both"}}],
            "keydiff+kivi4": [{"keydiff": {"budget": 40, "sinks": 0, "recent": 16, "phase": "both"}}, KIVI4]}[name]


def _middle(entries):
    cfg = next(iter(entries[0].values()))
    middle = 40 - cfg["sinks"] - 16  # budget - sinks - the stack's window (16: tova's recent, or KIVI's residual)
    return middle // 16 * 16 if len(entries) > 1 else middle  # KIVI: whole groups


@pytest.mark.parametrize("name", ["tova", "tova+kivi4", "snapkv-both", "expected_attention-both", "keydiff-both",
                                  "keydiff+kivi4"])
def test_static_equals_dynamic_and_holds_the_budget(name):
    """Left-padded batch, dense and KIVI middles: the static cache decides and computes what the dynamic cache does;
    the middle sits at its budget, memory flat."""
    model = tiny_model("llama")
    entries = _stack_of(name)
    stack = {"compressors": entries}
    ids = torch.randint(1, 256, (2, PROMPT + STEPS), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    static, cache = _run(model, stack, ids, mask, static=True)
    dynamic, _ = _run(model, stack, ids, mask)
    assert (static - dynamic).abs().max().item() <= 1e-5
    for layer in cache.compressed_layers:  # the middle is at its budget and evicts per head
        assert layer.middle.slot_valid().sum(1).tolist()[1] == _middle(entries)


@pytest.mark.parametrize("name", ["tova", "tova+kivi4", "expected_attention-both", "keydiff-both"])
def test_compiled_decode_equals_eager(name):
    """torch.compile(fullgraph=True) of the static decode step - observation, attention mass, per-head replacement
    and slot writes inside the graph - gives the eager static step's logits, one graph for every step."""
    model = tiny_model("llama", layers=1)
    stack = {"compressors": _stack_of(name)}
    ids = torch.randint(1, 256, (2, PROMPT + 10), generator=torch.Generator().manual_seed(2))
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        out = []
        with kvcompress.compress(model, stack, max_cache_len=ids.shape[1] + 2) as cache, torch.no_grad():
            step = torch.compile(model.forward, backend="aot_eager", fullgraph=True) if compiled else model.forward
            model(ids[:, :PROMPT], cache=cache)
            for t in range(PROMPT, ids.shape[1]):
                pos = torch.full((2, 1), t)
                out.append(step(input_ids=ids[:, t:t + 1], position_ids=pos, cache=cache).logits[:, -1])
        runs.append(torch.stack(out))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
    assert (runs[1] - runs[0]).abs().max().item() <= 1e-5


def test_store_without_per_head_slots_is_refused_when_the_cache_is_built():
    """KIVI under a ratio (no bound to preallocate by) in a dynamic cache, and a paged store: refused at build."""
    model = tiny_model("llama", layers=1)
    stack = {"compressors": [{"snapkv": {"ratio": 0.5, "phase": "both", "sinks": 0, "recent": 16}}, KIVI4]}
    with pytest.raises(ConfigError, match=r"compressors\[0\]\.snapkv: expected a middle store with per-head slots.*"
                                          r"got 'KiviStore in a dynamic cache'"):
        kvcompress.Cache(stack, model)
    kvcompress.Cache(stack, model, max_cache_len=64)  # a static cache preallocates KIVI's store: accepted
    with pytest.raises(ConfigError, match=r"tova.*got 'PagedStore"):
        _paged_with_slots(model)


def _paged_with_slots(model):
    """A third-party evictor that asks for per-head slots and builds a paged store: refused at build."""
    import dataclasses

    from kvcompress import CompressorSpec, Layout, hookimpl, param
    from kvcompress.paged import PagedStore
    from kvcompress.registry import Registry
    from kvcompress.stack import parse_stack

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        budget: int = param(32, "budget", min=1)

    class PagedSlots(kvcompress.Compressor):
        name = "tova"

        @hookimpl
        def kvcompress_layer_layout(self, layer):
            return Layout(recent=4, flush=4, head_slots=True)

        @hookimpl
        def kvcompress_middle_store(self, layer, codec):
            return PagedStore(4, codec)

    reg = Registry()
    reg.add(CompressorSpec(name="tova", axis="evict", config=Cfg, factory=PagedSlots), "test")
    return kvcompress.Cache(parse_stack({"compressors": [{"tova": {}}]}, registry=reg), model)
