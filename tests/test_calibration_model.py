"""LeanK calibration against the real default model (SmolLM2-135M-Instruct): shipped masks, RoPE mask."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvcompress.calibration.masks import config_hash, load_mask, rope_mask

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def default_config():
    """The default model's config only (no weights are loaded)."""
    from transformers import AutoConfig

    from kvcompress.models import converted_default_model

    return AutoConfig.from_pretrained(converted_default_model())


@pytest.mark.parametrize("ratio", [50, 70])
def test_shipped_mask_matches_the_default_model(default_config, ratio):
    mask = load_mask(ROOT / "masks" / f"smollm2-135m-leank-{ratio}.safetensors", default_config)
    assert mask.meta["model_config_hash"] == config_hash(default_config)
    assert mask.meta["model"] == "SmolLM2-135M-Instruct"
    assert mask.shape == (30, 3, 64) and (mask.counts % mask.meta["align"] == 0).all()


def test_rope_mask_of_the_default_model(default_config):
    keep = rope_mask(default_config, 0.5, 16)
    # head_dim 64: pairs (i, i + 32); the 16 lowest-frequency pairs are i = 16..31
    expected = torch.zeros(64, dtype=torch.bool)
    expected[16:32] = expected[48:64] = True
    assert keep.shape == (30, 3, 64) and (keep == expected).all()
