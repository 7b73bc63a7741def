#!/usr/bin/env bash
# Nsight Compute on one kernel of one benchutil read per case (Firecracker machines read the hardware counters;
# clocks left alone): where a kernel's time goes - memory throughput, achieved occupancy, warp stall reasons and the
# SASS lines that stall most.  One device call:
#   bash benchmarks/gpu_ncu.sh OUTDIR 'OP|SHAPE|KERNEL_REGEX' ...
#   e.g. 'paged-dense|llama3-8b:16:32k|_paged_split_kernel' 'none|llama3-8b:16:32k|_lanes_kernel'
# Each case: benchutil --ops OP --only-shapes SHAPE under ncu, the 4th launch of a kernel matching KERNEL_REGEX
# (after the benchmark's warm-up calls); sections SpeedOfLight, MemoryWorkloadAnalysis, Occupancy, LaunchStats,
# SchedulerStats, WarpStateStats, SourceCounters; the report as text in OUTDIR/ncu.txt (one file for every case).
# NCU_SOURCE=1: also each case's per-SASS-instruction table (warp stall samples, instructions executed) as CSV in
# OUTDIR/source_N.csv (ncu --page source --print-source sass), to find the instructions a kernel waits on.
set -o pipefail
OUT=$(realpath -m "${1:-out}"); shift || true
source "$(dirname "$0")/gpu_site.sh"  # install under /tmp/site, cd there
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU" | tee -a "$OUT/ncu.txt"
for case in "$@"; do
  IFS='|' read -r op shape kern <<< "$case"
  echo "########## $op $shape $kern" | tee -a "$OUT/ncu.txt"
  timeout 240 "$NCU" --clock-control none -k "regex:$kern" -s 3 -c 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
    --section SchedulerStats --section WarpStateStats --section SourceCounters \
    python -m kvcompress.kernels.benchutil --device cuda --ops "$op" --only-shapes "$shape" 2>&1 \
    | grep -v "^==PROF==\|^| \|^|---" >> "$OUT/ncu.txt"
  echo "rc $?" >> "$OUT/ncu.txt"
  if [ -n "${NCU_SOURCE:-}" ]; then
    n=$((${n:-0} + 1))
    timeout 240 "$NCU" --clock-control none -k "regex:$kern" -s 3 -c 1 --section SourceCounters \
      --section WarpStateStats -f -o "$OUT/rep_$n" \
      python -m kvcompress.kernels.benchutil --device cuda --ops "$op" --only-shapes "$shape" > /dev/null 2>&1
    "$NCU" -i "$OUT/rep_$n.ncu-rep" --page source --csv --print-source sass > "$OUT/source_$n.csv" 2>&1
    echo "source_$n.csv: $op $shape $kern rc $?" | tee -a "$OUT/ncu.txt"
    rm -f "$OUT/rep_$n.ncu-rep"
  fi
done
date -u | tee -a "$OUT/log.txt"
