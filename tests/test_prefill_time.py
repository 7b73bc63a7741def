"""benchmarks/prefill_time.py on a one-layer random Llama: a row per stack, timed against the empty stack, the
profile of the stack asked for, and clear errors for bad arguments before a model is built."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def prefill_time():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import prefill_time
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return prefill_time


def test_rows_table_and_profile(prefill_time, tmp_path, capsys):
    out = tmp_path / "prefill.json"
    window = str(ROOT / "examples/stacks/window-4+124.yaml")
    assert prefill_time.main(["--stack", "none", "kivi2", window, "--prompt", "300", "--chunk", "128", "--layers",
                              "1", "--profile", "kivi2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["stack"] for r in data["rows"]] == ["none", "kivi2", window]
    assert all(r["seconds"] > 0 for r in data["rows"])
    assert (data["prompt"], data["chunk"], data["layers"]) == (300, 128, 1)
    captured = capsys.readouterr()
    assert "| none | " in captured.out and "| 1.00x |" in captured.out and "| kivi2 | " in captured.out
    assert "cumulative" in captured.err and "kvcompress_attention" in captured.err  # kivi2's profile


@pytest.mark.parametrize("args,message", [
    (["--stack", "no-such-stack"], "--stack: expected a name of kvcompress bench's stacks"),
    (["--chunk", "0"], "--chunk: expected a positive integer, got 0"),
    (["--stack", "none", "--profile", "kivi2"], "--profile: expected one of the --stack names (none), got 'kivi2'"),
])
def test_bad_arguments_are_named(prefill_time, args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        prefill_time.main(args)
    text = str(exc.value.code) + capsys.readouterr().err
    assert message in text
