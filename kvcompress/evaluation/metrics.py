"""Quality metrics: pure functions on logits and token sequences (no model, no I/O).

Conventions: logits are ``[..., vocab]`` tensors; per-position metrics reduce over the last
dimension and return one value per position; all arithmetic is done in float64 so that metric
differences between two nearly identical runs are not rounding noise of the metric itself.
"""

from __future__ import annotations

import math
import re
from typing import Sequence

import torch


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood (nats) of each target under its next-token logits.

    Args:
        logits: ``[n, vocab]`` next-token logits.
        targets: ``[n]`` token ids.

    Returns:
        ``[n]`` float64 tensor.
    """
    logp = torch.log_softmax(logits.double(), dim=-1)
    return -logp.gather(-1, targets.reshape(-1, 1).to(logp.device)).squeeze(-1)


def perplexity(nll: torch.Tensor | Sequence[float]) -> float:
    """``exp(mean NLL)``: the perplexity of tokens with these negative log-likelihoods (nats)."""
    nll = torch.as_tensor(nll, dtype=torch.float64)
    if nll.numel() == 0:
        raise ValueError("perplexity of zero tokens is undefined")
    return math.exp(nll.mean().item())


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(P‖Q) in nats per position, P and Q given as logits over the same vocabulary.

    In the harness P is the uncompressed baseline and Q the compressed run:
    ``sum_v P(v) (log P(v) - log Q(v))``.  Zero iff the distributions are equal.

    Returns:
        float64 tensor of the leading shape of the inputs.
    """
    if p_logits.shape != q_logits.shape:
        raise ValueError(f"logit shapes differ: {tuple(p_logits.shape)} vs {tuple(q_logits.shape)}")
    logp = torch.log_softmax(p_logits.double(), dim=-1)
    logq = torch.log_softmax(q_logits.double().to(logp.device), dim=-1)
    return (logp.exp() * (logp - logq)).sum(-1).clamp_min(0.0)


def top1_agreement(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Fraction of positions whose most likely token is the same under P and Q."""
    if p_logits.shape != q_logits.shape:
        raise ValueError(f"logit shapes differ: {tuple(p_logits.shape)} vs {tuple(q_logits.shape)}")
    a, b = p_logits.argmax(-1), q_logits.argmax(-1).to(p_logits.device)
    return (a == b).double().mean().item()


def relative_change(value: float, baseline: float) -> float:
    """``(value - baseline) / baseline``, e.g. the relative Δppl (0.05 = 5% worse)."""
    if baseline == 0:
        raise ValueError("relative change against a baseline of 0 is undefined")
    return (value - baseline) / baseline


def token_agreement(reference: Sequence[int], other: Sequence[int]) -> float:
    """Fraction of the reference's positions where ``other`` has the same token.

    Positions are compared one by one over the whole reference (after a first difference,
    later positions still count when they match again).  Positions ``other`` lacks count as
    different; tokens beyond the reference's length are ignored.
    """
    if len(reference) == 0:
        raise ValueError("agreement with an empty reference is undefined")
    same = sum(1 for a, b in zip(reference, other) if a == b)
    return same / len(reference)


def prefix_agreement(reference: Sequence[int], other: Sequence[int]) -> float:
    """Length of the common prefix of the two sequences as a fraction of the reference's length."""
    if len(reference) == 0:
        raise ValueError("agreement with an empty reference is undefined")
    n = 0
    for a, b in zip(reference, other):
        if a != b:
            break
        n += 1
    return n / len(reference)


_DIGITS = re.compile(r"\d+")


def passkey_answer(text: str) -> str | None:
    """The first run of digits in a generated answer, or ``None``."""
    match = _DIGITS.search(text)
    return match.group(0) if match else None


def passkey_correct(text: str, key: str) -> bool:
    """Whether the first number in ``text`` is exactly ``key`` (``"123456"`` does not match ``"12345"``)."""
    return passkey_answer(text) == key
