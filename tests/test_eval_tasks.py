"""The evaluation tasks end to end on the real default model, at small contexts.

Uncompressed-equivalent stacks must score exactly like the baseline; a window too small to
keep the passkey must fail where the baseline passes.  No test looks at wall-clock times.
"""

import pytest

from kvcompress.evaluation import EvalSettings, Evaluator, data
from kvcompress.errors import ConfigError

pytestmark = pytest.mark.model

NONE = {"name": "none", "compressors": []}
TINY_WINDOW = {"name": "window-4+16", "compressors": [{"window": {"sinks": 4, "recent": 16}}]}


@pytest.fixture(scope="module")
def evaluator(default_model):
    model, tok = default_model
    return Evaluator(model, tok, "SmolLM2-135M-Instruct", progress=False)


def test_ppl_empty_stack_equals_baseline_and_window_degrades(evaluator):
    settings = EvalSettings.for_task("ppl", context=128, samples=2, tokens=4)
    none = evaluator.run(NONE, settings)
    assert none.metrics["scored_tokens"] == 8
    assert none.metrics["kl"] < 1e-6 and none.metrics["top1"] == 1.0
    assert none.metrics["ppl"] == pytest.approx(none.baseline["ppl"], rel=1e-5)
    assert 1.0 < none.baseline["ppl"] < 100.0  # a real model on English text

    window = evaluator.run(TINY_WINDOW, settings)
    assert window.baseline_reused and evaluator.baseline_runs == 1  # one baseline per settings
    assert window.baseline == none.baseline
    assert window.metrics["kl"] > 1e-3 and window.metrics["delta_ppl"] == pytest.approx(
        window.metrics["ppl"] / window.baseline["ppl"] - 1)
    # two samples of 4 scored tokens each, pooled
    assert len(window.details) == 2 and window.metrics["scored_tokens"] == 8
    assert window.metrics["top1"] == pytest.approx(sum(d["top1"] for d in window.details) / 2)
    assert window.metrics["kl"] == pytest.approx(sum(d["kl"] for d in window.details) / 2)
    assert window.cache_bytes < none.cache_bytes and window.compression > none.compression
    # memory at the end of prefill: the dense fp16 cache of 128 tokens of 30 layers x 3 heads x 64 dims
    assert window.dense_bytes == 128 * 30 * 3 * 64 * 2 * 2
    # and after decoding: the uncompressed cache grew by the 4 decoded tokens; its peak is its end
    per_token = none.baseline_cache_bytes // 128
    assert none.baseline_end_cache_bytes == none.baseline_cache_bytes + 4 * per_token
    assert none.baseline_peak_cache_bytes == none.baseline_end_cache_bytes
    assert none.end_cache_bytes >= none.cache_bytes and none.peak_cache_bytes >= none.end_cache_bytes
    assert window.peak_cache_bytes >= window.end_cache_bytes and window.end_cache_bytes < none.end_cache_bytes
    assert "cache MiB at end of decoding" in window.table() and "peak over the run" in window.table()


def test_passkey_window_that_evicts_the_key_fails_where_baseline_passes(evaluator):
    settings = EvalSettings.for_task("passkey", context=160, samples=1, tokens=6)
    result = evaluator.run(TINY_WINDOW, settings)
    assert result.baseline["accuracy"] == 1.0, result.details
    assert result.metrics["accuracy"] == 0.0, result.details
    assert [d["depth"] for d in result.details] == [0.5]
    assert not result.notes  # the baseline passes: nothing to warn about
    assert "FAIL" in result.table() and "ok" in result.table()


def test_passkey_question_in_prefill(evaluator):
    """The standard passkey prompt (question inside the prefill): the uncompressed model answers as when the
    question is fed after the prefill (same greedy tokens); the settings are a separate baseline; both round-trip."""
    after = evaluator.run(NONE, EvalSettings.for_task("passkey", context=160, samples=1, tokens=6))
    runs = evaluator.baseline_runs
    inside = evaluator.run(NONE, EvalSettings.for_task("passkey", context=160, samples=1, tokens=6,
                                                       question="prefill"))
    assert evaluator.baseline_runs == runs + 1 and not inside.baseline_reused
    assert inside.baseline["accuracy"] == after.baseline["accuracy"] == 1.0
    assert [d["answer"] for d in inside.details] == [d["answer"] for d in after.details]
    # the question was prefilled: the cache at the end of prefill holds all prompt tokens but the last
    (sample,) = data.passkey_samples(evaluator.tokenizer, 160, 1)
    per_token = after.dense_bytes // sample.question_start
    assert inside.dense_bytes == (len(sample.ids) - 1) * per_token
    assert "question in the prefill" in inside.table() and "question after the prefill" in after.table()
    assert type(inside).from_dict(inside.to_dict()).settings == inside.settings
    with pytest.raises(ConfigError, match="--question"):
        EvalSettings.for_task("ppl", question="prefill")
    with pytest.raises(ConfigError, match="--question"):
        EvalSettings.for_task("passkey", question="before")


def test_passkey_prompt_layout(default_model):
    _, tok = default_model
    samples = data.passkey_samples(tok, 300, 3, seed=7)
    assert samples == data.passkey_samples(tok, 300, 3, seed=7)  # deterministic
    assert [s.key for s in samples] != [s.key for s in data.passkey_samples(tok, 300, 3, seed=8)]
    starts = [s.needle_start for s in samples]
    assert starts == sorted(starts) and len(set(starts)) == 3  # deeper needles sit later
    for s in samples:
        assert len(s.ids) <= 300 and len(s.key) == 5
        needle = tok.decode(list(s.ids[s.needle_start:s.question_start]))
        assert needle.startswith(f" The pass key is {s.key}.")
        assert tok.decode(list(s.question)) == data.PASSKEY_QUESTION
    with pytest.raises(ValueError):
        data.passkey_samples(tok, 40, 1)


def test_agreement_empty_stack_is_identical_tiny_window_is_not(evaluator):
    settings = EvalSettings.for_task("agreement", context=96, samples=1, tokens=6)
    none = evaluator.run(NONE, settings)
    assert none.metrics == {"agreement": 1.0, "prefix": 1.0}
    window = evaluator.run(TINY_WINDOW, settings)
    assert window.metrics["agreement"] < 1.0
    assert 0.0 <= window.metrics["prefix"] <= window.metrics["agreement"]


def test_checks_needing_the_tokenizer(evaluator):
    with pytest.raises(ConfigError, match="--context.*passkey prompt"):
        evaluator.check(EvalSettings("passkey", 20, 1, 8))
    with pytest.raises(ConfigError, match="--context.*document"):
        evaluator.check(EvalSettings("ppl", 130_000, 1, 8))
    notes = evaluator.check(EvalSettings("agreement", 8190, 1, 64))
    assert "8192 trained positions" in notes[0]
