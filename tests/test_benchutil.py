"""The per-kernel benchmark (``kvcompress.kernels.benchutil``): its inputs and ops compute the right attention.

Each op the benchmark added for issue 19's grid is run on the CPU at a tiny shape, with the input built exactly as the
benchmark builds it (a static layer of the stack filled through its own commit path; paged pools written by the
stores), and compared with an independent dense oracle: masked softmax attention, in float64, over the tokens the op
should read - the full-precision regions as written, the middle as the stack stores it (LeanK: each head's kept key
channels only, no token of a head that keeps none; KIVI: the reference quantizer's codes of the original tokens, keys
per channel in 32-token groups aligned to the flushed blocks, values per token; low rank: ``(q U) . (k U)``).  The
static reads also run with the read kernels a CUDA layer chooses (``lanes_partial``: ``"triton"``, KIVI:
``"triton"``): the registered ops then run their CPU implementation (the references) through the CUDA control flow of
the read path (one lanes launch, the low-rank query extension, ``length``), so what the GPU benchmark times is checked
here up to the kernels themselves, which have their own interpreter tests.  The runner: grid and filters, error rows,
the JSON after every shape, ``--resume``.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvcompress.kernels import benchutil
from kvcompress.kernels.kivi import reference as kivi_ref
from kvcompress.kernels.paged import bench as paged_bench

SHAPE = benchutil.Shape("tiny", 16, 8, 32)  # 8 kv heads: LeanK 70 % keeps 0/8/8/8/8/8/16/24 channels (3 lanes)
REGIONS = {"sinks": 4, "window": 16, "flush": 32}  # KIVI's residual = flush = its group: the window is 32 tokens
BATCH, TOKENS, M = 2, 200, 2
ATOL, RTOL = 3e-3, 1e-2


def _tokens(tokens: int = TOKENS, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(BATCH, SHAPE.kv_heads, tokens, SHAPE.head_dim, generator=g).half()
    v = torch.randn(BATCH, SHAPE.kv_heads, tokens, SHAPE.head_dim, generator=g).half()
    q = torch.randn(BATCH, SHAPE.q_heads, 1, SHAPE.head_dim, generator=g).half()
    return q, k, v


def _oracle(scores, values, mask):
    """``softmax(scores * scale masked) @ values`` in float64: ``scores [B, Hkv, M, T]`` (unscaled), ``values
    [B, Hkv, T, Dv]``, ``mask [B|1, Hkv|1, 1|M, T]``.  ``(out [B, Hkv, M, Dv], lse [B, Hkv, M])``."""
    s = scores.double() * SHAPE.head_dim ** -0.5
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.einsum("bhmt,bhtd->bhmd", torch.softmax(s, -1), values.double()), lse


def _kivi(k, v):
    """KIVI-2 (G = 32) keys and values as the codec stores them, decoded (float32)."""
    kq = kivi_ref.dequantize_keys(*kivi_ref.quantize_keys(k, 2, 32), 2)
    vq = kivi_ref.dequantize_values(*kivi_ref.quantize_values(v, 2, 32), 2)
    return kq, vq


def _static_oracle(op, layer, q, k, v):
    """The decode read of ``layer`` (stack ``op``) holding tokens ``k`` / ``v``: ``[B, 1, Hq, D]`` float64."""
    b, hkv, t, d = k.shape
    g = SHAPE.q_heads // hkv
    qg = q.view(b, hkv, g, d)
    seen, flushed = layer.host_counts()
    s, window, f = REGIONS["sinks"], layer.layout.recent, layer.layout.flush
    assert seen == t
    if op == "none":
        flushed = s = 0  # one buffer: every token in full precision
    elif op == "kivi2-static":  # KIVI keeps no sinks: every block that left the window is quantized
        s = 0
        assert flushed == (t - window) // f * f and flushed > 0
    else:  # every block of F tokens after the sinks that left the window went to the middle: [sinks, flushed)
        assert flushed == s + (t - s - window) // f * f and flushed > s
    pos = torch.arange(t)
    fp = (pos < s) | (pos >= flushed)
    mid = ~fp
    scores = torch.einsum("bhgd,bhtd->bhgt", qg.double(), k.double())
    values = v.double().clone()
    mask = fp.view(1, 1, 1, t).expand(b, hkv, 1, t).clone()
    if op.startswith("leank70-kivi2"):
        keep = benchutil.leank_keep(70, hkv, d)[0]  # the mask the benchmark gives LeanK
        kq, vq = _kivi(k[:, :, s:flushed].float(), v[:, :, s:flushed].float())  # groups start after the sinks
        pruned = kq * keep.view(1, hkv, 1, d)  # a head scores its kept channels only
        scores[..., s:flushed] = torch.einsum("bhgd,bhtd->bhgt", qg.double(), pruned.double())
        values[:, :, s:flushed] = vq.double()
        mask = mask | (mid.view(1, 1, 1, t) & keep.any(-1).view(1, hkv, 1, 1))  # no middle for a head keeping none
    elif op == "kivi2-static":
        kq, vq = _kivi(k[:, :, :flushed].float(), v[:, :, :flushed].float())
        scores[..., :flushed] = torch.einsum("bhgd,bhtd->bhgt", qg.double(), kq.double())
        values[:, :, :flushed] = vq.double()
        mask = mask | mid.view(1, 1, 1, t)
    elif op == "lowrank":
        basis = benchutil.lowrank_basis(hkv, d, d // 2)  # [h, d, r]
        kc = torch.einsum("bhtd,hdr->bhtr", k.float(), basis).half()  # stored coordinates (the model's dtype)
        qc = torch.einsum("bhgd,hdr->bhgr", qg.float(), basis).half()  # the projected query
        low = torch.einsum("bhgr,bhtr->bhgt", qc.double(), kc.double())
        scores = torch.where(mid, low, scores)
        mask = mask | mid.view(1, 1, 1, t)
    out, _ = _oracle(scores, values, mask)
    return out.reshape(b, SHAPE.q_heads, d).unsqueeze(1)


def _cuda_choice(layer) -> None:
    """The read kernels a CUDA layer chooses (the registered ops run their CPU implementation on CPU tensors)."""
    layer.kernels = {"lanes_partial": "triton", "gather_partial": "triton"}
    if layer.middle is not None and hasattr(layer.middle, "kernels"):
        layer.middle.kernels = ["triton"] * len(layer.middle.kernels)
    if getattr(layer.middle, "merged", None) is not None:  # the stacked lanes' one op
        layer.middle.lanes_kernel = "triton"


@pytest.mark.parametrize("kernels", ["cpu", "cuda-choice"])
@pytest.mark.parametrize("op", benchutil.STATIC_OPS)
def test_static_read_matches_the_dense_oracle(op, kernels, monkeypatch):
    from kvcompress.kernels import ops

    calls = {"lanes_partial": 0, "kivi_partial": 0, "kivi_lanes_partial": 0}
    if kernels == "cuda-choice":
        pytest.importorskip("triton")  # the read path asks the Triton kernel's capability check (shapes only)
        for name in calls:  # count the registered ops' calls (the launches on CUDA)
            def counted(*args, _op=ops._OPS[name], _name=name):
                calls[_name] += 1
                return _op(*args)

            monkeypatch.setitem(ops._OPS, name, counted)
    q, k, v = _tokens()
    layer = benchutil.build_static_layer(op, SHAPE, BATCH, TOKENS, "cpu", regions=REGIONS, kv=(k, v),
                                         chunk_bytes=64 * BATCH * SHAPE.kv_heads * SHAPE.head_dim * 2)
    if kernels == "cuda-choice":
        _cuda_choice(layer)
    if op.startswith("leank70-kivi2"):
        assert len(layer.middle.lanes) == 3  # kept counts 24, 16, 8; the head keeping none has no lane
    got = benchutil.static_read(layer, q, SHAPE.head_dim ** -0.5)
    if kernels == "cuda-choice":  # one lanes launch (buffer, and the low-rank lane); one launch for all KIVI lanes
        assert calls == {"lanes_partial": 1, "kivi_partial": {"leank70-kivi2-perlane": 3, "kivi2-static": 1}.get(op, 0),
                         "kivi_lanes_partial": int(op in ("leank70-kivi2", "leank70-kivi2-triton"))}
    assert got.shape == (BATCH, 1, SHAPE.q_heads, SHAPE.head_dim)
    torch.testing.assert_close(got.double(), _static_oracle(op, layer, q, k, v), atol=ATOL, rtol=RTOL)
    # a copy (the benchmark's rotated inputs) reads its own buffers, the same values
    twin = benchutil._copy(layer)
    assert twin.pipeline is layer.pipeline and twin.k.data_ptr() != layer.k.data_ptr()
    torch.testing.assert_close(benchutil.static_read(twin, q, SHAPE.head_dim ** -0.5), got, atol=0, rtol=0)
    n = benchutil.static_read_bytes(layer, q)
    assert 0 < n < 2 * BATCH * SHAPE.kv_heads * (TOKENS + 64) * SHAPE.head_dim * 2 + 4096


def _pool_case(tokens=224, seed=1):
    g = torch.Generator().manual_seed(seed)
    shape = (BATCH, SHAPE.kv_heads, tokens, SHAPE.head_dim)
    k, v = torch.randn(shape, generator=g).half(), torch.randn(shape, generator=g).half()
    q = torch.randn(BATCH, SHAPE.kv_heads, M, SHAPE.head_dim, generator=g).half()
    return q, k, v


def _pool_oracle(q, k, v, quantized: bool):
    if quantized:
        k, v = _kivi(k.float(), v.float())
    scores = torch.einsum("bhmd,bhtd->bhmt", q.double(), k.double())
    return _oracle(scores, v, torch.ones(1, 1, 1, k.shape[2], dtype=torch.bool))


CHUNK = 64 * BATCH * SHAPE.kv_heads * SHAPE.head_dim * 2  # 64-token appends: the rows' pages interleave


@pytest.mark.parametrize("op", ["paged-dense", "paged-kivi2", "paged-kivi2-gather"])
def test_pool_reads_match_the_dense_oracle(op):
    q, k, v = _pool_case()
    scale = SHAPE.head_dim ** -0.5
    if op == "paged-kivi2":
        _, read = paged_bench.static_kivi_pool(BATCH, SHAPE.kv_heads, k.shape[2], SHAPE.head_dim, "cpu", kv=(k, v),
                                               chunk_bytes=CHUNK)
    else:
        codec = paged_bench.kivi_codec(SHAPE.head_dim) if op == "paged-kivi2-gather" else None
        store, read = paged_bench.paged_pool(BATCH, SHAPE.kv_heads, k.shape[2], SHAPE.head_dim, "cpu", kv=(k, v),
                                             page=32 if codec else 16, codec=codec, chunk_bytes=CHUNK)
        assert not torch.equal(read.table[0], torch.arange(read.table.shape[1], dtype=torch.int32))  # interleaved
        assert paged_bench.pool_bytes(q, read) > 0
    out, lse = read.attention_partial(q, scale)
    ref_out, ref_lse = _pool_oracle(q, k, v, quantized=op != "paged-dense")
    torch.testing.assert_close(out.double(), ref_out, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-3, rtol=0)
    twin = benchutil._copy(read)  # a rotated copy: its own buffers, the same read
    assert twin.valid.data_ptr() != read.valid.data_ptr()
    torch.testing.assert_close(twin.attention_partial(q, scale), (out, lse), atol=0, rtol=0)


def test_static_kivi_pool_is_what_the_store_writes_itself():
    """The benchmark writes the static pool's pages in bulk; the store's own append (one page at a time) must give
    the same buffers (what a read touches: payloads, slot flags, live pages, positions)."""
    from kvcompress.paged import StaticPagedStore
    from kvcompress.state import KVBlock

    _, k, v = _pool_case()
    t = k.shape[2]
    bulk, _ = paged_bench.static_kivi_pool(BATCH, SHAPE.kv_heads, t, SHAPE.head_dim, "cpu", kv=(k, v),
                                           chunk_bytes=CHUNK)
    own = StaticPagedStore(32, t // 32, paged_bench.kivi_codec(SHAPE.head_dim))
    own.append(KVBlock(k, v, torch.ones(BATCH, t, dtype=torch.bool), torch.arange(t)))
    for (_, a), (_, b) in zip(bulk.lanes, own.lanes, strict=True):
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name
    for name in ("valid", "live", "pos"):
        assert torch.equal(getattr(bulk, name), getattr(own, name)), name


def test_the_compressors_are_the_registered_ones():
    """The benchmark builds the built-in compressors directly (no entry-point lookup): the classes the registry has."""
    import importlib

    from kvcompress.manager import get_registry

    registry = get_registry()
    for name, (module, config, factory) in benchutil._COMPRESSORS.items():
        plugin = importlib.import_module(f"kvcompress.plugins.{module}")
        spec = registry.get(name)
        assert spec.factory is getattr(plugin, factory) and spec.config is getattr(plugin, config)
    assert set(benchutil.GRID_OPS) <= set(benchutil.ALL_OPS)


def test_grid_and_filters(capsys):
    full = benchutil.grid("cuda")
    assert len(full) == 2 * 4 * 3 and {b for _, b, _ in full} == {1, 4, 16, 64}
    assert {t for _, _, t in full} == {4096, 32768, 131072}
    some = benchutil.grid("cuda", models=["smollm2-135m"], batches=[16, 64], contexts=[benchutil.parse_context("32k")])
    assert [(s.model, b, t) for s, b, t in some] == [("smollm2-135m", 16, 32768), ("smollm2-135m", 64, 32768)]
    assert [(s.model, b, t) for s, b, t in benchutil.grid("cuda", only=[("llama3-8b", 4, "128k")])] == [
        ("llama3-8b", 4, 131072)]
    assert len(benchutil.grid("cuda", quick=True)) == 3
    assert [(b, t) for _, b, t in benchutil.grid("cpu")] == [(1, 4096), (1, 4096)]
    assert benchutil._only("llama3-8b:16:32k") == [("llama3-8b", 16, 32768)]
    with pytest.raises(ValueError, match="unknown model"):
        benchutil.grid("cuda", models=["gpt-5"])
    assert benchutil.main(["--device", "cuda", "--dry-run", "--models", "llama3-8b", "--batches", "1,4",
                           "--contexts", "4k,128k"]) == 0
    assert capsys.readouterr().out.split() == ["llama3-8b:1:4k", "llama3-8b:1:128k", "llama3-8b:4:4k",
                                               "llama3-8b:4:128k"]


def test_every_cpu_grid_op_runs_and_leank_bytes_count_every_lane():
    """The grid ops that run on the CPU run without an error row, and the LeanK rows' byte count (GPU-only ops) is the
    sum over the lanes' tensors by name - session 31's ``Lane.basis`` field broke a 5-field unpack there, which only
    the next GPU grid showed (every leank50 / leank70 row an error)."""
    tiny = benchutil.Shape("tiny", 4, 2, 64)
    rows = benchutil.run_kernel_benchmarks("cpu", None, ops=benchutil.GRID_OPS, models=[tiny], contexts=[256])
    assert rows and not {r["op"]: r["error"] for r in rows if "error" in r}
    q, lanes = benchutil.leank_inputs(2, 4, 100, 64, 4, 70, torch.device("cpu"))
    from kvcompress.kernels.leank.reference import Lane

    basis = torch.zeros(2, 64, 32)
    lanes = lanes + [Lane(None, None, lanes[-1].k, lanes[-1].v, None, basis)]
    want = q.numel() * 2
    for lane in lanes:
        want += (lane.k.numel() + lane.v.numel()) * 2
        want += 0 if lane.channels is None else lane.channels.numel() * 8
        want += 0 if lane.basis is None else lane.basis.numel() * 4
    assert benchutil.leank_bytes(q, lanes) == want


def test_bf16_run_reads_bf16_data_and_keeps_its_rows_apart(tmp_path, monkeypatch):
    """``--dtype bfloat16``: every CPU grid op times reads of bf16 queries and full-precision K / V (KIVI scales and
    zero points stay fp16, as the stores hold them), the rows say so, the JSON's conditions too, a resume with another
    dtype is refused, and the grid matrix names them ``op@bf16`` (never a cell of the float16 grid)."""
    import sys
    from pathlib import Path

    seen = {}
    real = benchutil.time_op

    def floats(x, name=""):
        if isinstance(x, torch.Tensor):
            return [(name, x.dtype)] if x.is_floating_point() and x.element_size() == 2 else []
        if isinstance(x, dict):
            return [t for k, y in x.items() for t in floats(y, str(k))]
        if hasattr(x, "_fields"):  # PackedKV, Lane: by field name
            return [t for k in x._fields for t in floats(getattr(x, k), k)]
        if isinstance(x, (tuple, list)):
            return [t for y in x for t in floats(y, name)]
        if hasattr(x, "__dict__"):  # static layers, pools: their tensors
            return [t for k, y in vars(x).items() for t in floats(y, k)]
        return []

    def spy(fn, inputs, **kw):
        for name, dtype in floats(inputs[0]):
            seen.setdefault("scales" if name.endswith(("_scale", "_zero")) else "data", set()).add(dtype)
        return real(fn, inputs, **kw)

    monkeypatch.setattr(benchutil, "time_op", spy)
    tiny = benchutil.Shape("tiny", 4, 2, 64)
    out = tmp_path / "bf16.json"
    rows = benchutil.run_kernel_benchmarks("cpu", str(out), ops=("sdpa", "kivi2-ref", "paged-kivi2", "none"),
                                           models=[tiny], contexts=[256], dtype=torch.bfloat16)
    assert rows and not [r for r in rows if "error" in r]
    assert seen["data"] == {torch.bfloat16} and seen["scales"] == {torch.float16}
    assert {r["dtype"] for r in rows} == {"bfloat16"}
    doc = json.loads(out.read_text())
    assert doc["conditions"]["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="holds bfloat16 rows"):
        benchutil.run_kernel_benchmarks("cpu", str(out), ops=("sdpa",), models=[tiny], contexts=[256], resume=True)
    with pytest.raises(ValueError, match="float16 or torch.bfloat16"):
        benchutil.run_kernel_benchmarks("cpu", None, ops=("sdpa",), models=[tiny], contexts=[256],
                                        dtype=torch.float32)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import kernel_grid_matrix

    assert {r["op"] for r in kernel_grid_matrix.load_rows(str(out))} == {"sdpa@bf16", "kivi2-ref@bf16",
                                                                          "paged-kivi2@bf16", "none@bf16"}
    assert "| sdpa@bf16 |" in benchutil.markdown_table(rows)


def test_run_keeps_going_after_an_error_and_writes_json_per_shape(tmp_path, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (test)")

    monkeypatch.setattr(benchutil, "lowrank_basis", broken)
    out = tmp_path / "k.json"
    tiny = benchutil.Shape("tiny", 4, 2, 16)
    ops = ("sdpa", "lowrank", "paged-kivi2")
    rows = benchutil.run_kernel_benchmarks("cpu", str(out), ops=ops, models=[tiny], contexts=[512])
    by_op = {r["op"]: r for r in rows}
    assert set(by_op) == set(ops)
    assert "OutOfMemoryError" in by_op["lowrank"]["error"] and "latency_us" not in by_op["lowrank"]
    for op in ("sdpa", "paged-kivi2"):  # the op after the failing one ran too
        row = by_op[op]
        assert row["latency_us"] > 0 and row["bytes"] > 0 and row["speedup_vs_sdpa"] > 0
        assert row["pct_of_peak"] == pytest.approx(100 * row["bandwidth_tbps"] / 4.3)
    captured = capsys.readouterr()
    assert "% of 4.3 TB/s" in captured.out and "error: OutOfMemoryError" in captured.out
    assert "lowrank tiny B1 512: ERROR" in captured.err
    doc = json.loads(out.read_text())
    assert doc["done"] == [["tiny", 1, 512]] and doc["remaining"] == [] and len(doc["rows"]) == len(ops)
    # --resume: the shape is done, nothing runs again and the rows are kept
    again = benchutil.run_kernel_benchmarks("cpu", str(out), ops=ops, models=[tiny], contexts=[512], resume=True)
    assert [r["op"] for r in again] == [r["op"] for r in rows]
    # --max-seconds 0: no shape starts, the JSON says what is left
    out2 = tmp_path / "k2.json"
    assert benchutil.run_kernel_benchmarks("cpu", str(out2), ops=ops, models=[tiny], contexts=[512],
                                           max_seconds=0) == []
    assert json.loads(out2.read_text())["remaining"] == [["tiny", 1, 512]]


def test_static_reads_issue_one_op_where_one_launch_reads_everything():
    """``benchmarks/read_ops.py``: with a CUDA layer's choices, the empty stack's and the low-rank decode reads are
    one ``kvcompress::lanes_partial`` op and nothing else (no projection, cast or validity op: sessions 23, 31, 32);
    the LeanK + KIVI read, its lanes op, its KIVI lanes op and the merge op (no per-head validity op)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, str(root / "benchmarks/read_ops.py"), "--ops", "none,lowrank,leank70-kivi2"],
                         capture_output=True, text=True, cwd=root)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = {line.split("|")[1].strip(): line.split("|")[3].strip() for line in res.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| read")}
    assert rows["none"] == rows["lowrank"] == "kvcompress::lanes_partial"
    assert rows["leank70-kivi2"] == ("kvcompress::lanes_partial, kvcompress::kivi_lanes_partial, "
                                     "kvcompress::merge_partials")


def test_sweep_table_variant_columns():
    """``sweep_table --variant-suffix``: op ``X-fused`` of a run becomes the second column of op ``X`` in that run, each
    against the SDPA row of its own run; ops without a variant keep one filled column."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import sweep_table
    finally:
        sys.path.pop(0)

    def run(sdpa, plain, fused):
        rows = [dict(op="sdpa", model="m", batch=1, ctx=4096, latency_us=sdpa),
                dict(op="ds16", model="m", batch=1, ctx=4096, latency_us=plain),
                dict(op="ds16-fused", model="m", batch=1, ctx=4096, latency_us=fused),
                dict(op="kivi2", model="m", batch=1, ctx=4096, latency_us=5.0)]
        return {(r["op"], r["model"], r["batch"], r["ctx"]): r for r in rows}

    runs, names = sweep_table.split_variants([run(10.0, 12.0, 9.0), run(20.0, 12.5, 9.5)], ["a", "b"], "-fused")
    assert names == ["a", "a -fused", "b", "b -fused"]
    assert [r[("ds16", "m", 1, 4096)]["latency_us"] for r in runs] == [12.0, 9.0, 12.5, 9.5]
    assert [r[("sdpa", "m", 1, 4096)]["latency_us"] for r in runs] == [10.0, 10.0, 20.0, 20.0]
    assert ("kivi2", "m", 1, 4096) in runs[0] and ("kivi2", "m", 1, 4096) not in runs[1]
    text = sweep_table.table(runs, names)
    line = next(x for x in text.splitlines() if x.startswith("| ds16 |"))
    assert "9.0 (-25.0%), 1.11x" in line and "9.5 (-20.8%), 2.11x" in line and line.endswith("| a -fused |")
