"""The KIVI kernel's phase-clock build (-DKIVI_PHASES=1, benchmarks/gpu_kivi_phases.py): it compiles without spills
within the default register cap, the default build has none of it, ``build_for`` selects it from ``phases``, and the
script's decoding of a warp's record."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvcompress.kernels.kivi import cuda_kernel as ck

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_kivi_phases  # noqa: E402


def _cubin(tmp_path, *defines):
    if not ck.nvcc_path():
        pytest.skip("nvcc not on the PATH")
    out = tmp_path / "k.cubin"
    cmd = [ck.nvcc_path(), "-O3", "--use_fast_math", "-std=c++17", "-cubin", "-gencode=arch=compute_90a,code=sm_90a",
           "-Xptxas", "-v", "-DKIVI_BITS=2", "-DKIVI_DK=128", "-DKIVI_DV=128", "-DKIVI_MIN_BLOCKS=4", *defines,
           "-o", str(out), str(ck.SOURCE)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stderr


def test_phase_build_compiles_without_spills_under_the_default_cap(tmp_path):
    report = _cubin(tmp_path, "-DKIVI_PHASES=1")
    entries = re.findall(r"Compiling entry function '(\w+)' for 'sm_90a'", report)
    assert len([e for e in entries if "kivi_v3_kernel" in e]) == 6, entries
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert len(spills) == len(entries) and all(s == ("0", "0") for s in spills), report
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", report)]
    assert regs and max(regs) <= 128
    assert "kivi_phase_buf" in report or "kivi_phase_buf" in (tmp_path / "k.cubin").read_bytes().decode("latin-1")


def test_default_build_records_no_phases(tmp_path):
    _cubin(tmp_path)
    assert "kivi_phase_buf" not in (tmp_path / "k.cubin").read_bytes().decode("latin-1")


def test_build_for_selects_the_phase_build(monkeypatch):
    seen = {}

    def fake_compile(path, command, failure):  # what build() would compile; compiles nothing
        seen["path"], seen["cmd"] = path, command(str(path))
        raise RuntimeError("not compiled")

    monkeypatch.setattr(ck, "compile_cached", fake_compile)
    monkeypatch.setattr(ck, "_LIBS", {})
    with pytest.raises(RuntimeError, match="not compiled"):
        ck.build_for(2, 128, 128, {**ck.DEFAULT_CONFIG, "phases": 1})
    assert "-DKIVI_PHASES=1" in seen["cmd"] and "_ph_" in seen["path"].name
    with pytest.raises(RuntimeError, match="not compiled"):
        ck.build_for(2, 128, 128, dict(ck.DEFAULT_CONFIG))
    assert "-DKIVI_PHASES=1" not in seen["cmd"] and "_ph_" not in seen["path"].name


def _record(t0, clocks, tiles, t1, sm=3):
    rec = [0] * gpu_kivi_phases.SLOTS
    rec[0], rec[1], rec[2], rec[10] = t0, sm, tiles, t1
    rec[3:10] = clocks
    return rec


def test_warp_phases_decode_a_record():
    # 2 cycles per ns: 2000 cycles per µs; entry at cycle 1000, then +2000 (prologue), +1000 (query), +4000, +10000, +6000, +2000
    clocks = [1000, 3000, 4000, 8000, 18000, 24000, 26000]
    ph = gpu_kivi_phases.warp_phases(_record(500, clocks, 4, 500 + 12500))
    assert ph == pytest.approx({"prologue": 1.0, "query": 0.5, "first_wait": 2.0, "tiles": 5.0, "merge": 3.0,
                                "write": 1.0})
    # a warp without tiles waits for no copy: its first_wait is 0 and the loop phase runs from the query build
    clocks = [1000, 3000, 4000, 0, 5000, 24000, 26000]
    ph = gpu_kivi_phases.warp_phases(_record(500, clocks, 0, 500 + 12500))
    assert ph["first_wait"] == 0 and ph["tiles"] == pytest.approx(0.5)
    assert gpu_kivi_phases.warp_phases([0] * gpu_kivi_phases.SLOTS) is None  # a record no warp wrote


def test_summarize_takes_medians_over_the_written_records():
    recs = [_record(100 * i, [0, 2000 * (i + 1), 2000 * (i + 1), 2000 * (i + 2), 2000 * (i + 3), 2000 * (i + 4),
                              2000 * (i + 5)], 2, 100 * i + 5000) for i in range(3)]
    recs.append([0] * gpu_kivi_phases.SLOTS)
    s = gpu_kivi_phases.summarize(recs)
    assert s["warps"] == 3 and s["tile_counts"] == {"2": 3}
    # every phase has its statistics (the tile counts once overwrote the "tiles" phase: KeyError on the GPU)
    assert all(set(s[p]) == {"median", "p90"} for p in gpu_kivi_phases.PHASES)
    assert s["entry_skew_us"] == pytest.approx(0.2) and s["span_us"] == pytest.approx(5.2)
    # warp i: (i + 5) * 2000 cycles over 5000 ns; its prologue phase is (i + 1) / (i + 5) * 5 µs
    want = sorted((i + 1) / (i + 5) * 5 for i in range(3))
    assert s["prologue"]["median"] == pytest.approx(want[1])
