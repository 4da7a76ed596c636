#!/usr/bin/env bash
# Issue 14 on the GPU machine: FastDecoder tests (CPU + CUDA), fast == eager at the Qwen2.5-1.5B shape, and
# the speed table. One call: carry [".whl"], command: bash scripts/device_fast.sh STEP...
#   tests    pytest tests/models/test_fast.py tests/modules/test_gdn.py (CPU and CUDA cases)
#   cudatests  only the CUDA cases of tests/models/test_fast.py
#   check    bench/hybrid_speed.py --check at 2K (prefill + 64 teacher-forced decode steps)
#   quick    the four non-compiled rows at 2K only
#   speed    all non-compiled rows at 2K/8K/32K + batched decode at 32K (B = 1, 8, 32)
#   final    speed at 2K-64K + batched B up to 128, then teacher-compiled at 2K with a 2K-sized cache
#   compiled the teacher's HF StaticCache + torch.compile row at 2K/8K/32K
#   speed6   teacher eager/fast and hybrid fast at 2K-64K, batched decode at 32K up to the largest batch (max)
#   speed9   teacher and hybrid fast at 2K-64K, batched decode at 32K (B = 1, 32, 128, max): the decode step's
#            masked softmax compiled (session 9)
#   ab       teacher and hybrid fast at 2K and 32K, B = 1, once as the tree is and once with AB_BEFORE as
#            src/tcal/models/fast.py (an untracked copy of an older one, e.g. git show REV:src/tcal/models/fast.py):
#            the same machine, minutes apart
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests:$PWD/bench PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -c "import torch, transformers, triton, fla; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, 'fla', fla.__version__, torch.cuda.get_device_name())"
B="python3 bench/hybrid_speed.py --shape qwen2.5-1.5b --keep uniform:25%"
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
      $B --contexts 2048 --rows "" --check --json "$OUT/check.json" 2>&1 | tail -8 ;;
    quick)
      $B --contexts 2048 --rows teacher-eager,hybrid-eager,teacher-fast,hybrid-fast --json "$OUT/quick.json" 2>&1 | tail -12 ;;
    speed)
      $B --contexts 2048,8192,32768 --rows teacher-eager,hybrid-eager,teacher-fast,hybrid-fast \
        --batch-sizes 1,8,32 --json "$OUT/hybrid_speed_fast.json" 2>&1 | tail -30 ;;
    final)
      $B --contexts 2048,8192,32768,65536 --rows teacher-eager,hybrid-eager,teacher-fast,hybrid-fast \
        --batch-sizes 1,8,32,64,128 --json "$OUT/hybrid_speed_final.json" 2>&1 | tail -34
      $B --contexts 2048 --rows teacher-compiled --compiled-cache context --json "$OUT/teacher_compiled_2k.json" 2>&1 | tail -3 ;;
    speed6)
      # the prefill glue compiled (packed GDN inputs, norms, SiLU-MLPs); batched decode up to each model's largest batch
      $B --contexts 2048,8192,32768,65536 --rows teacher-eager,teacher-fast,hybrid-fast --batch-sizes 1,32,128,max \
        --json "$OUT/speed6.json" 2>&1 | grep -v "it/s" | tail -30 ;;
    speed9)
      $B --contexts 2048,8192,32768,65536 --rows teacher-fast,hybrid-fast --batch-sizes 1,32,128,max \
        --json "$OUT/speed9.json" 2>&1 | grep -v "it/s" | tail -30 ;;
    ab)
      $B --contexts 2048,32768 --rows teacher-fast,hybrid-fast --reps 5 --json "$OUT/ab_after.json" 2>&1 | tail -6
      # the older fast.py runs from a copy of the package, so a call cut off here leaves the tree as it was
      # (session 9 swapped the file in place, was cut off, and ran its later steps on the old file)
      rm -rf /tmp/ab-before && mkdir -p /tmp/ab-before && cp -r src/tcal /tmp/ab-before/ \
        && cp "${AB_BEFORE:?set AB_BEFORE}" /tmp/ab-before/tcal/models/fast.py
      PYTHONPATH=/tmp/site:/tmp/ab-before:$PWD/tests:$PWD/bench $B --contexts 2048,32768 --rows teacher-fast,hybrid-fast \
        --reps 5 --json "$OUT/ab_before.json" 2>&1 | tail -6 ;;
    compiled)
      $B --contexts 2048,8192,32768 --rows teacher-compiled --json "$OUT/teacher_compiled.json" 2>&1 | tail -12 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
