"""Tensor parallelism (transformers' ``tp_plan="auto"`` under torchrun, 2 ranks, gloo on the CPU) and multi-device
placement.

One torchrun launch for the module (tests/tp_worker.py) runs every built-in stack, alone and stacked, on two tiny
random models whose 4 KV heads split 2 + 2 (llama and qwen2, 8 query heads), with calibration files made here for
each model: LeanK masks with different kept counts per head, low-rank bases with different ranks per head,
DoubleSparse label channels.  Each stack's 64 teacher-forced decode steps must give the logits of the same stack in
one process (fp32, 1e-4); the memory report summed over the ranks must give the single-process dense size and the
single-process bytes plus the per-row bookkeeping every rank repeats; files for another head split or another model
must be refused naming the file, the model and the split.

The models have one decoder layer: the K/V a cache stores are then bit-identical in both runs (the embedding's
all-reduce adds zeros, the key/value projections are split by output rows).  Past the first layer they are not:
the row-split output projections sum their partial products across ranks in another order than one process does,
and a quantizer's code sitting on a rounding boundary can flip - measured with two layers: window + KIVI-2 on llama
differed by 2.0e-4 and KIVI-4 on qwen2 by 6.0e-5 from step 1, while every stack without a quantizer (paged_eviction
included) stayed within 1.5e-6.  A flipped code is the model's arithmetic, not a different decision of kvcompress;
the one-layer models keep the comparison exact for every stack.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).parent / "tp_worker.py"
PROMPT, STEPS, TOL = 150, 64, 1e-4
#: decoder layers of the matrix' models: one, so that the K/V a cache stores are bit-identical in both runs (see the
#: module docstring); tests/test_tensor_parallel.py::test_two_layers... covers a deeper model
LAYERS = 1
ARCHS = ("llama", "qwen2")


def tp_model(arch: str, layers: int = LAYERS, seed: int = 0, vocab: int = 256):
    """A tiny random model with 8 query heads and 4 KV heads (head_dim 16): 2 KV heads per rank on 2 ranks."""
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=128, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)
    if arch == "llama":
        cfg, cls = tf.LlamaConfig(head_dim=16, **common), tf.LlamaForCausalLM
    else:
        cfg, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    cfg._name_or_path = f"tiny-{arch}-tp"
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():  # sharpen the near-uniform random init, as tests/models.py does
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model.generation_config.eos_token_id = None
    return model


def calibration_files(model, arch: str, folder: Path) -> dict[str, str]:
    """A LeanK mask (kept channels 0-16 in steps of 4, differing per head), a low-rank basis (ranks 4-16 per head)
    and DoubleSparse channels (8 of 16), all made for ``model``; plus a mask sliced to 2 of its 4 heads."""
    from kvcompress.calibration.doublesparse import rank_channels, save_channels
    from kvcompress.calibration.lowrank import kv_spectra, save_basis
    from kvcompress.calibration.masks import config_hash, save_mask

    gen = torch.Generator().manual_seed(3)
    layers, heads, d = model.config.num_hidden_layers, 4, 16
    counts = torch.tensor([[16, 0, 8, 4], [12, 8, 16, 4]] * layers)[:layers]
    order = torch.rand(layers, heads, d, generator=gen).argsort(-1)
    keep = order < counts[..., None]
    meta = {"model": f"tiny-{arch}-tp", "model_config_hash": config_hash(model.config), "ratio": 0.5, "align": 4,
            "sinks": 4, "local": 16, "method": "trained", "settings": {}}
    out = {"mask": str(folder / f"{arch}-mask.safetensors"), "split_mask": str(folder / f"{arch}-mask-2of4.safetensors")}
    save_mask(out["mask"], keep, meta)
    save_mask(out["split_mask"], keep[:, :2].contiguous(), meta)
    tokens = torch.randint(1, 256, (4, 64), generator=gen)
    (eigenvalues, vectors), _ = kv_spectra(model, tokens, skip=2)
    ranks = torch.tensor([[16, 8, 12, 4], [4, 12, 8, 16]] * layers, dtype=torch.int32)[:layers]
    out["basis"] = str(folder / f"{arch}-basis.safetensors")
    save_basis(out["basis"], vectors, ranks, eigenvalues, {"model": f"tiny-{arch}-tp", "target": "test", "align": 1,
                                                           "model_config_hash": config_hash(model.config),
                                                           "settings": {}})
    scores = torch.rand(layers, heads, d, generator=gen)
    out["channels"] = str(folder / f"{arch}-channels.safetensors")
    save_channels(out["channels"], rank_channels(scores, 8), scores, model.config, f"tiny-{arch}-tp", {})
    return out


def stacks(files: dict[str, str]) -> dict[str, list]:
    def kivi(bits):
        return {"kivi": {"bits": bits, "group": 16, "residual": 16}}

    window = {"window": {"sinks": 4, "recent": 32}}
    leank = {"leank": {"mask": files["mask"], "sinks": 4, "local": 16, "flush": 16}}
    lowrank = {"lowrank": {"basis": files["basis"], "sinks": 4, "recent": 16, "flush": 16}}
    paged = {"paged_eviction": {"budget": 96, "block": 16}}
    ds = {"double_sparse": {"channels": files["channels"], "r": 8, "k": 24, "dense_layers": 0, "sinks": 4,
                            "window": 8}}
    snapkv = {"snapkv": {"ratio": 0.5, "window": 16, "sinks": 4, "recent": 16}}
    return {
        "none": [], "window": [window], "kivi2": [kivi(2)], "kivi4": [kivi(4)], "leank": [leank],
        "paged_eviction": [paged], "double_sparse": [ds], "lowrank": [lowrank],
        "snapkv": [snapkv], "knorm": [{"knorm": {"ratio": 0.5, "sinks": 4, "recent": 16}}],
        "tova": [{"tova": {"budget": 64, "sinks": 4, "recent": 8}}],
        "tova_layer": [{"tova": {"budget": 64, "sinks": 4, "recent": 8, "heads": "layer"}}],
        "expected_attention": [{"expected_attention": {"budget": 64, "sinks": 4, "recent": 8, "window": 16,
                                                       "n_future": 32, "phase": "both"}}],
        "window+kivi2": [window, kivi(2)], "leank+kivi4": [leank, kivi(4)], "lowrank+kivi2": [lowrank, kivi(2)],
        "paged_eviction+kivi2": [paged, kivi(2)], "snapkv+kivi4": [snapkv, kivi(4)],
    }


CLI_ARGS = ["generate", "a prompt long enough for a few pages of the cache " * 3, "--max-new-tokens", "24",
            "--dtype", "float32", "--raw", "--report"]
STACK_NAMES = tuple(stacks({"mask": "", "basis": "", "channels": ""}))
#: also run with a static cache (capacity preallocated): the ones whose static state differs most from the dynamic
STATIC_STACKS = tuple(n for n in ("kivi2", "paged_eviction", "tova_layer", "snapkv") if n in STACK_NAMES)
#: also decoded through a compiled step (llama): every stack with KVCOMPRESS_TEST_FULL=1 (18 stacks, 93 s of the
#: module's 177 s on the CI machine, session 57); in CI the stacks whose state is split by heads with files (LeanK
#: masks, low-rank bases, DoubleSparse channels), both KIVI widths, the page evictor and a query scorer (SnapKV), each
#: in one stack: 5 stacks, about 26 s a rank (session 59 dropped kivi2 alone - two of these stacks run its store -,
#: tova_layer and expected_attention from CI: 7 s a rank each; every built-in's compiled decode in one process:
#: tests/test_conformance.py names where each is tested)
COMPILED_STACKS = STACK_NAMES if os.environ.get("KVCOMPRESS_TEST_FULL") else tuple(
    n for n in ("leank+kivi4", "lowrank+kivi2", "paged_eviction+kivi2", "double_sparse", "snapkv+kivi4")
    if n in STACK_NAMES)
#: `kvcompress bench --model-shape tiny` under the launch (and in one process, in the test)
BENCH_ARGS = ["bench", "--model-shape", "tiny", "--random-weights", "--device", "cpu", "--dtype", "float32",
              "--compile", "--no-eager", "--stack", "kivi2", "--points", "2x300", "--steps", "2", "--warmup", "2",
              "--profile-steps", "0", "--quiet"]
#: the same in throughput mode: the largest batch whose cache fits a KV budget (per rank under torchrun), tokens/s
THROUGHPUT_ARGS = ["bench", "--model-shape", "tiny", "--random-weights", "--device", "cpu", "--dtype", "float32",
                   "--throughput", "--kv-gib", "0.001", "--ctx", "300", "--fill-rows", "2", "--steps", "2", "--warmup",
                   "2", "--stack", "kivi2", "--quiet"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """Saves the models and files, launches the worker once under torchrun (2 ranks), returns its outputs."""
    from safetensors.torch import load_file

    folder = tmp_path_factory.mktemp("tp")
    spec = {"seed": 0, "prompt": PROMPT, "steps": STEPS, "models": {}, "stacks": {}, "refused": {},
            "static": list(STATIC_STACKS), "compiled": {"llama": list(COMPILED_STACKS)}}
    files = {}
    for arch in ARCHS:
        model = tp_model(arch)
        model.save_pretrained(folder / arch)
        spec["models"][arch] = str(folder / arch)
        files[arch] = calibration_files(model, arch, folder)
        spec["stacks"][arch] = {name: {"compressors": s} for name, s in stacks(files[arch]).items()}
    for arch, other in zip(ARCHS, reversed(ARCHS)):
        mine, theirs = files[arch], files[other]
        spec["refused"][arch] = {
            "split_mask": {"compressors": [{"leank": {"mask": mine["split_mask"], "sinks": 4, "local": 16,
                                                      "flush": 16}}]},
            "other_model_basis": {"compressors": [{"lowrank": {"basis": theirs["basis"], "sinks": 4, "recent": 16,
                                                               "flush": 16}}]},
        }
    # `kvcompress generate` under the same launch: a tiny llama with the default model's tokenizer (its vocabulary)
    from transformers import AutoTokenizer

    from kvcompress.models import resolve_model_path

    tp_model("llama", vocab=49152).save_pretrained(folder / "cli-model")
    AutoTokenizer.from_pretrained(resolve_model_path(None)).save_pretrained(folder / "cli-model")
    stack_file = folder / "cli-stack.yaml"
    stack_file.write_text("compressors:\n  - paged_eviction: {budget: 48, block: 16}\n")
    spec["cli"] = CLI_ARGS + ["--model", str(folder / "cli-model"), "--stack", str(stack_file)]
    spec["cli_compiled"] = spec["cli"] + ["--compile"]
    spec["bench"] = BENCH_ARGS + ["--weights-dir", str(folder / "random-tiny"), "--json", str(folder / "bench.json")]
    spec["bench_throughput"] = THROUGHPUT_ARGS + ["--weights-dir", str(folder / "random-tiny"), "--json",
                                                  str(folder / "throughput.json")]
    cases = folder / "cases.json"
    cases.write_text(json.dumps(spec))
    out = folder / "out"
    out.mkdir()
    # PYTHONFAULTHANDLER: a worker killed by a native fault prints the Python stack it was in
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false",
               PYTHONFAULTHANDLER="1")
    for attempt in (1, 2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", str(WORKER), str(cases),
               str(out)]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        tail = f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        if proc.returncode == 0 or attempt == 2 or not _native_abort(proc.stdout + proc.stderr):
            break
        # A worker aborted inside native code (glibc's heap check `malloc(): unaligned tcache chunk detected`, in
        # two fresh-clone CI runs of sessions 19-20, each under the full suite; the module alone passed every
        # time): not a comparison of this module.  Where it happens is not known yet (PYTHONFAULTHANDLER prints the
        # worker's Python stack next time).  One relaunch; a second abort, or any other failure, fails the module.
        warnings.warn(f"tensor-parallel worker aborted natively (attempt 1 of 2), relaunching:\n{tail[-4000:]}",
                      stacklevel=1)
        for stale in out.iterdir():
            stale.unlink()
    assert proc.returncode == 0, tail
    logits, results = {}, []
    for rank in range(2):
        logits.update(load_file(out / f"logits_rank{rank}.safetensors"))
        results.append(json.loads((out / f"results_rank{rank}.json").read_text()))
    return {"logits": logits, "results": results, "files": files, "folders": spec["models"], "cli": spec["cli"],
            "cli_compiled": spec["cli_compiled"],
            "bench_json": {"bench": folder / "bench.json", "bench_throughput": folder / "throughput.json"},
            "weights": folder / "random-tiny"}


def _native_abort(output: str) -> bool:
    """torchrun's report names a worker that died of SIGABRT / SIGSEGV / SIGBUS (a fault in native code; a Python
    exception exits with 1 and is not retried)."""
    return re.search(r"exitcode\s*:\s*-(6|7|11)\b", output) is not None


def _case(tp_run, key):
    entries = [r[key] for r in tp_run["results"]]
    for rank, e in enumerate(entries):
        assert "error" not in e, f"rank {rank}: {e['error']}"
        assert "ref_error" not in e, f"rank {rank} (single-process reference): {e['ref_error']}"
    return entries


def _assert_logits_match(tp_run, tp_key, ref_key, what):
    tp, ref = tp_run["logits"][f"tp/{tp_key}"], tp_run["logits"][f"ref/{ref_key}"]
    assert tp.shape == ref.shape == (1, STEPS + 1, 256)
    diff = (tp - ref).abs().max().item()
    assert diff <= TOL, f"{what}: the 2-rank logits differ from the single-process run by {diff:.3g}"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("stack", STACK_NAMES)
def test_tensor_parallel_logits_equal_single_process(tp_run, arch, stack):
    key = f"{arch}/{stack}"
    _case(tp_run, key)
    _assert_logits_match(tp_run, key, key, key)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("stack", STATIC_STACKS)
def test_static_cache_under_tensor_parallelism_equals_single_process(tp_run, arch, stack):
    """A cache with a capacity (``compress(model, stack, max_cache_len=N)``, the graph-capturable state, run
    eagerly) on the 2-rank model gives the single-process dynamic cache's logits."""
    key = f"{arch}/{stack}"
    assert all(e["is_static"] for e in _case(tp_run, key + "@static"))
    _assert_logits_match(tp_run, key + "@static", key, f"{key}, static cache")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("stack", STACK_NAMES)
