"""The Triton paged decode kernel against the PyTorch reference (kernels/paged/reference.py).

On a CPU-only machine the kernel runs under the Triton interpreter.  ``TRITON_INTERPRET`` must be
set before Triton's ``@jit`` decorators run, so the cases run in ONE worker subprocess (this file
executed as a script) with that variable set.  Each case is one pytest test reading the worker's
result.  With CUDA present, ``test_cases_on_gpu`` runs the same cases natively (marker ``gpu``).

Pages are fp16 (the interpreter computes bf16 ``tl.dot`` wrongly, triton#11584) or fp32.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from interpreter import collect
from interpreter import interpreted as run_interpreted

# name -> (batch, kv_heads, rows M, Dk, Dv, page size P, pool pages, table width, dtype, extras)
CASES = {
    "b2-gqa4-p16-holes-invalid-slots": (2, 2, 4, 64, 64, 16, 12, 5, "float16", {"short_row": 2}),
    "b1-fp32-p32-dk48-rows12-one-split": (1, 1, 12, 48, 64, 32, 6, 4, "float32", {"splits": 1}),
    "b2-p16-uneven-splits": (2, 1, 3, 64, 64, 16, 20, 9, "float16", {"splits": 3}),
    "b2-all-invalid-row": (2, 2, 4, 32, 32, 16, 8, 3, "float16", {"dead_row": 1}),
    "b1-rows80-two-row-blocks": (1, 1, 80, 64, 64, 16, 4, 2, "float16", {}),
    "b2-p64-one-page-per-step": (2, 1, 4, 64, 64, 64, 6, 3, "float16", {"pages_per_step": 1}),
    "b2-strided-query": (2, 2, 4, 64, 64, 16, 8, 4, "float16", {"strided": True}),
    "pool-after-eviction": (2, 2, 4, 64, 64, 16, 0, 0, "float16", {"pool": True}),
    # a launch configuration other than the default (what KVCOMPRESS_PAGED_CONFIG / ops pass as ``base``)
    "b2-p16-config-base": (2, 2, 4, 64, 64, 16, 20, 9, "float16",
                           {"base": {"pages_per_step": 8, "num_warps": 8, "num_stages": 3, "waves": 1}}),
    # NaN / inf written into the slots the flags mark dead (and into unused pool pages): none may reach the output
    "b2-p16-poisoned-dead-slots": (2, 2, 4, 64, 64, 16, 20, 9, "float16", {"poison": True, "splits": 2}),
    # a merge over more splits than one step of the tile merge folds (COMBINE_TILE_SPLITS = 32): 70 one-page splits
    # (3 steps, the last short); with a short row and a dead row, whole steps of empty partials
    "b1-p16-seventy-splits": (1, 2, 4, 32, 32, 16, 72, 70, "float32", {"splits": 70, "pages_per_step": 1}),
    "b3-p16-forty-splits-dead-row": (3, 1, 3, 32, 48, 16, 130, 40, "float16",
                                     {"splits": 40, "pages_per_step": 1, "short_row": 9, "dead_row": 2}),
    # page ids loaded TSTEPS steps at a time (``table_steps``): whole and cut blocks, a short and a dead row, poison
    "b3-p16-table-steps": (3, 2, 4, 64, 64, 16, 60, 17, "float16",
                           {"splits": 2, "short_row": 3, "dead_row": 2, "poison": True,
                            "base": {"pages_per_step": 2, "num_warps": 4, "num_stages": 2, "waves": 1,
                                     "table_steps": 4}}),
    # valid_late: the K copies masked by the page only - NaN keys and inf values in dead slots, a dead and a short
    # row, with and without page ids a block at a time
    "b3-p16-valid-late-poisoned": (3, 2, 4, 64, 64, 16, 60, 17, "float16",
                                   {"splits": 2, "short_row": 3, "dead_row": 2, "poison": True,
                                    "base": {"pages_per_step": 2, "num_warps": 4, "num_stages": 2, "waves": 1,
                                             "table_steps": 4, "valid_late": True}}),
    "b2-p16-valid-late-poisoned-step-loop": (2, 2, 4, 64, 64, 16, 20, 9, "float16",
                                             {"poison": True, "splits": 2,
                                              "base": {"num_warps": 4, "num_stages": 2, "waves": 1, "table_steps": 0,
                                                       "valid_late": True}}),
    # valid_block: the flags of a block of steps loaded with its page ids (whole and cut blocks, poison, a dead and a
    # short row; with and without valid_late)
    "b3-p16-valid-block-poisoned": (3, 2, 4, 64, 64, 16, 60, 17, "float16",
                                    {"splits": 2, "short_row": 3, "dead_row": 2, "poison": True,
                                     "base": {"pages_per_step": 2, "num_warps": 4, "num_stages": 2, "waves": 1,
                                              "table_steps": 4, "valid_block": True}}),
    "b3-p16-valid-block-late-poisoned": (3, 2, 4, 64, 64, 16, 60, 17, "float16",
                                         {"splits": 3, "short_row": 3, "dead_row": 2, "poison": True,
                                          "base": {"pages_per_step": 1, "num_warps": 4, "num_stages": 2, "waves": 1,
                                                   "table_steps": 8, "valid_block": True, "valid_late": True}}),
    # a live length mid-page (slots after it dead, their pages not read): the step loop and valid_block's flags
    "b3-p16-length-mid-page": (3, 2, 4, 64, 64, 16, 60, 17, "float16",
                               {"splits": 2, "poison": True, "length": 203}),
    "b3-p16-length-valid-block": (3, 2, 4, 64, 64, 16, 60, 17, "float16",
                                  {"splits": 2, "poison": True, "length": 203,
                                   "base": {"pages_per_step": 2, "num_warps": 4, "num_stages": 2, "waves": 1,
                                            "table_steps": 4, "valid_block": True}}),
    # bf16_scale_in_exponent "all" (session 57): the query enters the dot as given and the scale rides in the exponent
    # (unscaled running maximum, scaled at the end) - on fp16 and fp32 pages, which the interpreter can run (its
    # bf16 dots are unusable): page ids a block at a time with a short and a dead row and poison, the step loop with a
    # live length, many splits
    "b3-p16-scale-exponent-table-steps": (3, 2, 4, 64, 64, 16, 60, 17, "float16",
                                          {"splits": 2, "short_row": 3, "dead_row": 2, "poison": True,
                                           "base": {"pages_per_step": 2, "num_warps": 4, "num_stages": 2, "waves": 1,
                                                    "table_steps": 4, "bf16_scale_in_exponent": "all"}}),
    "b3-p16-scale-exponent-step-loop-length": (3, 2, 4, 64, 64, 16, 60, 17, "float16",
                                               {"splits": 2, "poison": True, "length": 203,
                                                "base": {"num_warps": 4, "num_stages": 2, "waves": 1,
                                                         "table_steps": 0, "bf16_scale_in_exponent": "all"}}),
    "b1-p16-scale-exponent-fp32-splits": (1, 2, 4, 32, 32, 16, 40, 30, "float32",
                                          {"splits": 7, "pages_per_step": 1,
                                           "base": {"num_warps": 4, "num_stages": 2, "waves": 1, "table_steps": 4,
                                                    "bf16_scale_in_exponent": "all"}}),
}
ATOL, RTOL, LSE_ATOL = 3e-3, 1e-2, 2e-3


def _from_pool(gen, b, h, m, dk, dtype):
    """Query + tensors of a real PagedStore after prefill packing, appends, retain and eviction."""
    from kvcompress.paged import PagedStore
    from kvcompress.state import KVBlock

    store = PagedStore(16)
    for start, t in ((0, 70), (70, 16), (86, 16), (102, 32)):
        valid = torch.rand(b, t, generator=gen) > 0.2
        k = torch.randn(b, h, t, dk, generator=gen).to(dtype)
        v = torch.randn(b, h, t, dk, generator=gen).to(dtype)
        store.append(KVBlock(k, v, valid, torch.arange(start, start + t)))
        if start == 70:
            store.evict([(0, 1), (1, 0)])
    keep = store.valid_mask() & (torch.rand(store.valid_mask().shape, generator=gen) > 0.3)
    keep[1, :16] = False
    store.retain(keep)
    (bufs,) = [lane for _, lane in store.lanes]
    q = torch.randn(b, h, m, dk, generator=gen).to(dtype)
    return q, bufs["k"], bufs["v"], store.valid, store.table(), store


def make_case(name: str, device: str = "cpu"):
    b, h, m, dk, dv, p, n_pages, width, dtype, extra = CASES[name]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    dt = getattr(torch, dtype)
    if extra.get("pool"):
        q, k, v, valid, table, _ = _from_pool(gen, b, h, m, dk, dt)
    else:
        q = torch.randn(b, h, m, dk, generator=gen).to(dt)
        k = (torch.randn(n_pages, h, p, dk, generator=gen) * 1.5 + 0.3).to(dt)
        v = torch.randn(n_pages, h, p, dv, generator=gen).to(dt)
        valid = torch.rand(n_pages, p, generator=gen) > 0.15
        perm = torch.randperm(n_pages, generator=gen)
        table = torch.full((b, width), -1, dtype=torch.int32)
        used = 0
        for row in range(b):
            n = width - extra.get("short_row", 0) * row
            table[row, :n] = perm[used:used + n].int()
            used += n
        if "dead_row" in extra:
            table[extra["dead_row"]] = -1
        if extra.get("poison"):  # dead slots hold NaN keys and inf values, pages no row uses NaN
            extra = dict(extra, clean=(k.clone(), v.clone()))
            dead = ~valid
            k[dead.nonzero(as_tuple=True)[0], :, dead.nonzero(as_tuple=True)[1]] = float("nan")
            v[dead.nonzero(as_tuple=True)[0], :, dead.nonzero(as_tuple=True)[1]] = float("inf")
            unused = torch.ones(n_pages, dtype=torch.bool)
            unused[table[table >= 0].long()] = False
            k[unused], v[unused] = float("nan"), float("nan")
        if extra.get("strided"):
            q = q.transpose(1, 2).contiguous().transpose(1, 2)
    return tuple(x.to(device) for x in (q, k, v, valid, table)), extra


def run_case(name: str, device: str = "cpu") -> dict:
    from kvcompress.kernels.paged import triton_kernel
    from kvcompress.kernels.paged.reference import paged_attention_partial

    (q, k, v, valid, table), extra = make_case(name, device)
    scale = q.shape[-1] ** -0.5
    length = torch.tensor(extra["length"], device=device) if "length" in extra else None  # live slots (a device int)
    out, lse = triton_kernel._forward(q, k, v, valid, table, scale, splits=extra.get("splits"),
                                      pages_per_step=extra.get("pages_per_step"), base=extra.get("base"),
                                      length=length)
    if extra.get("poison"):  # the oracle reads the pool as it was before its dead slots were poisoned
        k, v = (x.to(device) for x in extra["clean"])
    ref_out, ref_lse = paged_attention_partial(q, k, v, valid, table, scale, length=length)
    finite = torch.isfinite(ref_lse)
    return {
        "shape_out": list(out.shape), "dtype_out": str(out.dtype), "dtype_lse": str(lse.dtype),
        "same_inf": bool(torch.equal(torch.isfinite(lse), finite)),
        "out_err": float((out - ref_out).abs().max()),
        "out_tol_ok": bool(torch.allclose(out, ref_out, atol=ATOL, rtol=RTOL)),
        "lse_err": float((lse[finite] - ref_lse[finite]).abs().max()) if bool(finite.any()) else 0.0,
        "dead_rows_zero": bool((out[~finite] == 0).all()),
        "any_nan": bool(torch.isnan(out).any() or torch.isnan(lse).any()),
        "any_dead": bool((~finite).any()),
    }


def _worker(path: str) -> None:
    collect({name: (lambda n=name: run_case(n)) for name in CASES}, path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return run_interpreted(__file__, tmp_path_factory.mktemp("paged"), OMP_NUM_THREADS="1")


def _check(res: dict, name: str) -> None:
    assert "error" not in res, res.get("error")
    b, h, m, dk, dv, *_ = CASES[name]
    assert res["shape_out"] == [b, h, m, dv]
    assert res["dtype_out"] == res["dtype_lse"] == "torch.float32"
    assert not res["any_nan"]
    assert res["same_inf"], "-inf LSE exactly where no key is valid"
    assert res["dead_rows_zero"]
    assert res["out_tol_ok"], f"max |out - ref| = {res['out_err']:.2e}"
    assert res["lse_err"] <= LSE_ATOL, f"max |lse - ref| = {res['lse_err']:.2e}"
    if "dead_row" in CASES[name][-1]:
        assert res["any_dead"]


@pytest.mark.parametrize("name", list(CASES))
def test_case_interpreted(interpreted, name):
    _check(interpreted[name], name)


def test_pool_view_reads_what_it_stores():
    """The store's paged view (reference path) equals attention over its dequantized copy."""
    from kvcompress.kernels.attention.reference import partial_attention

    gen = torch.Generator().manual_seed(5)
    q, *_, store = _from_pool(gen, 2, 2, 4, 32, torch.float32)
    (seg,) = store.segments()
    out, lse = seg.packed.attention_partial(q, 0.2)
    k, v = seg.packed.dequantize()
    ref_out, ref_lse = partial_attention(q, k, v, seg.valid[:, None, None, :], 0.2)
    assert torch.allclose(out, ref_out, atol=1e-6) and torch.allclose(lse, ref_lse, atol=1e-6)
    assert seg.heads.tolist() == [0, 1] and seg.valid.shape == (2, store.table().shape[1] * 16)


