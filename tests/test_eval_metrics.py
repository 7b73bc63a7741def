"""Evaluation metrics and helpers on tiny cases with known answers (no model)."""

import io
import math

import pytest
import torch

from kvcompress.evaluation import data, metrics
from kvcompress.evaluation.report import Progress, format_table, markdown_table


def test_kl_of_identical_distributions_is_zero():
    logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(metrics.kl_divergence(logits, logits), torch.zeros(7, dtype=torch.float64), atol=1e-12)
    # logits are defined up to a constant per row
    assert metrics.kl_divergence(logits, logits + 3.0).abs().max() < 1e-12


def test_kl_known_value_and_direction():
    p = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    q = torch.log(torch.tensor([[0.25, 0.75]], dtype=torch.float64))
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)  # = 0.5 ln(4/3)
    assert metrics.kl_divergence(p, q).item() == pytest.approx(expected, abs=1e-12)
    reverse = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert metrics.kl_divergence(q, p).item() == pytest.approx(reverse, abs=1e-12)  # KL(P||Q) != KL(Q||P)


def test_kl_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="shapes differ"):
        metrics.kl_divergence(torch.zeros(2, 3), torch.zeros(2, 4))


def test_perplexity_of_uniform_distribution_is_vocab_size():
    vocab = 1000
    logits = torch.zeros(5, vocab)
    nll = metrics.token_nll(logits, torch.tensor([0, 1, 2, 999, 500]))
    assert torch.allclose(nll, torch.full((5,), math.log(vocab), dtype=torch.float64))
    assert metrics.perplexity(nll) == pytest.approx(vocab, rel=1e-12)


def test_perplexity_of_certain_predictions_is_one_and_known_mix():
    logits = torch.tensor([[0.0, 100.0], [100.0, 0.0]])
    assert metrics.perplexity(metrics.token_nll(logits, torch.tensor([1, 0]))) == pytest.approx(1.0)
    # probabilities 1/2 and 1/8: ppl = exp(mean(ln 2, ln 8)) = 4
    assert metrics.perplexity([math.log(2), math.log(8)]) == pytest.approx(4.0)
    with pytest.raises(ValueError):
        metrics.perplexity([])


def test_top1_agreement():
    a = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    assert metrics.top1_agreement(a, a) == 1.0
    b = torch.tensor([[0.0, 1.0], [0.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    assert metrics.top1_agreement(a, b) == 0.5


def test_token_and_prefix_agreement():
    ref = [1, 2, 3, 4]
    assert metrics.token_agreement(ref, ref) == 1.0 and metrics.prefix_agreement(ref, ref) == 1.0
    assert metrics.token_agreement(ref, [1, 9, 3, 4]) == 0.75  # positions after a difference still count
    assert metrics.prefix_agreement(ref, [1, 9, 3, 4]) == 0.25  # nothing after the first difference
    assert metrics.token_agreement(ref, [1, 2]) == 0.5  # missing positions are differences
    assert metrics.token_agreement(ref, [1, 2, 3, 4, 5, 6]) == 1.0  # extra tokens are ignored
    assert metrics.token_agreement(ref, [5, 6, 7, 8]) == 0.0
    with pytest.raises(ValueError):
        metrics.token_agreement([], [1])


def test_relative_change():
    assert metrics.relative_change(11.0, 10.0) == pytest.approx(0.1)
    assert metrics.relative_change(10.0, 10.0) == 0.0
    with pytest.raises(ValueError):
        metrics.relative_change(1.0, 0.0)


@pytest.mark.parametrize("text,ok", [
    (" 12345. Remember it.", True), ("12345", True), ("The pass key is 12345", True),
    (" 123456", False), (" 1234", False), (" 54321, not 12345", False), (" a magical key", False), ("", False),
])
def test_passkey_scoring(text, ok):
    assert metrics.passkey_correct(text, "12345") is ok


def test_spread_offsets_and_depths():
    assert data.spread_offsets(100, 10, 1) == [0]
    offs = data.spread_offsets(100, 10, 4)
    assert offs == [0, 30, 60, 90] and offs[-1] + 10 == 100
    assert data.spread_offsets(10, 10, 3) == [0, 0, 0]
    with pytest.raises(ValueError):
        data.spread_offsets(5, 10, 2)
    assert data.passkey_depths(5) == pytest.approx([0.1, 0.3, 0.5, 0.7, 0.9])
    assert data.passkey_depths(1) == [0.5]


def test_document_text_is_the_fixed_stdlib_text():
    import pydoc_data.topics as topics

    text = data.document_text()
    first = sorted(topics.topics)[0]
    assert text.startswith(topics.topics[first]) and len(text) > 100_000
    assert data.document_text() == text


def test_progress_bar_quarters_without_a_terminal():
    out = io.StringIO()
    with Progress(8, "ppl window", stream=out) as bar:
        for _ in range(8):
            bar.update()
    lines = out.getvalue().splitlines()
    assert len(lines) == 4 and lines[-1].startswith("ppl window [") and "8/8" in lines[-1]
    quiet = io.StringIO()
    bar = Progress(8, "x", stream=quiet, enabled=False)
    bar.update(8)
    bar.close()
    assert quiet.getvalue() == ""


def test_tables():
    rows = [["stack", "ppl"], ["none", "1.0"], ["window-4+252", "12.5"]]
    text = format_table(rows).splitlines()
    assert text[0].startswith("stack") and set(text[1]) <= {"-", " "} and text[3].endswith("12.5")
    assert markdown_table(rows).splitlines()[1] == "|---|---|"


def test_importing_the_harness_loads_neither_transformers_nor_matplotlib():
    import subprocess
    import sys

    code = ("import sys, kvcompress.evaluation, kvcompress.evaluation.sweep, kvcompress.evaluation.bench; "
            "print('transformers' in sys.modules, 'matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
