"""Programmatic dependent launch (PDL, opt-in ``pdl`` in the lanes, paged and DoubleSparse kernel configurations).

A split kernel's programs signal ``griddepcontrol.launch_dependents`` as they start; the merge after it (and the
DoubleSparse gather after its select) is launched with the PDL attribute and waits in ``griddepcontrol.wait`` before
it touches global memory - before any load *and* any store: a PDL-launched kernel runs while its predecessor does, and
the caching allocator may hand it memory the predecessor still reads.  No GPU here: each wrapper runs on CPU tensors
with its Triton kernels replaced by recorders (``tests/triton_offline.py``), and every launch it makes is compiled
with Triton's real pipeline for sm_90; the checks read the PTX.  The GPU tests (marker ``gpu``) compare the PDL reads,
eager and replayed from a CUDA graph, with the reference.
"""

from __future__ import annotations

import re

import pytest
import torch

from triton_offline import compile_launch, record_launches

pytest.importorskip("triton")


def _first(ptx: str, pattern: str) -> int:
    found = re.search(pattern, ptx)
    return found.start() if found else len(ptx)


def _check(launches, primaries: set[str], waiters: set[str], pdl: bool) -> dict[str, str]:
    """Compile every launch; primaries trigger before their first global access, waiters (launched with PDL) wait
    before theirs; without ``pdl`` nothing of either.  Returns the PTX by kernel name."""
    ptxs = {}
    for launch in launches:
        name = launch.fn.fn.__name__
        ptx = compile_launch(launch).asm["ptx"]
        ptxs[name] = ptx
        access = min(_first(ptx, r"\bld\.global"), _first(ptx, r"\bst\.global"), _first(ptx, r"cp\.async"))
        trig, wait = ptx.count("griddepcontrol.launch_dependents"), ptx.count("griddepcontrol.wait")
        assert launch.kwargs.get("launch_pdl", False) == (pdl and name in waiters), name
        assert trig == int(pdl and name in primaries), (name, trig)
        assert wait == int(pdl and name in waiters), (name, wait)
        if pdl and name in primaries:
            assert ptx.index("griddepcontrol.launch_dependents") < access, name
        if pdl and name in waiters:
            assert ptx.index("griddepcontrol.wait") < access, name
    assert primaries | waiters <= set(ptxs) or not pdl, (sorted(ptxs), primaries, waiters)
    return ptxs


def _force_pdl(monkeypatch, *modules):
    """The CPU is no Hopper GPU: ``use_pdl`` answers as it would on one (configuration decides)."""
    for module in modules:
        monkeypatch.setattr(module, "use_pdl", lambda enabled, device: bool(enabled))


@pytest.mark.parametrize("pdl", [False, True])
def test_lanes_kernel_and_its_merge(monkeypatch, pdl):
    from kvcompress.kernels.leank import triton_kernel
    from kvcompress.kernels.leank.reference import Lane

    _force_pdl(monkeypatch, triton_kernel)
    gen = torch.Generator().manual_seed(0)
    b, h, m, d, t = 1, 2, 4, 64, 300
    kv = [torch.randn(b, h, t, d, generator=gen).half() for _ in range(2)]
    q = torch.randn(b, h, m, d, generator=gen).half()
    lanes = [Lane(None, None, *kv, torch.ones(b, t, dtype=torch.bool))]
    kernels = [(triton_kernel, n) for n in ("_lanes_kernel", "_combine_kernel", "_combine_splits_kernel")]
    for combine in ("splits", "loop"):
        launches = record_launches(monkeypatch, kernels, lambda: triton_kernel.grouped_partial_attention(
            q, lanes, 0.125, splits=3, config={"pdl": pdl, "combine": combine}))
        merge = "_combine_splits_kernel" if combine == "splits" else "_combine_kernel"
        assert [x.fn.fn.__name__ for x in launches] == ["_lanes_kernel", merge]
        _check(launches, {"_lanes_kernel"}, {merge}, pdl)