def test_summed_memory_report_is_the_whole_models(tp_run, arch, stack):
    """The collective report is the single-process report of the same stack (dynamic cache), segment by segment:
    per-head regions add up over the ranks, per-row bookkeeping (``... (rows)``: validity masks, positions, block
    tables, head-pooled scores) is the same on both ranks and counted once, and the second rank's copy of it is
    ``replicated_bytes``."""
    _check_summed_report(_case(tp_run, f"{arch}/{stack}"))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("stack", STATIC_STACKS)
def test_summed_memory_report_of_a_static_cache_is_the_whole_models(tp_run, arch, stack):
    """The same for caches with a capacity (``max_cache_len``), against the single-process static cache."""
    _check_summed_report(_case(tp_run, f"{arch}/{stack}@static"))


def _check_summed_report(entries: list[dict]) -> None:
    from kvcompress.state import ROWS

    refs = [e["ref_report"] for e in entries if "ref_report" in e]
    assert refs, [e.get("ref_error") for e in entries]
    ref = refs[0]
    local = [e["local_report"] for e in entries]
    rows = [n for n in ref["segments"] if n.endswith(ROWS)]
    assert rows and sum(ref["segments"][n] for n in rows) > 0  # the stores name their bookkeeping
    for rank, e in enumerate(entries):
        summed = e["summed_report"]
        assert summed["ranks"] == 2 and local[rank]["ranks"] == 1
        assert e["shard"] == f"tensor-parallel rank {rank} of 2 holds KV heads {2 * rank}-{2 * rank + 1} of the model's 4"
        for field in ("dense_fp16_bytes", "dense_native_bytes", "tokens", "batch"):
            assert summed[field] == ref[field], (field, summed[field], ref[field])
        # the bar: the summed report equals the single-process report
        assert summed["segments"] == ref["segments"], (summed["segments"], ref["segments"])
        # ... made of the ranks' own reports: bookkeeping held alike by both, per-head regions split between them
        for name, n in ref["segments"].items():
            mine = [r["segments"][name] for r in local]
            if name.endswith(ROWS):
                assert mine == [n, n], (name, mine, n)
            else:
                assert sum(mine) == n, (name, mine, n)
        assert summed["replicated_bytes"] == sum(ref["segments"][n] for n in rows)
    # each rank's own report is its half: the dense size of 2 of the 4 KV heads
    assert [r["dense_fp16_bytes"] * 2 for r in local] == [ref["dense_fp16_bytes"]] * 2


