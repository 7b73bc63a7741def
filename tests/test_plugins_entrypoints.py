"""A third-party compressor installed as its own package is found through the entry-point group
and usable by name from YAML; built-ins come through the same path."""

import os
import subprocess
import sys

import torch

import kvcompress
from kvcompress.manager import get_plugin_manager, get_registry
from models import tiny_model
from reference import decode_chunks, masked_logits, streamed_logits


def test_builtin_window_is_registered_through_the_entry_point_group():
    from importlib import metadata

    eps = {ep.name: ep for ep in metadata.entry_points(group="kvcompress")}
    assert eps["window"].value == "kvcompress.plugins.window"
    spec = get_registry().get("window")
    assert spec.source == "built-in" and spec.axis == "evict"


def test_installed_plugin_is_listed_and_used_from_yaml(with_stride_plugin, tmp_path):
    spec = get_registry().get("stride")
    assert spec is not None and spec.source == "kvcompress-stride 0.1.0"
    f = tmp_path / "stride.yaml"
    f.write_text("compressors:\n  - stride: {every: 3, recent: 10}\n")
    stack = kvcompress.load_stack(f)

    model = tiny_model("llama")
    length = 150
    ids = torch.randint(1, 256, (1, length), generator=torch.Generator().manual_seed(0))
    chunks = decode_chunks(40, length)
    with kvcompress.compress(model, stack) as cache:
        got = streamed_logits(model, ids, cache, chunks)
    allowed = torch.zeros(length, length, dtype=torch.bool)
    for c0, c1 in chunks:
        old = max(0, c0 - 10)
        kept = torch.zeros(length, dtype=torch.bool)
        kept[old:c0] = True
        kept[:old] = torch.arange(old) % 3 == 0
        for t in range(c0, c1):
            allowed[t] = kept
            allowed[t, c0:t + 1] = True
    assert (got - masked_logits(model, ids, allowed)).abs().max().item() < 1e-4


def test_cli_lists_and_validates_the_installed_plugin(stride_plugin, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(stride_plugin))
    out = subprocess.run([sys.executable, "-m", "kvcompress.cli", "plugins"], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert "stride" in out and "kvcompress-stride 0.1.0" in out and "built-in" in out
    f = tmp_path / "s.yaml"
    f.write_text("compressors:\n  - stride: {every: 0}\n")
    res = subprocess.run([sys.executable, "-m", "kvcompress.cli", "validate", str(f)], env=env,
                         capture_output=True, text=True)
    assert res.returncode == 2 and "compressors[0].stride.every" in res.stderr


def test_blocked_plugin_is_not_loaded(stride_plugin, monkeypatch):
    monkeypatch.syspath_prepend(str(stride_plugin))
    monkeypatch.setenv("KVCOMPRESS_BLOCK_PLUGINS", "stride")
    pm = get_plugin_manager()
    assert pm.is_blocked("stride") and pm.get_plugin("window") is not None


def test_misspelled_hook_in_a_compressor_fails_loudly():
    import pytest

    from kvcompress.errors import PluginError
    from kvcompress.pipeline import StackPipeline

    class Typo:
        @kvcompress.hookimpl
        def kvcompress_evict_token(self, layer, block):  # missing "s"
            return None

    with pytest.raises(PluginError, match="kvcompress_evict_token"):
        StackPipeline([("typo", Typo())])
