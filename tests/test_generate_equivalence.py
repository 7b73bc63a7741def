"""An empty stack must behave exactly like transformers' own cache."""

import pytest
import torch

import kvcompress
from models import ARCHS, tiny_model


@pytest.mark.parametrize("arch", ARCHS)
def test_empty_stack_generates_like_plain_generate(arch):
    model = tiny_model(arch)
    ids = torch.randint(1, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    ref = model.generate(ids, max_new_tokens=32, do_sample=False)
    with kvcompress.compress(model, None) as cache:
        out = model.generate(ids, max_new_tokens=32, do_sample=False, cache=cache)
    assert torch.equal(out, ref)
    assert cache.get_seq_length() == ids.shape[1] + 31  # the last token is never fed back


def test_cache_without_context_matches_plain_generate():
    model = tiny_model("llama")
    ids = torch.randint(1, 256, (1, 20), generator=torch.Generator().manual_seed(2))
    ref = model.generate(ids, max_new_tokens=24, do_sample=False)
    out = model.generate(ids, max_new_tokens=24, do_sample=False, cache=kvcompress.Cache(None, model))
    assert torch.equal(out, ref)


def test_sampling_matches_plain_generate_with_same_seed():
    model = tiny_model("qwen2")
    ids = torch.randint(1, 256, (1, 16), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(7)
    ref = model.generate(ids, max_new_tokens=20, do_sample=True, top_k=20)
    torch.manual_seed(7)
    with kvcompress.compress(model, None) as cache:
        out = model.generate(ids, max_new_tokens=20, do_sample=True, top_k=20, cache=cache)
    assert torch.equal(out, ref)


def test_beam_search_matches_plain_generate():
    model = tiny_model("llama")
    ids = torch.randint(1, 256, (1, 16), generator=torch.Generator().manual_seed(4))
    ref = model.generate(ids, max_new_tokens=12, num_beams=3, do_sample=False)
    with kvcompress.compress(model, None) as cache:
        out = model.generate(ids, max_new_tokens=12, num_beams=3, do_sample=False, cache=cache)
    assert torch.equal(out, ref)


def test_context_restores_the_model_exactly():
    model = tiny_model("llama")
    before_impl = model.config._attn_implementation
    before_state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(1, 256, (1, 12))
    with torch.no_grad():
        ref = model(ids).logits
    stack = {"compressors": [{"window": {"sinks": 1, "recent": 4}}]}
    with kvcompress.compress(model, stack) as cache:
        assert model.config._attn_implementation == "kvcompress"
        assert "get_compiled_call" in vars(model)  # generate's compiled step planned by the cache (PlannedCall)
        model.generate(ids, max_new_tokens=8, do_sample=False, cache=cache)
    assert model.config._attn_implementation == before_impl
    assert "get_compiled_call" not in vars(model)  # the class' method again
    assert all(torch.equal(before_state[k], v) for k, v in model.state_dict().items())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)


def test_context_restores_on_exception():
    model = tiny_model("llama")
    before = model.config._attn_implementation
    with pytest.raises(RuntimeError, match="boom"):
        with kvcompress.compress(model, None):
            raise RuntimeError("boom")
    assert model.config._attn_implementation == before
    assert "get_compiled_call" not in vars(model)


def test_planned_call_ends_its_plan_when_the_step_raises():
    """generate's compiled step inside compress() (PlannedCall): a step that raises ends its plan (the next step can
    be planned) and the next planned step gives the eager step's logits; multi-token calls are not planned."""
    from kvcompress.adapters import hf

    model = tiny_model("llama")
    ids = torch.randint(1, 256, (2, 44), generator=torch.Generator().manual_seed(6))
    stack = {"compressors": [{"kivi": {"bits": 2, "group": 16, "residual": 16}}]}
    logits = []
    for broken in (False, True):
        with kvcompress.compress(model, stack, max_cache_len=48) as cache, torch.no_grad():
            model(ids[:, :20], cache=cache)
            seen = []

            def boom(**kw):
                seen.append(cache.step_planned)
                raise RuntimeError("boom")

            if broken:
                with pytest.raises(RuntimeError, match="boom"):
                    hf.PlannedCall(boom)(input_ids=ids[:, 20:21], cache=cache)
                assert seen == [True] and not cache.step_planned
            step = hf.PlannedCall(lambda **kw: (seen.append(cache.step_planned), model(**kw))[1])
            out = [step(input_ids=ids[:, t:t + 1], cache=cache).logits for t in range(20, 44)]
            assert seen[-24:] == [True] * 24 and not cache.step_planned
            assert int(cache.compressed_layers[0].flushed) > 0  # the planned steps flushed blocks
            step(input_ids=ids[:, 40:42], cache=cache)  # two tokens: passed through unplanned
            assert seen[-1] is False
            logits.append(torch.cat(out))
    assert torch.equal(logits[0], logits[1])


def test_continuing_a_filled_cache_feeds_only_new_tokens():
    """A second generate() on the returned sequence continues the cache (logical positions)."""
    model = tiny_model("llama")
    ids = torch.randint(1, 256, (1, 20), generator=torch.Generator().manual_seed(5))
    ref = model.generate(ids, max_new_tokens=20, do_sample=False)
    with kvcompress.compress(model, None) as cache:
        first = model.generate(ids, max_new_tokens=10, do_sample=False, cache=cache)
        second = model.generate(first, max_new_tokens=10, do_sample=False, cache=cache)
    assert torch.equal(second, ref)


def test_crop_is_refused_clearly():
    model = tiny_model("llama")
    with kvcompress.compress(model, None) as cache:
        model.generate(torch.randint(1, 256, (1, 8)), max_new_tokens=2, do_sample=False, cache=cache)
        with pytest.raises(kvcompress.UnsupportedOperationError, match="cannot be cropped"):
            cache.crop(-1)


def test_keys_changed_between_update_and_attention_are_refused():
    """The hand-off from cache.update to kvcompress attention checks it gets the very keys update returned."""
    from kvcompress.adapters import hf

    model = tiny_model("llama", layers=1)
    with kvcompress.compress(model, None) as cache:
        k = torch.randn(1, 2, 3, 16)
        cache.update(k, torch.randn(1, 2, 3, 16), 0)
        attn = model.model.layers[0].self_attn
        with pytest.raises(kvcompress.UnsupportedModelError, match="changes the keys"):
            hf.kvcompress_attention(attn, torch.randn(1, 4, 3, 16), k.clone(), torch.randn(1, 2, 3, 16), None)
        # nothing pending any more: a later call falls back to plain SDPA
        out, _ = hf.kvcompress_attention(attn, torch.randn(1, 4, 3, 16), k, torch.randn(1, 2, 3, 16), None)
        assert out.shape == (1, 3, 4, 16)


def test_generate_graphs_only_for_one_cuda_device():
    """generate's default compiled step replays kvcompress' CUDA graphs only for a model on one CUDA device in one
    process; a device map over several devices (or the CPU) keeps transformers' compiled call, planned."""
    from types import SimpleNamespace

    from kvcompress.adapters import hf

    cuda = torch.device("cuda", 0)
    assert hf._one_cuda_device(SimpleNamespace(device=cuda))
    assert hf._one_cuda_device(SimpleNamespace(device=cuda, hf_device_map={"model.layers.0": 0, "lm_head": 0}))
    assert not hf._one_cuda_device(SimpleNamespace(device=cuda, hf_device_map={"model.layers.0": 0, "lm_head": 1}))
    assert not hf._one_cuda_device(SimpleNamespace(device=torch.device("cpu")))
    model = tiny_model("llama", layers=1)
    with kvcompress.compress(model, None):
        call = model.get_compiled_call(None)
        assert isinstance(call, hf.PlannedCall) and call.graph_fn is None  # the CPU: transformers' call, planned
