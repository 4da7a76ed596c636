#!/usr/bin/env bash
# Runs tcal's GPU jobs on a machine without network (an air-gapped cluster node): docs/airgap.md.
# On a machine with network, once: python -m tcal.airgap pack (the teachers, corpora, token pools and wheels, cut into
# numbered folders under .dev/carry, each sized to travel in one transfer). Then, on the GPU machine, in the
# repository root, one job per transfer:
#   transfer some folders of .dev/carry             bash scripts/device_session.sh stage [STEP...]
#   (sweep jobs: also a folder of the calibration token files they read, .dev/sweep, .dev/sw or .dev/sn,
#    made by `python bench/calib_sweep.py tokens`)
#   later jobs on the same machine: bash scripts/device_session.sh STEP...
# A run that pauses (recover, recover50, distill-long, teacher-distill) resumes when its step is run again, until it
# prints "wrote". Results land in $OUT (default /tmp/out). TEACHER names the built-in teacher the steps convert
# (default: tcal's default teacher); its token pool is the one packed as --pool TEACHER=DIR (staged in
# $S/pools/TEACHER). Steps:
#   stage          python -m tcal.airgap stage: keep the pieces transferred, join and check every item whose pieces
#                  are all here, put it where tcal looks (the tcal cache, $S/pools, the wheels in $S/site)
#   check          CUDA tests: fla vs the fp32 loop, chunked PyTorch on CUDA with gradients, distill on CUDA;
#                  then bench/gdn_ops.py at B=4 T=4096 H=16 D=128 (bf16 and fp32; the fp32 loop forward once)
#   speed          tcal bench at the Qwen2.5-1.5B shape (teacher vs hybrid prefill/decode)
#   distill-speed  bench/distill_speed.py at the teacher's shape (SHAPE; training tokens/s, peak memory)
#   sweep          bench/calib_sweep.py on the GPU (SWEEP_JOBS, SWEEP_WORKERS (default 1), SWEEP_MINUTES, SWEEP_ARGS);
#                  each converted hybrid is saved under /tmp/tcal-runs/sweep/<job> for the quality step
#   calib-speed    bench/calib_speed.py: Taylor-Calibrate wall time at the Qwen2.5-1.5B shape
#   recover        bench/distill_device.sh: the resumable recovery run (RECOVER_TOKENS, RECOVER_MINUTES, INITS)
#   recover50      the same at 50 % converted: copy, taylor-reference, taylor; mixed calibration; init weights kept
#   quality        bench/quality_suite.py on the teacher and recover50's models (PPL x 3 domains, niah, lm-eval); after distill-long,
#                  DISTILL_FROM zero-shot and distilled
#   smoke          bench/fsdp_smoke.py under torchrun with one process: the FSDP2 path on a mesh of one GPU
#   gputests       the CUDA cases of Phase 2 side by side (tests/modules/test_gdn_stack.py, tests/taylor/test_phase2_concurrent.py)
#   phase2-ab      Phase 2 wall time one layer at a time vs side by side, fp32 vs TF32 (SHAPE, random weights)
#   scan-speed     bench/gdn_ops.py: the chunk loop (eager, compiled) against the parallel scan over chunks (backend "scan")
#   distill-long   tcal distill of a saved sweep hybrid (DISTILL_FROM) on long sequences (DISTILL_SEQ, DISTILL_TOKENS,
#                  DISTILL_EVAL_EVERY, DISTILL_ARGS; DISTILL_TAG names a second run of one hybrid; CALL_S or
#                  DISTILL_MINUTES bound a job),
#                  passkey at every curve point (DISTILL_PASSKEY lengths, 20 prompts each)
#   layout         the qwen3_5 target against the native layout at equal budgets (LAYOUT_BUDGETS, default reference large
#                  long; LAYOUT_TARGETS native qwen3_5), all through the CLI: tcal convert with PPL on three held-out
#                  domains, then tcal eval's passkey at 512-4K (LAYOUT_SAMPLES per length, seed 0); a job already done on
#                  this machine is skipped, and none starts with fewer than LAYOUT_JOB_S seconds of CALL_S left
#   teacher        TEACHER on the GPU, each part skipped once this machine has it: the teacher's passkey at 512-8K (and
#                  HumanEval pass@1 for a code teacher), the zero-shot ablation at the CPU default protocol for each of
#                  ABLATE_KEEPS (default auto; ABLATE=0 skips it; every init's pass@1 for a code teacher), then its
#                  conversions (JOBS: NAME/KEEP/INIT/BUDGET, default taylor-large/auto/taylor/large) with PPL on its
#                  held-out domains (EVAL, default its own; EVAL_WINDOWS), passkey at 512-8K (SAMPLES per length, seed
#                  0) and pass@1 for a code teacher; none starts with fewer than JOB_S seconds of CALL_S left
#   teacher-distill  tcal distill of a teacher job's hybrid (DISTILL_FROM, default taylor-large) on TEACHER's staged pool
#                  (DISTILL_TOKENS, DISTILL_SEQ, DISTILL_BATCH, DISTILL_EVAL_EVERY, DISTILL_ARGS), resumed across calls
#                  (CALL_S), then its passkey at 512-8K
#   shape-bench    tcal bench FastDecoder rows at 8K-32K for each of SHAPES (default SHAPE), one hybrid per BENCH_KEEPS
#                  entry (NAME=KEEP, default auto=auto)
#   bench          tcal bench at the Llama-3.2-3B shape (BENCH_LLAMA=0 skips it) and on recover50's trained taylor hybrid (--check, generate)
set -uo pipefail
cd "$(dirname "$0")/.."
S=${STAGE:-/tmp/tcal-stage}
R50=/tmp/tcal-runs/recover50
OUT=${OUT:-/tmp/out}
mkdir -p "$S" "$OUT"
export PYTHONPATH=$S/site:$PWD/src:$PWD/tests PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# the built-in teacher the steps convert (default: tcal's default teacher), its staged pool, and the shape of its
# model (tcal.models.shapes names the SmolLM2 and Gemma 3 shapes after their teachers)
TEACHER=${TEACHER:-$(python3 -c 'from tcal.utils.config import DEFAULT_TEACHER as t; print(t)')}
POOL=$S/pools/$TEACHER
SHAPE=${SHAPE:-$TEACHER}

