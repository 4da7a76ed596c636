#!/usr/bin/env bash
# FastDecoder on a GPU machine without network (docs/airgap.md): its tests (CPU + CUDA), fast == eager at the
# Qwen2.5-1.5B shape, and the speed tables, through `tcal bench`. One job: transfer the folders
# `tcal airgap pack` wrote (its wheels; they are staged first), command:
#   bash scripts/device_fast.sh STEP...
#   tests      pytest tests/models/test_fast.py tests/modules/test_gdn.py (CPU and CUDA cases)
#   cudatests  only the CUDA cases of tests/models/test_fast.py
#   check      tcal bench --check at 2K (prefill + 64 teacher-forced decode steps against an fp32 copy)
#   quick      the four non-compiled rows at 2K only
#   speed      all non-compiled rows at 2K/8K/32K + batched decode at 32K (B = 1, 8, 32)
#   final      speed + batched B up to 128, then teacher-compiled at 2K (its StaticCache sized to the context)
#   compiled   the teacher's HF StaticCache + torch.compile row at 2K/8K/32K
#   speed6     teacher eager/fast and hybrid fast at 2K-32K, batched decode at 32K up to the largest batch (max)
#   speed9     teacher and hybrid fast at 2K-32K, batched decode at 32K (B = 1, 32, 128, max)
#   ab         teacher and hybrid fast at 2K and 32K, B = 1, once as the tree is and once with AB_BEFORE as
#              src/tcal/models/fast.py (an untracked copy of an older one, e.g. git show REV:src/tcal/models/fast.py):
#              the same machine, minutes apart
# Contexts stop at 32K: tcal bench keeps a shape's contexts within its max_position_embeddings (Qwen2.5-1.5B: 32,768).
# Each step writes a tcal bench output directory (bench.json, bench.md, bench.png) under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
S=${STAGE:-/tmp/tcal-stage}
[ -d .dev/carry ] && PYTHONPATH=$PWD/src python3 -m tcal airgap stage --carry .dev/carry --stage "$S"
export PYTHONPATH=$S/site:$PWD/src:$PWD/tests PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -c "import torch, transformers, triton, fla; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, 'fla', fla.__version__, torch.cuda.get_device_name())"
B="python3 -m tcal.cli bench --model qwen2.5-1.5b --keep uniform:25% --device cuda --no-progress"
for step in "$@"; do
  echo "=== $step ($(date +%T))"
  case $step in
    tests)
      python3 -m pytest -q -p no:cacheprovider -rs tests/models/test_fast.py tests/modules/test_gdn.py 2>&1 \
        | tee "$OUT/tests.log" | grep -vE "^\s*$" | tail -40 ;;
    cudatests)
      python3 -m pytest -q -p no:cacheprovider -rs -k cuda tests/models/test_fast.py 2>&1 \
        | tee "$OUT/cuda_tests.log" | grep -vE "^\s*$" | tail -20 ;;
    check)
      $B --contexts 2048 --rows "" --check --out "$OUT/check" 2>&1 | tail -12 ;;
    quick)
      $B --contexts 2048 --rows teacher-eager,hybrid-eager,teacher-fast,hybrid-fast --out "$OUT/quick" 2>&1 | tail -16 ;;
    speed)
      $B --contexts 2048,8192,32768 --rows teacher-eager,hybrid-eager,teacher-fast,hybrid-fast \
        --batch-sizes 1,8,32 --out "$OUT/speed" 2>&1 | tail -30 ;;
    final)
      $B --contexts 2048,8192,32768 --rows teacher-eager,hybrid-eager,teacher-fast,hybrid-fast \
        --batch-sizes 1,8,32,64,128 --out "$OUT/final" 2>&1 | tail -34
      $B --contexts 2048 --rows teacher-compiled --out "$OUT/teacher-compiled-2k" 2>&1 | tail -6 ;;
    speed6)
      # the prefill glue compiled (packed GDN inputs, norms, SiLU-MLPs); batched decode up to each model's largest batch
      $B --contexts 2048,8192,32768 --rows teacher-eager,teacher-fast,hybrid-fast --batch-sizes 1,32,128,max \
        --out "$OUT/speed6" 2>&1 | grep -v "it/s" | tail -30 ;;
    speed9)
      $B --contexts 2048,8192,32768 --rows teacher-fast,hybrid-fast --batch-sizes 1,32,128,max \
        --out "$OUT/speed9" 2>&1 | grep -v "it/s" | tail -30 ;;
    ab)
      $B --contexts 2048,32768 --rows teacher-fast,hybrid-fast --reps 5 --out "$OUT/ab-after" 2>&1 | tail -10
      # the older fast.py runs from a copy of the package, so a job cut off here leaves the tree as it was
      rm -rf /tmp/ab-before && mkdir -p /tmp/ab-before && cp -r src/tcal /tmp/ab-before/ \
        && cp "${AB_BEFORE:?set AB_BEFORE}" /tmp/ab-before/tcal/models/fast.py
      PYTHONPATH=$S/site:/tmp/ab-before:$PWD/tests $B --contexts 2048,32768 --rows teacher-fast,hybrid-fast \
        --reps 5 --out "$OUT/ab-before" 2>&1 | tail -10 ;;
    compiled)
      $B --contexts 2048,8192,32768 --rows teacher-compiled --out "$OUT/teacher-compiled" 2>&1 | tail -12 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