@pytest.mark.parametrize("arch", ARCHS)
def test_calibration_file_for_another_split_is_refused(tp_run, arch):
    for rank, results in enumerate(tp_run["results"]):
        got = results[f"refused/{arch}/split_mask"]
        msg = got["message"]
        assert msg is not None, "a mask holding 2 of the model's 4 KV heads was accepted"
        assert got["type"] == "MaskFileError"
        assert tp_run["files"][arch]["split_mask"] in msg  # the file
        assert f"tiny-{arch}-tp" in msg and "4 KV heads" in msg and "2 KV heads" in msg  # the model, the file's heads
        assert f"tensor-parallel rank {rank} of 2 holds KV heads {2 * rank}-{2 * rank + 1}" in msg  # the split


@pytest.mark.parametrize("arch", ARCHS)
def test_calibration_file_for_another_model_is_refused(tp_run, arch):
    other = next(a for a in ARCHS if a != arch)
    for rank, results in enumerate(tp_run["results"]):
        got = results[f"refused/{arch}/other_model_basis"]
        msg = got["message"]
        assert msg is not None and got["type"] == "BasisFileError"
        assert tp_run["files"][other]["basis"] in msg  # the file
        assert f"'{tp_run['folders'][arch]}' ({arch}, 1 layers, 4 KV heads" in msg  # the model given
        assert f"made for 'tiny-{other}-tp'" in msg  # the model the file was made for
        assert f"tensor-parallel rank {rank} of 2" in msg


