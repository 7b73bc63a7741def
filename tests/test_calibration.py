"""LeanK calibration: binarization rules, RoPE mask, mask files, scaled attention, training."""

from __future__ import annotations

import json
import math
import types
from pathlib import Path

import pytest
import torch
from models import tiny_model
from reference import eager

from kvcompress.calibration import attention as attn
from kvcompress.calibration import data
from kvcompress.calibration.leank import LeanKSettings, LeanKTrainer, checkpoint_path
from kvcompress.calibration.masks import (FORMAT, MaskFileError, binarize, config_hash, load_mask, rope_mask,
                                          round_half_up, save_mask)
from kvcompress.errors import ConfigError, KVCompressError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run fastest on one thread (two threads spin-wait badly on a busy 2-core machine)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# ----------------------------------------------------------------------------- binarize


def _alpha_with_counts(counts: list[list[int]], head_dim: int) -> torch.Tensor:
    """alpha whose global top set gives each head exactly counts[l][h] channels (distinct values)."""
    layers, heads = len(counts), len(counts[0])
    alpha = torch.empty(layers, heads, head_dim)
    g = torch.Generator().manual_seed(1)
    for l in range(layers):
        for h in range(heads):
            hi = 0.6 + 0.39 * torch.rand(head_dim, generator=g)
            lo = 0.01 + 0.39 * torch.rand(head_dim, generator=g)
            row = lo.clone()
            chosen = torch.randperm(head_dim, generator=g)[: counts[l][h]]
            row[chosen] = hi[chosen]
            alpha[l, h] = row
    return alpha


def test_binarize_global_threshold_and_zero_count_heads():
    # head (0,0) holds every high alpha: a global threshold keeps all of it and nothing of (0,1)
    alpha = torch.tensor([[[0.9, 0.8, 0.95, 0.7], [0.1, 0.2, 0.05, 0.3]]])
    keep = binarize(alpha, 0.5, 1)
    assert keep[0, 0].all() and not keep[0, 1].any()
    # per-head thresholds would have kept two channels in each head
    assert keep.sum().item() == 4


def test_binarize_rounds_each_head_half_up_to_align():
    counts = [[4, 3, 12, 11], [5, 13, 16, 0]]  # with align 8: 4->8 (half up), 3->0, 12->16, 11->8, 5->8, 13->16
    alpha = _alpha_with_counts(counts, 16)
    total = sum(map(sum, counts))
    keep = binarize(alpha, 1 - total / alpha.numel(), 8)
    assert keep.sum(-1).tolist() == [[8, 0, 16, 8], [8, 16, 16, 0]]
    # each head keeps its top channels by alpha
    for l in range(2):
        for h in range(4):
            n = int(keep[l, h].sum())
            top = torch.sort(alpha[l, h], descending=True, stable=True).indices[:n]
            assert set(top.tolist()) == set(keep[l, h].nonzero().flatten().tolist())
    assert round_half_up(4, 8) == 8 and round_half_up(3, 8) == 0 and round_half_up(12, 8) == 16
    assert round_half_up(torch.tensor([4, 3, 12, 20]), 8).tolist() == [8, 0, 16, 24]


def test_binarize_counts_are_multiples_of_align_and_total_near_ratio():
    alpha = torch.rand(6, 3, 64, generator=torch.Generator().manual_seed(0))
    for ratio in (0.3, 0.5, 0.7):
        for align in (1, 8, 16, 32, 64):
            keep = binarize(alpha, ratio, align)
            c = keep.sum(-1)
            assert ((c % align) == 0).all() and (c <= 64).all()
            if align == 1:
                assert keep.sum().item() == alpha.numel() - round(ratio * alpha.numel())
    assert not binarize(alpha, 1.0, 16).any() and binarize(alpha, 0.0, 16).all()


def test_binarize_ties_are_deterministic():
    flat = torch.ones(2, 2, 8)
    keep = binarize(flat, 0.5, 1)
    # global ties: lower flat index (layer, head, channel) kept first
    assert keep[0].all() and not keep[1].any()
    # ties inside a head: lower channel index first
    alpha = torch.tensor([[[0.5, 0.9, 0.5, 0.5, 0.9, 0.1, 0.5, 0.5]]])
    keep = binarize(alpha, 0.5, 1)
    assert keep[0, 0].nonzero().flatten().tolist() == [0, 1, 2, 4]
    assert torch.equal(binarize(alpha, 0.5, 1), keep)


