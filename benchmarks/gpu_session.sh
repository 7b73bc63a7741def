#!/usr/bin/env bash
# One GPU session (H200 image: torch 2.11, triton 3.6; `pip install -e .` fails silently there, so the
# package is assembled under /tmp/site).  Usage on the device machine, from the repository root:
#   bash benchmarks/gpu_session.sh OUTDIR PHASE      (PHASE: sweep | final | tables | tilelang | ds | dsfinal | kivicuda | kiviprof | kernels)
set -o pipefail
OUT=${1:-out}; PHASE=${2:-final}
mkdir -p /tmp/site "$OUT" && rm -rf /tmp/site/kvcompress && cp -r kvcompress /tmp/site/ \
  && ln -s "$PWD/kernels" /tmp/site/kvcompress/kernels && ln -s "$PWD/plugins" /tmp/site/kvcompress/plugins
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
date -u | tee "$OUT/date.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv | tee "$OUT/gpu.txt"
best() {  # best config (JSON) from a sweep file: kivi -> {"2": {...}, "4": {...}}, leank -> {...}
  python - "$@" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))["best"]
print(json.dumps({k: v["config"] for k, v in d.items()} if sys.argv[2] == "kivi" else d["config"]))
PY
}
case "$PHASE" in
  sweep)  # first session: correctness + quick sweeps (B = 16, 32k)
    python benchmarks/gpu_kivi.py --out "$OUT" --correctness 2>&1 | tee "$OUT/kivi_correctness.log"
    python benchmarks/gpu_kivi.py --out "$OUT" --sweep --v1 --shapes q2 2>&1 | tee "$OUT/kivi_sweep_q2.log"
    python benchmarks/gpu_leank.py --out "$OUT" --sweep --shapes q70 2>&1 | tee "$OUT/leank_sweep_q70.log"
    ;;
  tables)  # GPU tests and the kernel tables with the code's defaults
    # from outside the checkout: its kvcompress/ (without kernels/) must not shadow /tmp/site's
    (cd /tmp/site && python -m pytest -q -m gpu "$OLDPWD/tests/test_kivi_kernel.py" "$OLDPWD/tests/test_leank_kernel.py" \
      -p no:cacheprovider 2>&1 | tail -15) | tee "$OUT/pytest_gpu.log"
    (cd /tmp/site && python -m kvcompress.kernels.benchutil --device cuda --out "$OUT/kernels.json" \
      --ops sdpa,kivi2,kivi4,leank50,leank70 2>&1) | tee "$OUT/kernels.log"
    ;;
  tilelang)  # TileLang 0.1.15 from .tl/tlsite.tar.xz (its wheels unpacked: tilelang, apache-tvm-ffi 0.1.12,
             # torch-c-dlpack-ext, z3-solver 4.15.4; xz-packed to fit one 64 MiB transfer), then its GPU tests and timing
    mkdir -p /tmp/tl && tar xJf .tl/tlsite.tar.xz -C /tmp/tl && export PYTHONPATH=/tmp/tl/tlsite:$PYTHONPATH
    export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} PATH=/usr/local/cuda/bin:$PATH
    (cd /tmp/site && python -m pytest -q -m gpu "$OLDPWD/tests/test_leank_kernel.py" -k tilelang \
      -p no:cacheprovider 2>&1 | tail -15) | tee "$OUT/pytest_tilelang.log"
    python benchmarks/gpu_leank.py --out "$OUT" --sweep --tilelang --shapes q70 --configs default 2>&1 \
      | tee "$OUT/leank_tilelang.log"
    ;;
  final)  # sweeps over several shapes with v1 before/after, GPU tests, then the kernel tables with the best configs
    python benchmarks/gpu_kivi.py --out "$OUT" --sweep --v1 --shapes wide \
      --configs default,noprefetch,nocap,r96,waves1,waves4,w1bn16,w1bn32,w2bn32s3,w2bn64,w4bn64,eager \
      2>&1 | tee "$OUT/kivi_sweep.log"
    python benchmarks/gpu_leank.py --out "$OUT" --sweep --shapes wide 2>&1 | tee "$OUT/leank_sweep.log"
    export KVCOMPRESS_KIVI_CONFIG=$(best "$OUT/kivi_sweep_wide.json" kivi)
    export KVCOMPRESS_LEANK_CONFIG=$(best "$OUT/leank_sweep_wide.json" leank)
    echo "KIVI $KVCOMPRESS_KIVI_CONFIG LEANK $KVCOMPRESS_LEANK_CONFIG" | tee "$OUT/picked.txt"
    # from outside the checkout: its kvcompress/ (without kernels/) must not shadow /tmp/site's
    (cd /tmp/site && python -m pytest -q -m gpu "$OLDPWD/tests/test_kivi_kernel.py" "$OLDPWD/tests/test_leank_kernel.py" \
      -p no:cacheprovider 2>&1 | tail -15) | tee "$OUT/pytest_gpu.log"
    (cd /tmp/site && python -m kvcompress.kernels.benchutil --device cuda --out "$OUT/kernels.json" \
      --ops sdpa,kivi2,kivi4,leank50,leank70 2>&1) | tee "$OUT/kernels.log"
    ;;
  ds)  # DoubleSparse: GPU tests (fused select, gather), then correctness + timing + launch sweep (--quick)
    (cd /tmp/site && timeout 200 python -m pytest -q -m gpu "$OLDPWD/tests/test_doublesparse_kernel.py" \
      -p no:cacheprovider 2>&1 | tail -15) | tee "$OUT/pytest_ds.log"
    timeout 300 python benchmarks/gpu_doublesparse.py --out "$OUT" --quick --sweep 2>&1 | tee "$OUT/ds.log"
    ;;
  dsfinal)  # DoubleSparse: GPU tests, correctness, the full timing table with the code's defaults (no sweep)
    (cd /tmp/site && timeout 200 python -m pytest -q -m gpu "$OLDPWD/tests/test_doublesparse_kernel.py" \
      -p no:cacheprovider 2>&1 | tail -15) | tee "$OUT/pytest_ds.log"
    timeout 300 python benchmarks/gpu_doublesparse.py --out "$OUT" 2>&1 | tee "$OUT/ds.log"
    ;;
  kivicuda)  # the CUDA KIVI kernel (v3): build, fp64 correctness, timing sweep, then its GPU tests (one script)
    export PATH=/usr/local/cuda/bin:$PATH
    timeout 540 python benchmarks/gpu_kivi_cuda.py --out "$OUT" 2>&1 | tee "$OUT/kivi_cuda.log"
    ;;
  kernels)  # the evaluation harness's kernel benchmark (kvcompress bench --kernels) for KIVI, then the KIVI GPU tests
    export PATH=/usr/local/cuda/bin:$PATH
    (cd /tmp/site && timeout 330 python -m kvcompress.kernels.benchutil --device cuda --out "$OUT/kernels.json" \
      --ops ${KERNEL_OPS:-sdpa,kivi2,kivi4,kivi2-triton} 2>&1) | tee "$OUT/kernels.log"
    (cd /tmp/site && timeout 200 python -m pytest -q -m gpu -n 8 "$OLDPWD/tests/test_kivi_cuda.py" \
      "$OLDPWD/tests/test_kivi_kernel.py" -p no:cacheprovider 2>&1 | tail -6) | tee "$OUT/pytest_kivi.log"
    ;;
  kiviprof)  # where the v3 kernel's time goes: timing probes, then Nsight Compute (full set, SASS stall samples)
    export PATH=/usr/local/cuda/bin:$PATH
    timeout 300 python benchmarks/gpu_kivi_profile.py --out "$OUT" --time 2>&1 | tee "$OUT/kivi_profile.log"
    mkdir -p /tmp/prof
    for v in ${KIVI_PROF_VARIANTS:-v3 kf1-vf}; do
      timeout 150 ncu --clock-control none --set full --import-source yes -k regex:kivi_v3_kernel --launch-skip 2 \
        --launch-count 1 -f -o /tmp/prof/$v python benchmarks/gpu_kivi_profile.py --run $v > /tmp/prof/$v.ncu.log 2>&1
      tail -5 /tmp/prof/$v.ncu.log
      ncu -i /tmp/prof/$v.ncu-rep --page details --print-details all > /tmp/prof/$v.details.txt 2>&1
      ncu -i /tmp/prof/$v.ncu-rep --page raw --csv > /tmp/prof/$v.raw.csv 2>&1
      ncu -i /tmp/prof/$v.ncu-rep --page source --csv --print-source sass > /tmp/prof/$v.sass.csv 2>&1
      head -c 300 /tmp/prof/$v.sass.csv; echo
    done
    grep -h -E "Warp Cycles Per Issued|Issued Ipc|Stall|Memory Throughput|DRAM Throughput|Achieved Occupancy|No Eligible|L2 Hit|Bank" \
      /tmp/prof/*.details.txt | head -80
    tar czf "$OUT/prof.tgz" -C /tmp prof
    ;;
esac
