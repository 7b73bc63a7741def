#!/usr/bin/env bash
# Nsight Compute per SASS line of one kernel of one benchutil read: the lines with the most shared-memory bank
# conflicts (L1 wavefronts shared excessive), uncoalesced global sectors and warp stall samples.  One device call:
#   bash benchmarks/gpu_ncu_source.sh OUTDIR OP SHAPE KERNEL_REGEX
# Writes OUTDIR/source.ncu-rep (open it in Nsight Compute) and OUTDIR/source_top.txt (the top lines of each metric).
set -o pipefail
OUT=$(realpath -m "${1:-out}"); OP=$2; SHAPE=$3; KERN=$4
source "$(dirname "$0")/gpu_site.sh"  # install under /tmp/site, cd there
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
timeout 300 "$NCU" --clock-control none -k "regex:$KERN" -s 3 -c 1 --import-source yes \
  --section SourceCounters --section WarpStateStats --section MemoryWorkloadAnalysis_Tables -o "$OUT/source" -f \
  python -m kvcompress.kernels.benchutil --device cuda --ops "$OP" --only-shapes "$SHAPE" > "$OUT/ncu_run.txt" 2>&1
echo "rc $?" >> "$OUT/ncu_run.txt"
"$NCU" -i "$OUT/source.ncu-rep" --page source --print-source sass --csv > /tmp/source.csv 2>> "$OUT/ncu_run.txt"
python - /tmp/source.csv "$OUT/source_top.txt" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1], errors="replace")))
head = next((i for i, r in enumerate(rows) if any("Source" == c or "Address" == c for c in r)), 0)
names, body = rows[head], [r for r in rows[head + 1:] if len(r) == len(rows[head])]
def num(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0
with open(sys.argv[2], "w") as f:
    f.write("columns: " + " | ".join(names) + "\n")
    for col, name in enumerate(names):
        if not any(k in name for k in ("Excessive", "Stall Sampling", "Sectors")):
            continue
        top = sorted(body, key=lambda r: -num(r[col]))[:25]
        f.write(f"\n== top by {name} (total {sum(num(r[col]) for r in body):.0f})\n")
        for r in top:
            f.write(f"{num(r[col]):>12.0f}  " + " | ".join(c[:90] for c in r[:2]) + "\n")
PY
date -u | tee -a "$OUT/log.txt"
