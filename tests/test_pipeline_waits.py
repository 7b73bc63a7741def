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
