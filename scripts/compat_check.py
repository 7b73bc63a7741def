"""Compatibility check across transformers versions (5.17 uses past_key_values=, 5.24 cache=).

Run: python scripts/compat_check.py  (with the transformers version to check installed)
"""
import sys, pathlib; sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import torch, kvcompress, transformers
from kvcompress.adapters import hf
from models import tiny_model
from reference import *
print("transformers", transformers.__version__)
KW = hf.cache_kwarg(tiny_model("llama"))
m = tiny_model("llama")
L=200; ids = torch.randint(1,256,(1,L))
S,W=3,16
chunks = decode_chunks(40, L, [(100, 7), (150, 30)])
st = {"compressors":[{"window":{"sinks":S,"recent":W}}]}
with kvcompress.compress(m, st) as cache:
    got = torch.cat([m(ids[:, a:b], **{KW: cache}, use_cache=True).logits[0] for a,b in chunks])
ref = masked_logits(m, ids, window_visibility(L, chunks, S, W))
print("window vs oracle", (got-ref).abs().max().item())
a = torch.randint(1,256,(2,20))
ref = m.generate(a, max_new_tokens=20, do_sample=False)
with kvcompress.compress(m, None) as cache:
    out = m.generate(a, max_new_tokens=20, do_sample=False, **{KW: cache})
print("empty==plain", torch.equal(ref, out))
m = tiny_model("gemma3")
with kvcompress.compress(m, st) as cache:
    got = torch.cat([m(ids[:, a:b], **{KW: cache}, use_cache=True).logits[0] for a,b in chunks])
ref = masked_logits(m, ids, window_visibility(L, chunks, S, W), sliding_window=8)
print("gemma", (got-ref).abs().max().item())
# generate's own compiled step inside compress (session 62): every decode step planned, prompt chunks run eagerly,
# tokens equal the eager generate's (aot_eager through a compile_config that allows the CPU)
m = tiny_model("llama")
a = torch.randint(1, 256, (1, 30), generator=torch.Generator().manual_seed(0))
KIVI2 = {"kivi": {"bits": 2, "group": 16, "residual": 16}}
LEANK = {"leank": {"mask": "rope", "ratio": 0.5, "align": 4, "sinks": 4, "local": 24, "flush": 16}}
for stack, chunk in (([KIVI2], None), ([LEANK, KIVI2], 12)):
    st = {"compressors": stack}
    extra = {"prefill_chunk_size": chunk} if chunk else {}
    with kvcompress.compress(m, st, max_cache_len=80) as cache:
        eager = m.generate(a, max_new_tokens=40, do_sample=False, **{KW: cache}, **extra)
    keys = []
    torch._dynamo.reset()
    with kvcompress.compress(m, st, max_cache_len=80) as cache:
        plan = cache.plan_step
        cache.plan_step = lambda: keys.append(plan()) or keys[-1]
        out = m.generate(a, max_new_tokens=40, do_sample=False, **{KW: cache}, **extra,
                         compile_config=hf.compile_config({"backend": "aot_eager", "fullgraph": True}))
    print(f"planned generate ({len(stack)} compressors, prefill_chunk_size={chunk}): {len(keys)} steps planned, "
          f"{len(set(keys))} plan keys, tokens == eager: {torch.equal(out, eager)}")
print("get_compiled_call restored:", "get_compiled_call" not in vars(m))
