#!/usr/bin/env bash
# GPU-machine routine in two device calls (64 MiB travel per call; the teacher GGUF is 98 MB).
#
# Here, once:   scripts/device_stage_gguf.sh            # .dev/gguf/{part-a,part-b,cache}
#               tcal pool --out .dev/pool10m --max-tokens 10000000 --max-file-mb 9.6
#               pip download --no-deps -d .whl flash-linear-attention fla-core gguf
# Call A:  carry [".whl", ".dev/gguf/part-a", ".dev/pool10m/tokens-00000.bin"]
#          command: bash scripts/device_session.sh stage-a check speed
# Call B (right after A, while the machine is warm):
#          carry [".dev/gguf/part-b", ".dev/gguf/cache", ".dev/pool10m/tokens-00001.bin", ".dev/pool10m/manifest.json"]
#          command: bash scripts/device_session.sh stage-b select-timing recover
set -uo pipefail
cd "$(dirname "$0")/.."
S=/tmp/tcal-stage
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
OUT=${OUT:-/tmp/out}
mkdir -p "$S/pool" "$OUT"
export PYTHONPATH=$S/site:$PWD/src:$PWD/tests PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
RECOVER_TOKENS=${RECOVER_TOKENS:-20000000}

for step in "$@"; do
  echo "=== $step ($(date +%T))"
  case $step in
    stage-a)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $S/site .whl/*.whl
      cp .dev/gguf/part-a $S/ && cp .dev/pool10m/tokens-00000.bin $S/pool/
      python3 -c "import torch, transformers, fla; print('torch', torch.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__, torch.cuda.get_device_name())" ;;
    stage-b)
      cat $S/part-a .dev/gguf/part-b > $S/$NAME && echo "$SHA  $S/$NAME" | sha256sum -c && rm -f $S/part-a
      mkdir -p ~/.cache/tcal/gguf && ln -sf $S/$NAME ~/.cache/tcal/gguf/$NAME && cp -r .dev/gguf/cache/pypi ~/.cache/tcal/
      cp .dev/pool10m/tokens-00001.bin .dev/pool10m/manifest.json $S/pool/ ;;
    check)
      python3 -m pytest tests/test_fla.py -q -s -p no:cacheprovider 2>&1 | grep -E "fla chunk|passed|failed|Error" | tee "$OUT/fla_tests.log"
      for dt in bfloat16 float32; do
        python3 bench/gdn_ops.py --B 4 --T 4096 --H 16 --D 128 --dtype $dt --impls chunk,fla --reps 10 --json "$OUT/gdn_ops_$dt.json" | tail -5
      done ;;
    speed)
      python3 bench/hybrid_speed.py --shape qwen2.5-1.5b --keep uniform:25% --contexts 2048,8192,32768 --json "$OUT/hybrid_speed.json" | tail -9 ;;
    select-timing)
      python3 bench/select_policies.py --device cuda --ks 8,15 --init taylor-exact-silent --out "$OUT/select" | tail -12 ;;
    recover)  # resumable: rerun this step (same warm machine) until it prints "wrote"
      bash bench/distill_device.sh --data $S/pool --tokens "$RECOVER_TOKENS" --minutes "${RECOVER_MINUTES:-8}" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
