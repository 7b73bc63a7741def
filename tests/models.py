"""Tiny random-weight models of several architectures (no downloads) and reference helpers."""

from __future__ import annotations

import torch

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3")


def tiny_model(arch: str = "llama", seed: int = 0, layers: int = 2):
    """A small causal LM with random weights: 4 query heads, 2 kv heads (GQA), head_dim 16."""
    import transformers as tf

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    if arch == "llama":
        cfg, cls = tf.LlamaConfig(head_dim=16, **common), tf.LlamaForCausalLM
    elif arch == "mistral":
        cfg, cls = tf.MistralConfig(head_dim=16, sliding_window=None, **common), tf.MistralForCausalLM
    elif arch == "qwen2":
        cfg, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg, cls = tf.Qwen3Config(head_dim=16, **common), tf.Qwen3ForCausalLM
    elif arch == "gemma3":
        n = common["num_hidden_layers"] = max(layers, 3)
        types = [("full_attention" if i % 3 == 2 else "sliding_attention") for i in range(n)]
        cfg = tf.Gemma3TextConfig(head_dim=16, sliding_window=8, layer_types=types, **common)
        cls = tf.Gemma3ForCausalLM
    elif arch == "phi3":
        cfg, cls = tf.Phi3Config(pad_token_id=0, **common), tf.Phi3ForCausalLM
    else:
        raise ValueError(arch)
    cfg.pad_token_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    # Random init is near-uniform; sharpen weights a little so greedy decoding is not all ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model.generation_config.eos_token_id = None
    return model
