#!/usr/bin/env bash
# Recovery experiment on the GPU machine (DESIGN.md §6 "Recovery"): smollm2-135m with attention kept
# at layers 0,4,...,28 (22 of 30 layers converted), inits copy and taylor, the same distillation
# (data, order, seed, schedule, budget) for each: >= 20M tokens per init from the real-text token
# pool; held-out PPL on wiki:eval (16 x 512) along the way. Never train on wiki:eval.
#
# Before the first call:
#   - scripts/device_stage_gguf.sh (teacher GGUF -> /tmp/tcal-stage/, gguf wheel, wiki corpus cache);
#   - a token pool built here with the teacher's tokenizer (tcal.pool.build_pool) under a
#     git-ignored folder, e.g. .dev/pool (uint16: 2 bytes a token, so ~25M tokens fit the 64 MiB carry).
# Each device call (carry [".dev/pool", ".whl"]; same warm machine as the staging):
#   bash bench/distill_device.sh [--tokens N] [--data .dev/pool] [--minutes 8] [extra tcal recover flags]
# A call stops itself after --minutes (checkpoint in $RUN.partial/); call again until it prints "wrote".
# Results (tables, plot, curves, reports; no weights) are copied to $OUT/recover each call.
set -euo pipefail
TOKENS=20000000 DATA=.dev/pool MINUTES=8 RUN=/tmp/tcal-runs/recover-smollm2
while [ $# -gt 0 ]; do
  case $1 in
    --tokens) TOKENS=$2; shift 2 ;;
    --data) DATA=$2; shift 2 ;;
    --minutes) MINUTES=$2; shift 2 ;;
    --run) RUN=$2; shift 2 ;;
    *) break ;;
  esac
done
if [ ! -d /tmp/site ] && ls .whl/*.whl >/dev/null 2>&1; then  # fla kernels (optional; chunked PyTorch otherwise)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PWD/src:/tmp/tcal-stage/site:/tmp/site PYTHONUNBUFFERED=1
python3 -c "import torch, transformers; from tcal.ops import fla_available as f, fla_backward_ok as b; \
print('torch', torch.__version__, 'transformers', transformers.__version__, \
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU', 'fla', f(), 'fla backward', f() and b())"
if [ -f "$RUN/recovery.md" ] && [ ! -d "$RUN.partial" ]; then
  echo "already finished: $RUN"
else
  RESUME=; [ -d "$RUN.partial" ] && RESUME=--resume
  python3 -m tcal.cli recover --teacher smollm2-135m --keep 0,4,8,12,16,20,24,28 --inits copy,taylor \
    --data "$DATA" --tokens "$TOKENS" --out "$RUN" --seq-len 1024 --batch-size 32 --kl-chunk 4096 \
    --eval wiki:eval --eval-window 512 --eval-windows 16 --eval-every 500000 \
    --calib wiki:calib --calib-window 512 --calib-windows 32 \
    --max-minutes "$MINUTES" --no-progress $RESUME "$@"
fi
R=${OUT:-/tmp/out}/recover; mkdir -p "$R"
for d in "$RUN" "$RUN.partial"; do
  [ -d "$d" ] || continue
  (cd "$d" && find . -maxdepth 2 \( -name '*.md' -o -name '*.json' -o -name '*.csv' -o -name '*.png' \) \
    -not -path './*/checkpoint/*' -exec cp --parents {} "$R/" \;)
done
cat "$R/recovery.md" 2>/dev/null || true
