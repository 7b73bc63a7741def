"""How many programs of a split kernel an SM holds (:func:`kvcompress.kernels.attention.triton_shared.occupancy`, the
arithmetic behind ``resident_programs`` and the split rules), and ``benchmarks/read_occupancy.py``, which reads it
off the real launches of the grid's reads compiled for sm_90 without a GPU.  The expected counts are worked out by
hand from an H200's limits (65536 registers, 233472 bytes of shared memory, 2048 threads, 32 blocks per SM)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]


def test_occupancy_names_what_limits_the_programs():
    from kvcompress.kernels.attention.triton_shared import SMLimits, occupancy

    lim = SMLimits()
    # registers: a warp of 225-register threads takes ceil(225 x 32 / 256) = 29 blocks of 256 (7424 registers), a
    # 4-warp program 29696: 2 fit in 65536 (shared memory would let 3 in)
    assert occupancy(225, 61440, 4, lim) == (2, "registers")
    # 104448 + 1024 bytes a program: 233472 // 105472 = 2 (registers would let 3 in) - the lanes kernel at Llama
    # heads with 4 stages (benchmarks/read_occupancy.py, Triton 3.6)
    assert occupancy(128, 104448, 4, lim) == (2, "shared")
    assert occupancy(106, 71680, 4, lim) == (3, "shared")  # 3 stages: 72704 bytes a program
    assert occupancy(145, 61440, 4, lim) == (3, "registers")  # a tie (19 blocks a warp; 62464 bytes): registers
    assert occupancy(16, 0, 16, lim) == (4, "threads")  # 2048 // 512 (registers would let 8 in)
    assert occupancy(16, 0, 1, lim) == (32, "blocks")
    assert occupancy(255, 0, 32, lim) == (1, "registers")  # never below one program
    assert occupancy(96, 20480, 4, SMLimits(registers=32768)) == (2, "registers")  # the limits are the device's


def test_read_occupancy_reports_the_launch_the_read_makes(capsys):
    """The tool's row for the empty stack's read at SmolLM2 heads, batch 1: the lanes kernel with the warps and
    stages the launch rule picks there (``_launch_shape``: 4 stages below head dim 128), and a per-SM count that is
    ``occupancy`` of the registers and shared memory it read from the sm_90 build."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import read_occupancy
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from kvcompress.kernels.attention.triton_shared import occupancy
    from kvcompress.kernels.leank import triton_kernel as tk

    assert read_occupancy.main(["--ops", "none", "--batches", "1", "--models", "smollm2-135m"]) == 0
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith("| none |")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    kernel, lanes, tokens, warps, stages, regs, spilled, shared, per_sm, limit = cells[3:13]
    assert kernel == "_lanes_kernel" and lanes == "[64]" and int(tokens) == tk._config()["BN"]
    assert (int(warps), int(stages)) == (tk._config()["num_warps"], tk._launch_shape(tk._config(), 1, 3, 64, True)[1])
    assert int(regs) > 0 and int(shared) > 0 and int(spilled) == 0
    assert (int(per_sm), limit) == occupancy(int(regs), int(shared), int(warps))
    # a variant: the same launch with 32-token steps and 2 warps, a row of its own with what it asked for
    assert read_occupancy.main(["--ops", "none", "--batches", "1", "--models", "smollm2-135m",
                                "--variants", '[{"BN": 32, "num_warps": 2, "num_stages": 3}]']) == 0
    cells = [c.strip() for c in capsys.readouterr().out.splitlines()[-1].strip("|").split("|")]
    assert cells[0] == "none" and cells[5:8] == ["32", "2", "3"]
    with pytest.raises(SystemExit):
        read_occupancy.main(["--variants", '{"BN": 32}'])


# ----------------------------------------------------------------------------- GPU

#: the lanes kernel's launch shapes benchmarks/gpu_s35_session.sh times (PART=stages, PART=shapes) besides the default
SWEPT_SHAPES = [{"num_stages": 3}, {"num_stages": 4}, {"BN": 32, "num_stages": 4},
                {"BN": 32, "num_warps": 2, "num_stages": 3}, {"num_warps": 8, "num_stages": 3},
                {"BN": 128, "num_stages": 3}, {"valid_ahead": True}, {"warp_groups": 4, "num_stages": 3},
                {"warp_groups": 2}]


def _gpu_lanes_cases(dev):
    """Llama-3-8B heads at odd lengths: LeanK-70's lanes beside a full-precision region (batch 3, a masked row), low
    rank (r = 64) beside a buffer lane, and the empty stack's one lane read up to a live length; LeanK-70 at SmolLM2
    heads (3 kv heads, d 64)."""
    import torch

    from kvcompress.kernels import benchutil
    from kvcompress.kernels.leank.reference import Lane

    gen = torch.Generator(device=dev).manual_seed(7)
    q, lanes = benchutil.leank_inputs(3, 8, 1333, 128, 4, 70, dev, gen, fp_tokens=517)
    valid = torch.rand(3, 1333, device=dev, generator=gen) > 0.2
    valid[1] = False  # a row with nothing valid in the middle lanes
    lanes = [lane._replace(valid=valid) if lane.heads is not None else lane for lane in lanes]
    basis = torch.linalg.qr(torch.randn(8, 128, 128, device=dev, generator=gen))[0][..., :64].half().contiguous()
    buffer = [torch.randn(2, 8, 517, 128, device=dev, generator=gen).half() for _ in range(2)]
    coords = torch.randn(2, 8, 2049, 64, device=dev, generator=gen).half()
    values = torch.randn(2, 8, 2049, 128, device=dev, generator=gen).half()
    q2 = torch.randn(2, 8, 4, 128, device=dev, generator=gen).half()
    lowrank = [Lane(None, None, *buffer), Lane(None, None, coords, values, None, basis)]
    dense = [Lane(None, None, *(torch.randn(2, 8, 3001, 128, device=dev, generator=gen).half() for _ in range(2)))]
    q3, small = benchutil.leank_inputs(2, 3, 1777, 64, 3, 70, dev, gen, fp_tokens=333)  # SmolLM2 heads
    return {"leank70": (q, lanes, None), "lowrank": (q2, lowrank, None),
            "none-length": (q2, dense, torch.tensor(2777, device=dev)), "leank70-d64": (q3, small, None)}


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", SWEPT_SHAPES, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_swept_launch_shapes_match_the_reference_on_gpu(shape):
    import torch

    from kvcompress.kernels.leank import reference
    from kvcompress.kernels.leank import triton_kernel as tk

    for name, (q, lanes, length) in _gpu_lanes_cases(torch.device("cuda")).items():
        out, lse = tk.grouped_partial_attention(q, lanes, 0.09, length=length, config=shape)
        ref_out, ref_lse = reference.grouped_partial_attention(q, lanes, 0.09, length=length)
        finite = torch.isfinite(ref_lse)
        assert torch.equal(finite, torch.isfinite(lse)), name
        assert (out[finite] - ref_out[finite]).abs().max().item() < 2e-3, name
        assert (lse[finite] - ref_lse[finite]).abs().max().item() < 2e-3, name
