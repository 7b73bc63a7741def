"""The evaluation harness: measured quality, memory and speed of any stack (issue 3).

Modules:

* :mod:`~kvcompress.evaluation.data`: the texts and prompts (standard-library documentation
  text, passkey haystacks, agreement prompts); deterministic for a seed.
* :mod:`~kvcompress.evaluation.metrics`: pure functions (perplexity, KL, top-1 and token
  agreement, passkey scoring), unit tested on cases with known answers.
* :mod:`~kvcompress.evaluation.runner`: the tasks ``ppl``, ``passkey`` and ``agreement``,
  run through the real compressed cache (prefill, then one decode step at a time) against
  plain transformers on the same tokens; JSON-ready results.
* :mod:`~kvcompress.evaluation.sweep`: several stacks on one task, a table and a PNG plot.
* :mod:`~kvcompress.evaluation.bench`: model-level decode latency, cache memory and the
  framework's own per-step overhead.
* :mod:`~kvcompress.evaluation.e2e`: the end-to-end decode benchmark at a real model shape with
  random weights (plain eager, StaticCache + compile, stacks eager and compiled; wall and GPU-busy
  ms per step, cache bytes, compile time; throughput at a fixed KV budget).

``--compile`` (``Evaluator(compile=True)``, ``bench_decode(compile=True)``): a static cache and a
decode step compiled with :func:`~kvcompress.evaluation.runner.compile_options`.

The command line is ``kvcompress eval`` and ``kvcompress bench`` (``--model-shape``: the e2e
benchmark, also ``benchmarks/e2e_decode.py``); see docs/evaluation.md.
Importing this package imports neither transformers nor matplotlib.
"""

from __future__ import annotations

from .metrics import (kl_divergence, passkey_correct, perplexity, prefix_agreement, relative_change,
                      token_agreement, token_nll, top1_agreement)
from .runner import TASKS, EvalResult, EvalSettings, Evaluator, check_settings

__all__ = [
    "TASKS", "EvalResult", "EvalSettings", "Evaluator", "check_settings", "kl_divergence", "passkey_correct",
    "perplexity", "prefix_agreement", "relative_change", "token_agreement", "token_nll", "top1_agreement",
]
