#!/usr/bin/env bash
# Session 35 (issue 19): the next device calls, each one command (run from the exported tree: cd .gpusrc; carry
# .gpusrc and .gpuwheels).
#   PART=stages  bash benchmarks/gpu_s35_session.sh $OUT   the lanes kernel's pipeline depth: the default against 3
#       and 4 stages (KVCOMPRESS_LEANK_CONFIG {"num_stages": N}) for every lanes op at the Llama shapes and the
#       SmolLM2 B16 / B64 reads.  benchmarks/read_occupancy.py (offline, Triton 3.6, sm_90) puts the Llama builds at 4
#       stages - LeanK, low rank, and the empty stack from 128 batch x heads - at 104448 bytes of shared memory, 2
#       programs per SM, and at 3 stages at 71680 bytes, 3 per SM.  The depth was last swept before session 16, under
#       older split rules: 3 stages faster at LeanK-70 B16, slower at B1 and B64 (the empty stack B64: 0.94x ->
#       0.78x); the B64 splits then were one per row, which at 3 per SM leaves a second wave 29 % full - the resident
#       split count (resident_batch 16, since session 34) fills it, and that pairing has not been timed.
#   PART=occupancy  the same launches' builds as the device compiles them (benchmarks/read_occupancy.py
#       --device-build, Llama heads): registers and shared memory from the driver, against the offline table
#       (docs/data/s35_offline/); the paged kernel's offline build (146-148 registers, 3 per SM) disagrees with
#       session 27's Nsight Compute reading (112, 4 per SM).
#   PART=grid / PART=splits: benchmarks/gpu_s34_session.sh (not yet run).
set -o pipefail
OUT=$(realpath "${1:-out}")
HERE=$(cd "$(dirname "$0")" && pwd)
case "${PART:-stages}" in
  stages)
    cd "$HERE/.." || exit 1
    PS_TESTS=none PS_VAR=KVCOMPRESS_LEANK_CONFIG PS_OPS=${S35_OPS:-none,lowrank,leank50,leank70,leank70-kivi2} \
      PS_SHAPES=${S35_SHAPES:-llama3-8b:1:32k,llama3-8b:4:32k,llama3-8b:16:4k,llama3-8b:16:32k,llama3-8b:64:4k,llama3-8b:64:32k,smollm2-135m:16:32k,smollm2-135m:64:32k} \
      bash benchmarks/gpu_paged_sweep.sh "$OUT" '{}' '{"num_stages": 3}' '{"num_stages": 4}'
    rm -f "$OUT/base.json"
    ;;
  occupancy)
    cd "$HERE/.." || exit 1
    source "$HERE/gpu_site.sh"  # install under /tmp/site, cd there
    timeout 300 python "$SRC/benchmarks/read_occupancy.py" --device-build --models "${S35_MODELS:-llama3-8b}" \
      --out "$OUT/occupancy_device.json" > "$OUT/occupancy_device.md" 2> "$OUT/occupancy_device.err"
    tail -3 "$OUT/occupancy_device.err"; cat "$OUT/occupancy_device.md"
    ;;
  grid|splits) bash "$HERE/gpu_s34_session.sh" "$OUT" ;;
  *) echo "PART: stages, occupancy, grid or splits" >&2; exit 2 ;;
esac
