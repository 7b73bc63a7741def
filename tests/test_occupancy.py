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
    kernel, lanes, warps, stages, regs, spilled, shared, per_sm, limit = cells[3:12]
    assert kernel == "_lanes_kernel" and lanes == "[64]"
    assert (int(warps), int(stages)) == (tk._config()["num_warps"], tk._launch_shape(tk._config(), 1, 3, 64, True)[1])
    assert int(regs) > 0 and int(shared) > 0 and int(spilled) == 0
    assert (int(per_sm), limit) == occupancy(int(regs), int(shared), int(warps))
