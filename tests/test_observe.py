"""Observation API (kvcompress_observe): the attention mass a plugin receives equals independent eager softmax oracles.

Dense middle: the oracle is the model's own eager attention probabilities (transformers, ``output_attentions``) over
the whole sequence - with nothing evicted, kvcompress attends exactly what full attention does.  KIVI middle: an
eager softmax over the true keys with the middle's keys fake-quantized by ``tests/reference.fake_quant`` (never
kvcompress' dequantizer).  Prefill and decode, static and dynamic caches; shapes as documented.  The observation
inside a compiled decode step is covered by tests/test_bounded_decode.py (TOVA reads the mass every step there).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kvcompress
from kvcompress import CompressorSpec, Layout, hookimpl, param
from kvcompress.registry import Registry
from kvcompress.stack import parse_stack
from models import tiny_model
from reference import eager, fake_quant

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT, LENGTH = 40, 62
GROUP = 16


@dataclasses.dataclass(frozen=True)
class ObsCfg:
    sinks: int = param(2, "sinks", min=0)
    recent: int = param(8, "recent", min=0)
    flush: int = param(4, "flush", min=1)
    window: int = param(6, "observed query positions", min=1)


class Observer(kvcompress.Compressor):
    """Records every observation (and where the middle's columns sit at that moment), checks shapes."""

    name = "observer"
    graph_safe = True

    def __init__(self, config):
        super().__init__(config)
        self.seen: list[tuple[int, dict]] = []

    @hookimpl
    def kvcompress_layer_layout(self, layer):
        c = self.config
        return Layout(sinks=c.sinks, recent=c.recent, flush=c.flush, observe=c.window, attention=True)

    @hookimpl
    def kvcompress_observe(self, layer, obs):
        b, hkv, q, d = obs.keys.shape
        info = layer.info
        w = min(q, self.config.window) if q > 1 else 1
        assert obs.query.shape == (b, info.num_q_heads, w, info.head_dim)
        assert obs.query_positions.shape == (w,) and obs.positions.shape == (q,)
        assert obs.values.shape == obs.keys.shape and hkv == info.num_kv_heads and d == info.head_dim
        assert obs.valid is None or obs.valid.shape == (b, q)
        assert set(obs.mass) == {"sinks", "recent", "middle", "new"}
        assert all(m.shape[:2] == (b, hkv) and m.dtype == torch.float32 for m in obs.mass.values())
        assert obs.mass["new"].shape[-1] == q
        middle_pos = None
        if layer.middle is not None:
            if getattr(layer.middle, "static", False):
                middle_pos = layer.middle.positions()
            else:
                segs = layer.middle.segments()
                middle_pos = segs[0].positions if segs else None
        record = {"obs": obs, "middle_pos": None if middle_pos is None else middle_pos.clone(),
                  "mass": {k: m.clone() for k, m in obs.mass.items()},
                  "slots": {k: p.clone() for k, p in obs.slot_positions.items()}}
        self.seen.append((info.index, record))


def _registry():
    reg = Registry()
    reg.add(CompressorSpec(name="observer", axis="evict", config=ObsCfg, factory=Observer), "test")
    from kvcompress.plugins import kivi

    reg.add(CompressorSpec(name="kivi", axis="quantize", config=kivi.KiviConfig, factory=kivi.KiviCompressor),
            "built-in")
    return reg


def _by_position(record, length: int, middle_positions=None) -> torch.Tensor:
    """The observation's mass per logical position ``[b, kv, length]`` (every region scattered to its positions)."""
    mass, slots = record["mass"], record["slots"]
    b, h = mass["new"].shape[:2]
    out = torch.zeros(b, h, length)
    sink_pos = slots["sinks"]
    out.scatter_add_(2, sink_pos.view(b, 1, -1).expand(b, h, -1), mass["sinks"][..., :sink_pos.shape[-1]])
    rec = mass["recent"]
    out.scatter_add_(2, slots["recent"][: rec.shape[-1]].view(1, 1, -1).expand(b, h, -1), rec)
    out.scatter_add_(2, slots["new"].view(1, 1, -1).expand(b, h, -1), mass["new"])
    mid = mass["middle"]
    if mid.shape[-1]:
        pos = middle_positions if middle_positions is not None else record["middle_pos"]
        out.scatter_add_(2, pos.view(1, 1, -1).expand(b, h, -1), mid)
    return out


def _run(model, stack, ids, static):
    kw = {"max_cache_len": ids.shape[1] + 4} if static else {}
    with kvcompress.compress(model, stack, **kw) as cache, torch.no_grad():
        model(ids[:, :PROMPT], cache=cache)
        for t in range(PROMPT, ids.shape[1]):
            model(ids[:, t:t + 1], cache=cache)
    return cache.pipeline.compressors[0][1].seen


def _steps(records, layer):
    return [r for i, r in records if i == layer]


@pytest.mark.parametrize("arch,static", [("llama", False), ("llama", True), ("gemma2", False), ("gpt_oss", True)],
                         ids=["dynamic", "static", "softcap-dynamic", "sink-logits-static"])
def test_mass_equals_eager_attention_probabilities_dense_middle(arch, static):
    """Gemma 2 soft-caps its logits, gpt-oss adds learned sink logits to each softmax (its eager attention returns
    the probabilities of the tokens, the sink's share left out): the mass applies both as the model does."""
    model = tiny_model(arch)
    ids = torch.randint(1, 256, (2, LENGTH), generator=torch.Generator().manual_seed(0))
    stack = parse_stack({"compressors": [{"observer": {}}]}, registry=_registry())
    records = _run(model, stack, ids, static)
    with eager(model), torch.no_grad():
        probs = model(ids, output_attentions=True).attentions  # per layer [b, hq, L, L]
    worst = 0.0
    layers = sorted({i for i, _ in records})
    assert layers == ([0, 1] if arch == "llama" else [1])  # hybrids: only full-attention layers are compressed
    for layer in layers:
        steps = _steps(records, layer)
        assert len(steps) == 1 + LENGTH - PROMPT
        p = probs[layer].float()
        b, hq = p.shape[:2]
        for rec in steps:
            qpos = rec["obs"].query_positions
            ref = p[:, :, qpos].view(b, 2, hq // 2, len(qpos), -1).sum(dim=(2, 3))
            got = _by_position(rec, LENGTH)
            worst = max(worst, (got - ref).abs().max().item())
        # the regions were exercised: sinks, the middle and the ring all received mass at the end
        last = steps[-1]["mass"]
        assert all(last[r].sum() > 0 for r in ("sinks", "recent", "middle", "new"))
    assert worst <= 1e-5


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_mass_equals_fake_quant_oracle_kivi_middle(static):
    model = tiny_model("llama")
    ids = torch.randint(1, 256, (1, LENGTH), generator=torch.Generator().manual_seed(1))
    stack = parse_stack({"compressors": [{"observer": {"sinks": 0, "recent": GROUP, "flush": GROUP}},
                                         {"kivi": {"bits": 2, "group": GROUP, "residual": GROUP}}]}, registry=_registry())
    records = _run(model, stack, ids, static)
    worst = 0.0
    for layer in range(2):
        steps = _steps(records, layer)
        keys = torch.cat([r["obs"].keys for r in steps], dim=2).float()  # the true keys of every position
        scale = steps[0]["obs"].scaling
        for rec in steps:
            obs = rec["obs"]
            start, end = int(obs.positions[0]), int(obs.positions[-1]) + 1
            # sinks 0, nothing evicted: the middle holds the oldest whole groups that left the ring (recent G,
            # flush G: the ring keeps G to 2G - 1 tokens between steps), quantized; everything newer is exact
            n_mid = ((start - GROUP) // GROUP) * GROUP if start >= GROUP else 0
            k = keys[:, :, :end].clone()
            b, h, _, d = k.shape
            if n_mid:
                k[:, :, :n_mid] = fake_quant(k[:, :, :n_mid].reshape(b, h, n_mid // GROUP, GROUP, d), 2,
                                             dim=3).view(b, h, n_mid, d)
            q = obs.query.float()
            hq = q.shape[1]
            s = torch.einsum("bhqd,bhtd->bhqt", q, k.repeat_interleave(hq // h, dim=1)) * scale
            visible = torch.arange(end).view(1, -1) <= obs.query_positions.view(-1, 1)
            s = s.masked_fill(~visible, float("-inf"))
            ref = torch.softmax(s, dim=-1).view(b, h, hq // h, len(obs.query_positions), end).sum(dim=(2, 3))
            mid_pos = rec["middle_pos"] if static else torch.arange(rec["mass"]["middle"].shape[-1])
            got = _by_position(rec, end, middle_positions=mid_pos)
            worst = max(worst, (got - ref).abs().max().item())
        assert steps[-1]["mass"]["middle"].sum() > 0
    assert worst <= 1e-5

