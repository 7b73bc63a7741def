"""The CUDA radix select of DoubleSparse (kernels/doublesparse/radix_cuda.cu).

Without a GPU: :func:`radix_cuda.select_keys` (the select kernel's digit steps, early stop and output slots in
PyTorch) against a stable sort on constructed keys that need one, two and three digits; :func:`radix_cuda.emulate`
against a stable sort of the reference's label scores on every label format; the ``.cu`` file compiled with nvcc
for sm_90a without spills (skipped where nvcc is missing).  On a GPU (marker ``gpu``) the kernels themselves: the
top-k of the reference scores on every score case and on long odd contexts, exactly the stable sort (and the fused
Triton select's indices, in the same order) on integer scores with ties, and a replay inside a CUDA graph.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

from test_doublesparse_kernel import RADIX_TIE_CASES, SCORE_CASES, channel_major, score_case, tie_case

from kvcompress.kernels.doublesparse import radix_cuda as rc
from kvcompress.kernels.doublesparse import reference, triton_kernel
from kvcompress.kernels.doublesparse.reference import Labels


def _expected(keys: torch.Tensor, k: int) -> list[int]:
    """The k largest keys, ties to the lowest tokens, in token order (a stable sort)."""
    order = torch.sort(keys, descending=True, stable=True).indices[:k]
    return order.sort().values.tolist()


def _keys(kind: str, t: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "spread":  # distinct top digits: one digit is enough
        return torch.randint(1, 2 ** 32, (t,), generator=gen, dtype=torch.int64)
    if kind == "shared-top":  # every key in one top-10-bit digit: a second digit
        return (0x2D1 << 22) + torch.randint(0, 2 ** 22, (t,), generator=gen)
    if kind == "shared-21":  # the top 21 bits shared: all three digits
        return (0x1234AB << 11) + torch.randint(0, 8, (t,), generator=gen) * 256 + torch.randint(0, 2, (t,),
                                                                                             generator=gen)
    if kind == "ties":  # few distinct values: ties straddle the k-th key
        return torch.tensor([0x80000000 + 5, 0x80000000 + 7, 0x007FFFFF])[torch.randint(0, 3, (t,), generator=gen)]
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["spread", "shared-top", "shared-21", "ties"])
def test_select_model_against_a_stable_sort(kind):
    """The select kernel's steps on constructed keys: the k largest, ties to the lowest tokens, in token order, for
    k = 1, k = all and values between; the keys of each kind take the digits their name says."""
    gen = torch.Generator().manual_seed(sum(map(ord, kind)))
    levels = set()
    for t in (1, 7, 300, 2049):
        for k in sorted({1, max(1, t // 3), max(1, t - 1), t}):
            keys = _keys(kind, t, gen)
            trace: list = []
            assert rc.select_keys(keys, k, trace) == _expected(keys, k), (t, k)
            levels.add(len(trace))
    want = {"spread": {1}, "shared-top": {2}, "shared-21": {3}, "ties": {3}}[kind]
    assert want <= levels, f"digits used {levels}, expected at least {want}"


@pytest.mark.parametrize("c", [2, 4, 8])
def test_cluster_model_equals_the_one_cta_model(c):
    """The cluster select's model (histograms summed over C CTAs, each CTA's indices after the counts of the CTAs
    before it) gives the one-CTA model's indices - a stable sort's - with ties straddling CTA boundaries, CTAs
    left empty (fewer tokens than CTAs x 8) and k = every token."""
    gen = torch.Generator().manual_seed(c)
    for kind in ("spread", "shared-top", "shared-21", "ties"):
        for t in (1, 9, 300, 2049):
            keys = _keys(kind, t, gen)
            for k in sorted({1, max(1, t // 3), t}):
                assert rc.select_keys_cluster(keys, k, c) == _expected(keys, k), (kind, t, k)


@pytest.mark.parametrize("c", [1, 3, 8])
def test_cluster_exact_pick_against_a_stable_sort(c):
    """The cluster select's exact pick (at most PICK_CAP keys left at the prefix: one round by (key, token) instead of
    the next digit) gives a stable sort's indices: after the first digit (few keys share it), after the second, and
    with equal keys straddling CTA boundaries; the model without the pick takes more digits for the same indices."""
    gen = torch.Generator().manual_seed(10 + c)
    picks = set()
    for kind in ("spread", "shared-top", "shared-21", "ties"):
        for t in (40, 300, 2049, 5000):
            keys = _keys(kind, t, gen)
            for k in sorted({1, max(1, t // 5), t // 2, t - 1}):
                trace: list = []
                got = rc.select_keys_cluster(keys, k, c, trace)
                assert got == _expected(keys, k), (kind, t, k)
                if trace[-1][-1] == "pick":
                    picks.add(len(trace) - 1)  # the pick came after this many digits
                    plain: list = []
                    assert rc.select_keys_cluster(keys, k, c, plain, pick_cap=0) == got
                    assert len(plain) >= len(trace) - 1
    assert {1, 2} <= picks, f"the pick followed digits {picks}"


@pytest.mark.parametrize("nb", [1024, 2048])
def test_cluster_find_steps_equal_find_digit_on_the_summed_histogram(nb):
    """The cluster find's steps (group sums, the group of the need-th key, then its bins; one warp) give find_digit's
    digit and keys above it on the summed histogram, and the earlier CTAs' keys above / at it, for every CTA of
    clusters of 1 - 8, on spread and crowded histograms, need from the first to the last key."""
    gen = torch.Generator().manual_seed(nb)
    checked = 0
    for c in (1, 2, 3, 8):
        for crowd in (False, True):
            if crowd:  # all keys in a few bins near one group boundary
                hists = [torch.zeros(nb, dtype=torch.int64) for _ in range(c)]
                for h in hists:
                    h[[31, 32, 33, 95]] = torch.randint(0, 40, (4,), generator=gen)
            else:
                hists = [torch.randint(0, 3, (nb,), generator=gen) * (torch.rand(nb, generator=gen) < 0.2)
                         for _ in range(c)]
            comb = sum(hists)
            total = int(comb.sum())
            if total == 0:
                continue
            for need in sorted({1, 2, total // 3, total // 2, total - 1, total} - {0}):
                digit, above = rc.find_digit(comb, need)
                for rank in range(c):
                    earlier = sum(hists[:rank]) if rank else torch.zeros(nb, dtype=torch.int64)
                    want = (digit, above, int(earlier[digit + 1:].sum()), int(comb[digit]), int(earlier[digit]))
                    assert rc.cluster_find_grouped(hists, need, rank) == want, (c, crowd, need, rank)
                    checked += 1
    assert checked > 100


def test_cluster_plan():
    cfg = dict(rc.RADIX_CUDA_CONFIG, cluster=8)
    assert rc.cluster_plan(32768, (9, 0), 227 * 1024, cfg) == (8, 4096)
    assert rc.cluster_plan(32769, (9, 0), 227 * 1024, cfg) == (8, 4104)  # rounded up to 8 tokens per CTA
    assert rc.cluster_plan(32768, (8, 0), 227 * 1024, cfg) is None  # clusters need sm_90
    assert rc.cluster_plan(8 * rc.SMEM_KEYS + 8, (9, 0), 227 * 1024, cfg) is None  # a CTA's share beyond SMEM_KEYS
    assert rc.cluster_plan(32768, (9, 0), 227 * 1024, dict(rc.RADIX_CUDA_CONFIG, cluster=0)) is None
    assert rc.cluster_plan(32768, (9, 0), 227 * 1024, rc.RADIX_CUDA_CONFIG) is None  # None: cluster_auto decides
    # cluster_auto on an H200 (132 SMs): 8 CTAs per head up to 16 heads beyond the fused select's one chunk; up to 37
    # heads 4 beyond 64k and 2 below; never at 4k or from 38 heads on
    assert [rc.cluster_auto(r, 32768, 132) for r in (3, 9, 16, 17, 32, 36, 37, 38)] == [8, 8, 8, 2, 2, 2, 2, 0]
    assert [rc.cluster_auto(r, 131072, 132) for r in (8, 32, 33, 36, 37, 38)] == [8, 4, 4, 4, 4, 0]
    assert rc.cluster_plan(131072, (9, 0), 227 * 1024, dict(rc.RADIX_CUDA_CONFIG, cluster=2)) is None  # 64k keys per CTA
    assert rc.cluster_plan(98304, (9, 0), 227 * 1024, dict(rc.RADIX_CUDA_CONFIG, cluster=2)) == (2, 49152)
    assert rc.cluster_auto(8, 4096, 132) == 0
    # within one fused chunk (session 45, H100): 4 CTAs per head for 8193 - 16384 tokens up to 16 heads; never at 8k
    assert [rc.cluster_auto(r, 16384, 132) for r in (3, 8, 9, 12, 16, 17, 32, 36)] == [4] * 5 + [0] * 3
    assert [rc.cluster_auto(8, t, 132) for t in (8192, 8193, 9000, 16384, 16385)] == [0, 4, 4, 4, 8]


def test_select_model_catches_a_wrong_tie_rule(monkeypatch):
    """The check above fails for a model that takes the *last* ties (a wrong slot rule)."""
    gen = torch.Generator().manual_seed(3)
    keys = _keys("ties", 300, gen)
    real = rc.select_keys(keys, 100)
    wrong = rc.select_keys(keys.flip(0), 100)
    wrong = sorted(299 - i for i in wrong)  # the same rule on reversed tokens: ties to the highest
    assert real == _expected(keys, 100) and wrong != _expected(keys, 100)


@pytest.mark.parametrize("name", list(SCORE_CASES))
def test_emulated_select_matches_a_stable_sort_of_the_reference_scores(name):
    """:func:`radix_cuda.emulate` on every label format (fp16 / fp32 / 4-bit / 2-bit labels, bf16 query, padding,
    k above the valid tokens, k = every token) picks exactly the stable sort's tokens of the reference scores."""
    q, labels, channels, valid = score_case(name)
    extra = SCORE_CASES[name][-1]
    k = extra.get("k", max(1, labels.num_tokens // 8))
    got = rc.emulate(q, labels, channels, valid, k)
    scores = reference.label_scores(q, labels, channels, valid)
    want = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k].sort(-1).values
    assert torch.equal(got, want)
    assert reference.is_topk(got, scores, k, 0.0)


def test_plan_spreads_small_batches_over_the_sms():
    cfg = rc.RADIX_CUDA_CONFIG
    for rows, t in [(8, 32768), (3, 32768), (128, 32768), (8, 4096), (1, 100)]:
        chunk = rc.plan(rows, t, 132, cfg)
        least = max(cfg["min_chunk"], rc.TPT * cfg["keys_threads"])  # every thread of a keys CTA gets a step
        assert least <= chunk <= cfg["max_chunk"] and chunk & (chunk - 1) == 0
        enough = rows * -(-t // chunk) >= cfg["ctas_per_sm"] * 132
        assert enough or chunk == least
        assert chunk == cfg["max_chunk"] or rows * -(-t // (2 * chunk)) < cfg["ctas_per_sm"] * 132
    assert [rc.heads_per_cta(g) for g in (1, 2, 3, 4, 5, 8, 12)] == [1, 2, 4, 4, 8, 8, 8]


def test_cpu_tensors_are_refused_and_the_select_falls_back():
    q, labels, channels, valid = score_case("fp16-gqa4-r16-odd-t")
    labels = channel_major(labels)
    assert rc.problem(q, labels, channels, valid, 5) == "not a CUDA tensor"
    cfg = dict(triton_kernel.SELECT_CONFIG, method="cuda")
    assert triton_kernel.select_method(q, labels, channels, 5, cfg, valid) == "fused"
    with pytest.raises(ValueError, match="method must be"):
        triton_kernel.select_method(q, labels, channels, 5, dict(cfg, method="cub"), valid)


def test_auto_takes_the_cuda_select_where_the_sweep_found_it_faster():
    """The rule of ``"auto"`` on an H200 (132 SMs) at the shapes of the session 29 sweep: per-query-head selections
    from batch 4 at 32k; not at batch 1, not at 4k, not for group-shared selections (one query row per kv head)."""
    rule = (lambda b, hq, hkv, t: rc.prefers_cuda(b, hq, hkv, t, triton_kernel.FUSED_MAX_TOKENS, 132))
    assert rule(4, 32, 8, 32768) and rule(64, 32, 8, 32768) and rule(4, 9, 3, 32768) and rule(16, 9, 3, 32768)
    assert not rule(1, 32, 8, 32768) and not rule(1, 9, 3, 32768) and not rule(16, 32, 8, 4096)
    assert not rule(16, 8, 8, 32768)  # ds16-shared
    assert rc.launch_shape(2048, 132, rc.RADIX_CUDA_CONFIG) == (False, 512)
    assert rc.launch_shape(128, 132, rc.RADIX_CUDA_CONFIG) == (True, 1024)
    assert rc.launch_shape(2048, 132, dict(rc.RADIX_CUDA_CONFIG, smem=True, select_threads=256)) == (True, 256)


def test_config_is_validated():
    q, labels, channels, valid = score_case("fp16-gqa4-r16-odd-t")
    with pytest.raises(ValueError, match="unknown entries.*keys_thread"):
        rc.problem(q, labels, channels, valid, 5, {"keys_thread": 128})
    with pytest.raises(ValueError, match="select_threads 100"):
        rc.problem(q, labels, channels, valid, 5, {"select_threads": 100})
    with pytest.raises(ValueError, match="cluster_rows_in_flight 2"):
        rc.problem(q, labels, channels, valid, 5, {"cluster_rows_in_flight": 2})
    with pytest.raises(ValueError, match="emit_vectors 3 \\(None, 1, 2 or 4\\)"):
        rc.problem(q, labels, channels, valid, 5, {"emit_vectors": 3})
    for gone in ("cluster_find", "cluster_fence"):  # (sessions 47 / 48's opt-ins, now the code)
        with pytest.raises(ValueError, match=f"unknown entries \\['{gone}'\\]"):
            rc.problem(q, labels, channels, valid, 5, {gone: "groups"})


def test_emit_auto_takes_a_row_in_one_tile():
    """emit_vectors None: the fewest 16-byte reads (4 keys each) per thread per tile that cover the CTA's keys in one
    tile (one block scan), at most 4; an explicit value wins."""
    for threads in (256, 512, 1024):
        for keys in (1, threads * 4, threads * 4 + 1, threads * 8, threads * 8 + 1, threads * 16, threads * 64):
            v = rc.emit_auto(keys, threads)
            assert v in (1, 2, 4)
            assert keys <= threads * 4 * v or v == 4, (keys, threads, v)
            smaller = [u for u in (1, 2, 4) if u < v]
            assert all(keys > threads * 4 * u for u in smaller), (keys, threads, v)
    assert rc.emit_vectors_for(dict(rc.RADIX_CUDA_CONFIG, emit_vectors=1), 1 << 20, 1024) == 1
    assert rc.emit_vectors_for(dict(rc.RADIX_CUDA_CONFIG), 1 << 20, 1024) == 4


def test_import_compiles_nothing():
    assert not rc._LIB


def test_cuda_source_compiles_for_sm90a_without_spills(tmp_path, triton_cuobjdump):
    """Every kernel compiles for sm_90a without spills; the cluster kernels' exchange barriers fence only the CTA's
    own shared memory - no GPU-scope fence (MEMBAR.ALL.GPU) is left in them, and each has the CTA-scope one - where a
    disassembler is at hand (Triton's cuobjdump)."""
    if not rc._nvcc():
        pytest.skip("nvcc not on the PATH")
    cubin = tmp_path / "ds.cubin"
    cmd = [rc._nvcc(), "-O3", "-std=c++17", "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
           "-o", str(cubin), str(rc.SOURCE)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    kernels = re.findall(r"Compiling entry function '(\w+)'", res.stderr)
    spills = re.findall(r"(\d+) bytes spill stores", res.stderr)
    # keys: 4 label formats x 4 head counts x vector loads or not x 1 or 4 rows; 2 selects; cluster: 4 formats x
    # vector loads or not x 1 or 4 rows
    assert len(kernels) == 82, kernels
    assert len(spills) == len(kernels) and all(s == "0" for s in spills), res.stderr[-3000:]
    if triton_cuobjdump is not None:
        sass = subprocess.run([str(triton_cuobjdump), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
        cluster = [f for f in sass.split("Function : ")[1:] if "ds_cluster_kernel" in f.split("\n", 1)[0]]
        assert len(cluster) == 16
        assert [f.count("MEMBAR.ALL.GPU") for f in cluster] == [0] * 16
        assert all(f.count("MEMBAR.ALL.CTA") >= 2 for f in cluster)  # (two exchanges at least: a digit, the lists)


# ----------------------------------------------------------------------------- on the GPU

on_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# long odd contexts (several keys CTAs per head, all digits): name -> (batch, kv heads, group, tokens, r, bits,
# k, score scale (small: crowded top digits), left padding)
LONG_CASES = {
    "fp16-gqa4-70001-crowded": (1, 2, 4, 70001, 16, 16, 70001 // 16, 0.01, 0),
    "4bit-gqa3-33333-pad": (2, 3, 3, 33333, 16, 4, 33333 // 8, 1.0, 1000),
    "2bit-gqa8-9000": (1, 1, 8, 9000, 16, 2, 1111, 1.0, 0),
    "fp16-gqa12-5000-k1": (1, 1, 12, 5000, 8, 16, 1, 1.0, 37),
    # 40 query heads at 20001 tokens: "auto" takes the CUDA select on an H200
    "fp16-b5-gqa4-20001-auto": (5, 2, 4, 20001, 16, 16, 20001 // 16, 1.0, 0),
}


def _gpu_select(q, labels, channels, valid, k, group=1, **cuda):
    """The CUDA select; the two kernels unless ``cluster`` is given."""
    cuda.setdefault("cluster", 0)
    cfg = dict(triton_kernel.SELECT_CONFIG, method="cuda", cuda=cuda)
    assert triton_kernel.select_method(q[:, ::group], labels, channels, k, cfg, valid) == "cuda"
    return triton_kernel.select_topk(q, labels, channels, valid, k, config={"method": "cuda", "cuda": cuda},
                                     group=group)


def _check_topk(got, q, labels, channels, valid, k):
    scores = reference.label_scores(q, labels, channels, valid)
    tol = 1e-3 * max(1.0, float(scores[torch.isfinite(scores)].abs().max()))
    assert reference.is_topk(got, scores, k, tol)
    assert torch.equal(got, got.sort(-1).values), "indices not in token order"


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("name", list(SCORE_CASES))
def test_cuda_select_on_score_cases(name):
    q, labels, channels, valid = score_case(name, "cuda")
    labels = channel_major(labels)
    k = SCORE_CASES[name][-1].get("k", max(1, labels.num_tokens // 8))
    got = _gpu_select(q, labels, channels, valid, k)
    _check_topk(got, q, labels, channels, valid, k)
    if torch.cuda.get_device_capability()[0] >= 9:  # the cluster select computes the same keys
        assert torch.equal(_gpu_select(q, labels, channels, valid, k, cluster=4), got)


def long_case(name: str):
    b, h, g, t, r, bits, k, spread, pad = LONG_CASES[name]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    d = 64
    lab = (torch.randn(b, h, t, r, generator=gen) * spread + 1.0).half()
    q = torch.randn(b, h * g, d, generator=gen).half().cuda()
    channels = torch.stack([torch.randperm(d, generator=gen)[:r] for _ in range(h)]).cuda()
    valid = None
    if pad:
        valid = torch.ones(b, t, dtype=torch.bool)
        valid[-1, :pad] = False
        valid = valid.cuda()
    labels = reference.quantize_labels(lab.cuda(), bits)
    return q, channel_major(labels), channels, valid, k


def _aligned_copy(labels: Labels) -> Labels:
    """The labels channel-major in a fresh buffer whose channel stride is padded to 16 tokens (vector loads)."""
    b, h, t, w = labels.data.shape
    buf = labels.data.new_zeros(b, h, w, -(-t // 16) * 16)
    buf[..., :t] = labels.data.transpose(-1, -2)
    same = (lambda x: None if x is None else x.contiguous())
    return Labels(buf[..., :t].transpose(-1, -2), labels.bits, same(labels.scale), same(labels.zero))


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("name", list(LONG_CASES))
def test_cuda_select_long_odd_contexts(name):
    q, labels, channels, valid, k = long_case(name)
    got = _gpu_select(q, labels, channels, valid, k)
    _check_topk(got, q, labels, channels, valid, k)
    assert torch.equal(got, _gpu_select(q, labels, channels, valid, k)), "a second run wrote other indices"
    # the keys read from L2 on every pass instead of shared memory, and scalar label loads (a view one token in, not
    # aligned for vector loads, against an aligned copy of it): the same keys, so the same indices
    assert rc.smem_select(labels.num_tokens, 227 * 1024, rc.RADIX_CUDA_CONFIG) == (labels.num_tokens <= rc.SMEM_KEYS)
    # "auto" takes the CUDA select at a long context with many query heads, or the cluster select with few (sm_90),
    # and returns the same indices
    if (labels.num_tokens > triton_kernel.FUSED_MAX_TOKENS and q.shape[0] * q.shape[1] * 4 >= rc._sms(0)) or (
            torch.cuda.get_device_capability()[0] >= 9 and rc.cluster_auto(q.shape[0] * q.shape[1],
                                                                           labels.num_tokens, rc._sms(0))):
        assert triton_kernel.select_method(q, labels, channels, k, dict(triton_kernel.SELECT_CONFIG), valid) == "cuda"
        assert torch.equal(triton_kernel.select_topk(q, labels, channels, valid, k), got)
    assert torch.equal(got, _gpu_select(q, labels, channels, valid, k, smem=False))
    # the other launch shapes: 256-thread keys CTAs reading one label row at a time, 256- / 512-thread selects
    assert torch.equal(got, _gpu_select(q, labels, channels, valid, k, keys_threads=256, rows_in_flight=1,
                                        select_threads=256))
    assert torch.equal(got, _gpu_select(q, labels, channels, valid, k, smem=False, select_threads=512))
    assert torch.equal(got, _gpu_select(q, labels, channels, valid, k, keys_threads=128, rows_in_flight=4,
                                        select_threads=1024))
    # the emit pass with 4 / 8 / 16 keys per thread per tile (emit_auto picks one), from shared memory and from L2
    for vecs in (1, 2, 4):
        assert torch.equal(got, _gpu_select(q, labels, channels, valid, k, emit_vectors=vecs)), vecs
        assert torch.equal(got, _gpu_select(q, labels, channels, valid, k, emit_vectors=vecs, smem=False)), vecs
    # the cluster select (C CTAs per head): the same indices wherever a CTA's share fits its shared memory
    for c in (1, 2, 8):
        if rc.cluster_plan(labels.num_tokens, torch.cuda.get_device_capability(), rc._smem_optin(0),
                           dict(rc.RADIX_CUDA_CONFIG, cluster=c)) is not None:
            assert torch.equal(got, _gpu_select(q, labels, channels, valid, k, cluster=c)), f"cluster {c}"
            assert torch.equal(got, _gpu_select(q, labels, channels, valid, k, cluster=c, cluster_threads=256))
            for vecs in (1, 4):
                assert torch.equal(got, _gpu_select(q, labels, channels, valid, k, cluster=c, emit_vectors=vecs))
            for threads, rows in ((512, 4), (1024, 1)):  # label rows in flight (default 4 at 1024 threads)
                assert torch.equal(got, _gpu_select(q, labels, channels, valid, k, cluster=c, cluster_threads=threads,
                                                    cluster_rows_in_flight=rows))
    view = labels.narrow(1, labels.num_tokens - 1)
    copy = _aligned_copy(view)
    vvalid = None if valid is None else valid[:, 1:].contiguous()
    assert not rc.vector_loads(view) and rc.vector_loads(copy)
    assert torch.equal(_gpu_select(q, view, channels, vvalid, k), _gpu_select(q, copy, channels, vvalid, k))


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("name", list(RADIX_TIE_CASES))
def test_cuda_select_exact_ties(name):
    """Integer scores (exact in any summation order, many ties): exactly the stable sort, in token order, and the
    fused Triton select's indices in the same order."""
    q, lab, channels, valid, k = tie_case(name)
    scores = reference.label_scores(q.float(), Labels(lab.float()), channels, valid)
    want = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k].sort(-1).values
    labels = channel_major(Labels(lab.cuda()))
    got = _gpu_select(q.cuda(), labels, channels.cuda(), valid.cuda(), k)
    assert torch.equal(got.cpu(), want)
    fused = triton_kernel.select_topk(q.cuda(), labels, channels.cuda(), valid.cuda(), k, config={"method": "fused"})
    assert torch.equal(got, fused)
    if torch.cuda.get_device_capability()[0] >= 9:
        for c in (1, 2, 4, 8):
            assert torch.equal(_gpu_select(q.cuda(), labels, channels.cuda(), valid.cuda(), k, cluster=c), got), c


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("name", list(RADIX_TIE_CASES))
def test_cuda_select_sums_each_group_of_query_heads(name):
    """group = G (one selection per kv head) and group = 2: the kernels add a group's query rows as they load them -
    exactly the stable sort of the summed integer scores, the fused select's indices, and the same indices as the
    select on the query summed beforehand (two kernels, and clusters of 1, 2 and 8)."""
    q, lab, channels, valid, k = tie_case(name)
    g = q.shape[1] // channels.shape[0]
    labels = channel_major(Labels(lab.cuda()))
    for group in sorted({g, 2} if g % 2 == 0 else {g}):
        summed = reference.group_query(q, group)
        scores = reference.label_scores(summed, Labels(lab.float()), channels, valid)
        want = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k].sort(-1).values
        got = _gpu_select(q.cuda(), labels, channels.cuda(), valid.cuda(), k, group=group)
        assert got.shape == (q.shape[0], q.shape[1] // group, k)
        assert torch.equal(got.cpu(), want), group
        assert torch.equal(got, _gpu_select(summed.cuda(), labels, channels.cuda(), valid.cuda(), k))
        fused = triton_kernel.select_topk(q.cuda(), labels, channels.cuda(), valid.cuda(), k,
                                          config={"method": "fused"}, group=group)
        assert torch.equal(got, fused), group
        if torch.cuda.get_device_capability()[0] >= 9:
            for c in (1, 2, 8):
                assert torch.equal(_gpu_select(q.cuda(), labels, channels.cuda(), valid.cuda(), k, group=group,
                                               cluster=c), got), (group, c)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("cluster", [0, 8])
def test_cuda_select_replays_in_a_cuda_graph(cluster):
    """Captured once, replayed on a new query in place: the same indices as an eager call on that query (the two
    kernels, and the cluster select's one launch)."""
    if cluster and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread-block clusters need sm_90")
    q, labels, channels, valid, k = long_case("4bit-gqa3-33333-pad")
    static_q = q.clone()
    _gpu_select(static_q, labels, channels, valid, k, cluster=cluster)  # build + warm up outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _gpu_select(static_q, labels, channels, valid, k, cluster=cluster)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _gpu_select(static_q, labels, channels, valid, k, cluster=cluster)
    new_q = torch.randn_like(q)
    static_q.copy_(new_q)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, _gpu_select(new_q, labels, channels, valid, k, cluster=cluster))


def test_every_cuda_source_ships_with_the_package():
    """Each ``.cu`` file under kernels/ is package data of its package (the kernels compile it at first use from the
    installed package)."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for cu in (root / "kernels").rglob("*.cu"):
        package = "kvcompress.kernels." + ".".join(cu.parent.relative_to(root / "kernels").parts)
        assert "*.cu" in data.get(package, []), f"{cu.name}: add '*.cu' to package-data of {package}"


def test_instrumented_build_is_separate_and_checked():
    """``build(defines)`` takes only the listed preprocessor names (the phase-clock build of
    benchmarks/gpu_cluster_phases.py), and its nvcc line defines them; the default line defines none."""
    with pytest.raises(ValueError, match="allowed \\['DS_PHASES'\\]"):
        rc.build(("DS_PHASE",))
    assert "-DDS_PHASES" in rc.nvcc_command("x.so", ("DS_PHASES",))
    assert not any(a.startswith("-D") for a in rc.nvcc_command("x.so"))
