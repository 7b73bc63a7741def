"""Model-level decode benchmarks for every example stack in examples/stacks/.

Run:  .venv/bin/python -m pytest benchmarks/test_model_stacks.py --benchmark-only -q
      (add --benchmark-json OUT.json to keep extra_info)

Each round prefills CONTEXT tokens of the standard library's documentation text (not timed),
then times STEPS teacher-forced decode steps of SmolLM2-135M-Instruct (fp32, as in
test_decode_step.py).  After timing, one instrumented round of the same stack records in
``extra_info``: the cache's bytes, the dense fp16 equivalent, and kvcompress' own work per
decode step (attend, SDPA, read, commit, flush, select, overhead = attend - SDPA; ms summed
over layers), measured as `kvcompress bench` does (kvcompress/evaluation/bench.py).
No assertion on time.
"""

from pathlib import Path

import pytest
import torch

import kvcompress
from kvcompress.evaluation.bench import decode_round
from kvcompress.evaluation.data import document_tokens
from kvcompress.evaluation.runner import DecodeSession

CONTEXT, STEPS = 1024, 32
STACK_FILES = sorted((Path(__file__).resolve().parents[1] / "examples" / "stacks").glob("*.yaml"))
GROUP = f"{STEPS} decode steps after a {CONTEXT}-token prefill, example stacks (SmolLM2-135M, fp32); prefill not timed"


@pytest.fixture(scope="module")
def tokens(default_model):
    _, tok = default_model
    return document_tokens(tok)[: CONTEXT + STEPS]


def _timed_steps(model, stack, tokens):
    """Benchmark target: setup prefills a fresh cache, the timed call runs the decode steps."""
    def setup():
        session = DecodeSession(model, stack).__enter__()
        session.forward(tokens[:CONTEXT], fetch=False)
        return (session,), {}

    def run(session):
        try:
            for t in range(CONTEXT, CONTEXT + STEPS):
                session.forward(tokens[t:t + 1], fetch=False)
        finally:
            session.__exit__(None, None, None)

    return setup, run


def test_decode_plain_transformers_reference(benchmark, default_model, tokens):
    model, _ = default_model
    benchmark.group = GROUP
    setup, run = _timed_steps(model, None, tokens)
    benchmark.pedantic(run, setup=setup, rounds=5, iterations=1)
    _, held, dense, _, _, _ = decode_round(model, None, tokens, CONTEXT, STEPS)
    benchmark.extra_info.update(cache_bytes=held, dense_fp16_bytes=dense)


@pytest.mark.parametrize("path", STACK_FILES, ids=lambda p: p.stem)
def test_decode_example_stack(benchmark, default_model, tokens, path):
    model, _ = default_model
    stack = kvcompress.load_stack(path)
    benchmark.group = GROUP
    setup, run = _timed_steps(model, stack, tokens)
    with torch.no_grad():
        benchmark.pedantic(run, setup=setup, rounds=5, iterations=1)
        _, held, dense, _, breakdown, wall = decode_round(model, stack, tokens, CONTEXT, STEPS, probe=True)
    benchmark.extra_info.update(stack=stack.label, cache_bytes=held, dense_fp16_bytes=dense,
                                compression=dense / held, instrumented_step_ms=wall,
                                **{f"{k}_ms_per_step": v for k, v in breakdown.items()})
