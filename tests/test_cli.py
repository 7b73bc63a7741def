import subprocess
import sys
from pathlib import Path

from kvcompress.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_validate_ok_and_error(tmp_path, capsys):
    assert main(["validate", str(ROOT / "examples/stacks/window.yaml")]) == 0
    assert "valid stack (window)" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("compressors:\n  - window: {recent: -5}\n")
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "compressors[0].window.recent" in err and "got -5" in err


def test_plugins_lists_axis_and_source(capsys):
    assert main(["plugins", "--all"]) == 0
    out = capsys.readouterr().out
    assert "window" in out and "evict" in out and "built-in" in out and "recent (default 1024" in out


def test_console_script_is_installed():
    res = subprocess.run([sys.executable, "-m", "kvcompress.cli", "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "generate" in res.stdout and "validate" in res.stdout


def test_generate_compile_matches_eager(monkeypatch, tmp_path, capsys):
    """``generate --compile``: a static cache and one compiled decode step (kvcompress' step loop; on the CPU
    aot_eager, on CUDA replayed by GraphStep); greedy tokens equal the eager ``model.generate`` run's (tiny
    model, fp32, a window that evicts)."""
    import kvcompress.models
    from kvcompress.evaluation.runner import static_supported
    from models import tiny_model
    from test_eval_cli import ByteTokenizer
    from torch._dynamo.utils import counters

    if not static_supported():
        import pytest

        pytest.skip("no static kvcompress cache (max_cache_len) yet")
    model = tiny_model("llama")
    monkeypatch.setattr(kvcompress.models, "load_model",
                        lambda name=None, dtype=None, device=None: (model, ByteTokenizer()))
    stack = tmp_path / "w.yaml"
    stack.write_text("compressors:\n  - window: {sinks: 4, recent: 16}\n")
    argv = ["generate", "--stack", str(stack), "--max-new-tokens", "40", "--dtype", "float32", "--report",
            "the quick brown fox"]
    assert main(argv) == 0
    eager = capsys.readouterr().out
    graphs = counters["stats"]["unique_graphs"]
    assert main([*argv, "--compile"]) == 0
    compiled = capsys.readouterr().out
    assert counters["stats"]["unique_graphs"] > graphs  # the decode step really was compiled
    text = lambda out: out.split("\nKV cache memory")[0]  # noqa: E731
    assert text(compiled) == text(eager) and len(text(eager).strip()) > 0
