"""The fused Triton KIVI quantizer (kernels/kivi/quantize_triton.py) against the reference path of
``kvcompress::kivi_quantize``: codes, scales and zeros must be bit-identical.

The kernel runs under the Triton interpreter in ONE worker subprocess (this file executed as a script with
``TRITON_INTERPRET=1``, see ``tests/interpreter.py``); each case below is one pytest test reading the worker's result.
With CUDA present, ``test_cases_on_gpu`` runs the same cases natively (marker ``gpu``).  In-process tests cover the
op's ``impl`` argument, ``ops.choose`` and the stores' plumbing of the choice.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from interpreter import collect
from interpreter import interpreted as run_interpreted

NAMES = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")

# name -> (batch, heads, groups NG, key group G, Dk, Dv, value group Gv, bits, dtype, k_per_token, mask, extras)
# mask: None | "random" | "dead_group" (random, plus one fully masked group in every row) | "dead_row" (random, plus
# one fully masked row) | "all" (every slot masked) | "none" (a mask with every slot valid)
CASES = {
    "b1h1-t1-g32-d64-bits2-fp16-nomask": (1, 1, 1, 32, 64, 64, 32, 2, "float16", False, None, {}),
    "b2h3-t2-g32-d128-bits4-bf16-random": (2, 3, 2, 32, 128, 128, 32, 4, "bfloat16", False, "random", {}),
    "b3h2-t4-g32-d96-bits2-fp32-random": (3, 2, 4, 32, 96, 96, 32, 2, "float32", False, "random", {}),
    "b2h2-t3-g64-d128-vg64-bits2-bf16-deadgroup": (2, 2, 3, 64, 128, 128, 64, 2, "bfloat16", False, "dead_group", {}),
    "b2h1-t2-g128-d128-vg128-bits4-fp16-deadrow": (2, 1, 2, 128, 128, 128, 128, 4, "float16", False, "dead_row", {}),
    "b1h2-t1-g128-d64-vg64-bits2-fp32-random": (1, 2, 1, 128, 64, 64, 64, 2, "float32", False, "random", {}),
    "b4h1-t4-g16-d64-vg16-bits4-bf16-random": (4, 1, 4, 16, 64, 64, 16, 4, "bfloat16", False, "random", {}),
    "b2h2-t3-g64-d96-vg32-bits4-fp32-deadgroup": (2, 2, 3, 64, 96, 96, 32, 4, "float32", False, "dead_group", {}),
    "b2h1-t2-g32-d64-bits2-bf16-allmasked": (2, 1, 2, 32, 64, 64, 32, 2, "bfloat16", False, "all", {}),
    "b1h2-t2-g32-d64-bits4-fp16-fullmask": (1, 2, 2, 32, 64, 64, 32, 4, "float16", False, "none", {}),
    # key head dims that are not a multiple of 32 // bits: the last key word is padded with zero codes
    "dk72-dv64-bits2-bf16-random": (2, 2, 2, 32, 72, 64, 32, 2, "bfloat16", False, "random", {}),
    "dk36-dv96-bits4-fp16-deadgroup": (1, 3, 3, 32, 36, 96, 32, 4, "float16", False, "dead_group", {}),
    "dk8-dv32-bits2-fp32-random": (2, 1, 2, 32, 8, 32, 32, 2, "float32", False, "random", {}),
    # per-token keys (the key_axis="token" ablation)
    "kpt-b2h2-t2-d128-vg32-bits2-bf16-random": (2, 2, 2, 32, 128, 128, 32, 2, "bfloat16", True, "random", {}),
    "kpt-b1h2-t3-g64-d64-vg64-bits4-fp32-deadrow": (2, 2, 3, 64, 64, 64, 64, 4, "float32", True, "dead_row", {}),
    "kpt-b1h1-t1-g128-d96-vg32-bits4-fp16-nomask": (1, 1, 1, 128, 96, 96, 32, 4, "float16", True, None, {}),
    # value groups narrower than (or as wide as) a word: several groups per word
    "vg8-bits2-d64-bf16-random": (1, 2, 2, 32, 64, 64, 8, 2, "bfloat16", False, "random", {}),
    "vg16-bits2-d128-fp16-kpt": (2, 1, 2, 16, 128, 128, 16, 2, "float16", True, "random", {}),
    # strided inputs: [B, T, H, d] storage viewed as [B, H, T, d]; every other channel; a slice of a wider mask
    "noncontig-bthd-bits2-bf16-random": (2, 3, 2, 32, 64, 128, 32, 2, "bfloat16", False, "random",
                                         {"layout": "bthd"}),
    "noncontig-channel-stride-bits4-fp16-deadgroup": (2, 2, 2, 32, 128, 64, 64, 4, "float16", False, "dead_group",
                                                      {"layout": "strided"}),
    "noncontig-kpt-bits4-fp32-random": (1, 2, 3, 32, 64, 64, 32, 4, "float32", True, "random", {"layout": "bthd"}),
    # exact .5 quotients (round half to even), constant groups (scale 1), ranges that underflow an fp16 scale
    "ties-bits2-fp16": (2, 2, 2, 32, 64, 64, 32, 2, "float16", False, None, {"data": "ties"}),
    "ties-bits4-bf16-kpt": (1, 2, 2, 32, 64, 64, 32, 4, "bfloat16", True, "random", {"data": "ties"}),
    # (fp32 masks are left out here: a masked mean's last fp32 bit follows the summation order, the documented caveat,
    # and in a constant group it is the whole range; bf16 sums of such groups are exact in fp32)
    "constant-and-tiny-ranges-fp32": (2, 1, 2, 32, 64, 64, 32, 2, "float32", False, None, {"data": "flat"}),
    "constant-and-tiny-ranges-bf16": (2, 2, 2, 32, 64, 64, 32, 4, "bfloat16", True, "dead_group",
                                      {"data": "flat", "scale": 1e-6}),
    "large-magnitude-bf16": (1, 2, 2, 64, 128, 128, 64, 2, "bfloat16", False, "dead_group", {"data": "large"}),
    # groups with no valid token over negative data (x * 0 sums to -0) holding inf / nan in their masked slots: the
    # reference fills them with exactly +0, the kernel writes the same constants without reading them
    "deadgroup-negative-nonfinite-bf16": (2, 2, 3, 32, 64, 64, 32, 2, "bfloat16", False, "dead_group",
                                          {"data": "negative", "dead": "nonfinite"}),
    "deadgroup-negative-nonfinite-kpt-fp32": (2, 1, 2, 32, 64, 96, 32, 4, "float32", True, "dead_group",
                                              {"data": "negative", "dead": "nonfinite"}),
}


def make_case(name: str, device: str = "cpu"):
    """``(k, v, valid, bits, group, v_group, k_per_token)`` of a case (seeded)."""
    b, h, ng, g, dk, dv, gv, bits, dtype, kpt, mask, extra = CASES[name]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    t = ng * g
    kind = extra.get("data")
    if kind == "ties":  # integers in [0, 2*qmax] with both ends in every group: scale 2, zero 0, odd x -> .5
        top = 2 * ((1 << bits) - 1)
        k = torch.randint(0, top + 1, (b, h, t, dk), generator=gen).float()
        v = torch.randint(0, top + 1, (b, h, t, dv), generator=gen).float()
        k[:, :, 0::g], k[:, :, 1::g] = 0, top  # per-channel key groups
        if kpt:
            k[..., 0::gv], k[..., 1::gv] = 0, top
        v[..., 0::gv], v[..., 1::gv] = 0, top  # per-token value groups
    elif kind == "flat":  # constant key channels / value groups (scale 1), and ranges far below fp16's smallest scale
        s = extra.get("scale", 1.0)  # bf16 at 1e-6: neighbours 1e-8 apart, far below fp16's smallest scale
        k = torch.randn(b, h, 1, dk, generator=gen).expand(b, h, t, dk).clone() * s
        k[..., : dk // 2] *= 1 + torch.randn(b, h, t, dk // 2, generator=gen) * 1e-8 / s
        v = torch.randn(b, h, t, dv // gv, 1, generator=gen).expand(b, h, t, dv // gv, gv).reshape(b, h, t, dv) * s
        v = v * (1 + torch.randn(b, h, t, dv, generator=gen) * 1e-8 / s * (torch.arange(dv) % 2))
    elif kind == "large":
        k = torch.randn(b, h, t, dk, generator=gen) * 3e4 + 1e4
        v = torch.randn(b, h, t, dv, generator=gen) * 500
    elif kind == "negative":
        k = -torch.rand(b, h, t, dk, generator=gen) - 0.05
        v = -torch.rand(b, h, t, dv, generator=gen) - 0.05
    else:
        k = torch.randn(b, h, t, dk, generator=gen) * 1.7 + 0.4
        v = torch.randn(b, h, t, dv, generator=gen)
    k, v = k.to(getattr(torch, dtype)), v.to(getattr(torch, dtype))
    valid = None
    if mask is not None:
        valid = torch.rand(b, t, generator=gen) > 0.3
        if mask == "dead_group":
            for row in range(b):
                valid[row, (row % ng) * g: (row % ng + 1) * g] = False
                if extra.get("dead") == "nonfinite":  # in the masked slots of the dead group only
                    t0 = (row % ng) * g
                    k[row, :, t0, 0], k[row, :, t0 + 1, 1], k[row, :, t0 + 2, :] = float("inf"), float("nan"), -1e30
                    v[row, :, t0, 3], v[row, :, t0 + 5, :] = float("-inf"), float("nan")
        elif mask == "dead_row":
            valid[b - 1] = False
        elif mask == "all":
            valid[:] = False
        elif mask == "none":
            valid[:] = True
    layout = extra.get("layout")
    if layout == "bthd":  # heads interleaved with tokens, as a [B, T, H, d] projection viewed per head
        k = k.transpose(1, 2).contiguous().transpose(1, 2)
        v = v.transpose(1, 2).contiguous().transpose(1, 2)
    elif layout == "strided":  # every other channel of a wider buffer; a mask sliced from a wider one
        k = torch.stack([k, torch.full_like(k, float("nan"))], dim=-1).flatten(-2)[..., 0::2]
        v = torch.cat([v, torch.full_like(v, float("nan"))], dim=-1)[..., :dv]
        if valid is not None:
            valid = torch.cat([valid, torch.zeros_like(valid)], dim=1).view(b, 2, t)[:, 0]
    if layout:
        assert not k.is_contiguous() and not v.is_contiguous()
    to = (lambda x: None if x is None else x.to(device))
    return to(k), to(v), to(valid), bits, g, gv, kpt


def reference(args):
    from kvcompress.kernels import ops

    return ops._kivi_quantize_reference(*args)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16) if x.dtype == torch.float16 else x


def _layout(x: torch.Tensor) -> list:
    """Strides of the dims longer than 1 (a size-1 dim's stride places nothing)."""
    return [s for s, n in zip(x.stride(), x.shape) if n > 1]


def compare(got, ref) -> dict:
    res = {}
    for name, a, r in zip(NAMES, got, ref):
        same_shape = a.shape == r.shape
        res[name] = {"shape": same_shape, "dtype": a.dtype == r.dtype, "contiguous": a.is_contiguous(),
                     "strides": _layout(a) == _layout(r),
                     "mismatches": int((_bits(a) != _bits(r)).sum()) if same_shape else -1}
    return res


def run_case(name: str, device: str = "cpu") -> dict:
    from kvcompress.kernels.kivi.quantize_triton import kivi_quantize_triton

    args = make_case(name, device)
    return compare(kivi_quantize_triton(*args), reference(args))


def scale_division_case() -> dict:
    """Ranges where ``fp16(r / qmax)`` and ``fp16(r * fp32(1 / qmax))`` differ: the kernel divides as the reference on
    CPU tensors, and multiplies by the reciprocal (PyTorch's CUDA division by a Python scalar) when asked to."""
    from kvcompress.kernels.kivi.quantize_triton import kivi_quantize_triton

    bits, g, d = 4, 32, 64
    qmax, inv = 15, torch.tensor(1.0) / 15
    gen = torch.Generator().manual_seed(5)
    r = torch.rand(400_000, generator=gen) * 7 + 0.01
    r = r[(r / qmax).half() != (r * inv).half()].repeat(4)  # ~50 distinct ranges, 96 needed
    k = torch.rand(1, 1, g, d, generator=gen) * r[:d]
    k[:, :, 0], k[:, :, 1] = 0, r[:d]  # per-channel range [0, r]
    v = torch.rand(1, 1, g, d, generator=gen) * r[d: d + g, None]
    v[..., 0::32], v[..., 1::32] = 0, r[d: d + g, None]  # per-token ranges [0, r] in each 32-channel group
    args = (k, v, None, bits, g, 32, False)
    res = compare(kivi_quantize_triton(*args, scale_reciprocal=False), reference(args))
    got = kivi_quantize_triton(*args, scale_reciprocal=True)
    res["reciprocal_k_scale"] = bool(torch.equal(got[1], (r[:d] * inv).half().view(1, 1, 1, d)))
    v_scale = (r[d: d + g] * inv).half().view(1, 1, g, 1).expand(-1, -1, -1, d // 32)
    res["reciprocal_v_scale"] = bool(torch.equal(got[4], v_scale))
    res["reciprocal_differs"] = int((got[1] != reference(args)[1]).sum()) == d
    return res


def _worker(path: str) -> None:
    from kvcompress.kernels import ops

    cases = {name: (lambda n=name: run_case(n)) for name in CASES}
    cases["scale-division"] = scale_division_case
    # the op's CUDA implementation (its Python glue) on CPU tensors, impl "triton" and "reference"
    for impl in ("triton", "reference"):
        def through_op(impl=impl):
            args = make_case("b2h3-t2-g32-d128-bits4-bf16-random")
            return compare(ops.CUDA_IMPLS["kivi_quantize"](*args, impl), reference(args))
        cases[f"op-cuda-glue-{impl}"] = through_op
    collect(cases, path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return run_interpreted(__file__, tmp_path_factory.mktemp("kivi_quantize"), OMP_NUM_THREADS="1")


def test_scale_division_follows_the_device(interpreted):
    res = interpreted["scale-division"]
    _check(res)
    assert res["reciprocal_differs"], "the test ranges must tell the two divisions apart"
    assert res["reciprocal_k_scale"] and res["reciprocal_v_scale"]


def _check(res: dict) -> None:
    assert "error" not in res, res.get("error")
    for name in NAMES:
        r = res[name]
        assert r["shape"] and r["dtype"] and r["contiguous"] and r["strides"], f"{name}: {r}"
        assert r["mismatches"] == 0, f"{name}: {r['mismatches']} elements differ (bits)"


@pytest.mark.parametrize("name", list(CASES) + ["op-cuda-glue-triton", "op-cuda-glue-reference"])
def test_bit_identical_to_reference_interpreted(interpreted, name):
    _check(interpreted[name])


# ----------------------------------------------------------------------------- in-process: op, choose, plumbing


def test_groups_without_a_valid_token_encode_as_constants():
    """The reference's rule the kernel relies on (it writes these constants without reading such a group): codes 0,
    scales 1, zeros +0 (bits, not just values: x * 0 over negative data sums to -0), whatever the masked slots hold;
    the groups with valid tokens keep finite, data-dependent encodings."""
    for name in ("deadgroup-negative-nonfinite-bf16", "deadgroup-negative-nonfinite-kpt-fp32"):
        k, v, valid, bits, g, gv, kpt = make_case(name)
        kc, ks, kz, vc, vs, vz = reference((k, v, valid, bits, g, gv, kpt))
        b, ng = valid.shape[0], valid.shape[1] // g
        dead = ~valid.view(b, ng, g).any(-1)  # [b, ng]
        assert dead.any() and not dead.all()
        tok = dead.repeat_interleave(g, dim=1)  # [b, t]
        for codes, scale, zero, per_group in ((kc, ks, kz, not kpt), (vc, vs, vz, False)):
            sel = dead if per_group else tok
            assert int(codes[sel[:, None].expand(-1, codes.shape[1], -1)].abs().sum()) == 0
            sc, zr = scale[sel[:, None].expand(-1, scale.shape[1], -1)], zero[sel[:, None].expand(-1, zero.shape[1], -1)]
            assert bool((sc == 1).all()) and bool((zr.view(torch.int16) == 0).all()) if zr.dtype == torch.float16 \
                else bool((zr == 0).all())
            live = ~sel[:, None].expand(-1, scale.shape[1], -1)
            assert bool(torch.isfinite(scale[live].float()).all()) and bool((scale[live] != 1).any())


def test_invalid_arguments_raise_before_launching():
    from kvcompress.kernels.kivi.quantize_triton import kivi_quantize_triton, problem

    k, v, valid, bits, g, gv, kpt = make_case("b1h1-t1-g32-d64-bits2-fp16-nomask")
    with pytest.raises(ValueError, match="key group 48"):
        kivi_quantize_triton(torch.randn(1, 1, 48, 64), torch.randn(1, 1, 48, 64), None, bits, 48, gv, kpt)
    with pytest.raises(ValueError, match="multiple of the group"):
        kivi_quantize_triton(k[:, :, :16], v[:, :, :16], None, bits, g, gv, kpt)
    with pytest.raises(ValueError, match="bits 3"):
        kivi_quantize_triton(k, v, None, 3, g, gv, kpt)
    with pytest.raises(ValueError, match="dtype torch.float64"):
        kivi_quantize_triton(k.double(), v.double(), None, bits, g, gv, kpt)
    with pytest.raises(ValueError, match="valid must be bool"):
        kivi_quantize_triton(k, v, torch.ones(1, 32, dtype=torch.int32), bits, g, gv, kpt)
    assert problem(2, 32, 32, 72, 64, False) is None  # keys pad their last word
    assert "value group" in problem(2, 32, 32, 72, 64, True)  # per-token keys need whole words and groups
    assert "value group" in problem(2, 32, 24, 96, 96, False)  # not a power of two
    assert "head dims" in problem(4, 32, 32, 512, 64, False)


def test_op_impl_argument_on_cpu():
    """CPU: the reference whatever the default; impl "triton" on CPU tensors raises a clear error."""
    from kvcompress.kernels import ops

    args = make_case("b2h2-t3-g64-d128-vg64-bits2-bf16-deadgroup")
    ref = reference(args)
    for got in (ops.kivi_quantize(*args), ops.kivi_quantize(*args, "reference")):
        assert all(torch.equal(a, r) for a, r in zip(got, ref))
    with pytest.raises(ValueError, match="kivi_quantize: impl 'triton' runs on CUDA tensors only"):
        ops.kivi_quantize(*args, "triton")
    with pytest.raises(ValueError, match="impl must be one of"):
        ops.kivi_quantize(*args, "cuda")


def test_opcheck_and_compiled_fullgraph():
    from kvcompress.kernels import ops

    op = torch.ops.kvcompress.kivi_quantize.default
    for name in ("dk36-dv96-bits4-fp16-deadgroup", "kpt-b2h2-t2-d128-vg32-bits2-bf16-random"):
        torch.library.opcheck(op, (*make_case(name), "reference"))
    args = make_case("b3h2-t4-g32-d96-bits2-fp32-random")
    torch._dynamo.reset()
    fn = torch.compile(lambda *a: ops.kivi_quantize(*a, "reference"), fullgraph=True, backend="aot_eager")
    assert all(torch.equal(a, r) for a, r in zip(fn(*args), reference(args)))


def test_choose(monkeypatch):
    """Reference on CPU (whatever KVCOMPRESS_KERNELS says); on CUDA (faked) Triton when the facts fit, the reference
    otherwise, with KVCOMPRESS_KERNELS=reference, or without Triton."""
    from kvcompress.kernels import ops

    facts = dict(bits=2, group=32, v_group=32, head_dim=128, v_dim=128, k_per_token=False, dtype=torch.bfloat16)
    for mode in (None, "auto", "triton"):
        if mode is None:
            monkeypatch.delenv("KVCOMPRESS_KERNELS", raising=False)
        else:
            monkeypatch.setenv("KVCOMPRESS_KERNELS", mode)
        assert ops.choose("kivi_quantize", "cpu", **facts) == "reference"
    monkeypatch.delenv("KVCOMPRESS_KERNELS", raising=False)
    monkeypatch.setattr(ops, "triton_available", lambda: True)
    cuda = torch.device("cuda")
    assert ops.choose("kivi_quantize", cuda, **facts) == "triton"
    assert ops.choose("kivi_quantize", cuda, **dict(facts, head_dim=72)) == "triton"
    assert ops.choose("kivi_quantize", cuda, **dict(facts, k_per_token=True, v_group=64, bits=4)) == "triton"
    for bad in (dict(group=48), dict(v_group=24), dict(dtype=torch.float64), dict(head_dim=512), dict(bits=3),
                dict(head_dim=72, k_per_token=True)):
        assert ops.choose("kivi_quantize", cuda, **dict(facts, **bad)) == "reference", bad
    with pytest.raises(TypeError, match="unknown static facts"):
        ops.choose("kivi_quantize", cuda, tokens=4)
    monkeypatch.setenv("KVCOMPRESS_KERNELS", "reference")
    assert ops.choose("kivi_quantize", cuda, **facts) == "reference"
    monkeypatch.delenv("KVCOMPRESS_KERNELS")
    monkeypatch.setattr(ops, "triton_available", lambda: False)
    assert ops.choose("kivi_quantize", cuda, **facts) == "reference"


def test_stores_pass_the_chosen_quantizer(monkeypatch):
    """The static store chooses once, at allocation, per lane; the dynamic store per call; both pass the choice to
    the op (spied here: on CPU the real op would refuse "triton")."""
    from kvcompress.kernels import ops
    from kvcompress.plugins.kivi import KiviConfig, KiviStaticStore, KiviStore
    from kvcompress.state import KVBlock

    chosen, calls = [], []
    real_choose, real_op = ops.choose, ops.kivi_quantize

    def choose(op, device, **facts):
        if op != "kivi_quantize":
            return real_choose(op, device, **facts)
        chosen.append(facts)
        return "triton"

    def op(*args):
        calls.append(args[-1])
        return real_op(*args[:-1], "reference")

    monkeypatch.setattr(ops, "choose", choose)
    monkeypatch.setattr(ops, "kivi_quantize", op)
    gen = torch.Generator().manual_seed(3)

    def block(n, start):
        return KVBlock(torch.randn(1, 2, n, 32, generator=gen), torch.randn(1, 2, n, 32, generator=gen),
                       torch.rand(1, n, generator=gen) > 0.2, torch.arange(start, start + n))

    static = KiviStaticStore(KiviConfig(bits=2, group=16, residual=16), head_dim=32, capacity=64)
    static.append(block(32, 0))
    static.append(block(16, 32))
    assert static.quantizers == ["triton"] and calls == ["triton", "triton"] and len(chosen) == 1
    assert chosen[0] == dict(bits=2, group=16, v_group=16, head_dim=32, v_dim=32, k_per_token=False,
                             dtype=torch.float32)
    dynamic = KiviStore(KiviConfig(bits=4, group=16, residual=16), head_dim=32)
    dynamic.append(block(32, 0))
    dynamic.append(block(16, 32))
    assert calls[2:] == ["triton", "triton"] and len(chosen) == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(CASES))
def test_cases_on_gpu(name):
    _check(run_case(name, "cuda"))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        _worker(sys.argv[2])