@pytest.mark.parametrize("run", ["cli", "cli_compiled"])
def test_cli_generate_under_torchrun_prints_on_rank_0_what_one_process_prints(tp_run, monkeypatch, capsys, run):
    """``torchrun --nproc-per-node 2 -m kvcompress.cli generate ...`` (and with ``--compile``: a static cache, the
    decode steps compiled): the model is split over the ranks (tp_plan auto), rank 0 prints the continuation and the
    memory report summed over the ranks, rank 1 prints nothing; the continuation and the report's dense size are
    those of the same command in one process."""
    from kvcompress import cli

    ranks = [r[run] for r in tp_run["results"]]
    assert [r["code"] for r in ranks] == [0, 0]
    assert ranks[1]["stdout"] == ""
    tp_out = ranks[0]["stdout"]
    assert "summed over 2 tensor-parallel ranks" in tp_out
    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    assert cli.main(tp_run[run]) == 0
    single = capsys.readouterr().out
    text = lambda out: out.split("\nKV cache memory")[0]  # noqa: E731
    dense = lambda out: next(line for line in out.splitlines() if line.startswith("dense fp16"))  # noqa: E731
    assert text(tp_out) == text(single) and text(single).strip()
    assert dense(tp_out) == dense(single)


def test_cli_refuses_device_map_with_a_model_shape(capsys, monkeypatch):
    from kvcompress import cli

    code = cli.main(["bench", "--model-shape", "tiny", "--random-weights", "--device-map", "auto"])
    assert code == 2 and "--device-map: expected omitted with --model-shape" in capsys.readouterr().err
    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    code = cli.main(["bench", "--model-shape", "tiny", "--random-weights", "--weights-dir", "w"])
    assert code == 2 and "--weights-dir: expected used with --model-shape under a torchrun launch" in \
        capsys.readouterr().err


