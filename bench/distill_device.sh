#!/usr/bin/env bash
# The recovery run on a GPU machine (docs/results.md, *Recovery*): smollm2-135m with attention kept at layers
# 0,4,...,28 (22 of 30 layers converted), inits copy and taylor, the same distillation (data, order, seed, schedule,
# budget) for each: >= 20M tokens per init from the real-text token pool; held-out PPL on wiki:eval (16 x 512)
# along the way. Never train on wiki:eval.
#
# On a machine without network, stage the teacher, corpora, token pool and wheels first (docs/airgap.md):
# tcal airgap pack on a machine with network, then the `stage` step of scripts/device_session.sh on the GPU
# machine; that script's `recover` and `recover50` steps call this one:
#   bash bench/distill_device.sh [--tokens N] [--data POOL] [--minutes 6.5] [--inits copy,taylor] [tcal recover flags]
# A job stops itself after --minutes (checkpoint in $RUN.partial/); run it again until it prints "wrote".
# Results (tables, plot, curves, reports; no weights) go to $OUT/recover.tgz each time.
set -euo pipefail
TOKENS=20000000 DATA=/tmp/tcal-stage/pools/smollm2-135m MINUTES=6.5 INITS=copy,taylor RUN=/tmp/tcal-runs/recover-smollm2
while [ $# -gt 0 ]; do
  case $1 in
    --tokens) TOKENS=$2; shift 2 ;;
    --data) DATA=$2; shift 2 ;;
    --minutes) MINUTES=$2; shift 2 ;;
    --run) RUN=$2; shift 2 ;;
    --inits) INITS=$2; shift 2 ;;
    *) break ;;
  esac
done
export PYTHONPATH=$PWD/src:/tmp/tcal-stage/site PYTHONUNBUFFERED=1
python3 -c "import torch, transformers; from tcal.ops import fla_available as f, fla_backward_ok as b; \
print('torch', torch.__version__, 'transformers', transformers.__version__, \
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU', 'fla', f(), 'fla backward', f() and b())"
if [ -f "$RUN/recovery.md" ] && [ ! -d "$RUN.partial" ]; then
  echo "already finished: $RUN"
else
  RESUME=; [ -d "$RUN.partial" ] && RESUME=--resume
  python3 -m tcal.cli recover --teacher smollm2-135m --keep 0,4,8,12,16,20,24,28 --inits "$INITS" \
    --data "$DATA" --tokens "$TOKENS" --out "$RUN" --seq-len 1024 --batch-size 32 --kl-chunk 4096 \
    --eval wiki:eval --eval-window 512 --eval-windows 16 --eval-every 500000 \
    --calib wiki:calib --calib-window 512 --calib-windows 32 \
    --max-minutes "$MINUTES" --no-progress $RESUME "$@"
fi
# Pack the results (no weights) into one archive: one file to copy back from the GPU machine.
R=$(mktemp -d)/recover; mkdir -p "$R"
for d in "$RUN" "$RUN.partial"; do
  [ -d "$d" ] || continue
  (cd "$d" && find . -maxdepth 2 \( -name '*.md' -o -name '*.json' -o -name '*.csv' -o -name '*.png' \) \
    -not -path './*/checkpoint/*' -exec cp --parents {} "$R/" \;)
done
mkdir -p "${OUT:-/tmp/out}" && tar czf "${OUT:-/tmp/out}/recover.tgz" -C "$(dirname "$R")" recover
cat "$R/recovery.md" 2>/dev/null || true