def test_invalid_arguments_raise():
    from kvcompress.kernels.paged import triton_kernel

    (q, k, v, valid, table), _ = make_case("b2-gqa4-p16-holes-invalid-slots")
    with pytest.raises(ValueError, match="page size"):
        triton_kernel._forward(q, k[:, :, :12], v[:, :, :12], valid[:, :12], table, 0.1)
    with pytest.raises(ValueError, match="k_pages"):
        triton_kernel._forward(q[..., :32], k, v, valid, table, 0.1)
    with pytest.raises(ValueError, match="block_table"):
        triton_kernel._forward(q, k, v, valid, table[:1], 0.1)


def test_launch_config_reads_the_environment_once_through_ops(monkeypatch):
    """``KVCOMPRESS_PAGED_CONFIG`` overrides the launch defaults (JSON entries); the ops read it once (cached)."""
    from kvcompress.kernels import ops
    from kvcompress.kernels.paged import triton_kernel

    default = {"pages_per_step": None, "num_warps": 4, "num_stages": None, "waves": 1, "table_steps": 16, "pdl": False,
               "valid_late": False, "valid_block": False, "bf16_scale_in_exponent": True}
    assert triton_kernel._config() == default
    monkeypatch.setenv("KVCOMPRESS_PAGED_CONFIG", '{"num_stages": 3, "pages_per_step": 8}')
    assert triton_kernel._config() == {**default, "pages_per_step": 8, "num_stages": 3}
    ops._paged_base.cache_clear()
    try:
        first = ops._paged_base()
        monkeypatch.setenv("KVCOMPRESS_PAGED_CONFIG", '{"num_stages": 4}')
        assert ops._paged_base() is first and first["num_stages"] == 3
    finally:
        ops._paged_base.cache_clear()


