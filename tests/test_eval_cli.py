"""``kvcompress eval`` and ``kvcompress bench``: input validation, JSON schema, sweep plot, bench tables."""

import json
import sys
import types
from pathlib import Path

import pytest

import kvcompress
from kvcompress.cli import main

ROOT = Path(__file__).resolve().parents[1]
WINDOW = str(ROOT / "examples/stacks/window.yaml")
NONE = str(ROOT / "examples/stacks/none.yaml")


@pytest.fixture
def no_model(monkeypatch):
    """Fail loudly if a command loads a model."""
    import kvcompress.models

    def refuse(*args, **kwargs):
        raise AssertionError("the model must not be loaded before the inputs are validated")

    monkeypatch.setattr(kvcompress.models, "load_model", refuse)


@pytest.fixture
def fixture_model(monkeypatch, default_model):
    """The CLI gets the session's already loaded default model (float32) instead of loading it again."""
    import kvcompress.models

    calls = []

    def load(name=None, dtype=None, device=None):
        calls.append((name, dtype, device))
        return default_model

    monkeypatch.setattr(kvcompress.models, "load_model", load)
    return calls


@pytest.fixture
def tiny_window(tmp_path):
    path = tmp_path / "window-tiny.yaml"
    path.write_text("name: window-4+16\ncompressors:\n  - window: {sinks: 4, recent: 16}\n")
    return str(path)


@pytest.mark.parametrize("argv,needle", [
    (["eval", "--stack", WINDOW], "--task: expected one of ppl, passkey, agreement, got None. the option is required"),
    (["eval", "--stack", WINDOW, "--task", "rouge"], "--task: expected one of ppl, passkey, agreement, got 'rouge'"),
    (["eval", "--stack", WINDOW, "--task", "ppl", "--context", "0"],
     "--context: expected an integer in [16, 131072] (tokens), got 0"),
    (["eval", "--stack", WINDOW, "--task", "passkey", "--samples", "-1"],
     "--samples: expected an integer in [1, 10000], got -1"),
    (["eval", "--stack", WINDOW, "--task", "agreement", "--tokens", "0"], "--tokens: expected an integer"),
    (["eval", "--stack", WINDOW, "--task", "ppl", "--plot", "x.png"], "--plot: expected used together with --sweep"),
    (["bench", "--context", "0"], "--context: expected an integer in [1, 131072], got 0"),
])
def test_inputs_are_validated_before_the_model_loads(no_model, capsys, argv, needle):
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_invalid_stack_is_reported_before_the_model_loads(no_model, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("compressors:\n  - window: {recent: 0}\n")
    assert main(["eval", "--sweep", WINDOW, str(bad), "--task", "ppl"]) == 2
    assert "compressors[0].window.recent" in capsys.readouterr().err
    assert main(["bench", "--stack", str(bad)]) == 2


@pytest.mark.model
def test_eval_json_schema(fixture_model, tmp_path, capsys):
    out = tmp_path / "ppl.json"
    rc = main(["eval", "--stack", WINDOW, "--task", "ppl", "--context", "128", "--tokens", "4", "--json", str(out),
               "--quiet"])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "perplexity" in stdout and "window-4+252" in stdout and f"wrote {out}" in stdout
    assert fixture_model and fixture_model[0][0] is None  # the default model was asked for
    obj = json.loads(out.read_text())
    required = {
        "schema": str, "task": str, "stack": dict, "stack_label": str, "model": str, "dtype": str, "context": int,
        "samples": int, "tokens": int, "metrics": dict, "baseline": dict, "cache_bytes": int, "dense_bytes": int,
        "compression": float, "baseline_cache_bytes": int, "wall_s": float, "baseline_wall_s": float,
        "details": list, "notes": list, "environment": dict,
    }
    for key, typ in required.items():
        assert isinstance(obj[key], typ), key
    assert obj["schema"] == "kvcompress.eval/1" and obj["task"] == "ppl" and obj["model"] == "SmolLM2-135M-Instruct"
    assert (obj["context"], obj["samples"], obj["tokens"]) == (128, 1, 4)
    assert obj["stack"] == kvcompress.load_stack(WINDOW).to_dict()
    assert set(obj["metrics"]) >= {"ppl", "delta_ppl", "kl", "top1"} and set(obj["baseline"]) >= {"ppl"}
    assert obj["compression"] == pytest.approx(obj["dense_bytes"] / obj["cache_bytes"])
    assert obj["dense_bytes"] == 128 * 30 * 3 * 64 * 2 * 2
    assert set(obj["environment"]) >= {"date", "machine", "cpu", "device", "torch", "transformers", "python"}
    assert obj["environment"]["transformers"]


@pytest.mark.model
def test_sweep_table_plot_and_json(fixture_model, tmp_path, tiny_window, capsys):
    plot, out = tmp_path / "sweep.png", tmp_path / "sweep.json"
    rc = main(["eval", "--sweep", NONE, tiny_window, "--task", "agreement", "--context", "64", "--samples", "1",
               "--tokens", "4", "--plot", str(plot), "--json", str(out), "--quiet"])
    assert rc == 0
    stdout = capsys.readouterr().out
    lines = stdout.splitlines()
    assert any(line.startswith("uncompressed (transformers)") for line in lines)
    assert any(line.startswith("window-4+16") for line in lines) and any(line.startswith("none ") for line in lines)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    obj = json.loads(out.read_text())
    assert obj["schema"] == "kvcompress.sweep/1" and [r["stack_label"] for r in obj["runs"]] == ["none", "window-4+16"]
    assert [r["baseline_reused"] for r in obj["runs"]] == [False, True]  # the baseline ran once
    assert obj["runs"][0]["metrics"]["agreement"] == 1.0
    from kvcompress.evaluation.sweep import load_sweep, plot_sweep

    again = load_sweep(out)  # the JSON round-trips into results that can be re-plotted
    assert [r.to_dict()["metrics"] for r in again] == [r["metrics"] for r in obj["runs"]]
    assert plot_sweep(again, tmp_path / "again.png")


def test_plot_from_results_without_a_model(tmp_path):
    from kvcompress.evaluation.runner import EvalResult, EvalSettings
    from kvcompress.evaluation.sweep import plot_sweep, sweep_table

    settings = EvalSettings.for_task("ppl", 2048, 1, 256)

    def result(label, ppl, held):
        return EvalResult(settings, {"compressors": []}, label, "<stack>", "m", "bfloat16",
                          {"ppl": ppl, "delta_ppl": ppl / 10 - 1, "kl": 0.1, "top1": 0.9}, {
                              "ppl": 10.0, "delta_ppl": 0.0, "kl": 0.0, "top1": 1.0},
                          held, 1000, 1000, 1.0, 1.0, False, [], [], {})

    results = [result("window-4+252", 12.0, 125), result("window-0+256", 30.0, 125), result("window-4+1020", 10.5, 500)]
    path = plot_sweep(results, tmp_path / "p.png")
    assert Path(path).read_bytes()[:4] == b"\x89PNG"
    table = sweep_table(results)
    assert "8.00x" in table and "+20.00%" in table and "uncompressed (transformers)" in table


@pytest.mark.model
def test_bench_reports_latency_memory_and_overhead(fixture_model, tmp_path, tiny_window, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "--stack", NONE, tiny_window, "--context", "64", "--steps", "3", "--rounds", "1",
               "--json", str(out), "--quiet", "--markdown"])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "| transformers DynamicCache |" in stdout and "overhead = attend - SDPA" in stdout
    obj = json.loads(out.read_text())
    plain, none, window = obj["rows"]
    assert plain["stack"] is None and plain["overhead_ms_per_step"] is None
    assert len(plain["step_ms"]) == 3 and all(t > 0 for t in plain["step_ms"])
    for row in (none, window):
        b = row["overhead_ms_per_step"]
        assert set(b) == {"attend", "sdpa", "read", "commit", "flush", "select", "overhead"}
        assert b["attend"] > 0 and b["sdpa"] > 0 and b["overhead"] == pytest.approx(b["attend"] - b["sdpa"])
    assert window["overhead_ms_per_step"]["flush"] > 0  # the window evicts every step
    assert window["cache_bytes"] < none["cache_bytes"]
    assert obj["device"] == "cpu" and plain["peak_bytes"] is None  # no allocator peak on the CPU


