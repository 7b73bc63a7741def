"""Independent oracle of SnapKV on passkey (question in the prefill): plain transformers, eager attention; the
prefill is exact and records each layer's SnapKV selection (last W queries' softmax, mean over the window, sum
over the GQA group, max-pool K, per-kv-head top ratio*n, sinks and window always kept); every decode step then
attends only to the selected prompt tokens (+ everything after the prompt).  No kvcompress code in the path
(kvcompress is imported only for the default model's weights and the eval's passkey prompts).
    python benchmarks/snapkv_passkey_oracle.py RATIO WINDOW        # e.g. 0.25 128 (max pool 7, 4 sinks)
Compare with `kvcompress eval --stack S --task passkey --question prefill --samples 5 --dtype float32 --device cpu`
for a snapkv stack of the same ratio and window (docs/results.md, issue 17, session 11)."""
import sys, torch, torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv
from kvcompress.models import load_model
from kvcompress.evaluation.data import passkey_samples
from kvcompress.evaluation import metrics
ratio, W, K, SINKS = float(sys.argv[1]), int(sys.argv[2]), 7, 4
model, tok = load_model(None, dtype=torch.float32, device="cpu")
g = model.config.num_attention_heads // model.config.num_key_value_heads
sel = {}
def attn(module, q, k, v, attention_mask, scaling=None, dropout=0.0, **kw):
    i = module.layer_idx
    kk, vv = repeat_kv(k, g), repeat_kv(v, g)
    s = (q @ kk.transpose(-1, -2)) * scaling
    ql, n = q.shape[2], kk.shape[2]
    if ql > 1:  # prefill: causal + selection
        causal = torch.ones(ql, n, dtype=torch.bool).tril(n - ql)
        s = s.masked_fill(~causal, float("-inf"))
        p = s.softmax(-1)
        m = p[0, :, -W:, :].mean(1).view(-1, g, n).sum(1)  # [kvh, n]
        m[:, n - W:] = 0
        pooled = F.max_pool1d(m.unsqueeze(1), K, stride=1, padding=K // 2).squeeze(1)
        top = pooled.max() + 1
        pooled[:, n - W:] = top
        pooled[:, :SINKS] = top + 1
        keep = torch.zeros_like(pooled, dtype=torch.bool).scatter_(1, pooled.topk(int(ratio * n), -1).indices, True)
        sel[i] = keep
    else:
        keep = sel[i]
        full = torch.ones(keep.shape[0], n, dtype=torch.bool)
        full[:, :keep.shape[1]] = keep
        mask = full.repeat_interleave(g, 0).view(1, -1, 1, n)
        s = s.masked_fill(~mask, float("-inf"))
        p = s.softmax(-1)
    return (p @ vv).transpose(1, 2).contiguous(), None
AttentionInterface.register("snapkv_oracle", attn)
model.set_attn_implementation("snapkv_oracle")
ok = 0
for s in passkey_samples(tok, 4096, 5):
    ids = list(s.ids)
    with torch.no_grad():
        out = model(torch.tensor([ids[:-1]]), use_cache=True)
        cache = out.past_key_values
        o = model(torch.tensor([ids[-1:]]), past_key_values=cache, use_cache=True)
        gen = []
        for _ in range(8):
            t = int(o.logits[0, -1].argmax()); gen.append(t)
            o = model(torch.tensor([[t]]), past_key_values=cache, use_cache=True)
    text = tok.decode(gen)
    c = metrics.passkey_correct(text, s.key); ok += c
    print(f"ratio {ratio} window {W} key {s.key}: {text!r} {'ok' if c else 'FAIL'}", flush=True)
print(f"ratio {ratio} window {W}: {ok}/5")