def test_binarize_and_rope_mask_validate_arguments():
    alpha = torch.rand(1, 2, 16)
    for ratio in (-0.1, 1.5, float("nan")):
        with pytest.raises(ConfigError, match="ratio"):
            binarize(alpha, ratio, 4)
    for align in (0, 3, 32, True):
        with pytest.raises(ConfigError, match="align"):
            binarize(alpha, 0.5, align)
    with pytest.raises(ConfigError):
        binarize(torch.rand(2, 16), 0.5, 4)


# ----------------------------------------------------------------------------- RoPE mask


def test_rope_mask_keeps_the_lowest_frequency_pairs():
    model = tiny_model("llama")
    cfg = model.config  # head_dim 16, rotate_half: channel i pairs with i + 8
    keep = rope_mask(cfg, 0.5, 4)
    assert keep.shape == (2, 2, 16) and (keep == keep[0, 0]).all()
    assert keep[0, 0].nonzero().flatten().tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    # kept pairs are exactly the lowest-frequency ones: theta_i = base^(-2i/d)
    base = cfg.rope_parameters["rope_theta"]
    freq = torch.tensor([base ** (-2 * (i % 8) / 16) for i in range(16)])
    assert freq[keep[0, 0]].max() < freq[~keep[0, 0]].min()
    # the count is round((1 - ratio) d) rounded half-up to align
    assert rope_mask(cfg, 0.7, 4).sum(-1).unique().tolist() == [4]     # 4.8 -> 5 -> 4
    assert rope_mask(cfg, 0.75, 2)[0, 0].nonzero().flatten().tolist() == [6, 7, 14, 15]
    assert rope_mask(cfg, 0.6, 8).sum(-1).unique().tolist() == [8]      # 6.4 -> 6 -> 8 (half up)


