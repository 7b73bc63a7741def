"""The fused Triton KIVI kernel against the PyTorch reference (kernels/kivi/reference.py).

On a CPU-only machine the kernel runs under the Triton interpreter.  ``TRITON_INTERPRET``
must be set before Triton's ``@jit`` decorators run, so the cases run in ONE worker
subprocess (this file executed as a script) with that variable set: nothing leaks into
the other tests' process.  Each case below is one pytest test that reads the worker's
result.  With CUDA present, ``test_cases_on_gpu`` runs the same cases natively (marker
``gpu``).

Queries are fp16 (plus one bf16 and one fp32 case: the kernel converts the query itself;
the interpreter computes bf16 ``tl.dot`` wrongly, and the kernel never issues one).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from interpreter import collect
from interpreter import interpreted as run_interpreted

# name -> (batch, kv_heads, rows M, Dk, Dv, groups NG, bits, key group G, value group Gv, extras)
CASES = {
    "b2-gqa4-padding-allinvalid-row": (2, 2, 4, 64, 64, 8, 2, 32, 32, {"pad": 40, "dead_row": 1}),
    "b4-gqa3-dk48-dv64-odd-groups-vfold": (2, 1, 3, 48, 64, 5, 4, 32, 64, {"pad": 7}),
    "b2-g16-vgroup8-gather-gqa1": (1, 2, 1, 32, 64, 7, 2, 16, 8, {}),
    "b4-g64-qlen3-gqa4-d128-uneven-splits": (1, 2, 12, 128, 128, 7, 4, 64, 32, {"splits": 3}),
    "b2-g128-dk16-gqa3": (2, 1, 3, 16, 64, 3, 2, 128, 64, {}),
    "b2-rows80-two-row-blocks": (1, 1, 80, 64, 64, 2, 2, 32, 32, {}),
    "b4-strided-views-one-split": (2, 2, 4, 32, 64, 6, 4, 32, 32, {"views": True, "splits": 1}),
    "b2-all-invalid-region": (1, 2, 4, 64, 64, 2, 2, 32, 32, {"all_invalid": True}),
    "b2-bf16-query": (1, 1, 4, 64, 64, 3, 2, 32, 32, {"dtype": "bfloat16"}),
    "b4-fp32-query-g16": (1, 1, 3, 64, 64, 9, 4, 16, 16, {"dtype": "float32"}),
    # non-default configurations (tile of several key groups, mma.sync formulation, eager rescale, no prefetch)
    "b2-bn64-multi-group-tiles-4warps": (1, 2, 4, 64, 64, 6, 2, 16, 16, {"config": {"BN": 64, "num_warps": 4}}),
    "b4-qk-form-eager-no-prefetch": (2, 1, 4, 32, 32, 5, 4, 32, 32,
                                     {"config": {"TRANS": False, "LAZY": False, "PREFETCH": False}, "pad": 9}),
    "b2-bn32-g64-partial-split": (1, 1, 3, 64, 64, 3, 2, 64, 32, {"config": {"BN": 32}, "splits": 2}),
    "b2-dk8-padded-key-word": (1, 2, 4, 8, 32, 3, 2, 32, 32, {}),
}
ATOL, RTOL, LSE_ATOL = 3e-3, 1e-2, 2e-3


def make_case(name: str, device: str = "cpu"):
    """Query and packed region of a case (quantized by the reference quantizers, seeded)."""
    from kvcompress.kernels.kivi.reference import PackedKV, quantize_keys, quantize_values

    b, h, m, dk, dv, ng, bits, g, gv, extra = CASES[name]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    t = ng * g
    k = torch.randn(b, h, t, dk, generator=gen) * 1.5 + 0.3
    v = torch.randn(b, h, t, dv, generator=gen)
    q = torch.randn(b, h, m, dk, generator=gen).to(getattr(torch, extra.get("dtype", "float16")))
    valid = torch.rand(b, t, generator=gen) > 0.15
    if extra.get("pad"):
        valid[0, : extra["pad"]] = False  # left padding of row 0
    if "dead_row" in extra:
        valid[extra["dead_row"]] = False
    if extra.get("all_invalid"):
        valid[:] = False
    kc, ks, kz = quantize_keys(k, bits, g)
    vc, vs, vz = quantize_values(v, bits, gv)
    parts = [kc, ks, kz, vc, vs, vz, valid]
    if extra.get("views"):  # slices of larger (preallocated) buffers: strided outer dims
        def widen(x, dim):
            shape = list(x.shape)
            shape[dim] += 3
            return torch.zeros(shape, dtype=x.dtype).narrow(dim, 0, x.shape[dim]).copy_(x)
        parts = [widen(x, 2) for x in parts[:6]] + [widen(valid, 1)]
        q = q.transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous query
    parts = [x.to(device) for x in parts]
    return q.to(device), PackedKV(bits, g, *parts), extra


def run_case(name: str, device: str = "cpu") -> dict:
    from kvcompress.kernels.kivi import triton_kernel
    from kvcompress.kernels.kivi.reference import kivi_attention_partial

    q, packed, extra = make_case(name, device)
    scale = q.shape[-1] ** -0.5
    out, lse = triton_kernel._forward(q, packed, scale, splits=extra.get("splits"), config=extra.get("config"))
    ref_out, ref_lse = kivi_attention_partial(q, packed, scale)
    finite = torch.isfinite(ref_lse)
    res = {
        "shape_out": list(out.shape), "dtype_out": str(out.dtype), "dtype_lse": str(lse.dtype),
        "same_inf": bool(torch.equal(torch.isfinite(lse), finite)),
        "out_err": float((out - ref_out).abs().max()),
        "out_tol_ok": bool(torch.allclose(out, ref_out, atol=ATOL, rtol=RTOL)),
        "lse_err": float((lse[finite] - ref_lse[finite]).abs().max()) if bool(finite.any()) else 0.0,
        "dead_rows_zero": bool((out[~finite] == 0).all()),
        "any_nan": bool(torch.isnan(out).any() or torch.isnan(lse).any()),
    }
    return res


def _worker(path: str) -> None:
    collect({name: (lambda n=name: run_case(n)) for name in CASES}, path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return run_interpreted(__file__, tmp_path_factory.mktemp("kivi"))


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


@pytest.mark.parametrize("name", list(CASES))
def test_case_interpreted(interpreted, name):
    _check(interpreted[name], name)


def test_invalid_arguments_raise():
    from kvcompress.kernels.kivi import triton_kernel
    from kvcompress.kernels.kivi.reference import PackedKV

    q, packed, _ = make_case("b2-gqa4-padding-allinvalid-row")
    bad = PackedKV(**{**packed.__dict__, "group": 48})
    with pytest.raises(ValueError, match="group"):
        triton_kernel._forward(q, bad, 0.1)
    with pytest.raises(ValueError, match="per-channel"):
        triton_kernel._forward(q, PackedKV(**{**packed.__dict__, "k_per_token": True}), 0.1)
    with pytest.raises(ValueError, match="k_codes"):
        triton_kernel._forward(q[..., :32], packed, 0.1)


def test_dispatch_is_an_explicit_capability_check():
    """Unsupported packs go to the reference through ``supports()``, not by catching kernel errors."""
    from kvcompress.kernels import kivi
    from kvcompress.kernels.kivi import triton_kernel
    from kvcompress.kernels.kivi.reference import PackedKV

    q, packed, _ = make_case("b2-gqa4-padding-allinvalid-row")
    assert triton_kernel.supports(q, packed)
    assert not triton_kernel.supports(q, PackedKV(**{**packed.__dict__, "group": 48}))
    assert not triton_kernel.supports(q, PackedKV(**{**packed.__dict__, "k_per_token": True}))
    assert not triton_kernel.supports(q[..., :32], packed)
    out, lse = kivi.kivi_attention_partial(q, packed, 0.1)  # CPU tensors: the reference
    ref_out, ref_lse = kivi.kivi_attention_partial_reference(q, packed, 0.1)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    import inspect

    assert "except" not in inspect.getsource(kivi.kivi_attention_partial)


def test_import_compiles_nothing():
    code = ("import sys, kvcompress.kernels.kivi.triton_kernel as t; "
            "print(len(t._kivi_split_kernel.device_caches) if hasattr(t._kivi_split_kernel, 'device_caches') else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["0"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(CASES))
def test_cases_on_gpu(name):
    _check(run_case(name, "cuda"), name)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        _worker(sys.argv[2])