@pytest.mark.parametrize("env,message", [
    ('{"table_step": 16}', r"unknown entries \['table_step'\]; known: \['bf16_scale_in_exponent', 'num_stages', "
                           r"'num_warps', 'pages_per_step', 'pdl', 'table_steps', 'valid_block', 'valid_late', "
                           r"'waves'\]"),
    ('{"bf16_scale_in_exponent": "yes"}', r"bf16_scale_in_exponent: expected one of false, true, \"all\", got 'yes'"),
    ('{"table_steps": 3}', r"table_steps must be null, 0 or a power of two, got 3"),
    ('{"pages_per_step": 2.0}', r"pages_per_step must be null, 0 or a power of two, got 2.0"),
    ('{"num_warps": 0}', r"num_warps must be a power of two, got 0"),
    ('{"num_warps": true}', r"num_warps must be a power of two, got True"),
    ('{"valid_block": true, "table_steps": 0}', r"valid_block .* needs table_steps > 1, got table_steps 0"),
])
def test_launch_config_refuses_entries_the_kernel_cannot_build(monkeypatch, env, message):
    """A misspelt entry or a block size the kernel cannot build is named, with what is allowed, before any launch
    (a non-power-of-two block would otherwise fail inside Triton's compiler, and a misspelt key be ignored)."""
    from kvcompress.kernels.paged import triton_kernel

    monkeypatch.setenv("KVCOMPRESS_PAGED_CONFIG", env)
    with pytest.raises(ValueError, match="KVCOMPRESS_PAGED_CONFIG: " + message):
        triton_kernel._config()
    monkeypatch.setenv("KVCOMPRESS_PAGED_CONFIG", '{"table_steps": 0, "pages_per_step": 2, "valid_late": true}')
    assert triton_kernel._config()["table_steps"] == 0