@pytest.mark.parametrize("stack", COMPILED_STACKS)
def test_compiled_decode_of_the_split_model_equals_eager_and_one_process(tp_run, stack):
    """The static cache's decode steps compiled in one graph (fullgraph, aot_eager: the CPU's compiled decode, the
    split model's collectives inside it) give the eager split model's logits, and those of the stack in one
    process (the dynamic cache, 1e-4: the issue's bar)."""
    key = f"llama/{stack}@compiled"
    for results in tp_run["results"]:
        entry = results[key]
        assert "error" not in entry, entry.get("error")
        assert 1 <= entry["graphs"] <= 2, entry  # the growing positions may recompile once, nothing else
    compiled, eager = tp_run["logits"][f"tp/{key}"], tp_run["logits"][f"tp/{key}/eager"]
    assert (compiled - eager).abs().max().item() <= 1e-5
    assert (compiled - tp_run["logits"][f"ref/llama/{stack}"]).abs().max().item() <= TOL


def _bench_under_torchrun_and_alone(tp_run, name: str, args: list, monkeypatch, tmp_path) -> tuple[dict, dict]:
    """The JSON rank 0 wrote for the launch's bench ``name`` (both ranks exited 0, rank 1 printed nothing), and the
    JSON of the same bench ``args`` in this process."""
    from kvcompress import cli

    ranks = [r[name] for r in tp_run["results"]]
    assert [r["code"] for r in ranks] == [0, 0] and ranks[1]["stdout"] == ""
    tp = json.loads(tp_run["bench_json"][name].read_text())
    for env in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(env, raising=False)
    single_json = tmp_path / "single.json"
    assert cli.main(args + ["--json", str(single_json)]) == 0
    return tp, json.loads(single_json.read_text())


