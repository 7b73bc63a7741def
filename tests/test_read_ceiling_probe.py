"""benchmarks/gpu_read_ceiling.cu (session 53's probe of the GPU's read bandwidth for a full-precision decode read's
bytes) builds for sm_90a, and each of its read variants is what its name says in the machine code: plain 16-byte
loads, cp.async copies (LDGSTS), TMA bulk copies (UBLKCP) behind mbarriers.  Running it needs a GPU
(benchmarks/gpu_s35_session.sh PART=read-ceiling); the program checks every variant's XOR of the bytes it read
against the first variant's."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from kvcompress.kernels.kivi import cuda_kernel as ck

SRC = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_read_ceiling.cu"


def test_read_ceiling_probe_builds_with_the_named_copies(tmp_path, triton_cuobjdump):
    nvcc = ck.nvcc_path()
    if nvcc is None:
        pytest.skip("nvcc not found")
    binary = tmp_path / "read_ceiling"
    done = subprocess.run([nvcc, "-O3", "-std=c++17", "-w", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
                           "-o", str(binary), str(SRC)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", done.stderr)
    assert spills and all(x == ("0", "0") for x in spills), done.stderr
    if triton_cuobjdump is None:
        pytest.skip("no disassembler (Triton's cuobjdump)")
    sass = subprocess.run([str(triton_cuobjdump), "-sass", str(binary)], capture_output=True, text=True, check=True).stdout
    kernels = {m.group(1): body for m, body in zip(re.finditer(r"Function : (\S+)", sass),
                                                     re.split(r"Function : \S+", sass)[1:])}
    by_kind = {kind: [b for name, b in kernels.items() if f"read_{kind}" in name] for kind in ("ldg", "cpasync", "bulk")}
    assert [len(by_kind[k]) for k in ("ldg", "cpasync", "bulk")] == [2, 3, 3], sorted(kernels)
    for body in by_kind["ldg"]:
        assert "LDG.E.NA.128.CONSTANT" in body and "LDGSTS" not in body and "UBLKCP" not in body
    for body in by_kind["cpasync"]:
        assert "LDGSTS.E.BYPASS.128" in body and "UBLKCP" not in body
    for body in by_kind["bulk"]:
        assert "UBLKCP" in body and "SYNCS.PHASECHK.TRANS64.TRYWAIT" in body and "LDGSTS" not in body