@pytest.mark.parametrize("pdl", [False, True])
def test_paged_kernel_and_the_shared_merge(monkeypatch, pdl):
    from kvcompress.kernels.attention import triton_shared
    from kvcompress.kernels.paged import triton_kernel

    _force_pdl(monkeypatch, triton_kernel)
    gen = torch.Generator().manual_seed(1)
    b, h, m, d, p, pages = 2, 2, 4, 64, 16, 12
    q = torch.randn(b, h, m, d, generator=gen).half()
    k = torch.randn(pages, h, p, d, generator=gen).half()
    v = torch.randn(pages, h, p, d, generator=gen).half()
    valid = torch.ones(pages, p, dtype=torch.bool)
    table = torch.arange(pages, dtype=torch.int32).view(b, pages // b)
    launches = record_launches(
        monkeypatch, [(triton_kernel, "_paged_split_kernel"), (triton_shared, "_combine_tiles_kernel")],
        lambda: triton_kernel._forward(q, k, v, valid, table, 0.125, splits=3,
                                       base={**triton_kernel._config(), "pdl": pdl}))
    assert [x.fn.fn.__name__ for x in launches] == ["_paged_split_kernel", "_combine_tiles_kernel"]
    _check(launches, {"_paged_split_kernel"}, {"_combine_tiles_kernel"}, pdl)


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("shared, rows_dot", [(False, True), (False, False), (True, True)])
def test_doublesparse_gather_waits_for_the_select_and_triggers_its_merge(monkeypatch, pdl, shared, rows_dot):
    from kvcompress.kernels.attention import triton_shared
    from kvcompress.kernels.doublesparse import triton_kernel

    _force_pdl(monkeypatch, triton_kernel)
    gen = torch.Generator().manual_seed(2)
    b, h, m, t, d, kk = 1, 2, 4, 600, 64, 400  # 2-3 splits of 64- or 128-index blocks
    k = torch.randn(b, h, t, d, generator=gen).half()
    v = torch.randn(b, h, t, d, generator=gen).half()
    q = torch.randn(b, h, m, d, generator=gen).half()
    if shared:
        index = torch.stack([torch.randperm(t, generator=gen)[:kk] for _ in range(b * h)]).view(b, h, 1, kk)
        index = index.expand(b, h, m, kk)
    else:
        index = torch.stack([torch.randperm(t, generator=gen)[:kk] for _ in range(b * h * m)]).view(b, h, m, kk)
    names = ["_gather_shared_kernel" if shared else "_gather_rows_dot_kernel" if rows_dot else "_gather_kernel"]
    launches = record_launches(
        monkeypatch, [(triton_kernel, n) for n in names] + [(triton_shared, "_combine_tiles_kernel")],
        lambda: triton_kernel.gather_partial_attention(q, k, v, None, index, 0.125, splits=3,
                                                       config={"pdl": pdl, "rows_dot": rows_dot}))
    assert [x.fn.fn.__name__ for x in launches] == names + ["_combine_tiles_kernel"]
    _check(launches, set(names), set(names) | {"_combine_tiles_kernel"}, pdl)


@pytest.mark.parametrize("pdl", [False, True])
def test_doublesparse_fused_select_lets_the_gather_start(monkeypatch, pdl):
    """The fused select (one chunk; chunks + merge) signals its dependents as its programs start."""
    from kvcompress.kernels.doublesparse import triton_kernel
    from kvcompress.kernels.doublesparse.reference import Labels

    _force_pdl(monkeypatch, triton_kernel)
    gen = torch.Generator().manual_seed(3)
    b, hq, h, t, r, kk = 1, 4, 2, 300, 16, 40
    q = torch.randn(b, hq, 64, generator=gen).half()
    channels = torch.stack([torch.randperm(64, generator=gen)[:r] for _ in range(h)])
    labels = Labels(torch.randn(b, h, r, t, generator=gen).half().transpose(-1, -2))  # channel-major, as the cache
    kernels = [(triton_kernel, n) for n in ("_select_kernel", "_merge_kernel", "_merge_level_kernel")]
    for chunk in (None, 128):
        cfg = {"pdl": pdl, "method": "fused", **({"chunk_tokens": chunk} if chunk else {})}
        launches = record_launches(monkeypatch, kernels, lambda: triton_kernel.select_topk(
            q, labels, channels, None, kk, config=cfg))
        names = [x.fn.fn.__name__ for x in launches]
        assert names == (["_select_kernel"] if chunk is None else ["_select_kernel", "_merge_kernel"])
        _check(launches, set(names), set(), pdl)


def test_doublesparse_pdl_auto_follows_the_query_rows(monkeypatch):
    """DoubleSparse's default ``pdl: "auto"``: PDL up to ``PDL_AUTO_ROWS`` query rows (batch x query heads), where it
    was faster on the H200, plain launches above; the select and the gather decide alike from the same rows (a gather
    launched with PDL waits; one launched plainly behind a triggering select is simply ordered), and the recorded
    launches of a whole read carry the decision into the compiled PTX."""
    from kvcompress.kernels.attention import triton_shared
    from kvcompress.kernels.doublesparse import triton_kernel

    assert triton_kernel.SELECT_CONFIG["pdl"] == "auto" == triton_kernel.GATHER_CONFIG["pdl"]
    monkeypatch.setattr(triton_kernel, "use_pdl", lambda enabled, device: bool(enabled))
    rows = triton_kernel.PDL_AUTO_ROWS
    assert triton_kernel.pdl_for("auto", rows, torch.device("cuda", 0))
    assert not triton_kernel.pdl_for("auto", rows + 1, torch.device("cuda", 0))
    assert triton_kernel.pdl_for(True, 10 * rows, torch.device("cuda", 0))
    assert not triton_kernel.pdl_for(False, 1, torch.device("cuda", 0))
    with pytest.raises(ValueError, match="pdl must be true, false or \"auto\", got 'yes'"):
        triton_kernel.pdl_for("yes", 1, torch.device("cuda", 0))
    gen = torch.Generator().manual_seed(4)
    for b, expect in ((1, True), (24, False)):  # 4 query rows per batch row: 4 and 96 rows
        h, m, t, d, kk = 2, 2, 600, 64, 400
        k, v = (torch.randn(b, h, t, d, generator=gen).half() for _ in range(2))
        q = torch.randn(b, h, m, d, generator=gen).half()
        index = torch.stack([torch.randperm(t, generator=gen)[:kk] for _ in range(b * h * m)]).view(b, h, m, kk)
        names = ["_gather_rows_dot_kernel", "_combine_tiles_kernel"]
        launches = record_launches(
            monkeypatch, [(triton_kernel, names[0]), (triton_shared, names[1])],
            lambda: triton_kernel.gather_partial_attention(q, k, v, None, index, 0.125, splits=3))
        assert [x.fn.fn.__name__ for x in launches] == names
        _check(launches, {names[0]}, set(names), expect)


def test_use_pdl_needs_a_hopper_gpu_and_the_option(monkeypatch):
    from kvcompress.kernels.attention import triton_shared

    assert not triton_shared.use_pdl(True, torch.device("cpu"))  # the interpreter never takes it
    monkeypatch.setattr(triton_shared, "_pdl_capable", lambda index: index == 0)
    assert triton_shared.use_pdl(True, torch.device("cuda", 0))
    assert not triton_shared.use_pdl(False, torch.device("cuda", 0))
    assert not triton_shared.use_pdl(True, torch.device("cuda", 1))  # an sm_80 device: no griddepcontrol
    assert triton_shared.pdl_launch(True) == {"launch_pdl": True} and triton_shared.pdl_launch(False) == {}


# ----------------------------------------------------------------------------- GPU


def _reads(device="cuda"):
    """``name -> read(q, pdl)`` over fixed inputs: the lanes kernel (3 splits, one lane and a LeanK-style pair), the
    paged kernel, the DoubleSparse select + gather (per row and group-shared)."""
    from kvcompress.kernels.doublesparse import triton_kernel as ds
    from kvcompress.kernels.doublesparse.reference import Labels
    from kvcompress.kernels.leank import triton_kernel as lk
    from kvcompress.kernels.leank.reference import Lane
    from kvcompress.kernels.paged import triton_kernel as pg

    gen = torch.Generator(device=device).manual_seed(5)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device).half()

    b, h, m, d, t = 2, 4, 4, 128, 3000
    lanes = [Lane(None, None, rnd(b, h, t, d), rnd(b, h, t, d), torch.rand(b, t, generator=gen, device=device) > 0.1),
             Lane(torch.tensor([3, 1], device=device), torch.arange(0, 128, 2, device=device).expand(2, 64),
                  rnd(b, 2, 999, 64), rnd(b, 2, 999, d), None)]
    p, pages = 16, 2 * 200
    kp, vp = rnd(pages, h, p, d), rnd(pages, h, p, d)
    pvalid = torch.rand(pages, p, generator=gen, device=device) > 0.05
    table = torch.randperm(pages, generator=gen, device=device).int().view(b, 200)
    labels = Labels(rnd(b, h, 16, t).transpose(-1, -2))
    channels = torch.stack([torch.randperm(d, generator=gen, device=device)[:16] for _ in range(h)])
    kk, vv = rnd(b, h, t, d), rnd(b, h, t, d)

    def doublesparse(q, pdl, group):
        cfg = {"pdl": pdl}
        index = ds.select_topk(q.reshape(b, h * m, d), labels, channels, None, 200, config=cfg,
                               group=m if group else 1)
        index = index.view(b, h, 1, 200).expand(b, h, m, 200) if group else index.view(b, h, m, 200)
        return ds.gather_partial_attention(q, kk, vv, None, index, d ** -0.5, config=cfg)

    return {
        "lanes": lambda q, pdl: lk.grouped_partial_attention(q, lanes, d ** -0.5, splits=3, config={"pdl": pdl}),
        "paged": lambda q, pdl: pg._forward(q, kp, vp, pvalid, table, d ** -0.5, base={**pg._config(), "pdl": pdl}),
        "ds-rows": lambda q, pdl: doublesparse(q, pdl, False),
        "ds-shared": lambda q, pdl: doublesparse(q, pdl, True),
    }, (b, h, m, d)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a GPU of compute capability 9.0 or newer")
