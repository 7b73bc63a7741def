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
