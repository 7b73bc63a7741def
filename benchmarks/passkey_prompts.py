"""Write the prompts of ``kvcompress eval --task passkey`` to a JSON file, for another tool to answer.

Runs in the kvcompress venv.  The prompts are built by the function the eval runner uses
(``kvcompress/evaluation/runner.py``, ``Evaluator._execute``): ``data.passkey_samples(tokenizer, context, samples,
seed)`` with the default model's tokenizer (intro, filler, needle and question tokenized separately without special
tokens and concatenated; ``ids[:question_start]`` is the haystack, the rest the question).  The runner then
prefills ``ids[:prefill]`` (``--question prefill``: ``len(ids) - 1``, the question included; ``--question after``:
``question_start``), feeds the remaining prompt tokens one decode step at a time, and decodes ``tokens`` tokens
greedily (the first from the last prompt token's logits, no stop at EOS); the answer is
``tokenizer.decode(generated, skip_special_tokens=True)`` and it is correct iff its first run of digits is the key
(``metrics.passkey_correct``: ``re.search(r"\\d+", answer).group(0) == key``).

    .venv/bin/python benchmarks/passkey_prompts.py               # 5 prompts of 4096 tokens -> /tmp/passkey_prompts.json
    .venv/bin/python benchmarks/passkey_prompts.py --samples 1 --out /tmp/p.json

The file is JSON: per sample the ``ids``, ``key``, ``depth``, ``needle_start``, ``question_start``; the settings;
the prompt texts (so the reader can check its own tokenizer encodes them to the same ids); a SHA-256 of the ids
(int32 little-endian, prompts concatenated).  ``benchmarks/kvpress_passkey.py`` reads it in the kvpress venv.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ppl_windows import windows_sha256  # noqa: E402  (the same hash of int32 ids)

SCHEMA = "kvcompress.passkey_prompts/1"


def build(context: int | None, samples: int | None, tokens: int | None, seed: int) -> dict:
    import transformers

    import kvcompress
    from kvcompress.evaluation import data
    from kvcompress.evaluation.runner import EvalSettings
    from kvcompress.models import DEFAULT_MODEL, GGUF_FILE, resolve_model_path

    settings = EvalSettings.for_task("passkey", context, samples, tokens, seed, "prefill")  # validates like the CLI
    tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model_path(None))
    prompts = data.passkey_samples(tokenizer, settings.context, settings.samples, settings.seed)
    ids = [list(p.ids) for p in prompts]
    return {
        "schema": SCHEMA,
        "model": DEFAULT_MODEL,
        "tokenizer": f"{DEFAULT_MODEL} tokenizer (kvcompress.models: converted from {GGUF_FILE})",
        "context": settings.context, "samples": settings.samples, "tokens": settings.tokens, "seed": settings.seed,
        "protocol": {
            "prefill": {"question": "prefill: ids[:len(ids) - 1] prefilled, ids[-1] one decode step",
                        "after": "after: ids[:question_start] prefilled, the question fed one token per step"},
            "generate": "tokens greedy tokens: the first is the argmax after the last prompt token, no EOS stop",
            "answer": "tokenizer.decode(generated, skip_special_tokens=True)",
            "correct": r"the first re.search(r'\d+', answer) equals key (kvcompress.evaluation.metrics)",
        },
        "texts": {"intro": data.PASSKEY_INTRO, "filler": data.PASSKEY_FILLER, "needle": data.PASSKEY_NEEDLE,
                  "question": data.PASSKEY_QUESTION},
        "sha256": windows_sha256(ids),
        "versions": {"kvcompress": kvcompress.__version__, "transformers": transformers.__version__,
                     "python": sys.version.split()[0]},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "prompts": [{"key": p.key, "depth": p.depth, "needle_start": p.needle_start,
                     "question_start": p.question_start, "ids": list(p.ids)} for p in prompts],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, help="prompt tokens at most (default: the eval's, 4096)")
    p.add_argument("--samples", type=int, help="prompts (default: the eval's, 5)")
    p.add_argument("--tokens", type=int, help="generated tokens (default: the eval's, 8)")
    p.add_argument("--seed", type=int, default=0, help="key seed (default 0, as the eval)")
    p.add_argument("--out", type=Path, default=Path("/tmp/passkey_prompts.json"), help="JSON file to write")
    args = p.parse_args(argv)
    obj = build(args.context, args.samples, args.tokens, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(obj) + "\n")
    print(f"{args.out}: {obj['samples']} prompts of <= {obj['context']} tokens "
          f"({', '.join(str(len(q['ids'])) for q in obj['prompts'])}), keys "
          f"{', '.join(q['key'] for q in obj['prompts'])}, {obj['tokens']} generated; sha256 {obj['sha256'][:16]}...")


if __name__ == "__main__":
    main()