# A machine that has not been staged (a new node, or one whose /tmp and cache were cleared) cannot fetch the teacher:
# say so in one line instead of a download traceback from deep inside a step.
need_teacher() { python3 -m tcal.airgap check --teacher "$TEACHER" || { echo "$1: not run" >&2; exit 3; }; }
need_pool() {
  [ -f "$POOL/manifest.json" ] && return 0
  echo "$1: no token pool of $TEACHER is staged ($POOL): pack one with python -m tcal.airgap pack --pool $TEACHER=DIR" >&2
  exit 3
}

# passkey MODEL OUTDIR LENGTHS SAMPLES: tcal eval's single-needle retrieval (seed 0) of a hybrid or teacher
passkey() {
  python3 -m tcal.cli eval "$1" --tasks "single:$4@$3" --seed 0 --device cuda --no-progress \
    --out "$2" 2>&1 | grep -v "it/s" | tail -3
}
# humaneval MODEL OUTDIR: HumanEval pass@1 of a hybrid or teacher, every problem in one batch
humaneval() {
  python3 -m tcal.cli eval "$1" --tasks humaneval --allow-code-execution --batch-size 164 --device cuda --no-progress \
    --out "$2" 2>&1 | grep -v "it/s" | grep -E "pass@1|error" | head -3
}
# cuda_tests LOG [-k EXPR] TEST...: pytest on TEST..., its whole output in LOG and the lines that matter on screen;
# fails loudly where a named test file does not exist, pytest fails, or no test passed (on a machine without CUDA or
# fla every one of these skips, which is not a check)
cuda_tests() {
  local log=$1 t rc summary
  shift
  for t in "$@"; do
    case $t in tests/*) [ -e "${t%%::*}" ] || { echo "check: ${t%%::*} does not exist; name the tests that do" >&2; return 4; } ;; esac
  done
  python3 -m pytest -q -s -rs -p no:cacheprovider "$@" > "$log" 2>&1
  rc=$?
  grep -E "fla chunk|torch chunk|passed|failed|Error|SKIP" "$log"
  summary=$(tail -1 "$log")
  if [ "$rc" -ne 0 ] || ! grep -qE "[1-9][0-9]* passed" <<<"$summary"; then
    echo "check: the CUDA tests did not run and pass (pytest exit $rc: $summary); see $log" >&2
    return 1
  fi
}
# pack_runs DIR NAME: DIR's reports, curves and retrieval results (no weights, no unfinished runs) as $OUT/NAME.tgz
pack_runs() { (cd "$1" && tar czf "$OUT/$2.tgz" --exclude='*.safetensors' --exclude='*.partial' .); }

# CALL_S (seconds, optional): the wall-time limit of this job, set a little below the cluster's own limit per job.
# distill-long then trains for what is left of it (DISTILL_MINUTES, when set, still caps it) and quality is skipped,
# with a line that says so, when fewer than QUALITY_S seconds (default 150) are left: one job can run
# `distill-long quality` and stop inside its limit whether the run finishes in it or not.
T0=$(date +%s)
left() { echo $(( ${CALL_S:-100000} - $(date +%s) + T0 )); }
# minutes_left RESERVE [CAP]: the minutes of CALL_S left once RESERVE seconds are kept back, at most CAP; fails below one
minutes_left() {
  python3 -c "import sys; m = min(float(sys.argv[3] or 1e9), (int(sys.argv[1]) - int(sys.argv[2])) / 60)
sys.exit(1) if m < 1 else print(round(m, 2))" "$(left)" "$1" "${2:-}"
}

for step in "$@"; do
  echo "=== $step ($(date +%T))"
  case $step in recover|sweep|recover50|quality|distill-long|layout|teacher|teacher-distill) need_teacher "$step" ;; esac
  case $step in recover|recover50|distill-long|teacher-distill) need_pool "$step" ;; esac
  case $step in
    stage)
      python3 -m tcal.airgap stage --carry "${CARRY:-.dev/carry}" --stage "$S"
      python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
      python3 -c "import fla; print('fla', fla.__version__)" 2>&1 | tail -1 ;;
    check)
      cuda_tests "$OUT/cuda_tests.log" tests/ops/test_fla.py tests/evaluate/test_perplexity.py::test_cuda_matches_cpu \
        tests/train/test_trainer.py::test_distill_on_cuda_bf16_trains_and_resumes || exit 1
      for dt in bfloat16 float32; do
        python3 bench/gdn_ops.py --B 4 --T 4096 --H 16 --D 128 --dtype $dt --impls chunk,scan,fla --reps 10 \
          --json "$OUT/gdn_ops_$dt.json" | tail -5
      done
      python3 bench/gdn_ops.py --B 4 --T 4096 --H 16 --D 128 --dtype float32 --impls naive --no-backward \
        --reps 1 --warmup 0 --json "$OUT/gdn_ops_naive.json" | tail -2 ;;
    speed)
      python3 -m tcal.cli bench --model qwen2.5-1.5b --keep uniform:25% --contexts 2048,8192,32768 \
        --rows teacher-eager,hybrid-eager --out "$OUT/speed" --no-progress 2>&1 | grep -v "it/s" | tail -20 ;;
    distill-speed)
      python3 bench/distill_speed.py --shape "$SHAPE" --keep 0,4,8,12,16,20,24,28 --seq-len 1024 \
        --batch-size 32 --steps 8 --json "$OUT/distill_speed.json" ;;
    recover)
      # RECOVER_MINUTES (default 6.5) bounds the training of one job; the job's wall-time limit must also hold what
      # --max-minutes cannot pause: loading the teacher, a taylor conversion (146 s for 22 layers on an H200), the
      # last checkpoint and the archive.
      bash bench/distill_device.sh --data "$POOL" --tokens "${RECOVER_TOKENS:-20000000}" \
        --minutes "${RECOVER_MINUTES:-6.5}" --inits "${INITS:-copy,taylor}" --teacher "$TEACHER" ;;
    sweep)
      # bench/calib_sweep.py on the carried token ids (.dev/sweep, made here by `calib_sweep.py tokens`):
      # SWEEP_JOBS (job sets), SWEEP_WORKERS processes sharing the GPU, no job started after SWEEP_MINUTES.
      # .dev/sw, .dev/sn: folders of only the token files the jobs read, when .dev/sweep whole is above the transfer limit
      for d in .dev/sweep .dev/sw .dev/sn; do [ -d $d ] && mkdir -p $S/sweep && cp $d/*.npy $S/sweep/ 2>/dev/null; done
      # One worker by default: four processes sharing an H200 finished no 256K job in 10 minutes where one
      # alone finishes one in 4.3. Time-slicing between CUDA contexts costs these launch-bound fits more than it
      # overlaps.
      n=${SWEEP_WORKERS:-1}
      # one process dequantises the GGUF into the teacher cache before the workers all read it
      python3 -c "from tcal.data.teachers import load_teacher; load_teacher('$TEACHER', device='cpu')" 2>&1 | tail -1
      # keep sets written on this machine ($S/NAME.keep, one comma list of layers) join the long-window-4k jobs under
      # their names
      kf=; for f in $S/*.keep; do [ -f "$f" ] && kf="$kf --keep-file $(basename "$f" .keep)=$f"; done
      for w in $(seq 0 $((n - 1))); do
        OMP_NUM_THREADS=2 python3 bench/calib_sweep.py run $kf --tokens $S/sweep --jobs "${SWEEP_JOBS:-methods16}" \
          --worker $w --workers $n --deadline-min "${SWEEP_MINUTES:-6}" --out "$OUT/sweep-$w.jsonl" \
          --save /tmp/tcal-runs/sweep ${SWEEP_ARGS:-} \
          > "$OUT/sweep-$w.log" 2>&1 &
      done
      wait
      grep -h . "$OUT"/sweep-*.jsonl | python3 -c "import sys, json; [print(r.get('method'), r.get('keep'), r.get('budget'), r.get('calib'), {k: round(v, 2) for k, v in (r.get('ppl') or {}).items()}, round(r.get('wall_s', 0)), r.get('error', '')) for r in map(json.loads, sys.stdin)]" ;;
    calib-speed)
      # Taylor-Calibrate wall time at the Qwen2.5-1.5B shape (random weights), CALIB_LAYERS deep (0 = all 28); a second
      # run in one job finds the compile caches the first one filled (calib_speed_0.json, calib_speed_1.json, ...)
      python3 bench/calib_speed.py --shape qwen2.5-1.5b --keep uniform:25% --windows "${CALIB_WINDOWS:-128}" \
        --window 512 --init "${CALIB_INIT:-taylor}" --num-layers "${CALIB_LAYERS:-0}" \
        --json "$OUT/calib_speed_$(ls "$OUT"/calib_speed_*.json 2>/dev/null | wc -l).json" \
        2>&1 | grep -v "it/s" | tail -20 ;;
    recover50)
      # 50 % converted (attention kept at 0,2,...,28): copy vs the paper's recipe vs taylor, the same pool, order,
      # schedule and budget for each; both calibrated inits read the same 512 x 512 mixed calibration tokens.
      # The calibrated inits go first: a conversion cannot pause, so it must not straddle a job's deadline.
      # --keep-init keeps each init's weights before training (the quality step scores both).
      # Runs that record no resolved calibration settings (bench/results/2026-12-01-recovery-50-percent, taylor with a
      # 100-step KL stage) cannot be compared by bench/merge_recovery.py: it says so.
      bash bench/distill_device.sh --data "$POOL" --tokens "${RECOVER_TOKENS:-8000000}" \
        --minutes "${RECOVER_MINUTES:-6.5}" --inits "${INITS:-taylor,taylor-reference,copy}" --run $R50 \
        --keep 0,2,4,6,8,10,12,14,16,18,20,22,24,26,28 --calib wiki:calib+shakespeare:calib --calib-windows 512 \
        --keep-init --teacher "$TEACHER" ;;
    quality)
      # every quality axis of the teacher and of recover50's models, zero-shot (-init) and trained
      # QUALITY_MODELS (name=path,...) replaces the default list; the teacher always comes first
      [ "$(left)" -lt "${QUALITY_S:-150}" ] && { echo "quality: $(left) s left of CALL_S, skipped"; continue; }
      m=teacher=$TEACHER
      [ -n "${QUALITY_MODELS:-}" ] && m=$m,$QUALITY_MODELS
      # after distill-long (DISTILL_FROM): the hybrid zero-shot and, once its run has finished, distilled
      if [ -z "${QUALITY_MODELS:-}" ] && [ -n "${DISTILL_FROM:-}" ]; then
        m=$m,zero-shot=/tmp/tcal-runs/sweep/$DISTILL_FROM
        DL=/tmp/tcal-runs/distill-long/$DISTILL_FROM${DISTILL_TAG:-}
        if [ -d $DL ] && [ ! -d $DL.partial ]; then m=$m,distilled=$DL; else echo "quality: $DL not finished, zero-shot only"; fi
      fi
      [ -z "${QUALITY_MODELS:-}${DISTILL_FROM:-}" ] && for i in copy taylor-reference phase2 taylor; do
        [ -d $R50/$i-init ] && m=$m,$i-init=$R50/$i-init
        [ -d $R50/$i ] && m=$m,$i=$R50/$i
      done
      python3 bench/quality_suite.py --models "$m" --device cuda --out "$OUT/quality" ${QUALITY_ARGS:-} 2>&1 \
        | grep -v "it/s\|Loading weights" | tail -60 ;;
    bench)
      # tcal bench: the Llama-3.2-3B shape (random weights, 75 % converted), then recover50's trained taylor
      # hybrid (taylor, else taylor-reference, else copy: the real SmolLM2 conversion; fast == eager check,
      # HF generate() vs FastDecoder.generate)
      [ "${BENCH_LLAMA:-1}" = 1 ] && python3 -m tcal.cli bench --model llama-3.2-3b --keep uniform:25% --contexts 2048,8192,32768 \
        --rows teacher-eager,hybrid-eager,teacher-fast,hybrid-fast --batch-sizes 1,32,max --out /tmp/bench-llama \
        --no-progress 2>&1 | grep -v "it/s" | tail -40
      H=; for i in taylor taylor-reference copy; do [ -z "$H" ] && [ -d $R50/$i ] && H=$R50/$i; done
      [ -n "$H" ] && python3 -m tcal.cli bench --model $H --contexts 512,2048,4096 \
        --rows teacher-fast,hybrid-eager,hybrid-fast,generate --check --out /tmp/bench-smol --no-progress 2>&1 \
        | grep -v "it/s" | tail -40
      tar czf "$OUT/bench.tgz" -C /tmp $(cd /tmp && ls -d bench-llama bench-smol 2>/dev/null) ;;
    gputests)
      # the CUDA cases of Phase 2 side by side: the stack's forward on fla, the group fit against each layer alone
      cuda_tests "$OUT/gputests.log" -k cuda tests/modules/test_gdn_stack.py tests/taylor/test_phase2_concurrent.py \
        || exit 1 ;;
    phase2-ab)
      # Phase 2 at the SmolLM2-135M shape (random weights, 15 of 30 layers converted, 64 x 512 tokens, 150 steps of 16):
      # one layer at a time in fp32 (as before), then side by side with TF32 (PHASE2_AB: more "concurrent,tf32" pairs)
      for ct in ${PHASE2_AB:-off,off on,on}; do
        timeout 85 python3 bench/calib_speed.py --shape "$SHAPE" --keep uniform:50% --windows 64 --window 512 \
          --steps 150 --init phase2 --concurrent ${ct%,*} --tf32 ${ct#*,} --json "$OUT/p2ab.json" 2>&1 \
          | grep -E '"phase2_s"|"total_s"' | tr '\n' ' '; echo " concurrent,tf32=$ct"
        cat "$OUT/p2ab.json" >> "$OUT/phase2_ab.jsonl"; echo >> "$OUT/phase2_ab.jsonl"
      done; rm -f "$OUT/p2ab.json" ;;
    scan-speed)
      # the gated delta rule's state passed by a loop (compiled and not) or by a parallel scan, forward + backward at
      # the SmolLM2 head shape, 512 to 4,096 tokens: how long-sequence training should run where fla cannot train
      # The compiled loop runs in a process of its own and last: its compile at 4,096 tokens (64 chunks unrolled,
      # forward and backward) can outrun a 120 s limit, and would take the eager rows of its process with it.
      for bt in 16,512 4,2048 1,4096 8,4096; do
        timeout 90 python3 bench/gdn_ops.py --B ${bt%,*} --T ${bt#*,} --H 9 --D 64 --impls chunk,scan \
          --reps 10 --json "$OUT/scan_${bt/,/x}.json" | tail -3
      done
      for bt in 16,512 4,2048 1,4096 8,4096; do
        timeout 150 python3 bench/gdn_ops.py --B ${bt%,*} --T ${bt#*,} --H 9 --D 64 --impls compile \
          --reps 10 --json "$OUT/scan_${bt/,/x}_compile.json" | tail -2
      done ;;
    distill-long)
      # distil a hybrid the sweep saved (DISTILL_FROM, a job name) on DISTILL_SEQ-token sequences of the pool: retrieval
      # up to the passkey lengths needs training sequences that long (recover50's 1,024 brought it back to 1K only)
      H=/tmp/tcal-runs/sweep/$DISTILL_FROM
      D=/tmp/tcal-runs/distill-long/$DISTILL_FROM${DISTILL_TAG:-}
      RESUME=; [ -d "$D.partial" ] && RESUME=--resume
      [ -d "$D" ] && [ ! -d "$D.partial" ] && { echo "distill-long: $D is finished"; continue; }
      # 100 s of CALL_S are kept for what --max-minutes may not bound: starting the process, the last checkpoint
      # and evaluation, copying the curve
      MIN=${DISTILL_MINUTES:-4}
      if [ -n "${CALL_S:-}" ]; then
        MIN=$(minutes_left 100 "${DISTILL_MINUTES:-}") \
          || { echo "distill-long: $(left) s left of CALL_S, too few to start"; continue; }
      fi
      echo "distill-long: --max-minutes $MIN"
      python3 -m tcal.cli distill "$H" --teacher "$TEACHER" --data "$POOL" --tokens "${DISTILL_TOKENS:-4000000}" \
        --seq-len "${DISTILL_SEQ:-4096}" --batch-size "${DISTILL_BATCH:-8}" --kl-chunk 4096 --eval wiki:eval \
        --eval-window 512 --eval-windows 16 --eval-every "${DISTILL_EVAL_EVERY:-1000000}" --max-minutes "$MIN" --out "$D" \
        --tasks "passkey:20@${DISTILL_PASSKEY:-1024,2048,4096}" \
        --no-progress $RESUME ${DISTILL_ARGS:-} 2>&1 | grep -v "it/s" | tail -15
      for f in curve.csv report.json report.md; do [ -f "$D/$f" ] && cp "$D/$f" "$OUT/distill_long_$f"; done ;;
    layout)
      for b in ${LAYOUT_BUDGETS:-reference large long}; do
        K=0,2,4,6,8,10,12,14,16,18,20,22,24,26,28
        [ "$b" = long ] && K=0,1,2,4,7,8,15,16,18,19,20,21,23,24,29  # the retrieval set the long budget was measured on
        for t in ${LAYOUT_TARGETS:-native qwen3_5}; do
          D=/tmp/tcal-runs/layout/$b-$t
          if [ ! -f $D/report.json ]; then
            [ "$(left)" -lt "${LAYOUT_JOB_S:-240}" ] && { echo "layout: $(left) s left of CALL_S, $b-$t not started"; break 2; }
            python3 -m tcal.cli convert --teacher "$TEACHER" --keep $K --calib-budget $b --target $t \
              --eval wiki:eval,shakespeare:eval,sotu:eval --device cuda --no-progress --out $D 2>&1 | grep -v "it/s" | tail -4
          fi
          if [ -f $D/report.json ] && [ ! -f $D-niah/niah.json ]; then
            [ "$(left)" -lt 100 ] && { echo "layout: $(left) s left of CALL_S, passkey of $b-$t not started"; break 2; }
            passkey $D $D-niah 512,1024,2048,4096 "${LAYOUT_SAMPLES:-50}"
          fi
        done
      done
      pack_runs /tmp/tcal-runs/layout layout ;;
    teacher)
      # TEACHER through the CLI, each part skipped once this machine has it: the teacher's own passkey (and pass@1),
      # the zero-shot ablation at the CPU default protocol (reference budget, 60 Phase 2 and 10 KL steps), then JOBS
      T=/tmp/tcal-runs/$TEACHER
      mkdir -p "$T"
      CODE=$(python3 -c "from tcal.data.teacher_table import TEACHERS; print(int(TEACHERS['$TEACHER'].code))")
      EV=${EVAL:-$(python3 -c "from tcal.data.teacher_table import default_eval; print(','.join(default_eval('$TEACHER')))")}
      HE=; [ "$CODE" = 1 ] && HE="--tasks humaneval --allow-code-execution"
      [ "$CODE" = 1 ] && [ ! -f "$T/teacher-he/humaneval.json" ] && humaneval "$TEACHER" "$T/teacher-he"
      [ -f "$T/teacher-niah/niah.json" ] || passkey "$TEACHER" "$T/teacher-niah" 512,1024,2048,4096,8192 "${SAMPLES:-30}"
      for k in ${ABLATE_KEEPS:-auto}; do
        [ "${ABLATE:-1}" = 1 ] || break
        D=$T/ablate-$(echo "$k" | tr -c 'a-z0-9\n' -)
        [ -f "$D/ablation.json" ] && continue
        [ "$(left)" -lt "${ABLATE_S:-300}" ] && { echo "teacher: $(left) s left of CALL_S, ablation $k not started"; break; }
        python3 -m tcal.cli ablate --teacher "$TEACHER" --keep "$k" --calib-budget reference --align-steps 60 --kl-steps 10 \
          --eval "$EV" ${EVAL_WINDOWS:+--eval-windows $EVAL_WINDOWS} $HE --device cuda --no-progress --out "$D" 2>&1 \
          | grep -v "it/s" | tail -14
      done
      for job in ${JOBS:-taylor-large/auto/taylor/large}; do
        IFS=/ read -r name keep init budget <<< "$job"
        D=$T/$name
        if [ ! -f "$D/report.json" ]; then
          [ "$(left)" -lt "${JOB_S:-360}" ] && { echo "teacher: $(left) s left of CALL_S, $name not started"; break; }
          python3 -m tcal.cli convert --teacher "$TEACHER" --keep "$keep" --init "$init" --calib-budget "$budget" \
            --eval "$EV" ${EVAL_WINDOWS:+--eval-windows $EVAL_WINDOWS} --device cuda --no-progress --out "$D" 2>&1 \
            | grep -v "it/s" | tail -5
        fi
        [ -f "$D/report.json" ] && [ "$CODE" = 1 ] && [ ! -f "$D-he/humaneval.json" ] && humaneval "$D" "$D-he"
        if [ -f "$D/report.json" ] && [ ! -f "$D-niah/niah.json" ]; then
          [ "$(left)" -lt 60 ] && { echo "teacher: $(left) s left of CALL_S, passkey of $name not started"; break; }
          passkey "$D" "$D-niah" 512,1024,2048,4096,8192 "${SAMPLES:-30}"
        fi
      done
      pack_runs "$T" "$TEACHER" ;;
    teacher-distill)
      # distil a hybrid of the teacher step (DISTILL_FROM, a job name) on TEACHER's staged pool, scored on its home
      # domain at every curve point; resumes where a call's time ran out (CALL_S), until "wrote"; then its passkey
      H=/tmp/tcal-runs/$TEACHER/${DISTILL_FROM:-taylor-large}
      D=$H-distilled
      [ -f "$H/report.json" ] || { echo "teacher-distill: no hybrid at $H: run the teacher step with a JOBS entry of that name" >&2; exit 3; }
      if [ ! -f "$D/report.json" ] || [ -d "$D.partial" ]; then
        RESUME=; [ -d "$D.partial" ] && RESUME=--resume
        MIN=$(minutes_left "${DISTILL_KEEP_S:-150}") \
          || { echo "teacher-distill: $(left) s left of CALL_S, too few to start"; continue; }
        HOME_EVAL=$(python3 -c "from tcal.data.teacher_table import default_eval; print(default_eval('$TEACHER')[0])")
        python3 -m tcal.cli distill "$H" --teacher "$TEACHER" --data "$POOL" --tokens "${DISTILL_TOKENS:-8000000}" \
          --seq-len "${DISTILL_SEQ:-4096}" --batch-size "${DISTILL_BATCH:-8}" --kl-chunk 4096 --eval "$HOME_EVAL" \
          --eval-windows 16 --eval-every "${DISTILL_EVAL_EVERY:-4000000}" --max-minutes "$MIN" --no-progress \
          --out "$D" $RESUME ${DISTILL_ARGS:-} 2>&1 | grep -v "it/s" | tail -14
      fi
      if [ -f "$D/report.json" ] && [ ! -d "$D.partial" ] && [ ! -f "$D-niah/niah.json" ]; then
        passkey "$D" "$D-niah" 512,1024,2048,4096,8192 "${SAMPLES:-30}"
      fi
      pack_runs "/tmp/tcal-runs/$TEACHER" "$TEACHER" ;;
    shape-bench)
      # FastDecoder speed of model shapes (random weights: speed does not depend on them) against their teachers,
      # one hybrid per BENCH_KEEPS entry (space-separated NAME=KEEP)
      for shape in ${SHAPES:-$SHAPE}; do
        for kk in ${BENCH_KEEPS:-auto=auto}; do
          python3 -m tcal.cli bench --model "$shape" --keep "${kk#*=}" --contexts 8192,16384,32768 \
            --rows teacher-fast,hybrid-fast --batch-sizes 1,8,32 --device cuda --no-progress \
            --out "$OUT/bench-$shape-${kk%%=*}" 2>&1 | grep -v "it/s" | tail -12
        done
      done ;;
    smoke)
      python3 -m torch.distributed.run --nproc_per_node 1 bench/fsdp_smoke.py 2>&1 | grep -v "it/s" | tail -20 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
