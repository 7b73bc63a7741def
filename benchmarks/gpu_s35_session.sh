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
#   PART=shapes  the same reads under launch shapes never timed (the last sweep, before session 16, tried 2 / 3 / 4
#       stages, 2 / 4 waves, BN 128 with 4 / 8 warps): 32-token steps at 4 stages (4 programs per SM at Llama heads:
#       the same 192 KB of copies in flight per SM as the default's 2, twice the warps), 32-token steps with 2 warps at
#       3 stages (5-6 per SM), 8 warps at 3 stages (3 per SM, 24 warps) - docs/data/s35_offline/
#       read_occupancy_variants_triton36.md.  Llama shapes; PART=shapes-smol: the SmolLM2 shapes, with 128-token
#       steps at 3 stages in place of 2 warps (3 programs per SM at d 64, a quarter of the steps per byte).
#   PART=valid-ahead  the lanes kernel with each block's valid flags loaded a block ahead (opt-in valid_ahead; the
#       pipeline copies K and V ahead but not the byte-wide flags, so in the sm_90 SASS each 64-token block waited for
#       its flags' four loads before masking its scores) against the default, two rounds.
#   PART=warp-groups  the lanes kernel with the query rows repeated in 2 or 4 groups, each scoring its part of every
#       block with its own softmax state (opt-in warp_groups): with 4 groups the MMA tile is 64 rows, each warp owns
#       whole rows and nothing is exchanged between warps per block (Triton then uses wgmma: 220-232 registers, 2
#       programs per SM at 3 stages, offline); 4x the tensor-core work of a memory-bound read.
#   PART=occupancy  the same launches' builds as the device compiles them (benchmarks/read_occupancy.py
#       --device-build, Llama heads): registers and shared memory from the driver, against the offline table
#       (docs/data/s35_offline/, docs/data/s36_offline/; session 36: the paged kernel's offline build of the
#       grid's launch - no live length - takes 108-112 registers, as session 27's Nsight Compute read).
#   PART=buffer-tests  the KIVI buffer read's GPU tests (tests/test_kivi_buffer_read.py, tests/test_kivi_lanes.py):
#       session 35 changed the buffer CTAs' loop (kernels/kivi/cuda_kernel.cu attend_buffer: the valid flags of 32 slots
#       in one ballot, the next valid slot's key and value loaded before the current one is scored), built and checked
#       offline (nvcc 13.0: no spills at sm_90a / sm_80, every cap) but not yet run on a GPU.
#   PART=buffer-ab  the reads that take the buffer CTAs - static KIVI-2, LeanK-70 + KIVI-2 - timed from this tree and
#       from the tree before the change, alternating (benchmarks/gpu_ab_trees.sh).  Export both first:
#         git archive HEAD | tar -x -C .gpusrc; git archive <the commit before the buffer loop> | tar -x -C .gpusrc_old
#       carry [".gpusrc", ".gpusrc_old", ".gpuwheels"]; run: PART=buffer-ab bash .gpusrc/benchmarks/gpu_s35_session.sh
#       $OUT (from the device copy's root, not from .gpusrc).
#   PART=buffer-rule  when to read the buffer in the same launch, with the new buffer CTAs: the default rule
#       (buffer_rows 16, buffer_work 256k, from session 26's slower CTAs) against a wider one and against never
#       (KVCOMPRESS_KIVI_CUDA_CONFIG) for static KIVI-2 and LeanK-70 + KIVI-2 from B4 to B64.
#   PART=buffer-ctas  how many buffer CTAs: the default's 16 (LeanK + KIVI's 1k-slot buffer in runs of 64) against 32
#       and 64 (new setting buffer_ctas) at the batch-1 / batch-4 reads, where the buffer CTAs are the longest chain.
#   PART=paged-shapes  the paged dense read (10 of the 52 cells below 1x, from B16) under launch shapes not timed since
#       session 19's defaults changed: 2 pages (32 tokens) per step - offline, Llama heads, 3 stages: 100 registers,
#       37888 B, 4 programs per SM where the default's 71680 B of shared memory hold 3 (docs/data/s36_offline/
#       paged_occupancy_triton36.md) - and 8 warps (2 per SM, 16 warps); the paged kernel's GPU tests first.
#   PART=grid / PART=splits: benchmarks/gpu_s34_session.sh (not yet run).
# Session 37: buffer_ctas "auto" is the default (kernels/kivi/cuda_kernel.py buffer_launch: a launch of at most 16
# rows over at most 128k rows x region slots spreads its buffer over about 384 CTAs of at least 16 slots).
#   PART=grid37  the GPU tests of the KIVI buffer read and the lanes kernels (xdist), then the grid rows of the ops
#       that changed since session 34 - leank50, leank70, leank70-kivi2 (valid_ahead, the buffer CTAs), none, lowrank
#       (valid_ahead) - at every shape, into grid.json (PART=grid37b: no tests, continues G_RESUME's grid JSON).
#   PART=grid-full  every op of the grid at every shape, no tests (about 110 s on the H200).
#   PART=split-cap  the lanes kernel's one-wave split cap (single_wave_split_tokens 1536, session 37) against none,
#       SmolLM2 B1 (the one-wave launches of the grid) at 4k / 32k / 128k and Llama B1 / 128k (unaffected), 2 rounds.
#   PART=paged-late  the paged kernel with its K copies masked by the page, not the slots' valid flags (opt-in
#       valid_late, session 37: in the sm_90 TTGIR the flags' synchronous load sat before both copies of each
#       prefetched step), and with the flags of a block of steps loaded with its page ids (opt-in valid_block: no
#       load left in the steps; 168 registers against 110), against the default, the 9 paged-dense reads below 1.0x
#       and Llama B1 / 32k, two rounds.
#   PART=ds-steps  the DoubleSparse gathers with their indices loaded several steps at a time (opt-in index_steps,
#       session 37: without it each step waits for every copy in flight, sm_90 TTGIR) against the default, and with
#       64 indices a step in the group-shared gather (the same 71680 B of shared memory as the default's 128 - with
#       128 a step and index_steps the three stages really buffer: 139264 B, one program per SM), B4-B64, two rounds.
#   PART=tests37  grid37's GPU tests alone (and tests/test_kivi_lanes_buffer.py), 12 xdist workers.
#   PART=paged-tests  the paged kernel's GPU tests (xdist) and one read (session 38).
#   PART=paged-layout  why the paged dense read falls below SDPA from B16 (10 of the 43 cells below 1x): the same
#       read over pools differing only in page layout (benchmarks/paged_layout_probe.py; PL_SHAPES to change shapes).
#   PART=profile4k  per-kernel time of the Llama 4k lanes reads below 1x (benchmarks/gpu_read_profile.py).
#   PART=ops-grid  every read op against the reference at the grid's shapes (benchmarks/gpu_ops_check.py --grid
#       --eager; OG_SHAPES=grid-llama3-8b-b16-,... for the other batches).
#   PART=buffer-auto  the rule against the old fixed 16 CTAs of 32 slots ({"buffer_ctas": 16}), static KIVI-2 and
#       LeanK-70 + KIVI-2 at the batch-1 / batch-4 reads the rule changes (and Llama B1 / 32k, which it keeps), two rounds.
# Session 36 ran buffer-tests, buffer-ab, stages, buffer-ctas, valid-ahead, shapes and shapes-smol on an H100
# (docs/results.md "Session 36"; valid_ahead is now the default).  Left, in this order: PART=grid on an H200 (the
# grid's lanes rows with valid_ahead and the new buffer CTAs, for docs/data/grid_latest.txt), buffer-rule,
# paged-shapes, warp-groups, occupancy, splits; and a buffer_ctas rule (more CTAs where the buffer has few rows).
# Session 37 (H200) ran buffer-auto, grid37, paged-shapes, buffer-rule, warp-groups, grid-full and splits
# (docs/results.md "Session 37").  Left, in this order: PARTS="paged-late ds-steps split-cap" (opt-in valid_late and
# index_steps, the one-wave split cap, each against the default), then grid-full on an H200 with whatever won.
# Session 38 ran paged-late, split-cap (H100), ds-steps, paged-tests and grid-full (H200): no opt-in won, the cap
# stays, the grid is 43 of 312 below 1x (docs/results.md "Session 38").  Left: PARTS="paged-layout profile4k" (why
# the paged dense read is 0.85-0.95x from B16, where the lanes kernel reading the same bytes is at SDPA's bandwidth;
# where the 4k lanes reads below 1x spend their time), then ops-grid in pieces (B1-B4, B16, B64: correctness at the
# grid's shapes after the changes since session 21).
# Session 39 (H100 only) ran all of that: the ops pass at every grid shape; the paged dense gap from B16 is the
# caching allocator's (0.81-0.84x -> 0.96-1.00x with expandable segments), not the page layout (docs/results.md
# "Session 39").  Left: PARTS="grid-full grid-full-expandable" on an H200 (the whole grid under the default allocator
# and under expandable segments, same machine; about 210 s each), then the 4k lanes reads' launch rule (lanes4k, two
# rounds, H200), PART=proj-stages (the opt-in 3-stage rule for low rank, two rounds, H200) and
# PART=compiled-expandable (compiled decode of every stack under the allocator setting the README recommends),
# PART=none-resident (the opt-in resident split count for the empty stack at B1 / B4, two rounds), PART=ds-tests
# (the DoubleSparse GPU tests after the fused select's candidate buffers lost their memsets).
# Session 40 (H100 only) ran grid-full, grid-full-expandable, none-resident, proj-stages, ds-tests,
# compiled-expandable and rules40 (docs/results.md "Session 40"): the two lanes rules are defaults where they won.
# Left, on an H200: PARTS="grid-full buffer-apart rules40" (about 250 + 80 + 145 s: the README count with session
# 40's defaults; the LeanK-70 + KIVI-2 Llama B4/4k cell, 0.81x on the H200 - its one-launch read of a 1024-slot
# buffer - against the two regions apart; the two new lanes rules against the old on the H200), then PART=ds-search
# (the opt-in interpolation search of the DoubleSparse select, its GPU tests and two rounds) and lanes4k.
# Session 41 (H100 only) ran grid-full (twice), buffer-apart, rules40, ds-search, buffer-weight and lanes4k
# (docs/results.md "Session 41"); the buffer's slots now count in the fuse rule (buffer_weight 6, checked as the
# default by buffer-weight), and few-program DoubleSparse selects take unroll 16 (not yet run as the default).  Left:
# PARTS="ds-unroll ds-fused paged-pdl" (about 150 + 120 + 100 s: the unroll rule's GPU tests and two rounds against
# unroll 4; the one-kernel DoubleSparse select + gather against the two kernels - the model takes it with
# KVCOMPRESS_DS_CONFIG='{"fuse_gather": true}' since session 42, and the grid's ds ops follow that setting; the paged
# kernel's opt-in PDL merge, never timed), PART=ds-fused-model if ds-fused shows the one kernel faster (whole decode
# steps with it, about 340 s), then PART=splits1 (about 60 s: one split at Llama B16 / B64 for the empty
# stack and low rank), then on an H200 grid-full for the README count.  On a two-GPU machine: PART=tp2, then
# PART=tp2-throughput, one call each (issue 18's bar).
# Session 43 (H100) ran ds-unroll, ds-fused, paged-pdl and splits1 (docs/results.md "Session 43"): the unroll rule
# holds, the one-kernel DoubleSparse read became a rule (fuse_gather null -> fuse_rule), the empty stack's Llama reads
# filling the SMs take one split (one_split_tokens), PDL for the paged merge stays opt-in.  Left: PARTS="rules43-ds
# rules43-none ds-fused-long" (about 120 + 60 + 150 s: each rule against itself off, with its GPU test; the one
# kernel at 8k / 16k, where the rule has no data), then grid-full on an H200 for the README count.
# Session 45 (H100) ran rules43-ds, rules43-none, ds-fused-long, grid-full three times, rules45-ds and
# ds-cluster-mid (docs/results.md "Session 45"): the one-split rule holds; session 43's fuse rule made Llama B16 / B64
# 4k reads 59-138 % slower and was refitted to every measured pair (benchmarks/fuse_rule_fit.py; as the default never
# slower, H100 grid 37 -> 34 of 311); 8193-16384 label tokens over up to 16 rows take the cluster select (C = 4).
# Left: grid-full on an H200 for the README count; ds-cluster-mid again as the default (its {} column).
# Session 46 (H100) ran grid-full (31 of 311) and ds-cluster-mid (the rule holds as the default), then two parts
# since removed with what they timed (docs/results.md "Session 46"): none-tma (TMA copies for the empty stack's read,
# equal, at e45ce49) and cache-memory (a driver-mapped pool for cache buffers, which did not avoid the slow state of
# a read, at 89b2417); benchmarks/gpu_vmm_probe.py and gpu_placement_probe.py are the probes of that state.
# Left: grid-full on an H200 for the README count.
# Session 47 (H100 / H200) timed the DoubleSparse cluster select phase by phase (benchmarks/gpu_cluster_phases.py)
# and cut its cross-CTA rounds, each cut A/B'd by benchmarks/gpu_ab_trees.sh; grid-full on an H100: 25 of 311
# (docs/results.md "Session 47").
# Session 48 (H100) timed session 47's two opt-ins (parts ds-find and ds-emit, since removed with the code they
# compared; their last tree is bc7ef36): the grouped cluster find became the only find, emit_vectors got a rule
# (emit_auto).
# It also ran ds-cluster-size (the rule holds), ds-cluster-4k (no cluster size lifts the 4k reads), two H100 grids
# (25 and 26 of 311) and, on an H200, the DoubleSparse GPU tests of the relaxed last cluster arrive (b96e517) and the
# four DoubleSparse ops at 11 shapes (docs/results.md "Session 48").
# Session 49 (H100) ran ds-fence (racecheck, the GPU tests, two rounds of the opt-in shared-memory exchange fence
# against cluster.sync(): 2 - 8 % faster at all 24 cluster reads); the fence became the only exchange barrier and the
# part became ds-racecheck (its last tree with the comparison is 44b2ba9); A/B'd as reads against 85d9be2 (the
# fence, the relaxed last arrive, the query-row loads: 23 of 24 cluster reads faster, geometric mean 0.95) and an
# H100 grid-full (24 of 311).  Then ds-attend timed a one-launch cluster select + attention (cuda.attend = C): its GPU
# tests passed but it was slower at every read it took (4k: +7 to +26 % at C = 8), so it was removed with its part
# (its tree is 73b2c55; docs/results.md "Session 49").  So were, after an A/B each, an L2 prefetch of the cluster
# select's label rows (8e89e9b: 17 of 24 reads slower) and a 256-thread cluster select with 16 label rows in flight
# and the select + attention on top of it (a4919f1: cluster reads 7-10 % slower, the select + attention 15-190 %).
# Session 50 (H100) ran grid-full (24 of 311 again, same kernels) with profile4k, and kivi-nw8: an opt-in 8-warp KIVI
# build for the batch-1 reads (its GPU configuration tests passed; Llama KIVI-2 B1/4k and B1/32k 15 % slower, B1/128k
# 4.5 % faster), removed with its part (its tree is 8190503; docs/results.md "Session 50").
# Session 51 (H100) ran kivi-phases (a third of a batch-1 warp outside its tile loop, the partial's write the largest
# part) and profile4k's kernel tails, then kivi-write on the tree that acts on them: its KIVI GPU tests passed (82);
# the timeout cut its A/B after the new tree's round, so the tree before was not timed in the same call.
# Session 52 (H100) ran kivi-write with KW_LANES=1 three times: session 51's change against eb3f020 (105 GPU tests
# passed; Llama reads 0.6-4.5 % faster), then the split merge inside the split kernel (3c95218: batch-1 reads 8-54 %
# slower) and a one-pass combine (f1e4406: no faster), each against 1f62b12 and reverted (docs/results.md "Session 52").
# Session 53 (H100) ran merge-floor (the PDL combine is the cheapest merge of stub partials at 8-64 splits; a cluster
# merge costs 0.8-1.5 us more, clusters + the combine 1.4-3.4 us, the last CTA 3.1-21 us) and the per-warp partials build of session 52 (110 GPU
# tests passed; batch-1 reads 6-47 % slower, removed), then grid-full (31 of 311 on that H100) and a KIVI-4 A/B of
# session 51's change (docs/results.md "Session 53"). Still wanted: grid-full on an H200. Prepared, not run:
# read-ceiling (benchmarks/gpu_read_ceiling.cu - the GPU's read bandwidth ceiling beside SDPA and the full-precision
# reads; about 60 s) and lane-balance (the KIVI lanes kernel's split count per lane, opt-in lane_balance: its GPU
# tests and a two-round A/B at the LeanK-70 + KIVI-2 reads).
# Session 54 (H200) ran both (the read ceiling 4.36-4.72 TB/s, SDPA 96-98 % of it at Llama B16+; lane_balance 10-18 %
# faster at B4-B64, 6 % slower at B1/32k) and grid-full (29 of 312), then lane-balance-default on an H100 (lane_balance
# on by default, batch 1 taking the uniform plan: 3-20 % faster from B4). Prepared, not run: none-plan (the empty
# stack's Llama B16 read with and without session 43's single split; wants an H200) and leank-balance (the Triton
# LeanK lanes kernel's split count per lane, opt-in lane_balance: its GPU tests and a two-round A/B).
# Session 57 ran leank-balance (mixed: stays opt-in), none-plan and grid-lanes on an H100 (none-plan still wants an
# H200) and prepared grid-bf16 (issue 19's ops on bf16 data, benchutil --dtype bfloat16), lowrank-bf16 (the low-rank
# lanes' bf16 errors against a float64 oracle) and paged-bf16 (the paged kernel's opt-in bf16_scale_in_exponent).
# Session 58 (H100) ran paged-bf16 and lowrank-bf16 (both settings became defaults: proj_query split,
# bf16_scale_in_exponent true) and ops-grid with OG_DTYPE=bfloat16 (out of time, files lost); none-plan, grid-lanes
# and grid-bf16 still want an H200 call.
#   PARTS="buffer-tests buffer-ab stages ..." [S35_BUDGET=540] bash benchmarks/gpu_s35_session.sh $OUT
#       runs the parts in that order in one device call, each into $OUT/<part> under `timeout` of what is left of
#       S35_BUDGET seconds (default 540, under the 600 s a call may take); a part is not started with less than
#       S35_MIN_LEFT seconds (default 45) left, and the parts not run are listed in $OUT/parts.txt.
set -o pipefail
OUT=$(realpath -m "${1:-out}")
HERE=$(cd "$(dirname "$0")" && pwd)
if [ -n "${PARTS:-}" ]; then  # several parts in one call, in priority order, within the call's budget
  mkdir -p "$OUT"
  start=$(date +%s)
  for part in $PARTS; do
    left=$(( ${S35_BUDGET:-540} - ($(date +%s) - start) ))
    if [ "$left" -lt "${S35_MIN_LEFT:-45}" ]; then echo "$part: not run (${left} s left)" | tee -a "$OUT/parts.txt"; continue; fi
    mkdir -p "$OUT/$part"
    t0=$(date +%s)
    PARTS= PART=$part timeout "$left" bash "$HERE/gpu_s35_session.sh" "$OUT/$part" > "$OUT/$part/log.txt" 2>&1
    rc=$?
    echo "$part: rc $rc, $(( $(date +%s) - t0 )) s" | tee -a "$OUT/parts.txt"
    tail -5 "$OUT/$part/log.txt"
  done
  exit 0
