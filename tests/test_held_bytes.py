"""benchmarks/held_bytes.py on the default model: a ring holds the same bytes at every step, the empty stack at
most an eighth (the growth rule's slack) more than the dense cache of the same tokens."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_held_bytes_per_step(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import held_bytes
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    out = tmp_path / "held.json"
    stacks = [str(ROOT / "examples/stacks/window.yaml"), str(ROOT / "examples/stacks/none.yaml")]
    # a 600-token prompt (the default 2048 took 25 s of the CI machine; session 59)
    assert held_bytes.main([*stacks, "--prompt", "600", "--steps", "3", "--at", "1,3", "--json", str(out)]) == 0
    window, none = json.loads(out.read_text())["rows"]
    assert len(window["held_per_step"]) == len(none["dense_per_step"]) == 4  # after the prompt, then each step
    assert len(set(window["held_per_step"])) == 1  # 4 sinks + 252 recent: the ring never grows
    assert window["tokens_after_prompt"] == 600
    assert 256 / 600 < window["after_prompt_x_dense"] < 256 / 600 + 0.01  # 256 of 600 tokens, plus per-slot positions
    #                                                                       and flags
    dense = none["dense_per_step"]
    assert dense[1] > dense[0] and all(1.0 <= h / d <= 1.125 + 0.01 for h, d in zip(none["held_per_step"], dense))
    table = capsys.readouterr().out
    assert "| window-4+252 | " in table and "| none | " in table
