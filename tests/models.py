"""Tiny random-weight models of several architectures (no downloads) and reference helpers."""

from __future__ import annotations

import torch

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3")
#: attention variants (tests/test_attention_variants.py): Gemma 2's logit soft-cap, gpt-oss' learned sinks
VARIANT_ARCHS = ("gemma2", "gpt_oss")
#: the architecture matrix (tests/test_architectures.py): every one passes or is refused at compress() time
MATRIX_ARCHS = ARCHS + VARIANT_ARCHS + ("qwen2_moe", "qwen3_moe", "mixtral", "gpt2", "opt", "gptj", "glm", "olmo2",
                                        "falcon")
#: the soft-cap of the tiny Gemma 2 (real models use 50): small, so that tanh bends the tiny model's scores
TINY_SOFTCAP = 0.5


def tiny_model(arch: str = "llama", seed: int = 0, layers: int = 2):
    """A small causal LM with random weights: 4 query heads, 2 kv heads (GQA), head_dim 16.

    Sliding-window hybrids (gemma3, gemma2, gpt_oss) alternate sliding (window 8) and full-attention layers, the
    last layer full.  gemma2 soft-caps its attention logits at :data:`TINY_SOFTCAP`; gpt_oss' learned sink logits
    are drawn large enough (std 2) to matter.
    """
    import transformers as tf

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    alternating = ["sliding_attention" if (layers - 1 - i) % 2 else "full_attention" for i in range(layers)]
    moe = dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
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
    elif arch == "gemma2":
        cfg = tf.Gemma2Config(head_dim=16, sliding_window=8, layer_types=alternating, query_pre_attn_scalar=16,
                              attn_logit_softcapping=TINY_SOFTCAP, final_logit_softcapping=None, **common)
        cls = tf.Gemma2ForCausalLM
    elif arch == "gpt_oss":
        cfg = tf.GptOssConfig(head_dim=16, sliding_window=8, layer_types=alternating, num_local_experts=4,
                              num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                              **common)
        cls = tf.GptOssForCausalLM
    elif arch == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(shared_expert_intermediate_size=32, **moe, **common)
        cls = tf.Qwen2MoeForCausalLM
    elif arch == "qwen3_moe":
        cfg, cls = tf.Qwen3MoeConfig(head_dim=16, **moe, **common), tf.Qwen3MoeForCausalLM
    elif arch == "mixtral":
        cfg = tf.MixtralConfig(head_dim=16, num_local_experts=4, num_experts_per_tok=2, **common)
        cls = tf.MixtralForCausalLM
    elif arch == "glm":
        cfg, cls = tf.GlmConfig(head_dim=16, pad_token_id=0, eos_token_id=2, **common), tf.GlmForCausalLM
    elif arch == "olmo2":
        cfg, cls = tf.Olmo2Config(eos_token_id=2, **common), tf.Olmo2ForCausalLM
    elif arch == "gpt2":  # multi-head (no GQA), learned positions
        cfg = tf.GPT2Config(vocab_size=256, n_embd=64, n_layer=layers, n_head=4, n_positions=1024, bos_token_id=1,
                            eos_token_id=2)
        cls = tf.GPT2LMHeadModel
    elif arch == "opt":
        cfg = tf.OPTConfig(vocab_size=256, hidden_size=64, ffn_dim=128, num_hidden_layers=layers, num_attention_heads=4,
                           max_position_embeddings=1024, word_embed_proj_dim=64)
        cls = tf.OPTForCausalLM
    elif arch == "gptj":
        cfg = tf.GPTJConfig(vocab_size=256, n_embd=64, n_layer=layers, n_head=4, rotary_dim=8, n_positions=1024,
                            bos_token_id=1, eos_token_id=2)
        cls = tf.GPTJForCausalLM
    elif arch == "falcon":  # attention outside transformers' AttentionInterface: refused
        cfg = tf.FalconConfig(vocab_size=256, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                              max_position_embeddings=1024)
        cls = tf.FalconForCausalLM
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
        for m in model.modules():
            if isinstance(getattr(m, "sinks", None), torch.nn.Parameter):  # gpt-oss: sinks that matter
                m.sinks.normal_(0.0, 2.0)
    model.generation_config.eos_token_id = None
    return model


def lowrank_basis_file(model, path, rank: int = 8, value_rank: int | None = None, tokens: int = 64) -> str:
    """A low-rank basis file for ``model`` at ``path``: the uncentred PCA of its keys (and, with ``value_rank``, of
    its values) over 4 random ``tokens``-token rows (seed 7, 2 sinks skipped), ``rank`` directions per head kept."""
    from kvcompress.calibration.lowrank import kv_spectra, save_basis
    from kvcompress.calibration.masks import config_hash

    ids = torch.randint(1, 256, (4, tokens), generator=torch.Generator().manual_seed(7))
    (eigenvalues, vectors), (v_eigenvalues, v_vectors) = kv_spectra(model, ids, skip=2)
    shape = (model.config.num_hidden_layers, model.config.num_key_value_heads)
    values = None if value_rank is None else (v_vectors, torch.full(shape, value_rank, dtype=torch.int32),
                                              v_eigenvalues)
    save_basis(path, vectors, torch.full(shape, rank, dtype=torch.int32), eigenvalues,
               {"model": "tiny-llama", "model_config_hash": config_hash(model.config), "target": "test", "align": 1,
                "settings": {}}, values=values)
    return str(path)