def test_bench_probe_restores_the_cache_objects(default_model):
    """The overhead probe wraps instance attributes only and removes them."""
    from kvcompress.evaluation.bench import _Probe

    model, _ = default_model
    cache = kvcompress.Cache(kvcompress.parse_stack({"compressors": [{"window": {"recent": 8}}]}), model)
    layer = cache.compressed_layers[0]
    cls_attend, cls_flush = type(layer).attend, type(cache.pipeline).flush
    probe = _Probe(cache, lambda: None)
    probe.install()
    assert "attend" in vars(layer) and "flush" in vars(cache.pipeline)
    assert type(layer).attend is cls_attend and type(cache.pipeline).flush is cls_flush  # classes untouched
    probe.remove()
    assert "attend" not in vars(layer) and "commit" not in vars(layer) and "flush" not in vars(cache.pipeline)
    other = kvcompress.Cache(kvcompress.parse_stack({"compressors": []}), model)
    assert "attend" not in vars(other.compressed_layers[0])


def test_bench_kernels_unavailable(no_model, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "kvcompress.kernels.benchutil", None)
    assert main(["bench", "--kernels", "--device", "cpu"]) == 1
    assert "kernel benchmarks are not available" in capsys.readouterr().err


def test_bench_kernels_calls_benchutil(no_model, monkeypatch, capsys, tmp_path):
    calls = []
    fake = types.ModuleType("kvcompress.kernels.benchutil")

    def run_kernel_benchmarks(device, out):
        calls.append((device, out))
        return "kernel table"

    fake.run_kernel_benchmarks = run_kernel_benchmarks
    monkeypatch.setitem(sys.modules, "kvcompress.kernels.benchutil", fake)
    out = str(tmp_path / "k.json")
    assert main(["bench", "--kernels", "--device", "cpu", "--kernels-out", out]) == 0
    assert calls == [("cpu", out)] and "kernel table" in capsys.readouterr().out