def test_split_plan_fills_whole_waves_and_picks_the_depth():
    """Splits round down to whole waves; 3 stages while the read still splits at least twice, else 2 with its own
    (larger) slot count; never more splits than steps."""
    from kvcompress.kernels.paged.triton_kernel import split_plan

    slots = {3: 396, 2: 528}.__getitem__  # an H200 at head dim 128: 3 / 4 programs per SM
    assert split_plan(2048, 4, 128, 1, (3, 2), slots) == (3, 3)  # B16 Llama: 396 // 128, not 4 (= 512 > 396)
    assert split_plan(2048, 4, 8, 1, (3, 2), slots) == (49, 3)  # B1: 396 // 8
    assert split_plan(2048, 4, 512, 1, (3, 2), slots) == (1, 2)  # B64: one split at either depth -> 2 stages
    assert split_plan(2048, 4, 264, 1, (3, 2), slots) == (2, 2)  # 396 // 264 = 1 at 3 stages, 528 // 264 = 2 at 2
    assert split_plan(6, 4, 8, 1, (3, 2), slots) == (2, 3)  # capped by the 2 steps of a 6-page table
    assert split_plan(2048, 4, 128, 2, (2,), slots) == (8, 2)  # a given depth, two waves


def test_import_compiles_nothing():
    code = ("import kvcompress.kernels.paged.triton_kernel as t; "
            "print(len(getattr(t._paged_split_kernel, 'device_caches', {})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["0"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(CASES))
def test_cases_on_gpu(name):
    _check(run_case(name, "cuda"), name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("table_steps", [16, 0])
def test_bf16_pages_scale_in_exponent_on_gpu(table_steps):
    """bf16 pages over 4k tokens (256 pages of 16, a short and a dead row), by default (``bf16_scale_in_exponent``
    ``True`` since session 58: the query enters the dot as given and the scale rides in the exponent) and with the
    setting named: LSE within 5e-4 of the float32 reference of the same bf16 values. ``False`` (the pre-scaled bf16
    query, the default until session 58) was 1.5e-2 off here on an H100. The Triton interpreter cannot run bf16
    dots, hence a GPU test."""
    from kvcompress.kernels.paged import triton_kernel
    from kvcompress.kernels.paged.reference import paged_attention_partial

    gen = torch.Generator().manual_seed(57)
    b, h, m, d, p, width = 3, 2, 4, 128, 16, 256
    q = (torch.randn(b, h, m, d, generator=gen) * 2).bfloat16()
    k = (torch.randn(b * width, h, p, d, generator=gen) * 2).bfloat16()
    v = torch.randn(b * width, h, p, d, generator=gen).bfloat16()
    valid = torch.rand(b * width, p, generator=gen) > 0.1
    table = torch.randperm(b * width, generator=gen)[:b * width].view(b, width).int()
    table[1, 200:] = -1
    table[2] = -1
    scale = d ** -0.5
    ref_out, ref_lse = paged_attention_partial(q.float(), k.float(), v.float(), valid, table, scale)
    finite = torch.isfinite(ref_lse)
    base = {**triton_kernel._config(), "table_steps": table_steps}
    for flag in ("default", True):
        cfg = base if flag == "default" else {**base, "bf16_scale_in_exponent": flag}
        out, lse = triton_kernel._forward(*(x.cuda() for x in (q, k, v, valid, table)), scale, base=cfg)
        out, lse = out.cpu(), lse.cpu()
        assert torch.equal(torch.isfinite(lse), finite) and bool((out[~finite] == 0).all())
        assert (lse[finite] - ref_lse[finite]).abs().max().item() <= 5e-4, flag
        assert torch.allclose(out, ref_out, atol=ATOL, rtol=RTOL), flag


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dims", [(128, 128), (64, 64)])
def test_programs_per_sm_matches_the_driver(dims):
    """The split count's programs per SM (from the compiled kernel's registers and shared memory) equals what the
    CUDA driver's occupancy calculator says for the same compiled function."""
    cu = pytest.importorskip("cuda.bindings.driver")
    from kvcompress.kernels.paged import triton_kernel

    dk, dv = dims
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 4, dk, generator=gen).half().cuda()
    k = torch.randn(64, 4, 16, dk, generator=gen).half().cuda()
    v = torch.randn(64, 4, 16, dv, generator=gen).half().cuda()
    valid = torch.ones(64, 16, dtype=torch.bool, device="cuda")
    table = torch.arange(64, dtype=torch.int32, device="cuda").view(2, 32)
    triton_kernel._RESIDENT.clear()  # the other tests' configurations
    for stages in (None, 2):  # automatic depth (3 here: the read splits) and 2
        triton_kernel._forward(q, k, v, valid, table, 0.1, base={**triton_kernel._config(), "num_stages": stages})
    assert len(triton_kernel._RESIDENT) == 2
    out = torch.empty(2, 4, 4, dv, device="cuda")
    lse = torch.empty(2, 4, 4, device="cuda")
    args = (q, k, v, valid.view(torch.uint8), table, table, out, lse, 0.1, 0.0, 4, 4, 32, 32, *q.stride()[:3],
            *k.stride()[:3], *v.stride()[:3], 16, 32, 0, *out.stride()[:3], 0, *lse.stride()[:2])
    for key, resident in triton_kernel._RESIDENT.items():
        consts, warps, stages = dict(key[1]), key[2], key[3]
        kernel = triton_kernel._paged_split_kernel.warmup(*args, grid=(1, 1, 1), num_warps=warps,
                                                          num_stages=stages, **consts)
        kernel._init_handles()
        err, blocks = cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(cu.CUfunction(kernel.function), 32 * warps,
                                                                     kernel.metadata.shared)
        assert err == cu.CUresult.CUDA_SUCCESS
        assert resident == blocks, (stages, resident, blocks)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_paged_eviction_decode_on_gpu_matches_cpu():
    """End to end on CUDA (Triton paged kernel) against the CPU reference path, fp32 tiny model."""
    import kvcompress
    from kvcompress.adapters.hf import cache_kwarg

    sys.path.insert(0, str(Path(__file__).parent))
    from models import tiny_model

    def stream(model, ids, cache, chunks):  # the cache keyword of the installed transformers (5.17 or 5.24)
        key = cache_kwarg(model)
        with torch.no_grad():
            return torch.cat([model(ids[:, c0:c1], **{key: cache}).logits[0] for c0, c1 in chunks]).float().cpu()

    model = tiny_model("llama")
    ids = torch.randint(1, 256, (1, 260), generator=torch.Generator().manual_seed(0))
    chunks = [(0, 120)] + [(t, t + 1) for t in range(120, 260)]
    stack = {"compressors": [{"paged_eviction": {"budget": 80, "block": 16}}]}
    with kvcompress.compress(model, stack) as cache:
        cpu = stream(model, ids, cache, chunks)
    model = model.cuda()
    with kvcompress.compress(model, stack) as cache:
        gpu = stream(model, ids.cuda(), cache, chunks)
        assert cache.compressed_layers[0].middle.segments()[0].packed.attention_partial  # the paged read path
    assert (gpu - cpu).abs().max().item() < 1e-3


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        _worker(sys.argv[2])
