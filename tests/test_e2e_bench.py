"""The end-to-end decode benchmark (``kvcompress bench --model-shape``, benchmarks/e2e_decode.py) on the CPU.

A smoke run at the tiny shape (tiny context, a few steps, eager and aot_eager-compiled rows)
checks that every row is in the JSON with sane fields, that a failing row is recorded and the run
goes on, the time budget, throughput mode and the option checks.  No wall-clock time is asserted.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvcompress.cli import main
from kvcompress.evaluation import e2e
from kvcompress.evaluation.runner import static_supported

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def window_file(tmp_path):
    path = tmp_path / "window-4+16.yaml"
    path.write_text("name: window-4+16\ncompressors:\n  - window: {sinks: 4, recent: 16}\n")
    return str(path)


@pytest.fixture
def no_model_built(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model must not be built before the options are checked")

    monkeypatch.setattr(e2e, "random_model", refuse)


def test_smoke_tiny_shape_every_row_in_the_json(tmp_path, window_file, capsys):
    out = tmp_path / "e2e.json"
    # 'leank' is examples/stacks/leank.yaml, whose mask file was made for SmolLM2: its rows must fail, alone.
    rc = main(["bench", "--model-shape", "tiny", "--random-weights", "--points", "1x40", "--steps", "3",
               "--warmup", "2", "--device", "cpu", "--stack", "none", window_file, "leank", "--compile",
               "--json", str(out), "--markdown", "--quiet"])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "| transformers StaticCache + compile | 1x40 |" in stdout and f"wrote {out}" in stdout
    obj = json.loads(out.read_text())
    assert obj["schema"] == "kvcompress.e2e/1" and obj["mode"] == "latency" and obj["complete"]
    assert obj["settings"]["points"] == ["1x40"] and obj["settings"]["compile_options"] == {
        "backend": "aot_eager", "fullgraph": True}
    assert obj["model"]["layers"] == 2 and obj["model"]["head_dim"] == 16
    assert set(obj["environment"]) >= {"date", "torch", "transformers", "gpu", "device"}
    labels = [r["label"] for r in obj["rows"]]
    assert labels == ["transformers DynamicCache", "transformers StaticCache + compile", "none", "none static",
                      "none + compile", "window-4+16", "window-4+16 static", "window-4+16 + compile", "leank50",
                      "leank50 static", "leank50 + compile"]
    rows = {r["label"]: r for r in obj["rows"]}
    dense = (40 + 2 + 3 + 5) * 2 * 2 * 16 * 2 * 2  # tokens x layers x kv heads x head_dim x (K, V) x bf16
    ok = ["transformers DynamicCache", "transformers StaticCache + compile", "none", "window-4+16"]
    if static_supported():
        ok += ["none static", "none + compile", "window-4+16 static", "window-4+16 + compile"]
    for label in ok:
        r = rows[label]
        assert r["error"] is None, (label, r["traceback"])
        assert len(r["step_ms"]) == 3 and all(t > 0 for t in r["step_ms"]) and r["wall_ms"] > 0
        assert r["gpu_busy_ms"] is None and r["peak_bytes"] is None  # CPU: no profiler kernels, no allocator peak
        assert r["cache_bytes"] > 0 and r["dense_bytes"] == dense and r["prefill_s"] >= 0
        if r["compiled"]:
            assert r["compile_s"] > 0 and 1 <= r["graphs"] <= 2 and r["recompiles"] == r["graphs"] - 1
            assert r["capacity"] == 50 and r["cudagraph_skips"] == 0
        else:
            assert r["compile_s"] is None and r["graphs"] is None
    assert rows["transformers DynamicCache"]["cache_bytes"] == dense  # plain: exactly the keys and values
    assert rows["transformers StaticCache + compile"]["cache_bytes"] == dense  # sized to the capacity
    assert rows["transformers StaticCache + compile"]["graphs"] == 1
    assert rows["window-4+16"]["cache_bytes"] < rows["none"]["cache_bytes"]
    for label in ("leank50", "leank50 static", "leank50 + compile"):
        assert "MaskFileError" in rows[label]["error"] and rows[label]["wall_ms"] is None
    assert "MaskFileError" in stdout  # the failure is in the table
    assert e2e.load_result(out).table(markdown=True) in stdout  # the JSON re-renders the printed table


def test_time_budget_skips_rows_and_keeps_them_listed():
    model = e2e.random_model("tiny", "cpu", torch.float32)
    stacks = e2e.resolve_stacks(["none"], model)
    seen = []
    result = e2e.run(model, stacks, shape="tiny", points=[(1, 16), (2, 16)], steps=1, warmup=0, time_budget=0.0,
                     on_row=lambda r: seen.append(len(r.rows)), progress=False)
    assert [r["label"] for r in result.rows] == ["transformers DynamicCache", "none"] * 2
    assert result.rows[0]["error"] is None  # the first row always runs
    assert all(r["error"].startswith("skipped: time budget") for r in result.rows[1:])
    assert seen == [1, 2, 3, 4, 4] and result.complete  # JSON rewritten after every row, then once complete
    assert "skipped: time budget" in result.table(markdown=True)


def test_interleaved_rounds_time_eager_rows_together(window_file):
    """--rounds R: the eager rows of a point (plain, every stack's dynamic cache and static cache run eagerly)
    prefill once and are timed in R rounds of --steps steps each; the compiled rows still run alone after them.
    Each interleaved row's cache holds what the same row measured alone holds (same prompt, same steps)."""
    model = e2e.random_model("tiny", "cpu", torch.float32)
    stacks = e2e.resolve_stacks(["none", window_file], model)
    compile = static_supported()
    result = e2e.run(model, stacks, shape="tiny", points=[(2, 40)], steps=2, warmup=1, rounds=3, compile=compile,
                     progress=False)
    specs = e2e.row_specs(stacks, compile=compile)
    eager = [s for s in specs if not s.compiled]
    assert [r["label"] for r in result.rows] == [s.label for s in eager + [s for s in specs if s.compiled]]
    assert result.settings["interleaved_rounds"] == 3 and len(eager) == (5 if compile else 3)
    for spec, row in zip(eager, result.rows):
        assert row["error"] is None, row["traceback"]
        assert len(row["step_ms"]) == 6 and len(row["round_ms"]) == 3 and row["rounds"] == 3
        alone = e2e.measure_row(model, spec, 2, 40, steps=6, warmup=1, profile_steps=5)
        assert alone["error"] is None and alone["cache_bytes"] == row["cache_bytes"], spec.label
    for row in result.rows[len(eager):]:
        assert row["error"] is None and "round_ms" not in row


def test_throughput_mode_picks_the_batch_from_the_budget(tmp_path, capsys):
    out = tmp_path / "tput.json"
    rc = main(["bench", "--model-shape", "tiny", "--random-weights", "--throughput", "--kv-gib", "0.0001",
               "--ctx", "32", "--steps", "2", "--warmup", "1", "--max-batch", "6", "--device", "cpu",
               "--json", str(out), "--quiet"])
    assert rc == 0
    obj = json.loads(out.read_text())
    assert obj["mode"] == "throughput" and obj["settings"]["kv_gib"] == 0.0001
    (row,) = obj["rows"]
    assert row["label"] == "transformers StaticCache + compile" and row["error"] is None, row["traceback"]
    per_token = 2 * 2 * 16 * 2 * 2
    assert row["bytes_per_seq"] == (32 + 1) * per_token  # the sizing cache holds context + 1 tokens
    assert row["batch"] == min(6, int(0.0001 * 2**30 // row["bytes_per_seq"]))
    assert row["decode_tok_s"] > 0 and row["cache_bytes"] == row["batch"] * (32 + 1 + 2) * per_token
    assert "decode tok/s" in capsys.readouterr().out


def test_throughput_without_baseline_runs_only_the_stacks(tmp_path):
    out = tmp_path / "tput.json"
    rc = main(["bench", "--model-shape", "tiny", "--random-weights", "--throughput", "--kv-gib", "0.0001",
               "--ctx", "32", "--steps", "2", "--warmup", "1", "--max-batch", "6", "--device", "cpu",
               "--stack", "kivi2", "--no-baseline", "--json", str(out), "--quiet"])
    assert rc == 0
    obj = json.loads(out.read_text())
    assert obj["settings"]["baseline"] is False
    assert [r["label"] for r in obj["rows"]] == ["kivi2 + compile"]
    assert obj["rows"][0]["error"] is None and obj["rows"][0]["batch"] >= 1


def test_throughput_fill_rows_repeats_prefilled_rows_to_the_same_cache(tmp_path):
    """--fill-rows 2 prefills two prompts and repeats their rows over a batch of 5 (not a multiple): transformers'
    StaticCache and a kvcompress stack end with the cache bytes of a batch of 5 prefilled whole."""
    rows = {}
    for fill in ("0", "2"):
        out = tmp_path / f"tput{fill}.json"
        rc = main(["bench", "--model-shape", "tiny", "--random-weights", "--throughput", "--kv-gib", "0.0001",
                   "--ctx", "32", "--steps", "2", "--warmup", "1", "--max-batch", "5", "--device", "cpu",
                   "--stack", "kivi2", "--fill-rows", fill, "--json", str(out), "--quiet"])
        assert rc == 0
        rows[fill] = json.loads(out.read_text())["rows"]
    for whole, filled in zip(rows["0"], rows["2"]):
        assert whole["error"] is None and filled["error"] is None, filled["traceback"]
        assert filled["batch"] == whole["batch"] == 5 and filled["prefilled_rows"] == 2
        assert filled["cache_bytes"] == whole["cache_bytes"] and filled["decode_tok_s"] > 0


def test_builtin_stacks_resolve_and_run_on_a_random_model():
    """Every built-in benchmark stack needs no calibration file of a particular model (head_dim 128 as
    Llama-3-8B; the low-rank stacks get a random basis made for the model)."""
    model = e2e.random_model("tiny", "cpu", torch.float32, head_dim=128, hidden_size=128, num_attention_heads=2,
                             num_key_value_heads=1)
    stacks = e2e.resolve_stacks(["builtin"], model)
    assert [s.label for s in stacks] == list(e2e.BUILTIN_STACKS)
    for st in [s for s in stacks if s.label in ("kivi2", "lowrank32-random", "ds-shared-random-1024")]:
        row = e2e.measure_row(model, e2e.RowSpec("eager", st.label, st), 1, 1100, steps=1, warmup=0,
                              profile_steps=0)
        assert row["error"] is None, (st.label, row["traceback"])


@pytest.mark.parametrize("argv,needle", [
    (["--model-shape", "tiny"], "--random-weights: expected given with --model-shape"),
    (["--model-shape", "huge", "--random-weights"], "--model-shape: expected one of llama3-8b, tiny, got 'huge'"),
    (["--model-shape", "tiny", "--random-weights", "--points", "1x"], "--points: expected comma-separated"),
    (["--model-shape", "tiny", "--random-weights", "--stack", "nosuch"], "--stack: expected a YAML stack file"),
    (["--model-shape", "tiny", "--random-weights", "--context", "64"], "--context: expected not given"),
    (["--model-shape", "tiny", "--random-weights", "--no-eager"], "--no-eager: expected used together with"),
    (["--model-shape", "tiny", "--random-weights", "--model", "x"], "--model: expected not given"),
    (["--random-weights"], "--random-weights: expected used together with --model-shape"),
    (["--throughput"], "--throughput: expected used together with --model-shape"),
    (["--model-shape", "tiny", "--random-weights", "--no-baseline"], "--no-baseline: expected used together with "
     "--throughput"),
    (["--no-baseline"], "--no-baseline: expected used together with --model-shape"),
    (["--model-shape", "tiny", "--random-weights", "--fill-rows", "2"], "--fill-rows: expected used together with "
     "--throughput"),
    (["--model-shape", "tiny", "--random-weights", "--throughput", "--rounds", "2"], "--rounds: expected an integer "
     "in [1, 64] without --throughput"),
    (["--model-shape", "tiny", "--random-weights", "--throughput", "--fill-rows", "-1"], "--fill-rows: expected an "
     "integer in [0, 65536], got -1"),
])
def test_options_are_checked_before_the_model_is_built(no_model_built, capsys, argv, needle):
    assert main(["bench", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_parse_points():
    assert e2e.parse_points("1x32768,8x16384") == [(1, 32768), (8, 16384)]
    assert e2e.parse_points(" 2X64 ") == [(2, 64)]


def test_script_forwards_to_the_cli():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks/e2e_decode.py"), "--model-shape", "huge"],
                         capture_output=True, text=True)
    assert res.returncode == 2 and "--model-shape: expected one of llama3-8b, tiny, got 'huge'" in res.stderr


def test_kernel_time_sums_cuda_kernels_only():
    """GPU-busy time: the CUDA kernels of a profiler run; CPU ops and memory copies/sets are not counted."""
    import types

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(name, device_type, us):
        return types.SimpleNamespace(name=name, device_type=device_type, self_device_time_total=us)

    prof = types.SimpleNamespace(events=lambda: [ev("sm90_gemm", cuda, 1500.0), ev("Memcpy HtoD (Pageable)", cuda, 90.0),
                                                 ev("aten::mm", cpu, 0.0), ev("Memset (Device)", cuda, 3.0),
                                                 ev("softmax_kernel", cuda, 500.0)])
    assert e2e.kernel_time(prof) == (2.0, 2)
