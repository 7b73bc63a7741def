"""Texts and prompts of the evaluation tasks, built deterministically from a seed.

* The **document**: the standard library's documentation text (``pydoc_data.topics``, present in
  every CPython install), topics concatenated in sorted-key order with blank lines between them.
  About 113k tokens with SmolLM2's tokenizer.
* **Passkey** prompts (Mohtashami & Jaggi 2023, "Landmark Attention", arXiv:2305.16300): a
  5-digit key hidden at a given depth of repeated filler sentences, then asked for.
* **Agreement** prompts: windows of the document at fixed, evenly spread offsets.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from typing import Any

PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                 "I will quiz you about the important information there.")
PASSKEY_FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = " What is the pass key? The pass key is"


def document_text() -> str:
    """The standard library's documentation text, in a fixed order."""
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


@functools.lru_cache(maxsize=4)
def document_tokens(tokenizer: Any) -> tuple[int, ...]:
    """Token ids of :func:`document_text` (no special tokens added), cached per tokenizer."""
    return tuple(tokenizer(document_text(), add_special_tokens=False).input_ids)


def spread_offsets(total: int, length: int, count: int) -> list[int]:
    """``count`` start offsets of windows of ``length`` tokens, evenly spread over ``total`` tokens.

    The first window starts at 0; windows overlap when ``count * length > total``.
    """
    if length > total:
        raise ValueError(f"a window of {length} tokens does not fit in {total} tokens")
    room = total - length
    if count <= 1:
        return [0]
    return [round(i * room / (count - 1)) for i in range(count)]


@dataclasses.dataclass(frozen=True)
class PasskeySample:
    """One passkey prompt: ``ids[:question_start]`` is the haystack, the rest is the question."""

    ids: tuple[int, ...]
    key: str
    depth: float             #: requested depth of the needle (0 = start of the filler, 1 = end)
    needle_start: int        #: token index where the needle sentence starts
    question_start: int      #: token index where the question starts

    @property
    def haystack(self) -> tuple[int, ...]:
        return self.ids[: self.question_start]

    @property
    def question(self) -> tuple[int, ...]:
        return self.ids[self.question_start:]


def passkey_depths(samples: int) -> list[float]:
    """Depths spread over the samples: the middles of ``samples`` equal slices of [0, 1]."""
    return [(i + 0.5) / samples for i in range(samples)]


def passkey_samples(tokenizer: Any, context: int, samples: int, seed: int = 0) -> list[PasskeySample]:
    """``samples`` passkey prompts of at most ``context`` tokens (filled with whole filler sentences).

    Keys are uniform 5-digit numbers from ``random.Random(seed)``; depths come from
    :func:`passkey_depths`.  Pieces are tokenized separately and concatenated, so the
    needle's token position is exact.
    """
    def enc(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False).input_ids)

    rng = random.Random(seed)
    intro, filler, question = enc(PASSKEY_INTRO), enc(PASSKEY_FILLER), enc(PASSKEY_QUESTION)
    out = []
    for depth in passkey_depths(samples):
        key = str(rng.randint(10000, 99999))
        needle = enc(PASSKEY_NEEDLE.format(key=key))
        fixed = len(intro) + len(needle) + len(question)
        n_fill = (context - fixed) // len(filler)
        if n_fill < 1:
            raise ValueError(f"a passkey prompt needs at least {fixed + len(filler)} tokens, context is {context}")
        before = round(n_fill * depth)
        ids = intro + filler * before
        needle_start = len(ids)
        ids += needle + filler * (n_fill - before)
        question_start = len(ids)
        ids += question
        out.append(PasskeySample(tuple(ids), key, depth, needle_start, question_start))
    return out


def min_passkey_context(tokenizer: Any) -> int:
    """The smallest context that holds a passkey prompt with one filler sentence."""
    def n(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    return n(PASSKEY_INTRO) + n(PASSKEY_NEEDLE.format(key="12345")) + n(PASSKEY_QUESTION) + n(PASSKEY_FILLER)