@pytest.mark.parametrize("name", ["lanes", "paged", "ds-rows", "ds-shared"])
def test_pdl_reads_equal_plain_reads_eager_and_replayed(name):
    """With PDL every read gives exactly the plain launches' result (the same kernels and arithmetic), eagerly and
    replayed from a CUDA graph after its query changed in place (the capture keeps the programmatic edges)."""
    reads, (b, h, m, d) = _reads()
    read = reads[name]
    gen = torch.Generator(device="cuda").manual_seed(9)
    q = torch.randn(b, h, m, d, generator=gen, device="cuda").half()
    plain = read(q, False)
    fast = read(q, True)
    assert all(torch.equal(x, y) for x, y in zip(fast, plain))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        read(q, True)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = read(q, True)
    for _ in range(3):
        q.copy_(torch.randn(b, h, m, d, generator=gen, device="cuda").half())
        graph.replay()
        want = read(q, False)
        assert all(torch.equal(x, y) for x, y in zip(captured, want))


@pytest.mark.parametrize("lanes", [False, True])
def test_kivi_cuda_kernels_trigger_and_their_combine_waits(tmp_path, lanes):
    """The hand-written KIVI kernels (plain and lanes, with their buffer CTAs) signal ``launch_dependents`` as they
    start, and the split combine (every output dtype) waits before its first global access - in the sm_90a PTX; the
    sm_80 PTX has neither (``griddepcontrol`` is Hopper PTX: the device functions compile to nothing there)."""
    from kvcompress.kernels.kivi import cuda_kernel as ck

    if ck.nvcc_path() is None:
        pytest.skip("needs nvcc")
    import subprocess

    defines = ["-DKIVI_BITS=2", "-DKIVI_DK=128", "-DKIVI_DV=128", "-DKIVI_MIN_BLOCKS=4", "-DKIVI_KFOLD=0",
               "-DKIVI_VFOLD=0", "-DKIVI_PROBE=0", "-DKIVI_SOFTCAP=0"]
    if lanes:
        defines += ["-DKIVI_LANES=1", "-DKIVI_QDIM=128", "-DKIVI_LANE_DK0=64", "-DKIVI_LANE_DK1=128"]
    for arch in ("90a", "80"):
        out = tmp_path / f"k{arch}.ptx"
        res = subprocess.run([ck.nvcc_path(), "-std=c++17", "-ptx", f"-arch=compute_{arch}", *defines, "-o", str(out),
                              str(ck.SOURCE)], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-3000:]
        ptx = out.read_text()
        bodies = re.split(r"\.entry\s+", ptx)[1:]
        entries = {body.split("(", 1)[0]: body for body in bodies}
        split = [n for n in entries if ("kivi_v3_lanes_kernel" if lanes else "kivi_v3_kernel") in n]
        combine = [n for n in entries if "kivi_v3_combine" in n]
        assert split and len(combine) == 3, sorted(entries)
        for name in split + combine:
            body = entries[name]
            access = min(_first(body, r"\bld\.global"), _first(body, r"\bst\.global"), _first(body, r"cp\.async"))
            want = "griddepcontrol.launch_dependents" if name in split else "griddepcontrol.wait"
            if arch == "80":
                assert "griddepcontrol" not in body, name
            else:
                assert body.count(want) == 1 and "griddepcontrol" not in body.replace(want, ""), name
                assert body.index(want) < access, name  # before the first global load, store or async copy


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a GPU of compute capability 9.0 or newer")
@pytest.mark.parametrize("out_dtype", [None, torch.float16])
def test_kivi_cuda_pdl_combine_equals_the_plain_launch_eager_and_replayed(out_dtype):
    """KIVI-2 through the CUDA kernel (64 splits at batch 1) with ``pdl``: exactly the plain launch's result, eagerly and
    replayed from a CUDA graph after the query changed in place; also with the combine storing fp16."""
    from kvcompress.kernels.kivi import cuda_kernel as ck
    from kvcompress.kernels.kivi.reference import PackedKV, quantize_keys, quantize_values

    if ck.nvcc_path() is None:
        pytest.skip("needs nvcc")
    gen = torch.Generator(device="cuda").manual_seed(11)
    b, h, m, d, t = 1, 8, 4, 128, 32768
    kc, ks, kz = quantize_keys(torch.randn(b, h, t, d, generator=gen, device="cuda"), 2, 32)
    vc, vs, vz = quantize_values(torch.randn(b, h, t, d, generator=gen, device="cuda"), 2, 32)
    packed = PackedKV(2, 32, kc, ks, kz, vc, vs, vz, torch.ones(b, t, dtype=torch.bool, device="cuda"))
    q = torch.randn(b, h, m, d, generator=gen, device="cuda").half()

    def read(pdl):
        return ck._forward(q, packed, d ** -0.5, base={**ck.config(2), "pdl": pdl}, out_dtype=out_dtype)

    plain = read(False)
    assert all(torch.equal(x, y) for x, y in zip(read(True), plain))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        read(True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = read(True)
    for _ in range(3):
        q.copy_(torch.randn(b, h, m, d, generator=gen, device="cuda").half())
        graph.replay()
        assert all(torch.equal(x, y) for x, y in zip(captured, read(False)))
