"""benchmarks/gpu_read_profile.py: every op it is asked for builds the read the grid times (session 38's profile asked
for ``leank50`` and got "unknown static-read op": a GPU call's row lost)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_read_profile  # noqa: E402


def _shape():
    from kvcompress.kernels import benchutil

    return benchutil._shape_named("smollm2-135m")


def test_sdpa_row_is_sdpa_on_the_uncompressed_cache():
    gen = torch.Generator().manual_seed(0)
    read, impl, _ = gpu_read_profile.reader("sdpa", _shape(), 2, 96, torch.device("cpu"), gen)
    out = read()
    assert impl == "sdpa" and out.shape == (2, 3, 3, 64)
    from kvcompress.kernels import benchutil

    q, k, v = benchutil.dense_inputs(2, 3, 96, 64, 3, torch.device("cpu"), torch.Generator().manual_seed(0))
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize("op", ["leank50", "leank70"])
def test_leank_rows_build_the_grids_lanes(op):
    """The lanes of benchutil's ``leank50`` / ``leank70`` rows: the pruned middle of ``ctx - 1024`` tokens in lanes
    narrower than the head, and the full-precision region (built only: the Triton kernel needs a GPU)."""
    from kvcompress.kernels import benchutil

    read = gpu_read_profile.reader(op, _shape(), 1, 1100, torch.device("cpu"), torch.Generator().manual_seed(0))
    assert read.impl == "lanes:triton"
    _, lanes = read.inputs
    assert lanes[-1].k.shape[2] == benchutil.LEANK_FP_TOKENS
    assert all(lane.k.shape[2] == 1100 - benchutil.LEANK_FP_TOKENS for lane in lanes[:-1])
    assert all(lane.k.shape[-1] < 64 for lane in lanes[:-1])


def test_static_rows_read_the_layer_the_grid_builds():
    """``none`` / ``lowrank``: a static layer of that stack, read by ``benchutil.static_read`` (run on the CPU: the
    reference path), its output one row per query head."""
    read = gpu_read_profile.reader("lowrank", _shape(), 1, 1100, torch.device("cpu"), torch.Generator().manual_seed(0))
    q, layer = read.inputs
    assert layer.middle is not None  # the low-rank middle beside the full-precision buffer
    out = read.call()
    assert out.shape == (1, 1, 9, 64) and torch.isfinite(out).all()


def _tails_oracle(spans, step=0.25):
    """Brute force on a time grid: each instant covered by a span belongs to the span that started first (ties: the
    one listed first after sorting by start, then end), i.e. to the kernel already running."""
    order = sorted(spans, key=lambda x: (x[1], x[2]))
    lo, hi = min(s for _, s, _ in spans), max(e for _, _, e in spans)
    out = {}
    t = lo + step / 2
    while t < hi:
        for name, s, e in order:
            if s <= t < e:
                out[name] = out.get(name, 0.0) + step
                break
        t += step
    return out


@pytest.mark.parametrize("spans", [
    [("split", 0.0, 10.0), ("combine", 2.0, 12.0)],  # a PDL combine: launched early, waits, runs 2 past the split
    [("a", 0.0, 4.0), ("b", 5.0, 7.0), ("c", 6.0, 6.5), ("b", 8.0, 9.0), ("a", 8.5, 12.0)],  # gaps, nesting, repeats
    [("x", 3.0, 5.0), ("y", 0.0, 1.0), ("z", 0.5, 3.5)],  # unsorted input
])
def test_kernel_tails_count_each_instant_once_for_the_kernel_already_running(spans):
    tails = gpu_read_profile.kernel_tails(spans)
    want = _tails_oracle(spans)
    assert set(tails) == {n for n, _, _ in spans}
    for name in tails:
        assert tails[name] == pytest.approx(want.get(name, 0.0), abs=1e-9)
    union = sum(want.values())
    assert sum(tails.values()) == pytest.approx(union)


def test_a_pdl_wait_is_not_a_kernels_tail():
    tails = gpu_read_profile.kernel_tails([("split", 0.0, 10.0), ("combine", 1.0, 11.5)])
    assert tails == {"split": 10.0, "combine": 1.5}  # the combine's duration is 10.5, its own cost past the split 1.5
