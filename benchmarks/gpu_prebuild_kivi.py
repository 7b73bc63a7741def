"""Compile, in parallel, every KIVI CUDA library that ``tests/test_kivi_cuda.py -m gpu`` loads, so that the tests
spend a device call's minutes on the GPU rather than on ~60 serial ``nvcc`` runs (about 8 s each).

    python benchmarks/gpu_prebuild_kivi.py [--jobs N]

The libraries land in the build cache (``$KVCOMPRESS_CACHE`` or ``~/.cache/kvcompress``) that the tests then load
from; :func:`kvcompress.kernels.kivi.cuda_kernel.build` writes each library to a temporary file and renames it, so
parallel builds of different keys are safe.  Needs ``nvcc``, not a GPU.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from kvcompress.kernels.kivi import cuda_kernel as ck  # noqa: E402

# the build options the GPU tests launch with (test_kivi_cuda.py: the defaults, every fold variant, min_blocks 1 / 5)
TEST_CONFIGS = [{}, {"min_blocks": 1}, {"min_blocks": 5}, {"kfold": 1}, {"kfold": 2}, {"vfold": 1},
                {"kfold": 1, "vfold": 1}, {"kfold": 2, "vfold": 1}, {"kfold": 1, "vfold": 1, "min_blocks": 1}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    from test_kivi_cuda import CASES  # the test cases' (bits, Dk, Dv): one source of truth

    dims = sorted({(c[6], c[3], c[4]) for c in CASES.values()})
    jobs = [(bits, dk, dv, {**ck.DEFAULT_CONFIG, **cfg}) for bits, dk, dv in dims for cfg in TEST_CONFIGS]
    t0 = time.time()

    def one(job):
        bits, dk, dv, cfg = job
        ck.build_for(bits, dk, dv, cfg)

    with ThreadPoolExecutor(args.jobs) as pool:
        for _ in pool.map(one, jobs):
            pass
    print(f"prebuilt {len(jobs)} KIVI CUDA libraries ({len(dims)} (bits, Dk, Dv) x {len(TEST_CONFIGS)} build options) "
          f"in {time.time() - t0:.0f} s with {args.jobs} jobs")


if __name__ == "__main__":
    main()
