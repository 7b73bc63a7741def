"""Write the token windows of ``kvcompress eval --task ppl`` to a JSON file, for another tool to score.

Runs in the kvcompress venv.  The windows are built by the same functions the eval runner uses
(``kvcompress/evaluation/runner.py``, ``Evaluator._execute``): the document text
(``data.document_text()``: ``pydoc_data.topics``, sorted keys) tokenized by the default model's
tokenizer without special tokens (``data.document_tokens``), then ``samples`` windows of
``context + tokens + 1`` tokens at ``data.spread_offsets(len(doc), context + tokens + 1, samples)``.
A window is scored as the runner does: prefill ``ids[:context]``, feed ``ids[context:context + tokens]``
one decode step at a time; the logits of the step that feeds ``ids[t]`` score ``ids[t + 1]`` (so the
scored tokens are ``ids[context + 1:]``; the prefill's own last logits are not scored).

    .venv/bin/python benchmarks/ppl_windows.py                       # 3 windows of 2048 + 256 (issue 17)
    .venv/bin/python benchmarks/ppl_windows.py --samples 1 --out /tmp/w.json

The file is JSON (no pickle): ``windows`` (lists of token ids), their ``offsets``, the sizes, the number of
document tokens, a SHA-256 of the ids (int32 little-endian, windows concatenated) and the versions that
tokenized them.  ``benchmarks/kvpress_compare.py`` reads it in the kvpress venv.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import sys
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "data" / "ppl_windows.json"
SCHEMA = "kvcompress.ppl_windows/1"


def windows_sha256(windows: list[list[int]]) -> str:
    """SHA-256 of the windows' ids as int32 little-endian, concatenated (the same in both venvs)."""
    h = hashlib.sha256()
    for w in windows:
        h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in w))
    return h.hexdigest()


def build(context: int, tokens: int, samples: int) -> dict:
    import transformers

    import kvcompress
    from kvcompress.evaluation import data
    from kvcompress.evaluation.runner import EvalSettings
    from kvcompress.models import DEFAULT_MODEL, GGUF_FILE, resolve_model_path

    settings = EvalSettings.for_task("ppl", context, samples, tokens)  # validates like the CLI
    path = resolve_model_path(None)  # the converted default model (converts the GGUF on first use)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    doc = data.document_tokens(tokenizer)
    span = settings.context + settings.tokens + 1
    if span > len(doc):
        sys.exit(f"context + tokens + 1 = {span} exceeds the document's {len(doc)} tokens")
    offsets = data.spread_offsets(len(doc), span, settings.samples)
    windows = [list(doc[o:o + span]) for o in offsets]
    return {
        "schema": SCHEMA,
        "model": DEFAULT_MODEL,
        "tokenizer": f"{DEFAULT_MODEL} tokenizer (kvcompress.models: converted from {GGUF_FILE})",
        "context": settings.context,
        "tokens": settings.tokens,
        "samples": settings.samples,
        "document_tokens": len(doc),
        "offsets": offsets,
        "sha256": windows_sha256(windows),
        "versions": {"kvcompress": kvcompress.__version__, "transformers": transformers.__version__,
                     "python": sys.version.split()[0]},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "windows": windows,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=2048, help="prompt tokens (default 2048)")
    p.add_argument("--tokens", type=int, default=256, help="scored tokens per window (default 256)")
    p.add_argument("--samples", type=int, default=3, help="windows (default 3)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON file to write (default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    obj = build(args.context, args.tokens, args.samples)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # one window per line: small and diffable
    head = {k: v for k, v in obj.items() if k != "windows"}
    text = json.dumps(head, indent=1)[:-2] + ',\n "windows": [\n'
    text += ",\n".join("  " + json.dumps(w, separators=(",", ":")) for w in obj["windows"]) + "\n ]\n}\n"
    assert json.loads(text) == obj
    args.out.write_text(text)
    print(f"{args.out}: {obj['samples']} windows of {obj['context']} + {obj['tokens']} (+1) tokens at offsets "
          f"{obj['offsets']} of {obj['document_tokens']} document tokens; sha256 {obj['sha256'][:16]}...")


if __name__ == "__main__":
    main()
