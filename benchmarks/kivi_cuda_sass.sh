#!/usr/bin/env bash
# The KIVI CUDA kernel's sm_90a builds at six variants (2 / 4 bits, the key / value folds, the lanes build with the
# soft-cap and the buffer CTAs), without a GPU: SASS per variant with the addresses stripped, its instruction count and
# a hash, to check that a source change leaves the machine code alone.  Needs nvcc and a cuobjdump (Triton's bundled
# one is used when none is on the PATH).
#   bash benchmarks/kivi_cuda_sass.sh OUT_BEFORE [SOURCE]     (default SOURCE: kernels/kivi/cuda_kernel.cu)
#   ... change the source ...; bash benchmarks/kivi_cuda_sass.sh OUT_AFTER; diff -r OUT_BEFORE OUT_AFTER
set -e
OUT=$(realpath -m "${1:?usage: kivi_cuda_sass.sh OUT [SOURCE]}"); mkdir -p "$OUT"
SRC=${2:-$(dirname "$0")/../kernels/kivi/cuda_kernel.cu}
CUOBJ=$(command -v cuobjdump || python -c "import os, triton; print(os.path.join(os.path.dirname(triton.__file__), 'backends', 'nvidia', 'bin', 'cuobjdump'))")
build() {
  local name=$1; shift
  nvcc -O3 --use_fast_math -std=c++17 -cubin -arch=sm_90a "$@" -o "$OUT/$name.cubin" "$SRC" 2>/dev/null
  "$CUOBJ" -sass "$OUT/$name.cubin" 2>/dev/null | sed 's#/\*[0-9a-f]*\*/##g' \
    | awk '/Function :/ {f = $3; next} /^[ \t]+[A-Z@]/ {gsub(/^[ \t]+/, ""); print f "\t" $0}' > "$OUT/$name.sass"
  rm -f "$OUT/$name.cubin"
  echo "$name: $(wc -l < "$OUT/$name.sass") instructions, $(md5sum < "$OUT/$name.sass" | cut -c1-12)"
}
DIMS=(-DKIVI_DK=128 -DKIVI_DV=128 -DKIVI_MIN_BLOCKS=4)
build b2 -DKIVI_BITS=2 "${DIMS[@]}" & build b4 -DKIVI_BITS=4 "${DIMS[@]}" & wait
build kfold1 -DKIVI_BITS=2 "${DIMS[@]}" -DKIVI_KFOLD=1 & build kfold2-vfold -DKIVI_BITS=2 "${DIMS[@]}" -DKIVI_KFOLD=2 -DKIVI_VFOLD=1 & wait
build vfold-b4-d64 -DKIVI_BITS=4 -DKIVI_DK=64 -DKIVI_DV=64 -DKIVI_MIN_BLOCKS=4 -DKIVI_VFOLD=1 &
build lanes-softcap -DKIVI_BITS=2 "${DIMS[@]}" -DKIVI_LANES=1 -DKIVI_LANE_DK0=32 -DKIVI_LANE_DK1=96 -DKIVI_QDIM=128 -DKIVI_SOFTCAP=1 &
wait
