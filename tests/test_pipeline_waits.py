"""benchmarks/pipeline_waits.py's reading of a TTGIR loop, on hand-written IR with known waits and loads."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _loop_facts():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from pipeline_waits import loop_facts
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return loop_facts


IR = """
    %q = tt.load %qp : tensor<16x128x!tt.ptr<f16>>
    %a:3 = scf.for %i = %s to %e step %c64 iter_args(%x = %c0) -> (tensor<16xf32>) {
      %blk = tt.load %tp : tensor<64x!tt.ptr<i32>>
      %r:4 = scf.for %j = %c0 to %n step %c4 iter_args(%y = %x) -> (tensor<16xf32>) {
        %ok = tt.load %vp, %m : tensor<64x!tt.ptr<i8>>
        %k = ttg.async_wait %k1, %v1 {num = 2 : i32}
        %s = tt.dot %q, %k
        %ok2 = tt.load %vp2, %m2 : tensor<64x!tt.ptr<i8>>
        %k2 = ttg.async_copy_global_to_local %kp, %kb mask %ok2
      }
      %d = ttg.async_wait {num = 0 : i32}
    }
    %o = tt.load %lp : tensor<16x!tt.ptr<f32>>
"""


def test_loop_facts_reads_the_pipelined_loop_only():
    loop_facts = _loop_facts()
    # the inner (pipelined) loop: one wait keeping 2 groups in flight, two plain loads; the outer loop's table load,
    # the query load before it and the drain after it are not counted
    assert loop_facts(IR) == {"waits": [2], "plain_loads": 2}
    drained = IR.replace("{num = 2 : i32}", "{num = 0 : i32}").replace("%ok = tt.load", "%ok = arith.constant")
    assert loop_facts(drained) == {"waits": [0], "plain_loads": 1}


def _helpers():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from pipeline_waits import STEP_OPS, dot_kwidths, sass_step
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return STEP_OPS, dot_kwidths, sass_step


SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64] ;
.L_x_1:
        /*0020*/                   DEPBAR.LE SB0, 0x2 ;
        /*0030*/              @!P0 LDS.64 R6, [R8] ;
        /*0040*/                   LDSM.16.M88.4 R10, [R9] ;
        /*0050*/                   HMMA.16816.F32 R12, R10, R6, RZ ;
        /*0060*/               @P1 LDG.E.U8 R14, desc[UR4][R16.64] ;
        /*0070*/                   IMAD.MOV.U32 R6, RZ, RZ, R7 ;
        /*0080*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0090*/               @P2 BRA `(.L_x_1) ;
        /*00a0*/                   BRA `(.L_x_0) ;
        /*00b0*/                   EXIT ;
"""


def test_sass_step_reads_the_innermost_loop():
    step_ops, _, sass_step = _helpers()
    got = sass_step(SASS)
    # the loop to .L_x_1 (8 instructions, its branch included), not the outer one to .L_x_0 (10)
    assert got["instructions"] == 8
    assert {op: got[op] for op in step_ops} == {"HMMA": 1, "LDSM": 1, "LDS": 1, "LDGSTS": 0, "LDG": 1, "IMAD": 1,
                                                "BAR": 1}
    assert sass_step("        /*0000*/ EXIT ;")["instructions"] == 0  # no loop


def test_dot_kwidths_lists_each_operand_width_once():
    _, dot_kwidths, _ = _helpers()
    ir = ("%a = ttg.local_load %x -> tensor<16x128xf16, #ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 4}>>\n"
          "%b = ttg.local_load %y -> tensor<128x64xf16, #ttg.dot_op<{opIdx = 1, parent = #mma, kWidth = 4}>>\n"
          "%c = ttg.local_load %z -> tensor<64x128xf16, #ttg.dot_op<{opIdx = 1, parent = #mma, kWidth = 2}>>\n")
    assert dot_kwidths(ir) == [2, 4]
