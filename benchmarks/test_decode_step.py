"""Per-step decode latency of the full default model: plain transformers vs kvcompress stacks.

Run:  .venv/bin/python -m pytest benchmarks/test_decode_step.py --benchmark-only -q
Each round prefills CONTEXT tokens of the standard library's documentation text, then times
STEPS greedy decode steps (teacher-forced on the same text); reported time is per round.
"""

import pydoc_data.topics as topics
import pytest
import torch

import kvcompress

CONTEXT, STEPS = 1024, 32
STACKS = {
    "none": {"compressors": []},
    "window-4+252": {"compressors": [{"window": {"sinks": 4, "recent": 252}}]},
}


@pytest.fixture(scope="module")
def tokens(default_model):
    _, tok = default_model
    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    return tok(text, return_tensors="pt").input_ids[:, : CONTEXT + STEPS]


def _kw(model):
    from kvcompress.adapters import hf

    return hf.cache_kwarg(model)  # ``cache`` from transformers 5.24, ``past_key_values`` before


def _steps(model, ids, cache):
    kw = _kw(model)
    with torch.no_grad():
        for t in range(CONTEXT, CONTEXT + STEPS):
            model(ids[:, t:t + 1], **{kw: cache})


def _prefill(model, ids, cache):
    kw = _kw(model)
    with torch.no_grad():
        model(ids[:, :CONTEXT], **{kw: cache})


GROUP = f"{STEPS} decode steps after a {CONTEXT}-token prefill (SmolLM2-135M, CPU fp32); prefill not timed"


def test_decode_plain_transformers(benchmark, default_model, tokens):
    from transformers import DynamicCache

    model, _ = default_model
    benchmark.group = GROUP

    def setup():
        cache = DynamicCache(config=model.config)
        _prefill(model, tokens, cache)
        return (cache,), {}

    benchmark.pedantic(lambda cache: _steps(model, tokens, cache), setup=setup, rounds=5, iterations=1)


@pytest.mark.parametrize("name", list(STACKS))
def test_decode_kvcompress(benchmark, default_model, tokens, name):
    model, _ = default_model
    stack = kvcompress.parse_stack(STACKS[name])
    benchmark.group = GROUP

    def setup():
        scope = kvcompress.compress(model, stack)
        cache = scope.__enter__()
        _prefill(model, tokens, cache)
        return (scope, cache), {}

    def run(scope, cache):
        try:
            _steps(model, tokens, cache)
        finally:
            scope.__exit__(None, None, None)

    benchmark.pedantic(run, setup=setup, rounds=5, iterations=1)