fi
LANES_OPS=none,lowrank,leank50,leank70,leank70-kivi2

sweep() {  # sweep TESTS VAR OPS SHAPES CONFIG...: benchmarks/gpu_paged_sweep.sh over the configurations (ROUNDS rounds)
  local tests=$1 var=$2 ops=$3 shapes=$4
  shift 4
  cd "$HERE/.." || exit 1
  PS_TESTS=$tests PS_VAR=$var PS_OPS=$ops PS_SHAPES=$shapes PS_ROUNDS=${ROUNDS:-1} \
    bash benchmarks/gpu_paged_sweep.sh "$OUT" "$@"
  rm -f "$OUT/base.json"
}

case "${PART:-stages}" in
  stages)  # first the GPU tests of every swept shape against the reference (tests/test_occupancy.py)
    sweep tests/test_occupancy.py KVCOMPRESS_LEANK_CONFIG "${S35_OPS:-$LANES_OPS}" \
      "${S35_SHAPES:-llama3-8b:1:32k,llama3-8b:4:32k,llama3-8b:16:4k,llama3-8b:16:32k,llama3-8b:64:4k,llama3-8b:64:32k,smollm2-135m:16:32k,smollm2-135m:64:32k}" \
      '{}' '{"num_stages": 3}' '{"num_stages": 4}'
    ;;
  shapes)
    sweep none KVCOMPRESS_LEANK_CONFIG "${S35_OPS:-$LANES_OPS}" \
      "${S35_SHAPES:-llama3-8b:1:32k,llama3-8b:4:32k,llama3-8b:16:4k,llama3-8b:16:32k,llama3-8b:64:4k,llama3-8b:64:32k}" \
      '{}' '{"BN": 32, "num_stages": 4}' '{"BN": 32, "num_warps": 2, "num_stages": 3}' '{"num_warps": 8, "num_stages": 3}'
    ;;
  shapes-smol)  # SmolLM2 heads (d 64: half the bytes of a Llama tile per step): also 128-token steps
    sweep none KVCOMPRESS_LEANK_CONFIG "${S35_OPS:-$LANES_OPS}" \
      "${S35_SHAPES:-smollm2-135m:1:32k,smollm2-135m:4:32k,smollm2-135m:16:32k,smollm2-135m:64:4k,smollm2-135m:64:32k}" \
      '{}' '{"BN": 32, "num_stages": 4}' '{"BN": 128, "num_stages": 3}' '{"num_warps": 8, "num_stages": 3}'
    ;;
  valid-ahead)
    ROUNDS=2 && sweep none KVCOMPRESS_LEANK_CONFIG "${S35_OPS:-$LANES_OPS}" \
      "${S35_SHAPES:-llama3-8b:1:32k,llama3-8b:16:4k,llama3-8b:16:32k,llama3-8b:64:32k,smollm2-135m:1:32k,smollm2-135m:16:32k,smollm2-135m:64:32k}" \
      '{}' '{"valid_ahead": true}'
    ;;
  warp-groups)
    sweep none KVCOMPRESS_LEANK_CONFIG "${S35_OPS:-none,lowrank,leank70,leank70-kivi2}" \
      "${S35_SHAPES:-llama3-8b:1:32k,llama3-8b:16:4k,llama3-8b:16:32k,llama3-8b:64:32k,smollm2-135m:1:32k,smollm2-135m:16:32k,smollm2-135m:64:32k}" \
      '{}' '{"warp_groups": 2}' '{"warp_groups": 4, "num_stages": 3}' '{"warp_groups": 4}'
    ;;
  occupancy)
    cd "$HERE/.." || exit 1
    source "$HERE/gpu_site.sh"  # install under /tmp/site, cd there
    timeout 300 python "$SRC/benchmarks/read_occupancy.py" --device-build --models "${S35_MODELS:-llama3-8b}" \
      --out "$OUT/occupancy_device.json" > "$OUT/occupancy_device.md" 2> "$OUT/occupancy_device.err"
    tail -3 "$OUT/occupancy_device.err"; cat "$OUT/occupancy_device.md"
    ;;
  buffer-tests)
    cd "$HERE/.." || exit 1
    source "$HERE/gpu_site.sh"  # install under /tmp/site, cd there
    timeout 540 python -m pytest -q -m gpu "$SRC/tests/test_kivi_buffer_read.py" "$SRC/tests/test_kivi_lanes.py" \
      -p no:cacheprovider -p no:logging 2>&1 | grep -v DEBUG | tail -15 | tee "$OUT/buffer_tests.txt"
    ;;
  buffer-ab)
    ROOT=$(cd "$HERE/../.." && pwd)  # the device copy's root, holding .gpusrc and .gpusrc_old
    cd "$ROOT" || exit 1
    AB_OPS=sdpa,kivi2-static,leank70-kivi2 AB_ROUNDS=${S35_ROUNDS:-2} \
      AB_SHAPES=${S35_SHAPES:-llama3-8b:1:4k,llama3-8b:1:32k,llama3-8b:4:4k,llama3-8b:16:4k,smollm2-135m:1:4k,smollm2-135m:1:32k,smollm2-135m:4:4k,smollm2-135m:16:4k} \
      bash .gpusrc/benchmarks/gpu_ab_trees.sh "$OUT" .gpusrc .gpusrc_old
    ;;
  buffer-rule)
    sweep none KVCOMPRESS_KIVI_CUDA_CONFIG kivi2-static,leank70-kivi2 \
      "${S35_SHAPES:-llama3-8b:4:32k,llama3-8b:16:4k,llama3-8b:16:32k,llama3-8b:64:4k,smollm2-135m:16:32k,smollm2-135m:64:4k,smollm2-135m:64:32k}" \
      '{}' '{"buffer_rows": 64, "buffer_work": 1048576}' '{"buffer_rows": 1024, "buffer_work": 0}' '{"buffer_tokens": 0}'
    ;;
  buffer-ctas)
    sweep none KVCOMPRESS_KIVI_CUDA_CONFIG kivi2-static,leank70-kivi2 \
      "${S35_SHAPES:-llama3-8b:1:4k,llama3-8b:1:32k,llama3-8b:4:4k,smollm2-135m:1:4k,smollm2-135m:1:32k,smollm2-135m:4:4k,smollm2-135m:16:4k}" \
      '{}' '{"buffer_ctas": 32}' '{"buffer_ctas": 64, "buffer_tokens": 16}'
    ;;
  paged-shapes)  # the paged kernel's GPU tests first
    sweep tests/test_paged_kernel.py KVCOMPRESS_PAGED_CONFIG paged-dense \
      "${S35_SHAPES:-llama3-8b:4:128k,llama3-8b:16:4k,llama3-8b:16:32k,llama3-8b:16:128k,llama3-8b:64:4k,llama3-8b:64:32k,smollm2-135m:16:32k,smollm2-135m:64:4k,smollm2-135m:64:32k}" \
      '{}' '{"pages_per_step": 2}' '{"num_warps": 8}' '{"pages_per_step": 2, "num_stages": 4}'
    ;;
  grid|splits) bash "$HERE/gpu_s34_session.sh" "$OUT" ;;
  grid37|grid37b)
    T="$(cd "$HERE/.." && pwd)/tests"
    S34_TESTS="$T/test_kivi_buffer_read.py $T/test_kivi_lanes.py $T/test_kivi_lanes_buffer.py $T/test_leank_kernel.py $T/test_pdl.py" \
      S34_GRID_OPS=leank50,leank70,leank70-kivi2,none,lowrank \
      S34_GRID_PART=$([ "$PART" = grid37 ] && echo grid || echo grid2) PART=grid bash "$HERE/gpu_s34_session.sh" "$OUT"
    ;;
  tests37)  # the GPU tests of grid37 alone (xdist), every result line in tests_full.txt
    cd "$HERE/.." || exit 1
    source "$HERE/gpu_site.sh"  # install under /tmp/site, cd there
    python -m pip install -q --no-index --no-deps --target /tmp/xdist "$SRC"/../.gpuwheels/*.whl 2>&1 | tail -2
    T="$SRC/tests"
    PYTHONPATH=$PYTHONPATH:/tmp/xdist timeout "${S37_TEST_TIMEOUT:-300}" python -m pytest -v -m gpu -p no:cacheprovider \
      -n "${S37_XDIST:-12}" "$T/test_kivi_buffer_read.py" "$T/test_kivi_lanes.py" "$T/test_kivi_lanes_buffer.py" \
      "$T/test_leank_kernel.py" "$T/test_pdl.py" > "$OUT/tests_full.txt" 2>&1
    tail -5 "$OUT/tests_full.txt"; grep -c PASSED "$OUT/tests_full.txt"; grep -E "FAILED|ERROR" "$OUT/tests_full.txt" | head -30
    ;;
  kivi-phases)  # session 50: where the batch-1 KIVI reads' warps spend their time (benchmarks/gpu_kivi_phases.py: the
    # -DKIVI_PHASES=1 build, clock64() per warp at each phase boundary, results checked equal to the plain build's), at
    # the default launch and with more splits (min_tiles 2: 17 % slower at Llama KIVI-2 B1/32k in session 50)
    cd "$HERE/.." || exit 1
    source "$HERE/gpu_site.sh"  # install under /tmp/site, cd there
    timeout "${KP_TIMEOUT:-200}" python "$SRC/benchmarks/gpu_kivi_phases.py" --out "$OUT/default" \
      ${KP_SHAPES:+--shapes "$KP_SHAPES"} 2>&1 | grep -v Warning | tail -30 | tee -a "$OUT/phases.txt"
    timeout "${KP_TIMEOUT:-200}" python "$SRC/benchmarks/gpu_kivi_phases.py" --out "$OUT/mt2" --config '{"min_tiles": 2}' \
      --shapes "${KP_SHAPES:-llama3-8b:1:32k:2,llama3-8b:1:4k:2}" 2>&1 | grep -v Warning | tail -12 | tee -a "$OUT/phases.txt"
    ;;
  kivi-write)  # session 51: the KIVI split kernels' partial written with per-row merge weights and 16-byte stores, and
    # the query built after the prologue's copies (the batch-1 phase clocks' two largest fixed costs): the KIVI GPU
    # tests (xdist; KW_LANES=1 adds the lanes kernel's), an A/B against the tree before (../.gpusrc_old, alternating
    # rounds), then this tree's phase clocks
    ROOT=$(cd "$HERE/../.." && pwd)
    (cd "$HERE/.." && source "$HERE/gpu_site.sh" >/dev/null \
      && python -m pip install -q --no-index --no-deps --target /tmp/xdist "$SRC/../.gpuwheels"/*.whl 2>&1 | tail -2; \
      timeout 100 python "$SRC/benchmarks/gpu_prebuild_kivi.py" 2>&1 | tail -2 | tee -a "$OUT/tests.txt"; \
      PYTHONPATH=/tmp/site:/tmp/xdist timeout "${KW_TEST_TIMEOUT:-150}" python -m pytest -q -m gpu -n 8 \
        "$SRC/tests/test_kivi_cuda.py" "$SRC/tests/test_kivi_buffer_read.py" ${KW_LANES:+"$SRC/tests/test_kivi_lanes.py"} \
        -p no:cacheprovider -p no:logging 2>&1 \
        | grep -v DEBUG | tail -15 | tee -a "$OUT/tests.txt")
    cd "$ROOT" || exit 1
    AB_OPS=sdpa,kivi2,kivi2-static,leank70-kivi2 AB_ROUNDS=${KW_ROUNDS:-2} \
      AB_SHAPES=${KW_SHAPES:-llama3-8b:1:4k,llama3-8b:1:32k,smollm2-135m:1:32k,llama3-8b:16:32k} \
      bash .gpusrc/benchmarks/gpu_ab_trees.sh "$OUT/ab" .gpusrc .gpusrc_old
    cd "$HERE/.." && source "$HERE/gpu_site.sh" >/dev/null
    timeout 90 python "$SRC/benchmarks/gpu_kivi_phases.py" --out "$OUT/phases" \
      --shapes "${KP_SHAPES:-llama3-8b:1:32k:2,llama3-8b:1:4k:2,llama3-8b:16:32k:2,smollm2-135m:1:32k:2}" 2>&1 \
      | grep -v Warning | tail -16 | tee -a "$OUT/phases.txt"
    ;;
  merge-floor)  # session 52: what merging a batch-1 read's split partials costs on stub split kernels - none, the PDL
    # combine (today), the last CTA of a row, a thread-block cluster merging through distributed shared memory,
    # clusters of 16 + combine (benchmarks/gpu_merge_floor.cu), Llama and SmolLM2 batch-1 shapes: tables in
    # merge_floor.md
    export PATH=/usr/local/cuda/bin:$PATH
    mkdir -p "$OUT"
    cd "$HERE/.." || exit 1
    for dv in 128 64; do
      nvcc -O3 -std=c++17 -w -gencode=arch=compute_90a,code=sm_90a -DPROBE_DV=$dv -o /tmp/merge_floor_$dv \
        benchmarks/gpu_merge_floor.cu 2>&1 | tail -5 | tee -a "$OUT/log.txt"
    done
    timeout 60 /tmp/merge_floor_128 8 4 8 16 32 64 2>&1 | tee "$OUT/merge_floor.md"
    echo | tee -a "$OUT/merge_floor.md"
    timeout 60 /tmp/merge_floor_64 3 3 16 32 64 2>&1 | tee -a "$OUT/merge_floor.md"
    ;;
  lane-balance)  # session 53 (prepared): the KIVI lanes kernel with a split count per lane (configuration
    # lane_balance: wider lanes more splits, narrower fewer, within one wave) against one count for every lane. Why:
    # the session-50 profile put the lanes kernel of LeanK-70 + KIVI-2 at Llama B16/32k at 150.4 us, as long per
    # covered head as plain KIVI-2's (171.0 us over 8 heads), though its lanes keep 32-96 of 128 key channels - the
    # 96-channel lane's CTAs set the span while the 32-channel ones idle. The lanes GPU tests (which also read with
    # lane_balance), then two alternating rounds; SmolLM2's two lanes are of one width (a control)
    export PS_XDIST=8 PS_TEST_TIMEOUT=${LB_TEST_TIMEOUT:-240}
    ROUNDS=2 && sweep "tests/test_kivi_lanes.py tests/test_kivi_lanes_buffer.py" KVCOMPRESS_KIVI_CUDA_CONFIG \
      "${S35_OPS:-leank70-kivi2}" \
      "${S35_SHAPES:-llama3-8b:1:4k,llama3-8b:1:32k,llama3-8b:4:4k,llama3-8b:4:32k,llama3-8b:16:4k,llama3-8b:16:32k,llama3-8b:16:128k,llama3-8b:64:32k,smollm2-135m:1:32k,smollm2-135m:16:32k}" \
      '{}' '{"lane_balance": true}'
    ;;
  lane-balance-default)  # session 54: lane_balance is the default (its greedy plan no longer stops the narrow lanes
    # short where the widest one reaches the per-warp cap: batch 1 takes the uniform plan). The lanes GPU tests at the
    # default, then two alternating rounds against lane_balance off at shapes where the plans differ (B1/128k, B4,
    # B16 and B64) and two where they agree (Llama B1/32k, SmolLM2 B16/32k: controls)
    export PS_XDIST=8 PS_TEST_TIMEOUT=${LB_TEST_TIMEOUT:-240}
    ROUNDS=2 && sweep "tests/test_kivi_lanes.py tests/test_kivi_lanes_buffer.py" KVCOMPRESS_KIVI_CUDA_CONFIG \
      "${S35_OPS:-leank70-kivi2}" \
      "${S35_SHAPES:-llama3-8b:1:32k,llama3-8b:1:128k,llama3-8b:4:32k,llama3-8b:4:128k,llama3-8b:16:32k,llama3-8b:16:128k,llama3-8b:64:4k,llama3-8b:64:32k,smollm2-135m:16:32k}" \
      '{}' '{"lane_balance": false}'
    ;;
  none-plan)  # session 54: the empty stack's read at Llama B16 went 496 -> 535 us (B16/32k) and 1930 -> 2101 us (B16/128k)
    # between the session-38 and session-54 H200 grids; sessions 40 (resident_full_width_rows) and 43 (one_split_tokens)
    # changed its plan on an H100 in between. The default against the single split off, and gated by bandwidth per SM
    # (one_split_max_sm_gbps 30: off on an H200, on on an H100), two rounds
    ROUNDS=2 && sweep none KVCOMPRESS_LEANK_CONFIG "${S35_OPS:-none}" \
      "${S35_SHAPES:-llama3-8b:16:4k,llama3-8b:16:32k,llama3-8b:16:128k,llama3-8b:64:32k}" \
      '{}' '{"one_split_tokens": 0}' '{"one_split_max_sm_gbps": 30}' \
      ${NP_MORE:+'{"one_split_tokens": 0, "resident_full_width_rows": 0}'}
    ;;
  leank-balance)  # session 54 (prepared): the Triton LeanK lanes kernel with a split count per long lane (opt-in
    # lane_balance: resident launches whose long programs fit one wave) against one count for every lane. Why: the KIVI
    # lanes kernel's same plan was 10-20 % faster from B4; LeanK-70 Llama B16/32k is 1.39x SDPA on an H200 (goal 1.6x).
    # The LeanK kernel's GPU tests (every case against the reference, with lane_splits cases), then two rounds
    export PS_XDIST=8 PS_TEST_TIMEOUT=${LB_TEST_TIMEOUT:-200}
    ROUNDS=2 && sweep tests/test_leank_kernel.py KVCOMPRESS_LEANK_CONFIG "${S35_OPS:-leank70,leank50}" \
      "${S35_SHAPES:-llama3-8b:16:4k,llama3-8b:16:32k,llama3-8b:16:128k,llama3-8b:64:32k,smollm2-135m:16:32k,smollm2-135m:64:32k}" \
      '{}' '{"lane_balance": true}'
    ;;
  read-ceiling)  # session 53 (prepared): the highest read bandwidth of this GPU for a full-precision read's bytes
    # (benchmarks/gpu_read_ceiling.cu: plain loads, cp.async stages, TMA bulk copies; CUDA graphs, buffers rotated
    # past L2), then SDPA, the empty stack and paged dense at the same shapes in the same call - how far the reads
    # at 0.94-1.00x of SDPA are from what the GPU can read, and how far SDPA is (tables: ceiling.md, reads.md)
    export PATH=/usr/local/cuda/bin:$PATH
    mkdir -p "$OUT"
    RC_SHAPES=${RC_SHAPES:-llama3-8b:1:32k,llama3-8b:4:32k,llama3-8b:16:4k,llama3-8b:16:32k,llama3-8b:16:128k,llama3-8b:64:32k,smollm2-135m:16:32k,smollm2-135m:64:32k,smollm2-135m:64:128k}
    cd "$HERE/.." || exit 1
    nvcc -O3 -std=c++17 -w -gencode=arch=compute_90a,code=sm_90a -o /tmp/read_ceiling benchmarks/gpu_read_ceiling.cu \
      2>&1 | tail -5 | tee -a "$OUT/log.txt"
    timeout 120 /tmp/read_ceiling ${RC_SHAPES//,/ } 2>&1 | tee "$OUT/ceiling.md"
    source "$HERE/gpu_site.sh" >/dev/null
    timeout 200 python -m kvcompress.kernels.benchutil --device cuda --ops sdpa,none,paged-dense \
      --only-shapes "$RC_SHAPES" --out "$OUT/reads.json" 2>/dev/null | grep '^|' | tee "$OUT/reads.md"
    ;;
  grid-full)  # every op of the grid (no tests) into grid.json
    S34_GRID_PART=grid2 S34_GRID_OPS=kivi2,kivi4,leank50,leank70,leank70-kivi2,ds8,ds16,ds8-shared,ds16-shared,paged-dense,paged-kivi2,lowrank,none \
      G_TIMEOUT=${G_TIMEOUT:-300} G_SECONDS=${G_SECONDS:-280} PART=grid bash "$HERE/gpu_s34_session.sh" "$OUT"
    ;;
  overlap)  # session 55: LeanK-70 + KIVI-2's buffer read and KIVI lanes read on two streams (a fork / join in the graph)
    # against one after the other (benchmarks/gpu_overlap_probe.py; the upper bound of overlapping them)
    cd "$HERE/.." || exit 1
    source benchmarks/gpu_site.sh >/dev/null
    timeout "${OV_TIMEOUT:-300}" python "$SRC/benchmarks/gpu_overlap_probe.py" ${OV_SHAPES:+--shapes "$OV_SHAPES"} \
      --out "$OUT/overlap.json" 2>"$OUT/overlap.err" | tee "$OUT/overlap.md"
    tail -5 "$OUT/overlap.err"
    ;;
  buffer-lanes)  # session 55 (prepared): LeanK-70 + KIVI-2 reads too large for the buffer CTAs take the buffer through
    # the Triton lanes kernel in a launch beside the KIVI lanes kernel's (PDL), into the same split combine (opt-in
    # buffer_lanes: 3 launches instead of 5, the buffer read overlapping the lanes'; static KIVI-2 too). The GPU tests,
    # then two rounds
    export PS_XDIST=8 PS_TEST_TIMEOUT=${LB_TEST_TIMEOUT:-240}
    ROUNDS=2 && sweep "${BL_TESTS:-tests/test_kivi_lanes_buffer.py tests/test_kivi_buffer_read.py tests/test_leank_kernel.py}" \
      KVCOMPRESS_KIVI_CUDA_CONFIG \
      "${S35_OPS:-leank70-kivi2,kivi2-static}" \
      "${S35_SHAPES:-llama3-8b:4:4k,llama3-8b:16:4k,llama3-8b:64:4k,llama3-8b:4:32k,llama3-8b:16:32k,llama3-8b:64:32k,llama3-8b:16:128k,smollm2-135m:16:4k,smollm2-135m:16:32k,smollm2-135m:64:32k}" \
      '{"buffer_lanes": false}' '{}'
    ;;
  buffer-lanes-quick)  # session 55: the buffer_lanes GPU tests alone (-k beside: both kernels, PDL on and off, graph
    # replays), then alternating rounds of benchutil at a few shapes ('{}' against '{"buffer_lanes": true}'), for a
    # call with little device time left
    cd "$HERE/.." || exit 1
    source benchmarks/gpu_site.sh >/dev/null
    timeout "${BQ_TEST_TIMEOUT:-150}" python -m pytest -q -m gpu -p no:cacheprovider --tb=short -rfE -k beside \
      "$SRC/tests/test_kivi_lanes_buffer.py" "$SRC/tests/test_kivi_buffer_read.py" 2>&1 | tail -15 | tee "$OUT/tests.txt"
    for r in $(seq "${ROUNDS:-2}"); do
      for cfg in '{"buffer_lanes": false}' '{}'; do
        echo "round $r $cfg" | tee -a "$OUT/rows.md"
        KVCOMPRESS_KIVI_CUDA_CONFIG=$cfg timeout "${BQ_TIMEOUT:-60}" python -m kvcompress.kernels.benchutil --device cuda \
          --ops "${S35_OPS:-sdpa,leank70-kivi2}" \
          --only-shapes "${S35_SHAPES:-llama3-8b:4:4k,llama3-8b:16:4k,llama3-8b:16:32k}" 2>/dev/null | grep '^|' \
          | tee -a "$OUT/rows.md"
      done
    done
    ;;
  grid-bf16)  # session 57 (prepared): issue 19's ops on bf16 data (benchutil --dtype bfloat16: the queries and
    # full-precision K / V of a bf16 model's cache; KIVI scales fp16, as the stores hold them) against SDPA on the
    # same bf16 cache, rows named op@bf16 - the grid is fp16, the models bf16
    cd "$HERE/.." || exit 1
    source benchmarks/gpu_site.sh >/dev/null
    timeout "${GB_TIMEOUT:-300}" python -m kvcompress.kernels.benchutil --device cuda --dtype bfloat16 --ops grid \
      --only-shapes "${S35_SHAPES:-llama3-8b:1:32k,llama3-8b:4:4k,llama3-8b:16:4k,llama3-8b:16:32k,smollm2-135m:1:4k,smollm2-135m:16:32k}" \
      --max-seconds "${GB_SECONDS:-270}" --out "$OUT/grid_bf16.json" 2>"$OUT/grid_bf16.err" | grep '^|' \
      | tee "$OUT/grid_bf16.md"
    tail -3 "$OUT/grid_bf16.err"
    ;;
  lowrank-bf16)  # session 57 (prepared): the low-rank lanes' LSE and output errors against a float64 oracle in fp16
    # and bf16, kernel and reference (benchmarks/gpu_lowrank_bf16_probe.py): the projected query is still rounded
    # scaled before the dot, where the reference rounds it unscaled
    cd "$HERE/.." || exit 1
    source benchmarks/gpu_site.sh >/dev/null
    timeout "${LR_TIMEOUT:-120}" python "$SRC/benchmarks/gpu_lowrank_bf16_probe.py" 2>"$OUT/lowrank_bf16.err" \
      | tee "$OUT/lowrank_bf16.md"
    tail -3 "$OUT/lowrank_bf16.err"
    # (session 58) the split setting's GPU test, then the bf16 low-rank read under each proj_query setting,
    # alternating rounds
    timeout "${LR_TEST_TIMEOUT:-120}" python -m pytest -q -m gpu -p no:cacheprovider --tb=short -rfE \
      "$SRC/tests/test_leank_kernel.py" -k "lowrank_split or bf16_long_lanes" 2>&1 | tail -8 | tee "$OUT/tests.txt"
    for r in $(seq "${ROUNDS:-2}"); do
      for pq in scaled unscaled split; do
        echo "round $r proj_query $pq" | tee -a "$OUT/rows.md"
        KVCOMPRESS_LEANK_CONFIG="{\"proj_query\": \"$pq\"}" timeout "${LR_ROW_TIMEOUT:-90}" python -m kvcompress.kernels.benchutil \
          --device cuda --dtype bfloat16 --ops "${LR_OPS:-sdpa,lowrank}" \
          --only-shapes "${S35_SHAPES:-llama3-8b:1:32k,llama3-8b:4:4k,llama3-8b:16:32k,smollm2-135m:16:32k}" \
          2>/dev/null | grep '^|' | tee -a "$OUT/rows.md"
      done
    done
    ;;
  paged-bf16)  # session 57 (prepared): the paged Triton kernel's opt-in bf16_scale_in_exponent (bf16 pages: the query
    # as given, the scale in the exponent, as the lanes kernel since session 57) - its GPU test, then alternating
    # rounds of the bf16 dense-pages read off / on (benchutil --dtype bfloat16)
    cd "$HERE/.." || exit 1
    source benchmarks/gpu_site.sh >/dev/null
    timeout "${PB_TEST_TIMEOUT:-150}" python -m pytest -q -m gpu -p no:cacheprovider --tb=short -rfE \
      ${PB_XDIST:+-n "$PB_XDIST"} "$SRC/tests/test_paged_kernel.py" 2>&1 | tail -15 | tee "$OUT/tests.txt"
    for r in $(seq "${ROUNDS:-2}"); do
      for cfg in '{}' '{"bf16_scale_in_exponent": true}'; do
        echo "round $r $cfg" | tee -a "$OUT/rows.md"
        KVCOMPRESS_PAGED_CONFIG=$cfg timeout "${PB_TIMEOUT:-90}" python -m kvcompress.kernels.benchutil --device cuda \
          --dtype bfloat16 --ops "${PB_OPS:-sdpa,paged-dense}" \
          --only-shapes "${S35_SHAPES:-llama3-8b:1:32k,llama3-8b:4:32k,llama3-8b:16:4k,llama3-8b:16:32k,smollm2-135m:16:32k}" \
          2>/dev/null | grep '^|' | tee -a "$OUT/rows.md"
      done
    done
    ;;
  grid-lanes)  # session 54: LeanK-70 + KIVI-2 at every grid shape (lane_balance now the default) into grid.json
    S34_GRID_PART=grid2 S34_GRID_OPS=${S35_OPS:-leank70-kivi2} \
      G_TIMEOUT=${G_TIMEOUT:-120} G_SECONDS=${G_SECONDS:-100} PART=grid bash "$HERE/gpu_s34_session.sh" "$OUT"
    ;;
  proj-stages)  # low rank with the empty stack's 3-stage rule at every length (session 40 ran it with the opt-in
    # proj_stages of session 39; now proj_stages_tokens, default 8192) against 4 stages, every Llama shape of the grid
    # up to B16 (where the rule applies) and B64 / 4k (where it does not), two rounds
    ROUNDS=2 && sweep none KVCOMPRESS_LEANK_CONFIG lowrank \
      "${S35_SHAPES:-llama3-8b:1:4k,llama3-8b:1:32k,llama3-8b:1:128k,llama3-8b:4:4k,llama3-8b:4:32k,llama3-8b:4:128k,llama3-8b:16:4k,llama3-8b:16:32k,llama3-8b:16:128k,llama3-8b:64:4k}" \
      '{"proj_stages_tokens": 0}' '{"proj_stages_tokens": 1000000000}'
    ;;
  none-resident)  # the empty stack's read with the resident split count at B1 / B4 too (session 40 ran it with the
    # opt-in resident_full_width of session 39; now resident_full_width_rows, default 32) against without, two rounds
    ROUNDS=2 && sweep none KVCOMPRESS_LEANK_CONFIG none \
      "${S35_SHAPES:-llama3-8b:1:4k,llama3-8b:1:32k,llama3-8b:1:128k,llama3-8b:4:4k,llama3-8b:4:32k,llama3-8b:4:128k,smollm2-135m:1:4k,smollm2-135m:1:32k,smollm2-135m:1:128k,smollm2-135m:4:4k,smollm2-135m:4:32k,smollm2-135m:4:128k}" \
      '{"resident_full_width_rows": 0}' '{"resident_full_width_rows": 1}'
    ;;
  compiled-expandable)  # compiled decode (reduce-overhead CUDA graphs) of every built-in stack, eager vs compiled,
    # under expandable segments - the README's allocator tip was measured on plain CUDA-graph reads only (session 39)
    cd "$HERE/.." || exit 1
    source benchmarks/gpu_site.sh
    # (session 40, H100: 15 of the 18 stacks in 387 s; CE_ONLY=name,name runs a subset, as --only)
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "${CE_TIMEOUT:-400}" python "$SRC/benchmarks/gpu_compiled_check.py" \
      --out "$OUT" --steps "${CE_STEPS:-64}" ${CE_ONLY:+--only "$CE_ONLY"} 2>&1 | grep -v Warning | tail -40 | tee -a "$OUT/compiled.txt"
    ;;
  rules40)  # session 40's two lanes-kernel defaults (resident_full_width_rows 32, proj_stages_tokens 8192): the LeanK
    # and occupancy GPU tests under them, then against the rules before them, two rounds, at the reads they change
    export PS_TEST_TIMEOUT=${PS_TEST_TIMEOUT:-300} PS_XDIST=${PS_XDIST:-8}
    ROUNDS=2 && sweep "tests/test_occupancy.py tests/test_leank_kernel.py" KVCOMPRESS_LEANK_CONFIG none,lowrank \
      "${S35_SHAPES:-llama3-8b:1:4k,llama3-8b:4:4k,llama3-8b:16:4k,llama3-8b:4:32k,llama3-8b:4:128k,llama3-8b:1:32k,smollm2-135m:1:32k,smollm2-135m:4:32k}" \
      '{}' '{"resident_full_width_rows": 0, "proj_stages_tokens": 0}'
    ;;
  ds-search)  # the fused DoubleSparse select's threshold by interpolation search (opt-in, session 40: 17.8 -> 10.8
    # rounds at 4096 keys in the CPU model, benchmarks/select_rounds_model.py) against the bit search: the DoubleSparse
    # GPU tests (both searches against the oracle and each other), then two rounds at the small reads below 1.0x
    export PS_TEST_TIMEOUT=${PS_TEST_TIMEOUT:-400} PS_XDIST=${PS_XDIST:-8}
    ROUNDS=2 && sweep tests/test_doublesparse_kernel.py KVCOMPRESS_DS_CONFIG ds8,ds16,ds8-shared,ds16-shared \
      "${S35_SHAPES:-smollm2-135m:1:4k,smollm2-135m:4:4k,smollm2-135m:16:4k,llama3-8b:1:4k,llama3-8b:4:4k,llama3-8b:16:4k,smollm2-135m:4:32k}" \
      '{}' '{"search": "interpolation"}'
    ;;
  buffer-apart)  # the one-launch buffer read against the two regions apart ({"buffer_tokens": 0}) at the fused shapes,
    # two rounds.  Session 40's profile (H100): LeanK-70 + KIVI-2 Llama B4/4k (32 rows x 3k middle slots, under the
    # 256k buffer_work: one launch) spent 30.3 us in the lanes kernel with its 1024-slot buffer against 12.8 at B1 -
    # the rule of session 26 was measured with static KIVI-2's 128-slot buffer and does not count the buffer's size
    ROUNDS=2 && sweep none KVCOMPRESS_KIVI_CUDA_CONFIG leank70-kivi2,kivi2-static \
      "${S35_SHAPES:-llama3-8b:1:4k,llama3-8b:4:4k,llama3-8b:1:32k,smollm2-135m:1:4k,smollm2-135m:4:4k,smollm2-135m:16:4k,smollm2-135m:1:32k,smollm2-135m:4:32k}" \
      '{}' '{"buffer_tokens": 0}'
    ;;
  buffer-weight)  # session 41's buffer_weight (default 6: a buffer slot counts as 6 region slots in buffer_work, so
    # LeanK-70 + KIVI-2 at Llama B4/4k and SmolLM2 B16/4k reads its 1024-slot buffer apart) against the rule before
    # ({"buffer_weight": 0}): the buffer-read GPU tests, then two rounds at the two reads it moves and two it keeps
    export PS_TEST_TIMEOUT=${PS_TEST_TIMEOUT:-300} PS_XDIST=${PS_XDIST:-8}
    ROUNDS=2 && sweep "tests/test_kivi_buffer_read.py tests/test_kivi_lanes_buffer.py" KVCOMPRESS_KIVI_CUDA_CONFIG \
      leank70-kivi2,kivi2-static \
      "${S35_SHAPES:-llama3-8b:4:4k,smollm2-135m:16:4k,llama3-8b:1:4k,smollm2-135m:4:4k}" \
      '{}' '{"buffer_weight": 0}'
    ;;
  ds-unroll)  # session 41's select rule (unroll null: 16 label loads in flight where a select launch has fewer programs
    # than two per SM, else 4) against unroll 4 everywhere: the DoubleSparse GPU tests, then two rounds at the 4k reads
    # of the H100 sweep and the 32k ones session 21 found slower with 16 (many-program launches, where the rule keeps 4)
    export PS_TEST_TIMEOUT=${PS_TEST_TIMEOUT:-400} PS_XDIST=${PS_XDIST:-8}
    ROUNDS=2 && sweep tests/test_doublesparse_kernel.py KVCOMPRESS_DS_CONFIG ds8,ds16,ds8-shared,ds16-shared \
      "${S35_SHAPES:-smollm2-135m:1:4k,smollm2-135m:4:4k,smollm2-135m:16:4k,llama3-8b:1:4k,llama3-8b:16:4k,smollm2-135m:1:32k,llama3-8b:1:32k,llama3-8b:4:32k,smollm2-135m:16:32k}" \
      '{}' '{"unroll": 4}'
    ;;
  ds-fused)  # session 41's kernel: the DoubleSparse select and gather in one kernel (select_gather_partial; one
    # program per selection row, no second launch, no split merge) against the two-kernel read, where the select has
    # few programs (the group below 1.0x: SmolLM2 B1 / B4 at 4k); the DoubleSparse GPU tests first (its own included,
    # and since session 42 the model's read through it: a static cache built with fuse_gather on, in CUDA graphs).
    # Table: python benchmarks/sweep_table.py OUT/ds-fused/configs.json --variant-suffix=-fused
    export PS_TEST_TIMEOUT=${PS_TEST_TIMEOUT:-400} PS_XDIST=${PS_XDIST:-8}
    ROUNDS=2 && sweep "tests/test_doublesparse_kernel.py tests/test_graph_step.py" KVCOMPRESS_DS_CONFIG \
      ds8,ds8-fused,ds16,ds16-fused,ds8-shared,ds8-shared-fused,ds16-shared,ds16-shared-fused \
      "${S35_SHAPES:-smollm2-135m:1:4k,smollm2-135m:4:4k,smollm2-135m:16:4k,llama3-8b:1:4k,llama3-8b:4:4k}" '{}'
    ;;
  paged-pdl)  # the paged kernel's opt-in PDL split merge (never timed; the KIVI kernel's PDL became the default after
    # two H200 rounds, session 34): the PDL GPU tests (paged with and without PDL, eager and replayed) and the paged
    # kernel's, then two rounds at the paged dense reads that split (B1-B16)
    export PS_TEST_TIMEOUT=${PS_TEST_TIMEOUT:-300} PS_XDIST=${PS_XDIST:-8}
    ROUNDS=2 && sweep "tests/test_pdl.py tests/test_paged_kernel.py" KVCOMPRESS_PAGED_CONFIG \
      paged-dense \
      "${S35_SHAPES:-llama3-8b:1:4k,llama3-8b:1:32k,llama3-8b:4:4k,llama3-8b:4:32k,llama3-8b:16:4k,llama3-8b:16:32k,smollm2-135m:1:4k,smollm2-135m:4:32k,smollm2-135m:16:32k}" \
      '{}' '{"pdl": true}'
    ;;
  grid-full-expandable)  # the same grid with PyTorch's expandable segments (session 39: allocation history moved
    # same-kernel reads by 16-19 % under the default caching allocator); benchutil records the setting in each row
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PARTS= PART=grid-full bash "$HERE/gpu_s35_session.sh" "$OUT"
    ;;
  split-cap)
    ROUNDS=2 && sweep none KVCOMPRESS_LEANK_CONFIG leank50,leank70,lowrank,none \
      "${S35_SHAPES:-smollm2-135m:1:4k,smollm2-135m:1:32k,smollm2-135m:1:128k,llama3-8b:1:128k}" \
      '{}' '{"single_wave_split_tokens": 0}'
    ;;
  paged-late)  # the paged kernel's GPU tests first (valid_late cases included)
    ROUNDS=2 && sweep tests/test_paged_kernel.py KVCOMPRESS_PAGED_CONFIG paged-dense \
      "${S35_SHAPES:-llama3-8b:1:32k,llama3-8b:4:128k,llama3-8b:16:4k,llama3-8b:16:32k,llama3-8b:16:128k,llama3-8b:64:32k,smollm2-135m:16:32k,smollm2-135m:64:4k,smollm2-135m:64:32k}" \
      '{}' '{"valid_late": true}' '{"valid_block": true}'
    ;;
  ds-steps)  # the DoubleSparse GPU tests first (the gathers with index_steps 4 against the reference), 400 s cold
    export PS_TEST_TIMEOUT=${PS_TEST_TIMEOUT:-400} PS_XDIST=${PS_XDIST:-8}
    ROUNDS=2 && sweep tests/test_doublesparse_kernel.py \
      KVCOMPRESS_DS_CONFIG ds8,ds16,ds16-shared \
      "${S35_SHAPES:-llama3-8b:4:32k,llama3-8b:16:32k,llama3-8b:64:32k,smollm2-135m:16:32k,smollm2-135m:64:32k}" \
      '{}' '{"index_steps": 4}' '{"index_steps": 8, "shared_block_k": 64}'
    ;;
  paged-layout)  # benchmarks/paged_layout_probe.py: the paged dense read over 16-token pages as the grid fills them, as
    # decoding fills them (one page per row per append) and 64-token pages, beside SDPA (session 38, not yet run)
    cd "$HERE/.." || exit 1
    source benchmarks/gpu_site.sh
    for r in $(seq 1 "${PL_ROUNDS:-1}"); do  # PL_ROUNDS: the probe again (session 39's one round was not monotone)
      echo "## round $r" | tee -a "$OUT/probe.md"
      timeout "${PL_TIMEOUT:-300}" python "$SRC/benchmarks/paged_layout_probe.py" --out "$OUT/probe_$r.json" \
        ${PL_SHAPES:+--shapes "$PL_SHAPES"} ${PL_VARIANTS:+--variants "$PL_VARIANTS"} 2>&1 | grep -v Warning | tee -a "$OUT/probe.md"
    done
    ;;
  profile4k)  # where the Llama 4k lanes reads below 1x spend their kernel time (session 38: the empty stack B16/4k
    # 0.94x, low rank B4-B64/4k 0.81-0.92x, LeanK-50 B16/4k 0.96x; eager, per kernel)
    cd "$HERE/.." || exit 1
    source benchmarks/gpu_site.sh
    timeout "${PF_TIMEOUT:-200}" python "$SRC/benchmarks/gpu_read_profile.py" --ops "${PF_OPS:-sdpa,none,lowrank,leank50}" \
      --shapes "${PF_SHAPES:-llama3-8b:4:4k,llama3-8b:16:4k,llama3-8b:64:4k}" --out "$OUT/read_profile.json" 2>&1 \
      | grep -v Warning | tail -80 | tee -a "$OUT/profile.txt"
    ;;
  ops-grid)  # every registered read op, each implementation uncompiled against the reference on the GPU, at issue 19's
    # grid shapes (ctx - 37 live tokens, padding, a dead row; last run session 21: 396 of 396, B1-B16 only); OG_SHAPES
    # picks the batches (about 10 min for all on an H200: split over calls)
    cd "$HERE/.." || exit 1
    source benchmarks/gpu_site.sh
    # (OG_DTYPE=bfloat16, session 57: the cases on a bf16 model's data - the same tolerances, which the bf16 Triton
    # lanes read missed by 2.2e-3 LSE until session 57)
    timeout "${OG_TIMEOUT:-500}" python "$SRC/benchmarks/gpu_ops_check.py" --grid --eager --out "$OUT" ${OG_OPS:+--ops "$OG_OPS"} \
      ${OG_DTYPE:+--dtype "$OG_DTYPE"} \
      --shapes "${OG_SHAPES:-grid-llama3-8b-b1-,grid-smollm2-135m-b1-,grid-llama3-8b-b4-,grid-smollm2-135m-b4-}" 2>&1 \
      | grep -v Warning | tail -40 | tee -a "$OUT/ops_grid.txt"
    ;;
  lanes4k)  # the Llama 4k lanes reads below 1x (session 38 H200: the empty stack B16/4k 0.94x, low rank B4-B64/4k
    # 0.81-0.92x, LeanK-50 B16/4k 0.96x) under launch settings the rules do not pick there: fixed split counts, 3 / 4
    # stages, 4 waves (session 39)
    ROUNDS=${ROUNDS:-1} && sweep none KVCOMPRESS_LEANK_CONFIG none,lowrank,leank50 \
      "${S35_SHAPES:-llama3-8b:4:4k,llama3-8b:16:4k,llama3-8b:64:4k}" \
      '{}' '{"num_stages": 3}' '{"num_stages": 4}' '{"waves": 4}' '{"splits": 2}' '{"splits": 4}' '{"splits": 8}' \
      '{"splits": 16}'
    ;;
  ds-fused-model)  # whole decode steps (GraphStep rows, Llama-3-8B shape, B1 / 4k): DoubleSparse 1024 tokens
    # group-shared (30 sparse layers) through the one-kernel select + gather against the two kernels - what the model
    # gains from the read's launches, wall and GPU-busy time per step (about 2 x 170 s: one 32-layer compile each)
    cd "$HERE/.." || exit 1
    source "$HERE/gpu_site.sh"
    for cfg in '{}' '{"fuse_gather": true}'; do
      tag=$([ "$cfg" = '{}' ] && echo two_kernels || echo one_kernel)
      KVCOMPRESS_DS_CONFIG=$cfg timeout "${S35_ROWS_S:-240}" python "$SRC/benchmarks/gpu_graph_rows.py" --kind graph \
        --stack ds-shared-random-1024 --points "${S35_POINTS:-1x4096}" --out "$OUT/$tag" 2>&1 \
        | grep -E '^\{|Error' | cut -c1-420 | tee -a "$OUT/log.txt"
    done
    ;;
  tp2|tp2-throughput)  # issue 18's bar on a TWO-GPU machine (kind nvidia-h100-x2 / nvidia-h200-x2): the Llama-3-8B
    # shape split over 2 ranks (tensor parallelism; rank 0 writes the 16 GB of random weights to /tmp first, which a
    # later call on the same warm machine reuses).  tp2: B8 / 32k, transformers StaticCache + compile against KIVI-2
    # compiled (and replayed as kvcompress' CUDA graph); rows that would start after S35_TP_ROWS_S seconds are skipped.
    # tp2-throughput: decode tokens/s at a fixed per-GPU KV budget (S35_KV_GIB, default 40 GiB per GPU), both.
    # Not run yet: no two-GPU machine has been lent.  Each part wants a call of its own (a 32-layer compile is ~130 s).
    mkdir -p "$OUT"
    nvidia-smi -L > "$OUT/gpus.txt" 2>&1
    [ "$(grep -c '^GPU' "$OUT/gpus.txt")" -ge 2 ] || { echo "$PART: needs 2 GPUs" >&2; exit 3; }
    cd "$HERE/.." || exit 1
    source "$HERE/gpu_site.sh"  # kvcompress installed under /tmp/site (PYTHONPATH), cd there
    if [ "$PART" = tp2 ]; then
      MODE=(--compile --no-eager --points "${S35_TP_POINTS:-8x32768}" --time-budget "${S35_TP_ROWS_S:-300}")
    else
      MODE=(--throughput --kv-gib "${S35_KV_GIB:-40}" --ctx 32768 --fill-rows 2)
    fi
    timeout "${S35_TP_S:-530}" python -m torch.distributed.run --standalone --nproc-per-node 2 -m kvcompress.cli \
      bench --model-shape llama3-8b --random-weights --stack kivi2 "${MODE[@]}" \
      --weights-dir /tmp/kvc-random-llama3-8b --json "$OUT/$PART.json" > "$OUT/$PART.log" 2>&1
    ;;
  splits1)  # one split - no merge launch - for the same-bytes reads below 1x where a row has whole waves of heads
    # (session 41's lanes4k swept 2-16 splits, never 1): the empty stack and low rank at Llama B16 / B64, where
    # B x kv heads already fills whole waves (128 / 512 programs on 132 SMs)
    ROUNDS=2 && sweep none KVCOMPRESS_LEANK_CONFIG none,lowrank \
      "${S35_SHAPES:-llama3-8b:16:4k,llama3-8b:16:32k,llama3-8b:16:128k,llama3-8b:64:4k}" \
      '{}' '{"splits": 1}'
    ;;
  rules43-ds)  # session 43's fuse rule (fuse_gather null: the one-kernel DoubleSparse read for k <= 256, or k <= 512
    # over more programs than a quarter of the SMs) against the two kernels ({"fuse_gather": false}); the GPU tests
    # of the one-kernel read in CUDA graphs first
    export PS_TEST_TIMEOUT=${PS_TEST_TIMEOUT:-200} PS_XDIST=${PS_XDIST:-4}
    ROUNDS=1 && sweep "tests/test_graph_step.py::test_cuda_graph_replays_the_one_kernel_double_sparse_read" \
      KVCOMPRESS_DS_CONFIG ds8,ds16,ds8-shared,ds16-shared \
      "${S35_SHAPES:-smollm2-135m:1:4k,smollm2-135m:16:4k,llama3-8b:1:4k,llama3-8b:4:4k,llama3-8b:16:4k,smollm2-135m:64:4k,llama3-8b:64:4k}" \
      '{}' '{"fuse_gather": false}'
    ;;
  ds-fused-long)  # the one kernel against the two where fuse_rule has no measurement: 8k and 16k contexts (k 512-2048:
    # ds8 / ds16 of 8k and 16k; 16384 tokens is one select chunk's limit) at B1 / B4 / B16, both head shapes, two
    # rounds - whether the rule's k <= 512 bound can move
    ROUNDS=2 && sweep none KVCOMPRESS_DS_CONFIG ds8,ds16,ds8-shared,ds16-shared \
      "${S35_SHAPES:-smollm2-135m:1:8k,smollm2-135m:4:8k,smollm2-135m:16:8k,llama3-8b:1:8k,llama3-8b:4:8k,llama3-8b:16:8k,smollm2-135m:1:16k,smollm2-135m:4:16k,smollm2-135m:16:16k,llama3-8b:1:16k,llama3-8b:4:16k,llama3-8b:16:16k}" \
      '{"fuse_gather": false}' '{"fuse_gather": true}'
    ;;
  rules45-ds)  # session 45's refitted fuse rule (no one-kernel read over 2 programs per SM; 8k / 16k label caches
    # only at head dim 128 with a wave of programs) as the default against the two kernels, at the reads it changed
    # or newly takes; the GPU test of the one-kernel read in CUDA graphs first
    export PS_TEST_TIMEOUT=${PS_TEST_TIMEOUT:-200} PS_XDIST=${PS_XDIST:-4}
    ROUNDS=1 && sweep "tests/test_graph_step.py::test_cuda_graph_replays_the_one_kernel_double_sparse_read" \
      KVCOMPRESS_DS_CONFIG ds8,ds16,ds8-shared,ds16-shared \
      "${S35_SHAPES:-llama3-8b:16:4k,llama3-8b:64:4k,smollm2-135m:64:4k,llama3-8b:4:8k,llama3-8b:16:8k,llama3-8b:4:16k,llama3-8b:16:16k,smollm2-135m:16:8k}" \
      '{}' '{"fuse_gather": false}'
    ;;
  ds-cluster-size)  # session 47 made the cluster select's cross-CTA rounds cheaper (docs/results.md "Session 47"):
    # cluster_auto's C = 2 at 17-37 rows (session 30's timings; 16384 keys per CTA, scoring 8.6 us + emit 4.9 us)
    # against C = 4 / 8, and the 8k reads where the rule keeps the fused select; two rounds, after the DoubleSparse
    # CUDA GPU tests (S35_TESTS=none: without them)
    export PS_TEST_TIMEOUT=${PS_TEST_TIMEOUT:-240}
    ROUNDS=2 && sweep "${S35_TESTS:-tests/test_doublesparse_cuda.py}" KVCOMPRESS_DS_CONFIG ds8,ds16,ds8-shared,ds16-shared \
      "${S35_SHAPES:-llama3-8b:1:32k,smollm2-135m:4:32k,llama3-8b:1:128k,smollm2-135m:4:128k,smollm2-135m:1:8k,llama3-8b:1:8k}" \
      '{}' '{"method": "cuda", "cuda": {"cluster": 4}}' '{"method": "cuda", "cuda": {"cluster": 8}}'
    ;;
  ds-racecheck)  # the cluster select's exchanges under compute-sanitizer racecheck (where the machine has it;
    # informational: the exact-ties GPU tests at clusters of 1 - 8), then the DoubleSparse CUDA GPU tests
    ( cd "$HERE/.." && source "$HERE/gpu_site.sh" > /dev/null 2>&1
      if command -v compute-sanitizer > /dev/null; then
        timeout 200 compute-sanitizer --tool racecheck --racecheck-report all --kernel-name kns=ds_cluster_kernel \
          python -m pytest -q -m gpu -p no:cacheprovider "$SRC/tests/test_doublesparse_cuda.py" -k exact_ties 2>&1 \
          | tail -25 > "$OUT/racecheck.txt"
      else
        echo "no compute-sanitizer" > "$OUT/racecheck.txt"
      fi
      timeout "${PS_TEST_TIMEOUT:-240}" python -m pytest -q -m gpu -p no:cacheprovider \
        "$SRC/tests/test_doublesparse_cuda.py" > "$OUT/tests.txt" 2>&1; tail -3 "$OUT/tests.txt" ) || true
    tail -6 "$OUT/racecheck.txt"
    ;;
  ds-cluster-4k)  # session 48: the cluster select (cheaper rounds since session 47, the grouped find) at 4k, where the
    # fused Triton select keeps SmolLM2 B1 reads at 0.85-0.93x SDPA (one program per head); C = 1 (one CTA scores and
    # selects a head's 4096 keys in shared memory), 2, 4 and 8 against the rule; two rounds
    ROUNDS=2 && sweep none KVCOMPRESS_DS_CONFIG ds8,ds16,ds8-shared,ds16-shared \
      "${S35_SHAPES:-smollm2-135m:1:4k,smollm2-135m:4:4k,llama3-8b:1:4k}" '{}' '{"method": "cuda", "cuda": {"cluster": 1}}' \
      '{"method": "cuda", "cuda": {"cluster": 2}}' '{"method": "cuda", "cuda": {"cluster": 4}}' \
      '{"method": "cuda", "cuda": {"cluster": 8}}'
    ;;
  ds-cluster-mid)  # the CUDA cluster select (C CTAs per query head, sm_90) at 8k / 16k, where "auto" never takes it
    # (cluster_auto: only beyond one fused chunk, 16384 tokens) and the one fused program per head over 8-16k label
    # keys made SmolLM2 B1 / B4 reads 0.71-0.89x SDPA (session 45, ds-fused-long); 32k as the reference, two rounds
    ROUNDS=2 && sweep none KVCOMPRESS_DS_CONFIG ds8,ds16,ds8-shared,ds16-shared \
      "${S35_SHAPES:-smollm2-135m:1:8k,smollm2-135m:4:8k,llama3-8b:1:8k,smollm2-135m:1:16k,smollm2-135m:4:16k,llama3-8b:1:16k,smollm2-135m:1:32k}" \
      '{}' '{"method": "cuda", "cuda": {"cluster": 8}}' '{"method": "cuda", "cuda": {"cluster": 4}}'
    ;;
  rules43-none)  # session 43's one-split rule (one_split_tokens 4096: full-width Llama reads filling the SMs) against
    # the rules before it ({"one_split_tokens": 0}); its GPU test first
    export PS_TEST_TIMEOUT=${PS_TEST_TIMEOUT:-200} PS_XDIST=${PS_XDIST:-2}
    ROUNDS=1 && sweep "tests/test_leank_kernel.py::test_one_split_read_on_gpu" KVCOMPRESS_LEANK_CONFIG none \
      "${S35_SHAPES:-llama3-8b:16:4k,llama3-8b:16:32k,llama3-8b:64:4k,llama3-8b:4:4k}" '{}' '{"one_split_tokens": 0}'
    ;;
  ds-tests)  # the DoubleSparse GPU tests alone (session 39: the fused select's candidate buffers are no longer zeroed -
    # its chunk and merge-level kernels write every slot; about 400 s cold, 8 xdist workers)
    export PS_TEST_TIMEOUT=${PS_TEST_TIMEOUT:-400} PS_XDIST=${PS_XDIST:-8}
    ROUNDS=1 && sweep tests/test_doublesparse_kernel.py KVCOMPRESS_DS_CONFIG ds16 llama3-8b:1:32k '{}'
    ;;
  paged-tests)  # the paged kernel's GPU tests alone (session 38: its page-id gathers' indices wrapped into the block)
    export PS_XDIST=${PS_XDIST:-8}
    ROUNDS=1 && sweep tests/test_paged_kernel.py \
      KVCOMPRESS_PAGED_CONFIG paged-dense llama3-8b:1:4k '{}'
    ;;
  buffer-auto)
    ROUNDS=2 && sweep none KVCOMPRESS_KIVI_CUDA_CONFIG kivi2-static,leank70-kivi2 \
      "${S35_SHAPES:-llama3-8b:1:4k,llama3-8b:1:32k,smollm2-135m:1:4k,smollm2-135m:1:32k,smollm2-135m:4:4k}" \
      '{}' '{"buffer_ctas": 16}'
    ;;
  *) echo "PART: stages, shapes, shapes-smol, valid-ahead, warp-groups, occupancy, buffer-tests, buffer-ab, buffer-rule, buffer-ctas, paged-shapes," \
       "grid, splits, grid37, grid37b, grid-full, split-cap, paged-late, ds-steps, tests37, paged-tests, paged-layout, profile4k, ops-grid, lanes4k, proj-stages, none-resident, rules40, buffer-apart, buffer-weight, ds-unroll, ds-fused, ds-fused-model, paged-pdl, splits1, rules43-ds, rules43-none, ds-fused-long, rules45-ds, ds-cluster-mid, tp2, tp2-throughput, ds-search, compiled-expandable, grid-full-expandable, ds-tests or buffer-auto" >&2
     exit 2 ;;
esac
