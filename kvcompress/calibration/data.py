"""Offline calibration text and retrieval-style training samples.

Everything comes from the standard library's documentation text (``pydoc_data.topics``), split by
topic into a **training** part (4 of every 5 topics in sorted-key order) and a **held-out** part
(every 5th topic), so quality checks never read text the masks were calibrated on.

Training samples (LeanK trains on synthetic retrieval, arXiv 2508.02215 §4) have a fixed layout of
exactly ``context`` context tokens followed by exactly ``tail`` question/answer tokens:

* **passkey**: 1-3 sentences "The first pass key is 48213. Remember it." hidden at random depths
  of a window of documentation text; the tail asks for them and answers;
* **key-value**: 3-6 sentences "The value of lima-tango is 583920." scattered the same way; the
  tail asks for several of them and answers;
* **text** (optional): a plain window of documentation; the tail is its next tokens.

Pieces are tokenized separately and concatenated, so every needle's position is exact, and all
samples have the same length (they batch without padding).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliett",
         "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango",
         "uniform", "victor", "whiskey", "xray", "yankee", "zulu")
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth")

PASSKEY_INTRO = ("There is important information hidden inside a lot of irrelevant text. Find it and memorize it. "
                 "I will quiz you about it afterwards.\n\n")
PASSKEY_NEEDLE = "\nThe {ordinal} pass key is {key}. Remember it. {key} is the {ordinal} pass key.\n"
PASSKEY_QA = "\nWhat is the {ordinal} pass key? The {ordinal} pass key is {key}."
KV_INTRO = ("Some special values are defined in the following text. Memorize them. "
            "I will ask you about them afterwards.\n\n")
KV_NEEDLE = "\nThe value of {name} is {value}.\n"
KV_QA = "\nWhat is the value of {name}? The value of {name} is {value}."


def topic_texts() -> list[tuple[str, str]]:
    """(topic, text) of ``pydoc_data.topics`` in sorted-key order."""
    import pydoc_data.topics as topics

    return [(k, topics.topics[k]) for k in sorted(topics.topics)]


def split_text(part: str) -> str:
    """``"train"`` (4 of every 5 topics) or ``"heldout"`` (every 5th topic), blank lines between topics."""
    if part not in ("train", "heldout"):
        raise ValueError(f"part must be 'train' or 'heldout', got {part!r}")
    chosen = [text for i, (_, text) in enumerate(topic_texts()) if (i % 5 == 4) == (part == "heldout")]
    return "\n\n".join(chosen)


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def split_tokens(tokenizer: Any, part: str) -> list[int]:
    return encode(tokenizer, split_text(part))


def windows(tokens: list[int], length: int, count: int, seed: int = 0) -> list[list[int]]:
    """``count`` windows of ``length`` tokens at evenly spread offsets (``seed`` shifts them)."""
    if length > len(tokens):
        raise ValueError(f"a window of {length} tokens does not fit in {len(tokens)} tokens")
    room = len(tokens) - length
    shift = random.Random(seed).randrange(max(1, room // max(1, count))) if seed else 0
    starts = [min(room, round(i * room / max(1, count)) + shift) for i in range(count)]
    return [tokens[s: s + length] for s in starts]


@dataclasses.dataclass(frozen=True)
class Sample:
    """One training sample: ``ids[:context]`` is the context, ``ids[context:]`` the question/answer tail."""

    ids: tuple[int, ...]
    context: int
    kind: str
    needle_starts: tuple[int, ...]


def _passkey(rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
    n = rng.randint(1, 3)
    needles, qas = [], []
    for i in range(n):
        key = str(rng.randint(10000, 99999))
        ordinal = ORDINALS[i] if n > 1 else "secret"
        needles.append(PASSKEY_NEEDLE.format(ordinal=ordinal, key=key))
        qas.append(PASSKEY_QA.format(ordinal=ordinal, key=key))
    return PASSKEY_INTRO, list(zip(needles, qas))


def _key_value(rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
    n = rng.randint(3, 6)
    names = rng.sample([f"{a}-{b}" for a in WORDS for b in WORDS if a != b], n)
    pairs = []
    for name in names:
        value = str(rng.randint(100000, 999999))
        pairs.append((KV_NEEDLE.format(name=name, value=value), KV_QA.format(name=name, value=value)))
    return KV_INTRO, pairs


KINDS = ("passkey", "key-value", "text")


def retrieval_samples(tokenizer: Any, tokens: list[int], count: int, context: int, tail: int,
                      seed: int = 0, kinds: tuple[str, ...] = ("passkey", "key-value")) -> list[Sample]:
    """``count`` samples of exactly ``context + tail`` tokens, cycling through ``kinds``.

    Args:
        tokenizer: a Hugging Face tokenizer (only ``tokenizer(text).input_ids`` is used).
        tokens: haystack token stream (normally ``split_tokens(tokenizer, "train")``).
        count, context, tail: number of samples, context tokens and tail tokens per sample.
        seed: everything (offsets, keys, depths, question order) follows ``random.Random(seed)``.
        kinds: ``passkey``, ``key-value`` (retrieval, see the module docstring) and ``text`` (a
            window of documentation whose tail is simply the next ``tail`` tokens).
    """
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"sample kinds must be some of {KINDS}, got {kinds}")
    rng = random.Random(seed)
    out = []
    for i in range(count):
        kind = kinds[i % len(kinds)]
        if kind == "text":
            start = rng.randrange(0, len(tokens) - context - tail)
            out.append(Sample(tuple(tokens[start: start + context + tail]), context, kind, ()))
            continue
        intro, pairs = (_passkey if kind == "passkey" else _key_value)(rng)
        intro_ids = encode(tokenizer, intro)
        needle_ids = [encode(tokenizer, n) for n, _ in pairs]
        room = context - len(intro_ids) - sum(len(n) for n in needle_ids)
        if room < 16:
            raise ValueError(f"context {context} is too short for a {kind} sample")
        start = rng.randrange(0, len(tokens) - room)
        haystack = tokens[start: start + room]
        cuts = sorted(rng.randint(int(0.05 * room), int(0.9 * room)) for _ in needle_ids)
        ids, starts, prev = list(intro_ids), [], 0
        for cut, needle in zip(cuts, needle_ids):
            ids += haystack[prev:cut]
            starts.append(len(ids))
            ids += needle
            prev = cut
        ids += haystack[prev:]
        assert len(ids) == context
        qa = []
        while len(qa) < tail:
            order = list(range(len(pairs)))
            rng.shuffle(order)
            for j in order:
                qa += encode(tokenizer, pairs[j][1])
        out.append(Sample(tuple(ids + qa[:tail]), context, kind, tuple(starts)))
    return out