# ----------------------------------------------------------------------------- --compile (tiny model, no download)


class ByteTokenizer:
    """A tokenizer for tests/models.py's tiny models (vocabulary 256): one token per UTF-8 byte."""

    pad_token_id = 0
    eos_token_id = None
    chat_template = None

    def __call__(self, text, add_special_tokens=False, return_tensors=None):
        ids = [b or 1 for b in text.encode("utf-8")]
        if return_tensors == "pt":
            import torch

            t = torch.tensor([ids])
            return {"input_ids": t, "attention_mask": torch.ones_like(t)}
        return types.SimpleNamespace(input_ids=ids)

    def decode(self, ids, skip_special_tokens=True):
        return bytes(int(i) for i in ids).decode("utf-8", "replace")


@pytest.fixture
def tiny_cli_model(monkeypatch):
    """The CLI gets tests/models.py's tiny llama (float32) and a byte tokenizer instead of the default model."""
    import kvcompress.models
    from models import tiny_model

    model, tok = tiny_model("llama"), ByteTokenizer()
    monkeypatch.setattr(kvcompress.models, "load_model", lambda name=None, dtype=None, device=None: (model, tok))
    return model


def _static_supported():
    from kvcompress.evaluation.runner import static_supported

    return static_supported()


needs_static = pytest.mark.skipif(not _static_supported(), reason="no static kvcompress cache (max_cache_len) yet")

TINY_KIVI = "name: kivi2-g16\ncompressors:\n  - kivi: {bits: 2, group: 16, residual: 16}\n"


@needs_static
@pytest.mark.parametrize("stack", ["window", "kivi"])
def test_eval_compile_equals_eager(tiny_cli_model, tmp_path, tiny_window, stack):
    """ppl through the static cache + aot_eager-compiled decode step equals the eager run (fp32), across
    the window's evictions and KIVI's group flushes (40 decode steps after a 64-token prefill)."""
    path = tiny_window
    if stack == "kivi":
        path = tmp_path / "kivi.yaml"
        path.write_text(TINY_KIVI)
    samples = 2 if stack == "window" else 1  # two samples share one compiled step
    argv = ["eval", "--stack", str(path), "--task", "ppl", "--context", "64", "--tokens", "40", "--samples",
            str(samples), "--dtype", "float32", "--device", "cpu", "--quiet", "--json"]
    assert main([*argv, str(tmp_path / "eager.json")]) == 0
    assert main([*argv, str(tmp_path / "compiled.json"), "--compile"]) == 0
    eager = json.loads((tmp_path / "eager.json").read_text())
    compiled = json.loads((tmp_path / "compiled.json").read_text())
    assert eager["compile"] is None and compiled["compile"] == {"backend": "aot_eager", "fullgraph": True}
    assert compiled["baseline"] == eager["baseline"]  # the baseline is plain eager transformers either way
    m, e = compiled["metrics"], eager["metrics"]
    assert m["scored_tokens"] == e["scored_tokens"] == 40 * samples
    assert m["ppl"] == pytest.approx(e["ppl"], rel=1e-5) and m["kl"] == pytest.approx(e["kl"], abs=1e-6)
    assert m["top1"] == e["top1"] and e["kl"] > 1e-4  # the stack really compresses
    for a, b in zip(compiled["details"], eager["details"]):
        assert a["ppl"] == pytest.approx(b["ppl"], rel=1e-5)


@needs_static
def test_bench_compile_adds_compiled_rows(tiny_cli_model, tmp_path, tiny_window, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--stack", tiny_window, "--context", "64", "--steps", "3", "--rounds", "1", "--compile",
                 "--device", "cpu", "--json", str(out), "--quiet"]) == 0
    assert "'+ compile' rows: static cache" in capsys.readouterr().out
    obj = json.loads(out.read_text())
    assert obj["compile"] == {"backend": "aot_eager", "fullgraph": True}
    rows = {r["label"]: r for r in obj["rows"]}
    assert list(rows) == ["transformers DynamicCache", "transformers StaticCache + compile", "window-4+16",
                          "window-4+16 + compile"]
    for label, r in rows.items():
        assert len(r["step_ms"]) == 3 and r["cache_bytes"] > 0
        assert r["compiled"] == label.endswith("+ compile")
        assert (r["warmup_s"] is not None) == r["compiled"]
        assert (r["overhead_ms_per_step"] is not None) == (label == "window-4+16")  # compiled rows: no probe


def test_compile_without_a_static_cache_is_refused_before_loading(no_model, monkeypatch, tiny_window, capsys):
    import kvcompress.evaluation.runner as runner

    monkeypatch.setattr(runner, "static_supported", lambda: False)
    for argv in (["eval", "--stack", tiny_window, "--task", "ppl", "--compile"],
                 ["bench", "--stack", tiny_window, "--compile"],
                 ["generate", "--compile", "hello"]):
        assert main(argv) == 2
        assert "--compile needs kvcompress' static-capacity cache" in capsys.readouterr().err