def test_bench_at_a_model_shape_under_torchrun_measures_each_ranks_share(tp_run, monkeypatch, tmp_path):
    """``torchrun --nproc-per-node 2 -m kvcompress.cli bench --model-shape tiny --random-weights --compile ...``:
    rank 0 builds the random weights and writes them, both ranks load their shard (tensor parallelism) and time the
    compiled rows, rank 0 writes the JSON.  Each row holds one rank's share: transformers' StaticCache and the dense
    size exactly half of the same bench in one process, KIVI-2's cache between half and all of it (the per-row
    bookkeeping is on both ranks)."""
    assert (tp_run["weights"] / "kvcompress-random-weights.ready").exists()
    tp, single = _bench_under_torchrun_and_alone(tp_run, "bench", BENCH_ARGS, monkeypatch, tmp_path)
    assert tp["model"]["tensor_parallel"] == 2 and single["model"]["tensor_parallel"] == 1
    assert tp["model"]["kv_heads"] == single["model"]["kv_heads"] == 2
    rows = {r["kind"]: r for r in tp["rows"]}
    ones = {r["kind"]: r for r in single["rows"]}
    assert set(rows) == set(ones) == {"static", "static-eager", "compiled"}
    for kind, row in rows.items():
        assert row["error"] is None, (kind, row["error"])
        assert row["wall_ms"] > 0 and row["recompiles"] in (None, 0, 1)
        assert row["dense_bytes"] * 2 == ones[kind]["dense_bytes"]
    assert rows["static"]["cache_bytes"] * 2 == ones["static"]["cache_bytes"]
    assert ones["compiled"]["cache_bytes"] / 2 < rows["compiled"]["cache_bytes"] < ones["compiled"]["cache_bytes"]


def test_bench_throughput_under_torchrun_fits_the_budget_per_rank(tp_run, monkeypatch, tmp_path):
    """``bench --model-shape tiny --random-weights --throughput --kv-gib G`` under torchrun (the weights written by
    the latency bench of the same launch are loaded again, not rebuilt): the budget is per rank, so each rank holds
    half of a sequence's StaticCache bytes and fits about twice one process' batch in the same G; both rows decode
    that batch within the budget."""
    tp, single = _bench_under_torchrun_and_alone(tp_run, "bench_throughput", THROUGHPUT_ARGS, monkeypatch, tmp_path)
    budget = 0.001 * 2 ** 30
    rows = {r["kind"]: r for r in tp["rows"]}
    ones = {r["kind"]: r for r in single["rows"]}
    assert set(rows) == set(ones) == {"static", "compiled"}
    for kind, row in rows.items():
        assert row["error"] is None, (kind, row["error"])
        assert row["batch"] >= 1 and row["decode_tok_s"] > 0
        assert row["cache_bytes"] <= budget, (kind, row["cache_bytes"], budget)
        assert row["batch"] >= ones[kind]["batch"]
    assert rows["static"]["bytes_per_seq"] * 2 == ones["static"]["bytes_per_seq"]
    assert rows["static"]["batch"] in (2 * ones["static"]["batch"], 2 * ones["static"]["batch"] + 1)


# ----------------------------------------------------------------------------- placement over devices


