#!/usr/bin/env bash
# The Qwen2.5-Coder-0.5B GPU measurements of docs/results.md (*Qwen2.5-Coder 0.5B and 1.5B*), on a GPU machine staged
# with scripts/device_session.sh stage (the Qwen pieces, .dev/carry/qdata and .dev/carry/qp). Steps, in order:
#   sweep     bench/coder_sweep.py: keep sets and calibration text at the CPU default budget; pass@1, PPL, passkey
#   instruct  tcal instruct: the teacher's own answers to the documented functions of code:calib and python-src
#   keep      the answer:50% layer set (the teacher's answers to code tasks with each attention layer removed)
#   recover   tcal recover of copy, taylor-reference and taylor on the instruct set with a quarter of every batch raw
#             code-and-prose text, attention kept as the keep step says (else the sweep's set of lowest development
#             answer KL; RECOVER_KEEP to set it);
#             pass@1, passkey and the development answer KL at every curve point
# Usage: bash bench/coder_gpu.sh sweep instruct recover    (runs in $CODER_RUNS, default /tmp/tcal-runs/coder;
#        each step packs its reports, without weights, into $OUT/<step>.tgz)
set -uo pipefail
cd "$(dirname "$0")/.."
S=/tmp/tcal-stage
R=${CODER_RUNS:-/tmp/tcal-runs/coder}
OUT=${OUT:-/tmp/out}
T=qwen2.5-coder-0.5b
mkdir -p "$R" "$OUT"
export PYTHONPATH=$S/site:$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
pack() { (cd "$R" && tar czf "$OUT/$1.tgz" --exclude='*.safetensors' --exclude='tokenizer*' --exclude='*.npy' "$1"*); }

for step in "$@"; do
  echo "=== $step ($(date +%T))"
  case $step in
    sweep)
      python3 bench/coder_sweep.py --teacher $T --out "$R/sweep" ${SWEEP_ARGS:-} 2>&1 | grep -v "it/s"
      pack sweep ;;
    instruct)
      python3 -m tcal.cli instruct --teacher $T --sources code:calib,python-src --max-tasks "${INSTRUCT_TASKS:-2048}" \
        --seq-len 1024 --batch-size "${INSTRUCT_BATCH:-256}" --out "$R/instruct" --no-progress --overwrite
      cp "$R/instruct/report.md" "$OUT/instruct.md" ;;
    keep)
      # answer:50%: the layers whose attention the teacher's answers to code tasks need most (tcal.conversion.select)
      python3 -c "import sys
from tcal.conversion.select import select_layers
from tcal.data.teachers import load_teacher
t, tok = load_teacher(sys.argv[1], device='cuda')
print(','.join(map(str, select_layers(t, 'answer:50%', tokenizer=tok, progress=False).layers)))" $T | tail -1 > "$R/keep.txt"
      cat "$R/keep.txt" ;;
    recover)
      # the sweep's keep set of lowest development answer KL at the reference budget; every other layer without one
      [ -s "$R/keep.txt" ] && RECOVER_KEEP=${RECOVER_KEEP:-$(cat "$R/keep.txt")}
      keep=${RECOVER_KEEP:-$(python3 -c "import json, sys
try:
    r = json.load(open(sys.argv[1]))
    ref = {k: v for k, v in r.items() if k.endswith('/reference')}
    print(','.join(map(str, ref[min(ref, key=lambda k: ref[k]['dev_answer_kl'])]['keep'])))
except (OSError, ValueError, KeyError):
    print(','.join(map(str, range(0, 24, 2))))" "$R/sweep/results.json")}
      echo "recover: attention kept at $keep"
      python3 -m tcal.cli recover --teacher $T --keep "$keep" --inits "${RECOVER_INITS:-copy,taylor-reference,taylor}" \
        --data "$R/instruct" --seq-len 1024 --batch-size 16 --micro-batch 8 --mix-data $S/qpool --mix-frac 0.25 \
        --tokens "${RECOVER_TOKENS:-1000000}" --eval-every "${RECOVER_EVAL_EVERY:-500000}" --eval-early 0 \
        --eval code:eval --eval-windows 8 --tasks humaneval:164,passkey:10@1024,4096 --allow-code-execution \
        --align-steps 200 --kl-steps 100 \
        --out "$R/recover" --no-progress ${RECOVER_ARGS:-} 2>&1 | grep -v "it/s"
      pack recover ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