def test_rope_mask_partial_rotary_keeps_unrotated_channels_first():
    cfg = {"model_type": "x", "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
           "head_dim": 16, "hidden_size": 32, "rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.5}}
    keep = rope_mask(cfg, 0.5, 2)  # rotary dim 8: channels 8..15 are not rotated
    assert keep[0, 0].nonzero().flatten().tolist() == [8, 9, 10, 11, 12, 13, 14, 15]


# ----------------------------------------------------------------------------- files


def _meta(cfg, **over):
    meta = {"model": "tiny-llama", "model_config_hash": config_hash(cfg), "ratio": 0.5, "align": 4, "sinks": 4,
            "local": 8, "method": "trained", "settings": {"steps": 3, "lr": 0.02}}
    meta.update(over)
    return meta


def test_mask_file_round_trip(tmp_path):
    from safetensors import safe_open

    cfg = tiny_model("llama").config
    alpha = torch.rand(2, 2, 16, generator=torch.Generator().manual_seed(0))
    keep = binarize(alpha, 0.5, 4)
    path = tmp_path / "m.safetensors"
    save_mask(path, keep, _meta(cfg), alpha=alpha)
    with safe_open(str(path), framework="pt") as fh:
        raw = fh.metadata()
        assert fh.get_tensor("keep").dtype == torch.uint8 and fh.get_tensor("alpha").dtype == torch.float32
    assert raw["format"] == FORMAT == "kvcompress.leank-mask/1"
    assert {"model", "model_config_hash", "ratio", "align", "sinks", "local", "method", "settings",
            "created"} <= set(raw)
    assert json.loads(raw["settings"]) == {"steps": 3, "lr": 0.02}
    mask = load_mask(path, cfg)
    assert mask.keep.dtype == torch.bool and torch.equal(mask.keep, keep) and torch.equal(mask.alpha, alpha)
    assert (mask.meta["ratio"], mask.meta["align"], mask.meta["sinks"], mask.meta["local"]) == (0.5, 4, 4, 8)
    assert mask.meta["settings"]["steps"] == 3 and mask.meta["model"] == "tiny-llama"
    assert mask.counts.tolist() == keep.sum(-1).tolist() and mask.kept_fraction == pytest.approx(keep.float().mean().item())
    save_mask(path, keep, _meta(cfg, method="rope"))
    assert load_mask(path).alpha is None


def test_mask_for_another_model_is_refused(tmp_path):
    cfg = tiny_model("llama").config
    path = tmp_path / "tiny.safetensors"
    save_mask(path, rope_mask(cfg, 0.5, 4), _meta(cfg))
    other = tiny_model("llama", layers=3).config
    with pytest.raises(MaskFileError) as err:
        load_mask(path, other)
    msg = str(err.value)
    assert str(path) in msg and "tiny-llama" in msg and "2 layers" in msg and "3 layers" in msg
    assert "kvcompress calibrate leank" in msg
    assert isinstance(err.value, ConfigError) and isinstance(err.value, KVCompressError)
    # same geometry, different RoPE base: the config hash differs
    moved = tiny_model("llama").config
    moved.rope_parameters = {**moved.rope_parameters, "rope_theta": 12345.0}
    with pytest.raises(MaskFileError, match="hash differs"):
        load_mask(path, moved)
    assert load_mask(path, cfg).keep.shape == (2, 2, 16)


def test_missing_and_malformed_mask_files_are_refused(tmp_path):
    from safetensors.torch import save_file

    with pytest.raises(MaskFileError, match="no such file.*kvcompress calibrate leank"):
        load_mask(tmp_path / "absent.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(MaskFileError, match="unreadable"):
        load_mask(tmp_path / "junk.safetensors")
    save_file({"keep": torch.ones(1, 1, 4, dtype=torch.uint8)}, str(tmp_path / "other.safetensors"),
              metadata={"format": "something/else"})
    with pytest.raises(MaskFileError, match="format"):
        load_mask(tmp_path / "other.safetensors")


def test_config_hash_covers_geometry_and_rope_only():
    a, b = tiny_model("llama").config, tiny_model("llama", seed=5).config
    assert config_hash(a) == config_hash(b) and len(config_hash(a)) == 64
    b.rms_norm_eps = 1e-3
    b._name_or_path = "elsewhere"
    assert config_hash(a) == config_hash(b)
    assert config_hash(a) != config_hash(tiny_model("llama", layers=3).config)
    assert config_hash(a) != config_hash(tiny_model("qwen3").config)


def test_shipped_masks_are_valid_files():
    for ratio in ("50", "70"):
        path = ROOT / "masks" / f"smollm2-135m-leank-{ratio}.safetensors"
        mask = load_mask(path)  # the shape/hash check against the real model is in test_calibration_model.py
        assert mask.shape == (30, 3, 64) and mask.meta["method"] == "trained"
        assert mask.meta["ratio"] == int(ratio) / 100
        assert (mask.counts % mask.meta["align"] == 0).all()
        assert abs(mask.kept_fraction - (1 - mask.meta["ratio"])) < 0.05
        assert mask.alpha is not None and 0 <= mask.alpha.min() and mask.alpha.max() <= 1


# ----------------------------------------------------------------------------- scaled attention


def _loop_reference(query, key, value, alpha, sinks, local, scaling, drop=True):
    """Per (batch, head, query) loops: middle keys scaled channel-wise by alpha, others exact."""
    b, hq, q_len, d = query.shape
    hkv, kv_len = key.shape[1], key.shape[2]
    out = torch.zeros(b, q_len, hq, d, dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            g = h // (hq // hkv)
            drop_middle = drop and not alpha[g].any()  # a head keeping no channel reads sinks + local only
            for i in range(q_len):
                t = kv_len - q_len + i
                keys, rows = [], []
                for j in range(t + 1):
                    middle = sinks <= j < t - local
                    if middle and drop_middle:
                        continue
                    k = key[bi, g, j].double()
                    keys.append(k * alpha[g].double() if middle else k)
                    rows.append(j)
                scores = torch.stack(keys) @ query[bi, h, i].double() * scaling
                out[bi, i, h] = torch.softmax(scores, 0) @ value[bi, g, rows].double()
    return out


def test_scaled_attention_matches_an_independent_masked_computation():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=g)        # 5 new queries after 7 prefix tokens
    k = torch.randn(2, 2, 12, 8, generator=g)
    v = torch.randn(2, 2, 12, 8, generator=g)
    alpha = torch.rand(3, 2, 8, generator=g)
    one_empty = (alpha > 0.5).float()
    one_empty[1, 0] = 0
    module = types.SimpleNamespace(layer_idx=1)
    for a, sinks, local, drop in ((alpha, 2, 3, True), ((alpha > 0.5).float(), 1, 0, True), (one_empty, 2, 1, True),
                                  (one_empty, 2, 1, False), (torch.zeros_like(alpha), 0, 2, True)):
        prefix = [(k[:, :, :7], v[:, :, :7])] * 3
        state = attn.ScaledKeys(alpha=a, sinks=sinks, local=local, prefix=prefix, drop_empty_heads=drop)
        attn._ACTIVE.append(state)
        try:
            got, _ = attn.scaled_attention_forward(module, q, k[:, :, 7:], v[:, :, 7:], None, scaling=0.3)
        finally:
            attn._ACTIVE.remove(state)
        ref = _loop_reference(q, k, v, a[1], sinks, local, 0.3, drop)
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_scaled_attention_with_alpha_one_is_exactly_eager_attention(arch):
    model = tiny_model(arch)
    ids = torch.randint(1, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), eager(model):
        ref = model(ids).logits
    before = model.config._attn_implementation
    with torch.no_grad(), attn.scaled_keys(model, attn.ScaledKeys(alpha=torch.ones(2, 2, 16), sinks=3, local=5)):
        got = model(ids).logits
    assert torch.equal(got, ref)
    assert model.config._attn_implementation == before
    with torch.no_grad(), attn.scaled_keys(model, attn.ScaledKeys(alpha=torch.zeros(2, 2, 16), sinks=3, local=5)):
        pruned = model(ids).logits
    assert not torch.allclose(pruned, ref, atol=1e-3)  # scaling really changes the middle
    assert torch.equal(pruned[:, :9], ref[:, :9])      # queries t <= sinks + local have no middle


def test_prefilled_context_plus_tail_equals_one_forward():
    from kvcompress.adapters import hf

    model = tiny_model("llama")
    ids = torch.randint(1, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    alpha = torch.rand(2, 2, 16, generator=torch.Generator().manual_seed(3))
    captured: dict = {}
    with torch.no_grad(), attn.scaled_keys(model, attn.ScaledKeys(capture=captured)):
        full = hf.final_hidden_states(model, ids)
    prefix = [(captured[i][0][:, :, :30], captured[i][1][:, :, :30]) for i in range(2)]
    with torch.no_grad(), attn.scaled_keys(model, attn.ScaledKeys(alpha=torch.ones(2, 2, 16), prefix=prefix)):
        tail = hf.final_hidden_states(model, ids[:, 30:], torch.arange(30, 40)[None])
    torch.testing.assert_close(tail, full[:, 30:], atol=1e-5, rtol=1e-5)
    # only the tail queries are scaled: changing alpha changes the tail, and gradients reach alpha
    alpha.requires_grad_(True)
    with attn.scaled_keys(model, attn.ScaledKeys(alpha=alpha, sinks=2, local=4, prefix=prefix)):
        out = hf.final_hidden_states(model, ids[:, 30:], torch.arange(30, 40)[None])
    (out - full[:, 30:]).pow(2).mean().backward()
    assert alpha.grad is not None and alpha.grad.abs().sum() > 0


def test_unsupported_layouts_are_refused(monkeypatch):
    """Full and sliding-window layers calibrate (hybrids: tests/test_attention_variants.py); any other layer
    type is refused."""
    from kvcompress.adapters import hf
    from kvcompress.errors import UnsupportedModelError

    attn.check_calibratable(tiny_model("gemma3"))
    monkeypatch.setattr(hf, "layer_types", lambda model: ["full_attention", "linear_attention"])
    with pytest.raises(UnsupportedModelError, match="linear_attention"):
        attn.check_calibratable(tiny_model("llama"))


# ----------------------------------------------------------------------------- training


def _tiny_samples(n: int, context: int, tail: int) -> list[data.Sample]:
    g = torch.Generator().manual_seed(7)
    return [data.Sample(tuple(torch.randint(1, 256, (context + tail,), generator=g).tolist()), context, "random", ())
            for _ in range(n)]


def _trainer(tmp_path=None, **over):
    model = tiny_model("llama", layers=2)
    settings = LeanKSettings(**{**dict(ratio=0.5, align=4, sinks=2, local=6, context=64, tail=8, samples=4, batch=2,
                                       steps=12, ft_steps=4, lr=0.05, ft_lr=0.02), **over})
    trainer = LeanKTrainer(model, None, settings, log=None,
                           checkpoint=str(tmp_path / "new" / "m.ckpt.safetensors") if tmp_path else None)
    trainer.prepare(_tiny_samples(settings.samples, settings.context, settings.tail))
    return trainer


def test_training_lowers_the_loss_and_yields_an_aligned_mask():
    trainer = _trainer()
    keep, alpha = trainer.train()
    h = trainer.history
    assert h["stage1_loss_last"] < h["stage1_loss_first"]
    assert keep.shape == alpha.shape == (2, 2, 16) and (keep.sum(-1) % 4 == 0).all()
    assert 0 <= alpha.min() and alpha.max() <= 1
    assert torch.equal(keep, binarize(alpha, 0.5, 4))
    # stage 2 keeps the best-scoring mask: never worse than plain binarization of stage 1
    assert h["stage2_best_mse"] <= h["stage2_pool_mse_step0"]
    assert trainer.pool_mse(keep) == pytest.approx(h["stage2_best_mse"])
    assert all(not p.requires_grad for p in trainer.model.parameters())


def test_training_recovers_the_distillation_loss_from_a_bad_start():
    trainer = _trainer(reg=0.0, steps=15, ft_steps=0, lr=0.1)
    idx = torch.arange(4)
    start = torch.full((2, 2, 16), 0.2)
    with torch.no_grad():
        before = trainer.tail_mse(start, idx).item()
    _, alpha = trainer.train(init_alpha=start)
    with torch.no_grad():
        after = trainer.tail_mse(alpha, idx).item()
    assert after < 0.5 * before
    assert trainer.tail_mse(torch.ones(2, 2, 16), idx).item() < 1e-10  # alpha = 1 is the full model


def test_training_resumes_from_the_checkpoint(tmp_path, monkeypatch):
    ref_keep, ref_alpha = _trainer().train()
    trainer = _trainer(tmp_path)
    trainer.checkpoint_every = 3
    real = trainer.tail_mse
    calls = {"n": 0}

    def flaky(alpha, idx, **kw):
        calls["n"] += 1
        if calls["n"] == 8:  # interrupted in stage 1, after the checkpoint of step 6
            raise KeyboardInterrupt
        return real(alpha, idx, **kw)

    monkeypatch.setattr(trainer, "tail_mse", flaky)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert Path(trainer.checkpoint).is_file()
    resumed = _trainer(tmp_path)
    keep, alpha = resumed.train(resume=True)
    torch.testing.assert_close(alpha, ref_alpha, atol=1e-6, rtol=0)
    assert torch.equal(keep, ref_keep)
    # a checkpoint made with other settings is refused
    with pytest.raises(ConfigError, match="same model and settings"):
        _trainer(tmp_path, lr=0.5).train(resume=True)


def test_settings_are_validated_before_anything_runs():
    with pytest.raises(ConfigError, match="--ratio"):
        LeanKSettings(ratio=1.5, align=16).validate()
    with pytest.raises(ConfigError, match="--context"):
        LeanKSettings(ratio=0.5, align=16, sinks=64, local=512, context=512).validate()
    with pytest.raises(ConfigError, match="--align"):
        LeanKSettings(ratio=0.5, align=24).validate(64)
    with pytest.raises(ConfigError, match="--data"):
        LeanKSettings(ratio=0.5, align=16, data=("passkey", "essay")).validate()
    assert checkpoint_path("masks/a.safetensors") == "masks/a.ckpt.safetensors"


def test_retrieval_samples_have_the_fixed_layout():
    class Tok:  # a byte-level stand-in tokenizer
        def __call__(self, text, add_special_tokens=False):
            return types.SimpleNamespace(input_ids=list(text.encode()))

    tokens = list(data.split_text("train").encode()[:20000])
    samples = data.retrieval_samples(Tok(), tokens, 4, context=1500, tail=60, seed=3)
    assert [s.kind for s in samples] == ["passkey", "key-value"] * 2
    for s in samples:
        assert len(s.ids) == 1560 and s.context == 1500
        raw = bytes(s.ids)
        assert (b"pass key is" in raw[1500:]) or (b"The value of" in raw[1500:])
        for start in s.needle_starts:
            assert raw[start + 1:start + 4] == b"The"
    assert samples == data.retrieval_samples(Tok(), tokens, 4, context=1500, tail=60, seed=3)
    mixed = data.retrieval_samples(Tok(), tokens, 3, context=1500, tail=60, seed=3,
                                   kinds=("passkey", "key-value", "text"))
    text = mixed[2]
    assert text.kind == "text" and len(text.ids) == 1560 and bytes(text.ids) in bytes(tokens)
    with pytest.raises(ValueError, match="kinds"):
        data.retrieval_samples(Tok(), tokens, 3, context=1500, tail=60, kinds=("essay",))
    train, held = data.split_text("train"), data.split_text("heldout")
    assert held[:200] not in train and 3 * len(held) < len(train)


# ----------------------------------------------------------------------------- CLI


def test_cli_validates_before_loading_a_model(tmp_path, capsys, monkeypatch):
    import argparse

    from kvcompress.calibration import cli

    def no_model(*a, **k):
        raise AssertionError("the model must not be loaded for invalid input")

    monkeypatch.setattr("kvcompress.models.load_model", no_model)
    parser = argparse.ArgumentParser(prog="kvcompress")
    cli.add_parser(parser.add_subparsers(dest="command"))
    for argv, needle in ((["--ratio", "1.2", "--align", "16"], "--ratio"),
                         (["--ratio", "0.5", "--align", "0"], "--align"),
                         (["--ratio", "0.5", "--align", "16", "--steps", "-1"], "--steps")):
        args = parser.parse_args(["calibrate", "leank", *argv, "--out", str(tmp_path / "m.safetensors")])
        assert args.func(args) == 2
        assert needle in capsys.readouterr().err
    args = parser.parse_args(["calibrate", "leank", "--ratio", "0.5", "--align", "16", "--out", "m.pt"])
    assert args.func(args) == 2 and ".safetensors" in capsys.readouterr().err


def test_calibrate_writes_trained_rope_and_qk_masks_for_a_loaded_model(tmp_path):
    from kvcompress.calibration.leank import calibrate

    model = tiny_model("llama")
    settings = LeanKSettings(ratio=0.5, align=4, sinks=2, local=6, context=64, tail=8, samples=2, batch=1, steps=2,
                             ft_steps=1)
    rope = calibrate("rope", settings, model=model, model_name="tiny", out=str(tmp_path / "r.safetensors"))
    assert rope.meta["method"] == "rope" and torch.equal(rope.keep, rope_mask(model.config, 0.5, 4))
    ids = torch.randint(1, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    from kvcompress.calibration.qk import qk_mask, qk_scores

    scores = qk_scores(model, ids)
    assert scores.shape == (2, 2, 16) and (scores > 0).all()
    assert torch.equal(qk_mask(model, ids, 0.5, 4), binarize(scores, 0.5, 4))
    mask = load_mask(tmp_path / "r.safetensors", model.config)
    assert mask.meta["model"] == "tiny" and mask.meta["sinks"] == 2 and mask.meta["local"] == 6
    assert math.isclose(mask.kept_fraction, 0.5)


# ----------------------------------------------------------------------------- the compressor consumes the files


def test_leank_compressor_reads_a_mask_file_and_refuses_another_models(tmp_path):
    import kvcompress

    model = tiny_model("llama")
    alpha = torch.rand(2, 2, 16, generator=torch.Generator().manual_seed(4))
    keep = binarize(alpha, 0.5, 4)
    path = tmp_path / "tiny.safetensors"
    save_mask(path, keep, _meta(model.config), alpha=alpha)
    stack = kvcompress.parse_stack({"compressors": [{"leank": {"mask": str(path), "sinks": 2, "local": 8, "flush": 4}}]})
    ids = torch.randint(1, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), kvcompress.compress(model, stack) as cache:
        model(ids, cache=cache)
        model(ids[:, :1], cache=cache)
    other = tiny_model("llama", layers=3)
    with pytest.raises(MaskFileError, match="made for"):
        with torch.no_grad(), kvcompress.compress(other, stack) as cache:
            other(ids, cache=cache)


def test_mask_and_cli_modules_do_not_import_transformers():
    import subprocess
    import sys

    code = ("import sys, kvcompress.calibration.cli, kvcompress.calibration.masks; "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False"]