def test_static_cache_allocates_each_layer_on_its_layers_device():
    """A model whose layers sit on different devices (here layer 1 on 'meta', the only second device a CPU machine
    has): a cache allocated ahead of time puts each layer's buffers on its own layer's device."""
    import kvcompress
    from kvcompress.adapters import hf

    model = tp_model("llama", layers=2)
    model.model.layers[1].to("meta")
    assert hf.layer_devices(model) == {0: torch.device("cpu"), 1: torch.device("meta")}
    stack = {"compressors": [{"kivi": {"bits": 2, "group": 16, "residual": 16}}]}
    cache = kvcompress.Cache(stack, model, max_cache_len=64, max_batch_size=1)
    devices = [{t.device for t in (core.k, core.v)} for core in cache.compressed_layers]
    assert devices == [{torch.device("cpu")}, {torch.device("meta")}]


def test_device_map_with_an_offloaded_layer_runs_stacks_like_the_plain_model(tmp_path):
    """A model loaded with an explicit ``device_map`` whose layer 1 is offloaded (accelerate's hooks run it on the
    CPU, its weights live on disk and show as 'meta'): each layer's cache lives where the layer runs - the static
    cache's buffers of layer 1 on the CPU, not on 'meta' - and the stacks give the plain model's logits."""
    from transformers import AutoModelForCausalLM

    import kvcompress
    from kvcompress.adapters import hf

    tp_model("qwen2", layers=2).save_pretrained(tmp_path / "model")
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": "cpu",
                  "model.rotary_emb": "cpu", "lm_head": "cpu"}
    mapped = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map, dtype=torch.float32,
                                                  offload_folder=tmp_path / "offload").eval()
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32).eval()
    assert mapped.model.layers[1].self_attn.k_proj.weight.device.type == "meta"
    assert hf.layer_devices(mapped) == {0: torch.device("cpu"), 1: torch.device("cpu")}
    ids = torch.randint(1, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    kivi = {"kivi": {"bits": 4, "group": 16, "residual": 16}}
    for stack, static in (({"compressors": [{"window": {"sinks": 4, "recent": 24}}, kivi]}, False),
                          ({"compressors": [kivi]}, True)):
        outs = []
        for model in (mapped, plain):
            kw = {"max_cache_len": 48, "max_batch_size": 1} if static else {}
            with kvcompress.compress(model, stack, **kw) as cache, torch.no_grad():
                if static:
                    assert [c.k.device.type for c in cache.compressed_layers] == ["cpu", "cpu"]
                logits = [model(input_ids=ids[:, :24], cache=cache).logits[:, -1]]
                for t in range(24, 40):
                    logits.append(model(input_ids=ids[:, t:t + 1], cache=cache).logits[:, -1])
            outs.append(torch.stack(logits))
        assert (outs[0] - outs[1]).abs().max().item() <= 1e-5


def test_sum_reports_counts_equal_bookkeeping_once_and_sums_the_rest(monkeypatch):
    """``sum_reports`` without a process group (the gather replaced by two fixed rank reports): a ``(rows)`` region
    that both ranks hold alike is counted once and its second copy is ``replicated_bytes``; one that differs between
    the ranks (it should not) and every per-head region are summed; the table names both totals."""
    import torch.distributed as dist

    from kvcompress.cache import MemoryReport
    from kvcompress.distributed import HeadShard, sum_reports

    ranks = [({"middle": 100, "middle (rows)": 40, "odd (rows)": 3}, 500, 1000),
             ({"middle": 120, "middle (rows)": 40, "odd (rows)": 5}, 500, 1000)]

    def gather(out, obj, group=None):
        out[:] = ranks

    monkeypatch.setattr(dist, "all_gather_object", gather)
    mine = MemoryReport(dict(ranks[0][0]), 500, tokens=7, batch=1, dense_native_bytes=1000)
    summed = sum_reports(mine, HeadShard(rank=0, size=2, kv_heads=4, q_heads=8))
    assert summed.segments == {"middle": 220, "middle (rows)": 40, "odd (rows)": 8}
    assert summed.replicated_bytes == 40 and summed.ranks == 2
    assert (summed.dense_fp16_bytes, summed.dense_native_bytes, summed.tokens) == (1000, 2000, 7)
    held = sum(sum(part.values()) for part, _, _ in ranks)  # what the two ranks hold: 143 + 165
    assert summed.cache_bytes + summed.replicated_bytes == held == 308
    assert "308 bytes held by the ranks together" in summed.table()
